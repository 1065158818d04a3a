"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021).

Each round, a sampled client starts from the global representation (body) and
its own head, then
1. trains the head for `head_epochs` epochs with the body frozen,
2. trains the body with the head frozen, for the local schedule of `local`
   (LocalTraining steps or epochs);
only the body is sent and averaged (weighted by train size); heads stay local.
Freezing masks updates with `optax.multi_transform(..., set_to_zero)`, so the
frozen leaves do not move (nor do momentum or weight decay act on them); each
phase starts a fresh optimizer state.

Defaults follow the paper and its code (`--local_ep 11 --local_rep_ep 1`): 10
head epochs, then 1 body epoch (`local.epochs=1`), head = the last layer
(`head_layers=1`; BatchNorm statistics of head layers stay local with it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.algorithms import fedavg
from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map
from pfljax.core.domains import SERVER_LR, Domain, checked
from pfljax.core.layers import last_layers
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm
from pfljax.models.base import Model


class FedRepHyper(NamedTuple):
    """The head and body trainers, and FedAvg's server pieces with the head local."""

    train_head: Callable
    train_body: Callable
    avg: fedavg.FedAvgHyper  # is_local = the head; its `train` is unused


def frozen(optimizer: optax.GradientTransformation, trainable: dict) -> optax.GradientTransformation:
    """`optimizer` on leaves where `trainable` (a bool tree over "params") is True, zero updates elsewhere."""
    labels = jax.tree.map(lambda t: "train" if t else "freeze", trainable)
    return optax.multi_transform({"train": optimizer, "freeze": optax.set_to_zero()}, labels)


def client_update(hp: FedRepHyper, state: fedavg.FedAvgState, cid, head, data, key):
    """ONE client: head epochs (body frozen), then body training (head frozen).

    Returns ((body, head), head loss) and the body phase's loss.
    """
    h = hp.train_head(P.merge(state.global_params, head), data, jax.random.fold_in(key, 0))
    b = hp.train_body(h.params, data, jax.random.fold_in(key, 1))
    return (P.split(b.params, hp.avg.is_local), h.loss), b.loss


def server_update(hp: FedRepHyper, state: fedavg.FedAvgState, outputs, part: Participants):
    """FedAvg's server step on the bodies, heads stored; the weighted mean head loss."""
    split, head_loss = outputs
    state, metrics = fedavg.server_update(hp.avg, state, split, part)
    metrics["head_loss"] = jnp.sum(aggregate.normalized_weights(part.weights) * head_loss)
    return state, metrics


DOMAINS = {
    "head_layers": fedavg.LOCAL_LAYERS,
    "head_epochs": Domain(1, integer=True),
    "server_lr": SERVER_LR,
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    head_layers: int = 1,
    head_epochs: int = 10,
    server_lr: float = 1.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
) -> Algorithm:
    """FedRep: alternate head epochs (body frozen) and body training (head frozen); body averaged.

    Args:
      head_layers: number of last layers forming the personal head.
      head_epochs: local epochs on the head per round (paper: 10).
      Others: as fedavg.build; `local` sets the optimizer, batch size and the
        body phase's steps/epochs (paper: 1 epoch).
    """
    check_weighting(weighting)
    aggregate.check_server_optimizer(server_optimizer, server_lr)
    local = local.validate()
    cmap = as_client_map(client_map)
    template = model.template()
    is_head = P.match_paths(template, last_layers(model, head_layers, argument="head_layers"))
    head_params = is_head["params"]
    body_params = jax.tree.map(lambda h: not h, head_params)
    hp = FedRepHyper(
        make_local_train(
            model.apply,
            local._replace(optimizer=frozen(local.optimizer, head_params), steps=None, epochs=head_epochs),
        ),
        make_local_train(model.apply, local._replace(optimizer=frozen(local.optimizer, body_params))),
        fedavg.FedAvgHyper(None, is_head, server_lr, server_optimizer),
    )
    body_bytes = P.tree_bytes(P.split(template, is_head)[0])
    step = client_step(
        functools.partial(client_update, hp),
        functools.partial(server_update, hp),
        cmap,
        fedavg.own_local_leaves,
    )
    # FedAvg with the head local has FedRep's state, init and evaluation.
    return Algorithm(
        functools.partial(fedavg.init, model, is_head, server_optimizer=server_optimizer),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=body_bytes,
            bytes_down=body_bytes,
        ),
        functools.partial(fedavg.evaluate, model, cmap, local.loss),
    )
