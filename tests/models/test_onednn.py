"""oneDNN's convolutions (pfljax.models.onednn): float64 oracle, gradients, vmap, jvp of the
gradient, a training loop, the build cache and the fallbacks. Skipped where oneDNN cannot be
built (no `g++` / `libdnnl-dev`); CI installs both."""

import subprocess

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfljax.models import build_model, onednn
from pfljax.models.conv import conv2d, resolve_impl

needs_onednn = pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.unavailable_reason()}")


def _loss(impl, strides=(1, 1), padding="SAME"):
    return lambda x, w: jnp.sum(jnp.sin(conv2d(x, w, strides=strides, padding=padding, impl=impl)))


def _native64(x, w, strides, padding):
    """The same convolution and gradients by XLA's own convolution in float64 (the oracle)."""
    with jax.enable_x64(True):
        x64, w64 = jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(w, np.float64))
        y = conv2d(x64, w64, strides=strides, padding=padding, impl="native")
        grads = jax.grad(_loss("native", strides, padding), argnums=(0, 1))(x64, w64)
        return np.asarray(y), [np.asarray(g) for g in grads]


@needs_onednn
@pytest.mark.parametrize("cin,cout", [(1, 8), (3, 5), (16, 32)])
@pytest.mark.parametrize(
    "padding,strides,k",
    [
        ("SAME", (1, 1), 5),
        ("VALID", (1, 1), 5),
        ("SAME", (2, 2), 3),
        ("VALID", (2, 1), 4),
        ("SAME", (1, 1), 4),
    ],
)
def test_onednn_equals_a_float64_convolution(cin, cout, padding, strides, k):
    kx, kk = jax.random.split(jax.random.key(cin))
    x = jax.random.normal(kx, (3, 11, 10, cin))
    w = jax.random.normal(kk, (k, k, cin, cout)) / k
    y = jax.jit(lambda x, w: conv2d(x, w, strides=strides, padding=padding, impl="onednn"))(x, w)
    grads = jax.jit(jax.grad(_loss("onednn", strides, padding), argnums=(0, 1)))(x, w)
    y64, grads64 = _native64(x, w, strides, padding)
    assert y.shape == y64.shape
    np.testing.assert_allclose(y, y64, rtol=1e-5, atol=1e-5)
    for g, g64 in zip(grads, grads64):
        np.testing.assert_allclose(g, g64, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_onednn_under_vmap_equals_a_loop_and_allows_forward_over_reverse():
    """Clients vmapped (each its own kernel) == one at a time, bit for bit; the jvp of the
    gradient (Per-FedAvg's exact Hessian-vector product) equals plain im2col's."""
    xs = jax.random.normal(jax.random.key(3), (3, 2, 9, 9, 8))
    ws = jax.random.normal(jax.random.key(4), (3, 5, 5, 8, 4)) / 5
    grad = jax.jit(jax.grad(_loss("onednn"), argnums=(0, 1)))
    looped = [grad(x, w) for x, w in zip(xs, ws)]
    chex.assert_trees_all_equal(
        jax.jit(jax.vmap(grad))(xs, ws), jax.tree.map(lambda *g: jnp.stack(g), *looped)
    )

    def hvp(impl):
        g = jax.grad(_loss(impl), argnums=1)
        return jax.jvp(lambda w: g(xs[0], w), (ws[0],), (ws[1],))[1]

    chex.assert_trees_all_close(hvp("onednn"), hvp("im2col"), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_onednn_training_loop_equals_im2col_nn():
    """Twenty SGD steps of the CNN in a lax.scan (where XLA's own convolution falls back to
    Eigen): the same parameters as with im2col_nn, to float32 rounding."""
    x = jax.random.normal(jax.random.key(5), (20, 8, 28, 28, 1))
    y = jax.random.randint(jax.random.key(6), (20, 8), 0, 10)

    def train(impl):
        model = build_model("cnn", (28, 28, 1), 10, conv_impl=impl)
        params = model.init(jax.random.key(0))

        def step(params, batch):
            def loss(p):
                logits = model.apply(p, batch[0])[0]
                return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1))

            value, grads = jax.value_and_grad(loss)(params)
            return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

        return jax.jit(lambda p: jax.lax.scan(step, p, (x, y)))(params)

    (params_a, losses_a), (params_b, losses_b) = train("onednn"), train("im2col_nn")
    assert float(losses_a[-1]) < float(losses_a[0])
    chex.assert_trees_all_close(losses_a, losses_b, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(params_a, params_b, rtol=1e-3, atol=1e-5)


@needs_onednn
def test_auto_is_onednn_on_cpu_and_other_dtypes_fall_back_to_im2col_nn():
    if jax.default_backend() == "cpu":
        assert resolve_impl("auto") == "onednn"
    x = jax.random.normal(jax.random.key(7), (2, 7, 7, 3))
    w = jax.random.normal(jax.random.key(8), (3, 3, 3, 4))
    with jax.enable_x64(True):
        x64, w64 = x.astype(jnp.float64), w.astype(jnp.float64)
        chex.assert_trees_all_equal(conv2d(x64, w64, impl="onednn"), conv2d(x64, w64, impl="im2col_nn"))
    with pytest.raises(ValueError, match="float32"):
        onednn.conv2d(x.astype(jnp.bfloat16), w, (1, 1), ((1, 1), (1, 1)))


@needs_onednn
def test_build_reuses_the_cached_library(monkeypatch):
    library = onednn.build()

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert onednn.build() == library


def test_build_failures_say_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(OSError, match="building onednn.cc failed"):
        onednn.build()
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(OSError, match="no C.. compiler"):
        onednn.build()


def test_auto_without_onednn_is_im2col_nn(monkeypatch):
    monkeypatch.setattr(onednn, "_load", lambda: "no oneDNN here")
    onednn.available_or_log.cache_clear()
    try:
        expected = {"tpu": "native", "cpu": "im2col_nn"}.get(jax.default_backend(), "im2col")
        assert resolve_impl("auto") == expected
        with pytest.raises(RuntimeError, match="no oneDNN here"):
            onednn.conv2d(jnp.ones((1, 4, 4, 1)), jnp.ones((3, 3, 1, 1)), (1, 1), ((1, 1), (1, 1)))
    finally:
        onednn.available_or_log.cache_clear()


# ---------------------------------------------------------------- LSTM


def _lstm64(x, wi, wh, b):
    """The LSTM recurrence written plainly, in float64 (the oracle): gates i, f, g, o side by side."""
    hidden = wh.shape[0]

    def step(carry, xt):
        c, h = carry
        z = xt @ wi + h @ wh + b[None]
        i, f, g, o = (z[:, k * hidden : (k + 1) * hidden] for k in range(4))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h

    zero = jnp.zeros((x.shape[1], hidden), x.dtype)
    return jax.lax.scan(step, (zero, zero), x)[1]


def _lstm_case(seed, steps, batch, width, hidden, scale=1.0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = scale * jax.random.normal(keys[0], (steps, batch, width))
    wi = jax.random.normal(keys[1], (width, 4 * hidden)) / np.sqrt(width)
    wh = jax.random.normal(keys[2], (hidden, 4 * hidden)) / np.sqrt(hidden)
    b = 0.5 * jax.random.normal(keys[3], (4 * hidden,))
    cot = jax.random.normal(keys[4], (steps, batch, hidden))
    return (x, wi, wh, b), cot


@needs_onednn
@pytest.mark.parametrize(
    "steps,batch,width,hidden,scale", [(1, 2, 3, 4, 1.0), (6, 3, 5, 8, 3.0), (20, 4, 16, 32, 1.0)]
)
def test_onednn_lstm_equals_a_float64_loop(steps, batch, width, hidden, scale):
    """Values and all four gradients; with one step the recurrent kernel's gradient is zero (a
    zero initial state), which oneDNN 2.6 got wrong when that state was left out."""
    args, cot = _lstm_case(steps, steps, batch, width, hidden, scale)
    hs = jax.jit(onednn.lstm)(*args)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(onednn.lstm(*a) * cot), argnums=(0, 1, 2, 3)))(*args)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
        cot64 = jnp.asarray(np.asarray(cot, np.float64))
        hs64 = _lstm64(*args64)
        grads64 = jax.grad(lambda *a: jnp.sum(_lstm64(*a) * cot64), argnums=(0, 1, 2, 3))(*args64)
        grads64 = [np.asarray(g) for g in grads64]
    np.testing.assert_allclose(hs, np.asarray(hs64), rtol=1e-5, atol=1e-6)
    for g, g64 in zip(grads, grads64):
        assert g.shape == g64.shape and g.dtype == jnp.float32
        np.testing.assert_allclose(g, g64, rtol=1e-4, atol=1e-5)
    if steps == 1:
        assert not np.any(np.asarray(grads[2]))


