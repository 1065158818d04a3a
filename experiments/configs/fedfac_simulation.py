"""The shipped config `pfljax/experiment/configs/fedfac_simulation.py` (this path keeps working;
`--config=fedfac_simulation` finds it from any directory)."""

from pfljax.experiment.configs.fedfac_simulation import *  # noqa: F401,F403
from pfljax.experiment.configs.fedfac_simulation import get_config  # noqa: F401
