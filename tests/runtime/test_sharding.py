"""Sharding the client axis: helpers, ShardedMap, and 4 devices == 1 device (subprocess)."""

import json
import os
import subprocess
import sys
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedavg
from pfljax.core.local import LocalTraining
from pfljax.models import build_model
from pfljax.runtime.sharding import (
    ShardedMap,
    client_mesh,
    map_client_leaves,
    pad_rows,
    padded_size,
    shard_algorithm,
    state_shardings,
    unpad_rows,
    use_cpu_devices,
)
from tests.toydata import toy_data, toy_pool_data

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# Algorithms the 4-device test runs; PFLJAX_SHARDING_ALGORITHMS=all runs every one.
DEFAULT_ALGORITHMS = "fedavg,local"
TIMING_KEYS = (
    "wall_seconds",
    "compile_seconds",
    "round_seconds_median",
    "seconds",
    "eval_seconds",
    "devices",
    "memory",  # bytes available, padded state: the machine's, not the run's numbers
)


class State(NamedTuple):
    global_w: jax.Array
    client_w: dict
    round: jax.Array


def test_padding_and_client_leaves():
    state = State(jnp.ones(3), {"a": jnp.arange(10.0).reshape(5, 2)}, jnp.int32(4))
    padded = map_client_leaves(state, lambda x: pad_rows(x, 8))
    assert padded.client_w["a"].shape == (8, 2) and padded.global_w.shape == (3,)
    np.testing.assert_array_equal(padded.client_w["a"][5:], 0)
    chex.assert_trees_all_equal(map_client_leaves(padded, lambda x: unpad_rows(x, 5)), state)
    mesh = client_mesh(1)
    specs = state_shardings(state, mesh)
    assert specs.client_w["a"].spec == jax.sharding.PartitionSpec("clients")
    assert specs.global_w.spec == jax.sharding.PartitionSpec()
    assert padded_size(6, mesh) == 6
    with pytest.raises(ValueError, match="num_devices"):
        client_mesh(jax.device_count() + 1)


@pytest.mark.parametrize("layout", ["padded", "pool"])
def test_sharded_map_on_one_device_equals_map(layout):
    counts = (12, 7, 20, 3, 9, 15)
    data = toy_data(counts) if layout == "padded" else toy_pool_data(counts)[0]
    model = build_model("mlp", (6,), 3, hidden=(8,))
    spec = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=1)
    ref = fedavg.build(model, spec, clients_per_round=4, client_map="map")
    mesh = client_mesh(1)
    alg = fedavg.build(model, spec, clients_per_round=4, client_map=ShardedMap(mesh, "map"))
    run = shard_algorithm(alg, mesh, len(counts))
    state = ref.init(jax.random.key(0), None, len(counts))
    placed = run.place_state(state)
    key = jax.random.key(1)
    s1, m1 = jax.jit(ref.round)(state, data, key)
    s2, m2 = jax.jit(run.round)(placed, run.place_data(data), run.place_key(key))
    # atol: float32 rounding of entries near 0 (e.g. 9e-9 on a bias of -0.0086)
    chex.assert_trees_all_close(run.unplace_state(s2), s1, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(m2, m1, rtol=1e-6, atol=1e-7)


def _numbers(tree):
    """Drops timing keys; the rest must agree across device counts."""
    if isinstance(tree, dict):
        return {k: _numbers(v) for k, v in tree.items() if k not in TIMING_KEYS}
    if isinstance(tree, list):
        return [_numbers(v) for v in tree]
    return tree


def test_four_devices_equal_one_device():
    names = os.environ.get("PFLJAX_SHARDING_ALGORITHMS", DEFAULT_ALGORITHMS)
    if names == "all":
        from pfljax import algorithms

        names = ",".join(algorithms.available())
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))
    )
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "multidevice_worker.py"), *names.split(",")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["algorithm"] for r in results] == names.split(",")
    for r in results:
        single, sharded = r["single"], r["sharded"]
        assert single["summary"]["devices"] == 1 and sharded["summary"]["devices"] == 4
        assert len(single["rows"]) == 3
        a, b = _numbers(sharded), _numbers(single)
        strings = lambda t: {k: v for k, v in t["summary"].items() if isinstance(v, str)}  # noqa: E731
        assert strings(a) == strings(b)
        numeric = lambda t: jax.tree.map(lambda v: None if isinstance(v, str) else v, t)  # noqa: E731
        chex.assert_trees_all_close(numeric(a), numeric(b), rtol=1e-5, atol=1e-6)


def test_cpu_devices_can_only_be_set_before_jax_runs():
    """`use_cpu_devices` (the binaries' --cpu_devices) is a no-op for 1 and one clear error once
    JAX's backends are up (the tests' process has run JAX by now); the forced devices
    themselves are exercised by tests/experiment/test_multiprocess.py's reference run."""
    jax.devices()
    use_cpu_devices(1)
    with pytest.raises(ValueError, match="CPU devices can only be set before JAX runs anything"):
        use_cpu_devices(2)
