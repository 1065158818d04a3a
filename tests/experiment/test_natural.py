"""LEAF / TFF configs end to end: 2 rounds of FedAvg and a personalized method on fixtures of
each format, bad files on the CLI."""

import json

import numpy as np
import pytest

from pfljax.experiment import train_and_evaluate
from pfljax.experiment.configs import leaf_femnist, leaf_shakespeare, tff_emnist, tff_shakespeare
from tests.experiment.tiny import ROOT, fork_runs
from tests.naturaldata import write_leaf, write_tff

SIZES = {"u3": (6, 2), "u1": (5, 2), "u2": (1, 1), "u0": (4, 2)}


def _tiny(config_module, root, algorithm):
    """The shipped config on 3 fixture users for 2 rounds, with a tiny model of its kind."""
    config = config_module.get_config()
    config.data_dir, config.algorithm = root, algorithm
    config.num_clients, config.clients_per_round, config.rounds = 3, 0, 2
    config.source.min_samples, config.batch_size, config.checkpoint_every = 3, 4, 2
    if config.model == "char_lstm":
        config.model_kwargs.embed, config.model_kwargs.hidden = 4, (8,)
    else:
        config.model_kwargs.channels, config.model_kwargs.dense = (2, 4), (8,)
    return config


# FedAvg on one task and Ditto (personalized) on the other: each run is a compile of
# its own round (~20 s on a loaded 2-core CPU), so not all four pairs.
@pytest.mark.parametrize("task,algorithm", [("shakespeare", "fedavg"), ("femnist", "ditto")])
def test_two_rounds_on_a_leaf_fixture(tmp_path, task, algorithm):
    root = write_leaf(str(tmp_path / "data"), task, SIZES)
    config = _tiny(leaf_shakespeare if task == "shakespeare" else leaf_femnist, root, algorithm)
    summary = train_and_evaluate(config, str(tmp_path / "run"), progress=False)
    assert summary["status"] == "completed" and np.isfinite(summary["final_mean_accuracy"])
    with open(tmp_path / "run" / "data.json") as f:
        clients = json.load(f)["clients"]
    assert [(c["train"], c["test"]) for c in clients] == [(4, 2), (5, 2), (6, 2)]


# FedPer (personalized) on TFF's Shakespeare, FedAvg on TFF's EMNIST: the LEAF test's pairs swapped.
@pytest.mark.parametrize("task,algorithm", [("shakespeare", "fedper"), ("emnist", "fedavg")])
def test_two_rounds_on_a_tff_fixture(tmp_path, task, algorithm):
    """TFF's HDF5 files end to end (Shakespeare: snippets -> 80-character windows -> the
    per-token LSTM); data.json names the users as the partition."""
    sizes = {"c0": (3, 2), "c1": (5, 2), "c2": (4, 3)}
    root = write_tff(str(tmp_path / "data"), task, sizes)
    config = _tiny(tff_shakespeare if task == "shakespeare" else tff_emnist, root, algorithm)
    config.source.min_samples = 2
    summary = train_and_evaluate(config, str(tmp_path / "run"), progress=False)
    assert summary["status"] == "completed" and np.isfinite(summary["final_mean_accuracy"])
    assert summary["partition"] == "users"  # not config.partition's "iid"
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["round"] for r in rows if "mean_accuracy" in r][-1] == 2
    with open(tmp_path / "run" / "data.json") as f:
        data = json.load(f)
    assert data["partition"] == "users"
    if task == "emnist":  # one row per image: the files' own counts
        assert [(c["train"], c["test"]) for c in data["clients"]] == list(sizes.values())
    else:  # windows of each client's snippets
        assert len(data["clients"]) == 3 and all(c["train"] >= 3 and c["test"] >= 2 for c in data["clients"])


def test_configs_name_their_data_and_models():
    assert leaf_shakespeare.get_config().model == "char_lstm" and leaf_femnist.get_config().model == "cnn"
    assert tff_emnist.get_config().dataset == "tff_emnist"
    assert tff_shakespeare.get_config().model_kwargs.last_only is False


def test_missing_or_bad_files_are_one_line_and_exit_2(tmp_path):
    write_tff(str(tmp_path / "tff"), "shakespeare", SIZES)
    with open(tmp_path / "tff" / "shakespeare_test.h5", "w") as f:
        f.write("not hdf5")
    cases = [
        (
            "leaf_femnist",
            tmp_path / "nothing",
            "nothing/train: no .json files; expected a LEAF data/ directory",
        ),
        ("tff_shakespeare", tmp_path / "tff", "shakespeare_test.h5: not a TFF shakespeare file"),
    ]
    argv = lambda name, d: [f"--config={name}", f"--config.data_dir={d}", f"--workdir={tmp_path / name}"]  # noqa: E731
    runs = [{"module": "experiments.main", "args": argv(name, d), "cwd": ROOT} for name, d, _ in cases]
    for (_, _, needle), res in zip(cases, fork_runs(runs, timeout=300), strict=True):
        lines = res["stderr"].strip().splitlines()
        assert res["rc"] == 2 and len(lines) == 1 and needle in lines[0], res["stderr"][-2000:]
        assert "Traceback" not in res["stderr"]


def test_too_few_users_names_the_whole_fix_in_one_line(tmp_path):
    """100 users asked (10 a round) of a directory with 3 that pass min_samples: one line
    names both flags at once, and with them the data build."""
    from pfljax.experiment.config import ConfigError, make_data  # noqa: PLC0415

    config = leaf_femnist.get_config()
    config.data_dir, config.source.min_samples = write_leaf(str(tmp_path / "data"), "femnist", SIZES), 3
    config.num_clients = 100
    with pytest.raises(ConfigError) as e:
        make_data(config)
    message = str(e.value)
    fix = "give --config.num_clients=3 and --config.clients_per_round <= 3 (it is 10)"
    assert message.endswith(fix), message
    config.num_clients, config.clients_per_round = 3, 3
    assert make_data(config).data.train.count.shape == (3,)


def test_the_shipped_natural_configs_take_every_user(tmp_path):
    """num_clients 0 (the shipped LEAF / TFF configs): every user that passes min_samples
    becomes a client; the resolved config, its settings and data.json say how many."""
    from pfljax.experiment.config import ConfigError, prepare  # noqa: PLC0415

    for module in (leaf_femnist, leaf_shakespeare, tff_emnist, tff_shakespeare):
        assert module.get_config().num_clients == 0, module.__name__
    config = leaf_femnist.get_config()
    config.data_dir, config.source.min_samples = write_leaf(str(tmp_path / "data"), "femnist", SIZES), 3
    with pytest.raises(ConfigError, match=r"clients_per_round=10 is above the 3 users .*<= 3$"):
        prepare(config)
    config.clients_per_round = 2
    prep = prepare(config)
    assert prep.config.num_clients == 3 and prep.settings.num_clients == 3 and config.num_clients == 0
    assert prep.fed_data.summary["num_clients"] == 3
