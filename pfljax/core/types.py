"""Core types shared by every algorithm: client arrays, client data, Algorithm.

Shapes use C for the client axis, n for a client's (padded) sample axis, N for
the rows of a pool.

Client data come in two layouts with one interface (`count` [C], `n_max`, and
`take(data, c)` from pfljax.core.clients giving ONE client's ClientArrays):

- `ClientPool` (what `build_federated_data` makes): every client's rows once,
  unpadded, at the source's dtype (images uint8 with a 256-entry table of their
  float values), client c's rows at pool[offset[c] : offset[c] + count[c]];
- `ClientArrays` with a client axis: zero-padded [C, n_max, ...] arrays (simple
  to build by hand; tests and benchmarks use it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PyTree = Any
Params = Any
State = Any
Metrics = dict[str, jax.Array]


class ClientArrays(NamedTuple):
    """Padded per-client samples; without the client axis, ONE client's view.

    Attributes:
      x: [C, n_max, *feature_shape] float inputs; rows >= count[c] are padding
        (zeros here; other clients' rows in a view of a ClientPool: never use
        them unmasked).
      y: [C, n_max] int32 labels (classification) or [C, n_max, *target] float32
        targets (regression).
      count: [C] int32 number of real rows of each client.
    """

    x: jax.Array
    y: jax.Array
    count: jax.Array

    @property
    def n_max(self) -> int:
        """Rows per client of stacked arrays (static)."""
        return self.x.shape[1]

    def rows(self, c: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x, y) of client c's rows r [B] of stacked arrays."""
        return self.x[c, r], self.y[c, r]

    def client_labels(self) -> list:
        """Host numpy y of each client of stacked arrays (its real rows)."""
        y, n = np.asarray(self.y), np.asarray(self.count)
        return [y[c, :k] for c, k in enumerate(n)]


@struct.dataclass
class ClientPool:
    """Every client's rows once, unpadded, at the source's dtype (see module doc).

    Attributes:
      x: [N, *feature_shape] inputs: float32, or integer codes into `levels`.
      y: [N] int32 labels or [N, *target] float32 targets.
      offset: [C] int32 first pool row of each client.
      count: [C] int32 rows of each client.
      levels: [L] float32 value of each code (None: x holds the values).
      n_max: rows of a client's view, max(count, 1); static. The pool is laid out
        so that offset[c] + n_max <= N for every c (the largest client last).
    """

    x: jax.Array
    y: jax.Array
    offset: jax.Array
    count: jax.Array
    levels: jax.Array | None = None
    n_max: int = struct.field(pytree_node=False, default=1)

    def values(self, x: jax.Array) -> jax.Array:
        """Pool inputs as float32 values (a 256-entry table lookup for codes: exactly
        the float the source would have stored, unlike x / 255 rewritten by XLA)."""
        return x if self.levels is None else jnp.take(self.levels, x.astype(jnp.int32), axis=0)

    def client(self, c: jax.Array) -> ClientArrays:
        """Client c's ClientArrays view [n_max, ...]: its rows first, then (masked by
        count) the next rows of the pool; codes become float32 values here, inside jit."""
        window = lambda a: jax.lax.dynamic_slice_in_dim(a, self.offset[c], self.n_max)  # noqa: E731
        return ClientArrays(self.values(window(self.x)), window(self.y), self.count[c])

    def rows(self, c: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x, y) of client c's rows r [B] (r < n_max), without building its view."""
        i = self.offset[c] + r
        return self.values(self.x[i]), self.y[i]

    def padded(self) -> ClientArrays:
        """The zero-padded [C, n_max, ...] ClientArrays of the same clients (float x)."""
        views = jax.vmap(self.client)(jnp.arange(self.count.shape[0]))
        real = jnp.arange(self.n_max)[None, :] < self.count[:, None]
        zero = lambda a: jnp.where(real.reshape(real.shape + (1,) * (a.ndim - 2)), a, 0)  # noqa: E731
        return ClientArrays(zero(views.x), zero(views.y), self.count)

    def client_labels(self) -> list:
        """Host numpy y of each client (its real rows)."""
        y, off, n = (np.asarray(a) for a in (self.y, self.offset, self.count))
        return [y[o : o + k] for o, k in zip(off, n, strict=True)]

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool (x, y, offsets, counts, levels)."""
        return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(self))


@struct.dataclass
class ClientView:
    """Rows that are some of the C clients: a round's participants gathered from
    host memory (`pfljax.runtime.offload`).

    Attributes:
      ids: [K] int32 the client id of each row.
      num_clients: C, static.
    """

    ids: jax.Array
    num_clients: int = struct.field(pytree_node=False, default=0)


class ClientData(NamedTuple):
    """Train and test data of every client (same client order in both).

    Attributes:
      train, test: the clients' rows.
      view: None (row c is client c), or a ClientView: the rows are some of the
        clients (a round's participants gathered from host memory), whose round
        takes every row as a participant and keys it by its client id.
    """

    train: ClientPool | ClientArrays
    test: ClientPool | ClientArrays
    view: ClientView | None = None

    def client_id(self, c: jax.Array) -> jax.Array:
        """The client id of row c: c, or view.ids[c]. Per-client keys are folded
        from it, so a client draws the same numbers in a view as among all C."""
        return c if self.view is None else self.view.ids[c]


class Algorithm(NamedTuple):
    """A federated algorithm as pure functions (optax style).

    Attributes:
      init: (key, params_template, num_clients) -> State. Fields named
        `client_*` carry a leading client axis C; `global_*` fields have none;
        every state has a `round` counter.
      round: (State, ClientData, key) -> (State, Metrics). Jittable, one round of
        communication (build it with `pfljax.core.round.federated_round`).
        Scalar metrics include train_loss, bytes_up, bytes_down, participants;
        non-scalar ones are traces.
      evaluate: (State, ClientData, key) -> dict of [C] arrays with at least
        `accuracy`, `loss` and `count` on each client's own test set (extra [C]
        keys are reported as their test-size-weighted means). The key feeds any
        randomness of evaluation (e.g. fine-tuning batches).
      collaboration_matrix: optional, (State) -> [C, C] who learns from whom
        (rows sum to 1), written to summary.json and collaboration.png.
      final_report: optional, (State, FederatedData, per_client, key) -> dict of
        extra summary numbers; `per_client` is the final `evaluate` output (host
        numpy arrays) and `key` the final evaluation's key.
    """

    init: Callable[..., State]
    round: Callable[[State, ClientData, jax.Array], tuple[State, Metrics]]
    evaluate: Callable[[State, ClientData, jax.Array], dict[str, jax.Array]]
    collaboration_matrix: Callable[[State], jax.Array] | None = None
    final_report: Callable[..., dict] | None = None
