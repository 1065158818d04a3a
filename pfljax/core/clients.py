"""Stacked-client pytrees: stack, gather, scatter and the client-mapping strategy.

Every `client_*` leaf carries a leading client axis C. Per-client functions are
written for ONE client and mapped over that axis once, with a strategy:

- "vmap": `jax.vmap` (the default on GPU/TPU);
- "map": `jax.lax.map` with an optional `chunk_size` (vmapped chunks of that many
  clients, run sequentially). The default on CPU, where XLA's batched matmuls and
  batched convolutions are slower than a sequential scan over clients.

Both give the same numbers (tested); pick by measurement (`experiments/bench/bench.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core.types import ClientPool

PyTree = Any
STRATEGIES = ("auto", "vmap", "map")


def stack(trees: Sequence[PyTree]) -> PyTree:
    """Stacks a list of identically structured pytrees into one with axis 0 = client."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: PyTree) -> list[PyTree]:
    """Inverse of `stack`: a list with one pytree per client."""
    n = num_clients(tree)
    return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


def broadcast(tree: PyTree, n: int) -> PyTree:
    """Repeats a pytree n times along a new leading client axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


def num_clients(tree: PyTree) -> int:
    """Size of the leading (client) axis shared by all leaves."""
    sizes = {jnp.shape(x)[0] for x in jax.tree.leaves(tree)}
    if len(sizes) != 1:
        raise ValueError(f"leaves disagree on the client axis size: {sorted(sizes)}")
    return sizes.pop()


def is_client_leaf(path) -> bool:
    """True for leaves under a state field whose name starts with 'client_'."""
    first = path[0] if path else None
    name = getattr(first, "name", getattr(first, "key", None))
    return isinstance(name, str) and name.startswith("client_")


def gather(tree: PyTree, idx: jax.Array) -> PyTree:
    """Rows `idx` [K] of every leaf: [C, ...] -> [K, ...]."""
    return jax.tree.map(lambda x: x[idx], tree)


def scatter(tree: PyTree, idx: jax.Array, rows: PyTree) -> PyTree:
    """Writes `rows` [K, ...] into rows `idx` of `tree` [C, ...]."""
    return jax.tree.map(lambda x, r: x.at[idx].set(r), tree, rows)


def take(tree: PyTree, i: jax.Array) -> PyTree:
    """Row i of every leaf (a dynamic slice, no copy of the other rows); of a
    ClientPool, client i's ClientArrays view."""
    if isinstance(tree, ClientPool):
        return tree.client(i)
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


class ClientMap(NamedTuple):
    """How a per-client function is mapped over the client axis.

    Attributes:
      strategy: "auto" (map on CPU, vmap elsewhere), "vmap" or "map".
      chunk_size: for "map", how many clients one vmapped chunk holds (None: 1).
    """

    strategy: str = "auto"
    chunk_size: int | None = None

    def resolved(self) -> str:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"client_map strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy == "auto":
            return "map" if jax.default_backend() == "cpu" else "vmap"
        return self.strategy

    def __call__(self, fn: Callable[[PyTree], PyTree], xs: PyTree) -> PyTree:
        """Applies fn to each row of xs (a pytree with leading axis K)."""
        if self.resolved() == "vmap":
            return jax.vmap(fn)(xs)
        return jax.lax.map(fn, xs, batch_size=self.chunk_size)


def as_client_map(spec: ClientMap | str | Callable | None) -> ClientMap | Callable:
    """Accepts a ClientMap, a strategy name, None ("auto"), or any callable
    `(fn, xs) -> stacked results` (e.g. a Python loop over rows, which tests use
    as an oracle for the jitted strategies)."""
    if spec is None:
        return ClientMap()
    if isinstance(spec, str):
        spec = ClientMap(spec)
    if isinstance(spec, ClientMap):
        spec.resolved()  # validates the name early
        return spec
    if not callable(spec):
        raise ValueError(f"client_map must be a ClientMap, one of {STRATEGIES} or a callable, got {spec!r}")
    return spec


def python_loop_map(fn: Callable[[PyTree], PyTree], xs: PyTree) -> PyTree:
    """Reference mapping: a Python loop over rows, results stacked. For tests only;
    inside jit it unrolls (program size grows with the number of clients). `fn` is
    compiled once for all rows (run eagerly, its loops would compile per row)."""
    one = jax.jit(fn)
    return stack([one(take(xs, i)) for i in range(num_clients(xs))])


def round_keys(key: jax.Array, round_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sample_key, train_key) of one round, both derived from fold_in(key, round)."""
    sample_key, train_key = jax.random.split(jax.random.fold_in(key, round_index))
    return sample_key, train_key


def client_key(train_key: jax.Array, client_id: jax.Array) -> jax.Array:
    """A client's key for the round: fold_in(train_key, client_id).

    It does not depend on which other clients were sampled or on batching.
    """
    return jax.random.fold_in(train_key, client_id)
