import re

import jax
import pytest

from pfljax.core import layers
from pfljax.core.params import leaf_paths
from pfljax.models import build_model


def selected(model, patterns):
    paths = leaf_paths(jax.eval_shape(model.init, jax.random.key(0)))
    return sorted(p for p in paths if any(re.search(q, p) for q in patterns))


def test_forward_order_groups_norm_layers_with_their_layer():
    cnn = build_model("cnn_bn", (12, 12, 1), 4, channels=(2, 3), dense=(5,), kernel_size=3)
    assert layers.param_order(cnn) == ("conv_0", "bn_0", "conv_1", "bn_1", "dense_0", "head")
    assert layers.layer_groups(cnn) == (("conv_0", "bn_0"), ("conv_1", "bn_1"), ("dense_0",), ("head",))
    first = selected(cnn, layers.first_layers(cnn, 1))
    assert first == [
        "batch_stats/bn_0/mean",
        "batch_stats/bn_0/var",
        "params/bn_0/bias",
        "params/bn_0/scale",
        "params/conv_0/bias",
        "params/conv_0/kernel",
    ]
    assert selected(cnn, layers.last_layers(cnn, 1)) == ["params/head/bias", "params/head/kernel"]


def test_mlp_layers_and_bounds():
    mlp = build_model("mlp", (6,), 3, hidden=(8, 4))
    assert layers.layer_groups(mlp) == (("hidden_0",), ("hidden_1",), ("head",))
    assert selected(mlp, layers.last_layers(mlp, 2))[0] == "params/head/bias"
    assert len(selected(mlp, layers.last_layers(mlp, 2))) == 4
    for n in (0, 3):
        with pytest.raises(ValueError, match="personal"):
            layers.last_layers(mlp, n, argument="personal")


def test_leaf_groups_module_and_tensor():
    """Per-leaf groups (pFedLA's layer groups), in tree-flatten order."""
    cnn = build_model("cnn_bn", (28, 28, 1), 10)
    params = jax.eval_shape(cnn.init, jax.random.key(0))["params"]
    groups, names = layers.leaf_groups(params, "module")
    assert names == ("bn_0", "bn_1", "conv_0", "conv_1", "dense_0", "head")  # tree-flatten order
    assert groups["bn_0"] == {"scale": 0, "bias": 0} and groups["head"] == {"kernel": 5, "bias": 5}
    _, tensors = layers.leaf_groups(params, "tensor")
    assert len(tensors) == len(jax.tree.leaves(params)) == 12 and "head/kernel" in tensors
    with pytest.raises(ValueError, match="grouping"):
        layers.leaf_groups(params, "block")
