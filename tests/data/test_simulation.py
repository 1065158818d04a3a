"""Tests for the FedFac simulation (model (8) of arXiv 2312.04281)."""

import numpy as np
import pytest

from pfljax.data.simulation import simulate_fedfac

C, N, D, M = 8, 300, 100, 200


@pytest.fixture(scope="module")
def sim():
    return simulate_fedfac(C, N, d=D, m=M, p=0.5, alpha=0.4, seed=0)


def test_shapes_and_dtypes(sim):
    x, y, truth = sim
    assert x.shape == (C, N, D) and x.dtype == np.float32
    assert y.shape == (C, N) and y.dtype == np.int32
    assert set(np.unique(y)) == {0, 1}
    assert truth["hidden_weights"].shape == (C, M, D)
    assert truth["output_weights"].shape == (M,)
    assert truth["shared_unit_mask"].shape == (M,)
    assert truth["shared_unit_mask"].dtype == bool
    assert truth["shared_covariate_mask"].shape == (D,)
    assert truth["client_means"].shape == (C, truth["d1"])
    assert truth["covariate_means"].shape == (C, D)
    assert truth["personalized_covariance"].shape == (truth["d1"],) * 2
    assert truth["thresholds"].shape == (C,)


@pytest.mark.parametrize("p,alpha", [(0.5, 0.4), (0.2, 0.4), (0.5, 0.8)])
def test_p_and_alpha_set_the_shared_counts(p, alpha):
    _, _, truth = simulate_fedfac(2, 10, d=D, m=M, p=p, alpha=alpha, seed=1)
    assert truth["shared_unit_mask"].sum() == round(p * M) == truth["m2"]
    assert truth["shared_covariate_mask"].sum() == round(alpha * D)
    assert truth["d1"] + truth["d2"] == D and truth["m1"] + truth["m2"] == M


def test_shared_units_identical_and_personalized_units_differ(sim):
    _, _, truth = sim
    w, shared = truth["hidden_weights"], truth["shared_unit_mask"]
    np.testing.assert_array_equal(w[:, shared], np.broadcast_to(w[:1, shared], w[:, shared].shape))
    pers = w[:, ~shared]
    for c in range(1, C):
        assert np.abs(pers[c] - pers[0]).mean() > 0.5


def test_covariate_means_follow_the_model(sim):
    x, _, truth = sim
    d1 = truth["d1"]
    mu = truth["client_means"]
    # Personalized covariates ~ N(mu_c, Sigma) (unit variances): sample means
    # within 0.3 of mu_c (standard error ~ 0.06 for n = 300).
    assert np.abs(x[:, :, :d1].mean(1) - mu).max() < 0.3
    assert np.abs(x[:, :, d1:].mean(1)).max() < 0.3  # shared: N(0, I)
    assert np.abs(x[:, :, d1:].std(1) - 1).max() < 0.2
    # Clients' means really differ (mu_c ~ N(0, I)).
    assert np.abs(mu[0] - mu[1]).mean() > 0.5
    # Personalized units' weights are drawn around the same mu_c.
    w_pp = truth["hidden_weights"][:, ~truth["shared_unit_mask"], :d1]
    assert np.abs(w_pp.mean(1) - mu).max() < 0.5


def test_truth_explains_the_labels(sim):
    x, y, truth = sim
    h = np.einsum(
        "cnm,m->cn",
        np.maximum(np.einsum("cnd,cmd->cnm", x, truth["hidden_weights"]), 0),
        truth["output_weights"],
    )
    # noise_scale=1 is tiny against h (spread in the hundreds): recomputed
    # labels agree with the drawn ones almost everywhere.
    agree = (h > truth["thresholds"][:, None]) == (y == 1)
    assert agree.mean() > 0.97


def test_median_rule_balances_every_client(sim):
    _, y, truth = sim
    frac = y.mean(1)
    assert np.all((frac >= 0.4) & (frac <= 0.6))
    assert truth["label_rule"] == "median"


def test_paper_rule_is_heavily_imbalanced():
    _, y, truth = simulate_fedfac(20, 200, label_rule="paper", seed=0)
    np.testing.assert_array_equal(truth["thresholds"], 0)
    majority = np.maximum(y.mean(1), 1 - y.mean(1))
    # As documented: nearly constant labels, and the same class everywhere
    # (seed 0: every label is 1).
    assert majority.min() >= 0.99
    assert y.mean() > 0.99
    means = []
    for seed in range(1, 5):
        _, y, _ = simulate_fedfac(10, 100, label_rule="paper", seed=seed)
        means.append(np.maximum(y.mean(), 1 - y.mean()))
    assert np.mean(means) > 0.95


def test_seeded_and_client_data_independent_of_num_clients():
    x1, y1, t1 = simulate_fedfac(3, 50, seed=5)
    x2, y2, t2 = simulate_fedfac(5, 50, seed=5)
    np.testing.assert_array_equal(x1, x2[:3])
    np.testing.assert_array_equal(y1, y2[:3])
    np.testing.assert_array_equal(t1["hidden_weights"], t2["hidden_weights"][:3])
    x3, _, _ = simulate_fedfac(3, 50, seed=6)
    assert not np.allclose(x1, x3)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(num_clients=0), "num_clients"),
        (dict(samples_per_client=0), "samples_per_client"),
        (dict(p=1.5), "p"),
        (dict(alpha=-0.1), "alpha"),
        (dict(noise_scale=-1.0), "noise_scale"),
        (dict(label_rule="sigmoid"), "label_rule"),
    ],
)
def test_bad_arguments_raise(kwargs, name):
    args = dict(num_clients=2, samples_per_client=10) | kwargs
    with pytest.raises(ValueError, match=name):
        simulate_fedfac(**args)
