"""pFedLA round time relative to FedAvg, and the memory of the stacked hypernetworks.

    python -m experiments.bench.bench_pfedla [--cases=mlp10,mlp100,cnn10] [--repeats=5] [--json] [--donate]
        [--baseline=/tmp/pfedla_before.py]

For each case (model, C clients, K per round) it times one jitted round of FedAvg
and of pFedLA (same local training, same data shapes, random data), interleaved
(median of --repeats; `timing.compare_rounds`), and prints seconds per round, their
ratio `over_fedavg` against the target TARGET (at C = 100), the bytes of the
stacked hypernetworks and their optimizer state ([C, ...] in the state), the bytes of
all C client models pFedLA keeps, and XLA's temp-buffer size of each compiled round (memory_analysis).
--donate donates the state to the round as `pfljax.experiment.train` does (the
participants' rows of the [C, ...] state are then written in place).
--baseline: another version of pfljax/algorithms/pfedla.py (e.g. `git show
REV:pfljax/algorithms/pfedla.py > /tmp/pfedla_before.py`), timed in the same interleaving
(`baseline_s`, `baseline_over_fedavg`): before/after figures from one process. The file
runs against the checked-out pfljax.core: a version from before `hypernet.generated_step` passed
the starts to `server_update` (a460bea) needs that argument added to its server_update.
"""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from experiments.bench import timing
from pfljax.algorithms import fedavg, pfedla
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.types import ClientArrays, ClientData
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["mlp10", "mlp100", "cnn10"], "cases to run (see CASES)")
flags.DEFINE_integer("repeats", 5, "timed rounds of each algorithm, interleaved (median reported)")
flags.DEFINE_bool("json", False, "print one JSON object per line (else a readable line)")
flags.DEFINE_bool("donate", False, "donate the state to the round (as training does)")
flags.DEFINE_string("client_map", "auto", "client-mapping strategy")
flags.DEFINE_string("baseline", None, "path of another pfedla.py to time alongside (before/after)")
TARGET = 1.5  # pFedLA over FedAvg at C = 100

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


def load_baseline(path: str):
    """The module at `path` (a pfedla.py of another version; it imports pfljax.core)."""
    spec = importlib.util.spec_from_file_location("pfedla_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv):
    del argv
    for name in FLAGS.cases:
        model_name, kwargs, num, k, rows, epochs = CASES[name]
        model = build_model(model_name, (28, 28, 1), 10, **kwargs)
        spec = LocalTraining(optax.sgd(0.01), batch_size=32, epochs=epochs)
        data = random_data(num, rows)
        common = dict(clients_per_round=k, client_map=FLAGS.client_map)
        algs = {"fedavg": fedavg.build(model, spec, **common), "pfedla": pfedla.build(model, spec, **common)}
        if FLAGS.baseline:
            algs["baseline"] = load_baseline(FLAGS.baseline).build(model, spec, **common)
        res = timing.compare_rounds(algs, data, FLAGS.repeats, FLAGS.donate)
        avg, la = res["fedavg"], res["pfedla"]
        ratio = la["round_s"] / avg["round_s"]
        state = la["state"]
        out = {
            "case": name,
            "backend": jax.default_backend(),
            "clients": num,
            "per_round": k,
            "donate": FLAGS.donate,
            "fedavg_s": round(avg["round_s"], 4),
            "pfedla_s": round(la["round_s"], 4),
            "over_fedavg": round(ratio, 3),
            "target": f"<= {TARGET}",
            "met": ratio <= TARGET,
            "hypernet_MB": round(tree_bytes(state.client_hn) / 2**20, 2),
            "hypernet_opt_MB": round(tree_bytes(state.client_hn_opt) / 2**20, 2),
            "client_models_MB": round(tree_bytes(state.client_params) / 2**20, 2),
            "fedavg_temp_MB": round(avg["memory"].get("round_temp_bytes", -1) / 2**20, 2),
            "pfedla_temp_MB": round(la["memory"].get("round_temp_bytes", -1) / 2**20, 2),
        }
        if FLAGS.baseline:
            base = res["baseline"]
            out["baseline_s"] = round(base["round_s"], 4)
            out["baseline_over_fedavg"] = round(base["round_s"] / avg["round_s"], 3)
            out["baseline_temp_MB"] = round(base["memory"].get("round_temp_bytes", -1) / 2**20, 2)
        print(json.dumps(out) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
