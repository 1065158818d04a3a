"""Federated data: a source, partitioned among clients, as a ClientPool per split.

`build_federated_data` turns a source (see `sources`) into `FederatedData`,
whose train and test data are `ClientPool`s (pfljax.core.types): every client's
rows once, unpadded, at the source's dtype (Fashion-MNIST and uint8 TFDS images
stay uint8 codes with a 256-entry table of their float values):

* Pooled sources (Fashion-MNIST, TFDS): the source's train and test splits are
  pooled, partitioned among clients (`partition`), optionally capped
  (`samples_per_client`, class-stratified), then each client's share is split
  into train/test with `test_fraction`, stratified by label (`test_split=
  "stratified"`) or as PFLlib splits it (`test_split="pfllib"`: sklearn's shuffled
  train_test_split on PFLlib's numpy stream, `partition.pfllib_train_test_split`).
* Per-client sources (the FedFac simulation, the "sine" toy): the data are
  already per client; only `partition="iid"` is accepted and means "keep the
  generator's clients" (the partition arguments are ignored); the cap and the
  train/test split apply as above (stratified by label; random for
  real-valued targets). A per-client source with its own test split
  (`PerClient.test`: LEAF, TFF) keeps it: no test_fraction split, no cap.

Labels may then be transformed per client: with `partition="groups"` and
`group_relabel=True` each group's classes are relabelled 0..k-1 (k = K // G,
in ascending order of the original class ids), so one global model meets
conflicting labels across groups; `permute_labels` applies a permutation per
client or per group on top of any partition (`partition.label_maps`).

`pool_clients` builds a ClientPool from per-client arrays; `pad_clients` the
zero-padded [C, n_max, ...] ClientArrays (for tests and hand-built data).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from pfljax.core.types import ClientArrays, ClientData, ClientPool
from pfljax.data import partition as part
from pfljax.data import sources

PARTITIONS = ("iid", "dirichlet", "shards", "classes", "dominant", "groups")
PARTITIONS += ("pfllib_dirichlet", "pfllib_pathological")  # PFLlib's "dir" and "pat"
# How each client's share is split into train and test (`test_split`).
TEST_SPLITS = ("stratified", "pfllib")


class FederatedData(NamedTuple):
    """Client data ready for an Algorithm, plus what describes it.

    Attributes:
      data: ClientData of ClientPools: each client's rows once, unpadded, at
        the source's dtype (images as uint8 codes, converted to float32 inside
        jit; generated inputs float32), y int32 [N] (see
        pfljax.core.types.ClientPool).
      num_classes: number of labels the model must output.
      input_shape: shape of one input, e.g. (28, 28, 1).
      summary: JSON-serializable description (per-client train/test sizes,
        classes, per-class train/test counts `train_class_counts` /
        `test_class_counts` over the model's labels, groups, label maps; totals).
      truth: generator parameters of a simulated source, else None.
      task: "classification", or "regression" for a per-client source with
        real-valued targets (y float32 [N, *target]; no label maps,
        random caps and splits; train with the "mse" loss), or "sequence" for
        integer targets per token (y int32 [N, T], TFF's Shakespeare; train
        with the "token_cross_entropy" loss).
    """

    data: ClientData
    num_classes: int
    input_shape: tuple
    summary: dict
    truth: dict[str, Any] | None
    task: str = "classification"


def pad_clients(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> ClientArrays:
    """Stacks per-client arrays into zero-padded client arrays.

    Args:
      xs: C arrays [n_c, *feature_shape].
      ys: C arrays [n_c] (integer labels) or [n_c, *target] (float targets).

    Returns:
      ClientArrays with x float32 [C, n_max, *feature_shape], y int32 [C,
      n_max] (or float32 [C, n_max, *target]) and count int32 [C], as jax
      arrays; n_max = max(n_c, 1) and padded rows are zero.
    """
    check_client_lists(xs, ys, "pad_clients")
    counts = np.array([len(x) for x in xs], np.int32)
    n_max = max(int(counts.max(initial=0)), 1)
    y_dtype = np.int32 if np.issubdtype(np.asarray(ys[0]).dtype, np.integer) else np.float32
    x = np.zeros((len(xs), n_max) + np.shape(xs[0])[1:], np.float32)
    y = np.zeros((len(ys), n_max) + np.shape(ys[0])[1:], y_dtype)
    for c, (xc, yc) in enumerate(zip(xs, ys, strict=True)):
        x[c, : len(xc)] = xc
        y[c, : len(yc)] = yc
    return ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.asarray(counts))


def check_client_lists(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], call: str) -> None:
    """ValueError unless xs and ys hold the same number of clients, each client as
    many rows of x as of y, and every client the trailing shape of client 0's."""
    if len(xs) != len(ys):
        raise ValueError(
            f"{call}: xs has {len(xs)} clients but ys has {len(ys)}; give one array of each per client"
        )
    shapes = {"xs": [np.shape(x) for x in xs], "ys": [np.shape(y) for y in ys]}
    for name, per_client in shapes.items():
        for c, shape in enumerate(per_client):
            if len(shape) < 1:
                raise ValueError(
                    f"{call}: {name}[{c}] must be an array [n_c, ...] of rows, got shape {shape}"
                )
            if shape[1:] != per_client[0][1:]:
                raise ValueError(
                    f"{call}: {name}[{c}] has rows of shape {shape[1:]} but {name}[0] has "
                    f"{per_client[0][1:]}; every client's rows must have the same shape"
                )
    for c, (x_shape, y_shape) in enumerate(zip(shapes["xs"], shapes["ys"], strict=True)):
        if x_shape[0] != y_shape[0]:
            raise ValueError(
                f"{call}: client {c} has {x_shape[0]} rows in xs[{c}] but {y_shape[0]} in ys[{c}]"
            )


def pool_clients(
    xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], levels: np.ndarray | None = None
) -> ClientPool:
    """Every client's rows once, unpadded, as a ClientPool (at the inputs' dtype).

    Args:
      xs: C arrays [n_c, *feature_shape]: float values, integer codes into
        `levels` (e.g. uint8 pixels), or (levels None) integer token ids, kept int32.
      ys: C arrays [n_c] (integer labels) or [n_c, *target] (float targets).
      levels: [L] float32 value of each code, or None (xs are float values).

    The largest client is stored last, so every client's view window
    [offset, offset + n_max) lies inside the pool without padding rows.
    ValueError naming the argument and the first mismatching client when xs and
    ys differ in length, a client's xs and ys in rows, or clients in trailing shape.
    """
    check_client_lists(xs, ys, "pool_clients")
    counts = np.array([len(x) for x in xs], np.int32)
    n_max = max(int(counts.max(initial=0)), 1)
    order = [c for c in range(len(xs)) if c != int(np.argmax(counts))] + [int(np.argmax(counts))]
    offsets = np.zeros(len(xs), np.int32)
    offsets[order] = np.concatenate([[0], np.cumsum(counts[order])[:-1]]).astype(np.int32)
    y_dtype = np.int32 if np.issubdtype(np.asarray(ys[0]).dtype, np.integer) else np.float32
    x_dtype = np.asarray(xs[0]).dtype
    if levels is None:  # token ids (text) stay integers, int32; other inputs float32
        x_dtype = np.int32 if np.issubdtype(x_dtype, np.integer) else np.float32
    x = np.concatenate([np.asarray(xs[c], x_dtype) for c in order])
    y = np.concatenate([np.asarray(ys[c], y_dtype) for c in order])
    if len(x) < n_max:  # only when every client is empty: one zero row
        x = np.zeros((n_max,) + x.shape[1:], x.dtype)
        y = np.zeros((n_max,) + y.shape[1:], y.dtype)
    return ClientPool(
        jnp.asarray(x),
        jnp.asarray(y),
        jnp.asarray(offsets),
        jnp.asarray(counts),
        None if levels is None else jnp.asarray(levels, jnp.float32),
        n_max=n_max,
    )


