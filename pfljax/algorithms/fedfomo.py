"""FedFomo (Zhang et al., "Personalized Federated Learning with First Order Model
Optimization", ICLR 2021).

The server keeps every client's latest uploaded model. One round, for each
sampled client i:

1. it downloads M other clients' models, chosen epsilon-greedily from its row of
   the affinity matrix P (with probability eps_t a random client, else the
   highest-affinity one not yet chosen; eps_t = max(epsilon - round *
   epsilon_decay, 0));
2. on its own held-out validation rows it weighs every candidate n, its own
   locally trained model included, against its baseline model
   theta_i (the model its last local training started from):
       w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||
   keeps max(w_n, 0) and normalizes them to sum to 1 (all zero: keeps theta_i);
3. federated update theta_i + sum_n w_n (theta_n - theta_i), then local
   training on its train rows (validation rows excluded), and upload;
4. the server adds the raw w_n to P[i, n].

Paper vs released code (NVlabs/FedFomo): the paper's L2 distance is the
default, the code's L1 (`--model_delta_norm l1`) is `distance="l1"` (both over
every leaf of the variables, BatchNorm statistics included). As in the code:
the client's own trained model is a candidate, the baseline is the model its
last local training started from ("first_model"), epsilon starts at 0.3 and
decays by 0.05 per round (the paper gives no values). The validation split is
`val_fraction` of each client's train rows (at least one row when it has two
or more), fixed per client (seeded by the client index only) and carved inside
jit. Candidates are drawn from all other clients, including ones that never
trained (their initial models are weighed like any other).

State: `client_params` [C, ...] uploaded models (evaluated: each client's own),
`client_base` [C, ...] baselines, `client_affinity` [C, C] P,
`client_mixing` [C, C] summed normalized mixing rows (own weight on the
diagonal), `client_rounds` [C] participations; `collaboration_matrix` is their
running average.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, gather, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_client, evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train, shuffled_rows
from pfljax.core.round import Participants, client_step, federated_round
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

DISTANCES = ("l2", "l1")
SPLIT_KEY = 0xF0F0


class FedFomoState(NamedTuple):
    client_params: Any
    client_base: Any
    client_affinity: jax.Array  # [C, C]
    client_mixing: jax.Array  # [C, C]
    client_rounds: jax.Array  # [C] int32
    round: jax.Array


def holdout_split(arrays: ClientArrays, key: jax.Array, fraction: float) -> tuple[ClientArrays, ClientArrays]:
    """Splits one client's rows into (train, validation) inside jit.

    A random permutation (from `key`) of the `count` real rows; the last
    round(fraction * count) of them (at least 1 when count >= 2, none when
    count < 2) are validation. Both halves come back padded to n_max rows,
    their real rows first.
    """
    n_max = arrays.y.shape[0]
    count = arrays.count
    n_val = jnp.where(count >= 2, jnp.clip(jnp.round(fraction * count), 1, count - 1), 0).astype(count.dtype)
    order = shuffled_rows(key, count, n_max)
    n_train = count - n_val
    val_order = jnp.roll(order, -n_train)

    def rows(o, n):
        return ClientArrays(arrays.x[o], arrays.y[o], n)

    return rows(order, n_train), rows(val_order, n_val)


def tree_distance(a, b, kind: str = "l2") -> jax.Array:
    """||a - b|| over all leaves: L2 or L1."""
    if kind == "l1":
        return sum(jnp.sum(jnp.abs(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return jnp.sqrt(sum(jnp.sum((x - y) ** 2) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def fomo_weights(
    base_loss: jax.Array, losses: jax.Array, distances: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """FedFomo weights of N candidates.

    Args:
      base_loss: [] validation loss of the baseline model.
      losses: [N] validation losses of the candidates.
      distances: [N] parameter distances candidate - baseline.

    Returns:
      raw: [N] (base_loss - losses) / distances (0 where the distance is 0).
      mix: [N] max(raw, 0) normalized to sum 1 (all zero if none is positive).
    """
    raw = jnp.where(distances > 0, (base_loss - losses) / jnp.where(distances > 0, distances, 1.0), 0.0)
    return raw, aggregate.normalized_weights(jnp.maximum(raw, 0.0))


def select_candidates(key, affinity_row, self_id, num_models: int, epsilon) -> jax.Array:
    """M distinct client ids != self_id, epsilon-greedy over an affinity row [C].

    Slot by slot: with probability epsilon the next one of a random order,
    else the highest-affinity client not yet chosen (ties broken at random).
    """
    num = affinity_row.shape[0]
    k_order, k_tie, k_explore = jax.random.split(key, 3)
    random_rank = jax.random.uniform(k_order, (num,))
    ascending = jnp.lexsort((jax.random.uniform(k_tie, (num,)), affinity_row))
    greedy_rank = jnp.zeros((num,), jnp.float32).at[ascending].set(jnp.arange(num, dtype=jnp.float32))
    explore = jax.random.uniform(k_explore, (num_models,)) < epsilon

    def pick(taken, explore_s):
        score = jnp.where(explore_s, random_rank, greedy_rank)
        score = jnp.where(taken, -jnp.inf, score)
        choice = jnp.argmax(score)
        return taken.at[choice].set(True), choice

    taken0 = jnp.zeros((num,), bool).at[self_id].set(True)
    _, chosen = jax.lax.scan(pick, taken0, explore)
    return chosen


class FedFomoHyper(NamedTuple):
    """What the pieces of a FedFomo round need (see `build` for the options)."""

    model: Model
    loss: Any
    train: Callable
    num_models: int
    epsilon: float
    epsilon_decay: float
    val_fraction: float
    distance: str
    model_bytes: int


def init(model: Model, key, params_template=None, num_clients: int = 1) -> FedFomoState:
    params = model.initial(key, params_template)
    stacked = broadcast(params, num_clients)
    zeros = jnp.zeros((num_clients, num_clients), jnp.float32)
    return FedFomoState(
        stacked, stacked, zeros, zeros, jnp.zeros((num_clients,), jnp.int32), jnp.zeros([], jnp.int32)
    )


def exploration(hp: FedFomoHyper, round_: jax.Array) -> jax.Array:
    """eps_t = max(epsilon - round * epsilon_decay, 0)."""
    return jnp.maximum(hp.epsilon - hp.epsilon_decay * round_.astype(jnp.float32), 0.0)


def downloads(hp: FedFomoHyper, num_clients: int) -> int:
    """M: other clients' models each participant downloads, min(num_models, C - 1)."""
    return min(hp.num_models, num_clients - 1)


