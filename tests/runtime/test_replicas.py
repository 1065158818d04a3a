"""Replicas: R seeds / grid points in one program equal R separate runs; one trace;
options that cannot be traced are named; memory refused with the estimate."""

import chex
import jax
import numpy as np
import optax
import pytest

from pfljax.algorithms import ditto, fedavg, fedprox, pfedla, scaffold
from pfljax.core.local import LocalTraining
from pfljax.models import build_model
from pfljax.runtime import replicas
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9, 15)
C = len(COUNTS)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=1, steps=None)
ROUNDS = 2
SEEDS = (0, 3, 7)


def seed_keys(seed):
    return jax.random.split(jax.random.key(seed))  # (init key, run key) as the run loop


def separate(alg, data, seed):
    """One run alone: init, ROUNDS jitted rounds, evaluation (the reference)."""
    init_key, run_key = seed_keys(seed)
    state = alg.init(init_key, None, C)
    round_fn = jax.jit(alg.round)
    losses = []
    for _ in range(ROUNDS):
        state, metrics = round_fn(state, data, run_key)
        losses.append(metrics["train_loss"])
    return state, np.asarray(losses), jax.jit(alg.evaluate)(state, data, jax.random.fold_in(run_key, 5))


def together(reps, data, seeds):
    keys = [seed_keys(s) for s in seeds]
    init_keys, run_keys = jax.numpy.stack([k[0] for k in keys]), jax.numpy.stack([k[1] for k in keys])
    states = reps.init(init_keys, None, C)
    traces = []

    def counted(states, data, keys):
        traces.append(1)
        return reps.round(states, data, keys)

    round_fn = jax.jit(counted)
    losses = []
    for _ in range(ROUNDS):
        states, metrics = round_fn(states, data, run_keys)
        losses.append(metrics["train_loss"])
    eval_keys = jax.vmap(lambda k: jax.random.fold_in(k, 5))(run_keys)
    return states, np.stack(losses, 1), jax.jit(reps.evaluate)(states, data, eval_keys), len(traces)


def assert_equal_runs(reps, algs, data, seeds):
    states, losses, per_client, traced = together(reps, data, seeds)
    assert traced == 1
    for r, (alg, seed) in enumerate(zip(algs, seeds)):
        state, loss, ev = separate(alg, data, seed)
        chex.assert_trees_all_close(replicas.take(states, r), state, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(losses[r], loss, rtol=1e-5)
        chex.assert_trees_all_close(replicas.take(per_client, r), ev, rtol=1e-5, atol=1e-6)
    return losses


@pytest.mark.parametrize("strategy", ["vmap", "map"])
def test_fedavg_partial_participation_seeds_equal_separate_runs(strategy):
    data = toy_data(COUNTS)
    alg = fedavg.build(MODEL, SPEC, clients_per_round=3, client_map="vmap")
    losses = assert_equal_runs(replicas.replicate(alg, len(SEEDS), strategy), [alg] * 3, data, SEEDS)
    assert not np.allclose(losses[0], losses[1])  # the seeds differ


def test_pfedla_seeds_equal_separate_runs():
    data = toy_data(COUNTS)
    alg = pfedla.build(MODEL, SPEC, embedding_dim=4, hn_hidden=(6,), hn_lr=0.05, client_map="map")
    assert_equal_runs(replicas.replicate(alg, 2), [alg] * 2, data, SEEDS[:2])


def lr_build(learning_rate, clients_per_round=3):
    spec = LocalTraining(optax.sgd(learning_rate, momentum=0.5), batch_size=4, epochs=1)
    return fedavg.build(MODEL, spec, clients_per_round=clients_per_round, client_map="vmap")


@pytest.mark.parametrize("strategy", ["vmap", "map"])
def test_learning_rate_grid_equals_separate_runs(strategy):
    data = toy_data(COUNTS)
    lrs = (0.05, 0.2, 0.4)
    replicas.check_varying(lr_build, {"learning_rate": lrs}, data, C)
    reps = replicas.replicate_grid(lr_build, {"learning_rate": lrs}, strategy=strategy)
    # seed 1 for every grid point: the grid points differ only by the learning rate
    losses = assert_equal_runs(reps, [lr_build(lr) for lr in lrs], data, (1, 1, 1))
    assert not np.allclose(losses[0], losses[2])
    assert reps.algorithm(2).round is not None


def test_only_options_that_choose_code_or_shapes_cannot_vary():
    """fedprox mu and ditto lam enter the math as scalars: their builds check their
    domains for concrete values only, so they vary. scaffold's local_lr chooses the
    control formula (0: the mean gradient) and a step count is a shape: tracing names them."""
    data = toy_data(COUNTS)
    replicas.check_varying(lambda mu: fedprox.build(MODEL, SPEC, mu=mu), {"mu": (0.1, 0.2)}, data, C)
    replicas.check_varying(lambda lam: ditto.build(MODEL, SPEC, lam=lam), {"lam": (0.1, 1.0)}, data, C)
    local_lr = lambda local_lr: scaffold.build(MODEL, SPEC, local_lr=local_lr)  # noqa: E731
    with pytest.raises(ValueError, match=r"^scaffold\.local_lr cannot vary inside one program: .*TracerBool"):
        replicas.check_varying(local_lr, {"local_lr": (0.1, 0.2)}, data, C, prefix="scaffold.")
    steps = lambda local_steps: fedavg.build(  # noqa: E731
        MODEL, LocalTraining(optax.sgd(0.1), steps=local_steps), client_map="vmap"
    )
    with pytest.raises(ValueError, match="local_steps cannot vary"):  # a shape: an int from a float
        replicas.check_varying(steps, {"local_steps": (1.0, 2.0)}, data, C)


def test_bad_grids_and_counts():
    with pytest.raises(ValueError, match="same number of values"):
        replicas.grid_values({"a": (1.0, 2.0), "b": (1.0,)})
    with pytest.raises(
        ValueError, match=r"replica strategy must be one of \('vmap', 'map', 'auto'\), got 'pmap'"
    ):
        replicas.replicate(lr_build(0.1), 2, "pmap")
    with pytest.raises(ValueError, match="replica count must be an integer >= 1"):
        replicas.replicate(lr_build(0.1), 0)
    with pytest.raises(ValueError, match="a cannot vary inside one program: grid values must be floats"):
        replicas.grid_values({"a": ("x", "y")})


def test_memory_refused_with_estimate_and_largest_count():
    data = toy_data(COUNTS)
    state = lr_build(0.1).init(jax.random.key(0), None, C)
    s, d = replicas.tree_bytes(state), replicas.tree_bytes(data)
    assert replicas.check_memory(state, data, 8, limit=10**12) == d + 8 * replicas.ROUND_STATE_COPIES * s
    limit = d + 5 * replicas.ROUND_STATE_COPIES * s + 1  # 5 fit, 6 do not
    replicas.check_memory(state, data, 5, limit=limit)
    with pytest.raises(
        ValueError, match=r"6 replicas do not fit in memory: estimated .* largest count that fits is 5$"
    ):
        replicas.check_memory(state, data, 6, limit=limit)
