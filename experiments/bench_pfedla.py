"""pFedLA round time relative to FedAvg, and the memory of the stacked hypernetworks.

    python -m experiments.bench_pfedla [--cases=mlp10,mlp100,cnn10] [--repeats=3]

For each case (model, C clients, K per round) it times one jitted round of FedAvg
and of pFedLA (same local training, same data shapes, random data) and prints
seconds per round, their ratio, the bytes of the stacked hypernetworks and their
optimizer state ([C, ...] in the state), the bytes of all C client models pFedLA
keeps, and XLA's temp-buffer size of each compiled round (memory_analysis).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from experiments import timing
from pfljax.algorithms import fedavg, pfedla
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.types import ClientArrays, ClientData
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["mlp10", "mlp100", "cnn10"], "cases to run (see CASES)")
flags.DEFINE_integer("repeats", 3, "timed rounds (best is reported)")
flags.DEFINE_string("client_map", "auto", "client-mapping strategy")

CASES = {
    # name: (model, kwargs, C, K, rows per client, local epochs)
    "mlp10": ("mlp", {"hidden": (200,)}, 10, 10, 560, 1),
    "mlp100": ("mlp", {"hidden": (200,)}, 100, 10, 560, 1),
    "cnn10": ("cnn", {}, 10, 10, 560, 1),
    "cnn100": ("cnn", {}, 100, 10, 560, 1),
}


def random_data(num, rows, seed=0) -> ClientData:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.random((num, rows, 28, 28, 1), np.float32))
    y = jnp.asarray(rng.integers(0, 10, (num, rows)), jnp.int32)
    arrays = ClientArrays(x, y, jnp.full((num,), rows, jnp.int32))
    return ClientData(arrays, arrays)


def time_round(alg, num, data, repeats):
    res = timing.time_round(alg, data, repeats)
    return res["round_s"], res["memory"].get("round_temp_bytes", -1), res["state"]


def main(argv):
    del argv
    for name in FLAGS.cases:
        model_name, kwargs, num, k, rows, epochs = CASES[name]
        model = build_model(model_name, (28, 28, 1), 10, **kwargs)
        spec = LocalTraining(optax.sgd(0.01), batch_size=32, epochs=epochs)
        data = random_data(num, rows)
        common = dict(clients_per_round=k, client_map=FLAGS.client_map)
        t_avg, temp_avg, _ = time_round(fedavg.build(model, spec, **common), num, data, FLAGS.repeats)
        t_la, temp_la, state = time_round(pfedla.build(model, spec, **common), num, data, FLAGS.repeats)
        out = {
            "case": name,
            "backend": jax.default_backend(),
            "clients": num,
            "per_round": k,
            "fedavg_s": round(t_avg, 4),
            "pfedla_s": round(t_la, 4),
            "ratio": round(t_la / t_avg, 3),
            "hypernet_MB": round(tree_bytes(state.client_hn) / 2**20, 2),
            "hypernet_opt_MB": round(tree_bytes(state.client_hn_opt) / 2**20, 2),
            "client_models_MB": round(tree_bytes(state.client_params) / 2**20, 2),
            "fedavg_temp_MB": round(temp_avg / 2**20, 2),
            "pfedla_temp_MB": round(temp_la / 2**20, 2),
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    app.run(main)
