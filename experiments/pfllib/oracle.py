"""pfljax from the weights PFLlib's own run started from, compared with where PFLlib ended.

The exact oracle of experiments/results/pfllib_differential.md ("All eight methods from the
same weights and batches"): `experiments/pfllib/pfllib_side.py record` runs PFLlib's
unmodified code on a tiny dataset (`pfllib_side.py cut`: 3 clients of 10 train rows, one full
batch, so batch order cannot matter) and saves every weight before and after; this binary
starts the same method in pfljax from those weights (FedAvgCNN through
`pfljax.models.weights.from_torch_state`, each method's extra modules copied in), runs as many
rounds on the same rows, and prints JSON lines: the mean test accuracies of both sides, then
per compared group the largest relative difference max |pfljax - PFLlib| / max |PFLlib| of
its tensors.

    python -m experiments.pfllib.oracle --record=gpfl.npz --method=gpfl \\
        --data=$PFLLIB/dataset/FashionMNISToracle --lr=0.05 --epochs=5 [--options='{"mu": 0.1}']

`--options` (JSON) replaces build options; the defaults (`PFLLIB_OPTIONS`) follow PFLlib's
code. `--rotate=K` makes round r train clients r..r+K-1 (mod C), as `record --rotate=K`;
`--no_gumbel` (FedCP) and `--fixed_draws` (FedGen) remove the draws `record`'s flags of the
same names remove on PFLlib's side. PFLlib evaluates at the start of each round, pfljax after
it: PFLlib's accuracy r is pfljax's after round r - 1.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from pfljax import algorithms
from pfljax.core import round as core_round
from pfljax.core.clients import stack, take
from pfljax.core.local import LocalTraining
from pfljax.core.types import ClientData
from pfljax.data.federated import pad_clients
from pfljax.experiment.cli import fail, parse_flags
from pfljax.models import build_model
from pfljax.models.weights import from_torch_state

# PFLlib's FedAvgCNN(1, 10, 1024): its base's tensors (then the head's "weight", "bias")
CNN_BASE = ("conv1.0.weight", "conv1.0.bias", "conv2.0.weight", "conv2.0.bias", "fc1.0.weight", "fc1.0.bias")
MODEL = build_model(
    "cnn",
    (28, 28, 1),
    10,
    channels=(32, 64),
    dense=(512,),
    kernel_size=5,
    padding="VALID",
    init_scheme="torch",
)
# pfljax's options that follow PFLlib's code (its main.py flags of the record's run in comments)
PFLLIB_OPTIONS = {
    "fedavg": {},
    "fedper": {},
    "ditto": dict(lam=0.0, personal_epochs=1),  # -mu 0.0 -pls 1 (main.py's defaults)
    "gpfl": dict(lam=1.0, mu=0.0, guidance_norm="batch", conditional_inputs="local"),  # -lam 1.0 -mu 0.0
    "feddbe": dict(kappa=1.0, momentum=0.1),  # -klw 1.0 -mo 0.1
    "fedproto": dict(lam=1.0, weighting="uniform"),  # -lam 1.0
    "feddistill": dict(gamma=1.0, teacher="all", outputs="logits"),  # -lam 1.0
    "fedamp": dict(alpha_k=1.0, lam=0.0, sigma=1.0, attention="distance", start="own"),  # -alk 1 -lam 1 -sg 1
    "apple": dict(  # -dlr 0.0 -L 1.0 -mu 0.0
        dr_learning_rate=0.0,
        mu=0.0,
        L=2,
        scheduler="cosine",
        dr_gradient="leaf_mean",
        p_init="uniform",
        scale_core_lr=True,
        sequential=True,
    ),
    "fedcp": dict(lam=1.0, head_upload_weight=0.5, initial_context="random"),  # -lam 1.0
    "fedgen": dict(  # -nd 512 -glr 0.005 -hd 512 -se <generator_steps>
        ensemble="samples",
        noise="uniform",
        noise_dim=512,
        hidden_dim=512,
        generator_lr=0.005,
        generator_steps=50,
        generator_batch=0,
        diversity=0.0,
        generative_alpha=1.0,
        generative_beta=0.0,
        generative_decay=1.0,
    ),
}

_RECORD = flags.DEFINE_string("record", None, "the .npz of `pfllib_side.py record`")
_METHOD = flags.DEFINE_enum("method", None, list(PFLLIB_OPTIONS), "the method (pfljax's name)")
_DATA = flags.DEFINE_string("data", None, "the PFLlib dataset directory the record ran on")
_LR = flags.DEFINE_float("lr", 0.05, "the record's -lr (plain SGD)")
_EPOCHS = flags.DEFINE_integer("epochs", 5, "the record's -ls (local epochs)")
_OPTIONS = flags.DEFINE_string("options", "{}", "JSON dict of build options replacing PFLLIB_OPTIONS'")
_ROTATE = flags.DEFINE_integer("rotate", 0, "K > 0: round r trains clients r..r+K-1 (mod C)", lower_bound=0)
_NO_GUMBEL = flags.DEFINE_bool("no_gumbel", False, "FedCP: the policy without its Gumbel noise")
_FIXED_DRAWS = flags.DEFINE_bool("fixed_draws", False, "FedGen: noise 0, labels the clients' rows in order")


def rel(got, want) -> float:
    """max |got - want| / max |want| (the denominator at least 1e-12)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-12))


