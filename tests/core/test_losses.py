"""token_cross_entropy: padding (id 0) masked, per-example means over real tokens."""

import jax.numpy as jnp
import numpy as np
import optax

from pfljax.core.losses import get_loss


def test_token_loss_and_score_skip_padding():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    y = jnp.asarray([[2, 4, 0], [0, 0, 0]])
    loss = get_loss("token_cross_entropy")
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    np.testing.assert_allclose(loss.per_example(logits, y), [(ce[0, 0] + ce[0, 1]) / 2, 0.0], rtol=1e-6)
    right = (jnp.argmax(logits, -1) == y)[0, :2].mean()
    np.testing.assert_allclose(loss.score(logits, y), [right, 0.0])
