"""experiments/compare.py: same data for every algorithm, table of mean +- std over seeds, overlay plot."""

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
        cell = f"{100 * finals.mean():.2f} +- {100 * finals.std():.2f}"
        assert any(line.startswith(f"| {name} | {cell} |") for line in table.splitlines()), table
    # Same partition for both algorithms at a seed.
    for s in (0, 1):
        data = [
            json.load(open(os.path.join(workdir, n, f"seed_{s}", "data.json"))) for n in ("fedavg", "local")
        ]
        assert data[0] == data[1]
    assert results["local"]["bytes_up_total"]["mean"] == 0 < results["fedavg"]["bytes_up_total"]["mean"]
    assert is_png(os.path.join(workdir, "accuracy.png"))
