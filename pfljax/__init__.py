"""pfljax: personalized federated learning in JAX, clients stacked on a leading axis.

Public builders and pure functions, re-exported (importing pfljax stays light:
no TensorFlow, orbax or matplotlib; `pfljax.experiment` loads them when used):

    import optax
    import pfljax

    fd = pfljax.build_federated_data("simulation", 20)
    model = pfljax.build_model("mlp", fd.input_shape, fd.num_classes)
    alg = pfljax.fedavg.build(model, pfljax.LocalTraining(optax.sgd(0.05)))

Every algorithm module is re-exported by name (`pfljax.<name>.build`), read from
`pfljax.algorithms.available()`: a new module needs no edit here.
"""

from pfljax import algorithms as algorithms
from pfljax import core as core
from pfljax import data as data
from pfljax import maths as maths
from pfljax import models as models
from pfljax.core import aggregate as aggregate
from pfljax.core import params as params
from pfljax.core.clients import ClientMap as ClientMap
from pfljax.core.clients import broadcast as broadcast
from pfljax.core.clients import client_key as client_key
from pfljax.core.clients import gather as gather
from pfljax.core.clients import round_keys as round_keys
from pfljax.core.clients import scatter as scatter
from pfljax.core.clients import stack as stack
from pfljax.core.clients import take as take
from pfljax.core.evaluate import evaluate_client as evaluate_client
from pfljax.core.evaluate import evaluate_clients as evaluate_clients
from pfljax.core.evaluate import summarize as summarize
from pfljax.core.factor import factor_split as factor_split
from pfljax.core.hypernet import vjp_generate as vjp_generate
from pfljax.core.local import LocalTraining as LocalTraining
from pfljax.core.local import make_local_train as make_local_train
from pfljax.core.types import Algorithm as Algorithm
from pfljax.core.types import ClientArrays as ClientArrays
from pfljax.core.types import ClientData as ClientData
from pfljax.core.types import ClientPool as ClientPool
from pfljax.data import FederatedData as FederatedData
from pfljax.data import build_federated_data as build_federated_data
from pfljax.data import register_source as register_source
from pfljax.models import Model as Model
from pfljax.models import build_model as build_model
from pfljax.runtime import sharding as sharding
from pfljax.runtime.sharding import ShardedMap as ShardedMap
from pfljax.runtime.sharding import client_mesh as client_mesh
from pfljax.runtime.sharding import shard_algorithm as shard_algorithm

get_algorithm = algorithms.get
for _name in algorithms.available():
    globals()[_name] = algorithms.get(_name)
del _name

__version__ = "0.1.0"


def __getattr__(name):
    """`pfljax.experiment` and `pfljax.train_and_evaluate` load lazily (they import orbax etc.)."""
    if name == "experiment":
        import importlib  # pylint: disable=import-outside-toplevel

        return importlib.import_module("pfljax.experiment")
    if name == "train_and_evaluate":
        from pfljax.experiment import train_and_evaluate  # pylint: disable=import-outside-toplevel

        return train_and_evaluate
    raise AttributeError(f"module 'pfljax' has no attribute {name!r}")
