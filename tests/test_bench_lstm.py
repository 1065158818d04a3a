"""experiments/bench/bench_lstm.py: a JSON line per impl with positive timings; bad flags one line, exit 2."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.bench.bench_lstm", *args],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300,
    )  # fmt: skip


def test_one_client_one_window_prints_a_row_per_impl():
    proc = _run("--impls=scan", "--clients=1", "--batch=1", "--repeats=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["impl"] for r in rows] == ["scan"]
    row = rows[0]
    assert row["clients"] == 1 and row["batch"] == 1 and row["backend"] == "cpu"
    for name in ("forward", "gradient"):
        assert len(row[f"{name}_all_s"]) == 2 and all(t > 0 for t in row[f"{name}_all_s"])
        assert min(row[f"{name}_all_s"]) <= row[f"{name}_s"] <= max(row[f"{name}_all_s"])


def test_bad_flags_get_one_line_and_exit_2():
    for flag, words in (
        ("--impls=scan,cudnn", "--impls takes values from auto, scan, flax, onednn"),
        ("--clients=0", "--clients"),
    ):
        proc = _run(flag)
        assert proc.returncode == 2, (flag, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (flag, proc.stderr)
