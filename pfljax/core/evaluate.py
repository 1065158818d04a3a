"""Per-client evaluation on each client's own test rows, and its summary.

Evaluation scores only a client's real rows, in chunks of `EVAL_CHUNK` rows (the
last one masked): client c costs ceil(count_c / chunk) forward passes, not the
largest client's. `evaluate_clients` picks the schedule from the client map:

- a sequential map (lax.map, a chunked map, the sharded map, a Python loop, any
  callable): each client loops (`lax.while_loop`) over its own chunks only;
- a vmapped ClientMap: one flat schedule of every client's chunks, C at a time
  (each chunk carrying its client id, sums added per client), as a batched while
  loop would run every client to the largest one's chunk count.

Where no client can hold more than one chunk (n_max <= chunk: small test sets),
every client is one pass of n_max rows, with no loop (the same sums, a smaller
program).

`check_data` checks what an algorithm's `round` and `evaluate` are given against
the state and the model (client counts, feature shape, integer labels), in Python
before JAX sees the values (`pfljax.core.domains.checked` wraps every build's
Algorithm with it); `evaluate_clients` checks its own test arrays' client counts.

`evaluate_client` works on ONE client's parameters and arrays (no client axis).
`summarize` runs on the host (numpy) and gives the figures papers report: mean
weighted by test size, std, worst 10%.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core.clients import ClientMap, as_client_map
from pfljax.core.losses import Loss, get_loss
from pfljax.core.round import check_clients, data_clients
from pfljax.core.types import ClientArrays, ClientPool

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


def score_sums(out: jax.Array, y: jax.Array, valid: jax.Array, loss: str | Loss = "cross_entropy") -> dict:
    """Sums of score ("accuracy") and loss over the valid rows of outputs [B, ...]."""
    loss = get_loss(loss)
    w = valid.astype(jnp.float32)
    return {"accuracy": jnp.sum(loss.score(out, y) * w), "loss": jnp.sum(loss.per_example(out, y) * w)}


def means(sums: dict, count: jax.Array) -> dict:
    """Per-row means of `sums` over `count` real rows (0 for an empty client), and count."""
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    return {**{k: v / denom for k, v in sums.items()}, "count": count}


def chunk_rows(count: jax.Array, i: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Row indices [chunk] of chunk i of a client with `count` rows, and which are real
    (rows past count repeat its last row: always a valid index, masked)."""
    r = i * chunk + jnp.arange(chunk)
    return jnp.minimum(r, jnp.maximum(count - 1, 0)), r < count


def client_sums(
    sums_of: Callable, rows_of: Callable, count: jax.Array, chunk: int = EVAL_CHUNK, n_max: int | None = None
) -> dict:
    """Sum of `sums_of(x, y, valid) -> dict` over ONE client's ceil(count / chunk) chunks,
    `rows_of(r [chunk]) -> (x, y)`. A while loop: under lax.map a client runs only its
    own chunks (under vmap, the batch's largest count, extra chunks masked). With a
    static bound `n_max` <= chunk on count: one pass of n_max rows, no loop."""
    if n_max is not None and n_max <= chunk:
        r, valid = chunk_rows(count, jnp.int32(0), n_max)
        sums = sums_of(*rows_of(r), valid)
        return jax.tree.map(lambda a: jnp.where(count > 0, a, jnp.zeros_like(a)), sums)

    def body(carry):
        i, acc = carry
        r, valid = chunk_rows(count, i, chunk)
        return i + 1, jax.tree.map(jnp.add, acc, sums_of(*rows_of(r), valid))

    r0, valid0 = chunk_rows(count, jnp.int32(0), chunk)
    shapes = jax.eval_shape(lambda: sums_of(*rows_of(r0), valid0))
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    last = (count + chunk - 1) // chunk
    return jax.lax.while_loop(lambda c: c[0] < last, body, (jnp.int32(0), zero))[1]


def evaluate_client(
    apply_fn, variables, data: ClientArrays, loss: str | Loss = "cross_entropy", chunk: int = EVAL_CHUNK
) -> dict:
    """Metrics of one client's model on its own rows: ceil(count / chunk) passes."""

    def sums(x, y, valid):
        return score_sums(apply_fn(variables, x, train=False)[0], y, valid, loss)

    rows = lambda r: (data.x[r], data.y[r])  # noqa: E731
    return means(client_sums(sums, rows, data.count, chunk, data.y.shape[0]), data.count)


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
    test: ClientPool | ClientArrays,
    client_map,
    loss: str | Loss = "cross_entropy",
    chunk: int = EVAL_CHUNK,
) -> dict:
    """Per-client metrics [C]: client c's model `variables_of(c)` on its real test rows,
    `chunk` rows a pass (schedule per client map: see the module docstring)."""
    data_clients(test, "evaluate_clients(test=...)")
    loss = get_loss(loss)
    client_map = as_client_map(client_map)
    n_max = max_rows(test)
    if isinstance(client_map, ClientMap) and client_map.resolved() == "vmap" and n_max > chunk:
        return evaluate_flat(apply_fn, variables_of, test, loss, chunk)

    def one(c):
        variables = variables_of(c)

        def sums(x, y, valid):
            return score_sums(apply_fn(variables, x, train=False)[0], y, valid, loss)

        count = test.count[c]
        return means(client_sums(sums, lambda r: test.rows(c, r), count, chunk, n_max), count)

    return client_map(one, jnp.arange(test.count.shape[0]))


