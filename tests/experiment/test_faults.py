"""Faults a run survives, on the real binary: SIGTERM mid-run (one line, exit 143, the
round checkpointed), a second writer refused, kill -9 during a checkpoint write; each
rerun ends exactly where an uninterrupted run does."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from tests.experiment.tiny import ROOT, TINY_FLAGS, binary_env

TIMEOUT = 120
# A run whose 2nd checkpoint write is cut by kill -9 after orbax started writing it.
KILLED_IN_WRITE = """
import os, runpy, signal, sys
from pfljax.experiment import checkpoint
save = checkpoint.Checkpoints.save
def cut(self, step, state, host):
    if step == 2:
        a = self.ocp.args
        items = a.Composite(state=a.StandardSave(state), host=a.JsonSave(host))
        self.manager.save(step, args=items, force=True)
        os.kill(os.getpid(), signal.SIGKILL)
    save(self, step, state, host)
checkpoint.Checkpoints.save = cut
sys.argv = ["experiments.main", *sys.argv[1:]]
runpy.run_module("experiments.main", run_name="__main__", alter_sys=True)
"""


def binary(*args: str, prefix=("-m", "experiments.main")) -> list[str]:
    return [sys.executable, *prefix, *TINY_FLAGS, *args]


def start(command: list[str]) -> subprocess.Popen:
    env = binary_env(PYTHONPATH=ROOT)
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, err


def rows(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in f]


def wait_for_rows(workdir: str, count: int, proc: subprocess.Popen) -> None:
    path, deadline = os.path.join(workdir, "metrics.jsonl"), time.monotonic() + TIMEOUT
    while not (os.path.exists(path) and len(open(path).readlines()) >= count):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_sigterm_a_second_writer_and_kill_during_a_checkpoint_write(tmp_path):
    w, full, cut = (str(tmp_path / d) for d in ("w", "full", "cut"))
    first = start(binary("--config.rounds=100000", f"--workdir={w}"))
    wait_for_rows(w, 2, first)
    # A second process on the same workdir: refused in one line, naming the holder.
    rc, err = finish(start(binary("--config.rounds=100000", f"--workdir={w}")))
    assert rc == 2 and err.strip().count("\n") == 0, err[-3000:]
    assert f"is in use by process {first.pid} on " in err
    # SIGTERM: the round in flight ends, is checkpointed, one line, exit 143.
    first.send_signal(signal.SIGTERM)
    rc, err = finish(first)
    last = err.strip().splitlines()[-1]
    assert rc == 143 and "Traceback" not in err, err[-3000:]
    stopped = int(re.match(r"interrupted by SIGTERM: stopped after round (\d+) of 100000; rerun", last)[1])
    assert os.path.isdir(os.path.join(w, "checkpoints", str(stopped))) and len(rows(w)) == stopped
    assert not os.path.exists(os.path.join(w, "run.lock"))
    # Resumed to two rounds more == uninterrupted; killed inside a checkpoint write, resumed == the same.
    rounds = f"--config.rounds={stopped + 2}"
    procs = [start(binary(rounds, f"--workdir={full}")), start(binary(rounds, f"--workdir={w}"))]
    procs.append(start(binary(rounds, f"--workdir={cut}", prefix=("-c", KILLED_IN_WRITE))))
    results = [finish(p) for p in procs]
    assert [rc for rc, _ in results] == [0, 0, -signal.SIGKILL], [err[-2000:] for _, err in results]
    assert rows(w) == rows(full)
    assert len(rows(cut)) >= 1
    rc, err = finish(start(binary(rounds, f"--workdir={cut}")))
    assert rc == 0, err[-3000:]
    assert "taking over the lock of process" in err  # the killed run's
    assert rows(cut) == rows(full)
