"""Clients in host memory: only a round's participants on the device.

With host storage (`config.client_storage="host"`) every client's data and the
rows of every `client_*` state field stay in host memory (numpy), and a round
moves only its K participants to the device:

    ids  = participant_ids(key, rounds)          # the round's own sampling, known ahead
    view = rows ids of the state and the data    # [K, ...]; ClientData.view: ids, C
    view, metrics = algorithm.round(view, view data, key)   # the algorithm's round, unchanged
    rows[ids] = the view's client rows           # back into host memory

`participants` (pfljax.core.round) takes every row of a view as a participant and
keys row i by its client id ids[i], as the all-on-device round keys that client,
so both give the same numbers (tests/runtime/test_offload.py, every algorithm that
allows host storage). Device memory follows K, not C: the view (the
participants' data rows and state rows), the rest of the state, the round's
temporaries, and the next round's data rows, prefetched (gathered on the host
and put on the device) while the current round runs (JAX's asynchronous
dispatch). The state rows are gathered after the previous round's rows are
written back (a client may take part in both); they are K rows, the data K
clients' windows. The participants of every round of a block are sampled at its
start, in one dispatch.

A round is still one compiled program, but each round is one dispatch: its
gather and scatter are host events, so a block of L rounds (pfljax.runtime.blocks's
BlockOut, the run loop's unit) is L dispatches, with evaluation where it falls,
over all C clients in chunks of K clients (`eval_clients`).

Which algorithms: those whose round reads and writes only its participants' rows
(per-client state of O(parameters)). A module whose round cannot declares why in
`HOST_STORAGE_REFUSED` (`pfljax.algorithms.host_storage_refusal`).

The host rows are the one mutable thing here: `scatter` writes a round's rows
into them in place (the rows of 1,000,000 clients are not copied every round).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core.clients import is_client_leaf, round_keys
from pfljax.core.sampling import check_clients_per_round, sample_clients
from pfljax.core.types import Algorithm, ClientArrays, ClientData, ClientPool, ClientView
from pfljax.runtime.blocks import BlockOut, all_finite

PyTree = Any
STORAGES = ("device", "host")  # where the clients live: config.client_storage


class Layout(NamedTuple):
    """A state's tree structure and which of its leaves are `client_*` rows."""

    treedef: Any
    client: tuple[bool, ...]

    @classmethod
    def of(cls, state: PyTree) -> Layout:
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        return cls(treedef, tuple(is_client_leaf(path) for path, _ in flat))

    def split(self, state: PyTree) -> tuple[list, list]:
        """(the `client_*` leaves, the other leaves) of `state`."""
        leaves = self.treedef.flatten_up_to(state)
        return [x for x, c in zip(leaves, self.client) if c], [
            x for x, c in zip(leaves, self.client) if not c
        ]

    def merge(self, client: list, other: list) -> PyTree:
        client, other = iter(client), iter(other)
        return self.treedef.unflatten([next(client) if c else next(other) for c in self.client])


class HostState(NamedTuple):
    """A run's state with its clients in host memory.

    Attributes:
      rows: the `client_*` leaves [C, ...] as numpy arrays (written in place by
        `Offload.scatter`).
      other: the other leaves (global state, round counter), on the device.
    """

    rows: tuple
    other: tuple


def gather_rows(arrays: ClientPool | ClientArrays, ids: np.ndarray) -> ClientPool | ClientArrays:
    """Clients `ids`' rows of host arrays, as the same layout for len(ids) clients. A
    pool's view lays client i's window (its n_max rows from its offset, as
    `ClientPool.client` reads them) at i * n_max, so every value a round reads is
    the one it reads in the whole pool."""
    if isinstance(arrays, ClientPool):
        n = arrays.n_max
        rows = (np.asarray(arrays.offset)[ids][:, None] + np.arange(n)).reshape(-1)
        return arrays.replace(
            x=np.asarray(arrays.x)[rows],
            y=np.asarray(arrays.y)[rows],
            offset=np.arange(len(ids), dtype=np.int32) * n,
            count=np.asarray(arrays.count)[ids],
        )
    return jax.tree.map(lambda a: np.asarray(a)[ids], arrays)


def gather_data(data: ClientData, ids: np.ndarray) -> ClientData:
    """The view of clients `ids` of all C (host numpy): their train and test rows, their ids."""
    num = int(np.shape(data.train.count)[0])
    view = ClientView(np.asarray(ids, np.int32), num)
    return ClientData(gather_rows(data.train, ids), gather_rows(data.test, ids), view)


