"""Round throughput: the library's jitted round vs a Python loop over clients.

    python -m experiments.bench.bench [--json] [--cases=cnn,mlp] [--strategies=auto,vmap,map]
        [--conv_impl=auto|im2col|im2col_nn|native|onednn] [--clients=N]

For each case it prints samples/s of one FedAvg round (all local updates in one
jit, with the client-mapping strategy given, "auto" being the library's
choice on this backend), samples/s of a Python loop calling a jitted
per-client local_train (the usual PyTorch-style structure), the achieved
GFLOP/s of the round (XLA's cost analysis of one train step, times steps), and
a measured float32 matmul peak.

Cases: "cnn" (the CNN on 28x28x1, 10 clients x 50 steps x batch 32), "resnet9"
(ResNet-9 on 32x32x3, 10 clients x 10 steps x batch 32) and "mlp"
(the FedFac simulation MLP: d=100, m=200 hidden, 100 clients x 20 steps x
batch 32). Data are random arrays of the right shapes (throughput only).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from pfljax.algorithms import fedavg
from pfljax.core import aggregate
from pfljax.core.clients import ClientMap, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.types import ClientArrays, ClientData
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model
from pfljax.models.conv import IMPLS, ONEDNN_MISSING, runs_here

FLAGS = flags.FLAGS


def define_flags():
    """The binary's flags (also those of bench_sweep, bench_sharding, bench_fedfac), defined
    only when one of them runs: importing the module (experiments.bench.gpu_suite) must not clash."""
    flags.DEFINE_bool("json", False, "print one JSON object per line")
    flags.DEFINE_list("cases", ["cnn", "mlp"], "cases to run: cnn, mlp, resnet9")
    flags.DEFINE_list("strategies", ["auto"], "client-mapping strategies: auto, vmap, map")
    flags.DEFINE_integer("chunk_size", 0, "lax.map batch_size for strategy=map (0: None)")
    flags.DEFINE_integer("repeats", 3, "timed repetitions (best is reported)")
    flags.DEFINE_enum("conv_impl", "auto", list(IMPLS), "CNN convolution implementation")
    flags.register_validator("conv_impl", runs_here, ONEDNN_MISSING)
    flags.DEFINE_integer("clients", 0, "number of clients (0: the case's own)")


CASES = {
    "cnn": dict(model="cnn", input_shape=(28, 28, 1), classes=10, clients=10, rows=1000, steps=50, batch=32),
    "resnet9": dict(
        model="resnet9", input_shape=(32, 32, 3), classes=10, clients=10, rows=320, steps=10, batch=32
    ),
    "mlp": dict(
        model="mlp", input_shape=(100,), classes=2, clients=100, rows=400, steps=20, batch=32, hidden=(200,)
    ),
}


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best float32 n x n matmul rate on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_case(name: str, clients: int = 0, conv_impl: str = "auto", **sizes):
    """(case dict, model, ClientData of random arrays, LocalTraining) of CASES[name], with
    `clients` (0: the case's own) and `sizes` (rows, steps, batch, input_shape, hidden,
    model_kwargs: extra build_model arguments) replacing the case's."""
    c = dict(CASES[name], **sizes, clients=clients or CASES[name]["clients"])
    kwargs = {"hidden": c["hidden"]} if "hidden" in c else {"conv_impl": conv_impl}
    model = build_model(c["model"], c["input_shape"], c["classes"], **kwargs, **c.get("model_kwargs", {}))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(c["clients"], c["rows"], *c["input_shape"])).astype(np.float32)
    y = rng.integers(0, c["classes"], size=(c["clients"], c["rows"])).astype(np.int32)
    arrays = ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.full((c["clients"],), c["rows"], jnp.int32))
    spec = LocalTraining(optax.sgd(0.01), batch_size=c["batch"], steps=c["steps"], epochs=None)
    return c, model, ClientData(arrays, arrays), spec


def flag_case(name: str):
    """make_case(name) with --clients and --conv_impl."""
    return make_case(name, FLAGS.clients, FLAGS.conv_impl)


def step_flops(model, spec, data) -> float:
    """XLA's flop count of one local optimizer step (forward + backward + update)."""
    one = spec._replace(steps=1)
    train = make_local_train(model.apply, one)
    params = model.init(jax.random.key(0))
    lowered = jax.jit(train).lower(params, take(data.train, 0), jax.random.key(0))
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))


def bench_round(model, spec, data, strategy: str, chunk: int | None, repeats: int) -> float:
    alg = fedavg.build(model, spec, client_map=ClientMap(strategy, chunk))
    state = alg.init(jax.random.key(0), None, data.train.count.shape[0])
    rnd = jax.jit(alg.round)
    state, _ = rnd(state, data, jax.random.key(1))
    jax.block_until_ready(state)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        state, m = rnd(state, data, jax.random.key(2 + r))
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_loop(model, spec, data, repeats: int) -> float:
    """A Python loop of jitted per-client training, then a jitted average."""
    train = jax.jit(make_local_train(model.apply, spec))
    mean = jax.jit(aggregate.weighted_mean)
    params = model.init(jax.random.key(0))
    num = data.train.count.shape[0]
    clients = [take(data.train, c) for c in range(num)]

    def one_round(p):
        outs = [train(p, clients[c], jax.random.key(c)).params for c in range(num)]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
        return mean(stacked, data.train.count.astype(jnp.float32))

    params = one_round(params)
    jax.block_until_ready(params)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        params = one_round(params)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv):
    del argv
    peak = matmul_peak_gflops()
    for name in FLAGS.cases:
        if name not in CASES:
            raise app.UsageError(f"--cases must be among {sorted(CASES)}, got {name!r}")
        c, model, data, spec = flag_case(name)
        samples = c["clients"] * c["steps"] * c["batch"]
        flops = step_flops(model, spec, data) * c["clients"] * c["steps"]
        loop_s = bench_loop(model, spec, data, FLAGS.repeats)
        for strategy in FLAGS.strategies:
            resolved = ClientMap(strategy).resolved()
            chunk = FLAGS.chunk_size or None
            round_s = bench_round(model, spec, data, strategy, chunk, FLAGS.repeats)
            row = {
                "case": name,
                "clients": c["clients"],
                "conv_impl": FLAGS.conv_impl if "hidden" not in c else None,
                "strategy": resolved + (f"/chunk={chunk}" if chunk and resolved == "map" else ""),
                "round_samples_per_s": round(samples / round_s, 1),
                "loop_samples_per_s": round(samples / loop_s, 1),
                "round_over_loop": round(loop_s / round_s, 2),
                "gflops": round(flops / round_s / 1e9, 2),
                "peak_gflops": round(peak, 1),
                "backend": jax.default_backend(),
            }
            print(
                json.dumps(row) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True
            )


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
