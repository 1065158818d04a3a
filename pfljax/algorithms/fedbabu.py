"""FedBABU (J. Oh et al., "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022).

FedAvg on the body only: the head (the last `head_layers` layers) stays at its
random initialisation during federated training: clients train the body with
the head frozen (its updates masked, as FedRep freezes), send the body, and the
server averages it; the head is never sent nor changed. Evaluation first
fine-tunes the whole model (body and head) on the client's own train rows for
`finetune_epochs` epochs with `local.optimizer` and batch size (client c's
batches from fold_in(evaluation key, c)), as FedAvg+ does, then tests it.

Paper vs code: the server mean is weighted by train size as in the paper's
FedAvg (the authors' code averages uniformly: `weighting="uniform"`); the code
freezes the head by a zero learning rate with weight decay 0, which moves
nothing either. Default 5 fine-tuning epochs (the code's `--ft_ep`).
"""

from __future__ import annotations

import functools

import jax
import optax

from pfljax.algorithms import fedavg, fedavg_ft
from pfljax.algorithms.fedrep import frozen
from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map
from pfljax.core.domains import SERVER_LR, checked
from pfljax.core.layers import last_layers
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.privacy import ClientDP
from pfljax.core.round import check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm
from pfljax.models.base import Model


def client_update(hp: fedavg.FedAvgHyper, state: fedavg.FedAvgState, cid, own, data, key):
    """ONE client: the global model trained with the head frozen; only the body goes back.

    `hp.is_local` marks the head: the leaves nobody sends. Returns ((body, {}), loss).
    """
    res = hp.train(state.global_params, data, key)
    body, _ = P.split(res.params, hp.is_local)
    return (body, {}), res.loss


DOMAINS = {
    "head_layers": fedavg.LOCAL_LAYERS,
    "finetune_epochs": fedavg_ft.DOMAINS["finetune_epochs"],
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
    finetune_epochs: int = 5,
    server_lr: float = 1.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
) -> Algorithm:
    """FedBABU: the body federated with the head frozen at its initialisation; fine-tuned to evaluate.

    Args:
      head_layers: number of last layers forming the frozen head.
      finetune_epochs: epochs of whole-model fine-tuning before each evaluation (>= 1).
      Others: as fedavg.build.
    """
    check_weighting(weighting)
    local = local.validate()
    cmap = as_client_map(client_map)
    template = model.template()
    is_head = P.match_paths(template, last_layers(model, head_layers, argument="head_layers"))
    body_params = jax.tree.map(lambda h: not h, is_head["params"])
    train_body = make_local_train(model.apply, local._replace(optimizer=frozen(local.optimizer, body_params)))
    aggregate.check_server_optimizer(server_optimizer, server_lr)
    hp = fedavg.FedAvgHyper(train_body, is_head, server_lr, server_optimizer)
    body_bytes = P.tree_bytes(P.split(template, is_head)[0])
    # FedAvg's state with no local leaves (client_params = {}); its server step
    # averages the bodies and leaves the head in place.
    server_update = functools.partial(fedavg.server_update, hp)
    step = client_step(functools.partial(client_update, hp), server_update, cmap)
    tune = make_local_train(model.apply, fedavg_ft.finetune_spec(local, finetune_epochs, 0, 0, 0.0))
    return Algorithm(
        functools.partial(
            fedavg.init,
            model,
            jax.tree.map(lambda _: False, template),
            server_optimizer=server_optimizer,
            not_averaged=is_head,
        ),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=body_bytes,
            bytes_down=body_bytes,
        ),
        functools.partial(fedavg_ft.evaluate, model, cmap, local.loss, tune),
    )
