"""Local training: every client trains its own model, nothing is communicated."""

from __future__ import annotations

from pfljax.algorithms import fedavg
from pfljax.core.local import LocalTraining
from pfljax.core.types import Algorithm
from pfljax.models.base import Model


def build(model: Model, local: LocalTraining, **fedavg_kwargs) -> Algorithm:
    """FedAvg with every leaf personal: zero bytes, independent clients."""
    return fedavg.build(model, local, local_leaves=(".*",), **fedavg_kwargs)
