"""The default experiment (the `make demo` run) and the schema every config shares.

Variants import this module, call `get_config()` and override a few fields.
Each algorithm's own options live under `config.<algorithm>.<option>`; they are
read from the keyword-only arguments of `pfljax.algorithms.<name>.build`
(their defaults become the config defaults), so a new algorithm needs no edit
here. Conventions: 0 means "none/all" for the integer caps below.
"""

from __future__ import annotations

import inspect
import os

import ml_collections

from pfljax import algorithms

IDX_DIR = "/usr/share/datasets/fashion-mnist"
# Arguments every build takes, set from the common fields instead.
COMMON_BUILD_ARGS = ("model", "local", "clients_per_round", "client_map")
SIMPLE_TYPES = (bool, int, float, str)


def algorithm_options(name: str) -> ml_collections.ConfigDict:
    """The keyword-only, simply typed arguments of `<name>.build` with their defaults."""
    params = inspect.signature(algorithms.get(name).build).parameters
    options = {}
    for arg in params.values():
        if arg.name in COMMON_BUILD_ARGS or arg.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        default = arg.default
        if isinstance(default, SIMPLE_TYPES) or (
            isinstance(default, tuple) and all(isinstance(v, SIMPLE_TYPES) for v in default)
        ):
            options[arg.name] = default
    return ml_collections.ConfigDict(options)


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    fmnist = os.path.exists(os.path.join(IDX_DIR, "train-images-idx3-ubyte.gz"))
    # What to run.
    config.algorithm = "fedavg"
    config.seed = 0
    # Data (pfljax.data.build_federated_data).
    config.dataset = "fashion_mnist" if fmnist else "simulation"
    config.data_dir = ""
    config.partition = "classes" if fmnist else "iid"
    config.dirichlet_alpha = 0.5
    config.classes_per_client = 4
    config.num_dominant = 2
    config.dominant_fraction = 0.8
    config.num_groups = 2
    config.group_relabel = True
    config.permute_labels = "none"
    config.samples_per_client = 1000 if fmnist else 0  # 0: no cap
    config.test_fraction = 0.2
    config.source = ml_collections.ConfigDict()  # extra source options (e.g. simulation p, alpha)
    # Federation.
    config.num_clients = 10
    config.clients_per_round = 0  # 0: all clients
    config.rounds = 20
    # Local training (pfljax.core.LocalTraining).
    config.local_steps = 0  # 0: use local_epochs
    config.local_epochs = 1
    config.batch_size = 32
    config.optimizer = "sgd"
    config.learning_rate = 0.05
    config.momentum = 0.9
    config.weight_decay = 0.0
    # Model (pfljax.models.build_model); model_kwargs go to the flax module.
    config.model = "mlp"
    config.model_kwargs = ml_collections.ConfigDict({"hidden": (200,)})
    # Execution and outputs.
    config.client_map = "auto"
    config.chunk_size = 0  # 0: lax.map without chunks
    config.eval_every = 1
    config.checkpoint_every = 5
    # Each algorithm's own options.
    for name in algorithms.available():
        config[name] = algorithm_options(name)
    return config
