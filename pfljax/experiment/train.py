"""The run loop: `train_and_evaluate(config, workdir)`.

One jitted round per round (compiled ahead of time, no host transfer inside:
it runs under `jax.transfer_guard("disallow")`), evaluation every `eval_every`
rounds and at the last, outputs written as the run goes (see `outputs`), an
orbax checkpoint every `checkpoint_every` rounds and at the last. Rerunning on
the same workdir resumes from the latest checkpoint and ends with the same
numbers as an uninterrupted run; a checkpoint of a different config is refused
(ConfigError) before training.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from pfljax.core import privacy
from pfljax.core.evaluate import summarize
from pfljax.core.memory import check_fits, memory_report
from pfljax.experiment import plots
from pfljax.experiment.checkpoint import Checkpoints, check_config
from pfljax.experiment.config import DIVERGENCE_KNOBS, ConfigError, Prepared, dp_delta, prepare, to_plain
from pfljax.experiment.outputs import JsonlLog, TensorBoard, jsonable, read_json, write_csv, write_json
from pfljax.sharding import shard_algorithm, state_shardings

BASE_KEYS = ("accuracy", "loss", "count")
STATUS_COMPLETED, STATUS_DIVERGED = "completed", "diverged"
STATUS_BUDGET = "privacy_budget_reached"  # stopped before a round that would exceed config.dp.target_epsilon
BEST_WINDOW = 10  # best_mean_10_accuracy: best mean accuracy over 10 consecutive evaluated rounds


def best_window_mean(values: list, window: int = BEST_WINDOW) -> float | None:
    """The best mean over `window` consecutive values (all of them when there are fewer)."""
    if not values:
        return None
    w = min(window, len(values))
    return max(float(np.mean(values[i : i + w])) for i in range(len(values) - w + 1))


def privacy_epsilon(config, rounds: int) -> float | None:
    """Epsilon at config.dp's delta after `rounds` rounds, or None without client-level DP."""
    if not config.dp.enabled:
        return None
    k = config.clients_per_round or config.num_clients
    return privacy.epsilon(config.dp.noise_multiplier, config.num_clients, k, rounds, dp_delta(config))


MEMORY_HINT = (
    "lower --config.num_clients or --config.samples_per_client, pick a smaller --config.model, "
    "or spread the clients over more devices (--config.num_devices)"
)
EVAL_STREAM = 0xE7A1  # evaluation keys: fold_in(fold_in(run_key, EVAL_STREAM), round)


def eval_key(base: jax.Array, round_index: int) -> jax.Array:
    """The key of the evaluation after round `round_index` (the same on resume)."""
    return jax.random.fold_in(base, round_index)


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


def _host(state):
    if jax.process_count() > 1:  # multi-host: every process gets the full arrays
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        return multihost_utils.process_allgather(state, tiled=True)
    return jax.device_get(state)


def all_finite(tree) -> jax.Array:
    """True when every floating-point leaf of `tree` is finite (a jittable bool)."""
    leaves = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


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


def divergence_knobs(config) -> str:
    """The settings that usually make a run diverge, as `name=value` pairs."""
    knobs = [f"optimizer={config.optimizer}", f"learning_rate={config.learning_rate:g}"]
    if config.optimizer == "sgd":
        knobs.append(f"momentum={config.momentum:g}")
    knobs.append(
        f"local_steps={config.local_steps}" if config.local_steps else f"local_epochs={config.local_epochs}"
    )
    knobs.append(f"batch_size={config.batch_size}")
    options = config[config.algorithm] if config.algorithm in config else {}
    named = DIVERGENCE_KNOBS.get(config.algorithm, ())
    for option, value in sorted(options.items()):
        if option.endswith("lr") or option in named:
            knobs.append(f"{config.algorithm}.{option}={value}")
    return ", ".join(knobs)


def divergence_message(config, round_index: int, what: str, workdir: str) -> str:
    """The one line that reports a diverged run: round, what was non-finite,
    algorithm and the knobs that usually cause it."""
    hint = "--config.optimizer=adam" if config.optimizer == "sgd" else "a smaller --config.learning_rate"
    return (
        f"{config.algorithm} diverged at round {round_index} of {config.rounds} ({what}); "
        f"usual causes: {divergence_knobs(config)}; try --config.learning_rate={config.learning_rate / 10:g} "
        f"or {hint}; "
        + (f"outputs up to round {round_index - 1}" if round_index > 1 else "data, config and plots")
        + f" kept in {workdir} (summary.json status 'diverged')"
    )


