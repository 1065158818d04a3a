"""Run outputs written as the run goes: JSON files, JSONL logs, TensorBoard events.

Workdir layout (see `pfljax.experiment.loop`):

    config.json        the config of the run (resolved: no "auto" fields)
    data.json          the partition: per client train/test sizes, classes, per-class counts
    partition.png      the label distribution (clients x classes)
    metrics.jsonl      one line per evaluated round
    metrics.csv        the same rows as a CSV table (appended as they come)
    traces.jsonl       non-scalar round metrics, one line per round that has any
    summary.json       at the end ("status": "completed" or "diverged")
    accuracy.png, loss.png, collaboration.png (plots)
    tensorboard/       TensorBoard event files
    checkpoints/       orbax checkpoints
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any

import numpy as np
from absl import logging


def jsonable(value: Any) -> Any:
    """numpy / jax scalars and arrays -> Python floats, ints and lists (NaN -> None)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        arr = np.asarray(value)
        if arr.ndim:
            return jsonable(arr.tolist())
        value = arr.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return value.item()
    return value


def write_text(path: str, text: str) -> None:
    """Writes `text` atomically (a temporary file, then rename): a reader or a killed
    writer never leaves half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, value: Any) -> None:
    """Writes JSON atomically (`write_text`)."""
    write_text(path, json.dumps(jsonable(value), indent=1) + "\n")


def write_csv(path: str, rows: list[dict]) -> None:
    """Writes `rows` as a CSV table (atomically): columns in order of first
    appearance, scalars only (lists are left out), empty cells for missing or
    non-finite values."""
    rows = [jsonable(r) for r in rows]
    columns = _columns(rows)
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows([_cells(row, columns) for row in rows])
    os.replace(tmp, path)


class CsvLog:
    """metrics.csv kept in step with metrics.jsonl by appending: written whole once
    (from the rows kept on resume), then one line per row; rewritten only when a
    row brings a new column (so a long run writes O(rounds) bytes)."""

    def __init__(self, path: str, rows: list[dict]):
        self.path, self.rows = path, [jsonable(r) for r in rows]
        self.columns = _columns(self.rows)
        write_csv(path, self.rows)

    def append(self, row: dict) -> None:
        row = jsonable(row)
        self.rows.append(row)
        if any(k not in self.columns for k in _columns([row])):
            self.columns = _columns(self.rows)
            write_csv(self.path, self.rows)
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(_cells(row, self.columns))


def _columns(rows: list[dict]) -> list[str]:
    """Scalar columns in order of first appearance (lists and dicts are left out)."""
    columns = []
    for row in rows:
        columns += [k for k, v in row.items() if k not in columns and not isinstance(v, list | dict)]
    return columns


def _cells(row: dict, columns: list[str]) -> dict:
    return {k: ("" if row.get(k) is None else row.get(k)) for k in columns}


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


class JsonlLog:
    """An append-only JSON-lines file of rows keyed by "round"."""

    def __init__(self, path: str):
        self.path = path

    def rows(self) -> list[dict]:
        """The rows; a line that does not parse (a write cut by a kill) is dropped with a warning."""
        if not os.path.exists(self.path):
            return []
        rows = []
        with open(self.path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    logging.warning("%s: line %d is cut short: dropped", self.path, number)
        return rows

    def truncate(self, last_round: int) -> list[dict]:
        """Keeps rows with round <= last_round (drops what a killed run wrote
        after its last checkpoint) and returns them."""
        kept = [r for r in self.rows() if r["round"] <= last_round]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
        return kept

    def append(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(jsonable(row)) + "\n")


class TensorBoard:
    """Scalars to TensorBoard event files (tensorboardX; no TensorFlow import).

    Args:
      logdir: event directory.
      purge_step: on resume, the first round written again; TensorBoard drops
        events at or after it from earlier writers.
    """

    def __init__(self, logdir: str, purge_step: int | None = None):
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

        self.writer = SummaryWriter(logdir, purge_step=purge_step, flush_secs=10)

    def scalars(self, step: int, values: dict) -> None:
        for name, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and value is not None:
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
