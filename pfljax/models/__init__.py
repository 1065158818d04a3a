"""Models as pure (init, apply) pairs; `build_model` picks one by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pfljax.models.base import Model, from_flax
from pfljax.models.cnn import CNN
from pfljax.models.conv import Conv, conv2d, max_pool
from pfljax.models.factorized import FactorizedCNN, FactorizedMLP
from pfljax.models.lowrank import LowRankCNN, LowRankMLP
from pfljax.models.lstm import CharLSTM
from pfljax.models.mlp import MLP
from pfljax.models.mlp_bn import MLPBN
from pfljax.models.resnet import ResNet9

MODELS: dict[str, Callable[..., Any]] = {
    "mlp": MLP,
    "cnn": CNN,
    "cnn_bn": lambda **kw: CNN(batch_norm=True, **kw),
    "mlp_bn": MLPBN,
    "resnet9": ResNet9,
    "factorized_mlp": FactorizedMLP,
    "factorized_cnn": FactorizedCNN,
    "factorized_cnn_bn": lambda **kw: FactorizedCNN(batch_norm=True, **kw),
    "factorized_resnet9": lambda **kw: ResNet9(factorized=True, **kw),
    "lowrank_mlp": LowRankMLP,
    "lowrank_cnn": LowRankCNN,
    "char_lstm": CharLSTM,
}


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int, **kwargs) -> Model:
    """A Model by name (one of MODELS: MLP, CNN, their BatchNorm versions, ResNet-9,
    the factorized versions (Factorized-FL) and the low-rank Hadamard ones
    (pFedPara), LEAF's Shakespeare character LSTM); kwargs go to the flax module."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    module = MODELS[name](num_outputs=num_outputs, **kwargs)
    return from_flax(module, tuple(input_shape), num_outputs)


__all__ = [
    "CNN",
    "CharLSTM",
    "MLP",
    "MLPBN",
    "MODELS",
    "Conv",
    "FactorizedCNN",
    "FactorizedMLP",
    "Model",
    "ResNet9",
    "build_model",
    "conv2d",
    "from_flax",
    "max_pool",
]
