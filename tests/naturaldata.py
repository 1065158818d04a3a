"""Tiny LEAF JSON and TFF HDF5 files for tests, written where the test says."""

import json
import os

import numpy as np

LETTERS = "abcdefgh ,.ABC"


def _leaf_rows(task: str, n: int, rng) -> dict:
    if task == "femnist":
        x = (rng.integers(0, 256, (n, 784)) / 255.0).tolist()
        return {"x": x, "y": rng.integers(0, 62, n).tolist()}
    text = ["".join(rng.choice(list(LETTERS), 81)) for _ in range(n)]
    return {"x": [t[:80] for t in text], "y": [t[80] for t in text]}


def write_leaf(root: str, task: str, sizes: dict, seed: int = 0) -> str:
    """LEAF's data/ directory: users {id: (n_train, n_test)}, the users split over two
    files per split (as LEAF's *_niid_*.json shards); returns root."""
    rng = np.random.default_rng(seed)
    users = list(sizes)
    for s, split in enumerate(("train", "test")):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for f, part in enumerate((users[::2], users[1::2])):
            data = {u: _leaf_rows(task, sizes[u][s], rng) for u in part}
            body = {"users": part, "num_samples": [sizes[u][s] for u in part], "user_data": data}
            with open(os.path.join(root, split, f"all_data_{f}_{split}.json"), "w") as fh:
                json.dump(body, fh)
    return root


def write_tff(root: str, task: str, sizes: dict, seed: int = 0) -> str:
    """TFF's <name>_train.h5 / <name>_test.h5 (examples/<client>/pixels+label or
    snippets) with clients {id: (n_train, n_test)}; returns root."""
    import h5py  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    name = "fed_emnist" if task == "emnist" else "shakespeare"
    os.makedirs(root, exist_ok=True)
    for s, split in enumerate(("train", "test")):
        with h5py.File(os.path.join(root, f"{name}_{split}.h5"), "w") as f:
            for client, n in sizes.items():
                g = f.create_group(f"examples/{client}")
                if task == "emnist":
                    g["pixels"] = rng.integers(0, 256, (n[s], 28, 28)).astype(np.float32) / np.float32(255)
                    g["label"] = rng.integers(0, 62, n[s]).astype(np.int32)
                else:
                    lengths = rng.integers(1, 200, n[s])
                    g["snippets"] = np.array(
                        ["".join(rng.choice(list(LETTERS), k)).encode() for k in lengths], dtype=object
                    )
    return root
