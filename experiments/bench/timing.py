"""Timing compiled rounds, shared by the benchmarks."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.runtime.memory import memory_report


def compile_round(alg, data: Any, donate: bool = False) -> dict:
    """One algorithm's jitted round on `data`, compiled and run once: compile seconds,
    the compiled round, the state after it and the memory report (`memory`, with
    `round_temp_bytes` where XLA gives it). `donate`: the state's buffers are donated
    to the round, as `pfljax.experiment.train` does (updates of [C, ...] state in place)."""
    num = int(data.train.count.shape[0])
    state = jax.tree.map(jnp.copy, alg.init(jax.random.key(0), None, num))  # no shared buffers
    t0 = time.perf_counter()
    jitted = jax.jit(alg.round, donate_argnums=(0,) if donate else ())
    compiled = jitted.lower(state, data, jax.random.key(1)).compile()
    compile_s = time.perf_counter() - t0
    memory = memory_report(state, data, compiled)
    state, _ = compiled(state, data, jax.random.key(1))
    jax.block_until_ready(state)
    return {"compile_s": compile_s, "compiled": compiled, "state": state, "memory": memory}


def run_timed(res: dict, data: Any, key: jax.Array) -> float:
    """Seconds of one round of a `compile_round` result (its state moves on)."""
    t0 = time.perf_counter()
    res["state"], metrics = res["compiled"](res["state"], data, key)
    jax.block_until_ready((res["state"], metrics))
    return time.perf_counter() - t0


def time_round(alg, data: Any, repeats: int, donate: bool = False) -> dict:
    """One algorithm's jitted round on `data`: compile seconds, the best of `repeats`
    timed rounds after the first (`round_s`), the state after them, and the memory
    report of the compiled round (`memory`, with `round_temp_bytes` where XLA gives it)."""
    res = compile_round(alg, data, donate)
    best = min(run_timed(res, data, jax.random.key(2 + r)) for r in range(repeats))
    return {"compile_s": res["compile_s"], "round_s": best, "state": res["state"], "memory": res["memory"]}


def compare_rounds(algs: dict, data: Any, repeats: int, donate: bool = False) -> dict:
    """Several algorithms' rounds timed interleaved (one round of each in turn, `repeats`
    times), so that a noisy machine slows them alike: {name: time_round's dict, with
    `round_s` the median and `best_s` the best of the repeats}."""
    res = {name: compile_round(alg, data, donate) for name, alg in algs.items()}
    times = {name: [] for name in algs}
    for r in range(repeats):
        for name in algs:
            times[name].append(run_timed(res[name], data, jax.random.key(2 + r)))
    return {
        name: {
            "compile_s": res[name]["compile_s"],
            "round_s": float(np.median(times[name])),
            "best_s": min(times[name]),
            "state": res[name]["state"],
            "memory": res[name]["memory"],
        }
        for name in algs
    }
