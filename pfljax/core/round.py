"""One federated round, shared by every algorithm (fedjax's for_each_client, optax's init/update).

The round owns what every algorithm shares: the participants (a static K of the
eligible clients, sampled from the round key), the keys, the aggregation weights,
the client map, the round counter and the standard metrics. An algorithm supplies
pieces:

    round = federated_round(
        client_step(client_update, server_update, client_map, client_inputs=...),
        clients_per_round=K, weighting="samples", bytes_up=b, bytes_down=b)

- `client_update(state, cid, inputs, data, key) -> (output, loss)`: what ONE client
  does in the round. `state` is the server's view (read its `global_*` fields);
  `inputs` is the client's own row of `client_inputs(state, ids)`; `data` is the
  client's train ClientArrays (no client axis); `key` its round key.
- `server_update(state, outputs, part) -> (state, metrics)`: what the server does
  with the stacked outputs [K, ...] of the participants `part` (a Participants).
- A method whose round is not "map one client, then aggregate" (FedeRiCo's
  neighbour exchange) gives `federated_round` its own `step(state, data, part)`.

Before anything else (in Python, at trace time) the round checks that `data`
is a ClientData with as many clients as the state's `client_*` leaves have rows
(`check_clients`): a mismatch would sample or gather rows the state lacks.

The round increments `state.round`, reports `train_loss` (the weighted mean of the
participants' losses), `bytes_up` / `bytes_down` (K times the per-client figures)
and `participants`; metrics returned by the algorithm's piece override these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core import aggregate
from pfljax.core.clients import ClientMap, client_key, gather, is_client_leaf, round_keys, scatter, take
from pfljax.core.privacy import ClientDP, private_mean_update
from pfljax.core.sampling import check_clients_per_round, sample_clients
from pfljax.core.types import ClientArrays, ClientData, ClientPool

PyTree = Any
WEIGHTINGS = ("samples", "uniform")
DP_NOISE_STREAM = 0xD9  # the server's noise key: fold_in(sample_key, DP_NOISE_STREAM)


class Participants(NamedTuple):
    """The clients taking part in one round.

    Attributes:
      ids: [K] int32 client ids (sorted).
      weights: [K] float32 aggregation weights (train sizes or ones).
      sample_key: the round's sampling key (for server-side randomness).
      train_key: the round's training key; client c uses `client_key(c)`.
      num_clients: C, static.
      privacy: client-level DP of the server's average (`average`), or None.
      everyone: static; True when ids are every row of the state (all C clients
        eligible and taking part, or a view of the participants), so `gather`
        and `scatter` are the identity (no copy of [C, ...] trees).
      client_ids: None, or in a view of the participants (`ClientData.view`, host
        storage) the client id of each row: `ids` are then rows 0..K-1 of the view
        and `client_key` folds in the client's id, as the all-clients round does.
    """

    ids: jax.Array
    weights: jax.Array
    sample_key: jax.Array
    train_key: jax.Array
    num_clients: int
    privacy: ClientDP | None = None
    everyone: bool = False
    client_ids: jax.Array | None = None

    @property
    def k(self) -> int:
        return self.ids.shape[0]

    def client_key(self, cid: jax.Array) -> jax.Array:
        """fold_in(train_key, client id of cid): independent of who else takes part."""
        return client_key(self.train_key, cid if self.client_ids is None else self.client_ids[cid])

    def gather(self, tree: PyTree) -> PyTree:
        """The participants' rows [K, ...] of a [C, ...] tree."""
        return tree if self.everyone else gather(tree, self.ids)

    def scatter(self, tree: PyTree, rows: PyTree) -> PyTree:
        """`tree` [C, ...] with the participants' rows replaced by `rows` [K, ...]."""
        if self.everyone:
            return jax.tree.map(lambda x, r: jnp.broadcast_to(r, x.shape).astype(x.dtype), tree, rows)
        return scatter(tree, self.ids, rows)

    def mean(self, stacked: PyTree) -> PyTree:
        """Weighted mean over the participants of [K, ...] leaves."""
        return aggregate.weighted_mean(stacked, self.weights)

    def average(self, uploads: PyTree, reference: PyTree) -> tuple[PyTree, dict]:
        """The server's average of the participants' uploads [K, ...] of the model
        `reference` it sent: their weighted mean; under client-level DP, reference plus
        the clipped, noised mean update (pfljax.core.privacy). Returns (average, metrics)."""
        if self.privacy is None:
            return self.mean(uploads), {}
        updates = jax.tree.map(lambda u, r: u - r[None], uploads, reference)
        key = jax.random.fold_in(self.sample_key, DP_NOISE_STREAM)
        mean, metrics = private_mean_update(updates, key, self.privacy)
        return jax.tree.map(jnp.add, reference, mean), metrics


