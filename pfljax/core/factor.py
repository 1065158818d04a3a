"""Factor analysis of hidden units, and the shared / personalized split it gives.

FedSplit / FedFac (Wang, Tang & Li, "Factor-Assisted Federated Learning for
Personalized Optimization with Heterogeneous Data", arXiv 2312.04281) treats
every hidden unit of a layer as a variable whose observations are its incoming
weights on every sampled client: Z [fan_in * K, units]. Units with a high
communality (variance explained by the common factors) are shared, the others
personalized.

Steps (all jittable, fixed shapes: factors are masked, never sliced):
1. Standardize Z's columns; R = correlation matrix [units, units] (a constant
   column is uncorrelated with the rest, its diagonal stays 1).
2. Eigenvalues g_1 >= g_2 >= ... of R; G = min{m : (g_1 + ... + g_m) / sum g
   >= kappa}.
3. Loadings A [units, units] (columns >= G zero), by `method`:
   - "ipf": iterated principal-axis factoring (the paper): start from
     sqrt(g_m) u_m, put the communalities on R's diagonal, re-solve, repeat
     until the uniquenesses 1 - h change by less than `tol` (at most
     `max_iter` times). Communalities are clipped to [0, 1] on the diagonal
     (a Heywood-case guard). At convergence this is the ULS / minres solution
     that the authors' code gets from `factor_analyzer.FactorAnalyzer`.
   - "pca": sqrt(g_m) u_m, no iteration (principal-component loadings).
   - "eig": the raw unit eigenvectors u_m, as the authors' released code does
     with `--direct_eigDecom`; like that code it keeps G - 1 of them (its loop
     counts the eigenvalues before the one that reaches kappa). "ipf" and "pca"
     keep G factors, as the paper defines G; the released code appears to pass
     the same G - 1 to its FactorAnalyzer call too (read, not run here).
4. Communality nu_j = sum_m a_jm^2. The split is by rank: the
   round(tau_quantile / 100 * units) units with the smallest nu are
   personalized (ties by unit index), the rest shared. This is the paper's
   "tau = the tau_quantile-th quantile of nu" made exact: 0 shares every unit
   (FedAvg), 100 personalizes every unit. (The released code's
   `nu < np.percentile(nu, q)` keeps the largest unit shared even at q = 100.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

METHODS = ("ipf", "pca", "eig")


class FactorSplit(NamedTuple):
    """Result of `factor_split` for one layer.

    Attributes:
      shared: [units] bool, True for a shared unit.
      communality: [units] float32, nu_j.
      num_factors: [] int32, G (the number of factors kappa asks for; "eig"
        uses G - 1 of them).
      loadings: [units, units] float32, columns >= the factors used are zero.
      iterations: [] int32, principal-axis iterations run ("ipf"; 0 otherwise).
    """

    shared: jax.Array
    communality: jax.Array
    num_factors: jax.Array
    loadings: jax.Array
    iterations: jax.Array


def check_split_args(kappa: float, tau_quantile: float, method: str) -> None:
    """ValueError naming the argument for values out of range."""
    if not 0.0 < kappa <= 1.0:
        raise ValueError(f"kappa must be in (0, 1], got {kappa!r}")
    if not 0.0 <= tau_quantile <= 100.0:
        raise ValueError(f"tau_quantile must be in [0, 100], got {tau_quantile!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def unit_observations(kernels: jax.Array) -> jax.Array:
    """Z [K * fan_in, units] from stacked kernels [K, ..., units] (Dense or Conv)."""
    units = kernels.shape[-1]
    return kernels.reshape(-1, units)


def correlation(z: jax.Array) -> jax.Array:
    """Correlation matrix [units, units] of the columns of z [n, units], NaN-free.

    A (numerically) constant column gets correlation 0 with every other column
    and 1 on the diagonal.
    """
    z = z.astype(jnp.float32)
    zc = z - jnp.mean(z, axis=0, keepdims=True)
    std = jnp.sqrt(jnp.mean(zc**2, axis=0, keepdims=True))
    scale = jnp.maximum(jnp.max(jnp.abs(z), axis=0, keepdims=True), 1e-30)
    ok = std > 1e-6 * scale
    zs = jnp.where(ok, zc / jnp.where(ok, std, 1.0), 0.0)
    # Full float32 precision: GPUs default to TF32, which can reorder near-tied communalities.
    r = jnp.matmul(zs.T, zs, precision=jax.lax.Precision.HIGHEST) / z.shape[0]
    r = jnp.clip(0.5 * (r + r.T), -1.0, 1.0)
    eye = jnp.eye(r.shape[0], dtype=bool)
    return jnp.where(eye, 1.0, r)


def sorted_eigh(r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eigenvalues (descending, clipped at 0) and eigenvectors (columns) of symmetric r."""
    g, u = jnp.linalg.eigh(r)
    return jnp.maximum(g[::-1], 0.0), u[:, ::-1]