class Offload:
    """An algorithm's rounds and evaluation with its clients in host memory.

    Args:
      algorithm: the Algorithm (built with `clients_per_round`).
      data: every client's ClientData (moved to host numpy here).
      clients_per_round: K, as given to the algorithm's build (None: all C).
      template: a state of the algorithm for C clients (arrays or ShapeDtypeStructs).
      eval_clients: clients per evaluation dispatch (None: K, so that evaluation's
        device memory follows K too; the last chunk repeats the last client).
    """

    def __init__(
        self,
        algorithm: Algorithm,
        data: ClientData,
        clients_per_round: int | None,
        template: PyTree,
        eval_clients: int | None = None,
    ):
        self.algorithm = algorithm
        self.data = jax.device_get(ClientData(data.train, data.test))
        self.num = int(np.shape(self.data.train.count)[0])
        self.k = check_clients_per_round(clients_per_round, self.num)
        self.eval_clients = min(eval_clients or self.k, self.num)
        self.layout = Layout.of(template)
        self._round = jax.jit(self._step)  # no donation: the view's global leaves outlive a bad round
        self._evaluate = jax.jit(algorithm.evaluate)
        self._out_info = {}  # length -> BlockOut of ShapeDtypeStructs
        num, k = self.num, self.k
        self._ids = jax.jit(jax.vmap(lambda key, r: sample_clients(round_keys(key, r)[0], num, k), (None, 0)))

    def _step(self, view, data, key):
        new, metrics = self.algorithm.round(view, data, key)
        return new, metrics, all_finite(new) & jnp.isfinite(metrics.get("train_loss", 0.0))

    # State: host rows and device leaves.
    def from_state(self, state: PyTree) -> HostState:
        """A full state (C rows) -> HostState: client rows copied to writable numpy."""
        rows, other = self.layout.split(state)
        return HostState(tuple(np.array(r) for r in rows), tuple(jax.device_put(x) for x in other))

    def to_state(self, hs: HostState) -> PyTree:
        """The full state on the host (numpy client rows): checkpoints and final reports."""
        return self.layout.merge(list(hs.rows), jax.device_get(list(hs.other)))

    def view(self, hs: HostState, ids: np.ndarray) -> PyTree:
        """The state of clients `ids` on the device: their rows, the other leaves."""
        return self.layout.merge([jax.device_put(r[ids]) for r in hs.rows], list(hs.other))

    def scatter(self, hs: HostState, ids: np.ndarray, rows: list, other: list) -> HostState:
        """`rows` (host) written into clients `ids`' rows, in place; `other` the new device leaves."""
        for store, new in zip(hs.rows, rows):
            store[ids] = new
        return HostState(hs.rows, tuple(other))

    def participant_ids(self, key: jax.Array, rounds: np.ndarray) -> np.ndarray:
        """[len(rounds), K] the participants of the rounds whose counter (state.round
        before the round) is `rounds`: the round's own sampling, ahead of time."""
        return np.asarray(jax.device_get(self._ids(key, jax.device_put(np.asarray(rounds, np.int32)))))

    def prefetch(self, ids: np.ndarray) -> ClientData:
        """Clients `ids`' data put on the device (asynchronously)."""
        return jax.device_put(gather_data(self.data, ids))

    # Rounds and evaluation.
    def round(self, hs: HostState, key: jax.Array, ids: np.ndarray, data: ClientData, step=None):
        """Dispatches one round on the view of `ids` (data: `prefetch(ids)`; `step`: the
        compiled round of `lower`, else jitted here); returns its device outputs (new
        view, metrics, finite) without waiting."""
        return (step or self._round)(self.view(hs, ids), data, key)

    def evaluate(self, hs: HostState, key: jax.Array) -> dict:
        """Per-client metrics [C] (host numpy), `eval_clients` clients per dispatch; a
        chunk's results come back while the next chunk runs."""
        outs, running, e = [], None, self.eval_clients
        for start in range(0, self.num, e):
            ids = np.minimum(np.arange(start, start + e), self.num - 1)
            chunk = self._evaluate(self.view(hs, ids), self.prefetch(ids), key)
            if running is not None:
                outs.append(jax.device_get(running))
            running = chunk
        outs.append(jax.device_get(running))
        return {name: np.concatenate([o[name] for o in outs])[: self.num] for name in outs[0]}

    def out_info(self, hs: HostState, key: jax.Array, length: int) -> BlockOut:
        """The BlockOut of `length` rounds as ShapeDtypeStructs (metrics [L, ...],
        per-client evaluation [L, C], flags [L]); traced once per length."""
        if length not in self._out_info:
            self._out_info[length] = self._trace_out_info(hs, key, length)
        return self._out_info[length]

    def _trace_out_info(self, hs: HostState, key: jax.Array, length: int) -> BlockOut:
        ids = np.arange(self.k)
        view, data = self.view(hs, ids), gather_data(self.data, ids)
        _, metrics, _ = jax.eval_shape(self._step, view, data, key)
        one = jax.eval_shape(self.algorithm.evaluate, view, data, key)
        stacked = lambda shape, dtype: jax.ShapeDtypeStruct((length, *shape), dtype)  # noqa: E731
        return BlockOut(
            {n: stacked(s.shape, s.dtype) for n, s in metrics.items()},
            {n: stacked((self.num, *s.shape[1:]), s.dtype) for n, s in one.items()},
            *(stacked((), bool) for _ in range(5)),
        )

    def lower(self, hs: HostState, key: jax.Array):
        """The round lowered for the view of K clients (its memory_analysis follows K)."""
        ids = np.arange(self.k)
        return self._round.lower(self.view(hs, ids), jax.device_put(gather_data(self.data, ids)), key)

    def block(
        self, hs: HostState, key, eval_key, schedule, length: int, evaluate_at: Callable, step=None
    ) -> tuple[HostState, BlockOut]:
        """Rounds start+1 .. stop of `schedule` = [start, stop, eval_every, last], one
        dispatch each, the next round's data prefetched while one runs; evaluation
        `evaluate_at(hs, eval_key, r)` after round r when r % eval_every == 0 or r == last.
        Returns the HostState and pfljax.runtime.blocks's BlockOut over `length` rounds
        (host numpy). A round that is not finite is not written back; the block stops
        there (its `ok` False), keeping the state of the round before."""
        start, stop, every, last = (int(v) for v in np.asarray(schedule))
        out = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self.out_info(hs, key, length))
        todo = max(stop - start, 0)
        ids = self.participant_ids(key, np.arange(start, start + todo)) if todo else None
        pending = self.prefetch(ids[0]) if todo else None
        for i in range(todo):
            r = start + i + 1
            new, metrics, finite = self.round(hs, key, ids[i], pending, step)
            if i + 1 < todo:
                pending = self.prefetch(ids[i + 1])  # while round r runs
            client, other = self.layout.split(new)
            client, metrics, finite = jax.device_get((client, metrics, finite))
            out.ran[i], out.state_finite[i] = True, bool(finite)
            for n, v in metrics.items():
                out.metrics[n][i] = v
            if not finite:
                break
            before, hs_before = [rows[ids[i]] for rows in hs.rows], hs
            hs = self.scatter(hs, ids[i], client, other)
            out.eval_finite[i] = True
            if r % every == 0 or r == last:
                evaluation = evaluate_at(hs, eval_key, r)
                out.evaluated[i] = True
                for n, v in evaluation.items():
                    out.evaluation[n][i] = v
                count, loss = np.asarray(evaluation["count"]), np.asarray(evaluation["loss"])
                out.eval_finite[i] = not np.any((count > 0) & ~np.isfinite(loss))
                if not out.eval_finite[i]:  # keep the round before, as a compiled block does
                    hs = self.scatter(hs_before, ids[i], before, list(hs_before.other))
                    break
            out.ok[i] = True
        return hs, out


