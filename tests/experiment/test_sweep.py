"""compare(vectorize=True): the same run directories and numbers as separate runs;
a learning-rate grid; resume of the replica state; bad input refused before training."""

import json
import os

import numpy as np
import pytest

from pfljax.experiment import ConfigError
from pfljax.experiment.compare import compare, parse_grid
from pfljax.experiment.config import base_config
from pfljax.experiment.outputs import JsonlLog
from tests.experiment.tiny import tiny_config

NUMBERS = ("train_loss", "mean_accuracy", "mean_loss", "worst10_accuracy", "bytes_up")


def config(rounds=3, **overrides):
    c = tiny_config(base_config(), rounds=rounds, **overrides)
    c.data_seed = 5
    c.clients_per_round = 3
    c.eval_every = 1
    return c


def assert_same_runs(a, b, labels, seeds):
    for lab in labels:
        for s in seeds:
            da, db = os.path.join(a, lab, f"seed_{s}"), os.path.join(b, lab, f"seed_{s}")
            ra, rb = (
                JsonlLog(os.path.join(da, "metrics.jsonl")).rows(),
                JsonlLog(os.path.join(db, "metrics.jsonl")).rows(),
            )
            assert [r["round"] for r in ra] == [r["round"] for r in rb] == [1, 2, 3]
            for x, y in zip(ra, rb):
                for k in NUMBERS:
                    np.testing.assert_allclose(x[k], y[k], rtol=1e-5, err_msg=f"{lab} seed {s} {k}")
            sa, sb = (json.load(open(os.path.join(d, "summary.json"))) for d in (da, db))
            np.testing.assert_allclose(sa["per_client_accuracy"], sb["per_client_accuracy"], rtol=1e-5)
            assert sa["status"] == sb["status"] == "completed" and sa["seed"] == sb["seed"] == s
            for f in ("config.json", "data.json", "metrics.csv", "accuracy.png", "partition.png"):
                assert os.path.exists(os.path.join(da, f)), f


def test_vectorized_seeds_and_grid_equal_separate_runs(tmp_path):
    seeds = (0, 1)
    sep, vec = str(tmp_path / "sep"), str(tmp_path / "vec")
    grid = parse_grid("learning_rate=0.05,0.2")
    compare(config(), ["fedavg"], seeds, sep, progress=False, grid=grid)
    out_vec = compare(config(), ["fedavg"], seeds, vec, progress=False, grid=grid, vectorize=True)
    labels = ["fedavg.learning_rate=0.05", "fedavg.learning_rate=0.2"]
    assert list(out_vec["results"]) == labels
    assert_same_runs(sep, vec, labels, seeds)
    assert "| fedavg.learning_rate=0.2 |" in out_vec["table"]


def test_vectorized_resume_equals_uninterrupted(tmp_path):
    once, twice = str(tmp_path / "once"), str(tmp_path / "twice")
    compare(config(), ["local"], (0, 2), once, progress=False, vectorize=True)
    compare(config(rounds=2), ["local"], (0, 2), twice, progress=False, vectorize=True)
    assert len(JsonlLog(os.path.join(twice, "local", "seed_2", "metrics.jsonl")).rows()) == 2
    compare(config(), ["local"], (0, 2), twice, progress=False, vectorize=True)  # resumes at round 2
    assert_same_runs(once, twice, ["local"], (0, 2))


def test_bad_input_refused_before_training(tmp_path):
    w = str(tmp_path / "w")
    c = config()
    c.data_seed = -1
    with pytest.raises(ConfigError, match="one shared partition, but config.data_seed=-1"):
        compare(c, ["fedavg"], (0, 1), w, vectorize=True)
    with pytest.raises(ConfigError, match=r"scaffold option local_lr cannot vary inside one program"):
        compare(config(), ["scaffold"], (0,), w, vectorize=True, grid=parse_grid("local_lr=0.1,0.2"))
    with pytest.raises(ConfigError, match=r"config.fedfomo.num_models is an integer option: it cannot vary"):
        compare(config(), ["fedfomo"], (0,), w, vectorize=True, grid=parse_grid("num_models=2,3"))
    with pytest.raises(ConfigError, match="not a float option of fedavg"):
        compare(config(), ["fedavg"], (0,), w, vectorize=True, grid=parse_grid("nope=1,2"))
    with pytest.raises(ValueError, match="--grid=learning_rate: give <option>=v1,v2"):
        parse_grid("learning_rate")
    compare(config(rounds=1), ["fedavg"], (0,), w)  # a separate run in w ...
    with pytest.raises(ConfigError, match="holds a run .* --vectorize cannot resume it"):
        compare(config(), ["fedavg"], (0,), w, vectorize=True)  # ... is not resumed as replicas
    assert not os.path.exists(os.path.join(w, "fedavg", "replica_checkpoints"))


def test_vectorized_divergence_stays_in_its_replica(tmp_path):
    sep, vec = str(tmp_path / "sep"), str(tmp_path / "vec")
    grid = parse_grid("learning_rate=0.05,1e30")
    out_sep = compare(config(), ["fedavg"], (0,), sep, progress=False, grid=grid)
    out_vec = compare(config(), ["fedavg"], (0,), vec, progress=False, grid=grid, vectorize=True)
    assert out_vec["diverged"] == out_sep["diverged"] == [("fedavg.learning_rate=1e+30", 0, 1)]
    assert_same_runs(sep, vec, ["fedavg.learning_rate=0.05"], (0,))  # the other replica is untouched
    d = os.path.join(vec, "fedavg.learning_rate=1e+30", "seed_0")
    summary = json.load(open(os.path.join(d, "summary.json")))
    assert summary["status"] == "diverged" and "diverged at round 1 of 3" in summary["divergence"]
    assert JsonlLog(os.path.join(d, "metrics.jsonl")).rows() == []
