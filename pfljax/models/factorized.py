"""Factorized layers and models of Factorized-FL (Jeong & Hwang, NeurIPS 2022).

"Factorized-FL: Personalized Federated Learning with Parameter Factorization &
Similarity Matching" (arXiv:2202.00270). Every kernel is reparameterized as a
rank-r product plus a sparse full-size bias:

- dense: kernel [I, O] = u v^T + mu, u [I, r], v [O, r], mu [I, O];
- conv: kernel [F, F, I, O] = reshape(u v^T, [F, F, I, O]) + mu, u [F*F, r]
  (a spatial basis), v [I*O, r] (per input/output channel coefficients),
  mu [F, F, I, O].

u carries knowledge common to clients, v client-specific knowledge, mu the
client's sparse residual (initialised to zero, as the paper says; the release
draws the dense layers' mu from Glorot, the convs' from zero). The paper uses
r = 1. u and v start from Glorot draws as in the release (see `factor_init`).

Released code vs paper: the code (wyjeong/Factorized-FL, modules/layers.py)
builds the conv kernel as `(uu @ vv).view(O, I, F, F)` from a [F*F, O*I]
matrix; that view reinterprets memory, so u no longer acts as a spatial basis
shared by all channels (each filter takes one entry of u). The paper's
semantics are implemented here: u indexes the F x F positions.

`materialize(params)` gives the plain kernels (the layout of the unfactorized
models: `kernel`, `bias`), `factorize(params, rank)` the inverse (a truncated
SVD for u v^T, the exact residual in mu), so materialize(factorize(p)) == p.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pfljax.models.conv import conv2d, max_pool

FACTORS = ("u", "v", "mu")


def factor_init():
    """Glorot-uniform init of each factor matrix (u [n_u, r], v [n_v, r]), as the
    release does (torch xavier_uniform_ on uu and vv). Each factor then has a
    squared norm of about 2 * r whatever the layer size, so u v^T starts with a
    spectral scale like a plain layer's, and neither factor's gradient path
    dominates (a product initialised to the plain layer's entry variance
    instead has norm ~ sqrt(O) and diverges with the plain learning rates)."""
    return nn.initializers.glorot_uniform()


class FactorizedDense(nn.Module):
    """Dense layer with kernel u v^T + mu; leaves u [I, r], v [O, r], mu [I, O], bias [O]."""

    features: int
    rank: int = 1
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fan_in = x.shape[-1]
        u = self.param("u", factor_init(), (fan_in, self.rank))
        v = self.param("v", factor_init(), (self.features, self.rank))
        mu = self.param("mu", nn.initializers.zeros, (fan_in, self.features))
        y = x @ dense_kernel(u, v, mu)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,))
            y = y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
        return y


def dense_kernel(u: jax.Array, v: jax.Array, mu: jax.Array) -> jax.Array:
    """u [in, r] @ v [out, r]^T + mu [in, out]: a factorized Dense layer's kernel."""
    if u.ndim != 2 or v.ndim != 2 or u.shape[1] != v.shape[1] or mu.shape != (u.shape[0], v.shape[0]):
        raise ValueError(
            f"dense_kernel: u [in, r], v [out, r] and mu [in, out] expected, got u {u.shape}, "
            f"v {v.shape}, mu {mu.shape}"
        )
    return u @ v.T + mu


def conv_kernel(u: jax.Array, v: jax.Array, mu: jax.Array) -> jax.Array:
    """reshape(u [F*F, r] @ v [I*O, r]^T, mu.shape) + mu: the kernel [F, F, I, O]."""
    return (u @ v.T).reshape(mu.shape) + mu


class FactorizedConv(nn.Module):
    """Convolution with kernel reshape(u v^T) + mu (see module docstring).

    Leaves u [F*F, r], v [I*O, r], mu [F, F, I, O] and, with use_bias, bias [O].
    The convolution itself is `pfljax.models.conv.conv2d` (`conv_impl`: oneDNN or im2col on CPU,
    im2col on GPU, native on TPU).
    """

    features: int
    kernel_size: tuple[int, int] = (3, 3)
    strides: tuple[int, int] = (1, 1)
    padding: str = "SAME"
    rank: int = 1
    use_bias: bool = True
    impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kh, kw = self.kernel_size
        cin = x.shape[-1]
        u = self.param("u", factor_init(), (kh * kw, self.rank))
        v = self.param("v", factor_init(), (cin * self.features, self.rank))
        mu = self.param("mu", nn.initializers.zeros, (kh, kw, cin, self.features))
        y = conv2d(x, conv_kernel(u, v, mu), strides=self.strides, padding=self.padding, impl=self.impl)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,)).reshape((1,) * 3 + (-1,))
        return y


