"""Partitioners: split a labelled pool of samples among clients.

Every partitioner is a pure numpy function
`(labels [N], num_clients, rng, **params) -> list of C int64 index arrays`,
one per client; no sample index appears twice across clients. `rng` is a
`numpy.random.Generator` (or an int seed). Label transforms (group relabelling,
label permutations) are separate: see `label_maps`.

* `iid`: uniform random split into near-equal parts.
* `dirichlet`: per-class proportions over clients ~ Dir(alpha) (Yurochkin et
  al. 2019 / NIID-Bench), resampled until every client has `min_size`.
* `shards`: McMahan et al. 2017 pathological split, S classes per client.
* `classes`: k random classes per client, equal amounts per class (pFedLA's
  first non-IID setting, e.g. 10 clients x 4 classes).
* `dominant`: all classes on every client, a few dominant ones holding a
  large share (pFedLA's second non-IID setting, see `dominant`).
* `groups`: clients in the same group share a label set disjoint from the
  other groups' (FedeRiCo / Factorized-FL style domains); which client is in
  which group is `assign_groups` (random as in FedeRiCo, or balanced).
* `cap_per_client`: keep at most n samples per client, class-stratified.
* `pfllib_dirichlet`, `pfllib_pathological`: PFLlib's "dir" and "pat" splits
  with its minimum client size (`pfllib_least_samples`), drawn from the legacy
  `numpy.random.RandomState(seed)` in PFLlib's order (they take a seed, not a
  Generator); `pfllib_train_test_split` is PFLlib's per-client train/test split
  (sklearn's shuffled train_test_split) on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERMUTE_MODES = ("none", "client", "group")
GROUP_ASSIGNMENTS = ("random", "random_nonempty", "balanced")


def as_rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    """Returns `rng` if it is a Generator, else default_rng(rng)."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


def apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Splits `total` into integers proportional to `weights` (largest remainder).

    Args:
      total: non-negative integer to split.
      weights: [K] non-negative weights, not all zero unless total is 0.

    Returns:
      [K] int64 counts summing to `total`, each within 1 of its exact share.
    """
    weights = np.asarray(weights, np.float64)
    if total == 0 or weights.sum() == 0:
        return np.zeros(len(weights), np.int64)
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    remainder = total - counts.sum()
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:remainder]] += 1
    return counts


def client_groups(num_clients: int, num_groups: int) -> np.ndarray:
    """Returns [C] group ids, g = floor(c * num_groups / num_clients)."""
    return np.arange(num_clients) * num_groups // num_clients


def assign_groups(
    num_clients: int,
    num_groups: int,
    rng: np.random.Generator | int | Sequence[int] | None = None,
    assignment: str = "random",
    max_draws: int = 100_000,
) -> np.ndarray:
    """Which group (data distribution) each client belongs to.

    FedeRiCo (Sui et al. 2022) draws each client's distribution at random: its
    Fig. 3 shows "client 0 alone in distribution 0, in this particular random
    split". That is the default here.

    * "random": every client's group uniform over 0..G-1, independently (the
      paper); a group may get one client, or none (its classes are then unused).
    * "random_nonempty": the same draw, repeated until every group has at least
      one client (i.e. conditioned on that; needs G <= C).
    * "balanced": g = floor(c * G / C) (`client_groups`), contiguous groups of
      near-equal size; draws nothing from `rng`. Not in the paper; the
      builder's default.

    Args:
      num_clients: C >= 1.
      num_groups: G >= 1.
      rng: Generator or seed (anything `numpy.random.default_rng` takes).
      assignment: one of GROUP_ASSIGNMENTS.
      max_draws: "random_nonempty" gives up (ValueError) after this many draws.

    Returns:
      [C] int64 group ids in 0..G-1.
    """
    if assignment not in GROUP_ASSIGNMENTS:
        raise ValueError(f"group_assignment must be one of {GROUP_ASSIGNMENTS}, got {assignment!r}.")
    if isinstance(num_groups, bool) or int(num_groups) != num_groups or num_groups < 1:
        raise ValueError(f"num_groups must be an integer >= 1, got {num_groups!r}.")
    if assignment == "balanced":
        return client_groups(num_clients, num_groups).astype(np.int64)
    if assignment == "random_nonempty" and num_groups > num_clients:
        raise ValueError(
            f"group_assignment='random_nonempty' needs num_groups <= num_clients={num_clients}, "
            f"got {num_groups}."
        )
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if assignment == "random":
        return rng.integers(0, num_groups, num_clients).astype(np.int64)
    batch = 1024  # draws per batch; the first full draw of the first batch with one wins
    for _ in range(max(1, -(-max_draws // batch))):
        draws = rng.integers(0, num_groups, (batch, num_clients))
        full = np.all(np.any(draws[:, :, None] == np.arange(num_groups), axis=1), axis=1)
        if full.any():
            return draws[int(np.argmax(full))].astype(np.int64)
    raise ValueError(
        f"group_assignment='random_nonempty': no draw in {max_draws} gave every one of "
        f"{num_groups} groups a client among {num_clients}; use group_assignment='balanced'."
    )


def _class_indices(labels: np.ndarray, rng: np.random.Generator, num_classes: int) -> list[np.ndarray]:
    """Shuffled indices of each class 0..num_classes-1."""
    return [rng.permutation(np.flatnonzero(labels == k)) for k in range(num_classes)]


def _num_classes(labels: np.ndarray) -> int:
    return int(labels.max()) + 1 if labels.size else 0


def _finish(parts: Sequence[list[np.ndarray]], rng: np.random.Generator) -> list[np.ndarray]:
    """Concatenates each client's pieces and shuffles them."""
    return [
        rng.permutation(np.concatenate(p).astype(np.int64)) if p else np.zeros(0, np.int64) for p in parts
    ]


