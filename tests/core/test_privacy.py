"""Client-level DP: clipping, the noise of the aggregate, accounting, and the no-op setting."""

import inspect
import math

import chex
import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.algorithms import fedavg, fedper
from pfljax.core.local import LocalTraining
from pfljax.core.privacy import ClientDP, clip_update, epsilon, noise_for_epsilon, private_mean_update
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import toy_data

MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.1), batch_size=4, steps=3)
COUNTS = (9, 5, 12, 3, 7)


def test_clipping_bounds_every_update_and_keeps_small_ones():
    rng = np.random.default_rng(0)
    updates = {"a": jnp.asarray(rng.normal(size=(6, 4, 3)) * np.arange(1, 7)[:, None, None])}
    clipped, norms = jax.vmap(lambda u: clip_update(u, 2.0))(updates)
    np.testing.assert_allclose(norms, np.linalg.norm(updates["a"].reshape(6, -1), axis=1), rtol=1e-5)
    after = np.linalg.norm(np.asarray(clipped["a"]).reshape(6, -1), axis=1)
    assert np.all(after <= 2.0 + 1e-5)
    small = np.asarray(norms) <= 2.0
    np.testing.assert_allclose(np.asarray(clipped["a"])[small], np.asarray(updates["a"])[small])


def test_noise_of_the_aggregate_has_the_formula_std():
    k, z, clip = 4, 1.3, 0.5
    zeros = {"w": jnp.zeros((k, 200_000)), "b": jnp.zeros((k, 3))}
    mean, metrics = private_mean_update(zeros, jax.random.key(3), ClientDP(z, clip))
    std = float(np.std(np.asarray(mean["w"])))
    assert abs(std - z * clip / k) < 0.01 * z * clip / k, (std, z * clip / k)
    assert abs(float(np.mean(np.asarray(mean["w"])))) < 5 * z * clip / k / math.sqrt(200_000)
    assert float(metrics["dp_clipped_fraction"]) == 0.0
    # Clipped updates enter the sum: identical big updates average to clip-norm length.
    ones = {"w": jnp.ones((k, 100)), "b": jnp.ones((k, 3))}
    mean, metrics = private_mean_update(ones, jax.random.key(0), ClientDP(0.0, clip))
    np.testing.assert_allclose(float(optax.tree.norm(mean)), clip, rtol=1e-5)
    assert float(metrics["dp_clipped_fraction"]) == 1.0


def test_epsilon_equals_dp_accounting_for_fixed_size_sampling():
    want = (
        dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        .compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.SampledWithoutReplacementDpEvent(20, 5, dp_accounting.GaussianDpEvent(1.1)), 8
            )
        )
        .get_epsilon(1e-3)
    )
    assert epsilon(1.1, 20, 5, 8, 1e-3) == pytest.approx(want, rel=1e-9)
    assert epsilon(1.1, 20, 5, 8, 1e-3) == pytest.approx(5.71, abs=0.01)
    assert epsilon(1.1, 20, 5, 16, 1e-3) > epsilon(1.1, 20, 5, 8, 1e-3)
    assert epsilon(0.0, 20, 5, 1, 1e-3) == math.inf and epsilon(1.0, 20, 5, 0, 1e-3) == 0.0


def test_zero_noise_and_no_clipping_reproduce_the_uniform_mean():
    data = toy_data(COUNTS)
    plain = fedavg.build(MODEL, SPEC, clients_per_round=3, weighting="uniform", client_map="vmap")
    noop = fedavg.build(
        MODEL, SPEC, clients_per_round=3, client_map="vmap", privacy=ClientDP(0.0, float("inf"))
    )
    a = b = plain.init(jax.random.key(0), None, len(COUNTS))
    for r in range(3):
        a, _ = jax.jit(plain.round)(a, data, jax.random.key(r))
        b, m = jax.jit(noop.round)(b, data, jax.random.key(r))
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(m["dp_clipped_fraction"]) == 0.0


def test_personal_leaves_get_no_noise_and_shared_ones_do():
    data = toy_data(COUNTS)
    plain = fedper.build(MODEL, SPEC, weighting="uniform", client_map="vmap")
    noisy = fedper.build(MODEL, SPEC, client_map="vmap", privacy=ClientDP(5.0, 1.0))
    s0 = plain.init(jax.random.key(0), None, len(COUNTS))
    a, _ = jax.jit(plain.round)(s0, data, jax.random.key(1))
    b, m = jax.jit(noisy.round)(s0, data, jax.random.key(1))
    chex.assert_trees_all_close(a.client_params, b.client_params, rtol=1e-5, atol=1e-6)  # heads: local
    body = np.asarray(
        a.global_params["params"]["hidden_0"]["kernel"] - b.global_params["params"]["hidden_0"]["kernel"]
    )
    assert np.std(body) > 0.5 * 5.0 * 1.0 / len(COUNTS)  # noise std z * S / K on the body
    assert float(m["dp_update_norm"]) > 0


@pytest.mark.parametrize("name", [n for n in algorithms.available() if algorithms.supports_privacy(n)])
def test_every_private_algorithm_is_exact_without_noise_and_noised_with_it(name):
    model = build_model(algorithms.model_variant(name, "mlp"), (6,), 3, hidden=(8,))
    build = algorithms.get(name).build
    uniform = {"weighting": "uniform"} if "weighting" in inspect.signature(build).parameters else {}
    data = toy_data(COUNTS)
    plain = build(model, SPEC, clients_per_round=3, client_map="vmap", **uniform)
    noop = build(model, SPEC, clients_per_round=3, client_map="vmap", privacy=ClientDP(0.0, float("inf")))
    noisy = build(model, SPEC, clients_per_round=3, client_map="vmap", privacy=ClientDP(1.0, 0.1))
    s0 = plain.init(jax.random.key(0), None, len(COUNTS))
    a, _ = jax.jit(plain.round)(s0, data, jax.random.key(1))
    b, _ = jax.jit(noop.round)(s0, data, jax.random.key(1))
    c, m = jax.jit(noisy.round)(s0, data, jax.random.key(1))
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)
    assert "dp_clipped_fraction" in m and np.isfinite(float(m["dp_update_norm"]))
    assert not all(np.allclose(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)))


def test_noise_for_epsilon_hits_the_target_from_below():
    delta = 1 / 20**1.1
    z = noise_for_epsilon(4.0, 20, 10, 20, delta)
    got = epsilon(z, 20, 10, 20, delta)
    assert got <= 4.0 and got == pytest.approx(4.0, rel=0.01), (z, got)
    # Minimal: 2% less noise spends more than the target.
    assert epsilon(z * 0.98, 20, 10, 20, delta) > 4.0
    assert noise_for_epsilon(math.inf, 20, 5, 20, delta) == 0.0
    with pytest.raises(ValueError, match="target"):
        noise_for_epsilon(0.0, 20, 5, 20, delta)


def test_epsilons_of_every_round_equal_one_accountant_call_per_round():
    from pfljax.core.privacy import epsilon, epsilons  # noqa: PLC0415

    table = epsilons(1.1, 50, 10, 30, 1e-5)
    assert table.shape == (31,) and table[0] == 0
    for r in (1, 2, 17, 30):
        assert table[r] == pytest.approx(epsilon(1.1, 50, 10, r, 1e-5), rel=1e-12)
    assert np.all(np.diff(table) > 0)
    assert np.all(np.isinf(epsilons(0.0, 50, 10, 3, 1e-5)[1:]))
