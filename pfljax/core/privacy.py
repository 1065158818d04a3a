"""Client-level differential privacy (DP-FedAvg, McMahan et al., ICLR 2018) and its accounting.

Each participant's upload is its update of the shared parameters (upload minus the
model the server sent). With `ClientDP`, the server clips every update to L2 norm
`clip_norm` (over all its shared leaves together), adds Gaussian noise of std
`noise_multiplier * clip_norm` to their SUM, and divides by K, the number of
participants, which is fixed by the sampling (K of C without replacement every
round): the fixed denominator the analysis requires. Updates are weighted
uniformly under DP (a sample-weighted mean would let one client's weight, hence
its sensitivity, grow without bound). Leaves that never leave a client (personal
layers) are not part of the upload and get no noise.

Accounting (`epsilon`) uses the `dp-accounting` package for exactly this sampling:
a fixed-size sample without replacement, whose privacy amplification
`dp_accounting` analyses under the replace-one neighbouring relation (a client's
data replaced by another's), composed over the rounds run.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import optax

from pfljax.core.domains import Domain, check

PyTree = Any
# The domains of ClientDP's fields (the experiment config's dp.* fields of the same names).
DOMAINS = {
    "noise_multiplier": Domain(0),
    "clip_norm": Domain(0, math.inf, low_open=True, note="inf: no clipping"),
}
# Participants up to which `private_mean_update` writes its norms and sums per participant.
UNROLLED_PARTICIPANTS = 32


class ClientDP(NamedTuple):
    """noise_multiplier z >= 0 (noise std z * clip_norm on the sum); clip_norm > 0 (inf: no clipping)."""

    noise_multiplier: float
    clip_norm: float

    def validate(self) -> ClientDP:
        """self; ValueError naming a field outside its domain (`DOMAINS`)."""
        check(DOMAINS, self._asdict())
        return self


def clip_update(update: PyTree, clip_norm: float) -> tuple[PyTree, jax.Array]:
    """One client's update scaled to L2 norm <= clip_norm (over all leaves), and its norm."""
    norm = optax.tree.norm(update)
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norm, 1e-30))
    return jax.tree.map(lambda u: (u * scale).astype(u.dtype), update), norm


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32's rotation distances, rounds 1-4 and 5-8


