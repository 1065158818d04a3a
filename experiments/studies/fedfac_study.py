"""FedFac simulation study (Sec. 4.3 of arXiv 2312.04281): which split of the hidden units?

    nice -n 10 python -m experiments.studies.fedfac_study --settings=0.5:0.4 --seeds=0,1,2 \\
        --out=/tmp/fedfac_study.jsonl
    python -m experiments.studies.fedfac_study --table_only --out=/tmp/fedfac_study.jsonl \\
        --markdown=experiments/results/fedfac_simulation.md

Data: model (8) (`pfljax.data.simulation`), C clients, d=100 covariates, m=200
hidden units, median labels; a one-hidden-layer MLP (200 ReLU units). Every
variant uses the same data, initialization, local training and rounds; the split
variants personalize the generator's number of personalized units,
tau_quantile = 100 (1 - p), so they differ only in WHICH units. The paper's names
are true / oracle / static / dynamic / random:

- true: the true split, fixed from the start: that many personalized units
  (hidden units are permutation-symmetric at initialization, so any fixed set
  of that size is the generator's split up to a relabelling of units). Its run
  also reports how well factor analysis recovers the split from the
  generator's own per-client weights (truth_precision / truth_recall);
- oracle: no training: the generator's own noise-free decision function on
  each client's test data (relu(x W_c^T) a > the client's label cut), the
  accuracy ceiling the label noise leaves. (The paper's text was not at hand
  offline when this was written; this is our reading of "oracle" beside
  "true", and is said as such in the results file.)
- static: factor analysis once, after round 0 (all clients), then fixed;
- dynamic: factor analysis of the sampled clients' weights every round;
- dynamic_updates: the same on their updates;
- eig: dynamic with the authors' released scoring (raw eigenvectors);
- random: the same number of units, drawn at random every round;
- random_static: the same number of units, drawn at random once (round 0), then
  fixed: by the symmetry above, the same method as the oracle;
- fedavg, all_personalized (the hidden layer personal, the head shared), local.

--study=fmnist runs the paper's Tables 3-6 on Fashion-MNIST instead (the
setting of experiments/configs/fedfac_fmnist.py: 10 clients with 4 classes
each, 1000 samples per client, the CNN, SGD 0.05 momentum 0.9, batch 32, one
local epoch; FedFac splits dense_0 with kappa 0.85, tau 50, dynamic):

    nice -n 10 python -m experiments.studies.fedfac_study --study=fmnist --rounds=20 \
        --seeds=0,1,2 --out=/tmp/fedfac_fmnist.jsonl
    python -m experiments.studies.fedfac_study --study=fmnist --rounds=20 --table_only \
        --out=/tmp/fedfac_fmnist.jsonl --markdown=experiments/results/fedfac_fmnist_tables.md

- Table 3 (new clients): 20% of the clients never train; their LocalTrain
  and Ensemble accuracies beside the existing clients', for FedFac static and
  dynamic, tau 0 (FedAvg's global model) and tau 100 (dense_0 personal).
- Table 4 (Lambda): the split layer, conv_0, conv_1, dense_0 or head.
- Table 5 (tau): 25, 50, 75, 100 (100: the whole layer personalized).
- Table 6 (kappa): 0.5, 0.7, 0.85, 0.95.
- References: FedAvg and Local.
Every run is evaluated every round: final accuracy and best_mean_10 (the best
mean over 10 consecutive evaluated rounds, the paper's metric), both weighted
by test size. --runs picks some of the runs by name (see FMNIST_RUNS).

OPENBLAS_NUM_THREADS defaults to 1 here (a multi-threaded OpenBLAS makes the
factor analysis' eigh ~30x slower on a loaded 2-core machine).

Factor-analysis variants also record the analysis' convergence over the run
(fa_solves: rounds with an analysis; fa_iterations_mean / _max: "ipf"
principal-axis solves; fa_change_max: the largest final communality change;
fa_converged_fraction), and "true" the convergence of its analysis of the
generator's weights (truth_fa_*); the tables show them.

--truth_only trains nothing: for every setting and seed it only factor-analyses
the generator's own per-client weights (as the "true" runs do; variant
"truth_fa" in --out), for the truth-recovery table:

    nice -n 10 python -m experiments.studies.fedfac_study --truth_only \
        --settings=0.5:0.4,0.3:0.4,0.5:0.2,0.5:0.6,0.7:0.4 --seeds=0,1,2 --out=/tmp/fedfac_study.jsonl

Each finished run appends one JSON line to --out (so a study can be resumed and
split over several invocations); --table_only rebuilds the Markdown table.
"""

