"""Factorized-FL: similarity weights against a sort-based reference, the L1 subgradient,
the mapped round against a per-client Python loop written here, bytes, and a small
Fashion-MNIST domain run."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax import algorithms
from pfljax.algorithms import factorized_fl as F
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.evaluate import evaluate_client
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.sampling import sample_clients
from pfljax.models import build_model
from tests.toydata import toy_data


def factorized_model(name, input_shape, num_outputs, **kwargs):
    """The model Factorized-FL trains when asked for `name` (its MODEL_VARIANTS)."""
    return build_model(algorithms.model_variant("factorized_fl", name), input_shape, num_outputs, **kwargs)


COUNTS = (12, 7, 20, 3, 9, 15)
MODEL = factorized_model("mlp", (6,), 3, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.1, momentum=0.5), batch_size=4, epochs=1, steps=None)
LAYERS = ("hidden_0", "head")
IDX_DIR = "/usr/share/datasets/fashion-mnist"
similarity_weights = jax.jit(F.similarity_weights)  # one compile per shape, hyperparameters traced


def reference_weights(v, tau, epsilon, min_keep, participating):
    """The release's server rule, client by client: sort by cosine (self first),
    keep max(#{sigma >= tau}, min_keep), softmax(epsilon * sigma) over them."""
    v = np.asarray(v, np.float64)
    ids = np.flatnonzero(participating)
    out = np.zeros((len(v), len(v)))
    for i in ids:
        sigma = {int(j): float(v[i] @ v[j] / np.linalg.norm(v[i]) / np.linalg.norm(v[j])) for j in ids}
        sigma[int(i)] = 1.0
        order = sorted(sigma, key=lambda j: (j != i, -sigma[j]))
        n = max(sum(s >= tau for s in sigma.values()), min(min_keep, len(ids)))
        kept = order[:n]
        scores = np.exp([epsilon * sigma[j] for j in kept])
        out[i, kept] = scores / scores.sum()
    return out


@pytest.mark.parametrize(
    "tau,epsilon,min_keep", [(0.0, 1.0, 1), (0.3, 5.0, 3), (0.9, 20.0, 2), (2.0, 1.0, 4)]
)
def test_similarity_weights_match_reference(tau, epsilon, min_keep):
    v = jax.random.normal(jax.random.key(0), (7, 5)) + 0.5
    part = np.array([1, 1, 0, 1, 1, 0, 1], bool)
    for participating in (None, part):
        ref_part = np.ones(7, bool) if participating is None else participating
        w = np.asarray(
            similarity_weights(v, tau=tau, epsilon=epsilon, min_keep=min_keep, participating=participating)
        )
        np.testing.assert_allclose(
            w, reference_weights(v, tau, epsilon, min_keep, ref_part), rtol=1e-5, atol=1e-7
        )
        assert np.all(w >= 0)
        np.testing.assert_allclose(w.sum(1), ref_part.astype(float), rtol=1e-6)
        assert not np.any(w[:, ~ref_part]) and not np.any(w[~ref_part])


def test_identical_v_give_uniform_weights_over_kept_clients():
    v = jnp.tile(jnp.array([[1.0, -2.0, 0.5]]), (5, 1))
    w = similarity_weights(v, tau=0.5, epsilon=3.0, min_keep=1)
    np.testing.assert_allclose(w, np.full((5, 5), 0.2), rtol=1e-6)
    part = jnp.array([True, False, True, True, False])
    w = np.asarray(similarity_weights(v, tau=0.5, epsilon=3.0, min_keep=1, participating=part))
    np.testing.assert_allclose(w[np.ix_([0, 2, 3], [0, 2, 3])], np.full((3, 3), 1 / 3), rtol=1e-6)


def test_orthogonal_client_keeps_only_itself():
    v = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.1], [0.0, 1.0, 0.2], [0.0, 0.9, 0.0]])
    w = np.asarray(similarity_weights(v, tau=0.5, epsilon=1.0, min_keep=1))
    np.testing.assert_array_equal(w[0], [1.0, 0.0, 0.0, 0.0])
    assert np.all(w[1:, 1:] > 0) and not np.any(w[1:, 0])
    # min_keep forces the most similar others in even below tau.
    w = np.asarray(similarity_weights(v, tau=0.5, epsilon=1.0, min_keep=2))
    assert np.count_nonzero(w[0]) == 2 and w[0, 0] > 0


