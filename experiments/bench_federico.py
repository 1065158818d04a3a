"""FedeRiCo round time relative to FedAvg, and the memory of the neighbour models.

    python -m experiments.bench_federico [--json] [--clients=8,100] [--neighbours=3,all]
        [--steps=5] [--strategies=auto]

For each number of clients C and neighbours n (an integer, or "all" = C - 1) it
times one jitted FedeRiCo round and one FedAvg round with the same local steps
(best of --repeats, after compilation), on the MLP of experiments/bench.py's
"mlp" case (d=100, 200 hidden units, 2 classes, 400 rows per client, batch 32).
FedeRiCo computes C * (n + 1) (client, model) gradients per step where FedAvg
computes C, so its round should cost about (n + 1) times FedAvg's.

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

from experiments import timing
from pfljax.algorithms import fedavg, federico
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.types import ClientArrays, ClientData
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "print one JSON object per line")
flags.DEFINE_list("clients", ["8", "100"], "numbers of clients C")
flags.DEFINE_list("neighbours", ["3", "all"], "neighbours n per client (an integer or 'all' = C - 1)")
flags.DEFINE_integer("steps", 5, "local (M-) steps per round")
flags.DEFINE_integer("rows", 400, "training rows per client")
flags.DEFINE_list("strategies", ["auto"], "client-mapping strategies: auto, vmap, map")
flags.DEFINE_integer("repeats", 3, "timed repetitions (best is reported)")


def make_data(num_clients: int, rows: int, dim: int = 100, classes: int = 2) -> ClientData:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(num_clients, rows, dim)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, classes, size=(num_clients, rows)).astype(np.int32))
    arrays = ClientArrays(x, y, jnp.full((num_clients,), rows, jnp.int32))
    return ClientData(arrays, arrays)


def time_round(alg, num_clients: int, data: ClientData, repeats: int) -> tuple[float, float, int]:
    """(compile seconds, best round seconds, XLA temp bytes) of one jitted round."""
    res = timing.time_round(alg, data, repeats)
    return res["compile_s"], res["round_s"], res["memory"].get("round_temp_bytes", 0)


def main(argv):
    del argv
    model = build_model("mlp", (100,), 2, hidden=(200,))
    spec = LocalTraining(optax.adam(1e-3), batch_size=32, steps=FLAGS.steps, epochs=None)
    model_bytes = tree_bytes(model.template())
    for num in (int(c) for c in FLAGS.clients):
        data = make_data(num, FLAGS.rows)
        for strategy in FLAGS.strategies:
            base = fedavg.build(model, spec, client_map=strategy)
            fa_compile, fa_round, fa_temp = time_round(base, num, data, FLAGS.repeats)
            for spec_n in FLAGS.neighbours:
                n = num - 1 if spec_n == "all" else int(spec_n)
                alg = federico.build(model, spec, neighbours=n, client_map=strategy)
                fr_compile, fr_round, fr_temp = time_round(alg, num, data, FLAGS.repeats)
                row = {
                    "clients": num,
                    "neighbours": n,
                    "strategy": strategy,
                    "steps": FLAGS.steps,
                    "fedavg_round_s": round(fa_round, 4),
                    "federico_round_s": round(fr_round, 4),
                    "ratio": round(fr_round / fa_round, 2),
                    "pairs": num * (n + 1),
                    "pair_bytes": num * (n + 1) * model_bytes,
                    "fedavg_temp_bytes": fa_temp,
                    "federico_temp_bytes": fr_temp,
                    "fedavg_compile_s": round(fa_compile, 2),
                    "federico_compile_s": round(fr_compile, 2),
                }
                if FLAGS.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(
                        f"C={num:4d} n={n:3d} {strategy:5s}: FedAvg {fa_round * 1e3:8.1f} ms, "
                        f"FedeRiCo {fr_round * 1e3:9.1f} ms (x{row['ratio']:.1f}; {row['pairs']} pairs); "
                        f"pair tensors {row['pair_bytes'] / 2**20:8.1f} MiB; XLA temp "
                        f"{fa_temp / 2**20:.1f} / {fr_temp / 2**20:.1f} MiB",
                        flush=True,
                    )


if __name__ == "__main__":
    app.run(main)
