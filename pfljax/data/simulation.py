"""FedFac simulation: model (8) of Wang, Tang & Li (arXiv 2312.04281, Sec. 4.3.1).

"Factor-Assisted Federated Learning for Personalized Optimization with
Heterogeneous Data". Model (8), as printed in the v1 text:

* Covariates. x_c = (x_c^p, x_c^s) in R^d with d1 personalized covariates
  x_c^p ~ N(mu_c, Sigma) and d2 shared covariates x_c^s ~ N(0, I); the shared
  proportion is alpha = d2 / d. mu_c ~ N(0, I_d1) per client and
  Sigma = (0.5^|i-j|), a d1 x d1 AR(1) matrix.
* Network. A one-hidden-layer ReLU network without biases (Sec. 3.2 defines
  sigma as ReLU) with m = m1 + m2 hidden units, p = m2 / m of them shared:
      h_c(x) = sum_{q <= m1} a_q relu(w_cq^pp . x^p + w_cq^ps . x^s)
             + sum_{r > m1}  a_r relu(w_r^sp . x^p + w_r^ss . x^s).
  Shared units (same on every client): w^sp ~ U(-0.1, 0.1), w^ss ~ U(-1, 1).
  Personalized units (drawn per client): w_cq^pp ~ N(mu_c, I) -- the same
  mu_c as the client's covariate mean -- and w_cq^ps ~ U(-0.1, 0.1).
  Output weights a ~ N(0, I_m) are shared by all clients.
* Labels. y* = h_c(x) + eps, eps ~ N(0, c^2), and y = 1 iff sigmoid(y*) in
  (0.5, 1], i.e. iff y* > 0. The paper uses C = 100, d = 100, m = 200 and
  varies p (alpha = 0.4 fixed) and alpha (p = 0.5 fixed).

Assumptions (the paper leaves them open): the noise scale c is
`noise_scale` (default 1.0); n (samples per client) is `samples_per_client`;
d2 = round(alpha * d), m2 = round(p * m); unit order is the paper's
(personalized units first, then shared), covariate order is (x^p, x^s).

Label rules. `label_rule="paper"` is the literal rule above. It gives
nearly constant labels: a personalized unit's pre-activation has mean
|mu_c|^2 ~ d1 (about 60 for d = 100, alpha = 0.4; spread about 16), far above
the shared units' (spread about 4), so h_c is dominated by
|mu_c|^2 * sum_{q <= m1} a_q. As `a` is shared, that sign is the same on every
client: with seed 0 (defaults) every label of every client is 1; over seeds
0-5 five gave 100% one class and one (where sum_q a_q is small) 93%. The
tests measure this. `label_rule="median"` (the default) thresholds y* at
each client's own median instead: exactly balanced labels, same decision
function up to a per-client offset.

Randomness: one seed; the shared parameters and each client's parameters and
samples come from separate child streams, so client c's data does not depend
on the number of clients.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

LABEL_RULES = ("median", "paper")


def ar1_covariance(dim: int, rho: float = 0.5) -> np.ndarray:
    """Returns the [dim, dim] matrix rho^|i-j|."""
    idx = np.arange(dim)
    return rho ** np.abs(idx[:, None] - idx[None, :])


def simulate_fedfac(
    num_clients: int = 100,
    samples_per_client: int = 500,
    *,
    d: int = 100,
    m: int = 200,
    p: float = 0.5,
    alpha: float = 0.4,
    noise_scale: float = 1.0,
    label_rule: str = "median",
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Draws data and true parameters from the FedFac model (8).

    Args:
      num_clients: C, number of clients.
      samples_per_client: n, samples drawn for every client.
      d: number of covariates.
      m: number of hidden units.
      p: shared fraction of hidden units, m2 = round(p * m).
      alpha: shared fraction of covariates, d2 = round(alpha * d).
      noise_scale: standard deviation c of the additive noise on h.
      label_rule: "median" (default, balanced per client) or "paper"
        (y = 1 iff sigmoid(h + noise) > 0.5).
      seed: random seed.

    Returns:
      (x, y, truth): x float32 [C, n, d], y int32 [C, n] in {0, 1}, and truth,
      a dict of numpy arrays / scalars:
        hidden_weights [C, m, d] float32, row j is unit j's incoming weights;
        output_weights [m] float32 (a, shared);
        shared_unit_mask [m] bool (True = shared unit: the last m2 units);
        shared_covariate_mask [d] bool (True = shared covariate: last d2);
        client_means [C, d1] float32 (mu_c);
        covariate_means [C, d] float32 (mu_c padded with zeros);
        personalized_covariance [d1, d1] float32 (Sigma);
        thresholds [C] float32, the cut applied to h + noise (0 for "paper");
        d1, d2, m1, m2, p, alpha, noise_scale, label_rule, activation.

    Raises:
      ValueError: naming the argument, for values out of range.
    """
    _check_args(num_clients, samples_per_client, d, m, p, alpha, noise_scale, label_rule)
    d2 = int(round(alpha * d))
    m2 = int(round(p * m))
    shared_seq, *client_seqs = np.random.SeedSequence(seed).spawn(num_clients + 1)
    shared = _draw_shared(np.random.default_rng(shared_seq), m, m2, d - d2, d2)
    clients = [
        _draw_client(np.random.default_rng(seq), shared, samples_per_client, noise_scale, label_rule)
        for seq in client_seqs
    ]
    xs, ys, weights, means, thresholds = zip(*clients, strict=True)
    truth = _truth(shared, weights, means, thresholds)
    truth |= {"p": float(p), "alpha": float(alpha), "noise_scale": float(noise_scale)}
    truth |= {"label_rule": label_rule, "activation": "relu"}
    return np.stack(xs).astype(np.float32), np.stack(ys), truth


