"""experiments/bench/profile_round.py on CPU: a traced FedAvg round of a tiny bench case, read back
from its Perfetto trace (events summed per process, shares within each process)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_profile_of_a_tiny_round_lists_the_busiest_events(tmp_path):
    # --top=20: in a round this tiny, tracing's own start/stop can outweigh the round's events
    # (seen in CI: the top 5 were all profiler and Python frames).
    args = ["--case=mlp", "--clients=3", "--rows=16", "--steps=2", "--rounds=2", "--top=20"]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.profile_round", *args, f"--trace_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    head, processes = rows[0], rows[1:]
    assert head["case"] == "mlp" and head["clients"] == 3 and head["backend"] == "cpu"
    assert len(head["round_s"]) == 2 and all(t > 0 for t in head["round_s"])
    assert processes and processes[0]["events_s"] >= processes[-1]["events_s"]
    for p in processes:
        tops = p["top"]
        assert 0 < len(tops) <= 20
        assert [t["s"] for t in tops] == sorted((t["s"] for t in tops), reverse=True)
        assert all(t["count"] >= 1 and 0 <= t["share"] <= 1 for t in tops)
    names = {t["name"] for p in processes for t in p["top"]}
    assert any("Execute" in n or "run_timed" in n for n in names), names


def test_bad_flags_get_one_line_and_exit_2_before_anything_runs(tmp_path):
    for flag, words in (
        ("--case=nope", "--case must be one of"),
        ("--client_map=pmap", "--client_map must be one of"),
        ("--rounds=0", "--rounds must be an integer >= 1"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.bench.profile_round", flag, f"--trace_dir={tmp_path}"],
            capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, (flag, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: " + words), (flag, lines)
    assert not list(tmp_path.iterdir())  # nothing traced
