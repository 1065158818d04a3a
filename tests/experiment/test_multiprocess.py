"""Multi-process runs of the real binary: two CPU processes on 127.0.0.1 (jax.distributed,
gloo collectives), one device each, form one 2-device mesh and give the numbers of one
process with 2 devices; only process 0 writes; a 2-process run resumes from its
checkpoint; a process that cannot reach the coordinator, a process 0 whose peer never
joins, a process 0 whose peer is killed or hung during the run and a process 1 whose
process 0 (the one that started jax's coordination service) is killed each fail in one line.

Every process is bounded by a timeout; on any failure all are killed and their stderr
is shown.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from pfljax.experiment import peers
from pfljax.experiment.cli import EXIT_BAD_INPUT, EXIT_LOST_PEER
from tests.experiment.tiny import ROOT, TINY_FLAGS, binary_env

TIMEOUT = 240  # seconds for a wave of processes (a tiny run takes ~10 s on 2 cores)
RTOL = 1e-5
OUTPUTS = ("config.json", "data.json", "metrics.jsonl", "metrics.csv", "summary.json", "accuracy.png")


def free_port() -> int:
    """A TCP port nothing listens on now (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PEER_TIMEOUT = 12  # seconds: --peer_timeout of the lost-peer tests (the default 30 s works the same)


def command(args: list[str], workdir: str) -> list[str]:
    return [sys.executable, "-m", "experiments.main", *TINY_FLAGS, *args, f"--workdir={workdir}"]


def distributed(port: int, process_id: int, timeout: int = 60) -> list[str]:
    return [
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={process_id}",
        f"--initialization_timeout={timeout}",
    ]


def one_error_line(stderr: str) -> str:
    """The only `error:` line of a process that ended itself, with no C++ fatal error or traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr[-4000:]
    assert not re.search(r"^F\d{4} |Check failed|Fatal|Traceback", stderr, re.MULTILINE), stderr[-4000:]
    return errors[0]


def run_wave(commands: list[list[str]], devices: int = 1, timeout: float = TIMEOUT) -> list[dict]:
    """Starts every command at once (forced CPU devices each), waits for all; returns
    [{"rc", "stdout", "stderr", "seconds"}]. Kills them all on a timeout."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = binary_env(PYTHONPATH=ROOT, XLA_FLAGS=flags)
    with tempfile.TemporaryDirectory() as logs:
        files = [(open(f"{logs}/{i}.out", "w+"), open(f"{logs}/{i}.err", "w+")) for i in range(len(commands))]
        t0 = time.perf_counter()
        procs = [
            subprocess.Popen(c, cwd=ROOT, env=env, stdout=o, stderr=e) for c, (o, e) in zip(commands, files)
        ]
        timed_out = False
        try:
            for p in procs:
                p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for p, (o, e) in zip(procs, files):
            o.seek(0), e.seek(0)
            results.append({"rc": p.returncode, "stdout": o.read(), "stderr": e.read()})
            o.close(), e.close()
    seconds = time.perf_counter() - t0
    for r in results:
        r["seconds"] = seconds
    if timed_out:
        pytest.fail(f"processes ran past {timeout} s; killed\n{_shown(results)}")
    return results


def _shown(results: list[dict]) -> str:
    return "\n".join(
        f"--- process {i}, exit {r['rc']}:\n{r['stderr'][-4000:]}" for i, r in enumerate(results)
    )


def run_ok(commands: list[list[str]], devices: int = 1) -> list[dict]:
    results = run_wave(commands, devices)
    if any(r["rc"] != 0 for r in results):
        pytest.fail(f"a process failed\n{_shown(results)}")
    return results


def two_processes(args: list[str], workdir: str) -> list[dict]:
    port = free_port()
    return run_ok([command([*args, *distributed(port, i)], workdir) for i in range(2)])


def summary(workdir: str) -> dict:
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def rounds(workdir: str) -> list[int]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["round"] for line in f if line.strip()]


