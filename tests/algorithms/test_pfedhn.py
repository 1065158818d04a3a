"""pFedHN: the hypernetwork step is jax.grad of <HN(v_c), -delta_c> summed (default)
or averaged (combine="mean") over the sampled clients, with deltas from a per-client
loop written here."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import pfedhn
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.evaluate import evaluate_client
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.params import leaf_paths, tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9, 15)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=2, steps=None)
TEMPLATE = MODEL.init(jax.random.key(0))
PLAIN_SGD = dict(
    embedding_dim=4, hn_hidden=(10, 10), hn_lr=0.1, hn_momentum=0.0, hn_weight_decay=0.0, hn_clip_norm=0.0
)


def hn_model(hn, c):
    """Client c's model from the hypernetwork, written out: embedding, Linear
    (ReLU Linear)*, one Linear head per parameter leaf."""
    h = hn["embedding"][c]
    layers = [hn["trunk"][f"layer_{i}"] for i in range(len(hn["trunk"]))]
    for i, layer in enumerate(layers):
        h = h @ layer["kernel"] + layer["bias"]
        h = jax.nn.relu(h) if i < len(layers) - 1 else h
    leaves = [
        (h @ hn["heads"][p]["kernel"] + hn["heads"][p]["bias"]).reshape(leaf.shape)
        for p, leaf in zip(leaf_paths(TEMPLATE["params"]), jax.tree.leaves(TEMPLATE["params"]))
    ]
    return {"params": jax.tree.unflatten(jax.tree.structure(TEMPLATE["params"]), leaves)}


generated = jax.jit(hn_model)
evaluate_generated = jax.jit(lambda hn, c, rows: evaluate_client(MODEL.apply, hn_model(hn, c), rows))


def loop_step(state, data, key, k, lr, combine):
    """Reference: each sampled client trains its generated model; the server takes
    one SGD step on sum_c (or mean_c) <HN(v_c), -delta_c>."""
    train = jax.jit(make_local_train(MODEL.apply, SPEC))
    sample_key, train_key = round_keys(key, state.round)
    idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), k)]
    deltas = {}
    for c in idx:
        start = generated(state.global_hn, c)
        trained = train(start, take(data.train, c), client_key(train_key, c)).params
        deltas[c] = jax.tree.map(jnp.subtract, trained, start)

    def objective(hn):
        inner = [
            sum(jnp.vdot(t, -d) for t, d in zip(jax.tree.leaves(hn_model(hn, c)), jax.tree.leaves(deltas[c])))
            for c in idx
        ]
        return sum(inner) / (k if combine == "mean" else 1)

    grads = jax.jit(jax.grad(objective))(state.global_hn)
    return jax.tree.map(lambda p, g: p - lr * g, state.global_hn, grads)


def test_step_is_grad_of_inner_product_with_minus_delta_and_vmap_traces_once():
    data = toy_data(COUNTS)
    alg = pfedhn.build(MODEL, SPEC, clients_per_round=3, client_map="map", **PLAIN_SGD)  # combine="sum"
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    chex.assert_shape(state.global_hn["embedding"], (len(COUNTS), 4))
    rnd = jax.jit(alg.round)
    states = [state]
    for _ in range(2):
        want = loop_step(state, data, jax.random.key(2), 3, 0.1, "sum")
        state, metrics = rnd(state, data, jax.random.key(2))
        states.append(state)
        chex.assert_trees_all_close(state.global_hn, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(states[0].global_hn["embedding"], state.global_hn["embedding"])
    assert metrics["bytes_up"] == 3 * tree_bytes(TEMPLATE["params"])

    vmap_alg = pfedhn.build(MODEL, SPEC, clients_per_round=3, client_map="vmap", combine="mean", **PLAIN_SGD)

    chex.clear_trace_counter()

    vmap_round = jax.jit(chex.assert_max_traces(vmap_alg.round, n=1))

    state = states[0]
    want = loop_step(state, data, jax.random.key(2), 3, 0.1, "mean")
    for r in range(3):
        state, _ = vmap_round(state, data, jax.random.key(2))
        if r == 0:
            chex.assert_trees_all_close(state.global_hn, want, rtol=1e-5, atol=1e-6)

    # Each client is evaluated with its generated model, no fine-tuning.
    scores = jax.jit(vmap_alg.evaluate)(state, data, jax.random.key(5))
    for c in range(len(COUNTS)):
        want = evaluate_generated(state.global_hn, c, take(data.test, c))
        np.testing.assert_allclose(scores["accuracy"][c], want["accuracy"], rtol=1e-6)
        np.testing.assert_allclose(scores["loss"][c], want["loss"], rtol=1e-4)


def test_default_embedding_size_follows_the_code():
    alg = pfedhn.build(MODEL, SPEC, hn_hidden=(10,))
    assert alg.init(jax.random.key(0), None, 10).global_hn["embedding"].shape == (10, 3)  # int(1 + 10 / 4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hn_hidden=()), "hn_hidden"),
        (dict(embedding_dim=-1), "embedding_dim"),
        (dict(hn_lr=0.0), "hn_lr"),
        (dict(combine="max"), "combine"),
        (dict(client_map="pmap"), "strategy"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pfedhn.build(MODEL, SPEC, **kwargs)