from __future__ import annotations

import os

# LAPACK (eigh) through OpenBLAS: its threads slow a 200 x 200 eigh ~30x on a busy CPU.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json  # noqa: E402
import time  # noqa: E402

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import fedavg, fedfac
from pfljax.algorithms import local as local_alg
from pfljax.core.factor import factor_split, unit_observations
from pfljax.core.local import LocalTraining
from pfljax.data import build_federated_data
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_list("settings", ["0.5:0.4"], "p:alpha pairs")
flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (data, init and training)")
flags.DEFINE_list(
    "variants",
    [
        "true",
        "oracle",
        "static",
        "dynamic",
        "dynamic_updates",
        "eig",
        "random",
        "random_static",
        "fedavg",
        "all_personalized",
        "local",
    ],
    "variants to run",
)
flags.DEFINE_integer("clients", 100, "C")
flags.DEFINE_integer("clients_per_round", 0, "K (0: all)")
flags.DEFINE_integer("samples", 500, "samples per client (80% train, 20% test)")
flags.DEFINE_integer("rounds", 300, "communication rounds")
flags.DEFINE_integer("epochs", 1, "local epochs per round")
flags.DEFINE_integer("batch_size", 32, "local batch size")
flags.DEFINE_float("lr", 0.05, "local SGD learning rate (momentum 0.9)")
flags.DEFINE_float("kappa", 0.85, "factor analysis kappa")
flags.DEFINE_integer("eval_every", 50, "evaluate every this many rounds")
flags.DEFINE_string("client_map", "auto", "client mapping strategy")
flags.DEFINE_string("out", "/tmp/fedfac_study.jsonl", "JSONL of finished runs (appended)")
flags.DEFINE_string("markdown", "", "write the results table here")
flags.DEFINE_bool("table_only", False, "only rebuild the table from --out")
flags.DEFINE_bool(
    "truth_only", False, "simulation: only factor-analyse the generator's own weights (no training)"
)
flags.DEFINE_enum("study", "simulation", ["simulation", "fmnist"], "which study")
flags.DEFINE_list("runs", [], "fmnist: run names (empty: all of FMNIST_RUNS)")
flags.DEFINE_string("data_dir", "/usr/share/datasets/fashion-mnist", "fmnist: IDX files")


def variant_algorithm(name: str, model, spec, p: float, cpr):
    tau = 100.0 * (1.0 - p)
    common = dict(clients_per_round=cpr, client_map=FLAGS.client_map)
    fac = dict(common, layers=(0,), kappa=FLAGS.kappa, tau_quantile=tau)
    table = {
        "true": lambda: fedfac.build(model, spec, split="fixed", **fac),
        "static": lambda: fedfac.build(model, spec, mode="static", **fac),
        "dynamic": lambda: fedfac.build(model, spec, mode="dynamic", **fac),
        "dynamic_updates": lambda: fedfac.build(model, spec, mode="dynamic", split_input="updates", **fac),
        "eig": lambda: fedfac.build(model, spec, mode="dynamic", method="eig", **fac),
        "random": lambda: fedfac.build(model, spec, mode="dynamic", split="random", **fac),
        "random_static": lambda: fedfac.build(model, spec, mode="static", split="random", **fac),
        "fedavg": lambda: fedavg.build(model, spec, **common),
        "all_personalized": lambda: fedfac.build(model, spec, **dict(fac, tau_quantile=100.0, split="fixed")),
        "local": lambda: fedavg.build(model, spec, local_leaves=(".*",), **common),
    }
    if name not in table:
        raise ValueError(f"variant must be one of {sorted(table)}, got {name!r}")
    return table[name]()


