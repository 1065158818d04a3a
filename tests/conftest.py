"""Test-wide JAX settings.

- Silent broadcasting across the client axis is an error (rank promotion).
- float32 matmuls and convolutions in full precision: on GPU/TPU JAX's default
  uses TF32 / bf16 passes (relative errors ~1e-3), which is fine for training
  but not for comparing a mapped round with a per-client loop at float32
  tolerances. No effect on CPU.
- XLA's optimization passes off (`jax_disable_most_optimizations`): the test
  programs are small and short; the passes cost more compile time than they save
  (the suite ran about 20% faster without them).
- A persistent compilation cache: tests rebuild the same small programs many
  times; identical programs then compile once per machine. `make test` runs the
  suite in parallel (pytest-xdist, one worker per core) sharing that cache (an
  entry read while another worker still writes it fails to load, with a warning,
  and is compiled again).
- XLA:CPU's MLIR fusion emitters off (`--xla_cpu_use_fusion_emitters=false`, added
  to XLA_FLAGS, so the binaries the tests start get it too): XLA's older emitters
  compile these programs about 3x faster (a FedFac round: 1.4 s instead of 4.9 s
  of CPU), and compiling is most of the suite's time (the suite's user CPU seconds
  went from ~2360 to ~1410). Their fused kernels round with their context, so two
  programs computing the same numbers may differ in float32 last bits: a test that
  compares programs bit for bit compiles them with the default emitters
  (`compiler_options=EXACT`, tests/algorithms/fast_compile.py). A flag already in
  XLA_FLAGS is kept.
"""

import importlib.metadata
import os

_FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# XLA aborts on a flag it does not know: set only for the jaxlib versions seen to have it
# (constraints.txt pins 0.10.2); after an upgrade check the flag still exists, then widen this.
_JAXLIB = tuple(int(v) for v in importlib.metadata.version("jaxlib").split(".")[:2])
if _JAXLIB <= (0, 10) and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} {_FAST_EMITTERS}".strip()
    )  # before JAX starts

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
