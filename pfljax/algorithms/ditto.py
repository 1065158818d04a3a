"""Ditto (T. Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021).

The global model w is FedAvg's. Each participant also trains its personal model
v on f(v) + lam / 2 ||v - w||^2, with w the global model it received this round
(the paper's Algorithm 1), and is evaluated on v. `lam` -> 0 is Local training of
v; a large `lam` pulls v onto the global model.

Paper vs code: the paper updates v for s local iterations (`personal_steps`, or
`personal_epochs`; 0: the schedule of `local`); the authors' code takes one
personal and one global SGD step per local iteration on the same minibatch, which
is this module with both schedules equal: both trainings draw their batches from
the client's round key. The code's personal step is plain SGD; here v is trained
with `local.optimizer` (a fresh state each round). The code averages the global
updates uniformly (its clients are sampled by size): `weighting="uniform"`.
Default lam = 1, the value of the authors' Fashion-MNIST and Vehicle scripts (the
paper tunes it per dataset). The prox term acts on the "params" collection only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import SERVER_LR, Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model


class DittoState(NamedTuple):
    global_params: Any  # w (full variables)
    client_personal: Any  # v, full variables [C, ...]
    round: jax.Array
    server_state: Any = ()  # the server optimizer's state over w (() without one)


class DittoHyper(NamedTuple):
    """The global trainer (FedAvg's), the personal trainer (prox lam towards w), the server rate
    and the server optimizer (None: the server rate)."""

    train: Callable
    personal: Callable
    server_lr: float
    server_optimizer: optax.GradientTransformation | None = None


def personal_schedule(local: LocalTraining, epochs: int, steps: int) -> LocalTraining:
    """`local` with `steps` personal steps (> 0) or `epochs` epochs (> 0); else unchanged."""
    if steps:
        return local._replace(steps=steps, epochs=None)
    if epochs:
        return local._replace(steps=None, epochs=epochs)
    return local


def client_update(hp: DittoHyper, state: DittoState, cid, v, data, key):
    """ONE client: w trained from the global model; v trained towards the global model received.

    Returns ((w_k, v_k, personal loss), global loss); both trainings use `key`.
    """
    g = hp.train(state.global_params, data, key)
    p = hp.personal(v, data, key, anchor=state.global_params)
    return (g.params, p.params, p.loss), g.loss


def server_update(hp: DittoHyper, state: DittoState, outputs, part: Participants):
    """FedAvg's server step on the w_k; the participants' v_k stored; their mean personal loss."""
    w_new, v_new, personal_loss = outputs
    average, metrics = part.average(w_new, state.global_params)
    global_params, server_state = aggregate.server_update(
        hp.server_optimizer, hp.server_lr, state.server_state, state.global_params, average
    )
    state = state._replace(
        global_params=global_params,
        client_personal=part.scatter(state.client_personal, v_new),
        server_state=server_state,
    )
    return state, {
        "personal_loss": jnp.sum(aggregate.normalized_weights(part.weights) * personal_loss),
        **metrics,
    }


def init(
    model: Model, key, params_template=None, num_clients: int = 1, *, server_optimizer=None
) -> DittoState:
    """w and every v start from the same model."""
    params = model.initial(key, params_template)
    return DittoState(
        params,
        broadcast(params, num_clients),
        jnp.zeros([], jnp.int32),
        aggregate.init_server_state(server_optimizer, params),
    )


def evaluate(model: Model, client_map, loss, state: DittoState, data: ClientData, key):
    """Each client's personal model v on its test rows."""
    personal = lambda c: take(state.client_personal, c)  # noqa: E731
    return evaluate_clients(model.apply, personal, data.test, client_map, loss)


DOMAINS = {
    "lam": Domain(0, note="0: Local training of v"),
    "personal_epochs": Domain(0, integer=True, note="0: as local"),
    "personal_steps": Domain(0, integer=True, note="0: use personal_epochs"),
    "server_lr": SERVER_LR,
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    lam: float = 1.0,
    personal_epochs: int = 0,
    personal_steps: int = 0,
    server_lr: float = 1.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
) -> Algorithm:
    """Ditto: FedAvg for w, and per participant v trained with lam / 2 ||v - w||^2.

    Args:
      lam: weight lambda of the proximal term (>= 0; 0 is Local training of v).
      personal_epochs: epochs of personal training per round (0: as `local`).
      personal_steps: personal steps per round instead (0: use epochs / `local`).
      Others: as fedavg.build; `local` sets the global training (and the optimizer
        and batch size of both).
    """
    check_weighting(weighting)
    aggregate.check_server_optimizer(server_optimizer, server_lr)
    local = local.validate()
    cmap = as_client_map(client_map)
    hp = DittoHyper(
        make_local_train(model.apply, local),
        make_local_train(model.apply, personal_schedule(local, personal_epochs, personal_steps), prox_mu=lam),
        server_lr,
        server_optimizer,
    )
    model_bytes = P.tree_bytes(model.template())
    step = client_step(
        functools.partial(client_update, hp), functools.partial(server_update, hp), cmap, "client_personal"
    )
    return Algorithm(
        functools.partial(init, model, server_optimizer=server_optimizer),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=model_bytes,
            bytes_down=model_bytes,
        ),
        functools.partial(evaluate, model, cmap, local.loss),
    )
