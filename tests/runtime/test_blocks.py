"""Blocks of rounds (`pfljax.runtime.blocks`): skipped rounds, evaluation where it falls,
divergence kept at the last good round, per replica."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.runtime.blocks import all_finite, keep_where, make_block


def toy_round(state, data, key):
    """x <- x * data (per replica when x has an axis); train_loss = the new x summed."""
    x = state["x"] * data
    return {"x": x, "round": state["round"] + 1}, {"train_loss": x.sum(-1)}


def toy_evaluate(state, data, key, r):
    return {"loss": state["x"] + r, "accuracy": state["x"], "count": jnp.ones(state["x"].shape, jnp.int32)}


def run(x, factor, schedule, length=4, finite=all_finite):
    block = jax.jit(make_block(toy_round, toy_evaluate, finite, length))
    x = jnp.asarray(x, jnp.float32)
    state = {"x": x, "round": jnp.zeros(x.shape[:-1], jnp.int32)}  # a round per replica
    return block(
        state, jnp.float32(factor), jax.random.key(0), jax.random.key(1), jnp.array(schedule, jnp.int32)
    )


def test_rounds_run_and_evaluate_where_scheduled():
    state, out = run([1.0, 2.0], 2.0, [3, 6, 2, 5])  # rounds 4, 5, 6 of a 4-step block
    np.testing.assert_allclose(state["x"], [8.0, 16.0])
    assert int(state["round"]) == 3
    assert out.ran.tolist() == [True, True, True, False]
    assert out.evaluated.tolist() == [True, True, True, False]  # 4 % 2 == 0, 5 == last, 6 % 2 == 0
    np.testing.assert_allclose(out.evaluation["loss"][1], [4.0 + 5, 8.0 + 5])
    np.testing.assert_allclose(out.metrics["train_loss"][:3], [6.0, 12.0, 24.0])
    chex.assert_trees_all_equal(out.metrics["train_loss"][3], jnp.float32(0))  # skipped round: zeros
    assert out.ok[:3].all()


def test_a_non_finite_round_keeps_the_last_good_state():
    state, out = run([1.0, 1e34], 1e5, [0, 4, 100, 4])  # x overflows in round 1 (1e39 -> inf)
    assert out.ok.tolist() == [False, False, False, False]
    assert not out.state_finite[0]
    np.testing.assert_allclose(state["x"], [1.0, 1e34])  # the state before round 1
    state, out = run([1.0, 1e30], 1e5, [0, 4, 100, 4])  # round 2 overflows (1e40)
    assert out.ok.tolist() == [True, False, False, False]
    np.testing.assert_allclose(state["x"], [1e5, 1e35], rtol=1e-6)


def test_a_non_finite_test_loss_stops_the_run_at_its_evaluation():
    def nan_eval(state, data, key, r):
        out = toy_evaluate(state, data, key, r)
        return {**out, "loss": jnp.where(r == 2, jnp.nan, out["loss"])}

    block = jax.jit(make_block(toy_round, nan_eval, all_finite, 3))
    state = {"x": jnp.ones(2), "round": jnp.int32(0)}
    state, out = block(state, 2.0, jax.random.key(0), jax.random.key(1), jnp.array([0, 3, 1, 3], jnp.int32))
    assert out.ok.tolist() == [True, False, False] and out.state_finite.tolist() == [True, True, True]
    assert out.eval_finite.tolist() == [True, False, True]
    np.testing.assert_allclose(state["x"], [2.0, 2.0])


def test_replicas_diverge_alone():
    finite = jax.vmap(all_finite)
    x = [[1.0, 1.0], [1.0, 1e34]]  # replica 1 overflows in round 2 (1e40)
    state, out = run(x, 1e3, [0, 3, 1, 3], length=3, finite=finite)
    assert out.ok.tolist() == [[True, True], [True, False], [True, False]]
    np.testing.assert_allclose(state["x"][0], [1e9, 1e9], rtol=1e-6)
    np.testing.assert_allclose(state["x"][1], [1e3, 1e37], rtol=1e-6)


def test_keep_where_broadcasts_over_the_replica_axis():
    new, old = {"a": jnp.ones((2, 3))}, {"a": jnp.zeros((2, 3))}
    kept = keep_where(jnp.array([True, False]), new, old)
    np.testing.assert_array_equal(kept["a"], [[1, 1, 1], [0, 0, 0]])


def test_block_length_must_be_positive():
    with pytest.raises(ValueError, match="block length must be >= 1"):
        make_block(toy_round, toy_evaluate, all_finite, 0)
