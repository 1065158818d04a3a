"""LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated Learning with Local and
Global Representations", arXiv:2001.01523, 2020).

The first `local_layers` layers (the local representation) stay on each client;
the remaining (last) layers form the global model, trained with FedAvg. Only
the global layers are communicated.

Paper vs code: the released code counts the other way, `num_layers_keep` =
number of last layers kept global (MNIST MLP: 3, CIFAR CNN: 2); here
`local_layers` = total layers - num_layers_keep, as the issue states the method.
The released code also starts LG-FedAvg from a FedAvg-trained model
(`--load_fed`); pass that model as `params_template` to `init` to do the same.
"""

from __future__ import annotations

from pfljax.algorithms import fedavg
from pfljax.core.clients import ClientMap
from pfljax.core.layers import first_layers
from pfljax.core.local import LocalTraining
from pfljax.core.types import Algorithm
from pfljax.models.base import Model


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    local_layers: int = 1,
    server_lr: float = 1.0,
    weighting: str = "samples",
) -> Algorithm:
    """LG-FedAvg: the first `local_layers` layers personal, the rest averaged.

    Args:
      local_layers: number of first layers kept local (>= 1, fewer than all).
      Others: as fedavg.build.
    """
    local_leaves = first_layers(model, local_layers, argument="local_layers")
    return fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        server_lr=server_lr,
        weighting=weighting,
        local_leaves=local_leaves,
    )
