"""experiments/main.py as a user runs it: every output file, then bad input -> exit 2."""

import csv
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from tests.experiment.tiny import ROOT, TINY_FLAGS, is_png

SUMMARY_KEYS = {
    "algorithm",
    "dataset",
    "rounds",
    "final_mean_accuracy",
    "best_mean_accuracy",
    "per_client_accuracy",
    "wall_seconds",
    "round_seconds_median",
    "bytes_up_total",
    "bytes_down_total",
}
ROW_KEYS = {
    "round",
    "train_loss",
    "mean_accuracy",
    "std_accuracy",
    "worst10_accuracy",
    "bytes_up",
    "bytes_down",
    "seconds",
}


def run_main(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))
    )
    return subprocess.run(
        [sys.executable, "-m", "experiments.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


def tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Reads TFRecord event files: {tag: [(step, value), ...]}."""
    from tensorboardX.proto import event_pb2

    out = {}
    for name in sorted(os.listdir(logdir)):
        with open(os.path.join(logdir, name), "rb") as f:
            buf = f.read()
        pos = 0
        while pos < len(buf):
            (length,) = struct.unpack("<Q", buf[pos : pos + 8])
            event = event_pb2.Event.FromString(buf[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_smoke_every_output_then_bad_input(tmp_path):
    workdir = str(tmp_path / "run")
    proc = run_main(*TINY_FLAGS, f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final mean accuracy" in proc.stdout
    # Not a terminal: provenance and one log line per evaluation on stderr.
    assert "] data: the FedFac simulation (generated, no files)" in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if "] fedavg round " in line]
    assert [line.split("] fedavg round ")[1].split(":")[0] for line in progress] == ["1/2", "2/2"]
    assert all("mean acc" in line and "s/round, ETA" in line for line in progress)

    config = json.load(open(os.path.join(workdir, "config.json")))
    assert config["num_clients"] == 6 and config["rounds"] == 2 and config["algorithm"] == "fedavg"
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert 0 <= r["worst10_accuracy"] <= r["mean_accuracy"] <= 1 and r["bytes_up"] > 0
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    assert SUMMARY_KEYS <= set(summary), SUMMARY_KEYS - set(summary)
    assert summary["final_mean_accuracy"] == rows[-1]["mean_accuracy"]
    assert summary["best_mean_accuracy"] == max(r["mean_accuracy"] for r in rows)
    assert summary["bytes_up_total"] == sum(r["bytes_up"] for r in rows)
    assert len(summary["per_client_accuracy"]) == 6
    assert "collaboration_matrix" not in summary  # fedavg has no such hook
    for png in ("accuracy.png", "loss.png"):
        assert is_png(os.path.join(workdir, png))
    data = json.load(open(os.path.join(workdir, "data.json")))
    assert len(data["clients"]) == 6
    for c in data["clients"]:
        assert sum(c["train_class_counts"]) == c["train"] and sum(c["test_class_counts"]) == c["test"]
    assert is_png(os.path.join(workdir, "partition.png"))
    with open(os.path.join(workdir, "metrics.csv")) as f:
        table = list(csv.DictReader(f))
    assert [int(r["round"]) for r in table] == [1, 2]
    for row, logged in zip(table, rows):
        for key in ("train_loss", "mean_accuracy", "worst10_accuracy", "bytes_up"):
            assert float(row[key]) == logged[key], key
    assert summary["status"] == "completed"
    assert os.path.exists(os.path.join(workdir, "traces.jsonl"))
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
    scalars = tensorboard_scalars(os.path.join(workdir, "tensorboard"))
    assert [step for step, _ in scalars["mean_accuracy"]] == [1, 2]
    assert scalars["mean_accuracy"][-1][1] == pytest.approx(summary["final_mean_accuracy"], rel=1e-6)

    # Another config on this workdir: one line naming the field and both values, exit code 2,
    # nothing trained (every other bad input: tests/experiment/test_cli.py).
    proc = run_main(*TINY_FLAGS, "--config.learning_rate=0.5", "--config.rounds=3", f"--workdir={workdir}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --workdir="), proc.stderr
    assert "learning_rate: 0.05 there, 0.5 now" in lines[0]
    assert len(open(os.path.join(workdir, "metrics.jsonl")).readlines()) == 2

    # More rounds on the same workdir: resumed, and said so.
    proc = run_main(*TINY_FLAGS, "--config.rounds=3", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fedavg: resumed from round 2 of 3" in proc.stderr
    assert [
        line.split("] fedavg round ")[1][:3] for line in proc.stderr.splitlines() if "] fedavg round " in line
    ] == ["3/3"]
    assert len(open(os.path.join(workdir, "metrics.csv")).read().splitlines()) == 1 + 3


def test_fedfac_new_client_accuracies_reach_the_summary(tmp_path):
    workdir = str(tmp_path / "fedfac")
    proc = run_main(
        *TINY_FLAGS,
        "--config.algorithm=fedfac",
        "--config.fedfac.new_client_fraction=0.34",
        "--config.fedfac.tau_quantile=50",
        f"--workdir={workdir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    new = np.asarray(summary["per_client_new_client"]) > 0
    assert new.sum() == 2  # round(0.34 * 6) clients never train
    acc = np.asarray(summary["per_client_accuracy"])
    counts = np.asarray([c["test"] for c in json.load(open(os.path.join(workdir, "data.json")))["clients"]])
    want = np.sum(acc[new] * counts[new]) / np.sum(counts[new])
    assert summary["new_clients_localtrain_accuracy"] == pytest.approx(want, rel=1e-6)
    assert 0 <= summary["new_clients_ensemble_accuracy"] <= 1
    assert summary["existing_clients_accuracy"] == pytest.approx(
        np.sum(acc[~new] * counts[~new]) / np.sum(counts[~new]), rel=1e-6
    )
