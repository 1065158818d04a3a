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

# Keys that depend on the machine (times, memory available), not on the run's numbers.
TIMING_KEYS = {"wall_seconds", "compile_seconds", "round_seconds_median", "seconds", "eval_seconds", "memory"}


def numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in TIMING_KEYS}


def rows(workdir: str) -> list[dict]:
    return [numbers(r) for r in JsonlLog(os.path.join(workdir, "metrics.jsonl")).rows()]


def test_resume_after_kill_equals_uninterrupted_and_runs_reproduce(tmp_path):
    full, again, killed = (str(tmp_path / d) for d in ("full", "again", "killed"))
    reference = train_and_evaluate(tiny_config(base_config(), rounds=4, clients_per_round=4), full)
    assert reference["status"] == "completed" and read_json(os.path.join(full, "summary.json"))["status"] == (
        "completed"
    )
    # Same config and seed: identical numbers.
    assert numbers(train_and_evaluate(tiny_config(base_config(), rounds=4, clients_per_round=4), again)) == (
        numbers(reference)
    )
    # One block of 4 rounds on device (no checkpoint before the end) == a dispatch per round.
    blocked = str(tmp_path / "blocked")
    one_block = train_and_evaluate(
        tiny_config(base_config(), rounds=4, clients_per_round=4, checkpoint_every=0), blocked
    )
    assert numbers(one_block) == numbers(reference) and rows(blocked) == rows(full)
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
        ("clients_per_round", 7, r"config.clients_per_round must be in \[0, 6\] \(num_clients=6"),
        ("rounds", 0, "config.rounds must be >= 1"),
        ("optimizer", "lion", "config.optimizer must be one of"),
        ("bogus_field", 1, "config.bogus_field is not a known config field"),
        ("fedavg.bogus", 1, "config.fedavg.bogus is not an option of fedavg; its options: local_leaves"),
        ("fedavg.weighting", "median", "config.fedavg.weighting='median': weighting must be one of"),
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


def test_a_diverging_run_stops_at_that_round_and_keeps_its_outputs(tmp_path):
    """SGD at lr 1e4: the loss overflows within a few rounds. The run stops at the
    first non-finite round, says so, and keeps what it wrote before; rerunning
    resumes from the last checkpoint and diverges at the same round."""
    workdir = str(tmp_path / "run")

    def config():
        return tiny_config(base_config(), rounds=8, learning_rate=1e4, checkpoint_every=2)

    summary = train_and_evaluate(config(), workdir)
    r = summary["diverged_round"]
    assert summary["status"] == "diverged" and 1 < r <= 8, summary
    assert summary["final_mean_accuracy"] is None and summary["per_client_accuracy"] is None
    message = summary["divergence"]
    assert message.startswith(f"fedavg diverged at round {r} of 8 (")
    for knob in ("optimizer=sgd", "learning_rate=10000", "momentum=0.9", "fedavg.server_lr=1.0"):
        assert knob in message, knob
    advice = message.split("; try ")[1].split(";")[0]  # smaller values, never the diverged ones
    assert advice == "--config.learning_rate=1000 or --config.fedavg.server_lr=0.1 or --config.momentum=0"
    written = read_json(os.path.join(workdir, "summary.json"))
    assert written["status"] == "diverged" and written["diverged_round"] == r
    logged = JsonlLog(os.path.join(workdir, "metrics.jsonl")).rows()
    assert [row["round"] for row in logged] == list(range(1, r))  # every finite round, nothing after
    assert written["last_evaluation"]["round"] == r - 1
    kept = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")))
    assert kept == [c for c in (2, 4, 6) if c < r][-2:]  # the last good checkpoints (keep=2)
    csv_rounds = [
        line.split(",")[0] for line in open(os.path.join(workdir, "metrics.csv")).read().splitlines()
    ]
    assert csv_rounds == ["round", *map(str, range(1, r))]
    again = train_and_evaluate(config(), workdir)
    assert (again["status"], again["diverged_round"]) == ("diverged", r)
    assert [row["round"] for row in JsonlLog(os.path.join(workdir, "metrics.jsonl")).rows()] == list(
        range(1, r)
    )


def test_a_field_added_since_a_checkpoint_counts_as_its_default():
    from pfljax.experiment.checkpoint import check_config  # noqa: PLC0415
    from pfljax.experiment.config import to_plain  # noqa: PLC0415

    current = to_plain(tiny_config(base_config()))
    saved = {k: v for k, v in current.items() if k not in ("drop_last", "test_split")}
    check_config(saved, current, "w")  # the new fields at their defaults: resumable
    with pytest.raises(ConfigError, match="fields differ: test_split: 'stratified' there, 'pfllib' now"):
        check_config(saved, {**current, "test_split": "pfllib"}, "w")


