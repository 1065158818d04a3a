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

import math
from typing import Any, NamedTuple

import jax
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


def private_mean_update(updates: PyTree, key: jax.Array, dp: ClientDP) -> tuple[PyTree, dict]:
    """(sum_k clip(u_k) + N(0, (z * clip_norm)^2)) / K over the stacked updates [K, ...].

    Returns the noised mean update and metrics: the mean update norm before
    clipping and the fraction of participants clipped.
    """
    clipped, norms = jax.vmap(lambda u: clip_update(u, dp.clip_norm))(updates)
    k = norms.shape[0]
    leaves, treedef = jax.tree.flatten(clipped)
    keys = jax.random.split(key, len(leaves))
    std = dp.noise_multiplier * dp.clip_norm if math.isfinite(dp.clip_norm) else 0.0
    noised = [
        (jnp.sum(x.astype(jnp.float32), axis=0) + std * jax.random.normal(k_, x.shape[1:], jnp.float32)) / k
        for x, k_ in zip(leaves, keys)
    ]
    mean = jax.tree.unflatten(treedef, [n.astype(x.dtype) for n, x in zip(noised, leaves)])
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
