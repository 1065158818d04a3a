"""LEAF's Shakespeare character LSTM (Caldas et al. 2018; McMahan et al. 2017).

Token ids [B, T] -> embedding (`embed`, 8) -> stacked LSTM layers (`hidden`, two of
256) -> logits over the vocabulary: at the last position only ([B, V], LEAF's
one next character per sequence, `last_only=True`) or at every position ([B, T,
V], TFF's sequence-to-sequence targets, with the "token_cross_entropy" loss).
The vocabulary is `num_outputs` (LEAF: 80 characters; TFF: 90 ids, padding
included). Inputs may arrive as floats (Model.init's zeros): they are cast to
int32 ids.

The layers hold flax's `OptimizedLSTMCell` parameters (`lstm_{k}/i{g}/kernel`,
`lstm_{k}/h{g}/kernel`, `lstm_{k}/h{g}/bias` for the gates g in i, f, g, o) and are
initialised by that cell. `impl` picks how they run:

- "auto" (default): "onednn" on CPU where oneDNN can be built and a CPU device has two or more
  cores, else "scan" (`resolve_impl`).
- "onednn": oneDNN's LSTM primitive (forward and backward, what PyTorch's CPU LSTM runs) as
  XLA custom calls (`pfljax.models.onednn.lstm`), time-major; float32 (other dtypes run
  "scan"). On a 2-core CPU a Shakespeare round trains 1.2-1.5x faster than "scan"
  (`python -m experiments.bench.bench_vs_torch --cases=lstm --lstm_impl=scan,onednn`). Its
  training keeps oneDNN's workspace, about 4x the gates and cells that "scan" keeps (16 MB a
  layer for 10 windows of 80 characters, 256 units). Reverse mode only, as "scan".
- "scan": `lstm_layer`, time-major. The input projections of all time
  steps are one [T*B, in] x [in, 4H] matmul before the time loop; a step is one
  [B, H] x [H, 4H] matmul (the four gates' kernels side by side) and one elementwise
  pass over its [B, 4H] gates (XLA:CPU runs each small operation of a step as a task
  of its own, so their number sets the loop's overhead). Training keeps the gates and
  cells of every step; `lstm_scan`'s custom VJP computes, before the backward
  loop, everything it needs from them over all steps at once, runs the loop with one
  [B, 4H] x [4H, H] matmul and one elementwise pass a step, and leaves the weight
  gradients to two-dimensional matmuls over all T*B rows after it (JAX's own transpose
  of the loop would add a step's outer product to the recurrent kernel's gradient
  inside the loop, 80 times). On XLA:CPU this trains about twice as fast as "flax",
  and its inference is as fast (`python -m experiments.bench.bench_lstm`). Reverse
  mode only: a JVP through it (forward-over-reverse, e.g. Per-FedAvg's Hessian-vector
  products) is refused by JAX; use "flax" there.
- "flax": flax's `nn.RNN(nn.OptimizedLSTMCell)`, every derivative.

All compute the same function of the same parameters (equal to float32 rounding;
tests/models/test_lstm.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from pfljax.models import onednn

GATES = ("i", "f", "g", "o")
IMPLS = ("auto", "scan", "flax", "onednn")


def resolve_impl(impl: str) -> str:
    """'auto' -> 'onednn' on CPU where oneDNN can be built (`pfljax.models.onednn`) and each call
    has two or more cores (`onednn.threads_per_call`), else 'scan': on one core oneDNN's LSTM
    is slower than "scan" (one CPU device per core, `--cpu_devices=2` on 2 cores)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    on_cpu = jax.default_backend() == "cpu" and onednn.threads_per_call() >= 2
    return "onednn" if on_cpu and onednn.available_or_log() else "scan"


def _activate(z: jax.Array, hidden: int) -> jax.Array:
    """The gates [..., 4H] (i, f, g, o side by side) from their pre-activations in one
    elementwise pass: sigmoid on i, f, o, tanh on g."""
    is_g = lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) // hidden == 2
    return jnp.where(is_g, jnp.tanh(z), jax.nn.sigmoid(z))


def _split(gates: jax.Array, hidden: int) -> tuple[jax.Array, ...]:
    """(i, f, g, o) [..., H] from the gates side by side [..., 4H]."""
    return tuple(gates[..., k * hidden : (k + 1) * hidden] for k in range(4))


def _forward(xp: jax.Array, wh: jax.Array, keep: bool):
    """The time loop: hs [T, B, H]; with `keep` the gates [T, B, 4H] and the cells cs instead."""
    hidden = wh.shape[0]

    def step(carry, zx):
        c, h = carry
        gates = _activate(zx + h @ wh, hidden)
        i, f, g, o = _split(gates, hidden)
        c = f * c + i * g
        h = o * jnp.tanh(c)
        return (c, h), (gates, c) if keep else h

    zero = jnp.zeros(xp.shape[1:-1] + (hidden,), xp.dtype)
    return lax.scan(step, (zero, zero), xp)[1]


def _project(x: jax.Array, wi: jax.Array, bias: jax.Array) -> jax.Array:
    """x [T, B, in] @ wi + bias as one two-dimensional matmul -> [T, B, 4H]."""
    steps, batch, width = x.shape
    return (x.reshape(steps * batch, width) @ wi + bias[None]).reshape(steps, batch, -1)


