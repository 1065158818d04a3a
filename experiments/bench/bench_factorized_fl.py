"""Factorized-FL vs FedAvg on the same (unfactorized) architecture: round time and bytes.

    python -m experiments.bench.bench_factorized_fl [--cases=mlp,cnn,resnet9] [--json]

bytes: per-client upload/download of one round for the paper's ResNet-9 on
32x32x3 inputs with 10 classes (and the other cases), for each Factorized-FL
option that changes what travels, against FedAvg sending the whole plain model
both ways. Static (from shapes), no training.

time: best of `--repeats` jitted rounds (after one warm-up round, the two
algorithms interleaved) of Factorized-FL on the factorized model and of FedAvg
on the plain model, the same clients, steps and batch size, random data of the
right shapes; wall time, and the ratio of process CPU time (less sensitive to
other processes on a shared machine).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import factorized_fl, fedavg, model_variant
from pfljax.core.clients import ClientMap
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.types import ClientArrays, ClientData
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["mlp", "cnn", "resnet9"], "cases to time: mlp, cnn, resnet9")
flags.DEFINE_string("client_map", "auto", "client-mapping strategy: auto, vmap, map")
flags.DEFINE_integer("repeats", 7, "timed rounds per algorithm (best is reported)")
flags.DEFINE_bool("json", False, "print one JSON object per line")

CASES = {
    "mlp": dict(model="mlp", kw={"hidden": (200,)}, shape=(28, 28, 1), classes=10, clients=20, steps=20),
    "cnn": dict(model="cnn", kw={}, shape=(28, 28, 1), classes=10, clients=10, steps=20),
    "resnet9": dict(model="resnet9", kw={}, shape=(32, 32, 3), classes=10, clients=4, steps=4),
}
BATCH = 32
OPTIONS = {
    "base": dict(),
    "base, head mixed": dict(head_local=False),
    "base, other leaves mixed (release)": dict(other_leaves="mixed"),
    "beta": dict(variant="beta"),
    "beta without mu (Fig. 8 ablation)": dict(variant="beta", use_mu=False),
    "matching=fedavg (Fig. 8 ablation, no v uploaded)": dict(matching="fedavg"),
}


def emit(row: dict) -> None:
    if FLAGS.json:
        print(json.dumps(row), flush=True)
    else:
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def bytes_rows(name: str, case: dict) -> None:
    fmodel = build_model(
        model_variant("factorized_fl", case["model"]), case["shape"], case["classes"], **case["kw"]
    )
    plain = build_model(case["model"], case["shape"], case["classes"], **case["kw"])
    dense = tree_bytes(jax.eval_shape(plain.init, jax.random.key(0)))
    template = jax.eval_shape(fmodel.init, jax.random.key(0))
    layers = factorized_fl.layer_order(fmodel)
    match = [n for n in layers if n != "head"][-1]
    for option, kw in OPTIONS.items():
        mixed, uploaded = factorized_fl.leaf_roles(
            template,
            match,
            variant=kw.get("variant", "base"),
            head_local=kw.get("head_local", True),
            other_leaves=kw.get("other_leaves", "local"),
            use_mu=kw.get("use_mu", True),
            upload_match=kw.get("matching", "similarity") != "fedavg",
        )
        up = factorized_fl.flagged_bytes(template, uploaded)
        down = factorized_fl.flagged_bytes(template, mixed)
        emit(
            {
                "case": name,
                "option": option,
                "fedavg_bytes_each_way": dense,
                "ffl_bytes_up": up,
                "ffl_bytes_down": down,
                "fedavg_over_ffl_up": round(dense / up, 1),
                "fedavg_over_ffl_total": round(2 * dense / (up + down), 1),
            }
        )


def timed_rounds(algs: dict, data, num: int) -> dict:
    """Best wall and process-CPU seconds of one jitted round per algorithm,
    the algorithms interleaved so that load from other processes hits all alike."""
    states, rounds = {}, {}
    for name, alg in algs.items():
        rounds[name] = jax.jit(alg.round)
        states[name], _ = rounds[name](alg.init(jax.random.key(0), None, num), data, jax.random.key(1))
        jax.block_until_ready(states[name])
    wall = dict.fromkeys(algs, float("inf"))
    cpu = dict.fromkeys(algs, float("inf"))
    for r in range(FLAGS.repeats):
        for name in algs:
            t0, c0 = time.perf_counter(), time.process_time()
            out = rounds[name](states[name], data, jax.random.key(2 + r))
            jax.block_until_ready(out)
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return {"wall": wall, "cpu": cpu}


def time_rows(name: str, case: dict) -> None:
    rng = np.random.default_rng(0)
    num, rows = case["clients"], case["steps"] * BATCH
    x = rng.normal(size=(num, rows, *case["shape"])).astype(np.float32)
    y = rng.integers(0, case["classes"], size=(num, rows)).astype(np.int32)
    arrays = ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.full((num,), rows, jnp.int32))
    data = ClientData(arrays, arrays)
    spec = LocalTraining(optax.sgd(0.01, momentum=0.9), batch_size=BATCH, steps=case["steps"], epochs=None)
    cmap = ClientMap(FLAGS.client_map)
    fmodel = build_model(
        model_variant("factorized_fl", case["model"]), case["shape"], case["classes"], **case["kw"]
    )
    plain = build_model(case["model"], case["shape"], case["classes"], **case["kw"])
    algs = {
        "ffl": factorized_fl.build(fmodel, spec, client_map=cmap),
        "fedavg": fedavg.build(plain, spec, client_map=cmap),
    }
    t = timed_rounds(algs, data, num)
    emit(
        {
            "case": name,
            "clients": num,
            "steps": case["steps"],
            "batch": BATCH,
            "strategy": cmap.resolved(),
            "ffl_round_s": round(t["wall"]["ffl"], 4),
            "fedavg_round_s": round(t["wall"]["fedavg"], 4),
            "ffl_over_fedavg_time": round(t["wall"]["ffl"] / t["wall"]["fedavg"], 2),
            "ffl_over_fedavg_cpu": round(t["cpu"]["ffl"] / t["cpu"]["fedavg"], 2),
            "backend": jax.default_backend(),
        }
    )


def main(argv):
    del argv
    for name in FLAGS.cases:
        if name not in CASES:
            raise app.UsageError(f"--cases must be among {sorted(CASES)}, got {name!r}")
    for name in CASES:
        bytes_rows(name, CASES[name])
    for name in FLAGS.cases:
        time_rows(name, CASES[name])


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
