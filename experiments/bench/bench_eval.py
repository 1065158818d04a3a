"""Evaluation rows per forward pass (`pfljax.core.evaluate.EVAL_CHUNK`): time of one evaluation.

    python -m experiments.bench.bench_eval [--chunks=128,512] [--setting=dir]
        [--repeats=5] [--client_map=vmap]

Evaluates the FedAvgCNN of `pfllib_fmnist.py:<setting>` (20 clients, all test rows) with
`pfljax.core.evaluate.evaluate_clients(..., chunk=c)` under --client_map, jitted once per
chunk size; times the chunk sizes interleaved (--repeats times) and prints one JSON line
per chunk with the median seconds, every repeat's seconds and the backend. Larger chunks
keep more activations live at once (C x chunk rows per forward pass, times seed
replicas) and score more masked rows (each client's last chunk).
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from pfljax.core import evaluate
from pfljax.core.clients import ClientMap
from pfljax.experiment.cli import parse_flags
from pfljax.experiment.config import make_data, make_model, resolve
from pfljax.experiment.configs import pfllib_fmnist

FLAGS = flags.FLAGS


def define_flags():
    """The binary's flags, defined only when it runs (experiments.bench.gpu_suite imports the module)."""
    flags.DEFINE_list("chunks", ["128", "512"], "rows per forward pass to compare")
    flags.DEFINE_enum("setting", "dir", ["dir", "pat"], "PFLlib split")
    flags.DEFINE_integer("repeats", 5, "timed evaluations per chunk size")
    flags.DEFINE_enum("client_map", "vmap", ["auto", "vmap", "map"], "client-mapping strategy")


def compiled_accuracy(apply_fn, chunk: int, args, client_map: str = "vmap"):
    """(stacked variables [C, ...], test pool) -> accuracy [C], compiled for `args`, `chunk` rows a pass."""
    client_map = ClientMap(client_map)

    def run(stacked, test):
        def variables_of(c):
            return jax.tree.map(lambda a: a[c], stacked)

        return evaluate.evaluate_clients(apply_fn, variables_of, test, client_map, chunk=chunk)["accuracy"]

    return jax.jit(run).lower(*args).compile()


def _sig(x: float) -> float:
    return float(f"{x:.4g}")  # 4 significant digits: a GPU's milliseconds too


def time_chunks(model, test, chunks: list[int], repeats: int, client_map: str = "vmap") -> list[dict]:
    """One row per chunk size: seconds of evaluating `model`'s initial variables (every client
    the same) on the test pool `test`, the chunk sizes interleaved `repeats` times."""
    variables = model.init(jax.random.key(0))
    clients = test.count.shape[0]
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (clients,) + a.shape), variables)
    args = (stacked, test)
    fns = {c: compiled_accuracy(model.apply, c, args, client_map) for c in chunks}
    accs = {c: jax.block_until_ready(fns[c](*args)) for c in chunks}
    times = {c: [] for c in chunks}
    for _ in range(repeats):
        for c in chunks:
            start = time.perf_counter()
            jax.block_until_ready(fns[c](*args))
            times[c].append(time.perf_counter() - start)
    return [{
        "eval_chunk": c, "clients": clients, "test_rows": int(test.x.shape[0]),
        "median_s": _sig(statistics.median(times[c])), "all_s": [_sig(t) for t in times[c]],
        "same_accuracy_as_first": bool(jnp.allclose(accs[c], accs[chunks[0]])),
        "client_map": client_map, "backend": jax.default_backend(),
    } for c in chunks]  # fmt: skip


def main(argv):
    del argv
    chunks = [int(c) for c in FLAGS.chunks]
    config, _ = resolve(pfllib_fmnist.get_config(FLAGS.setting))
    fed = make_data(config)
    model = make_model(config, fed)
    for row in time_chunks(model, fed.data.test, chunks, FLAGS.repeats, FLAGS.client_map):
        print(json.dumps(row))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
