"""A multi-process run that ends in one line when a process is missing.

Left to jax.distributed, a process that never joins ends the waiting ones with a C++ fatal
error (exit 134) after the initialization timeout, and a process lost during the run leaves
the others with a traceback from the failed gloo collective, then waiting at jax's shutdown
barrier until the heartbeat timeout (100 s) ends them with the same fatal error. Here:

- `initialize` runs jax.distributed.initialize under a watchdog thread (the call releases
  the GIL while it waits); past the timeout it prints one line naming who did not join and
  exits 2. jax gets longer timeouts (JAX_MARGIN_S more), so these checks speak first.
- `watch` then keeps a heartbeat per process in jax's key-value store: a process silent for
  --peer_timeout seconds (default 30; below jax's heartbeat timeout), or a collective failing on a closed
  peer connection, ends this process with one line and EXIT_LOST_PEER (5), without the
  shutdown barrier (os._exit); what was written (the last checkpoint) is kept.

- process 0 runs jax's coordination service in a child process of its own
  (`coordination_service.py`, `service_apart`) instead of inside itself, so that when
  process 0 dies the service (and its key-value store) stays for the others: they find
  process 0's heartbeat missing and end with the same line, where jax's clients would
  abort in C++ (exit 134) on losing the service.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time

from pfljax.experiment.cli import EXIT_BAD_INPUT, EXIT_LOST_PEER, fail

JAX_MARGIN_S = 60  # jax's own initialization and heartbeat timeouts exceed ours by this
BEAT_S = 1.0  # seconds between heartbeats
_KEY = "pfljax_peers/"
_GLOO_LOST = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "timed out")


def end(message: str, code: int) -> None:
    """cli.fail's line and exit code, from any thread and without Python's exit handlers
    (jax's would wait at the shutdown barrier for the lost process)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        fail(message, code)
    finally:
        os._exit(code)


def initialize(kwargs: dict, timeout: int, lost_after: float) -> None:
    """jax.distributed.initialize(**kwargs); past `timeout` seconds without every process
    joined, one line and exit 2. Then `watch`es the processes (lost: `lost_after` seconds
    without a heartbeat)."""
    import jax  # pylint: disable=import-outside-toplevel
    from jax._src import distributed  # pylint: disable=import-outside-toplevel

    joined = threading.Event()

    def not_joined() -> None:
        if not joined.wait(timeout):
            state = distributed.global_state  # the ids jax settled on (auto-detected ones too)
            end(
                not_joined_message(state.process_id, state.num_processes, state.coordinator_address, timeout),
                EXIT_BAD_INPUT,
            )

    threading.Thread(target=not_joined, daemon=True, name="pfljax-join").start()
    try:
        with service_apart(linger=lost_after + JAX_MARGIN_S):
            jax.distributed.initialize(
                **kwargs,
                initialization_timeout=timeout + JAX_MARGIN_S,
                heartbeat_timeout_seconds=int(lost_after) + JAX_MARGIN_S,
            )
    finally:
        joined.set()
    state = distributed.global_state
    watch(state.client, state.process_id, state.num_processes, lost_after)


class ServiceProcess:
    """jax's coordination service in a child process (`coordination_service.py`) that outlives
    this one by `linger` seconds; `shutdown` (jax's, at exit) ends it."""

    def __init__(self, address: str, num_processes: int, heartbeat_s: int, shutdown_s: int, linger: float):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "coordination_service.py")
        arguments = (address, num_processes, heartbeat_s, shutdown_s, os.getpid(), linger)
        self.process = subprocess.Popen(
            [sys.executable, script, *map(str, arguments)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the terminal's process group reaches process 0 only
        )

    def shutdown(self) -> None:
        """Asks the service to stop (it waits for the other processes' disconnects) and waits."""
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)


@contextlib.contextmanager
def service_apart(linger: float):
    """Within: jax.distributed.initialize starts its coordination service (process 0's) as a
    `ServiceProcess` instead of inside this process (jax has no option for it: the factory
    it calls is swapped for the duration)."""
    from jax._src import distributed  # pylint: disable=import-outside-toplevel

    factory = distributed._jax.get_distributed_runtime_service  # noqa: SLF001

    def start(address, num_nodes, heartbeat_timeout=100, shutdown_timeout=300, **_):
        return ServiceProcess(address, num_nodes, heartbeat_timeout, shutdown_timeout, linger)

    distributed._jax.get_distributed_runtime_service = start  # noqa: SLF001
    try:
        yield
    finally:
        distributed._jax.get_distributed_runtime_service = factory  # noqa: SLF001