def client_update(hp: FedFomoHyper, state: FedFomoState, cid, _, data: ClientArrays, key):
    """ONE client: weighs its candidates on its validation rows, starts from the
    weighted update of its baseline, trains on the rest of its rows."""
    num = state.client_affinity.shape[0]
    select_key, local_key = jax.random.split(key)
    split_key = jax.random.fold_in(jax.random.key(SPLIT_KEY), cid)
    train_rows, val_rows = holdout_split(data, split_key, hp.val_fraction)
    eps = exploration(hp, state.round)
    others = select_candidates(select_key, state.client_affinity[cid], cid, downloads(hp, num), eps)
    cand_ids = jnp.concatenate([cid[None], others])
    cands = gather(state.client_params, cand_ids)
    base = take(state.client_base, cid)

    def val_loss(variables):
        return evaluate_client(hp.model.apply, variables, val_rows, hp.loss)["loss"]

    losses = jax.lax.map(val_loss, cands)
    dists = jax.lax.map(lambda v: tree_distance(v, base, hp.distance), cands)
    raw, w = fomo_weights(val_loss(base), losses, dists)
    start = jax.tree.map(lambda b, c: b + jnp.tensordot(w, c - b[None], axes=1), base, cands)
    res = hp.train(start, train_rows, local_key)
    affinity_add = jnp.zeros((num,), jnp.float32).at[others].add(raw[1:])
    mixing_row = jnp.zeros((num,), jnp.float32).at[cand_ids].add(w).at[cid].add(1.0 - jnp.sum(w))
    return (res.params, start, affinity_add, mixing_row), res.loss


