"""One run: `train_and_evaluate(config, workdir)`.

Builds the run's runner (`runners.DeviceRunner`: its algorithm sharded over the
devices, blocks of rounds compiled ahead of time and run under
`jax.transfer_guard("disallow")`; with `client_storage="host"`, `runners.HostRunner`:
the clients in host memory and each round's participants moved to one device,
pfljax.runtime.offload) and hands it to the one run loop, `loop.execute`, which
evaluates every `eval_every` rounds and at the last, writes the outputs as the run
goes, and checkpoints (orbax) every `checkpoint_every` rounds and at the last.
Rerunning on the same workdir resumes from the latest checkpoint and ends with the
same numbers as an uninterrupted run; a checkpoint of a different config is refused
(ConfigError) before training.
"""

from __future__ import annotations

import os
import time

import jax

from pfljax.experiment.checkpoint import Checkpoints
from pfljax.experiment.config import data_title, prepare, to_plain  # noqa: F401  (data_title: compare)
from pfljax.experiment.loop import MEMORY_HINT, execute, write_run_files  # noqa: F401  (re-exported)
from pfljax.experiment.outputs import read_json
from pfljax.experiment.reports import (  # noqa: F401  (re-exported: compare, partition_main, tests)
    STATUS_BUDGET,
    STATUS_COMPLETED,
    STATUS_DIVERGED,
    best_window_mean,
)
from pfljax.experiment.runners import EVAL_STREAM, DeviceRunner, HostRunner, eval_key  # noqa: F401
from pfljax.experiment.workdir import claim
from pfljax.runtime.sharding import shard_algorithm


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


def initial_state(algorithm, key, num: int, host: bool, params=None):
    """The algorithm's initial state for `num` clients (from the starting variables
    `params` if given), on the host (numpy); with host storage computed on the CPU,
    so that C clients' rows never go to an accelerator."""
    if not host:
        return jax.device_get(algorithm.init(key, params, num))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return jax.device_get(algorithm.init(key, params, num))


def _run(prep, workdir: str, ckpts: Checkpoints, progress, t_start) -> dict:
    num = prep.fed_data.data.train.count.shape[0]
    host_storage = prep.settings.placement.storage == "host"
    init_key, run_key = jax.random.split(jax.random.key(prep.settings.seed))
    plain = to_plain(prep.config)  # config.json and the checkpoints' record of the run
    template = initial_state(prep.algorithm, init_key, num, host_storage, prep.initial_params)
    if host_storage:
        runner = HostRunner(prep, ckpts, plain, run_key)
    else:
        runner = DeviceRunner(prep, shard_algorithm(prep.algorithm, prep.mesh, num), ckpts, plain, run_key)
    return execute(runner, [prep], [workdir], template, progress, t_start)[0]


def load_summary(workdir: str) -> dict:
    return read_json(os.path.join(workdir, "summary.json"))
