"""MLP with BatchNorm after every hidden Dense layer (FedBN's fully connected blocks).

Layers `hidden_i` (Dense), `bn_i` (BatchNorm), ReLU, then the classifier `head`;
same names as `MLP` plus the `bn_i` layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax


class MLPBN(nn.Module):
    """Flattens its input; Dense -> BatchNorm -> ReLU per hidden width, then `head`."""

    hidden: Sequence[int] = (200,)
    num_outputs: int = 10
    momentum: float = 0.9

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            x = nn.Dense(width, name=f"hidden_{i}")(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum, name=f"bn_{i}")(x)
            x = nn.relu(x)
        return nn.Dense(self.num_outputs, name="head")(x)
