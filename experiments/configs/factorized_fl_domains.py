"""The shipped config `pfljax/experiment/configs/factorized_fl_domains.py` (this path keeps working;
`--config=factorized_fl_domains` finds it from any directory)."""

from pfljax.experiment.configs.factorized_fl_domains import *  # noqa: F401,F403
from pfljax.experiment.configs.factorized_fl_domains import get_config  # noqa: F401
