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
   - "ipf": iterated principal-axis factoring (the paper): put communalities h
     on R's diagonal, take its G leading eigenpairs A = u_m sqrt(g_m), set h to
     rowsum(A^2), repeat until one more such step would change no h_j by `tol`
     (at most `max_iter` principal-axis solves). Its fixed points are the
     stationary points of the least-squares (ULS / minres) fit
     ||R_h - A A^T||_F^2, whose gradient in h is 2 (h - rowsum(A^2)): the
     textbook step is a gradient step of size 1/2. Heywood cases are handled as
     factor_analyzer and psych do: h is held in [0, 0.995] (uniquenesses
     >= 0.005), and the reported communality is rowsum(A^2). Options:
     `start` "smc" (default: squared multiple correlations, as factor_analyzer,
     psych and SPSS start) or "pca" (the paper's start, sqrt(g_m) u_m);
     `solver` "lbfgs" (default: limited-memory quasi-Newton steps on the same
     objective, with bounds) or "plain" (the textbook steps). With the defaults
     the result is the minres solution that `factor_analyzer.FactorAnalyzer(
     method="minres", rotation=None)` (the authors' code's call) computes: on
     planted and trained-network cases with up to 200 units and 135 factors,
     communalities within 3e-3 of a float64 L-BFGS-B fit of factor_analyzer's
     objective and bounds (factor_analyzer itself agrees with that fit to 1e-4,
     4e-3 on a Heywood unit: its gradient is by finite differences) and the
     same split, in 20-150 solves.
     Why the former iteration (paper's start, clip at 1, plain steps, at most 50
     of them, tol 1e-3) drifted from that solution: (a) the plain steps converge
     linearly and, with many factors, slowly: thousands of steps to within 1e-3
     (50 steps left it 0.3-0.7 away); (b) the paper's start can lead to another
     stationary point (a Heywood solution with a larger residual): on 4 of 8
     over-factored cases, communalities up to 0.88 away, splits agreeing on
     78-96% of units, whatever the solver; (c) the bound 1 instead of 0.995
     moves Heywood units by ~5e-3; float32 eigh is not a cause (float32 and
     float64 plain steps agree to < 1e-4 after 300 steps).
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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core.domains import Domain, check

METHODS = ("ipf", "pca", "eig")
STARTS = ("smc", "pca")  # "ipf" starting communalities
SOLVERS = ("lbfgs", "plain")  # "ipf" steps
# Heywood cases: communalities are held <= 0.995 (uniquenesses >= 0.005), the bound
# factor_analyzer (bounds=(0.005, 1)) and psych::fa (minres, lower = .005) put on the uniquenesses.
HEYWOOD_BOUND = 0.995
HISTORY = 10  # L-BFGS pairs
# The numeric arguments of `factor_split` (and FedFac's options of the same names).
DOMAINS = {
    "kappa": Domain(0, 1, low_open=True),
    "tau_quantile": Domain(0, 100),
    "max_iter": Domain(1, integer=True),
    "tol": Domain(0, low_open=True),
}


class FactorSplit(NamedTuple):
    """Result of `factor_split` for one layer.

    Attributes:
      shared: [units] bool, True for a shared unit.
      communality: [units] float32, nu_j.
      num_factors: [] int32, G (the number of factors kappa asks for; "eig"
        uses G - 1 of them).
      loadings: [units, units] float32, columns >= the factors used are zero.
      iterations: [] int32, principal-axis solves ("ipf"; 0 otherwise).
      change: [] float32, the last max |clip(rowsum(A^2)) - h| ("ipf"; 0 otherwise).
      converged: [] bool, change < tol ("ipf"; True otherwise).
    """

    shared: jax.Array
    communality: jax.Array
    num_factors: jax.Array
    loadings: jax.Array
    iterations: jax.Array
    change: jax.Array
    converged: jax.Array


def check_split_args(
    kappa: float,
    tau_quantile: float,
    method: str,
    *,
    start: str = "smc",
    solver: str = "lbfgs",
    max_iter: int = 500,
    tol: float = 1e-6,
) -> None:
    """ValueError naming the argument for values out of range (`DOMAINS`, choices)."""
    check(DOMAINS, {"kappa": kappa, "tau_quantile": tau_quantile, "max_iter": max_iter, "tol": tol})
    for name, value, allowed in (
        ("method", method, METHODS),
        ("start", start, STARTS),
        ("solver", solver, SOLVERS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


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


def _principal_axes(r: jax.Array, h: jax.Array, keep: jax.Array):
    """One principal-axis solve: R with diagonal h, its leading (masked) eigenpairs.

    Returns:
      (loadings [units, units], objective [], half gradient [units]): loadings
      u_m sqrt(max(g_m, 0)) for the kept m; objective ||R_h - A A^T||_F^2 (the ULS /
      minres criterion as factor_analyzer writes it, diagonal included) = sum of
      the dropped eigenvalues squared plus the kept negative ones squared; its
      gradient in h is 2 (h - rowsum(A^2)), so h - rowsum(A^2) is half of it and
      the textbook update h <- rowsum(A^2) is a gradient step of size 1/2.
    """
    eye = jnp.eye(r.shape[0], dtype=bool)
    g, u = jnp.linalg.eigh(jnp.where(eye, h[None, :], r))
    g, u = g[::-1], u[:, ::-1]
    a = u * jnp.where(keep, jnp.sqrt(jnp.maximum(g, 0.0)), 0.0)[None, :]
    objective = jnp.sum(jnp.where(keep, jnp.minimum(g, 0.0), g) ** 2)
    return a, objective, h - jnp.sum(a**2, axis=1)


def starting_communalities(eigenvalues: jax.Array, eigenvectors: jax.Array, factors: jax.Array, start: str):
    """h0 [units] in [0, HEYWOOD_BOUND] from R's eigenpairs (descending).

    "smc": squared multiple correlations 1 - 1 / diag(R^-1) (R^-1 from the
    eigenpairs, eigenvalues floored at 1e-6 so a singular R gives SMC ~ 1 for the
    units the others determine); "pca": the communalities of the first `factors`
    principal components, sum_m g_m u_jm^2 (the paper's start, sqrt(g_m) u_m).
    """
    g, u = eigenvalues, eigenvectors
    if start == "smc":
        h0 = 1.0 - 1.0 / jnp.sum(u**2 / jnp.maximum(g, 1e-6)[None, :], axis=1)
    else:
        h0 = jnp.sum(u**2 * jnp.where(jnp.arange(g.shape[0]) < factors, g, 0.0)[None, :], axis=1)
    return jnp.clip(h0, 0.0, HEYWOOD_BOUND)


def _two_loop(grad, s_hist, y_hist, valid):
    """L-BFGS inverse-Hessian product H grad from the pairs (oldest first, `valid` masked)."""
    sy = jnp.sum(s_hist * y_hist, axis=1)
    rho = jnp.where(valid, 1.0 / jnp.where(valid, sy, 1.0), 0.0)
    q, alphas = grad, []
    for i in reversed(range(s_hist.shape[0])):
        a_i = rho[i] * jnp.dot(s_hist[i], q)
        q = q - a_i * y_hist[i]
        alphas.append(a_i)
    yy = jnp.dot(y_hist[-1], y_hist[-1])
    gamma = jnp.where(valid[-1], sy[-1] / jnp.where(valid[-1], yy, 1.0), 1.0)
    out = gamma * q
    for i, a_i in zip(range(s_hist.shape[0]), reversed(alphas)):
        out = out + s_hist[i] * (a_i - rho[i] * jnp.dot(y_hist[i], out))
    return out


def principal_axis_loadings(
    r: jax.Array,
    factors: jax.Array,
    h0: jax.Array,
    *,
    solver: str = "lbfgs",
    max_iter: int = 500,
    tol: float = 1e-6,
):
    """Iterated principal-axis factoring of r [units, units] with `factors` (masked) factors.

    The communalities h (R's diagonal) are kept in [0, HEYWOOD_BOUND] and moved
    until one more textbook step, h <- clip(rowsum(A(h)^2)), would change none of
    them by `tol` or more; A(h) are the leading eigenpairs of R with diagonal h.
    The fixed points are the stationary points of the bounded ULS / minres
    problem (see `_principal_axes`), the solution factor_analyzer and psych reach
    by L-BFGS-B over the uniquenesses in [0.005, 1].

    solver="plain" takes exactly the textbook steps (projected gradient descent
    with step 1/2: linear and, with many factors, slow: thousands of steps);
    "lbfgs" steps along a limited-memory quasi-Newton direction of the same
    objective (HISTORY pairs; coordinates at a bound whose gradient points out
    are held; projected backtracking line search: Armijo, or its approximate
    form from the slopes, which float32 can resolve near the solution),
    starting with the textbook step. Every principal-axis solve (eigh) counts
    as an iteration, the one at the start included.

    Returns:
      (loadings [units, units], iterations [] int32, change [] float32: the last
      max |clip(rowsum(A^2)) - h|, converged [] bool: change < tol).
    """
    keep = jnp.arange(r.shape[0]) < factors
    x0 = _project(h0.astype(r.dtype))
    a0, f0, g0 = _principal_axes(r, x0, keep)
    zeros = jnp.zeros((HISTORY, r.shape[0]), r.dtype)
    init = dict(_ipf_point(x0, a0, f0, g0, zeros, zeros, jnp.int32(0), solver), it=jnp.int32(1))
    cond = lambda c: (c["change"] >= tol) & (c["it"] < max_iter)
    step = functools.partial(_ipf_step, r=r, keep=keep, solver=solver)
    out = jax.lax.while_loop(cond, step, init)
    return out["a"], out["it"], out["change"], out["change"] < tol


def _project(x: jax.Array) -> jax.Array:
    """Communalities held in [0, HEYWOOD_BOUND]."""
    return jnp.clip(x, 0.0, HEYWOOD_BOUND)


def _direction(x, grad, s_hist, y_hist, count, solver: str) -> jax.Array:
    """Search direction at x: -grad ("plain"); for "lbfgs" the L-BFGS direction of the
    `count` newest pairs, with the coordinates at a bound whose gradient points out held
    (steepest descent on the free ones where that is no descent direction)."""
    if solver == "plain":
        return -grad
    held = ((x <= 0.0) & (grad > 0.0)) | ((x >= HEYWOOD_BOUND) & (grad < 0.0))
    free_grad = jnp.where(held, 0.0, grad)
    valid = jnp.arange(HISTORY) >= HISTORY - count
    d = -jnp.where(held, 0.0, _two_loop(free_grad, s_hist, y_hist, valid))
    return jnp.where(jnp.dot(grad, d) < 0.0, d, -free_grad)


def _ipf_point(x, a, f, grad, s_hist, y_hist, count, solver: str) -> dict:
    """The iteration's state at an accepted point x (its solve: loadings a, objective f,
    half gradient grad; the L-BFGS pairs): a full step (t = 1) along the new direction
    next, and `change`, the largest move one textbook step would make."""
    return dict(
        x=x, a=a, f=f, grad=grad, S=s_hist, Y=y_hist, count=count,
        d=_direction(x, grad, s_hist, y_hist, count, solver), t=jnp.ones([], x.dtype),
        fails=jnp.int32(0), change=jnp.max(jnp.abs(_project(x - grad) - x)),
    )  # fmt: skip


def _push(hist: jax.Array, v: jax.Array, store: jax.Array) -> jax.Array:
    """hist [HISTORY, n] with v appended (the oldest row dropped) where `store`."""
    return jnp.where(store, jnp.concatenate([hist[1:], v[None]]), hist)


def _ipf_step(c: dict, *, r, keep, solver: str) -> dict:
    """One principal-axis solve at the projected trial point x + t d. Accepted ("plain":
    always), it is the new point and its (s, y) pair is stored where the curvature is
    positive; rejected, t is halved."""
    xn = _project(c["x"] + c["t"] * c["d"])
    an, fn, gn = _principal_axes(r, xn, keep)
    s, y = xn - c["x"], gn - c["grad"]
    gs, sy, ss, yy = jnp.dot(c["grad"], s), jnp.dot(s, y), jnp.dot(s, s), jnp.dot(y, y)
    # Sufficient decrease (Armijo); near the solution float32 objectives cannot resolve
    # it, so also Hager & Zhang's approximate form from the slopes (the trapezoid rule).
    armijo = fn <= c["f"] + 1e-4 * gs
    slopes = (gs + sy <= (2e-4 - 1.0) * gs) & (fn <= c["f"] + 1e-3 * jnp.abs(c["f"]))
    accept = True if solver == "plain" else armijo | slopes | (c["fails"] >= 20)
    store = accept & (sy > 1e-8 * jnp.sqrt(ss * yy)) & (ss > 0.0)
    count = jnp.where(store, jnp.minimum(c["count"] + 1, HISTORY), c["count"])
    new = _ipf_point(xn, an, fn, gn, _push(c["S"], s, store), _push(c["Y"], y, store), count, solver)
    old = dict(c, t=c["t"] * 0.5, fails=c["fails"] + 1)
    del old["it"]
    out = jax.tree.map(lambda a, b: jnp.where(accept, a, b), new, old)
    return dict(out, it=c["it"] + 1)


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
    max_iter: int = 500,
    tol: float = 1e-6,
    start: str = "smc",
    solver: str = "lbfgs",
) -> FactorSplit:
    """Shared / personalized split of the units (columns) of z by factor analysis.

    Args:
      z: [n, units] observations (e.g. `unit_observations(kernels)`).
      kappa: cumulative eigenvalue share that fixes the number of factors G.
      tau_quantile: percent of units personalized (lowest communalities).
      method: "ipf" (paper), "pca" or "eig" (authors' released code).
      max_iter, tol: bounds of the "ipf" iteration: at most max_iter
        principal-axis solves; converged when one more textbook step would
        change no communality by tol or more.
      start: "ipf" starting communalities, "smc" (standard) or "pca" (paper).
      solver: "ipf" steps, "lbfgs" (quasi-Newton) or "plain" (textbook).

    Returns:
      FactorSplit(shared, communality, num_factors, loadings, iterations, change, converged).
    """
    check_split_args(kappa, tau_quantile, method, start=start, solver=solver, max_iter=max_iter, tol=tol)
    r = correlation(z)
    g, u = sorted_eigh(r)
    factors = num_factors(g, kappa)
    idx = jnp.arange(r.shape[0])
    iterations, change, converged = jnp.int32(0), jnp.float32(0.0), jnp.bool_(True)
    if method == "ipf":
        h0 = starting_communalities(g, u, factors, start)
        loadings, iterations, change, converged = principal_axis_loadings(
            r, factors, h0, solver=solver, max_iter=max_iter, tol=tol
        )
    elif method == "pca":
        loadings = u * jnp.where(idx < factors, jnp.sqrt(g), 0.0)[None, :]
    else:
        loadings = u * (idx < factors - 1).astype(u.dtype)[None, :]
    nu = jnp.sum(loadings**2, axis=1)
    return FactorSplit(split_by_rank(nu, tau_quantile), nu, factors, loadings, iterations, change, converged)
