"""experiments/notebooks/quickstart.ipynb runs headless (nbclient) and shows its table and plots."""

import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_notebook_executes(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv(
        "JAX_COMPILATION_CACHE_DIR", os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))
    )
    path = os.path.join(ROOT, "experiments", "notebooks", "quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert "| fedavg |" in text and "| local |" in text
    assert "final" in text and "per client" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2


def test_install_cell_installs_this_clone_where_pfljax_is_missing(monkeypatch, tmp_path):
    """The first cell, where pfljax is not importable: `pip install -e <clone>[experiments]`
    from inside the clone, a clear error elsewhere (no placeholder repository URL)."""
    import importlib.util  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

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
