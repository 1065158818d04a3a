"""Mixtures of models: the posterior over components, and the mixture prediction.

A mixture explains data by one of several component models z = 1..M, with a
prior pi over them. Given each component's loss on the data (its negative
log-likelihood), Bayes' rule gives the posterior

    p(z = m | data) = pi_m exp(-loss_m) / sum_m' pi_m' exp(-loss_m'),

a softmax of log pi - loss over the component axis. FedEM uses it per sample
(M shared components, prior: the client's mixture weights); FedeRiCo per client
(the C clients' models, loss: a running estimate of each model's summed loss,
uniform prior over the models the client has evaluated, `mask`). The mixture's
prediction is sum_m w_m p(y | x; theta_m) (`predict`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def posterior(
    losses: jax.Array, log_prior: jax.Array | None = None, mask: jax.Array | None = None, axis: int = -1
) -> jax.Array:
    """softmax(log_prior - losses) along the component `axis` (log-sum-exp stable).

    Args:
      losses: per-component negative log-likelihoods, components along `axis`.
      log_prior: log prior weights, broadcastable to `losses` (None: uniform).
      mask: optional bool, broadcastable to `losses`: the components allowed;
        the others get weight 0 (a slice with none allowed is uniform).
      axis: the component axis.

    Returns:
      Non-negative weights of the shape of `losses`, summing to 1 along `axis`.
    """
    logits = -losses if log_prior is None else log_prior - losses
    if mask is None:
        return jax.nn.softmax(logits, axis=axis)
    any_allowed = jnp.any(mask, axis=axis, keepdims=True)
    logits = jnp.where(mask | ~any_allowed, logits, -jnp.inf)
    return jax.nn.softmax(jnp.where(any_allowed, logits, 0.0), axis=axis)


def log_evidence(losses: jax.Array, log_prior: jax.Array | None = None, axis: int = -1) -> jax.Array:
    """log sum_m pi_m exp(-loss_m) along `axis`: the mixture's log-likelihood."""
    logits = -losses if log_prior is None else log_prior - losses
    return jax.nn.logsumexp(logits, axis=axis)


def predict(outputs: jax.Array, weights: jax.Array, loss_name: str) -> jax.Array:
    """The mixture's prediction from the outputs [M, ...] of M models, weights [M].

    "cross_entropy": log sum_m w_m softmax(outputs_m), log-probabilities (valid
    logits; a weight 0 drops its model exactly); other losses: the mixture mean
    sum_m w_m outputs_m.
    """
    shape = (-1,) + (1,) * (outputs.ndim - 1)
    if loss_name == "cross_entropy":
        log_w = jnp.log(weights).reshape(shape)
        return jax.nn.logsumexp(log_w + jax.nn.log_softmax(outputs, axis=-1), axis=0)
    return jnp.sum(weights.reshape(shape) * outputs, axis=0)
