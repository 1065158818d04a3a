"""experiments/bench/gpu_suite.py --smoke on CPU: every case leaves rows, parseable, finite, no errors.

The binary runs as a user runs it (a subprocess, `python -m experiments.bench.gpu_suite`);
its JSON lines are both printed and appended to --out. Without torch the vs_torch
case leaves its one "skipped" row (as tests/test_bench_vs_torch.py skips).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

from experiments.bench.gpu_suite import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Figures that are rates or ratios of two measured times: never 0.
POSITIVE = ("_per_s", "_over_", "speedup", "s_per_round", "round_s", "median_s", "train_s", "eval_s")


def run_smoke(out: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")
    env.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.bench.gpu_suite",
            "--smoke",
            f"--out={out}",
            "--pfllib_maps=auto:0:auto,map:2:while",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


def check_figures(row: dict) -> None:
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        assert math.isfinite(value) and value >= 0, (key, row)
        if any(p in key for p in POSITIVE):
            assert value > 0, (key, row)


def test_smoke_suite_every_case_measured(tmp_path):
    out = tmp_path / "suite.jsonl"
    out.write_text('{"case": "earlier run"}\n')  # rows are appended, not overwritten
    proc = run_smoke(str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert json.loads(lines[0]) == {"case": "earlier run"}
    rows = [json.loads(line) for line in lines[1:]]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert printed == rows
    assert rows[0]["case"] == "suite" and rows[0]["smoke"] is True
    assert rows[-1]["case"] == "suite" and rows[-1]["total_s"] > 0

    assert not [r for r in rows if "error" in r]
    for row in rows:
        check_figures(row)
        if "target" in row:
            assert isinstance(row["met"], bool), row
    by_case = {name: [r for r in rows if r["case"] == name and "case_s" not in r] for name in CASES}
    for name, measured in by_case.items():
        assert measured, name
        assert all(r["backend"] == "cpu" and r["device"] for r in measured), name
    if importlib.util.find_spec("torch") is None:
        assert [r["skipped"] for r in by_case["vs_torch"]] == ["torch not installed"]
    else:
        assert any("torch_over_pfljax" in r for r in by_case["vs_torch"])
    for name in ("bench", "local_loop", "seeds", "eval_chunk", "pfllib_dir"):
        assert not [r for r in by_case[name] if "skipped" in r], name
    assert [r["met"] for r in by_case["seeds"]] and "target" in by_case["pfllib_dir"][0]
    assert by_case["pfllib_dir"][0]["seeds"] == 3
    assert [r["map"] for r in by_case["pfllib_dir"]] == ["auto:0:auto", "map:2:while"]
    assert {r["eval_chunk"] for r in by_case["eval_chunk"]} == {4, 16}


def test_a_bad_pfllib_map_is_refused_in_one_line_before_any_case(tmp_path):
    out = tmp_path / "suite.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.gpu_suite", "--smoke", f"--out={out}",
         "--pfllib_maps=map:x:while"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --pfllib_maps entries must be"), lines
    assert "map:x:while" in lines[0] and not out.exists()
