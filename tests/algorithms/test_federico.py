"""FedeRiCo: neighbour sampling, M-step, the mapped round against a
per-client Python loop written here, and a small Fashion-MNIST run."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import federico
from pfljax.core import mixture
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, batch_rows, epoch_order, make_local_train
from pfljax.core.losses import masked_mean
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.toydata import toy_data

COUNTS = (12, 7, 20, 3, 9, 15)
C = len(COUNTS)
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
ADAM = LocalTraining(optax.adam(0.05), batch_size=4, steps=3, epochs=None)
SGD = LocalTraining(optax.sgd(0.05), batch_size=4, steps=3, epochs=None)  # sees the M-step's scale
IDX_DIR = "/usr/share/datasets/fashion-mnist"
ALG = federico.build(MODEL, ADAM, neighbours=2, client_map="map")  # shared: one compiled round


# ----------------------------------------------------------- sample_neighbours
def test_greedy_neighbours_are_the_top_n():
    post = mixture.posterior(jax.random.normal(jax.random.key(1), (7, 7)) * 3)
    nbrs = np.asarray(federico.sample_neighbours(jax.random.key(2), post, 3, 0.0))
    for i in range(7):
        others = [j for j in np.argsort(-np.asarray(post[i]), kind="stable") if j != i]
        assert nbrs[i, 0] == i
        assert list(nbrs[i, 1:]) == others[:3]


def test_exploring_neighbours_are_uniform_and_distinct():
    num, n, draws = 6, 2, 3000
    post = mixture.posterior(-10.0 * jnp.eye(num))  # greedy would only pick... nothing but self
    keys = jax.random.split(jax.random.key(3), draws)
    nbrs = np.asarray(
        jax.vmap(lambda k: federico.sample_neighbours(k, post, n, 1.0))(keys)
    )  # [draws, C, n+1]
    assert all(len(set(row)) == n + 1 for row in nbrs.reshape(-1, n + 1))
    np.testing.assert_array_equal(nbrs[:, :, 0], np.broadcast_to(np.arange(num), (draws, num)))
    for i in range(num):
        freq = np.bincount(nbrs[:, i, 1:].ravel(), minlength=num)
        assert freq[i] == 0
        others = np.delete(freq, i)
        expected = draws * n / (num - 1)
        chi2 = np.sum((others - expected) ** 2 / expected)
        assert chi2 < 18.5, (i, others)  # 99.9% quantile of chi-square with 4 dof


def test_neighbours_of_a_client_do_not_depend_on_other_rows():
    post = mixture.posterior(jax.random.normal(jax.random.key(4), (C, C)))
    full = federico.sample_neighbours(jax.random.key(5), post, 2, 0.5)
    idx = jnp.array([4, 1])
    part = federico.sample_neighbours(jax.random.key(5), post[idx], 2, 0.5, idx)
    np.testing.assert_array_equal(part, full[idx])
    with pytest.raises(ValueError, match="neighbours"):
        federico.sample_neighbours(jax.random.key(5), post, C, 0.5)


# ---------------------------------------------------------------------- M-step
def test_combine_gradients_is_a_weighted_segment_sum():
    grads = {"a": jnp.arange(8.0).reshape(4, 2)}
    out, total = federico.combine_gradients(
        grads, jnp.array([0.5, 2.0, 1.0, 0.0]), jnp.array([2, 0, 2, 1]), 3
    )
    chex.assert_trees_all_close(out["a"], jnp.array([[4.0, 6.0], [0.0, 0.0], [4.0, 5.5]]))
    chex.assert_trees_all_close(total, jnp.array([2.0, 0.0, 1.5]))


def _run(alg, state, data, rounds=1, key=7):
    rnd = jax.jit(alg.round)
    for _ in range(rounds):
        state, metrics = rnd(state, data, jax.random.key(key))
    return state, metrics


def test_identity_posterior_is_local_training():
    """With w = identity (other models' losses huge) each model trains alone on its owner's data."""
    data = toy_data(COUNTS)
    state = ALG.init(jax.random.key(0), None, C)
    state = state._replace(client_losses=1e4 * (1 - jnp.eye(C)), client_seen=jnp.ones((C, C), bool))
    new, _ = _run(ALG, state, data)
    chex.assert_trees_all_close(new.client_posterior, jnp.eye(C), atol=1e-30)
    train = jax.jit(make_local_train(MODEL.apply, ADAM))
    train_key = round_keys(jax.random.key(7), 0)[1]
    for c in range(C):
        ref = train(take(state.client_params, c), take(data.train, c), client_key(train_key, c))
        chex.assert_trees_all_close(take(new.client_params, c), ref.params, rtol=1e-5, atol=1e-6)


def test_uniform_posterior_gives_every_model_the_same_averaged_gradient():
    """All clients hold all models, w uniform and fixed (beta=0): every model takes the step
    along (1/C) sum_i n_i grad L_i, computed here on full batches."""
    data = toy_data(COUNTS)
    spec = LocalTraining(optax.sgd(0.01), batch_size=max(COUNTS), steps=1, epochs=None)
    alg = federico.build(
        MODEL, spec, neighbours=C - 1, beta=0.0, initial_loss="zero", shared_init=True, client_map="map"
    )
    state = alg.init(jax.random.key(0), None, C)
    new, _ = _run(alg, state, data)
    chex.assert_trees_all_close(new.client_posterior, jnp.full((C, C), 1.0 / C))
    theta = take(state.client_params, 0)["params"]

    def nll(p, x, y, count):  # summed over the client's rows: n_i times the mean
        out = MODEL.apply({"params": p}, x)[0]
        per = optax.softmax_cross_entropy_with_integer_labels(out, y)
        return jnp.sum(per * (jnp.arange(y.shape[0]) < count))

    grads = jax.jit(jax.vmap(jax.grad(nll), in_axes=(None, 0, 0, 0)))(theta, *data.train)
    g = jax.tree.map(lambda x: jnp.mean(x, axis=0), grads)
    expected = jax.tree.map(lambda t, gi: t - 0.01 * gi, theta, g)
    for c in range(C):
        chex.assert_trees_all_close(take(new.client_params, c)["params"], expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- oracle: per-client loop
def loop_round(state, data, key, *, k, neighbours, epsilon, beta, spec, estep_data, accumulate, m_step="sum"):
    """One FedeRiCo round as plain Python loops over clients and their neighbours."""
    sample_key, train_key = round_keys(key, state.round)
    idx = np.asarray(sample_clients(sample_key, C, k))
    nbrs = np.asarray(
        federico.sample_neighbours(
            jax.random.fold_in(sample_key, 1), state.client_posterior[idx], neighbours, epsilon, idx
        )
    )
    models = [take(state.client_params, c)["params"] for c in range(C)]
    opts = [take(state.client_opt_state, c) for c in range(C)]
    losses, seen = np.array(state.client_losses, np.float64), np.array(state.client_seen)
    post = np.array(state.client_posterior, np.float64)
    n_max, bsz = data.train.x.shape[1], spec.batch_size

    @jax.jit
    def full_loss(p, c):
        out = MODEL.apply({"params": p}, data.train.x[c])[0]
        per = optax.softmax_cross_entropy_with_integer_labels(out, data.train.y[c])
        return jnp.sum(per * (jnp.arange(n_max) < data.train.count[c])) / data.train.count[c]

    def e_step(i, observed):
        for j, loss in observed.items():
            obs = COUNTS[i] * float(loss)
            old = losses[i, j] if seen[i, j] else None
            if old is None:
                losses[i, j] = obs
            else:
                losses[i, j] = (1 - beta) * old + beta * obs if accumulate == "ema" else old + obs
            seen[i, j] = True
        logit = np.where(seen[i], -losses[i], -np.inf)
        post[i] = np.exp(logit - logit.max()) / np.sum(np.exp(logit - logit.max()))

    if estep_data == "full":
        for r, i in enumerate(idx):
            e_step(i, {int(j): full_loss(models[j], i) for j in nbrs[r]})

    @jax.jit
    def value_and_grad(p, x, y, w):
        def f(p):
            out = MODEL.apply({"params": p}, x)[0]
            return masked_mean(optax.softmax_cross_entropy_with_integer_labels(out, y), w)

        return jax.value_and_grad(f)(p)

    for s in range(spec.steps):
        acc, total = [None] * C, np.zeros(C)
        for r, i in enumerate(idx):
            cnt = COUNTS[i]
            per_epoch = -(-cnt // bsz)
            order = epoch_order(client_key(train_key, i), s // per_epoch, cnt, n_max, bsz)
            rows, w = batch_rows(order, s % per_epoch, cnt, bsz)
            x, y = data.train.x[i][rows], data.train.y[i][rows]
            pairs = {int(j): value_and_grad(models[j], x, y, w) for j in nbrs[r]}
            if s == 0 and estep_data == "batch":
                e_step(i, {j: loss for j, (loss, _) in pairs.items()})
            for j, (_, g) in pairs.items():
                coef = post[i, j] * cnt
                contrib = jax.tree.map(lambda a, coef=coef: coef * np.asarray(a, np.float64), g)
                acc[j] = contrib if acc[j] is None else jax.tree.map(np.add, acc[j], contrib)
                total[j] += coef
        for j in range(C):
            if total[j] > 0:
                norm = total[j] if m_step == "mean" else 1.0
                g = jax.tree.map(lambda a, norm=norm: jnp.asarray(a / norm, jnp.float32), acc[j])
                upd, opts[j] = spec.optimizer.update(g, opts[j], models[j])
                models[j] = optax.apply_updates(models[j], upd)
    return models, losses, post


@pytest.mark.parametrize(
    "strategy,estep_data,accumulate,m_step",
    [("map", "batch", "ema", "sum"), ("vmap", "full", "cumulative", "sum"), ("map", "batch", "ema", "mean")],
)
def test_round_equals_per_client_loop(strategy, estep_data, accumulate, m_step):
    data = toy_data(COUNTS)
    kw = dict(
        neighbours=2, epsilon=0.3, beta=0.6, estep_data=estep_data, accumulate=accumulate, m_step=m_step
    )
    spec = SGD if m_step == "mean" else ADAM
    alg = federico.build(MODEL, spec, clients_per_round=4, client_map=strategy, **kw)
    state = alg.init(jax.random.key(0), None, C)
    chex.clear_trace_counter()

    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))

    for r in range(3):
        key = jax.random.key(10 + r)
        models, losses, post = loop_round(state, data, key, k=4, spec=spec, **kw)
        state, metrics = rnd(state, data, key)
        for c in range(C):
            chex.assert_trees_all_close(
                take(state.client_params, c)["params"], models[c], rtol=1e-5, atol=1e-6
            )
        np.testing.assert_allclose(state.client_losses, losses, rtol=1e-5)
        np.testing.assert_allclose(state.client_posterior, post, rtol=1e-4, atol=1e-6)
    assert int(state.round) == 3
    chex.assert_trees_all_close(jnp.sum(alg.collaboration_matrix(state), 1), jnp.ones(C), rtol=1e-5)
    assert metrics["posterior"].shape == (C, C)
    steps_bytes = 4 * 2 * ADAM.steps * tree_bytes(take(state.client_params, 0))
    assert metrics["bytes_down"] == steps_bytes and metrics["bytes_up"] == steps_bytes


def test_sequential_pair_sum_equals_the_segment_sum():
    """Under a sequential map each pair's weighted gradient is added to its model as it
    comes (a scan); vmap and chunked maps form the [P, ...] gradients and segment-sum
    them: the same rounds, BatchNorm-free and with the E-step on the first minibatch."""
    data = toy_data(COUNTS)
    out = {}
    for name, cmap in (("map", "map"), ("vmap", "vmap"), ("chunked", federico.ClientMap("map", 3))):
        alg = federico.build(MODEL, ADAM, neighbours=2, clients_per_round=5, client_map=cmap)
        state = alg.init(jax.random.key(0), None, C)
        rnd = jax.jit(alg.round)
        for r in range(2):
            state, metrics = rnd(state, data, jax.random.key(20 + r))
        out[name] = (state.client_params, state.client_opt_state, state.client_posterior)
        out[name] += (metrics["train_loss"],)
    chex.assert_trees_all_close(out["map"], out["vmap"], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(out["map"], out["chunked"], rtol=1e-5, atol=1e-6)


def test_evaluate_map_and_vmap_agree():
    data = toy_data(COUNTS)
    state = ALG.init(jax.random.key(0), None, C)
    state = state._replace(
        client_params=jax.vmap(MODEL.init)(jax.random.split(jax.random.key(1), C)),
        client_posterior=mixture.posterior(jax.random.normal(jax.random.key(2), (C, C))),
    )
    evs = [
        jax.jit(federico.build(MODEL, ADAM, client_map=m).evaluate)(state, data, jax.random.key(0))
        for m in ("map", "vmap")
    ]
    chex.assert_trees_all_close(evs[0], evs[1], rtol=1e-5, atol=1e-6)
    assert set(evs[0]) >= {"accuracy", "loss", "count", "own_accuracy", "own_loss"}
    chex.assert_shape(evs[0]["accuracy"], (C,))


def test_padding_junk_rows_change_nothing():
    """Junk in the padded rows (same shapes, so the same compiled round) changes nothing."""
    out = []
    for data in (toy_data(COUNTS), toy_data(COUNTS, junk=7.0)):
        state, m = _run(ALG, ALG.init(jax.random.key(0), None, C), data, rounds=2)
        loss = ALG.evaluate(state, data, jax.random.key(0))["loss"]
        out.append((state.client_params, state.client_posterior, m["train_loss"], loss))
    chex.assert_trees_all_close(out[0], out[1], rtol=1e-5, atol=1e-6)


def test_batch_norm_statistics_move_for_participants_only():
    data = toy_data(COUNTS)
    model = build_model("mlp_bn", (6,), 3, hidden=(8,))
    alg = federico.build(model, ADAM._replace(steps=1), neighbours=2, clients_per_round=3, client_map="map")
    state = alg.init(jax.random.key(0), None, C)
    new, _ = _run(alg, state, data)
    idx = set(np.asarray(sample_clients(round_keys(jax.random.key(7), 0)[0], C, 3)).tolist())
    for c in range(C):
        before, after = (jax.tree.leaves(take(s.client_params, c)["batch_stats"]) for s in (state, new))
        moved = not all(np.allclose(x, y) for x, y in zip(before, after))
        assert moved == (c in idx), (c, idx)


def test_group_mass_and_purity():
    groups = np.array([0, 0, 1, 1])
    post = np.array([[0, 0, 1, 0], [0, 0, 1, 0], [1, 0, 0, 0], [0.5, 0.5, 0, 0]])
    np.testing.assert_allclose(federico.group_mass(post, groups), [0, 0, 0, 0])
    np.testing.assert_allclose(federico.group_purity(post, groups), [1, 1, 1, 1])
    mixed = np.array([[0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_allclose(federico.group_purity(mixed, groups), [2 / 3, 2 / 3, 1 / 3, 1])


def test_final_report_reads_the_random_groups_of_the_data(monkeypatch):
    """With the paper's random split (a client alone in its distribution) the report's
    group figures use the groups drawn by the data builder, not contiguous blocks."""
    from types import SimpleNamespace

    from pfljax.data import build_federated_data, sources
    from pfljax.data import partition as part
    from pfljax.data.sources import Pooled

    def pooled(*, data_dir=None, seed=0):
        y = np.repeat(np.arange(4), 30).astype(np.int32)
        x = np.random.default_rng(0).normal(size=(120, 2)).astype(np.float32)
        return Pooled(x[:100], y[:100], x[100:], y[100:], 4)

    monkeypatch.setitem(sources.SOURCES, "rico_tiny", sources.SourceSpec(pooled, False, None))
    kw = dict(partition="groups", num_groups=2, group_relabel=False, seed=0)
    fd = build_federated_data("rico_tiny", 6, group_assignment="random", **kw)
    groups = part.assign_groups(6, 2, [0, 1], "random")
    assert [c["group"] for c in fd.summary["clients"]] == groups.tolist() == [1, 1, 1, 1, 0, 1]
    post = np.full((6, 6), 0.02) + 0.88 * np.eye(6)  # mostly itself
    post[4] = np.eye(6)[0]  # the lone client leans on client 0's model
    report = federico.final_report(SimpleNamespace(client_posterior=jnp.asarray(post)), fd)
    assert report["own_group_mass"] == pytest.approx(np.mean(federico.group_mass(post, groups)))
    assert report["own_group_mass_min"] == pytest.approx(0.0)  # client 4: nothing on group 0
    assert report["own_group_mass_chance"] == pytest.approx((5 * 5 / 6 + 1 / 6) / 6)
    balanced = part.client_groups(6, 2)
    assert report["group_purity"] != pytest.approx(np.mean(federico.group_purity(post, balanced)))


# -------------------------------------------------------------------- evaluate
def test_evaluate_one_hot_posterior_uses_that_model():
    data = toy_data(COUNTS)
    state = ALG.init(jax.random.key(0), None, C)
    params = jax.vmap(MODEL.init)(jax.random.split(jax.random.key(1), C))
    pick = jnp.array([3, 3, 0, 5, 1, 2])
    state = state._replace(client_params=params, client_posterior=jax.nn.one_hot(pick, C))
    ev = jax.jit(ALG.evaluate)(state, data, jax.random.key(0))
    for c in range(C):
        out = MODEL.apply(take(params, int(pick[c])), data.test.x[c][: COUNTS[c]])[0]
        acc = np.mean(np.argmax(out, -1) == data.test.y[c][: COUNTS[c]])
        np.testing.assert_allclose(ev["accuracy"][c], acc, rtol=1e-6)
        own = MODEL.apply(take(params, c), data.test.x[c][: COUNTS[c]])[0]
        own_acc = np.mean(np.argmax(own, -1) == data.test.y[c][: COUNTS[c]])
        np.testing.assert_allclose(ev["own_accuracy"][c], own_acc, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(neighbours=-1), "neighbours"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(beta=-0.1), "beta"),
        (dict(loss_scale="max"), "loss_scale"),
        (dict(accumulate="sum"), "accumulate"),
        (dict(estep_data="test"), "estep_data"),
        (dict(initial_loss="inf"), "initial_loss"),
        (dict(mixture_size=-2), "mixture_size"),
        (dict(m_step="avg"), "m_step"),
        (dict(client_map="pmap"), "strategy"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        federico.build(MODEL, ADAM, **kwargs)


def test_too_many_neighbours_raise_at_init():
    alg = federico.build(MODEL, ADAM, neighbours=C)
    with pytest.raises(ValueError, match="neighbours"):
        alg.init(jax.random.key(0), None, C)


# ----------------------------------------------------------------- end to end
@pytest.mark.skipif(not os.path.isdir(IDX_DIR), reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_permuted_groups_find_their_group_and_beat_fedavg():
    """Clients share models only within their group (purity; a model's owner may sit in
    another group, so the mass on owners' groups is printed, not asserted), and the
    mixture beats FedAvg, which cannot fit conflicting labels."""
    from pfljax.algorithms import fedavg
    from pfljax.core.evaluate import summarize
    from pfljax.data import build_federated_data

    fd = build_federated_data(
        "fashion_mnist",
        8,
        partition="iid",
        permute_labels="group",
        num_groups=2,
        samples_per_client=300,
        seed=0,
    )
    groups = np.array([c["group"] for c in fd.summary["clients"]])
    model = build_model("mlp", fd.input_shape, fd.num_classes, hidden=(100,))
    spec = LocalTraining(optax.adam(1e-3), batch_size=32, epochs=1, steps=None)
    acc = {}
    for name, mod in [("federico", federico), ("fedavg", fedavg)]:
        alg = mod.build(model, spec)
        state, _ = _run(alg, alg.init(jax.random.key(0), None, 8), fd.data, rounds=15, key=1)
        per_client = jax.device_get(jax.jit(alg.evaluate)(state, fd.data, jax.random.key(0)))
        acc[name] = summarize(per_client)["mean_accuracy"]
        if name == "federico":
            post = jax.device_get(state.client_posterior)
            purity = federico.group_purity(post, groups)
            report = alg.final_report(state, fd, per_client, jax.random.key(0))
    print(acc, federico.group_mass(post, groups), purity, report)
    assert np.all(purity > 0.8), purity
    assert report["group_purity"] == pytest.approx(np.mean(purity))
    assert acc["federico"] > acc["fedavg"] + 0.1, acc


def test_sine_intervals_fedavg_cannot_fit_federico_can():
    """Fig. 1: linear models on intervals of a sine; FedeRiCo's mixture follows the curve."""
    from pfljax.algorithms import fedavg
    from pfljax.data.sine import sine_federated_data

    fd = sine_federated_data(4, samples_per_client=30, num_intervals=2, noise=0.05, x_low=0.0, seed=0)
    model = build_model("mlp", (1,), 1, hidden=())
    spec = LocalTraining(optax.adam(0.05), batch_size=32, steps=10, epochs=None, loss="mse")
    mse = {}
    for name, mod in [("federico", federico), ("fedavg", fedavg)]:
        alg = mod.build(model, spec, client_map="map")
        state, _ = _run(alg, alg.init(jax.random.key(0), None, 4), fd.data, rounds=40, key=1)
        mse[name] = -float(np.mean(alg.evaluate(state, fd.data, jax.random.key(0))["accuracy"]))
    print(mse)
    assert mse["federico"] < 0.02 < mse["fedavg"], mse