def build_federated_data(
    dataset: str | DataSpec,
    num_clients: int | None = None,
    *,
    partition: str = "iid",
    dirichlet_alpha: float = 0.5,
    classes_per_client: int = 2,
    num_dominant: int = 2,
    dominant_fraction: float = 0.8,
    num_groups: int = 2,
    group_relabel: bool = True,
    group_assignment: str = "balanced",
    permute_labels: str = "none",
    samples_per_client: int | None = None,
    test_fraction: float = 0.2,
    test_split: str = "stratified",
    min_samples_per_client: int = 10,
    seed: int = 0,
    data_dir: str | None = None,
    source_kwargs: dict[str, Any] | None = None,
) -> FederatedData:
    """Builds every client's train and test rows, as ClientPools, from a named source.

    Args:
      dataset: "fashion_mnist", "simulation", "sine", "tfds:<name>" or another
        registered source (see sources.load_source); or a `DataSpec` holding
        every argument (then give no other).
      num_clients: C >= 1; 0 for a source of users (LEAF, TFF): every user.
      partition: one of PARTITIONS (pooled sources); per-client sources
        accept only "iid". "pfllib_dirichlet" / "pfllib_pathological" are
        PFLlib's "dir" / "pat" splits (partition.pfllib_*: RandomState(seed),
        PFLlib's own minimum client size; dirichlet_alpha / classes_per_client).
      dirichlet_alpha: Dirichlet concentration (> 0), partition="dirichlet".
      classes_per_client: classes per client (1..K), "shards" and "classes".
      num_dominant: dominant classes per client (1..K-1), "dominant".
      dominant_fraction: their share of a client's samples, in (0, 1].
      num_groups: G in [1, C] (and <= K for "groups"), used by
        partition="groups" and permute_labels="group"; which client is in
        which group: `group_assignment`.
      group_relabel: with "groups", relabel each group's classes 0..K//G-1
        (not in FedeRiCo's paper, which keeps the K source labels: False).
      group_assignment: "balanced" (client c in group floor(c * G / C), the
        default), "random" (each client's group drawn uniformly, as
        in FedeRiCo's paper) or "random_nonempty" (redrawn until no group is
        empty); random draws use default_rng([seed, 1]), so they leave the
        partition's other draws unchanged (partition.assign_groups).
      permute_labels: "none", "client" or "group" (see partition.label_maps).
      samples_per_client: cap per client (class-stratified) before the split; None: none.
      test_fraction: share of each client's samples held out, in (0, 1).
      test_split: one of TEST_SPLITS, "stratified" or "pfllib" (see `_split_one`).
      min_samples_per_client: minimum client size for "dirichlet".
      seed: seeds the partition, cap, split, permutations and generated sources.
      data_dir: source directory (IDX files, TFDS data_dir).
      source_kwargs: extra options for the source (e.g. samples_per_client,
        p, alpha for the simulation; standardize; prepare_from for TFDS).

    Returns:
      FederatedData (data: ClientData of two ClientPools, see FederatedData).

    Raises:
      ValueError: naming the offending argument and its allowed values, for
        every invalid input, before any data is read where possible.
    """
    if isinstance(dataset, DataSpec):
        others = {k: v for k, v in locals().items() if k != "dataset"}
        given = sorted(k for k, v in others.items() if v != DataSpec._field_defaults.get(k))
        if given:
            raise TypeError(f"build_federated_data: a DataSpec holds every argument; also given: {given}")
        return build_federated_data(**dataset._asdict())
    if num_clients is None:
        raise TypeError("build_federated_data: num_clients is required (or give a DataSpec)")
    return _build(DataSpec(**locals()))  # the arguments by name (locals() holds just them)