def server_update(hp: FedFomoHyper, state: FedFomoState, outputs, part: Participants):
    """Stores the uploads and baselines, adds the raw weights to P and the mixing rows."""
    trained, starts, affinity_add, mixing_rows = outputs
    new_state = state._replace(
        client_params=part.scatter(state.client_params, trained),
        client_base=part.scatter(state.client_base, starts),
        client_affinity=state.client_affinity.at[part.ids].add(affinity_add),
        client_mixing=state.client_mixing.at[part.ids].add(mixing_rows),
        client_rounds=state.client_rounds.at[part.ids].add(1),
    )
    return new_state, {
        # Each participant downloads M models: the figure depends on C.
        "bytes_down": jnp.float32(part.k * downloads(hp, part.num_clients) * hp.model_bytes),
        "epsilon": exploration(hp, state.round),
        "self_weight": jnp.mean(mixing_rows[jnp.arange(part.k), part.ids]),
    }


def evaluate(model: Model, client_map, loss, state: FedFomoState, data: ClientData, key):
    """Each client's own uploaded model on its test rows."""
    return evaluate_clients(model.apply, lambda c: take(state.client_params, c), data.test, client_map, loss)


def collaboration_matrix(state: FedFomoState) -> jax.Array:
    """[C, C] mean mixing weights client i gave client j's model over the rounds
    it took part in (own model and baseline on the diagonal; identity before
    any participation). Rows sum to 1."""
    rounds = state.client_rounds.astype(jnp.float32)[:, None]
    eye = jnp.eye(state.client_mixing.shape[0], dtype=jnp.float32)
    return jnp.where(rounds > 0, state.client_mixing / jnp.maximum(rounds, 1.0), eye)


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "each client keeps O(C) state ([C, C] affinities) and downloads "
    "other clients' models, rows of clients that do not take part"
)

DOMAINS = {
    "num_models": Domain(1, integer=True),
    "epsilon": Domain(0, 1),
    "epsilon_decay": Domain(0),
    "val_fraction": Domain(0, 1, low_open=True, high_open=True),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    num_models: int = 5,
    epsilon: float = 0.3,
    epsilon_decay: float = 0.05,
    val_fraction: float = 0.2,
    distance: str = "l2",
) -> Algorithm:
    """FedFomo.

    Args:
      model: the client model.
      local: local training hyperparameters.
      clients_per_round: K clients sampled per round (None: all).
      client_map: client-axis mapping strategy.
      num_models: M other clients' models each participant downloads (at most
        C - 1 are: min(M, C - 1)).
      epsilon: initial exploration probability of the epsilon-greedy download.
      epsilon_decay: subtracted from epsilon every round (floored at 0).
      val_fraction: share of each client's train rows held out for the weights.
      distance: "l2" (paper) or "l1" (released code) parameter distance.
    """
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
    cmap = as_client_map(client_map)
    train = make_local_train(model.apply, local)
    model_bytes = P.tree_bytes(model.template())
    hp = FedFomoHyper(
        model, local.loss, train, num_models, epsilon, epsilon_decay, val_fraction, distance, model_bytes
    )
    step = client_step(functools.partial(client_update, hp), functools.partial(server_update, hp), cmap)
    return Algorithm(
        functools.partial(init, model),
        federated_round(step, clients_per_round=clients_per_round, bytes_up=model_bytes),
        functools.partial(evaluate, model, cmap, local.loss),
        collaboration_matrix,
    )
