"""The run loop, one for a single run and for R replicas (seeds, grid points).

`train.train_and_evaluate` (one run, sharded over the devices or its clients in host
memory) and `sweep.train_replicas` (R replicas as one program) build a
`runners.Runner` and call `execute`. The rounds between two host events (a
checkpoint, the end of the run, a DP budget stop, at most `block_rounds` rounds) run
as ONE compiled block (`pfljax.runtime.blocks`), evaluation included where it falls;
the host then writes what the block returns, once per block:

    metrics.jsonl / metrics.csv   one row per evaluated round (appended)
    traces.jsonl                  non-scalar round metrics (appended)
    tensorboard/                  the same scalars
    checkpoints                   at every checkpoint round and the end

A run whose round is not finite (train loss, parameters, test loss) stops there:
the host names that round, the block kept the state of the round before, and
the summary says "diverged" (a replica that diverges leaves the others
running). `seconds` in a row is the wall time of its block divided by the rounds
in it (evaluation included); `block_rounds=1` times each round alone.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pfljax.experiment import interrupts, plots
from pfljax.experiment.checkpoint import check_config
from pfljax.experiment.config import ConfigError
from pfljax.experiment.outputs import CsvLog, JsonlLog, TensorBoard, jsonable, write_json
from pfljax.experiment.progress import Progress
from pfljax.experiment.reports import evaluation_row, finish, write_summary
from pfljax.experiment.runners import Runner
from pfljax.experiment.settings import Schedule
from pfljax.runtime.blocks import BlockOut
from pfljax.runtime.memory import check_fits

EXPLODING_LOSS = 1e6  # a finite train loss above this times round 1's (when positive) is a divergence
MEMORY_HINT = (
    "lower --config.num_clients or --config.samples_per_client, pick a smaller --config.model, "
    "spread the clients over more devices (--config.num_devices), or keep them in host memory "
    "(--config.client_storage=host, with clients_per_round)"
)


def new_host() -> dict:
    """A run's running totals (checkpointed with its state)."""
    return {
        "bytes_up_total": 0.0,
        "bytes_down_total": 0.0,
        "best_mean_accuracy": None,
        "round_seconds": [],
        "diverged": None,
        "first_train_loss": None,
    }


class Replica:
    """One run's host side: its settings (`prep.settings`), workdir, outputs and running totals."""

    def __init__(self, prep, workdir: str, host: dict, start: int, primary: bool = True):
        self.settings, self.prep, self.workdir, self.host = prep.settings, prep, workdir, host
        host.setdefault("diverged", None)
        host.setdefault("first_train_loss", None)
        self.primary = primary
        self.per_client = None
        metrics_log = JsonlLog(os.path.join(workdir, "metrics.jsonl"))
        self.rows = metrics_log.truncate(start) if primary else []
        if not primary:
            return
        self.metrics_log, self.traces_log = metrics_log, JsonlLog(os.path.join(workdir, "traces.jsonl"))
        self.traces_log.truncate(start)
        self.csv = CsvLog(os.path.join(workdir, "metrics.csv"), self.rows)
        self.tb = TensorBoard(os.path.join(workdir, "tensorboard"), purge_step=start + 1 if start else None)

    def record(self, rnd: int, scalars: dict, traces: dict, seconds: float) -> None:
        """A good round's totals and traces."""
        self.host["round_seconds"].append(seconds)
        self.host["bytes_up_total"] += scalars.get("bytes_up", 0.0)
        self.host["bytes_down_total"] += scalars.get("bytes_down", 0.0)
        if traces and self.primary:
            self.traces_log.append({"round": rnd, **traces})

    def evaluated(self, row: dict, per_client: dict) -> None:
        """An evaluated round's row, appended to every output."""
        self.per_client = per_client
        best = self.host["best_mean_accuracy"]
        self.host["best_mean_accuracy"] = (
            row["mean_accuracy"] if best is None else max(best, row["mean_accuracy"])
        )
        self.rows.append(jsonable(row))
        if self.primary:
            self.metrics_log.append(row)
            self.csv.append(row)
            self.tb.scalars(row["round"], {k: v for k, v in jsonable(row).items() if k != "round"})

    def close(self) -> None:
        if self.primary:
            self.tb.close()


def split_metrics(metrics: dict) -> tuple[dict, dict]:
    """(scalars as floats, non-scalar arrays) of a round's metrics."""
    scalars, traces = {}, {}
    for key, value in metrics.items():
        value = np.asarray(value)
        if value.ndim == 0:
            scalars[key] = value.item()
        else:
            traces[key] = value
    return scalars, traces


