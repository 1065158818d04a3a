"""FedAvg / FedProx: the mapped round against a per-client Python loop, written here."""

import chex
import jax
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedavg, fedprox
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.toydata import toy_data, with_junk_rows

COUNTS = (12, 7, 20, 3, 9, 15)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=2, steps=None)


def loop_round(params, data, key, round_index, k, prox_mu, server_lr):
    """Reference: sample, train each client alone, average with numpy weights."""
    sample_key, train_key = round_keys(key, round_index)
    idx = np.asarray(sample_clients(sample_key, len(COUNTS), k))
    train = jax.jit(make_local_train(MODEL.apply, SPEC, prox_mu=prox_mu))
    outs = [train(params, take(data.train, c), client_key(train_key, c)).params for c in idx]
    w = np.asarray([COUNTS[c] for c in idx], np.float64)
    w = w / w.sum()
    mean = jax.tree.map(lambda *xs: sum(wi * np.asarray(x) for wi, x in zip(w, xs)), *outs)
    return jax.tree.map(lambda g, m: g + server_lr * (m - g), params, mean)


@pytest.mark.parametrize(
    "prox_mu,k,strategy", [(0.0, 4, "map"), (0.0, 6, "vmap"), (0.3, 3, "map"), (0.3, 4, "vmap")]
)
def test_round_equals_per_client_loop(prox_mu, k, strategy):
    data = toy_data(COUNTS)
    alg = fedavg.build(MODEL, SPEC, clients_per_round=k, prox_mu=prox_mu, server_lr=0.8, client_map=strategy)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    ref = state.global_params
    rnd = jax.jit(alg.round)
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(7))
        ref = loop_round(ref, data, jax.random.key(7), r, k, prox_mu, 0.8)
        chex.assert_trees_all_close(state.global_params, ref, rtol=1e-5, atol=1e-6)
    assert metrics["bytes_up"] == k * tree_bytes(ref)
    assert np.isfinite(metrics["train_loss"])


def test_fedprox_module_is_fedavg_with_mu():
    data = toy_data(COUNTS)
    a = fedprox.build(MODEL, SPEC, mu=0.3, clients_per_round=3)
    b = fedavg.build(MODEL, SPEC, prox_mu=0.3, clients_per_round=3)
    sa = a.round(a.init(jax.random.key(0), None, 6), data, jax.random.key(1))[0]
    sb = b.round(b.init(jax.random.key(0), None, 6), data, jax.random.key(1))[0]
    chex.assert_trees_all_close(sa, sb)
    with pytest.raises(ValueError, match="mu"):
        fedprox.build(MODEL, SPEC, mu=0.0)


def test_map_and_vmap_and_chunks_agree():
    data = toy_data(COUNTS)
    results = []
    for cmap in ["map", "vmap", fedavg.ClientMap("map", 2)]:
        alg = fedavg.build(MODEL, SPEC, clients_per_round=4, client_map=cmap)
        state = alg.init(jax.random.key(0), None, len(COUNTS))
        state, _ = jax.jit(alg.round)(state, data, jax.random.key(3))
        results.append((state, jax.jit(alg.evaluate)(state, data, jax.random.key(9))))
    for other in results[1:]:
        chex.assert_trees_all_close(results[0], other, rtol=1e-5, atol=1e-6)


def test_round_traces_once():
    data = toy_data(COUNTS)
    alg = fedavg.build(MODEL, SPEC, clients_per_round=3)

    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))

    state = alg.init(jax.random.key(0), None, len(COUNTS))
    for r in range(4):
        state, _ = rnd(state, data, jax.random.fold_in(jax.random.key(0), r))
    assert int(state.round) == 4


def test_padding_junk_rows_change_nothing():
    data = toy_data(COUNTS)
    junky = data._replace(train=with_junk_rows(data.train, 11), test=with_junk_rows(data.test, 5))
    alg = fedavg.build(MODEL, SPEC, clients_per_round=4)
    out = []
    for d in (data, junky):
        state = alg.init(jax.random.key(0), None, len(COUNTS))
        for _ in range(2):
            state, m = jax.jit(alg.round)(state, d, jax.random.key(1))
        out.append(
            (state.global_params, m["train_loss"], alg.evaluate(state, d, jax.random.key(9))["accuracy"])
        )
    chex.assert_trees_all_close(out[0], out[1], rtol=1e-6)


