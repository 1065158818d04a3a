import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core.batches import batches_per_epoch, stream_batch
from pfljax.core.local import epoch_order


def test_each_epoch_covers_the_real_rows_once_and_never_padding():
    key, count, n_max, bsz = jax.random.key(3), jnp.int32(10), 16, 4
    per_epoch = int(batches_per_epoch(count, bsz))
    assert per_epoch == 3
    fn = jax.jit(lambda b: stream_batch(key, b, count, n_max, bsz))
    for epoch in range(2):
        seen = []
        for j in range(per_epoch):
            rows, w = fn(jnp.int32(epoch * per_epoch + j))
            seen += [int(r) for r, wi in zip(rows, w) if wi == 1.0]
        assert sorted(seen) == list(range(10))
    # Batch b is batch b % E of epoch b // E of the library's epoch order.
    rows, _ = fn(jnp.int32(4))
    np.testing.assert_array_equal(rows, epoch_order(key, 1, count, n_max, bsz)[4:8])
