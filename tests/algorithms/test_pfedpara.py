"""pFedPara: low-rank Hadamard layers (closed forms) and the second pair kept personal (loop oracle)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.algorithms import pfedpara
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.models import build_model
from pfljax.models.conv import conv2d
from pfljax.models.lowrank import LowRankConv, LowRankDense, conv_rank, dense_rank
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.algorithms.partial_oracle import check_against_state, flat, initial, loop_round
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model(algorithms.model_variant("pfedpara", "mlp"), (6,), 3, hidden=(8,), rank=2)
SPEC = LocalTraining(optax.sgd(0.1), batch_size=4, steps=3, epochs=None)


def is_second_pair(path):
    return path.rsplit("/", 1)[1] in ("x2", "y2")


@pytest.mark.parametrize("form", ["pfedpara", "fedpara"])
def test_dense_weight_is_hadamard_of_low_rank_products(form):
    layer = LowRankDense(5, rank=2, form=form)
    x = jax.random.normal(jax.random.key(0), (3, 4))
    v = layer.init(jax.random.key(1), x)["params"]
    w1, w2 = v["x1"] @ v["y1"].T, v["x2"] @ v["y2"].T
    w = w1 * (w2 + 1) if form == "pfedpara" else w1 * w2
    np.testing.assert_allclose(layer.apply({"params": v}, x), x @ w + v["bias"][None], rtol=1e-5, atol=1e-6)
    # FedPara's point: rank(W1 o W2) reaches r^2 while each factor has rank r.
    big = jax.random.normal(jax.random.key(2), (4, 12, 2))
    h1, h2 = big[0] @ big[1][:10].T, big[2] @ big[3][:10].T
    assert np.linalg.matrix_rank(np.asarray(h1)) == 2 and np.linalg.matrix_rank(np.asarray(h1 * h2)) == 4
    # ... and the layer's own weight (read off through apply on the identity) has it:
    # rank r^2 for W1 o W2, r^2 + r for pFedPara's W1 o (W2 + 1).
    wide = LowRankDense(10, rank=2, form=form)
    eye = jnp.eye(12)
    vw = wide.init(jax.random.key(3), eye)["params"]
    weight = np.asarray(wide.apply({"params": vw}, eye) - vw["bias"][None], np.float64)
    assert np.linalg.matrix_rank(weight, tol=1e-4) == (6 if form == "pfedpara" else 4)


def test_conv_kernel_is_tensor_form():
    layer = LowRankConv(3, (3, 3), padding="SAME", impl="native", rank=2)
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 4))
    v = layer.init(jax.random.key(1), x)["params"]
    k1, k2 = (jnp.einsum("hwab,ia,ob->hwio", v[f"t{i}"], v[f"x{i}"], v[f"y{i}"]) for i in (1, 2))
    want = conv2d(x, k1 * (k2 + 1), padding="SAME", impl="native") + v["bias"][None, None, None]
    np.testing.assert_allclose(layer.apply({"params": v}, x), want, rtol=1e-5, atol=1e-5)


def test_rank_from_ratio_follows_the_paper():
    # 784 x 200: r_min = min(28, 15) = 15, r_max = floor(784*200 / (2*984)) = 79.
    assert [dense_rank(784, 200, g) for g in (0.0, 0.5, 1.0)] == [15, 47, 79]
    # 5x5 conv 16 -> 32: r_min = 4; 25 r^2 + 48 r <= 6400 -> r_max = 15.
    assert [conv_rank(25, 16, 32, g) for g in (0.0, 1.0)] == [4, 15]


def test_round_equals_loop_and_second_pair_stays_personal():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = pfedpara.build(MODEL, SPEC, clients_per_round=3, client_map="vmap")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    g, personal = initial(state, len(COUNTS))
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(2))
        g, personal, idx = loop_round(MODEL, SPEC, g, personal, data, jax.random.key(2), r, 3, is_second_pair)
        check_against_state(state, g, personal, is_second_pair)
    x2 = state.client_params["params/hidden_0/x2"]
    assert not np.allclose(x2[idx[0]], x2[idx[1]])
    sent = sum(v.nbytes for p, v in flat(state.global_params).items() if not is_second_pair(p))
    assert metrics["bytes_up"] == 3 * sent and sent < tree_bytes(state.global_params)


def test_bad_models():
    with pytest.raises(ValueError, match="low-rank"):
        pfedpara.build(build_model("mlp", (6,), 3), SPEC)
    with pytest.raises(ValueError, match="model must be one of"):
        algorithms.model_variant("pfedpara", "resnet9")
