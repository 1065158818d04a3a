"""FedPer: the mapped round equals a per-client loop; a client's head is never touched by others."""

import chex
import jax
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedper
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.algorithms.partial_oracle import check_against_state, initial, loop_round
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9, 15)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=2, steps=None)


def is_head(path):
    return path.startswith("params/head/")


def test_round_equals_loop_and_heads_stay_personal():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = fedper.build(MODEL, SPEC, clients_per_round=3, client_map="map")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    g, personal = initial(state, len(COUNTS))
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        before = state.client_params["params/head/kernel"]
        state, metrics = rnd(state, data, jax.random.key(7))
        g, personal, idx = loop_round(MODEL, SPEC, g, personal, data, jax.random.key(7), r, 3, is_head)
        check_against_state(state, g, personal, is_head)
        after = state.client_params["params/head/kernel"]
        for c in set(range(len(COUNTS))) - set(idx):  # heads of absent clients: untouched
            np.testing.assert_array_equal(after[c], before[c])
        assert not np.allclose(after[idx[0]], after[idx[1]])
    assert metrics["bytes_up"] == 3 * tree_bytes(state.global_params["params"]["hidden_0"])


@pytest.mark.parametrize("n", [0, 2])
def test_bad_local_layers(n):
    with pytest.raises(ValueError, match="local_layers"):
        fedper.build(MODEL, SPEC, local_layers=n)


def test_old_option_name_is_refused_naming_the_new_one():
    with pytest.raises(TypeError, match="personal_layers.*now 'local_layers'"):
        fedper.build(MODEL, SPEC, personal_layers=1)
