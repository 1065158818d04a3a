"""Runs one experiment: `python -m experiments.main --config=experiments/configs/default.py
--workdir=runs/x [--config.<field>=value ...]`.

Writes config.json, metrics.jsonl, summary.json, plots, TensorBoard events and
checkpoints into --workdir; rerunning the same command resumes from the latest
checkpoint. Bad input: a one-line error and exit code 2.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from pfljax.experiment import ConfigError, train_and_evaluate
from pfljax.experiment.cli import fail, parse_flags, start

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (resumed if it holds checkpoints)")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "multi-host: jax.distributed.initialize() first (see BUILD.md)"
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    start(argv, _DISTRIBUTED.value)
    try:
        summary = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        fail(str(e))
    print(
        f"{summary['algorithm']}: final mean accuracy {summary['final_mean_accuracy']:.4f}, "
        f"best {summary['best_mean_accuracy']:.4f}; outputs in {_WORKDIR.value}"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
