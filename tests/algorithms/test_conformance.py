"""Every algorithm in `pfljax.algorithms.available()` through the same checks.

Discovered at collection time, so an algorithm added later is checked too.
Tiny MLP (its `MODEL_VARIANTS` variant where it has one), 4 clients of which 2
take part per round, 2 local steps:
- init: `client_*` leaves have the client axis leading, a `round` counter;
- rounds: finite state and metrics, `bytes_up` / `bytes_down` >= 0, round + 1;
- the jitted "vmap" and "map" rounds equal the round run eagerly with
  `python_loop_map` (a plain per-client loop), rtol 1e-5;
- evaluate gives finite [C] accuracy, loss and count, the same for the same key;
- collaboration_matrix (rows sum to 1) and final_report, where present;
- the jitted round traces once over 3 rounds;
- the same seed gives the same state bit for bit;
- a block of rounds compiled as one program (`pfljax.runtime.blocks`, the run loop's)
  equals one jitted round at a time, state, metrics and evaluation bit for bit;
- the data layouts and local loops give the same numbers: a ClientPool of uint8
  codes equals padded float arrays of the same values, and the "while" loop
  (each client only its own steps) equals the masked "scan", bit for bit under
  "map" (1 epoch, so clients of different sizes run different step counts).
Compiled without XLA optimization passes (`fast_compile`); the programs compared bit
for bit with another program with XLA's default emitters (`EXACT`).
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.core.clients import python_loop_map
from pfljax.core.local import LocalTraining
from pfljax.models import build_model
from pfljax.runtime.blocks import all_finite, make_block
from tests.algorithms.fast_compile import EXACT, fast_compile  # noqa: F401  (autouse)
from tests.algorithms.small_options import small_options
from tests.toydata import toy_data, toy_federated, toy_pool_data

COUNTS = (9, 5, 12, 3)
NUM, K = len(COUNTS), 2
SPEC = LocalTraining(optax.sgd(0.05), batch_size=4, steps=2, epochs=None)
ROUNDS = 3


def make(name, client_map):
    model = build_model(algorithms.model_variant(name, "mlp"), (6,), 3, hidden=(8,))
    options = small_options(name)
    return algorithms.get(name).build(model, SPEC, clients_per_round=K, client_map=client_map, **options)


def fields(state) -> dict:
    if dataclasses.is_dataclass(state):
        return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return state._asdict()


def round_key(r):
    return jax.random.fold_in(jax.random.key(1), r)


def assert_finite(tree, what):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = np.asarray(leaf)
        if np.issubdtype(leaf.dtype, np.inexact):
            assert np.all(np.isfinite(leaf)), f"{what}{jax.tree_util.keystr(path)} is not finite"


@pytest.mark.parametrize("name", algorithms.available())
def test_conformance(name):
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    vmap_alg, map_alg, loop_alg = make(name, "vmap"), make(name, "map"), make(name, python_loop_map)

    init = jax.jit(vmap_alg.init, static_argnums=2)
    state = init(jax.random.key(0), None, NUM)
    state_fields = fields(state)
    assert "round" in state_fields and int(state_fields["round"]) == 0, "state needs a `round` counter"
    for field, value in state_fields.items():
        if field.startswith("client_"):
            chex.assert_tree_shape_prefix(value, (NUM,))

    vmap_round = jax.jit(chex.assert_max_traces(vmap_alg.round, n=1), compiler_options=EXACT)

    states = [state]
    for r in range(ROUNDS):
        state, metrics = vmap_round(state, data, round_key(r))
        states.append(state)
        assert int(fields(state)["round"]) == r + 1
        assert_finite(state, "state")
        assert_finite(metrics, "metrics")
        for key in ("train_loss", "bytes_up", "bytes_down"):
            assert key in metrics, f"metric {key} missing"
        assert np.ndim(metrics["train_loss"]) == 0
        assert float(metrics["bytes_up"]) >= 0 and float(metrics["bytes_down"]) >= 0

    # Same seed, same result (a fresh init and the same round keys).
    again = init(jax.random.key(0), None, NUM)
    for r in range(ROUNDS):
        again, _ = vmap_round(again, data, round_key(r))
    chex.assert_trees_all_equal(states[-1], again)

    # The second round starts from client states that already differ: the per-client
    # Python loop (unrolled in one jit: compiling it once costs less than running it
    # eagerly, op by op) and the jitted "map" round must give the vmapped result.
    loop_state, loop_metrics = jax.jit(loop_alg.round)(states[1], data, round_key(1))
    map_state, _ = jax.jit(map_alg.round)(states[1], data, round_key(1))
    chex.assert_trees_all_close(loop_state, states[2], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(map_state, states[2], rtol=1e-5, atol=1e-6)
    assert_finite(loop_metrics, "loop metrics")

    eval_key = jax.random.key(7)
    evaluate = jax.jit(vmap_alg.evaluate, compiler_options=EXACT)
    scores = evaluate(states[-1], data, eval_key)
    for key in ("accuracy", "loss", "count"):
        assert np.shape(scores[key]) == (NUM,), f"evaluate()[{key!r}] must have shape [C]"
    assert_finite(scores, "evaluate")
    chex.assert_trees_all_equal(scores, evaluate(states[-1], data, eval_key))

    # The run loop's block: rounds 1-2 of a 3-round program (the third skipped), one
    # evaluation after round 2, the same numbers as one round at a time.
    def evaluate_at(s, d, k, r):
        return vmap_alg.evaluate(s, d, jax.random.fold_in(k, r))

    block = jax.jit(make_block(vmap_alg.round, evaluate_at, all_finite, length=3), compiler_options=EXACT)
    blocked, out = block(states[0], data, round_key(0), eval_key, jnp.array([0, 2, 2, 2], jnp.int32))
    one = states[0]
    for r in range(2):
        one, metrics = vmap_round(one, data, round_key(0))
        chex.assert_trees_all_equal(jax.tree.map(lambda x, r=r: x[r], out.metrics), metrics)
    chex.assert_trees_all_equal(blocked, one)
    want = evaluate(one, data, jax.random.fold_in(eval_key, 2))
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[1], out.evaluation), want)
    assert out.ran.tolist() == [True, True, False] and out.evaluated.tolist() == [False, True, False]
    assert out.ok[:2].all()

    # Optional pieces: typed fields of Algorithm, exercised where present.
    if vmap_alg.collaboration_matrix is not None:
        matrix = np.asarray(vmap_alg.collaboration_matrix(states[-1]))
        assert matrix.shape == (NUM, NUM)
        np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-4)
    if vmap_alg.final_report is not None:
        report = vmap_alg.final_report(states[-1], toy_federated(data), jax.device_get(scores), eval_key)
        assert isinstance(report, dict) and all(isinstance(k, str) for k in report)


EPOCH_SPEC = LocalTraining(optax.sgd(0.05), batch_size=4, epochs=1)


@pytest.mark.parametrize("name", algorithms.available())
def test_layouts_and_loops_give_the_same_numbers(name):
    pooled, padded = toy_pool_data(COUNTS)
    model = build_model(algorithms.model_variant(name, "mlp"), (6,), 3, hidden=(8,))

    def run(data, loop):
        spec = EPOCH_SPEC._replace(loop=loop)
        alg = algorithms.get(name).build(
            model, spec, clients_per_round=K, client_map="map", **small_options(name)
        )
        state = alg.init(jax.random.key(0), None, NUM)
        round_fn = jax.jit(alg.round, compiler_options=EXACT)
        for r in range(2):
            state, metrics = round_fn(state, data, round_key(r))
        return state, metrics, jax.jit(alg.evaluate, compiler_options=EXACT)(state, data, jax.random.key(7))

    reference = run(padded, "scan")  # the layout and loop before pools
    chex.assert_trees_all_equal(run(pooled, "while"), reference)


@pytest.mark.parametrize(
    "name", [n for n in algorithms.available() if algorithms.takes(n, "server_optimizer")]
)
def test_server_optimizer_sgd_is_the_server_learning_rate(name):
    """Every method with a server optimizer: optax.sgd(0.5) on the server gives the state
    that server_lr=0.5 gives, over two rounds; with optax.adam its state holds adam's moments."""
    model = build_model(algorithms.model_variant(name, "mlp"), (6,), 3, hidden=(8,))
    build = functools.partial(
        algorithms.get(name).build, model, SPEC, clients_per_round=K, **small_options(name)
    )
    with_lr, with_sgd = build(server_lr=0.5), build(server_optimizer=optax.sgd(0.5))
    a, b = with_lr.init(jax.random.key(0), None, NUM), with_sgd.init(jax.random.key(0), None, NUM)
    data = toy_data(COUNTS)
    for r in range(2):
        a, b = with_lr.round(a, data, round_key(r))[0], with_sgd.round(b, data, round_key(r))[0]
    chex.assert_trees_all_close(
        a._replace(server_state=()), b._replace(server_state=()), rtol=1e-5, atol=1e-6
    )
    with_adam = build(server_optimizer=optax.adam(1e-2))
    state = with_adam.round(with_adam.init(jax.random.key(0), None, NUM), data, round_key(0))[0]
    assert int(state.server_state[0].count) == 1
