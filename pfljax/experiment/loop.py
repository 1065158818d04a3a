"""The run loop, one for a single run and for R replicas (seeds, grid points).

`train.train_and_evaluate` (one run, sharded over the devices) and
`sweep.train_replicas` (R replicas as one program) build a `Program` and call
`run_loop`. The rounds between two host events (a checkpoint, the end of the
run, a DP budget stop, at most `config.block_rounds` rounds) run as ONE compiled
block (`pfljax.runtime.blocks`), evaluation included where it falls; the host then
writes what the block returns, once per block:

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
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pfljax.core import privacy
from pfljax.core.evaluate import summarize
from pfljax.experiment import interrupts, plots
from pfljax.experiment.config import DIVERGENCE_KNOBS, dp_delta, partition_name
from pfljax.experiment.outputs import CsvLog, JsonlLog, TensorBoard, jsonable, write_json
from pfljax.runtime.blocks import BlockOut

BASE_KEYS = ("accuracy", "loss", "count")
STATUS_COMPLETED, STATUS_DIVERGED = "completed", "diverged"
STATUS_BUDGET = "privacy_budget_reached"  # stopped before a round that would exceed config.dp.target_epsilon
BEST_WINDOW = 10  # best_mean_10_accuracy: best mean accuracy over 10 consecutive evaluated rounds
MAX_BLOCK_ROUNDS = 100  # block_rounds=0 (auto): at most this many rounds between host visits
MAX_BLOCK_BYTES = 256 * 2**20  # auto: the stacked per-round outputs of a block stay below this
EXPLODING_LOSS = 1e6  # a finite train loss above this times round 1's (when positive) is a divergence


class Program(NamedTuple):
    """What `run_loop` runs: one run (count 1) or R replicas of one algorithm.

    Attributes:
      count: R (1 for one run).
      block_for: length -> the jitted `block(state, data, key, eval_key, schedule)`
        of `pfljax.runtime.blocks.make_block` with blocks of that many rounds.
      args: (data, key, eval_key) as placed on the devices.
      take: (host tree, r) -> replica r's part (the identity for one run).
      save: (round, state, hosts) -> None, a checkpoint.
      evaluate: (state, round) -> host per-client metrics of every replica
        (only for a run resumed at its last round).
      final: (state, round) -> [(host state, algorithm, eval key)] per replica, for the reports.
      place: a host array -> on the devices as the block wants its schedule (replicated).
    """

    count: int
    block_for: Callable
    args: tuple
    take: Callable
    save: Callable
    evaluate: Callable
    final: Callable
    place: Callable = jax.device_put


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
    """One run's host side: its config, workdir, outputs and running totals."""

    def __init__(self, config, prep, workdir: str, host: dict, start: int, primary: bool = True):
        self.config, self.prep, self.workdir, self.host = config, prep, workdir, host
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


def best_window_mean(values: list, window: int = BEST_WINDOW) -> float | None:
    """The best mean over `window` consecutive values (all of them when there are fewer)."""
    if not values:
        return None
    w = min(window, len(values))
    return max(float(np.mean(values[i : i + w])) for i in range(len(values) - w + 1))


def epsilons(config) -> np.ndarray | None:
    """Epsilon at config.dp's delta after 0..rounds rounds (one accountant call), or
    None without client-level DP."""
    if not config.dp.enabled:
        return None
    k = config.clients_per_round or config.num_clients
    return privacy.epsilons(
        config.dp.noise_multiplier, config.num_clients, k, config.rounds, dp_delta(config)
    )


def last_round(config, eps: np.ndarray | None) -> int:
    """The last round to run: config.rounds, or the last within config.dp.target_epsilon."""
    target = config.dp.target_epsilon if config.dp.enabled else 0
    if not target:
        return config.rounds
    within = np.nonzero(eps[1:] > target)[0]
    return int(within[0]) if within.size else config.rounds


