"""pfljax.maths: the seed methods' functions alone, on plain arrays, against closed forms."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pfljax import maths
from pfljax.algorithms import factorized_fl, federico, pfedla
from pfljax.core import factor, mixture
from pfljax.models import factorized


def test_names_are_the_methods_own_functions():
    assert maths.running_losses is federico.running_losses
    assert maths.aggregation_weights is pfedla.aggregation_weights
    assert maths.similarity_weights is factorized_fl.similarity_weights
    assert maths.factor_split is factor.factor_split and maths.posterior is mixture.posterior
    assert maths.dense_kernel is factorized.dense_kernel
    assert sorted(maths.__all__) == maths.__all__ and all(hasattr(maths, n) for n in maths.__all__)


def test_running_losses_and_posterior_closed_form():
    old = jnp.array([[1.0, 2.0, 0.0], [0.5, 0.0, 4.0]])
    seen = jnp.array([[True, True, False], [True, False, True]])
    observed = jnp.array([[3.0, 0.0, 7.0], [1.5, 2.5, 0.0]])
    mask = jnp.array([[True, False, True], [True, True, False]])
    losses, now = maths.running_losses(old, seen, observed, mask, beta=0.25)
    # seen & observed: 0.75 old + 0.25 new; unseen & observed: the observation; unobserved: unchanged.
    chex.assert_trees_all_close(losses, jnp.array([[1.5, 2.0, 7.0], [0.75, 2.5, 4.0]]))
    chex.assert_trees_all_equal(now, jnp.array([[True, True, True], [True, True, True]]))
    summed, _ = maths.running_losses(old, seen, observed, mask, beta=0.25, accumulate="cumulative")
    chex.assert_trees_all_close(summed[0], jnp.array([4.0, 2.0, 7.0]))
    weights = maths.posterior(losses, mask=now)
    expected = np.exp(-np.asarray(losses)) / np.exp(-np.asarray(losses)).sum(1, keepdims=True)
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    masked = maths.posterior(losses, mask=jnp.array([[True, False, False], [True, True, False]]))
    np.testing.assert_allclose(masked[0], [1.0, 0.0, 0.0])


def test_aggregation_weights_softmax_and_top_k():
    raw = jax.random.normal(jax.random.key(0), (4, 5))
    alpha, retained = maths.aggregation_weights(raw, jnp.int32(2))
    np.testing.assert_allclose(alpha, jax.nn.softmax(raw, axis=-1), rtol=1e-6)
    assert not np.any(retained)
    alpha, retained = maths.aggregation_weights(raw, jnp.int32(2), top_k=2)
    top = np.argsort(-np.asarray(jax.nn.softmax(raw, axis=-1))[:, 2])[:2]
    assert sorted(np.nonzero(np.asarray(retained))[0]) == sorted(top)
    np.testing.assert_allclose(alpha[top], np.eye(5)[[2, 2]])
    relu, _ = maths.aggregation_weights(jnp.full((1, 3), -1.0), jnp.int32(1), "relu_normalize")
    np.testing.assert_allclose(relu, [[0.0, 1.0, 0.0]])  # all-zero row: the client's own layer


def test_dense_kernel_is_the_factorized_layer():
    key = jax.random.key(3)
    layer = factorized.FactorizedDense(4, rank=2, use_bias=False)
    x = jax.random.normal(key, (3, 5))
    variables = layer.init(key, x)
    p = jax.tree.map(lambda a: a + 0.1, variables["params"])  # mu away from its zero init
    want = np.asarray(x) @ (np.asarray(p["u"]) @ np.asarray(p["v"]).T + np.asarray(p["mu"]))
    np.testing.assert_allclose(layer.apply({"params": p}, x), want, rtol=1e-5, atol=1e-6)
    kernel = np.asarray(p["u"]) @ np.asarray(p["v"]).T + np.asarray(p["mu"])
    np.testing.assert_allclose(maths.dense_kernel(p["u"], p["v"], p["mu"]), kernel, rtol=1e-6)


def test_wrong_shapes_and_options_are_one_message_naming_the_argument():
    import pytest  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"dense_kernel: u \[in, r\], v \[out, r\] and mu \[in, out\]"):
        maths.dense_kernel(jnp.ones((5, 1)), jnp.ones((4, 2)), jnp.zeros((5, 4)))
    with pytest.raises(ValueError, match=r"aggregation_weights: raw \[L, C\].*got raw \(5,\)"):
        maths.aggregation_weights(jnp.ones(5), jnp.int32(0))
    with pytest.raises(ValueError, match=r"top_k=3"):
        maths.aggregation_weights(jnp.ones((2, 5)), jnp.int32(0), top_k=3)
    with pytest.raises(ValueError, match=r"normalization must be one of"):
        maths.aggregation_weights(jnp.ones((2, 5)), jnp.int32(0), "sigmoid")
    with pytest.raises(ValueError, match=r"accumulate must be one of \('ema', 'cumulative'\)"):
        maths.running_losses(jnp.zeros(3), jnp.zeros(3, bool), jnp.ones(3), jnp.ones(3, bool), 0.5, "sum")
    with pytest.raises(ValueError):
        maths.running_losses(jnp.zeros((2, 3)), jnp.zeros((2, 3), bool), jnp.ones(4), jnp.ones(3, bool), 0.5)
