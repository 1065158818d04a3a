"""Factorized layers: kernel algebra by hand, rank, materialize/factorize round trips."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.models import build_model
from pfljax.models.conv import conv2d
from pfljax.models.factorized import FactorizedConv, FactorizedDense, factorize, materialize

CASES = [
    ("mlp", (6,), dict(hidden=(8, 5))),
    ("cnn", (12, 12, 2), dict(channels=(3, 4), dense=(6,), kernel_size=3)),
]


@pytest.mark.parametrize("name,shape,kw", CASES)
def test_materialized_factorized_model_is_the_plain_model(name, shape, kw):
    plain = build_model(name, shape, 3, **kw)
    fact = build_model(f"factorized_{name}", shape, 3, **kw)
    variables = jax.jit(fact.init)(jax.random.key(0))
    dense = materialize(variables)
    expected = jax.eval_shape(plain.init, jax.random.key(0))
    chex.assert_trees_all_equal_shapes(dense, expected)
    assert jax.tree.structure(dense) == jax.tree.structure(expected)
    x = jax.random.normal(jax.random.key(1), (4, *shape))
    both = jax.jit(lambda p, x: (plain.apply(materialize(p), x)[0], fact.apply(p, x)[0]))(variables, x)
    chex.assert_trees_all_close(*both, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", [1, 2])
def test_kernel_rank_is_at_most_r_with_zero_mu(rank):
    dense = FactorizedDense(7, rank=rank).init(jax.random.key(0), jnp.zeros((1, 9)))["params"]
    conv = FactorizedConv(5, (3, 3), rank=rank).init(jax.random.key(1), jnp.zeros((1, 6, 6, 4)))["params"]
    assert not np.any(dense["mu"]) and not np.any(conv["mu"])
    kd = materialize({"d": dense})["d"]["kernel"]
    kc = materialize({"c": conv})["c"]["kernel"]
    assert kd.shape == (9, 7) and kc.shape == (3, 3, 4, 5)
    assert np.linalg.matrix_rank(np.asarray(kd), tol=1e-5) == rank
    assert np.linalg.matrix_rank(np.asarray(kc).reshape(9, 20), tol=1e-5) == rank


def test_conv_kernel_by_hand():
    """kernel[a, b, i, o] = sum_r u[a*F + b, r] v[i*O + o, r] + mu[a, b, i, o]."""
    rng = np.random.default_rng(0)
    F, I, O, R = 2, 2, 3, 2
    u, v = rng.normal(size=(F * F, R)), rng.normal(size=(I * O, R))
    mu, bias = rng.normal(size=(F, F, I, O)), rng.normal(size=(O,))
    kernel = np.zeros((F, F, I, O))
    for a in range(F):
        for b in range(F):
            for i in range(I):
                for o in range(O):
                    kernel[a, b, i, o] = (
                        sum(u[a * F + b, r] * v[i * O + o, r] for r in range(R)) + mu[a, b, i, o]
                    )
    params = {k: jnp.asarray(x, jnp.float32) for k, x in dict(u=u, v=v, mu=mu, bias=bias).items()}
    np.testing.assert_allclose(materialize({"c": params})["c"]["kernel"], kernel, rtol=1e-5)
    x = jnp.asarray(rng.normal(size=(2, 5, 5, I)), jnp.float32)
    out = FactorizedConv(O, (F, F), padding="VALID", rank=R, impl="native").apply({"params": params}, x)
    ref = conv2d(x, jnp.asarray(kernel, jnp.float32), padding="VALID", impl="native") + bias[None, None, None]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 3])
def test_factorize_then_materialize_is_identity(rank):
    plain = build_model("cnn", (10, 10, 1), 3, channels=(4, 5), dense=(6,), kernel_size=3)
    variables = jax.jit(plain.init)(jax.random.key(2))
    fact = jax.jit(factorize, static_argnums=1)(variables, rank)
    assert fact["params"]["conv_1"]["u"].shape == (9, rank)
    assert fact["params"]["conv_1"]["v"].shape == (4 * 5, rank)
    assert fact["params"]["head"]["u"].shape == (6, rank)
    chex.assert_trees_all_close(jax.jit(materialize)(fact), variables, rtol=1e-4, atol=1e-5)
    # The factors are the best rank-r part: mu is the residual, orthogonal to u v^T.
    layer = fact["params"]["dense_0"]
    low = layer["u"] @ layer["v"].T
    assert abs(float(jnp.sum(low * layer["mu"]))) < 1e-4 * float(jnp.sum(low**2))
    with pytest.raises(ValueError, match="rank"):
        factorize(variables, rank=0)


def test_factor_init_scale_is_independent_of_layer_size():
    """Glorot init per factor (as the release): |u|^2 and |v|^2 about 2 for any size."""
    for fan_in, units in [(16, 8), (784, 200)]:
        p = FactorizedDense(units).init(jax.random.key(3), jnp.zeros((1, fan_in)))["params"]
        for leaf in (p["u"], p["v"]):
            assert 0.8 < float(jnp.sum(leaf**2)) < 3.5
