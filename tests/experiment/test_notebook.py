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
