"""Scaling: round cost that follows the clients' real data, bytes of client data, many clients.

    python -m experiments.bench.bench_scale [--json] [--cases=a,b,c,d,million] [--repeats=2]
        [--clients_a=20,100] [--clients_c=10,100,1000,10000]
        [--million_clients=1000000] [--million_compare=10000] [--million_rounds=20]

One JSON line per measurement, each with its case, its target and whether it
is met. "before" is the layout and loop the library used until the ClientPool:
zero-padded float32 [C, n_max, ...] arrays (`ClientPool.padded()`) and the
masked local scan of n_max's step count (`loop="scan"`); "after" is the
ClientPool (rows once, uint8 images) and the library's default loop ("auto":
each client runs only its own steps on CPU). Both run in the same process.

- (a) Fashion-MNIST, the CNN, FedAvg, 1 local epoch, batch 32, every client
  every round: Dirichlet(0.1) vs IID over the same samples, at 20 and 100
  clients; target round-time ratio Dirichlet / IID <= 1.25.
- (b) device bytes of the client data (train + test) against the raw data set
  (uint8 images and int32 labels of every sample); target <= 1.1x.
- (c) the FedFac simulation's MLP (d=100, 200 hidden, 2 classes; 400 train and
  100 test rows per client, random values of the right shapes), FedAvg, 1
  local epoch, batch 32, at C clients all participating and K=100 of C:
  seconds per round, data and state bytes per client, the largest C that fits
  (memory_report); target: time per client at the largest C within 1.5x of C=100.
- (d) FedeRiCo (3 neighbours) and pFedLA against FedAvg at 100 clients (the
  MLP of (c), 5 local steps): round-time ratios, targets <= 5x and <= 1.5x, and
  the ratio to FedAvg with 4x the steps (the (neighbours + 1) gradients per
  step FedeRiCo cannot avoid).
- (million) clients beyond device memory (pfljax.runtime.offload): FedPer (a personal
  head per client: per-client state of O(parameters)), an MLP (32 inputs, 32 hidden,
  10 classes), 20 train and 5 test rows per client (uint8 codes, synthetic), 100
  clients per round, 1 local epoch of batch 10: 1,000,000 clients in host memory
  against 10,000 clients all on the device, at the same clients per round; blocks of
  10 rounds, no evaluation in the timed blocks (one full evaluation timed apart).
  Rounds/s, host bytes (the clients' rows and the process's peak RSS) and peak
  device bytes (accelerators: the device's peak_bytes_in_use; CPU: the live device
  arrays at the pipeline's fullest, after a round's dispatch and the next round's
  prefetch, plus the compiled round's temporaries). Target: the 1,000,000-client
  round within 2x the 10,000-client one. Also 10,000 clients in host memory (the
  offload's own cost at the same C) and each size's sampling time. The last JSON
  line has `case` "million", `million_over_10k` (round time ratio) and
  `peak_device_bytes` of both sizes.
"""

from __future__ import annotations

import json
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from experiments.bench.timing import time_round
from pfljax.algorithms import fedavg, federico, fedper, pfedla
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.core.types import ClientData, ClientPool
from pfljax.data import build_federated_data, pool_clients
from pfljax.experiment.cli import parse_flags
from pfljax.models import build_model
from pfljax.runtime.blocks import all_finite, make_block
from pfljax.runtime.memory import device_memory_bytes, host_memory_report, max_clients, memory_report
from pfljax.runtime.offload import HostBlock, Offload, gather_data

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "print one JSON object per line (else a readable line)")
flags.DEFINE_list("cases", ["a", "b", "c", "d"], "cases to run: a, b, c, d")
flags.DEFINE_integer("repeats", 2, "timed rounds after the compiled first one (best is reported)")
flags.DEFINE_list("clients_a", ["20", "100"], "numbers of clients of cases (a) and (b)")
flags.DEFINE_list("clients_c", ["10", "100", "1000", "10000"], "numbers of clients of case (c)")
flags.DEFINE_integer("per_round_c", 100, "K of case (c)'s partial-participation rows")
flags.DEFINE_integer("million_clients", 1_000_000, "clients of case (million) kept in host memory")
flags.DEFINE_integer("million_compare", 10_000, "clients of case (million)'s all-on-device comparison")
flags.DEFINE_integer("million_per_round", 100, "clients per round of case (million)")
flags.DEFINE_integer("million_rounds", 20, "timed rounds of case (million), per size (blocks of 10)")

