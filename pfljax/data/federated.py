"""Federated data: a source, partitioned among clients, as padded client arrays.

`build_federated_data` turns a source (see `sources`) into `FederatedData`:

* Pooled sources (Fashion-MNIST, TFDS): the source's train and test splits are
  pooled, partitioned among clients (`partition`), optionally capped
  (`samples_per_client`, class-stratified), then each client's share is split
  into train/test with `test_fraction`, stratified by label.
* Per-client sources (the FedFac simulation, a later "sine"): the data are
  already per client; only `partition="iid"` is accepted and means "keep the
  generator's clients" (the partition arguments are ignored); the cap and the
  stratified train/test split apply as above.

Labels may then be transformed per client: with `partition="groups"` and
`group_relabel=True` each group's classes are relabelled 0..k-1 (k = K // G,
in ascending order of the original class ids), so one global model meets
conflicting labels across groups; `permute_labels` applies a permutation per
client or per group on top of any partition (`partition.label_maps`).
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


class FederatedData(NamedTuple):
    """Client data ready for an Algorithm, plus what describes it.

    Attributes:
      data: ClientData of ClientPools: each client's rows once, unpadded,
        images as uint8 codes (converted to float32 inside jit), y int32 [N]
        (see pfljax.core.types.ClientPool).
      num_classes: number of labels the model must output.
      input_shape: shape of one input, e.g. (28, 28, 1).
      summary: JSON-serializable description (per-client train/test sizes,
        classes, per-class train/test counts `train_class_counts` /
        `test_class_counts` over the model's labels, groups, label maps; totals).
      truth: generator parameters of a simulated source, else None.
      task: "classification", or "regression" for a per-client source with
        real-valued targets (y float32 [N, *target]; no label maps,
        random caps and splits; train with the "mse" loss).
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
    counts = np.array([len(x) for x in xs], np.int32)
    n_max = max(int(counts.max(initial=0)), 1)
    y_dtype = np.int32 if np.issubdtype(np.asarray(ys[0]).dtype, np.integer) else np.float32
    x = np.zeros((len(xs), n_max) + np.shape(xs[0])[1:], np.float32)
    y = np.zeros((len(ys), n_max) + np.shape(ys[0])[1:], y_dtype)
    for c, (xc, yc) in enumerate(zip(xs, ys, strict=True)):
        x[c, : len(xc)] = xc
        y[c, : len(yc)] = yc
    return ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.asarray(counts))