class _Shared(NamedTuple):
    """The draws every client shares (shapes give d1, d2 and m2).

    Attributes:
      a: [m] output weights.
      w_sp: [m2, d1] shared units' weights on the personalized covariates.
      w_ss: [m2, d2] shared units' weights on the shared covariates.
      sigma: [d1, d1] covariance of the personalized covariates (AR(1), 0.5).
      chol: its Cholesky factor ([0, 0] when d1 = 0).
    """

    a: np.ndarray
    w_sp: np.ndarray
    w_ss: np.ndarray
    sigma: np.ndarray
    chol: np.ndarray


def _draw_shared(rng: np.random.Generator, m: int, m2: int, d1: int, d2: int) -> _Shared:
    """Draws a, then the shared units' weights (the shared stream's order)."""
    a = rng.standard_normal(m)
    w_sp = rng.uniform(-0.1, 0.1, size=(m2, d1))
    w_ss = rng.uniform(-1.0, 1.0, size=(m2, d2))
    sigma = ar1_covariance(d1)
    chol = np.linalg.cholesky(sigma) if d1 else np.zeros((0, 0))
    return _Shared(a, w_sp, w_ss, sigma, chol)


def _draw_client(rng: np.random.Generator, shared: _Shared, n: int, noise_scale: float, label_rule: str):
    """One client's mu_c, personalized units and n samples, from its own stream.

    Returns:
      (x [n, d], y [n] int32, w [m, d] hidden weights, mu [d1], the label cut).
    """
    (m2, d1), d2 = shared.w_sp.shape, shared.w_ss.shape[1]
    m1 = len(shared.a) - m2
    mu = rng.standard_normal(d1)
    w_pp = mu + rng.standard_normal((m1, d1))
    w_ps = rng.uniform(-0.1, 0.1, size=(m1, d2))
    w = np.block([[w_pp, w_ps], [shared.w_sp, shared.w_ss]])  # [m, d]
    x_p = mu + rng.standard_normal((n, d1)) @ shared.chol.T
    x_s = rng.standard_normal((n, d2))
    x = np.concatenate([x_p, x_s], axis=1)  # [n, d]
    y_star = np.maximum(x @ w.T, 0.0) @ shared.a + noise_scale * (rng.standard_normal(n))
    cut = 0.0 if label_rule == "paper" else float(np.median(y_star))
    return x, (y_star > cut).astype(np.int32), w, mu, cut


def _truth(shared: _Shared, weights, means, thresholds) -> dict[str, Any]:
    """The truth dict's arrays and sizes (see simulate_fedfac), from the draws."""
    (m2, d1), d2 = shared.w_sp.shape, shared.w_ss.shape[1]
    m1 = len(shared.a) - m2
    client_means = np.stack(means).reshape(len(means), d1)
    return {
        "hidden_weights": np.stack(weights).astype(np.float32),
        "output_weights": shared.a.astype(np.float32),
        "shared_unit_mask": np.arange(m1 + m2) >= m1,
        "shared_covariate_mask": np.arange(d1 + d2) >= d1,
        "client_means": client_means.astype(np.float32),
        "covariate_means": np.concatenate([client_means, np.zeros((len(means), d2))], 1).astype(np.float32),
        "personalized_covariance": shared.sigma.astype(np.float32),
        "thresholds": np.asarray(thresholds, np.float32),
        "d1": d1,
        "d2": d2,
        "m1": m1,
        "m2": m2,
    }


def _check_args(num_clients, samples_per_client, d, m, p, alpha, noise_scale, label_rule):
    for name, value in (
        ("num_clients", num_clients),
        ("samples_per_client", samples_per_client),
        ("d", d),
        ("m", m),
    ):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    for name, value in (("p", p), ("alpha", alpha)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}.")
    if noise_scale < 0:
        raise ValueError(f"noise_scale must be >= 0, got {noise_scale!r}.")
    if label_rule not in LABEL_RULES:
        raise ValueError(f"label_rule must be one of {LABEL_RULES}, got {label_rule!r}.")
