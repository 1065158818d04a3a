"""The four seed methods' maths as pure functions on plain arrays, usable in your own JAX code.

Each name is defined where its method uses it and re-exported here.

- FedFac / FedSplit, factor analysis over the clients' stacked layer weights:
  `unit_observations(kernels)` turns [C, ..., units] kernels into [C * fan_in, units]
  observations of the units; `factor_split(z, kappa=, tau_quantile=, ...)` gives a
  `FactorSplit` (`shared` [units] bool, communalities, loadings, ...).
- Factorized-FL, rank-1 kernels plus a sparse part: `dense_kernel(u, v, mu)` is u v^T + mu,
  `conv_kernel(u, v, mu)` the same reshaped to a convolution's kernel; `factorize(variables,
  rank)` and `materialize(variables)` go between a model's plain and factorized layers;
  `similarity_weights(v, tau=, epsilon=, min_keep=)` maps the clients' [C, d] `v` vectors to
  the [C, C] mixing matrix.
- pFedLA, layer-wise aggregation weights from hypernetworks: `aggregation_weights(raw,
  client, normalization, top_k)` maps raw outputs [L, C] to (alpha [L, C], retained [L])
  (`normalize_weights`, then HeurpFedLA's `retain_top_k`); `layer_mix(alpha, client_params,
  groups)` mixes the clients' models layer group by layer group (alpha [K, L, C]);
  `mlp_hypernet(...)` builds a hypernetwork (`pfljax.core.hypernet`).
- FedeRiCo, decentralized EM over which clients' models explain one's data:
  `running_losses(losses, seen, observed, mask, beta, accumulate)` is the E-step's loss
  estimate, `posterior(losses, log_prior=, mask=)` the softmax of log prior - loss over the
  models; `log_evidence` and `predict` a mixture's likelihood and prediction.

Example, the posterior of 2 clients over 3 models after one observation::

    import jax.numpy as jnp
    from pfljax import maths

    seen = jnp.zeros((2, 3), bool)
    observed = jnp.array([[0.1, 2.0, 3.0], [1.0, 0.2, 5.0]])
    losses, seen = maths.running_losses(jnp.zeros((2, 3)), seen, observed, ~seen, beta=0.6)
    weights = maths.posterior(losses, mask=seen)  # rows sum to 1
"""

from pfljax.algorithms.factorized_fl import similarity_weights
from pfljax.algorithms.federico import running_losses
from pfljax.algorithms.pfedla import aggregation_weights, layer_mix, normalize_weights, retain_top_k
from pfljax.core.factor import FactorSplit, factor_split, unit_observations
from pfljax.core.hypernet import mlp_hypernet
from pfljax.core.mixture import log_evidence, posterior, predict
from pfljax.models.factorized import conv_kernel, dense_kernel, factorize, materialize

__all__ = [
    "FactorSplit",
    "aggregation_weights",
    "conv_kernel",
    "dense_kernel",
    "factor_split",
    "factorize",
    "layer_mix",
    "log_evidence",
    "materialize",
    "mlp_hypernet",
    "normalize_weights",
    "posterior",
    "predict",
    "retain_top_k",
    "running_losses",
    "similarity_weights",
    "unit_observations",
]
