"""The GPU measurements (CASES below) in one command, under 9 minutes on a bare GPU machine.

    python -m experiments.bench.gpu_suite [--out=gpu_suite.jsonl] [--cases=bench,vs_torch,...] [--smoke]

One JSON object per measurement, printed and appended (flushed) to --out, so a run
cut short still leaves its figures. Every row carries `case`, `device` (jax's
device_kind) and `backend`; rows of a goal carry `target` and `met`. A case that
raises leaves one row {"case": ..., "error": "<one line>"} and the suite goes on; a
case past its time budget (BUDGET_S, about 8.5 minutes in all) leaves "skipped" rows
for what it did not run. The cases (CASES; those of a goal run first), each reusing the
bench module named:

- bench (experiments.bench.bench): FedAvg round samples/s, MLP and CNN, 10 / 100 / 1000
  clients (CNN clients hold 320 random rows; 50 local steps of 32), with the Python
  loop of jitted per-client training up to 100 clients and XLA's GFLOP/s;
- vs_torch (experiments.bench.bench_vs_torch): pfljax's round against the PyTorch-library
  loop, both on the same device; goal torch / pfljax >= 10 for the CNN at 100
  clients; one "skipped" row where torch is not installed;
- local_loop: the round with LocalTraining(loop="scan") vs loop="while" (the
  `config.local_loop` option; "auto" is scan on GPU), MLP and CNN, 100 equal clients;
- seeds (experiments.bench.bench_sweep): 1 vs 8 seeds as one program; goal 8 seeds in
  <= 2x the time of one;
- eval_chunk (experiments.bench.bench_eval): one evaluation of PFLlib's FedAvgCNN on the
  `pfllib_fmnist.py:dir` test rows per chunk size (`evaluate_clients(..., chunk=)`);
- pfllib_dir: FedAvg on `pfllib_fmnist.py:dir`, `--pfllib_seeds` (3) seeds as one program
  (pfljax.runtime.replicas, as `--vectorize` runs them): seconds of one jitted round and
  one evaluation (PFLlib evaluates every round), one row per `--pfllib_maps` entry
  "client_map:chunk_size:local_loop" (default auto:0:auto and map:5:while, sorted chunks of 5
  clients, the fastest for several seeds on an H200); goal <= 0.3 s per round (both).

--smoke: tiny sizes everywhere (2-3 clients, one local step, the small MLP only, the
simulation data instead of Fashion-MNIST): the whole suite runs on a CPU in seconds
(tests/test_gpu_suite.py).

On a GPU machine without network access: once, on a machine with network, in the
repository root,
    echo /.whl/ >> .git/info/exclude; echo /.gpudata/ >> .git/info/exclude
    pip download --no-deps -d .whl ml_collections tensorboardX dp-accounting
    cp -r /usr/share/datasets/fashion-mnist .gpudata/
then, with the repository copied to the GPU machine together with .whl and .gpudata, one
command (under 10 minutes):
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl;
    export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false;
    mkdir -p /usr/share/datasets && cp -r .gpudata/fashion-mnist /usr/share/datasets/;
    python3 -m experiments.bench.gpu_suite --out=gpu_suite.jsonl
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from typing import NamedTuple

import jax
from absl import app, flags

from experiments.bench import bench, bench_eval, bench_sweep, bench_vs_torch, timing
from pfljax.core.clients import STRATEGIES
from pfljax.core.evaluate import EVAL_CHUNK
from pfljax.core.local import LOOPS
from pfljax.core.types import Algorithm
from pfljax.experiment import base_config
from pfljax.experiment.cli import fail, parse_flags
from pfljax.experiment.config import make_data, make_model, prepare, resolve
from pfljax.experiment.configs import pfllib_fmnist
from pfljax.runtime import replicas

FLAGS = flags.FLAGS
# Seconds each case may start new measurements for (one already started runs to its end).
BUDGET_S = {"bench": 150, "vs_torch": 90, "local_loop": 45, "seeds": 75, "eval_chunk": 40, "pfllib_dir": 100}


class Plan(NamedTuple):
    """Sizes of one suite run (FULL on a GPU, SMOKE for tests)."""

    clients: tuple  # bench's client counts
    sizes: dict  # per bench case: bench.make_case overrides
    loop_max_clients: int  # bench's Python loop only up to this many clients
    few_clients: int  # local_loop's client count
    models: tuple  # the bench cases of bench, local_loop and seeds
    seed_clients: int  # seeds' client count (0: the bench case's own)
    torch_clients: tuple  # vs_torch's client counts, the goal's first
    torch_opts: bench_vs_torch.Options
    seeds: int  # R of the seeds case (R seeds as one program vs one run)
    chunks: tuple  # eval_chunk's rows per forward pass
    repeats: int
    matmul_n: int  # side of the matmul measuring the peak
    smoke: bool


FULL = Plan(
    clients=(10, 100, 1000),
    sizes={"mlp": {}, "cnn": {"rows": 320}},
    loop_max_clients=100,
    few_clients=100,
    models=("mlp", "cnn"),
    seed_clients=0,
    torch_clients=(100, 10),
    torch_opts=bench_vs_torch.Options(repeats=3),
    seeds=8,
    chunks=(64, 128, 512, 2048),
    repeats=3,
    matmul_n=2048,
    smoke=False,
)
SMOKE = Plan(
    clients=(2,),
    sizes={
        "mlp": {"rows": 8, "steps": 1, "batch": 4, "input_shape": (6,), "hidden": (5,)},
    },
    loop_max_clients=2,
    few_clients=2,
    models=("mlp",),
    seed_clients=2,
    torch_clients=(2,),
    torch_opts=bench_vs_torch.Options(rows=4, repeats=1),
    seeds=2,
    chunks=(4, 16),
    repeats=1,
    matmul_n=128,
    smoke=True,
)


def over(deadline: float) -> bool:
    return time.perf_counter() > deadline


def sig(x: float, digits: int = 4) -> float:
    """x rounded to `digits` significant digits (a tiny smoke time stays above 0)."""
    return float(f"{x:.{digits}g}")


# ---------------------------------------------------------------- the cases


def case_bench(plan: Plan, deadline: float) -> Iterator[dict]:
    """FedAvg round (and Python loop) samples/s, MLP and CNN, per client count."""
    peak = bench.matmul_peak_gflops(plan.matmul_n)
    for name in plan.models:
        for clients in plan.clients:
            if over(deadline):
                yield {"model": name, "clients": clients, "skipped": "time budget"}
                continue
            c, model, data, spec = bench.make_case(name, clients, **plan.sizes[name])
            samples = clients * c["steps"] * c["batch"]
            round_s = bench.bench_round(model, spec, data, "auto", None, plan.repeats)
            flops = bench.step_flops(model, spec, data) * clients * c["steps"]
            row = {"model": name, "clients": clients, "rows": c["rows"], "steps": c["steps"]}
            row |= {"batch": c["batch"], "round_s": sig(round_s)}
            row |= {"round_samples_per_s": sig(samples / round_s)}
            row |= {"gflops": sig(flops / round_s / 1e9), "peak_gflops": sig(peak)}
            if clients <= plan.loop_max_clients:
                loop_s = bench.bench_loop(model, spec, data, plan.repeats)
                row |= {"loop_samples_per_s": sig(samples / loop_s)}
                row |= {"round_over_loop": sig(loop_s / round_s)}
            else:
                row["loop"] = f"not run above {plan.loop_max_clients} clients (time budget)"
            yield row


def case_vs_torch(plan: Plan, deadline: float) -> Iterator[dict]:
    """pfljax's round vs the PyTorch-library loop on the same device (bench_vs_torch.run_case)."""
    if importlib.util.find_spec("torch") is None:
        yield {"skipped": "torch not installed"}
        return
    peaks = {"jax": bench_vs_torch.jax_matmul_peak(plan.matmul_n)}
    peaks["torch"] = bench_vs_torch.torch_matmul_peak(plan.matmul_n)
    for i, clients in enumerate(plan.torch_clients):
        for name in ("cnn", "mlp"):
            if over(deadline):
                yield {"model": name, "clients": clients, "skipped": "time budget"}
                continue
            row = bench_vs_torch.run_case(name, clients, "equal", peaks, plan.torch_opts)
            row = {"model": row.pop("case"), **row, "torch_device": str(bench_vs_torch.torch_device())}
            if i == 0 and name == "cnn":
                ratio = row["torch_over_pfljax"]
                row |= {"target": f"torch / pfljax >= 10 at {clients} clients", "met": ratio >= 10}
            yield row


