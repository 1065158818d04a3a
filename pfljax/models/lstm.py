"""LEAF's Shakespeare character LSTM (Caldas et al. 2018; McMahan et al. 2017).

Token ids [B, T] -> embedding (`embed`, 8) -> stacked LSTM layers (`hidden`, two of
256) -> logits over the vocabulary: at the last position only ([B, V], LEAF's
one next character per sequence, `last_only=True`) or at every position ([B, T,
V], TFF's sequence-to-sequence targets, with the "token_cross_entropy" loss).
The vocabulary is `num_outputs` (LEAF: 80 characters; TFF: 90 ids, padding
included). Inputs may arrive as floats (Model.init's zeros): they are cast to
int32 ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class CharLSTM(nn.Module):
    """Embedding, LSTM layers `lstm_i` (flax's OptimizedLSTMCell), Dense `head`."""

    embed: int = 8
    hidden: Sequence[int] = (256, 256)
    num_outputs: int = 80
    last_only: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        del train  # no dropout or batch statistics
        h = nn.Embed(self.num_outputs, self.embed, name="embedding")(x.astype(jnp.int32))
        for i, width in enumerate(self.hidden):
            h = nn.RNN(nn.OptimizedLSTMCell(width, name=f"lstm_{i}"))(h)
        if self.last_only:
            h = h[:, -1]
        return nn.Dense(self.num_outputs, name="head")(h)
