"""pfljax.core.heads: the head's call replaced by a function of the features."""

import chex
import jax
import jax.numpy as jnp
import pytest

from pfljax.core import heads as H
from pfljax.models import build_model


@pytest.mark.parametrize("name", ["mlp", "cnn_bn"])
def test_dense_of_features_is_the_model(name):
    model = build_model(name, (28, 28, 1), 10)
    variables = model.init(jax.random.key(0))
    head = H.linear_head(model, "test")
    x = jax.random.normal(jax.random.key(1), (5, 28, 28, 1))
    out, updates = model.apply(variables, x, train=True)
    z, z_updates = H.features(model, head, variables, x, train=True)
    assert z.shape == (5, H.feature_dim(model, head))
    chex.assert_trees_all_close(H.dense(variables["params"][head], z), out, atol=1e-5)
    chex.assert_trees_all_close(z_updates, updates)  # BatchNorm statistics move as in the model


def test_head_fn_replaces_the_head_under_jit_vmap_and_grad():
    model = build_model("mlp", (28, 28, 1), 10)
    variables = model.init(jax.random.key(0))
    head = H.linear_head(model, "test")
    x = jax.random.normal(jax.random.key(1), (3, 4, 28, 28, 1))

    def doubled(params, xb):
        v = {**variables, "params": params}
        return H.apply_with_head(model, head, v, xb, False, lambda z: 2.0 * H.dense(params[head], z))[0]

    got = jax.jit(jax.vmap(doubled, in_axes=(None, 0)))(variables["params"], x)
    want = jnp.stack([2.0 * model.apply(variables, xb)[0] for xb in x])
    chex.assert_trees_all_close(got, want, atol=1e-5)
    grad = jax.grad(lambda p: jnp.sum(doubled(p, x[0])))(variables["params"])
    want_grad = jax.grad(lambda p: 2.0 * jnp.sum(model.apply({**variables, "params": p}, x[0])[0]))(
        variables["params"]
    )
    chex.assert_trees_all_close(grad, want_grad, atol=1e-4)


def test_take_and_put_head_round_trip():
    model = build_model("mlp", (28, 28, 1), 10)
    variables = model.init(jax.random.key(0))
    body, head_params = H.take_head(variables, "head")
    assert "head" not in body["params"]
    chex.assert_trees_all_equal(H.put_head(body, "head", head_params), variables)


def test_a_model_without_a_dense_head_is_refused():
    model = build_model("factorized_mlp", (28, 28, 1), 10)
    with pytest.raises(ValueError, match="FedX needs a model whose last layer is one Dense"):
        H.linear_head(model, "FedX")
