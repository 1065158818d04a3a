"""Per-example losses and scores, chosen by name.

`score` is what `evaluate` reports as `accuracy`: 1 for a correct class
(cross_entropy); for regression ("mse") it is minus the squared error, so that
higher is better everywhere. "token_cross_entropy" is for sequence targets
(y int [B, T], logits [B, T, V]; TFF's Shakespeare): each example's loss is the
mean cross-entropy over its tokens that are not padding (id `PAD_ID`), its score
the share of those predicted right (an example with no real token scores 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class Loss(NamedTuple):
    """per_example(out [B, ...], y [B, ...]) -> [B]; score likewise."""

    name: str
    per_example: Callable[[jax.Array, jax.Array], jax.Array]
    score: Callable[[jax.Array, jax.Array], jax.Array]


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _correct(logits, y):
    return (jnp.argmax(logits, -1) == y).astype(jnp.float32)


def _sq(out, y):
    err = (out.reshape(out.shape[0], -1) - y.reshape(y.shape[0], -1)) ** 2
    return jnp.mean(err, axis=-1)


PAD_ID = 0  # the padding token of sequence targets ("token_cross_entropy")


def _token_mean(values, y):
    """[B] mean of values [B, T] over each row's non-padding tokens."""
    mask = (y != PAD_ID).astype(jnp.float32)
    return jnp.sum(values * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)


LOSSES = {
    "cross_entropy": Loss("cross_entropy", _ce, _correct),
    "mse": Loss("mse", _sq, lambda o, y: -_sq(o, y)),
    "token_cross_entropy": Loss(
        "token_cross_entropy",
        lambda o, y: _token_mean(_ce(o, y), y),
        lambda o, y: _token_mean(_correct(o, y), y),
    ),
}


def get_loss(name: str | Loss) -> Loss:
    """Looks a loss up by name ("cross_entropy", "mse" or "token_cross_entropy")."""
    if isinstance(name, Loss):
        return name
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {name!r}")
    return LOSSES[name]


def masked_mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    """sum(w * v) / max(sum(w), 1): a mean over real (weight-1) rows only."""
    return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1.0)
