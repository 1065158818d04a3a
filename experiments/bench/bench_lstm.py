"""The char LSTM's ways of running (`pfljax.models.lstm.IMPLS`): inference and one training step.

    python -m experiments.bench.bench_lstm [--impls=scan,flax,onednn] [--clients=10] [--batch=10]
        [--repeats=15]

The Shakespeare model of `bench_vs_torch`'s lstm case (80-character windows, embedding 8,
two LSTM layers of 256, logits at every position): for --clients clients, each with its own
parameters and a batch of --batch windows, mapped one client after another (`lax.map`,
the CPU default), the jitted forward pass (loss only) and the jitted gradient. Every impl
is compiled first, then timed interleaved (--repeats times); one JSON line per impl with
the median seconds of both, every repeat's seconds and the backend.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import optax
from absl import app, flags

from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model
from pfljax.models.lstm import IMPLS

FLAGS = flags.FLAGS
WINDOW, VOCAB = 80, 80


def programs(impl: str, clients: int, batch: int):
    """(forward, gradient) of `clients` clients' loss, jitted, and their arguments."""
    model = build_model("char_lstm", (WINDOW,), VOCAB, embed=8, hidden=(256, 256), last_only=False, impl=impl)
    keys = jax.random.split(jax.random.key(0), clients + 2)
    params = jax.vmap(model.init)(keys[:clients])
    x = jax.random.randint(keys[-2], (clients, batch, WINDOW), 1, VOCAB)
    y = jax.random.randint(keys[-1], (clients, batch, WINDOW), 1, VOCAB)

    def loss(variables, xb, yb):
        logits = model.apply(variables, xb)[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    forward = jax.jit(lambda *a: jax.lax.map(lambda row: loss(*row), a))
    gradient = jax.jit(lambda *a: jax.lax.map(lambda row: jax.grad(loss)(*row), a))
    return forward, gradient, (params, x, y)


def main(argv):
    del argv
    impls = list(FLAGS.impls)
    runs = {impl: programs(impl, FLAGS.clients, FLAGS.batch) for impl in impls}
    for forward, gradient, args in runs.values():
        jax.block_until_ready((forward(*args), gradient(*args)))
    times = {impl: {"forward": [], "gradient": []} for impl in impls}
    for _ in range(FLAGS.repeats):
        for impl, (forward, gradient, args) in runs.items():
            for name, fn in (("forward", forward), ("gradient", gradient)):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[impl][name].append(round(time.perf_counter() - t0, 5))
    for impl in impls:
        row = {"impl": impl, "clients": FLAGS.clients, "batch": FLAGS.batch, "backend": jax.default_backend()}
        for name, seconds in times[impl].items():
            row[f"{name}_s"] = round(statistics.median(seconds), 5)
            row[f"{name}_all_s"] = seconds
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    flags.DEFINE_list(
        "impls",
        [i for i in IMPLS if i != "auto"],
        f"ways of running the LSTM to compare, from {', '.join(IMPLS)}",
    )
    flags.DEFINE_integer("clients", 10, "clients, each with its own parameters", lower_bound=1)
    flags.DEFINE_integer("batch", 10, "windows per client", lower_bound=1)
    flags.DEFINE_integer("repeats", 15, "timed runs of each program", lower_bound=1)
    flags.register_validator(
        "impls", lambda v: bool(v) and set(v) <= set(IMPLS), f"--impls takes values from {', '.join(IMPLS)}"
    )
    app.run(main, flags_parser=parse_flags)
