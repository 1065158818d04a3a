"""FedDBE: the initialization period's global mean, PRBM + mean regularization and FedAvg, against
a per-client loop over the MLP written out by hand; the PRBMs stay local; the global mean is set
once; prediction is head(z + b_i); it learns; bad options name themselves."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.algorithms import feddbe
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.core.types import ClientView
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import same_rule_data, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR = len(COUNTS), 3, 4, 0.1
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)


def features(params, x):
    """The MLP's body by hand: z = relu(x W + b)."""
    return jax.nn.relu(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"][None])


def logits(params, prbm, x):
    return (features(params, x) + prbm[None]) @ params["head"]["kernel"] + params["head"]["bias"][None]


def batch_loss(params, prbm, running, gmean, x, y, w, kappa, momentum):
    """CE(head(z + b)) + kappa * mean(0.5 (r - g)^2), r = (1 - m) running + m * mean_batch(z);
    returns (total, r). `running` is an input: no gradient reaches the earlier batches."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits(params, prbm, x), y)
    z = features(params, x)
    r = (1 - momentum) * running + momentum * jnp.sum(w[:, None] * z, 0) / jnp.sum(w)
    return jnp.sum(ce * w) / jnp.sum(w) + kappa * jnp.mean(0.5 * (r - gmean) ** 2), r


GRAD = jax.jit(jax.grad(batch_loss, argnums=(0, 1), has_aux=True))


def loop_client(params, prbm, gmean, data, key, kappa, momentum, drop_last, dbe=True):
    """One local epoch of SGD steps (floor(n / B) with drop_last, else ceil); without dbe (the
    initialization period) plain cross-entropy, no PRBM. Returns (params, prbm, running mean)."""
    n = int(data.count)
    steps = n // B if drop_last else -(-n // B)
    running = jnp.zeros(8)
    zero = jnp.zeros(8)
    for s in range(steps):
        idx, w = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        x, y = data.x[idx], data.y[idx]
        if dbe:
            (gp, gb), running = GRAD(params, prbm, running, gmean, x, y, w, kappa, momentum)
            prbm = prbm - LR * gb
        else:
            (gp, _), running = GRAD(params, zero, running, gmean, x, y, w, 0.0, momentum)
        params = jax.tree.map(lambda a, g: a - LR * g, params, gp)
    return params, prbm, running


def weighted(trees, weights):
    w = np.asarray(weights, np.float32) / np.sum(weights)
    return jax.tree.map(lambda *vs: sum(wi * v for wi, v in zip(w, vs)), *trees)


@pytest.mark.parametrize(
    "drop_last, momentum, kappa",
    [(False, 0.3, 5.0), (True, 1.0, 50.0)],  # the latter: the authors' FMNIST settings
)
def test_round_equals_loop_and_prediction_adds_the_prbm(drop_last, momentum, kappa):
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    spec = SPEC._replace(drop_last=drop_last)
    alg = feddbe.build(MODEL, spec, clients_per_round=K, client_map="map", kappa=kappa, momentum=momentum)
    state = alg.init(jax.random.key(0), None, NUM)
    params = state.global_params["params"]
    prbm = [jnp.zeros(8) for _ in range(NUM)]
    chex.assert_trees_all_equal(state.client_prbm, jnp.zeros((NUM, 8)))
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))

    # Initialization period (round 0 only): every client, plain CE from the initial model.
    init_key = jax.random.fold_in(round_keys(jax.random.key(3), 0)[1], feddbe.INIT_STREAM)
    means, sizes = [], []
    for c in range(NUM):
        run = loop_client(
            params,
            None,
            jnp.zeros(8),
            take(data.train, c),
            client_key(init_key, c),
            0.0,
            momentum,
            drop_last,
            False,
        )
        took = (COUNTS[c] >= B) if drop_last else True  # a client of fewer than B rows takes no step
        means.append(run[2])
        sizes.append(COUNTS[c] * took)
    gmean = weighted(means, sizes)

    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(3))
        np.testing.assert_allclose(state.global_mean, gmean, rtol=1e-5, atol=1e-6)
        sample_key, train_key = round_keys(jax.random.key(3), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        outs = {
            i: loop_client(
                params,
                prbm[i],
                gmean,
                take(data.train, i),
                client_key(train_key, i),
                kappa,
                momentum,
                drop_last,
            )
            for i in idx
        }
        params = weighted([outs[i][0] for i in idx], [COUNTS[i] for i in idx])
        prbm = [outs[i][1] if i in outs else prbm[i] for i in range(NUM)]
        chex.assert_trees_all_close(state.global_params["params"], params, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state.client_prbm, jnp.stack(prbm), rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(state.client_prbm))) > 0  # the PRBMs did train
    model_bytes = (6 * 8 + 8 + 8 * 3 + 3) * 4  # base + head; the PRBM never travels
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * model_bytes

    scores = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    for i in range(NUM):
        test = take(data.test, i)
        valid = np.arange(test.y.shape[0]) < int(test.count)
        out = logits(state.global_params["params"], prbm[i], test.x)
        correct = np.asarray(jnp.argmax(out, -1) == test.y)[valid]
        ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(out, test.y))[valid]
        np.testing.assert_allclose(scores["accuracy"][i], correct.mean(), atol=1e-6)
        np.testing.assert_allclose(scores["loss"][i], ce.mean(), rtol=1e-5)


def test_global_mean_is_set_once_and_prbms_stay_local():
    data = toy_data(COUNTS)
    alg = feddbe.build(MODEL, SPEC, clients_per_round=K, client_map="map", kappa=5.0)
    rnd = jax.jit(alg.round)
    state = alg.init(jax.random.key(0), None, NUM)
    state, _ = rnd(state, data, jax.random.key(1))
    gmean = state.global_mean
    assert float(jnp.sum(jnp.abs(gmean))) > 0
    for _ in range(2):
        state, _ = rnd(state, data, jax.random.key(1))
        chex.assert_trees_all_equal(state.global_mean, gmean)  # never updated after round 0

    # Non-participants' PRBMs reach nothing and are not touched.
    idx = set(int(i) for i in sample_clients(round_keys(jax.random.key(1), state.round)[0], NUM, K))
    others = jnp.asarray([i not in idx for i in range(NUM)])[:, None]
    moved = state._replace(client_prbm=jnp.where(others, state.client_prbm + 5.0, state.client_prbm))
    a, b = rnd(state, data, jax.random.key(1))[0], rnd(moved, data, jax.random.key(1))[0]
    chex.assert_trees_all_equal(a.global_params, b.global_params)
    chex.assert_trees_all_equal(
        jnp.where(others, b.client_prbm, 0.0), jnp.where(others, moved.client_prbm, 0.0)
    )
    chex.assert_trees_all_equal(jnp.where(others, 0.0, a.client_prbm), jnp.where(others, 0.0, b.client_prbm))

    # kappa = 0: MR is off, the global mean does not matter; kappa > 0: it does.
    off = jax.jit(feddbe.build(MODEL, SPEC, clients_per_round=K, client_map="map").round)
    shifted = state._replace(global_mean=state.global_mean + 3.0)
    chex.assert_trees_all_equal(
        off(state, data, jax.random.key(1))[0].global_params,
        off(shifted, data, jax.random.key(1))[0].global_params,
    )
    assert not np.allclose(
        hidden_kernel(rnd(state, data, jax.random.key(1))[0]),
        hidden_kernel(rnd(shifted, data, jax.random.key(1))[0]),
    )


def hidden_kernel(state):
    return np.asarray(state.global_params["params"]["hidden_0"]["kernel"])


def test_it_learns():
    data = same_rule_data(24, 4)
    alg = feddbe.build(MODEL, SPEC, client_map="map", kappa=1.0, momentum=0.5)
    state = alg.init(jax.random.key(0), None, 4)
    before = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    rnd = jax.jit(alg.round)
    for r in range(15):
        state, _ = rnd(state, data, jax.random.key(r))
    after = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    assert float(np.mean(after["loss"])) < float(np.mean(before["loss"]))
    assert float(np.mean(after["accuracy"])) > 0.6  # 3 classes: chance is 1/3


def test_bad_options_and_host_storage():
    for option, value in (("kappa", -1.0), ("momentum", 0.0), ("momentum", 1.5)):
        with pytest.raises(ValueError, match=option):
            feddbe.build(MODEL, SPEC, **{option: value})
    with pytest.raises(ValueError, match="weighting"):
        feddbe.build(MODEL, SPEC, weighting="x")
    assert "initialization period" in algorithms.host_storage_refusal("feddbe")
    data = toy_data(COUNTS)
    alg = feddbe.build(MODEL, SPEC, client_map="map")
    view = data._replace(view=ClientView(jnp.arange(NUM), NUM))
    with pytest.raises(ValueError, match="host memory"):
        alg.round(alg.init(jax.random.key(0), None, NUM), view, jax.random.key(0))
