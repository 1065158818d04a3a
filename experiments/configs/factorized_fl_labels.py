"""The shipped config `pfljax/experiment/configs/factorized_fl_labels.py` (this path keeps working;
`--config=factorized_fl_labels` finds it from any directory)."""

from pfljax.experiment.configs.factorized_fl_labels import *  # noqa: F401,F403
from pfljax.experiment.configs.factorized_fl_labels import get_config  # noqa: F401
