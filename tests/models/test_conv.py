import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from pfljax.models import build_model
from pfljax.models.conv import conv2d, max_pool, resolve_impl


@pytest.mark.parametrize(
    "padding,strides,k",
    [("SAME", (1, 1), 5), ("VALID", (1, 1), 5), ("SAME", (2, 2), 3), ("VALID", (2, 1), 4)],
)
def test_im2col_equals_native_outputs_and_grads(padding, strides, k):
    kx, kk = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (3, 11, 10, 4))
    w = jax.random.normal(kk, (k, k, 4, 6))

    def f(impl):
        return lambda x, w: jnp.sum(jnp.sin(conv2d(x, w, strides=strides, padding=padding, impl=impl)))

    a = conv2d(x, w, strides=strides, padding=padding, impl="im2col")
    b = conv2d(x, w, strides=strides, padding=padding, impl="native")
    chex.assert_trees_all_close(a, b, rtol=1e-4, atol=1e-4)
    ga = jax.grad(f("im2col"), argnums=(0, 1))(x, w)
    gb = jax.grad(f("native"), argnums=(0, 1))(x, w)
    chex.assert_trees_all_close(ga, gb, rtol=1e-4, atol=1e-4)


def test_cnn_model_same_under_both_impls():
    x = jax.random.normal(jax.random.key(1), (4, 28, 28, 1))
    ma = build_model("cnn", (28, 28, 1), 10, conv_impl="im2col")
    mb = build_model("cnn", (28, 28, 1), 10, conv_impl="native")
    params = ma.init(jax.random.key(0))
    chex.assert_trees_all_close(ma.apply(params, x)[0], mb.apply(params, x)[0], rtol=1e-4, atol=1e-4)


def test_max_pool_equals_flax():
    x = jax.random.normal(jax.random.key(2), (2, 9, 8, 3))
    chex.assert_trees_all_close(max_pool(x), nn.max_pool(x, (2, 2), (2, 2)))


def test_resolve_impl():
    assert resolve_impl("auto") == ("native" if jax.default_backend() == "tpu" else "im2col")
    with pytest.raises(ValueError, match="im2col"):
        resolve_impl("winograd")
