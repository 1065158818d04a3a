"""Experiment configs: the shared schema, validation, and config -> objects.

`base_config()` is the schema every config shares (`experiments/configs/default.py`
returns it): the common fields of `config_fields.FIELDS` (each one's default, domain and
help line written there once); each algorithm's own options live under `config.<algorithm>.<option>`,
read from the keyword-only arguments of `pfljax.algorithms.<name>.build` (their
defaults become the config defaults). Integer caps use 0 for "none/all".

`prepare(config)` validates a config and builds everything a run needs (data,
model, algorithm, device mesh) before any training; every invalid input raises
`ConfigError`, one line naming the field, its value and what is allowed.

Fields left to "auto" are filled in by `resolve(config)` (the config written to
config.json is the resolved one): `optimizer="auto"` is the algorithm's
optimizer (`ALGORITHM_TRAINING`: Adam for FedeRiCo, as in its paper; SGD
otherwise), and unset (None) `learning_rate` / `momentum` take the method's own
values (`ALGORITHM_TRAINING`: no momentum for pFedMe) or that optimizer's defaults
(`OPTIMIZER_DEFAULTS`); `model_kwargs` that belong to another model
(switching `--config.model`) are dropped for the new model's defaults.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import inspect
import json
import os
import re
import sys
import tempfile
from typing import Any, NamedTuple

import jax
import ml_collections
import optax

from pfljax import algorithms
from pfljax.core import privacy
from pfljax.core.clients import STRATEGIES, ClientMap
from pfljax.core.domains import Domain
from pfljax.core.local import LOOPS, LocalTraining
from pfljax.core.privacy import ClientDP
from pfljax.core.types import Algorithm
from pfljax.data import DataSpec, FederatedData, build_federated_data
from pfljax.data.federated import TEST_SPLITS
from pfljax.data.idx import PIXEL_SCALES
from pfljax.experiment.config_fields import (  # noqa: F401  (source_options: re-exported)
    FIELDS,
    IDX_DIR,
    NATURAL_DATASETS,
    fashion_mnist_available,
    source_options,
)
from pfljax.experiment.settings import Accounting, Placement, RunSettings, Schedule
from pfljax.models import MODELS, Model, build_model
from pfljax.models.weights import load_variables
from pfljax.runtime.offload import STORAGES

# Arguments every build takes, set from the common fields instead.
COMMON_BUILD_ARGS = ("model", "local", "clients_per_round", "client_map", "privacy", "server_optimizer")
SIMPLE_TYPES = (bool, int, float, str)
OPTIMIZERS = ("auto", "sgd", "adam", "adamw")
SERVER_OPTIMIZERS = ("none", "sgd", "adam", "yogi", "adagrad")
SERVER_FIELDS = ("server_learning_rate", "server_momentum", "server_epsilon")
LOSS_NAMES = ("auto", "cross_entropy", "mse", "token_cross_entropy")
# loss="auto" by the data's task (FederatedData.task).
AUTO_LOSS = {"classification": "cross_entropy", "regression": "mse", "sequence": "token_cross_entropy"}
# learning_rate / momentum of each optimizer when the config leaves them unset (None).
OPTIMIZER_DEFAULTS = {
    "sgd": {"learning_rate": 0.05, "momentum": 0.9},
    "adam": {"learning_rate": 1e-3, "momentum": 0.0},
    "adamw": {"learning_rate": 1e-3, "momentum": 0.0},
}
# optimizer="auto": the training a method's paper uses where it is not SGD with momentum
# (optimizer, and learning_rate / momentum where the config leaves them unset), and why;
# every other algorithm gets SGD with OPTIMIZER_DEFAULTS["sgd"].
ALGORITHM_TRAINING = {
    "federico": (
        {"optimizer": "adam", "learning_rate": 1e-3, "momentum": 0.0},
        "FedeRiCo's paper trains with Adam; its M-step sums the neighbours' gradients "
        "(federico.m_step='sum'), which SGD at lr 0.05 with momentum 0.9 turns into a diverging step",
    ),
    "pfedme": (
        {"optimizer": "sgd", "momentum": 0.0},
        "pFedMe's paper and code use plain SGD: its outer step is eta * lam * (w - theta) with lam=15, "
        "and momentum 0.9 made the default Fashion-MNIST run fall from 53% to 34% (84% without)",
    ),
}


# The domains of the numeric common fields (`config_fields.FIELDS`), checked by `validate`
# whether or not the run uses the field; a function of the config where a bound
# depends on another field. Unset (None) learning_rate / momentum are not checked.
FIELD_DOMAINS = {name: f.domain for name, f in FIELDS.items() if f.domain is not None}
# config.dp.<field> (client-level DP): ClientDP's fields, the accountant's delta and the budget.
DP_DOMAINS = {
    **privacy.DOMAINS,
    "delta": Domain(0, 1, high_open=True, note="0: min(1e-5, 1/num_clients^1.1); below 1/num_clients"),
    "target_epsilon": Domain(0, note="0: no budget"),
}
# Options that usually make a run diverge, named in the divergence message
# (besides the common learning_rate / optimizer / momentum / local schedule and any
# option whose name ends in "lr").
DIVERGENCE_KNOBS = {
    "federico": ("m_step", "loss_scale"),
    "pfedme": ("lam", "beta"),
    "per_fedavg": ("alpha", "delta"),
    "fedprox": ("mu",),
    "pfedhn": ("hn_clip_norm",),
}
# Fields that may change between a run and its resumption (they do not change
# the trained state): more rounds, other output cadence, other devices.
RESUMABLE_FIELDS = (
    "rounds",
    "eval_every",
    "checkpoint_every",
    "client_map",
    "chunk_size",
    "local_loop",
    "num_devices",
    "replicate_data",
    "data_dir",
    "block_rounds",
    "client_storage",
)


def partition_name(config) -> str:
    """config.partition, or "users" for a natural data set (its users are the clients:
    config.partition does not apply)."""
    return "users" if config.dataset in NATURAL_DATASETS else config.partition


# The `config.source.<option>` fields each built-in source takes (others are refused).
SOURCE_OPTIONS = {
    "simulation": ("samples_per_client", "d", "m", "p", "alpha", "noise_scale", "label_rule"),
    "fashion_mnist": ("standardize", "pixel_scale"),
    "tfds:": ("splits", "prepare_from", "standardize"),
    **{name: ("min_samples", "users") for name in NATURAL_DATASETS},
}
# Domains of the numeric source options (checked where set).
SOURCE_DOMAINS = {
    "samples_per_client": Domain(1, integer=True),
    "d": Domain(1, integer=True),
    "m": Domain(1, integer=True),
    "p": Domain(0, 1),
    "alpha": Domain(0),
    "noise_scale": Domain(0),
    "min_samples": Domain(0, integer=True),
}
# One line per common field, for --help.
FIELD_HELP = {name: f.help for name, f in FIELDS.items()}


class ConfigError(ValueError):
    """An invalid config or workdir, found before training; the message is one line."""


def close_names(name: str, names, n: int = 3) -> str:
    """' (did you mean 'a' or 'b'?)' for the names closest to `name`, else ''."""
    close = difflib.get_close_matches(str(name), [str(x) for x in names], n=n, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def override_error(argv: list[str], config) -> str:
    """The message for an override of a field that does not exist."""
    for a in argv[1:]:
        if not a.startswith("--config."):
            continue
        flag, _, value = a.partition("=")
        parts = flag[len("--config.") :].split(".")
        node, depth = config, 0
        while depth < len(parts) and hasattr(node, "keys") and parts[depth] in node:
            node, depth = node[parts[depth]], depth + 1
        if depth == len(parts):
            continue  # this override names an existing field
        missing, parent = parts[depth], ".".join(parts[:depth])
        given = f"{flag}={value}" if value else flag
        if not hasattr(node, "keys"):
            return f"{given}: config.{parent} is a {type(node).__name__}, it has no field {missing!r}"
        keys = sorted(node.keys())
        if parent == "":
            fields = ", ".join(keys)
            return f"{given}: {missing!r} is not a config field{close_names(missing, keys)}; fields: {fields}"
        if parent == "model_kwargs":
            try:
                model = algorithms.model_variant(config.algorithm, config.model)
                args = ", ".join(f"{k}={v!r}" for k, v in model_arguments(model).items())
            except Exception:  # noqa: BLE001
                model, args = config.model, "?"
            close = close_names(missing, keys)
            return (
                f"{given}: model_kwargs of this config hold only {keys or 'nothing'}{close}; "
                f"model {model!r} takes {args}"
            )
        if depth == 1 and parent in algorithms.available():
            new = algorithms.renamed_option(parent, missing)
            if new:
                return f"{given}: {parent}.{missing} was renamed: use --config.{parent}.{new}"
            return (
                f"{given}: {missing!r} is not an option of {parent}{close_names(missing, keys)}; "
                f"its options: {', '.join(keys) or 'none'}"
            )
        fields = ", ".join(keys)
        close = close_names(missing, keys)
        return f"{given}: {missing!r} is not a field of config.{parent}{close}; its fields: {fields}"
    return "an override names a field the config does not have"


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


FASHION_MNIST_FIX = (
    f"apt-get install dataset-fashion-mnist (files under {IDX_DIR}), or "
    "--config.dataset=fashion_mnist --config.data_dir=DIR with the four IDX .gz files in DIR"
)


def base_config() -> ml_collections.ConfigDict:
    """The schema with its defaults (`config_fields.FIELDS`, then each algorithm's
    options under `config.<algorithm>`): FedAvg on Fashion-MNIST if its IDX files are
    present, else on the FedFac simulation data (a run says which, and why: `data_note`)."""
    config = ml_collections.ConfigDict({name: f.value() for name, f in FIELDS.items()})
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


def _one_of(config, field: str, allowed) -> None:
    value = config[field]
    _check(
        value in allowed,
        field,
        f"must be one of {tuple(allowed)}, got {value!r}{close_names(value, allowed)}",
    )


def _check_pfllib_mode(config: ml_collections.ConfigDict) -> None:
    """The fields of PFLlib's batches and pixels: drop_last, source.pixel_scale (test_split: `choices`)."""
    _check(
        isinstance(config.drop_last, bool), "drop_last", f"must be True or False, got {config.drop_last!r}"
    )
    scale, scales = config.source.get("pixel_scale"), PIXEL_SCALES
    _check(scale is None or scale in scales, "source.pixel_scale", f"must be one of {scales}, got {scale!r}")