def case_local_loop(plan: Plan, deadline: float) -> Iterator[dict]:
    """The round with the local loop as lax.scan vs lax.while_loop (LocalTraining.loop)."""
    for name in plan.models:
        if over(deadline):
            yield {"model": name, "skipped": "time budget"}
            continue
        c, model, data, spec = bench.make_case(name, plan.few_clients, **plan.sizes[name])
        secs = {
            loop: bench.bench_round(model, spec._replace(loop=loop), data, "auto", None, plan.repeats)
            for loop in ("scan", "while")
        }
        yield {
            "model": name, "clients": c["clients"], "steps": c["steps"], "batch": c["batch"],
            "client_sizes": "equal", "round_s_scan": sig(secs["scan"]),
            "round_s_while": sig(secs["while"]), "while_over_scan": sig(secs["while"] / secs["scan"]),
            "auto_is": spec.resolved_loop(),
        }  # fmt: skip


def case_seeds(plan: Plan, deadline: float) -> Iterator[dict]:
    """R seeds as one program vs one seed (bench_sweep.run_case); goal R=8 in <= 2x one."""
    strategy = replicas.resolve_strategy("auto")
    for name in plan.models:
        if over(deadline):
            yield {"model": name, "skipped": "time budget"}
            continue
        sizes = dict(plan.sizes[name], clients=plan.seed_clients)
        (row,) = bench_sweep.run_case(name, [plan.seeds], plan.repeats, strategy, **sizes)
        ratio = row["replicas_over_one"]
        yield {"model": row.pop("case"), **row, "target": f"{plan.seeds} seeds <= 2x one", "met": ratio <= 2}


