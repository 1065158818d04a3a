"""The shipped config `pfljax/experiment/configs/leaf_shakespeare.py` (this path keeps working;
`--config=leaf_shakespeare` finds it from any directory)."""

from pfljax.experiment.configs.leaf_shakespeare import *  # noqa: F401,F403
from pfljax.experiment.configs.leaf_shakespeare import get_config  # noqa: F401