def load_data(path: str) -> ClientData:
    """The PFLlib dataset's clients (train/<i>.npz, test/<i>.npz: {"x" NCHW, "y"}) as ClientData."""

    def split(name):
        files = sorted(os.listdir(os.path.join(path, name)), key=lambda f: int(f.split(".")[0]))
        rows = [np.load(os.path.join(path, name, f), allow_pickle=True)["data"].tolist() for f in files]
        return pad_clients(
            [r["x"].transpose(0, 2, 3, 1) for r in rows], [r["y"].astype(np.int32) for r in rows]
        )

    return ClientData(split("train"), split("test"))


def model_variables(rec: dict, base: str, head: str) -> dict:
    """FedAvgCNN's flax variables from the record: the base's tensors under `base`, the head's at `head`."""
    state = {k: rec[f"{base}.{k}"] for k in CNN_BASE}
    state |= {"fc.weight": rec[f"{head}.weight"], "fc.bias": rec[f"{head}.bias"]}
    return from_torch_state(state, MODEL.template(), MODEL.input_shape)


def whole_model(rec: dict, prefix: str) -> dict:
    """A BaseHeadSplit (`prefix`.base.*, `prefix`.head.*) or a plain FedAvgCNN (`prefix`.fc.*)."""
    if f"{prefix}.base.conv1.0.weight" in rec:
        return model_variables(rec, f"{prefix}.base", f"{prefix}.head")
    return model_variables(rec, prefix, f"{prefix}.fc")


def dense(rec: dict, prefix: str) -> dict:
    """A torch Linear as {"kernel" [in, out], "bias"}."""
    return {"kernel": rec[f"{prefix}.weight"].T, "bias": rec[f"{prefix}.bias"]}


def linear_norm(rec: dict, prefix: str) -> dict:
    """A torch Sequential(Linear, LayerNorm ...) at `prefix`.0 and `prefix`.<norm>."""
    norm = 1 if f"{prefix}.1.weight" in rec else 2
    return {
        "kernel": rec[f"{prefix}.0.weight"].T,
        "bias": rec[f"{prefix}.0.bias"],
        "scale": rec[f"{prefix}.{norm}.weight"],
        "offset": rec[f"{prefix}.{norm}.bias"],
    }


def max_rel(got, want) -> float:
    """The largest `rel` over the leaves of two trees of the same structure."""
    return max(jax.tree.leaves(jax.tree.map(rel, got, want)))


# ---------------------------------------------------------------- per method: start, compare


