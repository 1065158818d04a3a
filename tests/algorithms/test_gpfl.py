"""GPFL: rounds against a per-client loop written out by hand (PFLlib's clients, with their own GCE
copies for the "local" conditional inputs); heads stay local; the conditional inputs and the
cosine classifier in closed form; bad options; it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import gpfl
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import same_rule_data, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR, CLASSES = len(COUNTS), 3, 4, 0.1, 3
MODEL = build_model("mlp", (6,), CLASSES, hidden=(8,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)


def ln(h, p):
    m = h.mean(-1, keepdims=True)
    v = ((h - m) ** 2).mean(-1, keepdims=True)
    return (h - m) / jnp.sqrt(v + 1e-5) * p["scale"] + p["offset"]


def valve(cov, z, c):
    """CoV by hand: ReLU(z (gamma + 1) + beta), gamma and beta = LayerNorm(ReLU(Linear(c)))."""
    gamma = ln(jax.nn.relu(c @ cov["gamma"]["kernel"] + cov["gamma"]["bias"]), cov["gamma"])
    beta = ln(jax.nn.relu(c @ cov["beta"]["kernel"] + cov["beta"]["bias"]), cov["beta"])
    return jax.nn.relu(z * (gamma + 1)[None] + beta[None])


def routes(p, x, cond):
    """(logits of the personalized route, f_G) of the MLP by hand."""
    z = jax.nn.relu(x @ p["body"]["kernel"] + p["body"]["bias"][None])
    f_p, f_g = valve(p["cov"], z, cond[1]), valve(p["cov"], z, cond[0])
    return f_p @ p["head"]["kernel"] + p["head"]["bias"][None], f_g


def ref_loss(p, x, y, w, cond, frozen, lam, batch_norm):
    """PFLlib's loss: CE + angle-level softmax over cosines + lam * magnitude (no weight decay)."""
    logits, f_g = routes(p, x, cond)
    ce = -jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y]
    unit = lambda v: v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-12)  # noqa: E731
    angle = -jax.nn.log_softmax(unit(f_g) @ unit(p["gce"]).T)[jnp.arange(y.shape[0]), y]
    diff = f_g - frozen[y]
    if batch_norm:
        mag = jnp.sqrt(jnp.sum(w[:, None] * diff**2))
        return jnp.sum(w * (ce + angle)) / jnp.sum(w) + lam * mag
    return jnp.sum(w * (ce + angle + lam * jnp.linalg.norm(diff, axis=-1))) / jnp.sum(w)


REF_GRAD = jax.jit(jax.grad(ref_loss), static_argnums=(7,))


def shares_of(data):
    valid = np.arange(data.y.shape[0]) < int(data.count)
    n = np.bincount(np.asarray(data.y)[valid], minlength=CLASSES).astype(np.float32)
    return jnp.asarray(n / n.sum())


def cond_from(gce, shares):
    return jnp.stack([gce.mean(0), shares @ gce])


