"""FedProto: the round against a per-client loop over the MLP written out by hand; prototypes in
closed form (pooled mean, mean of client means); classes nobody saw keep theirs (or drop them);
nearest-prototype evaluation; bad options; it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedproto
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import mean, same_rule_data, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR, LAM = len(COUNTS), 3, 4, 0.1, 0.7
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1)


def feats(params, x):
    return jax.nn.relu(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"][None])


def loss(params, x, y, w, protos, mask):
    """Masked mean of CE + LAM * mean_d (z - P_y)^2 over rows whose class has a prototype."""
    z = feats(params, x)
    logits = z @ params["head"]["kernel"] + params["head"]["bias"][None]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    reg = jnp.mean((z - protos[y]) ** 2, -1) * mask[y]
    return jnp.sum((ce + LAM * reg) * w) / jnp.sum(w)


GRAD = jax.jit(jax.grad(loss))


def loop_client(params, protos, mask, data, key):
    """ceil(n / B) SGD steps; the features of each step's real rows summed per class."""
    sums, counts = np.zeros((3, 8)), np.zeros(3)
    for s in range(-(-int(data.count) // B)):
        idx, w = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        x, y = data.x[idx], data.y[idx]
        z, w_np, y_np = np.asarray(feats(params, x), np.float64), np.asarray(w), np.asarray(y)
        for r in range(B):
            sums[y_np[r]] += w_np[r] * z[r]
            counts[y_np[r]] += w_np[r]
        g = GRAD(params, x, y, w, protos, mask)
        params = jax.tree.map(lambda a, gi: a - LR * gi, params, g)
    return params, sums, counts


def row(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


def test_round_equals_loop():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = fedproto.build(MODEL, SPEC, clients_per_round=K, client_map="map", lam=LAM)
    state = alg.init(jax.random.key(0), None, NUM)
    models = [row(state.client_models, i)["params"] for i in range(NUM)]
    chex.assert_trees_all_equal(models[0], models[3])  # one initial model for every client
    protos, mask = np.zeros((3, 8)), np.zeros(3, bool)
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(3))
        sample_key, train_key = round_keys(jax.random.key(3), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        p, m = jnp.asarray(protos, jnp.float32), jnp.asarray(mask)
        outs = {i: loop_client(models[i], p, m, take(data.train, i), client_key(train_key, i)) for i in idx}
        models = [outs[i][0] if i in outs else models[i] for i in range(NUM)]
        sums, counts = sum(outs[i][1] for i in idx), sum(outs[i][2] for i in idx)
        seen = counts > 0
        protos = np.where(seen[:, None], sums / np.maximum(counts, 1)[:, None], protos)
        mask = mask | seen
        for i in range(NUM):  # participants trained, the others untouched
            chex.assert_trees_all_close(
                row(state.client_models, i)["params"], models[i], rtol=1e-5, atol=1e-6
            )
        np.testing.assert_allclose(state.global_protos, protos, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(state.global_mask, mask)
    assert mask.all() and float(metrics["prototype_classes"]) == 3
    assert metrics["bytes_up"] == K * 4 * 3 * (8 + 1) and metrics["bytes_down"] == K * 4 * 3 * 8


def test_prototypes_in_closed_form():
    """lr 0: every client's features are the initial model's, each real row seen once (1 epoch)."""
    data = toy_data(COUNTS)
    y = np.asarray(data.train.y)
    y = np.where(y == 2, 0, y)  # class 2 absent from every client
    data = data._replace(train=data.train._replace(y=jnp.asarray(y)))
    spec = SPEC._replace(optimizer=optax.sgd(0.0))
    init = fedproto.build(MODEL, spec).init(jax.random.key(0), None, NUM)
    z = np.stack(
        [np.asarray(feats(row(init.client_models, i)["params"], data.train.x[i])) for i in range(NUM)]
    )
    real = np.arange(y.shape[1])[None, :] < np.asarray(COUNTS)[:, None]
    kept = init._replace(global_protos=jnp.full((3, 8), 7.0), global_mask=jnp.array([False, False, True]))
    for weighting, absent in (("samples", "keep"), ("uniform", "keep"), ("samples", "drop")):
        alg = fedproto.build(MODEL, spec, weighting=weighting, absent_classes=absent)
        for start in (init, kept):
            state, _ = jax.jit(alg.round)(start, data, jax.random.key(1))
            for j in (0, 1):
                rows = real & (y == j)
                if weighting == "samples":  # Eq. 5: the pooled mean of the class's features
                    want = z[rows].mean(0)
                else:  # the code's: the plain mean of the clients' means
                    want = np.mean([z[i][rows[i]].mean(0) for i in range(NUM) if rows[i].any()], 0)
                np.testing.assert_allclose(state.global_protos[j], want, rtol=1e-5, atol=1e-6)
            # Class 2: nobody saw it; it keeps what it had (a prototype, or none), or loses it ("drop").
            had = bool(start.global_mask[2]) and absent == "keep"
            np.testing.assert_array_equal(state.global_protos[2], start.global_protos[2] if had else 0.0)
            np.testing.assert_array_equal(state.global_mask, [True, True, had])
        chex.assert_trees_all_equal(state.client_models, init.client_models)  # lr 0


def test_evaluate_nearest_prototype_and_own_head():
    data = toy_data(COUNTS)
    alg = fedproto.build(MODEL, SPEC, clients_per_round=K, client_map="map")
    state = alg.init(jax.random.key(0), None, NUM)
    evaluate = jax.jit(alg.evaluate)
    before = evaluate(state, data, jax.random.key(0))
    np.testing.assert_array_equal(before["accuracy"], 0.0)  # no prototype yet (PFLlib: 0)
    assert np.all(np.asarray(before["model_accuracy"]) > 0)
    state, _ = jax.jit(alg.round)(state, data, jax.random.key(2))
    state = state._replace(global_mask=jnp.array([True, False, True]))  # class 1 without one
    scores = evaluate(state, data, jax.random.key(0))
    protos = np.asarray(state.global_protos)
    for i in range(NUM):
        test, params = take(data.test, i), row(state.client_models, i)["params"]
        valid = np.arange(test.y.shape[0]) < int(test.count)
        z = np.asarray(feats(params, test.x))
        d2 = ((z[:, None, :] - protos[None]) ** 2).sum(-1)
        d2[:, 1] = np.inf
        near = (np.argmin(d2, -1) == np.asarray(test.y))[valid]
        logits = z @ np.asarray(params["head"]["kernel"]) + np.asarray(params["head"]["bias"])
        own = (np.argmax(logits, -1) == np.asarray(test.y))[valid]
        np.testing.assert_allclose(scores["accuracy"][i], near.mean(), atol=1e-6)
        np.testing.assert_allclose(scores["model_accuracy"][i], own.mean(), atol=1e-6)


def test_it_learns():
    data = same_rule_data(30, 4)
    alg = fedproto.build(MODEL, SPEC, client_map="map")
    state = alg.init(jax.random.key(0), None, 4)
    rnd = jax.jit(alg.round)
    for r in range(12):
        state, _ = rnd(state, data, jax.random.key(r))
    scores = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    assert mean(scores, "accuracy") > 0.7 and mean(scores, "model_accuracy") > 0.7


def test_bad_options():
    with pytest.raises(ValueError, match="lam must be"):
        fedproto.build(MODEL, SPEC, lam=-1.0)
    with pytest.raises(ValueError, match="weighting must be one of"):
        fedproto.build(MODEL, SPEC, weighting="clients")
    with pytest.raises(ValueError, match="absent_classes must be one of"):
        fedproto.build(MODEL, SPEC, absent_classes="forget")
    with pytest.raises(ValueError, match="cross_entropy"):
        fedproto.build(MODEL, SPEC._replace(loss="mse"))
