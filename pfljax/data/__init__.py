"""Federated data: sources, partitioners, and every client's rows as a ClientPool.

Entry points: `build_federated_data` (source -> FederatedData, whose train and
test data are `ClientPool`s: every client's rows once, unpadded, at the
source's dtype, images uint8; see pfljax.core.types) and `load_source` (one
source by name). Modules: `idx` (Fashion-MNIST IDX files), `simulation`
(FedFac model (8)), `sine` (FedeRiCo's sine regression toy, the "sine"
source), `tfds_source` (TFDS, imported lazily), `leaf` (LEAF's JSON files:
FEMNIST, Shakespeare), `tff_h5` (TFF's HDF5 files: EMNIST, Shakespeare; h5py
imported lazily), `natural` (what those two share: users as clients, their own
test split), `shakespeare` (LEAF's and TFF's character preprocessing), `sources` (registry),
`partition` (partitioners, caps, splits, label maps), `federated` (assembly:
partition, cap, per-client train/test split, summary; `pool_clients` and
`pad_clients` build ClientPools and padded ClientArrays from per-client
arrays). Importing this package does not import TensorFlow.
"""

from pfljax.data import leaf, sine, tff_h5  # noqa: F401  (register "leaf_*", "sine", "tff_*")
from pfljax.data.federated import (
    PARTITIONS,
    DataSpec,
    FederatedData,
    build_federated_data,
    pad_clients,
    pool_clients,
)
from pfljax.data.sources import PerClient, Pooled, load_source, register_source

__all__ = [
    "FederatedData",
    "PARTITIONS",
    "PerClient",
    "Pooled",
    "DataSpec",
    "build_federated_data",
    "load_source",
    "pad_clients",
    "pool_clients",
    "register_source",
]
