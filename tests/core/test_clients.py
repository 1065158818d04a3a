import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import local
from pfljax.core import clients, sampling
from pfljax.core.local import LocalTraining
from pfljax.core.round import chunked
from pfljax.models import build_model
from tests.toydata import toy_pool_data


def test_stack_unstack_gather_scatter():
    trees = [{"a": jnp.full((2,), float(i)), "b": jnp.array(i)} for i in range(4)]
    st = clients.stack(trees)
    chex.assert_tree_shape_prefix(st, (4,))
    assert clients.num_clients(st) == 4
    chex.assert_trees_all_close(clients.unstack(st)[2], trees[2])
    idx = jnp.array([3, 1])
    g = clients.gather(st, idx)
    np.testing.assert_array_equal(g["b"], [3, 1])
    s = clients.scatter(st, idx, jax.tree.map(lambda x: x * 0 - 1, g))
    np.testing.assert_array_equal(s["b"], [0, -1, 2, -1])
    chex.assert_trees_all_close(clients.take(st, jnp.int32(2)), trees[2])
    chex.assert_tree_shape_prefix(clients.broadcast({"x": jnp.zeros(3)}, 5), (5,))


@pytest.mark.parametrize("strategy,chunk", [("vmap", None), ("map", None), ("map", 2)])
def test_client_map_strategies_agree(strategy, chunk):
    xs = {"w": jnp.arange(15.0).reshape(5, 3)}
    fn = lambda t: {"s": jnp.sum(t["w"] ** 2), "v": t["w"] * 2}
    out = clients.ClientMap(strategy, chunk)(fn, xs)
    np.testing.assert_allclose(out["s"], np.sum(np.arange(15.0).reshape(5, 3) ** 2, 1))


def test_bad_strategy():
    with pytest.raises(ValueError, match="vmap"):
        clients.as_client_map("pmap")


def test_client_key_independent_of_others():
    _, train_key = clients.round_keys(jax.random.key(0), 3)
    a = clients.client_key(train_key, 5)
    b = clients.client_key(clients.round_keys(jax.random.key(0), 3)[1], 5)
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_sample_clients_distinct_static_k():
    for s in range(20):
        idx = np.asarray(sampling.sample_clients(jax.random.key(s), 10, 4))
        assert len(set(idx.tolist())) == 4 and idx.max() < 10
    np.testing.assert_array_equal(sampling.sample_clients(jax.random.key(0), 5, 5), np.arange(5))
    mask = sampling.participation_mask(jnp.array([1, 3]), 5)
    np.testing.assert_array_equal(mask, [False, True, False, True, False])


@pytest.mark.parametrize("k", [0, 11])
def test_bad_clients_per_round(k):
    with pytest.raises(ValueError, match="clients_per_round"):
        sampling.check_clients_per_round(k, 10)


def test_python_loop_map_matches_strategies():
    xs = {"w": jnp.arange(12.0).reshape(4, 3)}
    fn = lambda t: {"s": jnp.sum(t["w"] ** 2)}
    loop = clients.as_client_map(clients.python_loop_map)(fn, xs)
    chex.assert_trees_all_close(loop, clients.ClientMap("vmap")(fn, xs))
    with pytest.raises(ValueError, match="callable"):
        clients.as_client_map(3)


def test_chunks_ordered_by_size_give_the_unchunked_round():
    """With chunk_size > 1 the round maps participants in size order (a chunk's loop runs
    its largest client's steps) and puts the outputs back: same round as one at a time."""
    data = toy_pool_data((13, 2, 9, 0, 5, 7))[0]
    model = build_model("mlp", (6,), 3, hidden=(8,))
    spec = LocalTraining(optax.sgd(0.1, momentum=0.9), batch_size=4, epochs=1, loop="while")

    def run(client_map):
        alg = local.build(model, spec, clients_per_round=5, client_map=client_map)
        return jax.jit(alg.round)(alg.init(jax.random.key(0), None, 6), data, jax.random.key(1))

    assert chunked(clients.ClientMap("map", 2)) and not chunked(clients.ClientMap("map"))
    chex.assert_trees_all_close(run(clients.ClientMap("map", 2)), run("map"), rtol=1e-6, atol=1e-7)
