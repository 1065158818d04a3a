"""APPLE: the proximal schedule in closed form, the round against a per-client loop written here
(the exact gradients by autodiff through the mixture of cores; PFLlib's per-tensor mean gradient
written out by hand), the personalized model is sum_j p_ij c_j, what stays local stays local,
and it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import apple
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.params import tree_bytes
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import mean, same_rule_data, scores_before_after, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR = len(COUNTS), 3, 4, 0.1
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)
P0 = np.asarray(COUNTS, np.float64) / sum(COUNTS)


def hyper(**kw):
    base = dict(
        apply=None, local=None, loss=None, dr_learning_rate=0.0, mu=0.0, L=4, scheduler="cosine",
        dr_gradient="exact", p_init="samples", scale_core_lr=False,
    )  # fmt: skip
    return apple.APPLEHyper(**{**base, **kw})


def test_schedule_closed_forms():
    rounds = jnp.arange(6)
    cosine = apple.schedule(hyper(L=4), rounds)
    np.testing.assert_allclose(
        cosine, [1.0, (np.cos(np.pi / 4) + 1) / 2, 0.5, (np.cos(0.75 * np.pi) + 1) / 2, 0, 0], atol=1e-6
    )
    expo = apple.schedule(hyper(L=4, scheduler="exponential"), rounds)
    np.testing.assert_allclose(expo, [1.0, 0.001**0.25, 0.001**0.5, 0.001**0.75, 0, 0], rtol=1e-5)
    np.testing.assert_array_equal(apple.schedule(hyper(L=0), rounds), np.zeros(6))


def mixed(own, p, cores, cid):
    """sum_j p_j c_j with client cid's core replaced by `own` (a plain Python sum)."""
    trees = [own if j == cid else cores[j] for j in range(NUM)]
    return jax.tree.map(lambda *xs: sum(p[j] * x for j, x in enumerate(xs)), *trees)


def ce(params, x, y, w):
    per = optax.softmax_cross_entropy_with_integer_labels(MODEL.apply({"params": params}, x)[0], y)
    return jnp.sum(per * w) / jnp.sum(w)


@jax.jit
def ce_grad(params, x, y, w):
    return jax.grad(ce)(params, x, y, w)


@jax.jit
def exact_grads(own, p, cores, onehot, x, y, w, p0, coef):
    """d/d(own, p) of CE(sum_j p_j c_j) + coef ||p - p0||^2 by autodiff (own enters at onehot)."""

    def loss(own, p):
        params = jax.tree.map(
            lambda cs, o: jnp.tensordot(p * (1 - onehot), cs, 1) + jnp.dot(p, onehot) * o, cores, own
        )
        return ce(params, x, y, w) + coef * jnp.sum((p - p0) ** 2)

    return jax.grad(loss, argnums=(0, 1))(own, p)


def loop_round(
    cores, ps, personal, trained, data, key, r, dr_learning_rate, mu, L, leaf_mean=False, sequential=False
):
    """Reference: each sampled client alone, ceil(n / B) SGD steps on its core and p; its
    personalized model: the final core and p with the other cores of the round's start.
    `sequential` (PFLlib's code): the clients in id order, each against the cores as the
    earlier ones left them; its personalized model is the mix its last step was taken at
    (PFLlib's `self.model`), and the next round's cores are the personalized models."""
    sample_key, train_key = round_keys(key, r)
    idx = [int(c) for c in sample_clients(sample_key, NUM, K)]
    lam = (np.cos(np.pi * r / L) + 1) / 2 if r < L else 0.0
    new_cores, new_ps, new_personal = list(cores), list(ps), list(personal)
    for c in sorted(idx) if sequential else idx:
        if sequential:
            cores = list(new_cores)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *cores)
        own = cores[c]
        p = ps[c] if trained[c] else (np.full(NUM, 1.0 / NUM) if leaf_mean else P0)
        p = jnp.asarray(p, jnp.float32)
        d, ck = take(data.train, c), client_key(train_key, c)
        last_mix = personal[c]
        for s in range(-(-COUNTS[c] // B)):
            last_mix = mixed(own, p, cores, c)
            rows, w = stream_batch(ck, jnp.int32(s), d.count, d.x.shape[0], B)
            x, y = d.x[rows], d.y[rows]
            if leaf_mean:  # PFLlib: per-tensor means, core learning rate x C
                g = ce_grad(mixed(own, p, cores, c), x, y, w)
                currents = [own if j == c else cores[j] for j in range(NUM)]
                gp = [
                    np.mean(
                        [
                            np.mean(np.asarray(gl) * np.asarray(cl))
                            for gl, cl in zip(jax.tree.leaves(g), jax.tree.leaves(cur))
                        ]
                    )
                    for cur in currents
                ]
                gp = jnp.asarray(gp) + 2 * lam * mu * (p - P0)
                g_own = jax.tree.map(lambda x, p=p, c=c: NUM * p[c] * x, g)
            else:
                onehot = jnp.zeros(NUM).at[c].set(1.0)
                g_own, gp = exact_grads(
                    own, p, stacked, onehot, x, y, w, jnp.asarray(P0, jnp.float32), lam * mu
                )
            own = jax.tree.map(lambda a, g: a - LR * g, own, g_own)
            p = p - dr_learning_rate * gp
        new_cores[c], new_ps[c] = own, np.asarray(p)
        new_personal[c] = last_mix if sequential else mixed(own, p, cores, c)
        trained[c] = True
    if sequential:
        new_cores = [new_personal[c] if c in idx else new_cores[c] for c in range(NUM)]
    return new_cores, new_ps, new_personal, idx


@pytest.mark.parametrize("variant", ["paper", "pfllib", "pfllib_sequential"])
def test_round_equals_per_client_loop(variant):
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    kw = dict(dr_learning_rate=0.05, mu=0.5, L=3)
    code = dict(dr_gradient="leaf_mean", p_init="uniform", scale_core_lr=True) if variant != "paper" else {}
    sequential = variant == "pfllib_sequential"
    alg = apple.build(MODEL, SPEC, clients_per_round=K, client_map="map", sequential=sequential, **kw, **code)
    state = alg.init(jax.random.key(0), None, NUM)
    # Distinct cores, so that the mixture matters.
    state = state._replace(
        client_core=jax.tree.map(
            lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape), state.client_core
        )
    )
    cores = [take(state.client_core, c)["params"] for c in range(NUM)]
    personal = [take(state.client_personal, c)["params"] for c in range(NUM)]
    ps, trained = [None] * NUM, [False] * NUM
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(3))
        cores, ps, personal, idx = loop_round(
            cores,
            ps,
            personal,
            trained,
            data,
            jax.random.key(3),
            r,
            leaf_mean=variant != "paper",
            sequential=sequential,
            **kw,
        )
        for c in range(NUM):
            chex.assert_trees_all_close(take(state.client_core, c)["params"], cores[c], rtol=1e-5, atol=1e-6)
            chex.assert_trees_all_close(
                take(state.client_personal, c)["params"], personal[c], rtol=1e-5, atol=1e-6
            )
            if trained[c]:
                np.testing.assert_allclose(state.client_p[c], ps[c], rtol=1e-5, atol=1e-6)
        assert not np.allclose(state.client_p[idx[0]], P0 if variant == "paper" else 1.0 / NUM)  # p learns
    model_bytes = tree_bytes(MODEL.template())
    assert metrics["bytes_up"] == K * model_bytes and metrics["bytes_down"] == K * (NUM - 1) * model_bytes
    np.testing.assert_allclose(metrics["dr_lambda"], 0.75, rtol=1e-6)  # (cos(pi / 3) + 1) / 2

    # Evaluation: client c's personalized model as it holds it (the initial model where it never
    # trained): its final core and p, the other cores of the round it last trained in.
    scores = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    assert not all(trained)
    for c in range(NUM):
        test = take(data.test, c)
        logits = MODEL.apply({"params": personal[c]}, test.x)[0]
        valid = np.arange(test.y.shape[0]) < int(test.count)
        want = np.asarray(jnp.argmax(logits, -1) == test.y)[valid].mean()
        np.testing.assert_allclose(scores["accuracy"][c], want, atol=1e-6)
    collab = np.asarray(alg.collaboration_matrix(state))
    np.testing.assert_allclose(collab.sum(1), 1.0, rtol=1e-6)
    assert collab.min() >= 0


