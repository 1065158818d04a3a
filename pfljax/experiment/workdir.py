"""One writer per output directory: `claim(workdir)`.

A run holds an advisory lock (`fcntl.flock`) on `<workdir>/run.lock` for as
long as it writes there; the file names the holder (pid, host, command). A
second process on the same workdir is refused with a ConfigError naming the
holder (exit 2 in the binaries). The kernel drops the lock of a process that
dies, even by `kill -9`; the next run takes it over and logs the dead holder.
A workdir that `claim` created and that is still empty when the claim ends
(an error before anything was written) is removed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys

from absl import logging

from pfljax.experiment.config import ConfigError

LOCK_NAME = "run.lock"


def check_workdir(workdir: str) -> None:
    """ConfigError unless `workdir` is (or can be made) a writable directory."""
    if not workdir:
        raise ConfigError("--workdir is empty: give an output directory")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir!r} is a file, not a directory: give a directory")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"--workdir={workdir!r} cannot be created ({e.strerror}): give a writable directory"
        ) from e
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise ConfigError(f"--workdir={workdir!r} is not writable: give a writable directory")


@contextlib.contextmanager
def claim(workdir: str, lock: bool = True):
    """Creates `workdir` if needed and holds its lock (`lock=False`: only creates it,
    for the processes of a multi-process run other than the one that writes)."""
    created = not os.path.isdir(workdir)
    check_workdir(workdir)
    fd = _acquire(workdir) if lock else None
    try:
        yield
    finally:
        if fd is not None:
            _release(workdir, fd)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(workdir)  # only succeeds when nothing was written


def holder(workdir: str) -> dict | None:
    """The lock file's record of who holds (or last held) `workdir`, or None."""
    try:
        with open(os.path.join(workdir, LOCK_NAME)) as f:
            return json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None


def _acquire(workdir: str) -> int:
    """The fd of the locked lock file; ConfigError when another live process holds it."""
    path = os.path.join(workdir, LOCK_NAME)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(_busy_message(workdir, holder(workdir))) from None
        try:  # the file may have been unlinked by its releasing holder between open and lock
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    stale = holder(workdir)
    if stale:
        logging.warning(
            "%s: taking over the lock of process %s on %s, which ended without releasing it",
            workdir, stale.get("pid"), stale.get("host"),
        )  # fmt: skip
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


def _release(workdir: str, fd: int) -> None:
    """Removes the lock file while still holding it, then unlocks."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(workdir, LOCK_NAME))
    os.close(fd)


def _busy_message(workdir: str, record: dict | None) -> str:
    who = (
        f"process {record.get('pid')} on {record.get('host')} ({record.get('command', '?')})"
        if record
        else "another process"
    )
    return f"--workdir={workdir!r} is in use by {who}: wait for it to end, stop it, or give another --workdir"
