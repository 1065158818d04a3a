"""pFedLA studies on Fashion-MNIST: learned weights vs label overlap, label conflict, and
the comparison with Local / FedAvg / FedAvg+.

    python -m experiments.studies.pfedla_study --study=overlap [--rounds=40]
    python -m experiments.studies.pfedla_study --study=conflict
    python -m experiments.studies.pfedla_study --study=compare --variants=local,fedavg,fedavg_ft,pfedla
    python -m experiments.studies.pfedla_study --study=sweep --variants=pfedla@hn_lr=0.005,pfedla@hn_lr=0.5
    python -m experiments.studies.pfedla_study --study=sensitivity

Studies:
- overlap: 8 clients, client c holds classes c..c+3 (mod 10), so neighbours share 3
  classes. Reports the mean layer-averaged weight alpha_i^j between clients sharing
  >= 3 classes and <= 1 class, and the Spearman correlation of weight and overlap.
- conflict: 10 clients with IID images whose labels are permuted per group (2
  groups): one global model cannot fit both; pFedLA vs FedAvg.
- compare: 10 clients, 4 classes each (non-IID_1), every client every round.
- sweep: the compare data; every pfedla run also reports how far its weights moved
  (`pfedla.final_report`: alpha_max_move, alpha_mean_move, alpha_max_dev_from_uniform),
  the Spearman correlation of the layer-averaged weights (i != j) with the number of
  classes the two clients share, and the size of what drives the hypernetwork at
  the end: g_rms, the RMS over i != j of the first-order gain <theta_j - theta_bar_i,
  delta_i> (minus the gradient of client i's objective with respect to alpha_i^j,
  summed over layers) and delta_rms, the RMS of ||delta_i||. Results:
  experiments/results/pfedla_fmnist_sweep.md.
- table: reads the JSON lines of earlier runs (--inputs) and prints a markdown table,
  mean +- std over seeds per (variant, model, local epochs, local lr, rounds).
- sensitivity: no training; for each (normalization, head_init), the Jacobian J of
  one client's weights alpha [L, C] with respect to its hypernetwork's parameters at
  initialisation (C=10, the MLP's 2 layer groups, 5 seeds): an SGD step of size
  hn_lr moves alpha by -hn_lr J J^T g, so the eigenvalues of J J^T (projected on the
  simplex's tangent) are the gain from the alpha-gradient g to the weights' move;
  reports the largest and the mean eigenvalue, split by embedding / trunk / heads,
  the initial max |alpha - 1/C| and the share of head outputs <= 0.

Variants (--variants): local, fedavg, fedavg_ft, pfedla (SGD 5e-3 on the
hypernetwork, the released code's, set by --hn_optimizer / --hn_lr; descent sign),
pfedla_code (the public code's sign), pfedla_adam (Adam 1e-3: the library's
default), pfedla_softmax, heur1 (HeurpFedLA, top_k=1); "@key=value" suffixes any
build option, e.g.
`pfedla@hn_lr=0.1@normalization=softmax`. Prints one JSON line per run.

--model: mlp (200 hidden), cnn (the library's LeNet-sized CNN) or cnn_fedbn (the
public code's FedBN-sized CNN). --diagnose (pfedla runs): after training, for each
client i and model j, the first-order gain of moving i's aggregate towards j on its
train loss (the direction the hypernetwork follows: <theta_j - theta_bar_i,
delta_i>) and on its test loss; reports how often j = i is the best direction and
the Spearman correlation of the gains (j != i) with the label overlap.
"""

from __future__ import annotations

import json
import time

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from pfljax import algorithms
from pfljax.algorithms import pfedla
from pfljax.core.clients import take
from pfljax.core.evaluate import summarize
from pfljax.core.layers import leaf_groups
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.types import ClientData
from pfljax.data import FederatedData, build_federated_data, pad_clients
from pfljax.data import partition as part
from pfljax.data.idx import load_fashion_mnist
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
MODELS = {
    "mlp": ("mlp", {"hidden": (200,)}),
    "cnn": ("cnn", {}),  # the library's LeNet-sized CNN
    # FedBN's CNN as used by the public pFedLA code (see experiments/configs/pfedla_fmnist.py)
    "cnn_fedbn": ("cnn", {"channels": (64, 64, 128), "dense": (2048, 512), "padding": "SAME"}),
}