def pool_clients(
    xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], levels: np.ndarray | None = None
) -> ClientPool:
    """Every client's rows once, unpadded, as a ClientPool (at the inputs' dtype).

    Args:
      xs: C arrays [n_c, *feature_shape]: float values, or integer codes into
        `levels` (e.g. uint8 pixels).
      ys: C arrays [n_c] (integer labels) or [n_c, *target] (float targets).
      levels: [L] float32 value of each code, or None (xs are float values).

    The largest client is stored last, so every client's view window
    [offset, offset + n_max) lies inside the pool without padding rows.
    """
    counts = np.array([len(x) for x in xs], np.int32)
    n_max = max(int(counts.max(initial=0)), 1)
    order = [c for c in range(len(xs)) if c != int(np.argmax(counts))] + [int(np.argmax(counts))]
    offsets = np.zeros(len(xs), np.int32)
    offsets[order] = np.concatenate([[0], np.cumsum(counts[order])[:-1]]).astype(np.int32)
    y_dtype = np.int32 if np.issubdtype(np.asarray(ys[0]).dtype, np.integer) else np.float32
    x_dtype = np.float32 if levels is None else np.asarray(xs[0]).dtype
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
    dataset: str,
    num_clients: int,
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
    min_samples_per_client: int = 10,
    seed: int = 0,
    data_dir: str | None = None,
    source_kwargs: dict[str, Any] | None = None,
) -> FederatedData:
    """Builds padded per-client train/test data from a named source.

    Args:
      dataset: "fashion_mnist", "simulation", "tfds:<name>" or a registered
        source (see sources.load_source).
      num_clients: C >= 1.
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
        default, unchanged), "random" (each client's group drawn uniformly, as
        in FedeRiCo's paper) or "random_nonempty" (redrawn until no group is
        empty); random draws use default_rng([seed, 1]), so they leave the
        partition's other draws unchanged (partition.assign_groups).
      permute_labels: "none", "client" or "group" (see partition.label_maps).
      samples_per_client: cap per client (class-stratified) before the
        train/test split; None for no cap.
      test_fraction: share of each client's samples held out, in (0, 1).
      min_samples_per_client: minimum client size for "dirichlet".
      seed: seeds the partition, cap, split, permutations and generated
        sources.
      data_dir: source directory (IDX files, TFDS data_dir).
      source_kwargs: extra options for the source (e.g. samples_per_client,
        p, alpha for the simulation; standardize; prepare_from for TFDS).

    Returns:
      FederatedData.

    Raises:
      ValueError: naming the offending argument and its allowed values, for
        every invalid input, before any data is read where possible.
    """
    spec = sources.source_spec(dataset)
    _check_args(
        num_clients,
        partition,
        dirichlet_alpha,
        num_groups,
        permute_labels,
        samples_per_client,
        test_fraction,
        min_samples_per_client,
        spec.per_client,
    )
    if spec.num_classes is not None:
        _check_class_args(
            spec.num_classes,
            partition,
            classes_per_client,
            num_dominant,
            dominant_fraction,
            num_groups,
            num_clients,
        )
    if group_assignment not in part.GROUP_ASSIGNMENTS:
        raise ValueError(
            f"group_assignment must be one of {part.GROUP_ASSIGNMENTS}, got {group_assignment!r}."
        )
    uses_groups = partition == "groups" or permute_labels == "group"
    group_ids = (
        part.assign_groups(num_clients, num_groups, [seed, 1], group_assignment)
        if uses_groups
        else part.client_groups(num_clients, num_groups)
    )
    kwargs = dict(source_kwargs or {})
    if spec.per_client:
        if kwargs.setdefault("num_clients", num_clients) != num_clients:
            raise ValueError(
                f"source_kwargs['num_clients']={kwargs['num_clients']} != num_clients={num_clients}."
            )
    source = spec.load(data_dir=data_dir, seed=seed, **kwargs)
    num_classes = source.num_classes
    _check_class_args(
        num_classes, partition, classes_per_client, num_dominant, dominant_fraction, num_groups, num_clients
    )
    rng = np.random.default_rng(seed)

    if spec.per_client:
        xs_src, ys_src = source.xs, source.ys
        if len(xs_src) != num_clients:
            raise ValueError(f"num_clients={num_clients} but the source made {len(xs_src)} clients.")
        pools = list(zip(xs_src, ys_src, strict=True))
        parts = [np.arange(len(y)) for y in ys_src]
        truth = source.truth
        regression = not np.issubdtype(np.asarray(ys_src[0]).dtype, np.integer)
        if regression and permute_labels != "none":
            raise ValueError(
                f"permute_labels={permute_labels!r}: dataset={dataset!r} has real-valued targets, "
                f"so permute_labels must be 'none'."
            )
    else:
        x_all = np.concatenate([source.x_train, source.x_test])
        y_all = np.concatenate([source.y_train, source.y_test])
        if len(y_all) < num_clients:
            raise ValueError(
                f"num_clients={num_clients} exceeds the {len(y_all)} samples of dataset={dataset!r}."
            )
        parts = _partition(
            y_all,
            num_clients,
            rng,
            partition,
            num_classes,
            dirichlet_alpha,
            classes_per_client,
            num_dominant,
            dominant_fraction,
            num_groups,
            min_samples_per_client,
            group_ids,
            seed,
        )
        pools = [(x_all, y_all)] * num_clients
        truth = None
        regression = False
    class_sets = parts.pop() if partition == "groups" else None
    # Caps and splits are stratified by label; real-valued targets count as one class.
    strata = [np.zeros(len(y), np.int32) if regression else y for _, y in pools]
    if samples_per_client is not None:
        parts = [
            part.cap_per_client([p], y, samples_per_client, rng)[0]
            for p, y in zip(parts, strata, strict=True)
        ]

    maps, model_classes = _label_maps(
        num_clients, num_classes, class_sets, group_relabel, permute_labels, seed, group_ids
    )

    splits = {"train": ([], []), "test": ([], [])}
    clients = []
    for c, (idx, (x, y)) in enumerate(zip(parts, pools, strict=True)):
        train_pos, test_pos = part.stratified_split(strata[c][idx], test_fraction, rng)
        for name, pos in (("train", train_pos), ("test", test_pos)):
            splits[name][0].append(x[idx[pos]])
            targets = y[idx[pos]]
            splits[name][1].append(
                targets.astype(np.float32) if regression else maps[c][targets].astype(np.int32)
            )
        if len(train_pos) == 0:
            raise ValueError(
                f"num_clients={num_clients}: client {c} got no training "
                f"sample (dataset={dataset!r}, partition={partition!r}); use "
                f"fewer clients or a larger samples_per_client."
            )
        clients.append(
            {
                "client": c,
                "group": int(group_ids[c]) if uses_groups else None,
                "train": int(len(train_pos)),
                "test": int(len(test_pos)),
                "classes": [] if regression else sorted(int(k) for k in np.unique(maps[c][y[idx]])),
                "source_classes": [] if regression else sorted(int(k) for k in np.unique(y[idx])),
                "label_map": [] if regression else maps[c].tolist(),
                # Samples of each model label (0..num_classes-1) in the client's splits.
                "train_class_counts": []
                if regression
                else _class_counts(splits["train"][1][-1], model_classes),
                "test_class_counts": []
                if regression
                else _class_counts(splits["test"][1][-1], model_classes),
            }
        )

    levels = None if spec.per_client else source.levels
    train, test = (pool_clients(*splits[s], levels) for s in ("train", "test"))
    input_shape = tuple(int(s) for s in train.x.shape[1:])
    summary = {
        "dataset": dataset,
        "task": "regression" if regression else "classification",
        "partition": partition,
        "num_clients": num_clients,
        "num_classes": model_classes,
        "source_num_classes": int(num_classes),
        "input_shape": list(input_shape),
        "permute_labels": permute_labels,
        "num_groups": num_groups if uses_groups else None,
        "test_fraction": test_fraction,
        "seed": seed,
        "totals": {"train": sum(c["train"] for c in clients), "test": sum(c["test"] for c in clients)},
        # Source classes in no client's data (random class draws can leave some out).
        "unplaced_classes": [] if regression else unplaced_classes(clients, num_classes),
        "clients": clients,
    }
    task = "regression" if regression else "classification"
    return FederatedData(ClientData(train, test), model_classes, input_shape, summary, truth, task)