def weighted_accuracy(per_client) -> float:
    count = np.asarray(per_client["count"], np.float64)
    return float(np.sum(np.asarray(per_client["accuracy"]) * count) / count.sum())


def oracle_accuracy(fed) -> float:
    """The generator's noise-free decision function on every client's test data, weighted."""
    truth, test = fed.truth, fed.data.test.padded()
    w = np.asarray(truth["hidden_weights"], np.float64)  # [C, m, d]
    h = (
        np.maximum(np.einsum("cnd,cmd->cnm", np.asarray(test.x, np.float64), w), 0.0)
        @ truth["output_weights"]
    )
    pred = (h > np.asarray(truth["thresholds"])[:, None]).astype(np.int32)
    count = np.asarray(test.count)
    valid = np.arange(pred.shape[1])[None, :] < count[:, None]
    return float(np.sum((pred == np.asarray(test.y)) & valid) / count.sum())


def truth_recovery(truth, p: float) -> dict:
    """Factor analysis on the generator's true per-client weights: does it find the shared units?"""
    z = unit_observations(jnp.asarray(truth["hidden_weights"]).transpose(0, 2, 1))  # [C * d, m]
    res = factor_split(z, kappa=FLAGS.kappa, tau_quantile=100.0 * (1.0 - p))
    pred, true = np.asarray(res.shared), np.asarray(truth["shared_unit_mask"])
    hits = float(np.sum(pred & true))
    return {
        "truth_fa_iterations": int(res.iterations),
        "truth_fa_change": float(res.change),
        "truth_fa_converged": bool(res.converged),
        "truth_num_factors": int(res.num_factors),
        "truth_precision": hits / max(pred.sum(), 1),
        "truth_recall": hits / max(true.sum(), 1),
    }


def run_one(variant: str, p: float, alpha: float, seed: int) -> dict:
    fed = build_federated_data(
        "simulation",
        FLAGS.clients,
        seed=seed,
        source_kwargs={"samples_per_client": FLAGS.samples, "p": p, "alpha": alpha},
    )
    if variant == "oracle":
        acc = oracle_accuracy(fed)
        return {
            "variant": variant, "p": p, "alpha": alpha, "seed": seed, "rounds": FLAGS.rounds,
            "clients": FLAGS.clients, "clients_per_round": FLAGS.clients_per_round,
            "samples": FLAGS.samples, "lr": FLAGS.lr, "epochs": FLAGS.epochs,
            "accuracy": acc, "curve": [], "seconds": 0.0,
        }  # fmt: skip
    model = build_model("mlp", fed.input_shape, fed.num_classes, hidden=(200,))
    spec = LocalTraining(optax.sgd(FLAGS.lr, momentum=0.9), batch_size=FLAGS.batch_size, epochs=FLAGS.epochs)
    alg = variant_algorithm(variant, model, spec, p, FLAGS.clients_per_round or None)
    state = alg.init(jax.random.key(seed), None, FLAGS.clients)
    rnd, evaluate = jax.jit(alg.round), jax.jit(alg.evaluate)
    curve, split_trace, fa_iters, fa_change, fa_conv = [], [], [], [], []
    t0 = time.perf_counter()
    for r in range(FLAGS.rounds):
        state, metrics = rnd(state, fed.data, jax.random.fold_in(jax.random.key(seed), 1000 + r))
        if "shared_fraction" in metrics:
            split_trace.append((float(metrics["shared_fraction"]), float(metrics["unchanged_fraction"])))
        for k, v in metrics.items():  # rounds with a factor analysis ("ipf": its solves, > 0)
            if k.startswith("fa_iterations_") and int(v) > 0:
                fa_iters.append(int(v))
                fa_change.append(float(metrics[k.replace("iterations", "change")]))
                fa_conv.append(float(metrics[k.replace("iterations", "converged")]))
        if (r + 1) % FLAGS.eval_every == 0 or r + 1 == FLAGS.rounds:
            eval_key = jax.random.fold_in(jax.random.key(seed), 2000 + r)  # no variant here draws from it
            curve.append((r + 1, weighted_accuracy(evaluate(state, fed.data, eval_key))))
    seconds = time.perf_counter() - t0
    out = {
        "variant": variant,
        "p": p,
        "alpha": alpha,
        "seed": seed,
        "rounds": FLAGS.rounds,
        "clients": FLAGS.clients,
        "clients_per_round": FLAGS.clients_per_round,
        "samples": FLAGS.samples,
        "lr": FLAGS.lr,
        "epochs": FLAGS.epochs,
        "accuracy": curve[-1][1],
        "curve": curve,
        "seconds": seconds,
    }
    if split_trace:
        unchanged = np.asarray([u for _, u in split_trace])
        out["shared_fraction_final"] = split_trace[-1][0]
        out["unchanged_first10"] = float(unchanged[1:11].mean()) if len(unchanged) > 1 else 1.0
        out["unchanged_last50"] = float(unchanged[-50:].mean())
    if fa_iters:
        out["fa_solves"] = len(fa_iters)
        out["fa_iterations_mean"] = float(np.mean(fa_iters))
        out["fa_iterations_max"] = int(np.max(fa_iters))
        out["fa_change_max"] = float(np.max(fa_change))
        out["fa_converged_fraction"] = float(np.mean(fa_conv))
    if variant == "true":
        out.update(truth_recovery(fed.truth, p))
    return out


