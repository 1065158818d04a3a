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
from absl import logging

from pfljax import algorithms
from pfljax.experiment.checkpoint import Checkpoints, check_config
from pfljax.experiment.config import (
    ConfigError,
    _tuples,
    make_client_map,
    make_local,
    make_privacy,
    prepare,
    to_plain,
)
from pfljax.experiment.loop import Program, Replica, compile_block, finish, new_host, run_loop, write_summary
from pfljax.experiment.train import EVAL_STREAM, eval_key, write_run_files
from pfljax.experiment.workdir import claim
from pfljax.runtime import replicas as R
from pfljax.runtime.blocks import all_finite, make_block

TOP_LEVEL = ("learning_rate",)  # top-level fields a grid may vary (they enter through make_local)
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")


class _Override:
    """A config view with some fields replaced (by traced values)."""

    def __init__(self, base, **fields):
        self._base, self._fields = base, fields

    def __getattr__(self, name):
        return self._fields[name] if name in self._fields else getattr(self._base, name)


def grid_target(config, option: str) -> str:
    """'' for a top-level field, else the algorithm whose numeric option `option` is; ConfigError otherwise.

    Any scalar option with a declared domain (`pfljax.algorithms.domains`) may be a
    grid's. As one program (`train_replicas`) only float options can vary: an
    integer option is refused there (`make_build`), and whether a float option's
    build path traces is tried (`pfljax.runtime.replicas.check_varying`).
    """
    if option in TOP_LEVEL:
        return ""
    name = config.algorithm
    options = config[name] if name in config else {}
    domains, value = algorithms.domains(name), options.get(option)
    if option in domains and isinstance(value, int | float) and not isinstance(value, bool):
        return name
    if option in options:
        raise ConfigError(
            f"--grid={option}: config.{name}.{option}={value!r} is not a number; "
            "it cannot vary inside one program"
        )
    floats = sorted(k for k, d in domains.items() if not d.integer and isinstance(options.get(k), float))
    raise ConfigError(
        f"--grid={option}: not a float option of {name} nor one of {list(TOP_LEVEL)}; "
        f"{name}'s float options: {floats}"
    )


def make_build(config, prep, grid_names: Sequence[str]):
    """build(**{option: scalar}) -> the Algorithm of `config` with those options replaced.

    ConfigError for an integer option (`pfljax.algorithms.domains`): a grid's value is
    a traced float scalar, which a count or a shape cannot be.
    """
    name = config.algorithm
    domains = algorithms.domains(name)
    for option in grid_names:
        if option not in TOP_LEVEL and domains[option].integer:
            raise ConfigError(
                f"--grid={option}: config.{name}.{option} is an integer option: it cannot vary inside one "
                "program (its values are traced floats); run them as separate runs (without --vectorize)"
            )
    options = _tuples(to_plain(config[name])) if name in config else {}
    privacy = make_privacy(config)
    if privacy is not None:
        options["privacy"] = privacy
    cmap = make_client_map(config)

    def build(**hyper):
        top = {k: v for k, v in hyper.items() if k in TOP_LEVEL}
        local = make_local(_Override(config, **top), prep.fed_data.task)
        opts = {**options, **{k: v for k, v in hyper.items() if k not in TOP_LEVEL}}
        return algorithms.get(name).build(
            prep.model, local, clients_per_round=config.clients_per_round or None, client_map=cmap, **opts
        )

    return build


def _check_inputs(configs, workdirs, grid_names):
    first = configs[0]
    ignore = {"seed", "rounds", "eval_every", "checkpoint_every", *grid_names}
    base = {k: v for k, v in _flat(to_plain(first)).items() if k.split(".")[-1] not in ignore}
    for c in configs[1:]:
        other = {k: v for k, v in _flat(to_plain(c)).items() if k.split(".")[-1] not in ignore}
        if other != base:
            differ = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise ConfigError(
                f"replicas must differ only by seed and {list(grid_names)}; they differ in {differ}"
            )
        for field in ("rounds", "eval_every", "checkpoint_every"):
            if c[field] != first[field]:
                raise ConfigError(f"replicas must share config.{field}")
    seeds = {c.seed for c in configs}
    if len(seeds) > 1 and first.data_seed < 0:
        raise ConfigError(
            f"--vectorize runs seeds {sorted(seeds)} on one shared partition, but config.data_seed=-1 "
            "gives each seed its own: set --config.data_seed=<n> (>= 0), or run without --vectorize"
        )
    if first.num_devices not in (0, 1):
        raise ConfigError(f"--vectorize runs on one device; got config.num_devices={first.num_devices}")
    if len(set(map(os.path.abspath, workdirs))) != len(workdirs):
        raise ConfigError("replicas need distinct workdirs")


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "model_kwargs":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


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
    _check_inputs([p.config for p in preps], workdirs, grid)
    reps = _replicas(preps, grid, strategy, memory_limit)
    _check_fresh_workdirs(checkpoint_dir, workdirs)
    if dry_run:
        return None
    ckpts = Checkpoints(checkpoint_dir)
    try:
        return _run(preps, workdirs, reps, ckpts, t_start)
    finally:
        ckpts.close()


