"""The package's import direction: models <- core <- algorithms, core <- runtime <- experiment."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pfljax"
# Older import paths kept for users: modules that only alias their runtime module.
ALIASES = {"sharding.py", "core/blocks.py", "core/replicas.py", "core/offload.py", "core/memory.py"}


def imported(path: pathlib.Path) -> set[str]:
    """pfljax modules imported by a file at run time (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("pfljax")}


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("models", tuple(f"pfljax.{p}" for p in ("core", "algorithms", "runtime", "experiment", "data"))),
        ("core", tuple(f"pfljax.{p}" for p in ("runtime", "experiment", "algorithms", "data", "models"))),
        ("runtime", ("pfljax.experiment",)),
        ("algorithms", ("pfljax.runtime", "pfljax.experiment")),
    ],
)
def test_imports_go_one_way(folder, forbidden):
    bad = []
    for path in sorted((PACKAGE / folder).glob("*.py")):
        if str(path.relative_to(PACKAGE)) in ALIASES:
            continue
        bad += [f"{path.name}: {n}" for n in imported(path) if n.startswith(forbidden)]
    assert not bad, f"pfljax/{folder} imports against the layering: {bad}"
