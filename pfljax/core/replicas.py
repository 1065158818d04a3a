"""`pfljax.runtime.replicas` under its older import path (the same module object)."""

import sys

from pfljax.runtime import replicas as _module

sys.modules[__name__] = _module
