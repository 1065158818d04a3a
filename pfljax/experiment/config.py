"""Experiment configs: the shared schema, validation, and config -> objects.

`base_config()` is the schema every config shares (`experiments/configs/default.py`
returns it); each algorithm's own options live under `config.<algorithm>.<option>`,
read from the keyword-only arguments of `pfljax.algorithms.<name>.build` (their
defaults become the config defaults). Integer caps use 0 for "none/all".

`prepare(config)` validates a config and builds everything a run needs (data,
model, algorithm, device mesh) before any training; every invalid input raises
`ConfigError`, one line naming the field.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, NamedTuple

import jax
import ml_collections
import optax

from pfljax import algorithms
from pfljax.core.clients import STRATEGIES, ClientMap
from pfljax.core.local import LocalTraining
from pfljax.core.privacy import ClientDP
from pfljax.core.types import Algorithm
from pfljax.data import FederatedData, build_federated_data
from pfljax.models import MODELS, Model, build_model

IDX_DIR = "/usr/share/datasets/fashion-mnist"
# Arguments every build takes, set from the common fields instead.
COMMON_BUILD_ARGS = ("model", "local", "clients_per_round", "client_map", "privacy")
SIMPLE_TYPES = (bool, int, float, str)
OPTIMIZERS = ("sgd", "adam", "adamw")
LOSS_NAMES = ("auto", "cross_entropy", "mse")
# Fields that may change between a run and its resumption (they do not change
# the trained state): more rounds, other output cadence, other devices.
RESUMABLE_FIELDS = (
    "rounds",
    "eval_every",
    "checkpoint_every",
    "client_map",
    "chunk_size",
    "num_devices",
    "replicate_data",
    "data_dir",
)


class ConfigError(ValueError):
    """An invalid config or workdir, found before training; the message is one line."""


def algorithm_options(name: str) -> ml_collections.ConfigDict:
    """The keyword-only arguments of `<name>.build` with their defaults: every one
    is a config field `config.<name>.<option>`. An option whose default is not a
    simple value (bool, int, float, str, or a tuple of them) cannot be one: it is
    refused here (ValueError naming it), so none is silently missing."""
    params = inspect.signature(algorithms.get(name).build).parameters
    options = {}
    for arg in params.values():
        if arg.name in COMMON_BUILD_ARGS or arg.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        default = arg.default
        if not (
            isinstance(default, SIMPLE_TYPES)
            or (isinstance(default, tuple) and all(isinstance(v, SIMPLE_TYPES) for v in default))
        ):
            raise ValueError(
                f"{name}.build option {arg.name!r} has default {default!r}: config fields need a "
                f"bool, int, float, str or a tuple of them"
            )
        options[arg.name] = default
    return ml_collections.ConfigDict(options)


def source_options() -> ml_collections.ConfigDict:
    """Options of the built-in sources, all unset (None) so `--config.source.<name>=v`
    can set them: the simulation's (samples_per_client, d, m, p, alpha,
    noise_scale, label_rule), and standardize / splits / prepare_from (Fashion-MNIST,
    TFDS). Only the ones set are passed to the source."""
    ph = ml_collections.config_dict.placeholder
    return ml_collections.ConfigDict(
        {
            "samples_per_client": ph(int),
            "d": ph(int),
            "m": ph(int),
            "p": ph(float),
            "alpha": ph(float),
            "noise_scale": ph(float),
            "label_rule": ph(str),
            "standardize": ph(bool),
            "splits": ph(tuple),
            "prepare_from": ph(str),
        }
    )


def fashion_mnist_available(data_dir: str = IDX_DIR) -> bool:
    return os.path.exists(os.path.join(data_dir, "train-images-idx3-ubyte.gz"))


def base_config() -> ml_collections.ConfigDict:
    """The schema with its defaults: FedAvg on Fashion-MNIST if its IDX files are
    present, else on the FedFac simulation data."""
    config = ml_collections.ConfigDict()
    fmnist = fashion_mnist_available()
    # What to run.
    config.algorithm = "fedavg"
    config.seed = 0
    # Data (pfljax.data.build_federated_data).
    config.dataset = "fashion_mnist" if fmnist else "simulation"
    config.data_dir = ""
    config.data_seed = -1  # partition/sampling seed of the data; -1: `seed`
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
    config.source = source_options()  # extra source options (e.g. simulation p, alpha); None: unset
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
    config.loss = "auto"  # auto: cross_entropy for classification data, mse for regression (sine)
    # Model (pfljax.models.build_model); model_kwargs go to the flax module.
    config.model = "mlp"
    config.model_kwargs = ml_collections.ConfigDict({"hidden": (200,)})
    # Execution and outputs.
    config.client_map = "auto"
    config.chunk_size = 0  # 0: lax.map without chunks
    config.num_devices = 0  # devices the client axis is sharded over; 0: all visible
    config.replicate_data = False  # with several devices: ClientData on every device, not sharded
    config.eval_every = 1
    config.checkpoint_every = 5  # 0: only at the end
    # Client-level differential privacy (pfljax.core.privacy, DP-FedAvg): each upload
    # clipped to clip_norm, Gaussian noise noise_multiplier * clip_norm on the sum;
    # delta 0: 1 / num_clients^1.1; target_epsilon 0: no budget (else the run stops
    # before a round that would exceed it).
    config.dp = ml_collections.ConfigDict(
        {"enabled": False, "noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 0.0, "target_epsilon": 0.0}
    )
    # Each algorithm's own options.
    for name in algorithms.available():
        config[name] = algorithm_options(name)
    return config


def to_plain(value: Any) -> Any:
    """ConfigDict / tuples -> JSON-able dicts and lists (tuples become lists)."""
    if isinstance(value, ml_collections.ConfigDict | ml_collections.FrozenConfigDict):
        value = value.to_dict()
    return json.loads(json.dumps(value))


def _tuples(value: Any) -> Any:
    """Lists (from JSON or overrides) -> tuples, recursively, for build kwargs."""
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config.{field} {message}")


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks field names and values that need no data; raises ConfigError."""
    schema = base_config()
    unknown = sorted(set(config.keys()) - set(schema.keys()))
    _check(not unknown, unknown[0] if unknown else "", "is not a known config field")
    for name in algorithms.available():
        if name in config:
            extra = sorted(set(config[name].keys()) - set(schema[name].keys()))
            _check(
                not extra,
                f"{name}.{extra[0]}" if extra else name,
                f"is not an option of {name}.build; options: {sorted(schema[name].keys())}",
            )
    names = algorithms.available()
    _check(config.algorithm in names, "algorithm", f"must be one of {names}, got {config.algorithm!r}")
    _check(config.rounds >= 1, "rounds", f"must be >= 1, got {config.rounds}")
    _check(config.num_clients >= 1, "num_clients", f"must be >= 1, got {config.num_clients}")
    _check(
        0 <= config.clients_per_round <= config.num_clients,
        "clients_per_round",
        f"must be in [0, num_clients={config.num_clients}] (0: all), got {config.clients_per_round}",
    )
    _check(
        config.local_steps >= 0,
        "local_steps",
        f"must be >= 0 (0: use local_epochs), got {config.local_steps}",
    )
    _check(
        config.local_steps > 0 or config.local_epochs >= 1,
        "local_epochs",
        f"must be >= 1 when local_steps is 0, got {config.local_epochs}",
    )
    _check(config.batch_size >= 1, "batch_size", f"must be >= 1, got {config.batch_size}")
    _check(
        config.optimizer in OPTIMIZERS, "optimizer", f"must be one of {OPTIMIZERS}, got {config.optimizer!r}"
    )
    _check(config.loss in LOSS_NAMES, "loss", f"must be one of {LOSS_NAMES}, got {config.loss!r}")
    _check(config.learning_rate > 0, "learning_rate", f"must be > 0, got {config.learning_rate}")
    _check(0 <= config.momentum < 1, "momentum", f"must be in [0, 1), got {config.momentum}")
    _check(config.weight_decay >= 0, "weight_decay", f"must be >= 0, got {config.weight_decay}")
    _check(
        config.client_map in STRATEGIES,
        "client_map",
        f"must be one of {STRATEGIES}, got {config.client_map!r}",
    )
    _check(config.chunk_size >= 0, "chunk_size", f"must be >= 0, got {config.chunk_size}")
    _check(config.eval_every >= 1, "eval_every", f"must be >= 1, got {config.eval_every}")
    _check(config.checkpoint_every >= 0, "checkpoint_every", f"must be >= 0, got {config.checkpoint_every}")
    _check(
        config.samples_per_client >= 0, "samples_per_client", f"must be >= 0, got {config.samples_per_client}"
    )
    devices = jax.device_count()
    _check(
        0 <= config.num_devices <= devices,
        "num_devices",
        f"must be in [0, {devices}] (0: all visible devices), got {config.num_devices}",
    )
    _check(config.model in MODELS, "model", f"must be one of {sorted(MODELS)}, got {config.model!r}")
    try:
        algorithms.model_variant(config.algorithm, config.model)
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from e


