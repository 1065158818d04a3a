"""Models as pure (init, apply) pairs; `build_model` picks one by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pfljax.models.base import Model, from_flax
from pfljax.models.cnn import CNN
from pfljax.models.conv import Conv, conv2d, max_pool
from pfljax.models.mlp import MLP

MODELS: dict[str, Callable[..., Any]] = {
    "mlp": MLP,
    "cnn": CNN,
    "cnn_bn": lambda **kw: CNN(batch_norm=True, **kw),
}


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int, **kwargs) -> Model:
    """A Model by name ("mlp", "cnn", "cnn_bn"); kwargs go to the flax module."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    module = MODELS[name](num_outputs=num_outputs, **kwargs)
    return from_flax(module, tuple(input_shape), num_outputs)


__all__ = ["CNN", "MLP", "MODELS", "Conv", "Model", "build_model", "conv2d", "from_flax", "max_pool"]
