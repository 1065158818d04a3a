"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

FedAvg whose local objective adds mu / 2 * ||w - w_global||^2.
"""

from __future__ import annotations

from pfljax.algorithms import fedavg
from pfljax.core.local import LocalTraining
from pfljax.core.types import Algorithm
from pfljax.models.base import Model


def build(model: Model, local: LocalTraining, *, mu: float = 0.01, **fedavg_kwargs) -> Algorithm:
    """FedProx with proximal weight `mu` (> 0); other kwargs as fedavg.build."""
    if mu <= 0:
        raise ValueError(f"fedprox mu must be > 0, got {mu}")
    return fedavg.build(model, local, prox_mu=mu, **fedavg_kwargs)
