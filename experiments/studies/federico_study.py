"""FedeRiCo on Fashion-MNIST groups (the paper's Table 1 setting) and its ablations.

    python -m experiments.studies.federico_study --mode=table [--groups=2,3,4] [--seeds=0,1,2]
        [--methods=federico,local,fedavg,fedavg_ft,cfl,fedem,fedfomo] [--rounds=50]
    python -m experiments.studies.federico_study --mode=accumulate --groups=4 --trace_every=5
    python -m experiments.studies.federico_study --mode=sweep --groups=4 \\
        --sweep='epsilon=0,0.1,0.3,0.6,1;neighbours=1,2,3,5,7;beta=0.1,0.3,0.6,0.9,1'
    # any mode: --out=study.jsonl (one JSON record per run, appended);
    # --table_from=study.jsonl prints the tables of an existing file.

Sui et al., "Find Your Friends: Personalized Federated Learning with the Right
Collaborators" (NeurIPS 2022 FL workshop). 8 clients, each drawn into one of G
data distributions (`--group_assignment`, default "random_nonempty": the
paper's random draw of each client's distribution -- its Fig. 3 has "client 0
alone in distribution 0, in this particular random split" -- redrawn until all
G distributions have a client, so that a "G distributions" row has G; "random"
is the plain draw, "balanced" the default contiguous groups). Data-scarce
(`samples_per_client` of each client's share, 80/20 train/test). Schemes:

- "groups": disjoint label sets, one per distribution (K // G classes each; the
  K % G others unused), source labels kept (`--group_relabel=false`, the paper
  does not relabel; `--group_relabel` maps each set to 0..K//G-1);
- "permuted": an IID partition with labels permuted per distribution (not in
  the paper): every client sees all 10 classes, labels conflict across groups.

Every method trains the same MLP (784-200-K) with Adam (lr 1e-3, batch 32; the
paper's optimizer, `--optimizer=sgd --lr=0.05 --momentum=0.9` for the run
loop's default), one local epoch (FedeRiCo: one epoch of M-steps) per round,
for `rounds` rounds, and is evaluated on each client's own test rows at the
end (mean weighted by test size; test sizes are equal here). Baselines at
their modules' defaults: CFL (eps1 0.4, eps2 1.6, single linkage), FedEM (3
components), FedFomo (5 models, epsilon 0.3 decaying 0.05 per round), FedAvg+
(one epoch of fine-tuning).

Modes:
- table: every method in `--methods` for every G and seed (Table 1);
- accumulate: FedeRiCo with accumulate="ema" and "cumulative" (Fig. 5),
  traced every `trace_every` rounds (accuracy, self weight, effective
  collaborators, own-group mass and purity of the posterior);
- sweep: FedeRiCo with one option varied at a time around the defaults
  (n = 3, epsilon = 0.3, beta = 0.6) (Figs. 6-7).
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import cfl, fedavg, fedavg_ft, fedem, federico, fedfomo, local
from pfljax.core.evaluate import summarize
from pfljax.core.local import LocalTraining
from pfljax.data import build_federated_data
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "table", ["table", "accumulate", "sweep"], "what to run")
flags.DEFINE_list("schemes", ["groups"], "label schemes: groups, permuted")
flags.DEFINE_list("groups", ["2", "3", "4"], "numbers of distributions G")
flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (data split and initialisation)")
flags.DEFINE_list(
    "methods",
    ["federico", "local", "fedavg", "fedavg_ft", "cfl", "cfl_eps1", "fedem", "fedfomo"],
    "methods (table): METHODS and VARIANTS",
)
flags.DEFINE_string(
    "group_assignment", "random_nonempty", "random, random_nonempty or balanced (partition.assign_groups)"
)
flags.DEFINE_bool("group_relabel", False, "relabel each group's classes 0..K//G-1 (not in the paper)")
flags.DEFINE_integer("rounds", 50, "communication rounds")
flags.DEFINE_integer("samples_per_client", 900, "samples per client (about 10% of the per-client share)")
flags.DEFINE_integer("num_clients", 8, "clients")
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd"], "optimizer of every method (the paper: Adam)")
flags.DEFINE_float("lr", 1e-3, "learning rate")
flags.DEFINE_float("momentum", 0.0, "SGD momentum")
flags.DEFINE_string("federico_options", "{}", "JSON dict of extra federico.build options")
flags.DEFINE_string(
    "sweep", "epsilon=0,0.1,0.3,0.6,1;neighbours=1,2,3,5,7;beta=0.1,0.3,0.6,0.9,1", "sweep mode's grid"
)
flags.DEFINE_integer("trace_every", 5, "accumulate mode: rounds between traced evaluations")
flags.DEFINE_string("out", "", "JSONL file for one record per run (appended)")
flags.DEFINE_string("table_from", "", "only print the tables of an existing JSONL file")

METHODS = {
    "federico": federico,
    "local": local,
    "fedavg": fedavg,
    "fedavg_ft": fedavg_ft,
    "cfl": cfl,
    "fedem": fedem,
    "fedfomo": fedfomo,
}
# Variants: (module, options). CFL's eps1 = 0.4 (the released code's MNIST value, FedEM's
# code too) is below the plateau of the mean update norm under Adam here (~0.55-0.6 on
# G=4, seed 0), so CFL never splits; "cfl_eps1" sets eps1 = 1.0 to let it split.
VARIANTS = {"cfl_eps1": ("cfl", {"eps1": 1.0})}


def make_data(scheme: str, groups: int, seed: int):
    common = dict(
        num_groups=groups,
        group_assignment=FLAGS.group_assignment,
        samples_per_client=FLAGS.samples_per_client,
        seed=seed,
    )
    if scheme == "groups":
        return build_federated_data(
            "fashion_mnist",
            FLAGS.num_clients,
            partition="groups",
            group_relabel=FLAGS.group_relabel,
            **common,
        )
    if scheme == "permuted":
        return build_federated_data(
            "fashion_mnist", FLAGS.num_clients, partition="iid", permute_labels="group", **common
        )
    raise ValueError(f"scheme must be 'groups' or 'permuted', got {scheme!r}")


def optimizer():
    if FLAGS.optimizer == "adam":
        return optax.adam(FLAGS.lr)
    return optax.sgd(FLAGS.lr, momentum=FLAGS.momentum or None)


def posterior_stats(state, groups: np.ndarray) -> dict:
    """FedeRiCo's posterior: self weight, effective collaborators, own-group mass, purity."""
    post = np.asarray(jax.device_get(state.client_posterior), np.float64)
    entropy = -np.sum(post * np.log(np.maximum(post, 1e-30)), axis=1)
    return {
        "self_weight": float(np.mean(np.diag(post))),
        "effective_collaborators": float(np.mean(np.exp(entropy))),
        "own_group_mass": float(np.mean(federico.group_mass(post, groups))),
        "group_purity": float(np.mean(federico.group_purity(post, groups))),
    }