def truth_one(p: float, alpha: float, seed: int) -> dict:
    """No training: factor analysis of the generator's own per-client weights (variant "truth_fa")."""
    fed = build_federated_data(
        "simulation",
        FLAGS.clients,
        seed=seed,
        source_kwargs={"samples_per_client": FLAGS.samples, "p": p, "alpha": alpha},
    )
    return {
        "variant": "truth_fa", "p": p, "alpha": alpha, "seed": seed, "rounds": FLAGS.rounds,
        "clients": FLAGS.clients, "clients_per_round": FLAGS.clients_per_round,
        "samples": FLAGS.samples, "lr": FLAGS.lr, "epochs": FLAGS.epochs, "kappa": FLAGS.kappa,
        **truth_recovery(fed.truth, p),
    }  # fmt: skip


def done_runs(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(runs: list[dict]) -> str:
    """Markdown: one row per (p, alpha), one column per variant, mean +- std over seeds."""
    variants = [v for v in FLAGS.variants if any(r["variant"] == v for r in runs)]
    settings = sorted({(r["p"], r["alpha"]) for r in runs})
    lines = [
        "| p | alpha | seeds | " + " | ".join(variants) + " |",
        "|---|---|---|" + "---|" * len(variants),
    ]
    for p, alpha in settings:
        cells, seeds = [], set()
        for v in variants:
            acc = [100 * r["accuracy"] for r in runs if (r["p"], r["alpha"], r["variant"]) == (p, alpha, v)]
            seeds |= {r["seed"] for r in runs if (r["p"], r["alpha"], r["variant"]) == (p, alpha, v)}
            cells.append(f"{np.mean(acc):.2f} +- {np.std(acc):.2f} (n={len(acc)})" if acc else "-")
        lines.append(f"| {p} | {alpha} | {len(seeds)} | " + " | ".join(cells) + " |")
    stab = [
        "",
        "| p | alpha | variant | unchanged (rounds 1-10) | unchanged (last 50) "
        "| fa solves / mean (max) iterations / max change / converged |",
        "|---|---|---|---|---|---|",
    ]
    for p, alpha in settings:
        for v in ("static", "dynamic", "dynamic_updates", "eig", "random", "random_static"):
            rs = [
                r
                for r in runs
                if (r["p"], r["alpha"], r["variant"]) == (p, alpha, v) and "unchanged_last50" in r
            ]
            if rs:
                fa = [r for r in rs if "fa_iterations_mean" in r]
                fa_cell = (
                    f"{np.mean([r['fa_solves'] for r in fa]):.0f} / "
                    f"{np.mean([r['fa_iterations_mean'] for r in fa]):.1f} "
                    f"({max(r['fa_iterations_max'] for r in fa)}) / "
                    f"{max(r['fa_change_max'] for r in fa):.1e} / "
                    f"{np.mean([r['fa_converged_fraction'] for r in fa]):.3f}"
                    if fa
                    else "-"
                )
                stab.append(
                    f"| {p} | {alpha} | {v} | {np.mean([r['unchanged_first10'] for r in rs]):.3f} | "
                    f"{np.mean([r['unchanged_last50'] for r in rs]):.3f} | {fa_cell} |"
                )
    truth = [
        "",
        "| p | alpha | seed | factors | precision | recall | ipf solves / change / converged |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "truth_precision" in r:
            conv = (
                f"{r['truth_fa_iterations']} / {r['truth_fa_change']:.1e} / {r['truth_fa_converged']}"
                if "truth_fa_iterations" in r
                else "- (before the fix)"
            )
            truth.append(
                f"| {r['p']} | {r['alpha']} | {r['seed']} | {r['truth_num_factors']} | "
                f"{r['truth_precision']:.3f} | {r['truth_recall']:.3f} | {conv} |"
            )
    return "\n".join(lines + stab + truth) + "\n"


# --- Fashion-MNIST: Tables 3-6 ----------------------------------------------------------------

FMNIST_BASE = dict(layers=("dense_0",), kappa=0.85, tau_quantile=50.0, mode="dynamic")
# name -> (table, label, algorithm, FedFac options over FMNIST_BASE)
FMNIST_RUNS = {
    "fedavg": ("ref", "FedAvg", "fedavg", {}),
    "local": ("ref", "Local", "local", {}),
    "base": ("4,5,6", "dense_0, tau 50, kappa 0.85", "fedfac", {}),
    "lambda_conv_0": ("4", "conv_0", "fedfac", dict(layers=("conv_0",))),
    "lambda_conv_1": ("4", "conv_1", "fedfac", dict(layers=("conv_1",))),
    "lambda_head": ("4", "head", "fedfac", dict(layers=("head",))),
    "tau_25": ("5", "25", "fedfac", dict(tau_quantile=25.0)),
    "tau_75": ("5", "75", "fedfac", dict(tau_quantile=75.0)),
    "tau_100": ("5", "100 (+inf)", "fedfac", dict(tau_quantile=100.0)),
    "kappa_0.5": ("6", "0.5", "fedfac", dict(kappa=0.5)),
    "kappa_0.7": ("6", "0.7", "fedfac", dict(kappa=0.7)),
    "kappa_0.95": ("6", "0.95", "fedfac", dict(kappa=0.95)),
    "new_dynamic": ("3", "FedFac dynamic", "fedfac", dict(new_client_fraction=0.2)),
    "new_static": ("3", "FedFac static", "fedfac", dict(new_client_fraction=0.2, mode="static")),
    "new_tau_0": (
        "3",
        "tau 0 (FedAvg's global model)",
        "fedfac",
        dict(new_client_fraction=0.2, tau_quantile=0.0),
    ),
    "new_tau_100": (
        "3",
        "tau 100 (dense_0 personal)",
        "fedfac",
        dict(new_client_fraction=0.2, tau_quantile=100.0),
    ),
}


def best_mean(curve: list, window: int = 10) -> float:
    """Best mean over `window` consecutive evaluated rounds (all of them if fewer)."""
    acc = np.asarray([a for _, a in curve])
    if len(acc) <= window:
        return float(acc.mean())
    return float(np.max(np.convolve(acc, np.ones(window) / window, mode="valid")))


def fmnist_run(name: str, seed: int, cache: dict) -> dict:
    if seed not in cache:
        cache[seed] = build_federated_data(
            "fashion_mnist", 10, partition="classes", classes_per_client=4, samples_per_client=1000,
            seed=seed, data_dir=FLAGS.data_dir,
        )  # fmt: skip
    fed = cache[seed]
    table_id, label, kind, options = FMNIST_RUNS[name]
    model = build_model("cnn", fed.input_shape, fed.num_classes)
    spec = LocalTraining(optax.sgd(FLAGS.lr, momentum=0.9), batch_size=FLAGS.batch_size, epochs=FLAGS.epochs)
    common = dict(client_map=FLAGS.client_map)
    if kind == "fedavg":
        alg = fedavg.build(model, spec, **common)
    elif kind == "local":
        alg = local_alg.build(model, spec, **common)
    else:
        alg = fedfac.build(model, spec, **common, **{**FMNIST_BASE, **options})
    state = alg.init(jax.random.key(seed), None, 10)
    rnd, evaluate = jax.jit(alg.round), jax.jit(alg.evaluate)
    curve, fa_iters, fa_conv, per_client = [], [], [], None
    t0 = time.perf_counter()
    for r in range(FLAGS.rounds):
        state, metrics = rnd(state, fed.data, jax.random.fold_in(jax.random.key(seed), 1000 + r))
        for k, v in metrics.items():
            if k.startswith("fa_iterations_") and int(v) > 0:
                fa_iters.append(int(v))
                fa_conv.append(float(metrics[k.replace("iterations", "converged")]))
        per_client = evaluate(state, fed.data, jax.random.fold_in(jax.random.key(seed), 2000 + r))
        existing = np.asarray(per_client.get("new_client", np.zeros(10))) == 0
        count = np.asarray(per_client["count"], np.float64) * existing
        acc = float(np.sum(np.asarray(per_client["accuracy"]) * count) / count.sum())
        curve.append((r + 1, acc))
    out = {
        "study": "fmnist", "run": name, "table": table_id, "label": label, "seed": seed,
        "rounds": FLAGS.rounds, "lr": FLAGS.lr, "epochs": FLAGS.epochs,
        "accuracy": curve[-1][1], "best_mean_10": best_mean(curve), "curve": curve,
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    if fa_iters:
        out["fa_iterations_mean"] = float(np.mean(fa_iters))
        out["fa_iterations_max"] = int(np.max(fa_iters))
        out["fa_converged_fraction"] = float(np.mean(fa_conv))
    if kind == "fedfac":
        report = fedfac.final_report(state, fed, {k: np.asarray(v) for k, v in per_client.items()})
        out.update({k: v for k, v in report.items() if k.startswith(("new_clients", "existing"))})
    return out


def cell(values, scale=100.0) -> str:
    v = scale * np.asarray(values, np.float64)
    return f"{v.mean():.2f} +- {v.std():.2f}" if len(v) else "-"


def fmnist_table(runs: list[dict]) -> str:
    by = {}
    for r in runs:
        by.setdefault(r["run"], []).append(r)
    seeds = sorted({r["seed"] for r in runs})

    def row(name, label=None, extra=()):
        rs = by.get(name, [])
        if not rs:
            return None
        label = label or FMNIST_RUNS[name][1]
        fa = [r["fa_iterations_mean"] for r in rs if "fa_iterations_mean" in r]
        conv = [r["fa_converged_fraction"] for r in rs if "fa_converged_fraction" in r]
        fa_cell = f"{np.mean(fa):.0f} / {np.mean(conv):.2f}" if fa else "-"
        cells = [cell([r["accuracy"] for r in rs]), cell([r["best_mean_10"] for r in rs])]
        cells += [cell([r[k] for r in rs if k in r]) for k in extra]
        return f"| {label} | " + " | ".join(cells) + f" | {fa_cell} | {len(rs)} |"

    head = "| {} | final acc (%) | best mean-10 (%) |{} fa solves / converged | seeds |"
    out = []
    sections = [
        ("Table 4 (Lambda): the split layer", "Lambda",
         [("lambda_conv_0", None), ("lambda_conv_1", None), ("base", "dense_0"), ("lambda_head", None)]),
        ("Table 5 (tau): percent of dense_0's units personalized", "tau",
         [("tau_25", None), ("base", "50"), ("tau_75", None), ("tau_100", None)]),
        ("Table 6 (kappa): cumulative eigenvalue share fixing the number of factors", "kappa",
         [("kappa_0.5", None), ("kappa_0.7", None), ("base", "0.85"), ("kappa_0.95", None)]),
        ("References", "method",
         [("fedavg", None), ("local", None), ("base", "FedFac (dense_0, tau 50, kappa 0.85)")]),
    ]  # fmt: skip
    for title, col, rows in sections:
        out += [f"### {title}", "", head.format(col, ""), "|---|---|---|---|---|"]
        out += [line for line in (row(n, lab) for n, lab in rows) if line]
        out.append("")
    extra = ("new_clients_localtrain_accuracy", "new_clients_ensemble_accuracy")
    out += [
        "### Table 3 (new clients): 2 of the 10 clients never train (final round)",
        "",
        head.format("method (final acc: existing clients)", " new, LocalTrain (%) | new, Ensemble (%) |"),
        "|---|---|---|---|---|---|---|",
    ]
    out += [
        line
        for line in (row(n, None, extra) for n in ("new_static", "new_dynamic", "new_tau_0", "new_tau_100"))
        if line
    ]
    out.append("")
    return f"Seeds: {seeds}.\n\n" + "\n".join(out) + "\n"


def fmnist_main():
    runs = [r for r in done_runs(FLAGS.out) if r.get("study") == "fmnist"]
    names = FLAGS.runs or list(FMNIST_RUNS)
    for name in names:
        if name not in FMNIST_RUNS:
            raise ValueError(f"--runs entries must be among {sorted(FMNIST_RUNS)}, got {name!r}")
    if not FLAGS.table_only:
        cache = {}
        for seed in (int(s) for s in FLAGS.seeds):
            for name in names:
                if any((r["run"], r["seed"], r["rounds"]) == (name, seed, FLAGS.rounds) for r in runs):
                    continue
                result = fmnist_run(name, seed, cache)
                runs.append(result)
                with open(FLAGS.out, "a") as f:
                    f.write(json.dumps(result) + "\n")
                print(
                    f"seed={seed} {name:14s} acc={100 * result['accuracy']:.2f} "
                    f"best10={100 * result['best_mean_10']:.2f} ({result['seconds']:.0f}s)",
                    flush=True,
                )
    runs = [r for r in runs if r["rounds"] == FLAGS.rounds]
    text = fmnist_table(runs)
    print(text)
    if FLAGS.markdown and runs:
        with open(FLAGS.markdown, "w") as f:
            f.write(text)


def main(argv):
    del argv
    if FLAGS.study == "fmnist":
        return fmnist_main()
    runs = [r for r in done_runs(FLAGS.out) if r.get("study", "simulation") == "simulation"]
    if not FLAGS.table_only:
        for setting in FLAGS.settings:
            p, alpha = (float(v) for v in setting.split(":"))
            for seed in (int(s) for s in FLAGS.seeds):
                for variant in ["truth_fa"] if FLAGS.truth_only else FLAGS.variants:
                    key = (variant, p, alpha, seed, FLAGS.rounds)
                    if any((r["variant"], r["p"], r["alpha"], r["seed"], r["rounds"]) == key for r in runs):
                        continue
                    if variant == "truth_fa":
                        result = truth_one(p, alpha, seed)
                        runs.append(result)
                        with open(FLAGS.out, "a") as f:
                            f.write(json.dumps(result) + "\n")
                        print(json.dumps(result), flush=True)
                        continue
                    result = run_one(variant, p, alpha, seed)
                    runs.append(result)
                    with open(FLAGS.out, "a") as f:
                        f.write(json.dumps(result) + "\n")
                    print(
                        f"p={p} alpha={alpha} seed={seed} {variant:17s} acc={100 * result['accuracy']:.2f} "
                        f"({result['seconds']:.0f}s)",
                        flush=True,
                    )
    runs = [r for r in runs if r["rounds"] == FLAGS.rounds]
    text = table(runs)
    print(text)
    if FLAGS.markdown and runs:
        r = runs[0]
        header = (
            f"Test accuracy (%) after {r['rounds']} rounds, weighted by test size, mean +- std over seeds. "
            f"C={r['clients']} clients ({r['clients_per_round'] or r['clients']} per round), "
            f"{r['samples']} samples per client (80/20 train/test), d=100, m=200, median labels; "
            f"MLP 100-200-2, SGD lr={r['lr']} momentum 0.9, batch 32, {r['epochs']} local epoch(s); "
            f"kappa={FLAGS.kappa}; split variants personalize 100(1-p)% of the hidden units.\n"
            "Reproduce: `python -m experiments.studies.fedfac_study` (see its docstring).\n\n"
        )
        with open(FLAGS.markdown, "w") as f:
            f.write(header + text)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
