"""Multi-layer perceptron: Dense layers `hidden_0..` with ReLU, then `head`."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax


class MLP(nn.Module):
    """Flattens its input; hidden widths `hidden`, output size `num_outputs`."""

    hidden: Sequence[int] = (200,)
    num_outputs: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            x = nn.relu(nn.Dense(width, name=f"hidden_{i}")(x))
        return nn.Dense(self.num_outputs, name="head")(x)
