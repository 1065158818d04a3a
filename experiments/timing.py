"""Timing one compiled round, shared by the benchmarks."""

from __future__ import annotations

import time
from typing import Any

import jax

from pfljax.core.memory import memory_report


def time_round(alg, data: Any, repeats: int) -> dict:
    """One algorithm's jitted round on `data`: compile seconds, the best of `repeats`
    timed rounds after the first (`round_s`), the state after them, and the memory
    report of the compiled round (`memory`, with `round_temp_bytes` where XLA gives it)."""
    num = int(data.train.count.shape[0])
    state = alg.init(jax.random.key(0), None, num)
    t0 = time.perf_counter()
    compiled = jax.jit(alg.round).lower(state, data, jax.random.key(1)).compile()
    compile_s = time.perf_counter() - t0
    memory = memory_report(state, data, compiled)
    state, _ = compiled(state, data, jax.random.key(1))
    jax.block_until_ready(state)
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        state, metrics = compiled(state, data, jax.random.key(2 + r))
        jax.block_until_ready((state, metrics))
        best = min(best, time.perf_counter() - t0)
    return {"compile_s": compile_s, "round_s": best, "state": state, "memory": memory}