def define_flags():
    """Flags are defined only when run as a script, so tests can import overlap_data."""
    flags.DEFINE_enum(
        "study", "overlap", ["overlap", "conflict", "compare", "sweep", "sensitivity", "table"], "which study"
    )
    flags.DEFINE_list("inputs", [], "--study=table: JSON-lines files written by the other studies")
    flags.DEFINE_list("variants", ["pfedla"], "runs (see module doc)")
    flags.DEFINE_integer("rounds", 40, "communication rounds")
    flags.DEFINE_integer("samples_per_client", 300, "cap per client before the 80/20 split")
    flags.DEFINE_integer("local_epochs", 1, "local epochs per round")
    flags.DEFINE_float("lr", 0.05, "local SGD learning rate")
    flags.DEFINE_float("momentum", 0.0, "local SGD momentum")
    flags.DEFINE_integer("batch_size", 32, "local batch size")
    flags.DEFINE_enum("model", "mlp", list(MODELS), "model (see MODELS)")
    flags.DEFINE_float("hn_lr", 5e-3, "pfedla variant's hypernetwork learning rate (the released code's)")
    flags.DEFINE_string(
        "hn_optimizer", "sgd", "pfedla variant's hypernetwork optimizer (the released code's)"
    )
    flags.DEFINE_integer("eval_every", 10, "evaluate every k rounds")
    flags.DEFINE_integer("seed", 0, "data and model seed")
    flags.DEFINE_bool(
        "diagnose", False, "pfedla runs: first-order gains of each client's model (train vs test)"
    )


def overlap_data(num_clients=8, classes_per_client=4, samples_per_client=300, seed=0):
    """Client c gets classes c..c+3 mod 10; each class's images are split evenly and
    disjointly among the clients holding it; capped, then split 80/20 by label."""
    fm = load_fashion_mnist()
    x = np.concatenate([fm["x_train"], fm["x_test"]])
    y = np.concatenate([fm["y_train"], fm["y_test"]])
    rng = np.random.default_rng(seed)
    sets = [[(c + j) % 10 for j in range(classes_per_client)] for c in range(num_clients)]
    parts = [[] for _ in range(num_clients)]
    for k in range(10):
        owners = [c for c in range(num_clients) if k in sets[c]]
        for c, idx in zip(
            owners, np.array_split(rng.permutation(np.flatnonzero(y == k)), max(len(owners), 1))
        ):
            parts[c].append(idx)
    parts = part.cap_per_client([np.concatenate(p) for p in parts], y, samples_per_client, rng)
    splits = {"train": ([], []), "test": ([], [])}
    for idx in parts:
        tr, te = part.stratified_split(y[idx], 0.2, rng)
        for name, pos in (("train", tr), ("test", te)):
            splits[name][0].append(x[idx[pos]])
            splits[name][1].append(y[idx[pos]])
    overlap = np.array([[len(set(a) & set(b)) for b in sets] for a in sets])
    return ClientData(pad_clients(*splits["train"]), pad_clients(*splits["test"])), overlap


def variant(spec: str):
    """(module name, build kwargs) of a variant "name[@key=value...]", e.g.
    "pfedla@hn_lr=0.1@normalization=softmax" (values parsed as JSON, else strings)."""
    name, *overrides = spec.split("@")
    extra = {}
    for item in overrides:
        key, value = item.split("=", 1)
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    hn = dict(hn_lr=FLAGS.hn_lr, hn_optimizer=FLAGS.hn_optimizer)
    table = {
        "local": ("local", {}),
        "fedavg": ("fedavg", {}),
        "fedavg_ft": ("fedavg_ft", {}),
        "pfedla": ("pfedla", hn),
        "pfedla_code": ("pfedla", {**hn, "hn_sign": "code"}),
        "pfedla_adam": ("pfedla", {**hn, "hn_optimizer": "adam", "hn_lr": 1e-3}),
        "pfedla_softmax": ("pfedla", {**hn, "normalization": "softmax"}),
        "heur1": ("pfedla", {**hn, "top_k": 1}),
    }
    if name not in table:
        raise ValueError(f"variant must be one of {sorted(table)}, got {name!r}")
    module, kwargs = table[name]
    return module, {**kwargs, **extra}