@needs_onednn
def test_onednn_lstm_under_vmap_equals_a_loop():
    """Clients vmapped (each its own weights and inputs) == one at a time, bit for bit."""
    cases = [_lstm_case(seed, 7, 3, 5, 8)[0] for seed in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*cases)]
    cot = jax.random.normal(jax.random.key(9), (7, 3, 8))

    def grad(*a):
        return jax.grad(lambda *a: jnp.sum(onednn.lstm(*a) * cot), argnums=(0, 1, 2, 3))(*a)

    chex.assert_trees_all_equal(
        jax.jit(jax.vmap(onednn.lstm))(*stacked), jnp.stack([jax.jit(onednn.lstm)(*c) for c in cases])
    )
    looped = [jax.jit(grad)(*c) for c in cases]
    chex.assert_trees_all_equal(
        jax.jit(jax.vmap(grad))(*stacked), jax.tree.map(lambda *g: jnp.stack(g), *looped)
    )


@needs_onednn
def test_onednn_lstm_refuses_other_dtypes_and_reports_its_workspace():
    (x, wi, wh, b), _ = _lstm_case(0, 4, 2, 3, 4)
    with pytest.raises(ValueError, match="float32"):
        onednn.lstm(x.astype(jnp.bfloat16), wi, wh, b)
    assert onednn._workspace_bytes(80, 10, 256, 256) >= 80 * 10 * 4 * 256 * 4  # at least the gates


@needs_onednn
def test_onednn_lstm_on_one_thread_a_call_equals_the_shared_run():
    """With one OpenMP thread a call (a CPU device per core) the LSTM runs on the caller's thread
    instead of the library's worker: same values and gradients."""
    args, cot = _lstm_case(5, 9, 3, 6, 16)

    def run():
        hs = jax.jit(onednn.lstm)(*args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(onednn.lstm(*a) * cot), argnums=(0, 1, 2, 3)))(*args)
        return hs, grads

    shared = run()
    library = onednn._library()
    library.PfljaxOnednnSetThreads(1)
    try:
        jax.clear_caches()
        single = run()
    finally:
        library.PfljaxOnednnSetThreads(onednn.threads_per_call())
    chex.assert_trees_all_close(single, shared, rtol=1e-5, atol=1e-6)
