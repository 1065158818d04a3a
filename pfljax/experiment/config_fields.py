"""The common config fields, each written once: its default, its domain and its help line.

`pfljax.experiment.config.base_config` builds the schema from `FIELDS` (in this order,
then each algorithm's options), `validate` checks every numeric field against its domain
and `--help` prints the help lines. A default or a domain that depends on something else
is a function: of nothing (whether the Fashion-MNIST files are installed) for a default,
of the config for a domain (clients_per_round <= num_clients).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from pfljax.core.domains import Domain

IDX_DIR = "/usr/share/datasets/fashion-mnist"


def fashion_mnist_available(data_dir: str = IDX_DIR) -> bool:
    return os.path.exists(os.path.join(data_dir, "train-images-idx3-ubyte.gz"))


@dataclasses.dataclass(frozen=True)
class Field:
    """One common field.

    Attributes:
      default: its value in `base_config()`, or a function giving it.
      help: one line for --help (allowed values, what 0 or "auto" mean).
      domain: a numeric field's Domain, or a function of the config giving it; None otherwise.
    """

    default: Any
    help: str = ""
    domain: Domain | Callable[[Any], Domain] | None = None

    def value(self) -> Any:
        return self.default() if callable(self.default) else self.default


def _float_unset():
    return ml_collections.config_dict.placeholder(float)


def _dataset() -> str:
    return "fashion_mnist" if fashion_mnist_available() else "simulation"


def _partition() -> str:
    return "classes" if fashion_mnist_available() else "iid"


def _sample_cap() -> int:
    return 1000 if fashion_mnist_available() else 0


def source_options() -> ml_collections.ConfigDict:
    """Options of the built-in sources, all unset (None) so `--config.source.<name>=v`
    can set them: the simulation's (samples_per_client, d, m, p, alpha,
    noise_scale, label_rule), standardize / splits / prepare_from (Fashion-MNIST,
    TFDS), and pixel_scale (Fashion-MNIST: "unit" [0, 1], "symmetric" [-1, 1] as
    PFLlib's ToTensor + Normalize(0.5, 0.5)), min_samples and users (LEAF, TFF: keep
    users with at least min_samples samples, then the "first" or a "random"
    num_clients of them). Only the ones set are passed to the source."""
    ph = ml_collections.config_dict.placeholder
    types = {"samples_per_client": int, "d": int, "m": int, "p": float, "alpha": float, "noise_scale": float}
    types.update(label_rule=str, standardize=bool, splits=tuple, prepare_from=str, pixel_scale=str)
    types.update(min_samples=int, users=str)
    return ml_collections.ConfigDict({name: ph(kind) for name, kind in types.items()})


def _model_kwargs() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"hidden": (200,)})


def _dp() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        {"enabled": False, "noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 0.0, "target_epsilon": 0.0}
    )


# The natural federated data sets (pfljax.data.leaf, pfljax.data.tff_h5): users as clients.
NATURAL_DATASETS = ("leaf_femnist", "leaf_shakespeare", "tff_emnist", "tff_shakespeare")


def _num_clients(config) -> Domain:
    if config.dataset in NATURAL_DATASETS:
        return Domain(0, integer=True, note="0: every user of the data set")
    return Domain(1, integer=True)


def _clients_per_round(config) -> Domain:
    if not config.num_clients:  # every user: checked against their number once the data are read
        return Domain(0, integer=True, note="0: all clients")
    note = f"num_clients={config.num_clients}; 0: all clients"
    return Domain(0, config.num_clients, integer=True, note=note)


def _num_devices(config) -> Domain:
    del config
    return Domain(0, jax.device_count(), integer=True, note="0: all visible devices")


FIELDS = {
    # What to run.
    "algorithm": Field("fedavg", "one of pfljax.algorithms.available()"),
    "seed": Field(
        0, "seed of initialization, sampling and (data_seed -1) the data; >= 0", Domain(0, integer=True)
    ),
    # Data (pfljax.data.build_federated_data).
    "dataset": Field(
        _dataset,
        "fashion_mnist, simulation, tfds:<name>, leaf_femnist, leaf_shakespeare, tff_emnist or "
        "tff_shakespeare (default: fashion_mnist where its IDX files are, else simulation)",
    ),
    "data_dir": Field(
        "",
        "directory of the data files ('' : the source's default; LEAF: its data/ dir; "
        "TFF: the .h5 files' dir)",
    ),
    "data_seed": Field(-1, "seed of the partition; -1: seed", Domain(-1, integer=True, note="-1: use seed")),
    "partition": Field(
        _partition,
        "iid, dirichlet, shards, classes, dominant, groups, pfllib_dirichlet, pfllib_pathological "
        "(per-client sources: iid)",
    ),
    "dirichlet_alpha": Field(0.5, "> 0, partition=dirichlet/pfllib_dirichlet", Domain(0, low_open=True)),
    "classes_per_client": Field(
        4, ">= 1, partition=classes/shards/pfllib_pathological", Domain(1, integer=True)
    ),
    "num_dominant": Field(2, ">= 1, partition=dominant", Domain(1, integer=True)),
    "dominant_fraction": Field(0.8, "in (0, 1], partition=dominant", Domain(0, 1, low_open=True)),
    "num_groups": Field(2, ">= 1, partition=groups or permute_labels=group", Domain(1, integer=True)),
    "group_relabel": Field(True, "partition=groups: relabel each group's classes 0..K/G-1"),
    "group_assignment": Field(
        "balanced",
        "partition=groups: balanced (client c in group floor(c G / C)), random or random_nonempty "
        "(seeded, FedeRiCo's paper)",
    ),
    "permute_labels": Field("none", "none, client or group"),
    "samples_per_client": Field(
        _sample_cap, "cap per client (class-stratified); 0: no cap", Domain(0, integer=True, note="0: no cap")
    ),
    "test_fraction": Field(
        0.2,
        "share of each client's samples held out for test, in (0, 1)",
        Domain(0, 1, low_open=True, high_open=True),
    ),
    "test_split": Field(
        "stratified",
        "stratified (by label) or pfllib (PFLlib's shuffled train_test_split on its numpy stream)",
    ),
    "source": Field(source_options, "source options, unset by default (config.source.<option>)"),
    # Federation.
    "num_clients": Field(10, ">= 1; natural data sets (leaf_*, tff_*): 0 is every user", _num_clients),
    "clients_per_round": Field(0, "0: all clients, else in [1, num_clients]", _clients_per_round),
    "rounds": Field(20, ">= 1", Domain(1, integer=True)),
    # Local training (pfljax.core.LocalTraining).
    "local_steps": Field(
        0, "local steps per round; 0: use local_epochs", Domain(0, integer=True, note="0: use local_epochs")
    ),
    "local_epochs": Field(
        1, ">= 1; used when local_steps is 0", Domain(1, integer=True, note="used when local_steps is 0")
    ),
    "batch_size": Field(32, ">= 1", Domain(1, integer=True)),
    "drop_last": Field(
        False, "drop each epoch's last incomplete batch (floor(n / batch_size) steps; PFLlib's)"
    ),
    "optimizer": Field("auto", "auto (the method's: adam for federico, else sgd), sgd, adam, adamw"),
    "learning_rate": Field(
        _float_unset,
        "> 0; unset: the optimizer's default (sgd 0.05, adam 1e-3)",
        Domain(0, low_open=True, note="unset: the optimizer's default"),
    ),
    "momentum": Field(
        _float_unset,
        "sgd momentum in [0, 1); unset: 0.9 (pfedme: 0, as its paper)",
        Domain(0, 1, high_open=True),
    ),
    "weight_decay": Field(0.0, ">= 0", Domain(0)),
    # Server optimizer (methods with a server_lr; pfljax.core.aggregate.server_update).
    "server_optimizer": Field(
        "none",
        "none (the method's server_lr step), sgd (FedAvgM), adam (FedAdam), yogi (FedYogi), adagrad "
        "(FedAdagrad): an optax optimizer stepped on global - mean client model",
    ),
    "server_learning_rate": Field(1.0, "> 0: the server optimizer's learning rate", Domain(0, low_open=True)),
    "server_momentum": Field(
        0.9, "in [0, 1): sgd's momentum (0: none), adam's and yogi's b1", Domain(0, 1, high_open=True)
    ),
    "server_epsilon": Field(
        1e-3, "> 0: adam's, yogi's and adagrad's eps (Reddi et al.'s tau)", Domain(0, low_open=True)
    ),
    "loss": Field("auto", "auto (by the data's task), cross_entropy, mse, token_cross_entropy"),
    # Model (pfljax.models.build_model).
    "model": Field("mlp", "a pfljax.models.MODELS name; model_kwargs go to it"),
    "model_kwargs": Field(_model_kwargs, "arguments of the model (config.model_kwargs.<arg>)"),
    "init_params": Field(
        "",
        ".npz of starting weights for every client (flax layout or a torch state_dict); '{seed}' in the "
        "path: the seed; '': the model's own initialisation",
    ),
    # Execution and outputs.
    "client_map": Field("auto", "auto, vmap, map"),
    "chunk_size": Field(0, ">= 0 (0: no chunks)", Domain(0, integer=True, note="0: no chunks")),
    "local_loop": Field("auto", "auto, scan, while (same numbers; auto: while on CPU)"),
    "num_devices": Field(0, "devices the clients are sharded over; 0: all", _num_devices),
    "replicate_data": Field(False, "with several devices: the data on every device"),
    "eval_every": Field(1, ">= 1 rounds between evaluations", Domain(1, integer=True)),
    "checkpoint_every": Field(
        5,
        ">= 0 rounds between checkpoints (0: only at the end)",
        Domain(0, integer=True, note="0: only at the end"),
    ),
    "block_rounds": Field(
        0,
        ">= 0 rounds per compiled block (0: auto, up to the next checkpoint or the end)",
        Domain(0, integer=True, note="0: auto"),
    ),
    "client_storage": Field(
        "device",
        "device (every client on the device) or host (clients in host memory, a round's participants moved "
        "to one device, the next round's prefetched)",
    ),
    # Client-level differential privacy (pfljax.core.privacy, DP-FedAvg).
    "dp": Field(
        _dp,
        "client-level DP: each upload clipped to clip_norm, Gaussian noise noise_multiplier * clip_norm "
        "on the sum; delta 0: min(1e-5, 1/num_clients^1.1); target_epsilon 0: no budget",
    ),
}
