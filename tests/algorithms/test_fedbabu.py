"""FedBABU: the body federated with the head frozen at its initialisation; fine-tuned whole to evaluate.

The oracle freezes the head by `stop_gradient` in the forward pass (the module
masks its updates); with SGD and momentum both leave it exactly in place.
"""

import chex
import jax
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedbabu
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.evaluate import evaluate_client
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import mean, same_rule_data, scores_before_after, toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.1, momentum=0.5), batch_size=4, epochs=1, steps=None)
K, FT = 3, 2


def head_frozen_apply(variables, x, train=False):
    params = {**variables["params"], "head": jax.lax.stop_gradient(variables["params"]["head"])}
    return MODEL.apply({**variables, "params": params}, x, train=train)


TRAIN_BODY = jax.jit(make_local_train(head_frozen_apply, SPEC))


def weighted_mean(trees, counts):
    weights = np.asarray(counts, np.float64) / sum(counts)
    return jax.tree.map(lambda *xs: sum(wi * x for wi, x in zip(weights, xs)), *trees)


def test_round_equals_per_client_loop_and_head_never_changes():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = fedbabu.build(MODEL, SPEC, clients_per_round=K, client_map="map", finetune_epochs=FT)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    head0 = state.global_params["params"]["head"]
    ref = state.global_params
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(2))
        sample_key, train_key = round_keys(jax.random.key(2), r)
        idx = [int(c) for c in sample_clients(sample_key, len(COUNTS), K)]
        outs = [TRAIN_BODY(ref, take(data.train, c), client_key(train_key, c)).params for c in idx]
        for out in outs:  # the oracle's head does not move either
            chex.assert_trees_all_equal(out["params"]["head"], head0)
        body = weighted_mean([o["params"]["hidden_0"] for o in outs], [COUNTS[c] for c in idx])
        ref = {"params": {"hidden_0": body, "head": head0}}
        chex.assert_trees_all_close(state.global_params, ref, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_equal(state.global_params["params"]["head"], head0)  # bit for bit
    assert state.client_params == {}
    body_bytes = tree_bytes(state.global_params["params"]["hidden_0"])
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * body_bytes


def test_evaluation_fine_tunes_the_whole_model():
    data = toy_data(COUNTS)
    alg = fedbabu.build(MODEL, SPEC, finetune_epochs=FT)
    state, _ = jax.jit(alg.round)(alg.init(jax.random.key(0), None, len(COUNTS)), data, jax.random.key(1))
    key = jax.random.key(5)
    got = alg.evaluate(state, data, key)
    tune = make_local_train(MODEL.apply, SPEC._replace(epochs=FT))
    for c in range(len(COUNTS)):
        tuned = tune(state.global_params, take(data.train, c), jax.random.fold_in(key, c)).params
        head = tuned["params"]["head"]["kernel"]
        assert not np.allclose(head, state.global_params["params"]["head"]["kernel"])  # the head moved too
        want = evaluate_client(MODEL.apply, tuned, take(data.test, c))
        chex.assert_trees_all_close(got["loss"][c], want["loss"], rtol=1e-5)
        chex.assert_trees_all_close(got["accuracy"][c], want["accuracy"], rtol=1e-5)


def test_learns():
    data = same_rule_data(40, 4)
    alg = fedbabu.build(MODEL, LocalTraining(optax.sgd(0.2), batch_size=8, epochs=1), finetune_epochs=1)
    before, after = scores_before_after(alg, data, rounds=10)
    assert mean(after, "loss") < mean(before, "loss") - 0.1 and mean(after, "accuracy") > 0.6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(finetune_epochs=0), "finetune_epochs"),
        (dict(head_layers=2), "head_layers"),
        (dict(weighting="x"), "weighting"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedbabu.build(MODEL, SPEC, **kwargs)
