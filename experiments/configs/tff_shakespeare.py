"""The shipped config `pfljax/experiment/configs/tff_shakespeare.py` (this path keeps working;
`--config=tff_shakespeare` finds it from any directory)."""

from pfljax.experiment.configs.tff_shakespeare import *  # noqa: F401,F403
from pfljax.experiment.configs.tff_shakespeare import get_config  # noqa: F401
