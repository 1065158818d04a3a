"""Runs one experiment: the repository's name for `pfljax-run` (pfljax/experiment/main.py).

    python -m experiments.main --config=experiments/configs/default.py --workdir=runs/x \
        [--config.<field>=value ...]

See `python -m experiments.main --help` for the flags and config fields.
"""

from pfljax.experiment.main import run

if __name__ == "__main__":
    run()
