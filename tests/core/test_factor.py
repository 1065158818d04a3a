"""Factor analysis of units: known splits, an independent numpy PAF, an independent float64
minres fit (scipy L-BFGS-B, and factor_analyzer where installed), NaN-free edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import minimize

from pfljax.core import factor

# One compiled program per (shape, options), shared by the tests below.
SPLIT = jax.jit(
    factor.factor_split,
    static_argnames=("kappa", "tau_quantile", "method", "max_iter", "tol", "start", "solver"),
)


def two_factor_data(n=2000, units=40, seed=0):
    """Half the units load on 2 common factors (plus noise), half are pure noise; shuffled."""
    rng = np.random.default_rng(seed)
    f = rng.normal(size=(n, 2))
    load = rng.uniform(0.5, 0.9, size=(units // 2, 2)) * rng.choice([-1.0, 1.0], size=(units // 2, 2))
    common = f @ load.T + 0.5 * rng.normal(size=(n, units // 2))
    x = np.concatenate([common, rng.normal(size=(n, units // 2))], axis=1)
    perm = rng.permutation(units)
    return x[:, perm].astype(np.float32), perm < units // 2


def planted_data(seed, n=800, units=48, shared=30, k=3, low=0.2, high=0.6, noise=1.0):
    """`shared` units load on k common factors (weakly, plus noise), the rest are pure noise;
    at kappa=0.5 this asks for 13-14 factors: an over-factored analysis."""
    rng = np.random.default_rng(seed)
    f = rng.normal(size=(n, k))
    load = rng.uniform(low, high, size=(shared, k)) * rng.choice([-1.0, 1.0], size=(shared, k))
    common = f @ load.T + noise * rng.normal(size=(n, shared))
    x = np.concatenate([common, rng.normal(size=(n, units - shared))], axis=1)
    perm = rng.permutation(units)
    return x[:, perm], perm < shared


def minres_oracle(z, kappa):
    """ULS / minres in float64, written from factor_analyzer's definition: minimize
    ||R - diag(psi) - A A^T||_F^2 over uniquenesses psi in [0.005, 1] (A: the leading
    eigenpairs of R - diag(psi)) by scipy's L-BFGS-B from 1 - SMC, here with the exact
    gradient -2 diag(R - diag(psi) - A A^T). Returns (G, communalities, objective)."""
    r = np.corrcoef(np.asarray(z, np.float64).T)
    g = np.clip(np.linalg.eigvalsh(r)[::-1], 0, None)
    k = int(np.argmax(np.cumsum(g) / g.sum() >= kappa)) + 1

    def loadings(psi):
        rh = r.copy()
        np.fill_diagonal(rh, 1 - psi)
        gh, uh = np.linalg.eigh(rh)
        return uh[:, ::-1][:, :k] * np.sqrt(np.clip(gh[::-1][:k], 0, None))

    def objective(psi):
        res = r.copy()
        np.fill_diagonal(res, 1 - psi)
        res -= (a := loadings(psi)) @ a.T
        return np.sum(res**2), -2 * np.diag(res)

    start = np.clip(1 / np.diag(np.linalg.inv(r)), 0.005, 1)
    out = minimize(
        objective, start, jac=True, method="L-BFGS-B", bounds=[(0.005, 1)] * len(r),
        options=dict(maxiter=5000, ftol=1e-15, gtol=1e-10),
    )  # fmt: skip
    assert out.success, out.message
    return k, np.sum(loadings(out.x) ** 2, axis=1), out.fun


def uls_objective(z, communality_diag, k):
    """||R_h - A A^T||_F^2 at diagonal h, float64."""
    r = np.corrcoef(np.asarray(z, np.float64).T)
    np.fill_diagonal(r, communality_diag)
    g = np.linalg.eigvalsh(r)[::-1]
    return np.sum(g[k:] ** 2) + np.sum(np.minimum(g[:k], 0) ** 2)


def numpy_paf(z, kappa, max_iter=50, tol=1e-3, bound=factor.HEYWOOD_BOUND):
    """Iterated principal-axis factoring, written from the textbook recipe in float64
    (the paper's start, sqrt(g_m) u_m; communalities held in [0, bound] on the diagonal)."""
    r = np.corrcoef(z.T)
    g, u = np.linalg.eigh(r)
    g = np.clip(g[::-1], 0, None)
    share = np.cumsum(g) / g.sum()
    k = int(np.argmax(share >= kappa)) + 1
    h = np.sum((u[:, ::-1][:, :k] * np.sqrt(g[:k])) ** 2, axis=1)
    for _ in range(max_iter):
        rh = r.copy()
        np.fill_diagonal(rh, np.clip(h, 0, bound))
        gh, uh = np.linalg.eigh(rh)
        a = uh[:, ::-1][:, :k] * np.sqrt(np.clip(gh[::-1][:k], 0, None))
        h_new = np.sum(a**2, axis=1)
        done = np.max(np.abs(h_new - h)) < tol
        h = h_new
        if done:
            break
    return k, a, h


def precision_recall(pred, truth):
    hits = np.sum(pred & truth)
    return hits / max(pred.sum(), 1), hits / truth.sum()


@pytest.mark.parametrize("method", ["ipf", "pca", "eig"])
def test_recovers_units_on_common_factors(method):
    z, truth = two_factor_data()
    res = SPLIT(jnp.asarray(z), kappa=0.3, tau_quantile=50.0, method=method)
    assert int(res.num_factors) == 2
    precision, recall = precision_recall(np.asarray(res.shared), truth)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall)


