import chex
import jax
import numpy as np
import optax

from pfljax.algorithms import local
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.models import build_model
from tests.toydata import toy_data

MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.adam(0.05), batch_size=4, epochs=1, steps=None)


def test_each_client_trains_alone_and_sends_nothing():
    counts = (10, 4, 8)
    data = toy_data(counts)
    alg = local.build(MODEL, SPEC)
    state = alg.init(jax.random.key(0), None, 3)
    start = take(state.client_params, 0)  # every client starts from the same model
    state, m = jax.jit(alg.round)(state, data, jax.random.key(5))
    assert float(m["bytes_up"]) == 0.0 and float(m["bytes_down"]) == 0.0
    train = make_local_train(MODEL.apply, SPEC)
    _, train_key = round_keys(jax.random.key(5), 0)
    for c in range(3):
        want = train(start, take(data.train, c), client_key(train_key, c)).params
        chex.assert_trees_all_close(take(state.client_params, c), want, rtol=1e-5)
    acc = alg.evaluate(state, data, jax.random.key(9))["accuracy"]
    assert acc.shape == (3,) and np.all((acc >= 0) & (acc <= 1))
