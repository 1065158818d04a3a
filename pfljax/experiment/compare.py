"""Several algorithms on the same data and seeds: a Markdown table, CSV/JSON results and overlay plots.

For each seed the federated data are built once and shared by every
algorithm, so all of them see the same partition (with `config.data_seed` >= 0
the partition is also the same across seeds). Runs go to
`workdir/<algorithm>/seed_<s>/` (each resumable); the comparison writes into
`workdir`: `results.md` (mean +- std over seeds), `results.json` (the same plus
every seed's value and status), `results.csv` (one row per algorithm and seed),
`accuracy.png` and `loss.png` (overlays, mean +- std over seeds). A run that
diverges (see `train_and_evaluate`) does not stop the others: its row is marked
in the table and its seeds are left out of the means.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence

import numpy as np
from absl import logging

from pfljax.experiment import plots
from pfljax.experiment.config import make_data, prepare, resolve
from pfljax.experiment.outputs import JsonlLog, write_csv, write_json
from pfljax.experiment.train import STATUS_DIVERGED, check_workdir, data_title, train_and_evaluate

COLUMNS = (
    ("final_mean_accuracy", "final mean acc (%)", 100.0),
    ("best_mean_accuracy", "best mean acc (%)", 100.0),
    ("final_worst10_accuracy", "final worst-10% acc (%)", 100.0),
)
EXTRA_KEYS = ("final_mean_loss", "bytes_up_total", "round_seconds_median")


def run_dir(workdir: str, algorithm: str, seed: int) -> str:
    return os.path.join(workdir, algorithm, f"seed_{seed}")


def compare(
    config, algorithms: Sequence[str], seeds: Sequence[int], workdir: str, *, progress: bool = True
) -> dict:
    """Runs every algorithm for every seed; returns {"table": markdown, "results": ..., "diverged": [...]}.

    Every config is validated and every algorithm built (on the first seed's
    data) before the first round, so bad input fails early (ConfigError).
    `diverged` lists (algorithm, seed, round) of the runs that diverged.
    """
    if not algorithms:
        raise ValueError("algorithms must name at least one algorithm")
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    check_workdir(workdir)
    configs = {}
    for name in algorithms:
        c = copy.deepcopy(config)
        with c.unlocked():
            c.algorithm = name
        resolve(c)  # validates
        configs[name] = c
    summaries = {name: [] for name in algorithms}
    total, done = len(algorithms) * len(seeds), 0
    t_start = time.perf_counter()
    for i, seed in enumerate(seeds):
        base = copy.deepcopy(configs[algorithms[0]])
        base.seed = seed
        fed = make_data(base)
        for name in algorithms:
            configs[name].seed = seed
            if i == 0:
                prepare(configs[name], fed)
        for name in algorithms:
            done += 1
            path = run_dir(workdir, name, seed)
            logging.info("compare: run %d/%d: %s seed %d -> %s", done, total, name, seed, path)
            t0 = time.perf_counter()
            summary = train_and_evaluate(configs[name], path, fed_data=fed, progress=progress)
            summaries[name].append(summary)
            if summary.get("status") == STATUS_DIVERGED:
                logging.warning("compare: run %d/%d: %s", done, total, summary["divergence"])
            else:
                logging.info(
                    "compare: run %d/%d done: %s seed %d, final mean acc %.4f, %.1f s",
                    done,
                    total,
                    name,
                    seed,
                    summary["final_mean_accuracy"],
                    time.perf_counter() - t0,
                )
    results = aggregate(summaries)
    resolved = resolve(configs[algorithms[0]])[0]
    table = markdown_table(results, resolved, seeds)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(table)
    write_json(os.path.join(workdir, "results.json"), {"seeds": list(seeds), "results": results})
    write_csv(os.path.join(workdir, "results.csv"), per_seed_rows(summaries))
    title = f"{data_title(resolved)}; seeds {list(seeds)}"
    dirs = {label(name, results[name]): [run_dir(workdir, name, s) for s in seeds] for name in algorithms}
    plots.plot_overlay(
        {name: curve(d, "mean_accuracy") for name, d in dirs.items()},
        os.path.join(workdir, "accuracy.png"),
        title,
    )
    plots.plot_overlay_losses(
        {name: curve(d, "train_loss") for name, d in dirs.items()},
        {name: curve(d, "mean_loss") for name, d in dirs.items()},
        os.path.join(workdir, "loss.png"),
        title,
    )
    diverged = [
        (name, s["seed"], s["diverged_round"])
        for name, runs in summaries.items()
        for s in runs
        if s.get("status") == STATUS_DIVERGED
    ]
    logging.info(
        "compare: %d runs in %.1f s (%d diverged); results in %s",
        total,
        time.perf_counter() - t_start,
        len(diverged),
        workdir,
    )
    return {"table": table, "results": results, "diverged": diverged}


def aggregate(summaries: dict[str, list[dict]]) -> dict:
    """Per algorithm and column: mean and std (over the seeds that completed,
    ddof=0), every seed's value (`values`, None where a run diverged), plus the
    seeds' statuses and diverged rounds."""
    out = {}
    for name, runs in summaries.items():
        row = {
            "seeds": [r.get("seed") for r in runs],
            "status": [r.get("status", "completed") for r in runs],
            "diverged_round": [r.get("diverged_round") for r in runs],
        }
        for key in [c[0] for c in COLUMNS] + list(EXTRA_KEYS):
            per_seed = [r.get(key) for r in runs]
            values = np.asarray([v for v in per_seed if v is not None], np.float64)
            row[key] = (
                {"mean": float(values.mean()), "std": float(values.std()), "values": per_seed}
                if len(values)
                else None
            )
        out[name] = row
    return out


