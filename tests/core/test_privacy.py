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
from pfljax.core import privacy
from pfljax.core.local import LocalTraining
from pfljax.core.privacy import (
    ClientDP,
    clip_update,
    epsilon,
    gaussian,
    noise_for_epsilon,
    private_mean_update,
)
from pfljax.models import build_model
from tests.algorithms.fast_compile import EXACT, fast_compile  # noqa: F401  (autouse)
from tests.algorithms.small_options import small_options
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


def plain_private_mean(updates, key, dp):
    """The server's DP mean as a plain formula: each participant's update clipped by
    `clip_update` (rounded to its leaves' dtypes), the clipped updates summed in float32,
    noise jax.random.normal(key_j) * z * clip_norm on leaf j (keys: split(key, leaves)),
    divided by K and cast back."""
    leaves, treedef = jax.tree.flatten(updates)
    k = leaves[0].shape[0]
    clipped, norms = [], []
    for i in range(k):
        c, n = clip_update(jax.tree.unflatten(treedef, [x[i] for x in leaves]), dp.clip_norm)
        clipped.append(jax.tree.leaves(c))
        norms.append(n)
    keys = jax.random.split(key, len(leaves))
    std = dp.noise_multiplier * dp.clip_norm if math.isfinite(dp.clip_norm) else 0.0
    mean = []
    for j, x in enumerate(leaves):
        total = sum(clipped[i][j].astype(jnp.float32) for i in range(k))
        total = total + std * jax.random.normal(keys[j], x.shape[1:], jnp.float32)
        mean.append((total / k).astype(x.dtype))
    norms = jnp.stack(norms)
    metrics = {
        "dp_update_norm": jnp.mean(norms),
        "dp_clipped_fraction": jnp.mean((norms > dp.clip_norm).astype(jnp.float32)),
    }
    return jax.tree.unflatten(treedef, mean), metrics


def mixed_updates(k: int, seed: int) -> dict:
    """[k, ...] updates of mixed shapes and dtypes (117 values a client), client norms spread
    over about 0.5 to 6.5 (the participants in random order)."""
    rng = np.random.default_rng(seed)
    size = rng.permutation(np.geomspace(0.05, 0.6, k))

    def leaf(shape, dtype):
        x = rng.normal(size=(k, *shape)) * size.reshape((k,) + (1,) * len(shape))
        return jnp.asarray(x, dtype)

    return {
        "conv": {"kernel": leaf((3, 3, 2, 4), jnp.float32), "bias": leaf((4,), jnp.float32)},
        "dense": {"kernel": leaf((7, 5), jnp.bfloat16), "bias": leaf((5,), jnp.float16)},
        "scale": leaf((), jnp.float32),
    }


@pytest.mark.parametrize("k", [3, privacy.UNROLLED_PARTICIPANTS + 2])  # per participant; vmap + matmul
@pytest.mark.parametrize("clip", [0.5, 2.0, 4.0, math.inf])
@pytest.mark.parametrize("z", [0.0, 1.3])
def test_private_mean_update_equals_the_plain_formula(k, clip, z):
    updates = mixed_updates(k, seed=k)
    dp = ClientDP(z, clip)
    key = jax.random.key(7)
    got, got_m = jax.jit(lambda u, s: private_mean_update(u, s, dp))(updates, key)
    want, want_m = jax.jit(lambda u, s: plain_private_mean(u, s, dp))(updates, key)
    chex.assert_trees_all_equal_dtypes(got, want)
    chex.assert_trees_all_equal_shapes(got, want)
    for path, g, w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        # float32: float32 rounding of a differently ordered sum; 16-bit leaves: one unit of their last place.
        tol = {"rtol": 1e-5, "atol": 1e-6} if g.dtype == jnp.float32 else {"rtol": 1e-2, "atol": 1e-3}
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), **tol, err_msg=str(path)
        )
    np.testing.assert_allclose(float(got_m["dp_update_norm"]), float(want_m["dp_update_norm"]), rtol=1e-6)
    assert float(got_m["dp_clipped_fraction"]) == float(want_m["dp_clipped_fraction"])
    if clip == 2.0:  # the updates straddle this clip norm: some participants clipped, some not
        assert 0.0 < float(got_m["dp_clipped_fraction"]) < 1.0


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5, 7), (1000, 3)])
def test_gaussian_draws_the_numbers_of_jax_random_normal(shape):
    keys = [
        jax.random.key(0),
        jax.random.fold_in(jax.random.key(5), 3),
        jax.random.split(jax.random.key(9))[1],
    ]
    for key in keys:
        got = jax.jit(lambda s: gaussian(s, shape), compiler_options=EXACT)(key)
        want = jax.jit(lambda s: jax.random.normal(s, shape, jnp.float32), compiler_options=EXACT)(key)
        assert got.dtype == jnp.float32 and got.shape == shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        fast = jax.random.wrap_key_data(jax.random.key_data(key), impl=privacy._THREEFRY_STRAIGHT)
        np.testing.assert_array_equal(
            np.asarray(jax.random.bits(fast, shape, jnp.uint32)),
            np.asarray(jax.random.bits(key, shape, jnp.uint32)),
        )
    batch = jax.random.split(jax.random.key(4), 3)  # under vmap (e.g. seeds run as one program)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(jax.vmap(lambda s: gaussian(s, shape)), compiler_options=EXACT)(batch)),
        np.asarray(jax.jit(jax.vmap(lambda s: jax.random.normal(s, shape)), compiler_options=EXACT)(batch)),
    )
    # Keys of another generator, or threefry's other bit layout: jax.random.normal itself.
    rbg = jax.random.key(1, impl="rbg")
    np.testing.assert_array_equal(np.asarray(gaussian(rbg, shape)), np.asarray(jax.random.normal(rbg, shape)))
    with jax.threefry_partitionable(False):
        key = jax.random.key(2)
        np.testing.assert_array_equal(
            np.asarray(gaussian(key, shape)), np.asarray(jax.random.normal(key, shape))
        )


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
    small = small_options(name)
    plain = build(model, SPEC, clients_per_round=3, client_map="vmap", **uniform, **small)
    noop = build(
        model, SPEC, clients_per_round=3, client_map="vmap", privacy=ClientDP(0.0, math.inf), **small
    )
    noisy = build(model, SPEC, clients_per_round=3, client_map="vmap", privacy=ClientDP(1.0, 0.1), **small)
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
