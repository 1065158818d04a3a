"""The shipped config `pfljax/experiment/configs/pfllib_fmnist.py` (this path keeps working;
`--config=pfllib_fmnist` finds it from any directory)."""

from pfljax.experiment.configs.pfllib_fmnist import *  # noqa: F401,F403
from pfljax.experiment.configs.pfllib_fmnist import get_config  # noqa: F401
