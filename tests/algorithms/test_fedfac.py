"""FedFac: the mapped round against a per-client loop written here, FedAvg / FedPer limits,
splits, ablations, new clients, and a small simulation run."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedavg, fedfac
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.params import flat
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import EXACT
from tests.toydata import toy_data, toy_federated

COUNTS = (12, 7, 20, 3, 9, 15, 11, 8)
MODEL = build_model("mlp", (6,), 3, hidden=(8, 8))
SPEC = LocalTraining(optax.sgd(0.2, momentum=0.5), batch_size=4, epochs=2, steps=None)
KERNEL, BIAS = "params/hidden_0/kernel", "params/hidden_0/bias"
TRAIN = jax.jit(make_local_train(MODEL.apply, SPEC))
SPLIT = jax.jit(fedfac.factor_split, static_argnames=("kappa", "tau_quantile"))
EVAL_KEY = jax.random.key(11)


def loop_round(glob, own, shared, data, key, r, k, server_lr, tau):
    """Reference round on hidden_0, written from the method's description with numpy."""
    sample_key, train_key = round_keys(key, r)
    idx = np.asarray(sample_clients(sample_key, len(COUNTS), k))
    g = {p: np.asarray(v) for p, v in flat(glob).items()}
    starts, outs = [], []
    for c in idx:
        start = dict(g)
        start[KERNEL] = np.where(shared[None, :], g[KERNEL], own[KERNEL][c])
        start[BIAS] = np.where(shared, g[BIAS], own[BIAS][c])
        variables = jax.tree.unflatten(jax.tree.structure(glob), [start[p] for p in g])
        trained = TRAIN(variables, take(data.train, c), client_key(train_key, c)).params
        starts.append(start)
        outs.append({p: np.asarray(v) for p, v in flat(trained).items()})
    w = np.asarray([COUNTS[c] for c in idx], np.float64)
    w = w / w.sum()
    mean = {p: sum(wi * o[p] for wi, o in zip(w, outs)) for p in g}
    mean_start = {p: sum(wi * s[p] for wi, s in zip(w, starts)) for p in g}
    z = np.stack([o[KERNEL] for o in outs]).reshape(-1, 8)
    new_shared = np.asarray(SPLIT(jnp.asarray(z), kappa=0.85, tau_quantile=tau).shared)
    new = {}
    for p in g:
        base = g[p]
        if p == KERNEL:
            base = np.where(shared[None, :], g[p], mean_start[p])
        if p == BIAS:
            base = np.where(shared, g[p], mean_start[p])
        new[p] = base + server_lr * (mean[p] - base)
    own = {p: v.copy() for p, v in own.items()}
    for c, o in zip(idx, outs):
        own[KERNEL][c], own[BIAS][c] = o[KERNEL], o[BIAS]
    return jax.tree.unflatten(jax.tree.structure(glob), [new[p] for p in g]), own, new_shared


@pytest.mark.parametrize("strategy,k", [("map", 5), ("vmap", 8)])
def test_round_equals_per_client_loop(strategy, k):
    data = toy_data(COUNTS)
    alg = fedfac.build(
        MODEL, SPEC, clients_per_round=k, client_map=strategy, tau_quantile=50.0, server_lr=0.8
    )
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    glob, shared = state.global_params, np.ones(8, bool)
    own = {p: np.array(v) for p, v in state.client_params.items()}
    rnd = jax.jit(alg.round)
    for r in range(3):
        state, metrics = rnd(state, data, jax.random.key(7))
        glob, own, shared = loop_round(glob, own, shared, data, jax.random.key(7), r, k, 0.8, 50.0)
        np.testing.assert_array_equal(state.global_shared["hidden_0"], shared)
        chex.assert_trees_all_close(state.global_params, glob, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state.client_params, own, rtol=1e-5, atol=1e-6)
    assert int(np.sum(shared)) == 4
    assert metrics["shared_fraction_hidden_0"] == 0.5
    # Per client: all of hidden_1 and head, the full hidden_0 kernel (for the split), shared biases.
    per_client = 4 * (8 * 8 + 8 + 8 * 3 + 3 + 6 * 8 + 4)
    assert metrics["bytes_up"] == k * per_client
    assert np.isfinite(metrics["train_loss"])


