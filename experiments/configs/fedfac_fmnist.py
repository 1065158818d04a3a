"""The shipped config `pfljax/experiment/configs/fedfac_fmnist.py` (this path keeps working;
`--config=fedfac_fmnist` finds it from any directory)."""

from pfljax.experiment.configs.fedfac_fmnist import *  # noqa: F401,F403
from pfljax.experiment.configs.fedfac_fmnist import get_config  # noqa: F401
