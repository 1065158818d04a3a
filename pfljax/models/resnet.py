"""ResNet-9 of the Factorized-FL experiments, plain or factorized.

The network of the Factorized-FL release (wyjeong/Factorized-FL,
modules/nets.py), itself the fast CIFAR-10 ResNet-9: conv-BN-ReLU blocks
(convolutions without bias), two residual blocks, a global max pool to a
256-d feature, then the classifier `head`:

    conv_0  3x3, w0          conv_1  5x5 stride 2, w1
    res: conv_2, conv_3 (3x3, w1) added to their input
    conv_4  3x3, w2          2x2 max pool
    res: conv_5, conv_6 (3x3, w2) added to their input
    conv_7  3x3 'VALID', w2  global max pool -> [N, w2]     head  Dense

with widths (w0, w1, w2) = (64, 128, 256). `bn_i` follows `conv_i`. With
`factorized=True` every convolution is a `FactorizedConv` and the head a
`FactorizedDense`; `materialize` of its parameters has exactly the tree of
the plain network. Convolutions use `pfljax.models.conv.conv2d` (`conv_impl`:
oneDNN or im2col on CPU, im2col on GPU, native on TPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from pfljax.models.conv import Conv, max_pool
from pfljax.models.factorized import FactorizedConv, FactorizedDense

# (features index, kernel, stride, padding) of conv_0..conv_7; features index into `widths`.
LAYOUT = (
    (0, 3, 1, "SAME"),
    (1, 5, 2, "SAME"),
    (1, 3, 1, "SAME"),
    (1, 3, 1, "SAME"),
    (2, 3, 1, "SAME"),
    (2, 3, 1, "SAME"),
    (2, 3, 1, "SAME"),
    (2, 3, 1, "VALID"),
)


class ResNet9(nn.Module):
    """ResNet-9 (see module docstring); `factorized=True` for the Factorized-FL variant."""

    num_outputs: int = 10
    widths: Sequence[int] = (64, 128, 256)
    factorized: bool = False
    rank: int = 1
    conv_impl: str = "auto"

    def conv_bn(self, x: jax.Array, i: int, train: bool) -> jax.Array:
        w, k, s, pad = LAYOUT[i]
        kw = dict(kernel_size=(k, k), strides=(s, s), padding=pad, impl=self.conv_impl, name=f"conv_{i}")
        if self.factorized:
            conv = FactorizedConv(self.widths[w], rank=self.rank, use_bias=False, **kw)
        else:
            conv = Conv(self.widths[w], use_bias=False, **kw)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn_{i}")(conv(x))
        return nn.relu(x)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = self.conv_bn(x, 0, train)
        x = self.conv_bn(x, 1, train)
        x = x + self.conv_bn(self.conv_bn(x, 2, train), 3, train)
        x = max_pool(self.conv_bn(x, 4, train))
        x = x + self.conv_bn(self.conv_bn(x, 5, train), 6, train)
        x = self.conv_bn(x, 7, train).max(axis=(1, 2))  # global max pool -> [N, widths[2]]
        if self.factorized:
            return FactorizedDense(self.num_outputs, self.rank, name="head")(x)
        return nn.Dense(self.num_outputs, name="head")(x)
