"""Core types shared by every algorithm: client arrays, client data, Algorithm.

Shapes use C for the client axis, n for a client's (padded) sample axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

PyTree = Any
Params = Any
State = Any
Metrics = dict[str, jax.Array]


class ClientArrays(NamedTuple):
    """Padded per-client samples.

    Attributes:
      x: [C, n_max, *feature_shape] inputs; rows >= count[c] are padding.
      y: [C, n_max] int32 labels (classification) or [C, n_max, *target] float32
        targets (regression); padded rows hold 0.
      count: [C] int32 number of real rows of each client.
    """

    x: jax.Array
    y: jax.Array
    count: jax.Array


class ClientData(NamedTuple):
    """Train and test arrays of every client (same client order in both)."""

    train: ClientArrays
    test: ClientArrays


class Algorithm(NamedTuple):
    """A federated algorithm as pure functions (optax style).

    Attributes:
      init: (key, params_template, num_clients) -> State. Fields named
        `client_*` carry a leading client axis C; `global_*` fields have none;
        every state has a `round` counter.
      round: (State, ClientData, key) -> (State, Metrics). Jittable, one round of
        communication (build it with `pfljax.core.round.federated_round`).
        Scalar metrics include train_loss, bytes_up, bytes_down, participants;
        non-scalar ones are traces.
      evaluate: (State, ClientData, key) -> dict of [C] arrays with at least
        `accuracy`, `loss` and `count` on each client's own test set (extra [C]
        keys are reported as their test-size-weighted means). The key feeds any
        randomness of evaluation (e.g. fine-tuning batches).
      collaboration_matrix: optional, (State) -> [C, C] who learns from whom
        (rows sum to 1), written to summary.json and collaboration.png.
      final_report: optional, (State, FederatedData, per_client, key) -> dict of
        extra summary numbers; `per_client` is the final `evaluate` output (host
        numpy arrays) and `key` the final evaluation's key.
    """

    init: Callable[..., State]
    round: Callable[[State, ClientData, jax.Array], tuple[State, Metrics]]
    evaluate: Callable[[State, ClientData, jax.Array], dict[str, jax.Array]]
    collaboration_matrix: Callable[[State], jax.Array] | None = None
    final_report: Callable[..., dict] | None = None
