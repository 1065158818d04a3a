"""One module per algorithm, each with `build(model, local, **hyper) -> Algorithm`.

`get(name)` imports `pfljax.algorithms.<name>`, so a new algorithm is one new
module and needs no registry edit.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def available() -> list[str]:
    """Names of all algorithm modules."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def get(name: str) -> ModuleType:
    """The algorithm module `name`; ValueError listing the allowed names otherwise."""
    names = available()
    if name not in names:
        raise ValueError(f"algorithm must be one of {names}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
