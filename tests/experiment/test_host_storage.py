"""`config.client_storage="host"` through the run loop: the device run's numbers, resumable,
its memory report; bad input before training (one line, exit 2)."""

import json
import os

import numpy as np
import pytest

from pfljax.experiment.config import ConfigError, base_config, prepare
from pfljax.experiment.sweep import train_replicas
from pfljax.experiment.train import train_and_evaluate
from tests.experiment.tiny import ROOT, TINY_FLAGS, fork_runs, tiny_config


def rows(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def config(storage, rounds, algorithm="fedper"):
    return tiny_config(
        base_config(), algorithm, rounds=rounds, clients_per_round=2, client_storage=storage, eval_every=2
    )


def test_host_storage_run_equals_the_device_run_and_resumes(tmp_path):
    device = train_and_evaluate(config("device", 3), str(tmp_path / "device"), progress=False)
    # Two rounds with a checkpoint, then resumed to three: the uninterrupted device run's numbers.
    train_and_evaluate(config("host", 2), str(tmp_path / "host"), progress=False)
    host = train_and_evaluate(config("host", 3), str(tmp_path / "host"), progress=False)
    np.testing.assert_allclose(host["per_client_accuracy"], device["per_client_accuracy"], rtol=1e-5)
    want, got = rows(tmp_path / "device"), rows(tmp_path / "host")
    assert [r["round"] for r in got] == [r["round"] for r in want] == [2, 3]
    for a, b in zip(got, want):
        for key in ("train_loss", "mean_accuracy", "mean_loss", "bytes_up"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    memory = host["memory"]
    assert memory["client_storage"] == "host" and memory["num_clients"] == 6
    assert memory["clients_per_round"] == 2 and memory["estimated_bytes"] > 0


def test_refusals_name_the_option_and_why():
    with pytest.raises(
        ConfigError, match=r"config.client_storage='host' cannot run fedfomo: each client keeps"
    ):
        prepare(config("host", 1, "fedfomo"))
    with pytest.raises(ConfigError, match=r"cannot run pfedme: train_all=True"):
        prepare(config("host", 1, "pfedme"))
    with pytest.raises(
        ConfigError, match=r"config.client_storage must be one of \('device', 'host'\), got 'disk'"
    ):
        prepare(config("disk", 1))


def test_replicas_as_one_program_refuse_host_storage(tmp_path):
    with pytest.raises(ConfigError, match=r"client_storage='host' runs one run at a time"):
        train_replicas(
            [config("host", 1)], [str(tmp_path / "r")], checkpoint_dir=str(tmp_path / "c"), dry_run=True
        )


def test_bad_input_is_one_line_and_exit_2_before_training(tmp_path):
    cases = [
        ["--config.client_storage=disk"],
        ["--config.client_storage=host", "--config.algorithm=federico"],
    ]
    runs = [
        {"module": "experiments.main", "args": [*TINY_FLAGS, f"--workdir={tmp_path}/run{i}", *a], "cwd": ROOT}
        for i, a in enumerate(cases)
    ]
    for i, (res, needle) in enumerate(
        zip(
            fork_runs(runs),
            ["client_storage must be one of", "client_storage='host' cannot run federico"],
        )
    ):
        lines = res["stderr"].strip().splitlines()
        assert res["rc"] == 2 and len(lines) == 1 and needle in lines[0], res["stderr"][-1500:]
        assert not os.path.exists(tmp_path / f"run{i}" / "metrics.jsonl")