def start_state(method: str, rec: dict, alg, clients: int):
    """pfljax's state holding what PFLlib's run started from."""
    if method == "gpfl":
        state = alg.init(
            jax.random.key(0), model_variables(rec, "start.client0.base", "start.client0.head"), clients
        )
        gce = jnp.asarray(rec["start.client0.attr.GCE.embedding.weight"])
        cov = {k: linear_norm(rec, f"start.client0.attr.CoV.Conditional_{k}") for k in ("gamma", "beta")}
        return state._replace(gce=gce, previous_gce=gce, cov=jax.tree.map(jnp.asarray, cov))
    if method == "fedcp":
        state = alg.init(
            jax.random.key(0), model_variables(rec, "start.client0.base", "start.client0.head_g"), clients
        )
        state = state._replace(
            cpn=jax.tree.map(jnp.asarray, linear_norm(rec, "start.client0.gate.cs.fc")),
            client_heads=stack([dense(rec, f"start.client{c}.model.head") for c in range(clients)]),
            client_context=jnp.asarray(
                np.concatenate([rec[f"start.client{c}.attr.context"] for c in range(clients)])
            ),
        )
        if state.client_received is not None:  # each client's own global head and CPN
            held = [
                (dense(rec, f"start.client{c}.head_g"), linear_norm(rec, f"start.client{c}.gate.cs.fc"))
                for c in range(clients)
            ]
            state = state._replace(client_received=stack(held))
        return state
    state = alg.init(jax.random.key(0), whole_model(rec, "init.model"), clients)
    if method == "fedgen":  # its Adam state stays the fresh one of init
        state = state._replace(generator=generator(rec, "start.server.attr.generative_model"))
    return state


def generator(rec: dict, prefix: str) -> dict:
    """FedGen's generator (PFLlib's fc1 = Linear + BatchNorm, fc) in pfljax's layout."""
    return jax.tree.map(
        jnp.asarray,
        {
            "fc1": {"kernel": rec[f"{prefix}.fc1.0.weight"].T},
            "bn": {"scale": rec[f"{prefix}.fc1.1.weight"], "bias": rec[f"{prefix}.fc1.1.bias"]},
            "fc": dense(rec, f"{prefix}.fc"),
        },
    )


def gpfl_inputs(state, c: int, data: ClientData):
    """The conditional inputs GPFL's client c holds: its stored ones if it trained in the last
    round, else the ones it would build from the round's start GCE (gpfl.start_conditions)."""
    from pfljax.algorithms import gpfl

    shares = gpfl.class_shares(data.train.y[c], data.train.count[c], 10)
    if state.client_last is None:  # conditional_inputs="global": from the current GCE
        return gpfl.conditions(state.gce, shares)
    if int(state.client_last[c]) == int(state.round) - 1:
        return state.client_conditions[c]
    return gpfl.conditions(state.previous_gce, shares)


def pfllib_accuracies(method: str, rec: dict) -> np.ndarray:
    """PFLlib's mean accuracy at the start of each round (Ditto's rs_test_acc interleaves the
    global and the personalized models' evaluations: its personalized ones, pfljax's ditto's)."""
    return rec["acc"][1::2] if method == "ditto" else rec["acc"]


