"""pfljax-compare: several algorithms on the same partition and seeds, then tables and plots.

    pfljax-compare --config=default --algorithms=fedavg,local --seeds=0,1,2 --workdir=runs/cmp
    pfljax-compare ... --seeds=0,1,2 --config.data_seed=0 --vectorize --grid=learning_rate=0.01,0.05
    python -m pfljax.experiment.compare_main ...   (the same; in the repository also
    python -m experiments.compare --config=experiments/configs/default.py ...)

Each run goes to <workdir>/<algorithm>/seed_<s>/ (resumable, as pfljax-run);
--vectorize runs each algorithm's seeds and --grid points as one compiled
program (pfljax.experiment.sweep), writing the same run directories;
results.md (mean +- std over seeds), results.json and results.csv (every
seed's value and status), accuracy.png and loss.png go to <workdir>. A log line
when each run starts and ends. This is what `make demo` runs.
Exit codes: 0 every run completed; 2 bad input (one line, nothing trained;
also a workdir another process holds); 3 some run diverged (the table marks
it; the other runs completed); 4 out of device memory (one line; the runs
written so far are kept); 5 a multi-process run lost a process (one line
naming it; completed runs and the last checkpoint stay, rerunning every process
goes on); 130 / 143 interrupted by SIGINT / SIGTERM (one line
naming the run that stopped, at a checkpoint, and the runs completed;
rerunning goes on from there).
"""

from __future__ import annotations

from absl import flags

from pfljax.experiment.cli import (
    EXIT_DIVERGED,
    define_config_flag,
    define_distributed_flags,
    fail,
    is_primary,
    out_of_memory_exits,
    run_binary,
    start,
    stopping_on_signals,
)

USAGE = __doc__
_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["fedavg", "local"], "algorithms to compare (comma-separated)")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds (comma-separated integers >= 0)")
_VECTORIZE = flags.DEFINE_bool(
    "vectorize",
    False,
    "run each algorithm's seeds (and --grid points) as one compiled program (replicas sharing the data; "
    "needs --config.data_seed >= 0 for several seeds); same run directories as separate runs",
)
_GRID = flags.DEFINE_string(
    "grid",
    None,
    "<option>=v1,v2,...: run every algorithm once per value of learning_rate or a float option of the "
    "algorithm; rows and run directories <algorithm>.<option>=<value>",
)
_REPLICA_MAP = flags.DEFINE_enum(
    "replica_map",
    "auto",
    ["auto", "vmap", "map"],
    "with --vectorize: vmap the replicas, or lax.map them (one after another in one program); "
    "auto: map on CPU",
)
_DISTRIBUTED = define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


def parse_seeds(values: list[str]) -> list[int]:
    given = ",".join(values)
    try:
        seeds = [int(s) for s in values]
    except ValueError:
        fail(f"--seeds={given}: seeds must be comma-separated integers >= 0, e.g. --seeds=0,1,2")
    if not seeds:
        fail("--seeds is empty: give comma-separated integers >= 0, e.g. --seeds=0,1,2")
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        fail(f"--seeds={given}: seeds must be distinct integers >= 0")
    return seeds


def parse_algorithms(values: list[str]) -> list[str]:
    from pfljax import algorithms  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.config import close_names  # pylint: disable=import-outside-toplevel

    given = ",".join(values)
    if not values:
        fail(f"--algorithms is empty: give comma-separated names from {algorithms.available()}")
    for name in values:
        if name not in algorithms.available():
            fail(
                f"--algorithms={given}: {name!r} is not an algorithm"
                f"{close_names(name, algorithms.available())}; "
                f"allowed: {', '.join(algorithms.available())}"
            )
    if len(set(values)) != len(values):
        fail(f"--algorithms={given}: an algorithm is named twice")
    return list(values)


def stopped_compare(e, workdir: str) -> str:
    """What an interrupted comparison kept: the run in flight and the runs completed."""
    if e.during is None:
        return f"stopped before training; rerun the same command to run it (--workdir={workdir})"
    done = ", ".join(e.completed) or "none"
    at = f"after round {e.round} of {e.rounds}" if e.round else "before its first checkpoint"
    return (
        f"stopped {e.during} {at}; runs completed: {done}; rerun the same command to go on "
        f"(completed runs are kept, the stopped one resumes from its checkpoint in {workdir})"
    )


def main(argv):
    distributed = _DISTRIBUTED()
    if distributed.enabled and _VECTORIZE.value:
        fail("--vectorize runs on one process's devices: drop it (or --distributed) for a multi-process run")
    with stopping_on_signals(lambda e: stopped_compare(e, _WORKDIR.value)):
        start(argv, distributed)
        from pfljax.experiment import ConfigError, compare  # pylint: disable=import-outside-toplevel
        from pfljax.experiment.compare import parse_grid  # pylint: disable=import-outside-toplevel

        seeds = parse_seeds(_SEEDS.value)
        names = parse_algorithms(_ALGORITHMS.value)
        try:
            grid = parse_grid(_GRID.value) if _GRID.value is not None else None
            with out_of_memory_exits(_WORKDIR.value):
                out = compare(
                    _CONFIG.value,
                    names,
                    seeds,
                    _WORKDIR.value,
                    vectorize=_VECTORIZE.value,
                    grid=grid,
                    replica_strategy=_REPLICA_MAP.value,
                )
        except (ConfigError, ValueError) as e:
            from pfljax.experiment.peers import gloo_lost  # pylint: disable=import-outside-toplevel

            if gloo_lost(e):  # a collective lost its peer: pfljax.experiment.peers' line and exit 5
                raise
            fail(str(e))
        if is_primary():
            print(out["table"])
        if out["diverged"]:
            runs = ", ".join(f"{a} seed {s} at round {r}" for a, s, r in out["diverged"])
            fail(
                f"{len(out['diverged'])} of {len(out['results']) * len(seeds)} runs diverged ({runs}); "
                f"see their summary.json 'divergence' and results.md",
                EXIT_DIVERGED,
            )


def run() -> None:
    """Entry point of the `pfljax-compare` console script."""
    run_binary(main, USAGE)


if __name__ == "__main__":
    run()
