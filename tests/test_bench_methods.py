"""experiments/bench/bench_methods.py on CPU: rounds of several algorithms against FedAvg's on a
tiny default config, one JSON line each; bad flags one line and exit 2."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config=default", "--config.num_clients=4", "--config.samples_per_client=40"]


def bench(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.bench.bench_methods", *TINY, *args],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300,
    )  # fmt: skip


def test_each_algorithm_is_timed_against_fedavg_on_the_same_clients():
    proc = bench("--algorithms=fedproto,gpfl", "--repeats=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["algorithm"] for r in rows] == ["fedavg", "fedproto", "gpfl"]
    base = rows[0]["round_s"]
    for r in rows:
        assert r["clients"] == 4 and r["backend"] == "cpu"
        assert 0 < r["best_s"] <= r["round_s"] and r["compile_s"] > 0
        # over_fedavg (3 decimals) from the unrounded times; round_s and base carry 6 decimals
        assert abs(r["over_fedavg"] - r["round_s"] / base) <= 1e-3 + 1e-6 * (1 + r["over_fedavg"]) / base
    assert rows[0]["over_fedavg"] == 1.0


def test_bad_flags_get_one_line_and_exit_2():
    for args, words in (
        (["--algorithms=fedavgg"], "--algorithms: 'fedavgg' is not an algorithm (did you mean 'fedavg'"),
        (["--repeats=0"], "--repeats must be an integer >= 1"),
        (["--config.local_epochs=-1"], "local_epochs"),
    ):
        proc = bench(*args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        last = proc.stderr.strip().splitlines()[-1]
        assert words in last, (args, last)