def run(name, data, input_shape, num_classes, overlap=None):
    """Trains one variant; returns the summary of its last evaluation and its history
    (pfedla runs: `pfedla.final_report` and, given the [C, C] class overlap, the
    Spearman correlation of the layer-averaged weights with it)."""
    module, kwargs = variant(name)
    model_name, model_kwargs = MODELS[FLAGS.model]
    model = build_model(model_name, input_shape, num_classes, **model_kwargs)
    opt = optax.sgd(FLAGS.lr, momentum=FLAGS.momentum or None)
    spec = LocalTraining(opt, batch_size=FLAGS.batch_size, epochs=FLAGS.local_epochs)
    alg = algorithms.get(module).build(model, spec, **kwargs)
    num = data.train.count.shape[0]
    state = alg.init(jax.random.key(FLAGS.seed), None, num)
    rnd, evaluate = jax.jit(alg.round), jax.jit(alg.evaluate)
    history, t0 = [], time.perf_counter()
    for r in range(FLAGS.rounds):
        state, metrics = rnd(state, data, jax.random.key(FLAGS.seed + 1))
        if (r + 1) % FLAGS.eval_every == 0 or r + 1 == FLAGS.rounds:
            per_client = jax.device_get(evaluate(state, data, jax.random.key(FLAGS.seed + 2)))
            entry = {"round": r + 1, "acc": summarize(per_client)["mean_accuracy"]}
            if module == "pfedla":
                entry["own_acc"] = float(np.average(per_client["own_accuracy"], weights=per_client["count"]))
                entry["self_weight"] = float(np.mean(np.diagonal(pfedla.collaboration_matrix(state))))
                entry["alpha_dev"] = float(np.mean(np.abs(np.asarray(state.client_alpha) - 1.0 / num)))
                report = alg.final_report(state, FederatedData(data, num_classes, input_shape, {}, None))
                entry.update({k: round(v, 5) for k, v in report.items()})
                if overlap is not None:
                    w, off = np.asarray(pfedla.collaboration_matrix(state)), ~np.eye(num, dtype=bool)
                    entry["spearman_weight_overlap"] = round(spearman(w[off], overlap[off]), 4)
            history.append(entry)
    out = {"variant": name, **history[-1], "seconds": round(time.perf_counter() - t0, 1), "history": history}
    if module == "pfedla":
        out["collaboration"] = np.round(np.asarray(pfedla.collaboration_matrix(state)), 3).tolist()
        out["trace_alpha_client0"] = np.round(np.asarray(metrics["trace_alpha"]), 3).tolist()
        alpha = np.asarray(state.client_alpha)  # [C, L, C]
        names = leaf_groups(model.template()["params"])[1]
        out["self_weight_by_layer"] = dict(
            zip(names, np.round(alpha[np.arange(num), :, np.arange(num)].mean(0), 4).tolist())
        )
    return out, (state, model, spec)


