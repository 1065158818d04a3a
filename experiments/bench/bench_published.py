"""FLUTE's two published speed settings replayed on synthetic data of the same shapes.

    python -m experiments.bench.bench_published --json [--rounds=3] [--cases=femnist_flute,shakespeare_flute]
        [--scale=1.0] [--seed=0]

FLUTE's README (github:microsoft/msrflute, README.md, "Benchmarking" table and "FedML
Comparison") gives each task's setting and FLUTE's wall time (FLUTE over NCCL, "Fastest"):

- CNN_FEMNIST: 3,400 clients, 10 a round, batch 20, SGD lr 0.1, 1 epoch, 1500 rounds;
  00:08:22 = 502 s.
- RNN_FEDSHAKESPEARE: 715 clients, 10 a round, batch 4, SGD lr 0.8, 1 epoch, 1200 rounds;
  00:21:50 = 1310 s. (lr 0.8 also in experiments/nlp_rnn_fedshakespeare/config.yaml,
  `initial_lr_client`; experiments/cv_cnn_femnist/config.yaml has lr 0.1. Both runs were
  started with `torch.distributed.run --nproc_per_node=4 ... -backend nccl`, per the
  experiments' README.md files.)

Here each case is one FedAvg round of the library (`pfljax.algorithms.fedavg.build`, K of C
clients sampled inside the round, plain SGD, 1 local epoch, the library's default local
loop), jitted and timed after its compiled first run (`experiments.bench.timing`); evaluation
is not timed. Models as the library's LEAF configs build them
(`pfljax/experiment/configs/leaf_femnist.py`: LEAF's FEMNIST CNN, 5x5 convs of 32 and 64,
dense 2048, 62 classes; `leaf_shakespeare.py`: the char LSTM, embedding 8, two LSTM layers
of 256, logits of the next character at the last of 80 positions, 80 characters), with
FLUTE's clients, clients a round, batch and lr.

Data: random inputs and labels (throughput only), clients in one ClientPool on the
default device, per-client train counts drawn from LEAF's published statistics (Caldas
et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097, Table 1): FEMNIST
3,550 writers, 805,263 samples, 226.83 +- 88.94 per writer; Shakespeare 1,129 roles,
4,226,158 samples, 3,743.2 +- 6,212.26 per role. The draw: a log-normal with that mean and
standard deviation: exp(mu + sigma z) of seeded standard normal draws z (standardized over
the clients), sigma and mu fitted so that the drawn counts have exactly that mean and std
(the expected-value parameters, sigma^2 = log(1 + (std / mean)^2), leave a 715-client draw
of Shakespeare's heavy tail ~20% off in std), rounded, clipped to >= 1 (`draw_counts`).
FEMNIST images are uint8 codes of 28x28x1 (784 bytes a sample, `levels` to [0, 1]);
Shakespeare samples are 80 character ids stored as uint8 (80 bytes a window: the ~2.7M
windows take ~0.2 GiB, int32 ids would take ~0.9 GiB), cast to int32 ids by the LSTM. All
clients' data fit on one device here (0.6 GiB and 0.2 GiB), so no host offload. Every client
also has 1 test row (evaluation is not timed).

Caveat: FLUTE's runs use TFF's federated data as FedML ships it (the dataloaders' FedML
origin, experiments/*/dataloaders/preprocess.py and preprocessing.py): EMNIST-62 with 3,400
writers and 671,585 train samples (197.5 a writer), and Shakespeare with 715 roles and
16,068 train snippets cut into non-overlapping 81-id windows with a next-id target at every
position (vocabulary of 90). LEAF's Shakespeare samples are one 80-character window per
character of a role's text, so the LEAF counts drawn here are tens of times the windows of
FLUTE's Shakespeare run. FLUTE's FEMNIST model is FedML's CNN_DropOut (3x3 convs of 32 and
64, one pool, dense 128; experiments/cv_cnn_femnist/model.py), not LEAF's CNN. See
experiments/results/published_speed.md.

`--scale` (test only) multiplies the numbers of clients (at least 2) and the per-client
mean and standard deviation; clients a round are min(10, clients).

One JSON line per case: case, rounds_timed, s_per_round (median), s_per_round_min_max,
projected_full_run_s (s_per_round x published rounds), published_s, published_rounds,
clients, clients_per_round, samples_total, backend, device_kind, load_average (before,
after), and compile_s, expected_local_steps_per_round, n_max, data_MiB, scale.
"""

