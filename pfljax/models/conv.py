"""Convolution and pooling whose implementation follows the backend.

On CPU, `conv_impl="auto"` is "onednn": oneDNN's convolutions (what PyTorch's CPU
convolutions call) as XLA FFI custom calls, compiled on first use where a C++
compiler and oneDNN's headers are installed (`pfljax.models.onednn`); a FedAvg
round of the CNNs 1.06-1.67x and of ResNet-9 1.4x faster than with im2col_nn
(`python -m experiments.bench.bench_vs_torch --conv_impl=im2col_nn,auto`,
experiments/results/bench_vs_torch.md).
Without them, "auto" is "im2col_nn" on CPU.

A convolution written as im2col (shifted slices concatenated on the channel
axis, then one matmul) is the default on GPU. There the native convolution
vmapped over clients (each with its own kernel) becomes a grouped convolution
that runs no faster than a loop over clients. Measured on an H100
(`python -m experiments.bench.bench --cases=cnn --conv_impl=native|im2col
--strategies=vmap`), a FedAvg round of the CNN: 10 clients 216k -> 1.07M
samples/s, 100 clients 401k -> 1.49M. On CPU, inside the local-training loop
(a while/scan body), XLA hands the gradients' convolutions of the native
version, which are not in NHWC/HWIO form, to Eigen instead of YNNPACK: a round
about 10x slower than im2col (refcnn, 10 clients: 13.3 s against 1.03 s).

"im2col_nn" is im2col with a hand-written gradient: the kernel's gradient
patches^T dy contracts both operands over their major axis, which XLA:CPU gives
to Eigen; transposing the small dy first and the small result after (kept apart
from the product by optimization barriers, so XLA does not fold them back in)
makes it a row-major matmul for YNNPACK, 1.3-1.8x faster for patch widths
kh*kw*Cin from 144 and Cout up to 256 (every layer of the CNNs and ResNet-9 but
the first), slower for narrow patches (<= 27) and for Cout >= 512, which keep
XLA's product (`python -m experiments.bench.bench_weight_grad`). The input's gradient
is JAX's own. On TPU (not measured here) the native `lax.conv_general_dilated`
stays the default. All are tested equal (outputs and grads); "onednn" takes
float32 only (other dtypes run im2col_nn).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from pfljax.models import onednn

IMPLS = ("auto", "im2col", "im2col_nn", "native", "onednn")
# "im2col_nn" computes the kernel gradient as dy^T @ patches for patch widths kh * kw * Cin from
# NN_WEIGHT_GRAD_MIN_WIDTH and Cout up to NN_WEIGHT_GRAD_MAX_COUT (experiments/bench/bench_weight_grad.py).
NN_WEIGHT_GRAD_MIN_WIDTH = 128
NN_WEIGHT_GRAD_MAX_COUT = 256


def nn_weight_grad(width: int, cout: int) -> bool:
    """Whether "im2col_nn" takes the row-major product for a kernel of patch width kh*kw*Cin."""
    return width >= NN_WEIGHT_GRAD_MIN_WIDTH and cout <= NN_WEIGHT_GRAD_MAX_COUT


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
    """'auto' -> 'native' on TPU, 'im2col' on GPU, on CPU 'onednn' where it can be built (see
    `pfljax.models.onednn`), else 'im2col_nn'."""
    if impl not in IMPLS:
        raise ValueError(f"conv impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "cpu":
        return "onednn" if onednn.available_or_log() else "im2col_nn"
    return {"tpu": "native"}.get(backend, "im2col")


ONEDNN_MISSING = (
    "conv_impl 'onednn': oneDNN's convolutions cannot be built here (needs g++ and libdnnl-dev; "
    "pfljax.models.onednn.unavailable_reason() says why)"
)


def runs_here(impl: str) -> bool:
    """Whether conv impl `impl` can run in this process (the binaries' flag check): all but
    'onednn' always; 'onednn' where `pfljax.models.onednn` could be built (else ONEDNN_MISSING)."""
    return impl != "onednn" or onednn.available()


def _pads(padding: str, kernel: Sequence[int]) -> list[tuple[int, int]]:
    if padding == "VALID":
        return [(0, 0), (0, 0)]
    if padding == "SAME":
        return [((k - 1) // 2, k // 2) for k in kernel]
    raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")


def conv2d(x: jax.Array, kernel: jax.Array, *, strides=(1, 1), padding="SAME", impl="auto") -> jax.Array:
    """2-D convolution, x [N, H, W, Cin], kernel [kh, kw, Cin, Cout] -> [N, H', W', Cout]."""
    pads = tuple(tuple(p) for p in _pads(padding, kernel.shape[:2]))
    impl = resolve_impl(impl)
    if impl == "native":
        return jax.lax.conv_general_dilated(
            x, kernel, tuple(strides), pads, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    if impl == "onednn":
        if x.dtype == kernel.dtype == jnp.float32:
            return onednn.conv2d(x, kernel, strides, pads)
        impl = "im2col_nn"  # oneDNN's handlers are float32 only
    if impl == "im2col_nn":
        return _im2col_nn(x, kernel, tuple(strides), pads)
    return _im2col(x, kernel, tuple(strides), pads)


def _patches(x: jax.Array, kernel_hw: Sequence[int], strides, pads) -> jax.Array:
    """[N, out_h, out_w, kh*kw*Cin] patches of x, in (i, j, c) order."""
    kh, kw = kernel_hw
    x = jnp.pad(x, [(0, 0), pads[0], pads[1], (0, 0)])
    sh, sw = strides
    out_h = (x.shape[1] - kh) // sh + 1
    out_w = (x.shape[2] - kw) // sw + 1
    cols = [
        x[:, i : i + sh * (out_h - 1) + 1 : sh, j : j + sw * (out_w - 1) + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]
    return jnp.concatenate(cols, axis=-1)


def _im2col(x: jax.Array, kernel: jax.Array, strides, pads) -> jax.Array:
    kh, kw, cin, cout = kernel.shape
    return _patches(x, (kh, kw), strides, pads) @ kernel.reshape(kh * kw * cin, cout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _im2col_nn(x: jax.Array, kernel: jax.Array, strides, pads) -> jax.Array:
    return _im2col(x, kernel, strides, pads)


def _im2col_nn_fwd(x, kernel, strides, pads):
    kh, kw, cin, cout = kernel.shape
    patches = _patches(x, (kh, kw), strides, pads)
    return patches @ kernel.reshape(kh * kw * cin, cout), (x, kernel, patches)


def _im2col_nn_bwd(strides, pads, residuals, dy):
    x, kernel, patches = residuals
    cout = kernel.shape[-1]
    dx = jax.vjp(lambda x: _im2col(x, kernel, strides, pads), x)[1](dy)[0]
    p = patches.reshape(-1, patches.shape[-1])
    g = dy.reshape(-1, cout)
    if nn_weight_grad(p.shape[1], cout):
        barrier = jax.lax.optimization_barrier
        dkernel = barrier(barrier(g.T) @ p).T  # [Cout, M] @ [M, K]: row-major for YNNPACK
    else:
        dkernel = p.T @ g
    return dx, dkernel.reshape(kernel.shape)


_im2col_nn.defvjp(_im2col_nn_fwd, _im2col_nn_bwd)


def max_pool(x: jax.Array, window: int = 2) -> jax.Array:
    """Non-overlapping window x window max pooling (floor on odd sizes), [N, H, W, C]. Its
    gradient is JAX's (a tie shares the gradient equally), written as one select in a custom
    VJP: ReLU + pool forward and backward 25% faster on CPU than the gradient JAX derives
    ([32, 28, 28, 16]). Forward-over-reverse (jvp of the gradient) works; a plain jvp of the
    output is refused by JAX (nothing in pfljax takes one)."""
    n, h, w, c = x.shape
    h2, w2 = h // window, w // window
    return _max_pool(x[:, : h2 * window, : w2 * window], window)


def _windows(x: jax.Array, window: int) -> jax.Array:
    n, h, w, c = x.shape
    return x.reshape(n, h // window, window, w // window, window, c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_pool(x: jax.Array, window: int) -> jax.Array:
    return _windows(x, window).max(axis=(2, 4))


def _max_pool_fwd(x, window):
    return _windows(x, window).max(axis=(2, 4)), x


def _max_pool_bwd(window, x, g):
    windows = _windows(x, window)
    top = windows == windows.max(axis=(2, 4), keepdims=True)
    share = g[:, :, None, :, None, :] / top.sum(axis=(2, 4), keepdims=True)
    return (jnp.where(top, share, 0.0).reshape(x.shape),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


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
