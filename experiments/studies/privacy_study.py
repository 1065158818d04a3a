"""Client-level DP on Fashion-MNIST: accuracy of FedAvg, FedPer, FedRep and Ditto vs epsilon.

    python -m experiments.studies.privacy_study --probe            # update norms without clipping or noise
    python -m experiments.studies.privacy_study --clip_norm=C [--seeds=0,1,2] [--rounds=20]

Data: the default config (`experiments/configs/default.py`: Fashion-MNIST,
4 classes per client, 1000 samples per client, 80/20 split) with `--num_clients`
(20) clients, `--clients_per_round` of them sampled without replacement per round.
For every target epsilon of `--epsilons` (at delta `--delta`, 0: 1/C^1.1) the noise
multiplier is the smallest giving that epsilon after `--rounds` rounds
(`pfljax.core.privacy.noise_for_epsilon`); "inf" runs without DP (no clipping, no
noise, the algorithm's default sample weighting; the clients have equal sizes).
Every run goes through `pfljax.experiment.train_and_evaluate` into
`--workdir/<method>_eps<e>_s<seed>` (a finished run is read back, not rerun).

`--probe` runs each method for `--probe_rounds` rounds with DP on but noise 0 and
clip inf, and prints the mean (over participants) norm of the upload's update per
round: the documented basis of the one `--clip_norm` every private run uses.

Writes the markdown table (final and best mean accuracy, mean +- std over seeds)
to `--out` and prints one JSON line per run; `--collect` tabulates the finished
runs only (for seeds or epsilons run by separate processes).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from absl import app, flags

from experiments.configs.default import get_config
from pfljax import algorithms
from pfljax.core.privacy import epsilon, noise_for_epsilon
from pfljax.experiment.cli import parse_flags

FLAGS = flags.FLAGS
flags.DEFINE_list("methods", ["fedavg", "fedper", "fedrep", "ditto"], "algorithms (must support DP)")
flags.DEFINE_list("epsilons", ["1", "4", "8", "inf"], "target epsilons; inf: no DP")
flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (model, sampling and partition)")
flags.DEFINE_integer("num_clients", 20, "clients")
flags.DEFINE_integer("clients_per_round", 10, "clients sampled (without replacement) per round")
flags.DEFINE_integer("rounds", 20, "communication rounds")
flags.DEFINE_float(
    "delta", 0.0, "delta; 0: 1/num_clients^1.1 (the recorded table's; pfljax's dp.delta=0: min(1e-5, that))"
)
flags.DEFINE_float("clip_norm", 0.0, "L2 clip of each upload's update (required unless --probe)")
flags.DEFINE_bool("probe", False, "print update norms without clipping or noise, then stop")
flags.DEFINE_bool("collect", False, "only tabulate the finished runs (skip missing ones)")
flags.DEFINE_integer("probe_rounds", 5, "rounds of the --probe runs")
flags.DEFINE_string("workdir", "/tmp/privacy_study", "one subdirectory per run")
flags.DEFINE_string(
    "out", "experiments/results/privacy_fmnist_table.md", "generated markdown table ('' : none)"
)


def delta() -> float:
    return FLAGS.delta or 1.0 / FLAGS.num_clients**1.1


def make_config(method: str, seed: int, noise: float | None, clip: float, rounds: int):
    """The default config with this study's federation; noise None: no DP."""
    config = get_config()
    config.algorithm = method
    config.seed = seed
    config.num_clients = FLAGS.num_clients
    config.clients_per_round = FLAGS.clients_per_round
    config.rounds = rounds
    config.checkpoint_every = 0
    if noise is not None:
        config.dp.enabled = True
        config.dp.noise_multiplier = noise
        config.dp.clip_norm = clip
        config.dp.delta = delta()
    return config


