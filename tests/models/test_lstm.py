"""The char LSTM: output shapes, a FedAvg round on it (vmapped; impl "auto") against a per-client
loop, and its "scan" and "onednn" impls against flax's nn.RNN(OptimizedLSTMCell) on the same
parameters."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfljax.algorithms import fedavg
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import get_loss
from pfljax.core.types import ClientData
from pfljax.data import pool_clients
from pfljax.models import build_model, onednn
from pfljax.models.lstm import CharLSTM, lstm_scan, resolve_impl

COUNTS = (5, 3, 7)
MODEL = build_model("char_lstm", (5,), 80, embed=4, hidden=(8,))
SPEC = LocalTraining(optax.sgd(0.5), batch_size=2, epochs=1, steps=None)


def test_shapes_last_position_and_every_position():
    x = jax.ShapeDtypeStruct((3, 5), np.int32)
    assert jax.eval_shape(MODEL.apply, MODEL.template(), x)[0].shape == (3, 80)
    seq = build_model("char_lstm", (5,), 90, embed=4, hidden=(8, 6), last_only=False)
    variables = seq.template()
    assert jax.eval_shape(seq.apply, variables, x)[0].shape == (3, 5, 90)
    assert variables["params"]["embedding"]["embedding"].shape == (90, 4)
    assert variables["params"]["lstm_1"]["if"]["kernel"].shape == (8, 6)
    assert variables["params"]["head"]["kernel"].shape == (6, 90)


def test_vmapped_round_equals_per_client_loop():
    rng = np.random.default_rng(0)
    pools = [
        pool_clients([rng.integers(0, 80, (n, 5)) for n in COUNTS], [rng.integers(0, 80, n) for n in COUNTS])
        for _ in "tt"
    ]
    data = ClientData(*pools)
    assert data.train.x.dtype == np.int32
    alg = fedavg.build(MODEL, SPEC, client_map="vmap")
    state = alg.init(jax.random.key(0), None, len(COUNTS))
    ref = state.global_params
    train = jax.jit(make_local_train(MODEL.apply, SPEC))
    for r in range(2):
        state, metrics = jax.jit(alg.round)(state, data, jax.random.key(3))
        _, train_key = round_keys(jax.random.key(3), r)
        outs = [train(ref, take(data.train, c), client_key(train_key, c)).params for c in range(len(COUNTS))]
        ref = jax.tree.map(
            lambda *xs: sum(n / sum(COUNTS) * np.asarray(x) for n, x in zip(COUNTS, xs)), *outs
        )
        chex.assert_trees_all_close(state.global_params, ref, rtol=1e-5, atol=1e-6)
    assert np.isfinite(metrics["train_loss"])


# ------------------------------------------------ impl "scan" (lstm_scan) against flax's nn.RNN

TINY = dict(embed=3, hidden=(5, 4), num_outputs=11)


def _models(last_only):
    return [CharLSTM(**TINY, last_only=last_only, impl=impl) for impl in ("scan", "flax")]


def _padded_batch():
    """Ids [4, 7] of 1..10 with trailing padding (id 0) of several lengths, and next-id targets."""
    rng = np.random.default_rng(1)
    x = rng.integers(1, 11, (4, 7))
    x[0, 4:], x[1, 1:], x[3, 6:] = 0, 0, 0
    return jnp.asarray(x, jnp.int32), jnp.asarray(np.roll(x, -1, axis=1), jnp.int32)


def _params(model, x):
    """The model's initial parameters with every bias (and the embedding) made non-trivial."""
    params = model.init(jax.random.key(2), x)["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    return jax.tree.unflatten(tree, [v + 0.3 * jax.random.normal(k, v.shape) for v, k in zip(leaves, keys)])


def test_scan_initialises_flax_parameters():
    x, _ = _padded_batch()
    scan, flax_rnn = (m.init(jax.random.key(0), x)["params"] for m in _models(False))
    chex.assert_trees_all_equal(scan, flax_rnn)
    assert sorted(scan["lstm_0"]) == ["hf", "hg", "hi", "ho", "if", "ig", "ii", "io"]
    assert sorted(scan["lstm_1"]["hg"]) == ["bias", "kernel"] and list(scan["lstm_1"]["ig"]) == ["kernel"]


@pytest.mark.parametrize("last_only", [True, False])
def test_scan_equals_flax_outputs_and_gradients(last_only):
    x, y = _padded_batch()
    scan, flax_rnn = _models(last_only)
    params = _params(scan, x)
    loss = get_loss("cross_entropy" if last_only else "token_cross_entropy")
    if last_only:
        y = y[:, -1]
    outs, grads = [], []
    for m in (scan, flax_rnn):
        out = jax.jit(m.apply)({"params": params}, x)
        assert out.shape == ((4, 11) if last_only else (4, 7, 11))
        outs.append(out)
        grads.append(
            jax.jit(jax.grad(lambda p, m=m: jnp.mean(loss.per_example(m.apply({"params": p}, x), y))))(params)
        )
    chex.assert_trees_all_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    assert all(float(jnp.abs(g).max()) > 1e-3 for g in jax.tree.leaves(grads[1]))  # every parameter matters


def test_lstm_scan_vjp_equals_autodiff_of_the_loop():
    # The same recurrence written as a plain scan (JAX's own reverse mode) at sizes where every
    # gate saturates somewhere: inputs of scale 3.
    kx, ki, kh, kb, kd = jax.random.split(jax.random.key(4), 5)
    x = 3 * jax.random.normal(kx, (6, 3, 5))
    wi, wh, b = jax.random.normal(ki, (5, 16)), jax.random.normal(kh, (4, 16)), jax.random.normal(kb, (16,))
    cot = jax.random.normal(kd, (6, 3, 4))

    def reference(x, wi, wh, b):
        def step(carry, xt):
            c, h = carry
            z = xt @ wi + h @ wh + b[None]
            i, f, g, o = (z[:, k * 4 : (k + 1) * 4] for k in range(4))
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (c, h), h

        zero = jnp.zeros((3, 4))
        return jax.lax.scan(step, (zero, zero), x)[1]

    args = (x, wi, wh, b)
    chex.assert_trees_all_close(lstm_scan(*args), reference(*args), rtol=1e-5, atol=1e-6)
    got = jax.grad(lambda *a: jnp.sum(lstm_scan(*a) * cot), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * cot), argnums=(0, 1, 2, 3))(*args)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_fedavg_round_scan_equals_flax():
    # A Shakespeare-like case: windows of next-character targets (TFF's sequence loss), padded
    # windows, clients of unequal sizes, two local steps with a partial batch; one round each.
    rng = np.random.default_rng(5)
    counts = (5, 3)
    windows = [rng.integers(1, 11, (n, 8)) for n in counts]
    windows[0][1, 5:] = 0
    pool = pool_clients([w[:, :-1] for w in windows], [w[:, 1:] for w in windows])
    data = ClientData(pool, pool)
    spec = LocalTraining(optax.sgd(0.5), batch_size=3, epochs=1, steps=None, loss="token_cross_entropy")
    finals = []
    for impl in ("scan", "flax"):
        model = build_model("char_lstm", (7,), 11, embed=3, hidden=(5, 4), last_only=False, impl=impl)
        alg = fedavg.build(model, spec)
        state = alg.init(jax.random.key(0), None, len(counts))
        state, metrics = jax.jit(alg.round)(state, data, jax.random.key(1))
        assert np.isfinite(metrics["train_loss"])
        finals.append(state.global_params)
    chex.assert_trees_all_close(finals[0], finals[1], rtol=1e-5, atol=1e-6)
    init = fedavg.build(model, spec).init(jax.random.key(0), None, len(counts)).global_params
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(init))]
    assert min(moved) > 0 and max(moved) > 1e-3  # the round trained every parameter


