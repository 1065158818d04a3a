"""The small CNN of pFedLA / FedBN-style experiments.

Blocks `conv_i` (k x k convolution, optional BatchNorm `bn_i`, ReLU, 2x2 max
pool), then Dense layers `dense_i` with ReLU, then the classifier `head`.
Defaults (16 and 32 channels of 5x5, 'VALID', one dense layer of 100) are a
LeNet-sized network for 28x28 inputs; every size is configurable. `init_scheme`:
"flax" (LeCun-normal kernels, zero biases) or "torch" (torch.nn.Conv2d / Linear's
defaults: U(+-1 / sqrt(fan_in)) kernels and biases, as PFLlib's FedAvgCNN starts).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from pfljax.models.conv import Conv, bias_init, kernel_init, max_pool


class CNN(nn.Module):
    """Conv blocks then dense layers; `batch_norm=True` adds BN after each conv (FedBN)."""

    channels: Sequence[int] = (16, 32)
    dense: Sequence[int] = (100,)
    num_outputs: int = 10
    kernel_size: int = 5
    padding: str = "VALID"
    batch_norm: bool = False
    conv_impl: str = "auto"
    init_scheme: str = "flax"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        k = (self.kernel_size, self.kernel_size)
        for i, ch in enumerate(self.channels):
            x = Conv(
                ch,
                k,
                padding=self.padding,
                impl=self.conv_impl,
                init_scheme=self.init_scheme,
                name=f"conv_{i}",
            )(x)
            if self.batch_norm:
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn_{i}")(x)
            x = max_pool(nn.relu(x))
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.dense):
            x = nn.relu(_dense(width, x.shape[-1], self.init_scheme, f"dense_{i}")(x))
        return _dense(self.num_outputs, x.shape[-1], self.init_scheme, "head")(x)


def _dense(width: int, fan_in: int, init: str, name: str) -> nn.Dense:
    """nn.Dense with the kernel and bias initializers of `init` ('flax': nn.Dense's own)."""
    return nn.Dense(width, kernel_init=kernel_init(init), bias_init=bias_init(init, fan_in), name=name)