def unplaced_classes(clients: list[dict], num_classes: int) -> list[int]:
    """Source classes held by no client (summary["unplaced_classes"])."""
    return sorted(set(range(num_classes)) - set().union(*(c["source_classes"] for c in clients)))


def _class_counts(labels: np.ndarray, num_classes: int) -> list[int]:
    """[K] number of samples of each label (summary only; reads, never changes, the data)."""
    return np.bincount(np.asarray(labels, np.int64), minlength=num_classes)[:num_classes].tolist()


def _partition(
    labels,
    num_clients,
    rng,
    partition,
    num_classes,
    alpha,
    classes_per_client,
    num_dominant,
    dominant_fraction,
    num_groups,
    min_size,
    group_ids,
    seed,
) -> list:
    """Runs the named partitioner; for "groups" appends the class sets. PFLlib's
    splits draw from RandomState(seed), as PFLlib's np.random.seed (partition.pfllib_*)."""
    if partition == "pfllib_dirichlet":
        return part.pfllib_dirichlet(labels, num_clients, seed, alpha=alpha)
    if partition == "pfllib_pathological":
        return part.pfllib_pathological(labels, num_clients, seed, classes_per_client=classes_per_client)
    if partition == "iid":
        return part.iid(labels, num_clients, rng)
    if partition == "dirichlet":
        return part.dirichlet(labels, num_clients, rng, alpha=alpha, min_size=min_size)
    if partition == "shards":
        return part.shards(labels, num_clients, rng, classes_per_client=classes_per_client)
    if partition == "classes":
        return part.classes(labels, num_clients, rng, classes_per_client=classes_per_client)
    if partition == "dominant":
        return part.dominant(
            labels, num_clients, rng, num_dominant=num_dominant, dominant_fraction=dominant_fraction
        )
    class_sets = part.group_class_sets(num_classes, num_groups, rng)
    return part.groups(labels, num_clients, rng, class_sets=class_sets, group_ids=group_ids) + [class_sets]


