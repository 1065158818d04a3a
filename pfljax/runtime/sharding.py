"""The client axis sharded over devices: a 'clients' mesh axis, padding, a sharded client map.

Any Algorithm runs on several devices without change:

    mesh = client_mesh()                                   # all visible devices
    alg = <name>.build(model, local, client_map=ShardedMap(mesh), ...)
    run = shard_algorithm(alg, mesh, num_clients)
    state = run.place_state(alg.init(key, None, num_clients))
    data = run.place_data(fed_data.data)
    state, metrics = jax.jit(run.round)(state, data, key)

- Storage: every leaf under a `client_*` state field and every leaf of padded
  ClientArrays is a NamedSharding over the 'clients' axis; the rest is
  replicated, a ClientPool included (its rows are not laid out by client; as
  uint8 and unpadded it is ~C/n_max-fold smaller than padded float arrays). C is
  padded up to a multiple of the device count D (clients with count 0), as a
  sharded axis must divide evenly.
- The algorithm never sees the padding: `ShardedAlgorithm.round` slices the
  real C clients inside the jit, calls the algorithm's own round, and pads the
  new state again. Client sampling, weights and metrics are therefore exactly
  those of a single-device run; checkpoints (`unplace_state`) hold C rows and
  do not depend on D.
- Compute: `ShardedMap` is a client-mapping strategy (see
  `pfljax.core.clients`): it pads the K mapped rows to a multiple of D,
  reshapes them to [D, K/D] with the D axis sharded over 'clients', and
  vmaps over D the per-device strategy ("auto": lax.map on CPU, vmap on
  GPU/TPU) on each block; XLA's SPMD partitioner gives each device its block.
  (`lax.map` over the sharded axis alone runs the devices one after another;
  `vmap` alone is slow on CPU.) An explicit `jax.shard_map` (tried while
  building this module with a throwaway script; not kept as a benchmark) was
  no faster and failed for algorithms whose per-client function creates arrays
  with the outer mesh's sharding (FedEM, FedeRiCo, FedFomo, Per-FedAvg,
  pFedHN), so XLA partitions instead. Values the per-client function closes
  over (the full ClientData, global parameters) are gathered by XLA where
  needed, i.e. up to once per round; `place_data(..., replicate=True)` keeps
  the data on every device instead.

Multi-process (`jax.distributed.initialize()` before anything else; the
binaries' `--distributed` or `--coordinator_address`, `--num_processes`,
`--process_id`): `client_mesh` spans all processes' devices and the same code
runs on every process; `place_*` take the same host values on every process.
Tested with 2 CPU processes (tests/experiment/test_multiprocess.py); see BUILD.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pfljax.core.clients import ClientMap, as_client_map, is_client_leaf
from pfljax.core.types import Algorithm, ClientArrays, ClientData, ClientPool

PyTree = Any
AXIS = "clients"


def use_cpu_devices(count: int) -> None:
    """Makes JAX's CPU backend expose `count` host devices (`jax_num_cpu_devices`), so
    that sharding the clients over them runs `count` clients side by side, one per core.
    Call it before JAX runs anything (a binary's first step); 1 leaves JAX's default.
    ValueError when JAX's backends are already up with another count."""
    if count == 1:
        return
    try:
        jax.config.update("jax_num_cpu_devices", int(count))
    except RuntimeError as e:
        raise ValueError(f"CPU devices can only be set before JAX runs anything ({e})") from None


def client_mesh(num_devices: int = 0, devices=None) -> Mesh:
    """A 1-D Mesh with axis 'clients' over `devices` (default: all of jax.devices()).

    Args:
      num_devices: use the first `num_devices` devices (0: all).
      devices: explicit device list (overrides num_devices).
    """
    devices = list(jax.devices() if devices is None else devices)
    if num_devices:
        if not 1 <= num_devices <= len(devices):
            raise ValueError(f"num_devices must be in [0, {len(devices)}], got {num_devices}")
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def padded_size(num_clients: int, mesh: Mesh) -> int:
    """C rounded up to a multiple of the mesh size."""
    d = mesh.size
    return -(-num_clients // d) * d


def pad_rows(tree: PyTree, size: int) -> PyTree:
    """Zero-pads the leading axis of every leaf to `size` rows."""

    def pad(x):
        extra = size - x.shape[0]
        if extra < 0:
            raise ValueError(f"cannot pad {x.shape[0]} rows down to {size}")
        return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)]) if extra else x

    return jax.tree.map(pad, tree)


def unpad_rows(tree: PyTree, num: int) -> PyTree:
    """The first `num` rows of every leaf."""
    return jax.tree.map(lambda x: x[:num], tree)


def client_rows(arrays: ClientPool | ClientArrays, fn: Callable) -> ClientPool | ClientArrays:
    """`fn` applied to the per-client leaves: a pool's offsets and counts (its rows
    stay whole), every leaf of padded ClientArrays."""
    if isinstance(arrays, ClientPool):
        return arrays.replace(offset=fn(arrays.offset), count=fn(arrays.count))
    return jax.tree.map(fn, arrays)