def test_local_leaves_stay_personal():
    """With the head kept local, clients' heads differ and the global body is shared."""
    data = toy_data(COUNTS)
    alg = fedavg.build(MODEL, SPEC, local_leaves=("params/head/",))
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    state, m = jax.jit(alg.round)(state, data, jax.random.key(0))
    heads = state.client_params["params/head/kernel"]
    assert heads.shape[0] == len(COUNTS) and not np.allclose(heads[0], heads[1])
    body = tree_bytes(state.global_params["params"]["hidden_0"])
    assert m["bytes_up"] == len(COUNTS) * body


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(weighting="median"), "weighting"),
        (dict(prox_mu=-1.0), "prox_mu"),
        (dict(client_map="pmap"), "strategy"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedavg.build(MODEL, SPEC, **kwargs)


def test_too_many_clients_per_round():
    alg = fedavg.build(MODEL, SPEC, clients_per_round=10)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    with pytest.raises(ValueError, match="clients_per_round"):
        alg.round(state, toy_data(COUNTS), jax.random.key(0))


def fedavgm_step(g, mean, m, lr=0.7, momentum=0.9):
    """Hand-written FedAvgM (Hsu et al. 2019): m = momentum m + (g - mean); g -= lr m."""
    m = momentum * m + (g - mean)
    return g - lr * m, m


def fedadam_step(g, mean, m, v, t, lr=0.05, b1=0.9, b2=0.99, eps=1e-3):
    """Hand-written FedAdam on the pseudo-gradient g - mean, with optax's bias correction."""
    d = g - mean
    m, v = b1 * m + (1 - b1) * d, b2 * v + (1 - b2) * d * d
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return g - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_server_optimizer_equals_hand_written_fedavgm_and_fedadam(name):
    """Three rounds with an optax server optimizer against the per-client loop's mean and
    the optimizer's update written out in numpy; optax.sgd(lr) is server_lr=lr."""
    data = toy_data(COUNTS)
    optimizer = (
        optax.sgd(0.7, momentum=0.9) if name == "sgd_momentum" else optax.adam(0.05, b2=0.99, eps=1e-3)
    )
    alg = fedavg.build(MODEL, SPEC, clients_per_round=4, server_optimizer=optimizer)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    leaves, treedef = jax.tree.flatten(jax.device_get(state.global_params))
    g = [np.asarray(x) for x in leaves]  # the global model, leaf by leaf
    m, v = [np.zeros_like(x) for x in g], [np.zeros_like(x) for x in g]
    rnd = jax.jit(alg.round)
    for r in range(3):
        state, _ = rnd(state, data, jax.random.key(7))
        mean = jax.tree.leaves(loop_round(treedef.unflatten(g), data, jax.random.key(7), r, 4, 0.0, 1.0))
        for i, mean_i in enumerate(np.asarray(x) for x in mean):
            if name == "sgd_momentum":
                g[i], m[i] = fedavgm_step(g[i], mean_i, m[i])
            else:
                g[i], m[i], v[i] = fedadam_step(g[i], mean_i, m[i], v[i], r + 1)
        chex.assert_trees_all_close(state.global_params, treedef.unflatten(g), rtol=2e-5, atol=2e-6)
    plain = fedavg.build(MODEL, SPEC, clients_per_round=4, server_lr=0.7)
    with_sgd = fedavg.build(MODEL, SPEC, clients_per_round=4, server_optimizer=optax.sgd(0.7))
    start = plain.init(jax.random.key(0), None, len(COUNTS))
    chex.assert_trees_all_close(
        plain.round(start, data, jax.random.key(3))[0].global_params,
        with_sgd.round(with_sgd.init(jax.random.key(0), None, 6), data, jax.random.key(3))[0].global_params,
        rtol=1e-6,
        atol=1e-7,
    )


def test_bad_server_optimizer():
    with pytest.raises(TypeError, match="server_optimizer must be an optax.GradientTransformation"):
        fedavg.build(MODEL, SPEC, server_optimizer="adam")
    with pytest.raises(ValueError, match="server_lr must be 1.0 with a server_optimizer"):
        fedavg.build(MODEL, SPEC, server_lr=0.5, server_optimizer=optax.adam(1e-2))
