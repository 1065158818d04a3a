"""FedAvg (McMahan et al., 2017), with the options its personalized variants need.

Each round K of C clients start from the global model, train locally
(`pfljax.core.local`), and the server moves the global model towards the
data-size-weighted mean of their models with a server learning rate.

Options reused by other modules:
- `prox_mu` > 0 is FedProx (Li et al., 2020);
- `local_leaves` (regexes over leaf paths such as "params/head/") keeps those
  leaves personal: never averaged, never sent (FedPer, LG-FedAvg, FedBN; all
  leaves local is Local training).

State: `global_params` is the full variables tree (its local leaves stay at
their initial values and are unused); `client_params` is a flat dict
{path: [C, ...]} holding only the local leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import (
    ClientMap,
    as_client_map,
    broadcast,
    client_key,
    gather,
    round_keys,
    scatter,
    take,
)
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.sampling import check_clients_per_round, sample_clients
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

WEIGHTINGS = ("samples", "uniform")


class FedAvgState(NamedTuple):
    global_params: Any
    client_params: dict  # {path: [C, ...]} local leaves only
    round: jax.Array


def personalized(state: FedAvgState, c: jax.Array) -> Any:
    """Client c's model: the global leaves with its own local leaves."""
    return P.merge(state.global_params, take(state.client_params, c))


def client_weights(weighting: str, counts: jax.Array) -> jax.Array:
    """Aggregation weights [K]: sample counts or ones."""
    return counts.astype(jnp.float32) if weighting == "samples" else jnp.ones_like(counts, jnp.float32)


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    server_lr: float = 1.0,
    prox_mu: float = 0.0,
    local_leaves: Sequence[str] = (),
    weighting: str = "samples",
    client_map: ClientMap | str | None = "auto",
) -> Algorithm:
    """FedAvg / FedProx / partial averaging.

    Args:
      model: the client model.
      local: local training hyperparameters.
      clients_per_round: K clients sampled per round (None: all).
      server_lr: step on the mean client update (1.0: plain averaging).
      prox_mu: FedProx proximal weight (0: FedAvg).
      local_leaves: regexes of leaf paths kept personal.
      weighting: "samples" (by train size) or "uniform".
      client_map: client-axis mapping strategy (see pfljax.core.clients).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if prox_mu < 0:
        raise ValueError(f"prox_mu must be >= 0, got {prox_mu}")
    cmap = as_client_map(client_map)
    train = make_local_train(model.apply, local, prox_mu=prox_mu)
    template = jax.eval_shape(model.init, jax.random.key(0))
    is_local = P.match_paths(template, local_leaves)
    shared_bytes = P.tree_bytes(P.split(template, is_local)[0])

    def init(key, params_template=None, num_clients: int = 1) -> FedAvgState:
        params = model.init(key) if params_template is None else params_template
        _, local_part = P.split(params, is_local)
        return FedAvgState(params, broadcast(local_part, num_clients), jnp.zeros([], jnp.int32))

    def round_fn(state: FedAvgState, data: ClientData, key):
        num = data.train.count.shape[0]
        k = check_clients_per_round(clients_per_round, num)
        sample_key, train_key = round_keys(key, state.round)
        idx = sample_clients(sample_key, num, k)

        def client_update(args):
            cid, local_c = args
            start = P.merge(state.global_params, local_c)
            res = train(start, take(data.train, cid), client_key(train_key, cid))
            shared_new, local_new = P.split(res.params, is_local)
            return shared_new, local_new, res.loss

        shared_new, local_new, losses = cmap(client_update, (idx, gather(state.client_params, idx)))
        weights = client_weights(weighting, data.train.count[idx])
        shared_old, _ = P.split(state.global_params, is_local)
        target = aggregate.weighted_mean(shared_new, weights)
        shared = aggregate.server_step(shared_old, target, server_lr)
        new_state = FedAvgState(
            P.merge(state.global_params, shared),
            scatter(state.client_params, idx, local_new),
            state.round + 1,
        )
        metrics = {
            "train_loss": jnp.sum(aggregate.normalized_weights(weights) * losses),
            "bytes_up": jnp.float32(k * shared_bytes),
            "bytes_down": jnp.float32(k * shared_bytes),
            "participants": jnp.int32(k),
        }
        return new_state, metrics

    def evaluate(state: FedAvgState, data: ClientData):
        return evaluate_clients(model.apply, lambda c: personalized(state, c), data.test, cmap, local.loss)

    return Algorithm(init, round_fn, evaluate)
