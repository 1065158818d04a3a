"""The progress of a run: a tqdm bar on a terminal, else one absl log line per evaluated block."""

from __future__ import annotations

import sys
import time

import numpy as np
from absl import logging


class Progress:
    """A tqdm bar on a terminal; elsewhere one absl log line per block with an
    evaluation (round, mean / worst-10% accuracy over the running replicas,
    losses, seconds per round, ETA)."""

    def __init__(self, enabled: bool, start: int, total: int, name: str):
        self.start, self.total, self.name = start, total, name
        self.t0 = time.perf_counter()
        self.logged = start
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm  # pylint: disable=import-outside-toplevel

            self.bar = tqdm(total=total, initial=start, desc=name, unit="round", dynamic_ncols=True)
        self.enabled = enabled

    def block(self, n: int, latest: list[dict], r: int) -> None:
        """After a block of n rounds ending at round r; `latest`: each running replica's last row."""
        fresh = [row for row in latest if row["round"] > self.logged]
        if fresh:
            self.logged = max(row["round"] for row in fresh)
        if self.bar is not None:
            self.bar.update(n)
            if fresh:
                self.bar.set_postfix(acc=f"{np.mean([x['mean_accuracy'] for x in fresh]):.4f}")
            return
        if not (self.enabled and fresh):
            return
        mean = lambda key: float(np.mean([x.get(key, np.nan) for x in fresh]))  # noqa: E731
        per_round = (time.perf_counter() - self.t0) / max(r - self.start, 1)
        logging.info(
            "%s round %d/%d: mean acc %.4f, worst-10%% acc %.4f, train loss %.4g, test loss %.4g, "
            "%.3f s/round, ETA %s%s",
            self.name,
            self.logged,
            self.total,
            mean("mean_accuracy"),
            mean("worst10_accuracy"),
            mean("train_loss"),
            mean("mean_loss"),
            fresh[0]["seconds"],
            _duration(per_round * (self.total - r)),
            f" (mean of {len(fresh)} running replicas)" if len(latest) > 1 else "",
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
