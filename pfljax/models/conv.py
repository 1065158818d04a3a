"""Convolution and pooling whose implementation follows the backend.

A convolution written as im2col (shifted slices concatenated on the channel
axis, then one matmul) is the default on CPU and GPU: XLA's CPU convolution is
about 10x slower, and on GPU the native convolution vmapped over clients (each
with its own kernel) becomes a grouped convolution that runs no faster than a
loop over clients. Measured on an H100 (`python -m experiments.bench
--cases=cnn --conv_impl=native|im2col --strategies=vmap`), a FedAvg round of
the CNN: 10 clients 216k -> 1.07M samples/s, 100 clients 401k -> 1.49M. On TPU
(not measured here) the native `lax.conv_general_dilated` stays the default.
Both are tested equal (outputs and grads).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

IMPLS = ("auto", "im2col", "native")
INITS = ("flax", "torch")


def kernel_init(init: str = "flax"):
    """'flax': LeCun normal (std 1 / sqrt(fan_in)); 'torch': torch.nn.Conv2d / Linear's
    default, kaiming_uniform(a=sqrt(5)) = U(-1 / sqrt(fan_in), 1 / sqrt(fan_in))."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if init == "torch":
        return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
    return nn.initializers.lecun_normal()


def bias_init(init: str, fan_in: int):
    """'flax': zeros; 'torch': U(-1 / sqrt(fan_in), 1 / sqrt(fan_in)), fan_in of the layer's kernel."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if init == "flax":
        return nn.initializers.zeros
    bound = float(fan_in) ** -0.5

    def uniform(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return uniform


def resolve_impl(impl: str) -> str:
    """'auto' -> 'native' on TPU, 'im2col' elsewhere (CPU, GPU)."""
    if impl not in IMPLS:
        raise ValueError(f"conv impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "native" if jax.default_backend() == "tpu" else "im2col"
    return impl


def _pads(padding: str, kernel: Sequence[int]) -> list[tuple[int, int]]:
    if padding == "VALID":
        return [(0, 0), (0, 0)]
    if padding == "SAME":
        return [((k - 1) // 2, k // 2) for k in kernel]
    raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")


def conv2d(x: jax.Array, kernel: jax.Array, *, strides=(1, 1), padding="SAME", impl="auto") -> jax.Array:
    """2-D convolution, x [N, H, W, Cin], kernel [kh, kw, Cin, Cout] -> [N, H', W', Cout]."""
    kh, kw, cin, cout = kernel.shape
    pads = _pads(padding, (kh, kw))
    if resolve_impl(impl) == "native":
        return jax.lax.conv_general_dilated(
            x, kernel, tuple(strides), pads, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    x = jnp.pad(x, [(0, 0), pads[0], pads[1], (0, 0)])
    sh, sw = strides
    out_h = (x.shape[1] - kh) // sh + 1
    out_w = (x.shape[2] - kw) // sw + 1
    cols = [
        x[:, i : i + sh * (out_h - 1) + 1 : sh, j : j + sw * (out_w - 1) + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]
    patches = jnp.concatenate(cols, axis=-1)  # [N, out_h, out_w, kh*kw*Cin], (i, j, c) order
    return patches @ kernel.reshape(kh * kw * cin, cout)


def max_pool(x: jax.Array, window: int = 2) -> jax.Array:
    """Non-overlapping window x window max pooling (floor on odd sizes), [N, H, W, C]."""
    n, h, w, c = x.shape
    h2, w2 = h // window, w // window
    x = x[:, : h2 * window, : w2 * window]
    return x.reshape(n, h2, window, w2, window, c).max(axis=(2, 4))


class Conv(nn.Module):
    """Conv layer with leaves `kernel` [kh, kw, Cin, Cout] (lecun normal) and, with
    `use_bias`, `bias` [Cout] (zeros); `init_scheme="torch"`: torch.nn.Conv2d's defaults instead
    (see `kernel_init`, `bias_init`)."""

    features: int
    kernel_size: tuple[int, int] = (5, 5)
    strides: tuple[int, int] = (1, 1)
    padding: str = "SAME"
    impl: str = "auto"
    use_bias: bool = True
    init_scheme: str = "flax"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (*self.kernel_size, x.shape[-1], self.features)
        kernel = self.param("kernel", kernel_init(self.init_scheme), shape)
        y = conv2d(x, kernel, strides=self.strides, padding=self.padding, impl=self.impl)
        if not self.use_bias:
            return y
        fan_in = self.kernel_size[0] * self.kernel_size[1] * x.shape[-1]
        bias = self.param("bias", bias_init(self.init_scheme, fan_in), (self.features,))
        return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
