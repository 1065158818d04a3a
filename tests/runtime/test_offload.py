"""Clients in host memory (pfljax.runtime.offload): the same numbers as on the device.

Every algorithm that allows host storage runs 3 rounds with 2 evaluations with its
clients in host memory (a block, `Offload.block`) and on the device (one jitted
round at a time): state, metrics and evaluations equal (rtol 1e-5); 6 clients of
which 2 take part per round, a ClientPool of uint8 codes, evaluation in chunks of
4 clients (the last padded). The refusing algorithms name why. Sampling above
FLOYD_MIN_CLIENTS: K distinct sorted ids, every subset equally likely; the host's
ids are the round's own sample.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.core.clients import round_keys
from pfljax.core.local import LocalTraining
from pfljax.core.privacy import ClientDP
from pfljax.core.sampling import FLOYD_MIN_CLIENTS, floyd_sample, sample_clients
from pfljax.models import build_model
from pfljax.runtime.memory import host_memory_report
from pfljax.runtime.offload import Offload, gather_data
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.algorithms.small_options import small_options
from tests.toydata import toy_pool_data

COUNTS = (9, 5, 12, 3, 7, 4)
NUM, K = len(COUNTS), 2
SPEC = LocalTraining(optax.sgd(0.05), batch_size=4, steps=2, epochs=None)
ALLOWED = [n for n in algorithms.available() if algorithms.host_storage_refusal(n) is None]
REFUSED = [n for n in algorithms.available() if algorithms.host_storage_refusal(n) is not None]


def make(name, **options):
    model = build_model(algorithms.model_variant(name, "mlp"), (6,), 3, hidden=(8,))
    options = {**small_options(name), **options}
    return algorithms.get(name).build(model, SPEC, clients_per_round=K, client_map="map", **options)


def run_both(alg, rounds=3, eval_every=2):
    """(device state, per-round metrics and evaluations on the device, host state,
    host BlockOut) of `rounds` rounds, evaluated after round `eval_every` and the last."""
    data = toy_pool_data(COUNTS)[0]
    key, eval_key = jax.random.key(3), jax.random.key(9)
    state = jax.jit(alg.init, static_argnums=2)(jax.random.key(0), None, NUM)

    offload = Offload(alg, data, K, state, eval_clients=4)  # 2 evaluation chunks, the last padded
    hs = offload.from_state(jax.device_get(state))

    def host_evaluate_at(hs, k, r):
        return offload.evaluate(hs, jax.random.fold_in(k, r))

    schedule = np.array([0, rounds, eval_every, rounds], np.int32)
    hs, host_out = offload.block(hs, key, eval_key, schedule, rounds, host_evaluate_at)

    round_fn, evaluate = jax.jit(alg.round), jax.jit(alg.evaluate)
    metrics, evaluations = [], {}
    for r in range(1, rounds + 1):
        state, m = round_fn(state, data, key)
        metrics.append(m)
        if r % eval_every == 0 or r == rounds:
            evaluations[r] = evaluate(state, data, jax.random.fold_in(eval_key, r))
    return jax.device_get(state), jax.device_get((metrics, evaluations)), offload.to_state(hs), host_out


@pytest.mark.parametrize("name", ALLOWED)
def test_host_storage_gives_the_device_numbers(name):
    device_state, (metrics, evaluations), host_state, out = run_both(make(name))
    chex.assert_trees_all_close(host_state, device_state, rtol=1e-5, atol=1e-6)
    assert out.ran.tolist() == out.ok.tolist() == [True] * 3
    assert out.evaluated.tolist() == [False, True, True]
    for i, m in enumerate(metrics):
        chex.assert_trees_all_close(jax.tree.map(lambda x, i=i: x[i], out.metrics), m, rtol=1e-5, atol=1e-6)
    for r, evaluation in evaluations.items():
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, r=r: x[r - 1], out.evaluation), evaluation, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("name, options", [("pfedme", {"train_all": False})])
def test_an_option_that_keeps_to_the_participants_allows_host_storage(name, options):
    assert algorithms.host_storage_refusal(name) and algorithms.host_storage_refusal(name, options) is None
    device_state, _, host_state, _ = run_both(make(name, **options), rounds=2)
    chex.assert_trees_all_close(host_state, device_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, options", [("fedcp", {"send_global": "participants"})])
def test_an_option_with_more_client_rows_gives_the_device_numbers(name, options):
    """FedCP's per-client copies of the global head and CPN (`client_received`) are client rows too."""
    device_state, (_, evaluations), host_state, out = run_both(make(name, **options))
    chex.assert_trees_all_close(host_state, device_state, rtol=1e-5, atol=1e-6)
    last = jax.tree.map(lambda x: x[-1], out.evaluation)
    chex.assert_trees_all_close(last, evaluations[3], rtol=1e-5, atol=1e-6)


