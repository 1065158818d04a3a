"""Each algorithm's round against FedAvg's on the same data and config, in one process.

    python -m experiments.bench.bench_methods --config=pfllib_fmnist:dir \\
        --algorithms=fedcp,gpfl,feddbe,fedamp,apple,fedproto,feddistill,fedgen [--repeats=3]

Every algorithm is prepared from the one config (`--config.<field>=value` overrides as in
pfljax-run; `config.algorithm` set to each name in turn, FedAvg first) on one partition, its
round compiled and run once, then `--repeats` rounds of every algorithm are timed in turn (one
round of each, then the next: a noisy machine slows them alike; `timing.compare_rounds`). One
JSON line per algorithm: `algorithm`, `round_s` (median of the repeats), `best_s`,
`compile_s` (lowering and compilation), `over_fedavg` (round_s / FedAvg's round_s: the
method's overhead), `clients`, `backend`, `device_kind`. One seed; the evaluation is not timed.
"""

from __future__ import annotations

import json

import jax
from absl import flags

from experiments.bench import timing
from pfljax.experiment.cli import define_config_flag, fail, run_binary

USAGE = __doc__
_CONFIG = define_config_flag()
_ALGORITHMS = flags.DEFINE_list("algorithms", ["fedproto", "gpfl"], "algorithms timed against fedavg")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed rounds of each algorithm after its first")
flags.mark_flags_as_required(["config"])


def prepared(config, algorithms: list[str]) -> tuple[dict, object]:
    """({name: Algorithm}, the client data) of `config` with each algorithm, one partition."""
    from pfljax.experiment.config import prepare  # pylint: disable=import-outside-toplevel

    algs, fed_data = {}, None
    for name in algorithms:
        one = config.copy_and_resolve_references()
        one.algorithm = name
        prep = prepare(one, fed_data=fed_data, one_device=True)
        fed_data = prep.fed_data
        algs[name] = prep.algorithm
    return algs, fed_data.data


def rows(algs: dict, data, repeats: int) -> list[dict]:
    """One dict per algorithm (module docstring); `algs` holds "fedavg"."""
    timed = timing.compare_rounds(algs, data, repeats)
    base = timed["fedavg"]["round_s"]
    where = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind}
    return [
        {
            "algorithm": name,
            "round_s": round(t["round_s"], 6),
            "best_s": round(t["best_s"], 6),
            "compile_s": round(t["compile_s"], 2),
            "over_fedavg": round(t["round_s"] / base, 3),
            "clients": int(data.train.count.shape[0]),
            **where,
        }
        for name, t in timed.items()
    ]


def check_flags() -> list[str]:
    """The algorithms to time, FedAvg first; one line and exit 2 for a bad flag."""
    from pfljax import algorithms  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.config import close_names  # pylint: disable=import-outside-toplevel

    names = ["fedavg"] + [a for a in _ALGORITHMS.value if a != "fedavg"]
    for name in names:
        if name not in algorithms.available():
            fail(
                f"--algorithms: {name!r} is not an algorithm{close_names(name, algorithms.available())}; "
                f"allowed: {', '.join(algorithms.available())}"
            )
    if _REPEATS.value < 1:
        fail(f"--repeats must be an integer >= 1, got {_REPEATS.value}")
    return names


def main(argv):
    del argv
    names = check_flags()
    from pfljax.experiment import ConfigError  # pylint: disable=import-outside-toplevel

    try:
        algs, data = prepared(_CONFIG.value, names)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    for row in rows(algs, data, _REPEATS.value):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    run_binary(main, USAGE)
