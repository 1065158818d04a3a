"""The convolution kernel's gradient as XLA computes it, as `im2col_nn` computes it, and in torch.

    python -m experiments.bench.bench_weight_grad [--shapes=6272x400x32,...] [--repeats=7]

A kernel gradient of an im2col convolution is `patches^T @ dy`: patches [M, K]
(M = batch * output pixels, K = kh * kw * Cin), dy [M, Cout], both contracted over
their major axis M. For each M x K x N shape (defaults: the weight gradients of the
bench_vs_torch conv cases, then a square 2048^3 product) one JSON line gives GFLOP/s of

- `xla`: `p.T @ g` jitted, as JAX's own gradient leaves it (XLA:CPU gives this dot to
  Eigen: YNNPACK takes only a row-major left operand);
- `nn`: what `pfljax.models.conv` "im2col_nn" does where `nn_weight_grad(K, N)`:
  g transposed first and the [N, K] product transposed after, kept apart by
  optimization barriers, so the product is a row-major [N, M] @ [M, K] for YNNPACK;
- `torch`: `p.t() @ g` in torch (CPU), when torch is installed (`pip install -e .[bench]`).

Each is the best of --repeats timings of a loop of calls; the three are interleaved.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags

from pfljax.experiment.cli import parse_flags
from pfljax.models.conv import nn_weight_grad

FLAGS = flags.FLAGS
# M x K x N of the weight gradients: refcnn conv_0 / conv_1 (batch 32), bench CNN conv_1,
# FedAvgCNN conv_1 (batch 10), ResNet-9 conv_1 / conv_2 / conv_5 (batch 32), a square product.
SHAPES = (
    "25088x25x16",
    "6272x400x32",
    "2048x400x32",
    "640x800x64",
    "8192x1600x128",
    "8192x1152x128",
    "2048x2304x256",
    "2048x2048x2048",
)


def parse_shape(text: str) -> tuple[int, int, int] | None:
    """(M, K, N) of "MxKxN", None unless three positive integers."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        return None
    return tuple(int(p) for p in parts)


def best_seconds(fn, repeats: int, calls: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def variants(p, g) -> dict:
    """name -> zero-argument callable computing the [K, N] weight gradient."""
    barrier = jax.lax.optimization_barrier
    xla = jax.jit(lambda p, g: p.T @ g)
    nn = jax.jit(lambda p, g: barrier(barrier(g.T) @ p).T)
    out = {"xla": lambda: xla(p, g), "nn": lambda: nn(p, g)}
    try:
        import torch
    except ImportError:
        return out
    tp, tg = torch.from_numpy(np.asarray(p)), torch.from_numpy(np.asarray(g))
    out["torch"] = lambda: tp.t() @ tg
    return out


def measure(m: int, k: int, n: int, repeats: int) -> dict:
    p = jax.random.normal(jax.random.key(0), (m, k))
    g = jax.random.normal(jax.random.key(1), (m, n))
    fns = variants(p, g)
    np.testing.assert_allclose(fns["nn"](), fns["xla"](), rtol=1e-3, atol=1e-2 * np.sqrt(m))
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):  # interleaved: each variant's best over the same stretch of time
        for name, fn in fns.items():
            best[name] = min(best[name], best_seconds(fn, 1))
    gflop = 2.0 * m * k * n / 1e9
    row = {"shape": f"{m}x{k}x{n}", "nn_in_im2col_nn": nn_weight_grad(k, n)}
    row |= {f"{name}_gflops": round(gflop / s, 1) for name, s in best.items()}
    row["nn_over_xla"] = round(best["xla"] / best["nn"], 2)
    return row


def main(argv):
    del argv
    shapes = [parse_shape(s) for s in FLAGS.shapes]
    print(json.dumps({"machine": {"backend": jax.default_backend(), "jax": jax.__version__}}), flush=True)
    for m, k, n in shapes:
        print(json.dumps(measure(m, k, n, FLAGS.repeats)), flush=True)


def define_flags():
    flags.DEFINE_list("shapes", list(SHAPES), "M x K x N of patches [M, K] and dy [M, N]")
    flags.register_validator(
        "shapes",
        lambda shapes: all(parse_shape(s) for s in shapes),
        "--shapes must be a list of MxKxN, three positive integers each",
    )
    flags.DEFINE_integer("repeats", 7, "interleaved timings of each variant (the best)", lower_bound=1)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