def test_ipf_loadings_reproduce_correlations_and_match_numpy():
    z, _ = two_factor_data()
    res = SPLIT(jnp.asarray(z), kappa=0.3, tau_quantile=50.0, method="ipf")
    a = np.asarray(res.loadings, np.float64)
    r = np.corrcoef(z.T.astype(np.float64))
    off = ~np.eye(r.shape[0], dtype=bool)
    assert np.max(np.abs((a @ a.T - r)[off])) < 0.08
    k, _, h = numpy_paf(z.astype(np.float64), 0.3)
    assert int(res.num_factors) == k
    np.testing.assert_allclose(res.communality, h, atol=2e-3)
    np.testing.assert_array_equal(res.shared, h >= np.sort(h)[len(h) // 2])


def test_ipf_matches_numpy_with_many_factors():
    """The textbook steps from the paper's start, with the same budget, are the numpy recipe."""
    z, _ = two_factor_data(seed=3)
    res = SPLIT(
        jnp.asarray(z), kappa=0.85, tau_quantile=50.0, method="ipf",
        start="pca", solver="plain", max_iter=50, tol=1e-3,
    )  # fmt: skip
    k, _, h = numpy_paf(z.astype(np.float64), 0.85)
    assert int(res.num_factors) == k > 2
    np.testing.assert_allclose(res.communality, h, atol=5e-3)


@pytest.mark.parametrize("seed", [0, 2])
def test_ipf_default_is_the_minres_solution_when_over_factored(seed):
    """13-14 factors for 3 planted ones; seed 2 has a Heywood unit (at the 0.995 bound)."""
    z, truth = planted_data(seed)
    k, h_oracle, _ = minres_oracle(z, 0.5)
    res = SPLIT(jnp.asarray(z, jnp.float32), kappa=0.5, tau_quantile=100 * 18 / 48)
    assert int(res.num_factors) == k >= 13
    assert bool(res.converged) and float(res.change) < 1e-6 and 1 < int(res.iterations) < 200
    np.testing.assert_allclose(res.communality, h_oracle, atol=1e-3)
    q = 18  # units personalized
    np.testing.assert_array_equal(res.shared, h_oracle >= np.sort(h_oracle)[q])
    assert np.mean(np.asarray(res.shared) == truth) >= 0.9
    if seed == 2:
        assert h_oracle.max() > factor.HEYWOOD_BOUND - 1e-3
        assert float(res.communality.max()) > factor.HEYWOOD_BOUND - 1e-3


def test_ipf_default_is_the_minres_solution_with_the_right_number_of_factors():
    z, truth = planted_data(0, low=0.4, high=0.9, noise=0.6)
    k, h_oracle, _ = minres_oracle(z, 0.5)
    res = SPLIT(jnp.asarray(z, jnp.float32), kappa=0.5, tau_quantile=100 * 18 / 48)
    assert int(res.num_factors) == k == 3 and bool(res.converged)
    np.testing.assert_allclose(res.communality, h_oracle, atol=1e-4)
    np.testing.assert_array_equal(res.shared, truth)


def test_ipf_matches_factor_analyzer():
    """factor_analyzer (what the authors' code calls; a test-only oracle, needs scikit-learn < 1.6)."""
    fa_module = pytest.importorskip("factor_analyzer")
    z, _ = planted_data(1)
    k, _, _ = minres_oracle(z, 0.5)
    fa = fa_module.FactorAnalyzer(n_factors=k, rotation=None, method="minres")
    fa.fit(z)
    res = SPLIT(jnp.asarray(z, jnp.float32), kappa=0.5, tau_quantile=100 * 18 / 48)
    np.testing.assert_allclose(res.communality, fa.get_communalities(), atol=1e-3)


def test_plain_steps_reach_the_same_fixed_point_slowly():
    z, _ = planted_data(1)
    _, h_oracle, _ = minres_oracle(z, 0.5)
    kw = dict(kappa=0.5, tau_quantile=50.0, tol=1e-6)
    fast = SPLIT(jnp.asarray(z, jnp.float32), **kw)
    plain = SPLIT(jnp.asarray(z, jnp.float32), solver="plain", max_iter=5000, **kw)
    assert bool(plain.converged) and int(plain.iterations) > 10 * int(fast.iterations)
    np.testing.assert_allclose(plain.communality, h_oracle, atol=1e-3)
    short = SPLIT(jnp.asarray(z, jnp.float32), solver="plain", max_iter=50, **kw)
    assert not bool(short.converged) and int(short.iterations) == 50 and float(short.change) >= 1e-6
    assert np.max(np.abs(np.asarray(short.communality) - h_oracle)) > 0.03  # the former silent stop


def test_paper_start_ends_at_another_stationary_point():
    """From sqrt(g_m) u_m (the paper) this case converges to a Heywood solution with a larger
    least-squares residual than the minres one that the default start reaches."""
    z, _ = planted_data(0)
    k, h_oracle, f_oracle = minres_oracle(z, 0.5)
    paper = SPLIT(jnp.asarray(z, jnp.float32), kappa=0.5, tau_quantile=50.0, start="pca")
    assert bool(paper.converged)
    h = np.asarray(paper.communality, np.float64)
    assert np.max(np.abs(h - h_oracle)) > 0.5 and h.max() > factor.HEYWOOD_BOUND - 1e-3
    diag = np.clip(h, 0, factor.HEYWOOD_BOUND)  # a fixed point: rowsum(A^2) = h off the bound
    assert uls_objective(z, diag, k) > f_oracle + 1e-4


def test_convergence_is_reported():
    z, _ = two_factor_data()
    one = SPLIT(jnp.asarray(z), kappa=0.3, tau_quantile=50.0, max_iter=1)
    assert int(one.iterations) == 1 and not bool(one.converged) and float(one.change) > 1e-6
    for method in ("pca", "eig"):
        res = SPLIT(jnp.asarray(z), kappa=0.3, tau_quantile=50.0, method=method)
        assert int(res.iterations) == 0 and bool(res.converged) and float(res.change) == 0.0


def test_pca_and_eig_loadings_closed_form():
    z, _ = two_factor_data(seed=1)
    g, u = np.linalg.eigh(np.corrcoef(z.T.astype(np.float64)))
    g, u = g[::-1], u[:, ::-1]
    pca = SPLIT(jnp.asarray(z), kappa=0.3, tau_quantile=50.0, method="pca")
    k = int(pca.num_factors)
    np.testing.assert_allclose(pca.communality, np.sum(u[:, :k] ** 2 * g[:k], axis=1), atol=1e-3)
    eig = SPLIT(jnp.asarray(z), kappa=0.3, tau_quantile=50.0, method="eig")
    np.testing.assert_allclose(eig.communality, np.sum(u[:, : k - 1] ** 2, axis=1), atol=1e-3)
    assert np.count_nonzero(np.abs(np.asarray(eig.loadings)).sum(0) > 0) == k - 1


def test_num_factors_closed_form():
    g = jnp.array([4.0, 3.0, 2.0, 1.0])
    assert int(factor.num_factors(g, 0.7)) == 2  # 0.4, 0.7 -> reaches 0.7 at m = 2
    assert int(factor.num_factors(g, 0.71)) == 3
    assert int(factor.num_factors(g, 1.0)) == 4
    assert int(factor.num_factors(g, 0.1)) == 1


def test_split_by_rank_counts_and_ties():
    score = jnp.array([0.5, 0.1, 0.5, 0.9, 0.1])
    np.testing.assert_array_equal(factor.split_by_rank(score, 0.0), [True] * 5)
    np.testing.assert_array_equal(factor.split_by_rank(score, 100.0), [False] * 5)
    np.testing.assert_array_equal(factor.split_by_rank(score, 40.0), [True, False, True, True, False])
    np.testing.assert_array_equal(factor.split_by_rank(score, 60.0), [False, False, True, True, False])


def test_no_nan_for_constant_duplicated_columns_and_few_observations():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(6, 12)).astype(np.float32)  # fewer observations than units
    z[:, 3] = 2.5  # constant column
    z[:, 7] = z[:, 2]  # duplicated column
    z[:, 8] = 0.0
    every = jax.jit(
        lambda z: [factor.factor_split(z, kappa=0.85, tau_quantile=25.0, method=m) for m in factor.METHODS]
    )
    for res in every(jnp.asarray(z)):
        for leaf in (res.communality, res.loadings):
            assert np.all(np.isfinite(leaf))
        assert int(np.sum(~np.asarray(res.shared))) == 3
    r = factor.correlation(jnp.asarray(z))
    assert np.all(np.isfinite(r)) and r[3, 3] == 1.0 and r[3, 0] == 0.0
    np.testing.assert_allclose(r[2, 7], 1.0, atol=1e-5)


def test_unit_observations_of_conv_kernels():
    k = jnp.arange(2 * 3 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 3, 4, 5)
    z = factor.unit_observations(k)
    assert z.shape == (2 * 36, 5)
    np.testing.assert_array_equal(z[36 + 7], k[1].reshape(36, 5)[7])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kappa=0.0), "kappa"),
        (dict(tau_quantile=101.0), "tau_quantile"),
        (dict(method="minres"), "method"),
        (dict(start="ones"), "start"),
        (dict(solver="newton"), "solver"),
        (dict(max_iter=0), "max_iter"),
        (dict(tol=0.0), "tol"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        factor.factor_split(jnp.ones((4, 3)), **kwargs)
