"""Options that keep a heavy method small in the checks every algorithm goes through
(conformance, privacy, host storage). Those checks compare mapped rounds with a plain
per-client loop to rtol 1e-5; FedGen's default of 1000 Adam steps on its generator a
round amplifies float32 summation-order differences past any tolerance (2e-8 in the
clients' heads grows to 3e-4 after 10 steps), so there it trains 3 steps on a small
generator. Each method's own test file checks it at its defaults."""

SMALL = {"fedgen": {"generator_steps": 3, "noise_dim": 8, "hidden_dim": 16}}


def small_options(name: str) -> dict:
    """Keyword options of `name`'s build for the generic checks ({} for most)."""
    return dict(SMALL.get(name, {}))
