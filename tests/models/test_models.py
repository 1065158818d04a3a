import chex
import jax
import jax.numpy as jnp
import pytest

from pfljax.models import build_model


@pytest.mark.parametrize(
    "name,shape", [("mlp", (100,)), ("cnn", (28, 28, 1)), ("cnn_bn", (28, 28, 1)), ("cnn", (32, 32, 3))]
)
def test_shapes_and_layer_names(name, shape):
    model = build_model(name, shape, 7)
    v = model.init(jax.random.key(0))
    out, upd = model.apply(v, jnp.ones((5, *shape)), train=True)
    chex.assert_shape(out, (5, 7))
    assert "head" in v["params"]
    if name == "cnn_bn":
        assert set(upd) == {"batch_stats"} and "bn_0" in v["batch_stats"]
    else:
        assert upd == {}


def test_unknown_model():
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("resnet1000", (3,), 2)
