"""Minibatch b of an endless stream of epochs, for local loops that are not `make_local_train`.

Per-FedAvg (two or three batches per meta-step) and pFedMe (several inner steps
on one batch) draw batches themselves. `stream_batch` gives the same sequence
as `make_local_train`: epoch e is a fresh permutation of the client's real rows
(`epoch_order(key, e, ...)`), cut into ceil(count / B) batches, the last one
partial with weight-0 slots; padding rows never get weight 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pfljax.core.local import batch_rows, epoch_order


def batches_per_epoch(count: jax.Array, batch_size: int) -> jax.Array:
    """ceil(count / B), at least 1 (int32 scalar)."""
    return jnp.maximum((count + batch_size - 1) // batch_size, 1)


def stream_batch(key: jax.Array, b: jax.Array, count: jax.Array, n_max: int, batch_size: int):
    """Rows [B] and weights [B] of batch number b (0, 1, 2, ... across epochs) of one client.

    Args:
      key: the client's key for this round.
      b: int32 batch index; batch b is batch b % E of epoch b // E (E = batches per epoch).
      count: number of real rows of the client.
      n_max: padded row count (static).
      batch_size: B (static).
    """
    per_epoch = batches_per_epoch(count, batch_size)
    order = epoch_order(key, b // per_epoch, count, n_max, batch_size)
    return batch_rows(order, b % per_epoch, count, batch_size)
