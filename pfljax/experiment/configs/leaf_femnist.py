"""LEAF's FEMNIST (Caldas et al. 2018): writers as clients, LEAF's CNN.

    python -m pfljax.experiment.main --config=leaf_femnist --config.data_dir=LEAF/data/femnist/data \\
        --workdir=runs/leaf_femnist

`data_dir` is LEAF's `data/` directory (holding train/ and test/), as
`./preprocess.sh -s niid --sf 0.05 -k 0 -t sample` in leaf/data/femnist writes it;
each writer's own train/test split is kept. Model: LEAF's FEMNIST CNN (5x5 conv 32
SAME + ReLU + 2x2 max-pool, 5x5 conv 64 SAME + ReLU + pool, dense 2048 + ReLU,
dense 62): the library CNN with channels (32, 64), dense (2048,), SAME padding.
Training as LEAF's FedAvg baseline: SGD lr 0.004, batch 10, 1 epoch (lr and epochs as
LEAF's `paper_experiments/femnist.sh`; that script runs 2000 rounds of 3 or 35 clients, here
1000 rounds of 10: `--config.rounds`, `--config.clients_per_round`).
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs import default


def leaf_users(dataset: str, rounds: int, learning_rate: float) -> ml_collections.ConfigDict:
    """LEAF's FedAvg setting on `dataset`: every user as a client with its own split (no
    cap; `--config.num_clients=N` keeps the first N), 10 a round, 1 epoch of batch 10,
    plain SGD at `learning_rate`."""
    config = default.get_config()
    config.dataset = dataset
    config.data_dir = ""  # LEAF's data/<task>/data
    config.partition = "iid"  # keep the users as clients
    config.samples_per_client = 0  # LEAF's own per-user split, no cap
    config.num_clients = 0  # every user in data_dir (with at least source.min_samples samples)
    config.clients_per_round = 10
    config.rounds = rounds
    config.local_epochs = 1
    config.batch_size = 10
    config.optimizer = "sgd"
    config.learning_rate = learning_rate
    config.momentum = 0.0
    config.checkpoint_every = 50
    return config


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    del arg  # one setting
    config = leaf_users("leaf_femnist", rounds=1000, learning_rate=0.004)
    config.model = "cnn"
    config.model_kwargs = ml_collections.ConfigDict(
        {"channels": (32, 64), "dense": (2048,), "kernel_size": 5, "padding": "SAME"}
    )
    return config