def _build(o: DataSpec) -> FederatedData:
    """The FederatedData of the arguments `o` (see `build_federated_data`)."""
    spec = sources.source_spec(o.dataset)
    source = None
    if o.num_clients == 0 and spec.users:  # every user: C is known once the source is read
        source = _load_source(o, spec)
        o = o._replace(num_clients=len(source.xs))
    _check_options(o, spec)
    group_ids = _group_ids(o)
    source = _load_source(o, spec) if source is None else source
    _check_class_args(o, source.num_classes)
    rngs = (np.random.default_rng(o.seed), _pfllib_stream(o))  # see _partition, _split_one
    share = _client_shares(o, spec, source, rngs, group_ids)
    maps, model_classes = _label_maps(o, source.num_classes, share.class_sets, group_ids)
    splits, clients = _split_clients(o, share, maps, model_classes, group_ids, rngs)
    train, test = (pool_clients(*splits[s], share.levels) for s in ("train", "test"))
    input_shape = tuple(int(s) for s in train.x.shape[1:])
    summary = _summary(o, share, source.num_classes, model_classes, input_shape, clients)
    return FederatedData(
        ClientData(train, test), model_classes, input_shape, summary, share.truth, summary["task"]
    )


class DataSpec(NamedTuple):
    """Which federated data to build: `build_federated_data`'s arguments as one value
    (same names, same defaults; see its docstring). `build_federated_data(spec)` builds it."""

    dataset: str
    num_clients: int
    partition: str = "iid"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    num_dominant: int = 2
    dominant_fraction: float = 0.8
    num_groups: int = 2
    group_relabel: bool = True
    group_assignment: str = "balanced"
    permute_labels: str = "none"
    samples_per_client: int | None = None
    test_fraction: float = 0.2
    test_split: str = "stratified"
    min_samples_per_client: int = 10
    seed: int = 0
    data_dir: str | None = None
    source_kwargs: dict[str, Any] | None = None

    @property
    def uses_groups(self) -> bool:
        """Whether clients have groups: partition "groups" or permute_labels "group"."""
        return self.partition == "groups" or self.permute_labels == "group"