def test_unknown_impl_is_refused():
    x, _ = _padded_batch()
    with pytest.raises(ValueError, match="impl must be one of"):
        CharLSTM(**TINY, impl="cudnn").init(jax.random.key(0), x)


# ------------------------------------------------ impl "onednn" and "auto"

needs_onednn = pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.unavailable_reason()}")


@needs_onednn
@pytest.mark.parametrize("last_only", [True, False])
def test_onednn_equals_flax_outputs_and_gradients(last_only):
    x, y = _padded_batch()
    ours, theirs = (CharLSTM(**TINY, last_only=last_only, impl=impl) for impl in ("onednn", "flax"))
    params = _params(ours, x)
    loss = get_loss("cross_entropy" if last_only else "token_cross_entropy")
    y = y[:, -1] if last_only else y
    outs = [jax.jit(m.apply)({"params": params}, x) for m in (ours, theirs)]
    grads = [
        jax.jit(jax.grad(lambda p, m=m: jnp.mean(loss.per_example(m.apply({"params": p}, x), y))))(params)
        for m in (ours, theirs)
    ]
    chex.assert_trees_all_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_auto_is_onednn_on_cpu_with_two_cores_a_call_else_scan(monkeypatch):
    on_cpu = jax.default_backend() == "cpu" and onednn.threads_per_call() >= 2
    assert resolve_impl("auto") == ("onednn" if on_cpu and onednn.available() else "scan")
    assert resolve_impl("flax") == "flax"
    with monkeypatch.context() as one_core:  # a CPU device per core: scan
        one_core.setattr(onednn, "threads_per_call", lambda: 1)
        assert resolve_impl("auto") == "scan"
    monkeypatch.setattr(onednn, "_load", lambda: "no oneDNN here")
    onednn.available_or_log.cache_clear()
    try:
        assert resolve_impl("auto") == "scan"
    finally:
        onednn.available_or_log.cache_clear()