def run(config, name: str) -> dict:
    from pfljax.experiment import train_and_evaluate  # pylint: disable=import-outside-toplevel

    workdir = os.path.join(FLAGS.workdir, name)
    path = os.path.join(workdir, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
        if summary.get("rounds") == config.rounds:
            return summary
    return train_and_evaluate(config, workdir, progress=False)


def probe() -> None:
    for method in FLAGS.methods:
        name = f"probe_{method}_r{FLAGS.probe_rounds}"
        run(make_config(method, 0, 0.0, math.inf, FLAGS.probe_rounds), name)
        with open(os.path.join(FLAGS.workdir, name, "metrics.jsonl")) as f:
            norms = [json.loads(line)["dp_update_norm"] for line in f]
        print(
            json.dumps({"probe": method, "update_norm_per_round": [round(n, 3) for n in norms]}), flush=True
        )


def solved_noise(target: float) -> float:
    """noise_for_epsilon for this federation, cached in --workdir/noise.json (the
    accountant is slow on a loaded machine and several seeds may run at once)."""
    key = f"{target:g}_{FLAGS.num_clients}_{FLAGS.clients_per_round}_{FLAGS.rounds}_{delta():.10g}"
    path = os.path.join(FLAGS.workdir, "noise.json")
    cache = {}
    if os.path.exists(path):
        with open(path) as f:
            cache = json.load(f)
    if key not in cache:
        cache[key] = noise_for_epsilon(
            target, FLAGS.num_clients, FLAGS.clients_per_round, FLAGS.rounds, delta()
        )
        with open(path + ".tmp", "w") as f:
            json.dump(cache, f)
        os.replace(path + ".tmp", path)
    return cache[key]


def fmt(values: list) -> str:
    v = np.asarray([x for x in values if x is not None], np.float64)
    if len(v) == 0:
        return "-"
    return f"{100 * v.mean():.1f} ± {100 * v.std():.1f}" if len(v) > 1 else f"{100 * v[0]:.1f}"


def main(argv):
    del argv
    for method in FLAGS.methods:
        if not algorithms.supports_privacy(method):
            raise app.UsageError(f"--methods: {method} does not support client-level DP")
    os.makedirs(FLAGS.workdir, exist_ok=True)
    if FLAGS.probe:
        probe()
        return
    if not FLAGS.clip_norm > 0:
        raise app.UsageError("--clip_norm must be > 0 (choose it with --probe)")
    targets = [float(e) for e in FLAGS.epsilons]
    noises = {t: solved_noise(t) for t in targets}
    for t, z in noises.items():
        print(json.dumps({"target_epsilon": t, "noise_multiplier": z}), flush=True)
    results = {}
    for seed in (int(s) for s in FLAGS.seeds):
        for t in targets:
            for method in FLAGS.methods:
                noise = None if math.isinf(t) else noises[t]
                name = f"{method}_eps{t:g}_s{seed}"
                if FLAGS.collect and not os.path.exists(os.path.join(FLAGS.workdir, name, "summary.json")):
                    continue
                s = run(make_config(method, seed, noise, FLAGS.clip_norm, FLAGS.rounds), name)
                row = {
                    "method": method,
                    "target_epsilon": t,
                    "seed": seed,
                    "status": s["status"],
                    "final_mean_accuracy": s["final_mean_accuracy"],
                    "best_mean_accuracy": s["best_mean_accuracy"],
                    "dp_epsilon": s.get("dp_epsilon"),
                    "noise_multiplier": noise,
                    "wall_seconds": s["wall_seconds"],
                }
                print(json.dumps(row), flush=True)
                results.setdefault((method, t), []).append(row)
                if FLAGS.out:
                    write_table(results, noises, targets)


def write_table(results: dict, noises: dict, targets: list) -> None:
    head = "| method | " + " | ".join(f"ε={t:g}" for t in targets) + " |"
    lines = [
        f"Final / best mean test accuracy (%), mean ± std over seeds; {FLAGS.num_clients} clients, "
        f"{FLAGS.clients_per_round} per round, {FLAGS.rounds} rounds, δ={delta():.4g}, "
        f"clip {FLAGS.clip_norm:g}.",
        "",
        head,
        "| --- |" + " --- |" * len(targets),
    ]
    for method in FLAGS.methods:
        cells = []
        for t in targets:
            rows = results.get((method, t), [])
            cells.append(
                f"{fmt([r['final_mean_accuracy'] for r in rows])} / "
                f"{fmt([r['best_mean_accuracy'] for r in rows])}"
                f" (n={len(rows)})"
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "| target ε | noise multiplier z | ε spent after the rounds |", "| --- | --- | --- |"]
    for t in targets:
        z = noises[t]
        spent = (
            epsilon(z, FLAGS.num_clients, FLAGS.clients_per_round, FLAGS.rounds, delta()) if z else math.inf
        )
        lines.append(f"| {t:g} | {z:.4f} | {spent:.4f} |")
    lines += ["", "Runs:", "", "```"]
    lines += [json.dumps(r) for rows in results.values() for r in rows]
    lines += ["```", ""]
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
