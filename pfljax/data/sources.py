"""Data sources by name, and the one entry point `load_source`.

A source is either *pooled* (one labelled data set with train/test splits, to
be partitioned among clients: Fashion-MNIST, any TFDS data set) or
*per-client* (a generator that already produces each client's data: the FedFac
simulation, the "sine" toy). Sources live in the `SOURCES` registry;
`register_source` adds one (`pfljax.data.sine` registers "sine" with
per_client=True). Names starting with "tfds:" are dispatched to TFDS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from pfljax.data import idx, simulation

TFDS_PREFIX = "tfds:"


class Pooled(NamedTuple):
    """A centralised labelled data set, to be partitioned among clients.

    Attributes:
      x_train: [N_train, *input_shape] float32, or uint8 codes into `levels`.
      y_train: [N_train] int32 labels in 0..num_classes-1.
      x_test: [N_test, *input_shape], as x_train.
      y_test: [N_test] int32.
      num_classes: number of classes K.
      levels: None, or [256] float32: the value of each uint8 code (images stay
        uint8 on device, 4x smaller; `values()` gives the floats).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    levels: np.ndarray | None = None

    def values(self, x: np.ndarray) -> np.ndarray:
        """x_train / x_test as float32 values."""
        return np.asarray(x, np.float32) if self.levels is None else self.levels[x]


class PerClient(NamedTuple):
    """Data already split by client.

    Attributes:
      xs: C arrays [n_c, *input_shape] float32.
      ys: C arrays [n_c] int32 labels, or [n_c, *target] float32 targets (a
        regression source, e.g. "sine").
      num_classes: number of classes K (a regression source: its outputs).
      truth: generator parameters (e.g. simulation.simulate_fedfac's) or None.
      levels: None, or [256] float32 value of each uint8 code of xs (as Pooled's).
      test: None (build_federated_data splits each client's rows with
        test_fraction), or the clients' own test rows (xs, ys), kept as they are
        (natural data sets: LEAF, TFF).
    """

    xs: list[np.ndarray]
    ys: list[np.ndarray]
    num_classes: int
    truth: dict[str, Any] | None
    levels: np.ndarray | None = None
    test: tuple[list[np.ndarray], list[np.ndarray]] | None = None


class SourceSpec(NamedTuple):
    """How to load a source.

    Attributes:
      load: callable(*, data_dir, seed, **kwargs) -> Pooled | PerClient;
        per-client sources also receive num_clients.
      per_client: True if `load` returns PerClient.
      num_classes: K when known before loading (for early validation), else
        None.
      users: its clients are a data set's users (LEAF, TFF): num_clients 0 keeps them all.
    """

    load: Callable[..., Pooled | PerClient]
    per_client: bool
    num_classes: int | None
    users: bool = False


def _fashion_mnist(*, data_dir=None, seed=0, standardize=False, pixel_scale="unit") -> Pooled:
    del seed  # deterministic source
    d = idx.load_fashion_mnist(data_dir, standardize=standardize, codes=True, pixel_scale=pixel_scale)
    return Pooled(d["x_train"], d["y_train"], d["x_test"], d["y_test"], 10, d["levels"])


def _simulation(*, data_dir=None, seed=0, num_clients=100, **kwargs) -> PerClient:
    del data_dir  # generated, nothing to read
    x, y, truth = simulation.simulate_fedfac(num_clients, seed=seed, **kwargs)
    return PerClient(list(x), list(y), 2, truth)


def _tfds(
    name: str, *, data_dir=None, seed=0, splits: tuple[str, ...] = ("train", "test"), **kwargs
) -> Pooled:
    """TFDS data set; the first split is x_train, the others form x_test."""
    del seed  # deterministic source
    from pfljax.data import tfds_source  # pylint: disable=import-outside-toplevel

    d = tfds_source.load_tfds(name, data_dir, splits=tuple(splits), codes=True, **kwargs)
    first, rest = splits[0], splits[1:]
    x_first, y_first = d[f"x_{first}"], d[f"y_{first}"]
    x_rest = np.concatenate([x_first[:0]] + [d[f"x_{s}"] for s in rest])
    y_rest = np.concatenate([y_first[:0]] + [d[f"y_{s}"] for s in rest])
    return Pooled(x_first, y_first, x_rest, y_rest, d["num_classes"], d["levels"])


SOURCES: dict[str, SourceSpec] = {
    "fashion_mnist": SourceSpec(_fashion_mnist, False, 10),
    "simulation": SourceSpec(_simulation, True, 2),
}


def register_source(
    name: str,
    load: Callable[..., Pooled | PerClient],
    *,
    per_client: bool,
    num_classes: int | None = None,
    users: bool = False,
) -> None:
    """Adds a source to `SOURCES` (e.g. sine.py's "sine", per_client=True).

    Args:
      name: dataset name; must not start with "tfds:".
      load: callable(*, data_dir, seed, **kwargs) -> Pooled | PerClient.
      per_client: whether `load` returns PerClient (then it gets num_clients).
      num_classes: K if known before loading.
      users: the clients are a data set's users (`load` takes num_clients 0: all of them).
    """
    if name.startswith(TFDS_PREFIX):
        raise ValueError(f"name={name!r}: the prefix {TFDS_PREFIX!r} is reserved for TFDS data sets.")
    SOURCES[name] = SourceSpec(load, per_client, num_classes, users)


def allowed_datasets() -> list[str]:
    """Names accepted by `load_source`'s `dataset` argument."""
    return sorted(SOURCES) + [TFDS_PREFIX + "<name>"]


def source_spec(dataset: str) -> SourceSpec:
    """Returns the SourceSpec of `dataset`.

    Raises:
      ValueError: naming `dataset` and listing the allowed values.
    """
    if isinstance(dataset, str):
        if dataset in SOURCES:
            return SOURCES[dataset]
        if dataset.startswith(TFDS_PREFIX) and len(dataset) > len(TFDS_PREFIX):
            name = dataset[len(TFDS_PREFIX) :]
            return SourceSpec(lambda **kw: _tfds(name, **kw), per_client=False, num_classes=None)
    raise ValueError(
        f"dataset={dataset!r} is unknown; allowed values: {allowed_datasets()} (e.g. 'tfds:cifar10')."
    )


def load_source(name: str, *, data_dir: str | None = None, seed: int = 0, **kwargs) -> Pooled | PerClient:
    """Loads a data source by name.

    Args:
      name: "fashion_mnist" (IDX files; kwargs: standardize, pixel_scale), "simulation"
        (FedFac model (8); kwargs: num_clients, samples_per_client, d, m, p,
        alpha, noise_scale, label_rule), "tfds:<name>" (kwargs: splits --
        default ("train", "test"); the first becomes x_train, the others are
        concatenated into x_test --, prepare_from, standardize), "sine"
        (kwargs: those of sine.make_sine_clients) or any other name added by
        `register_source`.
      data_dir: where the source reads from (IDX directory, TFDS data_dir);
        None means the source's default.
      seed: seed of generated sources.
      **kwargs: source-specific options.

    Returns:
      Pooled or PerClient.

    Raises:
      ValueError: naming `dataset` for an unknown name; sources raise
        ValueError naming `data_dir` when it lacks their files.
    """
    return source_spec(name).load(data_dir=data_dir, seed=seed, **kwargs)
