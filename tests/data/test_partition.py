"""Tests for pfljax.data.partition on synthetic labels."""

import numpy as np
import pytest

from pfljax.data import partition as part

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
