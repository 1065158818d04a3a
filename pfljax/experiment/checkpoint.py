"""Orbax checkpoints of a run: the algorithm state plus the host loop's totals.

A checkpoint holds the unpadded state (C client rows, numpy, so it does not
depend on the device count) and a JSON dict with the running totals and the
config it was written under, which `check_config` compares on resume.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

from absl import logging

from pfljax.experiment.config import RESUMABLE_FIELDS, ConfigError, base_config, to_plain

# What orbax says when a checkpoint's tree has other fields than the restore template.
LAYOUT_MISMATCH = "tree structures do not match:"


class Checkpoints:
    """Saves and restores (state, host) pairs under `directory`, keeping the last `keep`."""

    def __init__(self, directory: str, keep: int = 2):
        import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

        self.ocp = ocp
        self.directory = directory
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, host: dict) -> None:
        args = self.ocp.args
        self.manager.save(
            step, args=args.Composite(state=args.StandardSave(state), host=args.JsonSave(host)), force=True
        )
        self.manager.wait_until_finished()

    def restore_host(self, step: int) -> dict:
        args = self.ocp.args
        return self.manager.restore(step, args=args.Composite(host=args.JsonRestore())).host

    def restore(self, step: int, template: Any) -> tuple[Any, dict]:
        """(state shaped like `template`, host dict) of checkpoint `step`."""
        args = self.ocp.args
        out = self.manager.restore(
            step, args=args.Composite(state=args.StandardRestore(template), host=args.JsonRestore())
        )
        return out.state, out.host

    def restore_latest(self, template: Any, check: Callable[[int, dict], None]) -> tuple[int, Any, Any]:
        """(step, state, host) of the newest checkpoint that restores, or (0, template,
        None) when there is none. `check(step, host)` sees each host dict before its
        state is read (its ConfigError propagates). A checkpoint that fails to restore is moved
        to `<directory>.damaged/<step>` with a warning and the one before is tried; when
        none restores: ConfigError saying how to start fresh."""
        damaged = []
        _drop_closed_loop_errors()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                host = self.restore_host(step)
            except Exception as e:  # noqa: BLE001  any failure to read is damage
                damaged.append(self._set_aside(step, e))
                continue
            check(step, host)
            try:
                return (step, *self.restore(step, template))
            except Exception as e:  # noqa: BLE001
                if LAYOUT_MISMATCH in str(e):
                    raise ConfigError(self._layout_message(step, e)) from None
                damaged.append(self._set_aside(step, e))
        if damaged:
            raise ConfigError(
                f"no checkpoint in {self.directory!r} restores (damaged, moved to {self.directory}.damaged: "
                f"{', '.join(damaged)}); to start fresh, give another --workdir or delete {self.directory!r}"
            )
        return 0, template, None

    def _layout_message(self, step: int, error: Exception) -> str:
        """One line for a checkpoint whose state has other fields than this run's (written by
        another pfljax version): it is left in place, not taken for damage."""
        lines = str(error).split(LAYOUT_MISMATCH, 1)[1].splitlines()
        first = next((line.strip().rstrip(":") for line in lines if line.strip()), "?")
        return (
            f"checkpoint {step} in {self.directory!r} holds a state laid out otherwise than this run's "
            f"(first difference at {first!r}: written by another pfljax version); resume it with that "
            f"version, or start fresh with another --workdir (the checkpoint is left in place)"
        )

    def _set_aside(self, step: int, error: Exception) -> str:
        """Moves checkpoint `step` out of the manager's directory; returns its name."""
        aside = f"{os.path.abspath(self.directory)}.damaged"
        os.makedirs(aside, exist_ok=True)
        target = os.path.join(aside, str(step))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(os.path.join(os.path.abspath(self.directory), str(step)), target)
        self.manager.reload()
        message = " ".join(str(error).split())[:200]
        logging.warning(
            "checkpoint %d in %s does not restore (%s: %s): moved to %s; trying the one before",
            step, self.directory, type(error).__name__, message, target,
        )  # fmt: skip
        return str(step)

    def close(self) -> None:
        self.manager.close()


def _drop_closed_loop_errors() -> None:
    """After a failed orbax restore, tensorstore's pending reads report into the closed
    asyncio loop of that call ('Event loop is closed', unraisable: a traceback on
    stderr each); the failure itself is reported in one warning. Drops those only."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop", False):
        return

    def hook(unraisable):
        closed = isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
            unraisable.exc_value
        )
        if not closed:
            previous(unraisable)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook


def check_config(saved: dict, current: dict, workdir: str) -> None:
    """ConfigError unless the configs agree on every field outside RESUMABLE_FIELDS. A
    field the saved config lacks (added to pfljax since) counts as its default there."""
    saved, current = flat_fields(saved), flat_fields(current)
    defaults = flat_fields(to_plain(base_config()))
    saved = {**{k: defaults.get(k) for k in set(current) - set(saved)}, **saved}
    keys = sorted((set(saved) | set(current)) - set(RESUMABLE_FIELDS))
    differ = [k for k in keys if saved.get(k) != current.get(k)]
    if differ:
        shown = "; ".join(
            f"{k}: {_short(saved.get(k))} there, {_short(current.get(k))} now" for k in differ[:4]
        )
        more = f"; and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise ConfigError(
            f"--workdir={workdir!r} holds a checkpoint of a different config (fields differ: {shown}{more}); "
            f"use another --workdir or the same config"
        )


def flat_fields(plain: dict, prefix: str = "") -> dict:
    """{"fedavg.server_lr": 1.0, ...}: a plain config's option groups flattened (model_kwargs kept whole)."""
    out = {}
    for key, value in plain.items():
        if isinstance(value, dict) and key != "model_kwargs" and not prefix:
            out.update(flat_fields(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
