"""The shipped config `pfljax/experiment/configs/leaf_femnist.py` (this path keeps working;
`--config=leaf_femnist` finds it from any directory)."""

from pfljax.experiment.configs.leaf_femnist import *  # noqa: F401,F403
from pfljax.experiment.configs.leaf_femnist import get_config  # noqa: F401
