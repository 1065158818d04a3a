"""SIGINT and SIGTERM that stop a run cleanly: `handled_signals()` and `Interrupted`.

Inside `handled_signals()` (the binaries' main), a signal raises `Interrupted`
at once, except while a run loop is in `deferred()`: there the first signal
only asks the loop to stop at the end of the block in flight (it checkpoints
that round, then raises `Interrupted` with it); a second signal stops at once,
losing the block in flight (the last checkpoint stays). Writes inside
`critical()` (checkpoints, output rows) always finish before a signal acts, so
nothing is left half written. Outside `handled_signals()` (library use)
signals keep Python's behaviour (KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A run stopped by a signal. `round`: the round of the run's newest checkpoint
    (0: none; None: stopped before its run loop), of `rounds`; `exit_code`: 128 +
    the signal's number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int, round: int | None = None, rounds: int | None = None):  # noqa: A002
        self.signum, self.round, self.rounds = signum, round, rounds
        self.during: str | None = None  # the run in flight (set by compare)
        self.completed: list[str] = []  # the runs completed before it (set by compare)
        super().__init__(signal.Signals(signum).name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    installed = False
    deferring = 0  # depth of deferred() sections
    critical = 0  # depth of critical() sections
    requested: int | None = None  # a signal that arrived while deferring
    pending: int | None = None  # a signal held back by a critical section


_STATE = _State()


def requested() -> int | None:
    """The signal that asked the run loop to stop after its block, if any."""
    return _STATE.requested


def _handler(signum, frame):  # noqa: ARG001
    if _STATE.critical:
        _STATE.pending = signum
        return
    if _STATE.deferring and _STATE.requested is None:
        _STATE.requested = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def handled_signals():
    """Installs the handlers for SIGINT and SIGTERM (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread() or _STATE.installed:
        yield
        return
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    _STATE.installed, _STATE.requested, _STATE.pending = True, None, None
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _STATE.installed = False


@contextlib.contextmanager
def deferred():
    """A run loop's section: a first signal sets `requested()` instead of raising."""
    _STATE.deferring += 1
    try:
        yield
    finally:
        _STATE.deferring -= 1
        if not _STATE.deferring:
            _STATE.requested = None


@contextlib.contextmanager
def critical():
    """A write that must finish: a signal during it acts when it ends."""
    _STATE.critical += 1
    try:
        yield
    finally:
        _STATE.critical -= 1
        signum, _STATE.pending = _STATE.pending, None
        if signum is not None and not _STATE.critical:
            _handler(signum, None)


@contextlib.contextmanager
def naming_runs(during: str, summaries: dict, seeds):
    """Names, on an `Interrupted` raised inside, the run in flight (`during`) and the
    runs completed so far (`summaries`: {label: summaries in seed order})."""
    try:
        yield
    except Interrupted as e:
        if e.during is None:
            e.during = during
            e.completed = [f"{lab} seed {s}" for lab, runs in summaries.items() for s in seeds[: len(runs)]]
        raise
