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
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pfljax.core.evaluate import summarize
from pfljax.experiment import plots
from pfljax.experiment.checkpoint import Checkpoints, check_config
from pfljax.experiment.config import ConfigError, Prepared, prepare, to_plain
from pfljax.experiment.outputs import JsonlLog, TensorBoard, jsonable, read_json, write_json
from pfljax.sharding import shard_algorithm, state_shardings

BASE_KEYS = ("accuracy", "loss", "count")
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


def train_and_evaluate(config, workdir: str, *, fed_data=None, progress: bool = True) -> dict:
    """Runs (or resumes) the experiment described by `config`, writing into `workdir`.

    Args:
      config: ConfigDict with the fields of `pfljax.experiment.config.base_config()`.
      workdir: output directory (created); resumed from if it holds checkpoints.
      fed_data: prebuilt FederatedData to use instead of building it from config.
      progress: show a tqdm progress bar (only on a terminal).

    Returns:
      The summary dict also written to workdir/summary.json.

    Raises:
      ConfigError: invalid config or a workdir holding another config's
        checkpoint; raised before training starts.
    """
    t_start = time.perf_counter()
    prep = prepare(config, fed_data)
    plain = to_plain(config)
    primary = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    ckpts = Checkpoints(os.path.join(workdir, "checkpoints"))
    try:
        return _run(config, plain, prep, workdir, ckpts, primary, progress, t_start)
    finally:
        ckpts.close()


def _run(config, plain: dict, prep: Prepared, workdir: str, ckpts: Checkpoints, primary, progress, t_start):
    num = prep.fed_data.data.train.count.shape[0]
    run = shard_algorithm(prep.algorithm, prep.mesh, num)
    init_key, run_key = jax.random.split(jax.random.key(config.seed))
    template = jax.device_get(prep.algorithm.init(init_key, None, num))

    start = ckpts.latest() or 0
    host = {"bytes_up_total": 0.0, "bytes_down_total": 0.0, "best_mean_accuracy": None, "round_seconds": []}
    if start:
        check_config(ckpts.restore_host(start)["config"], plain, workdir)
        if config.rounds < start:
            raise ConfigError(
                f"config.rounds={config.rounds} is below round {start} of the checkpoint in {workdir!r}"
            )
        state, host = ckpts.restore(start, template)
    else:
        state = template
    host["config"] = plain

    metrics_log = JsonlLog(os.path.join(workdir, "metrics.jsonl"))
    traces_log = JsonlLog(os.path.join(workdir, "traces.jsonl"))
    rows = metrics_log.truncate(start) if primary else []
    if primary:
        traces_log.truncate(start)
        write_json(os.path.join(workdir, "config.json"), plain)
        write_json(os.path.join(workdir, "data.json"), prep.fed_data.summary)
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
    shardings = (state_shardings(state, prep.mesh), replicated)
    round_fn = jax.jit(run.round, out_shardings=shardings, donate_argnums=0).lower(state, data, key).compile()
    eval_base = run.place_key(jax.random.fold_in(run_key, EVAL_STREAM))
    eval_fn = jax.jit(run.evaluate, out_shardings=replicated).lower(state, data, eval_base).compile()
    compile_seconds = time.perf_counter() - t0

    per_client = None
    bar = _progress(progress, start, config.rounds, config.algorithm)
    for r in range(start + 1, config.rounds + 1):
        t0 = time.perf_counter()
        with jax.transfer_guard("disallow"):
            state, metrics = round_fn(state, data, key)
        scalars, traces = split_metrics(jax.device_get(metrics))
        seconds = time.perf_counter() - t0
        host["round_seconds"].append(seconds)
        host["bytes_up_total"] += scalars.get("bytes_up", 0.0)
        host["bytes_down_total"] += scalars.get("bytes_down", 0.0)
        if traces and primary:
            traces_log.append({"round": r, **traces})
        if r % config.eval_every == 0 or r == config.rounds:
            t0 = time.perf_counter()
            key_r = run.place_key(eval_key(eval_base, r))
            with jax.transfer_guard("disallow"):
                per_client = eval_fn(state, data, key_r)
            per_client = jax.device_get(per_client)
            row = {"round": r, **scalars, **evaluation_row(per_client), "seconds": seconds}
            row["eval_seconds"] = time.perf_counter() - t0
            best = host["best_mean_accuracy"]
            host["best_mean_accuracy"] = (
                row["mean_accuracy"] if best is None else max(best, row["mean_accuracy"])
            )
            if primary:
                metrics_log.append(row)
                tb.scalars(r, {k: v for k, v in jsonable(row).items() if k != "round"})
            rows.append(jsonable(row))
            bar.set_postfix(
                acc=f"{row['mean_accuracy']:.4f}", loss=f"{scalars.get('train_loss', float('nan')):.4f}"
            )
        bar.update(1)
        if (config.checkpoint_every and r % config.checkpoint_every == 0) or r == config.rounds:
            ckpts.save(r, _host(run.unplace_state(state)), host)
    bar.close()
    if tb is not None:
        tb.close()

    final_state = _host(run.unplace_state(state))
    final_key = run.place_key(eval_key(eval_base, config.rounds))
    if per_client is None:  # resumed at the last round: evaluate the restored state
        per_client = jax.device_get(eval_fn(state, data, final_key))
    summary = _summary(config, prep, host, per_client, compile_seconds, t_start)
    summary.update(_optional_reports(prep, final_state, per_client, jax.device_get(final_key)))
    if primary:
        _plots(workdir, rows, summary, config)
        write_json(os.path.join(workdir, "summary.json"), summary)
    return jsonable(summary)


def _summary(config, prep, host, per_client, compile_seconds, t_start) -> dict[str, Any]:
    final = evaluation_row(per_client)
    seconds = host["round_seconds"]
    summary = {
        "algorithm": config.algorithm,
        "dataset": config.dataset,
        "rounds": config.rounds,
        "num_clients": config.num_clients,
        "seed": config.seed,
        "final_mean_accuracy": final["mean_accuracy"],
        "best_mean_accuracy": host["best_mean_accuracy"],
        **{f"final_{k}": v for k, v in final.items() if k != "mean_accuracy"},
        "per_client_accuracy": per_client["accuracy"],
        **{f"per_client_{k}": v for k, v in per_client.items() if k not in BASE_KEYS},
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
    title = f"{config.algorithm} on {config.dataset}"
    plots.plot_accuracy(rows, os.path.join(workdir, "accuracy.png"), title)
    plots.plot_loss(rows, os.path.join(workdir, "loss.png"), title)
    if "collaboration_matrix" in summary:
        plots.plot_matrix(summary["collaboration_matrix"], os.path.join(workdir, "collaboration.png"), title)


class _NoBar:
    def set_postfix(self, **_):
        pass

    def update(self, _):
        pass

    def close(self):
        pass


def _progress(enabled: bool, start: int, total: int, name: str):
    if not enabled or jax.process_index() != 0:
        return _NoBar()
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel

    return tqdm(total=total, initial=start, desc=name, unit="round", disable=None, dynamic_ncols=True)


def load_summary(workdir: str) -> dict:
    return read_json(os.path.join(workdir, "summary.json"))