def check_weighting(weighting: str) -> str:
    """ValueError naming the allowed values unless `weighting` is one of WEIGHTINGS."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return weighting


def client_weights(weighting: str, counts: jax.Array) -> jax.Array:
    """Aggregation weights [K]: sample counts ("samples") or ones ("uniform")."""
    check_weighting(weighting)
    return counts.astype(jnp.float32) if weighting == "samples" else jnp.ones_like(counts, jnp.float32)


def data_clients(arrays: Any, argument: str) -> int:
    """The client count C of a ClientPool or ClientArrays (rows of `count`); TypeError
    for anything else, ValueError when its arrays disagree on C (shapes only)."""
    if isinstance(arrays, ClientArrays):
        sizes = {"x": arrays.x, "y": arrays.y, "count": arrays.count}
    elif isinstance(arrays, ClientPool):
        sizes = {"offset": arrays.offset, "count": arrays.count}
    else:
        raise TypeError(
            f"{argument}: expected a ClientPool or ClientArrays (pfljax.core.types), "
            f"got {type(arrays).__name__}"
        )
    sizes = {name: (jnp.shape(a) or (None,))[0] for name, a in sizes.items()}
    if len(set(sizes.values())) != 1:
        shown = ", ".join(f"{name} {n}" for name, n in sizes.items())
        raise ValueError(f"{argument}: the arrays disagree on the number of clients (leading axis: {shown})")
    return sizes["count"]


def state_clients(state: Any) -> int | None:
    """The client count C of a state: the leading axis of its first `client_*` leaf
    with one (None: no such leaf, e.g. FedAvg without local leaves)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if is_client_leaf(path) and jnp.ndim(leaf) >= 1:
            return jnp.shape(leaf)[0]
    return None


def check_clients(state: Any, data: Any, call: str = "round") -> int:
    """C of `data` (a ClientData): TypeError for other data, ValueError unless its
    train and test sets and the state's `client_*` leaves have the same number of
    clients. Reads shapes only (no JAX operation)."""
    if not isinstance(data, ClientData):
        raise TypeError(
            f"{call}(data=...): expected a ClientData(train, test) (pfljax.core.types), "
            f"got {type(data).__name__}"
        )
    num = data_clients(data.train, f"{call}(data=...): data.train")
    test = data_clients(data.test, f"{call}(data=...): data.test")
    if test != num:
        raise ValueError(
            f"{call}(data=...): data.train has {num} clients but data.test has {test}; "
            "ClientData holds the same clients, in the same order, in both"
        )
    expected = state_clients(state)
    if expected is not None and expected != num:
        raise ValueError(
            f"{call}(data=...): data has {num} clients but the state was initialized for {expected} "
            f"(init(key, params, num_clients={expected})); pass the same clients to init and {call}"
        )
    return num


def participants(
    state: Any,
    data: ClientData,
    key: jax.Array,
    clients_per_round: int | None,
    weighting: str = "samples",
    eligible: Callable[[Any, int], tuple[jax.Array, int]] | None = None,
    privacy: ClientDP | None = None,
) -> Participants:
    """Samples this round's K clients: keys from (key, state.round), ids among the
    eligible clients (all, or `eligible(state, C) -> (ids [n], n)` with n static).
    Of a view (`data.view`: the participants gathered from host memory by
    `pfljax.runtime.offload`, sampled there from the same keys) every row takes part:
    `ids` are its rows 0..K-1, `client_ids` the clients' ids, `num_clients` C."""
    num = data.train.count.shape[0]
    if data.view is not None:
        sample_key, train_key = round_keys(key, state.round)
        weights = client_weights(weighting, data.train.count)
        view = data.view
        return Participants(
            jnp.arange(num), weights, sample_key, train_key, view.num_clients, privacy, True, view.ids
        )
    ids, n = (jnp.arange(num), num) if eligible is None else eligible(state, num)
    k = check_clients_per_round(clients_per_round, n)
    sample_key, train_key = round_keys(key, state.round)
    idx = sample_clients(sample_key, n, k)
    idx = idx if eligible is None else ids[idx]
    weights = client_weights(weighting, data.train.count[idx])
    return Participants(idx, weights, sample_key, train_key, num, privacy, eligible is None and k == num)


