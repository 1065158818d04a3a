"""Helpers for the absl binaries (`pfljax-run`, `pfljax-compare`, `pfljax-partition`).

Exit codes: 0 the run completed; 2 bad input (one line `error: ...` on stderr
naming the flag, its value and what is allowed, before any training); 3 a run
diverged (non-finite loss or parameters; one line naming the round, the
algorithm and the usual knobs; outputs up to the round before are kept); 4 the
device ran out of memory (one line; outputs written so far are kept); 5 a
multi-process run lost a process (one line naming it; the others end too, the
last checkpoint is kept: pfljax.experiment.peers). A process that never joins a
multi-process run is bad input (2); 130 / 143 interrupted by SIGINT / SIGTERM
(one line: the round checkpointed, see `stopped_run`). Anything else (1) is a
bug: please report its traceback.

`--config` takes a config file (`path.py[:argument]`) or the name of a shipped
config (`default`, `federico_fmnist:permuted_2`, ...: `SHIPPED_CONFIGS`), so the
binaries run from any directory once pfljax is installed.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import logging as std_logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import NamedTuple

from absl import flags

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_LOST_PEER = 5
# What a run imports from pyproject's `experiments` extra (import names; PIP_NAMES: their
# distributions where they differ). pfljax-partition needs matplotlib only.
RUN_PACKAGES = ("orbax.checkpoint", "matplotlib", "tensorboardX", "tqdm")
PARTITION_PACKAGES = ("matplotlib",)
PIP_NAMES = {"orbax.checkpoint": "orbax-checkpoint"}
EXIT_FOOTER = (
    "0 completed, 2 bad input, 3 a run diverged, 4 out of device memory, "
    "5 a multi-process run lost a process, 130 / 143 interrupted by SIGINT / SIGTERM."
)
DEFAULT_INIT_TIMEOUT = 300  # seconds, jax.distributed.initialize's default
DEFAULT_PEER_TIMEOUT = 30  # seconds: a process silent this long is lost (pfljax.experiment.peers)
HELP_FLAGS = ("-h", "--help", "-help", "--helpfull", "--helpshort", "-?")
SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../pfljax


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Prints `error: message` on one line to stderr and exits with `code` (2: bad input)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(code)


@contextlib.contextmanager
def out_of_memory_exits(workdir: str):
    """Turns a device out-of-memory error (XLA's RESOURCE_EXHAUSTED, at compile or run
    time) into one line and exit code 4; files already written in `workdir` stay."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  jax.errors.JaxRuntimeError, without importing jax here
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        fail(
            f"out of device memory: {str(e).strip().splitlines()[0][:200]}. What was written in {workdir} "
            "is kept (rerunning resumes from its last checkpoint). A round needs less memory with "
            "--config.client_map=map and a --config.chunk_size, fewer clients per round or a smaller "
            "batch_size; other processes on the device take its memory too",
            EXIT_OUT_OF_MEMORY,
        )


