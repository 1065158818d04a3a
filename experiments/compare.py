"""Several algorithms on the same partition and seeds, then a Markdown table and a plot:

    python -m experiments.compare --config=experiments/configs/default.py \
        --algorithms=fedavg,local --seeds=0,1,2 --workdir=runs/cmp

Each run goes to <workdir>/<algorithm>/seed_<s>/ (resumable, as experiments.main);
results.md (mean +- std over seeds), results.json and accuracy.png go to <workdir>.
This is what `make demo` runs with the default config.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from pfljax.experiment import ConfigError, compare
from pfljax.experiment.cli import fail, parse_flags, start

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["fedavg", "local"], "algorithms to compare")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds (integers)")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "multi-host: jax.distributed.initialize() first (see BUILD.md)"
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    start(argv, _DISTRIBUTED.value)
    try:
        seeds = [int(s) for s in _SEEDS.value]
    except ValueError:
        fail(f"--seeds must be integers, got {','.join(_SEEDS.value)}")
    try:
        out = compare(_CONFIG.value, _ALGORITHMS.value, seeds, _WORKDIR.value)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    print(out["table"])


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
