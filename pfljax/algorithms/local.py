"""Local training: every client trains its own model, nothing is communicated."""

from __future__ import annotations

from pfljax.algorithms import fedavg
from pfljax.core.clients import ClientMap
from pfljax.core.local import LocalTraining
from pfljax.core.types import Algorithm
from pfljax.models.base import Model


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
) -> Algorithm:
    """FedAvg with every leaf personal: zero bytes, independent clients."""
    return fedavg.build(
        model, local, clients_per_round=clients_per_round, client_map=client_map, local_leaves=(".*",)
    )