def label(name: str, row: dict) -> str:
    """The algorithm's name, marked when some of its seeds diverged (table rows, legends)."""
    diverged = sum(st == STATUS_DIVERGED for st in row["status"])
    return f"{name} (diverged: {diverged} of {len(row['status'])} seeds)" if diverged else name


def per_seed_rows(summaries: dict[str, list[dict]]) -> list[dict]:
    """One row per algorithm and seed (results.csv)."""
    keys = [c[0] for c in COLUMNS] + list(EXTRA_KEYS)
    return [
        {
            "algorithm": name,
            "seed": r.get("seed"),
            "status": r.get("status", "completed"),
            "diverged_round": r.get("diverged_round"),
            **{k: r.get(k) for k in keys},
        }
        for name, runs in summaries.items()
        for r in runs
    ]


def markdown_table(results: dict, config, seeds: Sequence[int]) -> str:
    head = ["algorithm"] + [c[1] for c in COLUMNS] + ["MB up total", "s / round"]
    lines = [
        f"{data_title(config)}, {config.rounds} rounds; mean +- std over seeds {list(seeds)}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    notes = []
    for name, row in results.items():
        diverged = [
            f"seed {s} at round {r}"
            for s, st, r in zip(row["seeds"], row["status"], row["diverged_round"])
            if st == STATUS_DIVERGED
        ]
        cells = [label(name, row)]
        for key, _, scale in COLUMNS:
            v = row[key]
            cells.append(
                "diverged"
                if v is None and diverged
                else "n/a"
                if v is None
                else (f"{scale * v['mean']:.2f} +- {scale * v['std']:.2f}")
            )
        up, sec = row["bytes_up_total"], row["round_seconds_median"]
        cells.append("n/a" if up is None else f"{up['mean'] / 1e6:.2f}")
        cells.append("n/a" if sec is None else f"{sec['mean']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
        if diverged:
            rest = (
                "no seed completed"
                if len(diverged) == len(row["seeds"])
                else "its means are over the seeds that completed"
            )
            notes.append(f"{name} diverged ({', '.join(diverged)}): {rest}.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def curve(run_dirs: Sequence[str], key: str = "mean_accuracy"):
    """(rounds, mean, std or None) of metric `key` over runs, on the rounds all
    runs evaluated (a diverged run's rows stop before its divergence)."""
    per_run = []
    for d in run_dirs:
        rows = JsonlLog(os.path.join(d, "metrics.jsonl")).rows()
        per_run.append({r["round"]: r[key] for r in rows if r.get(key) is not None})
    rounds = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    values = np.asarray([[p[r] for r in rounds] for p in per_run], np.float64).reshape(len(per_run), -1)
    return np.asarray(rounds), values.mean(0), values.std(0) if len(per_run) > 1 else None


def accuracy_curve(run_dirs: Sequence[str]):
    """(rounds, mean, std) of mean_accuracy over runs (see `curve`)."""
    return curve(run_dirs, "mean_accuracy")
