"""Helpers for the absl binaries: one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import os
import sys

from absl import flags

from pfljax import algorithms

EXIT_BAD_INPUT = 2


def fail(message: str) -> None:
    """Prints `error: message` on one line to stderr and exits with code 2."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing (use as `app.run(main, flags_parser=parse_flags)`), where
    an unknown flag or config field, a bad value or a missing config file is a
    one-line error and exit code 2 instead of a traceback."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except (AttributeError, KeyError) as e:  # ml_collections: override of an unknown field
        overrides = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
        for flag in overrides:
            parts = flag[len("--config.") :].split(".")
            new = algorithms.renamed_option(parts[0], parts[1]) if len(parts) == 2 else None
            if new:
                fail(f"{flag} was renamed: use --config.{parts[0]}.{new}")
        fail(f"unknown config field {e} (overrides given: {', '.join(overrides)})")
    except Exception as e:  # noqa: BLE001  config file errors (missing file, exception in get_config)
        fail(f"{type(e).__name__}: {e}")
    return []


def initialize_distributed() -> None:
    """jax.distributed.initialize() for multi-host runs: auto-detected on Cloud TPU,
    SLURM, Open MPI and Kubernetes; elsewhere from the environment variables
    JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID."""
    import jax  # pylint: disable=import-outside-toplevel

    kwargs = {}
    if "JAX_NUM_PROCESSES" in os.environ:
        kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if "JAX_PROCESS_ID" in os.environ:
        kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(**kwargs)


def start(argv: list[str], distributed: bool) -> None:
    """Common prologue of the binaries' `main`: quiet orbax logging, multi-host
    initialization when asked, and no stray positional arguments."""
    from absl import logging  # pylint: disable=import-outside-toplevel

    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    if distributed:
        initialize_distributed()
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")
