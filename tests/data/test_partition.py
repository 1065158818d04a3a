"""Tests for pfljax.data.partition on synthetic labels."""

import hashlib
import os
from collections import Counter

import numpy as np
import pytest

from pfljax.data import build_federated_data, idx, sources
from pfljax.data import partition as part
from pfljax.data.sources import Pooled

NUM_CLASSES = 10


def make_labels(seed=0):
    """[N] labels over 10 classes of unequal sizes (200..380), shuffled."""
    sizes = 200 + 20 * np.arange(NUM_CLASSES)
    labels = np.repeat(np.arange(NUM_CLASSES), sizes)
    return np.random.default_rng(seed).permutation(labels)


def counts(labels, idx):
    return np.bincount(labels[idx], minlength=NUM_CLASSES)


def label_entropy(labels, idx):
    p = counts(labels, idx) / len(idx)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def run(name, labels, num_clients, seed, **kw):
    if name == "groups":
        sets = part.group_class_sets(NUM_CLASSES, kw.pop("num_groups", 2), seed)
        return part.groups(labels, num_clients, seed, class_sets=sets)
    return getattr(part, name)(labels, num_clients, seed, **kw)


ALL = ["iid", "dirichlet", "shards", "classes", "dominant", "groups"]


@pytest.mark.parametrize("name", ALL)
def test_disjoint_seeded_and_seed_sensitive(name):
    labels = make_labels()
    parts = run(name, labels, 10, seed=1)
    assert len(parts) == 10
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # each sample at most once
    assert flat.min() >= 0 and flat.max() < len(labels)
    assert all(len(p) > 0 for p in parts)
    again = run(name, labels, 10, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = run(name, labels, 10, seed=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_iid_uses_everything_in_equal_parts():
    labels = make_labels()
    parts = part.iid(labels, 7, 0)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == len(labels)
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_small_alpha_is_more_skewed_than_large():
    labels = make_labels()
    ent = {}
    for alpha in (0.1, 100.0):
        parts = part.dirichlet(labels, 10, 0, alpha=alpha, min_size=20)
        assert min(len(p) for p in parts) >= 20
        ent[alpha] = np.mean([label_entropy(labels, p) for p in parts])
    # ln(10) = 2.30 is the maximum: alpha=100 is near it, alpha=0.1 far below.
    assert ent[100.0] > 2.2
    assert ent[0.1] < 1.3
    assert ent[100.0] - ent[0.1] > 1.0


def test_dirichlet_min_size_unreachable_raises():
    labels = make_labels()
    with pytest.raises(ValueError, match="min_samples_per_client"):
        part.dirichlet(labels, 10, 0, alpha=0.5, min_size=len(labels), max_attempts=3)


@pytest.mark.parametrize("s", [1, 2, 3])
def test_shards_exactly_s_classes_and_all_samples_used(s):
    labels = make_labels()
    parts = part.shards(labels, 10, 0, classes_per_client=s)
    for p in parts:
        assert np.count_nonzero(counts(labels, p)) == s
    assert sum(len(p) for p in parts) == len(labels)


def test_classes_exactly_k_classes_with_equal_amounts():
    labels = make_labels()
    parts = part.classes(labels, 10, 0, classes_per_client=4)
    for p in parts:
        cnt = counts(labels, p)
        present = cnt[cnt > 0]
        assert len(present) == 4
        assert np.all(present == present[0])  # equal amount per class


def test_dominant_classes_hold_the_stated_share():
    labels = make_labels()
    parts = part.dominant(labels, 10, 0, num_dominant=2, dominant_fraction=0.8)
    sizes = {len(p) for p in parts}
    assert len(sizes) == 1  # every client the same size
    for p in parts:
        cnt = np.sort(counts(labels, p))[::-1]
        assert np.all(cnt > 0)  # all classes present
        assert abs(cnt[:2].sum() / len(p) - 0.8) < 0.01
        assert cnt[2] < cnt[1] / 5  # the rest are far smaller


def test_groups_have_disjoint_label_sets_and_equal_mix_within():
    labels = make_labels()
    sets = part.group_class_sets(NUM_CLASSES, 3, 0)
    assert [len(s) for s in sets] == [3, 3, 3]
    assert len(np.unique(np.concatenate(sets))) == 9
    parts = part.groups(labels, 9, 0, class_sets=sets)
    gid = part.client_groups(9, 3)
    np.testing.assert_array_equal(gid, [0, 0, 0, 1, 1, 1, 2, 2, 2])
    for c, p in enumerate(parts):
        present = set(np.flatnonzero(counts(labels, p)))
        assert present == set(sets[gid[c]].tolist())
    for g in range(3):
        mixes = [counts(labels, parts[c]) for c in np.flatnonzero(gid == g)]
        assert np.abs(np.array(mixes) - mixes[0]).max() <= 1


def test_group_class_sets_rejects_more_groups_than_classes():
    with pytest.raises(ValueError, match="num_groups"):
        part.group_class_sets(4, 5, 0)


def test_label_maps_client_mode_is_a_seeded_bijection_per_client():
    maps = part.label_maps(6, NUM_CLASSES, permute="client", seed=3)
    for c, row in enumerate(maps):
        np.testing.assert_array_equal(np.sort(row), np.arange(NUM_CLASSES))
        np.testing.assert_array_equal(row, np.random.default_rng(3 + c).permutation(NUM_CLASSES))
    assert len({tuple(r) for r in maps}) == 6  # all different


def test_label_maps_group_mode_agrees_within_and_differs_across_groups():
    gid = part.client_groups(6, 2)
    maps = part.label_maps(6, NUM_CLASSES, permute="group", seed=0, group_ids=gid)
    for row in maps:
        np.testing.assert_array_equal(np.sort(row), np.arange(NUM_CLASSES))
    for c in range(6):
        np.testing.assert_array_equal(maps[c], maps[3 * gid[c]])
    assert not np.array_equal(maps[0], maps[3])


def test_label_maps_none_is_identity_and_bad_mode_raises():
    maps = part.label_maps(3, 4, permute="none")
    np.testing.assert_array_equal(maps, np.tile(np.arange(4), (3, 1)))
    with pytest.raises(ValueError, match="permute_labels"):
        part.label_maps(3, 4, permute="random")


def test_cap_per_client_keeps_class_proportions():
    labels = make_labels()
    parts = part.iid(labels, 4, 0)
    capped = part.cap_per_client(parts, labels, 100, 0)
    for p, q in zip(parts, capped, strict=True):
        assert len(q) == 100
        assert set(q.tolist()) <= set(p.tolist())
        expected = counts(labels, p) * 100 / len(p)
        assert np.abs(counts(labels, q) - expected).max() < 1.0
    small = part.cap_per_client([parts[0][:50]], labels, 100, 0)
    np.testing.assert_array_equal(small[0], parts[0][:50])


def test_stratified_split_fraction_and_label_mix():
    labels = make_labels()[:1000]
    train, test = part.stratified_split(labels, 0.2, 0)
    assert len(test) == 200 and len(train) == 800
    assert not set(train.tolist()) & set(test.tolist())
    per_class = np.bincount(labels, minlength=NUM_CLASSES)
    test_per_class = np.bincount(labels[test], minlength=NUM_CLASSES)
    assert np.abs(test_per_class - 0.2 * per_class).max() < 1.0


def test_apportion_is_exact_and_close():
    out = part.apportion(10, np.array([1.0, 1.0, 1.0]))
    assert out.sum() == 10 and sorted(out.tolist()) == [3, 3, 4]
    np.testing.assert_array_equal(part.apportion(7, np.array([0.0, 2.0])), [0, 7])


# ------------------------------------------------ group assignment (FedeRiCo's random split)


def _digest(arrays):
    m = hashlib.sha256()
    for a in arrays:
        m.update(np.asarray(a, np.int64).tobytes())
        m.update(b"|")
    return m.hexdigest()[:16]


def test_random_assignment_is_seeded_uniform_and_independent_per_client():
    a = part.assign_groups(8, 4, 3)
    np.testing.assert_array_equal(a, part.assign_groups(8, 4, 3))
    np.testing.assert_array_equal(a, np.random.default_rng(3).integers(0, 4, 8))
    draws = [part.assign_groups(8, 4, s) for s in range(20)]
    assert len({tuple(d) for d in draws}) == 20  # seed-sensitive
    big = part.assign_groups(40_000, 4, 0)
    assert big.min() == 0 and big.max() == 3
    np.testing.assert_allclose(np.bincount(big) / 40_000, 0.25, atol=0.01)
    # Plain random draws do leave groups empty (P ~ 0.38 for 8 clients, 4 groups).
    empty = np.mean([len(np.unique(part.assign_groups(8, 4, s))) < 4 for s in range(400)])
    assert 0.3 < empty < 0.46, empty


def test_random_nonempty_fills_every_group_uniformly_over_surjections():
    for s in range(200):
        assert len(np.unique(part.assign_groups(8, 4, s, "random_nonempty"))) == 4
    # 4 clients, 3 groups: 36 onto maps, each with probability 1/36 (the plain draw
    # conditioned on no empty group).
    n = 3600
    freq = Counter(tuple(part.assign_groups(4, 3, s, "random_nonempty")) for s in range(n))
    assert len(freq) == 36
    chi2 = sum((f - n / 36) ** 2 / (n / 36) for f in freq.values())
    assert chi2 < 66.6, chi2  # chi-square(35) 0.999 quantile
    assert len(part.assign_groups(8, 8, 0, "random_nonempty")) == 8  # P(onto) = 0.0024


def test_balanced_assignment_reproduces_the_earlier_split_exactly():
    """Digests of `groups` (without group_ids) and of build_federated_data's groups
    were taken with the code before assign_groups existed (commit a6429da)."""
    np.testing.assert_array_equal(part.assign_groups(9, 3, 0, "balanced"), [0, 0, 0, 1, 1, 1, 2, 2, 2])
    rng = np.random.default_rng(1)
    part.assign_groups(7, 3, rng, "balanced")
    assert rng.integers(1 << 30) == np.random.default_rng(1).integers(1 << 30)  # nothing drawn
    labels = make_labels()
    for (c, g, seed), digest in [((9, 3, 0), "0b145f846c2ac6c8"), ((8, 4, 5), "4c98b69b58af56d1")]:
        sets = part.group_class_sets(NUM_CLASSES, g, seed)
        balanced = part.assign_groups(c, g, 99, "balanced")
        assert _digest(part.groups(labels, c, seed, class_sets=sets)) == digest
        assert _digest(part.groups(labels, c, seed, class_sets=sets, group_ids=balanced)) == digest


def test_groups_follow_given_ids_lone_clients_take_all_and_empty_groups_drop_classes():
    labels = make_labels()
    sets = part.group_class_sets(NUM_CLASSES, 3, 0)
    gid = np.array([1, 1, 0, 1, 1, 1])  # client 2 alone in group 0, group 2 empty
    parts = part.groups(labels, 6, 0, class_sets=sets, group_ids=gid)
    for c, p in enumerate(parts):
        assert set(np.flatnonzero(counts(labels, p))) == set(sets[gid[c]].tolist())
    np.testing.assert_array_equal(counts(labels, parts[2])[sets[0]], np.bincount(labels)[sets[0]])
    mixes = np.array([counts(labels, parts[c]) for c in (0, 1, 3, 4, 5)])
    assert np.abs(mixes - mixes[0]).max() <= 1
    used = np.concatenate(parts)
    assert not np.isin(labels[used], sets[2]).any()
    assert len(used) == np.isin(labels, np.concatenate(sets[:2])).sum()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: part.assign_groups(8, 2, 0, "stripes"), "group_assignment"),
        (lambda: part.assign_groups(3, 4, 0, "random_nonempty"), "group_assignment"),
        (lambda: part.assign_groups(3, 0, 0), "num_groups"),
        (lambda: part.assign_groups(12, 12, 0, "random_nonempty", max_draws=10), "balanced"),
        (lambda: part.groups(make_labels(), 3, 0, class_sets=[[0], [1]], group_ids=[0, 2, 1]), "group_ids"),
    ],
)
def test_bad_group_assignment_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -------------------------------------------------- the builder's group_assignment option


