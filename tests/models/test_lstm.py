"""The char LSTM: output shapes, and a FedAvg round on it (vmapped) against a per-client loop."""

import chex
import jax
import numpy as np
import optax

from pfljax.algorithms import fedavg
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.types import ClientData
from pfljax.data import pool_clients
from pfljax.models import build_model

COUNTS = (5, 3, 7)
MODEL = build_model("char_lstm", (5,), 80, embed=4, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.5), batch_size=2, epochs=1, steps=None)


def test_shapes_last_position_and_every_position():
    x = jax.ShapeDtypeStruct((3, 5), np.int32)
    assert jax.eval_shape(MODEL.apply, MODEL.template(), x)[0].shape == (3, 80)
    seq = build_model("char_lstm", (5,), 90, embed=4, hidden=(8, 6), last_only=False)
    variables = seq.template()
    assert jax.eval_shape(seq.apply, variables, x)[0].shape == (3, 5, 90)
    assert variables["params"]["embedding"]["embedding"].shape == (90, 4)
    assert variables["params"]["lstm_1"]["if"]["kernel"].shape == (8, 6)
    assert variables["params"]["head"]["kernel"].shape == (6, 90)


def test_vmapped_round_equals_per_client_loop():
    rng = np.random.default_rng(0)
    pools = [
        pool_clients([rng.integers(0, 80, (n, 5)) for n in COUNTS], [rng.integers(0, 80, n) for n in COUNTS])
        for _ in "tt"
    ]
    data = ClientData(*pools)
    assert data.train.x.dtype == np.int32
    alg = fedavg.build(MODEL, SPEC, client_map="vmap")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    ref = state.global_params
    train = jax.jit(make_local_train(MODEL.apply, SPEC))
    for r in range(2):
        state, metrics = jax.jit(alg.round)(state, data, jax.random.key(3))
        _, train_key = round_keys(jax.random.key(3), r)
        outs = [train(ref, take(data.train, c), client_key(train_key, c)).params for c in range(len(COUNTS))]
        ref = jax.tree.map(
            lambda *xs: sum(n / sum(COUNTS) * np.asarray(x) for n, x in zip(COUNTS, xs)), *outs
        )
        chex.assert_trees_all_close(state.global_params, ref, rtol=1e-5, atol=1e-6)
    assert np.isfinite(metrics["train_loss"])
