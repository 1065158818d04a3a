"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", arXiv:1912.00818, 2019).

The base layers are trained with FedAvg; the last `personal_layers` layers (the
personalization layers, by default the classifier head) stay on the client:
never averaged, never sent. A layer is one top-level module of the model with
its normalization layer (`pfljax.core.layers`); the BatchNorm statistics of a
personal layer stay local with it.

The paper evaluates with 1 to 4 personalization layers (ResNet / MobileNet); 1
is the default here. Each client's personal layers start from the same initial
values and change only when the client trains.
"""

from __future__ import annotations

from pfljax.algorithms import fedavg
from pfljax.core.clients import ClientMap
from pfljax.core.layers import last_layers
from pfljax.core.local import LocalTraining
from pfljax.core.types import Algorithm
from pfljax.models.base import Model


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    personal_layers: int = 1,
    server_lr: float = 1.0,
    weighting: str = "samples",
) -> Algorithm:
    """FedPer: FedAvg on the base, the last `personal_layers` layers personal.

    Args:
      personal_layers: number of last layers kept local (>= 1, fewer than all).
      Others: as fedavg.build.
    """
    local_leaves = last_layers(model, personal_layers, argument="personal_layers")
    return fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        server_lr=server_lr,
        weighting=weighting,
        local_leaves=local_leaves,
    )