class _Shares(NamedTuple):
    """Every client's share of the source, before its train/test split.

    Attributes:
      pools: C (x, y) pairs, the arrays a client's indices point into: the pooled
        data set (the same arrays for every client) or the client's generated data.
      parts: C int index arrays into the client's pool (capped).
      class_sets: [G, k] classes of each group for partition "groups", else None.
      truth: generator parameters of a simulated source, else None.
      regression: whether the targets are real-valued.
      levels: [256] float32 value of each uint8 code of the pools' x, or None
        (x holds the values).
      fixed: None, or C (train, test) positions into each client's part: the
        source's own split (PerClient.test), kept instead of drawing one.
    """

    pools: list[tuple[np.ndarray, np.ndarray]]
    parts: list[np.ndarray]
    class_sets: np.ndarray | None
    truth: dict[str, Any] | None
    regression: bool
    levels: np.ndarray | None = None
    fixed: list[tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def task(self) -> str:
        """FederatedData.task: regression (real-valued targets), sequence (integer
        targets per token) or classification."""
        if self.regression:
            return "regression"
        return "sequence" if np.ndim(self.pools[0][1]) > 1 else "classification"

    @property
    def strata(self) -> list[np.ndarray]:
        """What caps and splits are stratified by: each pool's labels (real-valued
        and per-token targets count as one class)."""
        one = self.task != "classification"
        return [np.zeros(len(y), np.int32) if one else y for _, y in self.pools]


def _check_options(o: DataSpec, spec: sources.SourceSpec) -> None:
    """Every check that needs no data (ValueError naming the argument)."""
    _check_args(o, spec.per_client)
    if spec.num_classes is not None:
        _check_class_args(o, spec.num_classes)
    if o.group_assignment not in part.GROUP_ASSIGNMENTS:
        raise ValueError(
            f"group_assignment must be one of {part.GROUP_ASSIGNMENTS}, got {o.group_assignment!r}."
        )


def _pfllib_stream(o: DataSpec) -> np.random.RandomState | None:
    """numpy's legacy RandomState(seed), PFLlib's `np.random.seed(seed)` global stream,
    where a pfllib_* partition or the "pfllib" split draws from it; else None."""
    if o.partition.startswith("pfllib_") or o.test_split == "pfllib":
        return np.random.RandomState(o.seed)
    return None


def _group_ids(o: DataSpec) -> np.ndarray:
    """[C] group of each client: drawn by `group_assignment` where groups are used
    (default_rng([seed, 1]): the other draws stay unchanged), else balanced."""
    if o.uses_groups:
        return part.assign_groups(o.num_clients, o.num_groups, [o.seed, 1], o.group_assignment)
    return part.client_groups(o.num_clients, o.num_groups)


def _load_source(o: DataSpec, spec: sources.SourceSpec) -> sources.Pooled | sources.PerClient:
    """Loads the source; a per-client one is asked for num_clients clients."""
    kwargs = dict(o.source_kwargs or {})
    if spec.per_client and kwargs.setdefault("num_clients", o.num_clients) != o.num_clients:
        raise ValueError(
            f"source_kwargs['num_clients']={kwargs['num_clients']} != num_clients={o.num_clients}."
        )
    return spec.load(data_dir=o.data_dir, seed=o.seed, **kwargs)


def _client_shares(o: DataSpec, spec, source, rngs, group_ids) -> _Shares:
    """Each client's share: a per-client source's clients as generated, or the pooled
    source partitioned; then capped at samples_per_client (class-stratified).
    rngs: (Generator, PFLlib's RandomState stream or None)."""
    rng = rngs[0]
    if spec.per_client:
        share = _per_client_shares(o, source)
    else:
        share = _pooled_shares(o, source, rngs, group_ids)
    if o.samples_per_client is None:
        return share
    if share.fixed is not None:
        raise ValueError(
            f"samples_per_client={o.samples_per_client}: dataset={o.dataset!r} has its own train/test "
            f"split per client, which a cap would cut; use samples_per_client=0 (none)"
        )
    parts = [
        part.cap_per_client([p], y, o.samples_per_client, rng)[0]
        for p, y in zip(share.parts, share.strata, strict=True)
    ]
    return share._replace(parts=parts)


def _per_client_shares(o: DataSpec, source: sources.PerClient) -> _Shares:
    """A per-client source's clients, every row of each."""
    if len(source.xs) != o.num_clients:
        raise ValueError(f"num_clients={o.num_clients} but the source made {len(source.xs)} clients.")
    regression = not np.issubdtype(np.asarray(source.ys[0]).dtype, np.integer)
    if regression and o.permute_labels != "none":
        raise ValueError(
            f"permute_labels={o.permute_labels!r}: dataset={o.dataset!r} has real-valued targets, "
            f"so permute_labels must be 'none'."
        )
    if source.test is None:
        pools = list(zip(source.xs, source.ys, strict=True))
        return _Shares(
            pools, [np.arange(len(y)) for y in source.ys], None, source.truth, regression, source.levels
        )
    n_train = [len(y) for y in source.ys]
    pools = [
        (np.concatenate([x, xt]), np.concatenate([y, yt]))
        for x, y, xt, yt in zip(source.xs, source.ys, *source.test, strict=True)
    ]
    fixed = [(np.arange(n), np.arange(n, len(y))) for n, (_, y) in zip(n_train, pools, strict=True)]
    parts = [np.arange(len(y)) for _, y in pools]
    return _Shares(pools, parts, None, source.truth, regression, source.levels, fixed)


def _pooled_shares(o: DataSpec, source: sources.Pooled, rngs, group_ids) -> _Shares:
    """A pooled source's train and test splits pooled, then partitioned among the clients."""
    x_all = np.concatenate([source.x_train, source.x_test])
    y_all = np.concatenate([source.y_train, source.y_test])
    if len(y_all) < o.num_clients:
        raise ValueError(
            f"num_clients={o.num_clients} exceeds the {len(y_all)} samples of dataset={o.dataset!r}."
        )
    parts, class_sets = _partition(o, y_all, source.num_classes, rngs, group_ids)
    return _Shares([(x_all, y_all)] * o.num_clients, parts, class_sets, None, False, source.levels)


def _split_clients(o: DataSpec, share: _Shares, maps, model_classes: int, group_ids, rngs):
    """Splits each client's share into train and test (`test_split`), labels mapped
    to the model's (maps[c]; real-valued targets as float32). rngs: (Generator,
    PFLlib's RandomState stream or None).

    Returns:
      ({"train": (xs, ys), "test": (xs, ys)}, each C arrays; C summary entries).

    Raises:
      ValueError: naming num_clients, for a client left without a training sample.
    """
    splits = {"train": ([], []), "test": ([], [])}
    clients = []
    for c, (idx, (x, y), strata) in enumerate(zip(share.parts, share.pools, share.strata, strict=True)):
        train_pos, test_pos = _split_one(o, strata[idx], rngs) if share.fixed is None else share.fixed[c]
        for name, pos in (("train", train_pos), ("test", test_pos)):
            targets = y[idx[pos]]
            splits[name][0].append(x[idx[pos]])
            splits[name][1].append(
                targets.astype(np.float32) if share.regression else maps[c][targets].astype(np.int32)
            )
        if len(train_pos) == 0:
            raise ValueError(
                f"num_clients={o.num_clients}: client {c} got no training "
                f"sample (dataset={o.dataset!r}, partition={o.partition!r}); use "
                f"fewer clients or a larger samples_per_client."
            )
        group = int(group_ids[c]) if o.uses_groups else None
        labels = None if share.regression else y[idx]
        y_train, y_test = splits["train"][1][-1], splits["test"][1][-1]
        clients.append(_client_summary(c, group, labels, maps[c], y_train, y_test, model_classes))
    return splits, clients


def _split_one(o: DataSpec, strata: np.ndarray, rngs) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) positions of one client's samples, by `test_split`: "stratified"
    (per label, round(test_fraction * n) test samples, partition.stratified_split,
    from the Generator rngs[0]) or "pfllib" (PFLlib's split_data: floor((1 -
    test_fraction) * n) train samples, one permutation per client in client order,
    from the RandomState rngs[1] right after a pfllib_* partition's draws, as
    PFLlib's global numpy stream; partition.pfllib_train_test_split)."""
    if o.test_split == "pfllib":
        return part.pfllib_train_test_split(len(strata), 1.0 - o.test_fraction, rngs[1])
    return part.stratified_split(strata, o.test_fraction, rngs[0])