def _tiny_pooled(*, data_dir=None, seed=0):
    rng = np.random.default_rng(123)
    y = np.repeat(np.arange(6), 40).astype(np.int32)
    x = rng.normal(size=(240, 3)).astype(np.float32)
    return Pooled(x[:200], y[:200], x[200:], y[200:], 6)


def _fingerprint(fd):
    train, test = fd.data.train.padded(), fd.data.test.padded()  # the layout of a6429da
    x = (np.asarray(train.x) * 1000).astype(np.int64).ravel()
    return _digest([np.asarray(train.y).ravel(), np.asarray(test.y).ravel(), x])


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(sources.SOURCES, "fp_tiny", sources.SourceSpec(_tiny_pooled, False, None))
    return "fp_tiny"


EARLIER = [  # (options, digest and groups taken with the code of commit a6429da)
    (dict(partition="groups", num_groups=3), "279ac9d8c6b3be9e", [0, 0, 1, 1, 2, 2]),
    (
        dict(partition="groups", num_groups=2, group_relabel=False, samples_per_client=30),
        "b1694d200cd851cb",
        [0, 0, 0, 1, 1, 1],
    ),
    (dict(partition="iid", permute_labels="group", num_groups=2), "3b6239bbacff4008", [0, 0, 0, 1, 1, 1]),
]


