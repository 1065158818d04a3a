"""pfljax-partition: a config's partition without training: statistics and label-distribution plot.

    pfljax-partition --config=default --outdir=runs/partition [--config.<field>=value ...]
    python -m pfljax.experiment.partition_main ...   (in the repository also
    python -m experiments.partition ...)

Builds the federated data exactly as a run of the same config would (same
seed, same partition), prints one line per client (train / test sizes and
train samples per class) and the totals, and writes data.json (the run's
data.json: per-client per-class train and test counts) and partition.png
(clients x classes) into --outdir. Exit code 2 on bad input.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from pfljax.experiment.cli import PARTITION_PACKAGES, define_config_flag, fail, parse_flags, set_usage, start

USAGE = __doc__
_CONFIG = define_config_flag()
_OUTDIR = flags.DEFINE_string("outdir", "runs/partition", "where data.json and partition.png go")
flags.mark_flags_as_required(["config"])


def table(summary: dict) -> str:
    """The partition as text: one line per client, then the totals."""
    clients = summary["clients"]
    k = summary["num_classes"] if clients and clients[0].get("train_class_counts") else 0
    width = max(4, *(len(str(n)) for c in clients for n in c.get("train_class_counts", [])), 0)
    head = f"{'client':>6} {'train':>6} {'test':>6}" + ("  train samples per class " if k else "")
    lines = [head, " " * 22 + "".join(f"{i:>{width + 1}}" for i in range(k))] if k else [head]
    for c in clients:
        counts = "".join(f"{n:>{width + 1}}" for n in c.get("train_class_counts", []))
        lines.append(f"{c['client']:>6} {c['train']:>6} {c['test']:>6}" + ("  " if k else "") + counts)
    sizes = [c["train"] + c["test"] for c in clients]
    lines.append(
        f"total: {summary['totals']['train']} train, {summary['totals']['test']} test samples over "
        f"{len(clients)} clients ({min(sizes)}..{max(sizes)} per client)"
    )
    return "\n".join(lines)


def main(argv):
    start(argv, None, PARTITION_PACKAGES)
    from absl import logging  # pylint: disable=import-outside-toplevel

    from pfljax.experiment import plots  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.config import (  # pylint: disable=import-outside-toplevel
        ConfigError,
        data_note,
        data_warnings,
        make_data,
        resolve,
    )
    from pfljax.experiment.outputs import write_json  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.train import data_title  # pylint: disable=import-outside-toplevel
    from pfljax.experiment.workdir import check_workdir  # pylint: disable=import-outside-toplevel

    try:
        check_workdir(_OUTDIR.value)
        config, _ = resolve(_CONFIG.value)
        fed = make_data(config)
    except ConfigError as e:
        fail(str(e).replace("--workdir", "--outdir"))
    logging.info("%s", data_note(config))
    for line in data_warnings(config, fed):
        logging.warning("%s", line)
    print(f"{data_title(config)} (seed {fed.summary['seed']})")
    print(table(fed.summary))
    write_json(os.path.join(_OUTDIR.value, "data.json"), fed.summary)
    wrote = plots.plot_partition(
        fed.summary, os.path.join(_OUTDIR.value, "partition.png"), data_title(config)
    )
    print(f"wrote {os.path.join(_OUTDIR.value, 'data.json')}" + (" and partition.png" if wrote else ""))


def run() -> None:
    """Entry point of the `pfljax-partition` console script."""
    set_usage(USAGE, sys.argv)
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