@contextlib.contextmanager
def stopping_on_signals(what_stopped: Callable):
    """SIGINT / SIGTERM during the block: one line `interrupted by SIGINT: <what_stopped(e)>`
    on stderr and exit 130 / 143, no traceback (pfljax.experiment.interrupts says
    when a run stops and what it keeps)."""
    from pfljax.experiment.interrupts import Interrupted, handled_signals  # pylint: disable=import-outside-toplevel

    try:
        with handled_signals():
            yield
    except Interrupted as e:
        print(f"interrupted by {e.name}: {what_stopped(e)}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def run_binary(main: Callable, usage: str) -> None:
    """absl's app.run of a binary's `main` with pfljax's flag parsing and usage text;
    Ctrl-C before `main` installs its handlers is one line and exit 130 too."""
    from absl import app  # pylint: disable=import-outside-toplevel

    set_usage(usage, sys.argv)
    try:
        app.run(main, flags_parser=parse_flags)
    except KeyboardInterrupt:
        print("interrupted by SIGINT: stopped before training", file=sys.stderr, flush=True)
        sys.exit(130)


def stopped_run(e, workdir: str) -> str:
    """What an interrupted run kept and how to go on (the line's text after 'interrupted by X:')."""
    if e.round is None:
        return f"stopped before training; rerun the same command to run it (--workdir={workdir})"
    if e.round == 0:
        return f"stopped before its first checkpoint; rerun the same command to start it again in {workdir}"
    return (
        f"stopped after round {e.round} of {e.rounds}; rerun the same command to resume from the "
        f"checkpoint of round {e.round} in {os.path.join(workdir, 'checkpoints')}"
    )


def shipped_configs() -> list[str]:
    """Names of the configs shipped with pfljax (usable as `--config=<name>`)."""
    return sorted(f[:-3] for f in os.listdir(SHIPPED_CONFIGS) if f.endswith(".py") and not f.startswith("_"))


def resolve_config_path(value: str) -> str:
    """`--config` value -> an existing file path (`:argument` kept): a path as
    given when it exists, else a shipped config by name (`default`,
    `default.py`, `experiments/configs/default.py` from another directory)."""
    path, sep, arg = value.partition(":")
    if os.path.isfile(path):
        return value
    name = os.path.basename(path)
    name = name[:-3] if name.endswith(".py") else name
    if name in shipped_configs() and (os.sep not in path or path.startswith("experiments/configs/")):
        return os.path.join(SHIPPED_CONFIGS, f"{name}.py") + sep + arg
    return value


def _config_arg(argv: list[str]) -> tuple[int, str] | None:
    """(index, value) of the last --config flag in argv (absl uses the last)."""
    found = None
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            found = i, a[len("--config=") :]
        elif a == "--config" and i + 1 < len(argv):
            found = i + 1, argv[i + 1]
    return found


def load_config_file(value: str):
    """get_config(argument) of a config file `path.py[:argument]`; bad input -> fail()."""
    path, _, arg = value.partition(":")
    if not os.path.isfile(path):
        fail(
            f"--config={value}: no such config file {path!r}; give a path, or one of the shipped "
            f"configs: {', '.join(shipped_configs())}{_close(os.path.basename(path), shipped_configs())}"
        )
    try:
        spec = importlib.util.spec_from_file_location("pfljax_config_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            fail(f"--config={value}: {path} has no get_config() function")
        return module.get_config(*([arg] if ":" in value else []))
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001  any error in the config file is the user's input
        where = traceback.extract_tb(e.__traceback__)[-1]
        fail(
            f"--config={value}: {type(e).__name__}: {e} "
            f"(in {os.path.basename(where.filename)}:{where.lineno}, {where.name})"
        )


def _close(name: str, names) -> str:
    close = difflib.get_close_matches(str(name), [str(n) for n in names], n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _algorithm_names() -> list[str]:
    from pfljax import algorithms  # pylint: disable=import-outside-toplevel

    return algorithms.available()


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing (use as `app.run(main, flags_parser=parse_flags)`), where
    an unknown flag or config field, a bad value, a missing or failing config
    file is a one-line error and exit code 2 instead of a traceback."""
    argv = list(argv)
    found = _config_arg(argv)
    config = None
    if found is not None:
        i, value = found
        value = resolve_config_path(value)
        argv[i] = f"--config={value}" if argv[i].startswith("--config=") else value
        config = load_config_file(value)
    argv, model_kwargs = _split_model_arguments(argv, config)
    if model_kwargs:
        sys.argv = list(argv)  # ml_collections reads the config's overrides from sys.argv
    try:
        rest = flags.FLAGS(argv)
        if model_kwargs:
            with flags.FLAGS.config.unlocked():
                flags.FLAGS.config.model_kwargs.update(model_kwargs)
        return rest
    except SystemExit:
        if any(a in HELP_FLAGS for a in argv[1:]):
            sys.exit(0)  # absl exits 1 after printing --help
        raise
    except flags.Error as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except (AttributeError, KeyError) as e:  # ml_collections: override of an unknown field
        if config is None:
            fail(f"unknown config field {e}")
        from pfljax.experiment.config import override_error  # pylint: disable=import-outside-toplevel

        fail(override_error(argv, config))
    except Exception as e:  # noqa: BLE001  config file errors not caught above
        fail(f"{type(e).__name__}: {' '.join(str(e).split())}")
    return []


def _split_model_arguments(argv: list[str], config) -> tuple[list[str], dict]:
    """(argv without them, {arg: value}) of the `--config.model_kwargs.<arg>=value` overrides
    of arguments the run's model takes but the config file does not set (ml_collections
    refuses an override of a key the config lacks); values are Python literals, else
    strings. Other overrides stay in argv."""
    if config is None or "model_kwargs" not in config:
        return argv, {}
    prefix = "--config.model_kwargs."
    wanted = [
        a for a in argv if a.startswith(prefix) and "=" in a and "." not in a[len(prefix) :].split("=")[0]
    ]
    new = {a: a[len(prefix) :].partition("=") for a in wanted}
    new = {a: (k, v) for a, (k, _, v) in new.items() if k not in config.model_kwargs}
    if not new:
        return argv, {}
    from pfljax import algorithms  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.config import model_arguments  # pylint: disable=import-outside-toplevel

    def last(field, default):
        given = [a.partition("=")[2] for a in argv if a.startswith(f"--config.{field}=")]
        return given[-1] if given else default

    try:
        model = algorithms.model_variant(last("algorithm", config.algorithm), last("model", config.model))
        takes = model_arguments(model)
    except Exception:  # noqa: BLE001  an unknown model or algorithm: its own check says so
        return argv, {}
    taken = {a: kv for a, kv in new.items() if kv[0] in takes}
    return [a for a in argv if a not in taken], {k: _literal(v) for k, v in taken.values()}


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def config_help() -> str:
    """The config fields with their defaults (for --help)."""
    from pfljax.experiment.config import FIELD_HELP, base_config  # pylint: disable=import-outside-toplevel

    config = base_config()
    lines = ["Config fields (--config.<field>=value; defaults of the default config):"]
    for key in sorted(config.keys()):
        value = config[key]
        if key in _algorithm_names() or key in ("source", "model_kwargs", "dp"):
            continue
        lines.append(f"  {key}={value!r}" + (f"  -- {FIELD_HELP[key]}" if key in FIELD_HELP else ""))
    lines.append("  model_kwargs.<arg>=value  -- arguments of the model (default mlp: hidden=(200,))")
    lines.append(
        "  source.<option>=value  -- source options, unset by default: "
        + ", ".join(sorted(config.source.keys()))
    )
    lines.append(
        "  dp.<option>=value  -- client-level DP: "
        + ", ".join(f"{k}={v!r}" for k, v in sorted(config.dp.items()))
        + " (the others only with enabled=True)"
    )
    lines.append("Algorithm options (--config.<algorithm>.<option>=value):")
    for name in _algorithm_names():
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(config[name].items()))
        lines.append(f"  {name}: {options or '(none)'}")
    lines.append(f"Shipped configs (--config=<name>[:argument]): {', '.join(shipped_configs())}")
    return "\n".join(lines)


def set_usage(doc: str, argv: list[str]) -> None:
    """Makes absl's --help show `doc`, plus the config fields when help is asked
    for (computing them imports every algorithm, so only then)."""
    if any(a in HELP_FLAGS for a in argv[1:]):
        doc = doc + "\n\n" + config_help() + "\n\nExit codes: " + EXIT_FOOTER
    sys.modules["__main__"].__doc__ = doc


class _OwnLines(std_logging.Filter):
    """INFO lines from pfljax only (orbax and JAX log every checkpoint and compile at INFO)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or record.pathname.startswith(_PACKAGE)


def setup_logging() -> None:
    """absl logging to stderr: pfljax's progress and provenance lines at INFO, other
    libraries' warnings and errors only."""
    from absl import logging  # pylint: disable=import-outside-toplevel

    logging.set_verbosity(logging.INFO)
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _OwnLines) for f in handler.filters):
        handler.addFilter(_OwnLines())


