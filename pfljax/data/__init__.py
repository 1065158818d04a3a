"""Federated data: sources, partitioners and padded client arrays.

Entry points: `build_federated_data` (source -> FederatedData) and
`load_source` (one source by name). Modules: `idx` (Fashion-MNIST IDX files),
`simulation` (FedFac model (8)), `tfds_source` (TFDS, imported lazily),
`sources` (registry), `partition` (partitioners), `federated` (padding and
assembly). Importing this package does not import TensorFlow.
"""

from pfljax.data import sine  # noqa: F401  (registers the "sine" source)
from pfljax.data.federated import PARTITIONS, FederatedData, build_federated_data, pad_clients, pool_clients
from pfljax.data.sources import PerClient, Pooled, load_source, register_source

__all__ = [
    "FederatedData",
    "PARTITIONS",
    "PerClient",
    "Pooled",
    "build_federated_data",
    "load_source",
    "pad_clients",
    "pool_clients",
    "register_source",
]