class FactorizedMLP(nn.Module):
    """The MLP (`hidden_i`, `head`) with FactorizedDense layers."""

    hidden: Sequence[int] = (200,)
    num_outputs: int = 10
    rank: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            x = nn.relu(FactorizedDense(width, self.rank, name=f"hidden_{i}")(x))
        return FactorizedDense(self.num_outputs, self.rank, name="head")(x)


class FactorizedCNN(nn.Module):
    """The CNN (`conv_i`[/`bn_i`], `dense_i`, `head`) with factorized layers."""

    channels: Sequence[int] = (16, 32)
    dense: Sequence[int] = (100,)
    num_outputs: int = 10
    kernel_size: int = 5
    padding: str = "VALID"
    batch_norm: bool = False
    conv_impl: str = "auto"
    rank: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        k = (self.kernel_size, self.kernel_size)
        for i, ch in enumerate(self.channels):
            x = FactorizedConv(
                ch, k, padding=self.padding, rank=self.rank, impl=self.conv_impl, name=f"conv_{i}"
            )(x)
            if self.batch_norm:
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn_{i}")(x)
            x = max_pool(nn.relu(x))
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.dense):
            x = nn.relu(FactorizedDense(width, self.rank, name=f"dense_{i}")(x))
        return FactorizedDense(self.num_outputs, self.rank, name="head")(x)


def is_factorized_layer(node: Any) -> bool:
    """True for a layer's leaf dict holding u, v and mu."""
    return isinstance(node, dict) and all(k in node for k in FACTORS)


def _map_layers(tree: Any, fn) -> Any:
    if is_factorized_layer(tree) or (isinstance(tree, dict) and "kernel" in tree):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_layers(v, fn) for k, v in tree.items()}
    return tree


def materialize(tree: Any) -> Any:
    """Plain kernels from factorized layers: {u, v, mu[, bias]} -> {kernel[, bias]}.

    Works on a variables dict or on its "params" collection; other leaves
    (BatchNorm, plain layers) pass through. Shapes follow the unfactorized
    models: dense kernel [I, O], conv kernel [F, F, I, O].
    """

    def one(layer):
        if not is_factorized_layer(layer):
            return layer
        u, v, mu = layer["u"], layer["v"], layer["mu"]
        kernel = conv_kernel(u, v, mu) if mu.ndim == 4 else u @ v.T + mu
        return {"kernel": kernel, **{k: x for k, x in layer.items() if k not in FACTORS}}

    return _map_layers(tree, one)


def factorize(tree: Any, rank: int = 1) -> Any:
    """Factorized layers from plain kernels: {kernel[, bias]} -> {u, v, mu[, bias]}.

    u v^T is the best rank-`rank` approximation of the (reshaped [F*F, I*O])
    kernel, its singular values split evenly between u and v; mu is the exact
    residual, so `materialize(factorize(t))` reproduces t (up to float error).
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")

    def one(layer):
        if "kernel" not in layer:
            return layer
        kernel = layer["kernel"]
        if kernel.ndim not in (2, 4):
            raise ValueError(f"factorize takes dense [I, O] or conv [F, F, I, O] kernels, got {kernel.shape}")
        matrix = kernel if kernel.ndim == 2 else kernel.reshape(-1, kernel.shape[2] * kernel.shape[3])
        if rank > min(matrix.shape):
            raise ValueError(f"rank must be <= {min(matrix.shape)} for kernel {kernel.shape}, got {rank}")
        left, s, right = jnp.linalg.svd(matrix, full_matrices=False)
        root = jnp.sqrt(s[:rank])[None, :]
        u, v = left[:, :rank] * root, right[:rank].T * root
        mu = kernel - (u @ v.T).reshape(kernel.shape)
        return {"u": u, "v": v, "mu": mu, **{k: x for k, x in layer.items() if k != "kernel"}}

    return _map_layers(tree, one)