def _non_finite(loss, params_finite: bool, per_client: dict | None = None) -> str:
    """'' when the round is finite, else what was not (train loss, parameters, test loss)."""
    what = []
    if loss is not None and not np.isfinite(loss):
        what.append(f"train loss {loss}")
    if not params_finite:
        what.append("non-finite parameters")
    if per_client is not None:
        count = np.asarray(per_client["count"])
        test = np.asarray(per_client["loss"], np.float64)[count > 0]
        if not np.all(np.isfinite(test)):
            what.append(f"test loss not finite on {int(np.sum(~np.isfinite(test)))} of {len(test)} clients")
    return ", ".join(what)


def train_and_evaluate(config, workdir: str, *, fed_data=None, progress: bool = True) -> dict:
    """Runs (or resumes) the experiment described by `config`, writing into `workdir`.

    Args:
      config: ConfigDict with the fields of `pfljax.experiment.config.base_config()`.
      workdir: output directory (created); resumed from if it holds checkpoints.
      fed_data: prebuilt FederatedData to use instead of building it from config.
      progress: show a tqdm progress bar on a terminal; elsewhere (a log file,
        nohup, a batch scheduler) one absl log line per evaluation.

    Returns:
      The summary dict also written to workdir/summary.json. Its `status` is
      "completed", or "diverged" when a round gave a non-finite train loss or
      parameters: the run stopped there (`diverged_round`, `divergence`: the
      message; the final_* numbers are None), keeping what it had written
      (metrics up to the round before, checkpoints, plots).

    Raises:
      ConfigError: invalid config, a workdir that is not a writable directory,
        or one holding another config's checkpoint; raised before training.
    """
    t_start = time.perf_counter()
    check_workdir(workdir)
    prep = prepare(config, fed_data)
    plain = to_plain(prep.config)
    primary = jax.process_index() == 0
    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"))
    try:
        return _run(prep.config, plain, prep, workdir, ckpts, primary, progress, t_start)
    finally:
        ckpts.close()


