"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

FedAvg whose local objective adds mu / 2 * ||w - w_global||^2.
"""

from __future__ import annotations

import optax

from pfljax.algorithms import fedavg
from pfljax.core.clients import ClientMap
from pfljax.core.domains import SERVER_LR, Domain, checked
from pfljax.core.local import LocalTraining
from pfljax.core.privacy import ClientDP
from pfljax.core.types import Algorithm
from pfljax.models.base import Model

DOMAINS = {"mu": Domain(0, low_open=True), "server_lr": SERVER_LR}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    mu: float = 0.01,
    server_lr: float = 1.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
) -> Algorithm:
    """FedProx with proximal weight `mu` (> 0); other arguments as fedavg.build."""
    return fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        prox_mu=mu,
        server_lr=server_lr,
        weighting=weighting,
        privacy=privacy,
        server_optimizer=server_optimizer,
    )