from __future__ import annotations

import json
import os
import time
from typing import NamedTuple

import jax
import numpy as np
import optax
from absl import app, flags

from experiments.bench.timing import run_timed
from pfljax.algorithms import fedavg
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.types import ClientData, ClientPool
from pfljax.experiment.cli import parse_flags
from pfljax.experiment.configs import leaf_femnist, leaf_shakespeare
from pfljax.models import build_model

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The binary's flags (defined when run as a program, so that importing this module in a
    process that runs other absl programs' code defines none)."""
    flags.DEFINE_bool("json", False, "print one JSON object per line (else a readable line)")
    flags.DEFINE_integer("rounds", 3, "timed rounds after the compiled first one (median is reported)")
    flags.DEFINE_list("cases", list(CASES), f"cases: {', '.join(CASES)}")
    flags.DEFINE_float("scale", 1.0, "multiplies clients and per-client sample mean/std (tests: e.g. 0.01)")
    flags.DEFINE_integer("seed", 0, "seed of the per-client counts and the random data")


class Case(NamedTuple):
    """One published setting: FLUTE's numbers, LEAF's per-client statistics, the model."""

    config: object  # the library config holding the model (leaf_femnist / leaf_shakespeare)
    input_shape: tuple[int, ...]
    classes: int
    clients: int
    clients_per_round: int
    batch: int
    lr: float
    rounds: int
    published_s: int
    mean: float  # LEAF, samples per client
    std: float


CASES = {
    "femnist_flute": Case(leaf_femnist, (28, 28, 1), 62, 3400, 10, 20, 0.1, 1500, 502, 226.83, 88.94),
    "shakespeare_flute": Case(leaf_shakespeare, (80,), 80, 715, 10, 4, 0.8, 1200, 1310, 3743.2, 6212.26),
}


