"""Domains of numeric options: each declared once, checked on the host and in `build`.

Every numeric option (the experiment config's fields, the data source's and
client-level DP's options, each algorithm's `build` options) declares the values
it takes as a `Domain`, e.g. `Domain(0, 1, high_open=True)` for [0, 1) or
`Domain(1, integer=True)` for the integers >= 1. An algorithm declares its
options' domains next to them (`DOMAINS = {"lam": Domain(0)}`, then
`@checked(DOMAINS)` on its `build`); the experiment config reads them from there
(`domains_of(build)`) and checks a config's values before anything is built
(`pfljax.experiment.config.validate`: ConfigError "config.<algorithm>.<option>
must be ..., got X").

`build` checks what a Python caller passes (ValueError "<option> must be ...,
got X"), but only concrete values: a traced value (a grid's hyperparameter,
built inside the vmapped program of `pfljax.runtime.replicas.replicate_grid`) has
no value to check there; the experiment config checked each grid point.

`checked` also checks the arguments every build shares, by name: `model` must be
a `pfljax.models.base.Model` and `local` a `pfljax.core.local.LocalTraining`
(TypeError naming the argument and how to make one). Where both are given, the
returned Algorithm's `evaluate` checks its data against the state and the model
(`pfljax.core.evaluate.check_data`) and its `round` the data against the model
(the round itself checks the data against the state: `pfljax.core.round`): in
Python, before JAX sees the values, so the compiled programs are unchanged.

Non-finite values are outside every domain, except +inf where the domain's high
end is `math.inf` and closed (dp.clip_norm: inf is "no clipping"). A tuple
value (layer widths) is checked entry by entry; entries that are not numbers
(layer names) are left to the option's own checks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Domain:
    """The values a numeric option takes.

    Attributes:
      low, high: the ends (None: unbounded; values are finite unless high is
        math.inf, closed).
      low_open, high_open: whether that end itself is excluded.
      integer: only integers (Python or NumPy ints; not bools, not 2.0).
      note: what special values mean, e.g. "0: all clients".
    """

    low: float | None = None
    high: float | None = None
    _: dataclasses.KW_ONLY
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    note: str = ""

    def describe(self, integer: bool | None = None) -> str:
        """What is allowed: 'an integer >= 1', 'in (0, 1]', '> 0 (0: none)', 'a finite number'
        (`integer` False: without 'an integer', for an integer outside the bounds)."""
        low, high = _show(self.low), _show(self.high)
        if self.low is not None and self.high is not None:
            bounds = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            bounds = f"{'>' if self.low_open else '>='} {low}"
        elif self.high is not None:
            bounds = f"{'<' if self.high_open else '<='} {high}"
        else:
            bounds = ""
        integer = self.integer if integer is None else integer
        kind = "an integer" if integer else ("" if bounds else "a finite number")
        text = " ".join(t for t in (kind, bounds) if t)
        return text + (f" ({self.note})" if self.note else "")

    def contains(self, value: Any) -> bool:
        """Whether a concrete `value` (a number, not a bool) is in the domain."""
        value = _scalar(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.integer and not isinstance(value, numbers.Integral):
            return False
        v = float(value)
        if math.isnan(v) or (math.isinf(v) and not (v > 0 and self.high == math.inf and not self.high_open)):
            return False
        above = self.low is None or (v > self.low if self.low_open else v >= self.low)
        below = self.high is None or (v < self.high if self.high_open else v <= self.high)
        return above and below

    def error(self, name: str, value: Any) -> str | None:
        """'<name> must be <describe()>, got <value>' for a concrete value outside the
        domain (each number of a tuple value); None inside, or for a traced value. An
        integer outside the bounds is told the bounds only ('must be in [0, 6]')."""
        for v in value if isinstance(value, tuple | list) else (value,):
            if is_traced(v) or (isinstance(value, tuple | list) and isinstance(v, str)):
                continue
            if not self.contains(v):
                integral = isinstance(_scalar(v), numbers.Integral) and not isinstance(v, bool)
                return f"{name} must be {self.describe(self.integer and not integral)}, got {value!r}"
        return None


def _show(x: float | None) -> str:
    return "inf" if x == math.inf else f"{x:g}" if isinstance(x, float) else str(x)


def _scalar(value: Any) -> Any:
    """A 0-d NumPy or concrete JAX array as the Python number it holds."""
    if isinstance(value, np.ndarray | np.generic | jax.Array) and np.ndim(value) == 0:
        return value.item()
    return value


def is_traced(value: Any) -> bool:
    """Whether `value` is a JAX tracer (no concrete value at build time)."""
    return isinstance(value, jax.core.Tracer)


def known_zero(value: Any) -> bool:
    """Whether `value` is a concrete 0 (an optional term that can be left out); a
    traced value is not known, so the term is kept (it adds exactly 0 at 0)."""
    return not is_traced(value) and value == 0


def check(domains: Mapping[str, Domain], values: Mapping[str, Any], prefix: str = "") -> None:
    """ValueError '<prefix><name> must be ..., got X' for the first of `values` (those
    with a domain) outside its domain; traced values are skipped."""
    for name, domain in domains.items():
        if name in values:
            message = domain.error(prefix + name, values[name])
            if message:
                raise ValueError(message)


def checked(domains: Mapping[str, Domain]) -> Callable[[Callable], Callable]:
    """Decorator of an algorithm's `build`: its `model` and `local` arguments are
    checked (`check_arguments`) and its options with a domain in `domains`
    (`check`) before it runs; `domains_of(build)` returns the domains. Every name
    in `domains` must be a keyword-only parameter of `build` (TypeError otherwise).
    The Algorithm it returns checks its data (`with_data_checks`)."""

    def wrap(build: Callable) -> Callable:
        sig = inspect.signature(build)
        keyword = {n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        unknown = sorted(set(domains) - keyword)
        if unknown:
            raise TypeError(f"{build.__module__}.{build.__name__}: domains of unknown options {unknown}")

        @functools.wraps(build)
        def checked_build(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            check_arguments(bound.arguments)
            check(domains, bound.arguments)
            algorithm = build(*args, **kwargs)
            if "model" in bound.arguments and "local" in bound.arguments:
                return with_data_checks(algorithm, bound.arguments["model"], bound.arguments["local"])
            return algorithm

        checked_build.domains = dict(domains)
        return checked_build

    return wrap


MODEL_HINT = "pfljax.models.build_model(...) or pfljax.models.from_flax(module, ...)"
LOCAL_HINT = "LocalTraining(optax.sgd(0.05), batch_size=32, epochs=1) from pfljax.core.local"


def check_arguments(arguments: Mapping[str, Any]) -> None:
    """TypeError unless `arguments["model"]` (where given) is a pfljax Model and
    `arguments["local"]` a LocalTraining, saying how to make one: a flax module is
    wrapped with `from_flax`, an optax optimizer with `LocalTraining`."""
    # Imported here: pfljax.core.local imports this module.
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel

    from pfljax.core.local import LocalTraining  # pylint: disable=import-outside-toplevel

    if "model" in arguments and not is_model(arguments["model"]):
        model = arguments["model"]
        message = f"build(model=...): expected a pfljax Model ({MODEL_HINT}), got {_type_name(model)}"
        if isinstance(model, nn.Module):
            message += (
                "; wrap the flax module: pfljax.models.from_flax(module, input_shape, num_outputs) "
                "(its __call__ takes (x, train))"
            )
        elif isinstance(model, str):
            message += f"; make one: pfljax.models.build_model({model!r}, input_shape, num_outputs)"
        elif isinstance(model, LocalTraining):
            message += "; build(model, local, ...) takes the model first, then the LocalTraining"
        raise TypeError(message)
    if "local" in arguments and not isinstance(arguments["local"], LocalTraining):
        local = arguments["local"]
        message = f"build(local=...): expected a LocalTraining, e.g. {LOCAL_HINT}, got {_type_name(local)}"
        if isinstance(local, optax.GradientTransformation):
            message += "; wrap the optax optimizer: LocalTraining(optimizer, batch_size=..., epochs=...)"
        raise TypeError(message)


def is_model(value: Any) -> bool:
    """Whether `value` has what a pfljax Model (pfljax.models.base) gives an algorithm: init,
    apply and initial, an input_shape and num_outputs (checked by shape: core does not import
    models)."""
    calls = all(callable(getattr(value, name, None)) for name in ("init", "apply", "initial"))
    return calls and hasattr(value, "input_shape") and hasattr(value, "num_outputs")


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def with_data_checks(algorithm: Any, model: Any, local: Any) -> Any:
    """`algorithm` (an Algorithm; anything else as is) whose `round` and `evaluate`
    first check their data (`pfljax.core.evaluate.check_data`: client counts, feature
    shape, labels) against the state, `model` and `local.loss`. The checks read
    shapes and dtypes only: under jit they run once, at trace time."""
    from pfljax.core.evaluate import check_data  # pylint: disable=import-outside-toplevel
    from pfljax.core.types import Algorithm  # pylint: disable=import-outside-toplevel

    if not isinstance(algorithm, Algorithm):
        return algorithm

    def checking(fn: Callable, call: str) -> Callable:
        if getattr(fn, "checks_data", False):  # already checking: built by another checked build
            return fn

        @functools.wraps(fn)
        def run(*args, **kwargs):  # (state, data, key)
            if len(args) >= 2:
                check_data(args[0], args[1], model, local.loss, call)
            return fn(*args, **kwargs)

        # jit names its program after the function (a partial: after its func); keep that name
        inner = fn
        while isinstance(inner, functools.partial):
            inner = inner.func
        run.__name__ = getattr(inner, "__name__", call)
        run.checks_data = True
        return run

    return algorithm._replace(
        round=checking(algorithm.round, "round"), evaluate=checking(algorithm.evaluate, "evaluate")
    )


def domains_of(build: Callable) -> dict[str, Domain]:
    """The domains a `@checked` build declares ({} for an undecorated one)."""
    return dict(getattr(build, "domains", {}))


# Options several algorithms share.
SERVER_LR = Domain(0, low_open=True, note="1: plain averaging")
