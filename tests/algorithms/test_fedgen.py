"""FedGen: the round (local CE + generated-feature CE on the head, FedAvg, Adam steps of the
generator on the label-weighted ensemble of heads) against a per-client loop written out by hand;
alpha = 0 is FedAvg; the closed forms of the generator's pieces; bad options; it learns."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedavg, fedgen
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import same_rule_data, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR = len(COUNTS), 3, 4, 0.1
ND, HD, STEPS, GB, GLR = 5, 7, 3, 6, 0.01
MODEL = build_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)
PAPER = {}
CODE = dict(noise="uniform", ensemble="samples", diversity=0.5, generative_beta=0.3, generative_decay=0.9)


def build(**options):
    base = dict(noise_dim=ND, hidden_dim=HD, generator_steps=STEPS, generator_batch=GB, generator_lr=GLR)
    return fedgen.build(MODEL, SPEC, clients_per_round=K, client_map="map", **{**base, **options})


# ---- the reference, written plainly ----


def mlp(params, x):
    z = jax.nn.relu(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"][None])
    return z @ params["head"]["kernel"] + params["head"]["bias"][None]


def gen_forward(g, eps, y):
    h = jnp.concatenate([eps, jax.nn.one_hot(y, 3)], 1) @ g["fc1"]["kernel"]  # no bias before BatchNorm
    mu, var = h.mean(0, keepdims=True), h.var(0, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * g["bn"]["scale"][None] + g["bn"]["bias"][None]
    return jax.nn.relu(h) @ g["fc"]["kernel"] + g["fc"]["bias"][None]


def noise(key, shape, opts):
    return jax.random.uniform(key, shape) if opts.get("noise") == "uniform" else jax.random.normal(key, shape)


def labels(key, prior, n):
    return jax.random.categorical(key, jnp.log(prior), shape=(n,))


def log_softmax(v):
    return v - jnp.log(jnp.sum(jnp.exp(v), -1, keepdims=True))


def client_loss(params, x, y, w, gz, gy, kz, alpha, beta):
    lp = log_softmax(mlp(params, x))
    loss = -jnp.sum(lp[jnp.arange(len(y)), y] * w) / jnp.sum(w)
    glp = log_softmax(gz @ params["head"]["kernel"] + params["head"]["bias"][None])
    loss += alpha * -jnp.mean(glp[jnp.arange(len(gy)), gy])
    if kz is not None:
        head = jax.lax.stop_gradient(params["head"])
        t = jax.nn.softmax(kz @ head["kernel"] + head["bias"][None])
        loss += beta * jnp.sum(jnp.sum(t * (jnp.log(t) - lp), -1) * w) / jnp.sum(w)
    return loss


CLIENT_GRAD = jax.jit(jax.grad(client_loss))


def loop_client(params, gen, data, key, prior, r, opts):
    alpha = 1.0 * opts.get("generative_decay", 1.0) ** r
    beta = opts.get("generative_beta", 0.0) * opts.get("generative_decay", 1.0) ** r
    for s in range(-(-int(data.count) // B)):
        idx, w = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        x, y = data.x[idx], data.y[idx]
        k1, k2, k3 = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, 0x6F), s), 3)
        gy = labels(k1, prior, B)
        gz = gen_forward(gen, noise(k2, (B, ND), opts), gy)
        kz = gen_forward(gen, noise(k3, (B, ND), opts), y) if beta else None
        g = CLIENT_GRAD(params, x, y, w, gz, gy, kz, alpha, beta)
        params = jax.tree.map(lambda a, d: a - LR * d, params, g)
    return params


def gen_loss(gen, heads, alphas, eps, y, eta, ensemble):
    z = gen_forward(gen, eps, y)
    ens, ce = 0.0, 0.0
    for head, a in zip(heads, alphas):
        logits = z @ head["kernel"] + head["bias"][None]
        ens = ens + a[y][:, None] * logits
        ce_k = -log_softmax(logits)[jnp.arange(len(y)), y]  # this head's CE per row
        ce += jnp.mean(a[y] * ce_k) if ensemble == "label_loss" else jnp.mean(a[y]) * jnp.mean(ce_k)
    if ensemble in ("label", "samples"):
        ce = -jnp.mean(log_softmax(ens)[jnp.arange(len(y)), y])
    if eta:
        div = 0.0
        for i in range(len(y)):
            for j in range(len(y)):
                div += jnp.mean((eps[i] - eps[j]) ** 2) * jnp.mean(jnp.abs(z[i] - z[j]))
        ce = ce + eta * jnp.exp(-div / len(y) ** 2)
    return ce


def adam_steps(gen, m, v, t0, heads, alphas, prior, key, opts):
    for t in range(STEPS):
        k1, k2 = jax.random.split(jax.random.fold_in(key, t))
        y = labels(k1, prior, GB)
        eps = noise(k2, (GB, ND), opts)
        g = jax.grad(gen_loss)(
            gen, heads, alphas, eps, y, opts.get("diversity", 0), opts.get("ensemble", "label")
        )
        n = t0 + t + 1
        m = jax.tree.map(lambda a, d: 0.9 * a + 0.1 * d, m, g)
        v = jax.tree.map(lambda a, d: 0.999 * a + 0.001 * d * d, v, g)
        gen = jax.tree.map(
            lambda p, a, b, n=n: p - GLR * (a / (1 - 0.9**n)) / (jnp.sqrt(b / (1 - 0.999**n)) + 1e-8),
            gen,
            m,
            v,
        )
    return gen, m, v


@pytest.mark.parametrize(
    "opts",
    [PAPER, CODE, dict(PAPER, ensemble="label_loss"), dict(CODE, ensemble="authors_code")],
    ids=["paper", "code", "label_loss", "authors_code"],
)
def test_round_equals_loop(opts):
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    alg = build(**opts)
    state = alg.init(jax.random.key(0), None, NUM)
    params, gen = state.global_params["params"], state.generator
    m = v = jax.tree.map(jnp.zeros_like, gen)
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(3))
        sample_key, train_key = round_keys(jax.random.key(3), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        ys = [np.asarray(data.train.y[i, : COUNTS[i]]) for i in idx]
        counts = np.stack([np.bincount(y, minlength=3) for y in ys]).astype(np.float32)
        prior = jnp.asarray(counts.sum(0) / counts.sum())
        outs = [
            loop_client(params, gen, take(data.train, i), client_key(train_key, i), prior, r, opts)
            for i in idx
        ]
        w = np.asarray([COUNTS[i] for i in idx], np.float32) / sum(COUNTS[i] for i in idx)
        if opts.get("ensemble") == "samples":
            alphas = [np.full(3, wi, np.float32) for wi in w]
        else:
            alphas = list(counts / np.maximum(counts.sum(0, keepdims=True), 1))
        gen, m, v = adam_steps(
            gen, m, v, r * STEPS, [o["head"] for o in outs], alphas, prior,
            jax.random.fold_in(sample_key, 0x70), opts,
        )  # fmt: skip
        params = jax.tree.map(lambda *vs, w=w: sum(wi * x for wi, x in zip(w, vs)), *outs)
        chex.assert_trees_all_close(state.global_params["params"], params, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state.generator, gen, rtol=2e-4, atol=2e-5)
    assert np.isfinite(float(metrics["generator_loss"]))
    model_bytes = (6 * 8 + 8 + 8 * 3 + 3) * 4
    gen_bytes = ((ND + 3) * HD + 2 * HD + HD * 8 + 8) * 4  # fc1 (no bias), bn, fc
    assert metrics["bytes_up"] == K * (model_bytes + 3 * 4)
    assert metrics["bytes_down"] == K * (model_bytes + gen_bytes)


def test_alpha_zero_is_fedavg_and_no_steps_keep_the_generator():
    data = toy_data(COUNTS)
    alg = build(generative_alpha=0.0, generator_steps=0)
    ref = fedavg.build(MODEL, SPEC, clients_per_round=K, client_map="map")
    state = alg.init(jax.random.key(0), None, NUM)
    ref_state = ref.init(jax.random.key(0), None, NUM)
    chex.assert_trees_all_equal(state.global_params, ref_state.global_params)  # same model init
    new, _ = jax.jit(alg.round)(state, data, jax.random.key(2))
    ref_new, _ = jax.jit(ref.round)(ref_state, data, jax.random.key(2))
    chex.assert_trees_all_close(new.global_params, ref_new.global_params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(new.generator, state.generator)
    assert int(new.round) == 1


def test_generator_pieces_closed_forms():
    counts = jnp.asarray([[2.0, 0.0, 1.0], [6.0, 0.0, 3.0], [0.0, 0.0, 4.0]])
    weights = jnp.asarray([3.0, 9.0, 4.0])
    label = fedgen.ensemble_weights("label", counts, weights)
    np.testing.assert_allclose(label, [[0.25, 0, 1 / 8], [0.75, 0, 3 / 8], [0, 0, 0.5]], atol=1e-6)
    samples = fedgen.ensemble_weights("samples", counts, weights)
    np.testing.assert_allclose(samples[:, 1], [3 / 16, 9 / 16, 4 / 16], atol=1e-6)

    eps = jax.random.normal(jax.random.key(1), (4, 3))
    z = jax.random.normal(jax.random.key(2), (4, 5))
    e, f = np.asarray(eps, np.float64), np.asarray(z, np.float64)
    s = sum(np.mean((e[i] - e[j]) ** 2) * np.mean(np.abs(f[i] - f[j])) for i in range(4) for j in range(4))
    np.testing.assert_allclose(fedgen.diversity_loss(eps, z), math.exp(-s / 16), rtol=1e-5)

    gen = fedgen.init_generator(jax.random.key(0), 3, 3, 6, 5)
    y = jnp.asarray([0, 2, 2, 1])
    out = fedgen.generate(gen, eps, y, 3)
    np.testing.assert_allclose(out, gen_forward(gen, eps, y), rtol=1e-5, atol=1e-6)
    bound = 1 / math.sqrt(3 + 3)  # torch's Linear init
    assert float(jnp.max(jnp.abs(gen["fc1"]["kernel"]))) <= bound
    # Labels follow the prior; a class of probability 0 is never drawn.
    drawn = fedgen.sample_labels(jax.random.key(0), jnp.asarray([0.25, 0.0, 0.75]), 4000)
    np.testing.assert_allclose(np.bincount(np.asarray(drawn), minlength=3) / 4000, [0.25, 0, 0.75], atol=0.03)


def test_bad_arguments():
    for name, value in [
        ("noise_dim", 0),
        ("hidden_dim", -1),
        ("generator_lr", 0.0),
        ("generator_steps", -1),
        ("generator_batch", -1),
        ("diversity", -1.0),
        ("generative_alpha", -1.0),
        ("generative_beta", -1.0),
        ("generative_decay", 1.5),
    ]:
        with pytest.raises(ValueError, match=name):
            build(**{name: value})
    for name, value in [("noise", "x"), ("ensemble", "x"), ("weighting", "x"), ("batch_norm", 1)]:
        with pytest.raises(ValueError, match=name):
            build(**{name: value})
    with pytest.raises(ValueError, match="cross_entropy"):
        fedgen.build(MODEL, SPEC._replace(loss="mse"))


def test_it_learns():
    data = same_rule_data(20, 4)
    alg = fedgen.build(
        MODEL, SPEC, client_map="map", noise_dim=8, hidden_dim=16, generator_steps=20, generator_lr=0.01
    )
    state = alg.init(jax.random.key(0), None, 4)
    before = alg.evaluate(state, data, jax.random.key(1))
    rnd = jax.jit(alg.round)
    for r in range(12):
        state, metrics = rnd(state, data, jax.random.key(r))
    after = alg.evaluate(state, data, jax.random.key(1))
    assert float(np.mean(after["accuracy"])) > max(0.6, float(np.mean(before["accuracy"])) + 0.1)
    assert float(metrics["generator_loss"]) < 1.0  # the heads classify the generated features