def _client_summary(c: int, group, labels, label_map, y_train, y_test, model_classes: int) -> dict:
    """One client's summary entry; `labels` are its share's source labels (None:
    real-valued targets, whose label entries are empty)."""
    entry = {"client": c, "group": group, "train": int(len(y_train)), "test": int(len(y_test))}
    keys = ("classes", "source_classes", "label_map", "train_class_counts", "test_class_counts")
    if labels is None:
        return {**entry, **{k: [] for k in keys}}
    return {
        **entry,
        "classes": sorted(int(k) for k in np.unique(label_map[labels])),
        "source_classes": sorted(int(k) for k in np.unique(labels)),
        "label_map": label_map.tolist(),
        # Samples of each model label (0..num_classes-1) in the client's splits.
        "train_class_counts": _class_counts(y_train, model_classes),
        "test_class_counts": _class_counts(y_test, model_classes),
    }


def _summary(o: DataSpec, share: _Shares, num_classes: int, model_classes: int, input_shape, clients):
    """FederatedData.summary: the options, the shapes, and the clients' entries
    (test_split "source": the source's own per-client test rows)."""
    regression = share.regression
    return {
        "dataset": o.dataset,
        "task": share.task,
        "partition": o.partition if share.fixed is None else "users",  # the source's own clients
        "num_clients": o.num_clients,
        "num_classes": model_classes,
        "source_num_classes": int(num_classes),
        "input_shape": list(input_shape),
        "permute_labels": o.permute_labels,
        "num_groups": o.num_groups if o.uses_groups else None,
        "test_fraction": o.test_fraction,
        "test_split": o.test_split if share.fixed is None else "source",
        "seed": o.seed,
        "totals": {"train": sum(c["train"] for c in clients), "test": sum(c["test"] for c in clients)},
        # Source classes in no client's data (random class draws can leave some out).
        "unplaced_classes": [] if regression else unplaced_classes(clients, num_classes),
        "clients": clients,
    }