def _option(config, option):
    return float(config[option] if option in TOP_LEVEL else config[config.algorithm][option])


def _replicas(preps, grid, strategy, memory_limit) -> R.Replicas:
    """The Replicas of the preps' configs (a grid over `grid`, or seeds), memory checked."""
    config, prep, count = preps[0].config, preps[0], len(preps)
    num = prep.fed_data.data.train.count.shape[0]
    if grid:
        values = {o: [_option(p.config, o) for p in preps] for o in grid}
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


def _restore(ckpts, configs, plains, workdirs, template):
    """(start round, stacked states, per-replica host totals): from the newest
    checkpoint that restores, or fresh."""

    def check(step, saved):
        if len(saved["configs"]) != len(configs):
            held = len(saved["configs"])
            raise ConfigError(f"{ckpts.directory!r}: a checkpoint of {held} replicas, not {len(configs)}")
        for s, p, w in zip(saved["configs"], plains, workdirs):
            check_config(s, p, w)
        if configs[0].rounds < step:
            raise ConfigError(f"config.rounds={configs[0].rounds} is below round {step} of the checkpoint")

    start, states, saved = ckpts.restore_latest(template, check)
    return (start, states, saved["replicas"]) if start else (0, template, [new_host() for _ in configs])


def replicas_program(reps: R.Replicas, data, run_keys, ckpts, plains) -> Program:
    """The Program of R replicas: the round and evaluation mapped over R, one device."""
    eval_bases = jax.vmap(lambda k: jax.random.fold_in(k, EVAL_STREAM))(run_keys)

    def evaluate(states, data, keys, r):
        return reps.evaluate(states, data, jax.vmap(lambda k: eval_key(k, r))(keys))

    def block_for(length):
        return jax.jit(make_block(reps.round, evaluate, jax.vmap(all_finite), length), donate_argnums=0)

    def save(r, states, hosts):
        ckpts.save(r, jax.device_get(states), {"replicas": hosts, "configs": plains})

    def final(states, r):
        host_states, keys = jax.device_get((states, jax.vmap(lambda k: eval_key(k, r))(eval_bases)))
        return [(R.take(host_states, i), reps.algorithm(i), R.take(keys, i)) for i in range(reps.count)]

    def evaluate_at(states, r):
        return jax.device_get(jax.jit(evaluate)(states, data, eval_bases, r))

    return Program(reps.count, block_for, (data, run_keys, eval_bases), R.take, save, evaluate_at, final)


def _run(preps, workdirs, reps, ckpts, t_start):
    configs = [p.config for p in preps]
    config, prep, num = configs[0], preps[0], preps[0].fed_data.data.train.count.shape[0]
    plains = [to_plain(c) for c in configs]
    keys = [jax.random.split(jax.random.key(c.seed)) for c in configs]
    init_keys, run_keys = jnp.stack([k[0] for k in keys]), jnp.stack([k[1] for k in keys])
    per_seed = "{seed}" in config.init_params  # each replica's own starting weights
    params = R.stack([p.initial_params for p in preps]) if per_seed else prep.initial_params
    template = jax.device_get(jax.jit(lambda k, p: reps.init(k, p, num, per_seed))(init_keys, params))
    start, states, hosts = _restore(ckpts, configs, plains, workdirs, template)
    for line in prep.notes:
        logging.info("%s", line)
    replicas = []
    for c, p, w, host, plain in zip(configs, preps, workdirs, hosts, plains):
        replicas.append(Replica(c, p, w, host, start))
        write_run_files(w, plain, p, c)
    states, data = jax.device_put((states, prep.fed_data.data))
    program = replicas_program(reps, data, run_keys, ckpts, plains)
    compiled, length, compile_seconds = compile_block(program, config, states, start)
    logging.info(
        "%s: %d replicas, rounds %d..%d as one program (blocks of up to %d rounds), compiled in %.1f s",
        config.algorithm, len(configs), start + 1, config.rounds, length, compile_seconds,
    )  # fmt: skip
    states, end, eps = run_loop(program, compiled, length, replicas, states, start)
    finals = program.final(states, end)
    summaries = []
    for rep, final in zip(replicas, finals):
        summary = finish(rep, final, end, eps, compile_seconds, t_start, 1)
        summary["replicas"] = len(configs)
        summaries.append(write_summary(rep, summary))
    return summaries
