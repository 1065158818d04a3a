"""Several algorithms on the same data and seeds: a Markdown table and one overlay plot.

For each seed the federated data are built once and shared by every
algorithm, so all of them see the same partition (with `config.data_seed` >= 0
the partition is also the same across seeds). Runs go to
`workdir/<algorithm>/seed_<s>/` (each resumable); the comparison writes
`results.md`, `results.json` and `accuracy.png` into `workdir`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

import numpy as np

from pfljax.experiment import plots
from pfljax.experiment.config import make_data, prepare, validate
from pfljax.experiment.outputs import JsonlLog, write_json
from pfljax.experiment.train import train_and_evaluate

COLUMNS = (
    ("final_mean_accuracy", "final mean acc (%)", 100.0),
    ("best_mean_accuracy", "best mean acc (%)", 100.0),
    ("final_worst10_accuracy", "final worst-10% acc (%)", 100.0),
)


def run_dir(workdir: str, algorithm: str, seed: int) -> str:
    return os.path.join(workdir, algorithm, f"seed_{seed}")


def compare(
    config, algorithms: Sequence[str], seeds: Sequence[int], workdir: str, *, progress: bool = True
) -> dict:
    """Runs every algorithm for every seed; returns {"table": markdown, "results": ...}.

    Every config is validated and every algorithm built (on the first seed's
    data) before the first round, so bad input fails early (ConfigError).
    """
    if not algorithms:
        raise ValueError("algorithms must name at least one algorithm")
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    configs = {}
    for name in algorithms:
        c = copy.deepcopy(config)
        c.algorithm = name
        validate(c)
        configs[name] = c
    summaries = {name: [] for name in algorithms}
    for i, seed in enumerate(seeds):
        base = copy.deepcopy(configs[algorithms[0]])
        base.seed = seed
        fed = make_data(base)
        for name in algorithms:
            configs[name].seed = seed
            if i == 0:
                prepare(configs[name], fed)
        for name in algorithms:
            summaries[name].append(
                train_and_evaluate(
                    configs[name], run_dir(workdir, name, seed), fed_data=fed, progress=progress
                )
            )
    results = aggregate(summaries)
    table = markdown_table(results, config, seeds)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(table)
    write_json(os.path.join(workdir, "results.json"), {"seeds": list(seeds), "results": results})
    curves = {name: accuracy_curve([run_dir(workdir, name, s) for s in seeds]) for name in algorithms}
    plots.plot_overlay(
        curves, os.path.join(workdir, "accuracy.png"), f"{config.dataset}, seeds {list(seeds)}"
    )
    return {"table": table, "results": results}


def aggregate(summaries: dict[str, list[dict]]) -> dict:
    """Mean and std (over seeds, ddof=0) of each table column, per algorithm."""
    out = {}
    for name, runs in summaries.items():
        row = {}
        for key in [c[0] for c in COLUMNS] + ["bytes_up_total", "round_seconds_median"]:
            values = np.asarray([r[key] for r in runs if r.get(key) is not None], np.float64)
            row[key] = {"mean": float(values.mean()), "std": float(values.std())} if len(values) else None
        out[name] = row
    return out


def markdown_table(results: dict, config, seeds: Sequence[int]) -> str:
    head = ["algorithm"] + [c[1] for c in COLUMNS] + ["MB up total", "s / round"]
    lines = [
        f"{config.dataset}, {config.num_clients} clients, partition {config.partition}, "
        f"{config.rounds} rounds; mean +- std over seeds {list(seeds)}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, row in results.items():
        cells = [name]
        for key, _, scale in COLUMNS:
            v = row[key]
            cells.append("n/a" if v is None else f"{scale * v['mean']:.2f} +- {scale * v['std']:.2f}")
        up, sec = row["bytes_up_total"], row["round_seconds_median"]
        cells.append("n/a" if up is None else f"{up['mean'] / 1e6:.2f}")
        cells.append("n/a" if sec is None else f"{sec['mean']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def accuracy_curve(run_dirs: Sequence[str]):
    """(rounds, mean, std) of mean_accuracy over runs, on the rounds all runs evaluated."""
    per_run = []
    for d in run_dirs:
        rows = JsonlLog(os.path.join(d, "metrics.jsonl")).rows()
        per_run.append({r["round"]: r["mean_accuracy"] for r in rows})
    rounds = sorted(set.intersection(*(set(p) for p in per_run)))
    values = np.asarray([[p[r] for r in rounds] for p in per_run], np.float64)
    return np.asarray(rounds), values.mean(0), values.std(0) if len(per_run) > 1 else None
