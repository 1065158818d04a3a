"""Blocks of federated rounds as one compiled program, evaluation included.

    block = make_block(round_fn, evaluate_fn, finite_fn, length=L)
    schedule = jnp.array([start, stop, eval_every, last], jnp.int32)
    state, out = jax.jit(block)(state, data, key, eval_key, schedule)

runs rounds start+1 .. stop (at most L of them; the rest of the L scan steps are
skipped by a `lax.cond` on an unbatched predicate, so one program serves every
block of a run) and evaluates after round r when `r % eval_every == 0 or r == last`,
as `evaluate_fn(state, data, eval_key, r)`. Nothing returns to the host in between: the
per-round metrics and evaluations come back stacked on a leading [L] axis.

Divergence: after every round the block checks that the new state and its
train loss are finite (and, after an evaluation, the test loss of every client
with test rows). A run (or each replica of R: `finite_fn` returns a bool of
shape [] or [R]) whose round fails keeps the state of its last good round for
the rest of the block; `out.ok` says which rounds were good, so the host can name
the first bad one and what failed (`out.state_finite`, `out.eval_finite`).
`length=1` reproduces one dispatch per round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class BlockOut(NamedTuple):
    """What a block returns, stacked on a leading [L] axis (then [R] for replicas).

    Attributes:
      metrics: the round's metrics (zeros for rounds not run).
      evaluation: per-client evaluation (zeros where `evaluated` is False).
      ran: [L] bool, the round was run (start < r <= stop).
      evaluated: [L] bool, the round was evaluated.
      state_finite: [L(, R)] bool, the state after the round was finite.
      eval_finite: [L(, R)] bool, the evaluation (if any) had finite test losses.
      ok: [L(, R)] bool, the run was still good after the round (all rounds so far finite).
    """

    metrics: dict
    evaluation: dict
    ran: jax.Array
    evaluated: jax.Array
    state_finite: jax.Array
    eval_finite: jax.Array
    ok: jax.Array


def all_finite(tree) -> jax.Array:
    """True when every floating-point leaf of `tree` is finite (a jittable bool)."""
    leaves = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def finite_test_loss(evaluation: dict) -> jax.Array:
    """True when every client with test rows has a finite test loss (per-client [..., C])."""
    bad = (evaluation["count"] > 0) & ~jnp.isfinite(evaluation["loss"])
    return ~jnp.any(bad, axis=-1)


def keep_where(ok: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """`new` where ok, else `old`, leaf by leaf; ok [] or [R] (a leading replica axis)."""

    def pick(n, o):
        return jnp.where(jnp.reshape(ok, ok.shape + (1,) * (n.ndim - ok.ndim)), n, o)

    return jax.tree.map(pick, new, old)


def make_block(
    round_fn: Callable,
    evaluate_fn: Callable,
    finite_fn: Callable = all_finite,
    length: int = 1,
) -> Callable:
    """Builds `block(state, data, key, eval_key, schedule) -> (state, BlockOut)`.

    `schedule` is int32 [start, stop, eval_every, last] (a device array, so that
    every block of a run reuses one program).

    Args:
      round_fn: (state, data, key) -> (state, metrics), the algorithm's round.
      evaluate_fn: (state, data, eval_key, r) -> per-client metrics after round r.
      finite_fn: state -> bool [] (one run) or [R] (replicas, each its own).
      length: L, the most rounds a block runs (static).
    """
    if length < 1:
        raise ValueError(f"block length must be >= 1, got {length}")
    # jitted once here, so the shape queries below and the scan body share one trace.
    round_fn, evaluate_fn, finite_fn = jax.jit(round_fn), jax.jit(evaluate_fn), jax.jit(finite_fn)

    def block(state, data, key, eval_key, schedule):
        start, stop, eval_every, last = schedule[0], schedule[1], schedule[2], schedule[3]

        def run(state, alive, r):
            new, metrics = round_fn(state, data, key)
            state_ok = finite_fn(new) & jnp.isfinite(metrics.get("train_loss", 0.0))
            evaluated = (r % eval_every == 0) | (r == last)
            zeros = _zeros(eval_shape)
            evaluation = jax.lax.cond(
                evaluated, lambda s: evaluate_fn(s, data, eval_key, r), lambda s: zeros, new
            )
            eval_ok = ~evaluated | finite_test_loss(evaluation)
            ok = alive & state_ok & eval_ok
            return keep_where(ok, new, state), (metrics, evaluation, evaluated, state_ok, eval_ok, ok)

        def skip(state, alive, r):
            metrics = _zeros(metrics_shape)
            evaluation = _zeros(eval_shape)
            return state, (metrics, evaluation, jnp.asarray(False), alive, alive, alive)

        _, metrics_shape = jax.eval_shape(round_fn, state, data, key)
        eval_shape = jax.eval_shape(lambda s: evaluate_fn(s, data, eval_key, start), state)
        alive0 = jnp.ones(jax.eval_shape(finite_fn, state).shape, bool)  # [] or [R]: all start good

        def body(carry, i):
            state, alive = carry
            r = start + i + 1
            ran = r <= stop
            state, (metrics, evaluation, evaluated, state_ok, eval_ok, ok) = jax.lax.cond(
                ran, run, skip, state, alive, r
            )
            return (state, ok), BlockOut(metrics, evaluation, ran, evaluated, state_ok, eval_ok, ok)

        (state, _), out = jax.lax.scan(body, (state, alive0), jnp.arange(length))
        return state, out

    return block


def _zeros(shapes: PyTree) -> PyTree:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
