"""The three ways a run's rounds execute, behind one interface that `loop.run_loop` drives.

- `DeviceRunner`: one run, every client on the device(s), the client axis sharded over the
  mesh (`pfljax.runtime.sharding`); blocks of rounds run under `jax.transfer_guard("disallow")`.
- `HostRunner`: one run, the clients in host memory and each round's participants moved to
  one device (`pfljax.runtime.offload`); one dispatch a round.
- `ReplicaRunner`: R runs of one algorithm (seeds, grid points) as one program on one device
  (`pfljax.runtime.replicas`).

A runner holds what its blocks take (`args`: data, run key, evaluation key), places the
state where its blocks want it (`to_device`), brings it back for a checkpoint (`to_host`),
and says what a checkpoint holds besides the state (`pack` / `unpack`: per run its host
totals and its config as config.json has it).
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pfljax.runtime import replicas as R
from pfljax.runtime.blocks import all_finite, make_block
from pfljax.runtime.memory import host_memory_report, memory_report
from pfljax.runtime.offload import HostBlock, Offload, gather_data
from pfljax.runtime.sharding import state_shardings

EVAL_STREAM = 0xE7A1  # evaluation keys: fold_in(fold_in(run_key, EVAL_STREAM), round)


def eval_key(base: jax.Array, round_index) -> jax.Array:
    """The key of the evaluation after round `round_index` (the same on resume)."""
    return jax.random.fold_in(base, round_index)


def gathered(state):
    """`state` on the host; in a multi-process run every process gets the full arrays."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        return multihost_utils.process_allgather(state, tiled=True)
    return jax.device_get(state)


class Runner(abc.ABC):
    """What `loop.run_loop` runs: one run (`count` 1) or `count` replicas of one algorithm.

    Attributes:
      count: the runs in the program.
      devices: the devices one run spreads over (the summary's `devices`).
      args: (data, run key, evaluation key) as the blocks take them.
      ckpts: the run's `checkpoint.Checkpoints`.
      plains: each run's config as config.json has it (checkpointed beside the state).
    """

    count = 1
    devices = 1

    def __init__(self, ckpts, plains: list):
        self.ckpts, self.plains = ckpts, plains
        self.args: tuple = ()

    def to_device(self, state):
        """The (host) state as the blocks take it."""
        return jax.device_put(state)

    def to_host(self, state):
        """The blocks' state as a checkpoint holds it (host arrays)."""
        return jax.device_get(state)

    @abc.abstractmethod
    def block_for(self, length: int):
        """The jitted `block(state, *args, schedule)` of blocks of `length` rounds."""

    def place(self, schedule: np.ndarray):
        """The [4] schedule as the block takes it."""
        return jax.device_put(schedule)

    def take(self, tree, r: int):
        """Replica r's part of a host tree of the block's outputs."""
        del r
        return tree

    @abc.abstractmethod
    def evaluate_at(self, state, r: int) -> dict:
        """Per-client metrics (host) after round r: for a run resumed at its last round."""

    @abc.abstractmethod
    def final(self, state, r: int) -> list[tuple[Any, Any, Any]]:
        """[(host state, algorithm, evaluation key)] per run, for the reports."""

    def memory(self, state, compiled) -> dict | None:
        """The memory report of the compiled block (None: checked before, `sweep`)."""
        del state, compiled
        return None

    def report(self) -> dict:
        """Entries every run's summary adds."""
        return {}

    @abc.abstractmethod
    def describe(self, start: int, rounds: int, length: int, compile_seconds: float) -> str:
        """The log line before the first block."""

    def pack(self, hosts: list) -> dict:
        """A checkpoint's host entry for the runs' host totals."""
        return {**hosts[0], "config": self.plains[0]}

    def unpack(self, saved: dict) -> tuple[list, list]:
        """(configs, host totals) per run of a checkpoint's host entry."""
        return [saved["config"]], [saved]

    def save(self, r: int, state, hosts: list) -> None:
        """The checkpoint of round r."""
        self.ckpts.save(r, self.to_host(state), self.pack(hosts))


class _OneRun(Runner):
    """What the two single-run runners share: the reports of one run of `prep`."""

    note = ""  # said in the log line after the block length

    def __init__(self, prep, ckpts, plain: dict, eval_base, args: tuple):
        super().__init__(ckpts, [plain])
        self.prep, self.devices, self.eval_base, self.args = prep, prep.mesh.size, eval_base, args
        self.memory_report: dict | None = None

    def final(self, state, r: int):
        return [(self.to_host(state), self.prep.algorithm, jax.device_get(eval_key(self.eval_base, r)))]

    def report(self) -> dict:
        return {"memory": self.memory_report}

    def describe(self, start: int, rounds: int, length: int, compile_seconds: float) -> str:
        return (
            f"{self.prep.settings.algorithm}: rounds {start + 1}..{rounds} on {self.devices} "
            f"{jax.default_backend()} device(s), blocks of up to {length} rounds{self.note}, compiled in "
            f"{compile_seconds:.1f} s"
        )