def make_optimizer(config) -> optax.GradientTransformation:
    """sgd (with momentum; 0: none), adam or adamw from the config; weight_decay
    is decoupled for adamw and an L2 term (added to the gradient) otherwise."""
    lr = config.learning_rate
    if config.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=config.weight_decay)
    opt = optax.adam(lr) if config.optimizer == "adam" else optax.sgd(lr, momentum=config.momentum or None)
    if config.weight_decay:
        opt = optax.chain(optax.add_decayed_weights(config.weight_decay), opt)
    return opt


def make_local(config, task: str = "classification") -> LocalTraining:
    """LocalTraining from the common fields; loss "auto" follows the data's task."""
    steps = config.local_steps or None
    loss = config.loss
    if loss == "auto":
        loss = "mse" if task == "regression" else "cross_entropy"
    return LocalTraining(
        make_optimizer(config),
        batch_size=config.batch_size,
        steps=steps,
        epochs=None if steps else config.local_epochs,
        loss=loss,
    ).validate()


def make_data(config) -> FederatedData:
    """build_federated_data from the data fields; ConfigError on invalid values."""
    try:
        return build_federated_data(
            config.dataset,
            config.num_clients,
            partition=config.partition,
            dirichlet_alpha=config.dirichlet_alpha,
            classes_per_client=config.classes_per_client,
            num_dominant=config.num_dominant,
            dominant_fraction=config.dominant_fraction,
            num_groups=config.num_groups,
            group_relabel=config.group_relabel,
            permute_labels=config.permute_labels,
            samples_per_client=config.samples_per_client or None,
            test_fraction=config.test_fraction,
            seed=config.seed if config.data_seed < 0 else config.data_seed,
            data_dir=config.data_dir or None,
            source_kwargs={k: v for k, v in _tuples(to_plain(config.source)).items() if v is not None},
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"config (dataset={config.dataset!r}): {_one_line(e)}") from e


