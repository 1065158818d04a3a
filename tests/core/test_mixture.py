"""Mixture posterior, evidence and prediction against closed forms and an
independent float64 numpy computation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.core import mixture


def np_posterior(losses, log_prior=None, mask=None, axis=-1):
    """Bayes' rule in float64 numpy: prior * likelihood, normalised; masked
    components 0, a slice with none allowed uniform."""
    losses = np.asarray(losses, np.float64)
    prior = np.ones_like(losses) if log_prior is None else np.exp(np.asarray(log_prior, np.float64))
    allowed = np.ones(losses.shape, bool) if mask is None else np.broadcast_to(mask, losses.shape)
    shift = np.min(np.where(allowed, losses, np.inf), axis=axis, keepdims=True)
    shift = np.where(np.isfinite(shift), shift, 0.0)
    unnorm = np.where(allowed, prior * np.exp(-(losses - shift)), 0.0)
    total = np.sum(unnorm, axis=axis, keepdims=True)
    uniform = np.full(losses.shape, 1.0 / losses.shape[axis])
    return np.where(
        np.any(allowed, axis=axis, keepdims=True), unnorm / np.where(total > 0, total, 1.0), uniform
    )


# ---------------------------------------------------------------- posterior
def test_posterior_rows():
    equal = mixture.posterior(jnp.full((3, 5), 7.0))
    chex.assert_trees_all_close(equal, jnp.full((3, 5), 0.2))
    losses = jax.random.uniform(jax.random.key(0), (4, 6)) * 50.0
    w = mixture.posterior(losses)
    chex.assert_trees_all_close(jnp.sum(w, axis=1), jnp.ones(4), rtol=1e-6)
    np.testing.assert_array_equal(np.argmax(w, 1), np.argmin(losses, 1))
    big = mixture.posterior(jnp.array([[1e4, 1e4 + 1.0, 2e4], [1e4, 1e4, 1e4]]))
    assert np.all(np.isfinite(big))
    chex.assert_trees_all_close(big[0, :2], jnp.array([1.0, np.exp(-1.0)]) / (1.0 + np.exp(-1.0)), rtol=1e-6)
    chex.assert_trees_all_close(big[1], jnp.full(3, 1 / 3))


def test_posterior_masked_components_get_no_weight():
    losses = jnp.array([[3.0, 1.0, 0.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    seen = jnp.array([[True, True, False, True], [False, False, False, False]])
    w = mixture.posterior(losses, mask=seen)
    assert w[0, 2] == 0.0
    chex.assert_trees_all_close(w[0], mixture.posterior(losses[0].at[2].set(jnp.inf)))
    chex.assert_trees_all_close(w[1], jnp.full(4, 0.25))


def test_posterior_with_prior_closed_form():
    """Two components: q_0 = 1 / (1 + (pi_1 / pi_0) exp(loss_0 - loss_1))."""
    log_pi = jnp.log(jnp.array([0.8, 0.2]))
    losses = jnp.array([[1.0, 2.0, 5.0], [2.0, 1.0, 0.0]])
    q = mixture.posterior(losses, log_pi[:, None], axis=0)
    q0 = 1.0 / (1.0 + 0.25 * np.exp(np.array([1.0, 2.0, 5.0]) - np.array([2.0, 1.0, 0.0])))
    np.testing.assert_allclose(q[0], q0, rtol=1e-6)
    np.testing.assert_allclose(q[1], 1.0 - q0, rtol=1e-5)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("with_prior,with_mask", [(False, False), (True, False), (False, True), (True, True)])
def test_posterior_matches_numpy(axis, with_prior, with_mask):
    rng = np.random.default_rng(axis + 3)
    losses = rng.uniform(0.0, 30.0, size=(5, 7)).astype(np.float32)
    prior_shape = [1, 1]
    prior_shape[axis] = losses.shape[axis]
    prior = rng.dirichlet(np.ones(losses.shape[axis])).reshape(prior_shape)
    log_prior = np.log(prior).astype(np.float32) if with_prior else None
    mask = None
    if with_mask:
        mask = rng.uniform(size=losses.shape) < 0.5
        mask[0] = False  # a row with nothing allowed (and, along axis 0, a column with one fewer)
        mask[:, 0] = False
    got = mixture.posterior(
        jnp.asarray(losses), None if log_prior is None else jnp.asarray(log_prior), mask, axis
    )
    want = np_posterior(losses, log_prior, mask, axis)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.sum(got, axis=axis), 1.0, rtol=1e-6)


def test_log_evidence_matches_numpy():
    rng = np.random.default_rng(0)
    losses = rng.uniform(0.0, 5.0, size=(3, 8)).astype(np.float32)
    pi = rng.dirichlet(np.ones(3))
    got = mixture.log_evidence(jnp.asarray(losses), jnp.log(jnp.asarray(pi, jnp.float32))[:, None], axis=0)
    want = np.log(np.sum(pi[:, None] * np.exp(-losses.astype(np.float64)), axis=0))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(
        mixture.log_evidence(jnp.asarray(losses)), np.log(np.exp(-losses).sum(1)), rtol=1e-5
    )


# ------------------------------------------------------------------ predict
def test_predict_closed_form():
    out = jnp.array([[[2.0, 0.0]], [[0.0, 1.0]]])  # 2 models, 1 row, 2 classes
    w = jnp.array([0.25, 0.75])
    probs = 0.25 * jax.nn.softmax(out[0]) + 0.75 * jax.nn.softmax(out[1])
    chex.assert_trees_all_close(mixture.predict(out, w, "cross_entropy"), jnp.log(probs), rtol=1e-6)
    chex.assert_trees_all_close(mixture.predict(out, w, "mse"), 0.25 * out[0] + 0.75 * out[1])


def test_predict_zero_weight_drops_a_model():
    out = jax.random.normal(jax.random.key(1), (3, 4, 5)) * 10.0
    w = jnp.array([0.0, 1.0, 0.0])
    chex.assert_trees_all_close(
        mixture.predict(out, w, "cross_entropy"), jax.nn.log_softmax(out[1]), rtol=1e-6
    )
    chex.assert_trees_all_close(mixture.predict(out, w, "mse"), out[1])
