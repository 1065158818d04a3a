"""FD: the round against a per-client loop over the MLP written out by hand (the paper's softmax
outputs and other-clients teacher, and PFLlib's raw logits and all-clients teacher); the uploads and
teachers in closed form; labels without a teacher add nothing; bad options; it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import feddistill
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import mean, same_rule_data, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR, GAMMA = len(COUNTS), 3, 4, 0.1, 0.6
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1)


def forward(params, x):
    z = jax.nn.relu(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"][None])
    return z @ params["head"]["kernel"] + params["head"]["bias"][None]


def loss(params, x, y, w, table, has, received, outputs):
    """CE + GAMMA * -sum_k T_k log softmax_k: the paper's (softmax teacher, rows without one
    add 0) or PFLlib's (raw-logit targets, rows without one target their own logits)."""
    logits = forward(params, x)
    log_probs = jax.nn.log_softmax(logits)
    ce = -log_probs[jnp.arange(y.shape[0]), y]
    if outputs == "softmax":
        term = -jnp.sum(table[y] * log_probs, -1) * has[y]
    else:
        target = jnp.where(has[y][:, None], table[y], jax.lax.stop_gradient(logits))
        term = -jnp.sum(target * log_probs, -1) * received
    return jnp.sum((ce + GAMMA * term) * w) / jnp.sum(w)


GRAD = jax.jit(jax.grad(loss), static_argnums=7)


