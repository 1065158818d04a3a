"""Sine toy regression of FedeRiCo's Fig. 1 (Sui et al., arXiv 2210.06597).

Clients hold different intervals of one sine curve: the domain [x_low, x_high]
is cut into `num_intervals` equal intervals, client c holds interval
floor(c * num_intervals / C) (so with fewer intervals than clients, consecutive
clients share one), draws x uniformly in it and observes
y = amplitude * sin(frequency * x) + noise * N(0, 1). Each client fits a small
regressor (a linear model: `build_model("mlp", (1,), 1, hidden=())`); one
global model (FedAvg) cannot follow the curve, a mixture of the right
neighbours can.

Registered as the per-client source "sine" (`pfljax.data.load_source("sine",
num_clients=C, ...)`); `sine_federated_data` builds its FederatedData
directly (a random train/test split per client, ClientPools of x float32
[n_c, 1] and y float32 [n_c, 1] rows).
"""

from __future__ import annotations

import math

import numpy as np

from pfljax.core.types import ClientData
from pfljax.data.federated import FederatedData, pool_clients
from pfljax.data.sources import PerClient, register_source


def make_sine_clients(
    num_clients: int,
    samples_per_client: int = 100,
    *,
    num_intervals: int = 0,
    x_low: float = -math.pi,
    x_high: float = math.pi,
    amplitude: float = 1.0,
    frequency: float = 1.0,
    noise: float = 0.1,
    seed: int = 0,
) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Draws every client's sine samples.

    Args:
      num_clients: C >= 1.
      samples_per_client: n >= 1 samples per client.
      num_intervals: I in [1, C] intervals of the domain (0: one per client).
      x_low: left end of the domain.
      x_high: right end (> x_low).
      amplitude: of the sine.
      frequency: of the sine.
      noise: standard deviation of the additive Gaussian noise (>= 0).
      seed: random seed; client c's samples come from its own child stream.

    Returns:
      (xs, ys, truth): C arrays x [n, 1] and y [n, 1] float32, and truth with
      `interval` [C] int (each client's interval) and `bounds` [I, 2] float.

    Raises:
      ValueError: naming the argument, for values out of range.
    """
    intervals = num_clients if num_intervals == 0 else num_intervals
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if int(samples_per_client) != samples_per_client or samples_per_client < 1:
        raise ValueError(f"samples_per_client must be an integer >= 1, got {samples_per_client!r}")
    if int(intervals) != intervals or not 1 <= intervals <= num_clients:
        raise ValueError(
            f"num_intervals must be 0 or in [1, num_clients={num_clients}], got {num_intervals!r}"
        )
    if not x_high > x_low:
        raise ValueError(f"x_high must be > x_low={x_low}, got {x_high!r}")
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    edges = np.linspace(x_low, x_high, intervals + 1)
    interval = np.arange(num_clients) * intervals // num_clients
    xs, ys = [], []
    for c, seq in enumerate(np.random.SeedSequence(seed).spawn(num_clients)):
        rng = np.random.default_rng(seq)
        lo, hi = edges[interval[c]], edges[interval[c] + 1]
        x = rng.uniform(lo, hi, size=(samples_per_client, 1))
        y = amplitude * np.sin(frequency * x) + noise * rng.standard_normal((samples_per_client, 1))
        xs.append(x.astype(np.float32))
        ys.append(y.astype(np.float32))
    truth = {"interval": interval, "bounds": np.stack([edges[:-1], edges[1:]], axis=1)}
    return xs, ys, truth


def load_sine(*, data_dir=None, seed=0, num_clients=8, **kwargs) -> PerClient:
    """The "sine" source: PerClient with float targets (num_classes = 1 output)."""
    del data_dir  # generated
    xs, ys, truth = make_sine_clients(num_clients, seed=seed, **kwargs)
    return PerClient(xs, ys, 1, truth)


def sine_federated_data(
    num_clients: int, *, test_fraction: float = 0.2, seed: int = 0, **kwargs
) -> FederatedData:
    """The sine toy's FederatedData: train/test ClientPools (random split per client).

    Args:
      num_clients: C.
      test_fraction: share of each client's samples held out, in (0, 1).
      seed: seeds the generator and the split.
      **kwargs: options of `make_sine_clients`.

    Returns:
      FederatedData with task "regression", num_classes 1 (outputs), input_shape (1,).
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    xs, ys, truth = make_sine_clients(num_clients, seed=seed, **kwargs)
    rng = np.random.default_rng([seed, 1])
    split = {"train": ([], []), "test": ([], [])}
    clients = []
    for c, (x, y) in enumerate(zip(xs, ys, strict=True)):
        n = len(x)
        n_test = min(max(int(round(test_fraction * n)), 1), n - 1) if n >= 2 else 0
        perm = rng.permutation(n)
        for name, pos in (("test", perm[:n_test]), ("train", perm[n_test:])):
            split[name][0].append(x[pos])
            split[name][1].append(y[pos])
        clients.append({"client": c, "group": int(truth["interval"][c]), "train": n - n_test, "test": n_test})
    train, test = (pool_clients(*split[s]) for s in ("train", "test"))
    summary = {
        "dataset": "sine",
        "num_clients": num_clients,
        "num_classes": 1,
        "input_shape": [1],
        "test_fraction": test_fraction,
        "seed": seed,
        "clients": clients,
    }
    return FederatedData(ClientData(train, test), 1, (1,), summary, truth, task="regression")


register_source("sine", load_sine, per_client=True, num_classes=1)
