"""LEAF's JSON files (TalwalkarLab/leaf): FEMNIST and Shakespeare, users as clients.

LEAF's preprocess.sh writes `data/train/*.json` and `data/test/*.json`, each
{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y":
[...]}}}; every user has rows in both. Users are read as LEAF's models read them
(models/utils/model_utils.read_data: every file's user_data merged, users sorted
by id), then `natural.select_users` keeps users with at least `min_samples`
(train + test) samples and takes the first or a seeded random `num_clients`.

Tasks (`TASKS`):
- "femnist": x 784 floats in [0, 1] -> [28, 28, 1] images (uint8 codes with
  `levels` when they are k / 255, as LEAF writes them), y 62 classes;
- "shakespeare": x 80-character strings -> [80] int32 LEAF ids, y the next
  character's id (`shakespeare.leaf_ids`): one label per sequence, as LEAF.

Registered as the per-client sources "leaf_femnist" and "leaf_shakespeare"
(`data_dir`: the LEAF `data/` directory; options min_samples, users).
"""

from __future__ import annotations

import glob
import json
import os
from typing import NamedTuple

import numpy as np

from pfljax.data import natural, shakespeare
from pfljax.data.sources import PerClient, register_source

LAYOUT = 'train/*.json and test/*.json, each {"users", "num_samples", "user_data": {user: {"x", "y"}}}'


class Task(NamedTuple):
    """A LEAF task: how its x and y rows become arrays, and how LEAF makes its files."""

    num_classes: int
    images: bool
    how: str


TASKS = {
    "femnist": Task(62, True, "LEAF's data/femnist: ./preprocess.sh -s niid --sf 0.05 -k 0 -t sample"),
    "shakespeare": Task(
        80, False, "LEAF's data/shakespeare: ./preprocess.sh -s niid --sf 0.2 -k 0 -t sample -tf 0.8"
    ),
}


def read_split(data_dir: str, split: str, task: str) -> dict[str, dict]:
    """{user: {"x", "y"}} of every `<data_dir>/<split>/*.json` (ValueError naming
    the path for a missing directory or a malformed file)."""
    files = sorted(glob.glob(os.path.join(data_dir, split, "*.json")))
    if not files:
        where = os.path.join(data_dir, split)
        raise natural.data_error(
            where, "no .json files", f"a LEAF data/ directory with {LAYOUT}", TASKS[task].how
        )
    data = {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                users = json.load(f)["user_data"]
            data.update({u: {"x": users[u]["x"], "y": users[u]["y"]} for u in users})
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"not a LEAF JSON file ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
            raise natural.data_error(path, problem, LAYOUT, TASKS[task].how) from e
    return data


def user_arrays(rows: dict, task: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) arrays of one user's LEAF rows: [n, 28, 28, 1] float32 and [n] int32
    (femnist) or [n, 80] and [n] int32 LEAF ids (shakespeare)."""
    try:
        if task == "shakespeare":
            x, y = shakespeare.leaf_ids(rows["x"]), shakespeare.leaf_targets(rows["y"])
        else:
            x = np.asarray(rows["x"], np.float32).reshape(len(rows["x"]), 28, 28, 1)
            y = np.asarray(rows["y"], np.int32).reshape(len(rows["x"]))
    except ValueError as e:
        what = "784 pixels and a label" if task == "femnist" else "80-character strings and next characters"
        problem = f"rows are not {what} ({' '.join(str(e).split())[:80]})"
        raise natural.data_error(where, problem, LAYOUT, TASKS[task].how) from e
    return x, y


def load_leaf(task: str, *, data_dir=None, seed=0, num_clients=10, min_samples=0, users="first") -> PerClient:
    """The chosen users' train and test rows as sources.PerClient (with its test split).

    Args:
      task: "femnist" or "shakespeare".
      data_dir: LEAF's `data/` directory of the task (holding train/ and test/).
      seed: seed of users="random".
      num_clients: users to keep.
      min_samples: keep only users with at least this many (train + test) samples.
      users: "first" (in LEAF's sorted order) or "random".
    """
    if not data_dir:
        raise natural.data_error(
            "config.data_dir (unset)",
            "no directory",
            f"a LEAF data/ directory with {LAYOUT}",
            TASKS[task].how,
        )
    train, test = (read_split(data_dir, s, task) for s in ("train", "test"))
    if sorted(train) != sorted(test):
        odd = sorted(set(train) ^ set(test))[0]
        raise natural.data_error(
            data_dir, f"user {odd!r} is not in both train/ and test/", LAYOUT, TASKS[task].how
        )
    ids = sorted(train)
    sizes = [len(train[u]["y"]) + len(test[u]["y"]) for u in ids]
    chosen = [
        ids[i]
        for i in natural.select_users(sizes, num_clients, min_samples=min_samples, users=users, seed=seed)
    ]
    arrays = {
        s: [user_arrays(d[u], task, f"{data_dir}/{s} user {u!r}") for u in chosen]
        for s, d in (("train", train), ("test", test))
    }
    return natural.per_client_source(
        arrays["train"], arrays["test"], TASKS[task].num_classes, images=TASKS[task].images
    )


for _task in TASKS:
    register_source(
        f"leaf_{_task}",
        lambda _task=_task, **kw: load_leaf(_task, **kw),
        per_client=True,
        num_classes=TASKS[_task].num_classes,
        users=True,
    )
