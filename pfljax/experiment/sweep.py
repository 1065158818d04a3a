"""Several runs of one algorithm as one compiled program: `train_replicas(configs, workdirs)`.

The runs (replicas, `pfljax.runtime.replicas`) differ only by `seed` and by the
values of grid options (`grid`: the top-level `learning_rate` or a float option
of the algorithm); they share the federated data, so every config must give the
same partition (`data_seed` >= 0, or one seed). Each replica writes what
`train_and_evaluate` writes into its own workdir (config.json, data.json,
partition.png, metrics.jsonl / .csv, traces.jsonl, tensorboard/, summary.json,
accuracy.png, loss.png, collaboration.png) with the same numbers (up to float
summation order, rtol ~1e-5). The whole replica state is checkpointed in
`checkpoint_dir` (not in each run's `checkpoints/`); rerunning resumes from it.

The replicas run through the same loop as a single run
(`pfljax.experiment.loop.run_loop`: blocks of rounds on device, outputs appended,
a replica that diverges stops alone; a DP budget, shared by all, stops them all).
Not supported (ConfigError before training): more than one device
(`num_devices`), a workdir holding a run that this sweep's checkpoint does not cover.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pfljax.experiment.checkpoint import Checkpoints
from pfljax.experiment.config import ConfigError, prepare, to_plain
from pfljax.experiment.config_grid import (  # noqa: F401  (grid_target, make_build: re-exported)
    check_replica_configs,
    grid_target,
    grid_value,
    make_build,
)
from pfljax.experiment.loop import execute
from pfljax.experiment.runners import ReplicaRunner
from pfljax.experiment.workdir import claim
from pfljax.runtime import replicas as R

RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")


def train_replicas(
    configs: Sequence,
    workdirs: Sequence[str],
    *,
    fed_data=None,
    grid: Sequence[str] = (),
    checkpoint_dir: str,
    memory_limit: int | None = None,
    dry_run: bool = False,
    strategy: str = "auto",
) -> list[dict] | None:
    """Runs (or resumes) the configs as replicas of one program; returns their summaries.

    Args:
      configs: one ConfigDict per replica, differing only by `seed` and the `grid` options.
      workdirs: one output directory per replica (as train_and_evaluate's).
      fed_data: the shared FederatedData (built from configs[0] if None).
      grid: names of the options whose values vary (traced scalars).
      checkpoint_dir: where the whole replica state is checkpointed.
      memory_limit: bytes available (default: the device's, see replicas.device_memory_bytes).
      dry_run: only the checks (nothing trained or written); returns None.
      strategy: how the replicas are mapped ("vmap", "map" or "auto": map on CPU,
        see `pfljax.runtime.replicas.resolve_strategy`).

    Raises:
      ConfigError: before training, for configs that cannot run as one program
        (an option that cannot vary, different partitions, too many replicas for
        the memory, a workdir holding another run).
    """
    try:
        R.resolve_strategy(strategy)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if len(configs) != len(workdirs) or not configs:
        raise ConfigError("give one workdir per config, at least one")
    with contextlib.ExitStack() as claims:
        for w in workdirs:
            claims.enter_context(claim(w))
        return _checked_run(
            configs, workdirs, fed_data, grid, checkpoint_dir, memory_limit, dry_run, strategy
        )


def _checked_run(configs, workdirs, fed_data, grid, checkpoint_dir, memory_limit, dry_run, strategy):
    """train_replicas once its workdirs are claimed: every check, then the run."""
    t_start = time.perf_counter()
    # Validates every value concretely; the replicas run on one device even where several
    # are visible (num_devices 0 = all, --cpu_devices).
    preps = [prepare(c, fed_data, one_device=True) for c in configs]
    if any(p.config.client_storage == "host" for p in preps):
        raise ConfigError(
            "config.client_storage='host' runs one run at a time (its rounds move clients from host "
            "memory); replicas run as one program on the device: set client_storage='device'"
        )
    grid = list(grid)
    for option in grid:
        for p in preps:
            grid_target(p.config, option)
    check_replica_configs([p.config for p in preps], workdirs, grid)
    reps = _replicas(preps, grid, strategy, memory_limit)
    _check_fresh_workdirs(checkpoint_dir, workdirs)
    if dry_run:
        return None
    ckpts = Checkpoints(checkpoint_dir)
    try:
        return _run(preps, workdirs, reps, ckpts, t_start)
    finally:
        ckpts.close()


def _replicas(preps, grid, strategy, memory_limit) -> R.Replicas:
    """The Replicas of the preps' configs (a grid over `grid`, or seeds), memory checked."""
    config, prep, count = preps[0].config, preps[0], len(preps)
    num = prep.fed_data.data.train.count.shape[0]
    if grid:
        values = {o: [grid_value(p.config, o) for p in preps] for o in grid}
        build = make_build(config, prep, grid)
        try:
            R.check_varying(build, values, prep.fed_data.data, num, prefix=f"{config.algorithm} option ")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        reps = R.replicate_grid(build, values, strategy)
    else:
        reps = R.replicate(prep.algorithm, count, strategy)
    one = jax.eval_shape(lambda k: prep.algorithm.init(k, None, num), jax.random.key(0))
    try:
        R.check_memory(one, prep.fed_data.data, count, memory_limit, what=f"{config.algorithm} replicas")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return reps


def _check_fresh_workdirs(checkpoint_dir: str, workdirs) -> None:
    """Without a replica checkpoint, no workdir may hold a run (it could not be resumed)."""
    if os.path.isdir(checkpoint_dir):
        return
    for w in workdirs:
        held = [f for f in RUN_FILES if os.path.exists(os.path.join(w, f))]
        if held:
            raise ConfigError(
                f"--workdir {w!r} holds a run ({', '.join(held)}) and there is no replica checkpoint "
                f"{checkpoint_dir!r}: --vectorize cannot resume it; use another --workdir or run "
                "without --vectorize"
            )


def _run(preps, workdirs, reps, ckpts, t_start):
    configs = [p.config for p in preps]
    config, prep, num = configs[0], preps[0], preps[0].fed_data.data.train.count.shape[0]
    keys = [jax.random.split(jax.random.key(c.seed)) for c in configs]
    init_keys, run_keys = jnp.stack([k[0] for k in keys]), jnp.stack([k[1] for k in keys])
    per_seed = "{seed}" in config.init_params  # each replica's own starting weights
    params = R.stack([p.initial_params for p in preps]) if per_seed else prep.initial_params
    template = jax.device_get(jax.jit(lambda k, p: reps.init(k, p, num, per_seed))(init_keys, params))
    plains = [to_plain(c) for c in configs]
    runner = ReplicaRunner(reps, prep.fed_data.data, run_keys, ckpts, plains, config.algorithm)
    return execute(runner, preps, workdirs, template, True, t_start)
