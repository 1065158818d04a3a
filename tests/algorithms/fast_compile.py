"""An autouse fixture for test modules that import it: compile without XLA's optimization passes.

The test programs run for microseconds; the optimization passes cost about a third
of their compile time and save nothing. The flag is restored after each test.
Use: `from tests.algorithms.fast_compile import fast_compile  # noqa: F401`.

`EXACT`: `jax.jit(f, compiler_options=EXACT)` for programs whose results a test compares
bit for bit with another program's. tests/conftest.py turns XLA:CPU's fusion emitters
off (3x faster compiles); the older emitters' fused kernels round differently with
their context (float32 last bits), so equal computations in two different programs
agree only to tolerance. EXACT compiles with the default emitters.
"""

import os

import jax
import pytest

# Only where conftest turned the emitters off (XLA:CPU, a jaxlib that has the flag).
EXACT = (
    {"xla_cpu_use_fusion_emitters": True}
    if "xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", "")
    else {}
)


@pytest.fixture(autouse=True)
def fast_compile():
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)
