"""`pfljax.runtime.sharding` under its older import path (the same module object)."""

import sys

from pfljax.runtime import sharding as _module

sys.modules[__name__] = _module