def unplaced_classes(clients: list[dict], num_classes: int) -> list[int]:
    """Source classes held by no client (summary["unplaced_classes"])."""
    return sorted(set(range(num_classes)) - set().union(*(c["source_classes"] for c in clients)))


def _class_counts(labels: np.ndarray, num_classes: int) -> list[int]:
    """[K] number of samples (per-token targets: tokens) of each label (summary only;
    reads, never changes, the data)."""
    return np.bincount(np.ravel(np.asarray(labels, np.int64)), minlength=num_classes)[:num_classes].tolist()


def _partition(o: DataSpec, labels, num_classes: int, rngs, group_ids):
    """Runs the named partitioner: (C index arrays, the groups' class sets for "groups"
    else None). PFLlib's splits draw from rngs[1], RandomState(seed) as PFLlib's
    np.random.seed (partition.pfllib_*); the others from the Generator rngs[0]."""
    c, k, (rng, legacy) = o.num_clients, o.classes_per_client, rngs
    if o.partition == "pfllib_dirichlet":
        return part.pfllib_dirichlet(labels, c, legacy, alpha=o.dirichlet_alpha), None
    if o.partition == "pfllib_pathological":
        return part.pfllib_pathological(labels, c, legacy, classes_per_client=k), None
    if o.partition == "iid":
        return part.iid(labels, c, rng), None
    if o.partition == "dirichlet":
        return part.dirichlet(
            labels, c, rng, alpha=o.dirichlet_alpha, min_size=o.min_samples_per_client
        ), None
    if o.partition == "shards":
        return part.shards(labels, c, rng, classes_per_client=k), None
    if o.partition == "classes":
        return part.classes(labels, c, rng, classes_per_client=k), None
    if o.partition == "dominant":
        fraction = o.dominant_fraction
        return part.dominant(labels, c, rng, num_dominant=o.num_dominant, dominant_fraction=fraction), None
    class_sets = part.group_class_sets(num_classes, o.num_groups, rng)
    return part.groups(labels, c, rng, class_sets=class_sets, group_ids=group_ids), class_sets