def test_large_epsilon_concentrates_on_the_most_similar():
    v = jax.random.normal(jax.random.key(1), (4, 6))
    v = v.at[1].set(3.0 * v[0])  # client 1 is client 0's twin (cosine 1)
    w = np.asarray(similarity_weights(v, tau=-1.0, epsilon=1e4, min_keep=1))
    np.testing.assert_allclose(w[0], [0.5, 0.5, 0, 0], atol=1e-6)
    np.testing.assert_allclose(w[2], [0, 0, 1, 0], atol=1e-6)
    soft = np.asarray(similarity_weights(v, tau=-1.0, epsilon=0.0, min_keep=1))
    np.testing.assert_allclose(soft, np.full((4, 4), 0.25), rtol=1e-6)


def test_l1_term_changes_mu_gradient_by_lambda_sign_mu():
    params = jax.jit(MODEL.init)(jax.random.key(0))["params"]
    rng = np.random.default_rng(0)
    for layer in LAYERS:  # random mu with exact zeros, where sign(0) = 0 must hold
        mu = rng.normal(size=params[layer]["mu"].shape) * (rng.random(params[layer]["mu"].shape) < 0.6)
        params[layer]["mu"] = jnp.asarray(mu, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (5, 6))
    y = jnp.array([0, 1, 2, 1, 0])

    def data_loss(p):
        out, _ = MODEL.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    lam = 0.03
    g0, g1 = jax.jit(
        lambda p: (jax.grad(data_loss)(p), jax.grad(lambda q: data_loss(q) + F.sparse_penalty(q, lam))(p))
    )(params)
    for layer in LAYERS:
        for leaf in ("u", "v", "bias"):
            np.testing.assert_allclose(g1[layer][leaf], g0[layer][leaf], rtol=1e-6)
        diff = g1[layer]["mu"] - g0[layer]["mu"]
        np.testing.assert_allclose(diff, lam * np.sign(params[layer]["mu"]), atol=1e-7)
    assert float(F.sparse_penalty(params, lam)) == pytest.approx(
        lam * sum(float(jnp.abs(params[layer]["mu"]).sum()) for layer in LAYERS), rel=1e-5
    )


def mixed_leaf_names(variant, other_leaves):
    names = ("u", "v", "mu") if variant == "beta" else ("u",)
    return names + (("bias",) if other_leaves == "mixed" else ())


def loop_round(clients, data, key, r, k, opts, train):
    """Reference round over a list of per-client variables, written without the library's mixing."""
    sample_key, train_key = round_keys(key, r)
    idx = np.asarray(sample_clients(sample_key, len(COUNTS), k))
    part = np.zeros(len(COUNTS), bool)
    part[idx] = True
    v = np.stack([np.asarray(c["params"]["hidden_0"]["v"]).ravel() for c in clients])
    w = reference_weights(v, opts["tau"], opts["epsilon"], opts["min_keep"], part)
    layers = ("hidden_0",) if opts["head_local"] else LAYERS
    new = list(clients)
    for i in idx:
        start = jax.tree.map(lambda x: x, clients[i])
        for layer in layers:
            for leaf in mixed_leaf_names(opts["variant"], opts["other_leaves"]):
                mixed = sum(w[i, j] * np.asarray(clients[j]["params"][layer][leaf]) for j in idx)
                start["params"][layer][leaf] = jnp.asarray(mixed, jnp.float32)
        new[i] = train(start, take(data.train, i), client_key(train_key, i)).params
    return new, w


OPTS = [
    dict(variant="base", head_local=True, other_leaves="local", tau=0.2, epsilon=5.0, min_keep=2),
    dict(variant="beta", head_local=False, other_leaves="mixed", tau=0.9, epsilon=2.0, min_keep=1),
]