def federated_round(
    step: Callable,
    *,
    clients_per_round: int | None = None,
    weighting: str = "samples",
    bytes_up: float = 0.0,
    bytes_down: float = 0.0,
    eligible: Callable | None = None,
    privacy: ClientDP | None = None,
) -> Callable:
    """Builds `round(state, data, key) -> (state, metrics)` around an algorithm's step.

    Args:
      step: `(state, data, part) -> (state, losses [K] | None, metrics)`; the
        returned state's round counter is incremented here.
      clients_per_round: K sampled per round (None: every eligible client).
      weighting: aggregation weights, "samples" (train sizes) or "uniform".
      bytes_up, bytes_down: bytes one participant sends / receives (static).
      eligible: `(state, C) -> (ids [n], n)`: the clients that may be sampled.
      privacy: client-level DP applied by `Participants.average` (None: off).
    """
    check_weighting(weighting)
    privacy = None if privacy is None else privacy.validate()

    def round_fn(state, data: ClientData, key):
        check_clients(state, data, "round")
        part = participants(state, data, key, clients_per_round, weighting, eligible, privacy)
        new_state, losses, extra = step(state, data, part)
        metrics = {
            "bytes_up": jnp.float32(part.k * bytes_up),
            "bytes_down": jnp.float32(part.k * bytes_down),
            "participants": jnp.int32(part.k),
        }
        if losses is not None:
            metrics["train_loss"] = jnp.sum(aggregate.normalized_weights(part.weights) * losses)
        metrics.update(extra)
        return new_state._replace(round=state.round + 1), metrics

    return round_fn


def map_clients(client_update: Callable, client_map: Callable, state, data: ClientData, part, inputs=None):
    """Runs `client_update(state, cid, inputs_row, data_row, key)` for every participant.

    Returns the stacked outputs [K, ...] of `client_update`.
    """

    def one(args):
        cid, row = args
        return client_update(state, cid, row, take(data.train, cid), part.client_key(cid))

    if not chunked(client_map):
        return client_map(one, (part.ids, inputs))
    # Chunks of clients of similar size: a chunk's local loop runs its largest
    # client's steps, so order by size, then put the outputs back in id order.
    order = jnp.argsort(data.train.count[part.ids], stable=True)
    out = client_map(one, gather((part.ids, inputs), order))
    return gather(out, jnp.argsort(order))


def chunked(client_map: Callable) -> bool:
    """True for a lax.map over vmapped chunks of more than one client."""
    if not isinstance(client_map, ClientMap):
        return False
    return client_map.resolved() == "map" and (client_map.chunk_size or 1) > 1


def client_step(
    client_update: Callable,
    server_update: Callable,
    client_map: Callable,
    client_inputs: Callable | str | None = None,
) -> Callable:
    """The usual step: every participant runs `client_update`, the server `server_update`.

    Args:
      client_update: `(state, cid, inputs, data, key) -> (output, loss)` for ONE client.
      server_update: `(state, outputs [K], part) -> (state, metrics)`.
      client_map: how the per-client function is mapped (ClientMap or a callable).
      client_inputs: `(state, part) -> [K, ...]` what each participant receives of
        its own, or the name of a `client_*` state field (its participants' rows),
        or None (nothing).
    """
    if isinstance(client_inputs, str):
        field = client_inputs
        client_inputs = lambda state, part: part.gather(getattr(state, field))  # noqa: E731

    def step(state, data: ClientData, part: Participants):
        inputs = None if client_inputs is None else client_inputs(state, part)
        outputs, losses = map_clients(client_update, client_map, state, data, part, inputs)
        new_state, metrics = server_update(state, outputs, part)
        return new_state, losses, metrics

    return step