def non_finite(loss, params_finite: bool, per_client: dict | None = None, first_loss=None) -> str:
    """'' when the round is finite, else what was not (train loss, parameters, test
    loss), or a train loss above EXPLODING_LOSS times round 1's (`first_loss`)."""
    what = []
    if loss is not None and not np.isfinite(loss):
        what.append(f"train loss {loss}")
    elif loss is not None and first_loss and first_loss > 0 and loss > EXPLODING_LOSS * first_loss:
        what.append(f"train loss {loss:.4g} > {EXPLODING_LOSS:g} x round 1's {first_loss:.4g}")
    if not params_finite:
        what.append("non-finite parameters")
    if per_client is not None:
        count = np.asarray(per_client["count"])
        test = np.asarray(per_client["loss"], np.float64)[count > 0]
        if not np.all(np.isfinite(test)):
            what.append(f"test loss not finite on {int(np.sum(~np.isfinite(test)))} of {len(test)} clients")
    return ", ".join(what)


def _at(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


def read_block(out: BlockOut, runner: Runner, reps: list, first: int, seconds: float, eps) -> None:
    """Writes what a block returned (host arrays) into each replica's outputs."""
    for i in np.nonzero(out.ran)[0]:
        rnd = first + int(i)
        for r, rep in enumerate(reps):
            if rep.host["diverged"] is not None:
                continue
            scalars, traces = split_metrics(runner.take(_at(out.metrics, i), r))
            evaluated = bool(out.evaluated[i])
            per_client = runner.take(_at(out.evaluation, i), r) if evaluated else None
            loss, first_loss = scalars.get("train_loss"), rep.host["first_train_loss"]
            exploded = bool(non_finite(loss, True, None, first_loss))
            if exploded or not bool(np.asarray(runner.take(out.ok[i], r))):
                state_ok = bool(np.asarray(runner.take(out.state_finite[i], r)))
                what = non_finite(loss, state_ok, per_client, first_loss) or "non-finite round"
                rep.host["diverged"] = {"round": rnd, "train_loss": str(loss), "what": what}
                continue
            if first_loss is None and loss is not None:
                rep.host["first_train_loss"] = float(loss)
            rep.record(rnd, scalars, traces, seconds)
            if evaluated:
                row = {"round": rnd, **scalars, **evaluation_row(per_client), "seconds": seconds}
                if eps is not None:
                    row["dp_epsilon"] = float(eps[rnd])
                rep.evaluated(row, per_client)


def compile_block(runner: Runner, schedule: Schedule, state, start: int):
    """(the AOT-compiled block, its length L, the seconds compiling took). L is first
    taken without the memory cap; the block is lowered again only if its stacked
    outputs would pass MAX_BLOCK_BYTES."""
    t0 = time.perf_counter()
    steps = jnp.zeros(4, jnp.int32)
    length = schedule.block_length(start, schedule.rounds, 0)
    lowered = runner.block_for(length).lower(state, *runner.args, steps)
    outputs = jax.tree.leaves(lowered.out_info[1])
    per_round = sum(np.prod(x.shape) * x.dtype.itemsize for x in outputs) // length
    capped = schedule.block_length(start, schedule.rounds, int(per_round))
    if capped != length:
        length, lowered = capped, runner.block_for(capped).lower(state, *runner.args, steps)
    return lowered.compile(), length, time.perf_counter() - t0


def run_loop(runner: Runner, compiled, length: int, reps: list, state, start: int, progress: bool = True):
    """Runs rounds start+1 .. the end (the schedule's rounds or the DP budget) block by block;
    returns (state, end, eps). Writes outputs and checkpoints as it goes."""
    settings = reps[0].settings
    schedule, eps = settings.schedule, settings.epsilons()
    end = max(settings.last_round(eps), start)
    bar = Progress(progress and reps[0].primary, start, settings.rounds, settings.algorithm)
    r = saved = start
    try:
        with interrupts.deferred():
            while r < end and running(reps):
                stop = schedule.block_end(r, end, length)
                steps = runner.place(np.array([r, stop, schedule.eval_every, end], np.int32))
                t0 = time.perf_counter()
                with jax.transfer_guard("disallow"):
                    state, out = compiled(state, *runner.args, steps)
                out = jax.device_get(out)
                seconds = (time.perf_counter() - t0) / (stop - r)
                with interrupts.critical():
                    read_block(out, runner, reps, r + 1, seconds, eps)
                    bar.block(stop - r, [rep.rows[-1] for rep in reps if running([rep]) and rep.rows], stop)
                    r = stop
                    signum = interrupts.requested()
                    if (schedule.is_checkpoint(r, end) or signum) and running(reps):
                        runner.save(r, state, [rep.host for rep in reps])
                        saved = r
                if signum:
                    raise interrupts.Interrupted(signum)
    except interrupts.Interrupted as e:
        raise interrupts.Interrupted(e.signum, saved, settings.rounds) from None
    finally:
        bar.close()
        for rep in reps:
            rep.close()
    if r == end < settings.rounds:
        logging.info(
            "stop before round %d: epsilon %.3f > target %g", r + 1, eps[r + 1], settings.dp.target_epsilon
        )
    if any(rep.per_client is None and rep.host["diverged"] is None for rep in reps):  # resumed at the end
        per_client = runner.evaluate_at(state, end)
        for i, rep in enumerate(reps):
            rep.per_client = runner.take(per_client, i)
    return state, end, eps


def running(reps: list) -> bool:
    """Whether any replica has not diverged."""
    return any(rep.host["diverged"] is None for rep in reps)


def restore(runner: Runner, template, rounds: int, workdirs: list) -> tuple[int, object, list]:
    """(start round, state, host totals per run): from the newest checkpoint of
    `runner.ckpts` that restores and was written by these runs' configs, or fresh."""

    def check(step, saved):
        plains, _ = runner.unpack(saved)
        if len(plains) != runner.count:
            where = runner.ckpts.directory
            raise ConfigError(f"{where!r}: a checkpoint of {len(plains)} replicas, not {runner.count}")
        for old, new, workdir in zip(plains, runner.plains, workdirs):
            check_config(old, new, workdir)
        if rounds < step:
            where = workdirs[0] if runner.count == 1 else runner.ckpts.directory
            raise ConfigError(
                f"config.rounds={rounds} is below round {step} of the checkpoint in {where!r}; "
                f"give --config.rounds >= {step} or another --workdir"
            )

    start, state, saved = runner.ckpts.restore_latest(template, check)
    if not start:
        return 0, template, [new_host() for _ in range(runner.count)]
    return start, state, runner.unpack(saved)[1]


def execute(runner: Runner, preps: list, workdirs: list, template, progress: bool, t_start: float) -> list:
    """Runs (or resumes from `runner.ckpts`) the runs of `preps` from the host state
    `template`, each writing into its workdir; returns their summaries (JSON values).
    ConfigError before training for a checkpoint of other configs or a block that
    does not fit the device memory."""
    settings, primary = preps[0].settings, jax.process_index() == 0
    start, state, hosts = restore(runner, template, settings.rounds, workdirs)
    for line in preps[0].notes:  # every check has passed: say what this run is
        logging.info("%s", line)
    for line in preps[0].warnings:
        logging.warning("%s", line)
    if start:
        logging.info(
            "%s: resumed from round %d of %d (checkpoint in %s)",
            settings.algorithm, start, settings.rounds, runner.ckpts.directory,
        )  # fmt: skip
    reps = [Replica(p, w, h, start, primary) for p, w, h in zip(preps, workdirs, hosts)]
    if primary:
        for prep, workdir, plain in zip(preps, workdirs, runner.plains):
            write_run_files(workdir, plain, prep)
    state = runner.to_device(state)
    compiled, length, compile_seconds = compile_block(runner, settings.schedule, state, start)
    memory = runner.memory(state, compiled)
    if memory is not None:
        try:
            check_fits(memory, MEMORY_HINT)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if start < settings.rounds:
        logging.info("%s", runner.describe(start, settings.rounds, length, compile_seconds))
    state, end, eps = run_loop(runner, compiled, length, reps, state, start, progress)
    summaries = []
    for rep, final in zip(reps, runner.final(state, end)):
        summary = finish(rep, final, end, eps, compile_seconds, t_start, runner.devices)
        summaries.append(write_summary(rep, {**summary, **runner.report()}))
    return summaries


def write_run_files(workdir: str, plain: dict, prep) -> None:
    """config.json, data.json and partition.png of a run (before its first round)."""
    write_json(os.path.join(workdir, "config.json"), plain)
    write_json(os.path.join(workdir, "data.json"), prep.fed_data.summary)
    plots.plot_partition(prep.fed_data.summary, os.path.join(workdir, "partition.png"), prep.settings.title)
