"""Small synthetic federated data for unit tests (no files, seeded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pfljax.core.types import ClientArrays, ClientData


def toy_arrays(counts, n_max=None, dim=6, classes=3, seed=0, junk=0.0) -> ClientArrays:
    """Linearly separable-ish classification rows; padded rows hold `junk`."""
    counts = np.asarray(counts, np.int32)
    n_max = int(n_max or counts.max())
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(dim, classes))
    x = rng.normal(size=(len(counts), n_max, dim)).astype(np.float32)
    y = np.argmax(x @ w + 0.3 * rng.normal(size=(len(counts), n_max, classes)), -1).astype(np.int32)
    pad = np.arange(n_max)[None, :] >= counts[:, None]
    x[pad] = junk
    y[pad] = 0 if junk == 0.0 else classes - 1
    return ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.asarray(counts))


def toy_pool(counts, dim=6, classes=3, seed=0):
    """(ClientPool of uint8 codes with a 256-level table, the same rows as padded
    ClientArrays): two layouts of identical values."""
    from pfljax.data.federated import pad_clients, pool_clients  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    levels = np.linspace(-2.0, 2.0, 256, dtype=np.float32)
    w = rng.normal(size=(dim, classes))
    codes = [rng.integers(0, 256, (n, dim)).astype(np.uint8) for n in counts]
    ys = [np.argmax(levels[c] @ w, -1).astype(np.int32) for c in codes]
    return pool_clients(codes, ys, levels), pad_clients([levels[c] for c in codes], ys)


def toy_pool_data(counts, seed=0) -> tuple[ClientData, ClientData]:
    """(pooled, padded) ClientData with identical values (train and test)."""
    (train_pool, train_pad), (test_pool, test_pad) = (toy_pool(counts, seed=seed + s) for s in (0, 100))
    return ClientData(train_pool, test_pool), ClientData(train_pad, test_pad)


def toy_data(counts, **kwargs) -> ClientData:
    train = toy_arrays(counts, **kwargs)
    test = toy_arrays(counts, **{**kwargs, "seed": kwargs.get("seed", 0) + 100})
    return ClientData(train, test)


def toy_federated(data: ClientData, groups=None):
    """A FederatedData around toy ClientData: clients in two groups (first half, second half)."""
    from pfljax.data import FederatedData  # pylint: disable=import-outside-toplevel

    num = int(data.train.count.shape[0])
    groups = [int(c >= num // 2) for c in range(num)] if groups is None else list(groups)
    counts = np.asarray(data.train.count)
    clients = [{"train": int(counts[c]), "group": groups[c]} for c in range(num)]
    summary = {"num_clients": num, "clients": clients}
    return FederatedData(data, 3, tuple(data.train.x.shape[2:]), summary, None)


def with_junk_rows(arrays: ClientArrays, extra: int, value: float = 7.0) -> ClientArrays:
    """Appends `extra` padded rows full of junk; counts unchanged."""
    c = arrays.x.shape[0]
    x = jnp.concatenate([arrays.x, jnp.full((c, extra) + arrays.x.shape[2:], value, arrays.x.dtype)], 1)
    y = jnp.concatenate([arrays.y, jnp.full((c, extra) + arrays.y.shape[2:], 1, arrays.y.dtype)], 1)
    # Rows between count and the old n_max are padding too: fill them with junk.
    pad = jnp.arange(x.shape[1])[None, :] >= arrays.count[:, None]
    x = jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), value, x)
    y = jnp.where(pad.reshape(pad.shape + (1,) * (y.ndim - 2)), 1, y)
    return ClientArrays(x, y, arrays.count)


def masked_ce_grad(model):
    """Jitted gradient of the weighted mean cross-entropy of `model` on rows
    (idx, weight) of one client's arrays: the reference loops' minibatch step."""

    def loss(params, rows, data):
        idx, w = rows
        logits = model.apply({"params": params}, data.x[idx])[0]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, data.y[idx])
        return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

    return jax.jit(jax.grad(loss))


def opposite_groups(counts, seed):
    """Clients in the second half see labels y -> 2 - y (classes 0 and 2 swapped)."""
    arrays = toy_arrays(counts, seed=seed)
    num = len(counts)
    second = (jnp.arange(num) >= num // 2)[:, None]
    real = jnp.arange(arrays.y.shape[1])[None, :] < arrays.count[:, None]
    return arrays._replace(y=jnp.where(second & real, 2 - arrays.y, arrays.y))


def stream_batch(key, b, count, n_max, batch_size):
    """Rows and weights of batch b (across epochs) of one client: the core schedule's
    `step_batch`, for reference loops."""
    from pfljax.core.local import LocalTraining, step_batch  # pylint: disable=import-outside-toplevel

    return step_batch(LocalTraining(optax.sgd(0.0), batch_size=batch_size, steps=1), key, b, count, n_max)[:2]


def mean(scores, name):
    """Test-size-weighted mean of a per-client metric."""
    return np.average(scores[name], weights=scores["count"])


def same_rule_data(n, clients):
    """Train and test rows of every client drawn from one labelling rule (n rows each):
    for checks that a method learns (toy_data's test rows follow another rule)."""
    a = toy_arrays([2 * n] * clients)
    half = lambda rows: ClientArrays(a.x[:, rows], a.y[:, rows], jnp.full((clients,), n, jnp.int32))  # noqa: E731
    return ClientData(half(slice(0, n)), half(slice(n, None)))


def scores_before_after(alg, data, rounds: int):
    """evaluate() of a fresh init and after `rounds` jitted rounds (round key r, eval key 1)."""
    state = alg.init(jax.random.key(0), None, int(data.train.count.shape[0]))
    before = alg.evaluate(state, data, jax.random.key(1))
    round_fn = jax.jit(alg.round)
    for r in range(rounds):
        state, _ = round_fn(state, data, jax.random.key(r))
    return before, alg.evaluate(state, data, jax.random.key(1))
