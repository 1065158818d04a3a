"""One module per algorithm, each with `build(model, local, **hyper) -> Algorithm`.

The registry is this package: `get(name)` imports `pfljax.algorithms.<name>`, so a
new algorithm is one new module (and its test) and nothing else; `pfljax.<name>`
and README's list follow from `available()` (tests/test_readme.py checks README).

A module may declare three constants, read only here: `MODEL_VARIANTS: dict[str, str]`,
the model names it accepts, each mapped to the model it trains (FedBN: "cnn" ->
"cnn_bn"; without it any model is used as given), and `RENAMED_OPTIONS: dict[str,
str]`, old option names -> new ones (refused with a message naming the new one);
and `HOST_STORAGE_REFUSED`, why its clients cannot live in host memory
(`pfljax.runtime.offload`: its round reads or writes rows of clients that do not take
part, or keeps O(C) state per client): a string, or a function of the build options
returning one or None (`refused_when` below, for one boolean option);
without it, host storage is allowed.
Every numeric option of `build` has a domain (`pfljax.core.domains.Domain`), declared
next to the options as `DOMAINS` and given to `@checked(DOMAINS)` on `build`;
`domains(name)` reads them (the experiment config checks its values against them).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from types import ModuleType

from pfljax.core.domains import domains_of


@functools.cache
def _names() -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def available() -> list[str]:
    """Names of all algorithm modules."""
    return list(_names())


def get(name: str) -> ModuleType:
    """The algorithm module `name`; ValueError listing the allowed names otherwise."""
    if name not in _names():
        raise ValueError(f"algorithm must be one of {available()}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def model_variant(name: str, model: str) -> str:
    """The model algorithm `name` trains when the user asks for `model`."""
    variants = vars(get(name)).get("MODEL_VARIANTS")
    if variants is None:
        return model
    if model not in variants:
        raise ValueError(f"model must be one of {sorted(variants)} for {name}, got {model!r}")
    return variants[model]


def domains(name: str) -> dict:
    """{option: Domain} of the numeric options of `<name>.build`."""
    return domains_of(get(name).build)


def renamed_option(name: str, option: str) -> str | None:
    """The new name of a renamed option of algorithm `name`, else None."""
    if name not in available():
        return None
    return vars(get(name)).get("RENAMED_OPTIONS", {}).get(option)


def host_storage_refusal(name: str, options: dict | None = None) -> str | None:
    """Why algorithm `name` (built with `options`) cannot keep its clients in host
    memory, or None when it can."""
    refused = vars(get(name)).get("HOST_STORAGE_REFUSED")
    return refused(dict(options or {})) if callable(refused) else refused


def refused_when(option: str, default: bool, reason: str) -> Callable[[dict], str | None]:
    """A module's `HOST_STORAGE_REFUSED` function: `reason` when the build option `option`
    (default `default`) is true, else None (host storage allowed)."""
    return lambda options: reason if options.get(option, default) else None


def takes(name: str, argument: str) -> bool:
    """Whether `<name>.build` takes `argument` (e.g. "privacy", "server_optimizer")."""
    return argument in inspect.signature(get(name).build).parameters


def supports_privacy(name: str) -> bool:
    """Whether `<name>.build` takes `privacy` (client-level DP of an average of uploads)."""
    return takes(name, "privacy")


def summary_line(name: str) -> str:
    """The first paragraph of the module's docstring, on one line (README's list)."""
    doc = (get(name).__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split()) if doc else name


def readme_table() -> str:
    """README's table of algorithms (`python -m pfljax.algorithms` prints it)."""
    rows = [f"| `{name}` | {summary_line(name)} |" for name in available()]
    return "\n".join(["| algorithm | what |", "| --- | --- |", *rows])
