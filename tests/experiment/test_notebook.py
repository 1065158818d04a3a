"""quickstart.ipynb: installs itself into a fresh virtualenv and runs there headless (nbclient)."""

import os
import subprocess
import sys

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_notebook_installs_itself_into_a_fresh_virtualenv_and_runs(monkeypatch, tmp_path):
    """As a new user runs it: a new virtualenv outside the repository with only a Jupyter
    kernel in it; the notebook's first cell installs pfljax from this clone (pip, the package
    index or its cache) and every cell then runs in that environment (nbclient)."""
    venv, kernels = tmp_path / "venv", tmp_path / "jupyter"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    subprocess.run([*pip, "ipykernel"], check=True, timeout=600)
    assert subprocess.run([python, "-c", "import pfljax"], capture_output=True).returncode == 1  # fresh
    subprocess.run(
        [python, "-m", "ipykernel", "install", "--prefix", str(kernels), "--name", "fresh"],
        check=True,
        timeout=120,
    )
    monkeypatch.setenv("JUPYTER_PATH", str(kernels / "share" / "jupyter"))
    # the versions `make venv` tested (and likely cached): the cell itself pins nothing, so on
    # Colab pip keeps the runtime's own jax
    monkeypatch.setenv("PIP_CONSTRAINT", os.path.join(ROOT, "constraints.txt"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv(
        "JAX_COMPILATION_CACHE_DIR", os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))
    )
    path = os.path.join(ROOT, "experiments", "notebooks", "quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    where = {"metadata": {"path": os.path.dirname(path)}}  # as a user opens it: from its own folder
    NotebookClient(nb, timeout=900, kernel_name="fresh", resources=where).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert f"installed pfljax from {ROOT}" in text
    assert "| fedavg |" in text and "| local |" in text
    assert "final" in text and "per client" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
    where_installed = subprocess.run(
        [python, "-c", "import pfljax; print(pfljax.__file__)"], capture_output=True, text=True, check=True
    )
    assert where_installed.stdout.strip() == os.path.join(ROOT, "pfljax", "__init__.py")


def test_install_cell_installs_this_clone_where_pfljax_is_missing(monkeypatch, tmp_path):
    """The first cell, where pfljax is not importable: `pip install -e <clone>[experiments]`
    from inside the clone, a clear error elsewhere (no placeholder repository URL)."""
    import importlib.util  # noqa: PLC0415

    import pytest  # noqa: PLC0415

    nb = nbformat.read(os.path.join(ROOT, "experiments", "notebooks", "quickstart.ipynb"), as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code")
    assert "github.com" not in cell and "YOUR-ORG" not in cell
    calls = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(subprocess, "check_call", calls.append)
    monkeypatch.chdir(os.path.join(ROOT, "experiments", "notebooks"))
    exec(compile(cell, "quickstart.ipynb", "exec"), {})  # noqa: S102
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "-e", f"{ROOT}[experiments]"]]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="not inside a clone of its repository: clone it"):
        exec(compile(cell, "quickstart.ipynb", "exec"), {})  # noqa: S102