def iid(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator | int | None = None
) -> list[np.ndarray]:
    """Uniform random split into `num_clients` parts of near-equal size.

    Args:
      labels: [N] int labels (only N is used).
      num_clients: C.
      rng: Generator or seed.

    Returns:
      C int64 index arrays, sizes differing by at most one.
    """
    rng = as_rng(rng)
    return [np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator | int | None = None,
    *,
    alpha: float = 0.5,
    min_size: int = 10,
    max_attempts: int = 100,
) -> list[np.ndarray]:
    """Label-skewed split with per-class client proportions ~ Dir(alpha).

    For each class, proportions over clients are drawn from a symmetric
    Dirichlet(alpha); as in NIID-Bench (Li et al. 2022) clients already holding
    N / C samples get no more. The draw is repeated until every client has at
    least `min_size` samples.

    Args:
      labels: [N] int labels in 0..K-1.
      num_clients: C.
      rng: Generator or seed.
      alpha: concentration; small values (0.1) give few classes per client,
        large values (100) approach IID.
      min_size: minimum samples per client.
      max_attempts: draws tried before giving up.

    Returns:
      C int64 index arrays.

    Raises:
      ValueError: naming `min_samples_per_client`, if no draw within
        `max_attempts` gives every client `min_size` samples.
    """
    rng = as_rng(rng)
    labels = np.asarray(labels)
    n, num_classes = len(labels), _num_classes(labels)
    for _ in range(max_attempts):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, np.int64)
        for idx in _class_indices(labels, rng, num_classes):
            props = rng.dirichlet(np.full(num_clients, alpha))
            props = props * (sizes < n / num_clients)
            if props.sum() == 0:
                props = np.ones(num_clients)
            cuts = (np.cumsum(props / props.sum()) * len(idx)).astype(int)[:-1]
            for c, piece in enumerate(np.split(idx, cuts)):
                parts[c].append(piece)
                sizes[c] += len(piece)
        if sizes.min() >= min_size:
            return _finish(parts, rng)
    raise ValueError(
        f"dirichlet partition: no draw in {max_attempts} attempts gave every "
        f"one of {num_clients} clients at least min_samples_per_client="
        f"{min_size} samples (N={n}, alpha={alpha}); lower "
        f"min_samples_per_client or num_clients, or raise dirichlet_alpha."
    )