def _label_maps(o: DataSpec, num_classes: int, class_sets, group_ids):
    """Returns ([C, K] source label -> model label (-1: unused), model K)."""
    base = np.tile(np.arange(num_classes), (o.num_clients, 1))
    model_classes = num_classes
    if class_sets is not None and o.group_relabel:
        model_classes = len(class_sets[0])
        base = np.full((o.num_clients, num_classes), -1)
        for c in range(o.num_clients):
            base[c, class_sets[group_ids[c]]] = np.arange(model_classes)
    perm = part.label_maps(
        o.num_clients, model_classes, permute=o.permute_labels, seed=o.seed, group_ids=group_ids
    )
    maps = np.where(base >= 0, np.take_along_axis(perm, np.maximum(base, 0), 1), -1)
    return maps, model_classes


def _check_args(o: DataSpec, per_client: bool) -> None:
    """The checks of the arguments that need neither the data nor the number of classes."""
    num_clients, partition, alpha = o.num_clients, o.partition, o.dirichlet_alpha
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or (num_clients < 1):
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}.")
    if partition not in PARTITIONS:
        raise ValueError(f"partition={partition!r} is unknown; allowed values: {PARTITIONS}.")
    if per_client and partition != "iid":
        raise ValueError(
            f"partition={partition!r}: this dataset is generated "
            f"per client, so partition must be 'iid' (keep the "
            f"generator's clients)."
        )
    if o.permute_labels not in part.PERMUTE_MODES:
        raise ValueError(
            f"permute_labels={o.permute_labels!r} is unknown; allowed values: {part.PERMUTE_MODES}."
        )
    if partition in ("dirichlet", "pfllib_dirichlet") and not alpha > 0:
        raise ValueError(f"dirichlet_alpha must be > 0, got {alpha!r}.")
    if o.uses_groups and not (1 <= o.num_groups <= num_clients):
        raise ValueError(f"num_groups must be in [1, num_clients={num_clients}], got {o.num_groups!r}.")
    if o.samples_per_client is not None and not o.samples_per_client >= 1:
        raise ValueError(f"samples_per_client must be None or >= 1, got {o.samples_per_client!r}.")
    if not 0 < o.test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {o.test_fraction!r}.")
    if o.test_split not in TEST_SPLITS:
        raise ValueError(f"test_split={o.test_split!r} is unknown; allowed values: {TEST_SPLITS}.")
    if not o.min_samples_per_client >= 0:
        raise ValueError(f"min_samples_per_client must be >= 0, got {o.min_samples_per_client!r}.")


def _check_class_args(o: DataSpec, num_classes: int) -> None:
    """The checks of the partition's arguments against the number of classes K."""
    partition, k = o.partition, o.classes_per_client
    if partition in ("shards", "classes", "pfllib_pathological") and not 1 <= k <= num_classes:
        raise ValueError(f"classes_per_client must be in [1, num_classes={num_classes}], got {k!r}.")
    if partition in ("shards", "classes") and o.num_clients * k < num_classes:
        raise ValueError(
            f"num_clients={o.num_clients} x classes_per_client={k} < num_classes="
            f"{num_classes}: partition={partition!r} would leave classes in no client's data; "
            f"raise num_clients or classes_per_client."
        )
    if partition == "dominant":
        if not 1 <= o.num_dominant < num_classes:
            raise ValueError(
                f"num_dominant must be in [1, num_classes - 1 = {num_classes - 1}], got {o.num_dominant!r}."
            )
        if not 0 < o.dominant_fraction <= 1:
            raise ValueError(f"dominant_fraction must be in (0, 1], got {o.dominant_fraction!r}.")
    if partition == "groups" and o.num_groups > num_classes:
        raise ValueError(
            f"num_groups={o.num_groups} exceeds num_classes="
            f"{num_classes}: groups need disjoint label sets, so "
            f"num_groups must be in [1, {num_classes}]."
        )
