"""The library API's argument checks: a wrong argument gets one TypeError / ValueError
naming it and what was expected, raised in Python before JAX sees the value.

- every `@checked` build: `model` a pfljax Model, `local` a LocalTraining
  (`pfljax.core.domains.check_arguments`);
- round and evaluate: ClientData whose train, test and state agree on the number of
  clients, inputs of the model's input shape, integer labels for cross-entropy
  (`pfljax.core.round.check_clients`, `pfljax.core.evaluate.check_data`);
- `pool_clients`: per-client lists that agree;
- a correct call gives the numbers and the lowered program of the unchecked functions.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.algorithms import fedavg
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining
from pfljax.core.types import ClientArrays, ClientData
from pfljax.data.federated import pool_clients
from pfljax.models import MLP, build_model
from tests.algorithms.small_options import small_options
from tests.toydata import toy_arrays, toy_data, toy_pool_data

COUNTS = (5, 9, 3, 7)
NUM = len(COUNTS)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.05), batch_size=4, steps=2)
HEAD = ("params/head/",)  # FedAvg with the head local: the state has `client_params` [C, ...]
CHECKED = [n for n in algorithms.available() if hasattr(algorithms.get(n).build, "domains")]  # @checked


def init(alg, num=NUM):
    return alg.init(jax.random.key(0), None, num)


def test_every_model_local_build_is_checked():
    # fedrod and local build without @checked; their rounds still check data against
    # the state (federated_round), not their model / local arguments.
    assert len(CHECKED) >= len(algorithms.available()) - 2
    assert "fedavg" in CHECKED and "fedper" in CHECKED


@pytest.mark.parametrize("name", CHECKED)
def test_build_refuses_a_non_model(name):
    with pytest.raises(TypeError, match=r"build\(model=\.\.\.\): expected a pfljax Model .*got dict"):
        algorithms.get(name).build({"params": {}}, SPEC, **small_options(name))


@pytest.mark.parametrize("name", CHECKED)
def test_build_refuses_an_optimizer_as_local(name):
    with pytest.raises(TypeError, match=r"build\(local=\.\.\.\).*LocalTraining.*wrap the optax optimizer"):
        algorithms.get(name).build(MODEL, optax.sgd(0.05), **small_options(name))


def test_flax_module_is_told_to_use_from_flax():
    with pytest.raises(
        TypeError, match=r"build\(model=\.\.\.\): .*got pfljax\.models.*MLP; wrap .*from_flax"
    ):
        fedavg.build(MLP(num_outputs=3), SPEC)


def test_model_name_is_told_to_use_build_model():
    with pytest.raises(
        TypeError, match=r"got str; make one: pfljax\.models\.build_model\('mlp', input_shape"
    ):
        fedavg.build("mlp", SPEC)


def test_swapped_model_and_local():
    with pytest.raises(TypeError, match=r"build\(model=\.\.\.\).*got .*LocalTraining; .*model first"):
        fedavg.build(SPEC, MODEL)


def test_local_of_another_type_names_how_to_make_one():
    with pytest.raises(
        TypeError, match=r"build\(local=\.\.\.\): expected a LocalTraining, e\.g\. LocalTraining\("
    ):
        fedavg.build(MODEL, {"batch_size": 4}, clients_per_round=2)


def test_model_checked_before_options():
    # the type of `model` is told even where an option is also wrong
    with pytest.raises(TypeError, match="model"):
        fedavg.build(None, SPEC, server_lr=-1.0)
    with pytest.raises(ValueError, match="server_lr"):
        fedavg.build(MODEL, SPEC, server_lr=-1.0)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("call", ["round", "evaluate"])
def test_client_count_of_data_and_state(call, jit):
    alg = fedavg.build(MODEL, SPEC, local_leaves=HEAD, clients_per_round=2)
    state = init(alg)
    fn = getattr(alg, call)
    fn = jax.jit(fn) if jit else fn
    message = (
        rf"{call}\(data=\.\.\.\): data has 6 clients but the state was initialized for 4 "
        rf"\(init\(key, params, num_clients=4\)\); pass the same clients to init and {call}"
    )
    with pytest.raises(ValueError, match=message):
        fn(state, toy_data([4] * 6), jax.random.key(1))
    with pytest.raises(ValueError, match="data has 3 clients but the state was initialized for 4"):
        fn(state, toy_pool_data([4] * 3)[0], jax.random.key(1))


def test_client_count_in_the_shared_round_of_an_unchecked_build():
    # `local` is built without @checked: federated_round checks the data itself
    alg = algorithms.get("local").build(MODEL, SPEC)
    with pytest.raises(ValueError, match=r"round\(data=\.\.\.\): data has 2 clients .* initialized for 4"):
        alg.round(init(alg), toy_data([4, 4]), jax.random.key(1))


def test_train_and_test_of_different_client_counts():
    alg = fedavg.build(MODEL, SPEC)
    data = ClientData(toy_arrays(COUNTS), toy_arrays(COUNTS[:3]))
    with pytest.raises(ValueError, match=r"data\.train has 4 clients but data\.test has 3"):
        alg.round(init(alg), data, jax.random.key(1))


def test_arrays_that_disagree_on_clients():
    arrays = toy_arrays(COUNTS)
    bad = arrays._replace(count=arrays.count[:3])
    with pytest.raises(ValueError, match=r"data\.train: the arrays disagree .*x 4, y 4, count 3"):
        fedavg.build(MODEL, SPEC).round(
            init(fedavg.build(MODEL, SPEC)), ClientData(bad, arrays), jax.random.key(1)
        )
    variables = MODEL.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"evaluate_clients\(test=\.\.\.\): the arrays disagree"):
        evaluate_clients(MODEL.apply, lambda c: variables, bad, "vmap")


def test_data_of_the_wrong_type():
    alg = fedavg.build(MODEL, SPEC)
    with pytest.raises(
        TypeError, match=r"round\(data=\.\.\.\): expected a ClientData\(train, test\).*ClientArrays"
    ):
        alg.round(init(alg), toy_arrays(COUNTS), jax.random.key(1))
    with pytest.raises(TypeError, match=r"data\.test: expected a ClientPool or ClientArrays.*got dict"):
        alg.evaluate(init(alg), ClientData(toy_arrays(COUNTS), {}), jax.random.key(1))


@pytest.mark.parametrize("call", ["round", "evaluate"])
def test_feature_shape_against_the_model(call):
    alg = fedavg.build(MODEL, SPEC)
    data = toy_data(COUNTS, dim=5)
    message = rf"{call}\(data=\.\.\.\): data\.train inputs have feature shape \(5,\) .*input_shape \(6,\)"
    with pytest.raises(ValueError, match=message):
        getattr(alg, call)(init(alg), data, jax.random.key(1))


def test_float_labels_for_cross_entropy():
    alg = fedavg.build(MODEL, SPEC)
    data = toy_data(COUNTS)
    floats = data._replace(test=data.test._replace(y=data.test.y.astype(jnp.float32)))
    with pytest.raises(ValueError, match=r"data\.test\.y must hold integer class labels .*'cross_entropy'"):
        alg.evaluate(init(alg), floats, jax.random.key(1))
    # regression ("mse") takes float targets
    regression = fedavg.build(MODEL, SPEC._replace(loss="mse"))
    targets = data._replace(
        train=data.train._replace(y=jax.nn.one_hot(data.train.y, 3)),
        test=data.test._replace(y=jax.nn.one_hot(data.test.y, 3)),
    )
    regression.round(init(regression), targets, jax.random.key(1))


@pytest.mark.parametrize("layout", ["padded", "pool"])
def test_a_correct_call_is_the_unchecked_function(layout):
    # the checks read shapes only: the same numbers and the same lowered program as the
    # functions they wrap
    pooled, padded = toy_pool_data(COUNTS)
    data = pooled if layout == "pool" else padded
    alg = fedavg.build(MODEL, SPEC, local_leaves=HEAD, clients_per_round=2)
    state, key = init(alg), jax.random.key(3)
    for checked, plain in ((alg.round, alg.round.__wrapped__), (alg.evaluate, alg.evaluate.__wrapped__)):
        assert plain is not checked
        chex.assert_trees_all_equal(jax.jit(checked)(state, data, key), jax.jit(plain)(state, data, key))
        lowered = [jax.jit(f).lower(state, data, key).as_text() for f in (checked, plain)]
        assert lowered[0] == lowered[1]
    new, metrics = alg.round(state, data, key)
    assert int(new.round) == 1 and int(metrics["participants"]) == 2
    assert np.isfinite(float(metrics["train_loss"]))
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new.global_params, state.global_params)
    assert moved["params"]["hidden_0"] == {"bias": True, "kernel": True}  # shared leaves averaged
    assert moved["params"]["head"] == {"bias": False, "kernel": False}  # the local head is not
    rows = jax.tree.map(
        lambda a, b: np.asarray(jnp.any(a != b, axis=tuple(range(1, a.ndim)))),
        new.client_params,
        state.client_params,
    )
    assert all(int(np.sum(r)) == 2 for r in jax.tree.leaves(rows))  # the 2 participants' heads


def test_pool_clients_lists_of_different_lengths():
    xs, ys = [np.zeros((3, 2), np.float32)] * 3, [np.zeros(3, np.int32)] * 2
    with pytest.raises(ValueError, match="pool_clients: xs has 3 clients but ys has 2"):
        pool_clients(xs, ys)


def test_pool_clients_trailing_shapes():
    xs = [np.zeros((3, 2), np.float32), np.zeros((4, 2), np.float32), np.zeros((2, 5), np.float32)]
    ys = [np.zeros(n, np.int32) for n in (3, 4, 2)]
    with pytest.raises(
        ValueError, match=r"pool_clients: xs\[2\] has rows of shape \(5,\) but xs\[0\] has \(2,\)"
    ):
        pool_clients(xs, ys)
    with pytest.raises(ValueError, match=r"ys\[1\] has rows of shape \(2,\) but ys\[0\] has \(\)"):
        pool_clients(xs[:2], [ys[0], np.zeros((4, 2), np.float32)])


def test_pool_clients_rows_of_x_and_y():
    xs = [np.zeros((3, 2), np.float32), np.zeros((4, 2), np.float32)]
    with pytest.raises(ValueError, match=r"pool_clients: client 1 has 4 rows in xs\[1\] but 3 in ys\[1\]"):
        pool_clients(xs, [np.zeros(3, np.int32), np.zeros(3, np.int32)])


def test_pool_clients_of_agreeing_lists_unchanged():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 2)).astype(np.float32) for n in (3, 0, 4)]
    ys = [rng.integers(0, 3, n).astype(np.int32) for n in (3, 0, 4)]
    pool = pool_clients(xs, ys)
    np.testing.assert_array_equal(pool.count, [3, 0, 4])
    for c in range(3):
        view = pool.client(jnp.int32(c))
        np.testing.assert_array_equal(np.asarray(view.x)[: len(xs[c])], xs[c])
        np.testing.assert_array_equal(np.asarray(view.y)[: len(ys[c])], ys[c])
    assert isinstance(pool.padded(), ClientArrays)