def run_one(method: str, fd, seed: int, options: dict | None = None, trace_every: int = 0) -> dict:
    model = build_model("mlp", fd.input_shape, fd.num_classes, hidden=(200,))
    spec = LocalTraining(optimizer(), batch_size=32, epochs=1, steps=None)
    name, fixed = VARIANTS.get(method, (method, {}))
    alg = METHODS[name].build(model, spec, **fixed, **(options or {}))
    state = alg.init(jax.random.key(seed), None, FLAGS.num_clients)
    rnd, ev = jax.jit(alg.round), jax.jit(alg.evaluate)
    groups = np.array([c["group"] for c in fd.summary["clients"]])
    trace = []
    t0 = time.perf_counter()
    for r in range(FLAGS.rounds):
        state, _ = rnd(state, fd.data, jax.random.key(1000 + seed))
        if trace_every and ((r + 1) % trace_every == 0 or r == 0):
            per_client = jax.device_get(ev(state, fd.data, jax.random.key(seed)))
            point = {"round": r + 1, "accuracy": summarize(per_client)["mean_accuracy"]}
            if method == "federico":
                w = per_client["count"] / per_client["count"].sum()
                point["own_model_accuracy"] = float(np.sum(w * per_client["own_accuracy"]))
                point.update(posterior_stats(state, groups))
            trace.append(point)
    per_client = jax.device_get(ev(state, fd.data, jax.random.key(seed)))
    summary = summarize(per_client)
    record = {
        "accuracy": summary["mean_accuracy"],
        "worst10_accuracy": summary["worst10_accuracy"],
        "seconds": time.perf_counter() - t0,
        "client_groups": groups.tolist(),
    }
    if trace:
        record["trace"] = trace
    if method == "federico":
        w = per_client["count"] / per_client["count"].sum()
        record["own_model_accuracy"] = float(np.sum(w * per_client["own_accuracy"]))
        record.update(posterior_stats(state, groups))
        record["own_group_mass_min"] = float(
            np.min(federico.group_mass(jax.device_get(state.client_posterior), groups))
        )
    elif name == "cfl":
        record.update(cfl.final_report(state))
    return record