class Distributed(NamedTuple):
    """How a binary joins a multi-process run: `jax.distributed.initialize`'s arguments
    (None: auto-detected, or from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)."""

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout: int = DEFAULT_INIT_TIMEOUT
    cpu_devices: int = 1
    peer_timeout: int = DEFAULT_PEER_TIMEOUT


def define_distributed_flags() -> Callable[[], Distributed]:
    """The binaries' device flags (multi-process, forced CPU devices); returns a function giving
    their values after parsing. Any of --coordinator_address, --num_processes, --process_id
    implies --distributed."""
    enabled = flags.DEFINE_bool(
        "distributed",
        False,
        "multi-process run: jax.distributed.initialize() first (on Cloud TPU, SLURM, Open MPI, "
        "Kubernetes it finds the processes itself; see BUILD.md)",
    )
    address = flags.DEFINE_string(
        "coordinator_address",
        None,
        "host:port of process 0, the same on every process (implies --distributed)",
    )
    count = flags.DEFINE_integer("num_processes", None, "number of processes (implies --distributed)")
    index = flags.DEFINE_integer(
        "process_id", None, "this process: 0 .. num_processes-1 (implies --distributed)"
    )
    timeout = flags.DEFINE_integer(
        "initialization_timeout",
        DEFAULT_INIT_TIMEOUT,
        "seconds a process waits for the coordinator and the others to join",
    )
    peer_timeout = flags.DEFINE_integer(
        "peer_timeout",
        DEFAULT_PEER_TIMEOUT,
        "seconds without a heartbeat after which a process counts as lost (multi-process runs)",
    )
    cpu_devices = flags.DEFINE_integer(
        "cpu_devices",
        1,
        "CPU backend: expose this many host devices and shard the clients over them, N clients "
        "side by side (one per core; faster for convnets with batches of 32 and for the char LSTM, "
        "slower for small models: BUILD.md 'Several devices')",
    )

    def values() -> Distributed:
        given = (address.value, count.value, index.value)
        enabled_now = enabled.value or any(v is not None for v in given)
        return Distributed(enabled_now, *given, timeout.value, cpu_devices.value, peer_timeout.value)

    return values


