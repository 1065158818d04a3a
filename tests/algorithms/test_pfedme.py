"""pFedMe: Moreau-envelope local steps against a per-client loop; every client trains, only the
sampled ones reach the global model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import pfedme
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import masked_ce_grad, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
ETA, LAM, K, P_LR, BETA, STEPS, B = 0.05, 2.0, 3, 0.1, 0.7, 4, 4
SPEC = LocalTraining(optax.sgd(ETA), batch_size=B, steps=STEPS, epochs=None)


GRAD = masked_ce_grad(MODEL)


def loop_client(w, data, key):
    """R local steps: K prox-gradient steps on theta, then w <- w - eta lam (w - theta)."""
    theta = w
    for s in range(STEPS):
        rows = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        for _ in range(K):
            g = GRAD(theta, rows, data)
            theta = jax.tree.map(lambda t, gi, wi: t - P_LR * (gi + LAM * (t - wi)), theta, g, w)
        w = jax.tree.map(lambda wi, t: wi - ETA * LAM * (wi - t), w, theta)
    return w, theta


def build():
    kwargs = dict(lam=LAM, inner_steps=K, personal_lr=P_LR, beta=BETA)
    return pfedme.build(MODEL, SPEC, clients_per_round=2, client_map="map", **kwargs)


def test_round_equals_loop_all_clients_train():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = build()
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    glob = state.global_params["params"]
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(6))
        sample_key, train_key = round_keys(jax.random.key(6), r)
        idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), 2)]
        outs = [loop_client(glob, take(data.train, c), client_key(train_key, c)) for c in range(len(COUNTS))]
        mean = jax.tree.map(lambda *xs: sum(xs) / len(xs), *[outs[c][0] for c in idx])
        glob = jax.tree.map(lambda g, m: (1 - BETA) * g + BETA * m, glob, mean)
        chex.assert_trees_all_close(state.global_params["params"], glob, rtol=1e-5, atol=1e-6)
        for c in range(len(COUNTS)):  # every client's personal model moved, sampled or not
            theta = jax.tree.map(lambda x, c=c: x[c], state.client_personal["params"])
            chex.assert_trees_all_close(theta, outs[c][1], rtol=1e-5, atol=1e-6)
    assert metrics["bytes_up"] * len(COUNTS) == metrics["bytes_down"] * 2


def test_unsampled_clients_do_not_reach_the_global_model():
    data = toy_data(COUNTS)
    alg = build()
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    idx = set(int(c) for c in sample_clients(round_keys(jax.random.key(3), 0)[0], len(COUNTS), 2))
    other = min(set(range(len(COUNTS))) - idx)
    x = data.train.x.at[other].multiply(-3.0)  # change an absent client's data only
    changed = data._replace(train=data.train._replace(x=x))
    rnd = jax.jit(alg.round)
    a, _ = rnd(state, data, jax.random.key(3))
    b, _ = rnd(state, changed, jax.random.key(3))
    chex.assert_trees_all_equal(a.global_params, b.global_params)
    assert not np.allclose(
        a.client_personal["params"]["head"]["kernel"][other],
        b.client_personal["params"]["head"]["kernel"][other],
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(lam=0.0), "lam"), (dict(inner_steps=0), "inner_steps"), (dict(weighting="x"), "weighting")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pfedme.build(MODEL, SPEC, **kwargs)
