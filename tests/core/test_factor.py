"""Factor analysis of units: known splits, an independent numpy PAF, NaN-free edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.core import factor

# One compiled program per (shape, options), shared by the tests below.
SPLIT = jax.jit(factor.factor_split, static_argnames=("kappa", "tau_quantile", "method", "max_iter", "tol"))


def two_factor_data(n=2000, units=40, seed=0):
    """Half the units load on 2 common factors (plus noise), half are pure noise; shuffled."""
    rng = np.random.default_rng(seed)
    f = rng.normal(size=(n, 2))
    load = rng.uniform(0.5, 0.9, size=(units // 2, 2)) * rng.choice([-1.0, 1.0], size=(units // 2, 2))
    common = f @ load.T + 0.5 * rng.normal(size=(n, units // 2))
    x = np.concatenate([common, rng.normal(size=(n, units // 2))], axis=1)
    perm = rng.permutation(units)
    return x[:, perm].astype(np.float32), perm < units // 2


def numpy_paf(z, kappa, max_iter=50, tol=1e-3):
    """Iterated principal-axis factoring, written from the textbook recipe in float64."""
    r = np.corrcoef(z.T)
    g, u = np.linalg.eigh(r)
    g = np.clip(g[::-1], 0, None)
    share = np.cumsum(g) / g.sum()
    k = int(np.argmax(share >= kappa)) + 1
    h = np.sum((u[:, ::-1][:, :k] * np.sqrt(g[:k])) ** 2, axis=1)
    for _ in range(max_iter):
        rh = r.copy()
        np.fill_diagonal(rh, np.clip(h, 0, 1))
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
    z, _ = two_factor_data(seed=3)
    res = SPLIT(jnp.asarray(z), kappa=0.85, tau_quantile=50.0, method="ipf")
    k, _, h = numpy_paf(z.astype(np.float64), 0.85)
    assert int(res.num_factors) == k > 2
    np.testing.assert_allclose(res.communality, h, atol=5e-3)


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
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        factor.factor_split(jnp.ones((4, 3)), **kwargs)
