"""FedeRiCo round time relative to FedAvg, and the memory of the neighbour models.

    python -m experiments.bench.bench_federico [--json] [--clients=8,100] [--neighbours=3,all]
        [--steps=5] [--strategies=auto] [--repeats=5] [--donate]

For each number of clients C and neighbours n (an integer, or "all" = C - 1) it
times one jitted FedeRiCo round and one FedAvg round with the same local steps
and optimizer (Adam), interleaved (median of --repeats, after compilation;
`timing.compare_rounds`), on the MLP of experiments/bench/bench.py's "mlp" case
(d=100, 200 hidden units, 2 classes, 400 rows per client, batch 32). FedeRiCo
computes C * (n + 1) (client, model) gradients per step where FedAvg computes C,
so its round should cost about (n + 1) times FedAvg's; `over_fedavg` is the
ratio, against the target TARGET (n = 3 at C = 100). --donate donates
the state to the round as `pfljax.experiment.train` does.

Memory: the per-pair gradients [C * (n + 1), ...] (and, with --strategies=vmap,
the gathered neighbour models of the same size) are reported as
`pair_bytes` = C * (n + 1) * model bytes, next to XLA's temp-buffer size of the
compiled round (`memory_analysis().temp_size_in_bytes`) for both algorithms.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from experiments.bench import timing
from pfljax.algorithms import fedavg, federico
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.types import ClientArrays, ClientData
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "print one JSON object per line")
flags.DEFINE_list("clients", ["8", "100"], "numbers of clients C")
flags.DEFINE_list("neighbours", ["3", "all"], "neighbours n per client (an integer or 'all' = C - 1)")
flags.DEFINE_integer("steps", 5, "local (M-) steps per round")
flags.DEFINE_integer("rows", 400, "training rows per client")
flags.DEFINE_list("strategies", ["auto"], "client-mapping strategies: auto, vmap, map")
flags.DEFINE_integer("repeats", 5, "timed rounds of each algorithm, interleaved (median reported)")
flags.DEFINE_bool("donate", False, "donate the state to the round (as training does)")
TARGET = 5.0  # FedeRiCo over FedAvg at C = 100, n = 3


def make_data(num_clients: int, rows: int, dim: int = 100, classes: int = 2) -> ClientData:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(num_clients, rows, dim)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, classes, size=(num_clients, rows)).astype(np.int32))
    arrays = ClientArrays(x, y, jnp.full((num_clients,), rows, jnp.int32))
    return ClientData(arrays, arrays)


def main(argv):
    del argv
    model = build_model("mlp", (100,), 2, hidden=(200,))
    spec = LocalTraining(optax.adam(1e-3), batch_size=32, steps=FLAGS.steps, epochs=None)
    model_bytes = tree_bytes(model.template())
    for num in (int(c) for c in FLAGS.clients):
        data = make_data(num, FLAGS.rows)
        for strategy in FLAGS.strategies:
            sizes = [num - 1 if spec_n == "all" else int(spec_n) for spec_n in FLAGS.neighbours]
            algs = {"fedavg": fedavg.build(model, spec, client_map=strategy)}
            algs.update({n: federico.build(model, spec, neighbours=n, client_map=strategy) for n in sizes})
            res = timing.compare_rounds(algs, data, FLAGS.repeats, FLAGS.donate)
            for n in sizes:
                emit(row(res["fedavg"], res[n], num, n, strategy, model_bytes))


def row(base: dict, res: dict, num: int, n: int, strategy: str, model_bytes: int) -> dict:
    """One result line: round times, their ratio against TARGET, pair tensors, temporaries."""
    ratio = res["round_s"] / base["round_s"]
    return {
        "clients": num,
        "neighbours": n,
        "strategy": strategy,
        "steps": FLAGS.steps,
        "donate": FLAGS.donate,
        "fedavg_round_s": round(base["round_s"], 4),
        "federico_round_s": round(res["round_s"], 4),
        "over_fedavg": round(ratio, 2),
        "target": f"<= {TARGET}",
        "met": ratio <= TARGET,
        "pairs": num * (n + 1),
        "pair_bytes": num * (n + 1) * model_bytes,
        "fedavg_temp_bytes": base["memory"].get("round_temp_bytes", 0),
        "federico_temp_bytes": res["memory"].get("round_temp_bytes", 0),
        "fedavg_compile_s": round(base["compile_s"], 2),
        "federico_compile_s": round(res["compile_s"], 2),
    }


def emit(r: dict) -> None:
    if FLAGS.json:
        print(json.dumps(r), flush=True)
        return
    print(
        f"C={r['clients']:4d} n={r['neighbours']:3d} {r['strategy']:5s}: FedAvg "
        f"{r['fedavg_round_s'] * 1e3:8.1f} ms, FedeRiCo {r['federico_round_s'] * 1e3:9.1f} ms "
        f"(over_fedavg {r['over_fedavg']:.2f}, target {r['target']}, met {r['met']}; {r['pairs']} pairs); "
        f"pair tensors {r['pair_bytes'] / 2**20:8.1f} MiB; XLA temp "
        f"{r['fedavg_temp_bytes'] / 2**20:.1f} / {r['federico_temp_bytes'] / 2**20:.1f} MiB",
        flush=True,
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