def not_joined_message(process_id: int, num_processes: int, address: str | None, timeout: int) -> str:
    """The line of a run whose processes did not all join."""
    if num_processes == 2:
        who = f"process {1 - process_id} did not join"
    else:
        who = f"not every process of 0 .. {num_processes - 1} joined"
    return (
        f"--num_processes={num_processes}: {who} the coordinator at {address} within "
        f"--initialization_timeout={timeout} s (process {process_id} waited); start every process "
        f"(--process_id=0 .. {num_processes - 1}) with the same --coordinator_address and --num_processes, "
        "or give a longer --initialization_timeout when some start later"
    )


def lost_message(process_id: int, num_processes: int, lost: list[int] | None, what: str) -> str:
    """The line of a run that lost processes `lost` (None: unknown) while it ran."""
    if lost is None and num_processes == 2:
        lost = [1 - process_id]
    names = ", ".join(map(str, lost or []))
    who = "a process" if not lost else f"process {names}" if len(lost) == 1 else f"processes {names}"
    return (
        f"lost {who} of --num_processes={num_processes} during the run ({what}); process {process_id} "
        "stops. What was written is kept: rerun the same commands on every process to resume from the "
        "last checkpoint"
    )


def gloo_lost(exc: BaseException) -> str | None:
    """The message of a collective that failed on a closed or silent peer connection (in `exc`
    or its causes), else None."""
    while exc is not None:
        text = str(exc)
        if "Gloo" in text and any(s in text.lower() for s in _GLOO_LOST):
            return " ".join(text.split())[:300]
        exc = exc.__cause__ or exc.__context__
    return None


def watch(client, process_id: int, num_processes: int, lost_after: float) -> None:
    """Ends this process with one line and EXIT_LOST_PEER when another is lost: a collective
    failing on its connection (an uncaught exception, through sys.excepthook) or its heartbeat
    silent for `lost_after` seconds (a thread)."""
    exiting = threading.Event()
    atexit.register(exiting.set)  # runs before jax's shutdown (registered when jax was imported)
    previous = sys.excepthook

    def hook(kind, exc, tb):
        what = gloo_lost(exc)
        if what is None:
            previous(kind, exc, tb)
            return
        end(lost_message(process_id, num_processes, None, f"a collective failed: {what}"), EXIT_LOST_PEER)

    sys.excepthook = hook
    threading.Thread(
        target=_heartbeat,
        args=(client, process_id, num_processes, exiting, lost_after),
        daemon=True,
        name="pfljax-peers",
    ).start()


def _heartbeat(client, process_id: int, num_processes: int, exiting: threading.Event, lost_after) -> None:
    """Writes this process's count every BEAT_S seconds and reads the others'; ends the process
    when one stays unchanged `lost_after` seconds. An error of the store after the run's exit
    began (jax's shutdown) stops the thread; before, the coordinator (process 0) is gone."""
    seen = {j: ("", time.monotonic()) for j in range(num_processes) if j != process_id}
    count = 0
    while True:
        count += 1
        try:
            client.key_value_set(f"{_KEY}{process_id}", str(count), True)
            beats = dict(client.key_value_dir_get(_KEY))
        except Exception as e:  # noqa: BLE001  jax's client raises its own error types
            if exiting.is_set():
                return
            end(
                lost_message(process_id, num_processes, [0], f"its coordinator: {str(e)[:200]}"),
                EXIT_LOST_PEER,
            )
        now = time.monotonic()
        for j, (value, _) in seen.items():
            beat = beats.get(f"{_KEY}{j}", "")
            if beat != value:
                seen[j] = (beat, now)
        lost = [j for j, (_, since) in seen.items() if now - since > lost_after]
        if lost:
            end(
                lost_message(process_id, num_processes, lost, f"no heartbeat for {lost_after:g} s"),
                EXIT_LOST_PEER,
            )
        time.sleep(BEAT_S)
