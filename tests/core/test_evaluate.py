import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.core.clients import ClientMap, python_loop_map, take
from pfljax.core.evaluate import (
    evaluate_client,
    evaluate_clients,
    predict_rows,
    scores_from_outputs,
    summarize,
)
from pfljax.core.types import ClientArrays
from pfljax.runtime import replicas
from tests.toydata import toy_pool

CHUNK = 8
# fewer rows than a chunk, an exact multiple of it, empty, several chunks and a tail
COUNTS = [3, 16, 0, 37]
DIM, CLASSES = 6, 3
POOL, PADDED = toy_pool(COUNTS, dim=DIM, classes=CLASSES, seed=3)
KEYS = jax.random.split(jax.random.key(0), 2)
STACKED = {  # one linear model per client
    "w": jax.random.normal(KEYS[0], (len(COUNTS), DIM, CLASSES)),
    "b": jax.random.normal(KEYS[1], (len(COUNTS), CLASSES)),
}
MAPS = {
    "vmap": ClientMap("vmap"),
    "map": ClientMap("map"),
    "map2": ClientMap("map", 2),
    "loop": python_loop_map,
}


def apply_fn(variables, x, train=False):
    del train
    return x.reshape(x.shape[0], -1) @ variables["w"] + variables["b"][None], {}


def reference(variables_of) -> dict:
    """Plain numpy per client on its real rows."""
    out = {"accuracy": [], "loss": [], "count": []}
    for c, n in enumerate(COUNTS):
        v = jax.tree.map(np.asarray, variables_of(c))
        x, y = np.asarray(PADDED.x[c, :n], np.float64), np.asarray(PADDED.y[c, :n])
        logits = x @ v["w"] + v["b"]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        out["accuracy"].append(np.mean(logits.argmax(-1) == y) if n else 0.0)
        out["loss"].append(-np.mean(logp[np.arange(n), y]) if n else 0.0)
        out["count"].append(n)
    return out


def padded_old(variables_of, test) -> dict:
    """The previous evaluation: every client on an n_max-row window."""
    return python_loop_map(
        lambda c: scores_from_outputs(
            predict_rows(lambda xb: apply_fn(variables_of(c), xb)[0], take(test, c).x, CHUNK), take(test, c)
        ),
        jnp.arange(len(COUNTS)),
    )


def own(c):
    return take(STACKED, c)


def shared(c):
    del c
    return take(STACKED, 0)


def check(got, want):
    np.testing.assert_array_equal(got["count"], want["count"])
    np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)


VARIABLES = {"own": own, "shared": shared}
CASES = [  # (client map, models, layout): vmap runs the flat schedule, the others a loop per client
    ("vmap", "own", "pool"),
    ("vmap", "shared", "pool"),
    ("map", "own", "pool"),
    ("map", "shared", "pool"),
    ("map2", "own", "pool"),
    ("loop", "own", "pool"),
    ("vmap", "own", "padded"),
    ("vmap", "shared", "padded"),
    ("map", "own", "padded"),
]


@pytest.fixture(scope="module")
def loop_scores():
    """python_loop_map's scores of each layout (the per-client oracle)."""
    return {
        layout: jax.jit(lambda t: evaluate_clients(apply_fn, own, t, python_loop_map, chunk=CHUNK))(test)
        for layout, test in (("pool", POOL), ("padded", PADDED))
    }


@pytest.mark.parametrize("strategy,models,layout", CASES)
def test_real_rows_match_reference_and_loop(strategy, models, layout, loop_scores):
    test = POOL if layout == "pool" else PADDED
    fn = VARIABLES[models]
    got = jax.jit(lambda t: evaluate_clients(apply_fn, fn, t, MAPS[strategy], chunk=CHUNK))(test)
    check(got, reference(fn))
    if models == "own":
        chex.assert_trees_all_close(got, loop_scores[layout], rtol=1e-6)


@pytest.mark.parametrize("strategy", ["vmap", "map", "loop"])
@pytest.mark.parametrize("layout", ["pool", "padded"])
def test_one_pass_when_no_client_outgrows_a_chunk(strategy, layout):
    """chunk >= n_max: one pass per client, no chunk loop (lax.map's loop over clients
    is the only one); same scores."""
    test = POOL if layout == "pool" else PADDED
    run = jax.jit(lambda t: evaluate_clients(apply_fn, own, t, MAPS[strategy], chunk=max(COUNTS)))
    assert run.lower(test).as_text().count("stablehlo.while") == (strategy == "map")
    check(run(test), reference(own))


def test_reference_is_the_old_padded_evaluation():
    old = jax.jit(lambda t: padded_old(own, t))(PADDED)
    check(old, reference(own))


@pytest.mark.parametrize("strategy", ["vmap", "map"])
def test_under_replica_wrappers(strategy):
    """R = 2 models per client, mapped over R like `replicate` does."""
    reps = jax.tree.map(lambda a: jnp.stack([a, -a]), STACKED)

    def one(variables):
        return evaluate_clients(apply_fn, lambda c: take(variables, c), POOL, MAPS[strategy], chunk=CHUNK)

    got = jax.jit(lambda v: replicas._over_replicas(one, strategy)(v))(reps)
    for r in range(2):
        check(replicas.take(got, r), reference(lambda c, r=r: take(replicas.take(reps, r), c)))


def test_evaluate_client_one_client():
    run = jax.jit(lambda v, d: evaluate_client(apply_fn, v, d, chunk=CHUNK))
    want = reference(own)
    for c in (0, 1, 3):
        got = run(own(c), take(POOL, c))
        np.testing.assert_allclose(got["accuracy"], want["accuracy"][c], rtol=1e-6)
        np.testing.assert_allclose(got["loss"], want["loss"][c], rtol=1e-5)


def test_scores_ignore_padding():
    logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [9.0, 0.0]])
    data = ClientArrays(jnp.zeros((4, 1)), jnp.array([0, 1, 1, 1]), jnp.int32(3))
    s = scores_from_outputs(logits, data)
    np.testing.assert_allclose(s["accuracy"], 2 / 3, rtol=1e-6)


def test_predict_rows_chunks_match_full():
    x = jnp.arange(30.0).reshape(10, 3)
    out = predict_rows(lambda xb: xb.sum(-1), x, chunk=4)
    np.testing.assert_allclose(out, np.arange(30.0).reshape(10, 3).sum(-1))


def test_summarize_weighted_std_worst():
    per = {
        "accuracy": np.array([0.5, 1.0, 0.9, 0.8, 0.7, 0.6, 0.9, 0.95, 1.0, 0.2]),
        "loss": np.ones(10),
        "count": np.array([10, 30, 10, 10, 10, 10, 10, 10, 10, 10]),
    }
    s = summarize(per)
    w = per["count"] / per["count"].sum()
    np.testing.assert_allclose(s["mean_accuracy"], np.sum(w * per["accuracy"]))
    np.testing.assert_allclose(s["worst10_accuracy"], 0.2)
    np.testing.assert_allclose(s["std_accuracy"], np.std(per["accuracy"]))
