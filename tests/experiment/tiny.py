"""A tiny experiment for tests: FedFac simulation data, 6 clients, small MLP.

`tiny_config` sets it on a ConfigDict; `TINY_FLAGS` are the same overrides as
command-line flags of the binaries.
"""

import json
import os
import subprocess
import sys


def tiny_config(config, algorithm: str = "fedavg", rounds: int = 2, **overrides):
    """Overrides `config` (a base_config()) in place for a seconds-long run."""
    config.algorithm = algorithm
    config.dataset = "simulation"
    config.partition = "iid"
    config.samples_per_client = 0
    config.source.samples_per_client = 40
    config.source.d = 10
    config.source.m = 8
    config.num_clients = 6
    config.rounds = rounds
    config.batch_size = 8
    config.local_epochs = 1
    config.model_kwargs.hidden = (8,)
    config.checkpoint_every = 1
    for key, value in overrides.items():
        config[key] = value
    return config


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_FLAGS = [
    "--config=experiments/configs/default.py",
    "--config.dataset=simulation",
    "--config.partition=iid",
    "--config.samples_per_client=0",
    "--config.source.samples_per_client=40",
    "--config.source.d=10",
    "--config.source.m=8",
    "--config.num_clients=6",
    "--config.rounds=2",
    "--config.batch_size=8",
    "--config.model_kwargs.hidden=(8,)",
    "--config.checkpoint_every=1",
]


def binary_env(**variables: str) -> dict:
    """The environment of a binary run by a test: CPU, the tests' persistent compilation
    cache (PFLJAX_TEST_JAX_CACHE, default .jax_cache), plus `variables`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))
    )
    return {**env, **variables}


def fork_runs(runs: list[dict], timeout: float = 600) -> list[dict]:
    """Runs the binaries' cases through tests/experiment/forkrun.py (one warm process, a
    fork per case) in `binary_env()`; returns each case's {"rc", "stdout", "stderr"}."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.experiment.forkrun"],
        input=json.dumps(runs),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=binary_env(),
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def is_png(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"