def _split_even(idx: np.ndarray, num_parts: int) -> list[np.ndarray]:
    return np.array_split(idx, num_parts) if num_parts else []


def shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator | int | None = None,
    *,
    classes_per_client: int = 2,
) -> list[np.ndarray]:
    """Pathological split of McMahan et al. (2017): S classes per client.

    Samples are sorted by label and cut into C * S shards, each client gets S
    shards. Unlike McMahan's random dealing (where a client may draw two
    shards of one class, or a shard may straddle two classes), shards here are
    cut within classes -- class k gets a number of shards proportional to its
    size, at most C -- and dealt round-robin over the class-sorted shard list
    (client c gets shards c, c + C, ...), so every client holds exactly S
    distinct classes and each class is spread over about C * S / K clients.
    All samples are used. Class and client order are randomised by `rng`.

    Args:
      labels: [N] int labels in 0..K-1.
      num_clients: C.
      rng: Generator or seed.
      classes_per_client: S, with 1 <= S <= K.

    Returns:
      C int64 index arrays.
    """
    rng = as_rng(rng)
    labels = np.asarray(labels)
    num_classes = _num_classes(labels)
    s = _check_classes_per_client(classes_per_client, num_classes)
    by_class = _class_indices(labels, rng, num_classes)
    sizes = np.array([len(i) for i in by_class])
    cap = np.minimum(sizes, num_clients)  # no empty shard, <= 1 per client
    if cap.sum() < num_clients * s:
        raise ValueError(
            f"shards: {num_clients} clients x {s} classes need "
            f"{num_clients * s} non-empty single-class shards "
            f"but the class sizes {sizes.tolist()} allow "
            f"{cap.sum()}."
        )
    shards_per_class = _capped_apportion(num_clients * s, sizes, cap)
    shard_list = []
    for k in rng.permutation(num_classes):
        shard_list += _split_even(by_class[k], shards_per_class[k])
    client_of_slot = rng.permutation(num_clients)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for slot, shard in enumerate(shard_list):
        parts[client_of_slot[slot % num_clients]].append(shard)
    return _finish(parts, rng)


def _check_classes_per_client(classes_per_client: int, num_classes: int) -> int:
    """classes_per_client, if in [1, K] (ValueError naming it otherwise)."""
    if not 1 <= classes_per_client <= num_classes:
        raise ValueError(f"classes_per_client must be in [1, {num_classes}], got {classes_per_client}.")
    return classes_per_client