class DeviceRunner(_OneRun):
    """One run with every client on the device(s): `run` is the ShardedAlgorithm over `prep.mesh`."""

    def __init__(self, prep, run, ckpts, plain: dict, run_key):
        eval_base = run.place_key(jax.random.fold_in(run_key, EVAL_STREAM))
        data = run.place_data(prep.fed_data.data, replicate=prep.settings.placement.replicate_data)
        super().__init__(prep, ckpts, plain, eval_base, (data, run.place_key(run_key), eval_base))
        self.run, self.shardings = run, None
        self.replicated = NamedSharding(prep.mesh, PartitionSpec())

    def to_device(self, state):
        state = self.run.place_state(state)
        self.shardings = (state_shardings(state, self.prep.mesh), self.replicated)
        return state

    def to_host(self, state):
        return gathered(self.run.unplace_state(state))

    def evaluate(self, state, data, key, r):
        """The evaluation after round r inside a block."""
        return self.run.evaluate(state, data, eval_key(key, r))

    def block_for(self, length: int):
        block = make_block(self.run.round, self.evaluate, all_finite, length)
        return jax.jit(block, out_shardings=self.shardings, donate_argnums=0)

    def place(self, schedule: np.ndarray):
        return self.run.place_key(schedule)

    def evaluate_at(self, state, r: int) -> dict:
        key = eval_key(self.eval_base, r)
        evaluate = jax.jit(self.run.evaluate, out_shardings=self.replicated)
        return jax.device_get(evaluate(state, self.args[0], key))

    def memory(self, state, compiled) -> dict:
        self.memory_report = memory_report(state, self.args[0], compiled)
        return self.memory_report


class HostRunner(_OneRun):
    """One run with its clients in host memory (pfljax.runtime.offload): each round's
    participants moved to one device, the next round's prefetched; one dispatch a round."""

    note = " (clients in host memory: one dispatch a round)"

    def __init__(self, prep, ckpts, plain: dict, run_key):
        eval_base = jax.device_put(jax.random.fold_in(run_key, EVAL_STREAM))
        super().__init__(prep, ckpts, plain, eval_base, (None, jax.device_put(run_key), eval_base))
        self.offload, self._fold = None, jax.jit(eval_key)

    def to_device(self, state):
        k = self.prep.settings.placement.clients_per_round
        self.offload = Offload(self.prep.algorithm, self.prep.fed_data.data, k, state)
        return self.offload.from_state(state)

    def to_host(self, state):
        return self.offload.to_state(state)

    def _evaluate_host(self, hs, base, r):
        return self.offload.evaluate(hs, self._fold(base, jax.device_put(np.int32(r))))

    def block_for(self, length: int):
        return HostBlock(self.offload, length, self._evaluate_host)

    def place(self, schedule: np.ndarray):
        return np.asarray(schedule)  # the host block reads the schedule on the host

    def evaluate_at(self, state, r: int) -> dict:
        return self._evaluate_host(state, self.eval_base, r)

    def memory(self, state, compiled) -> dict:
        ids = np.arange(self.offload.k)
        view = (self.offload.view(state, ids), gather_data(self.offload.data, ids))
        self.memory_report = host_memory_report(self.offload.data, state.rows, *view, compiled)
        return self.memory_report


class ReplicaRunner(Runner):
    """R runs as one program on one device: the round and the evaluation mapped over R
    (`reps`, a `pfljax.runtime.replicas.Replicas`); `run_keys` [R] and `data` shared."""

    def __init__(self, reps: R.Replicas, data, run_keys, ckpts, plains: list, name: str):
        super().__init__(ckpts, plains)
        self.reps, self.count, self.name = reps, reps.count, name
        self.eval_bases = jax.vmap(lambda k: jax.random.fold_in(k, EVAL_STREAM))(run_keys)
        self.args = (jax.device_put(data), run_keys, self.eval_bases)

    def evaluate(self, states, data, keys, r):
        """The evaluation after round r inside a block (every replica)."""
        return self.reps.evaluate(states, data, jax.vmap(lambda k: eval_key(k, r))(keys))

    def block_for(self, length: int):
        block = make_block(self.reps.round, self.evaluate, jax.vmap(all_finite), length)
        return jax.jit(block, donate_argnums=0)

    def take(self, tree, r: int):
        return R.take(tree, r)

    def evaluate_at(self, state, r: int) -> dict:
        return jax.device_get(jax.jit(self.evaluate)(state, self.args[0], self.eval_bases, r))

    def final(self, state, r: int):
        keys = jax.vmap(lambda k: eval_key(k, r))(self.eval_bases)
        host_states, keys = jax.device_get((state, keys))
        return [(R.take(host_states, i), self.reps.algorithm(i), R.take(keys, i)) for i in range(self.count)]

    def report(self) -> dict:
        return {"replicas": self.count}

    def describe(self, start: int, rounds: int, length: int, compile_seconds: float) -> str:
        return (
            f"{self.name}: {self.count} replicas, rounds {start + 1}..{rounds} as one program "
            f"(blocks of up to {length} rounds), compiled in {compile_seconds:.1f} s"
        )

    def pack(self, hosts: list) -> dict:
        return {"replicas": hosts, "configs": self.plains}

    def unpack(self, saved: dict) -> tuple[list, list]:
        return saved["configs"], saved["replicas"]
