"""A model's layers: in forward order with regexes selecting them (for "which layers
stay local"), and as groups of the leaves of a params tree (for per-layer weights).

Two granularities of "layer", one module:

- `layer_groups(model)`: forward-order layers of a flax-backed model, each a tuple
  of top-level "params" entries (a layer with its normalization layer). FedPer
  (last layers local), LG-FedAvg (first layers local) and FedRep (head = last
  layers) select them with `first_layers` / `last_layers`.
- `leaf_groups(params, by)`: the group id of every leaf of a params tree, by module
  (the leaf's parent path: a kernel with its bias, a norm's scale with its offset;
  a norm layer is its own group) or by tensor, in tree-flatten order. pFedLA learns
  one aggregation weight per such group.

Flattening a variables dict sorts its keys ("bn_0" < "conv_0" < "head"), so
`layer_groups` reads the forward order from the flax module itself: `init` creates
submodules in call order. There a layer is one top-level entry of the "params"
collection; an entry whose leaves are all 1-D (a normalization layer: scale and
bias) belongs to the layer before it, so "conv_0 + bn_0" count as one layer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from pfljax.core.params import leaf_paths

if TYPE_CHECKING:  # core does not import models at run time
    from pfljax.models.base import Model

PyTree = Any
LEAF_GROUPINGS = ("module", "tensor")


def param_order(model: Model) -> tuple[str, ...]:
    """Top-level "params" entries of a flax-backed Model, in creation (forward) order."""
    if model.module is None:
        raise ValueError("layer order needs a Model built from a flax module (model.module is None)")
    names: list[str] = []

    def record(key):
        variables = model.module.init(key, jnp.zeros((1, *model.input_shape), jnp.float32), train=False)
        names.extend(variables["params"].keys())
        return 0

    jax.eval_shape(record, jax.random.key(0))
    return tuple(names)


def layer_groups(model: Model) -> tuple[tuple[str, ...], ...]:
    """Layers in forward order, each a tuple of top-level names (a layer and its norm).

    Example: the "cnn_bn" model gives (("conv_0", "bn_0"), ("conv_1", "bn_1"),
    ("dense_0",), ("head",)).
    """
    shapes = model.template()["params"]
    groups: list[list[str]] = []
    for name in param_order(model):
        is_norm = all(len(leaf.shape) <= 1 for leaf in jax.tree.leaves(shapes[name]))
        if is_norm and groups:
            groups[-1].append(name)
        else:
            groups.append([name])
    return tuple(tuple(g) for g in groups)


def layer_patterns(names: Sequence[str]) -> tuple[str, ...]:
    """Regexes matching every leaf of the named top-level layers, in any collection
    ("params", "batch_stats", ...): paths like "params/head/kernel"."""
    return tuple(rf"^[^/]+/{re.escape(n)}/" for n in names)


def first_layers(model: Model, n: int, *, argument: str = "n") -> tuple[str, ...]:
    """Leaf regexes of the first n layers; ValueError unless 1 <= n < number of layers."""
    groups = _check_count(model, n, argument)
    return layer_patterns([name for g in groups[:n] for name in g])


def last_layers(model: Model, n: int, *, argument: str = "n") -> tuple[str, ...]:
    """Leaf regexes of the last n layers; ValueError unless 1 <= n < number of layers."""
    groups = _check_count(model, n, argument)
    return layer_patterns([name for g in groups[len(groups) - n :] for name in g])


def _check_count(model: Model, n: int, argument: str):
    groups = layer_groups(model)
    if not 1 <= n < len(groups):
        raise ValueError(
            f"{argument} must be in [1, {len(groups) - 1}] for this model's {len(groups)} layers "
            f"{[g[0] for g in groups]}, got {n}"
        )
    return groups


def leaf_groups(params: PyTree, by: str = "module") -> tuple[PyTree, tuple[str, ...]]:
    """Group of every leaf of one client's "params" tree.

    Args:
      params: a params tree (no client axis), e.g. {"conv_0": {"kernel", "bias"}}.
      by: "module" (the leaves of one module together) or "tensor" (one per leaf).

    Returns:
      (groups, names): a pytree like params with an int group id per leaf, and
      the L group names (module paths or leaf paths) in tree-flatten order.
    """
    if by not in LEAF_GROUPINGS:
        raise ValueError(f"grouping must be one of {LEAF_GROUPINGS}, got {by!r}")
    paths = leaf_paths(params)
    keys = [p.rsplit("/", 1)[0] if by == "module" and "/" in p else p for p in paths]
    names = tuple(dict.fromkeys(keys))
    ids = [names.index(k) for k in keys]
    return jax.tree.unflatten(jax.tree.structure(params), ids), names
