"""The run loop: resume == uninterrupted, reproducibility, hooks, traces, bad input."""

import functools
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.algorithms import fedavg
from pfljax.core.types import Algorithm
from pfljax.experiment import ConfigError, base_config, train_and_evaluate
from pfljax.experiment.outputs import JsonlLog, read_json
from tests.experiment.tiny import tiny_config

TIMING_KEYS = {"wall_seconds", "compile_seconds", "round_seconds_median", "seconds", "eval_seconds"}


def numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in TIMING_KEYS}


def rows(workdir: str) -> list[dict]:
    return [numbers(r) for r in JsonlLog(os.path.join(workdir, "metrics.jsonl")).rows()]


def test_resume_after_kill_equals_uninterrupted_and_runs_reproduce(tmp_path):
    full, again, killed = (str(tmp_path / d) for d in ("full", "again", "killed"))
    reference = train_and_evaluate(tiny_config(base_config(), rounds=4, clients_per_round=4), full)
    # Same config and seed: identical numbers.
    assert numbers(train_and_evaluate(tiny_config(base_config(), rounds=4, clients_per_round=4), again)) == (
        numbers(reference)
    )
    # A run killed after logging round 3 but before its checkpoint: checkpoints
    # at round 2 only, metrics.jsonl holds rounds 1-3.
    cfg = tiny_config(base_config(), rounds=3, clients_per_round=4, checkpoint_every=2)
    train_and_evaluate(cfg, killed)
    shutil.rmtree(os.path.join(killed, "checkpoints", "3"))
    assert len(rows(killed)) == 3
    resumed = train_and_evaluate(tiny_config(base_config(), rounds=4, clients_per_round=4), killed)
    assert numbers(resumed) == numbers(reference)
    assert rows(killed) == rows(full)
    assert (
        read_json(os.path.join(killed, "summary.json"))["bytes_up_total"] == reference["bytes_up_total"] > 0
    )

    # A checkpoint of another config is refused, before training.
    other = tiny_config(base_config(), rounds=5, clients_per_round=4, learning_rate=0.3)
    with pytest.raises(ConfigError, match="different config.*learning_rate"):
        train_and_evaluate(other, killed)
    with pytest.raises(ConfigError, match="config.rounds=2 is below round 4"):
        train_and_evaluate(tiny_config(base_config(), rounds=2, clients_per_round=4), killed)


def with_hooks(build):
    """fedavg.build plus a [C] own_accuracy, a non-scalar round metric and the optional pieces."""

    @functools.wraps(build)
    def wrapped(*args, **kwargs):
        alg = build(*args, **kwargs)

        def round_fn(state, data, key):
            state, metrics = alg.round(state, data, key)
            return state, {**metrics, "per_client_count": data.train.count * 2}

        def evaluate(state, data, key):
            out = alg.evaluate(state, data, key)
            return {**out, "own_accuracy": 1.0 - out["accuracy"]}

        def final_report(state, fed_data, per_client, key):
            return {
                "clients_seen": len(fed_data.summary["clients"]),
                "final_mean": float(per_client["accuracy"].mean()),
            }

        return Algorithm(alg.init, round_fn, evaluate, lambda s: jnp.full((6, 6), 1 / 6), final_report)

    return wrapped


def test_hooks_traces_and_extra_metrics(tmp_path, monkeypatch):
    monkeypatch.setattr(fedavg, "build", with_hooks(fedavg.build))
    workdir = str(tmp_path / "run")
    summary = train_and_evaluate(tiny_config(base_config(), rounds=2, eval_every=2), workdir)
    np.testing.assert_allclose(np.sum(summary["collaboration_matrix"], 1), 1.0, rtol=1e-6)
    assert summary["clients_seen"] == 6
    np.testing.assert_allclose(summary["final_mean"], np.mean(summary["per_client_accuracy"]), rtol=1e-6)
    assert os.path.getsize(os.path.join(workdir, "collaboration.png")) > 1000
    acc = np.asarray(summary["per_client_accuracy"])
    np.testing.assert_allclose(summary["per_client_own_accuracy"], 1 - acc, rtol=1e-6)
    logged = JsonlLog(os.path.join(workdir, "metrics.jsonl")).rows()
    assert [r["round"] for r in logged] == [2]  # eval_every=2
    np.testing.assert_allclose(logged[0]["mean_own_accuracy"], 1 - logged[0]["mean_accuracy"], rtol=1e-6)
    traces = JsonlLog(os.path.join(workdir, "traces.jsonl")).rows()
    counts = read_json(os.path.join(workdir, "data.json"))["clients"]
    assert [t["round"] for t in traces] == [1, 2]
    assert traces[0]["per_client_count"] == [2 * c["train"] for c in counts]


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("algorithm", "nope", "config.algorithm must be one of"),
        ("model", "resnet1000", "config.model must be one of"),
        ("dataset", "nope", "dataset='nope' is unknown"),
        ("clients_per_round", 7, r"config.clients_per_round must be in \[0, num_clients=6\]"),
        ("rounds", 0, "config.rounds must be >= 1"),
        ("optimizer", "lion", "config.optimizer must be one of"),
        ("bogus_field", 1, "config.bogus_field is not a known config field"),
        ("fedavg.bogus", 1, "config.fedavg.bogus is not an option of fedavg.build"),
        ("fedavg.weighting", "median", "config.fedavg: weighting must be one of"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_field(tmp_path, field, value, match):
    config = tiny_config(base_config())
    if "." in field:
        sub, name = field.split(".")
        config[sub][name] = value
    else:
        config[field] = value
    with pytest.raises(ConfigError, match=match):
        train_and_evaluate(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # nothing trained
