"""Hypernetwork MLP and its VJP update, against hand-written numpy and jax.grad."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.core import hypernet as H


def numpy_forward(params, index, hidden, relu_last, heads):
    h = np.asarray(params["embedding"])[index]
    for i in range(len(hidden)):
        layer = params["trunk"][f"layer_{i}"]
        h = h @ np.asarray(layer["kernel"]) + np.asarray(layer["bias"])
        if relu_last or i < len(hidden) - 1:
            h = np.maximum(h, 0.0)
    return {
        n: (h @ np.asarray(params["heads"][n]["kernel"]) + np.asarray(params["heads"][n]["bias"])).reshape(s)
        for n, s in heads.items()
    }


@pytest.mark.parametrize("relu_last", [True, False])
def test_forward_matches_numpy(relu_last):
    heads = {"a": 5, "w/kernel": (3, 2)}
    hn = H.mlp_hypernet(heads, num_embeddings=4, embedding_dim=6, hidden=(7, 8), relu_last=relu_last)
    params = hn.init(jax.random.key(0))
    chex.assert_shape(params["embedding"], (4, 6))
    chex.assert_shape(params["heads"]["w/kernel"]["kernel"], (8, 6))
    out = hn.apply(params, jnp.int32(2))
    want = numpy_forward(params, 2, (7, 8), relu_last, {"a": (5,), "w/kernel": (3, 2)})
    chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
    assert hn.heads == {"a": (5,), "w/kernel": (3, 2)}


def test_inits():
    k = jax.random.key(1)
    torch = H.dense_init(k, 16, 50, "torch")
    assert np.abs(torch["kernel"]).max() <= 0.25 and np.abs(torch["bias"]).max() <= 0.25
    assert np.asarray(torch["kernel"]).min() < 0 < np.asarray(torch["bias"]).max()
    u01 = H.dense_init(k, 16, 50, "uniform01")
    assert 0 <= np.asarray(u01["kernel"]).min() <= np.asarray(u01["kernel"]).max() <= 1
    assert not np.any(u01["bias"])
    assert not np.any(H.dense_init(k, 3, 2, "zeros")["kernel"])
    lecun = H.dense_init(k, 16, 50, "lecun_normal")
    assert not np.any(lecun["bias"]) and 0.1 < np.std(lecun["kernel"]) < 0.4


def test_init_stacked_gives_independent_networks():
    hn = H.mlp_hypernet({"a": 3}, embedding_dim=4, hidden=(5,))
    stacked = H.init_stacked(hn, jax.random.key(0), 3)
    chex.assert_tree_shape_prefix(stacked, (3,))
    assert not np.allclose(stacked["embedding"][0], stacked["embedding"][1])
    out = jax.vmap(hn.apply)(stacked, jnp.zeros(3, jnp.int32))
    chex.assert_shape(out["a"], (3, 3))


def model_generator():
    """pFedHN-shaped: a shared hypernetwork emits a two-leaf model for client c."""
    shapes = {"dense/kernel": (3, 2), "dense/bias": (2,)}
    hn = H.mlp_hypernet(shapes, num_embeddings=4, embedding_dim=5, hidden=(6, 6), relu_last=False)
    return hn, (lambda p, c: hn.apply(p, c))


def mixing_generator(stacked_models):
    """pFedLA-shaped: per-layer softmax weights mixing stacked client models."""
    hn = H.mlp_hypernet({"dense": 4}, embedding_dim=5, hidden=(6,))

    def generate(p):
        alpha = jax.nn.softmax(hn.apply(p, 0)["dense"])
        return jax.tree.map(lambda x: jnp.einsum("n,n...->...", alpha, x), stacked_models)

    return hn, generate


def test_vjp_grad_is_grad_of_inner_product_with_minus_delta():
    rng = np.random.default_rng(0)
    hn, gen = model_generator()
    params = hn.init(jax.random.key(0))
    delta = {"dense/kernel": rng.normal(size=(3, 2)), "dense/bias": rng.normal(size=(2,))}
    delta = jax.tree.map(jnp.float32, delta)

    @jax.jit
    def both(params, delta):
        def inner(p):
            out = gen(p, 1)
            return -sum(jnp.sum(out[k] * delta[k]) for k in delta)

        return H.vjp_grad(lambda p: gen(p, 1), params, delta), jax.grad(inner)(params)

    got, want = both(params, delta)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    # Only client 1's embedding row moves.
    assert np.any(got["embedding"][1]) and not np.any(np.asarray(got["embedding"])[[0, 2, 3]])

    models = {"w": jnp.asarray(rng.normal(size=(4, 3, 2)), jnp.float32)}
    hn2, gen2 = mixing_generator(models)
    p2 = hn2.init(jax.random.key(1))
    d2 = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}

    @jax.jit
    def all_three(p2, d2):
        want = jax.grad(lambda p: -jnp.sum(gen2(p)["w"] * d2["w"]))(p2)
        target, grad_fn = H.vjp_generate(gen2, p2)
        return want, H.vjp_grad(gen2, p2, d2), target, grad_fn(d2), gen2(p2)

    want, got, target, got_again, direct = all_three(p2, d2)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(got_again, want, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(target, direct)


def test_vjp_step_sign_lowers_the_clients_loss():
    """delta = -eta grad L(generate(hn)) (one local SGD step); a small hypernetwork
    step along vjp_grad must lower L(generate(hn))."""
    rng = np.random.default_rng(1)
    models = {"w": jnp.asarray(rng.normal(size=(4, 3, 2)), jnp.float32)}
    target = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    hn, gen = mixing_generator(models)

    def loss(tree):
        return jnp.sum((tree["w"] - target) ** 2)

    opt = optax.sgd(1e-3)

    @jax.jit
    def step(params):
        start = gen(params)
        delta = jax.tree.map(lambda g: -0.1 * g, jax.grad(loss)(start))
        new, _ = H.vjp_step(gen, opt, params, opt.init(params), delta)
        return loss(start), loss(gen(new)), new, H.vjp_grad(gen, params, delta)

    for seed in range(3):
        params = hn.init(jax.random.key(seed))
        before, after, new, grads = step(params)
        assert after < before
        # And an SGD step is params - lr * grad exactly.
        chex.assert_trees_all_close(new, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), rtol=1e-6)


def test_vmapped_steps_over_stacked_hypernetworks_equal_a_loop():
    rng = np.random.default_rng(2)
    models = {"w": jnp.asarray(rng.normal(size=(4, 3, 2)), jnp.float32)}
    hn, gen = mixing_generator(models)
    opt = optax.adam(1e-2)
    stacked = H.init_stacked(hn, jax.random.key(0), 3)
    states = jax.vmap(opt.init)(stacked)
    deltas = {"w": jnp.asarray(rng.normal(size=(3, 3, 2)), jnp.float32)}
    got = jax.jit(jax.vmap(lambda p, s, d: H.vjp_step(gen, opt, p, s, d)))(stacked, states, deltas)
    one = jax.jit(lambda p, s, d: H.vjp_step(gen, opt, p, s, d))
    for i in range(3):
        row = jax.tree.map(lambda x, i=i: x[i], (stacked, states, deltas))
        want = one(*row)
        chex.assert_trees_all_close(jax.tree.map(lambda x, i=i: x[i], got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(heads={}), "heads"),
        (dict(heads={"a": 2}, hidden=()), "hidden"),
        (dict(heads={"a": 2}, head_init="xavier"), "head_init"),
        (dict(heads={"a": 2}, embedding_dim=0), "embedding_dim"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        H.mlp_hypernet(**kwargs)
