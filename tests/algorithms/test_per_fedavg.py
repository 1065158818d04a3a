"""Per-FedAvg: first-order MAML steps against a per-client loop; Hessian-free variants; the
evaluation adapts with one SGD step."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import per_fedavg
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.evaluate import evaluate_client
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import masked_ce_grad, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
ALPHA, BETA, B = 0.05, 0.2, 4
SPEC = LocalTraining(optax.sgd(BETA), batch_size=B, epochs=1, steps=None)


GRAD = masked_ce_grad(MODEL)


def loop_client(params, data, key):
    """ceil(batches / 2) first-order steps, each on two fresh minibatches (epochs=1)."""
    count = int(data.count)
    total = max(math.ceil(count / B), 1)
    for s in range(math.ceil(total / 2)):
        rows = [stream_batch(key, jnp.int32(2 * s + i), data.count, data.x.shape[0], B) for i in (0, 1)]
        tmp = jax.tree.map(lambda p, g: p - ALPHA * g, params, GRAD(params, rows[0], data))
        params = jax.tree.map(lambda p, g: p - BETA * g, params, GRAD(tmp, rows[1], data))
    return params


def test_first_order_round_equals_loop_and_evaluation_adapts():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = per_fedavg.build(MODEL, SPEC, clients_per_round=3, alpha=ALPHA, client_map="vmap")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    ref = state.global_params["params"]
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, _ = rnd(state, data, jax.random.key(9))
        sample_key, train_key = round_keys(jax.random.key(9), r)
        idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), 3)]
        outs = [loop_client(ref, take(data.train, c), client_key(train_key, c)) for c in idx]
        ref = jax.tree.map(lambda *xs: sum(xs) / len(xs), *outs)  # uniform, as the paper
        chex.assert_trees_all_close(state.global_params["params"], ref, rtol=1e-5, atol=1e-6)

    key = jax.random.key(11)
    got = jax.jit(alg.evaluate)(state, data, key)
    for c in range(len(COUNTS)):
        rows_data = take(data.train, c)
        rows = stream_batch(
            jax.random.fold_in(key, c), jnp.int32(0), rows_data.count, rows_data.x.shape[0], B
        )
        adapted = jax.tree.map(lambda p, g: p - ALPHA * g, ref, GRAD(ref, rows, rows_data))
        want = evaluate_client(MODEL.apply, {"params": adapted}, take(data.test, c))
        np.testing.assert_allclose(got["loss"][c], want["loss"], rtol=1e-5)


def test_hessian_free_matches_exact_hessian_vector_product():
    """On a smooth loss (softmax regression); with ReLU networks the finite difference
    can straddle a kink, where the gradient jumps and the jump is divided by 2 delta."""
    data = toy_data(COUNTS)
    spec = SPEC._replace(steps=3, epochs=None)
    linear = build_model("mlp", (6,), 3, hidden=())
    out = {}
    for variant in ("fo", "hf", "hf_exact"):
        alg = per_fedavg.build(linear, spec, alpha=0.5, variant=variant, client_map="map")
        state = alg.init(jax.random.key(0), None, len(COUNTS))
        out[variant] = jax.jit(alg.round)(state, data, jax.random.key(1))[0].global_params
    chex.assert_trees_all_close(out["hf"], out["hf_exact"], rtol=1e-3, atol=1e-5)
    gap = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), out["fo"], out["hf_exact"]))
    )
    assert gap > 1e-3  # the second-order term matters here


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(variant="so"), "variant"), (dict(alpha=0.0), "alpha"), (dict(adapt_steps=-1), "adapt")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        per_fedavg.build(MODEL, SPEC, **kwargs)
