"""Scaling: round cost that follows the clients' real data, bytes of client data, many clients.

    python -m experiments.bench_scale [--json] [--cases=a,b,c,d] [--repeats=2]
        [--clients_a=20,100] [--clients_c=10,100,1000,10000]

One JSON line per measurement, each with its case, its target and whether it
is met. "before" is the layout and loop the library used until the ClientPool:
zero-padded float32 [C, n_max, ...] arrays (`ClientPool.padded()`) and the
masked local scan of n_max's step count (`loop="scan"`); "after" is the
ClientPool (rows once, uint8 images) and the library's default loop ("auto":
each client runs only its own steps on CPU). Both run in the same process.

- (a) Fashion-MNIST, the CNN, FedAvg, 1 local epoch, batch 32, every client
  every round: Dirichlet(0.1) vs IID over the same samples, at 20 and 100
  clients; target round-time ratio Dirichlet / IID <= 1.25.
- (b) device bytes of the client data (train + test) against the raw data set
  (uint8 images and int32 labels of every sample); target <= 1.1x.
- (c) the FedFac simulation's MLP (d=100, 200 hidden, 2 classes; 400 train and
  100 test rows per client, random values of the right shapes), FedAvg, 1
  local epoch, batch 32, at C clients all participating and K=100 of C:
  seconds per round, data and state bytes per client, the largest C that fits
  (memory_report); target: time per client at the largest C within 1.5x of C=100.
- (d) FedeRiCo (3 neighbours) and pFedLA against FedAvg at 100 clients (the
  MLP of (c), 5 local steps): round-time ratios, targets <= 5x and <= 1.5x, and
  the ratio to FedAvg with 4x the steps (the (neighbours + 1) gradients per
  step FedeRiCo cannot avoid).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
from absl import app, flags

from experiments.timing import time_round
from pfljax.algorithms import fedavg, federico, pfedla
from pfljax.core.local import LocalTraining
from pfljax.core.memory import device_memory_bytes, max_clients
from pfljax.core.params import tree_bytes
from pfljax.core.types import ClientData
from pfljax.data import build_federated_data, pool_clients
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "print one JSON object per line (else a readable line)")
flags.DEFINE_list("cases", ["a", "b", "c", "d"], "cases to run: a, b, c, d")
flags.DEFINE_integer("repeats", 2, "timed rounds after the compiled first one (best is reported)")
flags.DEFINE_list("clients_a", ["20", "100"], "numbers of clients of cases (a) and (b)")
flags.DEFINE_list("clients_c", ["10", "100", "1000", "10000"], "numbers of clients of case (c)")
flags.DEFINE_integer("per_round_c", 100, "K of case (c)'s partial-participation rows")

GiB = 2**30
SGD = optax.sgd(0.01)


def emit(row: dict) -> None:
    print(json.dumps(row) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def fmnist_layouts(num: int, partition: str):
    fed = build_federated_data("fashion_mnist", num, partition=partition, dirichlet_alpha=0.1, seed=0)
    padded = ClientData(fed.data.train.padded(), fed.data.test.padded())
    return fed, padded


def raw_bytes(fed) -> int:
    """uint8 images and int32 labels of every sample of the federated data."""
    samples = fed.summary["totals"]["train"] + fed.summary["totals"]["test"]
    return samples * (int(np.prod(fed.input_shape)) + 4)


def case_a_b(repeats: int) -> None:
    model = build_model("cnn", (28, 28, 1), 10)
    for num in (int(c) for c in FLAGS.clients_a):
        times = {}
        for partition in ("iid", "dirichlet"):
            fed, padded = fmnist_layouts(num, partition)
            counts = np.asarray(fed.data.train.count)
            raw = raw_bytes(fed)
            for layout, data, loop in (("before", padded, "scan"), ("after", fed.data, "auto")):
                spec = LocalTraining(SGD, batch_size=32, epochs=1, loop=loop)
                res = time_round(fedavg.build(model, spec), data, repeats)
                times[(partition, layout)] = res["round_s"]
                if "b" in FLAGS.cases:
                    emit(
                        {
                            "case": "b",
                            "clients": num,
                            "partition": partition,
                            "layout": layout,
                            "data_MiB": round(tree_bytes(data) / 2**20, 1),
                            "raw_MiB": round(raw / 2**20, 1),
                            "ratio": round(tree_bytes(data) / raw, 3),
                            "target": "<= 1.1",
                            "met": tree_bytes(data) / raw <= 1.1,
                        }
                    )
                emit(
                    {
                        "case": "a",
                        "clients": num,
                        "partition": partition,
                        "layout": layout,
                        "train_samples": int(counts.sum()),
                        "n_max": int(counts.max()),
                        "n_max_over_mean": round(float(counts.max() / counts.mean()), 2),
                        "round_s": round(res["round_s"], 3),
                        "compile_s": round(res["compile_s"], 1),
                    }
                )
        for layout in ("before", "after"):
            ratio = times[("dirichlet", layout)] / times[("iid", layout)]
            emit(
                {
                    "case": "a",
                    "clients": num,
                    "layout": layout,
                    "dirichlet_over_iid": round(ratio, 2),
                    "target": "<= 1.25",
                    "met": ratio <= 1.25,
                }
            )


def mlp_data(num: int, train_rows: int = 400, test_rows: int = 100, dim: int = 100) -> ClientData:
    rng = np.random.default_rng(0)

    def split(rows):
        x = rng.normal(size=(num, rows, dim)).astype(np.float32)
        y = rng.integers(0, 2, size=(num, rows)).astype(np.int32)
        return pool_clients(list(x), list(y))

    return ClientData(split(train_rows), split(test_rows))


def mlp_model():
    return build_model("mlp", (100,), 2, hidden=(200,))


def case_c(repeats: int) -> None:
    model, spec = mlp_model(), LocalTraining(SGD, batch_size=32, epochs=1)
    per_client, largest = {}, None
    for num in (int(c) for c in FLAGS.clients_c):
        data = mlp_data(num)
        for k in sorted({num, min(FLAGS.per_round_c, num)}, reverse=True):
            res = time_round(fedavg.build(model, spec, clients_per_round=k), data, repeats)
            mem = res["memory"]
            row = {
                "case": "c",
                "clients": num,
                "per_round": k,
                "round_s": round(res["round_s"], 4),
                "s_per_participant": res["round_s"] / k,
                "compile_s": round(res["compile_s"], 1),
                "data_bytes_per_client": mem["data_bytes"] // num,
                "state_bytes_per_client": mem["client_state_bytes_per_client"],
                "round_temp_MiB": round(mem.get("round_temp_bytes", 0) / 2**20, 1),
                "max_clients_available": mem.get("max_clients"),
                "max_clients_24GiB": max_clients(mem, 24 * GiB),
            }
            emit(row)
            if k == num:
                per_client[num], largest = res["round_s"] / num, num
        del data
    if 100 in per_client and largest:
        ratio = per_client[largest] / per_client[100]
        emit(
            {
                "case": "c",
                "time_per_client_ratio": f"C={largest} / C=100",
                "ratio": round(ratio, 2),
                "target": "<= 1.5",
                "met": ratio <= 1.5,
                "available_GiB": round((device_memory_bytes() or 0) / GiB, 1),
            }
        )


def case_d(repeats: int) -> None:
    model, num, steps = mlp_model(), 100, 5
    data = mlp_data(num)
    spec = LocalTraining(SGD, batch_size=32, steps=steps)
    adam = LocalTraining(optax.adam(1e-3), batch_size=32, steps=steps)
    base = time_round(fedavg.build(model, spec), data, repeats)["round_s"]
    emit(
        {"case": "d", "algorithm": "fedavg", "clients": num, "local_steps": steps, "round_s": round(base, 4)}
    )
    # The work FedeRiCo cannot avoid: (neighbours + 1) gradients per step, as FedAvg with 4x the steps.
    work = time_round(fedavg.build(model, spec._replace(steps=4 * steps)), data, repeats)["round_s"]
    emit({"case": "d", "algorithm": "fedavg, 4x steps", "clients": num, "round_s": round(work, 4)})
    for name, alg, target in (
        ("federico", federico.build(model, adam, neighbours=3), 5.0),
        ("pfedla", pfedla.build(model, spec), 1.5),
    ):
        res = time_round(alg, data, repeats)
        ratio = res["round_s"] / base
        emit(
            {
                "case": "d",
                "algorithm": name,
                "clients": num,
                "round_s": round(res["round_s"], 4),
                "over_fedavg": round(ratio, 2),
                "target": f"<= {target}",
                "met": ratio <= target,
                "over_fedavg_4x_steps": round(res["round_s"] / work, 2),
                "round_temp_MiB": round(res["memory"].get("round_temp_bytes", 0) / 2**20, 1),
            }
        )


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.cases) - {"a", "b", "c", "d"})
    if unknown:
        raise app.UsageError(f"--cases must be among a, b, c, d; got {unknown}")
    emit({"backend": jax.default_backend(), "devices": jax.device_count(), "jax": jax.__version__})
    if {"a", "b"} & set(FLAGS.cases):
        case_a_b(FLAGS.repeats)
    if "c" in FLAGS.cases:
        case_c(FLAGS.repeats)
    if "d" in FLAGS.cases:
        case_d(FLAGS.repeats)


if __name__ == "__main__":
    app.run(main)
