"""FedEM: EM in closed form, the round against a per-client loop written here,
mixture weights summing to 1, and the mixture prediction."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedem
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import Loss
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9, 15)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=2, steps=None)
M = 2
log_probs = jax.jit(lambda variables, x: jax.nn.log_softmax(MODEL.apply(variables, x)[0]))


def test_em_iteration_closed_form():
    log_pi = jnp.log(jnp.array([0.8, 0.2]))
    losses = jnp.array([[1.0, 2.0, 5.0], [2.0, 1.0, 0.0]])
    q, pi = fedem.em_iteration(log_pi, losses, jnp.array([1.0, 1.0, 0.0]))
    q0 = np.array([1 / (1 + 0.25 * np.exp(-1.0)), 1 / (1 + 0.25 * np.exp(1.0)), 0.0])
    np.testing.assert_allclose(q[0], q0, rtol=1e-6)
    np.testing.assert_allclose(q[1], [1 - q0[0], 1 - q0[1], 0.0], rtol=1e-6)
    np.testing.assert_allclose(pi, [q0[:2].mean(), 1 - q0[:2].mean()], rtol=1e-6)
    _, unchanged = fedem.em_iteration(log_pi, losses, jnp.zeros(3))
    np.testing.assert_allclose(unchanged, [0.8, 0.2], rtol=1e-6)


def weighted_ce(out, yw):
    return yw[:, 1] * optax.softmax_cross_entropy_with_integer_labels(out, yw[:, 0].astype(jnp.int32))


WEIGHTED = Loss("weighted", weighted_ce, lambda out, yw: jnp.zeros(out.shape[0]))


def loop_round(state, data, key, k):
    """Reference: numpy E/M-steps per client, each component trained alone."""
    train = jax.jit(make_local_train(MODEL.apply, SPEC._replace(loss=WEIGHTED)))
    sample_key, train_key = round_keys(key, state.round)
    idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), k)]
    comps = [take(state.global_components, m) for m in range(M)]
    mixture = np.array(state.client_mixture)
    trained = {}
    for c in idx:
        rows = take(data.train, c)
        n = int(rows.count)
        log_p = [log_probs(comp, rows.x)[:n] for comp in comps]
        losses = -np.stack([np.asarray(lp)[np.arange(n), np.asarray(rows.y[:n])] for lp in log_p])
        a = np.log(mixture[c])[:, None] - losses
        q = np.exp(a - a.max(0)) / np.exp(a - a.max(0)).sum(0)
        mixture[c] = q.mean(1)
        for m in range(M):
            weights = np.zeros(rows.y.shape[0], np.float32)
            weights[:n] = q[m]
            packed = rows._replace(y=jnp.stack([rows.y.astype(jnp.float32), jnp.asarray(weights)], 1))
            key_cm = jax.random.fold_in(client_key(train_key, c), m)
            trained[c, m] = train(comps[m], packed, key_cm).params
    w = np.array([COUNTS[c] for c in idx], np.float64)
    w /= w.sum()
    new = [
        jax.tree.map(
            lambda *xs: sum(wi * np.asarray(x) for wi, x in zip(w, xs)), *[trained[c, m] for c in idx]
        )
        for m in range(M)
    ]
    return jax.tree.map(lambda *xs: np.stack(xs), *new), mixture


def test_round_equals_per_client_loop_and_vmap_traces_once():
    data = toy_data(COUNTS)
    alg = fedem.build(MODEL, SPEC, clients_per_round=4, num_components=M, client_map="map")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    assert not np.allclose(*state.global_components["params"]["hidden_0"]["kernel"])  # distinct inits
    rnd = jax.jit(alg.round)
    states = [state]
    for _ in range(2):
        want_comps, want_mixture = loop_round(state, data, jax.random.key(3), 4)
        state, metrics = rnd(state, data, jax.random.key(3))
        states.append(state)
        chex.assert_trees_all_close(state.global_components, want_comps, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.client_mixture, want_mixture, rtol=1e-5, atol=1e-7)
    # The defining invariant: every client's mixture weights are a distribution.
    mixture = np.asarray(state.client_mixture)
    assert mixture.min() >= 0 and not np.allclose(mixture, 1 / M)
    np.testing.assert_allclose(mixture.sum(1), 1.0, rtol=1e-6)
    assert metrics["bytes_up"] == 4 * M * tree_bytes(MODEL.init(jax.random.key(0)))

    vmap_alg = fedem.build(MODEL, SPEC, clients_per_round=4, num_components=M, client_map="vmap")

    chex.clear_trace_counter()

    vmap_round = jax.jit(chex.assert_max_traces(vmap_alg.round, n=1))

    state = states[0]
    for r in range(3):
        state, _ = vmap_round(state, data, jax.random.key(3))
        if r < 2:
            chex.assert_trees_all_close(state, states[r + 1], rtol=1e-5, atol=1e-6)

    # Prediction is the client's mixture sum_m pi_m softmax(h_m(x)).
    scores = jax.jit(vmap_alg.evaluate)(state, data, jax.random.key(0))
    for c in range(len(COUNTS)):
        rows = take(data.test, c)
        n = int(rows.count)
        probs = sum(
            state.client_mixture[c, m]
            * np.exp(np.asarray(log_probs(take(state.global_components, m), rows.x)[:n]))
            for m in range(M)
        )
        y = np.asarray(rows.y[:n])
        np.testing.assert_allclose(scores["accuracy"][c], np.mean(probs.argmax(1) == y), rtol=1e-6)
        np.testing.assert_allclose(scores["loss"][c], -np.mean(np.log(probs[np.arange(n), y])), rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(num_components=0), "num_components"), (dict(client_map="pmap"), "strategy")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedem.build(MODEL, SPEC, **kwargs)


def test_unsupported_loss():
    custom = Loss("hinge", weighted_ce, weighted_ce)
    with pytest.raises(ValueError, match="loss"):
        fedem.build(MODEL, SPEC._replace(loss=custom))
