"""FedFac round time over FedAvg round time on the same data, model and local training.

    nice -n 10 python -m experiments.bench.bench_fedfac [--cases=cnn,mlp] [--repeats=3] [--method=ipf]

Cases come from `experiments.bench.bench` (random arrays of the right shapes): "cnn" is
the CNN on 28x28x1 (10 clients x 50 steps x batch 32), "mlp" the FedFac
simulation MLP (d=100, m=200, 100 clients x 20 steps x batch 32). For each case
and split layer it times one jitted FedFac round (dynamic mode: a factor
analysis every round, the costly case; and static) against one jitted FedAvg
round, alternating the two so that load changes hit both, and prints the best
wall time and the best CPU time (all threads of the process) of each, and their
ratios (target: <= 1.15). On a shared machine the CPU ratio is the
steadier figure.

OPENBLAS_NUM_THREADS defaults to 1: the factor analysis' eigh runs through
LAPACK/OpenBLAS, whose threads make it ~30x slower on a busy 2-core machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments.bench import bench  # noqa: E402
from pfljax.algorithms import fedavg, fedfac  # noqa: E402
from pfljax.experiment.cli import parse_flags

FLAGS = flags.FLAGS  # --cases, --repeats and --json come from experiments.bench.bench
flags.DEFINE_string("method", "ipf", "factor_split method")

SPLITS = {
    "cnn": [("dense_0", "dynamic"), ("conv_1", "dynamic"), ("conv_0", "dynamic"), ("dense_0", "static")],
    "mlp": [("hidden_0", "dynamic"), ("hidden_0", "static")],
}


def round_runner(alg, data):
    state = alg.init(jax.random.key(0), None, data.train.count.shape[0])
    rnd = jax.jit(alg.round)
    holder = {"state": rnd(state, data, jax.random.key(1))[0], "r": 0}
    jax.block_until_ready(holder["state"])

    def timed() -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process, all threads) of one round."""
        holder["r"] += 1
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = rnd(holder["state"], data, jax.random.key(2 + holder["r"]))
        jax.block_until_ready((state, metrics))
        holder["state"] = state
        return time.perf_counter() - t0, time.process_time() - c0

    return timed


def main(argv):
    del argv
    for name in FLAGS.cases:
        _, model, data, spec = bench.flag_case(name)
        base = round_runner(fedavg.build(model, spec), data)
        for layer, mode in SPLITS[name]:
            alg = fedfac.build(
                model, spec, layers=(layer,), mode=mode, tau_quantile=50.0, method=FLAGS.method
            )
            other = round_runner(alg, data)
            t_avg, t_fac = [], []
            for _ in range(FLAGS.repeats):
                t_avg.append(base())
                t_fac.append(other())
            wall_avg, wall_fac = min(t[0] for t in t_avg), min(t[0] for t in t_fac)
            cpu_avg, cpu_fac = min(t[1] for t in t_avg), min(t[1] for t in t_fac)
            row = {
                "case": name,
                "layer": layer,
                "mode": mode,
                "method": FLAGS.method,
                "fedavg_s": round(wall_avg, 4),
                "fedfac_s": round(wall_fac, 4),
                "ratio": round(wall_fac / wall_avg, 3),
                "fedavg_cpu_s": round(cpu_avg, 4),
                "fedfac_cpu_s": round(cpu_fac, 4),
                "cpu_ratio": round(cpu_fac / cpu_avg, 3),
                "load": round(os.getloadavg()[0], 1),
            }
            print(
                json.dumps(row) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True
            )


if __name__ == "__main__":
    bench.define_flags()
    app.run(main, flags_parser=parse_flags)