@pytest.mark.parametrize("options,digest,group_ids", EARLIER)
@pytest.mark.parametrize("explicit", [False, True])
def test_builder_default_and_balanced_keep_the_earlier_data(tiny, options, digest, group_ids, explicit):
    extra = dict(group_assignment="balanced") if explicit else {}
    fd = build_federated_data(tiny, 6, seed=4, **options, **extra)
    assert _fingerprint(fd) == digest
    assert [c["group"] for c in fd.summary["clients"]] == group_ids


def test_builder_random_groups_as_in_the_paper(tiny):
    kw = dict(partition="groups", num_groups=3, group_relabel=False, seed=4)
    fd = build_federated_data(tiny, 6, group_assignment="random", **kw)
    gid = part.assign_groups(6, 3, [4, 1], "random")
    assert [c["group"] for c in fd.summary["clients"]] == gid.tolist()
    assert fd.num_classes == 6  # source labels kept
    balanced = build_federated_data(tiny, 6, group_assignment="balanced", **kw)
    sets = {}  # the class sets are the same draws as with balanced groups
    for info in balanced.summary["clients"]:
        sets[info["group"]] = info["source_classes"]
    for info in fd.summary["clients"]:
        assert info["classes"] == info["source_classes"] == sets[info["group"]]
        assert info["label_map"] == list(range(6))
    nonempty = build_federated_data(tiny, 6, group_assignment="random_nonempty", **kw)
    assert sorted({c["group"] for c in nonempty.summary["clients"]}) == [0, 1, 2]
    permuted = build_federated_data(
        tiny, 6, partition="iid", permute_labels="group", num_groups=2, group_assignment="random", seed=4
    )
    gid2 = part.assign_groups(6, 2, [4, 1], "random")
    maps = [c["label_map"] for c in permuted.summary["clients"]]
    for c in range(6):
        assert permuted.summary["clients"][c]["group"] == gid2[c]
        assert maps[c] == np.random.default_rng(4 + int(gid2[c])).permutation(6).tolist()