def _run(config, plain: dict, prep: Prepared, workdir: str, ckpts: Checkpoints, primary, progress, t_start):
    num = prep.fed_data.data.train.count.shape[0]
    run = shard_algorithm(prep.algorithm, prep.mesh, num)
    init_key, run_key = jax.random.split(jax.random.key(config.seed))
    template = jax.device_get(prep.algorithm.init(init_key, None, num))

    start = ckpts.latest() or 0
    host = {
        "bytes_up_total": 0.0,
        "bytes_down_total": 0.0,
        "best_mean_accuracy": None,
        "round_seconds": [],
    }
    if start:
        check_config(ckpts.restore_host(start)["config"], plain, workdir)
        if config.rounds < start:
            raise ConfigError(
                f"config.rounds={config.rounds} is below round {start} of the checkpoint in {workdir!r}; "
                f"give --config.rounds >= {start} or another --workdir"
            )
        state, host = ckpts.restore(start, template)
    else:
        state = template
    host["config"] = plain
    # Every check has passed: say what this run is.
    for line in prep.notes:
        logging.info("%s", line)
    for line in prep.warnings:
        logging.warning("%s", line)
    if start:
        logging.info(
            "%s: resumed from round %d of %d (checkpoint in %s)",
            config.algorithm,
            start,
            config.rounds,
            os.path.join(workdir, "checkpoints"),
        )

    metrics_log = JsonlLog(os.path.join(workdir, "metrics.jsonl"))
    traces_log = JsonlLog(os.path.join(workdir, "traces.jsonl"))
    rows = metrics_log.truncate(start) if primary else []
    if primary:
        traces_log.truncate(start)
        write_csv(os.path.join(workdir, "metrics.csv"), rows)
        write_json(os.path.join(workdir, "config.json"), plain)
        write_json(os.path.join(workdir, "data.json"), prep.fed_data.summary)
        plots.plot_partition(
            prep.fed_data.summary, os.path.join(workdir, "partition.png"), data_title(config)
        )
    tb = (
        TensorBoard(os.path.join(workdir, "tensorboard"), purge_step=start + 1 if start else None)
        if primary
        else None
    )

    state = run.place_state(state)
    data = run.place_data(prep.fed_data.data, replicate=config.replicate_data)
    key = run.place_key(run_key)
    t0 = time.perf_counter()
    replicated = NamedSharding(prep.mesh, PartitionSpec())
    shardings = (state_shardings(state, prep.mesh), replicated, replicated)

    def checked_round(state, data, key):
        state, metrics = run.round(state, data, key)
        return state, metrics, all_finite(state)

    round_fn = (
        jax.jit(checked_round, out_shardings=shardings, donate_argnums=0).lower(state, data, key).compile()
    )
    eval_base = run.place_key(jax.random.fold_in(run_key, EVAL_STREAM))
    eval_fn = jax.jit(run.evaluate, out_shardings=replicated).lower(state, data, eval_base).compile()
    compile_seconds = time.perf_counter() - t0
    memory = memory_report(state, data, round_fn)
    try:
        check_fits(memory, MEMORY_HINT)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if start < config.rounds:
        logging.info(
            "%s: rounds %d..%d on %d %s device(s), compiled in %.1f s",
            config.algorithm,
            start + 1,
            config.rounds,
            prep.mesh.size,
            jax.default_backend(),
            compile_seconds,
        )

    per_client = None
    diverged = None
    bar = _Progress(progress and primary, start, config.rounds, config.algorithm)
    budget_round = None
    for r in range(start + 1, config.rounds + 1):
        eps = privacy_epsilon(config, r)
        if config.dp.enabled and config.dp.target_epsilon and eps > config.dp.target_epsilon:
            budget_round = r - 1
            logging.info("stop before round %d: epsilon %.3f > target %g", r, eps, config.dp.target_epsilon)
            if not rows or rows[-1]["round"] != budget_round:
                per_client = None  # the state after budget_round is evaluated below
            if budget_round > start and ckpts.latest() != budget_round:
                ckpts.save(budget_round, _host(run.unplace_state(state)), host)
            break
        t0 = time.perf_counter()
        with jax.transfer_guard("disallow"):
            state, metrics, finite = round_fn(state, data, key)
        scalars, traces = split_metrics(jax.device_get(metrics))
        finite = bool(jax.device_get(finite))
        seconds = time.perf_counter() - t0
        loss = scalars.get("train_loss")
        what = _non_finite(loss, finite)
        if what:
            diverged = {"round": r, "train_loss": loss, "what": what}
            break
        host["round_seconds"].append(seconds)
        host["bytes_up_total"] += scalars.get("bytes_up", 0.0)
        host["bytes_down_total"] += scalars.get("bytes_down", 0.0)
        if traces and primary:
            traces_log.append({"round": r, **traces})
        if r % config.eval_every == 0 or r == config.rounds:
            t0 = time.perf_counter()
            k = run.place_key(eval_key(eval_base, r))  # outside the guard: folding in r is a transfer
            with jax.transfer_guard("disallow"):
                per_client = eval_fn(state, data, k)
            per_client = jax.device_get(per_client)
            what = _non_finite(None, True, per_client)
            if what:
                diverged = {"round": r, "train_loss": loss, "what": what}
                break
            row = {"round": r, **scalars, **evaluation_row(per_client), "seconds": seconds}
            if eps is not None:
                row["dp_epsilon"] = eps
            row["eval_seconds"] = time.perf_counter() - t0
            best = host["best_mean_accuracy"]
            host["best_mean_accuracy"] = (
                row["mean_accuracy"] if best is None else max(best, row["mean_accuracy"])
            )
            rows.append(jsonable(row))
            if primary:
                metrics_log.append(row)
                write_csv(os.path.join(workdir, "metrics.csv"), rows)
                tb.scalars(r, {k: v for k, v in jsonable(row).items() if k != "round"})
            bar.evaluated(r, row, host["round_seconds"])
        bar.update(1)
        if (config.checkpoint_every and r % config.checkpoint_every == 0) or r == config.rounds:
            ckpts.save(r, _host(run.unplace_state(state)), host)
    bar.close()
    if tb is not None:
        tb.close()

    if diverged is not None:
        message = divergence_message(config, diverged["round"], diverged["what"], workdir)
        summary = _summary(config, prep, host, None, compile_seconds, t_start)
        summary.update(
            status=STATUS_DIVERGED,
            diverged_round=diverged["round"],
            diverged_train_loss=str(diverged["train_loss"]),
            divergence=message,
            last_evaluation=rows[-1] if rows else None,
        )
    else:
        final_state = _host(run.unplace_state(state))
        final_key = run.place_key(
            eval_key(eval_base, config.rounds if budget_round is None else budget_round)
        )
        if per_client is None:  # resumed at the last round: evaluate the restored state
            per_client = jax.device_get(eval_fn(state, data, final_key))
        summary = _summary(config, prep, host, per_client, compile_seconds, t_start)
        summary.update(_optional_reports(prep, final_state, per_client, jax.device_get(final_key)))
        if budget_round is not None:
            summary.update(status=STATUS_BUDGET, rounds_run=budget_round)
    summary["best_mean_10_accuracy"] = best_window_mean([row["mean_accuracy"] for row in rows])
    summary["memory"] = memory
    if config.dp.enabled:
        rounds_run = summary.get("rounds_run", summary.get("diverged_round", config.rounds + 1) - 1)
        summary.update(
            dp_epsilon=privacy_epsilon(config, min(rounds_run, config.rounds)),
            dp_delta=dp_delta(config),
            dp_noise_multiplier=config.dp.noise_multiplier,
            dp_clip_norm=config.dp.clip_norm,
        )
    if primary:
        _plots(workdir, rows, summary, config)
        write_json(os.path.join(workdir, "summary.json"), summary)
    return jsonable(summary)


