"""pfljax: personalized federated learning in JAX, clients stacked on a leading axis.

Public builders and pure functions, re-exported (importing pfljax stays light:
no TensorFlow, orbax or matplotlib; `pfljax.experiment` loads them when used):

    import pfljax
    fd = pfljax.build_federated_data("simulation", 20)
    model = pfljax.build_model("mlp", fd.input_shape, fd.num_classes)
    alg = pfljax.fedavg.build(model, pfljax.LocalTraining(optax.sgd(0.05)))

Each algorithm module is re-exported by name (`pfljax.<name>.build`): one line
`<name> as <name>,` in the block below; pure functions of an algorithm that
other code may use get one `from pfljax.algorithms.<name> import f as f` line.
"""

from pfljax import algorithms as algorithms
from pfljax import core as core
from pfljax import data as data
from pfljax import models as models
from pfljax import sharding as sharding
from pfljax.algorithms import cfl as cfl
from pfljax.algorithms import factorized_fl as factorized_fl
from pfljax.algorithms import fedavg as fedavg
from pfljax.algorithms import fedavg_ft as fedavg_ft
from pfljax.algorithms import fedbn as fedbn
from pfljax.algorithms import fedem as fedem
from pfljax.algorithms import federico as federico
from pfljax.algorithms import fedfac as fedfac
from pfljax.algorithms import fedfomo as fedfomo
from pfljax.algorithms import fedper as fedper
from pfljax.algorithms import fedprox as fedprox
from pfljax.algorithms import fedrep as fedrep
from pfljax.algorithms import lg_fedavg as lg_fedavg
from pfljax.algorithms import local as local
from pfljax.algorithms import per_fedavg as per_fedavg
from pfljax.algorithms import pfedhn as pfedhn
from pfljax.algorithms import pfedla as pfedla
from pfljax.algorithms import pfedme as pfedme
from pfljax.algorithms import pfedpara as pfedpara
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
from pfljax.data import FederatedData as FederatedData
from pfljax.data import build_federated_data as build_federated_data
from pfljax.data import register_source as register_source
from pfljax.models import Model as Model
from pfljax.models import build_model as build_model
from pfljax.sharding import ShardedMap as ShardedMap
from pfljax.sharding import client_mesh as client_mesh
from pfljax.sharding import shard_algorithm as shard_algorithm

get_algorithm = algorithms.get

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
