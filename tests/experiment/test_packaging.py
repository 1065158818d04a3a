"""After `pip install` of pfljax: the console scripts run from any directory with the shipped configs.

Builds a wheel from a copy of the sources (setuptools builds in the source tree),
installs it into a temporary directory without dependencies (they come from this
environment), and runs `pfljax-partition` there on a shipped config by name.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.experiment.tiny import ROOT, is_png


def setuptools_reads_spdx_license() -> bool:
    """pyproject's `license = "Apache-2.0"` (an SPDX string) needs setuptools >= 77."""
    import setuptools  # noqa: PLC0415

    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.mark.skipif(
    not setuptools_reads_spdx_license(),
    reason="setuptools < 77 here cannot read pyproject's SPDX license string: pip install 'setuptools>=77' "
    "(the dev extra has it; make venv installs it)",
)
def test_wheel_ships_configs_and_console_scripts_that_run_anywhere(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(ROOT, "pfljax"), src / "pfljax", ignore=skip)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").iterdir()
    names = zipfile.ZipFile(wheel).namelist()
    assert "pfljax/experiment/configs/federico_fmnist.py" in names
    assert "pfljax/models/onednn.cc" in names  # built on first use by pfljax.models.onednn
    assert "pfljax/py.typed" in names  # PEP 561: type checkers read pfljax's annotations
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("experiments/") for n in names)  # the repository's scripts stay out
    entry_points = zipfile.ZipFile(wheel).read("pfljax-0.1.0.dist-info/entry_points.txt").decode()
    for line in (
        "pfljax-run = pfljax.experiment.main:run",
        "pfljax-compare = pfljax.experiment.compare_main:run",
        "pfljax-partition = pfljax.experiment.partition_main:run",
    ):
        assert line in entry_points
    site = tmp_path / "site"
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(site))
    proc = subprocess.run(
        [
            str(site / "bin" / "pfljax-partition"),
            "--config=fedfac_simulation:dynamic",
            "--config.num_clients=5",
            "--config.source.samples_per_client=20",
            "--outdir=out",
        ],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    which = subprocess.run(
        [sys.executable, "-c", "import pfljax.experiment.configs as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
    )
    assert which.stdout.startswith(f"{site}/pfljax/")  # the installed copy is what ran
    data = json.load(open(elsewhere / "out" / "data.json"))
    assert [c["train"] + c["test"] for c in data["clients"]] == [20] * 5
    assert is_png(str(elsewhere / "out" / "partition.png"))
