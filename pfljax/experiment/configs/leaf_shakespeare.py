"""LEAF's Shakespeare (Caldas et al. 2018): speaking roles as clients, LEAF's char LSTM.

    python -m pfljax.experiment.main --config=leaf_shakespeare \\
        --config.data_dir=LEAF/data/shakespeare/data --workdir=runs/leaf_shakespeare

`data_dir` is LEAF's `data/` directory (holding train/ and test/), as
`./preprocess.sh -s niid --sf 0.2 -k 0 -t sample -tf 0.8` in leaf/data/shakespeare
writes it. Each sample is 80 characters and the next one (LEAF's 80-character
vocabulary, pfljax.data.shakespeare): one label per sequence, cross-entropy.
Model: LEAF's stacked LSTM (embedding 8, two LSTM layers of 256, logits of the next
character from the last position). Training as LEAF's FedAvg baseline: SGD lr 0.8,
batch 10, 1 epoch; roles with fewer than 64 samples are left out (min_samples). (lr and
clients per round as LEAF's `paper_experiments/shakespeare.sh`, which runs 80 rounds of 1
or 20 epochs; here 500 rounds of 1.)
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs.leaf_femnist import leaf_users


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    del arg  # one setting
    config = leaf_users("leaf_shakespeare", rounds=500, learning_rate=0.8)
    config.source.min_samples = 64
    config.model = "char_lstm"
    config.model_kwargs = ml_collections.ConfigDict({"embed": 8, "hidden": (256, 256), "last_only": True})
    return config
