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

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import SERVER_LR, Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.layers import first_layers, last_layers
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model


class FedAvgState(NamedTuple):
    global_params: Any
    client_params: dict  # {path: [C, ...]} local leaves only
    round: jax.Array
    server_state: Any = ()  # the server optimizer's state over the shared leaves (() without one)


class FedAvgHyper(NamedTuple):
    """What the pieces of a FedAvg round need: the local trainer, the leaves kept
    local (a bool tree), the server learning rate and the server optimizer (None: server_lr)."""

    train: Callable
    is_local: Any
    server_lr: float
    server_optimizer: optax.GradientTransformation | None = None


def personalized(state: FedAvgState, c: jax.Array) -> Any:
    """Client c's model: the global leaves with its own local leaves."""
    return P.merge(state.global_params, take(state.client_params, c))


def own_local_leaves(state: FedAvgState, part: Participants) -> dict:
    """What a participant brings to the round: its own local leaves."""
    return part.gather(state.client_params)


def client_update(hp: FedAvgHyper, state: FedAvgState, cid, own: dict, data, key):
    """ONE client: the global model with its local leaves, trained locally."""
    res = hp.train(P.merge(state.global_params, own), data, key)
    return P.split(res.params, hp.is_local), res.loss


def server_update(hp: FedAvgHyper, state: FedAvgState, outputs, part: Participants):
    """The weighted mean of the shared leaves, a server step towards it; local leaves stored."""
    shared_new, local_new = outputs
    shared_old, _ = P.split(state.global_params, hp.is_local)
    target, metrics = part.average(shared_new, shared_old)
    shared, server_state = aggregate.server_update(
        hp.server_optimizer, hp.server_lr, state.server_state, shared_old, target
    )
    return state._replace(
        global_params=P.merge(state.global_params, shared),
        client_params=part.scatter(state.client_params, local_new),
        server_state=server_state,
    ), metrics


def init(
    model: Model,
    is_local,
    key,
    params_template=None,
    num_clients: int = 1,
    *,
    server_optimizer=None,
    not_averaged=None,
) -> FedAvgState:
    """The global model, each client's local leaves (`is_local`), and the server optimizer's
    state over the averaged leaves (all but `not_averaged`, default `is_local`)."""
    params = model.initial(key, params_template)
    local_part = P.split(params, is_local)[1]
    averaged = P.split(params, is_local if not_averaged is None else not_averaged)[0]
    return FedAvgState(
        params,
        broadcast(local_part, num_clients),
        jnp.zeros([], jnp.int32),
        aggregate.init_server_state(server_optimizer, averaged),
    )


def evaluate(model: Model, client_map, loss, state: FedAvgState, data: ClientData, key):
    """Each client's personalized model (global + its local leaves) on its test rows."""
    return evaluate_clients(model.apply, lambda c: personalized(state, c), data.test, client_map, loss)


DOMAINS = {"server_lr": SERVER_LR, "prox_mu": Domain(0, note="0: FedAvg")}


@checked(DOMAINS)
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
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
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
      privacy: client-level DP of the shared leaves' average (pfljax.core.privacy).
      server_optimizer: any optax transformation, stepped on the pseudo-gradient
        global - mean of the shared leaves (FedAvgM, FedAdam, FedYogi:
        `pfljax.core.aggregate.server_update`); None: the server_lr step.
    """
    check_weighting(weighting)
    aggregate.check_server_optimizer(server_optimizer, server_lr)
    cmap = as_client_map(client_map)
    template = model.template()
    is_local = P.match_paths(template, local_leaves)
    shared_bytes = P.tree_bytes(P.split(template, is_local)[0])
    train = make_local_train(model.apply, local, prox_mu=prox_mu)
    hp = FedAvgHyper(train, is_local, server_lr, server_optimizer)
    step = client_step(
        functools.partial(client_update, hp), functools.partial(server_update, hp), cmap, own_local_leaves
    )
    return Algorithm(
        functools.partial(init, model, is_local, server_optimizer=server_optimizer),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            bytes_up=shared_bytes,
            bytes_down=shared_bytes,
            privacy=privacy,
        ),
        functools.partial(evaluate, model, cmap, local.loss),
    )


LOCAL_LAYERS = Domain(1, integer=True, note="fewer than the model's layers")


def layers_local_builder(name: str, which: str, renamed: dict | None = None) -> Callable[..., Algorithm]:
    """The `build` of a method that is FedAvg with the `which` ("first" or "last")
    `local_layers` layers of the model local: LG-FedAvg and FedPer. `renamed`
    maps old option names to new ones (refused with a message naming the new one)."""
    select = {"first": first_layers, "last": last_layers}[which]

    @checked({"local_layers": LOCAL_LAYERS, "server_lr": SERVER_LR})
    def build_layers_local(
        model: Model,
        local: LocalTraining,
        *,
        clients_per_round: int | None = None,
        client_map: ClientMap | str | None = "auto",
        local_layers: int = 1,
        server_lr: float = 1.0,
        weighting: str = "samples",
        privacy: ClientDP | None = None,
        server_optimizer: optax.GradientTransformation | None = None,
        **unknown,
    ) -> Algorithm:
        for old in unknown:
            new = (renamed or {}).get(old)
            hint = f"; it is now {new!r}" if new else ""
            raise TypeError(f"{name}.build got an unexpected option {old!r}{hint}")
        return build(
            model,
            local,
            clients_per_round=clients_per_round,
            client_map=client_map,
            server_lr=server_lr,
            weighting=weighting,
            local_leaves=select(model, local_layers, argument="local_layers"),
            privacy=privacy,
            server_optimizer=server_optimizer,
        )

    build_layers_local.__doc__ = (
        f"{name}: FedAvg with the {which} `local_layers` layers local (>= 1, fewer than all); "
        "other arguments as fedavg.build."
    )
    return build_layers_local