def test_an_exploding_but_finite_loss_is_a_divergence():
    from pfljax.experiment.loop import EXPLODING_LOSS, non_finite  # noqa: PLC0415

    assert non_finite(2.0 * EXPLODING_LOSS, True, None, first_loss=1.0).startswith(
        "train loss 2e+06 > 1e+06 x"
    )
    assert non_finite(0.5 * EXPLODING_LOSS, True, None, first_loss=1.0) == ""
    assert non_finite(1e30, True, None, first_loss=None) == ""  # no first round yet
    assert non_finite(float("nan"), False, None, first_loss=1.0) == "train loss nan, non-finite parameters"


def test_client_level_dp_reports_epsilon_and_stops_at_the_budget(tmp_path):
    from pfljax.core.privacy import epsilon  # noqa: PLC0415

    def dp_config(rounds=6):
        config = tiny_config(base_config(), rounds=rounds, clients_per_round=3)
        config.dp.enabled, config.dp.noise_multiplier, config.dp.clip_norm = True, 1.0, 0.5
        config.dp.target_epsilon = budget
        return config

    delta = 1e-5  # the default: min(1e-5, 1 / 6^1.1)
    budget = (epsilon(1.0, 6, 3, 3, delta) + epsilon(1.0, 6, 3, 4, delta)) / 2
    workdir = str(tmp_path / "dp")
    summary = train_and_evaluate(dp_config(), workdir)
    assert summary["status"] == "privacy_budget_reached" and summary["rounds_run"] == 3
    rows = JsonlLog(os.path.join(workdir, "metrics.jsonl")).rows()
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["dp_epsilon"] == pytest.approx(epsilon(1.0, 6, 3, r["round"], delta), rel=1e-9)
        assert 0 <= r["dp_clipped_fraction"] <= 1
    assert summary["dp_epsilon"] == pytest.approx(rows[-1]["dp_epsilon"]) and summary["dp_epsilon"] <= budget
    assert summary["dp_delta"] == delta
    # Killed after round 2's checkpoint and resumed: the accountant goes on exactly.
    resumed = str(tmp_path / "resumed")
    train_and_evaluate(dp_config(rounds=2), resumed)
    again = train_and_evaluate(dp_config(), resumed)
    assert numbers(again) == numbers(summary)
    assert [r["dp_epsilon"] for r in JsonlLog(os.path.join(resumed, "metrics.jsonl")).rows()] == [
        r["dp_epsilon"] for r in rows
    ]


