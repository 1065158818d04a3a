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
    `use_bias`, `bias` [Cout] (zeros)."""

    features: int
    kernel_size: tuple[int, int] = (5, 5)
    strides: tuple[int, int] = (1, 1)
    padding: str = "SAME"
    impl: str = "auto"
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (*self.kernel_size, x.shape[-1], self.features)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), shape)
        y = conv2d(x, kernel, strides=self.strides, padding=self.padding, impl=self.impl)
        if not self.use_bias:
            return y
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