class HostBlock(NamedTuple):
    """`Offload.block` of `length` rounds with the interface of a jitted block that the
    run loop compiles ahead of time (pfljax.experiment.loop.compile_block): `lower(state,
    data, key, eval_key, schedule)` -> `.out_info`, `.compile()` -> a callable with the
    block's signature and the compiled round's `memory_analysis()`. `data` is unused
    (the clients' data are the Offload's, in host memory)."""

    offload: Offload
    length: int
    evaluate_at: Callable

    def lower(self, hs: HostState, data, key, eval_key, schedule) -> LoweredHostBlock:
        del data, eval_key, schedule
        return LoweredHostBlock(
            self, self.offload.lower(hs, key), (None, self.offload.out_info(hs, key, self.length))
        )


class LoweredHostBlock(NamedTuple):
    block: HostBlock
    round: Any  # jax.stages.Lowered of the round on K clients
    out_info: tuple

    def compile(self) -> CompiledHostBlock:
        return CompiledHostBlock(self.block, self.round.compile())


class CompiledHostBlock(NamedTuple):
    block: HostBlock
    round: Any  # jax.stages.Compiled

    def __call__(self, hs: HostState, data, key, eval_key, schedule) -> tuple[HostState, BlockOut]:
        del data
        b = self.block
        return b.offload.block(hs, key, eval_key, schedule, b.length, b.evaluate_at, self.round)

    def memory_analysis(self):
        return self.round.memory_analysis()
