"""The shipped config `pfljax/experiment/configs/tff_emnist.py` (this path keeps working;
`--config=tff_emnist` finds it from any directory)."""

from pfljax.experiment.configs.tff_emnist import *  # noqa: F401,F403
from pfljax.experiment.configs.tff_emnist import get_config  # noqa: F401
