"""Memory accounting: bytes of data and state, the largest C that fits, the one-line refusal."""

import jax
import optax
import pytest

from pfljax.algorithms import local
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.models import build_model
from pfljax.runtime.memory import ROUND_STATE_COPIES, check_fits, max_clients, memory_report
from tests.toydata import toy_pool_data

COUNTS = (9, 5, 12, 3)


def _report(available):
    model = build_model("mlp", (6,), 3, hidden=(8,))
    alg = local.build(model, LocalTraining(optax.sgd(0.1), batch_size=4, epochs=1), client_map="map")
    data = toy_pool_data(COUNTS)[0]
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    compiled = jax.jit(alg.round).lower(state, data, jax.random.key(1)).compile()
    return memory_report(state, data, compiled, available), state, data


def test_report_counts_every_byte_and_the_clients_that_fit():
    report, state, data = _report(available=10**12)
    # uint8 codes [29, 6], labels int32 [29], offsets and counts int32 [4], a 256-entry table: train and test.
    assert report["data_bytes"] == tree_bytes(data) == 2 * (29 * 6 + 29 * 4 + 2 * 4 * 4 + 256 * 4)
    assert report["state_bytes"] == tree_bytes(state)
    per_client = report["client_state_bytes_per_client"]
    assert per_client > 0 and report["fixed_state_bytes"] + 4 * per_client == report["state_bytes"]
    assert report["round_temp_bytes"] >= 0  # CPU gives memory_analysis()
    want = report["data_bytes"] + ROUND_STATE_COPIES * report["state_bytes"] + report["round_temp_bytes"]
    assert report["estimated_bytes"] == want
    # Room for exactly n clients (data per client + 4 state copies), then one byte less.
    n = 1000
    unit = report["data_bytes"] / 4 + ROUND_STATE_COPIES * per_client
    room = ROUND_STATE_COPIES * report["fixed_state_bytes"] + report["round_temp_bytes"] + int(n * unit) + 1
    assert max_clients(report, room) == n
    assert max_clients(report, room - int(unit)) == n - 1


def test_check_fits_refuses_in_one_line_naming_what_to_change():
    report, _, _ = _report(available=1000)
    assert report["max_clients"] == 0
    with pytest.raises(ValueError, match="lower --config.num_clients") as e:
        check_fits(report, "lower --config.num_clients")
    assert "\n" not in str(e.value) and "MiB are available" in str(e.value)
    check_fits(_report(available=10**12)[0], "unused")  # fits: no error