@pytest.mark.parametrize("opts,k,strategy", [(OPTS[0], 4, "vmap"), (OPTS[1], 6, "map")])
def test_round_equals_per_client_loop(opts, k, strategy):
    data = toy_data(COUNTS)
    lam = 0.01
    alg = F.build(MODEL, SPEC, clients_per_round=k, client_map=strategy, lambda_sparse=lam, **opts)

    def penalty(p):  # |mu|_1 with gradient sign(mu), sign(0) = 0, written differently
        return lam * sum(
            jnp.sum(p[layer]["mu"] * jax.lax.stop_gradient(jnp.sign(p[layer]["mu"]))) for layer in LAYERS
        )

    train = jax.jit(make_local_train(MODEL.apply, SPEC, regularizer=penalty))
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    clients = [take(state.client_params, c) for c in range(len(COUNTS))]
    total = np.zeros((len(COUNTS),) * 2)
    rnd = jax.jit(alg.round)
    key = jax.random.key(7)
    for r in range(3):
        state, metrics = rnd(state, data, key)
        clients, w = loop_round(clients, data, key, r, k, opts, train)
        total += w
        np.testing.assert_allclose(metrics["mixing"], w, rtol=1e-5, atol=1e-6)
        for c in range(len(COUNTS)):
            chex.assert_trees_all_close(take(state.client_params, c), clients[c], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.client_mixing_sum, total, rtol=1e-5, atol=1e-6)
    collab = np.asarray(F.collaboration_matrix(state))
    np.testing.assert_allclose(collab.sum(1), 1.0, rtol=1e-6)
    assert np.isfinite(metrics["train_loss"]) and 0 <= metrics["mu_density"] <= 1
    acc = jax.jit(alg.evaluate)(state, data, jax.random.key(0))
    for c in (0, 3):
        ref = evaluate_client(MODEL.apply, clients[c], take(data.test, c))
        np.testing.assert_allclose(acc["accuracy"][c], ref["accuracy"], rtol=1e-6)


def test_round_traces_once_and_never_participating_clients_stay_put():
    data = toy_data(COUNTS)
    alg = F.build(MODEL, SPEC, clients_per_round=2, tau=0.5, min_keep=2)

    rnd = jax.jit(chex.assert_max_traces(alg.round, n=1))

    state0 = alg.init(jax.random.key(0), None, len(COUNTS))
    state = state0
    for r in range(4):
        state, metrics = rnd(state, data, jax.random.fold_in(jax.random.key(0), r))
    assert int(state.round) == 4 and metrics["mixing"].shape == (6, 6)
    seen = np.asarray(state.client_mixing_sum).sum(1) > 0
    collab = np.asarray(F.collaboration_matrix(state))
    np.testing.assert_allclose(collab.sum(1), 1.0, rtol=1e-6)
    for c in np.flatnonzero(~seen):
        chex.assert_trees_all_equal(take(state.client_params, c), take(state0.client_params, c))
        assert collab[c, c] == 1.0


@pytest.mark.parametrize(
    "variant,head_local,other_leaves,up,down",
    [
        # MLP 6 -> 8 -> 3, rank 1, float32 (4 bytes): hidden_0 u [6, 1], v [8, 1], mu [6, 8],
        # bias [8]; head u [8, 1], v [3, 1], mu [8, 3], bias [3].
        ("base", True, "local", 4 * (6 + 8), 4 * 6),
        ("base", False, "local", 4 * (6 + 8 + 8), 4 * (6 + 8)),
        ("base", False, "mixed", 4 * (6 + 8 + 8 + 8 + 3), 4 * (6 + 8 + 8 + 3)),
        ("beta", True, "local", 4 * (6 + 8 + 48), 4 * (6 + 8 + 48)),
        (
            "beta",
            False,
            "mixed",
            4 * (6 + 8 + 48 + 8 + 8 + 3 + 24 + 3),
            4 * (6 + 8 + 48 + 8 + 8 + 3 + 24 + 3),
        ),
    ],
)
def test_bytes_per_client(variant, head_local, other_leaves, up, down):
    template = jax.eval_shape(MODEL.init, jax.random.key(0))
    mixed, uploaded = F.leaf_roles(
        template, "hidden_0", variant=variant, head_local=head_local, other_leaves=other_leaves
    )
    assert F.flagged_bytes(template, uploaded) == up
    assert F.flagged_bytes(template, mixed) == down


