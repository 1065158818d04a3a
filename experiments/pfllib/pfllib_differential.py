"""PFLlib's own FedAvg, FedPer, Ditto, FedDBE, FedCP, GPFL, FedProto, FedGen, FedAMP, APPLE and FD against
pfljax's PFLlib mode.

Reads what the two sides wrote and prints the Markdown tables of
experiments/results/pfllib_differential.md; draws the per-round curves (PNG).

    python -m experiments.pfllib.pfllib_differential --pfllib_logs=/work/pfllib_run/logs \\
        --pfljax=flax=/work/pfllib_run/pfljax_seeds012 --pfljax=torch=/work/pfllib_run/pfljax_torchinit \\
        --png=experiments/results/pfllib_differential.png
    # only some methods (tables and panels): --methods=FedGen,FedAMP,APPLE,FD

PFLlib side: the stdout of `system/main.py` per run, `<pfllib_logs>/pfllib_<Algo>_seed<s>.log`.
Its server prints, per evaluation, "Evaluate global model(s)" or another "Evaluate ..."
line of the personalized models ("Evaluate personalized models"; FedDBE's "Evaluate model",
FedCP's "Evaluate before local training", GPFL's "Evaluate performance") then "Averaged Test
Accuracy: a", and per round "time cost ... t" (FedCP, FedProto, APPLE and FD: a rule of dashes,
then t; their Budget, evaluation included). FedGen's server prints "Evaluate global model" (the
aggregated model on every client's test rows, as pfljax's fedgen evaluates); FedAMP's, APPLE's
and FD's "Evaluate personalized models" (each client's own model: FedAMP's w_i, APPLE's mix of
the core models, FD's model), as pfljax's fedamp, apple and feddistill evaluate. FedProto's
personalized accuracy is each client's nearest global prototype to its features (none yet at
evaluation 0: 0), as pfljax's fedproto `accuracy`. Ditto prints both (its rs_test_acc, and so
its reported best, interleaves global and personal accuracies); the personal ones are what
pfljax's Ditto evaluates, so they are the curve compared here. PFLlib evaluates at the start of rounds
0..R (evaluation r: after r updates), pfljax after each update (round r: after r
updates): PFLlib's evaluation r is compared with pfljax's round r, r >= 1; PFLlib's
evaluation 0 (the untrained model) has no pfljax counterpart.

pfljax side: `<workdir>/<algorithm>/seed_<s>/metrics.jsonl` (rows "round",
"mean_accuracy", "seconds": block wall time / rounds, evaluation included, compile
excluded) of `experiments.compare` workdirs.

Spread: std over seeds with ddof 0 (PFLlib's np.std); a difference in seed-spread units is
(pfljax mean - PFLlib mean) / sqrt((sd_pfljax^2 + sd_pfllib^2) / 2). A pfljax curve longer than
PFLlib's has its best taken over PFLlib's rounds (the per-round tables and the figure show it all).
PFLlib's runs of one seed differ run to run (experiments/results/pfllib_differential.md):
`--pfllib_seeds=0,1,2,10,11,12`, with reruns linked as seeds 10-12, compares pfljax's seeds
with all six PFLlib runs.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
from absl import app, flags

from pfljax.experiment.cli import parse_flags

METHODS = {
    "FedAvg": "fedavg",
    "FedPer": "fedper",
    "Ditto": "ditto",
    "FedDBE": "feddbe",
    "FedCP": "fedcp",
    "GPFL": "gpfl",
    "FedProto": "fedproto",
    "FedGen": "fedgen",
    "FedAMP": "fedamp",
    "APPLE": "apple",
    "FD": "feddistill",
}
CURVE = {m: "global" if m in ("FedAvg", "FedGen") else "personal" for m in METHODS}
# The seconds of a round: "time cost ... t" (most servers), a rule of dashes then t
# (FedCP, FedProto, APPLE, FD).
ROUND_SECONDS = re.compile(r"time cost -+ ([0-9.]+)|^-{25,} ([0-9.]+)$")

_LOGS = flags.DEFINE_string("pfllib_logs", "/work/pfllib_run/logs", "directory of pfllib_<Algo>_seed<s>.log")
_PFLJAX = flags.DEFINE_multi_string("pfljax", [], "LABEL=compare workdir (repeatable)")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds of both sides")
_PFLLIB_SEEDS = flags.DEFINE_list(
    "pfllib_seeds",
    None,
    "the PFLlib runs to read (default: --seeds); reruns of a seed linked under other numbers pool "
    "PFLlib's run-to-run spread",
)
_PNG = flags.DEFINE_string("png", "", "write the curves here")
_METHODS = flags.DEFINE_list("methods", list(METHODS), "PFLlib names of the methods to tabulate and draw")
_PARTIAL = flags.DEFINE_bool("partial", False, "also read unfinished PFLlib runs (cut to the shortest)")


def selected() -> list[str]:
    """The methods of --methods, in METHODS' order."""
    unknown = sorted(set(_METHODS.value) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; known: {list(METHODS)}")
    return [m for m in METHODS if m in _METHODS.value]


def parse_pfllib_log(path: str) -> dict:
    """{"global": [acc per evaluation], "personal": [...], "seconds": [Budget per round],
    "train_loss": [the evaluated models' loss on every client's train rows]}."""
    out: dict[str, list[float]] = {"global": [], "personal": [], "seconds": [], "train_loss": []}
    kind = "global"
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("Evaluate global model"):
                kind = "global"
            elif line.startswith("Evaluate"):  # personalized models, by each server's own words
                kind = "personal"
            elif m := re.match(r"Averaged Test Accuracy: ([0-9.]+)", line):
                out[kind].append(float(m.group(1)))
            elif m := re.match(r"Averaged Train Loss: ([0-9.]+)", line):
                out["train_loss"].append(float(m.group(1)))
            elif m := ROUND_SECONDS.search(line.strip()):
                out["seconds"].append(float(m.group(1) or m.group(2)))
    return out


def pfllib_runs(logs: str, method: str) -> list[dict]:
    runs = []
    for s in _PFLLIB_SEEDS.value or _SEEDS.value:
        path = os.path.join(logs, f"pfllib_{method}_seed{s}.log")
        if not os.path.exists(path):
            continue
        if _PARTIAL.value or "Average time cost:" in open(path, encoding="utf-8").read():  # finished
            runs.append({"seed": s, **parse_pfllib_log(path)})
    return runs


def pfljax_runs(workdir: str, algorithm: str, seeds: list[str]) -> list[dict]:
    runs = []
    for s in seeds:
        path = os.path.join(workdir, algorithm, f"seed_{s}", "metrics.jsonl")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows = [r for r in rows if "mean_accuracy" in r]
        if not rows:  # not run yet, or running
            continue
        runs.append(
            {
                "seed": s,
                "acc": [r["mean_accuracy"] for r in rows],
                "loss": [r["mean_loss"] for r in rows],
                "rounds": [r["round"] for r in rows],
                "seconds": [r["seconds"] for r in rows],
            }
        )
    return runs


def curve_matrix(curves: list[list[float]]) -> np.ndarray:
    """Seeds x rounds, cut to the shortest curve."""
    n = min(len(c) for c in curves)
    return np.array([c[:n] for c in curves], dtype=float)


def mean_sd(x) -> str:
    x = 100 * np.asarray(x, dtype=float)
    return f"{x.mean():.2f} +- {x.std():.2f}"


def spread_units(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    pooled = np.sqrt((a.std() ** 2 + b.std() ** 2) / 2)
    return float((b.mean() - a.mean()) / pooled) if pooled > 0 else float("nan")


def sides(method: str, loss: bool = False) -> dict[str, np.ndarray]:
    """{"PFLlib": seeds x (R+1) (evaluation 0..R), label: seeds x R (rounds 1..R)} of the
    accuracy, or with `loss` of the loss (PFLlib: train rows, pfljax: test rows)."""
    out = {}
    runs = pfllib_runs(_LOGS.value, method)
    if runs:
        out["PFLlib"] = curve_matrix([r["train_loss" if loss else CURVE[method]] for r in runs])
    for spec in _PFLJAX.value:
        label, workdir = spec.split("=", 1)
        jr = pfljax_runs(workdir, METHODS[method], _SEEDS.value)
        if jr:
            out[f"pfljax ({label})"] = curve_matrix([r["loss" if loss else "acc"] for r in jr])
    return out


def round_table(method: str, loss: bool = False) -> list[str]:
    """Per round: each side's mean +- sd over seeds, and pfljax - PFLlib in seed-spread units
    (loss: PFLlib prints one train loss per evaluation for FedAvg and FedPer, two for Ditto)."""
    data = sides(method, loss)
    ref = data.pop("PFLlib", None)
    if ref is None or not data:
        return []
    what = "loss (PFLlib: train rows, pfljax: test rows)" if loss else "mean test accuracy (%)"
    labels = list(data)
    lines = [
        f"| {method}: {what} after round | PFLlib | " + " | ".join(f"{k} | units" for k in labels) + " |",
        "| --- | --- |" + " --- | --- |" * len(labels),
    ]
    scale, digits = (1, 3) if loss else (100, 2)
    for r in range(1, ref.shape[1]):
        cells = [f"{scale * ref[:, r].mean():.{digits}f} +- {scale * ref[:, r].std():.{digits}f}"]
        for k in labels:
            m = data[k]
            if r > m.shape[1]:
                cells += ["", ""]
                continue
            x = m[:, r - 1]
            cells += [f"{scale * x.mean():.{digits}f} +- {scale * x.std():.{digits}f}"]
            cells += [f"{spread_units(ref[:, r], x):+.2f}"]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return lines


def best_table() -> list[str]:
    lines = [
        "| method | side | seeds | rounds | acc after round 1 (%) | best mean acc (%) "
        "| best - PFLlib's (seed-spread units) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method in selected():
        data = sides(method)
        ref = data.get("PFLlib")
        ref_best = ref[:, 1:].max(axis=1) if ref is not None else None
        for label, m in data.items():
            after = m[:, 1:] if label == "PFLlib" else m
            if ref is not None and label != "PFLlib":  # the rounds both sides ran
                after = after[:, : ref.shape[1] - 1]
            best = after.max(axis=1)
            units = "" if label == "PFLlib" or ref is None else f"{spread_units(ref_best, best):+.2f}"
            lines.append(
                f"| {method} | {label} | {m.shape[0]} | {after.shape[1]} | {mean_sd(after[:, 0])} "
                f"| {mean_sd(best)} | {units} |"
            )
    return lines


def curve_table() -> list[str]:
    lines = ["| method | side | per seed: acc (%) after round 0, 1, ... |", "| --- | --- | --- |"]
    for method in selected():
        for label, m in sides(method).items():
            rows = ["[" + ", ".join(f"{100 * a:.2f}" for a in seed) + "]" for seed in m]
            start = "0" if label == "PFLlib" else "1"
            lines.append(f"| {method} | {label} (rounds {start}..) | {'; '.join(rows)} |")
    return lines


def ditto_global_table() -> list[str]:
    if "Ditto" not in selected():
        return []
    runs = pfllib_runs(_LOGS.value, "Ditto")
    if not runs:
        return []
    g = curve_matrix([r["global"] for r in runs])
    p = curve_matrix([r["personal"] for r in runs])
    both = np.concatenate([g[:, 1:], p[:, 1:]], axis=1).max(axis=1)
    return [
        "| PFLlib Ditto | best (%) |",
        "| --- | --- |",
        f"| global model w | {mean_sd(g[:, 1:].max(axis=1))} |",
        f"| personal models v (compared) | {mean_sd(p[:, 1:].max(axis=1))} |",
        f"| max over both (PFLlib's rs_test_acc, its printed best) | {mean_sd(both)} |",
    ]


def seconds_table() -> list[str]:
    lines = [
        "| method | PFLlib s / round, one seed (rounds 1..R, its Budget) | "
        + " | ".join(f"pfljax {s.split('=')[0]} s / round (seeds in one process)" for s in _PFLJAX.value)
        + " |",
        "| --- | --- |" + " --- |" * len(_PFLJAX.value),
    ]
    for method in selected():
        runs = pfllib_runs(_LOGS.value, method)
        per = [f"seed {r['seed']}: {np.mean(r['seconds'][1:]):.0f}" for r in runs if len(r["seconds"]) > 1]
        cells = []
        for spec in _PFLJAX.value:
            _, workdir = spec.split("=", 1)
            jr = pfljax_runs(workdir, METHODS[method], _SEEDS.value)
            cells.append(f"{np.median(jr[0]['seconds']):.0f} ({len(jr)} seeds)" if jr else "-")
        lines.append(f"| {method} | {', '.join(per)} | " + " | ".join(cells) + " |")
    return lines


def plot(path: str) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    methods = [m for m in selected() if sides(m)]
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods) + 2, 3.8), squeeze=False)
    for ax, method in zip(axes[0], methods):
        data, rounds = sides(method), 1
        for j, (label, m) in enumerate(data.items()):
            m = m[:, 1:] if label == "PFLlib" else m  # PFLlib's evaluation 0: the untrained model
            x = np.arange(1, m.shape[1] + 1) + 0.08 * (j - (len(data) - 1) / 2)
            mu, sd, rounds = 100 * m.mean(0), 100 * m.std(0), max(rounds, m.shape[1])
            line = ax.errorbar(x, mu, yerr=sd, marker="o", capsize=4, label=f"{label}, {m.shape[0]} seeds")
            for seed in m:
                ax.plot(x, 100 * seed, ls="none", marker=".", color=line[0].get_color(), alpha=0.6)
        ax.set_title(f"{method} ({CURVE[method]} models)")
        ax.set_xlabel("updates (PFLlib evaluation r = pfljax round r)")
        ax.set_xticks(range(1, rounds + 1, max(1, rounds // 10)))
        ax.set_xlim(0.6, rounds + 0.4)
        ax.set_ylabel("mean test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = "PFLlib vs pfljax, Fashion-MNIST Dir(0.1), 20 clients:\nmean +- sd (dots: each seed)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    for title, lines in (
        ("best", best_table()),
        ("curves", curve_table()),
        ("ditto", ditto_global_table()),
        ("seconds", seconds_table()),
        *((f"rounds {m}", round_table(m)) for m in selected()),
        # PFLlib prints one train loss per evaluation for these (Ditto: two)
        *((f"loss {m}", round_table(m, loss=True)) for m in ("FedAvg", "FedPer") if m in selected()),
    ):
        print(f"\n<!-- {title} -->")
        print("\n".join(lines))
    if _PNG.value:
        plot(_PNG.value)
        print(f"\nwrote {_PNG.value}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
