"""pfljax-run: one experiment.

    pfljax-run --config=default --workdir=runs/x [--config.<field>=value ...]
    python -m pfljax.experiment.main ...        (the same; in the repository also
    python -m experiments.main --config=experiments/configs/default.py ...)

--config is a config file `path.py[:argument]` or a shipped config by name
(`default`, `federico_fmnist:permuted_2`, ...). Writes config.json, data.json,
partition.png, metrics.jsonl / metrics.csv, summary.json, plots, TensorBoard
events and checkpoints into --workdir; rerunning the same command resumes from
the latest checkpoint. Off a terminal, progress goes to stderr as log lines.
Exit codes: 0 completed; 2 bad input (one line on stderr, nothing trained);
3 the run diverged (one line naming the round, the algorithm and the usual
knobs; summary.json has "status": "diverged"); 4 out of device memory (one line;
what was written is kept, rerunning resumes); 5 a multi-process run lost a
process (one line naming it; the last checkpoint stays, rerunning every process
resumes; a process that never joined is exit 2); 130 / 143 interrupted by SIGINT
(Ctrl-C) / SIGTERM: the run stops after the block of rounds in flight,
checkpoints that round and says so in one line (a second signal stops at once;
the last checkpoint stays); rerunning resumes. A second process on the same
workdir is refused (exit 2, naming the holder).
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
    stopped_run,
    stopping_on_signals,
)

USAGE = __doc__
_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (resumed if it holds checkpoints)")
_DISTRIBUTED = define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    with stopping_on_signals(lambda e: stopped_run(e, _WORKDIR.value)):
        start(argv, _DISTRIBUTED())
        from pfljax.experiment import ConfigError, train_and_evaluate  # pylint: disable=import-outside-toplevel

        try:
            with out_of_memory_exits(_WORKDIR.value):
                summary = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
        except ConfigError as e:
            fail(str(e))
    if summary["status"] == "diverged":
        fail(summary["divergence"], EXIT_DIVERGED)
    if not is_primary():  # in a multi-process run, process 0 reports (and wrote the outputs)
        return
    print(
        f"{summary['algorithm']}: final mean accuracy {summary['final_mean_accuracy']:.4f}, "
        f"best {summary['best_mean_accuracy']:.4f}; outputs in {_WORKDIR.value}"
    )


def run() -> None:
    """Entry point of the `pfljax-run` console script."""
    run_binary(main, USAGE)


if __name__ == "__main__":
    run()