def choices() -> dict[str, Any]:
    """{field: its allowed values} of the common fields that name a choice."""
    from pfljax.data.federated import PARTITIONS  # pylint: disable=import-outside-toplevel
    from pfljax.data.partition import PERMUTE_MODES  # pylint: disable=import-outside-toplevel

    return {
        "algorithm": algorithms.available(),
        "partition": PARTITIONS,
        "permute_labels": PERMUTE_MODES,
        "test_split": TEST_SPLITS,
        "optimizer": OPTIMIZERS,
        "server_optimizer": SERVER_OPTIMIZERS,
        "loss": LOSS_NAMES,
        "client_map": STRATEGIES,
        "client_storage": STORAGES,
        "local_loop": LOOPS,
        "model": sorted(MODELS),
    }


def numeric_domains(config) -> dict[str, Domain]:
    """The domain of every numeric field, by its dotted name under `config.`: the common
    fields ("rounds"), source options ("source.p"), DP's ("dp.clip_norm") and each
    algorithm's options ("fedprox.mu", `pfljax.algorithms.domains`)."""
    out = {k: d(config) if callable(d) else d for k, d in FIELD_DOMAINS.items()}
    out.update({f"source.{k}": d for k, d in SOURCE_DOMAINS.items()})
    out.update({f"dp.{k}": d for k, d in DP_DOMAINS.items()})
    for name in algorithms.available():
        out.update({f"{name}.{k}": d for k, d in algorithms.domains(name).items()})
    return out


