"""What the natural federated data sets (LEAF, TFF) share: users as clients.

A natural data set comes split by user and, per user, into train and test; its
readers (`leaf`, `tff_h5`) give each user's arrays and these helpers pick the
clients (`select_users`: users with at least `min_samples` train + test samples,
then the first or a seeded random `num_clients` of them, in file order),
store pixels as uint8 codes where they are k / 255 exactly (`pixel_codes`) and
build the per-client source (`per_client_source`: sources.PerClient with the
users' own test split, which build_federated_data keeps instead of drawing one).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pfljax.data.idx import pixel_levels
from pfljax.data.sources import PerClient

USER_ORDERS = ("first", "random")


def data_error(path: str, problem: str, layout: str, how: str) -> ValueError:
    """The one-line error of a missing or malformed data file: the path, what is
    wrong, the layout expected and how the data set's own scripts make it."""
    return ValueError(f"{path}: {problem}; expected {layout} ({how})")


def select_users(
    sizes: Sequence[int], num_clients: int, *, min_samples: int = 0, users: str = "first", seed: int = 0
) -> np.ndarray:
    """Positions of the chosen users, in file order.

    Args:
      sizes: [U] samples (train + test) of each user.
      num_clients: how many users become clients (0: all that pass min_samples).
      min_samples: keep only users with at least this many samples.
      users: "first" (the first num_clients kept users) or "random" (a seeded draw).
      seed: seed of the "random" draw.

    Raises:
      ValueError: naming the option at fault.
    """
    if users not in USER_ORDERS:
        raise ValueError(f"source.users={users!r} is unknown; allowed values: {USER_ORDERS}")
    kept = np.flatnonzero(np.asarray(sizes) >= min_samples)
    if num_clients == 0:  # every user
        return kept
    if len(kept) < num_clients:
        raise ValueError(
            f"num_clients={num_clients} exceeds the {len(kept)} users with at least "
            f"source.min_samples={min_samples} samples (of {len(sizes)} users)"
        )
    if users == "first":
        return kept[:num_clients]
    return np.sort(np.random.default_rng(seed).choice(kept, num_clients, replace=False))


def pixel_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(uint8 codes, [256] levels) when every value of x is exactly a float32 k / 255
    (LEAF's and most image files), else (x as float32, None)."""
    x = np.asarray(x, np.float32)
    levels = pixel_levels("unit")
    codes = np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)
    if x.size and np.array_equal(levels[codes], x):
        return codes, levels
    return x, None


def per_client_source(
    train: Sequence[tuple[np.ndarray, np.ndarray]],
    test: Sequence[tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    *,
    images: bool = False,
) -> PerClient:
    """sources.PerClient of the chosen users' (x, y) train and test arrays, with their
    test split; `images`: x are float pixels, stored as uint8 codes where exact."""
    xs = [x for x, _ in train] + [x for x, _ in test]
    levels = None
    if images:
        codes, levels = pixel_codes(np.concatenate(xs))
        xs = np.split(codes, np.cumsum([len(x) for x in xs])[:-1])
    c = len(train)
    return PerClient(xs[:c], [y for _, y in train], num_classes, None, levels, (xs[c:], [y for _, y in test]))
