"""Shared building blocks: client stacking, local training, aggregation, evaluation."""

from pfljax.core import aggregate, clients, evaluate, local, losses, params, sampling
from pfljax.core.clients import ClientMap
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.types import Algorithm, ClientArrays, ClientData, ClientPool

__all__ = [
    "Algorithm",
    "ClientArrays",
    "ClientPool",
    "ClientData",
    "ClientMap",
    "LocalTraining",
    "aggregate",
    "clients",
    "evaluate",
    "local",
    "losses",
    "make_local_train",
    "params",
    "sampling",
]