def num_factors(eigenvalues: jax.Array, kappa: float) -> jax.Array:
    """G = min{m : cumulative share of the first m eigenvalues >= kappa}, in [1, units]."""
    share = jnp.cumsum(eigenvalues) / jnp.maximum(jnp.sum(eigenvalues), 1e-30)
    count = jnp.sum(share < kappa * (1.0 - 1e-6)).astype(jnp.int32) + 1
    return jnp.minimum(count, eigenvalues.shape[0])


def principal_axis_loadings(r: jax.Array, factors: jax.Array, max_iter: int = 50, tol: float = 1e-3):
    """Iterated principal-axis factoring of r [units, units] with `factors` (masked) factors.

    Returns:
      (loadings [units, units], iterations []).
    """
    keep = jnp.arange(r.shape[0]) < factors
    eye = jnp.eye(r.shape[0], dtype=bool)

    def loadings_of(mat):
        g, u = sorted_eigh(mat)
        return u * jnp.where(keep, jnp.sqrt(g), 0.0)[None, :]

    def cond(carry):
        _, _, change, it = carry
        return (change >= tol) & (it < max_iter)

    def body(carry):
        _, h, _, it = carry
        a = loadings_of(jnp.where(eye, jnp.clip(h, 0.0, 1.0), r))
        h_new = jnp.sum(a**2, axis=1)
        return a, h_new, jnp.max(jnp.abs(h_new - h)), it + 1

    a0 = loadings_of(r)
    init = (a0, jnp.sum(a0**2, axis=1), jnp.float32(jnp.inf), jnp.int32(0))
    a, _, _, it = jax.lax.while_loop(cond, body, init)
    return a, it


def split_by_rank(score: jax.Array, tau_quantile: float) -> jax.Array:
    """shared [units] bool: all but the round(q / 100 * units) lowest scores (ties by index)."""
    units = score.shape[0]
    num_personal = int(round(tau_quantile / 100.0 * units))
    order = jnp.argsort(score, stable=True)
    rank = jnp.zeros((units,), jnp.int32).at[order].set(jnp.arange(units, dtype=jnp.int32))
    return rank >= num_personal


def factor_split(
    z: jax.Array,
    *,
    kappa: float = 0.85,
    tau_quantile: float = 50.0,
    method: str = "ipf",
    max_iter: int = 50,
    tol: float = 1e-3,
) -> FactorSplit:
    """Shared / personalized split of the units (columns) of z by factor analysis.

    Args:
      z: [n, units] observations (e.g. `unit_observations(kernels)`).
      kappa: cumulative eigenvalue share that fixes the number of factors G.
      tau_quantile: percent of units personalized (lowest communalities).
      method: "ipf" (paper), "pca" or "eig" (authors' released code).
      max_iter, tol: bounds of the "ipf" iteration (change of uniquenesses).

    Returns:
      FactorSplit(shared, communality, num_factors, loadings, iterations).
    """
    check_split_args(kappa, tau_quantile, method)
    r = correlation(z)
    g, u = sorted_eigh(r)
    factors = num_factors(g, kappa)
    idx = jnp.arange(r.shape[0])
    iterations = jnp.int32(0)
    if method == "ipf":
        loadings, iterations = principal_axis_loadings(r, factors, max_iter, tol)
    elif method == "pca":
        loadings = u * jnp.where(idx < factors, jnp.sqrt(g), 0.0)[None, :]
    else:
        loadings = u * (idx < factors - 1).astype(u.dtype)[None, :]
    nu = jnp.sum(loadings**2, axis=1)
    return FactorSplit(split_by_rank(nu, tau_quantile), nu, factors, loadings, iterations)
