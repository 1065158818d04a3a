"""TFF's HDF5 files (tff.simulation.datasets): EMNIST and Shakespeare, clients as in the files.

`tff.simulation.datasets.emnist.load_data(cache_dir=DIR)` and
`...shakespeare.load_data(cache_dir=DIR)` download and unpack
`fed_emnist_train.h5` / `fed_emnist_test.h5` and `shakespeare_train.h5` /
`shakespeare_test.h5` (under DIR/datasets); `data_dir` is the directory holding
them. Each file has a group `examples/<client_id>` per client with:
- EMNIST: `pixels` [n, 28, 28] float32 in [0, 1] -> [n, 28, 28, 1] images (uint8
  codes with `levels` where they are k / 255) and `label` [n] (62 classes);
- Shakespeare: `snippets` [n] bytes strings -> TFF's 80-id windows with
  next-id targets per position (`shakespeare.tff_windows`, vocabulary of 90, 0
  padding: task "sequence", loss "token_cross_entropy").
Clients are the train file's client ids in sorted order (a client missing from
the test file has no test rows); `natural.select_users` keeps those with at
least `min_samples` train + test examples (EMNIST images, Shakespeare snippets) and takes the
first or a seeded random `num_clients`. h5py is imported when a file is read
(`pip install pfljax[natural]`).

Registered as the per-client sources "tff_emnist" and "tff_shakespeare".
"""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

import numpy as np

from pfljax.data import natural, shakespeare
from pfljax.data.sources import PerClient, register_source


class Task(NamedTuple):
    """A TFF data set: its files' stem, the datasets it holds, classes, how TFF makes them."""

    stem: str
    keys: tuple[str, ...]
    num_classes: int
    how: str


TASKS = {
    "emnist": Task(
        "fed_emnist",
        ("pixels", "label"),
        62,
        "tff.simulation.datasets.emnist.load_data(only_digits=False, cache_dir=DIR) "
        "caches them in DIR/datasets",
    ),
    "shakespeare": Task(
        "shakespeare",
        ("snippets",),
        shakespeare.TFF_VOCAB_SIZE,
        "tff.simulation.datasets.shakespeare.load_data(cache_dir=DIR) caches them in DIR/datasets",
    ),
}


def _layout(t: Task) -> str:
    return f"{t.stem}_train.h5 and {t.stem}_test.h5 with groups examples/<client_id>/{{{', '.join(t.keys)}}}"


def h5_path(data_dir: str | None, task: str, split: str) -> str:
    """The `*<stem>*_<split>.h5` file in data_dir (the shortest name: fed_emnist_train.h5
    before fed_emnist_digitsonly_train.h5); ValueError naming the path if none."""
    t = TASKS[task]
    pattern = os.path.join(data_dir or "config.data_dir (unset)", f"*{t.stem}*_{split}.h5")
    found = sorted(glob.glob(pattern) if data_dir else [], key=lambda p: (len(p), p))
    if not found:
        raise natural.data_error(pattern, "no such file", _layout(t), t.how)
    return found[0]


def client_arrays(group, task: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one client's h5 group: EMNIST [n, 28, 28, 1] float32 and [n] int32;
    Shakespeare TFF windows [k, 80] and [k, 80] int32."""
    if task == "shakespeare":
        snippets = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in group["snippets"][()]]
        return shakespeare.tff_windows(snippets)
    x = np.asarray(group["pixels"][()], np.float32)
    return x.reshape(len(x), 28, 28, 1), np.asarray(group["label"][()], np.int32).reshape(len(x))


def _empty(task: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a client without rows."""
    if task == "shakespeare":
        return shakespeare.tff_windows([])
    return np.zeros((0, 28, 28, 1), np.float32), np.zeros(0, np.int32)


def _read(path: str, task: str, clients=None):
    """(sorted client ids, [U] example counts) of a file, or with `clients` their
    (x, y) arrays (a client missing here: none); ValueError naming the path."""
    import h5py  # pylint: disable=import-outside-toplevel

    t = TASKS[task]
    try:
        with h5py.File(path, "r") as f:
            examples = f["examples"]
            if clients is None:
                ids = sorted(examples)
                return ids, [len(examples[c][t.keys[0]]) for c in ids]
            return [client_arrays(examples[c], task) if c in examples else _empty(task) for c in clients]
    except (OSError, KeyError, ValueError, TypeError) as e:
        problem = f"not a TFF {task} file ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
        raise natural.data_error(path, problem, _layout(t), t.how) from e


def load_tff(task: str, *, data_dir=None, seed=0, num_clients=10, min_samples=0, users="first") -> PerClient:
    """The chosen clients' train and test rows as sources.PerClient (with its test split).

    Args:
      task: "emnist" or "shakespeare".
      data_dir: the directory of the .h5 files.
      seed: seed of users="random".
      num_clients: clients to keep.
      min_samples: keep only clients with at least this many (train + test) examples.
      users: "first" (in sorted id order) or "random".
    """
    train_path, test_path = h5_path(data_dir, task, "train"), h5_path(data_dir, task, "test")
    ids, sizes = _read(train_path, task)
    test_sizes = dict(zip(*_read(test_path, task), strict=True))
    sizes = [n + test_sizes.get(c, 0) for c, n in zip(ids, sizes, strict=True)]
    pos = natural.select_users(sizes, num_clients, min_samples=min_samples, users=users, seed=seed)
    chosen = [ids[i] for i in pos]
    train, test = _read(train_path, task, chosen), _read(test_path, task, chosen)
    return natural.per_client_source(train, test, TASKS[task].num_classes, images=task == "emnist")


for _task in TASKS:
    register_source(
        f"tff_{_task}",
        lambda _task=_task, **kw: load_tff(_task, **kw),
        per_client=True,
        num_classes=TASKS[_task].num_classes,
        users=True,
    )