def map_client_leaves(state: PyTree, client_fn: Callable, other_fn: Callable = lambda x: x) -> PyTree:
    """Applies client_fn to `client_*` leaves and other_fn to the rest."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: client_fn(x) if is_client_leaf(path) else other_fn(x), state
    )


def state_shardings(state: PyTree, mesh: Mesh) -> PyTree:
    """NamedSharding per leaf: P('clients') on `client_*` leaves, replicated otherwise."""
    return map_client_leaves(
        state, lambda _: NamedSharding(mesh, P(AXIS)), lambda _: NamedSharding(mesh, P())
    )


def put(x, sharding: NamedSharding):
    """jax.device_put, typed PRNG keys included: a key goes as its key data (a key array
    cannot be put from one process onto devices of several processes)."""
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)


class ShardedMap(NamedTuple):
    """Client-mapping strategy: rows spread over the 'clients' axis, `inner` on each device's block.

    Attributes:
      mesh: a Mesh with a 'clients' axis (see `client_mesh`).
      inner: strategy on each device's block: a ClientMap or its name.
    """

    mesh: Mesh
    inner: ClientMap | str = "auto"

    def __call__(self, fn: Callable[[PyTree], PyTree], xs: PyTree) -> PyTree:
        inner = as_client_map(self.inner)
        d = self.mesh.size
        k = jax.tree.leaves(xs)[0].shape[0]
        size = padded_size(k, self.mesh)
        # Padded rows repeat row 0 (valid inputs, e.g. a real client id); dropped below.
        xs_p = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[:1], size - k, 0)]), xs)
        # [D, K/D, ...] with the device axis sharded: vmap over devices, `inner` within.
        blocks = jax.tree.map(lambda x: x.reshape((d, size // d) + x.shape[1:]), xs_p)
        blocks = jax.lax.with_sharding_constraint(blocks, NamedSharding(self.mesh, P(AXIS)))
        out = jax.vmap(lambda block: inner(fn, block))(blocks)
        out = jax.lax.with_sharding_constraint(out, NamedSharding(self.mesh, P(AXIS)))
        return unpad_rows(jax.tree.map(lambda x: x.reshape((size,) + x.shape[2:]), out), k)


class ShardedAlgorithm(NamedTuple):
    """An Algorithm's functions on padded, sharded state and data (see module doc).

    `round` and `evaluate` are jittable and take the placed (padded) state and
    data; `evaluate` returns [C] arrays of the real clients only.
    """

    algorithm: Algorithm
    mesh: Mesh
    num_clients: int

    @property
    def size(self) -> int:
        return padded_size(self.num_clients, self.mesh)

    def place_state(self, state: PyTree) -> PyTree:
        """Pads `client_*` leaves of an unpadded state and puts it on the mesh."""
        padded = map_client_leaves(state, lambda x: pad_rows(jnp.asarray(x), self.size))
        return jax.tree.map(put, padded, state_shardings(padded, self.mesh))

    def unplace_state(self, state: PyTree) -> PyTree:
        """The unpadded state (C client rows), as on a single device."""
        return map_client_leaves(state, lambda x: x[: self.num_clients])

    def place_data(self, data: ClientData, replicate: bool = False) -> ClientData:
        """Pads ClientData with empty clients (count 0) and shards (or replicates) it.
        A ClientPool is replicated whole: its rows are not laid out by client."""

        def place(arrays):
            if isinstance(arrays, ClientPool):
                padded = client_rows(arrays, lambda a: pad_rows(a, self.size))
                return jax.device_put(padded, NamedSharding(self.mesh, P()))
            spec = P() if replicate else P(AXIS)
            return jax.device_put(pad_rows(arrays, self.size), NamedSharding(self.mesh, spec))

        return ClientData(place(data.train), place(data.test))

    def place_key(self, key: jax.Array) -> jax.Array:
        return put(key, NamedSharding(self.mesh, P()))

    def real_data(self, data: ClientData) -> ClientData:
        """The real C clients of placed data."""
        return jax.tree.map(
            lambda a: client_rows(a, lambda x: x[: self.num_clients]),
            data,
            is_leaf=lambda a: isinstance(a, ClientPool | ClientArrays),
        )

    def round(self, state: PyTree, data: ClientData, key: jax.Array):
        real_state = self.unplace_state(state)
        new_state, metrics = self.algorithm.round(real_state, self.real_data(data), key)
        padded = map_client_leaves(new_state, lambda x: pad_rows(x, self.size))
        padded = jax.lax.with_sharding_constraint(padded, state_shardings(padded, self.mesh))
        return padded, metrics

    def evaluate(self, state: PyTree, data: ClientData, key: jax.Array) -> dict:
        return self.algorithm.evaluate(self.unplace_state(state), self.real_data(data), key)


def shard_algorithm(algorithm: Algorithm, mesh: Mesh, num_clients: int) -> ShardedAlgorithm:
    """Wraps `algorithm` (built with `client_map=ShardedMap(mesh)` to spread its
    per-client work) to keep its state and data padded and sharded on `mesh`."""
    return ShardedAlgorithm(algorithm, mesh, int(num_clients))
