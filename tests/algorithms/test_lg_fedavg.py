"""LG-FedAvg: the first layers stay local, the last ones are averaged (per-client loop oracle)."""

import chex
import jax
import numpy as np
import optax
import pytest

from pfljax.algorithms import lg_fedavg
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.algorithms.partial_oracle import check_against_state, initial, loop_round
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model("mlp", (6,), 3, hidden=(8, 5))
SPEC = LocalTraining(optax.sgd(0.2), batch_size=4, steps=3, epochs=None)


def is_representation(path):
    return path.startswith(("params/hidden_0/", "params/hidden_1/"))


def test_first_layers_local_head_global():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = lg_fedavg.build(MODEL, SPEC, clients_per_round=4, local_layers=2, client_map="vmap")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    g, personal = initial(state, len(COUNTS))
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(3))
        g, personal, idx = loop_round(
            MODEL, SPEC, g, personal, data, jax.random.key(3), r, 4, is_representation
        )
        check_against_state(state, g, personal, is_representation)
    reps = state.client_params["params/hidden_0/kernel"]
    assert not np.allclose(reps[idx[0]], reps[idx[1]])
    assert metrics["bytes_up"] == 4 * tree_bytes(state.global_params["params"]["head"])


@pytest.mark.parametrize("n", [0, 3])
def test_bad_local_layers(n):
    with pytest.raises(ValueError, match="local_layers"):
        lg_fedavg.build(MODEL, SPEC, local_layers=n)
