"""The shipped config `pfljax/experiment/configs/federico_fmnist.py` (this path keeps working;
`--config=federico_fmnist` finds it from any directory)."""

from pfljax.experiment.configs.federico_fmnist import *  # noqa: F401,F403
from pfljax.experiment.configs.federico_fmnist import get_config  # noqa: F401