def smoke_config():
    """A seconds-long stand-in for pfllib_fmnist.py:dir: simulation data, 3 clients, small MLP."""
    config = base_config()
    config.dataset, config.partition, config.samples_per_client = "simulation", "iid", 0
    config.source.samples_per_client, config.source.d, config.source.m = 16, 6, 4
    config.num_clients, config.batch_size, config.local_steps = 3, 4, 1
    config.model_kwargs.hidden = (8,)
    return config


def dir_config(plan: Plan):
    return smoke_config() if plan.smoke else pfllib_fmnist.get_config("dir")


def case_eval_chunk(plan: Plan, deadline: float) -> Iterator[dict]:
    """One evaluation of the pfllib :dir model per chunk size (bench_eval.time_chunks)."""
    del deadline  # one measurement
    config, _ = resolve(dir_config(plan))
    fed = make_data(config)
    rows = bench_eval.time_chunks(make_model(config, fed), fed.data.test, list(plan.chunks), plan.repeats)
    default = next((r["median_s"] for r in rows if r["eval_chunk"] == EVAL_CHUNK), None)
    for row in rows:
        row |= {"dataset": config.dataset, "default_chunk": EVAL_CHUNK}
        if default:
            row["over_default"] = sig(row["median_s"] / default)
        yield row


def seeds_algorithm(alg: Algorithm, count: int) -> Algorithm:
    """`count` seeds of `alg` (replicas.replicate, strategy auto) as one Algorithm whose
    keys are split into one per seed, so that timing.time_round can time it."""
    reps = replicas.replicate(alg, count, "auto")

    def keys(k):
        return jax.random.split(k, count)

    return Algorithm(
        init=lambda k, template, num: reps.init(keys(k), template, num),
        round=lambda s, data, k: reps.round(s, data, keys(k)),
        evaluate=lambda s, data, k: reps.evaluate(s, data, keys(k)),
    )


