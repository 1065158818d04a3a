"""The default experiment (the `make demo` run) and the schema every config shares.

`make demo` runs `experiments.compare` with this config: FedAvg vs Local on
Fashion-MNIST (10 clients, 4 classes each, 1000 samples each) if the IDX files
are present, else on the FedFac simulation data.

Variants import this module, call `get_config()` and override a few fields.
Each algorithm's own options live under `config.<algorithm>.<option>`; they are
read from the keyword-only arguments of `pfljax.algorithms.<name>.build`
(their defaults become the config defaults), so a new algorithm needs no edit
here. Conventions: 0 means "none/all" for the integer caps. The schema and its
validation live in `pfljax.experiment.config` (`base_config`, `validate`).
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.config import (  # noqa: F401  re-exported for configs that import them
    COMMON_BUILD_ARGS,
    IDX_DIR,
    SIMPLE_TYPES,
    algorithm_options,
    base_config,
)


def get_config() -> ml_collections.ConfigDict:
    return base_config()
