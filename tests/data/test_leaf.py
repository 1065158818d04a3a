"""LEAF JSON reader: per-user rows against a direct json read of fixture files, user choice, bad files."""

import glob
import json
import os

import numpy as np
import pytest

from pfljax.data import build_federated_data
from pfljax.data.leaf import load_leaf
from pfljax.data.shakespeare import LEAF_LETTERS
from tests.naturaldata import write_leaf

SIZES = {"u3": (5, 2), "u1": (3, 1), "u2": (1, 1), "u0": (4, 2), "u4": (6, 3)}


def _direct(root, split):
    """{user: rows} read straight from the files."""
    out = {}
    for path in glob.glob(os.path.join(root, split, "*.json")):
        with open(path) as f:
            out.update(json.load(f)["user_data"])
    return out


@pytest.mark.parametrize("task", ["femnist", "shakespeare"])
def test_rows_and_labels_are_the_files_users_in_sorted_order(tmp_path, task):
    root = write_leaf(str(tmp_path), task, SIZES)
    src = load_leaf(task, data_dir=root, num_clients=4, min_samples=3)  # u2 (2 samples) left out
    users = ["u0", "u1", "u3", "u4"]
    for split, xs, ys in (("train", src.xs, src.ys), ("test", *src.test)):
        rows = _direct(root, split)
        assert [len(y) for y in ys] == [len(rows[u]["y"]) for u in users]
        for u, x, y in zip(users, xs, ys, strict=True):
            if task == "femnist":
                assert x.dtype == np.uint8 and x.shape[1:] == (28, 28, 1)
                np.testing.assert_array_equal(src.levels[x].reshape(len(x), -1), np.float32(rows[u]["x"]))
                np.testing.assert_array_equal(y, rows[u]["y"])
            else:
                assert x.dtype == np.int32 and x.shape[1:] == (80,)
                assert ["".join(LEAF_LETTERS[i] for i in row) for row in x] == rows[u]["x"]
                assert [LEAF_LETTERS[i] for i in y] == rows[u]["y"]
    assert src.num_classes == (62 if task == "femnist" else 80)


def test_federated_data_keeps_each_users_split_and_random_users_are_seeded(tmp_path):
    root = write_leaf(str(tmp_path), "shakespeare", SIZES)
    fd = build_federated_data("leaf_shakespeare", 5, data_dir=root)
    assert fd.task == "classification" and fd.input_shape == (80,) and fd.num_classes == 80
    assert fd.data.train.x.dtype == np.int32 and fd.summary["test_split"] == "source"
    np.testing.assert_array_equal(fd.data.train.count, [4, 3, 1, 5, 6])
    np.testing.assert_array_equal(fd.data.test.count, [2, 1, 1, 2, 3])
    picks = [
        load_leaf("shakespeare", data_dir=root, num_clients=2, users="random", seed=s).ys for s in (0, 0, 1)
    ]
    sizes = [[len(y) for y in p] for p in picks]
    assert sizes[0] == sizes[1]
    with pytest.raises(ValueError, match="samples_per_client=3: dataset='leaf_shakespeare' has its own"):
        build_federated_data("leaf_shakespeare", 5, data_dir=root, samples_per_client=3)
    with pytest.raises(
        ValueError, match="num_clients=5 exceeds the 4 users with at least source.min_samples=3"
    ):
        load_leaf("shakespeare", data_dir=root, num_clients=5, min_samples=3)


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("nothing", "train: no .json files; expected a LEAF data/ directory"),
        ("not json", "all_data_0_train.json: not a LEAF JSON file (JSONDecodeError"),
        ("short row", "user 'u3': rows are not 784 pixels and a label"),
        ("extra user", "user 'zz' is not in both train/ and test/"),
    ],
)
def test_bad_files_are_one_line_naming_the_path_layout_and_script(tmp_path, damage, needle):
    root = str(tmp_path / "data")
    if damage != "nothing":
        write_leaf(root, "femnist", SIZES)
    path = os.path.join(root, "train", "all_data_0_train.json")
    if damage == "not json":
        with open(path, "w") as f:
            f.write("{not json")
    if damage in ("short row", "extra user"):
        with open(path) as f:
            body = json.load(f)
        if damage == "short row":
            body["user_data"]["u3"]["x"][0] = [0.0] * 5
        else:
            body["user_data"]["zz"] = body["user_data"]["u3"]
        with open(path, "w") as f:
            json.dump(body, f)
    with pytest.raises(ValueError) as e:
        load_leaf("femnist", data_dir=root, num_clients=5)
    message = str(e.value)
    assert needle in message and "\n" not in message and "./preprocess.sh -s niid" in message
