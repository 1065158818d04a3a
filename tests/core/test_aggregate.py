import chex
import jax.numpy as jnp
import numpy as np

from pfljax.core import aggregate


def test_weighted_mean_with_mask_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3, 2)).astype(np.float32)
    w = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
    mask = np.array([1, 0, 1, 1, 0], bool)
    got = aggregate.weighted_mean({"a": jnp.asarray(x)}, jnp.asarray(w), jnp.asarray(mask))["a"]
    ww = w * mask
    want = np.tensordot(ww / ww.sum(), x, axes=1)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_normalized_weights_sum_to_one_or_zero():
    w = aggregate.normalized_weights(jnp.array([3.0, 1.0]), jnp.array([True, True]))
    np.testing.assert_allclose(w, [0.75, 0.25])
    z = aggregate.normalized_weights(jnp.array([3.0, 1.0]), jnp.array([False, False]))
    np.testing.assert_array_equal(z, [0.0, 0.0])


def test_server_step_interpolates():
    out = aggregate.server_step({"a": jnp.array(1.0)}, {"a": jnp.array(3.0)}, 0.5)
    np.testing.assert_allclose(out["a"], 2.0)


def test_mix_identity_and_uniform():
    x = {"w": jnp.arange(12.0).reshape(3, 4)}
    chex.assert_trees_all_close(aggregate.mix(jnp.eye(3), x), x)
    u = aggregate.mix(jnp.full((3, 3), 1 / 3), x)["w"]
    np.testing.assert_allclose(u, np.broadcast_to(np.arange(12.0).reshape(3, 4).mean(0), (3, 4)), rtol=1e-6)


def test_unit_masked_mean_keeps_personal_units_and_non_participants():
    rng = np.random.default_rng(1)
    k = rng.normal(size=(4, 3, 5)).astype(np.float32)  # [C, fan_in, units]
    shared = jnp.array([True, False, True, False, False])
    mask = jnp.array([True, True, False, True])
    w = jnp.array([1.0, 1.0, 5.0, 2.0])
    out = np.asarray(aggregate.unit_masked_mean(jnp.asarray(k), shared, w, mask))
    mean = (k[0] + k[1] + 2 * k[3]) / 4
    for c in range(4):
        for u in range(5):
            want = mean[:, u] if (shared[u] and mask[c]) else k[c, :, u]
            np.testing.assert_allclose(out[c, :, u], want, rtol=1e-6)