def data_title(config) -> str:
    """'<dataset>, <C> clients, partition <p>' with the partition's parameter."""
    partition = config.partition
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


def _summary(config, prep, host, per_client, compile_seconds, t_start) -> dict[str, Any]:
    final = evaluation_row(per_client) if per_client is not None else {}
    seconds = host["round_seconds"]
    summary = {
        "status": STATUS_COMPLETED,
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        "partition": config.partition,
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
        "devices": int(prep.mesh.size),
        "backend": jax.default_backend(),
    }
    return summary


def _optional_reports(prep, state, per_client: dict, key) -> dict:
    """The algorithm's optional pieces: collaboration matrix and final report."""
    out = {}
    alg = prep.algorithm
    if alg.collaboration_matrix is not None:
        out["collaboration_matrix"] = np.asarray(alg.collaboration_matrix(state))
    if alg.final_report is not None:
        out.update(alg.final_report(state, prep.fed_data, per_client, key))
    return out


def _plots(workdir: str, rows: list, summary: dict, config) -> None:
    title = f"{config.algorithm}: {data_title(config)}"
    if summary.get("status") == STATUS_DIVERGED:
        title += f" (diverged at round {summary['diverged_round']})"
    plots.plot_accuracy(rows, os.path.join(workdir, "accuracy.png"), title)
    plots.plot_loss(rows, os.path.join(workdir, "loss.png"), title)
    if "collaboration_matrix" in summary:
        plots.plot_matrix(summary["collaboration_matrix"], os.path.join(workdir, "collaboration.png"), title)


class _Progress:
    """A tqdm bar on a terminal; elsewhere one absl log line per evaluation
    (round, mean / worst-10% accuracy, losses, seconds per round, ETA)."""

    def __init__(self, enabled: bool, start: int, total: int, name: str):
        self.start, self.total, self.name = start, total, name
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm  # pylint: disable=import-outside-toplevel

            self.bar = tqdm(total=total, initial=start, desc=name, unit="round", dynamic_ncols=True)

    def evaluated(self, r: int, row: dict, round_seconds: list) -> None:
        loss = row.get("train_loss", float("nan"))
        if self.bar is not None:
            self.bar.set_postfix(acc=f"{row['mean_accuracy']:.4f}", loss=f"{loss:.4f}")
            return
        per_round = (time.perf_counter() - self.t0) / max(r - self.start, 1)
        recent = round_seconds[-10:]
        logging.info(
            "%s round %d/%d: mean acc %.4f, worst-10%% acc %.4f, train loss %.4g, test loss %.4g, "
            "%.3f s/round, ETA %s",
            self.name,
            r,
            self.total,
            row["mean_accuracy"],
            row["worst10_accuracy"],
            loss,
            row.get("mean_loss", float("nan")),
            statistics.median(recent) if recent else float("nan"),
            _duration(per_round * (self.total - r)),
        )

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def load_summary(workdir: str) -> dict:
    return read_json(os.path.join(workdir, "summary.json"))