def test_code_sparsity_prunes_mu_at_evaluation():
    variables = jax.jit(MODEL.init)(jax.random.key(0))
    mu = variables["params"]["hidden_0"]["mu"]
    variables["params"]["hidden_0"]["mu"] = mu + jnp.linspace(-0.01, 0.01, mu.size).reshape(mu.shape)
    pruned = F.prune_mu(variables, 0.004)
    kept = np.asarray(pruned["params"]["hidden_0"]["mu"])
    full = np.asarray(variables["params"]["hidden_0"]["mu"])
    np.testing.assert_array_equal(kept, np.where(np.abs(full) < 0.004, 0.0, full))
    assert 0 < np.count_nonzero(kept) < kept.size
    chex.assert_trees_all_equal(pruned["params"]["head"], variables["params"]["head"])


def test_model_variants_and_layer_order():
    assert F.layer_order(factorized_model("cnn", (12, 12, 1), 3, kernel_size=3)) == [
        "conv_0",
        "conv_1",
        "dense_0",
        "head",
    ]
    resnet = factorized_model("resnet9", (12, 12, 1), 3, widths=(4, 6, 8))
    assert F.layer_order(resnet) == [f"conv_{i}" for i in range(8)] + ["head"]
    with pytest.raises(ValueError, match="model must be one of"):
        factorized_model("vgg", (6,), 3)
    assert F.MODEL_VARIANTS == {**F.FACTORIZED_MODELS, **{v: v for v in F.FACTORIZED_MODELS.values()}}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(variant="gamma"), "variant"),
        (dict(sparsity="prox"), "sparsity"),
        (dict(other_leaves="all"), "other_leaves"),
        (dict(epsilon=-1.0), "epsilon"),
        (dict(min_keep=0), "min_keep"),
        (dict(lambda_sparse=-1e-3), "lambda_sparse"),
        (dict(match_layer="hidden_7"), "match_layer"),
        (dict(client_map="pmap"), "strategy"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.build(MODEL, SPEC, **kwargs)


def test_plain_model_is_refused():
    with pytest.raises(ValueError, match="factorized"):
        F.build(build_model("mlp", (6,), 3, hidden=(8,)), SPEC)


@pytest.mark.skipif(not os.path.isdir(IDX_DIR), reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_domains_collaborate_within_groups():
    """2 groups of 4 clients with disjoint classes (relabelled 0..4 per group, not
    permuted per client) and the release's domain settings: the averaged mixing
    matrix weighs clients of the same group more. With labels also permuted per
    client the ratio is below 1 at this scale (experiments/factorized_fl_study.py)."""
    from pfljax.data import build_federated_data

    fd = build_federated_data(
        "fashion_mnist", 8, partition="groups", num_groups=2, samples_per_client=200, seed=0
    )
    model = factorized_model("mlp", fd.input_shape, fd.num_classes, hidden=(100,))
    spec = LocalTraining(optax.sgd(0.05, momentum=0.9), batch_size=32, epochs=1, steps=None)
    alg = F.build(model, spec, tau=0.95, epsilon=20.0, min_keep=4)
    state = alg.init(jax.random.key(0), None, 8)
    rnd = jax.jit(alg.round)
    for _ in range(8):
        state, _ = rnd(state, fd.data, jax.random.key(1))
    report = F.final_report(state, fd)
    print(report)
    assert report["collab_within_group"] > report["collab_across_group"], report
    assert np.mean(jax.jit(alg.evaluate)(state, fd.data, jax.random.key(0))["accuracy"]) > 0.5