def compared(method: str, rec: dict, state, data: ClientData) -> dict:
    """{what: max relative difference} after the run."""
    out, clients = {}, int(data.train.count.shape[0])
    if method in ("fedavg", "ditto"):
        out["global model"] = max_rel(state.global_params, whole_model(rec, "final.model"))
        for c in range(clients if method == "ditto" else 0):
            want = whole_model(rec, f"final.client{c}.attr.model_per")
            out[f"client {c} personalized model"] = max_rel(take(state.client_personal, c), want)
        return out
    if method == "fedper":  # PFLlib's global model is the base; the heads stay on the clients
        want = model_variables(rec, "final.model", "final.client0.head")["params"]
        body = {k: v for k, v in state.global_params["params"].items() if k != "head"}
        out["base"] = max_rel(body, {k: want[k] for k in body})
        for c in range(clients):
            head = {leaf: state.client_params[f"params/head/{leaf}"][c] for leaf in ("kernel", "bias")}
            out[f"client {c} head"] = max_rel(head, dense(rec, f"final.client{c}.head"))
        return out
    if method == "gpfl":
        want = model_variables(rec, "final.server.attr.global_model", "final.client0.head")["params"]
        body = {k: v for k, v in state.global_params["params"].items() if k != "head"}
        out["body"] = max_rel(body, {k: want[k] for k in body})
        out["GCE"] = rel(state.gce, rec["final.server.attr.GCE.embedding.weight"])
        cov = {k: linear_norm(rec, f"final.server.attr.CoV.Conditional_{k}") for k in ("gamma", "beta")}
        out["CoV"] = max_rel(state.cov, cov)
        for c in range(clients):
            out[f"client {c} head"] = max_rel(
                take(state.client_heads, c), dense(rec, f"final.client{c}.head")
            )
            attr = f"final.client{c}.attr"
            want = np.stack(
                [rec[f"{attr}.generic_conditional_input"], rec[f"{attr}.personalized_conditional_input"]]
            )
            out[f"client {c} conditional inputs"] = rel(gpfl_inputs(state, c, data), want)
        return out
    if method == "feddbe":
        out["model"] = max_rel(state.global_params, whole_model(rec, "final.model"))
        out["global mean"] = rel(state.global_mean, rec["final.client0.attr.global_mean"])
        for c in range(clients):
            out[f"client {c} PRBM"] = rel(state.client_prbm[c], rec[f"final.client{c}.attr.client_mean"])
        return out
    if method in ("fedproto", "feddistill", "fedamp"):
        models = state.client_params if method == "fedamp" else state.client_models
        for c in range(clients):
            out[f"client {c} model"] = max_rel(take(models, c), whole_model(rec, f"final.client{c}"))
        if method == "fedproto":
            classes = sorted(
                int(k.rsplit(".", 1)[1]) for k in rec if k.startswith("final.server.attr.global_protos.")
            )
            if np.flatnonzero(np.asarray(state.global_mask)).tolist() != classes:
                out["classes with a prototype"] = float("inf")
            out["global prototypes"] = max(
                rel(state.global_protos[j], rec[f"final.server.attr.global_protos.{j}"]) for j in classes
            )
        return out
    if method == "apple":
        for c in range(clients):
            out[f"client {c} personalized model"] = max_rel(
                take(state.client_personal, c), whole_model(rec, f"final.client{c}")
            )
            core = whole_model(rec, f"final.client{c}.attr.model_c")
            out[f"client {c} core model"] = max_rel(take(state.client_core, c), core)
        return out
    if method == "fedcp":
        want = model_variables(rec, "final.server.attr.global_modules", "final.server.attr.head")
        out["extractor and global head"] = max_rel(state.global_params, want)
        out["CPN"] = max_rel(state.cpn, linear_norm(rec, "final.server.attr.cs.fc"))
        heads = [dense(rec, f"final.client{c}.model.head") for c in range(clients)]
        out["personalized heads"] = max_rel(state.client_heads, stack(heads))
        contexts = np.concatenate([rec[f"final.client{c}.attr.context"] for c in range(clients)])
        out["contexts"] = rel(state.client_context, contexts)
        if state.client_received is not None:
            for c in range(clients):
                held = (
                    dense(rec, f"final.client{c}.head_g"),
                    linear_norm(rec, f"final.client{c}.gate.cs.fc"),
                )
                out[f"client {c} held global head and CPN"] = max_rel(take(state.client_received, c), held)
        return out
    out["global model"] = max_rel(state.global_params, whole_model(rec, "final.model"))  # fedgen
    out["generator"] = max_rel(state.generator, generator(rec, "final.server.attr.generative_model"))
    return out


# ---------------------------------------------------------------- the run


def mean_accuracy(evaluate, state, data: ClientData) -> float:
    scores = evaluate(state, data, jax.random.key(1))
    counts = np.asarray(data.test.count)
    return float(np.sum(np.asarray(scores["accuracy"]) * counts) / np.sum(counts))


