"""FedeRiCo vs Local, FedAvg and FedAvg+ on Fashion-MNIST groups (the paper's Table 1 setting).

    python -m experiments.federico_study [--schemes=groups,permuted] [--groups=2,3,4]
        [--seeds=0,1,2] [--rounds=50] [--samples_per_client=900] [--out=study.jsonl]
        [--federico_options='{"loss_scale": "mean"}']

8 clients in G groups (client c in group floor(c * G / 8)), data-scarce
(`samples_per_client` of each client's ~8750-sample share, 80/20 train/test):

- "groups": disjoint label sets, each group's K // G classes relabelled
  0..K//G-1 (`partition="groups", group_relabel=True`);
- "permuted": an IID partition with labels permuted per group
  (`partition="iid", permute_labels="group"`): every client sees all 10
  classes, and labels conflict across groups.

Every method trains the same MLP (784-200-K) with Adam (lr 1e-3, batch 32), one
local epoch (FedeRiCo: one epoch of M-steps) per round, for `rounds` rounds,
and is evaluated on each client's own test rows at the end (mean weighted by
test size). FedeRiCo also reports its own-model accuracy and the posterior mass
each client puts on its own group's models. One JSON object per run goes to
--out; a table of means (and std over seeds) is printed at the end.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import fedavg, fedavg_ft, federico, local
from pfljax.core.evaluate import summarize
from pfljax.core.local import LocalTraining
from pfljax.data import build_federated_data
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_list("schemes", ["groups", "permuted"], "label schemes: groups, permuted")
flags.DEFINE_list("groups", ["2", "3", "4"], "numbers of groups G")
flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (data split and initialisation)")
flags.DEFINE_list("methods", ["federico", "local", "fedavg", "fedavg_ft"], "methods to run")
flags.DEFINE_integer("rounds", 50, "communication rounds")
flags.DEFINE_integer("samples_per_client", 900, "samples per client (about 10% of the per-client share)")
flags.DEFINE_integer("num_clients", 8, "clients")
flags.DEFINE_string("federico_options", "{}", "JSON dict of extra federico.build options")
flags.DEFINE_string("out", "", "JSONL file for one record per run (appended)")
flags.DEFINE_string("table_from", "", "only print the table of an existing JSONL file")

METHODS = {"federico": federico, "local": local, "fedavg": fedavg, "fedavg_ft": fedavg_ft}


def make_data(scheme: str, groups: int, seed: int):
    common = dict(num_groups=groups, samples_per_client=FLAGS.samples_per_client, seed=seed)
    if scheme == "groups":
        return build_federated_data(
            "fashion_mnist", FLAGS.num_clients, partition="groups", group_relabel=True, **common
        )
    if scheme == "permuted":
        return build_federated_data(
            "fashion_mnist", FLAGS.num_clients, partition="iid", permute_labels="group", **common
        )
    raise ValueError(f"scheme must be 'groups' or 'permuted', got {scheme!r}")


def run_one(method: str, fd, seed: int) -> dict:
    model = build_model("mlp", fd.input_shape, fd.num_classes, hidden=(200,))
    spec = LocalTraining(optax.adam(1e-3), batch_size=32, epochs=1, steps=None)
    kwargs = json.loads(FLAGS.federico_options) if method == "federico" else {}
    alg = METHODS[method].build(model, spec, **kwargs)
    state = alg.init(jax.random.key(seed), None, FLAGS.num_clients)
    rnd = jax.jit(alg.round)
    t0 = time.perf_counter()
    for _ in range(FLAGS.rounds):
        state, _ = rnd(state, fd.data, jax.random.key(1000 + seed))
    per_client = jax.device_get(jax.jit(alg.evaluate)(state, fd.data, jax.random.key(seed)))
    record = {"accuracy": summarize(per_client)["mean_accuracy"], "seconds": time.perf_counter() - t0}
    if method == "federico":
        groups = np.array([c["group"] for c in fd.summary["clients"]])
        w = (per_client["count"] / per_client["count"].sum()).astype(np.float64)
        mass = federico.group_mass(jax.device_get(state.client_posterior), groups)
        record.update(
            own_model_accuracy=float(np.sum(w * per_client["own_accuracy"])),
            own_group_mass=float(np.mean(mass)),
            own_group_mass_min=float(np.min(mass)),
            group_purity=float(
                np.mean(federico.group_purity(jax.device_get(state.client_posterior), groups))
            ),
            **{k: v for k, v in federico.final_report(state, fd).items() if "group" not in k},
        )
    return record


def main(argv):
    del argv
    if FLAGS.table_from:
        with open(FLAGS.table_from) as f:
            print_table([json.loads(line) for line in f if line.strip()])
        return
    results = []
    for seed in (int(s) for s in FLAGS.seeds):  # seeds outermost: every setting gets seed 0 first
        for scheme in FLAGS.schemes:
            for groups in (int(g) for g in FLAGS.groups):
                fd = make_data(scheme, groups, seed)
                for method in FLAGS.methods:
                    rec = {"scheme": scheme, "groups": groups, "seed": seed, "method": method}
                    rec.update(run_one(method, fd, seed))
                    rec["rounds"] = FLAGS.rounds
                    rec["samples_per_client"] = FLAGS.samples_per_client
                    rec["federico_options"] = FLAGS.federico_options if method == "federico" else None
                    results.append(rec)
                    print(json.dumps(rec), flush=True)
                    if FLAGS.out:
                        with open(FLAGS.out, "a") as f:
                            f.write(json.dumps(rec) + "\n")
    print_table(results)


def print_table(results: list[dict]) -> None:
    """Mean (std) accuracy per setting and method over seeds, and FedeRiCo's wins over Local."""
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]
    print(
        "\nscheme    G  " + "  ".join(f"{m:>15s}" for m in methods) + "  wins  own_group_mass  group_purity"
    )
    for scheme, groups in sorted({(r["scheme"], r["groups"]) for r in results}):
        rows = [r for r in results if (r["scheme"], r["groups"]) == (scheme, groups)]
        acc = {m: {r["seed"]: r["accuracy"] for r in rows if r["method"] == m} for m in methods}
        cells = [
            f"{100 * np.mean(list(a.values())):6.2f} ({100 * np.std(list(a.values())):4.2f})"
            for a in acc.values()
        ]
        fr, lo = acc.get("federico", {}), acc.get("local", {})
        paired = sorted(set(fr) & set(lo))
        wins = f"{sum(fr[s] > lo[s] for s in paired)}/{len(paired)}" if paired else "-"
        fed = [r for r in rows if r["method"] == "federico"]
        mass = ""
        if fed:
            mass = f"{np.mean([r['own_group_mass'] for r in fed]):14.2f}  "
            mass += f"{np.mean([r['group_purity'] for r in fed]):12.2f}"
        print(f"{scheme:9s} {groups}  " + "  ".join(f"{c:>15s}" for c in cells) + f"  {wins:>4s}  {mass}")


if __name__ == "__main__":
    app.run(main)
