"""FedRep: head epochs with the body frozen, then body training with the head frozen; body averaged.

The oracle freezes by `stop_gradient` in the forward pass (not by masking
updates as the module does); with SGD both leave the frozen leaves exactly in place.
"""

import chex
import jax
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedrep
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.1, momentum=0.5), batch_size=4, epochs=1, steps=None)
HEAD_EPOCHS = 2


def frozen_apply(freeze_head: bool):
    def apply(variables, x, train=False):
        params = dict(variables["params"])
        for name in params:
            if (name == "head") == freeze_head:
                params[name] = jax.lax.stop_gradient(params[name])
        return MODEL.apply({**variables, "params": params}, x, train=train)

    return apply


TRAIN_HEAD = jax.jit(make_local_train(frozen_apply(False), SPEC._replace(epochs=HEAD_EPOCHS)))
TRAIN_BODY = jax.jit(make_local_train(frozen_apply(True), SPEC))


def loop_round(body, heads, data, key, r, k):
    """body: global variables; heads: list of per-client head dicts. Returns new copies."""
    sample_key, train_key = round_keys(key, r)
    idx = [int(c) for c in sample_clients(sample_key, len(heads), k)]
    heads = list(heads)
    trained = {}
    for c in idx:
        ck = client_key(train_key, c)
        start = {"params": {**body["params"], "head": heads[c]}}
        h = TRAIN_HEAD(start, take(data.train, c), jax.random.fold_in(ck, 0)).params
        np.testing.assert_array_equal(h["params"]["hidden_0"]["kernel"], body["params"]["hidden_0"]["kernel"])
        b = TRAIN_BODY(h, take(data.train, c), jax.random.fold_in(ck, 1)).params
        np.testing.assert_array_equal(b["params"]["head"]["kernel"], h["params"]["head"]["kernel"])
        trained[c], heads[c] = b["params"]["hidden_0"], b["params"]["head"]
    w = np.asarray([COUNTS[c] for c in idx], np.float64)
    w /= w.sum()
    mean = jax.tree.map(
        lambda *xs: sum(wi * np.asarray(x) for wi, x in zip(w, xs)).astype(np.float32),
        *[trained[c] for c in idx],
    )
    return {"params": {**body["params"], "hidden_0": mean}}, heads, idx


def test_round_equals_alternating_loop():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = fedrep.build(MODEL, SPEC, clients_per_round=3, head_epochs=HEAD_EPOCHS, client_map="map")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    body = state.global_params
    heads = [
        {
            "kernel": state.client_params["params/head/kernel"][c],
            "bias": state.client_params["params/head/bias"][c],
        }
        for c in range(len(COUNTS))
    ]
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(4))
        body, heads, idx = loop_round(body, heads, data, jax.random.key(4), r, 3)
        chex.assert_trees_all_close(
            state.global_params["params"]["hidden_0"], body["params"]["hidden_0"], rtol=1e-5, atol=1e-6
        )
        for c in range(len(COUNTS)):
            np.testing.assert_allclose(
                state.client_params["params/head/kernel"][c], heads[c]["kernel"], rtol=1e-5, atol=1e-6
            )
    assert np.isfinite(metrics["head_loss"]) and metrics["bytes_up"] == 3 * (6 * 8 + 8) * 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="head_epochs"):
        fedrep.build(MODEL, SPEC, head_epochs=0)
    with pytest.raises(ValueError, match="head_layers"):
        fedrep.build(MODEL, SPEC, head_layers=2)
