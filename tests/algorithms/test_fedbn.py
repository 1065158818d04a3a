"""FedBN: BatchNorm parameters and statistics never leave the client (per-client loop oracle)."""

import chex
import jax
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.algorithms import fedbn
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.algorithms.partial_oracle import check_against_state, initial, loop_round
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9)
MODEL = build_model(algorithms.model_variant("fedbn", "mlp"), (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.1, momentum=0.5), batch_size=4, steps=3, epochs=None)


def is_bn(path):
    return path.startswith(("batch_stats/", "params/bn_"))


def test_bn_statistics_untouched_by_aggregation():
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = fedbn.build(MODEL, SPEC, clients_per_round=3, client_map="map")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    g, personal = initial(state, len(COUNTS))
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(3):
        before = state.client_params["batch_stats/bn_0/mean"]
        state, metrics = rnd(state, data, jax.random.key(5))
        g, personal, idx = loop_round(MODEL, SPEC, g, personal, data, jax.random.key(5), r, 3, is_bn)
        # Each sampled client keeps exactly the statistics its own training produced.
        check_against_state(state, g, personal, is_bn)
        after = state.client_params["batch_stats/bn_0/mean"]
        for c in set(range(len(COUNTS))) - set(idx):
            np.testing.assert_array_equal(after[c], before[c])
    stats = state.client_params["batch_stats/bn_0/mean"]
    assert not np.allclose(stats[idx[0]], stats[idx[1]])
    shared = {k: v for k, v in state.global_params["params"].items() if not k.startswith("bn_")}
    assert metrics["bytes_up"] == 3 * tree_bytes(shared)


def test_model_variant_and_bad_model():
    assert algorithms.model_variant("fedbn", "mlp") == "mlp_bn"
    with pytest.raises(ValueError, match="model must be one of"):
        algorithms.model_variant("fedbn", "factorized_mlp")
    cnn = build_model(
        algorithms.model_variant("fedbn", "cnn"), (12, 12, 1), 4, channels=(2, 3), dense=(5,), kernel_size=3
    )
    assert fedbn.bn_leaves(cnn) == ("^batch_stats/", "^params/bn_0/", "^params/bn_1/")
    with pytest.raises(ValueError, match="BatchNorm"):
        fedbn.build(build_model("mlp", (6,), 3), SPEC)
