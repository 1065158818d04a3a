"""Replicas (seeds) as one program vs separate runs: wall time of one FedAvg round.

    python -m experiments.bench.bench_sweep [--cases=mlp,cnn] [--replicas=1,4,8] [--repeats=5]
        [--clients=N] [--steps=S] [--strategy=vmap|map]

For each case of `experiments.bench.bench` (the same models, data shapes and local
schedule; --clients / --steps shrink them) and each R it times, interleaved
(R separate, then R as one, repeated --repeats times):
- `separate_s`: R rounds of the single run's jitted round, one after another
  (R separate runs sharing one compiled program: a lower bound on R processes);
- `replicas_s`: one round of `pfljax.runtime.replicas.replicate(alg, R, strategy)`,
  jitted (R states, the client data shared; `--strategy=map`: lax.map over R);
and prints one JSON line per (case, R) with the medians, their ratio
(`speedup` = separate / replicas; `replicas_over_one` = replicas_s over R=1's
single-run round), the compile seconds of the R program, the machine's
1-minute load average before and after, and the backend. On a CPU that the
single run already keeps busy, R replicas cost about R x one run; the goal on
an accelerator is 8 replicas in at most 2x one run.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
from absl import app, flags

from experiments.bench import bench
from pfljax.algorithms import fedavg
from pfljax.experiment.cli import parse_flags
from pfljax.runtime import replicas

FLAGS = flags.FLAGS


def define_flags():
    """experiments.bench.bench's flags and this binary's, defined only when it runs."""
    bench.define_flags()
    flags.DEFINE_list("replicas", ["1", "4", "8"], "replica counts R")
    flags.DEFINE_integer("steps", 0, "local steps per round (0: the case's own)")
    flags.DEFINE_enum(
        "strategy", "vmap", ["vmap", "map"], "how the replicas are mapped (pfljax.runtime.replicas)"
    )


def _block_time(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def run_case(name: str, counts: list[int], repeats: int, strategy: str = "vmap", **case) -> list[dict]:
    """One row per R in `counts` for bench.make_case(name, **case), replicas mapped by `strategy`."""
    c, model, data, spec = bench.make_case(name, **case)
    num = c["clients"]
    alg = fedavg.build(model, spec)
    one_round = jax.jit(alg.round)
    keys = jax.random.split(jax.random.key(0), max(counts))
    singles = [alg.init(k, None, num) for k in keys]
    jax.block_until_ready(one_round(singles[0], data, keys[0]))  # compile the single run's round

    progs = {}
    for r in counts:
        reps = replicas.replicate(alg, r, strategy)
        states = reps.init(keys[:r], None, num)
        t0 = time.perf_counter()
        fn = jax.jit(reps.round).lower(states, data, keys[:r]).compile()
        progs[r] = (fn, states, time.perf_counter() - t0)
        jax.block_until_ready(fn(states, data, keys[:r]))  # warm

    load0 = os.getloadavg()[0]
    times = {r: {"separate": [], "replicas": []} for r in counts}
    one = []
    for _ in range(repeats):  # interleaved, so load changes hit every variant alike
        one.append(_block_time(lambda: one_round(singles[0], data, keys[0])))
        for r in counts:
            times[r]["separate"].append(
                _block_time(lambda r=r: [one_round(singles[i], data, keys[i]) for i in range(r)])
            )
            fn, states, _ = progs[r]
            times[r]["replicas"].append(
                _block_time(lambda fn=fn, states=states, r=r: fn(states, data, keys[:r]))
            )
    load1 = os.getloadavg()[0]
    one_s = statistics.median(one)
    rows = []
    for r in counts:
        sep, rep = statistics.median(times[r]["separate"]), statistics.median(times[r]["replicas"])
        rows.append(
            {
                "case": name,
                "clients": num,
                "steps": c["steps"],
                "batch": c["batch"],
                "replicas": r,
                "strategy": strategy,
                "one_run_s": round(one_s, 4),
                "separate_s": round(sep, 4),
                "replicas_s": round(rep, 4),
                "speedup": round(sep / rep, 2),
                "replicas_over_one": round(rep / one_s, 2),
                "compile_s": round(progs[r][2], 2),
                "repeats": repeats,
                "load_1min_before": round(load0, 2),
                "load_1min_after": round(load1, 2),
                "cpus": os.cpu_count(),
                "backend": jax.default_backend(),
                "device": str(jax.devices()[0].device_kind),
            }
        )
    return rows


def main(argv):
    del argv
    counts = [int(r) for r in FLAGS.replicas]
    if any(r < 1 for r in counts):
        raise app.UsageError(f"--replicas must be integers >= 1, got {FLAGS.replicas}")
    for name in FLAGS.cases:
        if name not in bench.CASES:
            raise app.UsageError(f"--cases must be among {sorted(bench.CASES)}, got {name!r}")
        steps = {"steps": FLAGS.steps} if FLAGS.steps else {}
        case = dict(clients=FLAGS.clients, conv_impl=FLAGS.conv_impl, **steps)
        for row in run_case(name, counts, FLAGS.repeats, FLAGS.strategy, **case):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    define_flags()
    FLAGS.set_default("repeats", 5)
    app.run(main, flags_parser=parse_flags)
