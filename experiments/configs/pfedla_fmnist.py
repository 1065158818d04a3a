"""The shipped config `pfljax/experiment/configs/pfedla_fmnist.py` (this path keeps working;
`--config=pfedla_fmnist` finds it from any directory)."""

from pfljax.experiment.configs.pfedla_fmnist import *  # noqa: F401,F403
from pfljax.experiment.configs.pfedla_fmnist import get_config  # noqa: F401
