"""FedAMP: the attention matrix in closed form (FedAMP's A' and HeurFedAMP's cosine), the round
against a per-client loop written here (float64 attention, hand-written proximal SGD), only
the participants exchange messages, and it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedamp
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import masked_ce_grad, mean, same_rule_data, scores_before_after, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR = len(COUNTS), 3, 4, 0.1
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)
GRAD = masked_ce_grad(MODEL)


def hyper(**kw):
    base = dict(train=None, alpha_k=1.0, sigma=1.0, attention="distance", self_weight=0.5, start="cloud")
    return fedamp.FedAMPHyper(**{**base, **kw})


def flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def np_attention(models, alpha_k, sigma, attention="distance", self_weight=0.5):
    """xi [K, K] in float64 from flattened models [K, P], written out as in the paper."""
    k = len(models)
    xi = np.zeros((k, k))
    for i in range(k):
        if attention == "distance":
            for j in range(k):
                if j != i:
                    d2 = np.sum((models[i] - models[j]) ** 2)
                    xi[i, j] = alpha_k * np.exp(-d2 / sigma) / sigma
            xi[i, i] = 1.0 - xi[i].sum()
        else:
            cos = [models[i] @ m / (np.linalg.norm(models[i]) * np.linalg.norm(m)) for m in models]
            e = np.array([np.exp(sigma * cos[j]) if j != i else 0.0 for j in range(k)])
            xi[i] = (1 - self_weight) * e / e.sum()
            xi[i, i] = self_weight
    return xi


def stacked_models(seed, k=4, scale=0.3):
    key = jax.random.key(seed)
    return {
        "a": scale * jax.random.normal(key, (k, 3, 2)),
        "b": 1.0 + scale * jax.random.normal(jax.random.fold_in(key, 1), (k, 5)),
    }


def test_attention_closed_forms():
    w = stacked_models(0)
    models = [flat(jax.tree.map(lambda x, i=i: x[i], w)) for i in range(4)]
    for kw in (
        dict(alpha_k=0.3, sigma=2.0),
        dict(alpha_k=1.0, sigma=0.5),
        dict(attention="cosine", sigma=3.0, self_weight=0.4),
    ):
        hp = hyper(**kw)
        u, xi = jax.jit(fedamp.cloud_models, static_argnums=0)(hp, w)
        want = np_attention(models, hp.alpha_k, hp.sigma, hp.attention, hp.self_weight)
        np.testing.assert_allclose(xi, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.sum(xi, 1), 1.0, rtol=1e-6)
        for i in range(4):
            np.testing.assert_allclose(
                flat(jax.tree.map(lambda x, i=i: x[i], u)), want[i] @ np.stack(models), 1e-5
            )

    # Identical models: u_i = w whatever the weights (rows sum to 1).
    same = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), w)
    u, xi = fedamp.cloud_models(hyper(alpha_k=0.3, sigma=2.0), same)
    np.testing.assert_allclose(np.asarray(xi)[0, 1], 0.3 / 2.0, rtol=1e-6)  # d = 0: alpha_k A'(0)
    chex.assert_trees_all_close(u, same, rtol=1e-6)
    # HeurFedAMP with sigma -> 0 and xi_ii = 1 / K: the mean of the participants.
    u, _ = fedamp.cloud_models(hyper(attention="cosine", sigma=1e-7, self_weight=0.25), w)
    chex.assert_trees_all_close(u, jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), w), rtol=1e-5)
    # Models far apart against sigma: xi = identity, u_i = w_i (local training).
    far = jax.tree.map(lambda x: 30.0 * x, w)
    u, xi = fedamp.cloud_models(hyper(alpha_k=1.0, sigma=0.1), far)
    np.testing.assert_allclose(xi, np.eye(4), atol=1e-6)
    # One participant: its own model.
    one = jax.tree.map(lambda x: x[:1], w)
    np.testing.assert_array_equal(fedamp.cloud_models(hyper(), one)[1], [[1.0]])


def loop_round(ws, data, key, round_, alpha_k, lam, sigma, start):
    """Reference: the float64 attention over the participants, then each alone: ceil(n / B)
    SGD steps on CE + lam / (2 alpha_k) ||w - u||^2 from u (start "cloud") or w."""
    sample_key, train_key = round_keys(key, round_)
    idx = [int(c) for c in sample_clients(sample_key, NUM, K)]
    models = [flat(ws[c]) for c in idx]
    xi = np_attention(models, alpha_k, sigma)
    out = list(ws)
    for a, c in enumerate(idx):
        u = jax.tree.map(
            lambda *xs, a=a: sum(xi[a, b] * np.asarray(x, np.float64) for b, x in enumerate(xs)),
            *[ws[b] for b in idx],
        )
        u = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), u)
        w = u if start == "cloud" else ws[c]
        d, ck = take(data.train, c), client_key(train_key, c)
        for s in range(-(-COUNTS[c] // B)):
            g = GRAD(w, stream_batch(ck, jnp.int32(s), d.count, d.x.shape[0], B), d)
            w = jax.tree.map(lambda p, gi, ui: p - LR * (gi + lam / alpha_k * (p - ui)), w, g, u)
        out[c] = w
    return out, xi


@pytest.mark.parametrize("start", ["cloud", "own"])
def test_round_equals_per_client_loop(start):
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    kw = dict(alpha_k=0.5, lam=0.5, sigma=2.0)
    alg = fedamp.build(MODEL, SPEC, clients_per_round=K, client_map="map", start=start, **kw)
    state = alg.init(jax.random.key(0), None, NUM)
    # Distinct starting models, so that the attention is neither uniform nor the identity.
    state = state._replace(
        client_params=jax.tree.map(
            lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), state.client_params
        )
    )
    ws = [take(state.client_params, c)["params"] for c in range(NUM)]
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(3))
        ws, xi = loop_round(ws, data, jax.random.key(3), r, start=start, **kw)
        assert 0.01 < np.min(xi) and np.max(np.diag(xi)) < 0.8  # a real mix
        np.testing.assert_allclose(metrics["self_weight"], np.mean(np.diag(xi)), rtol=1e-5)
        for c in range(NUM):
            chex.assert_trees_all_close(take(state.client_params, c)["params"], ws[c], rtol=1e-5, atol=1e-6)
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * tree_bytes(MODEL.template())

    scores = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    for c in range(NUM):
        test = take(data.test, c)
        logits = MODEL.apply({"params": ws[c]}, test.x)[0]
        valid = np.arange(test.y.shape[0]) < int(test.count)
        want = np.asarray(jnp.argmax(logits, -1) == test.y)[valid].mean()
        np.testing.assert_allclose(scores["accuracy"][c], want, atol=1e-6)


def test_only_participants_exchange_messages():
    """A non-participant's model changes nothing this round, and stays as it was."""
    data = toy_data(COUNTS)
    alg = fedamp.build(MODEL, SPEC, clients_per_round=K, sigma=0.5, alpha_k=0.2)
    state = alg.init(jax.random.key(0), None, NUM)
    idx = set(int(c) for c in sample_clients(round_keys(jax.random.key(1), 0)[0], NUM, K))
    out = sorted(set(range(NUM)) - idx)
    moved = state._replace(client_params=jax.tree.map(lambda x: x.at[out[0]].add(0.05), state.client_params))
    rnd = jax.jit(alg.round)
    a, b = rnd(state, data, jax.random.key(1))[0], rnd(moved, data, jax.random.key(1))[0]
    for c in idx:
        chex.assert_trees_all_equal(take(a.client_params, c), take(b.client_params, c))
    for c in out:
        chex.assert_trees_all_equal(take(b.client_params, c), take(moved.client_params, c))


def test_learns():
    data = same_rule_data(40, 4)
    alg = fedamp.build(MODEL, LocalTraining(optax.sgd(0.2), batch_size=8, epochs=1), alpha_k=0.5, lam=0.1)
    before, after = scores_before_after(alg, data, rounds=10)
    assert mean(after, "loss") < mean(before, "loss") - 0.1 and mean(after, "accuracy") > 0.6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(alpha_k=0.0), "alpha_k"),
        (dict(lam=-1.0), "lam"),
        (dict(sigma=0.0), "sigma"),
        (dict(self_weight=1.5), "self_weight"),
        (dict(attention="dot"), "attention"),
        (dict(start="global"), "start"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedamp.build(MODEL, SPEC, **kwargs)