def block_length(config, start: int, end: int, round_bytes: int) -> int:
    """L: config.block_rounds, or (auto) the rounds to the next checkpoint, at most
    MAX_BLOCK_ROUNDS and what MAX_BLOCK_BYTES of stacked outputs allow."""
    if config.block_rounds:
        return int(config.block_rounds)
    span = config.checkpoint_every or config.rounds
    fits = MAX_BLOCK_BYTES // round_bytes if round_bytes else MAX_BLOCK_ROUNDS
    return max(1, min(span, end - start, MAX_BLOCK_ROUNDS, fits))


def block_end(config, r: int, end: int, length: int) -> int:
    """The last round of the block starting after round r."""
    stop = min(r + length, end)
    every = config.checkpoint_every
    if every:
        stop = min(stop, (r // every + 1) * every)
    return stop


def is_checkpoint(config, r: int, end: int) -> bool:
    return (config.checkpoint_every and r % config.checkpoint_every == 0) or r == end


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


def evaluation_row(per_client: dict) -> dict:
    """summarize() of per-client [C] metrics, plus the test-size-weighted mean of
    every extra [C] key (e.g. own_accuracy -> mean_own_accuracy)."""
    row = summarize(per_client)
    count = np.asarray(per_client["count"], np.float64)
    w = count / max(count.sum(), 1.0)
    for key, value in per_client.items():
        value = np.asarray(value)
        if key not in BASE_KEYS and value.shape == count.shape:
            row[f"mean_{key}"] = float(np.sum(w * value))
    return row


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


def read_block(out: BlockOut, program: Program, reps: list, first: int, seconds: float, eps) -> None:
    """Writes what a block returned (host arrays) into each replica's outputs."""
    for i in np.nonzero(out.ran)[0]:
        rnd = first + int(i)
        for r, rep in enumerate(reps):
            if rep.host["diverged"] is not None:
                continue
            scalars, traces = split_metrics(program.take(_at(out.metrics, i), r))
            evaluated = bool(out.evaluated[i])
            per_client = program.take(_at(out.evaluation, i), r) if evaluated else None
            loss, first_loss = scalars.get("train_loss"), rep.host["first_train_loss"]
            exploded = bool(non_finite(loss, True, None, first_loss))
            if exploded or not bool(np.asarray(program.take(out.ok[i], r))):
                state_ok = bool(np.asarray(program.take(out.state_finite[i], r)))
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


def compile_block(program: Program, config, state, start: int):
    """(the AOT-compiled block, its length L, the seconds compiling took). L is first
    taken without the memory cap; the block is lowered again only if its stacked
    outputs would pass MAX_BLOCK_BYTES."""
    t0 = time.perf_counter()
    schedule = jnp.zeros(4, jnp.int32)
    length = block_length(config, start, config.rounds, 0)
    lowered = program.block_for(length).lower(state, *program.args, schedule)
    outputs = jax.tree.leaves(lowered.out_info[1])
    per_round = sum(np.prod(x.shape) * x.dtype.itemsize for x in outputs) // length
    capped = block_length(config, start, config.rounds, int(per_round))
    if capped != length:
        length, lowered = capped, program.block_for(capped).lower(state, *program.args, schedule)
    return lowered.compile(), length, time.perf_counter() - t0


def run_loop(program: Program, compiled, length: int, reps: list, state, start: int, progress: bool = True):
    """Runs rounds start+1 .. the end (config.rounds or the DP budget) block by block;
    returns (state, end, eps). Writes outputs and checkpoints as it goes."""
    config = reps[0].config
    eps = epsilons(config)
    end = max(last_round(config, eps), start)
    bar = Progress(progress and reps[0].primary, start, config.rounds, config.algorithm)
    r = saved = start
    try:
        with interrupts.deferred():
            while r < end and running(reps):
                stop = block_end(config, r, end, length)
                schedule = program.place(np.array([r, stop, config.eval_every, end], np.int32))
                t0 = time.perf_counter()
                with jax.transfer_guard("disallow"):
                    state, out = compiled(state, *program.args, schedule)
                out = jax.device_get(out)
                seconds = (time.perf_counter() - t0) / (stop - r)
                with interrupts.critical():
                    read_block(out, program, reps, r + 1, seconds, eps)
                    bar.block(stop - r, [rep.rows[-1] for rep in reps if running([rep]) and rep.rows], stop)
                    r = stop
                    signum = interrupts.requested()
                    if (is_checkpoint(config, r, end) or signum) and running(reps):
                        program.save(r, state, [rep.host for rep in reps])
                        saved = r
                if signum:
                    raise interrupts.Interrupted(signum)
    except interrupts.Interrupted as e:
        raise interrupts.Interrupted(e.signum, saved, config.rounds) from None
    finally:
        bar.close()
        for rep in reps:
            rep.close()
    if r == end < config.rounds:
        logging.info(
            "stop before round %d: epsilon %.3f > target %g", r + 1, eps[r + 1], config.dp.target_epsilon
        )
    if any(rep.per_client is None and rep.host["diverged"] is None for rep in reps):  # resumed at the end
        per_client = program.evaluate(state, end)
        for i, rep in enumerate(reps):
            rep.per_client = program.take(per_client, i)
    return state, end, eps


def running(reps: list) -> bool:
    """Whether any replica has not diverged."""
    return any(rep.host["diverged"] is None for rep in reps)


def divergence_knobs(config) -> str:
    """The settings that usually make a run diverge, as `name=value` pairs."""
    knobs = [f"optimizer={config.optimizer}", f"learning_rate={config.learning_rate:g}"]
    if config.optimizer == "sgd":
        knobs.append(f"momentum={config.momentum:g}")
    knobs.append(
        f"local_steps={config.local_steps}" if config.local_steps else f"local_epochs={config.local_epochs}"
    )
    knobs.append(f"batch_size={config.batch_size}")
    if config.dp.enabled:
        k = config.clients_per_round or config.num_clients
        std = config.dp.noise_multiplier * config.dp.clip_norm / k
        knobs.append(
            f"dp.noise_multiplier={config.dp.noise_multiplier:g} and dp.clip_norm={config.dp.clip_norm:g} "
            f"(noise std {std:.3g} on each coordinate of the mean update of {k} clients)"
        )
    options = config[config.algorithm] if config.algorithm in config else {}
    named = DIVERGENCE_KNOBS.get(config.algorithm, ())
    for option, value in sorted(options.items()):
        if option.endswith("lr") or option in named:
            knobs.append(f"{config.algorithm}.{option}={value}")
    return ", ".join(knobs)


def divergence_advice(config) -> str:
    """Concrete smaller settings to try: the learning rate and every positive `*lr`
    option of the algorithm divided by 10, and no momentum under SGD with momentum."""
    tries = [f"--config.learning_rate={config.learning_rate / 10:g}"]
    options = config[config.algorithm] if config.algorithm in config else {}
    for option, value in sorted(options.items()):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if option.endswith("lr") and number and 0 < value < float("inf"):
            tries.append(f"--config.{config.algorithm}.{option}={value / 10:g}")
    if config.optimizer == "sgd" and config.momentum:
        tries.append("--config.momentum=0")
    if config.dp.enabled and config.dp.noise_multiplier > 0:
        tries.append(f"--config.dp.clip_norm={config.dp.clip_norm / 2:g} (half the noise, more clipping)")
    return " or ".join(tries)


def divergence_message(config, round_index: int, what: str, workdir: str) -> str:
    """The one line that reports a diverged run: round, what was non-finite,
    algorithm, the knobs that usually cause it and smaller settings to try."""
    return (
        f"{config.algorithm} diverged at round {round_index} of {config.rounds} ({what}); "
        f"usual causes: {divergence_knobs(config)}; try {divergence_advice(config)}; "
        + (f"outputs up to round {round_index - 1}" if round_index > 1 else "data, config and plots")
        + f" kept in {workdir} (summary.json status 'diverged')"
    )


def finish(
    rep: Replica, final, end: int, eps, compile_seconds: float, t_start: float, mesh_size: int
) -> dict:
    """The replica's summary.json (and plots); `final` = (host state, algorithm, eval key)."""
    config, host = rep.config, rep.host
    d = host["diverged"]
    summary = base_summary(config, host, None if d else rep.per_client, compile_seconds, t_start, mesh_size)
    if d is not None:
        summary.update(
            status=STATUS_DIVERGED,
            diverged_round=d["round"],
            diverged_train_loss=d["train_loss"],
            divergence=divergence_message(config, d["round"], d["what"], rep.workdir),
            last_evaluation=rep.rows[-1] if rep.rows else None,
        )
    else:
        state, algorithm, key = final
        summary.update(optional_reports(algorithm, rep.prep.fed_data, state, rep.per_client, key))
        if end < config.rounds:
            summary.update(status=STATUS_BUDGET, rounds_run=end)
    summary["best_mean_10_accuracy"] = best_window_mean([row["mean_accuracy"] for row in rep.rows])
    if config.dp.enabled:
        rounds_run = summary.get("rounds_run", summary.get("diverged_round", config.rounds + 1) - 1)
        summary.update(
            dp_epsilon=float(eps[min(rounds_run, config.rounds)]),
            dp_delta=dp_delta(config),
            dp_noise_multiplier=config.dp.noise_multiplier,
            dp_clip_norm=config.dp.clip_norm,
        )
    return summary


def write_summary(rep: Replica, summary: dict) -> dict:
    if rep.primary:
        write_plots(rep.workdir, rep.rows, summary, rep.config)
        write_json(os.path.join(rep.workdir, "summary.json"), summary)
    return jsonable(summary)


def base_summary(config, host, per_client, compile_seconds, t_start, mesh_size) -> dict[str, Any]:
    final = evaluation_row(per_client) if per_client is not None else {}
    seconds = host["round_seconds"]
    return {
        "status": STATUS_COMPLETED,
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        "partition": partition_name(config),
        "rounds": config.rounds,
        "num_clients": config.num_clients,
        "seed": config.seed,
        "final_mean_accuracy": final.get("mean_accuracy"),
        "best_mean_accuracy": host["best_mean_accuracy"],
        **{f"final_{k}": v for k, v in final.items() if k != "mean_accuracy"},
        "per_client_accuracy": per_client["accuracy"] if per_client is not None else None,
        **{f"per_client_{k}": v for k, v in (per_client or {}).items() if k not in BASE_KEYS},
        "bytes_up_total": host["bytes_up_total"],
        "bytes_down_total": host["bytes_down_total"],
        "wall_seconds": time.perf_counter() - t_start,
        "compile_seconds": compile_seconds,
        "round_seconds_median": statistics.median(seconds) if seconds else None,
        "devices": int(mesh_size),
        "backend": jax.default_backend(),
    }


def optional_reports(alg, fed_data, state, per_client: dict, key) -> dict:
    """The algorithm's optional pieces: collaboration matrix and final report."""
    out = {}
    if alg.collaboration_matrix is not None:
        out["collaboration_matrix"] = np.asarray(alg.collaboration_matrix(state))
    if alg.final_report is not None:
        out.update(alg.final_report(state, fed_data, per_client, key))
    return out


def data_title(config) -> str:
    """'<dataset>, <C> clients, partition <p>' with the partition's parameter."""
    partition = partition_name(config)
    if config.dataset == "simulation":
        partition = "per-client generator"
    elif partition == "dirichlet":
        partition += f" alpha={config.dirichlet_alpha:g}"
    elif partition in ("classes", "shards"):
        partition += f" {config.classes_per_client} per client"
    elif partition == "dominant":
        partition += f" {config.num_dominant} x {config.dominant_fraction:g}"
    elif partition == "groups":
        partition += f" G={config.num_groups}"
    if config.permute_labels != "none":
        partition += f", labels permuted per {config.permute_labels}"
    return f"{config.dataset}, {config.num_clients} clients, {partition}"


def write_plots(workdir: str, rows: list, summary: dict, config) -> None:
    title = f"{config.algorithm}: {data_title(config)}"
    if summary.get("status") == STATUS_DIVERGED:
        title += f" (diverged at round {summary['diverged_round']})"
    plots.plot_accuracy(rows, os.path.join(workdir, "accuracy.png"), title)
    plots.plot_loss(rows, os.path.join(workdir, "loss.png"), title)
    if "collaboration_matrix" in summary:
        plots.plot_matrix(summary["collaboration_matrix"], os.path.join(workdir, "collaboration.png"), title)


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