def _lookup(config, field: str) -> Any:
    """config.<field> for a dotted name ("dp.delta"); None where it or its group is absent."""
    for part in field.split("."):
        if part not in config:
            return None
        config = config[part]
    return config


def _check_names(config, schema) -> None:
    """ConfigError for a field, source / DP option or algorithm option the schema lacks."""
    unknown = sorted(set(config.keys()) - set(schema.keys()))
    if unknown:
        raise ConfigError(
            f"config.{unknown[0]} is not a known config field{close_names(unknown[0], schema.keys())}; "
            f"fields: {', '.join(sorted(schema.keys()))}"
        )
    groups = {"source": "a source option", "dp": "a dp option"}
    for name in ["source", "dp", *(n for n in algorithms.available() if n in config)]:
        known = schema[name].keys()
        extra = sorted(set(config[name].keys()) - set(known))
        if extra:
            what = groups.get(name, f"an option of {name}")
            raise ConfigError(
                f"config.{name}.{extra[0]} is not {what}{close_names(extra[0], known)}; "
                f"{'its ' if name not in groups else ''}options: {', '.join(sorted(known)) or 'none'}"
            )


def _check_source(config) -> None:
    """ConfigError for a source option set (not None) that the dataset does not take."""
    given = {k: v for k, v in config.source.items() if v is not None}
    kind = "tfds:" if str(config.dataset).startswith("tfds:") else config.dataset
    for option in sorted(given) if kind in SOURCE_OPTIONS else ():
        if option not in SOURCE_OPTIONS[kind]:
            raise ConfigError(
                f"config.source.{option}={given[option]!r} is not an option of dataset "
                f"{config.dataset!r}; its options: {', '.join(SOURCE_OPTIONS[kind])}"
            )


def _check_privacy_set(config, schema) -> None:
    """ConfigError for a dp.* option set while dp.enabled is False: privacy is never silently off."""
    if config.dp.enabled:
        return
    for key, default in schema.dp.items():
        if key != "enabled" and config.dp[key] != default:
            raise ConfigError(
                f"config.dp.{key}={config.dp[key]!r} is set but config.dp.enabled is False, so the run "
                f"would have no privacy: set --config.dp.enabled=True, or leave dp.{key} at {default!r}"
            )


def _check_server_optimizer_set(config, schema) -> None:
    """ConfigError for a server_* option set while server_optimizer is "none" (it would do nothing)."""
    if config.server_optimizer != "none":
        return
    for key in SERVER_FIELDS:
        if config[key] != schema[key]:
            raise ConfigError(
                f"config.{key}={config[key]!r} is set but config.server_optimizer is 'none', so it would "
                f"do nothing: give --config.server_optimizer (one of {SERVER_OPTIMIZERS[1:]}), or leave "
                f"{key} at {schema[key]!r}"
            )


