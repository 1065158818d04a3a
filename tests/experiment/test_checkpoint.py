"""Checkpoints: a checkpoint of another state layout is refused in one line and kept."""

from typing import Any, NamedTuple

import numpy as np
import pytest

from pfljax.experiment.checkpoint import Checkpoints
from pfljax.experiment.config import ConfigError


class Old(NamedTuple):
    params: Any
    round: Any


class New(NamedTuple):
    params: Any
    round: Any
    server_state: Any = ()


def test_a_checkpoint_of_another_layout_is_refused_and_left_in_place(tmp_path):
    directory = str(tmp_path / "checkpoints")
    saved = Old({"w": np.arange(3.0)}, np.array(2, np.int32))
    Checkpoints(directory).save(2, saved, {"round": 2})
    same = Checkpoints(directory).restore_latest(
        Old({"w": np.zeros(3)}, np.array(0, np.int32)), lambda *_: None
    )
    assert same[0] == 2 and same[2] == {"round": 2}
    np.testing.assert_array_equal(same[1].params["w"], saved.params["w"])
    other = Checkpoints(directory)
    with pytest.raises(ConfigError, match=r"checkpoint 2 .*first difference at 'server_state'") as e:
        other.restore_latest(New({"w": np.zeros(3)}, np.array(0, np.int32)), lambda *_: None)
    assert "\n" not in str(e.value) and "left in place" in str(e.value)
    assert other.latest() == 2 and not (tmp_path / "checkpoints.damaged").exists()
