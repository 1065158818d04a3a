"""One run: `train_and_evaluate(config, workdir)`.

Builds the run's `Program` (its algorithm sharded over the devices, blocks of
rounds compiled ahead of time and run under `jax.transfer_guard("disallow")`;
with `client_storage="host"`, `host_program`: the clients in host memory and
each round's participants moved to one device, pfljax.runtime.offload) and hands
it to the one run loop, `pfljax.experiment.loop.run_loop`, which evaluates
every `eval_every` rounds and at the last, writes the outputs as the run goes,
and checkpoints (orbax) every `checkpoint_every` rounds and at the
last. Rerunning on the same workdir resumes from the latest checkpoint and ends
with the same numbers as an uninterrupted run; a checkpoint of a different
config is refused (ConfigError) before training.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from pfljax.experiment import plots
from pfljax.experiment.checkpoint import Checkpoints, check_config
from pfljax.experiment.config import ConfigError, prepare, to_plain
from pfljax.experiment.loop import (  # noqa: F401  (re-exported: compare, partition_main, tests)
    STATUS_BUDGET,
    STATUS_COMPLETED,
    STATUS_DIVERGED,
    Program,
    Replica,
    best_window_mean,
    block_length,
    compile_block,
    data_title,
    finish,
    new_host,
    run_loop,
    write_summary,
)
from pfljax.experiment.outputs import read_json, write_json
from pfljax.experiment.workdir import claim
from pfljax.runtime.blocks import all_finite, make_block
from pfljax.runtime.memory import check_fits, host_memory_report, memory_report
from pfljax.runtime.offload import HostBlock, Offload, gather_data
from pfljax.runtime.sharding import shard_algorithm, state_shardings

MEMORY_HINT = (
    "lower --config.num_clients or --config.samples_per_client, pick a smaller --config.model, "
    "spread the clients over more devices (--config.num_devices), or keep them in host memory "
    "(--config.client_storage=host, with clients_per_round)"
)
EVAL_STREAM = 0xE7A1  # evaluation keys: fold_in(fold_in(run_key, EVAL_STREAM), round)


def eval_key(base: jax.Array, round_index) -> jax.Array:
    """The key of the evaluation after round `round_index` (the same on resume)."""
    return jax.random.fold_in(base, round_index)


def _host(state):
    if jax.process_count() > 1:  # multi-host: every process gets the full arrays
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        return multihost_utils.process_allgather(state, tiled=True)
    return jax.device_get(state)


def write_run_files(workdir: str, plain: dict, prep, config) -> None:
    """config.json, data.json and partition.png of a run (before its first round)."""
    write_json(os.path.join(workdir, "config.json"), plain)
    write_json(os.path.join(workdir, "data.json"), prep.fed_data.summary)
    plots.plot_partition(prep.fed_data.summary, os.path.join(workdir, "partition.png"), data_title(config))


def train_and_evaluate(config, workdir: str, *, fed_data=None, progress: bool = True) -> dict:
    """Runs (or resumes) the experiment described by `config`, writing into `workdir`.

    Args:
      config: ConfigDict with the fields of `pfljax.experiment.config.base_config()`.
      workdir: output directory (created); resumed from if it holds checkpoints.
      fed_data: prebuilt FederatedData to use instead of building it from config.
      progress: show a tqdm progress bar on a terminal; elsewhere (a log file,
        nohup, a batch scheduler) one absl log line per block with an evaluation.

    Returns:
      The summary dict also written to workdir/summary.json. Its `status` is
      "completed", or "diverged" when a round gave a non-finite train loss or
      parameters: the run stopped there (`diverged_round`, `divergence`: the
      message; the final_* numbers are None), keeping what it had written
      (metrics up to the round before, checkpoints, plots).

    Raises:
      ConfigError: invalid config, a workdir that is not a writable directory,
        or one holding another config's checkpoint; raised before training.
    """
    t_start = time.perf_counter()
    with claim(workdir, lock=jax.process_index() == 0):
        prep = prepare(config, fed_data)
        ckpts = Checkpoints(os.path.join(workdir, "checkpoints"))
        try:
            return _run(prep, workdir, ckpts, progress, t_start)
        finally:
            ckpts.close()


def _restore(config, plain, ckpts, template, workdir):
    """(start round, state, host totals): from the newest checkpoint that restores, or fresh."""

    def check(step, host):
        check_config(host["config"], plain, workdir)
        if config.rounds < step:
            raise ConfigError(
                f"config.rounds={config.rounds} is below round {step} of the checkpoint in {workdir!r}; "
                f"give --config.rounds >= {step} or another --workdir"
            )

    start, state, host = ckpts.restore_latest(template, check)
    return start, state, host if start else new_host()


def single_program(prep, run, ckpts, plain, run_key, state) -> Program:
    """The Program of one run: `run` (a ShardedAlgorithm) from `state` (placed)."""
    mesh = prep.mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = (state_shardings(state, mesh), replicated)
    eval_base = run.place_key(jax.random.fold_in(run_key, EVAL_STREAM))
    data = run.place_data(prep.fed_data.data, replicate=prep.config.replicate_data)

    def evaluate(state, data, key, r):
        return run.evaluate(state, data, eval_key(key, r))

    def block_for(length):
        block = make_block(run.round, evaluate, all_finite, length)
        return jax.jit(block, out_shardings=shardings, donate_argnums=0)

    def save(r, state, hosts):
        ckpts.save(r, _host(run.unplace_state(state)), {**hosts[0], "config": plain})

    def final(state, r):
        return [(_host(run.unplace_state(state)), prep.algorithm, jax.device_get(eval_key(eval_base, r)))]

    def evaluate_at(state, r):
        key = eval_key(eval_base, r)
        return jax.device_get(jax.jit(run.evaluate, out_shardings=replicated)(state, data, key))

    return Program(
        1,
        block_for,
        (data, run.place_key(run_key), eval_base),
        lambda tree, r: tree,
        save,
        evaluate_at,
        final,
        run.place_key,
    )


def host_program(prep, ckpts, plain, run_key, state) -> tuple[Program, object, Offload]:
    """The Program of one run with its clients in host memory (pfljax.runtime.offload):
    blocks of rounds, one dispatch a round. Returns (Program, HostState, Offload)."""
    config = prep.config
    offload = Offload(prep.algorithm, prep.fed_data.data, config.clients_per_round or None, state)
    hs = offload.from_state(state)
    key = jax.device_put(run_key)
    eval_base = jax.device_put(jax.random.fold_in(run_key, EVAL_STREAM))
    fold = jax.jit(eval_key)

    def evaluate_at(hs, base, r):
        return offload.evaluate(hs, fold(base, jax.device_put(np.int32(r))))

    def save(r, hs, hosts):
        ckpts.save(r, offload.to_state(hs), {**hosts[0], "config": plain})

    def final(hs, r):
        return [(offload.to_state(hs), prep.algorithm, jax.device_get(eval_key(eval_base, r)))]

    program = Program(
        1,
        lambda length: HostBlock(offload, length, evaluate_at),
        (None, key, eval_base),
        lambda tree, r: tree,
        save,
        lambda hs, r: evaluate_at(hs, eval_base, r),
        final,
        np.asarray,  # the schedule stays on the host: the host block reads it
    )
    return program, hs, offload


def initial_state(algorithm, key, num: int, host: bool, params=None):
    """The algorithm's initial state for `num` clients (from the starting variables
    `params` if given), on the host (numpy); with host storage computed on the CPU,
    so that C clients' rows never go to an accelerator."""
    if not host:
        return jax.device_get(algorithm.init(key, params, num))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return jax.device_get(algorithm.init(key, params, num))


