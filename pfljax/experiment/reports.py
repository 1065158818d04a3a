"""What a run reports at its end: summary.json and the plots (accuracy, loss, collaboration)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import jax
import numpy as np

from pfljax.core.evaluate import summarize
from pfljax.experiment import plots
from pfljax.experiment.outputs import jsonable, write_json
from pfljax.experiment.settings import RunSettings

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


def finish(rep, final, end: int, eps, compile_seconds: float, t_start: float, devices: int) -> dict:
    """The summary of `rep` (a `loop.Replica`); `final` = (host state, algorithm, eval key)."""
    settings, host = rep.settings, rep.host
    d = host["diverged"]
    summary = base_summary(settings, host, None if d else rep.per_client, compile_seconds, t_start, devices)
    if d is not None:
        summary.update(
            status=STATUS_DIVERGED,
            diverged_round=d["round"],
            diverged_train_loss=d["train_loss"],
            divergence=settings.divergence_message(d["round"], d["what"], rep.workdir),
            last_evaluation=rep.rows[-1] if rep.rows else None,
        )
    else:
        state, algorithm, key = final
        summary.update(optional_reports(algorithm, rep.prep.fed_data, state, rep.per_client, key))
        if end < settings.rounds:
            summary.update(status=STATUS_BUDGET, rounds_run=end)
    summary["best_mean_10_accuracy"] = best_window_mean([row["mean_accuracy"] for row in rep.rows])
    if settings.dp is not None:
        rounds_run = summary.get("rounds_run", summary.get("diverged_round", settings.rounds + 1) - 1)
        summary.update(settings.dp.report(eps, min(rounds_run, settings.rounds)))
    return summary


def write_summary(rep, summary: dict) -> dict:
    """summary.json and the plots of `rep` (its primary process only); the summary as JSON values."""
    if rep.primary:
        write_plots(rep.workdir, rep.rows, summary, f"{rep.settings.algorithm}: {rep.settings.title}")
        write_json(os.path.join(rep.workdir, "summary.json"), summary)
    return jsonable(summary)


def base_summary(
    settings: RunSettings, host: dict, per_client, compile_seconds, t_start, devices
) -> dict[str, Any]:
    final = evaluation_row(per_client) if per_client is not None else {}
    seconds = host["round_seconds"]
    return {
        "status": STATUS_COMPLETED,
        "algorithm": settings.algorithm,
        "dataset": settings.dataset,
        "partition": settings.partition,
        "rounds": settings.rounds,
        "num_clients": settings.num_clients,
        "seed": settings.seed,
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
        "devices": int(devices),
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


def write_plots(workdir: str, rows: list, summary: dict, title: str) -> None:
    """accuracy.png, loss.png (and collaboration.png) of a run titled `title`."""
    if summary.get("status") == STATUS_DIVERGED:
        title += f" (diverged at round {summary['diverged_round']})"
    plots.plot_accuracy(rows, os.path.join(workdir, "accuracy.png"), title)
    plots.plot_loss(rows, os.path.join(workdir, "loss.png"), title)
    if "collaboration_matrix" in summary:
        plots.plot_matrix(summary["collaboration_matrix"], os.path.join(workdir, "collaboration.png"), title)