def test_builder_rejects_an_unknown_group_assignment(tiny):
    with pytest.raises(ValueError, match="group_assignment"):
        build_federated_data(tiny, 6, partition="iid", group_assignment="even")


# PFLlib's splits (partition.pfllib_*). Fashion-MNIST-shaped labels: 7000 per class
# (train + test merged), shuffled.
def fmnist_like_labels(seed=0):
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(NUM_CLASSES), 7000))


def assert_disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))


def test_pfllib_least_samples_is_one_test_batch_or_half_a_share():
    # int(min(10 / (1 - 0.75), N / C / 2)): PFLlib's Fashion-MNIST 40 = min(40, 1750).
    assert part.pfllib_least_samples(70000, 20) == 40
    assert part.pfllib_least_samples(1000, 20) == 25  # min(40, 25)
    assert part.pfllib_least_samples(70000, 20, batch_size=32, train_ratio=0.8) == 160


def test_pfllib_dirichlet_min_size_cover_and_seed():
    labels = fmnist_like_labels()
    parts = part.pfllib_dirichlet(labels, 20, 1, alpha=0.1)
    assert len(parts) == 20
    assert_disjoint_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= 40
    # label skew: with alpha 0.1 most clients miss several classes
    assert np.mean([(counts(labels, p) > 0).sum() for p in parts]) < 8
    again = part.pfllib_dirichlet(labels, 20, np.random.RandomState(1), alpha=0.1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = part.pfllib_dirichlet(labels, 20, 2, alpha=0.1)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_pfllib_dirichlet_redraws_until_every_client_has_the_minimum():
    labels = make_labels()  # 2900 samples: least = min(40, 2900 / 20 / 2 = 72.5) = 40
    sizes = [len(p) for p in part.pfllib_dirichlet(labels, 20, 0, alpha=0.1)]
    assert min(sizes) >= 40 and sum(sizes) == len(labels)
    # one draw alone rarely gives 20 clients 40 samples at alpha 0.1: the minimum is what redraws
    sizes = [len(p) for p in part.pfllib_dirichlet(labels, 20, 0, alpha=0.1, min_size=0)]
    assert min(sizes) < 40
    with pytest.raises(ValueError, match="minimum of 1000 samples"):
        part.pfllib_dirichlet(labels, 20, 0, alpha=0.1, min_size=1000, max_attempts=3)
    with pytest.raises(ValueError, match="dirichlet_alpha must be > 0"):
        part.pfllib_dirichlet(labels, 20, 0, alpha=0.0)
    with pytest.raises(ValueError, match="seed must be an int"):
        part.pfllib_dirichlet(labels, 20, np.random.default_rng(0))


@pytest.mark.parametrize("balance", [False, True])
def test_pfllib_pathological_two_classes_per_client(balance):
    labels = fmnist_like_labels()
    parts = part.pfllib_pathological(labels, 20, 1, classes_per_client=2, balance=balance)
    assert_disjoint_cover(parts, len(labels))
    for c, p in enumerate(parts):
        present = np.flatnonzero(counts(labels, p))
        # class k goes to the first ceil(20 / 10 * 2) = 4 clients with a slot left
        assert present.tolist() == [2 * (c // 4), 2 * (c // 4) + 1]
    for k in range(NUM_CLASSES):
        shares = [counts(labels, parts[4 * (k // 2) + j])[k] for j in range(4)]
        assert sum(shares) == 7000
        if balance:
            assert shares == [1750, 1750, 1750, 1750]
        else:  # randint(max(1750 / 10, 40 / 10), 1750) for all but the last
            assert all(175 <= s < 1750 for s in shares[:3]) and shares[3] == 7000 - sum(shares[:3])
    again = part.pfllib_pathological(labels, 20, 1, classes_per_client=2, balance=balance)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_pfllib_pathological_refuses_splits_that_leave_data_out():
    labels = fmnist_like_labels()
    with pytest.raises(ValueError, match="num_clients \\* classes_per_client >= num_classes=10"):
        part.pfllib_pathological(labels, 4, 1, classes_per_client=2)
    with pytest.raises(ValueError, match="classes_per_client must be in \\[1, num_classes=10\\]"):
        part.pfllib_pathological(labels, 20, 1, classes_per_client=11)


@pytest.mark.parametrize("partition", ["pfllib_dirichlet", "pfllib_pathological"])
def test_builder_pfllib_partitions_split_each_client_75_25(monkeypatch, partition):
    def pooled(*, data_dir=None, seed=0):
        y = fmnist_like_labels(3)[:4000].astype(np.int32)
        x = np.random.default_rng(4).normal(size=(4000, 2)).astype(np.float32)
        return Pooled(x[:3000], y[:3000], x[3000:], y[3000:], NUM_CLASSES)

    monkeypatch.setitem(sources.SOURCES, "pfl_pool", sources.SourceSpec(pooled, False, None))
    args = dict(partition=partition, dirichlet_alpha=0.1, classes_per_client=2, test_fraction=0.25, seed=1)
    fd = build_federated_data("pfl_pool", 20, **args)
    y_all = np.concatenate([pooled()[1], pooled()[3]])
    fn = part.pfllib_dirichlet if partition == "pfllib_dirichlet" else part.pfllib_pathological
    kw = dict(alpha=0.1) if partition == "pfllib_dirichlet" else dict(classes_per_client=2)
    expected = fn(y_all, 20, 1, **kw)  # train and test merged, seeded with data seed 1
    assert fd.summary["totals"]["train"] + fd.summary["totals"]["test"] == 4000
    for client, members in zip(fd.summary["clients"], expected, strict=True):
        n = len(members)
        assert client["train"] + client["test"] == n
        assert client["test"] == round(0.25 * n)  # PFLlib: n - floor(0.75 n), within one
        assert abs(client["test"] - (n - int(0.75 * n))) <= 1
        assert client["source_classes"] == sorted(np.unique(y_all[members]).tolist())
    if partition == "pfllib_pathological":
        assert all(len(c["source_classes"]) == 2 for c in fd.summary["clients"])
    with pytest.raises(ValueError, match="classes_per_client must be in \\[1, num_classes=10\\]"):
        build_federated_data(
            "pfl_pool", 20, **(args | dict(partition="pfllib_pathological", classes_per_client=0))
        )
    with pytest.raises(ValueError, match="dirichlet_alpha must be > 0"):
        build_federated_data(
            "pfl_pool", 20, **(args | dict(partition="pfllib_dirichlet", dirichlet_alpha=-1))
        )


FMNIST_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(FMNIST_DIR, "train-images-idx3-ubyte.gz")),
    reason="Fashion-MNIST IDX files absent (Debian package dataset-fashion-mnist)",
)
@pytest.mark.parametrize(
    "name,sizes,digest",
    [
        (
            "dir",
            [82, 320, 875, 2603, 1455, 5473, 4385, 4461, 5560, 3556]
            + [6170, 6803, 8551, 626, 1328, 195, 2937, 4832, 5090, 4698],
            "ea9ffc349fd19d6f",
        ),
        (
            "pat",
            [2316, 1300, 2293, 8091, 2059, 1002, 1893, 9046, 2933, 1909]
            + [2564, 6594, 2332, 1925, 1000, 8743, 1913, 1683, 3116, 7288],
            "e91739db9ad9b835",
        ),
    ],
)
def test_pfllib_splits_of_fashion_mnist_are_pfllibs_files(name, sizes, digest):
    """Client index sets of the merged 70000 labels (train then test, file order), seed 1.
    Sizes and digest were checked equal to what PFLlib's own separate_data (commit
    d832e76, np.random.seed(1), `noniid - dir` / `noniid - pat`) returns for the same
    labels, by running it once outside this repository."""
    d = idx.load_fashion_mnist(FMNIST_DIR)
    y = np.concatenate([d["y_train"], d["y_test"]])
    if name == "dir":
        parts = part.pfllib_dirichlet(y, 20, 1, alpha=0.1)
    else:
        parts = part.pfllib_pathological(y, 20, 1, classes_per_client=2)
    assert [len(p) for p in parts] == sizes
    digest_of = hashlib.sha256()
    for p in parts:
        digest_of.update(np.asarray(p, np.int64).tobytes())
    assert digest_of.hexdigest()[:16] == digest


def test_pfllib_train_test_split_is_sklearns_shuffled_split_on_the_global_stream():
    """Hard-coded: what np.random.seed(3) then sklearn 1.9.1's train_test_split(arange(n),
    train_size=0.75, shuffle=True) gave for n = 10, 7, 41 in turn, and the next draw
    np.random.randint(1000) (the stream advanced as sklearn advances it)."""
    rs = np.random.RandomState(3)
    want = {
        10: ([2, 9, 6, 7, 0, 3, 8], [5, 4, 1]),
        7: ([3, 4, 0, 5, 2], [6, 1]),
        41: (
            [0, 6, 23, 12, 4, 27, 37, 29, 16, 15, 30, 11, 7, 24, 10, 32, 40, 8, 5, 36]
            + [19, 1, 34, 2, 22, 38, 17, 26, 14, 39],
            [13, 28, 21, 3, 31, 25, 18, 20, 33, 9, 35],
        ),
    }
    for n, (train, test) in want.items():
        got = part.pfllib_train_test_split(n, 0.75, rs)
        assert [g.tolist() for g in got] == [train, test]  # floor(0.75 n) train, in sklearn's order
    assert rs.randint(1000) == 686
    assert [len(p) for p in part.pfllib_train_test_split(40, 1 - 0.25, 0)] == [30, 10]
    with pytest.raises(ValueError, match="leaves no training sample"):
        part.pfllib_train_test_split(1, 0.75, 0)


def test_builder_test_split_pfllib_continues_the_partitions_stream(monkeypatch):
    """test_split="pfllib": after pfllib_dirichlet's draws from RandomState(seed), one
    permutation per client, in client order, from the same stream (PFLlib's)."""

    def pooled(*, data_dir=None, seed=0):
        y = fmnist_like_labels(3)[:4000].astype(np.int32)
        x = np.arange(4000, dtype=np.float32)[:, None]  # x: the merged index
        return Pooled(x[:3000], y[:3000], x[3000:], y[3000:], NUM_CLASSES)

    monkeypatch.setitem(sources.SOURCES, "pfl_index", sources.SourceSpec(pooled, False, None))
    args = dict(partition="pfllib_dirichlet", dirichlet_alpha=1.0, test_fraction=0.25, seed=1)
    fd = build_federated_data("pfl_index", 20, test_split="pfllib", **args)
    rs = np.random.RandomState(1)
    y_all = np.concatenate([pooled()[1], pooled()[3]])
    members = part.pfllib_dirichlet(y_all, 20, rs, alpha=1.0)
    for c, m in enumerate(members):
        train_pos, test_pos = part.pfllib_train_test_split(len(m), 0.75, rs)
        for pool, pos in ((fd.data.train, train_pos), (fd.data.test, test_pos)):
            x, o, n = np.asarray(pool.x[:, 0]), int(pool.offset[c]), int(pool.count[c])
            np.testing.assert_array_equal(x[o : o + n], m[pos])  # PFLlib's row order
    assert fd.summary["test_split"] == "pfllib"
    with pytest.raises(ValueError, match="test_split='random' is unknown"):
        build_federated_data("pfl_index", 20, test_split="random", **args)
