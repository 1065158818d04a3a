"""The shipped config `pfljax/experiment/configs/default.py` (this path keeps working;
`--config=default` finds it from any directory)."""

from pfljax.experiment.configs.default import *  # noqa: F401,F403
from pfljax.experiment.configs.default import get_config  # noqa: F401
