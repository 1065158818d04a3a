"""Run by tests/runtime/test_sharding.py in a subprocess with 4 forced host devices.

For each algorithm named on the command line: the same tiny experiment with
the client axis sharded over 1 and over 4 devices (6 clients -> padded to 8,
3 sampled per round -> padded to 4 inside ShardedMap; ClientData sharded for
FedAvg, replicated for the others); prints one JSON line per
algorithm with both summaries and metrics rows (per-round train loss, test
loss and accuracies). The test compares them.
"""

import json
import os
import sys
import tempfile

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")

from pfljax.experiment import base_config, train_and_evaluate  # noqa: E402
from pfljax.experiment.outputs import JsonlLog  # noqa: E402
from tests.experiment.tiny import tiny_config  # noqa: E402


def run(name: str, devices: int, workdir: str) -> dict:
    config = tiny_config(base_config(), algorithm=name, rounds=3, clients_per_round=3)
    config.num_devices = devices
    if name == "fedavg":
        config.fedavg.weighting = "uniform"  # padded clients must not count
    else:
        config.replicate_data = True  # the other data placement
    summary = train_and_evaluate(config, workdir, progress=False)
    rows = JsonlLog(os.path.join(workdir, "metrics.jsonl")).rows()
    return {"summary": summary, "rows": rows}


def main() -> None:
    assert jax.device_count() == 4, jax.devices()
    for name in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            out = {d: run(name, d, os.path.join(tmp, str(d))) for d in (1, 4)}
        print(json.dumps({"algorithm": name, "single": out[1], "sharded": out[4]}), flush=True)


if __name__ == "__main__":
    main()
