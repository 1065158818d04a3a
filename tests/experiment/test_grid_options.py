"""A grid over an algorithm's float option, run as one program (`sweep.train_replicas`,
what `--vectorize --grid=<option>=...` runs), equals separate runs of each value:
fedprox.mu and ditto.lam, whose builds take the traced value (the domain check skips
it, the proximal term is kept for a traced weight)."""

import numpy as np
import pytest

from pfljax.experiment import ConfigError, sweep
from pfljax.experiment.config import base_config
from pfljax.experiment.train import train_and_evaluate
from tests.experiment.tiny import tiny_config

NUMBERS = ("best_mean_accuracy", "bytes_up_total", "bytes_down_total")


def config(algorithm, option, value):
    c = tiny_config(base_config(), algorithm=algorithm, rounds=2, checkpoint_every=0, eval_every=2)
    c.data_seed = 5
    c[algorithm][option] = value
    return c


@pytest.mark.parametrize(
    "algorithm,option,values", [("fedprox", "mu", (0.05, 5.0)), ("ditto", "lam", (0.1, 5.0))]
)
def test_grid_over_a_float_option_equals_separate_runs(tmp_path, algorithm, option, values):
    configs = [config(algorithm, option, v) for v in values]
    assert sweep.grid_target(configs[0], option) == algorithm
    grid = sweep.train_replicas(
        configs,
        [str(tmp_path / f"grid_{v}") for v in values],
        grid=[option],
        checkpoint_dir=str(tmp_path / "grid_checkpoints"),
    )
    # The oracle: a separate run of the second value (one compile, not one per value).
    for c, v, got in list(zip(configs, values, grid))[1:]:
        want = train_and_evaluate(c, str(tmp_path / f"separate_{v}"), progress=False)
        assert got["status"] == want["status"] == "completed"
        keys = [k for k in want if k.startswith(("final_", "per_client_")) or k in NUMBERS]
        assert "final_mean_loss" in keys and "per_client_accuracy" in keys
        for k in keys:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=f"{option}={v}: {k}")
    # The value reaches the program: the two grid points train different models.
    assert grid[0]["final_mean_loss"] != pytest.approx(grid[1]["final_mean_loss"], rel=1e-4)


def test_grid_values_outside_the_domain_are_refused(tmp_path):
    configs = [config("fedprox", "mu", v) for v in (0.1, 0.0)]
    with pytest.raises(ConfigError, match=r"config.fedprox.mu must be > 0, got 0.0"):
        sweep.train_replicas(
            configs, [str(tmp_path / "a"), str(tmp_path / "b")], grid=["mu"], checkpoint_dir=str(tmp_path)
        )