def assert_same_numbers(got: dict, want: dict) -> None:
    for key in ("final_mean_accuracy", "final_mean_loss", "per_client_accuracy", "best_mean_accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, err_msg=key)
    assert got["devices"] == want["devices"] == 2


def assert_process_0_wrote(results: list[dict], workdir: str, reference: str) -> None:
    """Process 0 reports; process 1 prints nothing of ours; one row per round (no second writer);
    the files of a single-process run, no more."""
    assert "final mean accuracy" in results[0]["stdout"]
    printed = [line for line in results[1]["stdout"].splitlines() if not line.startswith("[Gloo]")]
    assert printed == []  # gloo's C++ prints "[Gloo] Rank 1 is connected ..." to stdout
    assert rounds(workdir) == rounds(reference) == [1, 2]
    assert sorted(os.listdir(workdir)) == sorted(os.listdir(reference))
    assert all(os.path.exists(os.path.join(workdir, name)) for name in OUTPUTS)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process run with 2 devices of FedPer (the reference), the devices forced by
    the binary's own `--cpu_devices=2`. FedAvg over 2 processes was checked equal too (bit
    for bit) when this was built; one method keeps the test's process launches (and CI time)
    down."""
    root = tmp_path_factory.mktemp("single")
    names = ("fedper",)
    run_ok([command([f"--config.algorithm={n}", "--cpu_devices=2"], str(root / n)) for n in names])
    return {n: str(root / n) for n in names}


def test_two_processes_resume(single, tmp_path):
    """FedPer (personal layers in the client state) over 2 processes: 1 round, then
    resumed to 2 from the checkpoint, equals the uninterrupted single-process run with
    2 devices; only process 0 wrote outputs."""
    workdir = str(tmp_path / "fedper")
    two_processes(["--config.algorithm=fedper", "--config.rounds=1"], workdir)
    assert rounds(workdir) == [1]
    results = two_processes(["--config.algorithm=fedper"], workdir)
    assert all("resumed from round 1 of 2" in r["stderr"] for r in results)
    assert_same_numbers(summary(workdir), summary(single["fedper"]))
    assert_process_0_wrote(results, workdir, single["fedper"])


def test_unreachable_coordinator(tmp_path):
    """Process 1 alone, nobody at the address: one line naming it and the timeout, exit 2."""
    port = free_port()
    t0 = time.perf_counter()
    (result,) = run_wave([command(distributed(port, 1, timeout=3), str(tmp_path / "w"))], timeout=90)
    assert result["rc"] == 2, result["stderr"]
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"]
    line = lines[0]
    assert line.startswith("error: --coordinator_address=127.0.0.1:") and f":{port}" in line, line
    assert "--initialization_timeout=3 s" in line, line
    assert time.perf_counter() - t0 < 60


def test_vectorized_seeds_with_several_cpu_devices_run_on_one(tmp_path):
    """`compare --vectorize` with `--cpu_devices=2` (num_devices 0: all visible) runs its
    replicas on one device, with the numbers of the same sweep in a one-device process
    (it crashed with a device-to-device transfer error before)."""
    sweep = [sys.executable, "-m", "experiments.compare", *TINY_FLAGS, "--algorithms=fedavg"]
    sweep += ["--seeds=0,1", "--vectorize", "--config.data_seed=0"]
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    run_ok([[*sweep, "--cpu_devices=2", f"--workdir={two}"], [*sweep, f"--workdir={one}"]])
    for seed in (0, 1):
        got, want = (summary(os.path.join(w, "fedavg", f"seed_{seed}")) for w in (two, one))
        for key in ("final_mean_accuracy", "per_client_accuracy", "best_mean_accuracy"):
            np.testing.assert_allclose(got[key], want[key], rtol=RTOL, err_msg=key)


def test_peer_never_joins(tmp_path):
    """Process 0 alone with --num_processes=2: after --initialization_timeout, one line naming
    process 1 and the timeout, exit 2 (not XLA's fatal error, exit 134)."""
    port = free_port()
    t0 = time.perf_counter()
    (result,) = run_wave([command(distributed(port, 0, timeout=5), str(tmp_path / "w"))], timeout=90)
    assert result["rc"] == EXIT_BAD_INPUT, result["stderr"][-4000:]
    line = one_error_line(result["stderr"])
    assert line.startswith(
        "error: --num_processes=2: process 1 did not join the coordinator at 127.0.0.1:"
    ), line
    assert f":{port} " in line and "--initialization_timeout=5 s" in line, line
    assert time.perf_counter() - t0 < 5 + 45  # the timeout, plus start-up on a busy machine


@pytest.mark.parametrize("lost, signal_name", [(1, "SIGKILL"), (1, "SIGSTOP"), (0, "SIGKILL")])
def test_peer_lost_during_the_run(tmp_path, lost, signal_name):
    """2 processes; process 1 killed (SIGKILL) or hung (SIGSTOP), or process 0 (the one that
    started jax's coordination service) killed, once a checkpoint is written: the other ends
    within a bounded time with EXIT_LOST_PEER and one line naming the lost one, keeping the
    checkpoints written so far (jax alone prints a traceback, or waits in orbax's barrier,
    then ends in XLA's fatal error at its heartbeat timeout, ~100 s, exit 134; with process 0
    gone, its C++ client aborts at once, exit 134). A hung or killed process is found by its
    missing heartbeat (--peer_timeout, here PEER_TIMEOUT s) if no collective fails first."""
    workdir, port = tmp_path / "w", free_port()
    env = binary_env(PYTHONPATH=ROOT)
    args = ["--config.rounds=1000", f"--peer_timeout={PEER_TIMEOUT}"]
    logs = [(open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+")) for i in range(2)]
    procs = [
        subprocess.Popen(
            command([*args, *distributed(port, i)], str(workdir)), cwd=ROOT, env=env, stdout=o, stderr=e
        )
        for i, (o, e) in enumerate(logs)
    ]
    try:
        deadline = time.perf_counter() + TIMEOUT
        while not saved(workdir):
            assert all(p.poll() is None for p in procs) and time.perf_counter() < deadline, "no checkpoint"
            time.sleep(0.1)
        first = saved(workdir)
        procs[lost].send_signal(getattr(signal, signal_name))
        killed = time.perf_counter()
        try:
            rc = procs[1 - lost].wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = "still running after 60 s"
        seconds = time.perf_counter() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    logs[1 - lost][1].seek(0)
    stderr = logs[1 - lost][1].read()
    for o, e in logs:
        o.close(), e.close()
    assert rc == EXIT_LOST_PEER, stderr[-4000:]
    line = one_error_line(stderr)
    assert line.startswith(f"error: lost process {lost} of --num_processes=2 during the run ("), line
    assert "resume from the last checkpoint" in line, line
    assert seconds < PEER_TIMEOUT + 15  # at once when the collective in flight fails
    assert rounds(str(workdir))[0] == 1
    assert saved(workdir) and max(saved(workdir)) >= max(first)  # rerunning resumes from the last one


def saved(workdir) -> list[int]:
    """The rounds of the complete checkpoints in `workdir` (orbax names them by round)."""
    path = os.path.join(workdir, "checkpoints")
    return sorted(int(name) for name in os.listdir(path) if name.isdigit()) if os.path.isdir(path) else []


def test_peer_messages():
    """A failed gloo collective is found through an exception's causes (other errors are not);
    the lines name the missing or lost process when there is one other."""
    try:
        try:
            raise RuntimeError(
                "UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [::1]:1"
            )
        except RuntimeError as e:
            raise ValueError("while saving") from e
    except ValueError as e:
        assert peers.gloo_lost(e).startswith("UNKNOWN: Gloo AllGather failed")
    assert peers.gloo_lost(RuntimeError("Gloo: bad shape")) is None
    assert peers.gloo_lost(ValueError("Connection closed by peer")) is None
    assert "process 1 did not join" in peers.not_joined_message(0, 2, "h:1", 5)
    assert "not every process of 0 .. 2 joined" in peers.not_joined_message(1, 3, "h:1", 5)
    assert peers.lost_message(1, 2, None, "x").startswith("lost process 0 of --num_processes=2")
    assert peers.lost_message(0, 4, [2, 3], "x").startswith("lost processes 2, 3 of --num_processes=4")
    assert peers.lost_message(0, 4, None, "x").startswith("lost a process of --num_processes=4")
