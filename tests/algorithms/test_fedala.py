"""FedALA: adaptive local aggregation of the head against a per-client loop (start phase to the
std rule, then one epoch); weights in [0, 1]; weights at 1 start from the global model; ALA on
every client (the code's option); it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedala
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, client_key, round_keys, take
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train, shuffled_rows
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR = len(COUNTS), 3, 4, 0.1
ALA = dict(eta=5.0, rand_percent=60, threshold=0.005, num_pre_loss=3, max_start_epochs=8)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)
TRAIN = jax.jit(make_local_train(MODEL.apply, SPEC))


def head_loss(head, params, x, y, w):
    logits = MODEL.apply({"params": {**params, "head": head}}, x)[0]
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * w) / jnp.sum(w)


HEAD_GRAD = jax.jit(jax.value_and_grad(head_loss))


def loop_ala(local, glob, w, started, data, key):
    """The ALA of the head (layer_idx=1): returns (start params, W, started, epochs run)."""
    if all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(glob))):
        return local, w, started, 0
    n = int(data.count)
    order = np.asarray(shuffled_rows(key, data.count, data.x.shape[0]))
    sample = order[: min(max(n * ALA["rand_percent"] // 100, 1), n)]
    diff = jax.tree.map(jnp.subtract, glob["head"], local["head"])
    losses = []
    while True:
        for j in range(0, len(sample), B):
            rows = sample[j : j + B]  # a partial last batch padded with weight-0 rows (one compile)
            pad = np.zeros(B - len(rows), rows.dtype)
            mask = np.concatenate([np.ones(len(rows)), pad]).astype(np.float32)
            rows = np.concatenate([rows, pad])
            head = jax.tree.map(lambda lo, d, wi: lo + d * wi, local["head"], diff, w)
            loss, grad = HEAD_GRAD(head, glob, data.x[rows], data.y[rows], mask)
            w = jax.tree.map(lambda wi, g, d: jnp.clip(wi - ALA["eta"] * g * d, 0, 1), w, grad, diff)
        losses.append(float(loss))
        if started or len(losses) >= ALA["max_start_epochs"]:
            break
        if len(losses) > ALA["num_pre_loss"] and np.std(losses[-ALA["num_pre_loss"] :]) < ALA["threshold"]:
            break
    head = jax.tree.map(lambda lo, d, wi: lo + d * wi, local["head"], diff, w)
    return {**glob, "head": head}, w, True, len(losses)


def row(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


def test_round_equals_loop():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = fedala.build(MODEL, SPEC, clients_per_round=K, client_map="map", **ALA)
    state = alg.init(jax.random.key(0), None, NUM)
    glob = state.global_params["params"]
    locals_ = [glob] * NUM
    weights = [{"kernel": jnp.ones((8, 3)), "bias": jnp.ones((3,))} for _ in range(NUM)]
    started, epochs = [False] * NUM, []
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(2))
        sample_key, train_key = round_keys(jax.random.key(2), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        for i in idx:
            ck, arrays = client_key(train_key, i), take(data.train, i)
            start, weights[i], started[i], e = loop_ala(
                locals_[i], glob, weights[i], started[i], arrays, jax.random.fold_in(ck, 0)
            )
            locals_[i] = TRAIN({"params": start}, arrays, jax.random.fold_in(ck, 1)).params["params"]
            epochs.append(e)
        w = np.asarray([COUNTS[i] for i in idx], np.float32) / sum(COUNTS[i] for i in idx)
        glob = jax.tree.map(lambda *vs, w=w: sum(wi * v for wi, v in zip(w, vs)), *[locals_[i] for i in idx])
        chex.assert_trees_all_close(state.global_params["params"], glob, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(state.client_started, started)
        for i in range(NUM):
            chex.assert_trees_all_close(
                row(state.client_params["params"], i), locals_[i], rtol=1e-5, atol=1e-6
            )
            ala_w = {k: row(state.client_ala_weights[f"params/head/{k}"], i) for k in ("kernel", "bias")}
            chex.assert_trees_all_close(ala_w, weights[i], rtol=1e-5, atol=1e-6)
    # Round 0 skips ALA; start phases stop by the std rule or the bound; later ones run one epoch.
    assert {0, 1, ALA["max_start_epochs"]} <= set(epochs)
    assert any(ALA["num_pre_loss"] < e < ALA["max_start_epochs"] for e in epochs)
    all_w = np.concatenate([np.ravel(v) for v in state.client_ala_weights.values()])
    assert all_w.min() >= 0.0 and all_w.max() <= 1.0 and np.any((all_w > 0) & (all_w < 1))
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * (6 * 8 + 8 + 8 * 3 + 3) * 4

    # It learns: the personalized (trained local) models fit their own rows.
    own = data._replace(test=data.train)  # toy test rows follow another labelling rule
    before = jax.jit(alg.evaluate)(alg.init(jax.random.key(0), None, NUM), own, jax.random.key(0))
    for _ in range(3, 15):
        state, _ = rnd(state, data, jax.random.key(2))
    after = jax.jit(alg.evaluate)(state, own, jax.random.key(0))
    assert float(np.mean(after["loss"])) < 0.5 * float(np.mean(before["loss"]))
    assert float(np.mean(after["accuracy"])) > 0.7


def test_weights_at_one_start_from_the_global_model():
    template = MODEL.template()
    is_top = P.match_paths(template, (r"^params/head/",))
    local, glob = MODEL.init(jax.random.key(1)), MODEL.init(jax.random.key(2))
    ones = {k: jnp.ones(v.shape) for k, v in P.split(template, is_top)[1].items()}
    chex.assert_trees_all_equal(fedala.ala_blend(local, glob, ones, is_top), glob)

    # eta = 0: the weights stay 1 and the ALA start model of every client is the global
    # model; with all_clients (the code's option) every client runs ALA every round.
    data = toy_data(COUNTS)
    alg = fedala.build(
        MODEL, SPEC, clients_per_round=2, client_map="map", eta=0.0, all_clients=True, evaluate_ala=True
    )
    state = alg.init(jax.random.key(0), None, NUM)
    rnd = jax.jit(alg.round)
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(r))
        np.testing.assert_array_equal(state.client_started, [r == 1] * NUM)  # round 0 skips (l == g)
    assert metrics["bytes_down"] == NUM * metrics["bytes_up"] / 2
    chex.assert_trees_all_equal(
        state.client_ala_weights, jax.tree.map(jnp.ones_like, state.client_ala_weights)
    )
    scores = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    expected = evaluate_clients(MODEL.apply, lambda c: state.global_params, data.test, ClientMap("vmap"))
    np.testing.assert_allclose(scores["accuracy"], expected["accuracy"], atol=1e-6)
    np.testing.assert_allclose(scores["loss"], expected["loss"], rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rand_percent=0), "rand_percent"),
        (dict(eta=-1.0), "eta"),
        (dict(num_pre_loss=0), "num_pre_loss"),
        (dict(layer_idx=2), "layer_idx"),
        (dict(weighting="x"), "weighting"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedala.build(MODEL, SPEC, **kwargs)