def runs():
    """(setting, method, options, trace_every) of the mode, per data setting."""
    if FLAGS.mode == "table":
        base = json.loads(FLAGS.federico_options)
        return [(m, base if m == "federico" else {}, 0, {}) for m in FLAGS.methods]
    if FLAGS.mode == "accumulate":
        base = json.loads(FLAGS.federico_options)
        return [
            ("federico", {**base, "accumulate": a}, FLAGS.trace_every, {"accumulate": a})
            for a in ("ema", "cumulative")
        ]
    out = []
    for item in FLAGS.sweep.split(";"):
        name, values = item.split("=")
        for v in values.split(","):
            value = int(v) if name == "neighbours" else float(v)
            opts = {**json.loads(FLAGS.federico_options), name: value}
            out.append(("federico", opts, 0, {"swept": name, "value": value}))
    return out


def main(argv):
    del argv
    if FLAGS.table_from:
        with open(FLAGS.table_from) as f:
            print_tables([json.loads(line) for line in f if line.strip()])
        return
    results = []
    for seed in (int(s) for s in FLAGS.seeds):  # seeds outermost: every setting gets seed 0 first
        for scheme in FLAGS.schemes:
            for groups in (int(g) for g in FLAGS.groups):
                fd = make_data(scheme, groups, seed)
                for method, options, trace_every, tags in runs():
                    rec = {"mode": FLAGS.mode, "scheme": scheme, "groups": groups, "seed": seed}
                    rec.update(method=method, **tags)
                    rec.update(run_one(method, fd, seed, options, trace_every))
                    rec.update(
                        rounds=FLAGS.rounds,
                        samples_per_client=FLAGS.samples_per_client,
                        group_assignment=FLAGS.group_assignment,
                        group_relabel=FLAGS.group_relabel,
                        optimizer=f"{FLAGS.optimizer} lr={FLAGS.lr} momentum={FLAGS.momentum}",
                        options=options,
                    )
                    results.append(rec)
                    print(json.dumps({k: v for k, v in rec.items() if k != "trace"}), flush=True)
                    if FLAGS.out:
                        with open(FLAGS.out, "a") as f:
                            f.write(json.dumps(rec) + "\n")
    print_tables(results)


def _cell(values) -> str:
    return f"{100 * np.mean(values):6.2f} ± {100 * np.std(values):4.2f}" if values else "-"