def test_what_stays_local_stays_local():
    """Non-participants keep their core and p; with dr_learning_rate 0 p stays at p0; a
    participant's personalized model reads every core, its update writes only its own."""
    data = toy_data(COUNTS)
    alg = apple.build(MODEL, SPEC, clients_per_round=K, dr_learning_rate=0.0)
    state = alg.init(jax.random.key(0), None, NUM)
    rnd = jax.jit(alg.round)
    idx = [int(c) for c in sample_clients(round_keys(jax.random.key(1), 0)[0], NUM, K)]
    out = sorted(set(range(NUM)) - set(idx))
    new, _ = rnd(state, data, jax.random.key(1))
    for c in out:
        chex.assert_trees_all_equal(take(new.client_core, c), take(state.client_core, c))
        np.testing.assert_array_equal(new.client_p[c], state.client_p[c])
        assert int(new.client_rounds[c]) == 0
    for c in idx:
        np.testing.assert_allclose(new.client_p[c], P0, rtol=1e-6)
    # A non-participant's core enters the participants' personalized models.
    moved = state._replace(client_core=jax.tree.map(lambda x: x.at[out[0]].add(0.1), state.client_core))
    other, _ = rnd(moved, data, jax.random.key(1))
    assert not np.allclose(take(other.client_core, idx[0])["params"]["head"]["kernel"],
                           take(new.client_core, idx[0])["params"]["head"]["kernel"])  # fmt: skip
    # One-hot p: the personalized model is that core; p = p0 (dr_learning_rate 0), the p0-mixture.
    cores = moved.client_core["params"]
    chex.assert_trees_all_close(apple.personalized_params(jnp.eye(NUM)[2], cores), take(cores, 2), rtol=1e-6)
    c = idx[0]
    delta = jax.tree.map(lambda a, b: a - b, take(other.client_core, c)["params"], take(cores, c))
    want = jax.tree.map(lambda m, d: m + P0[c] * d, apple.personalized_params(jnp.asarray(P0), cores), delta)
    chex.assert_trees_all_close(take(other.client_personal, c)["params"], want, rtol=1e-5, atol=1e-6)
    for c in out:  # never trained: still the initial model
        chex.assert_trees_all_equal(take(other.client_personal, c), take(state.client_personal, c))


def test_learns():
    data = same_rule_data(40, 4)
    alg = apple.build(MODEL, LocalTraining(optax.sgd(0.2), batch_size=8, epochs=1), scale_core_lr=True)
    before, after = scores_before_after(alg, data, rounds=10)
    assert mean(after, "loss") < mean(before, "loss") - 0.1 and mean(after, "accuracy") > 0.6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dr_learning_rate=-1.0), "dr_learning_rate"),
        (dict(mu=-1.0), "mu"),
        (dict(L=-1), "L"),
        (dict(L=1.5), "L"),
        (dict(scheduler="linear"), "scheduler"),
        (dict(dr_gradient="x"), "dr_gradient"),
        (dict(p_init="x"), "p_init"),
        (dict(scale_core_lr=1), "scale_core_lr"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apple.build(MODEL, SPEC, **kwargs)
