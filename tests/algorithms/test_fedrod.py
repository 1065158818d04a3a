"""FedRoD: balanced softmax on the generic head, cross-entropy of g + p on the personal head,
against a per-client loop over the MLP written out by hand; the personal heads stay local;
prediction by g + p; it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedrod
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR = len(COUNTS), 3, 4, 0.1
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)


def forward(params, personal, x):
    """The MLP by hand: generic logits g(z) and personal logits p(z) of the body's features z."""
    z = jax.nn.relu(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"][None])
    return z @ params["head"]["kernel"] + params["head"]["bias"][None], z @ personal["kernel"] + personal[
        "bias"
    ][None]


def np_balanced_softmax(logits, y, counts):
    """-log(n_y e^{l_y} / sum_j n_j e^{l_j}), in float64."""
    e = counts[None, :] * np.exp(np.asarray(logits, np.float64))
    return -np.log(e[np.arange(len(y)), y] / e.sum(1))


def bsm_loss(params, x, y, w, counts):
    g, _ = forward(params, params["head"], x)
    e = counts[None, :] * jnp.exp(g)
    per = -jnp.log(e[jnp.arange(y.shape[0]), y] / e.sum(1))
    return jnp.sum(per * w) / jnp.sum(w)


def personal_loss(personal, params, x, y, w):
    g, p = forward(jax.lax.stop_gradient(params), personal, x)
    per = optax.softmax_cross_entropy_with_integer_labels(g + p, y)
    return jnp.sum(per * w) / jnp.sum(w)


BSM_GRAD = jax.jit(jax.grad(bsm_loss))
PERSONAL_GRAD = jax.jit(jax.grad(personal_loss))


def loop_client(params, personal, data, key):
    """ceil(n / B) SGD steps: body + g on the balanced softmax, p on the cross-entropy of g + p."""
    valid = np.arange(data.y.shape[0]) < int(data.count)
    counts = jnp.asarray(np.bincount(np.asarray(data.y)[valid], minlength=3), jnp.float32)
    for s in range(-(-int(data.count) // B)):
        idx, w = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        x, y = data.x[idx], data.y[idx]
        gp = PERSONAL_GRAD(personal, params, x, y, w)
        gb = BSM_GRAD(params, x, y, w, counts)
        params = jax.tree.map(lambda a, g: a - LR * g, params, gb)
        personal = jax.tree.map(lambda a, g: a - LR * g, personal, gp)
    return params, personal


def test_balanced_softmax_matches_the_formula():
    y = jnp.asarray([0, 2, 2, 0, 0, 1, 1], jnp.int32)  # 3 real rows: class 1 absent
    log_counts = fedrod.log_class_counts(y, jnp.int32(5), 3)
    np.testing.assert_allclose(np.exp(log_counts), [3, 0, 2], atol=1e-6)
    logits = jax.random.normal(jax.random.key(0), (5, 3))
    got = fedrod.balanced_softmax_loss(logits, y[:5], log_counts)
    np.testing.assert_allclose(
        got, np_balanced_softmax(logits, np.asarray(y[:5]), np.array([3.0, 0, 2])), rtol=1e-5
    )


def test_round_equals_loop_and_prediction_is_the_sum():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = fedrod.build(MODEL, SPEC, clients_per_round=K, client_map="map")
    state = alg.init(jax.random.key(0), None, NUM)
    params = state.global_params["params"]
    heads = [jax.tree.map(lambda v, i=i: v[i], state.client_heads) for i in range(NUM)]
    chex.assert_trees_all_equal(heads[0], params["head"])  # p starts as a copy of g (the code's)
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(3))
        sample_key, train_key = round_keys(jax.random.key(3), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        outs = {i: loop_client(params, heads[i], take(data.train, i), client_key(train_key, i)) for i in idx}
        w = np.asarray([COUNTS[i] for i in idx], np.float32) / sum(COUNTS[i] for i in idx)
        params = jax.tree.map(
            lambda *vs, w=w: sum(wi * v for wi, v in zip(w, vs)), *[outs[i][0] for i in idx]
        )
        heads = [outs[i][1] if i in outs else heads[i] for i in range(NUM)]
        chex.assert_trees_all_close(state.global_params["params"], params, rtol=1e-5, atol=1e-6)
        for i in range(NUM):
            chex.assert_trees_all_close(
                jax.tree.map(lambda v, i=i: v[i], state.client_heads), heads[i], rtol=1e-5, atol=1e-6
            )
    model_bytes = (6 * 8 + 8 + 8 * 3 + 3) * 4  # body + generic head; p never travels
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * model_bytes

    scores = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    for i in range(NUM):
        test = take(data.test, i)
        g, p = forward(state.global_params["params"], heads[i], test.x)
        valid = np.arange(test.y.shape[0]) < int(test.count)
        correct = np.asarray(jnp.argmax(g + p, -1) == test.y)[valid]
        generic = np.asarray(jnp.argmax(g, -1) == test.y)[valid]
        np.testing.assert_allclose(scores["accuracy"][i], correct.mean(), atol=1e-6)
        np.testing.assert_allclose(scores["generic_accuracy"][i], generic.mean(), atol=1e-6)

    # It learns: the personalized predictors fit their own rows.
    own = data._replace(test=data.train)  # toy test rows follow another labelling rule
    before = jax.jit(alg.evaluate)(alg.init(jax.random.key(0), None, NUM), own, jax.random.key(0))
    for _ in range(2, 15):
        state, _ = rnd(state, data, jax.random.key(3))
    after = jax.jit(alg.evaluate)(state, own, jax.random.key(0))
    assert float(np.mean(after["loss"])) < 0.5 * float(np.mean(before["loss"]))
    assert float(np.mean(after["accuracy"])) > 0.7


def test_personal_heads_stay_local():
    data = toy_data(COUNTS)
    alg = fedrod.build(MODEL, SPEC, clients_per_round=K, client_map="map")
    state = alg.init(jax.random.key(0), None, NUM)
    other = state._replace(client_heads=jax.tree.map(lambda v: v + 5.0, state.client_heads))
    rnd = jax.jit(alg.round)
    a, b = rnd(state, data, jax.random.key(1))[0], rnd(other, data, jax.random.key(1))[0]
    chex.assert_trees_all_equal(a.global_params, b.global_params)  # g and the body never see p
    idx = set(int(i) for i in sample_clients(round_keys(jax.random.key(1), 0)[0], NUM, K))
    for i in set(range(NUM)) - idx:
        chex.assert_trees_all_equal(
            jax.tree.map(lambda v, i=i: v[i], b.client_heads),
            jax.tree.map(lambda v, i=i: v[i], other.client_heads),
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="cross_entropy"):
        fedrod.build(MODEL, SPEC._replace(loss="mse"))
    with pytest.raises(ValueError, match="weighting"):
        fedrod.build(MODEL, SPEC, weighting="x")
