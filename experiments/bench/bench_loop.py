"""Costs of the run loop's pieces, one function per case (CASES).

    python -m experiments.bench.bench_loop [--json] [--cases=blocks,eval_rows,pfllib_dir_round] [--repeats=5]

One JSON line (with --json; else a readable line) per measurement, each with its
case; summary rows carry their target and whether it is met.

- eval_rows: seconds of one evaluation (jitted, warm, median of --repeats, the
  variants interleaved) of a FedAvg CNN state (PFLlib's FedAvgCNN, untrained) on
  the test rows of PFLlib's Dirichlet(0.1) Fashion-MNIST split
  (`pfllib_fmnist.py:dir`: 20 clients, 17,498 rows, the largest 2,138) and of an
  IID split of the same rows (20 equal clients), per client map of --eval_maps.
  "before" is the evaluation before commit bbd979f (every client on an n_max-row window,
  masked: `padded_evaluate_clients` here), "after" the library's
  (`pfljax.core.evaluate.evaluate_clients`: each client's real rows). Target:
  after, Dirichlet / IID <= 1.25; the per-client scores of before and after agree.
- blocks: rounds/s of a tiny model (MLP 32 units, 10 clients of the simulation data,
  1 local step, evaluation every 50 rounds, no checkpoint before the end) through
  the run loop (`train_and_evaluate`'s `run_loop`, timed around it: setup and
  compilation excluded, outputs and checkpoints included), 500 rounds with
  `block_rounds` 1 (one dispatch and host visit per round) vs 0 (auto: blocks of up
  to 100 rounds on device); interleaved, median of --repeats. Target:
  blocked_over_per_round >= 3 on CPU. Also the bare device work (a jitted scan of
  100 rounds, nothing else): `ceiling_over_per_round` is the most any blocking
  could give on this device (per-round time = device work + host visit).
- pfllib_dir_round: FedAvg on `pfllib_fmnist.py:dir` (one seed): seconds of one
  jitted round and of one evaluation (warm, best of --repeats); target eval/train <= 0.2.
- epoch_orders (not in the default --cases): one round of FedAvg (vmap, map) and SCAFFOLD
  (MLP 784-200-10, 20 random clients of 100-1,000 rows, batch 10, one epoch) with the epoch
  row orders drawn before the local steps (the library's) vs during them (the code before,
  `local.MAX_PLANNED_ROWS = 0`), interleaved; `same_state`: the two rounds' states are equal.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from experiments.bench.timing import time_round
from pfljax.algorithms import fedavg, scaffold
from pfljax.core import local
from pfljax.core.clients import ClientMap, take
from pfljax.core.evaluate import EVAL_CHUNK, evaluate_clients, predict_rows, scores_from_outputs
from pfljax.core.local import LocalTraining
from pfljax.core.types import ClientArrays, ClientData, ClientPool
from pfljax.experiment import base_config, train, train_and_evaluate
from pfljax.experiment.cli import parse_flags
from pfljax.experiment.config import make_data, make_model, prepare, resolve
from pfljax.experiment.configs import pfllib_fmnist
from pfljax.models import build_model

FLAGS = flags.FLAGS
flags.DEFINE_bool("json", False, "print one JSON object per line (else a readable line)")
flags.DEFINE_list("cases", ["blocks", "eval_rows", "pfllib_dir_round"], "cases to run (keys of CASES)")
flags.DEFINE_integer("repeats", 5, "timed calls per variant after a warm one (the median is reported)")
flags.DEFINE_list("eval_maps", ["auto"], "eval_rows: client maps (auto, map, vmap)")


def emit(row: dict) -> None:
    print(json.dumps(row) if FLAGS.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def interleaved_medians(fns: dict, args: dict, repeats: int) -> tuple[dict, dict]:
    """({name: output of a warm call}, {name: median seconds of `repeats` calls}), names interleaved."""
    outs = {k: jax.block_until_ready(f(*args[k])) for k, f in fns.items()}
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args[k]))
            times[k].append(time.perf_counter() - t0)
    return outs, {k: statistics.median(t) for k, t in times.items()}


# ---- eval_rows ---------------------------------------------------------------------------


def padded_evaluate_clients(apply_fn, variables_of, test, client_map, loss="cross_entropy") -> dict:
    """The evaluation before commit bbd979f: every client on an n_max-row window of the test
    rows, in EVAL_CHUNK-row passes, rows past its count masked."""

    def one(c):
        data = take(test, c)
        out = predict_rows(lambda xb: apply_fn(variables_of(c), xb, train=False)[0], data.x)
        return scores_from_outputs(out, data, loss)

    return client_map(one, jnp.arange(test.count.shape[0]))


def iid_pool(pool: ClientPool, seed: int = 0) -> ClientPool:
    """The rows of `pool` shuffled into as many clients of equal size (+-1), the largest last."""
    n, num = int(pool.count.sum()), int(pool.count.shape[0])
    counts = np.sort(np.full(num, n // num) + (np.arange(num) >= num - n % num)).astype(np.int32)
    perm = np.random.default_rng(seed).permutation(n)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    x, y = np.asarray(pool.x)[perm], np.asarray(pool.y)[perm]
    arrays = (jnp.asarray(a) for a in (x, y, offsets, counts))
    return ClientPool(*arrays, levels=pool.levels, n_max=int(counts.max()))


def scored_rows(counts: np.ndarray, version: str, strategy: str) -> int:
    """Rows the forward passes cover: n_max's chunks for every client (before), each
    client's own chunks (after, a loop per client) or C at a time (after, vmap)."""
    num, own = len(counts), int(np.sum(-(-counts // EVAL_CHUNK)))
    if version == "before":
        return num * -(-int(counts.max()) // EVAL_CHUNK) * EVAL_CHUNK
    return (own if strategy != "vmap" else -(-own // num) * num) * EVAL_CHUNK


def compiled_evaluations(model, cmap: ClientMap, state, tests: dict) -> tuple[dict, dict]:
    """({(split, version): compiled (state, test) -> per-client scores}, their args)."""
    versions = {"before": padded_evaluate_clients, "after": evaluate_clients}
    fns, args = {}, {}
    for split, test in tests.items():
        for version, evaluate in versions.items():

            def run(s, t, evaluate=evaluate):
                return evaluate(model.apply, lambda c: fedavg.personalized(s, c), t, cmap)

            fns[split, version] = jax.jit(run).lower(state, test).compile()
            args[split, version] = (state, test)
    return fns, args


def case_eval_rows(repeats: int) -> None:
    config, _ = resolve(pfllib_fmnist.get_config("dir"))
    fed = make_data(config)
    model = make_model(config, fed)
    tests = {"dirichlet": fed.data.test, "iid": iid_pool(fed.data.test)}
    num = int(fed.data.test.count.shape[0])
    spec = LocalTraining(optax.sgd(config.learning_rate), batch_size=config.batch_size, epochs=1)
    for name in FLAGS.eval_maps:
        cmap = ClientMap(name)
        strategy = cmap.resolved()
        state = fedavg.build(model, spec, client_map=cmap).init(jax.random.key(0), None, num)
        fns, args = compiled_evaluations(model, cmap, state, tests)
        outs, secs = interleaved_medians(fns, args, repeats)
        for split, version in fns:
            counts = np.asarray(tests[split].count)
            before = outs[split, "before"]
            diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), outs[split, version], before)
            emit({
                "case": "eval_rows", "client_map": strategy, "split": split, "version": version,
                "eval_s": round(secs[split, version], 3), "test_rows": int(counts.sum()),
                "n_max": int(counts.max()), "scored_rows": scored_rows(counts, version, strategy),
                "max_abs_diff_vs_before": diff, "backend": jax.default_backend(),
            })  # fmt: skip
        for version in ("before", "after"):
            ratio = secs["dirichlet", version] / secs["iid", version]
            speedup = secs["dirichlet", "before"] / secs["dirichlet", version]
            emit({
                "case": "eval_rows", "client_map": strategy, "version": version,
                "dirichlet_over_iid": round(ratio, 2), "target": "<= 1.25", "met": ratio <= 1.25,
                "dirichlet_speedup_over_before": round(speedup, 2),
            })  # fmt: skip


BLOCK_RUN_ROUNDS = 500


def tiny_loop_config(rounds: int, block_rounds: int):
    config = base_config()
    config.dataset, config.partition = "simulation", "iid"
    config.num_clients, config.rounds, config.local_steps = 10, rounds, 1
    config.model_kwargs = {"hidden": (32,)}
    config.eval_every, config.checkpoint_every, config.block_rounds = 50, 0, block_rounds
    return config


def loop_rounds_per_s(rounds: int, block_rounds: int) -> float:
    """Rounds per second of `run_loop` (timed around it: setup and compilation excluded)."""
    seconds, original = [], train.run_loop

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return out

    train.run_loop = timed
    try:
        with tempfile.TemporaryDirectory() as workdir:
            train_and_evaluate(tiny_loop_config(rounds, block_rounds), workdir, progress=False)
    finally:
        train.run_loop = original
    return rounds / seconds[0]


def device_rounds_per_s(rounds: int, repeats: int) -> float:
    """Rounds per second of the bare device work: one jitted lax.scan of `rounds` rounds
    of the same algorithm and data (no evaluation, no host visit): the most any loop,
    blocked or not, can reach on this device."""
    prep = prepare(tiny_loop_config(rounds, 0))
    alg, data, key = prep.algorithm, prep.fed_data.data, jax.random.key(0)
    state = alg.init(key, None, int(data.train.count.shape[0]))

    def scanned(state):
        return jax.lax.scan(lambda s, _: alg.round(s, data, key), state, None, length=rounds)

    run = jax.jit(scanned).lower(state).compile()
    _, secs = interleaved_medians({"scan": run}, {"scan": (state,)}, repeats)
    return rounds / secs["scan"]


def case_blocks(repeats: int) -> None:
    rates = {1: [], 0: []}
    for _ in range(repeats):
        for block_rounds in rates:
            rates[block_rounds].append(loop_rounds_per_s(BLOCK_RUN_ROUNDS, block_rounds))
    per_round, blocked = statistics.median(rates[1]), statistics.median(rates[0])
    device = device_rounds_per_s(100, repeats)
    ratio = blocked / per_round
    emit({
        "case": "blocks", "rounds": BLOCK_RUN_ROUNDS, "rounds_per_s_block_1": round(per_round, 1),
        "rounds_per_s_block_auto": round(blocked, 1), "blocked_over_per_round": round(ratio, 2),
        "target": ">= 3", "met": ratio >= 3, "rounds_per_s_device_only": round(device, 1),
        "ceiling_over_per_round": round(device / per_round, 2), "backend": jax.default_backend(),
    })  # fmt: skip


def case_pfllib_dir_round(repeats: int) -> None:
    config = pfllib_fmnist.get_config("dir")
    config.algorithm = "fedavg"
    prep = prepare(config)
    data = prep.fed_data.data
    timed = time_round(prep.algorithm, data, repeats)
    state = timed["state"]
    evaluate = jax.jit(prep.algorithm.evaluate).lower(state, data, jax.random.key(0)).compile()
    jax.block_until_ready(evaluate(state, data, jax.random.key(0)))
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(evaluate(state, data, jax.random.key(r)))
        best = min(best, time.perf_counter() - t0)
    ratio = best / timed["round_s"]
    emit({
        "case": "pfllib_dir_round", "train_s": round(timed["round_s"], 3), "eval_s": round(best, 3),
        "eval_over_train": round(ratio, 3), "target": "<= 0.2", "met": ratio <= 0.2,
        "backend": jax.default_backend(),
    })  # fmt: skip


def case_epoch_orders(repeats: int) -> None:
    """One round of FedAvg (vmap and map) and SCAFFOLD with every epoch's row order drawn
    before the local steps (`local.epoch_orders`, the default) vs drawn during them
    (`MAX_PLANNED_ROWS = 0`, the code before), same random data, interleaved."""
    rng = np.random.default_rng(0)
    num, rows = 20, 1000
    x = jnp.asarray(rng.normal(size=(num, rows, 784)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, (num, rows)).astype(np.int32))
    arrays = ClientArrays(x, y, jnp.asarray(rng.integers(rows // 10, rows + 1, num).astype(np.int32)))
    data = ClientData(arrays, arrays)
    model = build_model("mlp", (784,), 10, hidden=(200,))
    spec = LocalTraining(optax.sgd(0.01), batch_size=10, epochs=1)
    builds = {
        "fedavg_vmap": lambda: fedavg.build(model, spec, client_map="vmap"),
        "fedavg_map": lambda: fedavg.build(model, spec, client_map="map"),
        "scaffold_map": lambda: scaffold.build(model, spec, client_map="map"),
    }
    for name, build in builds.items():
        fns, args = {}, {}
        for version, limit in (("drawn_during", 0), ("drawn_before", local.MAX_PLANNED_ROWS)):
            saved, local.MAX_PLANNED_ROWS = local.MAX_PLANNED_ROWS, limit
            alg = build()
            state = alg.init(jax.random.key(0), None, num)
            fns[version] = jax.jit(alg.round).lower(state, data, jax.random.key(1)).compile()
            args[version] = (state, data, jax.random.key(1))
            local.MAX_PLANNED_ROWS = saved
        outs, med = interleaved_medians(fns, args, repeats)
        same = all(
            bool(jnp.array_equal(a, b)) for a, b in zip(*(jax.tree.leaves(o[0]) for o in outs.values()))
        )
        emit({
            "case": "epoch_orders", "round": name, "drawn_during_s": round(med["drawn_during"], 4),
            "drawn_before_s": round(med["drawn_before"], 4),
            "speedup": round(med["drawn_during"] / med["drawn_before"], 3), "same_state": same,
            "backend": jax.default_backend(),
        })  # fmt: skip


CASES = {
    "blocks": case_blocks,
    "eval_rows": case_eval_rows,
    "pfllib_dir_round": case_pfllib_dir_round,
    "epoch_orders": case_epoch_orders,
}


def main(argv):
    del argv
    unknown = [c for c in FLAGS.cases if c not in CASES]
    if unknown:
        raise app.UsageError(f"unknown cases {unknown}; known: {sorted(CASES)}")
    for name in FLAGS.cases:
        CASES[name](FLAGS.repeats)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