GiB = 2**30
SGD = optax.sgd(0.01)


def emit(row: dict) -> None:
    print(json.dumps(row) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def fmnist_layouts(num: int, partition: str):
    fed = build_federated_data("fashion_mnist", num, partition=partition, dirichlet_alpha=0.1, seed=0)
    padded = ClientData(fed.data.train.padded(), fed.data.test.padded())
    return fed, padded


def raw_bytes(fed) -> int:
    """uint8 images and int32 labels of every sample of the federated data."""
    samples = fed.summary["totals"]["train"] + fed.summary["totals"]["test"]
    return samples * (int(np.prod(fed.input_shape)) + 4)


def case_a_b(repeats: int) -> None:
    model = build_model("cnn", (28, 28, 1), 10)
    for num in (int(c) for c in FLAGS.clients_a):
        times = {}
        for partition in ("iid", "dirichlet"):
            fed, padded = fmnist_layouts(num, partition)
            counts = np.asarray(fed.data.train.count)
            raw = raw_bytes(fed)
            for layout, data, loop in (("before", padded, "scan"), ("after", fed.data, "auto")):
                spec = LocalTraining(SGD, batch_size=32, epochs=1, loop=loop)
                res = time_round(fedavg.build(model, spec), data, repeats)
                times[(partition, layout)] = res["round_s"]
                if "b" in FLAGS.cases:
                    emit(
                        {
                            "case": "b",
                            "clients": num,
                            "partition": partition,
                            "layout": layout,
                            "data_MiB": round(tree_bytes(data) / 2**20, 1),
                            "raw_MiB": round(raw / 2**20, 1),
                            "ratio": round(tree_bytes(data) / raw, 3),
                            "target": "<= 1.1",
                            "met": tree_bytes(data) / raw <= 1.1,
                        }
                    )
                emit(
                    {
                        "case": "a",
                        "clients": num,
                        "partition": partition,
                        "layout": layout,
                        "train_samples": int(counts.sum()),
                        "n_max": int(counts.max()),
                        "n_max_over_mean": round(float(counts.max() / counts.mean()), 2),
                        "round_s": round(res["round_s"], 3),
                        "compile_s": round(res["compile_s"], 1),
                    }
                )
        for layout in ("before", "after"):
            ratio = times[("dirichlet", layout)] / times[("iid", layout)]
            emit(
                {
                    "case": "a",
                    "clients": num,
                    "layout": layout,
                    "dirichlet_over_iid": round(ratio, 2),
                    "target": "<= 1.25",
                    "met": ratio <= 1.25,
                }
            )


def mlp_data(num: int, train_rows: int = 400, test_rows: int = 100, dim: int = 100) -> ClientData:
    rng = np.random.default_rng(0)

    def split(rows):
        x = rng.normal(size=(num, rows, dim)).astype(np.float32)
        y = rng.integers(0, 2, size=(num, rows)).astype(np.int32)
        return pool_clients(list(x), list(y))

    return ClientData(split(train_rows), split(test_rows))


def mlp_model():
    return build_model("mlp", (100,), 2, hidden=(200,))


def case_c(repeats: int) -> None:
    model, spec = mlp_model(), LocalTraining(SGD, batch_size=32, epochs=1)
    per_client, largest = {}, None
    for num in (int(c) for c in FLAGS.clients_c):
        data = mlp_data(num)
        for k in sorted({num, min(FLAGS.per_round_c, num)}, reverse=True):
            res = time_round(fedavg.build(model, spec, clients_per_round=k), data, repeats)
            mem = res["memory"]
            row = {
                "case": "c",
                "clients": num,
                "per_round": k,
                "round_s": round(res["round_s"], 4),
                "s_per_participant": res["round_s"] / k,
                "compile_s": round(res["compile_s"], 1),
                "data_bytes_per_client": mem["data_bytes"] // num,
                "state_bytes_per_client": mem["client_state_bytes_per_client"],
                "round_temp_MiB": round(mem.get("round_temp_bytes", 0) / 2**20, 1),
                "max_clients_available": mem.get("max_clients"),
                "max_clients_24GiB": max_clients(mem, 24 * GiB),
            }
            emit(row)
            if k == num:
                per_client[num], largest = res["round_s"] / num, num
        del data
    if 100 in per_client and largest:
        ratio = per_client[largest] / per_client[100]
        emit(
            {
                "case": "c",
                "time_per_client_ratio": f"C={largest} / C=100",
                "ratio": round(ratio, 2),
                "target": "<= 1.5",
                "met": ratio <= 1.5,
                "available_GiB": round((device_memory_bytes() or 0) / GiB, 1),
            }
        )


def case_d(repeats: int) -> None:
    model, num, steps = mlp_model(), 100, 5
    data = mlp_data(num)
    spec = LocalTraining(SGD, batch_size=32, steps=steps)
    adam = LocalTraining(optax.adam(1e-3), batch_size=32, steps=steps)
    base = time_round(fedavg.build(model, spec), data, repeats)["round_s"]
    emit(
        {"case": "d", "algorithm": "fedavg", "clients": num, "local_steps": steps, "round_s": round(base, 4)}
    )
    # The work FedeRiCo cannot avoid: (neighbours + 1) gradients per step, as FedAvg with 4x the steps.
    work = time_round(fedavg.build(model, spec._replace(steps=4 * steps)), data, repeats)["round_s"]
    emit({"case": "d", "algorithm": "fedavg, 4x steps", "clients": num, "round_s": round(work, 4)})
    for name, alg, target in (
        ("federico", federico.build(model, adam, neighbours=3), 5.0),
        ("pfedla", pfedla.build(model, spec), 1.5),
    ):
        res = time_round(alg, data, repeats)
        ratio = res["round_s"] / base
        emit(
            {
                "case": "d",
                "algorithm": name,
                "clients": num,
                "round_s": round(res["round_s"], 4),
                "over_fedavg": round(ratio, 2),
                "target": f"<= {target}",
                "met": ratio <= target,
                "over_fedavg_4x_steps": round(res["round_s"] / work, 2),
                "round_temp_MiB": round(res["memory"].get("round_temp_bytes", 0) / 2**20, 1),
            }
        )


MILLION_DIM, MILLION_CLASSES, MILLION_TRAIN, MILLION_TEST, MILLION_BLOCK = 32, 10, 20, 5, 10


def synthetic_pool(num: int, rows: int, seed: int) -> ClientPool:
    """`rows` rows per client of uint8 codes (a 256-level table in [-1, 1]), labels the
    largest of the first 10 features: a learnable task, built without per-client lists."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (num * rows, MILLION_DIM), dtype=np.uint8)
    y = np.argmax(x[:, :MILLION_CLASSES], axis=1).astype(np.int32)
    offset = np.arange(num, dtype=np.int32) * rows
    count = np.full(num, rows, np.int32)
    levels = np.linspace(-1.0, 1.0, 256, dtype=np.float32)
    return ClientPool(x, y, offset, count, levels, n_max=rows)


def million_algorithm():
    model = build_model("mlp", (MILLION_DIM,), MILLION_CLASSES, hidden=(32,))
    spec = LocalTraining(optax.sgd(0.05), batch_size=10, epochs=1)
    return fedper.build(model, spec, clients_per_round=FLAGS.million_per_round)


def live_device_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_peak(fallback: int) -> int:
    """The device's peak_bytes_in_use where it reports one (accelerators), else `fallback`."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats.get("peak_bytes_in_use", fallback))


class ProbedOffload(Offload):
    """Offload that records the live device bytes after each prefetch: the pipeline's
    fullest point (a round running, the next round's data on the device)."""

    peak = 0

    def prefetch(self, ids):
        out = super().prefetch(ids)
        self.peak = max(self.peak, live_device_bytes())
        return out


def million_on_device(num: int, rounds: int) -> dict:
    alg = million_algorithm()
    data = jax.device_put(
        ClientData(synthetic_pool(num, MILLION_TRAIN, 0), synthetic_pool(num, MILLION_TEST, 1))
    )
    state = jax.device_put(alg.init(jax.random.key(0), None, num))
    key, eval_key = jax.random.key(1), jax.random.key(2)

    def evaluate_at(s, d, k, r):
        return alg.evaluate(s, d, jax.random.fold_in(k, r))

    block = jax.jit(make_block(alg.round, evaluate_at, all_finite, MILLION_BLOCK), donate_argnums=0)
    never = 10**9  # no evaluation in the timed blocks
    schedule = lambda r: jnp.array([r, r + MILLION_BLOCK, never, never], jnp.int32)  # noqa: E731
    t0 = time.perf_counter()
    compiled = block.lower(state, data, key, eval_key, schedule(0)).compile()
    compile_s = time.perf_counter() - t0
    state, _ = compiled(state, data, key, eval_key, schedule(0))  # warm
    jax.block_until_ready(state)
    live = live_device_bytes()
    t0 = time.perf_counter()
    for r in range(MILLION_BLOCK, MILLION_BLOCK + rounds, MILLION_BLOCK):
        state, out = compiled(state, data, key, eval_key, schedule(r))
        live = max(live, live_device_bytes())
        jax.device_get(out)
    round_s = (time.perf_counter() - t0) / rounds
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(alg.evaluate)(state, data, eval_key))
    eval_s = time.perf_counter() - t0
    memory = memory_report(state, data, compiled)
    temp = memory.get("round_temp_bytes", 0)
    return {
        "clients": num,
        "storage": "device",
        "round_s": round_s,
        "rounds_per_s": 1 / round_s,
        "compile_s": compile_s,
        "eval_all_s": eval_s,
        "host_bytes": 0,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": device_peak(live + temp),
        "estimated_device_bytes": memory["estimated_bytes"],
    }


