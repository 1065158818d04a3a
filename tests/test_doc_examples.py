"""Every ```python block of BUILD.md and docs/ runs as written: whole programs as they
are, fragments after a prelude that makes the names they assume (README's example:
tests/test_readme.py). `pfljax/algorithms/local.py in full` is the file itself."""

import contextlib
import io
import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"```python\n(.*?)```", re.S)
# The names BUILD.md's fragments assume: a small federated data set, model and local schedule.
PRELUDE = """
import jax, numpy as np, optax, pfljax
fd = fed_data = pfljax.build_federated_data("simulation", 6, source_kwargs={"samples_per_client": 40})
model = pfljax.build_model("mlp", fd.input_shape, fd.num_classes, hidden=(8,))
local = pfljax.LocalTraining(optax.sgd(0.05), batch_size=8, epochs=1)
num_clients, K, R = 6, 3, 2
key, eval_key = jax.random.key(1), jax.random.key(2)
alg = pfljax.fedavg.build(model, local, clients_per_round=K)
with jax.default_device(jax.local_devices(backend="cpu")[0]):
    state = jax.device_get(alg.init(jax.random.key(0), None, num_clients))
"""


def blocks(path: str) -> list[str]:
    with open(os.path.join(ROOT, path)) as f:
        return FENCE.findall(f.read())


def run(code: str, where: str) -> dict:
    namespace = {"__name__": "doc_example"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, where, "exec"), namespace)  # noqa: S102
    return namespace


def test_build_md_shows_local_py_in_full():
    with open(os.path.join(ROOT, "pfljax", "algorithms", "local.py")) as f:
        assert blocks("BUILD.md")[0] == f.read()


@pytest.mark.parametrize("index", [1, 2])
def test_build_md_fragments_run_after_the_prelude(index):
    out = run(PRELUDE + blocks("BUILD.md")[index], f"BUILD.md block {index}")
    assert int(out["state"].round) >= 1
    assert len(blocks("BUILD.md")) == 3  # a new block needs a case here


@pytest.mark.parametrize("page", ["docs/guides/own_model.md", "docs/guides/privacy.md"])
def test_guide_programs_run(page):
    (code,) = blocks(page)
    out = run(code, page)
    assert int(out["state"].round) >= 10


def test_the_guides_config_file_is_a_valid_config():
    from pfljax.experiment.config import resolve  # noqa: PLC0415

    (code,) = blocks("docs/guides/binaries.md")
    config = run(code, "docs/guides/binaries.md")["get_config"]("dirichlet")
    resolved, _ = resolve(config)
    assert resolved.partition == "dirichlet" and resolved.num_clients == 20


def test_the_seed_methods_guide_example_runs():
    (code,) = blocks("docs/guides/seed_methods.md")
    out = run(code, "docs/guides/seed_methods.md")
    weights = np.asarray(out["weights"])
    assert weights.shape == (2, 3) and np.argmax(weights[0]) == 0 and np.argmax(weights[1]) == 1


def test_every_docs_page_with_python_is_covered_here():
    pages = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "docs")):
        dirs[:] = [d for d in dirs if not d.startswith("_")]  # _build, _ext
        pages += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md")]
    with_code = sorted(p for p in pages if blocks(p))
    assert with_code == [
        "docs/guides/binaries.md",
        "docs/guides/own_model.md",
        "docs/guides/privacy.md",
        "docs/guides/seed_methods.md",
    ]