def _capped_apportion(total: int, weights: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Like `apportion`, but count k never exceeds cap[k] (needs sum >= total)."""
    counts = np.minimum(apportion(total, weights), cap)
    while counts.sum() < total:
        room = (counts < cap) & (np.asarray(weights) > 0)
        counts += np.minimum(apportion(total - counts.sum(), weights * room), cap - counts)
    return counts


def classes(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator | int | None = None,
    *,
    classes_per_client: int = 4,
) -> list[np.ndarray]:
    """k random classes per client, equal amounts per class.

    Each client draws `classes_per_client` distinct classes at random (pFedLA's
    first non-IID setting: e.g. 10 clients x 4 classes). A class held by h
    clients is cut into h equal parts; a client then keeps the same number of
    samples q_c from each of its classes, q_c = the smallest such part among
    its classes, so its classes are exactly balanced. Unkept samples are
    unused.

    Args:
      labels: [N] int labels in 0..K-1.
      num_clients: C.
      rng: Generator or seed.
      classes_per_client: k, with 1 <= k <= K.

    Returns:
      C int64 index arrays.
    """
    rng = as_rng(rng)
    labels = np.asarray(labels)
    num_classes = _num_classes(labels)
    k = _check_classes_per_client(classes_per_client, num_classes)
    nonempty = np.flatnonzero(np.bincount(labels, minlength=num_classes))
    if k > len(nonempty):
        raise ValueError(f"classes_per_client={k} exceeds the {len(nonempty)} classes present.")
    chosen = [rng.choice(nonempty, k, replace=False) for _ in range(num_clients)]
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for c, ks in enumerate(chosen):
        for cls in ks:
            holders[cls].append(c)
    pieces = {}
    for cls, (idx, hs) in enumerate(zip(_class_indices(labels, rng, num_classes), holders, strict=True)):
        for c, piece in zip(hs, _split_even(idx, len(hs)), strict=True):
            pieces[c, cls] = piece
    parts = []
    for c, ks in enumerate(chosen):
        q = min(len(pieces[c, cls]) for cls in ks)
        parts.append([pieces[c, cls][:q] for cls in ks])
    return _finish(parts, rng)


def dominant(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator | int | None = None,
    *,
    num_dominant: int = 2,
    dominant_fraction: float = 0.8,
) -> list[np.ndarray]:
    """All classes on every client, `num_dominant` of them dominant.

    Each client draws `num_dominant` distinct dominant classes at random; they
    hold `dominant_fraction` of its samples (split equally between them) and
    the other classes present share the rest equally. Every client
    gets the same number of samples, the largest the class sizes allow.

    pFedLA's (Ma et al., CVPR 2022) second non-IID setting has all classes
    present with a few dominant ones; its exact numbers were not available to
    us, so the defaults (2 dominant classes holding 80%) follow the common
    "s% uniform, (100-s)% from dominant classes, s = 20" protocol (FedAMP /
    FedFomo / FedPAC). Here the remaining share goes to the non-dominant
    classes only, so the dominant classes hold exactly `dominant_fraction`
    (up to rounding).

    Args:
      labels: [N] int labels in 0..K-1.
      num_clients: C.
      rng: Generator or seed.
      num_dominant: dominant classes per client, 1 <= num_dominant < K.
      dominant_fraction: share of each client's samples in its dominant
        classes, in (0, 1].

    Returns:
      C int64 index arrays.
    """
    rng = as_rng(rng)
    labels = np.asarray(labels)
    num_classes = _num_classes(labels)
    if not 1 <= num_dominant < num_classes:
        raise ValueError(f"num_dominant must be in [1, {num_classes - 1}], got {num_dominant}.")
    if not 0 < dominant_fraction <= 1:
        raise ValueError(f"dominant_fraction must be in (0, 1], got {dominant_fraction}.")
    present = np.bincount(labels, minlength=num_classes) > 0
    if num_dominant >= present.sum():
        raise ValueError(f"num_dominant={num_dominant} must be below the {present.sum()} classes present.")
    shares = np.where(present, (1 - dominant_fraction) / (present.sum() - num_dominant), 0.0)
    shares = np.tile(shares, (num_clients, 1))
    for c in range(num_clients):
        dom = rng.choice(np.flatnonzero(present), num_dominant, replace=False)
        shares[c, dom] = dominant_fraction / num_dominant
    by_class = _class_indices(labels, rng, num_classes)
    sizes = np.array([len(i) for i in by_class])
    demand = shares.sum(0)
    n = int(np.min(sizes[demand > 0] / demand[demand > 0]))
    while True:  # rounding up in apportion may overshoot a class by a little
        counts = np.stack([apportion(n, s) for s in shares])  # [C, K]
        if np.all(counts.sum(0) <= sizes):
            break
        n -= 1
    starts = np.cumsum(counts, 0) - counts
    parts = [
        [by_class[k][starts[c, k] : starts[c, k] + counts[c, k]] for k in range(num_classes)]
        for c in range(num_clients)
    ]
    return _finish(parts, rng)


def group_class_sets(
    num_classes: int, num_groups: int, rng: np.random.Generator | int | None = None
) -> list[np.ndarray]:
    """Random disjoint class sets, one per group, each of K // G classes.

    The K % G classes left over are not used by any group.

    Args:
      num_classes: K.
      num_groups: G, with 1 <= G <= K.
      rng: Generator or seed.

    Returns:
      G sorted int64 arrays of K // G classes each.
    """
    if not 1 <= num_groups <= num_classes:
        raise ValueError(
            f"num_groups must be in [1, {num_classes}] for disjoint label sets, got {num_groups}."
        )
    size = num_classes // num_groups
    perm = as_rng(rng).permutation(num_classes)
    return [np.sort(perm[g * size : (g + 1) * size]).astype(np.int64) for g in range(num_groups)]


def groups(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator | int | None = None,
    *,
    class_sets: Sequence[np.ndarray],
    group_ids: np.ndarray | Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Clients of group g share the samples of `class_sets[g]`.

    Client c belongs to group group_ids[c] (see `assign_groups`; None: the
    balanced floor(c * G / C)); every class of the group's set is split evenly
    among the group's clients, so clients of one group have the same label
    distribution and groups have disjoint label sets. A group with no client
    leaves its classes unused; a client alone in its group gets all of them.

    Args:
      labels: [N] int labels in 0..K-1.
      num_clients: C.
      rng: Generator or seed.
      class_sets: G disjoint class arrays (see `group_class_sets`).
      group_ids: [C] group of each client, in 0..G-1 (None: balanced).

    Returns:
      C int64 index arrays.
    """
    rng = as_rng(rng)
    labels = np.asarray(labels)
    num_groups = len(class_sets)
    if group_ids is None:
        gid = client_groups(num_clients, num_groups)
    else:
        gid = np.asarray(group_ids, np.int64)
        if gid.shape != (num_clients,) or (gid.size and not 0 <= gid.min() <= gid.max() < num_groups):
            raise ValueError(
                f"group_ids must be {num_clients} group ids in [0, {num_groups}), got {gid.tolist()}."
            )
    by_class = _class_indices(labels, rng, _num_classes(labels))
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for g, class_set in enumerate(class_sets):
        members = np.flatnonzero(gid == g)
        for k in class_set:
            idx = by_class[k] if k < len(by_class) else np.zeros(0, np.int64)
            for c, piece in zip(members, _split_even(idx, len(members)), strict=True):
                parts[c].append(piece)
    return _finish(parts, rng)


def cap_per_client(
    parts: Sequence[np.ndarray],
    labels: np.ndarray,
    max_samples: int,
    rng: np.random.Generator | int | None = None,
) -> list[np.ndarray]:
    """Keeps at most `max_samples` of each client's samples, class-stratified.

    Args:
      parts: C index arrays into `labels`.
      labels: [N] int labels.
      max_samples: cap per client (>= 1).
      rng: Generator or seed.

    Returns:
      C int64 index arrays; a client over the cap keeps, per class, its share
      of `max_samples` in proportion to its class counts (largest remainder).
    """
    rng = as_rng(rng)
    out = []
    for idx in parts:
        idx = np.asarray(idx, np.int64)
        if len(idx) <= max_samples:
            out.append(idx)
            continue
        present, counts = np.unique(labels[idx], return_counts=True)
        keep = apportion(max_samples, counts)
        chosen = [rng.permutation(idx[labels[idx] == k])[:q] for k, q in zip(present, keep, strict=True)]
        out.append(rng.permutation(np.concatenate(chosen)))
    return out


def label_maps(
    num_clients: int,
    num_classes: int,
    *,
    permute: str = "none",
    seed: int = 0,
    group_ids: np.ndarray | None = None,
) -> np.ndarray:
    """Per-client label permutations.

    Args:
      num_clients: C.
      num_classes: K, the size of the label space being permuted.
      permute: "none" (identity), "client" (client c uses the permutation of
        default_rng(seed + c), as in Factorized-FL) or "group" (every client of
        group g uses the permutation of default_rng(seed + g)).
      seed: base seed.
      group_ids: [C] group ids, required for permute="group".

    Returns:
      [C, K] int64; row c maps label k to row[c, k], a bijection of 0..K-1.
    """
    if permute not in PERMUTE_MODES:
        raise ValueError(f"permute_labels must be one of {PERMUTE_MODES}, got {permute!r}.")
    if permute == "none":
        return np.tile(np.arange(num_classes, dtype=np.int64), (num_clients, 1))
    if permute == "group":
        if group_ids is None:
            raise ValueError("permute_labels='group' needs group_ids.")
        keys = np.asarray(group_ids)
    else:
        keys = np.arange(num_clients)
    return np.stack([np.random.default_rng(seed + int(k)).permutation(num_classes) for k in keys]).astype(
        np.int64
    )


def stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator | int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Splits one client's samples into train and test with equal label mix.

    n_test = round(test_fraction * n), clipped to [1, n - 1] when n >= 2, is
    apportioned over classes in proportion to their counts (largest
    remainder), so each class's test share is within one sample of exact.

    Args:
      labels: [n] int labels of the client's samples.
      test_fraction: in (0, 1).
      rng: Generator or seed.

    Returns:
      (train_pos, test_pos): int64 positions into `labels`, shuffled.
    """
    rng = as_rng(rng)
    labels = np.asarray(labels)
    n = len(labels)
    n_test = int(round(test_fraction * n))
    if n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    present, counts = np.unique(labels, return_counts=True)
    test_counts = apportion(n_test, counts)
    train, test = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for k, q in zip(present, test_counts, strict=True):
        pos = rng.permutation(np.flatnonzero(labels == k))
        test.append(pos[:q])
        train.append(pos[q:])
    return (rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test)))


# PFLlib's label-skew splits (TsingZ0/PFLlib, dataset/utils/dataset_utils.py,
# `separate_data`), re-implemented from its description: the same draws, in the same
# order, from the legacy `numpy.random.RandomState` that PFLlib seeds with
# `np.random.seed` (1 in its generate_*.py), so `seed=1` gives the partition of
# PFLlib's generated files. PFLlib's constants: batch_size 10, train_ratio 0.75.
PFLLIB_BATCH_SIZE = 10
PFLLIB_TRAIN_RATIO = 0.75


def pfllib_least_samples(
    num_samples: int,
    num_clients: int,
    batch_size: int = PFLLIB_BATCH_SIZE,
    train_ratio: float = PFLLIB_TRAIN_RATIO,
) -> int:
    """PFLlib's minimum client size: enough samples for one test batch after the
    train/test split, int(min(batch_size / (1 - train_ratio), N / C / 2))
    (40 for its Fashion-MNIST: 10 / 0.25 = 40 < 70000 / 20 / 2 = 1750)."""
    return int(min(batch_size / (1 - train_ratio), num_samples / num_clients / 2))


def _legacy_rng(seed: int | np.random.RandomState) -> np.random.RandomState:
    if isinstance(seed, np.random.RandomState):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed must be an int (PFLlib's np.random.seed) or a RandomState, got {seed!r}.")
    return np.random.RandomState(int(seed))


def pfllib_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    seed: int | np.random.RandomState = 1,
    *,
    alpha: float = 0.1,
    min_size: int | None = None,
    max_attempts: int = 1000,
) -> list[np.ndarray]:
    """PFLlib's practical non-IID split ("dir"): Dir(alpha) per class, redrawn until
    every client has PFLlib's minimum size.

    For each class k in 0..K-1 in turn: shuffle the class's indices, draw client
    proportions ~ Dir(alpha), zero those of clients already holding >= N / C
    samples, and cut the shuffled indices at the cumulative proportions. The whole
    draw is repeated until the smallest client has `min_size` samples (default
    `pfllib_least_samples`). Unlike `dirichlet`, the draws interleave per class and
    come from RandomState(seed), as PFLlib's; each client's indices are in the
    order PFLlib assigns them (class by class).

    Args:
      labels: [N] int labels in 0..K-1 (PFLlib: train then test images, file order).
      num_clients: C.
      seed: the RandomState's seed (PFLlib: 1), or a RandomState.
      alpha: Dirichlet concentration (PFLlib: 0.1).
      min_size: minimum client size; None: pfllib_least_samples(N, C).
      max_attempts: draws tried before giving up (PFLlib tries forever).

    Returns:
      C int64 index arrays, a disjoint cover of 0..N-1.

    Raises:
      ValueError: naming `dirichlet_alpha`, `num_clients` or the minimum size, for
        bad arguments or when no draw in `max_attempts` reaches the minimum.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if not alpha > 0:
        raise ValueError(f"dirichlet_alpha must be > 0, got {alpha!r}.")
    if not 1 <= num_clients <= n:
        raise ValueError(f"num_clients must be in [1, {n}], got {num_clients!r}.")
    least = pfllib_least_samples(n, num_clients) if min_size is None else int(min_size)
    rs = _legacy_rng(seed)
    num_classes = _num_classes(labels)
    for _ in range(max_attempts):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for k in range(num_classes):
            idx = np.where(labels == k)[0]
            rs.shuffle(idx)
            props = rs.dirichlet(np.repeat(alpha, num_clients))
            props = props * np.array([len(p) < n / num_clients for p in parts])
            if props.sum() == 0:  # PFLlib divides by zero here; count the draw as failed
                break
            cuts = (np.cumsum(props / props.sum()) * len(idx)).astype(int)[:-1]
            parts = [p + piece.tolist() for p, piece in zip(parts, np.split(idx, cuts), strict=True)]
        else:
            if min(len(p) for p in parts) >= least:
                return [np.asarray(p, np.int64) for p in parts]
    raise ValueError(
        f"pfllib_dirichlet partition: no draw in {max_attempts} attempts gave every one of "
        f"{num_clients} clients PFLlib's minimum of {least} samples (N={n}, "
        f"dirichlet_alpha={alpha}); use fewer clients or a larger dirichlet_alpha."
    )


def pfllib_pathological(
    labels: np.ndarray,
    num_clients: int,
    seed: int | np.random.RandomState = 1,
    *,
    classes_per_client: int = 2,
    balance: bool = False,
    min_size: int | None = None,
) -> list[np.ndarray]:
    """PFLlib's pathological non-IID split ("pat"): each client holds
    `classes_per_client` classes.

    Classes are dealt in order 0..K-1; class k goes to the first
    ceil(C / K * classes_per_client) clients (by id) that still have a class slot
    free, as contiguous runs of the class's indices in data order. Unbalanced
    (`balance=False`, PFLlib's Fashion-MNIST command "noniid - pat"): all but the
    last of those clients get randint(max(m / 10, least / K), m) samples, m = n_k /
    their number, from RandomState(seed), and the last the rest; balanced: int(m)
    each and the last the rest.

    Args:
      labels: [N] int labels in 0..K-1.
      num_clients: C.
      seed: the RandomState's seed (PFLlib: 1), or a RandomState.
      classes_per_client: classes per client (PFLlib's Fashion-MNIST: 2).
      balance: equal shares of a class among its clients.
      min_size: PFLlib's least_samples (None: pfllib_least_samples(N, C)); it
        only bounds the unbalanced draws from below (by min_size / K).

    Returns:
      C int64 index arrays, a disjoint cover of 0..N-1.

    Raises:
      ValueError: naming `classes_per_client` or `num_clients` where PFLlib's rule
        would leave a class or a client without data (num_clients *
        classes_per_client < K), or a class too small for the draws.
    """
    labels = np.asarray(labels)
    n = len(labels)
    num_classes = _num_classes(labels)
    _check_pathological(n, num_classes, num_clients, classes_per_client)
    least = pfllib_least_samples(n, num_clients) if min_size is None else int(min_size)
    rs = _legacy_rng(seed)
    free = [classes_per_client] * num_clients
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    per_class = int(np.ceil(num_clients / num_classes * classes_per_client))
    for k in range(num_classes):
        chosen = [c for c in range(num_clients) if free[c] > 0][:per_class]
        idx = np.flatnonzero(labels == k)
        counts = _pathological_shares(k, len(idx), len(chosen), balance, least / num_classes, rs)
        start = 0
        for c, count in zip(chosen, counts, strict=True):
            parts[c].append(idx[start : start + count])
            start += count
            free[c] -= 1
    empty = [c for c in range(num_clients) if not parts[c] or not sum(len(p) for p in parts[c])]
    if empty:
        raise ValueError(
            f"pfllib_pathological partition: clients {empty[:5]} get no data with num_clients={num_clients}, "
            f"classes_per_client={classes_per_client}, num_classes={num_classes} (PFLlib fails here too); "
            f"use num_clients <= num_classes / classes_per_client * ceil(...) or more classes_per_client."
        )
    return [np.concatenate(p).astype(np.int64) for p in parts]


def _check_pathological(n: int, num_classes: int, num_clients: int, classes_per_client: int) -> None:
    """pfllib_pathological's argument checks (ValueError naming the argument)."""
    if isinstance(classes_per_client, bool) or not 1 <= classes_per_client <= num_classes:
        raise ValueError(
            f"classes_per_client must be in [1, num_classes={num_classes}], got {classes_per_client!r}."
        )
    if not 1 <= num_clients <= n or num_clients * classes_per_client < num_classes:
        raise ValueError(
            f"num_clients={num_clients} with classes_per_client={classes_per_client}: PFLlib's pathological "
            f"split needs num_clients * classes_per_client >= num_classes={num_classes} (else classes get "
            f"no client), and num_clients <= N={n}."
        )


def _pathological_shares(
    k: int, size: int, num_chosen: int, balance: bool, least_share: float, rs: np.random.RandomState
) -> list[int]:
    """How many of class k's `size` samples each of its `num_chosen` clients gets, in
    PFLlib's "pat" rule: m = size / num_chosen; int(m) each (balanced) or
    randint(max(m / 10, least_share), m) each (drawn from `rs`), and the last the rest."""
    m = size / num_chosen
    if balance:
        counts = [int(m)] * (num_chosen - 1)
    else:
        low = max(m / 10, least_share)
        if num_chosen > 1 and not low < m:
            raise ValueError(
                f"pfllib_pathological partition: class {k} has {size} samples for {num_chosen} "
                f"clients, too few for PFLlib's draw in [{low:g}, {m:g}); use fewer clients."
            )
        counts = rs.randint(low, m, num_chosen - 1).tolist()
    return counts + [size - sum(counts)]


def pfllib_train_test_split(
    n: int, train_ratio: float = PFLLIB_TRAIN_RATIO, rs: np.random.RandomState | int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """PFLlib's per-client split: sklearn's train_test_split(train_size=train_ratio,
    shuffle=True) with no random_state, i.e. from numpy's global RandomState.

    sklearn (ShuffleSplit) takes n_train = floor(train_ratio * n), n_test = n -
    n_train, draws one `rs.permutation(n)` and returns its tail as train and its
    head as test, in that order; the same here, so `rs` (PFLlib's global stream,
    after its partition's draws) advances exactly as in PFLlib.

    Args:
      n: the client's number of samples.
      train_ratio: PFLlib's train_ratio (0.75), in (0, 1).
      rs: the RandomState (or its seed).

    Returns:
      (train_pos, test_pos): int64 positions into the client's samples, in
      sklearn's order.

    Raises:
      ValueError: naming `test_fraction` where the train part would be empty (as
        sklearn raises).
    """
    n_train = int(np.floor(train_ratio * n))
    if n_train == 0:
        raise ValueError(
            f"PFLlib's train/test split of {n} samples with train share {train_ratio} (1 - test_fraction) "
            f"leaves no training sample; use a smaller test_fraction or more samples per client."
        )
    perm = _legacy_rng(rs).permutation(n).astype(np.int64)
    return perm[n - n_train :], perm[: n - n_train]
