"""experiments/compare.py: same data for every algorithm, table of mean +- std over seeds, overlay plot."""

import csv
import json
import os
import subprocess
import sys

import numpy as np

from tests.experiment.tiny import ROOT, TINY_FLAGS, is_png


def test_compare_two_algorithms_two_seeds(tmp_path):
    workdir = str(tmp_path / "cmp")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))
    )
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.compare", *TINY_FLAGS, "--algorithms=fedavg,local", "--seeds=0,1"]
        + [f"--workdir={workdir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(os.path.join(workdir, "results.json")))["results"]
    table = open(os.path.join(workdir, "results.md")).read()
    assert table in proc.stdout
    for name in ("fedavg", "local"):
        runs = [json.load(open(os.path.join(workdir, name, f"seed_{s}", "summary.json"))) for s in (0, 1)]
        assert [r["seed"] for r in runs] == [0, 1]
        finals = np.asarray([r["final_mean_accuracy"] for r in runs])
        np.testing.assert_allclose(results[name]["final_mean_accuracy"]["mean"], finals.mean(), rtol=1e-9)
        np.testing.assert_allclose(results[name]["final_mean_accuracy"]["std"], finals.std(), rtol=1e-9)
        assert results[name]["final_mean_accuracy"]["values"] == finals.tolist()  # every seed's value
        assert results[name]["status"] == ["completed", "completed"]
        csv_rows = [
            r for r in csv.DictReader(open(os.path.join(workdir, "results.csv"))) if r["algorithm"] == name
        ]
        assert [(int(r["seed"]), r["status"]) for r in csv_rows] == [(0, "completed"), (1, "completed")]
        assert [float(r["final_mean_accuracy"]) for r in csv_rows] == finals.tolist()
        cell = f"{100 * finals.mean():.2f} +- {100 * finals.std():.2f}"
        assert any(line.startswith(f"| {name} | {cell} |") for line in table.splitlines()), table
    # Same partition for both algorithms at a seed.
    for s in (0, 1):
        data = [
            json.load(open(os.path.join(workdir, n, f"seed_{s}", "data.json"))) for n in ("fedavg", "local")
        ]
        assert data[0] == data[1]
    assert results["local"]["bytes_up_total"]["mean"] == 0 < results["fedavg"]["bytes_up_total"]["mean"]
    assert is_png(os.path.join(workdir, "accuracy.png")) and is_png(os.path.join(workdir, "loss.png"))
    assert table.startswith(
        "simulation, 6 clients, per-client generator, 2 rounds; mean +- std over seeds [0, 1]"
    )
    # A log line when each run starts and ends, and one at the end.
    starts = [line.split("] compare: ")[1] for line in proc.stderr.splitlines() if "] compare: run " in line]
    assert starts[0] == f"run 1/4: fedavg seed 0 -> {workdir}/fedavg/seed_0"
    assert starts[1].startswith("run 1/4 done: fedavg seed 0, final mean acc ")
    assert len(starts) == 8 and starts[-1].startswith("run 4/4 done: local seed 1")
    assert "] compare: 4 runs in " in proc.stderr and f"(0 diverged); results in {workdir}" in proc.stderr


def test_one_seed_reports_its_values_without_a_spread():
    from pfljax.experiment import base_config  # noqa: PLC0415
    from pfljax.experiment.compare import aggregate, markdown_table  # noqa: PLC0415
    from pfljax.experiment.config import resolve, run_settings  # noqa: PLC0415
    from tests.experiment.tiny import tiny_config  # noqa: PLC0415

    run = {"seed": 3, "final_mean_accuracy": 0.5, "best_mean_accuracy": 0.625, "final_worst10_accuracy": 0.25}
    settings = run_settings(resolve(tiny_config(base_config()))[0])
    title = (settings.title, settings.rounds)
    one = markdown_table(aggregate({"fedavg": [run]}), *title, [3])
    assert "2 rounds; seed 3\n" in one and "| fedavg | 50.00 | 62.50 | 25.00 |" in one and "+-" not in one
    two = markdown_table(
        aggregate({"fedavg": [run, {**run, "seed": 4, "final_mean_accuracy": 0.7}]}), *title, [3, 4]
    )
    assert "mean +- std over seeds [3, 4]" in two and "| fedavg | 60.00 +- 10.00 | 62.50 +- 0.00 |" in two
