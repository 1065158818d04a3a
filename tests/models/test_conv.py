import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from pfljax.models import build_model, onednn
from pfljax.models.conv import (
    NN_WEIGHT_GRAD_MAX_COUT,
    NN_WEIGHT_GRAD_MIN_WIDTH,
    conv2d,
    max_pool,
    nn_weight_grad,
    resolve_impl,
)


def _loss(impl, strides=(1, 1), padding="SAME"):
    return lambda x, w: jnp.sum(jnp.sin(conv2d(x, w, strides=strides, padding=padding, impl=impl)))


# Cin 4: patch widths 36-100, below NN_WEIGHT_GRAD_MIN_WIDTH; Cin 16: 144-400, from it on.
@pytest.mark.parametrize("impl", ["im2col", "im2col_nn"])
@pytest.mark.parametrize("cin", [4, 16])
@pytest.mark.parametrize(
    "padding,strides,k",
    [("SAME", (1, 1), 5), ("VALID", (1, 1), 5), ("SAME", (2, 2), 3), ("VALID", (2, 1), 4)],
)
def test_im2col_equals_native_outputs_and_grads(impl, cin, padding, strides, k):
    kx, kk = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (3, 11, 10, cin))
    w = jax.random.normal(kk, (k, k, cin, 6)) / k
    a = conv2d(x, w, strides=strides, padding=padding, impl=impl)
    b = conv2d(x, w, strides=strides, padding=padding, impl="native")
    chex.assert_trees_all_close(a, b, rtol=1e-4, atol=1e-4)
    ga = jax.grad(_loss(impl, strides, padding), argnums=(0, 1))(x, w)
    gb = jax.grad(_loss("native", strides, padding), argnums=(0, 1))(x, w)
    chex.assert_trees_all_close(ga, gb, rtol=1e-4, atol=1e-4)


def test_im2col_nn_weight_gradient_takes_the_nn_product_within_the_thresholds():
    """Both branches of the hand-written gradient, on either side of each threshold."""
    wide = NN_WEIGHT_GRAD_MAX_COUT + 1
    for cin, cout, nn_form in [(5, 3, False), (6, 3, True), (6, wide, False)]:  # 5 x 5 x Cin: 125, 150
        x = jax.random.normal(jax.random.key(1), (2, 7, 7, cin))
        w = jax.random.normal(jax.random.key(2), (5, 5, cin, cout))
        assert nn_weight_grad(25 * cin, cout) == nn_form
        assert (25 * cin >= NN_WEIGHT_GRAD_MIN_WIDTH and cout <= NN_WEIGHT_GRAD_MAX_COUT) == nn_form
        hlo = jax.jit(jax.grad(_loss("im2col_nn"), argnums=1)).lower(x, w).as_text()
        assert ("optimization_barrier" in hlo) == nn_form
        chex.assert_trees_all_close(
            jax.grad(_loss("im2col_nn"), argnums=1)(x, w),
            jax.grad(_loss("im2col"), argnums=1)(x, w),
            rtol=1e-5,
            atol=1e-5,
        )


def test_im2col_nn_under_vmap_equals_a_loop_and_allows_forward_over_reverse():
    """Clients vmapped (each its own kernel) == one at a time; jvp of the gradient (Per-FedAvg's
    exact Hessian-vector product) equals plain im2col's."""
    xs = jax.random.normal(jax.random.key(3), (3, 2, 9, 9, 8))
    ws = jax.random.normal(jax.random.key(4), (3, 5, 5, 8, 4)) / 5
    grad = jax.grad(_loss("im2col_nn"), argnums=1)
    chex.assert_trees_all_close(
        jax.vmap(grad)(xs, ws), jnp.stack([grad(x, w) for x, w in zip(xs, ws)]), rtol=1e-5, atol=1e-5
    )

    def hvp(impl):
        g = jax.grad(_loss(impl), argnums=1)
        return jax.jvp(lambda w: g(xs[0], w), (ws[0],), (ws[1],))[1]

    chex.assert_trees_all_close(hvp("im2col_nn"), hvp("im2col"), rtol=1e-4, atol=1e-4)


def test_cnn_model_same_under_both_impls():
    x = jax.random.normal(jax.random.key(1), (4, 28, 28, 1))
    ma = build_model("cnn", (28, 28, 1), 10, conv_impl="im2col")
    mb = build_model("cnn", (28, 28, 1), 10, conv_impl="native")
    params = ma.init(jax.random.key(0))
    chex.assert_trees_all_close(ma.apply(params, x)[0], mb.apply(params, x)[0], rtol=1e-4, atol=1e-4)


def test_max_pool_equals_flax():
    x = jax.random.normal(jax.random.key(2), (2, 9, 8, 3))
    chex.assert_trees_all_close(max_pool(x), nn.max_pool(x, (2, 2), (2, 2)))


def _derived_max_pool(x, window):
    """max_pool without its hand-written gradient: the one JAX derives (the oracle)."""
    n, h, w, c = x.shape
    h2, w2 = h // window, w // window
    return x[:, : h2 * window, : w2 * window].reshape(n, h2, window, w2, window, c).max(axis=(2, 4))


@pytest.mark.parametrize("window,shape", [(2, (2, 9, 8, 3)), (3, (3, 7, 10, 5))])
def test_max_pool_gradient_equals_the_derived_one_with_ties(window, shape):
    """Ties (ReLU's zeros, repeated values) share the gradient as JAX's derived gradient
    shares it; odd sizes; under vmap; the jvp of the gradient (Per-FedAvg) too."""
    x = jax.nn.relu(jax.random.normal(jax.random.key(5), shape))
    x = x.at[:, 0, 0, 0].set(1.5).at[:, 0, 1, 0].set(1.5)  # a tie of two positive values
    g = jax.random.normal(jax.random.key(6), max_pool(x, window).shape)

    def grads(pool):
        return jax.vjp(lambda z: pool(z, window), x)[1](g)[0]

    ours, derived = grads(max_pool), grads(_derived_max_pool)
    assert float(jnp.abs(derived[:, 0, 0, 0]).max()) > 0  # the tie gets gradient
    chex.assert_trees_all_equal(ours, derived)
    loss = lambda pool: lambda z: jnp.sum(jnp.sin(pool(z, window)) * g)
    grad = jax.grad(loss(max_pool))
    chex.assert_trees_all_equal(jax.vmap(grad)(jnp.stack([x, 2 * x])), jnp.stack([grad(x), grad(2 * x)]))
    hvp = lambda pool: jax.jvp(jax.grad(loss(pool)), (x,), (jnp.cos(x),))[1]
    chex.assert_trees_all_close(hvp(max_pool), hvp(_derived_max_pool), rtol=1e-6, atol=1e-6)


def test_resolve_impl():
    cpu = "onednn" if onednn.available() else "im2col_nn"
    expected = {"tpu": "native", "cpu": cpu}.get(jax.default_backend(), "im2col")
    assert resolve_impl("auto") == expected
    with pytest.raises(ValueError, match="im2col"):
        resolve_impl("winograd")
