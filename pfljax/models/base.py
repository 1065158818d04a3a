"""A model as two pure functions over a flax variables dict.

`variables` is a dict with a "params" collection (trained by gradient) and,
for models with BatchNorm, a "batch_stats" collection (updated by the forward
pass in training mode). Algorithms treat the whole dict as one client's model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

Variables = dict[str, Any]


class Model(NamedTuple):
    """init(key) -> variables; apply(variables, x [B, ...], train) -> (out, updates).

    `updates` holds the collections the forward pass changed (e.g. batch_stats
    in training mode); it is {} for stateless models or when train is False.
    """

    init: Callable[[jax.Array], Variables]
    apply: Callable[..., tuple[jax.Array, Variables]]
    input_shape: tuple[int, ...]
    num_outputs: int
    module: nn.Module | None = None

    def initial(self, key: jax.Array, params_template: Variables | None = None) -> Variables:
        """The starting variables of an algorithm's `init`: `params_template` if given, else init(key)."""
        return self.init(key) if params_template is None else params_template

    def template(self) -> Variables:
        """The variables' shapes and dtypes (jax.ShapeDtypeStruct leaves), without computing them."""
        return jax.eval_shape(self.init, jax.random.key(0))


def from_flax(module: nn.Module, input_shape: tuple[int, ...], num_outputs: int) -> Model:
    """Wraps a linen module as a Model. Its __call__ takes the inputs x [B, *input_shape],
    and a `train` flag if it has one (BatchNorm, dropout: the round passes train=True in
    local steps, False in evaluation; an ordinary module without it is called with x only).
    Collections other than "params" (e.g. batch_stats) are updated in training steps."""
    takes_train = "train" in inspect.signature(module.__call__).parameters

    def call(variables, x, train: bool, **kwargs):
        flags = {"train": train} if takes_train else {}
        return module.apply(variables, x, **flags, **kwargs)

    def init(key: jax.Array) -> Variables:
        flags = {"train": False} if takes_train else {}
        variables = module.init(key, jnp.zeros((1, *input_shape), jnp.float32), **flags)
        return jax.tree.map(lambda x: x, dict(variables))

    def apply(variables: Variables, x: jax.Array, train: bool = False):
        mutable = [k for k in variables if k != "params"] if train else []
        if mutable:
            out, updates = call(variables, x, True, mutable=mutable)
            return out, dict(updates)
        return call(variables, x, train), {}

    return Model(init, apply, tuple(input_shape), num_outputs, module)
