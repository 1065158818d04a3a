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

import jax
import numpy as np
from absl import logging

from pfljax.experiment import interrupts, plots
from pfljax.experiment.config import make_data, prepare, resolve, run_settings
from pfljax.experiment.config_grid import grid_label, replica_configs, row_configs  # noqa: F401  (grid_label)
from pfljax.experiment.outputs import JsonlLog, write_csv, write_json, write_text
from pfljax.experiment.reports import STATUS_DIVERGED
from pfljax.experiment.settings import RunSettings
from pfljax.experiment.train import train_and_evaluate
from pfljax.experiment.workdir import claim

COLUMNS = (
    ("final_mean_accuracy", "final mean acc (%)", 100.0),
    ("best_mean_accuracy", "best mean acc (%)", 100.0),
    ("final_worst10_accuracy", "final worst-10% acc (%)", 100.0),
)
EXTRA_KEYS = ("final_mean_loss", "bytes_up_total", "round_seconds_median")


def run_dir(workdir: str, algorithm: str, seed: int) -> str:
    return os.path.join(workdir, algorithm, f"seed_{seed}")


def parse_grid(text: str) -> tuple[str, list[float]]:
    """'<option>=v1,v2,...' -> (option, [floats]); ValueError naming the flag otherwise."""
    option, sep, values = (text or "").partition("=")
    try:
        numbers = [float(v) for v in values.split(",")] if sep and values else []
    except ValueError:
        numbers = []
    if not option or not numbers or len(set(numbers)) != len(numbers):
        raise ValueError(
            f"--grid={text}: give <option>=v1,v2,... with distinct numbers, "
            "e.g. --grid=learning_rate=0.01,0.03,0.1"
        )
    return option, numbers


def compare(
    config,
    algorithms: Sequence[str],
    seeds: Sequence[int],
    workdir: str,
    *,
    progress: bool = True,
    vectorize: bool = False,
    grid: tuple[str, Sequence[float]] | None = None,
    replica_strategy: str = "auto",
) -> dict:
    """Runs every algorithm for every seed; returns {"table": markdown, "results": ..., "diverged": [...]}.

    Every config is validated and every algorithm built (on the first seed's
    data) before the first round, so bad input fails early (ConfigError).
    `diverged` lists (algorithm, seed, round) of the runs that diverged.

    grid: (option, values): every algorithm runs once per value of `option`
      (`learning_rate` or a float option of the algorithm); rows and run
      directories are named `<algorithm>.<option>=<value>` (`grid_label`).
    vectorize: each algorithm's seeds (and grid points) run as one compiled
      program (`pfljax.experiment.sweep.train_replicas`), writing the same run
      directories; the seeds must share one partition (config.data_seed >= 0)
      and a grid option must be one that can be a traced scalar (ConfigError
      naming it otherwise, before training). The replica state is checkpointed in
      `workdir/<algorithm>/replica_checkpoints` and resumed from there.
    replica_strategy: "vmap", "map" or "auto" (map on CPU): how replicas are
      mapped inside the program (`pfljax.runtime.replicas.resolve_strategy`).
    """
    if not algorithms:
        raise ValueError("algorithms must name at least one algorithm")
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    with claim(workdir, lock=jax.process_index() == 0):
        configs, groups = row_configs(config, algorithms, grid)
        t_start = time.perf_counter()
        if vectorize:
            summaries = _run_vectorized(configs, groups, algorithms, seeds, workdir, grid, replica_strategy)
        else:
            summaries = _run_separately(configs, seeds, workdir, progress)
        settings = run_settings(resolve(configs[next(iter(configs))])[0])
        return _report(workdir, settings, summaries, seeds, t_start)


def _report(workdir: str, settings: RunSettings, summaries: dict, seeds, t_start: float) -> dict:
    """compare's tables and plots from every run's summary (see `compare`); `settings`:
    the first row's, for the data title and the rounds."""
    results = aggregate(summaries)
    table = markdown_table(results, settings.title, settings.rounds, seeds)
    if jax.process_index() == 0:  # a multi-process run: process 0 writes
        _write_results(workdir, summaries, results, table, settings.title, seeds)
    diverged = [
        (name, s["seed"], s["diverged_round"])
        for name, runs in summaries.items()
        for s in runs
        if s.get("status") == STATUS_DIVERGED
    ]
    logging.info(
        "compare: %d runs in %.1f s (%d diverged); results in %s",
        sum(map(len, summaries.values())),
        time.perf_counter() - t_start,
        len(diverged),
        workdir,
    )
    return {"table": table, "results": results, "diverged": diverged}