@functools.cache
def _schema() -> ml_collections.FrozenConfigDict:
    """base_config(), built once: `validate` reads its names and the dp defaults."""
    return ml_collections.FrozenConfigDict(base_config())


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks field names and values that need no data; raises ConfigError.

    Every numeric field is checked against its domain (`numeric_domains`: the common
    fields, source / DP options and every algorithm's options) whether or not the
    config uses it (e.g. dirichlet_alpha with partition="classes"), so a typo never
    waits for the run that needs it; the message is one line, "config.<field> must
    be <domain>, got X". A dp.* option set while dp.enabled is False is refused.
    """
    schema = _schema()
    _check_names(config, schema)
    _check_source(config)
    _check_pfllib_mode(config)
    _check(
        not config.init_params or os.path.isfile(init_params_path(config)),
        "init_params",
        "must be a .npz file's path ('{seed}' in it: the seed; '': the model's own initialisation), "
        f"got {init_params_path(config)!r}",
    )
    for field, allowed in choices().items():
        _one_of(config, field, allowed)
    for field, domain in numeric_domains(config).items():
        value = _lookup(config, field)
        message = None if value is None else domain.error(f"config.{field}", value)
        if message:
            raise ConfigError(message)
    _check_privacy_set(config, schema)
    _check_server_optimizer_set(config, schema)
    _check_host_storage(config)
    try:
        algorithms.model_variant(config.algorithm, config.model)
    except ValueError as e:
        raise ConfigError(f"config.model={config.model!r}: {e}") from e


def _check_host_storage(config) -> None:
    """ConfigError for client_storage="host" with an algorithm whose round cannot keep its
    clients in host memory (its reason), or on more than one device or process."""
    if config.client_storage != "host":
        return
    options = to_plain(config[config.algorithm]) if config.algorithm in config else {}
    why = algorithms.host_storage_refusal(config.algorithm, options)
    if why:
        able = [n for n in algorithms.available() if not algorithms.host_storage_refusal(n)]
        raise ConfigError(
            f"config.client_storage='host' cannot run {config.algorithm}: {why}; "
            f"use client_storage='device', or one of {able}"
        )
    if config.num_devices > 1 or jax.process_count() > 1:
        raise ConfigError(
            f"config.client_storage='host' moves each round's participants to one device of one process, "
            f"got num_devices={config.num_devices} on {jax.process_count()} process(es): "
            "set --config.num_devices=1 (or 0) and run one process"
        )


def _drop_variant_foreign(out, model: str, foreign: list[str], notes: list[str]) -> list[str]:
    """The algorithm trains its own variant `model` of config.model (Factorized-FL, pFedPara),
    which lacks some arguments of config.model (e.g. init_scheme): those are dropped from
    out.model_kwargs with a note (the variant keeps its own parametrization); returns the
    arguments of neither model."""
    given = to_plain(out.model_kwargs)
    base_only = [k for k in foreign if k in model_arguments(out.model)]
    if base_only:
        notes.append(
            f"{out.algorithm} trains model {model!r}, which has no "
            + ", ".join(f"{k}={given[k]!r}" for k in base_only)
            + f" (an argument of {out.model!r}): dropped"
        )
        kept = {k: out.model_kwargs[k] for k in given if k not in base_only}
        out.model_kwargs = ml_collections.ConfigDict(kept)
    return [k for k in foreign if k not in base_only]


def resolve(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, list[str]]:
    """(a validated copy of `config` with every "auto"/unset training field filled
    in, notes saying what was filled in and why). `config` is not changed."""
    validate(config)
    out = copy.deepcopy(config)
    notes = []
    with out.unlocked():
        training, why = ALGORITHM_TRAINING.get(out.algorithm, ({"optimizer": "sgd"}, ""))
        auto = out.optimizer == "auto"
        if auto:
            out.optimizer = training["optimizer"]
        # The method's own settings where its optimizer is used, else the optimizer's defaults.
        defaults = dict(OPTIMIZER_DEFAULTS[out.optimizer])
        if out.optimizer == training["optimizer"]:
            defaults.update({k: v for k, v in training.items() if k != "optimizer"})
        filled = []
        for field in ("learning_rate", "momentum"):
            if out[field] is None:
                out[field] = defaults[field]
                filled.append(f"{field}={defaults[field]:g}")
        if why and (auto or filled):
            shown = ", ".join(([f"optimizer={out.optimizer}"] if auto else []) + filled)
            notes.append(
                f"{out.algorithm}: {shown} ({why}); "
                "set --config.optimizer / learning_rate / momentum to override"
            )
        model = algorithms.model_variant(out.algorithm, out.model)
        accepted = model_arguments(model)
        given = to_plain(out.model_kwargs)
        for key, value in given.items():
            default = accepted.get(key)
            element = type(default[0]) if isinstance(default, tuple | list) and default else None
            if isinstance(default, tuple | list) and (
                not isinstance(value, tuple | list)
                or (element in (int, float) and not all(isinstance(v, int | float) for v in value))
            ):
                raise ConfigError(
                    f"config.model_kwargs.{key}={value!r} must be a tuple like {tuple(default)!r} "
                    f"(model {model!r}; on the command line: "
                    f"--config.model_kwargs.{key}='{tuple(default)!r}')"
                )
            if isinstance(default, int | float) and not isinstance(default, bool):
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise ConfigError(
                        f"config.model_kwargs.{key}={value!r} must be a number like {default!r} "
                        f"(model {model!r})"
                    )
        foreign = sorted(set(given) - set(accepted))
        if foreign and model != out.model:
            foreign = _drop_variant_foreign(out, model, foreign, notes)
            given = to_plain(out.model_kwargs)
        if foreign:
            if given == to_plain(base_config().model_kwargs):
                notes.append(
                    f"model_kwargs {given} are the default MLP's; model {out.model!r} uses its own "
                    f"defaults {accepted}"
                )
                out.model_kwargs = ml_collections.ConfigDict({})
            else:
                raise ConfigError(
                    f"config.model_kwargs.{foreign[0]} is not an argument of model {model!r}"
                    f"{close_names(foreign[0], accepted)}; its arguments (defaults): "
                    + ", ".join(f"{k}={v!r}" for k, v in accepted.items())
                )
    return out, notes


def model_arguments(name: str) -> dict[str, Any]:
    """The keyword arguments of model `name` (a MODELS entry) with their defaults."""
    module = MODELS[name](num_outputs=1)
    return {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(type(module))
        if f.init and f.name not in ("parent", "name", "num_outputs")
    }


def make_optimizer(config) -> optax.GradientTransformation:
    """sgd (with momentum; 0: none), adam or adamw from the config; weight_decay
    is decoupled for adamw and an L2 term (added to the gradient) otherwise.
    "auto" / unset fields are resolved first (`resolve`)."""
    if config.optimizer == "auto" or config.learning_rate is None or config.momentum is None:
        config = resolve(config)[0]
    lr = config.learning_rate
    if config.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=config.weight_decay)
    opt = optax.adam(lr) if config.optimizer == "adam" else optax.sgd(lr, momentum=config.momentum or None)
    if config.weight_decay:
        opt = optax.chain(optax.add_decayed_weights(config.weight_decay), opt)
    return opt


def make_server_optimizer(config) -> optax.GradientTransformation | None:
    """The optax server optimizer of config.server_optimizer (None for "none"). adam and yogi
    take b2=0.99 (Reddi et al.'s FedAdam / FedYogi) and keep optax's bias correction (the
    paper's have none)."""
    name, lr = config.server_optimizer, config.server_learning_rate
    momentum, eps = config.server_momentum, config.server_epsilon
    if name == "none":
        return None
    if name == "sgd":
        return optax.sgd(lr, momentum=momentum or None)
    if name == "adagrad":
        return optax.adagrad(lr, eps=eps)
    return {"adam": optax.adam, "yogi": optax.yogi}[name](lr, b1=momentum, b2=0.99, eps=eps)


def make_local(config, task: str = "classification") -> LocalTraining:
    """LocalTraining from the common fields; loss "auto" follows the data's task (AUTO_LOSS)."""
    steps = config.local_steps or None
    loss = AUTO_LOSS[task] if config.loss == "auto" else config.loss
    return LocalTraining(
        make_optimizer(config),
        batch_size=config.batch_size,
        steps=steps,
        epochs=None if steps else config.local_epochs,
        loss=loss,
        loop=config.local_loop,
        drop_last=config.drop_last,
    ).validate()


def data_note(config) -> str:
    """One line saying which data a run uses and why (the default config picks
    Fashion-MNIST where its IDX files are installed, the simulation elsewhere)."""
    if config.dataset == "fashion_mnist":
        where = config.data_dir or IDX_DIR
        return f"data: Fashion-MNIST from the IDX files in {where}"
    if config.dataset == "simulation":
        if fashion_mnist_available():
            return "data: the FedFac simulation (generated, no files)"
        return (
            "data: the FedFac simulation (generated, no files); default.py picks it where the "
            f"Fashion-MNIST IDX files are missing, as here (not in {IDX_DIR}); for Fashion-MNIST: "
            f"{FASHION_MNIST_FIX}"
        )
    if config.dataset.startswith("tfds:"):
        return f"data: TFDS {config.dataset[5:]!r} from {config.data_dir or 'the default TFDS data_dir'}"
    return f"data: {config.dataset!r}" + (f" from {config.data_dir}" if config.data_dir else "")


def _data_error(config, e: BaseException) -> ConfigError:
    """A one-line ConfigError for a data error: long lists cut, the fix named."""
    message = _one_line(e)
    if config.dataset.startswith("tfds:") and "not a TFDS data set" in message:
        name = config.dataset[5:]
        try:
            import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

            names = tfds.list_builders()
        except Exception:  # noqa: BLE001  tfds missing or broken: no suggestions
            names = []
        return ConfigError(
            f"config.dataset={config.dataset!r}: TFDS has no data set {name!r}{close_names(name, names)} "
            f"({len(names)} known: tfds.list_builders())"
        )
    if "generated per client" in message and config.dataset == "simulation" and not fashion_mnist_available():
        message += (
            f" default.py uses the simulation because the Fashion-MNIST IDX files are not in {IDX_DIR}; "
            f"for Fashion-MNIST: {FASHION_MNIST_FIX}"
        )
    users = re.search(r"exceeds the (\d+) users with at least", message)
    if users and config.dataset in NATURAL_DATASETS:  # the one fix, whole: every flag it takes
        n = int(users.group(1))
        fix = f"--config.num_clients={n}" if n else "a lower --config.source.min_samples"
        if n and config.clients_per_round > n:
            fix += f" and --config.clients_per_round <= {n} (it is {config.clients_per_round})"
        message += f"; give {fix}"
    if len(message) > 600:
        message = message[:600] + " ..."
    return ConfigError(f"config (dataset={config.dataset!r}): {message}")


def data_spec(config) -> DataSpec:
    """The DataSpec of the config's data fields (`build_federated_data`'s arguments)."""
    return DataSpec(
        config.dataset,
        config.num_clients,
        partition=config.partition,
        dirichlet_alpha=config.dirichlet_alpha,
        classes_per_client=config.classes_per_client,
        num_dominant=config.num_dominant,
        dominant_fraction=config.dominant_fraction,
        num_groups=config.num_groups,
        group_relabel=config.group_relabel,
        group_assignment=config.group_assignment,
        permute_labels=config.permute_labels,
        samples_per_client=config.samples_per_client or None,
        test_fraction=config.test_fraction,
        test_split=config.test_split,
        seed=config.seed if config.data_seed < 0 else config.data_seed,
        data_dir=config.data_dir or None,
        source_kwargs={k: v for k, v in _tuples(to_plain(config.source)).items() if v is not None},
    )


def make_data(config) -> FederatedData:
    """build_federated_data of the config's `data_spec`; ConfigError on invalid values."""
    quiet = _without_tf_log_lines() if str(config.dataset).startswith("tfds:") else contextlib.nullcontext()
    with quiet:
        try:
            return build_federated_data(data_spec(config))
        except (ValueError, TypeError, FileNotFoundError, OSError) as e:
            raise _data_error(config, e) from e


@contextlib.contextmanager
def _without_tf_log_lines():
    """Drops TensorFlow's C++ start-up log lines (`I0000 ... port.cc:153] oneDNN ...`,
    "WARNING: All log messages before absl::InitializeLog() ...") from stderr while
    TFDS loads: they are written at the file-descriptor level, and TF_CPP_MIN_LOG_LEVEL
    no longer applies once jax is imported. Other lines are passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not re.match(r"^([IW]\d{4} |WARNING: All log messages before absl::InitializeLog)", line):
                    sys.stderr.write(line)
            sys.stderr.flush()


# Splits whose client sizes are not what they define (iid: equal shares; classes, shards:
# which classes a client holds, kept by the class-stratified cap): a cap is no warning there.
SIZE_FREE_SPLITS = ("iid", "classes", "shards")


def data_warnings(config, fed_data: FederatedData) -> list[str]:
    """Lines about data that differ from what the config seems to ask for (a cap
    no client reaches, a cap that cuts clients of a non-IID split, classes
    no client holds)."""
    cap = config.samples_per_client
    sizes = [c["train"] + c["test"] for c in fed_data.summary["clients"]]
    lines = []
    if cap and sizes and max(sizes) < cap:
        lines.append(
            f"config.samples_per_client={cap} is a cap, and no client reaches it: "
            f"{sum(sizes)} samples over {len(sizes)} clients give {min(sizes)}..{max(sizes)} "
            f"(mean {sum(sizes) / len(sizes):.0f}) samples per client"
        )
    at_cap = sum(size == cap for size in sizes) if cap else 0
    if at_cap and config.partition not in SIZE_FREE_SPLITS:
        lines.append(
            f"config.samples_per_client={cap} cuts {at_cap} of {len(sizes)} clients of the "
            f"{config.partition!r} split to {cap} samples each, so client sizes are no longer the split's; "
            f"--config.samples_per_client=0 lifts the cap"
        )
    unplaced = fed_data.summary.get("unplaced_classes")
    if unplaced and config.dataset in NATURAL_DATASETS:  # the users' own data: nothing to place
        lines.append(f"classes {unplaced} are in none of the {len(sizes)} users' training data")
    elif unplaced:
        lines.append(
            f"classes {unplaced} are in no client's data (config.partition={config.partition!r}, "
            f"seed {config.seed}); more clients or config.classes_per_client would place them"
        )
    return lines


def make_model(config, fed_data: FederatedData) -> Model:
    """The model the algorithm trains for `config.model` (its MODEL_VARIANTS, e.g.
    FedBN: "cnn" -> "cnn_bn"), built with `config.model_kwargs`; its variables'
    shapes are computed here, so bad model_kwargs fail before the algorithm is built."""
    name = algorithms.model_variant(config.algorithm, config.model)
    kwargs = _tuples(to_plain(config.model_kwargs))
    try:
        model = build_model(name, tuple(fed_data.input_shape), fed_data.num_classes, **kwargs)
        model.template()
    except Exception as e:  # noqa: BLE001  any failure here is the model_kwargs' fault
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(
            f"config.model_kwargs ({given}) do not build model {name!r}: {_one_line(e)[:300]}; its arguments "
            "(defaults): " + ", ".join(f"{k}={v!r}" for k, v in model_arguments(name).items())
        ) from e
    return model


def init_params_path(config) -> str:
    """config.init_params with "{seed}" replaced by config.seed ("" when unset)."""
    return config.init_params.replace("{seed}", str(config.seed))


def _starting_weights_note(config) -> str:
    if "{seed}" not in config.init_params:
        return f"starting weights: {config.init_params} (every seed and client)"
    own = f"seed {config.seed}: {init_params_path(config)}"
    return f"starting weights: {config.init_params}, each seed its own file ({own})"


def load_initial_params(config, model: Model):
    """config.init_params' variables for `model` (None when unset); ConfigError if they do not fit."""
    if not config.init_params:
        return None
    try:
        return load_variables(init_params_path(config), model)
    except ValueError as e:
        raise ConfigError(f"config.init_params: {_one_line(e)}") from None


def make_client_map(config, mesh=None):
    """ClientMap from client_map/chunk_size; wrapped in a ShardedMap over `mesh` if given."""
    inner = ClientMap(config.client_map, config.chunk_size or None)
    if mesh is None:
        return inner
    from pfljax.runtime.sharding import ShardedMap  # pylint: disable=import-outside-toplevel

    return ShardedMap(mesh, inner)


DEFAULT_DELTA_CAP = 1e-5  # dp.delta=0: min(DEFAULT_DELTA_CAP, 1 / num_clients^1.1)


def dp_delta(config) -> float:
    """config.dp.delta, or min(1e-5, 1 / num_clients^1.1) when it is 0: below 1/C, where
    (eps, delta)-DP with delta >= 1/C allows publishing one client's data outright."""
    return config.dp.delta or min(DEFAULT_DELTA_CAP, 1.0 / config.num_clients**1.1)


def make_privacy(config) -> ClientDP | None:
    """ClientDP from config.dp (None unless enabled; its values were checked by
    `validate`); ConfigError for an algorithm whose server does not average client uploads."""
    dp = config.dp
    if not dp.enabled:
        return None
    if not algorithms.supports_privacy(config.algorithm):
        supported = [n for n in algorithms.available() if algorithms.supports_privacy(n)]
        raise ConfigError(
            f"config.dp.enabled: {config.algorithm} does not support client-level DP (its server mixes or "
            f"inspects per-client models, not an average of uploads); supported: {supported}"
        )
    bound = 1.0 / config.num_clients
    if dp.delta >= bound:
        raise ConfigError(
            f"config.dp.delta={dp.delta:g} is >= 1/num_clients = {bound:g}: a guarantee that allows one "
            f"client's data to be published whole; give dp.delta < {bound:g} "
            f"(0: the default min({DEFAULT_DELTA_CAP:g}, 1/num_clients^1.1))"
        )
    return ClientDP(float(dp.noise_multiplier), float(dp.clip_norm))


def make_algorithm(config, model: Model, client_map, task: str = "classification") -> Algorithm:
    """`pfljax.algorithms.<algorithm>.build(model, local, ..., **config.<algorithm>)`."""
    name = config.algorithm
    options = _tuples(to_plain(config[name])) if name in config else {}
    privacy = make_privacy(config)
    if privacy is not None:
        options["privacy"] = privacy
    server_optimizer = make_server_optimizer(config)
    if server_optimizer is not None:
        if not algorithms.takes(name, "server_optimizer"):
            supported = [n for n in algorithms.available() if algorithms.takes(n, "server_optimizer")]
            raise ConfigError(
                f"config.server_optimizer={config.server_optimizer!r}: {name} has no server optimizer; "
                f"the methods with one: {supported}"
            )
        options["server_optimizer"] = server_optimizer
    try:
        return algorithms.get(name).build(
            model,
            make_local(config, task),
            clients_per_round=config.clients_per_round or None,
            client_map=client_map,
            **options,
        )
    except (ValueError, TypeError) as e:
        message = _one_line(e)
        option = next((o for o in sorted(options, key=len, reverse=True) if message.startswith(o)), None)
        if option is not None:  # "<option> must be ...": name the flag and its value
            raise ConfigError(f"config.{name}.{option}={options[option]!r}: {message}") from e
        raise ConfigError(f"config.{name}: {message}") from e


def data_title(config) -> str:
    """'<dataset>, <C> clients, partition <p>' with the partition's parameter."""
    partition = partition_name(config)
    if config.dataset == "simulation":
        partition = "per-client generator"
    elif partition == "dirichlet":
        partition += f" alpha={config.dirichlet_alpha:g}"
    elif partition in ("classes", "shards"):
        partition += f" {config.classes_per_client} per client"
    elif partition == "dominant":
        partition += f" {config.num_dominant} x {config.dominant_fraction:g}"
    elif partition == "groups":
        partition += f" G={config.num_groups}"
    if config.permute_labels != "none":
        partition += f", labels permuted per {config.permute_labels}"
    return f"{config.dataset}, {config.num_clients} clients, {partition}"


def divergence_knobs(config) -> str:
    """The settings of a resolved config that usually make a run diverge, as `name=value` pairs."""
    knobs = [f"optimizer={config.optimizer}", f"learning_rate={config.learning_rate:g}"]
    if config.optimizer == "sgd":
        knobs.append(f"momentum={config.momentum:g}")
    knobs.append(
        f"local_steps={config.local_steps}" if config.local_steps else f"local_epochs={config.local_epochs}"
    )
    knobs.append(f"batch_size={config.batch_size}")
    if config.dp.enabled:
        k = config.clients_per_round or config.num_clients
        std = config.dp.noise_multiplier * config.dp.clip_norm / k
        knobs.append(
            f"dp.noise_multiplier={config.dp.noise_multiplier:g} and dp.clip_norm={config.dp.clip_norm:g} "
            f"(noise std {std:.3g} on each coordinate of the mean update of {k} clients)"
        )
    options = config[config.algorithm] if config.algorithm in config else {}
    named = DIVERGENCE_KNOBS.get(config.algorithm, ())
    for option, value in sorted(options.items()):
        if option.endswith("lr") or option in named:
            knobs.append(f"{config.algorithm}.{option}={value}")
    return ", ".join(knobs)


def divergence_advice(config) -> str:
    """Concrete smaller settings to try: the learning rate and every positive `*lr`
    option of the algorithm divided by 10, and no momentum under SGD with momentum."""
    tries = [f"--config.learning_rate={config.learning_rate / 10:g}"]
    options = config[config.algorithm] if config.algorithm in config else {}
    for option, value in sorted(options.items()):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if option.endswith("lr") and number and 0 < value < float("inf"):
            tries.append(f"--config.{config.algorithm}.{option}={value / 10:g}")
    if config.optimizer == "sgd" and config.momentum:
        tries.append("--config.momentum=0")
    if config.dp.enabled and config.dp.noise_multiplier > 0:
        tries.append(f"--config.dp.clip_norm={config.dp.clip_norm / 2:g} (half the noise, more clipping)")
    return " or ".join(tries)


def run_settings(config) -> RunSettings:
    """The RunSettings of a resolved config (`resolve`): what the run loop and reports read."""
    dp = config.dp
    accounting = None
    if dp.enabled:
        accounting = Accounting(
            float(dp.noise_multiplier),
            float(dp.clip_norm),
            dp_delta(config),
            float(dp.target_epsilon),
            config.num_clients,
            config.clients_per_round or config.num_clients,
        )
    schedule = Schedule(config.rounds, config.eval_every, config.checkpoint_every, config.block_rounds)
    return RunSettings(
        config.algorithm,
        config.seed,
        config.dataset,
        partition_name(config),
        config.num_clients,
        data_title(config),
        schedule,
        Placement(config.client_storage, bool(config.replicate_data), config.clients_per_round or None),
        accounting,
        divergence_knobs(config),
        divergence_advice(config),
    )


class Prepared(NamedTuple):
    """Everything a run needs, built and validated before training.

    Attributes:
      fed_data: the federated data.
      model: the client model.
      algorithm: the algorithm (per-client work spread over `mesh`).
      mesh: the 'clients' device mesh (pfljax.runtime.sharding).
    """

    fed_data: FederatedData
    model: Model
    algorithm: Algorithm
    mesh: Any
    config: Any = None
    notes: tuple = ()
    warnings: tuple = ()
    initial_params: Any = None  # config.init_params' variables (numpy), or None
    settings: RunSettings | None = None  # what the run loop and reports read (`run_settings`)


def with_clients(config, fed_data: FederatedData):
    """`config` with num_clients 0 (every user of a natural data set) set to the users
    read; ConfigError for clients_per_round above them."""
    if config.num_clients:
        return config
    count = int(fed_data.data.train.count.shape[0])
    if config.clients_per_round > count:
        raise ConfigError(
            f"config.clients_per_round={config.clients_per_round} is above the {count} users of "
            f"{config.dataset!r} (config.num_clients=0: every user); "
            f"give --config.clients_per_round <= {count}"
        )
    with config.unlocked():
        config.num_clients = count
    return config


def prepare(config, fed_data: FederatedData | None = None, one_device: bool = False) -> Prepared:
    """Validates `config` and builds data, model, algorithm and mesh (ConfigError if invalid).

    Args:
      config: a ConfigDict with the fields of `base_config()`.
      fed_data: reuse these data instead of building them (e.g. several
        algorithms on the same partition).
      one_device: a mesh of one device whatever `num_devices` says (a sweep's
        replicas run as one program on one device).

    Returns:
      Prepared, whose `config` is the resolved config (`resolve`), `notes` the
      lines saying which data and defaults a run uses, `warnings` the lines about
      data that differ from what the config seems to ask for, `settings` its
      RunSettings (`run_settings`). Nothing is logged
      here: the caller logs them once every check has passed.
    """
    from pfljax.runtime.sharding import client_mesh  # pylint: disable=import-outside-toplevel

    config, notes = resolve(config)
    if fed_data is None:
        # Host storage: the data are built in host memory (the CPU device), never on an accelerator.
        host = config.client_storage == "host"
        with jax.default_device(jax.local_devices(backend="cpu")[0]) if host else contextlib.nullcontext():
            fed_data = make_data(config)
    config = with_clients(config, fed_data)
    model = make_model(config, fed_data)
    initial = load_initial_params(config, model)
    mesh = client_mesh(1 if one_device or config.client_storage == "host" else config.num_devices)
    algorithm = make_algorithm(
        config, model, make_client_map(config, mesh if mesh.size > 1 else None), fed_data.task
    )
    notes = (data_note(config), *notes)
    if initial is not None:
        notes = (*notes, _starting_weights_note(config))
    warnings = tuple(data_warnings(config, fed_data))
    return Prepared(fed_data, model, algorithm, mesh, config, notes, warnings, initial, run_settings(config))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