def print_tables(results: list[dict]) -> None:
    """One markdown table per mode: mean ± std over seeds (std: population, ddof 0)."""
    table = [r for r in results if r.get("mode", "table") == "table"]
    if table:
        methods = [m for m in (*METHODS, *VARIANTS) if any(r["method"] == m for r in table)]
        print("\n| scheme | G | " + " | ".join(methods) + " | FedeRiCo > Local (seeds) | seeds |")
        print("|---|---|" + "---|" * (len(methods) + 2))
        for scheme, groups in sorted({(r["scheme"], r["groups"]) for r in table}):
            rows = [r for r in table if (r["scheme"], r["groups"]) == (scheme, groups)]
            acc = {m: {r["seed"]: r["accuracy"] for r in rows if r["method"] == m} for m in methods}
            fr, lo = acc.get("federico", {}), acc.get("local", {})
            paired = sorted(set(fr) & set(lo))
            wins = f"{sum(fr[s] > lo[s] for s in paired)}/{len(paired)}" if paired else "-"
            seeds = len({r["seed"] for r in rows})
            cells = [_cell(list(acc[m].values())) for m in methods]
            print(f"| {scheme} | {groups} | " + " | ".join(cells) + f" | {wins} | {seeds} |")
        print("\nPaired with Local (same data and seed): accuracy - Local's, mean ± std over seeds, wins")
        print("\n| scheme | G | " + " | ".join(m for m in methods if m != "local") + " |")
        print("|---|---|" + "---|" * (len(methods) - 1))
        for scheme, groups in sorted({(r["scheme"], r["groups"]) for r in table}):
            rows = [r for r in table if (r["scheme"], r["groups"]) == (scheme, groups)]
            acc = {m: {r["seed"]: r["accuracy"] for r in rows if r["method"] == m} for m in methods}
            cells = []
            for m in methods:
                if m == "local":
                    continue
                seeds = sorted(set(acc[m]) & set(acc.get("local", {})))
                d = [acc[m][s] - acc["local"][s] for s in seeds]
                wins = sum(x > 0 for x in d)
                cell = f"{100 * np.mean(d):+.2f} ± {100 * np.std(d):.2f} ({wins}/{len(d)})"
                cells.append(cell if d else "-")
            print(f"| {scheme} | {groups} | " + " | ".join(cells) + " |")
        fed = [r for r in table if r["method"] == "federico"]
        if fed:
            print("\n| scheme | G | own-model acc | self w. | eff. collab. | own-group mass | purity |")
            print("|---|---|---|---|---|---|---|")
            for scheme, groups in sorted({(r["scheme"], r["groups"]) for r in fed}):
                rows = [r for r in fed if (r["scheme"], r["groups"]) == (scheme, groups)]
                m = lambda k, rows=rows: np.mean([r[k] for r in rows])  # noqa: E731
                print(
                    f"| {scheme} | {groups} | {100 * m('own_model_accuracy'):.2f} | {m('self_weight'):.2f} "
                    f"| {m('effective_collaborators'):.2f} | {m('own_group_mass'):.2f} "
                    f"| {m('group_purity'):.2f} |"
                )
        for variant in ("cfl", "cfl_eps1"):
            cf = [r for r in table if r["method"] == variant]
            if cf:
                runs_ = sorted((r["scheme"], r["groups"], r["seed"], r["num_clusters"]) for r in cf)
                print(f"\n{variant} clusters (scheme, G, seed, clusters):", runs_)
    acc = [r for r in results if r.get("mode") == "accumulate"]
    if acc:
        print("\n| G | accumulate | round | accuracy | own-model acc | self weight | eff. collab. | purity |")
        print("|---|---|---|---|---|---|---|---|")
        for groups, kind in sorted({(r["groups"], r["accumulate"]) for r in acc}):
            rows = [r for r in acc if (r["groups"], r["accumulate"]) == (groups, kind)]
            for i, point in enumerate(rows[0]["trace"]):
                pts = [r["trace"][i] for r in rows]
                m = lambda k, pts=pts: np.mean([p[k] for p in pts])  # noqa: E731
                print(
                    f"| {groups} | {kind} | {point['round']} | {_cell([p['accuracy'] for p in pts])} "
                    f"| {100 * m('own_model_accuracy'):.2f} | {m('self_weight'):.2f} "
                    f"| {m('effective_collaborators'):.2f} | {m('group_purity'):.2f} |"
                )
    sweep = [r for r in results if r.get("mode") == "sweep"]
    if sweep:
        print("\n| G | option | value | accuracy | own-model acc | self w. | eff. collab. | purity | seeds |")
        print("|---|---|---|---|---|---|---|---|---|")
        for groups, name, value in sorted({(r["groups"], r["swept"], r["value"]) for r in sweep}):
            rows = [r for r in sweep if (r["groups"], r["swept"], r["value"]) == (groups, name, value)]
            m = lambda k, rows=rows: np.mean([r[k] for r in rows])  # noqa: E731
            print(
                f"| {groups} | {name} | {value:g} | {_cell([r['accuracy'] for r in rows])} "
                f"| {100 * m('own_model_accuracy'):.2f} | {m('self_weight'):.2f} "
                f"| {m('effective_collaborators'):.2f} | {m('group_purity'):.2f} | {len(rows)} |"
            )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