def test_static_split_traces_once_and_stays_fixed():
    data = toy_data(COUNTS)
    alg = fedfac.build(MODEL, SPEC, clients_per_round=3, mode="static", tau_quantile=25.0)

    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))

    state = alg.init(jax.random.key(0), None, len(COUNTS))
    history = []
    for r in range(4):
        state, m = rnd(state, data, jax.random.fold_in(jax.random.key(0), r))
        history.append(
            (
                np.asarray(state.global_shared["hidden_0"]),
                int(m["participants"]),
                float(m["unchanged_fraction"]),
                int(m["fa_iterations_hidden_0"]),
            )
        )
    assert history[0][1] == len(COUNTS)  # round 0 is the warm-up of every client
    assert [h[1] for h in history[1:]] == [3, 3, 3]
    assert int(np.sum(~history[0][0])) == 2
    assert history[0][3] >= 1 and [h[3] for h in history[1:]] == [0, 0, 0]  # one analysis
    for split, _, unchanged, _ in history[1:]:
        np.testing.assert_array_equal(split, history[0][0])
        assert unchanged == 1.0
    assert int(state.round) == 4


def test_round_metrics_report_the_factor_analysis_convergence():
    data = toy_data(COUNTS)
    alg = fedfac.build(MODEL, SPEC, layers=(0, 1), tau_quantile=25.0)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    _, m = jax.jit(alg.round)(state, data, jax.random.key(1))
    for name in ("hidden_0", "hidden_1"):
        assert 1 <= int(m[f"fa_iterations_{name}"]) < 500
        assert float(m[f"fa_converged_{name}"]) == 1.0 and float(m[f"fa_change_{name}"]) < 1e-6


def run(alg, data, rounds=3, key=5, evaluate=True):
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    rnd = jax.jit(alg.round, compiler_options=EXACT)
    for _ in range(rounds):
        state, metrics = rnd(state, data, jax.random.key(key))
    return state, metrics, (jax.jit(alg.evaluate)(state, data, EVAL_KEY) if evaluate else None)


def assert_same(a, b):
    """Bit for bit on CPU. Two different programs on GPU/TPU may fuse and order their
    reductions differently (seen on an H100: 1 ulp in the head), so there float32 rounding."""
    if jax.default_backend() == "cpu":
        chex.assert_trees_all_equal(a, b)
    else:
        chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)


def test_tau_zero_is_fedavg_bit_for_bit():
    data = toy_data(COUNTS)
    a, ma, ea = run(fedfac.build(MODEL, SPEC, clients_per_round=5, tau_quantile=0.0, server_lr=0.7), data)
    b, mb, eb = run(fedavg.build(MODEL, SPEC, clients_per_round=5, server_lr=0.7), data)
    assert_same(a.global_params, b.global_params)
    assert_same(
        {k: ea[k] for k in ("accuracy", "loss", "count")}, {k: eb[k] for k in ("accuracy", "loss", "count")}
    )
    assert_same(ma["train_loss"], mb["train_loss"])


def test_tau_hundred_on_last_hidden_layer_is_fedper_bit_for_bit():
    """All units of hidden_1 personalized: hidden_1 never leaves the clients (their models
    equal FedPer-style ones bit for bit), the other layers are FedAvg's."""
    data = toy_data(COUNTS)
    fac = fedfac.build(MODEL, SPEC, clients_per_round=5, layers=(-2,), tau_quantile=100.0)
    a, ma, _ = run(fac, data, evaluate=False)
    b, mb, _ = run(
        fedavg.build(MODEL, SPEC, clients_per_round=5, local_leaves=("params/hidden_1/",)),
        data,
        evaluate=False,
    )
    other = lambda t: {p: v for p, v in flat(t).items() if "hidden_1" not in p}  # noqa: E731
    assert_same(other(a.global_params), other(b.global_params))
    assert_same(a.client_params, b.client_params)
    assert ma["bytes_up"] == mb["bytes_up"]
    assert_same(ma["train_loss"], mb["train_loss"])


def test_masking_an_empty_group_changes_nothing():
    """mask="personalized" with no personalized unit (tau=0) is the unmasked run."""
    data = toy_data(COUNTS)
    states = []
    for mask in ("personalized", "none"):
        alg = fedfac.build(MODEL, SPEC, tau_quantile=0.0, mask=mask, clients_per_round=5, server_lr=0.7)
        state = alg.init(jax.random.key(0), None, len(COUNTS))
        states.append(jax.jit(alg.round, compiler_options=EXACT)(state, data, jax.random.key(5))[0])
    chex.assert_trees_all_equal(states[0], states[1])


