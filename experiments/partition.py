"""A config's partition without training (statistics and plot): the repository's name for
`pfljax-partition` (pfljax/experiment/partition_main.py).

    python -m experiments.partition --config=experiments/configs/default.py --outdir=runs/partition
"""

from pfljax.experiment.partition_main import run

if __name__ == "__main__":
    run()
