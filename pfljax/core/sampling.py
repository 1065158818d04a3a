"""Client sampling: a static number K of the C clients per round."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_clients_per_round(clients_per_round: int | None, num_clients: int) -> int:
    """Resolves K (None means all clients) and validates 1 <= K <= C."""
    if clients_per_round is None:
        return num_clients
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(
            f"clients_per_round must be in [1, num_clients={num_clients}], got {clients_per_round}"
        )
    return int(clients_per_round)


def sample_clients(key: jax.Array, num_clients: int, k: int) -> jax.Array:
    """K distinct client ids [K] (sorted), uniformly without replacement.

    With K == C every client takes part and the ids are simply 0..C-1.
    """
    if k == num_clients:
        return jnp.arange(num_clients)
    return jnp.sort(jax.random.choice(key, num_clients, (k,), replace=False))


def participation_mask(idx: jax.Array, num_clients: int) -> jax.Array:
    """Boolean [C] mask of the sampled clients."""
    return jnp.zeros((num_clients,), bool).at[idx].set(True)
