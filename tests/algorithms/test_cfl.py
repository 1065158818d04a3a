"""Clustered FL: the optimal bipartition, the round against a per-client loop
written here (brute-force bipartition), and the split of two client groups
whose labels are permuted against each other."""

import itertools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import cfl
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.core.types import ClientData
from pfljax.models import build_model
from tests.toydata import opposite_groups

MODEL = build_model("mlp", (6,), 3, hidden=(16,))
SPEC = LocalTraining(optax.sgd(0.1), batch_size=8, epochs=1, steps=None)


def brute_force_split(sim, members):
    """The bipartition of `members` minimizing the largest cross similarity,
    as the set NOT holding the first member."""
    best, best_side = np.inf, None
    rest = members[1:]
    for r in range(0, len(rest)):
        for other in itertools.combinations(rest, r):
            side = [m for m in rest if m not in other]
            group = [members[0], *other]
            cross = max(sim[i, j] for i in group for j in side)
            if cross < best - 1e-9:
                best, best_side = cross, set(side)
    return best_side, best


def test_single_linkage_bipartition_is_the_optimal_one():
    bipartition = jax.jit(cfl.bipartition, static_argnames="linkage")
    rng = np.random.default_rng(0)
    for trial in range(12):
        a = rng.normal(size=(7, 3))
        a /= np.linalg.norm(a, axis=1, keepdims=True)
        sim = a @ a.T
        members = np.ones(7, bool)
        members[trial % 7] = trial % 3 != 0
        side = np.asarray(bipartition(jnp.asarray(sim, jnp.float32), jnp.asarray(members)))
        ids = list(np.flatnonzero(members))
        want, _ = brute_force_split(sim, ids)
        assert set(np.flatnonzero(side)) == want
        assert not side[~members].any()


def test_complete_linkage_differs_on_a_chain():
    """A chain 0-1-2-3 with links 0.9, 0.85, 0.8: single linkage cuts the weakest
    link (2 | 3); complete linkage, after {0, 1}, sees {0, 1}-2 at min(0.1, 0.85)
    and merges 2 with 3 instead."""
    sim = np.array(
        [
            [1.0, 0.9, 0.1, 0.0],
            [0.9, 1.0, 0.85, 0.1],
            [0.1, 0.85, 1.0, 0.8],
            [0.0, 0.1, 0.8, 1.0],
        ],
        np.float32,
    )
    members = jnp.ones(4, bool)
    single = np.asarray(cfl.bipartition(jnp.asarray(sim), members, "single"))
    complete = np.asarray(cfl.bipartition(jnp.asarray(sim), members, "complete"))
    np.testing.assert_array_equal(single, [False, False, False, True])
    np.testing.assert_array_equal(complete, [False, False, True, True])


def loop_round(state, data, key, k, max_clusters):
    """Reference CFL round with forced splits (eps1 = inf, eps2 = 0), numpy + a
    brute-force bipartition."""
    train = jax.jit(make_local_train(MODEL.apply, SPEC))
    num = data.train.count.shape[0]
    sample_key, train_key = round_keys(key, state.round)
    idx = [int(c) for c in sample_clients(sample_key, num, k)]
    params = jax.tree.map(np.array, state.cluster_params)
    assign = np.array(state.client_cluster)
    n = int(state.num_clusters)
    deltas = {}
    for c in idx:
        start = jax.tree.map(lambda p, c=c: p[assign[c]], params)
        trained = train(start, take(data.train, c), client_key(train_key, c)).params
        deltas[c] = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, trained, start)
    flat = np.stack(
        [np.concatenate([np.ravel(x) for x in jax.tree.leaves(deltas[c]["params"])]) for c in idx]
    )
    norms = np.linalg.norm(flat, axis=1)
    sim = np.zeros((num, num))
    sim[np.ix_(idx, idx)] = flat @ flat.T / np.outer(norms, norms)
    n_start = n
    for cluster in range(n_start):
        members = [c for c in idx if assign[c] == cluster]
        if len(members) < 2 or n >= max_clusters:
            continue
        side, _ = brute_force_split(sim, members)
        for c in side:
            assign[c] = n
        params = jax.tree.map(
            lambda p, cl=cluster, n=n: np.concatenate([p[:n], p[cl][None], p[n + 1 :]]), params
        )
        n += 1
    counts = np.asarray(data.train.count)
    for cluster in range(n):
        members = [c for c in idx if assign[c] == cluster]
        if not members:
            continue
        w = np.array([counts[c] for c in members], np.float64)
        w /= w.sum()
        mean = jax.tree.map(
            lambda *ds, w=w: sum(wi * d for wi, d in zip(w, ds)), *[deltas[c] for c in members]
        )
        params = jax.tree.map(
            lambda p, m, cl=cluster: np.concatenate([p[:cl], (p[cl] + m)[None], p[cl + 1 :]]), params, mean
        )
    return params, assign, n


def test_round_equals_per_client_loop_with_forced_splits():
    counts = (12, 9, 15, 8, 10, 11)
    data = ClientData(opposite_groups(counts, 0), opposite_groups(counts, 1))
    alg = cfl.build(MODEL, SPEC, clients_per_round=5, eps1=1e9, eps2=0.0, max_clusters=3, client_map="map")
    state = alg.init(jax.random.key(0), None, len(counts))
    rnd = jax.jit(alg.round)
    for _ in range(2):
        want_params, want_assign, want_n = loop_round(state, data, jax.random.key(4), 5, 3)
        state, metrics = rnd(state, data, jax.random.key(4))
        chex.assert_trees_all_close(state.cluster_params, want_params, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(state.client_cluster, want_assign)
        assert int(state.num_clusters) == want_n == int(metrics["num_clusters"])
    assert int(state.num_clusters) == 3  # the cap stops further splits
    assert metrics["bytes_up"] == 5 * tree_bytes(MODEL.init(jax.random.key(0)))
    collab = np.asarray(cfl.collaboration_matrix(state))
    np.testing.assert_allclose(collab.sum(1), 1.0, rtol=1e-6)
    same = np.asarray(state.client_cluster)[:, None] == np.asarray(state.client_cluster)[None, :]
    assert np.all((collab > 0) == same)
    report = cfl.final_report(state, None)
    assert json.loads(json.dumps(report)) == report and report["num_clusters"] == 3


def test_splits_the_two_opposite_label_groups_once():
    """FedAvg until the mean update is small while single updates are not, then
    one split: exactly the two groups; no spurious split afterwards. The
    thresholds sit between the measured norms of this toy task (mean update
    norm 0.37 -> 0.17 over the first rounds, largest 0.76 -> 0.42)."""
    counts = (40, 30, 50, 35, 45, 30)
    data = ClientData(opposite_groups(counts, 0), opposite_groups(counts, 100))
    alg = cfl.build(MODEL, SPEC, eps1=0.2, eps2=0.3, gamma_max=0.3, client_map="vmap")

    chex.clear_trace_counter()

    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))

    state = alg.init(jax.random.key(0), None, len(counts))
    history = []
    for r in range(8):
        state, metrics = rnd(state, data, jax.random.key(r))
        history.append(int(metrics["num_clusters"]))
    assert history[0] == 1, history  # not split before FedAvg has settled
    assert history[-1] == 2, history
    np.testing.assert_array_equal(state.client_cluster, [0, 0, 0, 1, 1, 1])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(linkage="average"), "linkage"),
        (dict(weighting="median"), "weighting"),
        (dict(max_clusters=0), "max_clusters"),
        (dict(min_split_size=1), "min_split_size"),
        (dict(eps1=-1.0), "eps1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cfl.build(MODEL, SPEC, **kwargs)