def check_distributed(opts: Distributed) -> None:
    """One line and exit 2 for multi-process flags no process could run with."""
    if opts.num_processes is not None and opts.num_processes < 1:
        fail(f"--num_processes={opts.num_processes}: give a number of processes >= 1")
    if opts.process_id is not None and not 0 <= opts.process_id < (opts.num_processes or float("inf")):
        n = opts.num_processes
        upper = f"{n - 1} (--num_processes={n})" if n else "N-1"
        fail(f"--process_id={opts.process_id}: give this process's id in 0 .. {upper}")
    address = opts.coordinator_address
    host, _, port = (address or "").rpartition(":")
    if address is not None and not (host and port.isdigit()):
        fail(f"--coordinator_address={address}: give process 0's host:port, e.g. 10.0.0.1:1234")
    if opts.initialization_timeout < 1:
        fail(f"--initialization_timeout={opts.initialization_timeout}: give seconds >= 1")
    if opts.peer_timeout < 5:
        fail(f"--peer_timeout={opts.peer_timeout}: give seconds >= 5 (processes beat every second)")


def initialize_distributed(opts: Distributed) -> None:
    """jax.distributed.initialize() with the flags' arguments (the rest auto-detected),
    CPU collectives over gloo (so CPU processes form one mesh too); a process that
    cannot reach the coordinator, processes that do not all join, or bad arguments, is one
    line and exit 2; a process lost later is one line and exit 5 (pfljax.experiment.peers)."""
    import jax  # pylint: disable=import-outside-toplevel

    from pfljax.experiment import peers  # pylint: disable=import-outside-toplevel

    check_distributed(opts)
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {
        "coordinator_address": opts.coordinator_address,
        "num_processes": _given(opts.num_processes, "JAX_NUM_PROCESSES"),
        "process_id": _given(opts.process_id, "JAX_PROCESS_ID"),
    }
    address = kwargs["coordinator_address"] or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address and kwargs["process_id"] != 0 and not reachable(address, opts.initialization_timeout):
        # Checked here: jax's client aborts the process (a C++ fatal error) when it cannot connect.
        fail(
            f"--coordinator_address={address}: process {kwargs['process_id']} of {kwargs['num_processes']} "
            f"found no coordinator there within --initialization_timeout={opts.initialization_timeout} s; "
            "start process 0 (--process_id=0) on that host and port, the same --num_processes everywhere"
        )
    try:
        peers.initialize(kwargs, opts.initialization_timeout, opts.peer_timeout)
    except (ValueError, TypeError, RuntimeError) as e:  # jax's argument checks, auto-detection
        fail(
            f"--distributed: jax.distributed.initialize: {e}; outside Cloud TPU, SLURM, Open MPI and "
            "Kubernetes give --coordinator_address, --num_processes and --process_id"
        )


