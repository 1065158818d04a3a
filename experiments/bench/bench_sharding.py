"""Round time with the client axis sharded over D devices, by mapping strategy.

    python -m experiments.bench.bench_sharding [--devices=4] [--cases=cnn,mlp] [--json]

On CPU it forces D host devices (`pfljax.runtime.sharding.use_cpu_devices`, as the
binaries' `--cpu_devices`); on GPU/TPU it uses the first D devices. For the
bench.py cases (random data of the right shapes, FedAvg, all clients) it prints
seconds per round for:

- `1 device, <auto>`: the plain algorithm, no sharding (reference);
- `D devices, sharded(<auto>)`: pfljax.runtime.sharding.ShardedMap, the binaries' choice
  (`, data replicated`: ClientData on every device instead of sharded);
- `D devices, map` / `D devices, vmap`: state and data sharded, but the plain
  ClientMap strategy, left to XLA's sharding propagation (lax.map over a
  sharded axis runs the devices one after another).

Forced host devices share the machine's cores. With one device per core they
run clients side by side: on a 2-core CPU (under load) `--devices=2
--cases=cnn --clients=10` gave 2.75 s a round sharded against 4.27 s on one
device; the CNN gains, the MLP loses (BUILD.md, "Several devices, several hosts").
"""

from __future__ import annotations

import json
import time

import jax
from absl import app, flags

from experiments.bench import bench
from pfljax.algorithms import fedavg
from pfljax.core.clients import ClientMap
from pfljax.experiment.cli import parse_flags
from pfljax.runtime.sharding import ShardedMap, client_mesh, shard_algorithm, use_cpu_devices

FLAGS = flags.FLAGS  # --cases, --repeats, --json come from experiments.bench.bench
flags.DEFINE_integer("devices", 4, "devices D the client axis is sharded over")


def time_round(run, alg, data, num, repeats: int, replicate: bool = False) -> float:
    state = run.place_state(alg.init(jax.random.key(0), None, num))
    data = run.place_data(data, replicate=replicate)
    key = run.place_key(jax.random.key(1))
    rnd = jax.jit(run.round)
    state, _ = rnd(state, data, key)
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, m = rnd(state, data, key)
        jax.block_until_ready((state, m))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv):
    del argv
    use_cpu_devices(FLAGS.devices)  # before JAX runs anything; only the CPU backend's count
    auto = ClientMap().resolved()
    for name in FLAGS.cases:
        c, model, data, spec = bench.flag_case(name)
        num = c["clients"]
        one, many = client_mesh(1), client_mesh(FLAGS.devices)
        variants = [
            (f"1 device, {auto}", one, ClientMap(), False),
            (f"{many.size} devices, sharded({auto})", many, ShardedMap(many), False),
            (f"{many.size} devices, sharded({auto}), data replicated", many, ShardedMap(many), True),
            (f"{many.size} devices, map", many, ClientMap("map"), False),
            (f"{many.size} devices, vmap", many, ClientMap("vmap"), False),
        ]
        samples = num * c["steps"] * c["batch"]
        for label, mesh, cmap, replicate in variants:
            alg = fedavg.build(model, spec, client_map=cmap)
            run = shard_algorithm(alg, mesh, num)
            seconds = time_round(run, alg, data, num, FLAGS.repeats, replicate)
            row = {
                "case": name,
                "variant": label,
                "round_s": round(seconds, 4),
                "samples_per_s": round(samples / seconds, 1),
                "backend": jax.default_backend(),
            }
            text = json.dumps(row) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in row.items())
            print(text, flush=True)


if __name__ == "__main__":
    bench.define_flags()
    app.run(main, flags_parser=parse_flags)