def test_client_level_dp_draws_the_same_clipping_and_noise():
    device_state, (metrics, _), host_state, out = run_both(
        make("fedavg", privacy=ClientDP(1.0, 0.5)), rounds=2
    )
    chex.assert_trees_all_close(host_state, device_state, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[1], out.metrics), metrics[1], rtol=1e-5, atol=1e-6)


def test_every_refusal_is_one_line_naming_why():
    assert {"fedfomo", "federico", "pfedla", "pfedhn", "factorized_fl"} <= set(REFUSED)
    assert {"fedavg", "fedper", "ditto", "scaffold"} <= set(ALLOWED)
    for name in REFUSED:
        why = algorithms.host_storage_refusal(name)
        assert isinstance(why, str) and why and "\n" not in why, name


def test_a_non_finite_round_is_not_written_back():
    alg = make("fedavg")
    data = toy_pool_data(COUNTS)[0]
    state = alg.init(jax.random.key(0), None, NUM)
    bad = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    offload = Offload(alg, data, K, state)
    hs = offload.from_state(jax.device_get(bad))
    before = offload.to_state(hs)
    schedule = np.array([0, 2, 1, 2], np.int32)
    hs, out = offload.block(hs, jax.random.key(3), jax.random.key(9), schedule, 2, None)
    assert out.ran.tolist() == [True, False] and not out.ok.any() and not out.state_finite[0]
    chex.assert_trees_all_equal(offload.to_state(hs), before)


def test_the_view_is_the_rounds_sample_and_device_bytes_follow_k():
    key = jax.random.key(5)
    data = toy_pool_data(COUNTS)[0]
    alg = make("fedper")
    state = alg.init(jax.random.key(0), None, NUM)
    offload = Offload(alg, data, K, state)
    ids = offload.participant_ids(key, np.arange(3))
    for r in range(3):
        want = sample_clients(round_keys(key, jnp.int32(r))[0], NUM, K)
        np.testing.assert_array_equal(ids[r], want)
    # The pool view holds each client's window (its rows first) at i * n_max.
    view = gather_data(offload.data, ids[0])
    train = offload.data.train
    for i, c in enumerate(ids[0]):
        n = int(train.count[c])
        rows = slice(i * train.n_max, i * train.n_max + n)
        np.testing.assert_array_equal(view.train.x[rows], train.x[train.offset[c] : train.offset[c] + n])
    hs = offload.from_state(jax.device_get(state))
    report = host_memory_report(offload.data, hs.rows, offload.view(hs, ids[0]), view)
    assert report["client_storage"] == "host" and report["clients_per_round"] == K
    assert report["device_data_bytes"] == 2 * sum(x.nbytes for x in jax.tree.leaves(view))
    assert report["host_bytes"] >= NUM * report["host_bytes_per_client"]


def test_floyd_sampling_above_the_threshold():
    num, k = FLOYD_MIN_CLIENTS + 1000, 100
    seen = set()
    for r in range(5):
        ids = np.asarray(jax.jit(sample_clients, static_argnums=(1, 2))(jax.random.key(r), num, k))
        assert len(set(ids.tolist())) == k and ids.min() >= 0 and ids.max() < num
        assert (np.diff(ids) > 0).all()
        seen |= set(ids.tolist())
    assert len(seen) > 4 * k - 5  # five draws rarely share ids
    # Every K-subset equally likely: each id of a small population as often as the others.
    counts = np.zeros(10)
    draws = jax.jit(jax.vmap(lambda key: floyd_sample(key, 10, 3)))(jax.random.split(jax.random.key(0), 6000))
    np.add.at(counts, np.asarray(draws).ravel(), 1)
    np.testing.assert_allclose(counts / counts.sum(), 0.1, atol=0.01)
    # Below the threshold the draw is unchanged: jax.random.choice.
    want = jnp.sort(jax.random.choice(jax.random.key(1), 1000, (10,), replace=False))
    np.testing.assert_array_equal(sample_clients(jax.random.key(1), 1000, 10), want)
