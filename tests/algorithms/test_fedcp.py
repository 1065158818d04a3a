"""FedCP: the round against a per-client loop over the MLP written out by hand (CPN policy with
the Gumbel noise of the client's key, frozen global head, MMD to the received extractor), the
server's averages, what stays on the client, the evaluation's noise, bad options; it learns."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedcp
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining
from pfljax.core.privacy import ClientDP
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.algorithms.fast_compile import fast_compile  # noqa: F401  (autouse)
from tests.toydata import same_rule_data, stream_batch, toy_data

COUNTS = (12, 7, 20, 3, 9)
NUM, K, B, LR, D = len(COUNTS), 3, 4, 0.1, 8
MODEL = build_model("mlp", (6,), 3, hidden=(D,))
SPEC = LocalTraining(optax.sgd(LR), batch_size=B, epochs=1, steps=None)
OPTIONS = {"lam": 2.0, "tau": 0.7, "head_upload_weight": 0.5, "initial_context": "random"}


@jax.jit
def ref_logits(body, head, global_head, cpn, context, x, noise, tau):
    """(W_i(s * z) + W(r * z), z) of the MLP by hand; noise [B, 2, d] or None."""
    z = jax.nn.relu(x @ body["kernel"] + body["bias"][None])
    u = z * context[None] / jnp.maximum(jnp.linalg.norm(context), 1e-12)
    a = u @ cpn["kernel"] + cpn["bias"][None]
    a = (a - a.mean(-1, keepdims=True)) / jnp.sqrt(a.var(-1, keepdims=True) + 1e-5)
    a = jax.nn.relu(a * cpn["scale"][None] + cpn["offset"][None]).reshape(-1, 2, D)
    if noise is not None:
        a = a + noise
    e = jnp.exp(a / tau)
    s, r = e[:, 0] / e.sum(1), e[:, 1] / e.sum(1)
    out = (z * s) @ head["kernel"] + head["bias"][None] + (z * r) @ global_head["kernel"]
    out = out + global_head["bias"][None]
    return out, z


def ref_mmd(a, b, w):
    """sum_ij w_i w_j (k(a_i, a_j) + k(b_i, b_j) - 2 k(a_i, b_j)) / (sum w)^2, k the sum of 4 RBFs."""

    def k(p, q):
        sq = jnp.sum((p[:, None] - q[None]) ** 2, -1)
        return sum(jnp.exp(-sq / (2 * s)) for s in (10.0, 15.0, 20.0, 50.0))

    return jnp.sum(w[:, None] * w[None] * (k(a, a) + k(b, b) - 2 * k(a, b))) / jnp.sum(w) ** 2


def ref_loss(train, fixed, x, y, w, noise):
    global_head, frozen, context, lam, tau = fixed
    out, z = ref_logits(train["body"], train["head"], global_head, train["cpn"], context, x, noise, tau)
    z0 = jax.nn.relu(x @ frozen["kernel"] + frozen["bias"][None])
    ce = -jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], 1)[:, 0]
    return jnp.sum(ce * w) / jnp.sum(w) + lam * ref_mmd(z, z0, w)


@jax.jit
def ref_step(train, fixed, data, key, s):
    """SGD step s: the core schedule's rows, Gumbel noise from the key's second half, step s."""
    idx, w = stream_batch(key, s, data.count, data.x.shape[0], B)
    noise = jax.random.gumbel(jax.random.fold_in(jax.random.split(key)[1], s), (B, 2, D))
    grads = jax.grad(ref_loss)(train, fixed, data.x[idx], data.y[idx], w, noise)
    return jax.tree.map(lambda a, g: a - LR * g, train, grads)


def loop_client(params, cpn, head, context, data, key, lam, tau):
    """ceil(n / B) SGD steps on the extractor, W_i and the CPN, with W and the received extractor fixed."""
    train = {"body": params["hidden_0"], "head": head, "cpn": cpn}
    fixed = (params["head"], params["hidden_0"], context, lam, tau)
    for s in range(-(-int(data.count) // B)):
        train = ref_step(train, fixed, data, key, jnp.int32(s))
    return train


# Test row j's noise [n, 2, d] from a client's evaluation key (the module's scheme).
ROW_NOISE = jax.jit(
    lambda key, n: jax.vmap(lambda j: jax.random.gumbel(jax.random.fold_in(key, j), (2, D)))(jnp.arange(n)),
    static_argnums=1,
)


@jax.jit
def weighted(trees, w):
    return jax.tree.map(lambda *vs: sum(w[i] * v for i, v in enumerate(vs)), *trees)


@pytest.mark.parametrize("send_global", fedcp.SEND_GLOBAL)
def test_round_equals_loop_and_evaluation_uses_the_next_rounds_models(send_global):
    """send_global="participants" (PFLlib's): a client trains from, uploads a mix with, and is
    evaluated with the global head and CPN it last received; "all": the server's latest."""
    chex.clear_trace_counter()
    data = toy_data(COUNTS)
    options = {**OPTIONS, "send_global": send_global}
    alg = fedcp.build(MODEL, SPEC, clients_per_round=K, client_map="map", **options)
    state = alg.init(jax.random.key(0), None, NUM)
    params, cpn = state.global_params["params"], state.cpn
    heads = [take(state.client_heads, i) for i in range(NUM)]
    contexts = [state.client_context[i] for i in range(NUM)]
    held = [(params["head"], cpn)] * NUM  # each client's last received (W, CPN)
    sat_out_and_returned, round0 = False, []
    chex.assert_trees_all_equal(heads[0], params["head"])  # W_i starts as the model's head
    assert np.all((np.asarray(state.client_context) >= 0) & (np.asarray(state.client_context) < 1))
    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))
    for r in range(2):
        state, metrics = rnd(state, data, jax.random.key(3))
        sample_key, train_key = round_keys(jax.random.key(3), r)
        idx = [int(i) for i in sample_clients(sample_key, NUM, K)]
        if send_global == "all":
            held = [(params["head"], cpn)] * NUM
        # a client that sat out round 0 and takes part in round 1 starts from stale ones
        sat_out_and_returned |= r == 1 and any(i not in round0 for i in idx)
        round0 = idx if r == 0 else round0
        outs = {}
        for i in idx:
            start, key = {**params, "head": held[i][0]}, client_key(train_key, i)
            outs[i] = loop_client(start, held[i][1], heads[i], contexts[i], take(data.train, i), key, 2, 0.7)
        w = np.asarray([COUNTS[i] for i in idx], np.float32) / sum(COUNTS[i] for i in idx)
        uploads = [jax.tree.map(lambda p, g: 0.5 * p + 0.5 * g, outs[i]["head"], held[i][0]) for i in idx]
        params = {"hidden_0": weighted([outs[i]["body"] for i in idx], w), "head": weighted(uploads, w)}
        cpn = weighted([outs[i]["cpn"] for i in idx], w)
        for i in idx:
            heads[i], contexts[i] = outs[i]["head"], jnp.sum(outs[i]["head"]["kernel"], 1)
            held[i] = (params["head"], cpn)
        chex.assert_trees_all_close(state.global_params["params"], params, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state.cpn, cpn, rtol=1e-5, atol=1e-6)
        for i in range(NUM):
            chex.assert_trees_all_close(take(state.client_heads, i), heads[i], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(state.client_context[i], contexts[i], rtol=1e-5, atol=1e-6)
            if send_global == "participants":
                chex.assert_trees_all_close(take(state.client_received, i), held[i], rtol=1e-5, atol=1e-6)
    assert send_global == "all" or sat_out_and_returned  # the case that tells the two apart happened
    if send_global == "all":
        assert state.client_received is None
        held = [(params["head"], cpn)] * NUM
    shared = (6 * D + D + D * 3 + 3 + D * 2 * D + 3 * 2 * D) * 4  # extractor + W + CPN; W_i stays
    assert metrics["bytes_up"] == metrics["bytes_down"] == K * shared
    assert float(metrics["mmd"]) > 0

    # Evaluation: the global extractor, W and CPN with each client's W_i and context; Gumbel noise
    # of test row j of client c from fold_in(fold_in(key, c), j), or none.
    noiseless = fedcp.build(MODEL, SPEC, client_map="map", **options, inference_noise=False)
    for model, noisy in ((alg, True), (noiseless, False)):
        scores = jax.jit(model.evaluate)(state, data, jax.random.key(5))
        for i in range(NUM):
            n = COUNTS[i]
            x, y = data.test.x[i, :n], np.asarray(data.test.y[i, :n])
            noise = ROW_NOISE(jax.random.fold_in(jax.random.key(5), i), n) if noisy else None
            w_head, w_cpn = held[i]
            out, _ = ref_logits(params["hidden_0"], heads[i], w_head, w_cpn, contexts[i], x, noise, 0.7)
            out = np.asarray(out, np.float64)
            logp = out - np.log(np.exp(out).sum(1, keepdims=True))
            np.testing.assert_allclose(scores["loss"][i], -logp[np.arange(n), y].mean(), rtol=1e-5)
            np.testing.assert_allclose(scores["accuracy"][i], np.mean(np.argmax(out, -1) == y), atol=1e-6)


def test_policy_and_mmd_closed_forms():
    cpn = fedcp.init_cpn(jax.random.key(0), D)
    u = jax.random.normal(jax.random.key(1), (5, D))
    noise = jax.random.gumbel(jax.random.key(2), (5, 2, D))
    for g in (None, noise):
        s, r = fedcp.policy(cpn, u, 0.7, g)
        np.testing.assert_allclose(s + r, 1.0, rtol=1e-6)
        assert np.all((np.asarray(s) > 0) & (np.asarray(s) < 1))
    s, r = fedcp.policy(cpn, u, 1e6, None)  # a hot softmax is uniform over the pair
    np.testing.assert_allclose(s, 0.5, atol=1e-5)
    a, b = jax.random.normal(jax.random.key(3), (2, 6, D))
    w = jnp.asarray([1, 1, 1, 1, 0, 0], jnp.float32)  # a partial batch: two slots weigh 0
    np.testing.assert_allclose(fedcp.mmd(a, b, w), ref_mmd(a, b, w), rtol=1e-5)
    np.testing.assert_allclose(fedcp.mmd(a, b, w), fedcp.mmd(a[:4], b[:4], jnp.ones(4)), rtol=1e-5)
    np.testing.assert_allclose(fedcp.mmd(a, a, jnp.ones(6)), 0.0, atol=1e-6)
    an, bn = np.asarray(a[:4], np.float64), np.asarray(b[:4], np.float64)  # PFLlib's: mean of B x B kernels
    kern = lambda p, q: sum(
        np.exp(-0.5 * ((p[:, None] - q[None]) ** 2).sum(-1) / s) for s in (10, 15, 20, 50)
    )  # noqa: E731
    np.testing.assert_allclose(
        fedcp.mmd(a[:4], b[:4], jnp.ones(4)),
        np.mean(kern(an, an) + kern(bn, bn) - 2 * kern(an, bn)),
        rtol=1e-4,
    )


def test_what_stays_local_and_what_the_server_averages():
    data = toy_data(COUNTS)
    idx = [int(i) for i in sample_clients(round_keys(jax.random.key(1), 0)[0], NUM, K)]
    rest = sorted(set(range(NUM)) - set(idx))
    w = np.asarray([COUNTS[i] for i in idx], np.float32) / sum(COUNTS[i] for i in idx)
    for weight in (1.0, 0.0):
        alg = fedcp.build(MODEL, SPEC, clients_per_round=K, client_map="map", head_upload_weight=weight)
        state = alg.init(jax.random.key(0), None, NUM)
        # Non-participants' heads never reach the server; they and their contexts stay as they were.
        other = state._replace(
            client_heads=jax.tree.map(lambda v: v.at[np.asarray(rest)].add(5.0), state.client_heads)
        )
        a, b = (jax.jit(alg.round)(s, data, jax.random.key(1))[0] for s in (state, other))
        chex.assert_trees_all_equal((a.global_params, a.cpn), (b.global_params, b.cpn))
        for i in rest:
            chex.assert_trees_all_equal(take(b.client_heads, i), take(other.client_heads, i))
            chex.assert_trees_all_equal(b.client_context[i], other.client_context[i])
        for i in idx:  # a participant's context: the sum over classes of its trained head's weights
            np.testing.assert_allclose(a.client_context[i], a.client_heads["kernel"][i].sum(1), rtol=1e-6)
        head = a.global_params["params"]["head"]
        if weight == 1.0:  # the paper's: W is the weighted mean of the trained personalized heads
            want = weighted([take(a.client_heads, i) for i in idx], w)
        else:  # only W itself uploaded: W does not move
            want = state.global_params["params"]["head"]
        chex.assert_trees_all_close(head, want, rtol=1e-5, atol=1e-6)


def test_one_local_step_does_not_feel_the_mmd():
    """At the first step h = h0 (the extractor is the received one): MMD = 0 and so is its gradient."""
    data = toy_data(COUNTS)
    one_step = SPEC._replace(steps=1, epochs=None)
    out = []
    for lam in (0.0, 10.0):
        alg = fedcp.build(MODEL, one_step, clients_per_round=K, client_map="map", lam=lam)
        out.append(jax.jit(alg.round)(alg.init(jax.random.key(0), None, NUM), data, jax.random.key(1)))
    chex.assert_trees_all_close(out[0][0], out[1][0], rtol=1e-6, atol=1e-7)
    assert float(out[1][1]["mmd"]) < 1e-6


def test_evaluation_noise_follows_the_key():
    data = toy_data(COUNTS)
    alg = fedcp.build(MODEL, SPEC, client_map="map")
    state = jax.jit(alg.round)(alg.init(jax.random.key(0), None, NUM), data, jax.random.key(1))[0]
    evaluate = jax.jit(alg.evaluate)
    a, b, c = (evaluate(state, data, jax.random.key(k)) for k in (2, 2, 3))
    chex.assert_trees_all_equal(a, b)
    assert not np.allclose(a["loss"], c["loss"])
    quiet = jax.jit(fedcp.build(MODEL, SPEC, client_map="map", inference_noise=False).evaluate)
    chex.assert_trees_all_equal(quiet(state, data, jax.random.key(2)), quiet(state, data, jax.random.key(3)))


def test_bad_options():
    for option, value in (("lam", -1.0), ("tau", 0.0), ("head_upload_weight", 1.5)):
        with pytest.raises(ValueError, match=option):
            fedcp.build(MODEL, SPEC, **{option: value})
    with pytest.raises(ValueError, match="initial_context"):
        fedcp.build(MODEL, SPEC, initial_context="zeros")
    with pytest.raises(ValueError, match="inference_noise"):
        fedcp.build(MODEL, SPEC, inference_noise=1)
    with pytest.raises(ValueError, match="send_global must be one of"):
        fedcp.build(MODEL, SPEC, send_global="some")
    with pytest.raises(ValueError, match="send_global='participants' cannot be used with client-level DP"):
        fedcp.build(MODEL, SPEC, send_global="participants", privacy=ClientDP(1.0, 0.1))
    with pytest.raises(ValueError, match="cross_entropy"):
        fedcp.build(MODEL, SPEC._replace(loss="mse"))
    with pytest.raises(ValueError, match="weighting"):
        fedcp.build(MODEL, SPEC, weighting="x")


def test_it_learns():
    data = same_rule_data(40, 4)
    alg = fedcp.build(MODEL, SPEC, clients_per_round=3, client_map="map")
    state = alg.init(jax.random.key(0), None, 4)
    evaluate, rnd = jax.jit(alg.evaluate), jax.jit(alg.round)
    before = evaluate(state, data, jax.random.key(1))
    for r in range(12):
        state, _ = rnd(state, data, jax.random.key(r))
    after = evaluate(state, data, jax.random.key(1))
    assert float(np.mean(after["loss"])) < 0.7 * float(np.mean(before["loss"]))
    assert float(np.mean(after["accuracy"])) > 0.65