def million_on_host(num: int, rounds: int) -> dict:
    alg = million_algorithm()
    t0 = time.perf_counter()
    data = ClientData(synthetic_pool(num, MILLION_TRAIN, 0), synthetic_pool(num, MILLION_TEST, 1))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        state = jax.device_get(alg.init(jax.random.key(0), None, num))
    offload = ProbedOffload(alg, data, FLAGS.million_per_round, state)
    hs = offload.from_state(state)
    del state
    build_s = time.perf_counter() - t0
    key, eval_key = jax.device_put(jax.random.key(1)), jax.device_put(jax.random.key(2))
    never = 10**9
    t0 = time.perf_counter()
    lowered = HostBlock(offload, MILLION_BLOCK, None).lower(hs, None, key, eval_key, None)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    hs, _ = compiled(hs, None, key, eval_key, np.array([0, MILLION_BLOCK, never, never]))  # warm
    offload.peak = 0
    t0 = time.perf_counter()
    for r in range(MILLION_BLOCK, MILLION_BLOCK + rounds, MILLION_BLOCK):
        hs, _ = compiled(hs, None, key, eval_key, np.array([r, r + MILLION_BLOCK, never, never]))
    round_s = (time.perf_counter() - t0) / rounds
    rounds_peak, offload.peak = offload.peak, 0
    t0 = time.perf_counter()
    offload.evaluate(hs, eval_key)
    eval_s = time.perf_counter() - t0
    ids = np.arange(offload.k)
    view = (offload.view(hs, ids), gather_data(offload.data, ids))
    memory = host_memory_report(offload.data, hs.rows, *view, compiled)
    temp = memory.get("round_temp_bytes", 0)
    return {
        "clients": num,
        "storage": "host",
        "round_s": round_s,
        "rounds_per_s": 1 / round_s,
        "compile_s": compile_s,
        "build_s": build_s,
        "eval_all_s": eval_s,
        "host_bytes": memory["host_bytes"],
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": device_peak(rounds_peak + temp),
        "eval_live_device_bytes": offload.peak,
        "estimated_device_bytes": memory["estimated_bytes"],
    }