def _run(prep, workdir: str, ckpts: Checkpoints, progress, t_start):
    config, plain = prep.config, to_plain(prep.config)
    primary = jax.process_index() == 0
    num = prep.fed_data.data.train.count.shape[0]
    host_storage = config.client_storage == "host"
    run = shard_algorithm(prep.algorithm, prep.mesh, num)
    init_key, run_key = jax.random.split(jax.random.key(config.seed))
    template = initial_state(prep.algorithm, init_key, num, host_storage, prep.initial_params)
    start, state, host = _restore(config, plain, ckpts, template, workdir)
    for line in prep.notes:  # every check has passed: say what this run is
        logging.info("%s", line)
    for line in prep.warnings:
        logging.warning("%s", line)
    if start:
        logging.info(
            "%s: resumed from round %d of %d (checkpoint in %s)",
            config.algorithm, start, config.rounds, os.path.join(workdir, "checkpoints"),
        )  # fmt: skip
    rep = Replica(config, prep, workdir, host, start, primary)
    if primary:
        write_run_files(workdir, plain, prep, config)
    if host_storage:
        program, state, offload = host_program(prep, ckpts, plain, run_key, state)
        compiled, length, compile_seconds = compile_block(program, config, state, start)
        ids = np.arange(offload.k)
        view = (offload.view(state, ids), gather_data(offload.data, ids))
        memory = host_memory_report(offload.data, state.rows, *view, compiled)
    else:
        state = run.place_state(state)
        program = single_program(prep, run, ckpts, plain, run_key, state)
        compiled, length, compile_seconds = compile_block(program, config, state, start)
        memory = memory_report(state, program.args[0], compiled)
    try:
        check_fits(memory, MEMORY_HINT)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if start < config.rounds:
        logging.info(
            "%s: rounds %d..%d on %d %s device(s), blocks of up to %d rounds%s, compiled in %.1f s",
            config.algorithm, start + 1, config.rounds, prep.mesh.size, jax.default_backend(), length,
            " (clients in host memory: one dispatch a round)" if host_storage else "", compile_seconds,
        )  # fmt: skip
    state, end, eps = run_loop(program, compiled, length, [rep], state, start, progress)
    summary = finish(rep, program.final(state, end)[0], end, eps, compile_seconds, t_start, prep.mesh.size)
    summary["memory"] = memory
    return write_summary(rep, summary)


def load_summary(workdir: str) -> dict:
    return read_json(os.path.join(workdir, "summary.json"))
