"""Tests for build_federated_data, pad_clients and source dispatch."""

import json
import os

import chex
import numpy as np
import pytest

from pfljax.core.types import ClientPool
from pfljax.data import build_federated_data, idx, pad_clients, pool_clients, sources
from pfljax.data.sources import PerClient, Pooled

HAVE_FMNIST = all(
    os.path.isfile(os.path.join(idx.DEFAULT_FASHION_MNIST_DIR, s + ".gz"))
    for s in idx.FASHION_MNIST_FILES.values()
)
needs_fmnist = pytest.mark.skipif(
    not HAVE_FMNIST,
    reason="Fashion-MNIST IDX files absent from "
    "/usr/share/datasets/fashion-mnist (Debian package dataset-fashion-mnist)",
)

SIM = dict(samples_per_client=120, d=20, m=30)


def check_pool(pool):
    """Offsets tile the pool without overlap; every view window lies inside it."""
    off, n = np.asarray(pool.offset), np.asarray(pool.count)
    order = np.argsort(off, kind="stable")
    np.testing.assert_array_equal(off[order], np.concatenate([[0], np.cumsum(n[order])[:-1]]))
    assert n.sum() == len(pool.x) == len(pool.y)
    assert pool.n_max == max(n.max(), 1) and np.all(off + pool.n_max <= len(pool.x))


def padded(arrays):
    return arrays.padded() if isinstance(arrays, ClientPool) else arrays


def check_padding_and_counts(arrays, summary_counts):
    if isinstance(arrays, ClientPool):
        check_pool(arrays)
    x, y, count = (np.asarray(a) for a in padded(arrays))
    np.testing.assert_array_equal(count, summary_counts)
    assert x.dtype == np.float32 and y.dtype == np.int32
    assert count.dtype == np.int32
    assert x.shape[1] == y.shape[1] == count.max()
    for c, n in enumerate(count):
        assert not np.any(x[c, n:]) and not np.any(y[c, n:])
        assert np.any(x[c, :n])  # real rows are not blank


def labels_of(arrays, c):
    return arrays.client_labels()[c]


