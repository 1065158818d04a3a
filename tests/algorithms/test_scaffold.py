"""SCAFFOLD: corrected local steps and control variates against a per-client loop; option I;
identical clients make it FedAvg; it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedavg, scaffold
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import masked_ce_grad, stream_batch, toy_arrays, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR, SERVER_LR = len(COUNTS), 3, 4, 0.1, 0.8
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)
GRAD = masked_ce_grad(MODEL)
tree_close = chex.assert_trees_all_close


def loop_client(x, c, c_i, data, key):
    """The paper's client: y <- y - lr (g(y) - c_i + c) for the client's own K_i = ceil(n / B)
    steps, then option II's c_i+ = c_i - c + (x - y) / (K_i lr)."""
    steps = -(-int(data.count) // B)
    y = x
    for s in range(steps):
        g = GRAD(y, stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B), data)
        y = jax.tree.map(lambda yi, gi, ci, cc: yi - LR * (gi - ci + cc), y, g, c_i, c)
    c_new = jax.tree.map(lambda ci, cc, xi, yi: ci - cc + (xi - yi) / (steps * LR), c_i, c, x, y)
    return y, c_new


def row(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


def test_round_and_option_ii_controls_equal_the_loop():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = scaffold.build(MODEL, SPEC, clients_per_round=K, server_lr=SERVER_LR, client_map="map")
    state = alg.init(jax.random.key(0), None, NUM)
    x, c = state.global_params["params"], state.global_control
    controls = [row(state.client_controls, i) for i in range(NUM)]
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(5))
        sample_key, train_key = round_keys(jax.random.key(5), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        outs = {i: loop_client(x, c, controls[i], take(data.train, i), client_key(train_key, i)) for i in idx}
        mean_y = jax.tree.map(lambda *ys: sum(ys) / K, *[outs[i][0] for i in idx])
        delta_c = jax.tree.map(
            lambda *ds: sum(ds) / NUM, *[jax.tree.map(jnp.subtract, outs[i][1], controls[i]) for i in idx]
        )
        x = jax.tree.map(lambda xi, m: xi + SERVER_LR * (m - xi), x, mean_y)
        c = jax.tree.map(jnp.add, c, delta_c)
        for i in idx:
            controls[i] = outs[i][1]
        tree_close(state.global_params["params"], x, rtol=1e-5, atol=1e-6)
        tree_close(state.global_control, c, rtol=1e-4, atol=2e-5)
        for i in range(NUM):
            tree_close(row(state.client_controls, i), controls[i], rtol=1e-4, atol=2e-5)
        # c stays the mean of the c_i (they start at 0 and c moves by sum(delta c_i) / N).
        tree_close(state.global_control, jax.tree.map(lambda v: v.mean(0), state.client_controls), atol=1e-6)
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * 2 * (6 * 8 + 8 + 8 * 3 + 3) * 4


def test_option_ii_with_local_lr_and_option_i():
    data = toy_data(COUNTS)
    state = scaffold.init(MODEL, jax.random.key(0), None, NUM)
    mean_grad = jax.jit(scaffold.build(MODEL, SPEC, client_map="map").round)
    literal = jax.jit(scaffold.build(MODEL, SPEC, local_lr=LR, client_map="map").round)
    state = mean_grad(state, data, jax.random.key(1))[0]  # controls no longer 0
    a, b = mean_grad(state, data, jax.random.key(2))[0], literal(state, data, jax.random.key(2))[0]
    tree_close(a, b, rtol=1e-4, atol=2e-5)

    # Option I: c_i+ is the gradient of the client's loss over all its rows at x.
    option_i = jax.jit(scaffold.build(MODEL, SPEC, variant="i", client_map="map").round)
    new = option_i(state, data, jax.random.key(2))[0]
    x = state.global_params["params"]
    for i in range(NUM):
        arrays = take(data.train, i)
        full = GRAD(
            x, (jnp.arange(arrays.x.shape[0]), (jnp.arange(arrays.x.shape[0]) < arrays.count) * 1.0), arrays
        )
        tree_close(row(new.client_controls, i), full, rtol=1e-4, atol=1e-6)


def identical_clients(num, n):
    one = toy_arrays((n,), seed=3)
    tile = lambda v: jnp.broadcast_to(v, (num,) + v.shape[1:])  # noqa: E731
    return one._replace(x=tile(one.x), y=tile(one.y), count=jnp.full((num,), n, jnp.int32))


def test_identical_clients_make_it_fedavg():
    """Full-batch steps on identical clients: every c_i equals c, the corrections vanish."""
    train = identical_clients(4, 8)
    data = toy_data((8,) * 4)._replace(train=train)
    spec = LocalTraining(optax.sgd(0.2), batch_size=8, steps=3, epochs=None)
    a = scaffold.build(MODEL, spec, client_map="map")
    b = fedavg.build(MODEL, spec, weighting="uniform", client_map="map")
    sa, sb = a.init(jax.random.key(0), None, 4), b.init(jax.random.key(0), None, 4)
    ra, rb = jax.jit(a.round), jax.jit(b.round)
    for r in range(3):
        sa, sb = ra(sa, data, jax.random.key(r))[0], rb(sb, data, jax.random.key(r))[0]
        tree_close(sa.global_params, sb.global_params, rtol=1e-5, atol=1e-6)
        corrections = jax.tree.map(lambda cg, ci: cg[None] - ci, sa.global_control, sa.client_controls)
        tree_close(corrections, jax.tree.map(jnp.zeros_like, corrections), atol=1e-5)
    assert np.abs(np.asarray(sa.global_control["head"]["kernel"])).max() > 1e-3  # the controls did move


def test_learns():
    data = toy_data((30, 25, 40, 20), seed=2)
    data = data._replace(test=data.train)  # toy test rows follow another labelling rule
    spec = LocalTraining(optax.sgd(0.3), batch_size=8, epochs=1, steps=None)
    alg = scaffold.build(MODEL, spec, clients_per_round=2, client_map="map")
    state = alg.init(jax.random.key(0), None, 4)
    rnd, ev = jax.jit(alg.round), jax.jit(alg.evaluate)
    before = float(np.mean(ev(state, data, jax.random.key(0))["loss"]))
    for r in range(10):
        state, _ = rnd(state, data, jax.random.key(r))
    after = ev(state, data, jax.random.key(0))
    assert float(np.mean(after["loss"])) < 0.5 * before and float(np.mean(after["accuracy"])) > 0.8


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(variant="iii"), "variant"), (dict(server_lr=0.0), "server_lr"), (dict(local_lr=-1.0), "local_lr")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scaffold.build(MODEL, SPEC, **kwargs)