def _run_separately(configs: dict, seeds: Sequence[int], workdir: str, progress: bool) -> dict:
    """Every run on its own (`train_and_evaluate`), seed by seed, all rows sharing each
    seed's data; every algorithm is prepared on the first seed's data before the
    first round. Sets each config's seed (to the last seed at the end).

    Returns:
      {label: its summaries, in seed order}.
    """
    labels = list(configs)
    summaries = {lab: [] for lab in labels}
    total, done = len(labels) * len(seeds), 0
    for i, seed in enumerate(seeds):
        base = copy.deepcopy(configs[labels[0]])
        base.seed = seed
        fed = make_data(base)
        for lab in labels:
            configs[lab].seed = seed
            if i == 0:
                prepare(configs[lab], fed)
        for name in labels:
            done += 1
            path = run_dir(workdir, name, seed)
            logging.info("compare: run %d/%d: %s seed %d -> %s", done, total, name, seed, path)
            t0 = time.perf_counter()
            with interrupts.naming_runs(f"{name} seed {seed}", summaries, seeds):
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
    return summaries


def _run_vectorized(
    configs: dict, groups: dict, algorithms, seeds: Sequence[int], workdir: str, grid, strategy: str
) -> dict:
    """Each algorithm's runs (its labels x seeds) as one program
    (`sweep.train_replicas`) on the first seed's data; every algorithm is checked
    (a dry run) before the first round.

    Returns:
      {label: its summaries, in seed order}.
    """
    from pfljax.experiment import sweep  # pylint: disable=import-outside-toplevel

    first = copy.deepcopy(configs[next(iter(configs))])
    first.seed = seeds[0]
    fed = make_data(first)
    runs = {
        name: (
            replica_configs(configs, groups[name], seeds),
            [run_dir(workdir, lab, s) for lab in groups[name] for s in seeds],
        )
        for name in algorithms
    }

    def replicas(name, **kwargs):
        cs, dirs = runs[name]
        return sweep.train_replicas(
            cs,
            dirs,
            fed_data=fed,
            grid=[grid[0]] if grid else [],
            checkpoint_dir=os.path.join(workdir, name, "replica_checkpoints"),
            strategy=strategy,
            **kwargs,
        )

    for name in algorithms:  # every check before the first round
        replicas(name, dry_run=True)
    summaries = {lab: [] for lab in configs}
    for name in algorithms:
        logging.info("compare: %s: %d runs as one program", name, len(runs[name][0]))
        t0 = time.perf_counter()
        with interrupts.naming_runs(f"{name} ({len(runs[name][0])} runs as one program)", summaries, seeds):
            out = replicas(name)
        order = [lab for lab in groups[name] for _ in seeds]  # out's order
        for i, lab in enumerate(order):
            summaries[lab].append(out[i])
        logging.info(
            "compare: %s: %d runs done in %.1f s", name, len(runs[name][0]), time.perf_counter() - t0
        )
    return summaries


def _write_results(workdir: str, summaries: dict, results: dict, table: str, title: str, seeds) -> None:
    """results.md, results.json, results.csv and the overlay plots (accuracy.png, loss.png)."""
    write_text(os.path.join(workdir, "results.md"), table)
    write_json(os.path.join(workdir, "results.json"), {"seeds": list(seeds), "results": results})
    write_csv(os.path.join(workdir, "results.csv"), per_seed_rows(summaries))
    title = f"{title}; seeds {list(seeds)}"
    dirs = {label(name, results[name]): [run_dir(workdir, name, s) for s in seeds] for name in summaries}
    curves = lambda key: {name: curve(d, key) for name, d in dirs.items()}  # noqa: E731
    plots.plot_overlay(curves("mean_accuracy"), os.path.join(workdir, "accuracy.png"), title)
    plots.plot_overlay_losses(
        curves("train_loss"), curves("mean_loss"), os.path.join(workdir, "loss.png"), title
    )


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


def markdown_table(results: dict, title: str, rounds: int, seeds: Sequence[int]) -> str:
    """The results table (Markdown) of `aggregate`'s results, titled with the data
    (`RunSettings.title`) and the rounds."""
    head = ["algorithm"] + [c[1] for c in COLUMNS] + ["MB up total", "s / round"]
    one = len(seeds) == 1  # one seed: its values, no spread to report
    over = f"seed {seeds[0]}" if one else f"mean +- std over seeds {list(seeds)}"
    lines = [
        f"{title}, {rounds} rounds; {over}",
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
                else f"{scale * v['mean']:.2f}"
                if one
                else f"{scale * v['mean']:.2f} +- {scale * v['std']:.2f}"
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
