"""Labels on parameter leaves, from their paths (like optax.multi_transform labels).

FedPer, LG-FedAvg, FedBN, FedRep, FedFac and Factorized-FL are all "which
leaves are averaged with whom"; a leaf's path ("params/head/kernel") decides.
Communication bytes follow from the same labels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

PyTree = Any


def path_str(path) -> str:
    """'params/head/kernel' from a jax key path."""
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def leaf_paths(tree: PyTree) -> list[str]:
    """Path strings of all leaves, in tree-flatten order."""
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def flat(tree: PyTree) -> dict:
    """{path: leaf} of a pytree, in tree-flatten order ('params/head/kernel': leaf)."""
    return dict(zip(leaf_paths(tree), jax.tree.leaves(tree)))


def match_paths(tree: PyTree, patterns: Sequence[str]) -> PyTree:
    """A bool pytree: True where a leaf's path matches any regex (re.search)."""
    compiled = [re.compile(p) for p in patterns]
    return jax.tree_util.tree_map_with_path(lambda p, _: any(c.search(path_str(p)) for c in compiled), tree)


def label_leaves(tree: PyTree, rules: Sequence[tuple[str, str]], default: str = "shared") -> PyTree:
    """A str pytree: the label of the first (regex, label) rule matching each path."""
    compiled = [(re.compile(p), label) for p, label in rules]

    def label(path, _):
        s = path_str(path)
        return next((lab for c, lab in compiled if c.search(s)), default)

    return jax.tree_util.tree_map_with_path(label, tree)


def split(tree: PyTree, is_local: PyTree) -> tuple[dict, dict]:
    """Splits a pytree into two flat dicts {path: leaf}: (shared, local)."""
    leaves, flags = flat(tree), flat(is_local)
    shared = {k: v for k, v in leaves.items() if not flags[k]}
    local = {k: v for k, v in leaves.items() if flags[k]}
    return shared, local


def merge(tree: PyTree, *overrides: dict) -> PyTree:
    """`tree` with the leaves named in the flat {path: leaf} dicts replaced."""
    leaves = flat(tree)
    for part in overrides:
        unknown = set(part) - set(leaves)
        if unknown:
            raise ValueError(f"merge got leaves the tree does not have: {sorted(unknown)}")
        leaves.update(part)
    return jax.tree.unflatten(jax.tree.structure(tree), list(leaves.values()))


def tree_bytes(tree: PyTree, where: Callable[[str], bool] | None = None) -> int:
    """Bytes of all leaves (per client: pass an unstacked tree), optionally filtered by path."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if where is None or where(path_str(path)):
            total += int(np.prod(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize
    return total
