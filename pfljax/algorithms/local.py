"""Local training: every client trains its own model, nothing is communicated."""

from typing import Any, NamedTuple

import jax.numpy as jnp

from pfljax.core.clients import as_client_map, broadcast, take
from pfljax.core.domains import checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import make_local_train
from pfljax.core.round import client_step, federated_round
from pfljax.core.types import Algorithm


class LocalState(NamedTuple):
    client_params: Any  # each client's own variables, leaves [C, ...]
    round: Any  # int32 round counter


def client_update(train, state, cid, own, data, key):  # ONE client: its own model, trained
    res = train(own, data, key)
    return res.params, res.loss


def server_update(state, trained, part):  # nothing averaged: the new models are stored
    return state._replace(client_params=part.scatter(state.client_params, trained)), {}


@checked({})  # no numeric options; checks the model and local arguments and the data
def build(model, local, *, clients_per_round: int | None = None, client_map="auto") -> Algorithm:
    """Each participant trains its own model from where it left off; zero bytes."""
    cmap, train = as_client_map(client_map), make_local_train(model.apply, local)

    def init(key, params_template=None, num_clients=1):  # every client starts from the same model
        return LocalState(broadcast(model.initial(key, params_template), num_clients), jnp.int32(0))

    evaluate = lambda state, data, key: evaluate_clients(  # each client's own model, own test rows
        model.apply, lambda c: take(state.client_params, c), data.test, cmap, local.loss
    )
    step = client_step(lambda *args: client_update(train, *args), server_update, cmap, "client_params")
    return Algorithm(init, federated_round(step, clients_per_round=clients_per_round), evaluate)