def best_seconds(fn, args: tuple, repeats: int) -> float:
    """Best of `repeats` timed calls of `fn(*args)` after a warm one."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def case_pfllib_dir(plan: Plan, deadline: float) -> Iterator[dict]:
    """FedAvg on pfllib :dir, `--pfllib_seeds` seeds as one program: seconds of a round and an
    evaluation, for each `--pfllib_maps` entry "client_map:chunk_size:local_loop" (the config
    options; sorted chunks with a while loop skip most of the padded steps of unequal clients)."""
    for spec in FLAGS.pfllib_maps:
        if over(deadline):
            yield {"map": spec, "skipped": "time budget"}
            continue
        strategy, chunk, loop = spec.split(":")
        config = dir_config(plan)
        config.algorithm = "fedavg"
        config.client_map, config.chunk_size, config.local_loop = strategy, int(chunk), loop
        yield {"map": spec, **time_seeds_round(config, FLAGS.pfllib_seeds, plan.repeats)}


def time_seeds_round(config, seeds: int, repeats: int) -> dict:
    """Seconds of one jitted round and one evaluation of `seeds` seeds of `config` as one program."""
    prep = prepare(config)
    data = prep.fed_data.data
    alg = seeds_algorithm(prep.algorithm, seeds)
    timed = timing.time_round(alg, data, repeats)
    state, key = timed["state"], jax.random.key(0)
    evaluate = jax.jit(alg.evaluate).lower(state, data, key).compile()
    eval_s = best_seconds(evaluate, (state, data, key), repeats)
    per_round = timed["round_s"] + eval_s
    return {
        "dataset": config.dataset, "clients": int(data.train.count.shape[0]), "seeds": seeds,
        "strategy": replicas.resolve_strategy("auto"), "compile_s": sig(timed["compile_s"]),
        "train_s": sig(timed["round_s"]), "eval_s": sig(eval_s), "s_per_round": sig(per_round),
        "rounds_per_s": sig(1 / per_round), "target": f"<= 0.3 s per round for {seeds} seeds",
        "met": per_round <= 0.3,
    }  # fmt: skip


# The cases of a goal first: a run cut short has them.
CASES = {
    "pfllib_dir": case_pfllib_dir,
    "vs_torch": case_vs_torch,
    "seeds": case_seeds,
    "bench": case_bench,
    "local_loop": case_local_loop,
    "eval_chunk": case_eval_chunk,
}


# ---------------------------------------------------------------- the driver


def emit(path: str, row: dict) -> None:
    """Prints `row` as one JSON line and appends it to `path`, both flushed."""
    line = json.dumps(row)
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:300]


def run_case(name: str, plan: Plan, path: str) -> None:
    """Emits case `name`'s rows (tagged with case and device) or, if it raises, an error row."""
    device = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend()}
    t0 = time.perf_counter()
    try:
        for row in CASES[name](plan, t0 + BUDGET_S[name]):
            emit(path, {"case": name, **row, **device})
    except Exception as e:  # noqa: BLE001  the suite goes on
        emit(path, {"case": name, "error": one_line(e), **device})
    emit(path, {"case": name, "case_s": sig(time.perf_counter() - t0), **device})


def valid_map(spec: str) -> bool:
    """Whether `spec` is "client_map:chunk_size:local_loop" with known values."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    return parts[0] in STRATEGIES and parts[2] in LOOPS


def main(argv):
    del argv
    unknown = [c for c in FLAGS.cases if c not in CASES]
    if unknown:
        raise app.UsageError(f"unknown cases {unknown}; known: {list(CASES)}")
    bad = [spec for spec in FLAGS.pfllib_maps if not valid_map(spec)]
    if bad:
        fail(
            f"--pfllib_maps entries must be client_map:chunk_size:local_loop with client_map in "
            f"{STRATEGIES}, chunk_size an integer >= 0, local_loop in {LOOPS}; got {bad}"
        )
    plan = SMOKE if FLAGS.smoke else FULL
    t0 = time.perf_counter()
    emit(
        FLAGS.out,
        {"case": "suite", "smoke": plan.smoke, "jax": jax.__version__, "devices": str(jax.devices())},
    )
    for name in FLAGS.cases:
        run_case(name, plan, FLAGS.out)
    emit(FLAGS.out, {"case": "suite", "total_s": sig(time.perf_counter() - t0)})


def define_flags():
    """The binary's flags, defined only when it runs (a test may import the module)."""
    flags.DEFINE_list("cases", list(CASES), f"cases to run, among {list(CASES)}")
    flags.DEFINE_string("out", "gpu_suite.jsonl", "JSON lines file the rows are appended to")
    flags.DEFINE_bool("smoke", False, "tiny sizes everywhere (a CPU test of the suite)")
    flags.DEFINE_list(
        "pfllib_maps",
        ["auto:0:auto", "map:5:while"],
        "pfllib_dir: client_map:chunk_size:local_loop entries, e.g. map:5:while (sorted chunks of 5)",
    )
    flags.DEFINE_integer("pfllib_seeds", 3, "pfllib_dir: seeds as one program")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
