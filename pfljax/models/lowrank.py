"""Low-rank Hadamard layers of FedPara / pFedPara (Hyeon-Woo et al., ICLR 2022).

A weight is the Hadamard product of two low-rank weights, W1 = X1 Y1^T and
W2 = X2 Y2^T (rank r each, so rank(W1 o W2) can reach r^2):
- form "fedpara":  W = W1 o W2 (FedPara);
- form "pfedpara": W = W1 o (W2 + 1) = W1 o W2 + W1 (pFedPara: pair 1 global,
  pair 2 local; with W2 = 0 the global weight alone is the model).
Dense layers: x [fan_in, r], y [fan_out, r]. Convolutions use the paper's
tensor form W = T x1 X x2 Y with a core t [kh, kw, r, r] per pair (Prop. 3).
Leaves are `x1, y1, (t1), x2, y2, (t2), bias`.

Rank: `rank` if > 0, else from `rank_ratio` g in [0, 1] as in the paper:
r = ceil((1 - g) r_min + g r_max), r_min = min(ceil(sqrt(m)), ceil(sqrt(n))) (the
least rank reaching full rank), r_max = the largest rank with one pair holding at
most half of the original layer's parameters. Factors start from He-normal
draws on each factor (std sqrt(2 / first dim) of the torch shapes, as in the
authors' reimplementation in Flower baselines).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from pfljax.models.conv import conv2d, max_pool

FORMS = ("pfedpara", "fedpara")


def _interpolate(r_min: int, r_max: int, ratio: float) -> int:
    return max(1, math.ceil((1 - ratio) * r_min + ratio * r_max))


def dense_rank(fan_in: int, fan_out: int, ratio: float) -> int:
    """Rank of each low-rank pair of a fan_in x fan_out weight for rank ratio `ratio`."""
    r_min = min(math.ceil(math.sqrt(fan_in)), math.ceil(math.sqrt(fan_out)))
    r_max = math.floor(fan_in * fan_out / (2 * (fan_in + fan_out)))
    return _interpolate(r_min, r_max, ratio)


def conv_rank(window: int, cin: int, cout: int, ratio: float) -> int:
    """Rank of each pair of a conv kernel (window = kh * kw): r_max solves
    window r^2 + (cin + cout) r = cin cout window / 2."""
    r_min = min(math.ceil(math.sqrt(cin)), math.ceil(math.sqrt(cout)))
    a, b, c = window, cin + cout, -cin * cout * window / 2
    r_max = math.floor((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a))
    return _interpolate(r_min, r_max, ratio)


def _combine(w1: jax.Array, w2: jax.Array, form: str) -> jax.Array:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return w1 * (w2 + 1.0) if form == "pfedpara" else w1 * w2


def _normal(std: float):
    return nn.initializers.normal(stddev=std)


class LowRankDense(nn.Module):
    """Dense layer with W [fan_in, features] = combine(X1 Y1^T, X2 Y2^T)."""

    features: int
    rank_ratio: float = 0.5
    rank: int = 0
    form: str = "pfedpara"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fan_in = x.shape[-1]
        r = self.rank or dense_rank(fan_in, self.features, self.rank_ratio)
        pairs = []
        for i in (1, 2):
            xi = self.param(f"x{i}", _normal(math.sqrt(2 / fan_in)), (fan_in, r))
            yi = self.param(f"y{i}", _normal(math.sqrt(2 / self.features)), (self.features, r))
            pairs.append(xi @ yi.T)
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        y = x @ _combine(*pairs, self.form)
        return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


class LowRankConv(nn.Module):
    """Conv layer with kernel [kh, kw, Cin, Cout] = combine(T1 x X1 x Y1, T2 x X2 x Y2)."""

    features: int
    kernel_size: tuple[int, int] = (5, 5)
    padding: str = "SAME"
    impl: str = "auto"
    rank_ratio: float = 0.5
    rank: int = 0
    form: str = "pfedpara"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kh, kw = self.kernel_size
        cin = x.shape[-1]
        r = self.rank or conv_rank(kh * kw, cin, self.features, self.rank_ratio)
        kernels = []
        for i in (1, 2):
            t = self.param(f"t{i}", _normal(math.sqrt(2 / (r * kh * kw))), (kh, kw, r, r))
            xi = self.param(f"x{i}", _normal(math.sqrt(2 / r)), (cin, r))
            yi = self.param(f"y{i}", _normal(math.sqrt(2 / r)), (self.features, r))
            kernels.append(jnp.einsum("hwab,ia,ob->hwio", t, xi, yi))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        y = conv2d(x, _combine(*kernels, self.form), padding=self.padding, impl=self.impl)
        return y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


class LowRankMLP(nn.Module):
    """`MLP` (hidden_i, head) with every layer a LowRankDense."""

    hidden: Sequence[int] = (200,)
    num_outputs: int = 10
    rank_ratio: float = 0.5
    rank: int = 0
    form: str = "pfedpara"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        kw = dict(rank_ratio=self.rank_ratio, rank=self.rank, form=self.form)
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            x = nn.relu(LowRankDense(width, name=f"hidden_{i}", **kw)(x))
        return LowRankDense(self.num_outputs, name="head", **kw)(x)


class LowRankCNN(nn.Module):
    """`CNN` (conv_i, dense_i, head; no BatchNorm) with every layer low-rank Hadamard."""

    channels: Sequence[int] = (16, 32)
    dense: Sequence[int] = (100,)
    num_outputs: int = 10
    kernel_size: int = 5
    padding: str = "VALID"
    conv_impl: str = "auto"
    rank_ratio: float = 0.5
    rank: int = 0
    form: str = "pfedpara"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        kw = dict(rank_ratio=self.rank_ratio, rank=self.rank, form=self.form)
        k = (self.kernel_size, self.kernel_size)
        for i, ch in enumerate(self.channels):
            conv = LowRankConv(ch, k, padding=self.padding, impl=self.conv_impl, name=f"conv_{i}", **kw)
            x = max_pool(nn.relu(conv(x)))
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.dense):
            x = nn.relu(LowRankDense(width, name=f"dense_{i}", **kw)(x))
        return LowRankDense(self.num_outputs, name="head", **kw)(x)
