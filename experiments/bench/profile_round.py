"""Where a FedAvg round's time goes: a jax.profiler trace, summed per operation.

    python -m experiments.bench.profile_round --case=cnn [--clients=100] [--seeds=1]
        [--rows=0] [--steps=0] [--client_map=auto] [--chunk_size=0] [--local_loop=auto] [--conv_impl=auto]
        [--rounds=2] [--top=20] [--trace_dir=/tmp/profile_round]
    python -m experiments.bench.profile_round --case=pfllib_dir --seeds=3 [...]

`--case`: a bench case (experiments/bench/bench.py CASES: random data, equal clients) or
`pfllib_dir` (FedAvg on `pfllib_fmnist.py:dir`, Fashion-MNIST). The round is compiled
and run once, then `--rounds` rounds run under `jax.profiler.trace` with a Perfetto
trace, which is read back (plain JSON, no profiler plugin needed): one JSON line per
trace process (e.g. a GPU stream, the host's XLA threads) with its busy seconds, then
its `--top` events by total duration (name, count, seconds, share of the process).
On a GPU the device's kernels are their own process; on CPU only the host's calls are
traced unless XLA traces every operation: `XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true`
(names as in the optimized HLO, `--xla_dump_to=DIR --xla_dump_hlo_as_text`).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import time

import jax
from absl import app, flags

from experiments.bench import bench, timing
from experiments.bench.gpu_suite import seeds_algorithm
from pfljax.algorithms import fedavg
from pfljax.core.clients import STRATEGIES, ClientMap
from pfljax.core.local import LOOPS, LocalTraining
from pfljax.experiment.cli import fail, parse_flags
from pfljax.experiment.config import prepare
from pfljax.experiment.configs import pfllib_fmnist
from pfljax.models.conv import IMPLS, ONEDNN_MISSING, runs_here

FLAGS = flags.FLAGS


def build(case: str, clients: int, client_map: ClientMap, loop: str, conv_impl: str, sizes: dict):
    """(Algorithm, ClientData) of FedAvg on `case`."""
    if case == "pfllib_dir":
        config = pfllib_fmnist.get_config("dir")
        config.client_map, config.chunk_size = client_map.strategy, client_map.chunk_size or 0
        config.local_loop = loop
        prep = prepare(config)
        return prep.algorithm, prep.fed_data.data
    _, model, data, spec = bench.make_case(case, clients, conv_impl, **sizes)
    spec = spec._replace(loop=loop)
    assert isinstance(spec, LocalTraining)
    return fedavg.build(model, spec, client_map=client_map), data


def summarize(trace_dir: str, top: int) -> list[dict]:
    """Per trace process: busy seconds and the `top` event names by summed duration."""
    paths = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(max(paths), "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    per = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            row = per[names.get(e["pid"], str(e["pid"]))][e.get("name", "?")]
            row[0] += 1
            row[1] += e["dur"] * 1e-6
    rows = []
    for process, ops in per.items():
        busy = sum(s for _, s in ops.values())
        ranked = sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]
        rows.append(
            {
                "process": process,
                "events_s": round(busy, 6),
                "top": [
                    {"name": name[:120], "count": n, "s": round(s, 6), "share": round(s / busy, 4)}
                    for name, (n, s) in ranked
                ],
            }
        )
    return sorted(rows, key=lambda r: -r["events_s"])


def check_flags() -> None:
    """One line naming the flag and its allowed values (exit 2) before anything runs."""
    cases = sorted(bench.CASES) + ["pfllib_dir"]
    choices = {"case": cases, "client_map": STRATEGIES, "local_loop": LOOPS, "conv_impl": IMPLS}
    for name, allowed in choices.items():
        if FLAGS[name].value not in allowed:
            fail(f"--{name} must be one of {list(allowed)}, got {FLAGS[name].value!r}")
    if not runs_here(FLAGS.conv_impl):
        fail(ONEDNN_MISSING)
    for name, low in (
        ("clients", 0),
        ("rows", 0),
        ("steps", 0),
        ("chunk_size", 0),
        ("seeds", 1),
        ("rounds", 1),
        ("top", 1),
    ):
        if FLAGS[name].value < low:
            fail(f"--{name} must be an integer >= {low}, got {FLAGS[name].value}")


def main(argv):
    del argv
    check_flags()
    client_map = ClientMap(FLAGS.client_map, FLAGS.chunk_size or None)
    sizes = {k: v for k, v in (("rows", FLAGS.rows), ("steps", FLAGS.steps)) if v}
    alg, data = build(FLAGS.case, FLAGS.clients, client_map, FLAGS.local_loop, FLAGS.conv_impl, sizes)
    if FLAGS.seeds > 1:
        alg = seeds_algorithm(alg, FLAGS.seeds)
    res = timing.compile_round(alg, data)
    t0 = time.perf_counter()
    with jax.profiler.trace(FLAGS.trace_dir, create_perfetto_trace=True):
        times = [timing.run_timed(res, data, jax.random.key(2 + r)) for r in range(FLAGS.rounds)]
    wall = time.perf_counter() - t0
    head = {"case": FLAGS.case, "clients": int(data.train.count.shape[0]), "seeds": FLAGS.seeds}
    head |= {"client_map": FLAGS.client_map, "chunk_size": FLAGS.chunk_size, "local_loop": FLAGS.local_loop}
    head |= {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
    head |= {"round_s": [round(t, 5) for t in times], "traced_wall_s": round(wall, 4)}
    print(json.dumps(head), flush=True)
    for row in summarize(FLAGS.trace_dir, FLAGS.top):
        print(json.dumps(row), flush=True)


def define_flags():
    flags.DEFINE_string("case", "cnn", "a bench case (experiments/bench/bench.py) or pfllib_dir")
    flags.DEFINE_integer("clients", 0, "bench case: clients (0: the case's own)")
    flags.DEFINE_integer("rows", 0, "bench case: rows per client (0: the case's own)")
    flags.DEFINE_integer("steps", 0, "bench case: local steps (0: the case's own)")
    flags.DEFINE_integer("seeds", 1, "seeds as one program (replicas)")
    flags.DEFINE_string("client_map", "auto", "auto, vmap, map")
    flags.DEFINE_integer("chunk_size", 0, "map: clients per vmapped chunk (0: none)")
    flags.DEFINE_string("local_loop", "auto", "auto, scan, while")
    flags.DEFINE_string("conv_impl", "auto", f"bench case: {', '.join(IMPLS)}")
    flags.DEFINE_integer("rounds", 2, "rounds traced")
    flags.DEFINE_integer("top", 20, "events listed per trace process")
    flags.DEFINE_string("trace_dir", "/tmp/profile_round", "where the trace is written")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
