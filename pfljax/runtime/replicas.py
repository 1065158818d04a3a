"""R copies of an algorithm's state advanced by one jitted round (seeds and grids).

A replica is one run: its own state (from its own init key), its own round key
and, for a grid, its own values of some scalar hyperparameters. The replicas
are stacked on a new leading axis R of every state leaf and advanced together:

    reps = replicate(alg, 3)                       # seeds only
    states = reps.init(init_keys, None, C)         # init_keys [R]
    states, metrics = jax.jit(reps.round)(states, data, run_keys)   # metrics [R]
    per_client = reps.evaluate(states, data, eval_keys)             # [R, C]

The client data are shared by every replica (vmapped with in_axes None: not
copied). Replica r computes what a separate run with init key init_keys[r] and
round key run_keys[r] computes; only the float summation order of vmapped
matmuls may differ (tests: rtol 1e-5).

A grid (`replicate_grid`) builds the algorithm inside the vmapped function with
the varying hyperparameters as traced scalars: `build(**{name: tracer})`. Which
options can vary is decided by trying (`check_varying`): an option whose build
path needs a concrete value (Python control flow that chooses code, such as
scaffold's `if local_lr > 0`, a shape, an int) raises a JAX tracer error at trace
time, which is turned into one ValueError naming the option ("cannot vary inside
one program"). Range checks do not: builds check their options' domains only for
concrete values (`pfljax.core.domains`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core.params import tree_bytes
from pfljax.core.types import Algorithm, ClientData
from pfljax.runtime.memory import ROUND_STATE_COPIES, device_memory_bytes

# Errors JAX raises when a build path needs a concrete value of a traced hyperparameter.
TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


class Replicas(NamedTuple):
    """R replicas of one algorithm (see the module docstring).

    Attributes:
      count: R.
      init: (keys [R], params_template, num_clients, per_replica=False) -> stacked state
        (leaves [R, ...]); `per_replica`: the template's leaves have a leading R axis (each
        replica its own starting variables), else one template serves every replica.
      round: (states, data, keys [R]) -> (states, metrics with a leading R axis).
        Jittable; the data are shared (in_axes None).
      evaluate: (states, data, keys [R]) -> per-client dict of [R, C] arrays.
      hypers: {name: float32 [R]} the values of the varying hyperparameters ({} for seeds only).
      algorithm: (r) -> Algorithm of replica r with concrete hyperparameters
        (its collaboration_matrix / final_report apply to `take(states, r)`).
    """

    count: int
    init: Callable
    round: Callable
    evaluate: Callable
    hypers: dict
    algorithm: Callable


def take(states, r: int):
    """Replica r's state (leaves without the R axis)."""
    return jax.tree.map(lambda x: x[r], states)


def stack(trees: Sequence[Any]):
    """Trees stacked on a new leading R axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


STRATEGIES = ("vmap", "map", "auto")


def resolve_strategy(strategy: str) -> str:
    """ "vmap" (R batched into every op), "map" (lax.map: the R replicas one after
    another inside one program) or "auto" (map on CPU, vmap elsewhere: on CPU a
    vmapped convolution over R different kernels becomes a grouped convolution,
    which XLA:CPU runs several times slower than R separate ones)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"replica strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "auto":
        return "map" if jax.default_backend() == "cpu" else "vmap"
    return strategy


def _over_replicas(fn: Callable, strategy: str) -> Callable:
    """fn(*args) mapped over the leading axis of every arg (vmap or lax.map)."""
    if resolve_strategy(strategy) == "vmap":
        return jax.vmap(fn)
    return lambda *args: jax.lax.map(lambda a: fn(*a), args)


def replicate(alg: Algorithm, count: int, strategy: str = "vmap") -> Replicas:
    """R = `count` seeds of `alg`: init over R keys, the round and evaluation
    mapped over R (`strategy`, see `resolve_strategy`), the data shared."""
    _check_count(count)
    resolve_strategy(strategy)

    def init(keys, params_template=None, num_clients=1, per_replica=False):
        axis = 0 if per_replica else None
        return jax.vmap(lambda k, p: alg.init(k, p, num_clients), in_axes=(0, axis))(keys, params_template)

    if resolve_strategy(strategy) == "vmap":
        round_fn = jax.vmap(alg.round, in_axes=(0, None, 0))
        evaluate = jax.vmap(alg.evaluate, in_axes=(0, None, 0))
    else:
        round_fn = lambda states, data, keys: _over_replicas(  # noqa: E731
            lambda s, k: alg.round(s, data, k), "map"
        )(states, keys)
        evaluate = lambda states, data, keys: _over_replicas(  # noqa: E731
            lambda s, k: alg.evaluate(s, data, k), "map"
        )(states, keys)
    return Replicas(count, init, round_fn, evaluate, {}, lambda r: alg)