def first_order_scores(state, model, spec, data):
    """[C, C] first-order gains of moving client i's aggregate towards client j's model:
    train[i, j] = <theta_j - theta_bar_i, delta_i> (delta_i: a fresh local training from
    theta_bar_i; what the hypernetwork follows), test[i, j] = <theta_j - theta_bar_i,
    -grad L_i^test(theta_bar_i)> (what would help on the client's held-out rows); and
    [C] ||delta_i||."""
    params = state.client_params["params"]
    groups, _ = leaf_groups(jax.tree.map(lambda x: x[0], params))
    mixed = pfedla.layer_mix(state.client_alpha, params, groups)
    train = make_local_train(model.apply, spec)
    loss = get_loss(spec.loss)

    def one(i):
        bar = take(mixed, i)
        delta = jax.tree.map(
            jnp.subtract, train({"params": bar}, take(data.train, i), jax.random.key(9)).params["params"], bar
        )
        test = take(data.test, i)

        def test_loss(p):
            out, _ = model.apply({"params": p}, test.x)
            valid = (jnp.arange(test.x.shape[0]) < test.count).astype(jnp.float32)
            return masked_mean(loss.per_example(out, test.y), valid)

        g = jax.grad(test_loss)(bar)

        def dots(direction):
            per_leaf = jax.tree.map(
                lambda x, b, d: jnp.einsum("n...,...->n", x - b[None], d), params, bar, direction
            )
            return sum(jax.tree.leaves(per_leaf))

        norm = jnp.sqrt(sum(jnp.sum(d**2) for d in jax.tree.leaves(delta)))
        return dots(delta), dots(jax.tree.map(jnp.negative, g)), norm

    return jax.jit(lambda: jax.lax.map(one, jnp.arange(data.train.count.shape[0])))()


def spearman(a, b):
    """Spearman correlation, ties sharing their average rank (pfedla.spearman)."""
    return pfedla.spearman(a, b)


def sensitivity(num_clients=10, names=("head", "hidden_0"), seeds=5):
    """Rows {normalization, head_init, gain_max, gain_mean, gain by part, init_max_dev,
    raw_le_0} of the weights' Jacobian at initialisation (see the module doc)."""
    rows = []
    tangent = np.kron(np.eye(len(names)), np.eye(num_clients) - 1.0 / num_clients)
    for norm, init in (
        ("relu_normalize", "uniform01"),
        ("relu_normalize", "torch"),
        ("softmax", "zeros"),
        ("softmax", "torch"),
        ("softmax", "uniform01"),
    ):
        net = pfedla.make_hypernet(names, 100, (100, 100, 100), init, num_clients)
        stats = []
        for seed in range(seeds):
            params = net.init(jax.random.key(seed))
            flat, unravel = jax.flatten_util.ravel_pytree(params)

            def alpha(f, net=net, unravel=unravel, norm=norm):
                out = net.apply(unravel(f), 0)
                raw = jnp.stack([out[n] for n in names])
                return pfedla.normalize_weights(raw, jnp.int32(0), norm), raw

            (a, raw), jac = alpha(flat), np.asarray(jax.jacobian(lambda f: alpha(f)[0].reshape(-1))(flat))
            masks = jax.tree.map(jnp.zeros_like, params)
            row = {}
            for group in ("all", "embedding", "trunk", "heads"):
                if group == "all":
                    cols = np.ones(flat.shape, bool)
                else:
                    sub = {**masks, group: jax.tree.map(jnp.ones_like, params[group])}
                    cols = np.asarray(jax.flatten_util.ravel_pytree(sub)[0]).astype(bool)
                eig = np.linalg.eigvalsh(tangent @ jac[:, cols] @ jac[:, cols].T @ tangent)
                row[f"gain_max_{group}"] = float(eig[-1])
                if group == "all":
                    row["gain_mean"] = float(eig.sum() / np.trace(tangent))
            row["init_max_dev"] = float(jnp.max(jnp.abs(a - 1.0 / num_clients)))
            row["raw_le_0"] = float(jnp.mean(raw <= 0))
            stats.append(row)
        mean = {k: float(np.mean([r[k] for r in stats])) for k in stats[0]}
        std = {f"{k}_std": float(np.std([r[k] for r in stats])) for k in ("gain_max_all", "gain_mean")}
        rows.append({"normalization": norm, "head_init": init, **mean, **std})
    return rows


TABLE = (
    ("acc", "accuracy (aggregate)", 100),
    ("own_acc", "own model", 100),
    ("alpha_max_move", "max move", 1),
    ("alpha_mean_move", "mean move", 1),
    ("alpha_max_dev_from_uniform", "max dev. uniform", 1),
    ("self_weight", "self-weight", 1),
    ("spearman_weight_overlap", "Spearman overlap", 1),
    ("g_rms", "g_rms", 1),
)


