"""FedFac simulation study (Sec. 4.3 of arXiv 2312.04281): which split of the hidden units?

    nice -n 10 python -m experiments.fedfac_study --settings=0.5:0.4 --seeds=0,1,2 \\
        --out=/tmp/fedfac_study.jsonl
    python -m experiments.fedfac_study --table_only --out=/tmp/fedfac_study.jsonl \\
        --markdown=experiments/results/fedfac_simulation.md

Data: model (8) (`pfljax.data.simulation`), C clients, d=100 covariates, m=200
hidden units, median labels; a one-hidden-layer MLP (200 ReLU units). Every
variant uses the same data, initialization, local training and rounds; the split
variants personalize the generator's number of personalized units,
tau_quantile = 100 (1 - p), so they differ only in WHICH units:

- oracle: a fixed split with that many personalized units (hidden units are
  permutation-symmetric at initialization, so any fixed set of that size is the
  oracle up to a relabelling of units);
- static: factor analysis once, after round 0 (all clients), then fixed;
- dynamic: factor analysis of the sampled clients' weights every round;
- dynamic_updates: the same on their updates;
- eig: dynamic with the authors' released scoring (raw eigenvectors);
- random: the same number of units, drawn at random every round;
- random_static: the same number of units, drawn at random once (round 0), then
  fixed: by the symmetry above, the same method as the oracle;
- fedavg, all_personalized (the hidden layer personal, the head shared), local.

OPENBLAS_NUM_THREADS defaults to 1 here (a multi-threaded OpenBLAS makes the
factor analysis' eigh ~30x slower on a loaded 2-core machine).

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
from pfljax.core.factor import factor_split, unit_observations
from pfljax.core.local import LocalTraining
from pfljax.data import build_federated_data
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_list("settings", ["0.5:0.4"], "p:alpha pairs")
flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (data, init and training)")
flags.DEFINE_list(
    "variants",
    [
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


def variant_algorithm(name: str, model, spec, p: float, cpr):
    tau = 100.0 * (1.0 - p)
    common = dict(clients_per_round=cpr, client_map=FLAGS.client_map)
    fac = dict(common, layers=(0,), kappa=FLAGS.kappa, tau_quantile=tau)
    table = {
        "oracle": lambda: fedfac.build(model, spec, split="fixed", **fac),
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


def truth_recovery(truth, p: float) -> dict:
    """Factor analysis on the generator's true per-client weights: does it find the shared units?"""
    z = unit_observations(jnp.asarray(truth["hidden_weights"]).transpose(0, 2, 1))  # [C * d, m]
    res = factor_split(z, kappa=FLAGS.kappa, tau_quantile=100.0 * (1.0 - p))
    pred, true = np.asarray(res.shared), np.asarray(truth["shared_unit_mask"])
    hits = float(np.sum(pred & true))
    return {
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
    model = build_model("mlp", fed.input_shape, fed.num_classes, hidden=(200,))
    spec = LocalTraining(optax.sgd(FLAGS.lr, momentum=0.9), batch_size=FLAGS.batch_size, epochs=FLAGS.epochs)
    alg = variant_algorithm(variant, model, spec, p, FLAGS.clients_per_round or None)
    state = alg.init(jax.random.key(seed), None, FLAGS.clients)
    rnd, evaluate = jax.jit(alg.round), jax.jit(alg.evaluate)
    curve, split_trace = [], []
    t0 = time.perf_counter()
    for r in range(FLAGS.rounds):
        state, metrics = rnd(state, fed.data, jax.random.fold_in(jax.random.key(seed), 1000 + r))
        if "shared_fraction" in metrics:
            split_trace.append((float(metrics["shared_fraction"]), float(metrics["unchanged_fraction"])))
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
    if variant == "oracle":
        out.update(truth_recovery(fed.truth, p))
    return out


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
        "| p | alpha | variant | unchanged (rounds 1-10) | unchanged (last 50) |",
        "|---|---|---|---|---|",
    ]
    for p, alpha in settings:
        for v in ("static", "dynamic", "dynamic_updates", "eig", "random", "random_static"):
            rs = [
                r
                for r in runs
                if (r["p"], r["alpha"], r["variant"]) == (p, alpha, v) and "unchanged_last50" in r
            ]
            if rs:
                stab.append(
                    f"| {p} | {alpha} | {v} | {np.mean([r['unchanged_first10'] for r in rs]):.3f} | "
                    f"{np.mean([r['unchanged_last50'] for r in rs]):.3f} |"
                )
    truth = ["", "| p | alpha | seed | factors | precision | recall |", "|---|---|---|---|---|---|"]
    for r in runs:
        if "truth_precision" in r:
            truth.append(
                f"| {r['p']} | {r['alpha']} | {r['seed']} | {r['truth_num_factors']} | "
                f"{r['truth_precision']:.3f} | {r['truth_recall']:.3f} |"
            )
    return "\n".join(lines + stab + truth) + "\n"


def main(argv):
    del argv
    runs = done_runs(FLAGS.out)
    if not FLAGS.table_only:
        for setting in FLAGS.settings:
            p, alpha = (float(v) for v in setting.split(":"))
            for seed in (int(s) for s in FLAGS.seeds):
                for variant in FLAGS.variants:
                    key = (variant, p, alpha, seed, FLAGS.rounds)
                    if any((r["variant"], r["p"], r["alpha"], r["seed"], r["rounds"]) == key for r in runs):
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
            "Reproduce: `python -m experiments.fedfac_study` (see its docstring).\n\n"
        )
        with open(FLAGS.markdown, "w") as f:
            f.write(header + text)


if __name__ == "__main__":
    app.run(main)
