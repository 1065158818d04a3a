"""ResNet-9 (plain and factorized): layout, feature size, residuals, BatchNorm, materialize."""

import functools

import chex
import flax.linen as nn
import jax
import numpy as np
import pytest

from pfljax.models import build_model
from pfljax.models.conv import conv2d
from pfljax.models.factorized import materialize
from pfljax.models.resnet import ResNet9

SMALL = dict(widths=(4, 6, 8))


def paper_parameter_count(num_classes: int, channels: int = 3) -> int:
    """The release's ResNet-9 (bias-free convs, BN scale/offset, Dense head)."""
    convs = 9 * channels * 64 + 25 * 64 * 128 + 2 * 9 * 128 * 128 + 9 * 128 * 256 + 3 * 9 * 256 * 256
    bn = 2 * (64 + 3 * 128 + 4 * 256)
    return convs + bn + 256 * num_classes + num_classes


@pytest.mark.parametrize("shape", [(32, 32, 3), (28, 28, 1)])
def test_full_size_parameter_count_and_output(shape):
    model = build_model("resnet9", shape, 10)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))
    assert count == paper_parameter_count(10, shape[-1])
    assert shapes["params"]["head"]["kernel"].shape == (256, 10)  # the 256-d feature
    assert shapes["params"]["conv_1"]["kernel"].shape == (5, 5, 64, 128)
    assert set(shapes) == {"params", "batch_stats"}
    x = jax.ShapeDtypeStruct((2, *shape), np.float32)
    out, updates = jax.eval_shape(functools.partial(model.apply, train=True), shapes, x)
    assert out.shape == (2, 10) and set(updates) == {"batch_stats"}


def test_residual_blocks_add_their_input():
    """conv_4's input is conv_2's input plus relu(bn_3's output)."""
    module = ResNet9(num_outputs=3, **SMALL)
    x = jax.random.normal(jax.random.key(0), (2, 12, 12, 1))
    variables = jax.jit(module.init)(jax.random.key(1), x)

    @jax.jit
    def inputs_and_outputs(variables, x):
        seen = {}

        def spy(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.method_name == "__call__" and context.module.name in ("conv_2", "conv_4", "bn_3"):
                seen[context.module.name] = (args[0], out)
            return out

        with nn.intercept_methods(spy):
            module.apply(variables, x)
        return seen

    seen = inputs_and_outputs(variables, x)
    expected = seen["conv_2"][0] + jax.nn.relu(seen["bn_3"][1])
    np.testing.assert_allclose(seen["conv_4"][0], expected, rtol=1e-5, atol=1e-6)
    kernel = variables["params"]["conv_4"]["kernel"]
    np.testing.assert_allclose(seen["conv_4"][1], conv2d(expected, kernel), rtol=1e-4, atol=1e-5)


def test_factorized_resnet_materializes_to_the_plain_one():
    plain = build_model("resnet9", (12, 12, 1), 4, **SMALL)
    fact = build_model("factorized_resnet9", (12, 12, 1), 4, rank=2, **SMALL)
    variables = jax.jit(fact.init)(jax.random.key(0))
    assert variables["params"]["conv_7"]["u"].shape == (9, 2)
    assert variables["params"]["conv_7"]["v"].shape == (8 * 8, 2)
    assert "bias" not in variables["params"]["conv_7"]
    chex.assert_trees_all_equal_shapes(materialize(variables), jax.eval_shape(plain.init, jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (3, 12, 12, 1))

    @jax.jit
    def both(variables, x):
        dense = materialize(variables)
        return [(plain.apply(dense, x, train=t), fact.apply(variables, x, train=t)) for t in (False, True)]

    (eval_p, eval_f), (train_p, train_f) = both(variables, x)
    chex.assert_trees_all_close(eval_p, eval_f, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(train_p, train_f, rtol=1e-4, atol=1e-5)
    assert eval_f[0].shape == (3, 4) and eval_f[1] == {}
    moved = jax.tree.map(
        lambda a, b: not np.allclose(a, b), train_f[1]["batch_stats"], variables["batch_stats"]
    )
    assert all(jax.tree.leaves(moved))
