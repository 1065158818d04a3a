"""RunSettings: the schedule's blocks, the DP budget, and what `run_settings` reads of a config."""

import numpy as np
import pytest

from pfljax.core import privacy
from pfljax.experiment import base_config
from pfljax.experiment.config import data_title, dp_delta, resolve, run_settings
from pfljax.experiment.settings import MAX_BLOCK_BYTES, MAX_BLOCK_ROUNDS, Accounting, Schedule
from tests.experiment.tiny import tiny_config


def test_blocks_end_at_checkpoints_and_the_end():
    s = Schedule(rounds=12, eval_every=2, checkpoint_every=5)
    assert s.block_length(0, 12, 0) == 5
    # Blocks of 5 from round 0: 0..5, 5..10, 10..12; resumed at 3, the first block ends at 5.
    assert [s.block_end(r, 12, 5) for r in (0, 5, 10, 3)] == [5, 10, 12, 5]
    assert [r for r in range(13) if s.is_checkpoint(r, 12)] == [0, 5, 10, 12]
    assert Schedule(rounds=7, block_rounds=3).block_length(0, 7, 0) == 3
    every_round_fits = Schedule(rounds=500, checkpoint_every=0)
    assert every_round_fits.block_length(0, 500, 0) == MAX_BLOCK_ROUNDS
    assert every_round_fits.block_length(0, 500, MAX_BLOCK_BYTES // 7) == 7
    assert every_round_fits.block_length(0, 500, 2 * MAX_BLOCK_BYTES) == 1
    assert every_round_fits.block_end(120, 500, 100) == 220


def test_the_budget_stops_before_the_round_that_passes_it():
    acc = Accounting(1.0, 1.0, 1e-5, 0.0, num_clients=1000, clients_per_round=50)
    eps = acc.epsilons(40)
    np.testing.assert_allclose(eps, privacy.epsilons(1.0, 1000, 50, 40, 1e-5))
    assert acc.last_round(eps, 40) == 40  # no target
    target = float(eps[17] + eps[18]) / 2  # round 18 passes it
    capped = Accounting(1.0, 1.0, 1e-5, target, 1000, 50)
    assert capped.last_round(eps, 40) == 17
    assert capped.report(eps, 17)["dp_epsilon"] == pytest.approx(eps[17])


def test_run_settings_read_the_resolved_config():
    config = resolve(tiny_config(base_config(), rounds=9, eval_every=3, clients_per_round=4))[0]
    s = run_settings(config)
    assert (s.algorithm, s.seed, s.rounds, s.num_clients) == (
        config.algorithm,
        config.seed,
        9,
        config.num_clients,
    )
    assert s.schedule == Schedule(9, 3, config.checkpoint_every, config.block_rounds)
    assert s.title == data_title(config) and s.dp is None and s.epsilons() is None and s.last_round(None) == 9
    assert s.placement.clients_per_round == 4 and s.placement.storage == "device"
    assert f"learning_rate={config.learning_rate:g}" in s.divergence_knobs
    config.dp.enabled = True
    s = run_settings(config)
    assert s.dp.delta == dp_delta(config) and s.dp.clients_per_round == 4
    assert "dp.noise_multiplier=1" in s.divergence_knobs
    message = s.divergence_message(3, "train loss nan", "/w")
    assert message.startswith(f"{config.algorithm} diverged at round 3 of 9 (train loss nan); usual causes: ")
    assert message.endswith("outputs up to round 2 kept in /w (summary.json status 'diverged')")
