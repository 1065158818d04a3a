"""Several algorithms on the same partition and seeds: the repository's name for
`pfljax-compare` (pfljax/experiment/compare_main.py).

    python -m experiments.compare --config=experiments/configs/default.py \
        --algorithms=fedavg,local --seeds=0,1,2 --workdir=runs/cmp

This is what `make demo` runs. See `--help` for the flags and config fields.
"""

from pfljax.experiment.compare_main import run

if __name__ == "__main__":
    run()
