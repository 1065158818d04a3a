"""Experiment runs: config -> data/model/algorithm, the run loop, outputs, plots.

    from pfljax.experiment import base_config, train_and_evaluate
    config = base_config(); config.rounds = 5
    summary = train_and_evaluate(config, "runs/try")

Imports orbax, matplotlib and tensorboardX lazily, when a run needs them.
"""

from pfljax.experiment.compare import compare
from pfljax.experiment.config import ConfigError, algorithm_options, base_config, prepare, resolve, validate
from pfljax.experiment.train import load_summary, train_and_evaluate

__all__ = [
    "ConfigError",
    "algorithm_options",
    "base_config",
    "compare",
    "load_summary",
    "prepare",
    "resolve",
    "train_and_evaluate",
    "validate",
]
