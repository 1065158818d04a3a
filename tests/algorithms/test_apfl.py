"""APFL: global copy w, local model v and mixing weight alpha stepped together; against a per-client loop."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import apfl, fedavg
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import masked_ce_grad, mean, same_rule_data, scores_before_after, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
LR, ALPHA, ALPHA_LR, STEPS, B, K = 0.1, 0.5, 0.3, 3, 4, 3
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, steps=STEPS, epochs=None)
GRAD = masked_ce_grad(MODEL)


def mixture(alpha, v, w):
    return jax.tree.map(lambda a, b: alpha * a + (1 - alpha) * b, v, w)


def sgd(params, grads, lr):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def dot(a, b):
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def loop_client(w, v, alpha, data, key):
    """The paper's local steps, every gradient at the values before the step."""
    for s in range(STEPS):
        rows = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        g_w = GRAD(w, rows, data)
        g = GRAD(mixture(alpha, v, w), rows, data)  # the mixture's gradient
        w, v, alpha = (
            sgd(w, g_w, LR),
            sgd(v, g, LR * alpha),
            float(np.clip(alpha - ALPHA_LR * dot(jax.tree.map(jnp.subtract, v, w), g), 0.0, 1.0)),
        )
    return w, v, alpha


def test_round_equals_per_client_loop():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = apfl.build(MODEL, SPEC, clients_per_round=K, client_map="map", alpha=ALPHA, alpha_lr=ALPHA_LR)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    w = state.global_params["params"]
    vs, alphas = [w] * len(COUNTS), [ALPHA] * len(COUNTS)
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(4))
        sample_key, train_key = round_keys(jax.random.key(4), r)
        idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), K)]
        keys = {c: client_key(train_key, c) for c in idx}
        outs = {c: loop_client(w, vs[c], alphas[c], take(data.train, c), keys[c]) for c in idx}
        w = jax.tree.map(lambda *xs: sum(xs) / K, *[outs[c][0] for c in idx])  # uniform mean
        for c in idx:
            _, vs[c], alphas[c] = outs[c]
        chex.assert_trees_all_close(state.global_params["params"], w, rtol=1e-5, atol=1e-6)
        for c in range(len(COUNTS)):
            chex.assert_trees_all_close(take(state.client_params, c)["params"], vs[c], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.client_alpha, alphas, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(alphas, 6))) > 1  # alpha was learned, per client
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * tree_bytes(state.global_params)
    np.testing.assert_allclose(metrics["alpha"], np.mean([alphas[c] for c in idx]), rtol=1e-5)


@pytest.mark.parametrize("mix", ["params", "outputs"])
def test_alpha_stays_in_unit_interval(mix):
    data = toy_data(COUNTS)
    alg = apfl.build(MODEL, SPEC, alpha=0.5, alpha_lr=50.0, mix=mix)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    rnd = jax.jit(alg.round)
    seen = []
    for r in range(4):
        state, metrics = rnd(state, data, jax.random.key(r))
        seen.append(np.asarray(state.client_alpha))
        assert 0.0 <= float(metrics["alpha"]) <= 1.0
    seen = np.stack(seen)
    assert np.all((seen >= 0.0) & (seen <= 1.0)) and np.any(seen != 0.5)
    assert np.any((seen == 0.0) | (seen == 1.0))  # the step size is large enough to hit a bound
    assert np.all(np.isfinite(alg.evaluate(state, data, jax.random.key(0))["loss"]))


def test_alpha_fixed_at_zero_global_part_is_fedavg():
    data = toy_data(COUNTS)
    spec = SPEC._replace(optimizer=optax.sgd(LR, momentum=0.5), steps=None, epochs=2)
    alg = apfl.build(MODEL, spec, clients_per_round=K, alpha=0.0)
    base = fedavg.build(MODEL, spec, clients_per_round=K, weighting="uniform")
    state, ref = alg.init(jax.random.key(0), None, 5), base.init(jax.random.key(0), None, 5)
    v0 = state.client_params
    for r in range(2):
        state, m = jax.jit(alg.round)(state, data, jax.random.key(r))
        ref, m_ref = jax.jit(base.round)(ref, data, jax.random.key(r))
        chex.assert_trees_all_close(state.global_params, ref.global_params, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m["global_loss"], m_ref["train_loss"], rtol=1e-5)
    chex.assert_trees_all_equal(state.client_params, v0)  # alpha = 0: v gets no gradient
    np.testing.assert_array_equal(state.client_alpha, 0.0)
    chex.assert_trees_all_close(
        alg.evaluate(state, data, jax.random.key(0)), base.evaluate(ref, data, jax.random.key(0)), rtol=1e-5
    )


def test_learns():
    data = same_rule_data(40, 4)
    alg = apfl.build(MODEL, LocalTraining(optax.sgd(0.2), batch_size=8, epochs=1), alpha=0.5, alpha_lr=0.05)
    before, after = scores_before_after(alg, data, rounds=10)
    assert mean(after, "loss") < mean(before, "loss") - 0.1 and mean(after, "accuracy") > 0.6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(alpha=1.5), "alpha"),
        (dict(alpha_lr=-1.0), "alpha_lr"),
        (dict(mix="logits"), "mix"),
        (dict(weighting="x"), "weighting"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apfl.build(MODEL, SPEC, **kwargs)
