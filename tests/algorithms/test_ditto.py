"""Ditto: FedAvg for w, personal models v trained towards the w received; against a per-client loop."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import ditto, local
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import masked_ce_grad, mean, same_rule_data, scores_before_after, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
LR, LAM, STEPS, P_STEPS, B, K = 0.1, 0.5, 3, 2, 4, 3
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, steps=STEPS, epochs=None)
GRAD = masked_ce_grad(MODEL)


def loop_client(w, v, data, key):
    """STEPS SGD steps of w; P_STEPS steps of v on f(v) + LAM / 2 ||v - w||^2 (w as received)."""
    w_k = w
    for s in range(STEPS):
        g = GRAD(w_k, stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B), data)
        w_k = jax.tree.map(lambda p, gi: p - LR * gi, w_k, g)
    for s in range(P_STEPS):
        g = GRAD(v, stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B), data)
        v = jax.tree.map(lambda p, gi, a: p - LR * (gi + LAM * (p - a)), v, g, w)
    return w_k, v


def weighted_mean(trees, counts):
    weights = np.asarray(counts, np.float64) / sum(counts)
    return jax.tree.map(lambda *xs: sum(wi * x for wi, x in zip(weights, xs)), *trees)


def test_round_equals_per_client_loop():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = ditto.build(MODEL, SPEC, clients_per_round=K, client_map="map", lam=LAM, personal_steps=P_STEPS)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    w = state.global_params["params"]
    vs = [w] * len(COUNTS)
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(3))
        sample_key, train_key = round_keys(jax.random.key(3), r)
        idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), K)]
        outs = {c: loop_client(w, vs[c], take(data.train, c), client_key(train_key, c)) for c in idx}
        w = weighted_mean([outs[c][0] for c in idx], [COUNTS[c] for c in idx])
        vs = [outs[c][1] if c in outs else vs[c] for c in range(len(COUNTS))]
        chex.assert_trees_all_close(state.global_params["params"], w, rtol=1e-5, atol=1e-6)
        for c in range(len(COUNTS)):
            chex.assert_trees_all_close(take(state.client_personal, c)["params"], vs[c], rtol=1e-5, atol=1e-6)
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * tree_bytes(state.global_params)
    assert np.isfinite(metrics["personal_loss"]) and np.isfinite(metrics["train_loss"])


def test_lam_zero_is_local_training_of_the_personal_model():
    data = toy_data(COUNTS)
    spec = SPEC._replace(steps=None, epochs=2)
    alg = ditto.build(MODEL, spec, clients_per_round=K, lam=0.0)
    base = local.build(MODEL, spec, clients_per_round=K)
    state, ref = alg.init(jax.random.key(0), None, 5), base.init(jax.random.key(0), None, 5)
    for r in range(2):
        state, _ = jax.jit(alg.round)(state, data, jax.random.key(r))
        ref, _ = jax.jit(base.round)(ref, data, jax.random.key(r))
    chex.assert_trees_all_close(state.client_personal, ref.client_params, rtol=1e-6, atol=1e-7)
    heads = state.client_personal["params"]["head"]["kernel"]
    assert not np.allclose(heads[0], state.global_params["params"]["head"]["kernel"])
    got, want = alg.evaluate(state, data, jax.random.key(9)), base.evaluate(ref, data, jax.random.key(9))
    chex.assert_trees_all_close(got, want, rtol=1e-6)


def test_learns():
    data = same_rule_data(40, 4)
    alg = ditto.build(MODEL, LocalTraining(optax.sgd(0.2), batch_size=8, epochs=1), lam=0.1)
    before, after = scores_before_after(alg, data, rounds=10)
    assert mean(after, "loss") < mean(before, "loss") - 0.1 and mean(after, "accuracy") > 0.6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lam=-1.0), "lam"),
        (dict(personal_epochs=-1), "personal_epochs"),
        (dict(personal_steps=-1), "personal_steps"),
        (dict(weighting="x"), "weighting"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ditto.build(MODEL, SPEC, **kwargs)