def loop_client(p, data, key, cond, lam, mu, batch_norm):
    """One epoch of torch-style SGD steps: lr on everything, weight decay mu on the GCE and CoV."""
    frozen = p["gce"]
    for s in range(-(-int(data.count) // B)):
        idx, w = stream_batch(key, jnp.int32(s), data.count, data.x.shape[0], B)
        g = REF_GRAD(p, data.x[idx], data.y[idx], w, cond, frozen, lam, batch_norm)
        decay = {k: (mu if k in ("gce", "cov") else 0.0) for k in p}  # torch's SGD weight_decay
        p = {k: jax.tree.map(lambda a, b, d=decay[k]: a - LR * (b + d * a), p[k], g[k]) for k in p}
    return p


def tree_at(tree, i):
    return jax.tree.map(lambda v: v[i], tree)


def weighted(trees, w):
    return jax.tree.map(lambda *vs: sum(wi * v for wi, v in zip(w, vs)), *trees)


@pytest.mark.parametrize(
    "options, rounds",
    [
        ({}, 2),  # the paper's defaults: lam 0.01, mu 0.1, mean norms, inputs from the global GCE
        ({"lam": 0.5, "mu": 0.2, "guidance_norm": "batch", "conditional_inputs": "local"}, 3),
    ],
)
def test_rounds_equal_pfllib_clients_by_hand(options, rounds):
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    lam, mu = options.get("lam", 0.01), options.get("mu", 0.1)
    batch_norm = options.get("guidance_norm") == "batch"
    local_inputs = options.get("conditional_inputs") == "local"
    alg = gpfl.build(MODEL, SPEC, clients_per_round=K, client_map="map", **options)
    state = alg.init(jax.random.key(0), None, NUM)
    body, gce, cov = state.global_params["params"]["hidden_0"], state.gce, state.cov
    heads = [tree_at(state.client_heads, i) for i in range(NUM)]
    chex.assert_trees_all_equal(heads[0], MODEL.init(jax.random.key(0))["params"]["head"])
    shares = [shares_of(take(data.train, i)) for i in range(NUM)]
    # PFLlib's clients: their own GCE copies and conditional inputs (zeros before the first broadcast).
    own_gce = [gce] * NUM
    conds = [jnp.zeros((2, 8))] * NUM
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(rounds):
        state, metrics = rnd(state, data, jax.random.key(3))
        sample_key, train_key = round_keys(jax.random.key(3), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        if not local_inputs:
            conds = [cond_from(gce, shares[i]) for i in range(NUM)]
        outs = {}
        for i in idx:
            start = {"body": body, "head": heads[i], "gce": gce, "cov": cov}
            outs[i] = loop_client(
                start, take(data.train, i), client_key(train_key, i), conds[i], lam, mu, batch_norm
            )
        w = np.asarray([COUNTS[i] for i in idx], np.float32) / sum(COUNTS[i] for i in idx)
        body, gce, cov = (weighted([outs[i][k] for i in idx], w) for k in ("body", "gce", "cov"))
        heads = [outs[i]["head"] if i in outs else heads[i] for i in range(NUM)]
        for i in idx:
            own_gce[i] = outs[i]["gce"]
        conds = [cond_from(own_gce[i], shares[i]) for i in range(NUM)]  # set_GCE, then the overwrite
        own_gce = [gce] * NUM

        tol = {"rtol": 1e-5, "atol": 1e-6}
        chex.assert_trees_all_close(state.global_params["params"]["hidden_0"], body, **tol)
        chex.assert_trees_all_close(state.gce, gce, **tol)
        chex.assert_trees_all_close(state.cov, cov, **tol)
        for i in range(NUM):
            chex.assert_trees_all_close(tree_at(state.client_heads, i), heads[i], **tol)
    shared = (6 * 8 + 8) + 2 * (8 * 8 + 3 * 8) + CLASSES * 8  # body, CoV, GCE; no head
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * shared * 4

    # Evaluation: h(CoV(z, personalized input)) with the inputs of the next round.
    if not local_inputs:
        conds = [cond_from(gce, shares[i]) for i in range(NUM)]
    scores = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    for i in range(NUM):
        test = take(data.test, i)
        logits, _ = routes({"body": body, "head": heads[i], "cov": cov}, test.x, conds[i])
        valid = np.arange(test.y.shape[0]) < int(test.count)
        want = np.asarray(jnp.argmax(logits, -1) == test.y)[valid].mean()
        np.testing.assert_allclose(scores["accuracy"][i], want, atol=1e-6)


def test_heads_stay_local_and_conditions_in_closed_form():
    data = toy_data(COUNTS)
    alg = gpfl.build(MODEL, SPEC, clients_per_round=K, client_map="map")
    state = alg.init(jax.random.key(0), None, NUM)
    moved = state._replace(client_heads=jax.tree.map(lambda v: v + 5.0, state.client_heads))
    new = jax.jit(alg.round)(moved, data, jax.random.key(1))[0]
    idx = set(int(i) for i in sample_clients(round_keys(jax.random.key(1), 0)[0], NUM, K))
    for i in range(NUM):
        same = jax.tree.map(
            lambda a, b: bool(jnp.all(a == b)), tree_at(new.client_heads, i), tree_at(moved.client_heads, i)
        )
        assert all(s == (i not in idx) for s in jax.tree.leaves(same))
    assert new.client_conditions is None and new.previous_gce is None  # nothing kept per client

    y = jnp.asarray([0, 2, 2, 0, 1, 1], jnp.int32)  # 4 real rows: shares 1/2, 0, 1/2
    shares = gpfl.class_shares(y, jnp.int32(4), CLASSES)
    np.testing.assert_allclose(shares, [0.5, 0.0, 0.5])
    table = jax.random.normal(jax.random.key(2), (CLASSES, 5))
    cond = gpfl.conditions(table, shares)
    np.testing.assert_allclose(cond[0], table.mean(0), rtol=1e-6)
    np.testing.assert_allclose(cond[1], 0.5 * (table[0] + table[2]), rtol=1e-6)
    f = jax.random.normal(jax.random.key(3), (4, 5))
    cos = gpfl.cosine_logits(f, table)
    np.testing.assert_allclose(
        cos[:, 1], f @ table[1] / np.linalg.norm(f, axis=1) / np.linalg.norm(table[1]), rtol=1e-5
    )
    assert float(jnp.max(jnp.abs(cos))) <= 1.0 + 1e-6
    # A dead route (f_G = 0): torch's gradients, finite: 0 for a norm, 1 / eps for v / max(|v|, eps).
    zero = jnp.zeros(5)
    np.testing.assert_array_equal(jax.grad(lambda v: gpfl.safe_sqrt(jnp.sum(v * v)))(zero), np.zeros(5))
    np.testing.assert_allclose(
        jax.grad(lambda v: jnp.sum(gpfl.normalize(v)))(zero), np.full(5, 1e12), rtol=1e-6
    )


def test_local_inputs_lag_for_clients_that_sit_out():
    """PFLlib's inputs: zeros in round 0, then from the own trained GCE or the previous global one."""
    data = toy_data(COUNTS)
    alg = gpfl.build(MODEL, SPEC, clients_per_round=K, client_map="map", conditional_inputs="local")
    state = alg.init(jax.random.key(0), None, NUM)
    start = state
    state = jax.jit(alg.round)(state, data, jax.random.key(1))[0]
    idx = [int(i) for i in sample_clients(round_keys(jax.random.key(1), 0)[0], NUM, K)]
    np.testing.assert_array_equal(state.client_last, [0 if i in idx else -1 for i in range(NUM)])
    chex.assert_trees_all_equal(state.previous_gce, start.gce)
    for i in set(range(NUM)) - set(idx):
        np.testing.assert_array_equal(state.client_conditions[i], np.zeros((2, 8)))


def test_bad_options():
    for option in ("lam", "mu"):
        with pytest.raises(ValueError, match=option):
            gpfl.build(MODEL, SPEC, **{option: -1.0})
    with pytest.raises(ValueError, match="guidance_norm"):
        gpfl.build(MODEL, SPEC, guidance_norm="sum")
    with pytest.raises(ValueError, match="conditional_inputs"):
        gpfl.build(MODEL, SPEC, conditional_inputs="mine")
    with pytest.raises(ValueError, match="cross_entropy"):
        gpfl.build(MODEL, SPEC._replace(loss="mse"))


def test_it_learns():
    data = same_rule_data(24, 4)
    alg = gpfl.build(MODEL, SPEC, client_map="vmap")
    state = alg.init(jax.random.key(0), None, 4)
    evaluate = jax.jit(alg.evaluate)
    before = evaluate(state, data, jax.random.key(0))
    rnd = jax.jit(alg.round)
    for r in range(15):
        state, _ = rnd(state, data, jax.random.key(r))
    after = evaluate(state, data, jax.random.key(0))
    assert float(np.mean(after["loss"])) < 0.7 * float(np.mean(before["loss"]))
    assert float(np.mean(after["accuracy"])) > 0.6  # chance: 1/3