def test_pad_clients_zero_pads_beyond_count():
    xs = [np.ones((3, 2)), np.ones((1, 2)) * 2, np.ones((0, 2))]
    ys = [np.array([1, 2, 3]), np.array([4]), np.zeros(0, int)]
    out = pad_clients(xs, ys)
    np.testing.assert_array_equal(out.count, [3, 1, 0])
    assert out.x.shape == (3, 3, 2) and out.y.shape == (3, 3)
    np.testing.assert_array_equal(out.y, [[1, 2, 3], [4, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(out.x[1], [[2, 2], [0, 0], [0, 0]])
    assert out.y.dtype == np.int32 and out.x.dtype == np.float32
    reg = pad_clients([np.ones((2, 1))], [np.ones((2, 3), np.float32)])
    assert reg.y.shape == (1, 2, 3) and reg.y.dtype == np.float32


def test_pool_clients_views_equal_the_padded_arrays():
    rng = np.random.default_rng(0)
    sizes = [3, 7, 0, 5]
    codes = [rng.integers(0, 256, (n, 2, 2)).astype(np.uint8) for n in sizes]
    ys = [rng.integers(0, 4, n).astype(np.int32) for n in sizes]
    levels = (np.arange(256, dtype=np.float32) - 7.0) / 3.0
    pool = pool_clients(codes, ys, levels)
    check_pool(pool)
    assert pool.x.dtype == np.uint8 and pool.x.shape == (15, 2, 2)  # no padding rows
    assert int(pool.offset[1]) == 15 - 7  # the largest client is stored last
    ref = pad_clients([levels[x] for x in codes], ys)
    got = pool.padded()
    chex.assert_trees_all_equal(got, ref)  # bit for bit: the table is the float
    for c, n in enumerate(sizes):
        view = pool.client(c)
        assert view.x.shape == (7, 2, 2) and int(view.count) == n
        np.testing.assert_array_equal(view.x[:n], ref.x[c, :n])
        r = np.arange(n)
        np.testing.assert_array_equal(pool.rows(c, r)[0], ref.x[c, :n])
        np.testing.assert_array_equal(pool.client_labels()[c], ys[c])


def test_simulation_clients_split_stratified_with_truth():
    fd = build_federated_data("simulation", 6, source_kwargs=SIM, seed=3)
    s = fd.summary
    json.dumps(s)  # JSON-serializable
    check_padding_and_counts(fd.data.train, [c["train"] for c in s["clients"]])
    check_padding_and_counts(fd.data.test, [c["test"] for c in s["clients"]])
    assert [(c["train"], c["test"]) for c in s["clients"]] == [(96, 24)] * 6
    assert s["totals"] == {"train": 576, "test": 144}
    for c in range(6):
        # Median labels: 60 ones out of 120; stratified: 12 of 24 test.
        assert labels_of(fd.data.test, c).sum() == 12
        assert labels_of(fd.data.train, c).sum() == 48
    assert fd.num_classes == 2 and fd.input_shape == (20,)
    assert fd.task == "classification"
    assert fd.truth["hidden_weights"].shape == (6, 30, 20)
    again = build_federated_data("simulation", 6, source_kwargs=SIM, seed=3)
    np.testing.assert_array_equal(padded(fd.data.train).x, padded(again.data.train).x)


def test_simulation_label_permutation_per_group():
    # seed 2: group 0 uses default_rng(2).permutation(2) = [0, 1] and group 1
    # default_rng(3).permutation(2) = [1, 0].
    plain = build_federated_data("simulation", 6, source_kwargs=SIM, seed=2)
    fd = build_federated_data(
        "simulation", 6, source_kwargs=SIM, permute_labels="group", num_groups=2, seed=2
    )
    maps = [c["label_map"] for c in fd.summary["clients"]]
    assert [c["group"] for c in fd.summary["clients"]] == [0, 0, 0, 1, 1, 1]
    assert maps == [[0, 1]] * 3 + [[1, 0]] * 3
    # Same samples; labels of group 1 are flipped, group 0 untouched.
    np.testing.assert_array_equal(padded(fd.data.train).x, padded(plain.data.train).x)
    y, y0 = np.asarray(padded(fd.data.train).y), np.asarray(padded(plain.data.train).y)
    for c in range(6):
        n = int(fd.data.train.count[c])
        expected = y0[c, :n] if c < 3 else 1 - y0[c, :n]
        np.testing.assert_array_equal(y[c, :n], expected)


def test_registered_per_client_source_hook(monkeypatch):
    def sine(*, data_dir=None, seed=0, num_clients=3, n=30):
        rng = np.random.default_rng(seed)
        xs = [rng.uniform(-1, 1, (n, 1)).astype(np.float32) for _ in range(num_clients)]
        ys = [(np.sin(3 * x[:, 0] + c) > 0).astype(np.int32) for c, x in enumerate(xs)]
        return PerClient(xs, ys, 2, {"phase": np.arange(num_clients)})

    monkeypatch.setitem(sources.SOURCES, "sine", sources.SourceSpec(sine, True, 2))
    fd = build_federated_data("sine", 4, test_fraction=0.5)
    assert fd.input_shape == (1,)
    np.testing.assert_array_equal(fd.data.train.count + fd.data.test.count, [30] * 4)
    np.testing.assert_array_equal(fd.truth["phase"], np.arange(4))
    assert "sine" in sources.allowed_datasets()


@needs_fmnist
def test_fashion_mnist_ten_clients_four_classes_each():
    fd = build_federated_data("fashion_mnist", 10, partition="classes", classes_per_client=4, seed=0)
    s = fd.summary
    json.dumps(s)
    train, test = fd.data.train, fd.data.test
    assert train.count.shape[0] == 10 and train.x.shape[1:] == (28, 28, 1)
    assert train.x.dtype == np.uint8  # pixels stay uint8 on device
    assert fd.num_classes == 10 and fd.input_shape == (28, 28, 1)
    check_padding_and_counts(train, [c["train"] for c in s["clients"]])
    check_padding_and_counts(test, [c["test"] for c in s["clients"]])
    assert s["totals"]["train"] + s["totals"]["test"] <= 70000
    for c, info in enumerate(s["clients"]):
        n = info["train"] + info["test"]
        assert abs(info["test"] - 0.2 * n) <= 0.5
        ytr, yte = labels_of(train, c), labels_of(test, c)
        assert len(info["classes"]) == 4
        np.testing.assert_array_equal(np.unique(ytr), info["classes"])
        np.testing.assert_array_equal(np.unique(yte), info["classes"])
        per_class = np.bincount(np.concatenate([ytr, yte]), minlength=10)
        assert len(set(per_class[info["classes"]].tolist())) == 1  # equal
        # Stratified: each class's test count within one of 20%.
        test_per_class = np.bincount(yte, minlength=10)
        assert np.abs(test_per_class - 0.2 * per_class).max() <= 1
        assert np.asarray(padded(train).x[c, : info["train"]]).max() <= 1.0
        # data.json's per-class counts are the arrays' (what the model trains and is tested on).
        assert info["train_class_counts"] == np.bincount(ytr, minlength=10).tolist()
        assert info["test_class_counts"] == test_per_class.tolist()
        assert sum(info["train_class_counts"]) == info["train"]


@needs_fmnist
def test_fashion_mnist_groups_relabelled_with_permuted_clients():
    fd = build_federated_data(
        "fashion_mnist", 6, partition="groups", num_groups=3, samples_per_client=150, seed=1
    )
    s = fd.summary
    assert fd.num_classes == 3
    groups = [c["group"] for c in s["clients"]]
    assert groups == [0, 0, 1, 1, 2, 2]
    src = [set(c["source_classes"]) for c in s["clients"]]
    assert src[0] == src[1] and src[2] == src[3] and src[4] == src[5]
    assert not (src[0] & src[2]) and not (src[0] & src[4])
    assert not (src[2] & src[4])
    for c, info in enumerate(s["clients"]):
        assert info["train"] + info["test"] == 150  # the cap
        assert info["classes"] == [0, 1, 2]  # every group relabelled 0..2
        # The group's map sends its sorted source classes to 0, 1, 2.
        lm = np.array(info["label_map"])
        np.testing.assert_array_equal(lm[sorted(src[c])], [0, 1, 2])
        # Per-class counts over the relabelled (model) labels 0..2, as in the arrays.
        for split in ("train", "test"):
            arrays = fd.data.train if split == "train" else fd.data.test
            want = np.bincount(labels_of(arrays, c), minlength=3).tolist()
            assert info[f"{split}_class_counts"] == want and len(want) == 3
        assert np.all(lm[sorted(set(range(10)) - src[c])] == -1)
    # Same relabelled label means different source classes across groups.
    assert s["clients"][0]["label_map"] != s["clients"][2]["label_map"]

    perm = build_federated_data(
        "fashion_mnist",
        6,
        partition="groups",
        num_groups=3,
        samples_per_client=150,
        seed=1,
        permute_labels="client",
    )
    maps = [c["label_map"] for c in perm.summary["clients"]]
    assert maps[0] != maps[1]  # same group, different client permutation
    for info in perm.summary["clients"]:
        assert info["classes"] == [0, 1, 2]  # still a bijection of 0..2


def tiny_pooled(*, data_dir=None, seed=0):
    x = np.arange(20, dtype=np.float32).reshape(20, 1)
    y = np.arange(20, dtype=np.int32) % 4
    return Pooled(x[:15], y[:15], x[15:], y[15:], 4)


BAD = [
    (dict(dataset="mnist_typo"), "dataset"),
    (dict(dataset="tfds:"), "dataset"),
    (dict(partition="stripes"), "partition"),
    (dict(permute_labels="shuffle"), "permute_labels"),
    (dict(num_clients=0), "num_clients"),
    (dict(num_clients=-3), "num_clients"),
    (dict(partition="dirichlet", dirichlet_alpha=0.0), "dirichlet_alpha"),
    (dict(partition="dirichlet", dirichlet_alpha=-1.0), "dirichlet_alpha"),
    (dict(partition="classes", classes_per_client=0), "classes_per_client"),
    (dict(partition="shards", classes_per_client=11), "classes_per_client"),
    (dict(partition="groups", num_groups=0), "num_groups"),
    (dict(partition="groups", num_groups=5), "num_groups"),  # > 4 clients
    (dict(permute_labels="group", num_groups=9), "num_groups"),
    (dict(partition="dominant", num_dominant=10), "num_dominant"),
    (dict(partition="dominant", dominant_fraction=1.5), "dominant_fraction"),
    (dict(test_fraction=0.0), "test_fraction"),
    (dict(test_fraction=1.0), "test_fraction"),
    (dict(samples_per_client=0), "samples_per_client"),
    (dict(data_dir="/no/such/fashion-mnist"), "data_dir"),
]


@pytest.mark.parametrize("kwargs,name", BAD)
def test_bad_inputs_raise_naming_the_argument(kwargs, name):
    args = dict(dataset="fashion_mnist", num_clients=4) | kwargs
    with pytest.raises(ValueError, match=name):
        build_federated_data(**args)


def test_more_groups_than_classes_and_more_clients_than_samples(monkeypatch):
    monkeypatch.setitem(sources.SOURCES, "tiny", sources.SourceSpec(tiny_pooled, False, None))
    with pytest.raises(ValueError, match="num_groups.*num_classes"):
        build_federated_data("tiny", 6, partition="groups", num_groups=5)
    with pytest.raises(ValueError, match="num_clients"):
        build_federated_data("tiny", 21)
    fd = build_federated_data("tiny", 2, partition="groups", num_groups=2)
    assert fd.num_classes == 2
    assert fd.summary["totals"]["train"] + fd.summary["totals"]["test"] == 20


def test_per_client_source_rejects_other_partitions():
    with pytest.raises(ValueError, match="partition"):
        build_federated_data("simulation", 3, partition="dirichlet", source_kwargs=SIM)


def test_regression_source_keeps_real_targets():
    """A per-client source with float targets (the sine toy) gives task "regression",
    float32 targets split at random, and refuses label permutations."""
    fd = build_federated_data("sine", 4, samples_per_client=30, test_fraction=0.2, seed=1)
    assert fd.task == "regression" and fd.summary["task"] == "regression"
    assert fd.data.train.y.dtype == np.float32 and fd.data.train.y.shape[-1] == 1
    np.testing.assert_array_equal(np.asarray(fd.data.train.count) + np.asarray(fd.data.test.count), 30)
    assert np.all(np.abs(np.asarray(fd.data.train.y)) <= 1.6)  # sin + small noise, not class ids
    assert all(c["train_class_counts"] == [] == c["test_class_counts"] for c in fd.summary["clients"])
    with pytest.raises(ValueError, match="permute_labels"):
        build_federated_data("sine", 4, permute_labels="client")


def test_a_partition_that_must_leave_a_class_out_is_refused(monkeypatch):
    def four_classes(*, data_dir=None, seed=0):
        rng = np.random.default_rng(seed)
        y = np.repeat(np.arange(4), 30).astype(np.int32)
        return Pooled(rng.normal(size=(120, 3)).astype(np.float32), y, np.zeros((0, 3), np.float32), y[:0], 4)

    monkeypatch.setitem(sources.SOURCES, "four", sources.SourceSpec(four_classes, False, 4))
    for partition in ("classes", "shards"):
        with pytest.raises(ValueError, match=r"num_clients=2 x classes_per_client=1 < num_classes=4") as e:
            build_federated_data("four", 2, partition=partition, classes_per_client=1)
        assert "\n" not in str(e.value)
    # Random class draws that happen to leave one out are recorded, not refused.
    fd = build_federated_data("four", 4, partition="classes", classes_per_client=1, seed=0)
    held = {c["source_classes"][0] for c in fd.summary["clients"]}
    assert fd.summary["unplaced_classes"] == sorted(set(range(4)) - held)


def test_a_data_spec_holds_the_arguments_with_their_defaults_and_builds_the_same_data():
    import inspect  # noqa: PLC0415

    from pfljax.data import DataSpec  # noqa: PLC0415

    params = inspect.signature(build_federated_data).parameters
    assert list(params) == list(DataSpec._fields)
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    assert {k: v for k, v in defaults.items() if k != "num_clients"} == DataSpec._field_defaults
    source = {"samples_per_client": 30, "d": 6, "m": 4}
    spec = DataSpec("simulation", 5, seed=4, test_fraction=0.3, source_kwargs=source)
    by_spec = build_federated_data(spec)
    by_args = build_federated_data("simulation", 5, seed=4, test_fraction=0.3, source_kwargs=source)
    chex.assert_trees_all_equal(by_spec.data, by_args.data)
    assert by_spec.summary == by_args.summary
    with pytest.raises(TypeError, match=r"a DataSpec holds every argument; also given: \['seed'\]"):
        build_federated_data(spec, seed=1)
