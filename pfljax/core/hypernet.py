"""Hypernetworks on the server: an MLP from a learned embedding to named outputs,
and their update through a vector-Jacobian product.

Used by pFedHN (Shamsian et al., ICML 2021: one shared hypernetwork maps each
client's embedding to a full model) and pFedLA (Ma et al., CVPR 2022: one
hypernetwork per client maps its embedding to layer-wise aggregation weights).

The network (`mlp_hypernet`): embedding table [num_embeddings, E] -> trunk of
Dense+ReLU layers -> one Dense head per named output, reshaped to its shape.
Params are a plain dict, so C independent hypernetworks are the same dict with a
leading client axis (`init_stacked`) and map over clients like client models.

The update (`vjp_generate`, `vjp_grad`, `vjp_step`, `apply_grads`): a client
starts from `generate(hn)` (a model, or personalized aggregated params), trains,
and sends back `delta = new - start`. The hypernetwork moves along
`(d generate / d hn)^T (-delta)`, the gradient of `<generate(hn), -delta>`
(-delta / lr is the client's loss gradient to first order): one `jax.vjp` with
cotangent `-delta`, then an optax step. `generate` may close over anything
(e.g. the stacked client models pFedLA mixes); only its argument is
differentiated. For K clients at once, let `generate` map [K] hypernetworks (or
one shared one) to [K] targets: one VJP gives every client's gradient.

The round (`generated_step`): a `pfljax.core.round.federated_round` step whose
server generates every participant's start (one forward pass and one pullback for
all K), maps the clients' local training over them, then applies the gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pfljax.core.round import map_clients

PyTree = Any
INITS = ("torch", "lecun_normal", "uniform01", "zeros")


class HyperNet(NamedTuple):
    """init(key) -> params; apply(params, index) -> {head name: array of its shape}.

    Attributes:
      init: one hypernetwork's params {"embedding", "trunk", "heads"}.
      apply: outputs for embedding row `index` (int32 scalar).
      heads: {name: output shape}.
    """

    init: Callable[[jax.Array], dict]
    apply: Callable[[dict, jax.Array], dict[str, jax.Array]]
    heads: dict[str, tuple[int, ...]]


def dense_init(key: jax.Array, fan_in: int, fan_out: int, how: str) -> dict:
    """{"kernel" [fan_in, fan_out], "bias" [fan_out]} initialised by `how` (one of INITS).

    "torch": U(+-1/sqrt(fan_in)) for both (PyTorch nn.Linear, the papers' code);
    "lecun_normal": flax's default (truncated normal, bias 0); "uniform01":
    kernel U(0, 1), bias 0 (the pFedLA reimplementation's heads, so ReLU outputs
    of a ReLU trunk start positive and nearly equal); "zeros".
    """
    if how not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {how!r}")
    size = (fan_in + 1) * fan_out
    ku, kz = jax.random.split(key)
    z = jax.random.truncated_normal(kz, -2.0, 2.0, (size,)) if how == "lecun_normal" else None
    return _dense_from(jax.random.uniform(ku, (size,)), z, fan_in, fan_out, how)


def _dense_from(u: jax.Array, z: jax.Array | None, fan_in: int, fan_out: int, how: str) -> dict:
    """A dense layer from flat U(0, 1) draws u (and truncated normal z) of size (fan_in + 1) * fan_out."""
    n = fan_in * fan_out
    if how == "torch":
        bound = 1.0 / np.sqrt(fan_in)
        kernel, bias = (2 * u[:n] - 1) * bound, (2 * u[n:] - 1) * bound
    elif how == "uniform01":
        kernel, bias = u[:n], jnp.zeros((fan_out,), jnp.float32)
    elif how == "lecun_normal":  # flax's variance_scaling(1, "fan_in", "truncated_normal")
        kernel, bias = (
            z[:n] * (np.sqrt(1.0 / fan_in) / 0.87962566103423978),
            jnp.zeros((fan_out,), jnp.float32),
        )
    else:
        kernel, bias = jnp.zeros((n,), jnp.float32), jnp.zeros((fan_out,), jnp.float32)
    return {"kernel": kernel.reshape(fan_in, fan_out), "bias": bias}


def mlp_hypernet(
    heads: Mapping[str, int | Sequence[int]],
    *,
    num_embeddings: int = 1,
    embedding_dim: int = 100,
    hidden: Sequence[int] = (100, 100, 100),
    relu_last: bool = True,
    trunk_init: str = "torch",
    head_init: str = "torch",
    embedding_scale: float = 1.0,
) -> HyperNet:
    """An MLP hypernetwork: embedding -> Dense+ReLU trunk -> one Dense head per output.

    Args:
      heads: {name: output shape (int or tuple)}; head `name` is a Dense layer
        with prod(shape) outputs, reshaped.
      num_embeddings: rows of the embedding table (pFedHN: C clients; pFedLA:
        1 per client's own hypernetwork).
      embedding_dim: E.
      hidden: widths of the trunk's Dense layers (at least one).
      relu_last: ReLU after the last trunk layer too (pFedLA's code); False
        gives Linear (ReLU Linear)* as in pFedHN's code.
      trunk_init, head_init: one of INITS (see `dense_init`).
      embedding_scale: embedding rows start N(0, scale^2) (PyTorch nn.Embedding: 1).

    Returns:
      HyperNet whose params are {"embedding": [num_embeddings, E], "trunk":
      {"layer_i": dense}, "heads": {name: dense}}.
    """
    heads = {str(k): (int(v),) if np.ndim(v) == 0 else tuple(int(s) for s in v) for k, v in heads.items()}
    hidden = tuple(int(h) for h in hidden)
    _check_mlp(heads, hidden, num_embeddings, embedding_dim, trunk_init, head_init)
    widths = (embedding_dim,) + hidden
    layers = [(("trunk", f"layer_{i}"), widths[i], widths[i + 1], trunk_init) for i in range(len(hidden))]
    layers += [(("heads", name), hidden[-1], int(np.prod(shape)), head_init) for name, shape in heads.items()]
    init = functools.partial(_init_mlp, layers, num_embeddings, embedding_dim, embedding_scale)
    apply = functools.partial(_apply_mlp, len(hidden), relu_last, heads)
    return HyperNet(jax.jit(init), apply, heads)  # jit: init run eagerly is many small ops


def _check_mlp(heads, hidden, num_embeddings, embedding_dim, trunk_init, head_init) -> None:
    """ValueError on `mlp_hypernet` arguments out of range."""
    if not heads:
        raise ValueError("heads must name at least one output")
    if not hidden or min(hidden) < 1:
        raise ValueError(f"hidden must be a non-empty tuple of widths >= 1, got {hidden}")
    if num_embeddings < 1 or embedding_dim < 1:
        raise ValueError(
            f"num_embeddings and embedding_dim must be >= 1, got {num_embeddings}, {embedding_dim}"
        )
    for how in (trunk_init, head_init):
        if how not in INITS:
            raise ValueError(f"trunk_init/head_init must be one of {INITS}, got {how!r}")


def _init_mlp(layers, num_embeddings: int, embedding_dim: int, embedding_scale: float, key) -> dict:
    """Params of an MLP hypernetwork whose dense layers are `layers`, a list of
    ((kind, name), fan_in, fan_out, init), kind "trunk" or "heads"."""
    # One uniform (and one normal) draw for all layers: few random ops compile fast.
    sizes = [(fan_in + 1) * fan_out for _, fan_in, fan_out, _ in layers]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    needs_normal = any(how == "lecun_normal" for *_, how in layers)
    k_emb, k_u, k_z = jax.random.split(key, 3)
    u = jax.random.uniform(k_u, (offsets[-1],))
    z = jax.random.truncated_normal(k_z, -2.0, 2.0, (offsets[-1],)) if needs_normal else None
    params = {
        "embedding": embedding_scale * jax.random.normal(k_emb, (num_embeddings, embedding_dim), jnp.float32),
        "trunk": {},
        "heads": {},
    }
    for i, ((kind, name), fan_in, fan_out, how) in enumerate(layers):
        part = slice(offsets[i], offsets[i + 1])
        params[kind][name] = _dense_from(u[part], None if z is None else z[part], fan_in, fan_out, how)
    return params


def _apply_mlp(num_hidden: int, relu_last: bool, heads: dict, params: dict, index: jax.Array = 0) -> dict:
    """{head name: output} of an MLP hypernetwork for embedding row `index`."""
    h = params["embedding"][index]
    for i in range(num_hidden):
        layer = params["trunk"][f"layer_{i}"]
        h = h @ layer["kernel"] + layer["bias"]
        if relu_last or i < num_hidden - 1:
            h = jax.nn.relu(h)
    return {
        name: (h @ params["heads"][name]["kernel"] + params["heads"][name]["bias"]).reshape(shape)
        for name, shape in heads.items()
    }


def init_stacked(hypernet: HyperNet, key: jax.Array, num: int) -> dict:
    """`num` independent hypernetworks as one params dict with leading axis [num, ...]."""
    return jax.jit(jax.vmap(hypernet.init))(jax.random.split(key, num))  # jit: eager vmap is slow


def vjp_generate(
    generate: Callable[[PyTree], PyTree], hn_params: PyTree
) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """(target, grad_fn): target = generate(hn_params), and grad_fn(delta) =
    vjp_grad(generate, hn_params, delta) without running `generate` again.

    For a round that starts clients from `target`, trains them, and then needs
    the hypernetwork gradient of their deltas (one forward pass, one pullback).
    """
    target, pullback = jax.vjp(generate, hn_params)
    return target, lambda delta: pullback(jax.tree.map(lambda d: -d, delta))[0]


def vjp_grad(generate: Callable[[PyTree], PyTree], hn_params: PyTree, delta: PyTree) -> PyTree:
    """Gradient of <generate(hn_params), -delta> with respect to hn_params.

    Args:
      generate: hn_params -> target pytree (a model, mixed params...).
      hn_params: the hypernetwork's params (anything `generate` differentiates).
      delta: client update `trained - generate(hn_params)`, same structure as
        the target (float leaves; use zeros for parts that must not move it).

    Returns:
      A pytree like hn_params: vjp(generate)(-delta), i.e. (dT/dhn)^T (-delta).
      A gradient step with it moves generate(hn_params) towards the trained model.
    """
    return vjp_generate(generate, hn_params)[1](delta)


def apply_grads(
    optimizer: optax.GradientTransformation, hn_params: PyTree, opt_state: PyTree, grads: PyTree
) -> tuple[PyTree, PyTree]:
    """One optax step: (new hn_params, new opt_state)."""
    updates, opt_state = optimizer.update(grads, opt_state, hn_params)
    return optax.apply_updates(hn_params, updates), opt_state


def vjp_step(
    generate: Callable[[PyTree], PyTree],
    optimizer: optax.GradientTransformation,
    hn_params: PyTree,
    opt_state: PyTree,
    delta: PyTree,
) -> tuple[PyTree, PyTree]:
    """`vjp_grad` then one optax step (for one hypernetwork; map it over clients
    for stacked ones, or average `vjp_grad` over clients for a shared one)."""
    return apply_grads(optimizer, hn_params, opt_state, vjp_grad(generate, hn_params, delta))


def generated_step(
    generate: Callable, client_update: Callable, server_update: Callable, client_map: Callable
) -> Callable:
    """A `federated_round` step for a server that generates each participant's start.

    Args:
      generate: `(state, part) -> (starts [K, ...], grad_of)`: the participants'
        starts and the pullback of their generation (`vjp_generate`, one VJP for
        all K).
      client_update: `(state, cid, start, data, key) -> (output, loss)` for ONE
        client, `start` its own row of `starts`.
      server_update: `(state, outputs [K], part, grad_of, starts) -> (state, metrics)`; the
        starts let a server form trained - start itself (pFedLA) where clients need not return it.
      client_map: how the per-client function is mapped (ClientMap or a callable).
    """

    def step(state, data, part):
        starts, grad_of = generate(state, part)
        outputs, losses = map_clients(client_update, client_map, state, data, part, starts)
        new_state, metrics = server_update(state, outputs, part, grad_of, starts)
        return new_state, losses, metrics

    return step