def emit(row: dict, as_json: bool) -> None:
    print(json.dumps(row) if as_json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def draw_counts(mean: float, std: float, num: int, seed: int) -> np.ndarray:
    """[num] int32 per-client counts: exp(mu + sigma z) of seeded normal draws z (standardized),
    with sigma (bisection) and mu fitted so that the draws have this mean and std, rounded, >= 1."""
    z = np.random.default_rng(seed).normal(size=num)
    z = (z - z.mean()) / z.std()
    lo, hi = 0.0, 10.0
    for _ in range(100):  # std / mean of exp(sigma z) grows with sigma
        sigma = (lo + hi) / 2
        e = np.exp(sigma * z)
        lo, hi = (sigma, hi) if e.std() / e.mean() < std / mean else (lo, sigma)
    draws = mean * e / e.mean()
    return np.maximum(np.rint(draws), 1).astype(np.int32)


def synthetic_pool(case: Case, counts: np.ndarray, seed: int) -> ClientPool:
    """A ClientPool of random uint8 inputs and int32 labels, client c holding counts[c] rows;
    the largest client's rows last (its view window ends at the pool's end)."""
    rng = np.random.default_rng(seed)
    total = int(counts.sum())
    image = len(case.input_shape) > 1
    high = 256 if image else case.classes  # pixel codes, or character ids
    x = rng.integers(0, high, (total, *case.input_shape), dtype=np.uint8)
    y = rng.integers(0, case.classes, total).astype(np.int32)
    largest = int(np.argmax(counts))
    order = [c for c in range(len(counts)) if c != largest] + [largest]
    offset = np.zeros(len(counts), np.int32)
    offset[order] = np.concatenate([[0], np.cumsum(counts[order])[:-1]])
    levels = np.linspace(0.0, 1.0, 256, dtype=np.float32) if image else None
    return ClientPool(x, y, offset, counts.astype(np.int32), levels, n_max=int(counts.max()))


def scaled(case: Case, scale: float) -> Case:
    """The case with clients (at least 2) and per-client mean/std times `scale`."""
    clients = max(2, round(case.clients * scale))
    return case._replace(
        clients=clients,
        clients_per_round=min(case.clients_per_round, clients),
        mean=case.mean * scale,
        std=case.std * scale,
    )


def build(case: Case, seed: int):
    """(FedAvg Algorithm, ClientData, train counts) of a case, the model from its config."""
    config = case.config.get_config()
    model = build_model(config.model, case.input_shape, case.classes, **config.model_kwargs.to_dict())
    counts = draw_counts(case.mean, case.std, case.clients, seed)
    train = synthetic_pool(case, counts, seed + 1)
    test = synthetic_pool(case, np.ones(case.clients, np.int32), seed + 2)
    data = jax.device_put(ClientData(train, test))
    spec = LocalTraining(optax.sgd(case.lr), batch_size=case.batch, epochs=1)
    alg = fedavg.build(model, spec, clients_per_round=case.clients_per_round)
    return alg, data, counts


def compile_round(alg, data) -> dict:
    """The round jitted (state donated, as the binaries run it), compiled and run once, as
    experiments.bench.timing.compile_round, the initial state from a jitted `alg.init` (the char
    LSTM's eager flax init takes ~2.5x as long on CPU)."""
    num = int(data.train.count.shape[0])
    state = jax.jit(alg.init, static_argnums=(1, 2))(jax.random.key(0), None, num)
    t0 = time.perf_counter()
    compiled = jax.jit(alg.round, donate_argnums=(0,)).lower(state, data, jax.random.key(1)).compile()
    compile_s = time.perf_counter() - t0
    state, _ = compiled(state, data, jax.random.key(1))
    jax.block_until_ready(state)
    return {"compile_s": compile_s, "compiled": compiled, "state": state}


def run_case(name: str, rounds: int, scale: float, seed: int) -> dict:
    case = scaled(CASES[name], scale)
    load_before = os.getloadavg()
    alg, data, counts = build(case, seed)
    res = compile_round(alg, data)
    times = [run_timed(res, data, jax.random.key(2 + r)) for r in range(rounds)]
    median = float(np.median(times))
    steps = np.ceil(counts / case.batch)  # 1 epoch, the last batch partial
    return {
        "case": name,
        "rounds_timed": rounds,
        "s_per_round": round(median, 4),
        "s_per_round_min_max": [round(min(times), 4), round(max(times), 4)],
        "projected_full_run_s": round(median * case.rounds, 1),
        "published_s": case.published_s,
        "published_rounds": case.rounds,
        "clients": case.clients,
        "clients_per_round": case.clients_per_round,
        "samples_total": int(counts.sum()),
        "samples_mean_std": [round(float(counts.mean()), 1), round(float(counts.std()), 1)],
        "n_max": int(counts.max()),
        "expected_local_steps_per_round": round(float(steps.mean()) * case.clients_per_round, 1),
        "compile_s": round(res["compile_s"], 1),
        "data_MiB": round(tree_bytes(data) / 2**20, 1),
        "scale": scale,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "load_average": [[round(x, 2) for x in load_before], [round(x, 2) for x in os.getloadavg()]],
    }


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.cases) - set(CASES))
    if unknown:
        raise app.UsageError(f"--cases must be among {', '.join(CASES)}; got {unknown}")
    if FLAGS.rounds < 1 or not 0 < FLAGS.scale <= 1:
        raise app.UsageError("--rounds must be >= 1 and --scale in (0, 1]")
    run_cases(FLAGS.cases, FLAGS.rounds, FLAGS.scale, FLAGS.seed, FLAGS.json)


def run_cases(cases, rounds: int, scale: float, seed: int, as_json: bool) -> None:
    """Times and prints each case (one line each)."""
    for name in cases:
        emit(run_case(name, rounds, scale, seed), as_json)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