def reachable(address: str, timeout: float) -> bool:
    """Whether a TCP connection to `address` (host:port) opens within `timeout` seconds (retried)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _given(value: int | None, variable: str) -> int | None:
    """A flag's value, else the environment variable's (an integer), else None (auto-detected)."""
    if value is not None or variable not in os.environ:
        return value
    try:
        return int(os.environ[variable])
    except ValueError:
        fail(f"{variable}={os.environ[variable]!r}: give an integer")
    return None


def is_primary() -> bool:
    """Whether this is process 0 (the one that prints and writes the outputs)."""
    import jax  # pylint: disable=import-outside-toplevel

    return jax.process_index() == 0


def missing_package(name: str) -> bool:
    """Whether module `name` cannot be imported (not installed, or blocked by a None
    in sys.modules), found without importing it."""
    parts = name.split(".")
    if any(sys.modules.get(".".join(parts[: i + 1]), False) is None for i in range(len(parts))):
        return True
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def require_packages(modules: tuple[str, ...]) -> None:
    """One line and exit 2, before anything is written, when a package of the
    `experiments` extra that this binary imports is missing (a bare `pip install pfljax`)."""
    missing = [m for m in modules if missing_package(m)]
    if missing:
        names = ", ".join(PIP_NAMES.get(m, m) for m in missing)
        fail(
            f"missing package {names} (the binaries need the experiments extra): "
            f"pip install 'pfljax[experiments]' (in a clone: pip install -e '.[experiments]')"
        )


def start(argv: list[str], distributed: Distributed | None, needs: tuple[str, ...] = RUN_PACKAGES) -> None:
    """Common prologue of the binaries' `main`: no stray positional arguments, the
    extra's packages `needs` importable, logging (our lines at INFO, orbax quiet), forced
    CPU devices and multi-process initialization when asked (`define_distributed_flags`)."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])} (flags are --name=value)")
    require_packages(needs)
    setup_logging()
    if distributed is not None and distributed.cpu_devices != 1:
        if distributed.cpu_devices < 1:
            fail(f"--cpu_devices must be an integer >= 1, got {distributed.cpu_devices}")
        from pfljax.runtime.sharding import use_cpu_devices  # pylint: disable=import-outside-toplevel

        use_cpu_devices(distributed.cpu_devices)
    if distributed is not None and distributed.enabled:
        initialize_distributed(distributed)


def define_config_flag():
    """The binaries' `--config` flag (a config file or a shipped config's name, overridable
    field by field)."""
    from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

    return config_flags.DEFINE_config_file(
        "config",
        None,
        "config file path.py[:argument], or a shipped config's name (see --help); "
        "override fields with --config.<field>=value",
        lock_config=True,
    )
