"""The examples in the package's module docstrings run as written (a doctest of each
indented block that imports pfljax); a test lists which modules have one."""

import ast
import os
import pathlib
import re
import textwrap

import numpy as np
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pfljax"
EXAMPLE = re.compile(r"\n((?:    .*\n|\n)*?    (?:import |from pfljax)(?:.*\n|\n)*?)(?=\n\S|\Z)")


def examples() -> dict[str, str]:
    """{module path: its docstring's example} for every module docstring that has one."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc:
            continue
        found = EXAMPLE.search(doc + "\n")
        if found:
            out[str(path.relative_to(PACKAGE.parent))] = textwrap.dedent(found.group(1))
    return out


def test_the_modules_with_examples():
    assert sorted(examples()) == ["pfljax/__init__.py", "pfljax/experiment/__init__.py", "pfljax/maths.py"]


@pytest.mark.parametrize("module", ["pfljax/__init__.py", "pfljax/maths.py"])
def test_library_examples_run(module):
    namespace = {}
    exec(compile(examples()[module], module, "exec"), namespace)  # noqa: S102
    if module == "pfljax/maths.py":
        np.testing.assert_allclose(np.asarray(namespace["weights"]).sum(axis=1), 1.0, rtol=1e-6)
    else:
        assert callable(namespace["alg"].round)


def test_the_experiment_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {}
    code = examples()["pfljax/experiment/__init__.py"]
    exec(compile(code, "pfljax/experiment/__init__.py", "exec"), namespace)  # noqa: S102
    assert namespace["summary"]["status"] == "completed" and namespace["summary"]["rounds"] == 5
    assert os.path.isfile(tmp_path / "runs" / "try" / "summary.json")