def test_a_delta_that_allows_publishing_a_client_is_refused(tmp_path):
    config = tiny_config(base_config())
    config.dp.enabled, config.dp.delta = True, 1 / 6
    with pytest.raises(
        ConfigError, match=r"config.dp.delta=0.166667 is >= 1/num_clients = 0.166667.*dp.delta <"
    ):
        train_and_evaluate(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")  # refused before anything was written
    config.dp.delta = 0.16
    assert train_and_evaluate(config, str(tmp_path / "ok"))["dp_delta"] == 0.16


def test_dp_is_refused_for_an_algorithm_that_mixes_client_models(tmp_path):
    config = tiny_config(base_config(), algorithm="pfedla")
    config.dp.enabled = True
    with pytest.raises(ConfigError, match="config.dp.enabled: pfedla does not support client-level DP"):
        train_and_evaluate(config, str(tmp_path / "run"))


def test_best_mean_over_ten_consecutive_evaluations():
    from pfljax.experiment.train import best_window_mean  # noqa: PLC0415

    values = [0.1] * 5 + [0.9] * 10 + [0.2] * 5
    assert best_window_mean(values) == pytest.approx(0.9)
    assert best_window_mean([0.5, 0.7]) == pytest.approx(0.6)  # fewer than 10: all of them
    assert best_window_mean(list(range(12))) == pytest.approx(np.mean(range(2, 12)))
    assert best_window_mean([]) is None


def test_memory_report_in_summary_and_a_run_that_cannot_fit_is_refused(tmp_path, monkeypatch):
    summary = train_and_evaluate(tiny_config(base_config(), rounds=1), str(tmp_path / "fits"))
    memory = summary["memory"]
    assert memory["num_clients"] == 6 and memory["data_bytes"] > 0 and memory["max_clients"] >= 6
    assert memory["estimated_bytes"] <= memory["available_bytes"]
    # 1 kB of memory: refused before the first round, naming what to change.
    monkeypatch.setattr("pfljax.runtime.memory.device_memory_bytes", lambda device=None: 1000)
    workdir = tmp_path / "small"
    with pytest.raises(ConfigError, match=r"MiB are available.*--config.num_clients"):
        train_and_evaluate(tiny_config(base_config(), rounds=1), str(workdir))
    assert not (workdir / "metrics.jsonl").exists() or not (workdir / "metrics.jsonl").read_text()


def _damage(step_dir: str) -> None:
    """Cuts every file of a checkpoint's state to half its size (a write cut short)."""
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            path = os.path.join(root, name)
            os.truncate(path, os.path.getsize(path) // 2)


def test_a_damaged_checkpoint_and_a_cut_metrics_line_resume_from_the_checkpoint_before(tmp_path, caplog):
    full, w = str(tmp_path / "full"), str(tmp_path / "damaged")
    reference = train_and_evaluate(tiny_config(base_config(), rounds=4, clients_per_round=4), full)
    train_and_evaluate(tiny_config(base_config(), rounds=3, clients_per_round=4), w)
    _damage(os.path.join(w, "checkpoints", "3"))
    with open(os.path.join(w, "metrics.jsonl"), "a") as f:
        f.write('{"round": 4, "mean_acc')  # a row cut mid-line
    resumed = train_and_evaluate(tiny_config(base_config(), rounds=4, clients_per_round=4), w)
    assert numbers(resumed) == numbers(reference) and rows(w) == rows(full)
    assert "checkpoint 3 in" in caplog.text and "does not restore" in caplog.text
    assert os.path.isdir(os.path.join(w, "checkpoints.damaged", "3"))
    assert "line 4 is cut short: dropped" in caplog.text
    # Every checkpoint damaged: one ConfigError saying how to start fresh.
    for step in os.listdir(os.path.join(w, "checkpoints")):
        _damage(os.path.join(w, "checkpoints", step))
    with pytest.raises(
        ConfigError, match=r"no checkpoint in .* restores .*to start fresh, give another --workdir"
    ):
        train_and_evaluate(tiny_config(base_config(), rounds=5, clients_per_round=4), w)


def test_under_dp_the_divergence_message_names_the_noise():
    from pfljax.experiment.config import resolve, run_settings  # noqa: PLC0415

    def divergence_message(config, *args):
        return run_settings(config).divergence_message(*args)

    config = tiny_config(base_config(), clients_per_round=4)
    config.dp.enabled, config.dp.noise_multiplier, config.dp.clip_norm = True, 2.0, 0.5
    text = divergence_message(resolve(config)[0], 3, "train loss nan", "w")
    assert "dp.noise_multiplier=2 and dp.clip_norm=0.5 (noise std 0.25 on each coordinate" in text
    assert "--config.dp.clip_norm=0.25" in text
    config.dp.enabled, config.dp.noise_multiplier, config.dp.clip_norm = False, 1.0, 1.0
    assert "dp." not in divergence_message(resolve(config)[0], 3, "train loss nan", "w")


def test_a_server_optimizer_runs_and_is_refused_where_the_method_has_none(tmp_path, caplog):
    """FedAdam through the run loop (its optimizer state resumes with the checkpoint: the
    summary of a run stopped and resumed equals the uninterrupted one); a method without a
    server step is refused in one line naming the methods that have one."""
    config = tiny_config(base_config(), rounds=3)
    config.server_optimizer, config.server_learning_rate = "adam", 0.05
    whole = train_and_evaluate(config, str(tmp_path / "whole"))
    config.rounds = 2
    train_and_evaluate(config, str(tmp_path / "resumed"))
    config.rounds = 3
    with caplog.at_level("INFO"):
        resumed = train_and_evaluate(config, str(tmp_path / "resumed"))
    assert "fedavg: resumed from round 2 of 3" in caplog.text
    assert resumed["final_mean_accuracy"] == whole["final_mean_accuracy"]
    assert resumed["final_mean_loss"] == whole["final_mean_loss"]
    config.algorithm = "fedala"
    with pytest.raises(
        ConfigError, match=r"config.server_optimizer='adam': fedala has no server optimizer; the"
    ):
        train_and_evaluate(config, str(tmp_path / "fedala"))
