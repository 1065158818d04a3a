"""An autouse fixture for test modules that import it: compile without XLA's optimization passes.

The test programs run for microseconds; the optimization passes cost about a third
of their compile time and save nothing. The flag is restored after each test.
Use: `from tests.algorithms.fast_compile import fast_compile  # noqa: F401`.
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def fast_compile():
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)
