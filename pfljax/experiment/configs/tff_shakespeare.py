"""TFF's federated Shakespeare (tff.simulation.datasets.shakespeare): roles as clients.

    python -m pfljax.experiment.main --config=tff_shakespeare --config.data_dir=DIR/datasets \\
        --workdir=runs/tff_shakespeare

`data_dir` holds shakespeare_train.h5 and shakespeare_test.h5, as
`tff.simulation.datasets.shakespeare.load_data(cache_dir=DIR)` caches them. Snippets
become TFF's 80-id windows with a next-id target at every position (vocabulary of
90, id 0 padding; pfljax.data.shakespeare.tff_windows): task "sequence", loss
"token_cross_entropy" (padding masked), the char LSTM of leaf_shakespeare.py with
logits at every position (last_only=False). Clients with fewer than 2 snippets are
left out.
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs import leaf_shakespeare


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    config = leaf_shakespeare.get_config(arg)
    config.dataset = "tff_shakespeare"
    config.data_dir = ""  # the directory of shakespeare_{train,test}.h5
    config.source.min_samples = 2
    config.loss = "auto"  # token_cross_entropy for the "sequence" task
    config.batch_size = 4
    config.learning_rate = 1.0
    config.model_kwargs = ml_collections.ConfigDict({"embed": 8, "hidden": (256, 256), "last_only": False})
    return config
