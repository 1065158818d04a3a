"""Server-side aggregation over stacked client pytrees ([C, ...] leaves).

Three shapes of "who averages with whom", each one einsum or weighted sum:
- `weighted_mean`: one average over the participating clients (FedAvg);
- `unit_masked_mean`: per hidden unit, shared units averaged and personalized
  units kept per client (a building block for custom splits; FedFac adds a
  server learning rate and ablations and combines `weighted_mean` itself);
- `mix`: a mixing matrix A [C_out, C_in] (Factorized-FL, CFL clusters;
  pFedLA's `layer_mix` is the same einsum per layer group).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

PyTree = Any


def normalized_weights(weights: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """weights [C] * mask [C], divided by their sum (all zeros if nothing is left)."""
    w = weights.astype(jnp.float32)
    if mask is not None:
        w = w * mask.astype(jnp.float32)
    total = jnp.sum(w)
    return jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)


def weighted_mean(stacked: PyTree, weights: jax.Array, mask: jax.Array | None = None) -> PyTree:
    """sum_c w_c x_c / sum_c w_c over clients with mask[c] (leaves [C, ...] -> [...])."""
    w = normalized_weights(weights, mask)
    return jax.tree.map(lambda x: jnp.tensordot(w, x.astype(jnp.float32), axes=1).astype(x.dtype), stacked)


def server_step(global_tree: PyTree, target: PyTree, server_lr: float) -> PyTree:
    """global + server_lr * (target - global): server learning rate on the mean update."""
    return jax.tree.map(lambda g, t: g + server_lr * (t - g), global_tree, target)


def check_server_optimizer(server_optimizer: Any, server_lr: float) -> None:
    """TypeError unless `server_optimizer` is None or an optax transformation; ValueError
    when both it and a server_lr other than 1 are given (its own learning rate rules)."""
    if server_optimizer is None:
        return
    if not isinstance(server_optimizer, optax.GradientTransformation):
        raise TypeError(
            f"server_optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-2)) or None, "
            f"got {type(server_optimizer).__name__}"
        )
    if server_lr != 1.0:
        raise ValueError(
            f"server_lr must be 1.0 with a server_optimizer, got {server_lr}: the optimizer's own "
            "learning rate is the server's step"
        )


def init_server_state(server_optimizer: optax.GradientTransformation | None, global_tree: PyTree) -> Any:
    """The server optimizer's state over `global_tree` (() without one)."""
    return () if server_optimizer is None else server_optimizer.init(global_tree)


def server_update(
    server_optimizer: optax.GradientTransformation | None,
    server_lr: float,
    server_state: Any,
    global_tree: PyTree,
    target: PyTree,
) -> tuple[PyTree, Any]:
    """(new global, new server state): `server_step` with server_lr, or, with a server
    optimizer, one optax step on the pseudo-gradient global - target (the negated mean
    client update; Reddi et al., "Adaptive Federated Optimization", ICLR 2021: optax.sgd
    with momentum is FedAvgM, optax.adam FedAdam, optax.yogi FedYogi, optax.adagrad
    FedAdagrad; optax.sgd(lr) equals server_lr=lr)."""
    if server_optimizer is None:
        return server_step(global_tree, target, server_lr), server_state
    pseudo_gradient = jax.tree.map(jnp.subtract, global_tree, target)
    updates, server_state = server_optimizer.update(pseudo_gradient, server_state, global_tree)
    return optax.apply_updates(global_tree, updates), server_state


def mix(matrix: jax.Array, stacked: PyTree) -> PyTree:
    """Personalized averages: out[i] = sum_j A[i, j] x[j]; A [C_out, C_in]."""
    return jax.tree.map(lambda x: jnp.einsum("ij,j...->i...", matrix, x), stacked)


def unit_masked_mean(
    stacked: jax.Array,
    shared: jax.Array,
    weights: jax.Array,
    mask: jax.Array | None = None,
    unit_axis: int = -1,
) -> jax.Array:
    """Averages the shared units of one leaf, keeps personalized ones per client.

    Args:
      stacked: [C, ...] one leaf (e.g. a kernel [C, fan_in, units]).
      shared: [units] bool, along `unit_axis` of the per-client leaf.
      weights: [C] aggregation weights (e.g. sample counts).
      mask: [C] participating clients; non-participants keep their rows.

    Returns:
      [C, ...]: shared units replaced by the weighted mean over participants
      (for participants only), personalized units unchanged.
    """
    mean = weighted_mean(stacked, weights, mask)
    axis = unit_axis % (stacked.ndim - 1)
    shape = [1] * (stacked.ndim - 1)
    shape[axis] = shared.shape[0]
    unit = shared.reshape(shape)[None]
    take = unit if mask is None else unit & mask.reshape((-1,) + (1,) * (stacked.ndim - 1))
    return jnp.where(take, mean[None], stacked)