def table(paths) -> str:
    """Markdown table of JSON-lines runs: mean +- std over seeds (n = seeds) per
    (variant, model, local_epochs, lr, rounds); a NaN Spearman (constant weights) counts as n/a."""
    groups: dict = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    d = json.loads(line)
                    key = (d["variant"], d.get("model", "mlp"), d["local_epochs"], d["lr"], d["rounds"])
                    groups.setdefault(key, []).append(d)
    head = "| variant | model | epochs | lr | rounds | n | " + " | ".join(t[1] for t in TABLE) + " |"
    rows = [head, "|" + "---|" * (6 + len(TABLE))]
    for (name, model, epochs, lr, rounds), runs in groups.items():
        cells = []
        for field, _, scale in TABLE:
            vals = [r[field] * scale for r in runs if r.get(field) is not None]
            vals = [v for v in vals if np.isfinite(v)]
            fmt = ".2f" if scale == 100 else ".4f"
            if not vals:
                cells.append("n/a" if any(field in r for r in runs) else "-")
            elif len(vals) == 1:
                cells.append(f"{vals[0]:{fmt}}")
            else:
                cells.append(f"{np.mean(vals):{fmt}} +- {np.std(vals):{fmt}}")
        rows.append(
            f"| {name} | {model} | {epochs} | {lr} | {rounds} | {len(runs)} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)


def main(argv):
    del argv
    if FLAGS.study == "table":
        print(table(FLAGS.inputs))
        return
    if FLAGS.study == "sensitivity":
        for row in sensitivity():
            print(
                json.dumps(
                    {
                        "study": "sensitivity",
                        **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()},
                    }
                ),
                flush=True,
            )
        return
    if FLAGS.study == "overlap":
        data, overlap = overlap_data(samples_per_client=FLAGS.samples_per_client, seed=FLAGS.seed)
        shape, classes = tuple(data.train.x.shape[2:]), 10
    else:
        kw = dict(partition="classes", classes_per_client=4)
        if FLAGS.study == "conflict":
            kw = dict(partition="iid", permute_labels="group", num_groups=2)
        fd = build_federated_data(
            "fashion_mnist", 10, samples_per_client=FLAGS.samples_per_client, seed=FLAGS.seed, **kw
        )
        data, shape, classes = fd.data, fd.input_shape, fd.num_classes
        sets = [set(c["classes"]) for c in fd.summary["clients"]]
        overlap = np.array([[len(a & b) for b in sets] for a in sets])
    for name in FLAGS.variants:
        out, (state, model, spec) = run(name, data, shape, classes, overlap)
        if (FLAGS.diagnose or FLAGS.study == "sweep") and "collaboration" in out:
            off = ~np.eye(len(overlap), dtype=bool)
            *scores, norms = first_order_scores(state, model, spec, data)
            out["g_rms"] = float(np.sqrt(np.mean(np.asarray(scores[0])[off] ** 2)))
            out["delta_rms"] = float(np.sqrt(np.mean(np.asarray(norms) ** 2)))
            for kind, score in zip(("train", "test"), scores if FLAGS.diagnose else ()):
                score = np.asarray(score)
                out[f"self_is_best_{kind}"] = float(np.mean(np.argmax(score, 1) == np.arange(len(score))))
                out[f"spearman_{kind}_gain_overlap"] = spearman(score[off], overlap[off])
        if FLAGS.study == "overlap" and "collaboration" in out:
            w = np.asarray(out["collaboration"])
            off = ~np.eye(len(w), dtype=bool)
            out["mean_weight_overlap_ge3"] = float(w[off & (overlap >= 3)].mean())
            out["mean_weight_overlap_le1"] = float(w[off & (overlap <= 1)].mean())
            out["spearman_weight_overlap"] = spearman(w[off], overlap[off])
        flags_used = {
            k: FLAGS[k].value for k in ("seed", "rounds", "local_epochs", "lr", "samples_per_client")
        }
        print(json.dumps({"study": FLAGS.study, "model": FLAGS.model, **flags_used, **out}), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
