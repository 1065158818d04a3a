"""TFF HDF5 reader: per-client rows against a direct h5py read of fixture files, bad files."""

import os

import h5py
import numpy as np
import pytest

from pfljax.data import build_federated_data
from pfljax.data.shakespeare import tff_windows
from pfljax.data.tff_h5 import load_tff
from tests.naturaldata import write_tff

SIZES = {"c3": (5, 2), "c1": (3, 1), "c2": (1, 1), "c0": (4, 2)}


def test_emnist_rows_and_labels_are_the_files(tmp_path):
    root = write_tff(str(tmp_path), "emnist", SIZES)
    src = load_tff("emnist", data_dir=root, num_clients=3, min_samples=3)  # c2 left out
    for split, xs, ys in (("train", src.xs, src.ys), ("test", *src.test)):
        with h5py.File(os.path.join(root, f"fed_emnist_{split}.h5")) as f:
            for c, x, y in zip(["c0", "c1", "c3"], xs, ys, strict=True):
                assert x.dtype == np.uint8 and x.shape[1:] == (28, 28, 1)
                np.testing.assert_array_equal(src.levels[x][..., 0], f[f"examples/{c}/pixels"][()])
                np.testing.assert_array_equal(y, f[f"examples/{c}/label"][()])
    assert src.num_classes == 62


def test_shakespeare_is_tffs_windows_per_client_and_a_sequence_task(tmp_path):
    root = write_tff(str(tmp_path), "shakespeare", SIZES)
    fd = build_federated_data("tff_shakespeare", 4, data_dir=root)
    assert fd.task == "sequence" and fd.input_shape == (80,) and fd.num_classes == 90
    with h5py.File(os.path.join(root, "shakespeare_train.h5")) as f:
        expect = [
            tff_windows([s.decode() for s in f[f"examples/{c}/snippets"][()]])
            for c in ["c0", "c1", "c2", "c3"]
        ]
    np.testing.assert_array_equal(fd.data.train.count, [len(x) for x, _ in expect])
    pool = fd.data.train
    for c, (x, y) in enumerate(expect):
        o, n = int(pool.offset[c]), int(pool.count[c])
        np.testing.assert_array_equal(pool.x[o : o + n], x)
        np.testing.assert_array_equal(pool.y[o : o + n], y)


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("nothing", "*fed_emnist*_train.h5: no such file"),
        ("garbage", "fed_emnist_test.h5: not a TFF emnist file"),
    ],
)
def test_bad_files_are_one_line_naming_the_path_layout_and_tff_call(tmp_path, damage, needle):
    root = str(tmp_path)
    if damage == "garbage":
        write_tff(root, "emnist", SIZES)
        with open(os.path.join(root, "fed_emnist_test.h5"), "w") as f:
            f.write("not hdf5")
    with pytest.raises(ValueError) as e:
        load_tff("emnist", data_dir=root, num_clients=2)
    message = str(e.value)
    assert needle in message and "\n" not in message
    assert "examples/<client_id>/{pixels, label}" in message and "emnist.load_data" in message