def grid_values(values: Mapping[str, Sequence[float]]) -> tuple[dict, int]:
    """({name: float32 [R]}, R) of the varying hyperparameters; all of them give R values."""
    if not values:
        raise ValueError("a grid needs at least one hyperparameter with values")
    lengths = {name: len(v) for name, v in values.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"grid hyperparameters must give the same number of values, got {lengths}")
    out = {}
    for name, v in values.items():
        arr = np.asarray(v)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"{name} cannot vary inside one program: grid values must be floats, got {list(v)!r}"
            )
        out[name] = jnp.asarray(arr, jnp.float32)
    count = next(iter(lengths.values()))
    _check_count(count)
    return out, count


def replicate_grid(
    build: Callable[..., Algorithm], values: Mapping[str, Sequence[float]], strategy: str = "vmap"
) -> Replicas:
    """R replicas whose hyperparameters `values` ({name: [R] floats}) differ.

    `build(**{name: scalar})` returns the Algorithm; it is called inside the
    vmapped functions with traced scalars, and concretely by `algorithm(r)`.
    Replica r's seed is given by the r-th init / round key as in `replicate`.
    Call `check_varying` first to turn a tracer error into a clear ValueError.
    """
    hypers, count = grid_values(values)
    resolve_strategy(strategy)

    def init(keys, params_template=None, num_clients=1, per_replica=False):
        axis = 0 if per_replica else None
        return jax.vmap(lambda k, h, p: build(**h).init(k, p, num_clients), in_axes=(0, 0, axis))(
            keys, hypers, params_template
        )

    def round_fn(states, data, keys):
        return _over_replicas(lambda s, k, h: build(**h).round(s, data, k), strategy)(states, keys, hypers)

    def evaluate(states, data, keys):
        return _over_replicas(lambda s, k, h: build(**h).evaluate(s, data, k), strategy)(states, keys, hypers)

    def algorithm(r):
        return build(**{name: float(v[r]) for name, v in values.items()})

    return Replicas(count, init, round_fn, evaluate, hypers, algorithm)


def check_varying(
    build: Callable[..., Algorithm],
    values: Mapping[str, Sequence[float]],
    data: ClientData,
    num_clients: int,
    prefix: str = "",
) -> None:
    """ValueError naming the first option of `values` that cannot be a traced scalar.

    Traces (no compilation, no FLOPs: `jax.eval_shape`) init, round and evaluate
    of a grid over each option alone; an option whose build path needs a
    concrete value raises a tracer error, reported as
    "<prefix><option> cannot vary inside one program: <why>".
    """
    for name, v in values.items():
        reps = replicate_grid(build, {name: v})
        keys = jax.random.split(jax.random.key(0), reps.count)
        try:
            states = jax.eval_shape(functools.partial(reps.init, num_clients=num_clients), keys)
            jax.eval_shape(reps.round, states, data, keys)
            jax.eval_shape(reps.evaluate, states, data, keys)
        except TRACER_ERRORS as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"{prefix}{name} cannot vary inside one program: its build needs a concrete value "
                f"({type(e).__name__}: {first[:200]}); run its values as separate runs"
            ) from e


def _check_count(count: int) -> None:
    if not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"replica count must be an integer >= 1, got {count!r}")


# ---- memory -----------------------------------------------------------------------------


def estimate_bytes(state_bytes: int, data_bytes: int, count: int) -> int:
    """Estimated peak bytes of R replicas: the shared data once, plus R x (the state
    held ROUND_STATE_COPIES times in a round: input, output, updates, optimizer)."""
    return int(data_bytes + count * ROUND_STATE_COPIES * state_bytes)


def check_memory(state: Any, data: Any, count: int, limit: int | None = None, what: str = "replicas") -> int:
    """The estimated bytes of `count` replicas of `state` (one replica's state,
    arrays or ShapeDtypeStructs) over `data`; ValueError, with the estimate and the
    largest R that fits, when it exceeds `limit` (default: `device_memory_bytes()`)."""
    state_bytes, data_bytes = tree_bytes(state), tree_bytes(data)
    need = estimate_bytes(state_bytes, data_bytes, count)
    limit = device_memory_bytes() if limit is None else limit
    if limit is not None and need > limit:
        fits = max((limit - data_bytes) // max(ROUND_STATE_COPIES * state_bytes, 1), 0)
        raise ValueError(
            f"{count} {what} do not fit in memory: estimated {need / 2**20:.1f} MiB "
            f"(data {data_bytes / 2**20:.1f} MiB shared + {count} x {ROUND_STATE_COPIES} x state "
            f"{state_bytes / 2**20:.1f} MiB) > {limit / 2**20:.1f} MiB available; "
            f"the largest count that fits is {int(fits)}"
        )
    return need
