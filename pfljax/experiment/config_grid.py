"""The configs of a comparison's rows and of a grid's points (config -> configs and builders).

A grid varies one option over values: `learning_rate` (`TOP_LEVEL`) or a float option
of the algorithm with a declared domain (`grid_target`). `row_configs` gives each row
of `pfljax-compare` its config; `replica_configs` each replica of one program;
`make_build` the algorithm with the grid's options as traced scalars
(`pfljax.experiment.sweep.train_replicas`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

from pfljax import algorithms
from pfljax.experiment.checkpoint import flat_fields
from pfljax.experiment.config import (
    ConfigError,
    _tuples,
    make_client_map,
    make_local,
    make_privacy,
    resolve,
    to_plain,
)

TOP_LEVEL = ("learning_rate",)  # top-level fields a grid may vary (they enter through make_local)


def grid_label(name: str, option: str, value: float) -> str:
    """A grid row's name and run directory: `<algorithm>.<option>=<value>` (value as %g)."""
    return f"{name}.{option}={value:g}"


class _Override:
    """A config view with some fields replaced (by traced values)."""

    def __init__(self, base, **fields):
        self._base, self._fields = base, fields

    def __getattr__(self, name):
        return self._fields[name] if name in self._fields else getattr(self._base, name)


def grid_target(config, option: str) -> str:
    """'' for a top-level field, else the algorithm whose numeric option `option` is; ConfigError otherwise.

    Any scalar option with a declared domain (`pfljax.algorithms.domains`) may be a
    grid's. As one program (`train_replicas`) only float options can vary: an
    integer option is refused there (`make_build`), and whether a float option's
    build path traces is tried (`pfljax.runtime.replicas.check_varying`).
    """
    if option in TOP_LEVEL:
        return ""
    name = config.algorithm
    options = config[name] if name in config else {}
    domains, value = algorithms.domains(name), options.get(option)
    if option in domains and isinstance(value, int | float) and not isinstance(value, bool):
        return name
    if option in options:
        raise ConfigError(
            f"--grid={option}: config.{name}.{option}={value!r} is not a number; "
            "it cannot vary inside one program"
        )
    floats = sorted(k for k, d in domains.items() if not d.integer and isinstance(options.get(k), float))
    raise ConfigError(
        f"--grid={option}: not a float option of {name} nor one of {list(TOP_LEVEL)}; "
        f"{name}'s float options: {floats}"
    )


def make_build(config, prep, grid_names: Sequence[str]):
    """build(**{option: scalar}) -> the Algorithm of `config` with those options replaced.

    ConfigError for an integer option (`pfljax.algorithms.domains`): a grid's value is
    a traced float scalar, which a count or a shape cannot be.
    """
    name = config.algorithm
    domains = algorithms.domains(name)
    for option in grid_names:
        if option not in TOP_LEVEL and domains[option].integer:
            raise ConfigError(
                f"--grid={option}: config.{name}.{option} is an integer option: it cannot vary inside one "
                "program (its values are traced floats); run them as separate runs (without --vectorize)"
            )
    options = _tuples(to_plain(config[name])) if name in config else {}
    privacy = make_privacy(config)
    if privacy is not None:
        options["privacy"] = privacy
    cmap = make_client_map(config)

    def build(**hyper):
        top = {k: v for k, v in hyper.items() if k in TOP_LEVEL}
        local = make_local(_Override(config, **top), prep.fed_data.task)
        opts = {**options, **{k: v for k, v in hyper.items() if k not in TOP_LEVEL}}
        return algorithms.get(name).build(
            prep.model, local, clients_per_round=config.clients_per_round or None, client_map=cmap, **opts
        )

    return build


def grid_value(config, option: str) -> float:
    """The value of a grid's option (`grid_target`) in `config`."""
    return float(config[option] if option in TOP_LEVEL else config[config.algorithm][option])


def check_replica_configs(configs, workdirs, grid_names) -> None:
    """ConfigError unless the (resolved) configs can run as replicas of one program:
    differing only by seed and the grid's options, on one shared partition, one device."""
    first = configs[0]
    ignore = {"seed", "rounds", "eval_every", "checkpoint_every", *grid_names}
    base = {k: v for k, v in flat_fields(to_plain(first)).items() if k.split(".")[-1] not in ignore}
    for c in configs[1:]:
        other = {k: v for k, v in flat_fields(to_plain(c)).items() if k.split(".")[-1] not in ignore}
        if other != base:
            differ = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise ConfigError(
                f"replicas must differ only by seed and {list(grid_names)}; they differ in {differ}"
            )
        for field in ("rounds", "eval_every", "checkpoint_every"):
            if c[field] != first[field]:
                raise ConfigError(f"replicas must share config.{field}")
    seeds = {c.seed for c in configs}
    if len(seeds) > 1 and first.data_seed < 0:
        raise ConfigError(
            f"--vectorize runs seeds {sorted(seeds)} on one shared partition, but config.data_seed=-1 "
            "gives each seed its own: set --config.data_seed=<n> (>= 0), or run without --vectorize"
        )
    if first.num_devices not in (0, 1):
        raise ConfigError(f"--vectorize runs on one device; got config.num_devices={first.num_devices}")
    if len(set(map(os.path.abspath, workdirs))) != len(workdirs):
        raise ConfigError("replicas need distinct workdirs")


def row_configs(config, names: Sequence[str], grid) -> tuple[dict, dict]:
    """Every row's config, validated (ConfigError otherwise).

    Returns:
      ({label: config}, {algorithm: its labels}): a label is the algorithm's name,
      or with a grid (option, values) one `grid_label` per value.
    """
    configs, groups = {}, {}
    for name in names:
        c = copy.deepcopy(config)
        with c.unlocked():
            c.algorithm = name
        points = [(name, None)] if grid is None else [(grid_label(name, grid[0], v), v) for v in grid[1]]
        groups[name] = [lab for lab, _ in points]
        for lab, value in points:
            cc = copy.deepcopy(c)
            if grid is not None:
                target = grid_target(cc, grid[0])
                with cc.unlocked():
                    if target:
                        cc[target][grid[0]] = type(cc[target][grid[0]])(value)
                    else:
                        cc[grid[0]] = value
            resolve(cc)  # validates
            configs[lab] = cc
    return configs, groups


def replica_configs(configs: dict, labels: Sequence[str], seeds: Sequence[int]) -> list:
    """The configs of one program's replicas: every label at every seed (label-major)."""
    out = []
    for lab in labels:
        for seed in seeds:
            cc = copy.deepcopy(configs[lab])
            cc.seed = seed
            out.append(cc)
    return out
