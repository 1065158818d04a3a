"""Configs shipped with pfljax: `--config=<name>[:argument]` (or a path) in the binaries.

Each module has `get_config([argument]) -> ConfigDict`: `default` is the schema
with its defaults (`pfljax.experiment.config.base_config`), the others a paper's
setting on top of it. `experiments/configs/<name>.py` in the repository are
shims to these.
"""