def _label_maps(num_clients, num_classes, class_sets, group_relabel, permute_labels, seed, group_ids):
    """Returns ([C, K] source label -> model label (-1: unused), model K)."""
    base = np.tile(np.arange(num_classes), (num_clients, 1))
    model_classes = num_classes
    if class_sets is not None and group_relabel:
        model_classes = len(class_sets[0])
        base = np.full((num_clients, num_classes), -1)
        for c in range(num_clients):
            base[c, class_sets[group_ids[c]]] = np.arange(model_classes)
    perm = part.label_maps(num_clients, model_classes, permute=permute_labels, seed=seed, group_ids=group_ids)
    maps = np.where(base >= 0, np.take_along_axis(perm, np.maximum(base, 0), 1), -1)
    return maps, model_classes


def _check_args(
    num_clients,
    partition,
    dirichlet_alpha,
    num_groups,
    permute_labels,
    samples_per_client,
    test_fraction,
    min_samples_per_client,
    per_client,
):
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
    if permute_labels not in part.PERMUTE_MODES:
        raise ValueError(
            f"permute_labels={permute_labels!r} is unknown; allowed values: {part.PERMUTE_MODES}."
        )
    if partition in ("dirichlet", "pfllib_dirichlet") and not dirichlet_alpha > 0:
        raise ValueError(f"dirichlet_alpha must be > 0, got {dirichlet_alpha!r}.")
    if (partition == "groups" or permute_labels == "group") and not (1 <= num_groups <= num_clients):
        raise ValueError(f"num_groups must be in [1, num_clients={num_clients}], got {num_groups!r}.")
    if samples_per_client is not None and not samples_per_client >= 1:
        raise ValueError(f"samples_per_client must be None or >= 1, got {samples_per_client!r}.")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}.")
    if not min_samples_per_client >= 0:
        raise ValueError(f"min_samples_per_client must be >= 0, got {min_samples_per_client!r}.")


def _check_class_args(
    num_classes, partition, classes_per_client, num_dominant, dominant_fraction, num_groups, num_clients
):
    if partition in ("shards", "classes", "pfllib_pathological") and not (
        1 <= classes_per_client <= num_classes
    ):
        raise ValueError(
            f"classes_per_client must be in [1, num_classes={num_classes}], got {classes_per_client!r}."
        )
    if partition in ("shards", "classes") and num_clients * classes_per_client < num_classes:
        raise ValueError(
            f"num_clients={num_clients} x classes_per_client={classes_per_client} < num_classes="
            f"{num_classes}: partition={partition!r} would leave classes in no client's data; "
            f"raise num_clients or classes_per_client."
        )
    if partition == "dominant":
        if not 1 <= num_dominant < num_classes:
            raise ValueError(
                f"num_dominant must be in [1, num_classes - 1 = {num_classes - 1}], got {num_dominant!r}."
            )
        if not 0 < dominant_fraction <= 1:
            raise ValueError(f"dominant_fraction must be in (0, 1], got {dominant_fraction!r}.")
    if partition == "groups" and num_groups > num_classes:
        raise ValueError(
            f"num_groups={num_groups} exceeds num_classes="
            f"{num_classes}: groups need disjoint label sets, so "
            f"num_groups must be in [1, {num_classes}]."
        )
