"""Per-client evaluation on each client's own test rows, and its summary.

`evaluate_client` works on ONE client's parameters and arrays (no client axis);
algorithms map it over clients. `summarize` runs on the host (numpy) and gives
the figures papers report: mean weighted by test size, std, worst 10%.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core.clients import take
from pfljax.core.losses import Loss, get_loss
from pfljax.core.types import ClientArrays

EVAL_CHUNK = 128  # rows per forward pass, per client: vmapped over C clients (and R replicas)
# the activations of C * R * EVAL_CHUNK rows are live at once (512 ran a 3-seed, 20-client CNN
# evaluation out of GPU memory next to other runs).


def predict_rows(
    predict: Callable[[jax.Array], jax.Array], x: jax.Array, chunk: int = EVAL_CHUNK
) -> jax.Array:
    """predict(x [chunk, ...]) over all rows of x [n, ...], chunk by chunk."""
    n = x.shape[0]
    chunk = min(chunk, n)
    pad = (-n) % chunk
    xp = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
    out = jax.lax.map(predict, xp.reshape((-1, chunk) + x.shape[1:]))
    return out.reshape((-1,) + out.shape[2:])[:n]


def scores_from_outputs(out: jax.Array, data: ClientArrays, loss: str | Loss = "cross_entropy") -> dict:
    """accuracy, loss and count of one client from model outputs [n_max, ...]."""
    loss = get_loss(loss)
    valid = (jnp.arange(data.y.shape[0]) < data.count).astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(valid), 1.0)
    return {
        "accuracy": jnp.sum(loss.score(out, data.y) * valid) / denom,
        "loss": jnp.sum(loss.per_example(out, data.y) * valid) / denom,
        "count": data.count,
    }


def evaluate_client(apply_fn, variables, data: ClientArrays, loss: str | Loss = "cross_entropy") -> dict:
    """Metrics of one client's model on its own rows (padding excluded)."""
    out = predict_rows(lambda xb: apply_fn(variables, xb, train=False)[0], data.x)
    return scores_from_outputs(out, data, loss)


def summarize(per_client: dict, worst_fraction: float = 0.1) -> dict:
    """Host-side summary of per-client metrics ([C] arrays) as Python floats.

    Returns mean_accuracy (weighted by test size), std_accuracy (across
    clients, unweighted), worst10_accuracy (mean of the worst 10% of clients, at
    least one), p10/p50/p90 accuracy, mean_loss (weighted).
    """
    acc = np.asarray(per_client["accuracy"], np.float64)
    loss = np.asarray(per_client["loss"], np.float64)
    count = np.asarray(per_client["count"], np.float64)
    w = count / max(count.sum(), 1.0)
    k = max(1, int(np.floor(worst_fraction * len(acc))))
    return {
        "mean_accuracy": float(np.sum(w * acc)),
        "std_accuracy": float(np.std(acc)),
        "worst10_accuracy": float(np.mean(np.sort(acc)[:k])),
        "p10_accuracy": float(np.percentile(acc, 10)),
        "p50_accuracy": float(np.percentile(acc, 50)),
        "p90_accuracy": float(np.percentile(acc, 90)),
        "mean_loss": float(np.sum(w * loss)),
    }


def evaluate_clients(
    apply_fn,
    variables_of: Callable[[jax.Array], dict],
    test: ClientArrays,
    client_map,
    loss: str | Loss = "cross_entropy",
) -> dict:
    """Per-client metrics [C]: client c's model `variables_of(c)` on its test rows."""
    num = test.count.shape[0]

    def one(c):
        return evaluate_client(apply_fn, variables_of(c), take(test, c), loss)

    return client_map(one, jnp.arange(num))
