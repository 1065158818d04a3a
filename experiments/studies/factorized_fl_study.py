"""Factorized-FL on Fashion-MNIST: who collaborates with whom, and accuracy vs baselines.

    python -m experiments.studies.factorized_fl_study [--parts=domains,labels] [--rounds=20] [--json]

domains: 2 groups of `--domain_clients` clients with disjoint classes (relabelled
0..4 per group), labels permuted per client or not; the release's domain settings
(tau 0.95, epsilon 20, min_keep = group size). Prints the collaboration matrix's
mean weight within vs across groups, and the cosine similarity of the match
layer's v within vs across groups (what the server matches on).

labels: `--label_clients` clients, IID or Dirichlet(0.5), labels permuted per
client: Factorized-FL (base and beta; the release's label settings tau 0,
epsilon 1, min_keep C/2) vs FedAvg with a local head vs Local vs FedAvg, mean
test accuracy (weighted by test size) after `--rounds` rounds. The control
"factorized_local" trains the factorized model with no mixing (each client
keeps only itself), separating the architecture from the collaboration.

ablations: the paper's Fig. 8 on the label-heterogeneous split (`--label_clients`
clients, Dirichlet(0.5), labels permuted per client, the release's label settings),
one run per seed of `--seeds`: Factorized-FL; the factorized model under plain
FedAvg (matching="fedavg": u only, and every leaf but the local head); without mu
(use_mu=False); random and worst matching; the factorized model alone; FedAvg with
a local head on the plain model (and, when named in --variants, Local and FedAvg on
the plain model: plain_local, plain_fedavg); and lambda_sparse over `--lambdas` (accuracy,
share of mu entries the release would keep (|mu| >= lambda, non-zero), share with
|mu| >= 1e-3, mean |mu|, accuracy with mu pruned at lambda as the release
evaluates). `--ablation_split=domains` runs the same variants on the 2-group
domain split (`--domain_clients`, labels not permuted, the release's domain
settings), where the similarity rule does select.

Models: `--model` (mlp: 784-200-K; cnn; resnet9 with `--widths`); the baselines
use the unfactorized architecture of the same name.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import factorized_fl, fedavg, local, model_variant
from pfljax.core.clients import as_client_map
from pfljax.core.evaluate import summarize
from pfljax.core.local import LocalTraining
from pfljax.data import build_federated_data
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["domains", "labels"], "domains, labels, ablations")
flags.DEFINE_integer("rounds", 20, "communication rounds")
flags.DEFINE_integer("domain_clients", 8, "clients of the 2-group domain split")
flags.DEFINE_integer("label_clients", 20, "clients of the label-heterogeneity runs")
flags.DEFINE_integer("samples", 300, "samples per client (before the 80/20 split)")
flags.DEFINE_string("model", "mlp", "mlp, cnn or resnet9")
flags.DEFINE_list("widths", ["16", "32", "64"], "ResNet-9 widths")
flags.DEFINE_float("lr", 0.05, "local SGD learning rate (momentum 0.9)")
flags.DEFINE_integer("epochs", 1, "local epochs per round")
flags.DEFINE_integer("seed", 0, "data and model seed")
flags.DEFINE_bool("json", False, "print one JSON object per result")
flags.DEFINE_list("seeds", ["0"], "ablations: one run per seed (data split and model init)")
flags.DEFINE_list("lambdas", ["0", "5e-4", "5e-3", "5e-2"], "ablations: lambda_sparse sweep")
flags.DEFINE_list("variants", [], "ablations: run only these variants (default all)")
flags.DEFINE_enum("ablation_split", "labels", ["labels", "domains"], "ablations: the data split")


def factorized_model(fd):
    """The factorized variant of --model (factorized_fl's MODEL_VARIANTS)."""
    return build_model(
        model_variant("factorized_fl", FLAGS.model), fd.input_shape, fd.num_classes, **model_kwargs()
    )


def model_kwargs() -> dict:
    if FLAGS.model == "mlp":
        return {"hidden": (200,)}
    if FLAGS.model == "resnet9":
        return {"widths": tuple(int(w) for w in FLAGS.widths)}
    return {}


def run(alg, fd, rounds: int, on_round=None, seed: int | None = None):
    """Trains `rounds` rounds; returns (state, summary of the final evaluation, seconds)."""
    seed = FLAGS.seed if seed is None else seed
    num = fd.data.train.count.shape[0]
    state = alg.init(jax.random.key(seed), None, num)
    rnd = jax.jit(alg.round)
    t0 = time.perf_counter()
    for r in range(rounds):
        state, metrics = rnd(state, fd.data, jax.random.key(seed + 1))
        if on_round is not None:
            on_round(r, state, metrics)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    scores = jax.jit(alg.evaluate)(state, fd.data, jax.random.key(seed + 2))
    return state, summarize(jax.device_get(scores)), seconds


def emit(row: dict) -> None:
    if FLAGS.json:
        print(json.dumps(row), flush=True)
    else:
        print(
            "  ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in row.items()), flush=True
        )


def v_cosines(state, layer: str, groups: np.ndarray) -> tuple[float, float]:
    v = np.asarray(state.client_params["params"][layer]["v"]).reshape(len(groups), -1)
    unit = v / np.linalg.norm(v, axis=1, keepdims=True)
    sim = unit @ unit.T
    same = groups[:, None] == groups[None, :]
    off = ~np.eye(len(groups), dtype=bool)
    return float(sim[same & off].mean()), float(sim[~same].mean())


def domains(spec: LocalTraining) -> None:
    num = FLAGS.domain_clients
    checkpoints = {max(FLAGS.rounds // 4, 1), max(FLAGS.rounds // 2, 1), FLAGS.rounds}
    for permute in ("client", "none"):
        fd = build_federated_data(
            "fashion_mnist",
            num,
            partition="groups",
            num_groups=2,
            permute_labels=permute,
            samples_per_client=FLAGS.samples,
            seed=FLAGS.seed,
        )
        groups = np.asarray([c["group"] for c in fd.summary["clients"]])
        model = factorized_model(fd)
        layer = factorized_fl.layer_order(model)[-2]
        alg = factorized_fl.build(model, spec, tau=0.95, epsilon=20.0, min_keep=num // 2)

        def report(r, state, metrics, fd=fd, groups=groups, layer=layer, permute=permute):
            if r + 1 in checkpoints:
                within, across = v_cosines(state, layer, groups)
                ratio = factorized_fl.final_report(state, fd)
                emit(
                    {
                        "part": "domains",
                        "permute_labels": permute,
                        "model": FLAGS.model,
                        "round": r + 1,
                        "match_layer": layer,
                        "v_cos_within": within,
                        "v_cos_across": across,
                        **ratio,
                        "kept_clients": float(metrics["kept_clients"]),
                    }
                )

        _, summary, seconds = run(alg, fd, FLAGS.rounds, report)
        emit(
            {
                "part": "domains",
                "permute_labels": permute,
                "algorithm": "factorized_fl",
                "mean_accuracy": summary["mean_accuracy"],
                "seconds": seconds,
            }
        )


def labels(spec: LocalTraining) -> None:
    num = FLAGS.label_clients
    for partition in ("iid", "dirichlet"):
        fd = build_federated_data(
            "fashion_mnist",
            num,
            partition=partition,
            dirichlet_alpha=0.5,
            permute_labels="client",
            samples_per_client=FLAGS.samples,
            seed=FLAGS.seed,
        )
        fmodel = factorized_model(fd)
        plain = build_model(FLAGS.model, fd.input_shape, fd.num_classes, **model_kwargs())
        ffl = dict(tau=0.0, epsilon=1.0, min_keep=num // 2, head_local=True)
        algorithms = {
            "factorized_fl": factorized_fl.build(fmodel, spec, **ffl),
            "factorized_fl_beta": factorized_fl.build(fmodel, spec, variant="beta", **ffl),
            # Control: the factorized model trained alone (tau > 1, min_keep 1: only itself).
            "factorized_local": factorized_fl.build(fmodel, spec, tau=2.0, min_keep=1),
            "fedavg_local_head": fedavg.build(plain, spec, local_leaves=("params/head/",)),
            "local": local.build(plain, spec),
            "fedavg": fedavg.build(plain, spec),
        }
        for name, alg in algorithms.items():
            last = {}
            _, summary, seconds = run(alg, fd, FLAGS.rounds, lambda r, s, m, last=last: last.update(m))
            emit(
                {
                    "part": "labels",
                    "partition": partition,
                    "model": FLAGS.model,
                    "algorithm": name,
                    "mean_accuracy": summary["mean_accuracy"],
                    "worst10_accuracy": summary["worst10_accuracy"],
                    "bytes_up_per_round": float(last["bytes_up"]),
                    "seconds": seconds,
                }
            )


# Plain-model baselines: name -> how it is built (not factorized_fl options).
PLAIN_BASELINES = {
    "plain_fedavg_local_head": "fedavg_local_head",
    "plain_local": "local",
    "plain_fedavg": "fedavg",
}


def ablation_variants(num: int, split: str) -> dict:
    """name -> factorized_fl.build options, or a PLAIN_BASELINES kind for the plain-model baselines.

    plain_local and plain_fedavg run only when named in --variants (the headline baselines)."""
    if split == "labels":  # the release's label settings, labels permuted: head local
        ffl = dict(tau=0.0, epsilon=1.0, min_keep=num // 2, head_local=True)
    else:  # the release's domain settings; labels relabelled per group, not permuted
        ffl = dict(tau=0.95, epsilon=20.0, min_keep=num // 2, head_local=True)
    variants = {
        "factorized_fl": dict(ffl),
        "fedavg_u": dict(ffl, matching="fedavg"),
        "fedavg_all": dict(ffl, matching="fedavg", variant="beta", other_leaves="mixed"),
        "no_mu": dict(ffl, use_mu=False),
        "random": dict(ffl, matching="random"),
        "worst": dict(ffl, matching="worst"),
        "factorized_local": dict(ffl, tau=2.0, min_keep=1),
        "plain_fedavg_local_head": PLAIN_BASELINES["plain_fedavg_local_head"],
    }
    for name in ("plain_local", "plain_fedavg"):
        if name in FLAGS.variants:
            variants[name] = PLAIN_BASELINES[name]
    for lam in FLAGS.lambdas:
        if float(lam) != 5e-4:  # 5e-4 is the default (factorized_fl)
            variants[f"lambda={lam}"] = dict(ffl, lambda_sparse=float(lam))
    return {k: v for k, v in variants.items() if not FLAGS.variants or k in FLAGS.variants}


def mu_stats(state, lambda_sparse: float) -> dict:
    """Sparsity of the clients' mu: shares kept by the release's rule and above 1e-3, mean |mu|."""
    mus = np.concatenate(
        [np.asarray(m).ravel() for m in factorized_fl.mu_leaves(state.client_params["params"])]
    )
    size = mus.size
    return {
        "mu_kept_release": float(np.sum((np.abs(mus) >= lambda_sparse) & (mus != 0)) / size),
        "mu_above_1e-3": float(np.sum(np.abs(mus) >= 1e-3) / size),
        "mu_mean_abs": float(np.abs(mus).mean()),
    }


def ablations(spec: LocalTraining) -> None:
    split = FLAGS.ablation_split
    num = FLAGS.label_clients if split == "labels" else FLAGS.domain_clients
    for seed in (int(s) for s in FLAGS.seeds):
        if split == "labels":
            fd = build_federated_data(
                "fashion_mnist",
                num,
                partition="dirichlet",
                dirichlet_alpha=0.5,
                permute_labels="client",
                samples_per_client=FLAGS.samples,
                seed=seed,
            )
        else:
            fd = build_federated_data(
                "fashion_mnist",
                num,
                partition="groups",
                num_groups=2,
                permute_labels="none",
                samples_per_client=FLAGS.samples,
                seed=seed,
            )
        fmodel = factorized_model(fd)
        plain = build_model(FLAGS.model, fd.input_shape, fd.num_classes, **model_kwargs())
        for name, opts in ablation_variants(num, split).items():
            if opts == "fedavg_local_head":
                alg = fedavg.build(plain, spec, local_leaves=("params/head/",))
            elif opts == "local":
                alg = local.build(plain, spec)
            elif opts == "fedavg":
                alg = fedavg.build(plain, spec)
            else:
                alg = factorized_fl.build(fmodel, spec, **opts)
            last, kept = {}, []

            def on_round(r, state, metrics, last=last, kept=kept):
                last.update(metrics)
                kept.append(float(metrics.get("kept_clients", np.nan)))

            state, summary, seconds = run(alg, fd, FLAGS.rounds, on_round, seed=seed)
            row = {
                "part": "ablations",
                "split": split,
                "model": FLAGS.model,
                "seed": seed,
                "variant": name,
                "mean_accuracy": summary["mean_accuracy"],
                "worst10_accuracy": summary["worst10_accuracy"],
                "final_train_loss": float(last["train_loss"]),
                "bytes_up_per_round": float(last["bytes_up"]),
                "seconds": seconds,
            }
            if isinstance(opts, dict):
                lam = opts.get("lambda_sparse", 5e-4)
                row["kept_clients"] = float(np.mean(kept))
                if split == "domains":
                    row.update(factorized_fl.final_report(state, fd))
                row.update(mu_stats(state, lam))
                if opts.get("use_mu", True):  # the release's evaluation: mu pruned at lambda
                    pruned = factorized_fl.evaluate(
                        fmodel,
                        as_client_map("auto"),
                        spec.loss,
                        lam,
                        state,
                        fd.data,
                        jax.random.key(seed + 2),
                    )
                    row["pruned_mean_accuracy"] = summarize(jax.device_get(pruned))["mean_accuracy"]
            emit(row)


def main(argv):
    del argv
    spec = LocalTraining(optax.sgd(FLAGS.lr, momentum=0.9), batch_size=32, epochs=FLAGS.epochs, steps=None)
    parts = {"domains": domains, "labels": labels, "ablations": ablations}
    for part in FLAGS.parts:
        if part not in parts:
            raise app.UsageError(f"--parts must be among {', '.join(parts)}; got {part!r}")
        parts[part](spec)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
