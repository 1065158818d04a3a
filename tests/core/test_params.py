import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.core import params as P

TREE = {
    "params": {
        "head": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)},
        "hidden_0": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)},
    },
    "batch_stats": {"bn_0": {"mean": jnp.zeros(3)}},
}


def test_paths_and_labels():
    assert "params/head/kernel" in P.leaf_paths(TREE)
    labels = P.label_leaves(TREE, [("batch_stats", "local_stats"), ("head", "head")])
    assert labels["params"]["head"]["bias"] == "head"
    assert labels["batch_stats"]["bn_0"]["mean"] == "local_stats"
    assert labels["params"]["hidden_0"]["kernel"] == "shared"


def test_split_merge_roundtrip_and_bytes():
    is_local = P.match_paths(TREE, ["head/"])
    shared, local = P.split(TREE, is_local)
    assert set(local) == {"params/head/kernel", "params/head/bias"}
    back = P.merge(TREE, shared, local)
    assert jax.tree.structure(back) == jax.tree.structure(TREE)
    replaced = P.merge(TREE, {"params/head/bias": jnp.full(2, 9.0)})
    np.testing.assert_array_equal(replaced["params"]["head"]["bias"], [9.0, 9.0])
    assert P.tree_bytes(TREE) == 4 * (6 + 2 + 12 + 3 + 3)
    assert P.tree_bytes(local) == 4 * 8
    with pytest.raises(ValueError, match="does not have"):
        P.merge(TREE, {"params/nope": jnp.zeros(1)})
