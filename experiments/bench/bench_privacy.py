"""Cost of client-level DP in a FedAvg round: rounds with `config.dp.enabled` vs without.

    python -m experiments.bench.bench_privacy [--json] [--cases=femnist_cnn,default_mlp] [--repeats=5]
        [--clients_per_round=3] [--femnist_clients=10] [--femnist_rows=40]
        [--reference=FILE]

Cases, each built through the experiment machinery (`pfljax.experiment.config`: model,
local training and algorithm from the config, DP from `config.dp`):

- femnist_cnn: the `leaf_femnist` config (LEAF's FEMNIST CNN, 6.6M parameters; SGD,
  batch 10, 1 epoch) with `--clients_per_round` of `--femnist_clients` writers, each with
  `--femnist_rows` random 28x28x1 images of 62 classes (throughput only: LEAF's files
  are not needed).
- default_mlp: the `default` config (its data: Fashion-MNIST when the IDX files are
  present, else the simulation data; every client every round).

DP is the config's default (`dp.noise_multiplier` 1, `dp.clip_norm` 1). The rounds of
one case are compiled first, then timed interleaved (one round of each in turn,
`--repeats` times), so that a busy machine slows them alike. `--reference=FILE` adds a
third round whose server uses FILE's `private_mean_update` (e.g. the library's
privacy module at an older commit: `git show COMMIT:pfljax/core/privacy.py > FILE`).

One JSON line per case: case, clients_per_round, s_per_round_dp and s_per_round_nodp
({median, min, max} seconds over the repeats after compilation), ratio (median DP over
median non-DP), the same for the reference when given, backend, device_kind, load_avg.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.bench import timing
from pfljax.core import round as round_lib
from pfljax.core.types import ClientArrays, ClientData
from pfljax.data.federated import FederatedData
from pfljax.experiment.cli import parse_flags
from pfljax.experiment.config import prepare
from pfljax.experiment.configs import default, leaf_femnist

FLAGS = flags.FLAGS
CASES = ("femnist_cnn", "default_mlp")


def define_flags():
    flags.DEFINE_bool("json", False, "print one JSON object per line")
    flags.DEFINE_list("cases", list(CASES), f"cases to run: {', '.join(CASES)}")
    flags.DEFINE_integer("repeats", 5, "timed rounds of each kind after compilation")
    flags.DEFINE_integer("clients_per_round", 3, "femnist_cnn: participants per round")
    flags.DEFINE_integer("femnist_clients", 10, "femnist_cnn: writers")
    flags.DEFINE_integer("femnist_rows", 40, "femnist_cnn: random train rows per writer")
    flags.DEFINE_string("reference", "", "a Python file whose private_mean_update a third round uses")


def random_femnist(clients: int, rows: int) -> FederatedData:
    """FederatedData of random FEMNIST-shaped arrays (28x28x1, 62 classes), equal clients."""
    rng = np.random.default_rng(0)
    x = rng.random((clients, rows, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 62, size=(clients, rows)).astype(np.int32)
    arrays = ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.full((clients,), rows, jnp.int32))
    summary = {"clients": [{"train": rows, "test": rows}] * clients}
    return FederatedData(ClientData(arrays, arrays), 62, (28, 28, 1), summary, None)


def case_config(name: str):
    """(config, FederatedData or None: the config's own) of a case, DP off."""
    if name == "femnist_cnn":
        config = leaf_femnist.get_config()
        config.num_clients = FLAGS.femnist_clients
        config.clients_per_round = FLAGS.clients_per_round
        return config, random_femnist(FLAGS.femnist_clients, FLAGS.femnist_rows)
    if name == "default_mlp":
        return default.get_config(), None
    raise app.UsageError(f"--cases must be among {list(CASES)}, got {name!r}")


def build(name: str, kinds: tuple[str, ...]) -> tuple[dict, ClientData, dict]:
    """({kind: Algorithm}, train/test ClientData, facts about the case): kind "nodp" without
    DP, any other with DP (each built on its own, so that no compiled round is shared)."""
    config, fed_data = case_config(name)
    algs = {}
    for kind in kinds:
        config.dp.enabled = kind != "nodp"
        prep = prepare(config, fed_data)
        fed_data, algs[kind] = prep.fed_data, prep.algorithm
    model = prep.model
    facts = {
        "clients_per_round": config.clients_per_round or int(fed_data.data.train.count.shape[0]),
        "clients": int(fed_data.data.train.count.shape[0]),
        "dataset": config.dataset if name != "femnist_cnn" else "random",
        "params": int(sum(x.size for x in jax.tree.leaves(model.template()))),
        "noise_multiplier": config.dp.noise_multiplier,
        "clip_norm": config.dp.clip_norm,
    }
    return algs, fed_data.data, facts


def load_reference(path: str):
    """`private_mean_update` of the Python file at `path`."""
    spec = importlib.util.spec_from_file_location("reference_privacy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.private_mean_update


@contextlib.contextmanager
def server_privacy(fn):
    """The round's server uses `fn` as private_mean_update while a round is traced."""
    saved = round_lib.private_mean_update
    round_lib.private_mean_update = fn
    try:
        yield
    finally:
        round_lib.private_mean_update = saved


def summary(times: list[float]) -> dict:
    return {
        "median": round(float(np.median(times)), 5),
        "min": round(min(times), 5),
        "max": round(max(times), 5),
    }


def run_case(name: str, reference) -> dict:
    kinds = ("nodp", "dp") if reference is None else ("nodp", "dp", "dp_reference")
    algs, data, facts = build(name, kinds)
    res = {kind: timing.compile_round(algs[kind], data) for kind in ("nodp", "dp")}
    if reference is not None:
        with server_privacy(reference):
            res["dp_reference"] = timing.compile_round(algs["dp_reference"], data)
    times = {kind: [] for kind in res}
    for r in range(FLAGS.repeats):
        for kind in res:
            times[kind].append(timing.run_timed(res[kind], data, jax.random.key(2 + r)))
    row = {"case": name, **facts}
    row["s_per_round_dp"] = summary(times["dp"])
    row["s_per_round_nodp"] = summary(times["nodp"])
    row["ratio"] = round(float(np.median(times["dp"]) / np.median(times["nodp"])), 3)
    if reference is not None:
        row["reference"] = FLAGS.reference
        row["s_per_round_dp_reference"] = summary(times["dp_reference"])
        row["ratio_reference"] = round(float(np.median(times["dp_reference"]) / np.median(times["nodp"])), 3)
    row["repeats"] = FLAGS.repeats
    row["compile_s"] = {kind: round(r["compile_s"], 2) for kind, r in res.items()}
    row |= {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind}
    row["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    return row


def main(argv):
    del argv
    reference = load_reference(FLAGS.reference) if FLAGS.reference else None
    for name in FLAGS.cases:
        row = run_case(name, reference)
        print(json.dumps(row) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
