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
"""

import os

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("PFLJAX_TEST_JAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
