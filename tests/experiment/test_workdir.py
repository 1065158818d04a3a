"""One writer per workdir: the lock, its holder in the refusal, a dead holder's lock taken
over, and a workdir created for a run that failed before writing removed again."""

import json
import os

import pytest

from pfljax.experiment import ConfigError
from pfljax.experiment.workdir import LOCK_NAME, claim, holder


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    w = str(tmp_path / "run")
    with claim(w):
        record = holder(w)
        assert record["pid"] == os.getpid() and record["host"]
        with pytest.raises(ConfigError, match=rf"--workdir='{w}' is in use by process {os.getpid()} on "):
            with claim(w):
                pass
        assert holder(w) == record  # the refused claim changed nothing
    assert not os.path.exists(os.path.join(w, LOCK_NAME))  # released
    with claim(w):  # free again
        pass


def test_the_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    w = tmp_path / "run"
    w.mkdir()
    (w / LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "command": "x"}))
    with claim(str(w)):
        assert holder(str(w))["pid"] == os.getpid()
    assert "taking over the lock of process 999999 on elsewhere" in caplog.text


def test_a_workdir_created_for_a_failed_run_is_removed_and_an_existing_one_kept(tmp_path):
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    os.mkdir(old)
    for w in (new, old):
        with pytest.raises(ConfigError, match="boom"):
            with claim(w):
                raise ConfigError("boom")
    assert not os.path.exists(new) and os.listdir(old) == []
    with claim(new):
        open(os.path.join(new, "config.json"), "w").close()
    assert os.listdir(new) == ["config.json"]  # something written: kept


def test_without_the_lock_only_the_directory_is_made(tmp_path):
    w = str(tmp_path / "run")
    with claim(w, lock=False):
        assert os.path.isdir(w) and holder(w) is None
    open(w + "_file", "w").close()
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        with claim(w + "_file"):
            pass