def _threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 with 20 rounds (Salmon et al., SC 2011) of the uint32 counter words (x0, x1)
    under key (k0, k1), as straight-line array code (one pass over the counters)."""
    keys = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = jax.lax.shift_left(x1, np.uint32(r)) | jax.lax.shift_right_logical(x1, np.uint32(32 - r))
            x1 = x0 ^ x1
        x0 = x0 + keys[(i + 1) % 3]
        x1 = x1 + keys[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


_THREEFRY = jax.extend.random.threefry_prng_impl


def _threefry_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """`threefry_prng_impl.random_bits` (partitionable layout: counter = flat index as two
    uint32 words, bits = the XOR of the hash's two words), for 32 bits and < 2^32 values."""
    if bit_width != 32 or key.shape != (2,) or math.prod(shape) >= 2**32:
        return _THREEFRY.random_bits(key, bit_width, shape)
    index = jax.lax.iota(np.uint32, math.prod(shape)).reshape(shape)
    b0, b1 = _threefry2x32(key[0], key[1], jnp.zeros_like(index), index)
    return b0 ^ b1


# Threefry keys whose random bits come from `_threefry_bits`: the same bits as
# jax.random's threefry2x32 with jax_threefry_partitionable, whose CPU lowering loops over
# the rounds with the [shape] state in memory, many times slower for millions of values.
_THREEFRY_STRAIGHT = jax.extend.random.define_prng_impl(
    key_shape=_THREEFRY.key_shape,
    seed=_THREEFRY.seed,
    split=_THREEFRY.split,
    random_bits=_threefry_bits,
    fold_in=_THREEFRY.fold_in,
    name="threefry2x32_straight",
    tag="fry_s",
)


def gaussian(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """jax.random.normal(key, shape, float32), the same numbers; drawn by `_threefry_bits` for a
    threefry key under jax_threefry_partitionable (the default), else by jax.random itself."""
    threefry = (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        and str(jax.random.key_impl(key)) == _THREEFRY.name
        and jax.config.jax_threefry_partitionable
    )
    if threefry:
        key = jax.random.wrap_key_data(jax.random.key_data(key), impl=_THREEFRY_STRAIGHT)
    return jax.random.normal(key, shape, jnp.float32)


def private_mean_update(updates: PyTree, key: jax.Array, dp: ClientDP) -> tuple[PyTree, dict]:
    """(sum_k clip(u_k) + N(0, (z * clip_norm)^2)) / K over the stacked updates [K, ...].

    Returns the noised mean update and metrics: the mean update norm before
    clipping and the fraction of participants clipped. The numbers of `clip_update`
    on each participant, a float32 sum over them and per-leaf noise (`gaussian` of one
    key per leaf), computed as: the norms give the scales s_k = min(1, clip_norm / |u_k|),
    and each leaf's sum is sum_k s_k u_k (each term rounded to the leaf's dtype, as
    `clip_update` does). Up to `UNROLLED_PARTICIPANTS` participants, the norms and the sums
    are written per participant, so that the compiler reads the updates where they are made
    (e.g. uploads minus the server's model) without storing them; beyond, by vmap and one
    matrix product per leaf at full float32 precision. (A sum over the client axis of the
    scaled [K, ...] leaf, as `jnp.sum`, runs many times slower on some CPU backends.) No
    noise is drawn where its std is 0 (clip_norm inf or z 0).
    """
    leaves, treedef = jax.tree.flatten(updates)
    k = leaves[0].shape[0]
    unrolled = k <= UNROLLED_PARTICIPANTS
    if unrolled:
        norms = jnp.stack([optax.tree.norm([x[i] for x in leaves]) for i in range(k)])
    else:
        norms = jax.vmap(optax.tree.norm)(updates)
    scales = jnp.minimum(1.0, dp.clip_norm / jnp.maximum(norms, 1e-30))
    keys = jax.random.split(key, len(leaves))
    std = dp.noise_multiplier * dp.clip_norm if math.isfinite(dp.clip_norm) else 0.0

    def clipped_sum(x: jax.Array) -> jax.Array:
        if unrolled:
            terms = [(x[i] * scales[i]).astype(x.dtype).astype(jnp.float32) for i in range(k)]
            return functools.reduce(operator.add, terms)
        if x.dtype != jnp.float32 or scales.dtype != jnp.float32:
            x = (x * scales.reshape((k,) + (1,) * (x.ndim - 1))).astype(x.dtype)
            weights = jnp.ones((k,), jnp.float32)
        else:
            weights = scales
        return jnp.tensordot(weights, x.astype(jnp.float32), axes=1, precision=jax.lax.Precision.HIGHEST)

    def noised(x: jax.Array, key_: jax.Array) -> jax.Array:
        total = clipped_sum(x)
        if std:
            total = total + std * gaussian(key_, x.shape[1:])
        return (total / k).astype(x.dtype)

    mean = jax.tree.unflatten(treedef, [noised(x, k_) for x, k_ in zip(leaves, keys)])
    metrics = {
        "dp_update_norm": jnp.mean(norms),
        "dp_clipped_fraction": jnp.mean((norms > dp.clip_norm).astype(jnp.float32)),
    }
    return mean, metrics


def epsilon(
    noise_multiplier: float,
    num_clients: int,
    clients_per_round: int,
    rounds: int,
    delta: float,
) -> float:
    """Epsilon at `delta` after `rounds` rounds of K-of-C sampling without replacement
    with the Gaussian mechanism: dp-accounting's RDP accountant under the replace-one
    neighbouring relation (its PLD accountant does not support this sampling)."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    import dp_accounting  # pylint: disable=import-outside-toplevel  (loaded only when accounting)

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            num_clients, clients_per_round, dp_accounting.GaussianDpEvent(noise_multiplier)
        ),
        rounds,
    )
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    return float(acc.compose(event).get_epsilon(delta))


def epsilons(
    noise_multiplier: float,
    num_clients: int,
    clients_per_round: int,
    rounds: int,
    delta: float,
) -> np.ndarray:
    """[rounds + 1] epsilons at `delta` after 0, 1, ..., `rounds` rounds, from ONE
    accountant call: the RDP of r self-composed rounds is r times one round's, so
    each entry is `epsilon(..., r, delta)` without composing r times (tests: equal)."""
    out = np.zeros(rounds + 1)
    if noise_multiplier == 0:
        out[1:] = math.inf
        return out
    import dp_accounting  # pylint: disable=import-outside-toplevel

    event = dp_accounting.SampledWithoutReplacementDpEvent(
        num_clients, clients_per_round, dp_accounting.GaussianDpEvent(noise_multiplier)
    )
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(event)
    for r in range(1, rounds + 1):
        out[r] = dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(acc.orders, r * acc.rdp, delta)[0]
    return out


def noise_for_epsilon(
    target: float,
    num_clients: int,
    clients_per_round: int,
    rounds: int,
    delta: float,
    rtol: float = 1e-3,
) -> float:
    """The smallest noise multiplier z (to within the bisection's tolerance) with
    `epsilon(z, ...) <= target`: bisection on log z, epsilon being decreasing in z.

    Brackets by doubling/halving from z = 1, then bisects until the epsilon of the
    upper end is within `rtol` of `target` (relative); returns that upper end, so
    the run's epsilon never exceeds `target`. `target` inf gives 0 (no noise).
    """
    if not target > 0:
        raise ValueError(f"target must be > 0 (inf: no noise), got {target}")
    if math.isinf(target):
        return 0.0

    def eps(z: float) -> float:
        return epsilon(z, num_clients, clients_per_round, rounds, delta)

    lo, hi = 0.5, 1.0
    while eps(hi) > target:
        lo, hi = hi, hi * 2.0
    while eps(lo) <= target:
        lo, hi = lo / 2.0, lo
        if lo < 1e-4:
            raise ValueError(f"target {target} needs noise below 1e-4: over the accountant's range")
    for _ in range(60):
        if eps(hi) >= target * (1.0 - rtol):
            break
        mid = math.sqrt(lo * hi)
        if eps(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi
