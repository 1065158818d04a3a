"""TFF's federated EMNIST-62 (tff.simulation.datasets.emnist): writers as clients.

    python -m pfljax.experiment.main --config=tff_emnist --config.data_dir=DIR/datasets \\
        --workdir=runs/tff_emnist

`data_dir` holds fed_emnist_train.h5 and fed_emnist_test.h5, as
`tff.simulation.datasets.emnist.load_data(only_digits=False, cache_dir=DIR)` caches
them; each writer's own train/test split is kept. Model: the FEMNIST CNN of
leaf_femnist.py; SGD lr 0.01 without momentum, batch 20, 1 epoch, 10 clients a round.
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs import leaf_femnist


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = leaf_femnist.get_config(arg)
    config.dataset = "tff_emnist"
    config.data_dir = ""  # the directory of fed_emnist_{train,test}.h5
    config.learning_rate = 0.01
    config.batch_size = 20
    return config