def sample_ms(num: int, k: int, repeats: int = 5) -> float:
    """Milliseconds of one round's sampling of k of num clients (`sample_clients`, jitted):
    a permutation of num up to FLOYD_MIN_CLIENTS, Floyd's algorithm above."""
    fn = jax.jit(sample_clients, static_argnums=(1, 2))
    jax.block_until_ready(fn(jax.random.key(0), num, k))
    t0 = time.perf_counter()
    for r in range(repeats):
        jax.block_until_ready(fn(jax.random.key(r + 1), num, k))
    return (time.perf_counter() - t0) / repeats * 1e3


def case_million() -> None:
    rounds = max(MILLION_BLOCK, FLAGS.million_rounds // MILLION_BLOCK * MILLION_BLOCK)
    small = million_on_device(FLAGS.million_compare, rounds)  # first: its peak RSS is its own
    small["sample_ms"] = sample_ms(FLAGS.million_compare, FLAGS.million_per_round)
    emit({"case": "million", **{k: round(v, 4) if isinstance(v, float) else v for k, v in small.items()}})
    same = million_on_host(FLAGS.million_compare, rounds)  # the offload's own cost at the same C
    emit({"case": "million", **{k: round(v, 4) if isinstance(v, float) else v for k, v in same.items()}})
    big = million_on_host(FLAGS.million_clients, rounds)
    big["sample_ms"] = sample_ms(FLAGS.million_clients, FLAGS.million_per_round)
    emit({"case": "million", **{k: round(v, 4) if isinstance(v, float) else v for k, v in big.items()}})
    ratio = big["round_s"] / small["round_s"]
    emit(
        {
            "case": "million",
            "million_over_10k": round(ratio, 3),
            "target": "<= 2",
            "met": ratio <= 2,
            "clients": [small["clients"], big["clients"]],
            "per_round": FLAGS.million_per_round,
            "rounds_per_s": [round(small["rounds_per_s"], 2), round(big["rounds_per_s"], 2)],
            "sample_ms": [round(small["sample_ms"], 2), round(big["sample_ms"], 2)],
            "peak_device_bytes": {
                str(small["clients"]): small["peak_device_bytes"],
                str(big["clients"]): big["peak_device_bytes"],
            },
            "host_bytes": {str(big["clients"]): big["host_bytes"]},
            "peak_rss_bytes": {
                str(small["clients"]): small["peak_rss_bytes"],
                str(big["clients"]): big["peak_rss_bytes"],
            },
            "host_over_device_at_10k": round(same["round_s"] / small["round_s"], 3),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }
    )


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.cases) - {"a", "b", "c", "d", "million"})
    if unknown:
        raise app.UsageError(f"--cases must be among a, b, c, d, million; got {unknown}")
    emit({"backend": jax.default_backend(), "devices": jax.device_count(), "jax": jax.__version__})
    if {"a", "b"} & set(FLAGS.cases):
        case_a_b(FLAGS.repeats)
    if "c" in FLAGS.cases:
        case_c(FLAGS.repeats)
    if "d" in FLAGS.cases:
        case_d(FLAGS.repeats)
    if "million" in FLAGS.cases:
        case_million()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
