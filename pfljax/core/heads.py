"""A model's head (its last layer, one Dense) apart from the body that feeds it.

Methods that work on the features z = body(x) (PFLlib's `BaseHeadSplit`: FedRoD's
two heads, FedCP's feature split, GPFL's feature transforms, FedDBE's feature bias)
run the user's flax model with the head's call replaced by a function of z:

    head = linear_head(model, "fedcp")                   # "head" for pfljax's models
    out, updates = apply_with_head(model, head, variables, x, train, lambda z: ...)

`apply_with_head` intercepts the call of the submodule `head`
(`flax.linen.intercept_methods`), so any flax model whose last layer is one Dense
works, BatchNorm and all; nothing of the model is copied or rewritten.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pfljax.core.layers import layer_groups

if TYPE_CHECKING:  # core does not import models at run time
    from pfljax.models.base import Model

PyTree = Any


def linear_head(model: Model, method: str) -> str:
    """The name of the model's last layer; ValueError (naming `method`) unless it is
    one Dense (kernel [d, k], bias [k])."""
    last = layer_groups(model)[-1]
    shapes = model.template()["params"][last[0]] if len(last) == 1 else {}
    if set(shapes) != {"kernel", "bias"} or len(shapes["kernel"].shape) != 2:
        raise ValueError(f"{method} needs a model whose last layer is one Dense (kernel, bias), got {last}")
    return last[0]


def feature_dim(model: Model, head: str) -> int:
    """d, the width of the features the head reads (its kernel's rows)."""
    return int(model.template()["params"][head]["kernel"].shape[0])


def dense(params: dict, z: jax.Array) -> jax.Array:
    """A Dense layer's output z @ kernel + bias for z [B, d], `params` {"kernel", "bias"}."""
    return z @ params["kernel"] + params["bias"][None]


def apply_with_head(
    model: Model,
    head: str,
    variables: dict,
    x: jax.Array,
    train: bool,
    head_fn: Callable[[jax.Array], PyTree],
) -> tuple[PyTree, dict]:
    """`model.apply(variables, x, train)` with the head's output replaced by
    `head_fn(z)`, z [B, d] the features the head receives. Returns (what head_fn
    returned, the collections the forward pass updated).

    The head's own parameters are not read by the model here: `head_fn` uses
    whatever it closes over (e.g. `variables["params"][head]` with `dense`).
    """
    if model.module is None:
        raise ValueError("apply_with_head needs a Model built from a flax module (model.module is None)")

    def intercept(next_fun, args, kwargs, context):
        if (
            context.method_name == "__call__"
            and context.module.name == head
            and context.module.parent is not None
        ):
            return head_fn(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(intercept):
        return model.apply(variables, x, train=train)


def features(model: Model, head: str, variables: dict, x: jax.Array, train: bool = False):
    """(z [B, d], updates): the body's output, the input of the head."""
    return apply_with_head(model, head, variables, x, train, lambda z: z)


def take_head(variables: dict, head: str) -> tuple[dict, dict]:
    """(variables without the head's params, the head's params)."""
    params = dict(variables["params"])
    head_params = params.pop(head)
    return {**variables, "params": params}, head_params


def put_head(variables: dict, head: str, head_params: dict) -> dict:
    """`variables` with the head's params set to `head_params`."""
    return {**variables, "params": {**variables["params"], head: head_params}}


def zeros_like_features(model: Model, head: str) -> jax.Array:
    """A zero feature vector [d]."""
    return jnp.zeros((feature_dim(model, head),), jnp.float32)