def test_masking_shared_units_draws_standard_normal_values():
    data = toy_data(COUNTS)
    alg = fedfac.build(MODEL, SPEC, tau_quantile=50.0, split="fixed", mask="shared")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    plain = fedfac.build(MODEL, SPEC, tau_quantile=50.0, split="fixed")
    ea, eb = alg.evaluate(state, data, EVAL_KEY), plain.evaluate(state, data, EVAL_KEY)
    assert not np.allclose(ea["loss"], eb["loss"])
    state, _ = jax.jit(alg.round)(state, data, jax.random.key(0))
    # Shared units (the last 4) started from N(0, 1) draws, so trained values are far from init (~0.4 std).
    shared_std = float(np.std(np.asarray(state.client_params[KERNEL])[:, :, 4:]))
    personal_std = float(np.std(np.asarray(state.client_params[KERNEL])[:, :, :4]))
    assert shared_std > 0.7 and personal_std < 0.7, (shared_std, personal_std)


def test_random_and_fixed_splits_keep_the_proportion():
    data = toy_data(COUNTS)
    alg = fedfac.build(MODEL, SPEC, split="random", tau_quantile=37.5, clients_per_round=4)
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    masks = []
    for r in range(3):
        state, m = jax.jit(alg.round)(state, data, jax.random.key(r))
        masks.append(np.asarray(state.global_shared["hidden_0"]))
        assert int(np.sum(~masks[-1])) == 3 and m["shared_fraction"] == 5 / 8
    assert any(not np.array_equal(masks[0], x) for x in masks[1:])
    fixed = fedfac.build(MODEL, SPEC, split="fixed", tau_quantile=37.5).init(jax.random.key(0), None, 8)
    np.testing.assert_array_equal(fixed.global_shared["hidden_0"], [False] * 3 + [True] * 5)


def masked_sgd(trainable):
    """SGD with momentum whose updates are zeroed outside `trainable` (a bool pytree)."""

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, t: u * t, updates, trainable), state

    return optax.chain(SPEC.optimizer, optax.GradientTransformation(lambda p: optax.EmptyState(), update))


def test_new_clients_never_train_and_get_localtrain_and_ensemble():
    """New clients: rows untouched by training; LocalTrain equals training written here with the
    frozen parameters' updates masked out; Ensemble equals a mean of softmaxes written here."""
    data = toy_data(COUNTS)
    alg = fedfac.build(
        MODEL,
        SPEC,
        clients_per_round=3,
        new_client_fraction=0.25,
        layers=("head",),
        split="fixed",
        tau_quantile=50.0,
    )
    state0 = alg.init(jax.random.key(0), None, len(COUNTS))
    state, _, per_client = run(alg, data, rounds=3)
    new = np.asarray(state.client_new)
    assert new.sum() == 2
    chex.assert_trees_all_equal(
        {p: v[new] for p, v in state.client_params.items()},
        {p: v[new] for p, v in state0.client_params.items()},
    )
    np.testing.assert_array_equal(per_client["new_client"], new.astype(np.float32))
    personal = ~np.asarray(state.global_shared["head"])
    assert personal.tolist() == [True, True, False]

    def model_of(c):
        leaves = flat(state.global_params)
        for leaf in ("kernel", "bias"):
            path = f"params/head/{leaf}"
            leaves[path] = np.where(personal, state.client_params[path][c], leaves[path])
        return jax.tree.unflatten(jax.tree.structure(state.global_params), list(leaves.values()))

    trainable = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), state.global_params["params"])
    trainable["head"] = {
        "kernel": np.tile(personal, (8, 1)).astype(np.float32),
        "bias": personal.astype(np.float32),
    }
    tune = jax.jit(make_local_train(MODEL.apply, SPEC._replace(optimizer=masked_sgd(trainable), epochs=1)))
    existing = [model_of(j) for j in np.flatnonzero(~new)]
    for c in np.flatnonzero(new):
        n = int(data.test.count[c])
        x, y = data.test.x[c][:n], data.test.y[c][:n]
        tuned = tune(model_of(c), take(data.train, c), client_key(EVAL_KEY, c)).params
        logits = MODEL.apply(tuned, x)[0]
        np.testing.assert_allclose(per_client["accuracy"][c], np.mean(np.argmax(logits, -1) == y), atol=1e-6)
        loss = np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
        np.testing.assert_allclose(per_client["loss"][c], loss, rtol=1e-4)
        probs = np.mean([jax.nn.softmax(MODEL.apply(m, x)[0]) for m in existing], axis=0)
        np.testing.assert_allclose(
            per_client["ensemble_accuracy"][c], np.mean(np.argmax(probs, -1) == y), atol=1e-6
        )
    report = fedfac.final_report(state, None, per_client)
    assert set(report) >= {
        "existing_clients_accuracy",
        "new_clients_localtrain_accuracy",
        "new_clients_ensemble_accuracy",
    }