def run(method: str, rec: dict, data: ClientData, lr: float, epochs: int, options: dict, rotate: int = 0):
    """(pfljax's state after as many rounds as PFLlib's record has accuracies, its mean accuracy
    before round 0 and after each round); `rotate`: K clients a round, round r from client r."""
    clients = int(data.train.count.shape[0])
    local = LocalTraining(optax.sgd(lr), batch_size=10, epochs=epochs, drop_last=True)
    kwargs = {"clients_per_round": rotate} if rotate else {}
    alg = algorithms.get(method).build(MODEL, local, **kwargs, **{**PFLLIB_OPTIONS[method], **options})
    state = start_state(method, rec, alg, clients)
    evaluate = jax.jit(alg.evaluate)
    accs, sample = [mean_accuracy(evaluate, state, data)], core_round.sample_clients
    try:
        for r in range(len(pfllib_accuracies(method, rec))):
            if rotate:  # round r's participants, as PFLlib's with record --rotate (traced anew)
                core_round.sample_clients = lambda key, n, k, r=r: jnp.sort((r + jnp.arange(k)) % n)
            step = jax.jit(lambda s, d, k: alg.round(s, d, k))  # a new function: traced with round r's ids
            state, _ = step(state, data, jax.random.key(100 + r))
            accs.append(mean_accuracy(evaluate, state, data))
    finally:
        core_round.sample_clients = sample
    return state, accs


def fixed_draws(data: ClientData) -> None:
    """FedGen's draws as PFLlib's with record --fixed_draws: noise 0, the labels of every draw the
    first n of the clients' training labels in client, then label order."""
    from pfljax.algorithms import fedgen

    y, n = np.asarray(data.train.y), np.asarray(data.train.count)
    labels = jnp.asarray(
        [k for c in range(len(n)) for k in range(10) for _ in range(int(np.sum(y[c, : n[c]] == k)))]
    )
    fedgen.draw_noise = lambda key, kind, shape: jnp.zeros(shape, jnp.float32)
    fedgen.sample_labels = lambda key, prior, count: jnp.resize(labels, (count,))


def main(argv):
    del argv
    for name, flag in (("record", _RECORD), ("method", _METHOD), ("data", _DATA)):
        if flag.value is None:
            fail(f"--{name} is required")
    try:
        options = json.loads(_OPTIONS.value)
    except json.JSONDecodeError:
        options = None
    if not isinstance(options, dict):
        fail(f"--options must be a JSON object of build options, got {_OPTIONS.value!r}")
    for name, flag in (("record", _RECORD), ("data", _DATA)):
        if not os.path.exists(flag.value):
            fail(f"--{name}={flag.value}: no such file or directory")
    try:
        data = load_data(_DATA.value)
    except (OSError, KeyError, ValueError) as e:
        fail(f"--data={_DATA.value}: not a PFLlib dataset directory (train/<i>.npz, test/<i>.npz): {e}")
    if _NO_GUMBEL.value:
        jax.random.gumbel = lambda key, shape=(), dtype=jnp.float32, *a, **k: jnp.zeros(shape, dtype)
    if _FIXED_DRAWS.value:
        fixed_draws(data)
    rec = dict(np.load(_RECORD.value))
    try:
        state, accs = run(_METHOD.value, rec, data, _LR.value, _EPOCHS.value, options, _ROTATE.value)
        diffs = compared(_METHOD.value, rec, state, data)
    except (ValueError, TypeError) as e:  # a bad build option: one line
        fail(f"--options={_OPTIONS.value}: {e}")
    except KeyError as e:
        fail(f"--record={_RECORD.value} has no {e}: not a record of --method={_METHOD.value}'s PFLlib run")
    pfllib = np.round(pfllib_accuracies(_METHOD.value, rec), 4).tolist()
    print(json.dumps({"accuracy_pfllib": pfllib, "accuracy_pfljax": np.round(accs, 4).tolist()}))
    for what, diff in diffs.items():
        print(json.dumps({"method": _METHOD.value, "compared": what, "max_rel_diff": float(f"{diff:.3g}")}))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
