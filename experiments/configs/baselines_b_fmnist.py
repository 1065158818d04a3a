"""The shipped config `pfljax/experiment/configs/baselines_b_fmnist.py` (this path keeps working;
`--config=baselines_b_fmnist` finds it from any directory)."""

from pfljax.experiment.configs.baselines_b_fmnist import *  # noqa: F401,F403
from pfljax.experiment.configs.baselines_b_fmnist import get_config  # noqa: F401