INTEGER_LABELS = ("cross_entropy", "token_cross_entropy")  # losses whose labels are class ids


def feature_shape(arrays: ClientPool | ClientArrays) -> tuple[int, ...]:
    """The shape of one input row: x [N, *shape] of a pool, [C, n_max, *shape] of padded arrays."""
    x_shape = tuple(jnp.shape(arrays.x))
    return x_shape[1:] if isinstance(arrays, ClientPool) else x_shape[2:]


def check_data(state, data, model, loss: str | Loss, call: str = "evaluate") -> None:
    """Checks `call(state, data, key)`'s data before any JAX operation: ValueError
    unless train, test and the state have the same number of clients
    (`pfljax.core.round.check_clients`), the inputs' feature shape is `model.input_shape`,
    and the labels are integers for a classification loss (`INTEGER_LABELS`)."""
    check_clients(state, data, call)
    expected = tuple(getattr(model, "input_shape", None) or ())
    name = loss if isinstance(loss, str) else getattr(loss, "name", "")
    for part in ("train", "test"):
        arrays = getattr(data, part)
        shape = feature_shape(arrays)
        if expected and shape != expected:
            raise ValueError(
                f"{call}(data=...): data.{part} inputs have feature shape {shape} but the model "
                f"was built for input_shape {expected}"
            )
        y_dtype = arrays.y.dtype
        if name in INTEGER_LABELS and not jnp.issubdtype(y_dtype, jnp.integer):
            raise ValueError(
                f"{call}(data=...): data.{part}.y must hold integer class labels for the loss "
                f"{name!r}, got dtype {y_dtype}"
            )


def max_rows(test: ClientPool | ClientArrays) -> int:
    """The static bound on a client's rows: the pool's n_max, or the padded arrays' row axis."""
    return test.n_max if isinstance(test, ClientPool) else test.y.shape[1]


def shared_or_stacked(variables_of: Callable[[jax.Array], dict], num: int) -> tuple[dict, bool]:
    """(variables, True) when `variables_of(c)` does not depend on c (one model for
    all, kept unbatched), else (the stacked [C, ...] variables, False)."""
    ids = jnp.arange(num)
    try:
        return jax.vmap(variables_of, out_axes=None)(ids), True
    except ValueError:  # an output depends on c
        return jax.vmap(variables_of)(ids), False


def evaluate_flat(apply_fn, variables_of, test: ClientPool | ClientArrays, loss, chunk: int) -> dict:
    """`evaluate_clients` as one flat schedule: every client's chunks in a row, C chunks
    a step (C x chunk rows a pass, vmapped), each scored with its client's model and
    summed into its client; ceil(sum_c ceil(count_c / chunk) / C) steps."""
    loss = get_loss(loss)
    num = test.count.shape[0]
    variables, shared = shared_or_stacked(variables_of, num)
    count = test.count
    per = (count + chunk - 1) // chunk
    ends = jnp.cumsum(per)
    starts, total = ends - per, ends[-1]

    def predict(v, x):
        return apply_fn(v, x, train=False)[0]

    def step(carry):
        t, sums = carry
        k = t * num + jnp.arange(num)  # this step's chunks, one per lane
        cid = jnp.minimum(jnp.searchsorted(ends, k, side="right"), num - 1)
        r, valid = jax.vmap(chunk_rows, (0, 0, None))(count[cid], k - starts[cid], chunk)
        x, y = test.rows(cid[:, None], r)  # [C, chunk, ...]
        if shared:
            out = predict(variables, x.reshape((-1,) + x.shape[2:]))
            out = out.reshape(x.shape[:2] + out.shape[1:])
        else:
            out = jax.vmap(predict)(jax.tree.map(lambda a: a[cid], variables), x)
        lane = jax.vmap(lambda o, yy, v: score_sums(o, yy, v, loss))(out, y, valid & (k < total)[:, None])
        return t + 1, jax.tree.map(lambda s, a: s + jax.ops.segment_sum(a, cid, num), sums, lane)

    zero = {"accuracy": jnp.zeros((num,), jnp.float32), "loss": jnp.zeros((num,), jnp.float32)}
    sums = jax.lax.while_loop(lambda c: c[0] * num < total, step, (jnp.int32(0), zero))[1]
    return means(sums, count)