def test_final_report_weights_new_clients_localtrain_accuracy_by_test_size():
    """Algorithm.final_report, given the final evaluation, reports the new clients' LocalTrain
    accuracy as their test-size-weighted mean (computed here from the state and the data)."""
    data = toy_data(COUNTS)
    alg = fedfac.build(MODEL, SPEC, clients_per_round=3, new_client_fraction=0.25, tau_quantile=50.0)
    state, _, _ = run(alg, data, rounds=2, evaluate=False)
    key = jax.random.key(3)
    per_client = jax.device_get(jax.jit(alg.evaluate)(state, data, key))
    report = alg.final_report(state, toy_federated(data), per_client, key)
    new = np.asarray(state.client_new)
    count = np.asarray(data.test.count, np.float64)
    assert new.sum() == 2
    expected = np.sum(np.asarray(per_client["accuracy"])[new] * count[new]) / np.sum(count[new])
    np.testing.assert_allclose(report["new_clients_localtrain_accuracy"], expected, rtol=1e-12)
    existing = np.sum(np.asarray(per_client["accuracy"])[~new] * count[~new]) / np.sum(count[~new])
    np.testing.assert_allclose(report["existing_clients_accuracy"], existing, rtol=1e-12)
    assert "new_clients_ensemble_accuracy" in report


def test_unit_layers_and_layer_names():
    assert fedfac.unit_layers(MODEL) == ["hidden_0", "hidden_1", "head"]
    cnn = build_model("cnn", (28, 28, 1), 10)
    assert fedfac.unit_layers(cnn) == ["conv_0", "conv_1", "dense_0", "head"]
    alg = fedfac.build(cnn, SPEC, layers=("conv_1", -2), tau_quantile=50.0)
    state = jax.eval_shape(lambda key: alg.init(key, None, 2), jax.random.key(0))
    assert {k: v.shape for k, v in state.global_shared.items()} == {"conv_1": (32,), "dense_0": (100,)}
    assert set(state.client_params) == {
        f"params/{n}/{leaf}" for n in ("conv_1", "dense_0") for leaf in ("kernel", "bias")
    }


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(layers=("conv_9",)), "layers"),
        (dict(layers=(3,)), "layers"),
        (dict(layers=()), "layers"),
        (dict(layers=(0, "hidden_0")), "layers"),
        (dict(kappa=1.5), "kappa"),
        (dict(tau_quantile=-1.0), "tau_quantile"),
        (dict(method="minres"), "method"),
        (dict(mode="always"), "mode"),
        (dict(split_input="grads"), "split_input"),
        (dict(split="oracle"), "split"),
        (dict(mask="both"), "mask"),
        (dict(new_client_fraction=1.0), "new_client_fraction"),
        (dict(new_client_epochs=0), "new_client_epochs"),
        (dict(ipf_start="ones"), "ipf_start"),
        (dict(ipf_solver="newton"), "ipf_solver"),
        (dict(max_iter=0), "max_iter"),
        (dict(tol=-1.0), "tol"),
        (dict(client_map="pmap"), "strategy"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedfac.build(MODEL, SPEC, **kwargs)


def test_simulation_fedfac_beats_fedavg():
    """Model (8) of the paper (p=0.5, alpha=0.4, median labels), 20 clients: the split of the
    hidden layer into shared and personalized units must beat one shared model."""
    from pfljax.data import build_federated_data

    fed = build_federated_data("simulation", 20, source_kwargs={"samples_per_client": 250})
    model = build_model("mlp", fed.input_shape, fed.num_classes, hidden=(200,))
    spec = LocalTraining(optax.sgd(0.05, momentum=0.9), batch_size=32, epochs=1)
    acc = {}
    for name, alg in (
        ("fedfac", fedfac.build(model, spec, tau_quantile=50.0, mode="static")),
        ("fedavg", fedavg.build(model, spec)),
    ):
        state = alg.init(jax.random.key(0), None, 20)
        rnd = jax.jit(alg.round)
        for r in range(10):
            state, _ = rnd(state, fed.data, jax.random.key(r))
        per_client = alg.evaluate(state, fed.data, jax.random.key(0))
        acc[name] = float(np.sum(per_client["accuracy"] * per_client["count"]) / np.sum(per_client["count"]))
    assert acc["fedfac"] > acc["fedavg"] + 0.1, acc