def make_model(config, fed_data: FederatedData) -> Model:
    """The model the algorithm trains for `config.model` (its MODEL_VARIANTS, e.g.
    FedBN: "cnn" -> "cnn_bn"), built with `config.model_kwargs`."""
    name = algorithms.model_variant(config.algorithm, config.model)
    kwargs = _tuples(to_plain(config.model_kwargs))
    try:
        return build_model(name, tuple(fed_data.input_shape), fed_data.num_classes, **kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.model / config.model_kwargs: {_one_line(e)}") from e


def make_client_map(config, mesh=None):
    """ClientMap from client_map/chunk_size; wrapped in a ShardedMap over `mesh` if given."""
    inner = ClientMap(config.client_map, config.chunk_size or None)
    if mesh is None:
        return inner
    from pfljax.sharding import ShardedMap  # pylint: disable=import-outside-toplevel

    return ShardedMap(mesh, inner)


def dp_delta(config) -> float:
    """config.dp.delta, or 1 / num_clients^1.1 when it is 0."""
    return config.dp.delta or 1.0 / config.num_clients**1.1


def make_privacy(config) -> ClientDP | None:
    """ClientDP from config.dp (None unless enabled); ConfigError for bad values or an
    algorithm whose server does not average client uploads."""
    dp = config.dp
    if not dp.enabled:
        return None
    _check(dp.noise_multiplier >= 0, "dp.noise_multiplier", f"must be >= 0, got {dp.noise_multiplier}")
    _check(dp.clip_norm > 0, "dp.clip_norm", f"must be > 0 (inf: no clipping), got {dp.clip_norm}")
    _check(0 <= dp.delta < 1, "dp.delta", f"must be in [0, 1) (0: 1/num_clients^1.1), got {dp.delta}")
    _check(dp.target_epsilon >= 0, "dp.target_epsilon", f"must be >= 0 (0: none), got {dp.target_epsilon}")
    if "privacy" not in inspect.signature(algorithms.get(config.algorithm).build).parameters:
        supported = [
            n
            for n in algorithms.available()
            if "privacy" in inspect.signature(algorithms.get(n).build).parameters
        ]
        raise ConfigError(
            f"config.dp.enabled: {config.algorithm} does not support client-level DP (its server mixes or "
            f"inspects per-client models, not an average of uploads); supported: {supported}"
        )
    return ClientDP(float(dp.noise_multiplier), float(dp.clip_norm))


def make_algorithm(config, model: Model, client_map, task: str = "classification") -> Algorithm:
    """`pfljax.algorithms.<algorithm>.build(model, local, ..., **config.<algorithm>)`."""
    name = config.algorithm
    options = _tuples(to_plain(config[name])) if name in config else {}
    privacy = make_privacy(config)
    if privacy is not None:
        options["privacy"] = privacy
    try:
        return algorithms.get(name).build(
            model,
            make_local(config, task),
            clients_per_round=config.clients_per_round or None,
            client_map=client_map,
            **options,
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.{name}: {_one_line(e)}") from e


class Prepared(NamedTuple):
    """Everything a run needs, built and validated before training.

    Attributes:
      fed_data: the federated data.
      model: the client model.
      algorithm: the algorithm (per-client work spread over `mesh`).
      mesh: the 'clients' device mesh (pfljax.sharding).
    """

    fed_data: FederatedData
    model: Model
    algorithm: Algorithm
    mesh: Any


def prepare(config, fed_data: FederatedData | None = None) -> Prepared:
    """Validates `config` and builds data, model, algorithm and mesh (ConfigError if invalid).

    Args:
      config: a ConfigDict with the fields of `base_config()`.
      fed_data: reuse these data instead of building them (e.g. several
        algorithms on the same partition).
    """
    from pfljax.sharding import client_mesh  # pylint: disable=import-outside-toplevel

    validate(config)
    fed_data = make_data(config) if fed_data is None else fed_data
    model = make_model(config, fed_data)
    mesh = client_mesh(config.num_devices)
    algorithm = make_algorithm(
        config, model, make_client_map(config, mesh if mesh.size > 1 else None), fed_data.task
    )
    return Prepared(fed_data, model, algorithm, mesh)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