@jax.custom_vjp
def lstm_scan(x: jax.Array, wi: jax.Array, wh: jax.Array, bias: jax.Array) -> jax.Array:
    """Hidden states hs [T, B, H] of one LSTM layer from zero state on time-major inputs
    x [T, B, in]: input kernel wi [in, 4H], recurrent kernel wh [H, 4H] and bias [4H], the
    four gates (i, f, g, o) side by side."""
    return _forward(_project(x, wi, bias), wh, keep=False)


def _scan_fwd(x, wi, wh, bias):
    gates, cs = _forward(_project(x, wi, bias), wh, keep=True)
    hs = _split(gates, wh.shape[0])[3] * jnp.tanh(cs)  # after the loop: one pass over [T, B, H]
    return hs, (x, hs, cs, gates, wi, wh)


def _scan_bwd(residuals, dhs):
    x, hs, cs, gates, wi, wh = residuals
    hidden = wh.shape[0]
    i, f, g, o = _split(gates, hidden)
    cprev = jnp.concatenate([jnp.zeros_like(cs[:1]), cs[:-1]])
    tc = jnp.tanh(cs)
    # Everything the loop needs from the forward pass, as passes over all time steps before
    # it: dc_t = dc_{t+1} f_{t+1} + dh_t dh_to_dc_t, and dz_t = [dc_t, dc_t, dc_t, dh_t] * local_t.
    dh_to_dc = o * (1 - tc * tc)
    local = jnp.concatenate([g * i * (1 - i), cprev * f * (1 - f), i * (1 - g * g), tc * o * (1 - o)], -1)
    wh_t = wh.T

    def step(carry, inputs):
        dh_next, dc_next = carry
        dh_out, dh_to_dc_t, local_t, f_t = inputs
        dh = dh_out + dh_next
        dc = dc_next + dh * dh_to_dc_t
        # [dc, dc, dc, dh] by a select over the gate index (a concatenate here is not fused).
        lead = dc.shape[:-1]
        gate = lax.broadcasted_iota(jnp.int32, lead + (4, hidden), len(lead))
        upstream = jnp.where(gate < 3, dc[..., None, :], dh[..., None, :])
        dz = (upstream * local_t.reshape(lead + (4, hidden))).reshape(lead + (4 * hidden,))
        return (dz @ wh_t, dc * f_t), dz

    zero = jnp.zeros_like(hs[0])
    _, dz = lax.scan(step, (zero, zero), (dhs, dh_to_dc, local, f), reverse=True)
    # The weight gradients as two-dimensional matmuls over all T * B rows at once (XLA:CPU
    # runs the three-dimensional contractions 2-3x slower).
    rows = dz.reshape(-1, dz.shape[-1])
    dx = (rows @ wi.T).reshape(x.shape)
    dwi = x.reshape(-1, x.shape[-1]).T @ rows
    # h_{t-1}^T dz_t summed over t >= 1 (h_{-1} = 0); slices of whole time steps, no copies.
    dwh = hs[:-1].reshape(-1, hs.shape[-1]).T @ dz[1:].reshape(-1, dz.shape[-1])
    return dx, dwi, dwh, jnp.sum(rows, 0)


lstm_scan.defvjp(_scan_fwd, _scan_bwd)


def lstm_layer(cell: dict, x: jax.Array, impl: str = "scan") -> jax.Array:
    """One layer on time-major inputs x [T, B, in] -> hidden states [T, B, H], from an
    `OptimizedLSTMCell`'s parameters `cell` (`i{g}` kernels, `h{g}` kernels and biases), by
    `lstm_scan` ("scan") or oneDNN ("onednn", float32; other dtypes run "scan")."""
    wi, wh, bias = (
        jnp.concatenate([cell[f"{kind}{g}"][name] for g in GATES], -1)
        for kind, name in (("i", "kernel"), ("h", "kernel"), ("h", "bias"))
    )
    if impl == "onednn" and all(a.dtype == jnp.float32 for a in (x, wi, wh, bias)):
        return onednn.lstm(x, wi, wh, bias)
    return lstm_scan(x, wi, wh, bias)


class CharLSTM(nn.Module):
    """Embedding, LSTM layers `lstm_i` (flax's OptimizedLSTMCell parameters), Dense `head`."""

    embed: int = 8
    hidden: Sequence[int] = (256, 256)
    num_outputs: int = 80
    last_only: bool = True
    impl: str = "auto"  # "auto", "onednn", "scan" (lstm_layer) or "flax" (nn.RNN): the module docstring

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        del train  # no dropout or batch statistics
        impl = resolve_impl(self.impl)
        ids = x.astype(jnp.int32)
        embed = nn.Embed(self.num_outputs, self.embed, name="embedding")
        head = nn.Dense(self.num_outputs, name="head")
        if impl == "flax" or self.is_initializing():
            # flax's cells create (and initialise) the parameters that "scan" reads.
            h = embed(ids)
            for i, width in enumerate(self.hidden):
                h = nn.RNN(nn.OptimizedLSTMCell(width, name=f"lstm_{i}"))(h)
            return head(h[:, -1] if self.last_only else h)
        h = embed(ids.T)  # [T, B, E]
        params = self.variables["params"]
        for i in range(len(self.hidden)):
            h = lstm_layer(params[f"lstm_{i}"], h, impl)
        if self.last_only:
            return head(h[-1])
        steps, batch, width = h.shape
        logits = head(h.reshape(steps * batch, width)).reshape(steps, batch, -1)
        return jnp.swapaxes(logits, 0, 1)