def loop_client(params, table, has, received, outputs, data, key):
    """ceil(n / B) SGD steps; each step's outputs (softmax or logits) of its real rows summed per label."""
    sums, counts = np.zeros((3, 3)), np.zeros(3)
    for s in range(-(-int(data.count) // B)):
        idx, w = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        x, y = data.x[idx], data.y[idx]
        out = forward(params, x)
        vec = np.asarray(jax.nn.softmax(out) if outputs == "softmax" else out, np.float64)
        for r in range(B):
            sums[int(y[r])] += float(w[r]) * vec[r]
            counts[int(y[r])] += float(w[r])
        g = GRAD(params, x, y, w, table, has, received, outputs)
        params = jax.tree.map(lambda a, gi: a - LR * gi, params, g)
    return params, sums / np.maximum(counts, 1)[:, None], counts


def teacher(last, me, others):
    """Mean of the last participants' per-label means over those holding the label (not `me`)."""
    table, n = np.zeros((3, 3)), np.zeros(3)
    for i, (means, counts) in last.items():
        if others and i == me:
            continue
        table += means * (counts > 0)[:, None]
        n += counts > 0
    return jnp.asarray(table / np.maximum(n, 1)[:, None], jnp.float32), jnp.asarray(n > 0)


def row(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


@pytest.mark.parametrize("teacher_rule, outputs", [("others", "softmax"), ("all", "logits")])
def test_round_equals_loop(teacher_rule, outputs):
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = feddistill.build(
        MODEL, SPEC, clients_per_round=K, client_map="map", gamma=GAMMA, teacher=teacher_rule, outputs=outputs
    )
    state = alg.init(jax.random.key(0), None, NUM)
    models = [row(state.client_models, i)["params"] for i in range(NUM)]
    last = {}  # the previous round's participants: id -> (means, counts)
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(5))
        sample_key, train_key = round_keys(jax.random.key(5), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        outs = {}
        for i in idx:
            table, has = teacher(last, i, teacher_rule == "others")
            args = (table, has, jnp.float32(r > 0), outputs, take(data.train, i), client_key(train_key, i))
            outs[i] = loop_client(models[i], *args)
        models = [outs[i][0] if i in outs else models[i] for i in range(NUM)]
        last = {i: outs[i][1:] for i in idx}
        for i in range(NUM):
            chex.assert_trees_all_close(
                row(state.client_models, i)["params"], models[i], rtol=1e-5, atol=1e-6
            )
        np.testing.assert_array_equal(state.last_ids, idx)
        np.testing.assert_allclose(
            state.last_means, np.stack([last[i][0] for i in idx]), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(state.last_counts, np.stack([last[i][1] for i in idx]))
    assert metrics["bytes_up"] == K * 4 * 3 * 4 and metrics["bytes_down"] == K * 4 * 3 * 3


def test_uploads_and_teachers_in_closed_form():
    """lr 0: the uploads are the initial model's per-label mean softmax over each client's rows."""
    data = toy_data(COUNTS)
    alg = feddistill.build(MODEL, SPEC._replace(optimizer=optax.sgd(0.0)), clients_per_round=K)
    state = alg.init(jax.random.key(0), None, NUM)
    params = row(state.client_models, 0)["params"]
    state, _ = jax.jit(alg.round)(state, data, jax.random.key(2))
    idx = [int(i) for i in sample_clients(round_keys(jax.random.key(2), 0)[0], NUM, K)]
    np.testing.assert_array_equal(state.last_ids, idx)
    for k, i in enumerate(idx):
        y = np.asarray(data.train.y[i, : COUNTS[i]])
        probs = np.asarray(jax.nn.softmax(forward(params, data.train.x[i, : COUNTS[i]])))
        np.testing.assert_allclose(state.last_counts[k], np.bincount(y, minlength=3))
        for j in range(3):
            want = probs[y == j].mean(0) if (y == j).any() else np.zeros(3)
            np.testing.assert_allclose(state.last_means[k, j], want, rtol=1e-5, atol=1e-6)

    # A label only client 2 holds: its own teacher ("others") has none, everyone else's has it.
    means = jax.random.uniform(jax.random.key(1), (3, 3, 3))
    counts = jnp.array([[4.0, 0, 1], [2, 3, 0], [1, 0, 5]])  # label 1: client 2 only
    last = state._replace(last_ids=jnp.array([0, 2, 4]), last_means=means, last_counts=counts)
    m, c = np.asarray(means), np.asarray(counts)
    for me, others in ((2, True), (1, True), (2, False)):
        keep = [(k, i) for k, i in enumerate((0, 2, 4)) if not (others and i == me)]
        table, has = feddistill.teacher_table(last, jnp.int32(me), "others" if others else "all")
        for j in range(3):
            holders = [k for k, _ in keep if c[k, j] > 0]
            assert bool(has[j]) == bool(holders)
            want = np.mean([m[k, j] for k in holders], 0) if holders else np.zeros(3)
            np.testing.assert_allclose(table[j], want, rtol=1e-6)
    assert not feddistill.teacher_table(last, jnp.int32(2), "others")[1][1]
    assert feddistill.teacher_table(last, jnp.int32(2), "all")[1][1]


@pytest.mark.parametrize("outputs", ["softmax", "logits"])
def test_first_round_has_no_teacher(outputs):
    """Before any upload no row has a teacher: gamma changes nothing in round 0."""
    data = toy_data(COUNTS)
    states = []
    for gamma in (0.0, 5.0):
        alg = feddistill.build(MODEL, SPEC, clients_per_round=K, gamma=gamma, outputs=outputs)
        states.append(jax.jit(alg.round)(alg.init(jax.random.key(0), None, NUM), data, jax.random.key(1))[0])
    chex.assert_trees_all_close(states[0], states[1], rtol=1e-6, atol=1e-7)


def test_it_learns():
    data = same_rule_data(30, 4)
    alg = feddistill.build(MODEL, SPEC, client_map="map")
    state = alg.init(jax.random.key(0), None, 4)
    rnd = jax.jit(alg.round)
    for r in range(12):
        state, _ = rnd(state, data, jax.random.key(r))
    assert mean(jax.jit(alg.evaluate)(state, data, jax.random.key(0)), "accuracy") > 0.7


def test_bad_options():
    with pytest.raises(ValueError, match="gamma must be"):
        feddistill.build(MODEL, SPEC, gamma=-1.0)
    with pytest.raises(ValueError, match="teacher must be one of"):
        feddistill.build(MODEL, SPEC, teacher="mine")
    with pytest.raises(ValueError, match="outputs must be one of"):
        feddistill.build(MODEL, SPEC, outputs="probs")
    with pytest.raises(ValueError, match="cross_entropy"):
        feddistill.build(MODEL, SPEC._replace(loss="mse"))
