"""The documentation builds with warnings as errors, and every algorithm has its page.

Builds a copy of docs/ (so the generated pages land in a temporary directory, not in
the checkout) with `sphinx-build -W --keep-going -b html -q -j 1`, the same build as
`make docs`; needs the `docs` extra (skipped without Sphinx, furo or myst-parser).
"""

from __future__ import annotations

import html
import inspect
import os
import re
import shutil
import subprocess
import sys

import pytest

from pfljax import algorithms
from pfljax.experiment.config import COMMON_BUILD_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

for _module in ("sphinx", "furo", "myst_parser"):
    pytest.importorskip(_module, reason="the docs extra: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sphinx-build's completed process, the HTML directory)."""
    tmp = tmp_path_factory.mktemp("docs")
    src, out = tmp / "docs", tmp / "html"
    shutil.copytree(os.path.join(ROOT, "docs"), src, ignore=shutil.ignore_patterns("_build", "algorithms"))
    shutil.copy(os.path.join(ROOT, "BUILD.md"), tmp)  # the new-algorithm guide includes its section
    flags = ["-W", "--keep-going", "-b", "html", "-q", "-j", "1"]
    cmd = [sys.executable, "-m", "sphinx", *flags, str(src), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return proc, out


def options(name: str) -> list[inspect.Parameter]:
    params = inspect.signature(algorithms.get(name).build).parameters.values()
    return [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in COMMON_BUILD_ARGS]


def table_text(page: str) -> str:
    """The text of the page's options table (tags removed, entities decoded)."""
    tables = re.findall(r"<table.*?</table>", page, re.S)
    assert len(tables) <= 1, "more than one table on an algorithm page"
    return html.unescape(re.sub(r"<[^>]+>", " ", tables[0])) if tables else ""


def test_plain_docstrings_become_valid_rst():
    """A list right after its line, a formula indented under a line, `*`, `|` and a
    trailing `_` in plain text: docutils reads the converted text without a warning."""
    docutils_core = pytest.importorskip("docutils.core")
    sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))
    try:
        from plain_docstrings import to_rst  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.pop(0)
    doc = [
        "Steps, each one einsum:",
        "- `a * b`: the first, |mu| over the 'client_' leaves;",
        "  continued, then a formula:",
        "      w <- w - lr * g",
        "  and the rest of the item.",
        "1. an enumerated item",
        "   - nested",
        "After the list, *args and x_ [C, *shape].",
        "",
        "    code = example()",
        "",
        "Args:",
        "  x: [N, *feature_shape] inputs.",
    ]
    rst = "\n".join(to_rst(doc[:-2]))  # napoleon reads the Args section; docutils alone cannot
    settings = {"report_level": 2, "halt_level": 5, "warning_stream": False}
    tree = docutils_core.publish_doctree(rst, settings_overrides=settings)
    problems = [m.astext() for m in tree.findall(lambda n: n.tagname == "system_message")]
    assert not problems, problems
    text = tree.astext()
    assert "w <- w - lr * g" in text and "|mu|" in text and "'client_'" in text and "*args" in text
    assert to_rst(doc)[-2:] == ["Args:", "  x: [N, \\*feature_shape] inputs."]


def test_docs_build_without_warnings(built):
    proc, out = built
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    pages = ("index", "api/core", "api/runtime", "api/experiment", "guides/own_model", "algorithms/index")
    for page in pages:
        assert (out / f"{page}.html").is_file(), page


def test_every_algorithm_page_has_its_options_table(built):
    proc, out = built
    assert proc.returncode == 0, proc.stderr[-8000:]
    index = (out / "algorithms" / "index.html").read_text(encoding="utf-8")
    for name in algorithms.available():
        assert f'href="{name}.html"' in index, name
        page = (out / "algorithms" / f"{name}.html").read_text(encoding="utf-8")
        assert f"pfljax.algorithms.{name}" in page, name  # the module docstring, through autodoc
        text = f" {' '.join(table_text(page).split())} "
        domains = algorithms.domains(name)
        for p in options(name):
            row = f" {p.name} {p.default!r} "
            assert row in text, f"{name}: option row {row!r} not in its table: {text[:400]}"
            if p.name in domains:
                assert domains[p.name].describe() in text, f"{name}.{p.name}: domain missing"
        if not options(name):
            assert "no options of its own" in page, name
        dp = "supported (" if algorithms.supports_privacy(name) else "not supported"
        assert f"Client-level differential privacy: {dp}" in html.unescape(re.sub(r"<[^>]+>", "", page)), name
