"""FedFomo: its weights in closed form, the held-out split, the epsilon-greedy
download, the round against a per-client loop written here, and clients
learning to weigh their own group."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedfomo
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.evaluate import evaluate_client
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.core.types import ClientArrays, ClientData
from pfljax.models import build_model
from tests.toydata import opposite_groups, toy_data

COUNTS = (12, 7, 20, 3, 9, 15)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
holdout_split = jax.jit(fedfomo.holdout_split, static_argnums=2)
select_candidates = jax.jit(fedfomo.select_candidates, static_argnums=3)
val_loss_and_accuracy = jax.jit(lambda variables, rows: evaluate_client(MODEL.apply, variables, rows))
SPEC = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=2, steps=None)


def test_fomo_weights_closed_form():
    raw, mix = fedfomo.fomo_weights(
        jnp.float32(1.0), jnp.array([0.5, 1.2, 0.8, 0.7]), jnp.array([1.0, 2.0, 0.5, 0.0])
    )
    np.testing.assert_allclose(raw, [0.5, -0.1, 0.4, 0.0], rtol=1e-6)
    np.testing.assert_allclose(mix, [5 / 9, 0.0, 4 / 9, 0.0], rtol=1e-6)
    _, none = fedfomo.fomo_weights(jnp.float32(0.1), jnp.array([0.5, 1.2]), jnp.array([1.0, 2.0]))
    np.testing.assert_array_equal(none, [0.0, 0.0])


def test_holdout_split_is_a_partition_of_the_real_rows():
    counts = np.array([20, 1, 2, 0, 7], np.int32)
    n_max = 24
    x = np.broadcast_to(np.arange(n_max, dtype=np.float32)[None, :, None], (5, n_max, 1))
    arrays = ClientArrays(jnp.asarray(x), jnp.zeros((5, n_max), jnp.int32), jnp.asarray(counts))
    for c, count in enumerate(counts):
        train, val = holdout_split(take(arrays, c), jax.random.key(c), 0.2)
        n_train, n_val = int(train.count), int(val.count)
        want_val = 0 if count < 2 else max(1, min(count - 1, round(0.2 * count)))
        assert (n_train, n_val) == (count - want_val, want_val)
        rows_t = set(np.asarray(train.x[:n_train, 0]).astype(int))
        rows_v = set(np.asarray(val.x[:n_val, 0]).astype(int))
        assert not rows_t & rows_v and rows_t | rows_v == set(range(count))


def test_select_candidates_greedy_and_random():
    row = jnp.array([5.0, 1.0, 3.0, 9.0, 2.0, 7.0])
    greedy = np.asarray(select_candidates(jax.random.key(0), row, 3, 3, 0.0))
    np.testing.assert_array_equal(greedy, [5, 0, 2])
    for seed in range(5):
        picked = np.asarray(select_candidates(jax.random.key(seed), jnp.zeros(6), 1, 4, 1.0))
        assert len(set(picked)) == 4 and 1 not in picked


def loop_round(state, data, key, k, m, eps):
    """Reference: each sampled client alone, numpy weights and update."""
    train = jax.jit(make_local_train(MODEL.apply, SPEC))
    sample_key, train_key = round_keys(key, state.round)
    idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), k)]
    params = jax.tree.map(np.array, state.client_params)
    bases = jax.tree.map(np.array, state.client_base)
    affinity, mixing = np.array(state.client_affinity), np.array(state.client_mixing)
    for c in idx:
        select_key, local_key = jax.random.split(client_key(train_key, c))
        split_key = jax.random.fold_in(jax.random.key(fedfomo.SPLIT_KEY), c)
        train_rows, val_rows = holdout_split(take(data.train, c), split_key, 0.25)
        others = [int(o) for o in select_candidates(select_key, state.client_affinity[c], c, m, eps)]
        base = take(state.client_base, c)
        base_loss = float(val_loss_and_accuracy(base, val_rows)["loss"])
        raw = []
        for n in [c, *others]:
            model_n = take(state.client_params, n)
            dist = np.sqrt(
                sum(
                    np.sum((np.asarray(a) - np.asarray(b)) ** 2)
                    for a, b in zip(jax.tree.leaves(model_n), jax.tree.leaves(base))
                )
            )
            raw.append(
                (base_loss - float(val_loss_and_accuracy(model_n, val_rows)["loss"])) / dist
                if dist > 0
                else 0.0
            )
        pos = np.maximum(raw, 0.0)
        w = pos / pos.sum() if pos.sum() > 0 else pos
        models = [take(state.client_params, n) for n in [c, *others]]
        start = jax.tree.map(
            lambda b, *ms, w=w: np.asarray(b) + sum(wi * (np.asarray(x) - b) for wi, x in zip(w, ms)),
            base,
            *models,
        )
        trained = train(start, train_rows, local_key).params
        for tree, new in ((params, trained), (bases, start)):
            jax.tree.map(lambda t, v, c=c: t.__setitem__(c, v), tree, new)
        affinity[c, others] += raw[1:]
        mixing[c, [c, *others]] += w
        mixing[c, c] += 1.0 - w.sum()
    return params, bases, affinity, mixing


def test_round_equals_per_client_loop_and_vmap_traces_once():
    data = toy_data(COUNTS)
    kwargs = dict(clients_per_round=4, num_models=3, epsilon=0.5, epsilon_decay=0.2, val_fraction=0.25)
    alg = fedfomo.build(MODEL, SPEC, client_map="map", **kwargs)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    rnd = jax.jit(alg.round)
    states = [state]
    for r in range(3):
        want = loop_round(state, data, jax.random.key(5), 4, 3, max(0.5 - 0.2 * r, 0.0))
        state, metrics = rnd(state, data, jax.random.key(5))
        states.append(state)
        got = (state.client_params, state.client_base, state.client_affinity, state.client_mixing)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert metrics["bytes_down"] == 4 * 3 * tree_bytes(MODEL.init(jax.random.key(0)))
    # Mixing weights: non-negative, each participation adds a row summing to 1.
    mixing = np.asarray(state.client_mixing)
    assert mixing.min() >= 0
    np.testing.assert_allclose(mixing.sum(1), np.asarray(state.client_rounds), rtol=1e-5)
    collab = np.asarray(fedfomo.collaboration_matrix(state))
    np.testing.assert_allclose(collab.sum(1), 1.0, rtol=1e-5)

    vmap_alg = fedfomo.build(MODEL, SPEC, client_map="vmap", **kwargs)

    chex.clear_trace_counter()

    vmap_round = jax.jit(chex.assert_max_traces(vmap_alg.round, n=1))

    state = states[0]
    for r in range(3):
        state, _ = vmap_round(state, data, jax.random.key(5))
        chex.assert_trees_all_close(state, states[r + 1], rtol=1e-5, atol=1e-6)
    scores = jax.jit(vmap_alg.evaluate)(state, data, jax.random.key(0))
    for c in range(len(COUNTS)):
        want = val_loss_and_accuracy(take(state.client_params, c), take(data.test, c))
        np.testing.assert_allclose(scores["accuracy"][c], want["accuracy"], rtol=1e-6)


def test_clients_learn_to_weigh_their_own_group():
    """Two groups with labels permuted against each other: after a few rounds
    every client's affinity to its own group exceeds that to the other group."""
    counts = (40, 30, 50, 35, 45, 30)
    data = ClientData(opposite_groups(counts, 0), opposite_groups(counts, 0))
    model = build_model("mlp", (6,), 3, hidden=(16,))
    spec = LocalTraining(optax.sgd(0.1), batch_size=8, epochs=1, steps=None)
    alg = fedfomo.build(model, spec, num_models=3, client_map="vmap")
    state = alg.init(jax.random.key(0), None, len(counts))
    rnd = jax.jit(alg.round)
    for r in range(6):
        state, _ = rnd(state, data, jax.random.key(r))
    affinity = np.asarray(state.client_affinity)
    group = np.arange(6) >= 3
    for c in range(6):
        own = [j for j in range(6) if group[j] == group[c] and j != c]
        other = [j for j in range(6) if group[j] != group[c]]
        assert affinity[c, own].mean() > affinity[c, other].mean(), (c, affinity.round(2))
    collab = np.asarray(fedfomo.collaboration_matrix(state))
    same = group[:, None] == group[None, :]
    assert collab[same & ~np.eye(6, dtype=bool)].sum() > 3 * collab[~same].sum(), collab.round(2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(distance="cosine"), "distance"),
        (dict(num_models=0), "num_models"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(val_fraction=1.0), "val_fraction"),
        (dict(client_map="pmap"), "strategy"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedfomo.build(MODEL, SPEC, **kwargs)


def test_tree_distance_l2_and_l1_over_all_leaves():
    a = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([1.0, 1.0])}
    b = {"w": jnp.array([[0.0, 0.0], [0.5, 1.0]]), "b": jnp.array([-1.0, 1.0])}
    diff = np.array([1.0, -2.0, 0.0, 2.0, 2.0, 0.0])
    np.testing.assert_allclose(fedfomo.tree_distance(a, b), np.sqrt(np.sum(diff**2)), rtol=1e-6)
    np.testing.assert_allclose(fedfomo.tree_distance(a, b, "l1"), np.sum(np.abs(diff)), rtol=1e-6)
