"""experiments/pfllib/pfllib_fmnist.py's table: best, final and common-round accuracy from the runs' logs."""

import json
import os

import numpy as np

from experiments.pfllib import pfllib_fmnist as driver


def write_run(workdir, method, seed, accuracies, summary=None):
    algorithm = driver.METHODS[method][0]
    run = os.path.join(workdir, method, algorithm, f"seed_{seed}")
    os.makedirs(run)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for r, a in enumerate(accuracies, 1):
            f.write(json.dumps({"round": r, "mean_accuracy": a, "seconds": 2.0}) + "\n")
    if summary:
        with open(os.path.join(run, "summary.json"), "w") as f:
            json.dump(summary, f)


def test_table_reports_each_methods_rounds_and_the_common_round(tmp_path):
    workdir, seeds = str(tmp_path), ["0", "1"]
    fedavg = {0: [0.2, 0.6, 0.5, 0.7], 1: [0.4, 0.8, 0.9, 0.6]}
    for s, acc in fedavg.items():
        write_run(workdir, "fedavg", s, acc, {"status": "completed"})
    write_run(workdir, "ditto", 0, [0.5, 0.9, 0.95])  # stopped at the deadline: seed 1 reached round 2
    write_run(workdir, "ditto", 1, [0.7, 0.3])
    write_run(workdir, "pfedme", 0, [], {"status": "diverged"})
    write_run(workdir, "pfedme", 1, [], {"status": "diverged"})
    with open(os.path.join(workdir, "launch.json"), "w") as f:
        json.dump({"ditto": {"returncode": -15}, "fedprox": {"returncode": 1}}, f)
    os.makedirs(os.path.join(workdir, "fedprox"))

    lines = driver.table(workdir, ["fedavg", "ditto", "pfedme", "fedprox"], seeds).splitlines()
    assert "acc at round 2 (%)" in lines[0]  # the last round every seed of every method reached
    cells = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[2:]}

    def pm(values):
        v = 100 * np.asarray(values)
        return f"{v.mean():.2f} +- {v.std():.2f}"

    assert cells["fedavg"][:4] == [pm([0.7, 0.9]), pm([0.7, 0.6]), pm([0.6, 0.8]), "4"]
    assert cells["fedavg"][5] == "completed |"
    # ditto: only the rounds both seeds reached count (2), so seed 0's 0.95 at round 3 does not
    assert cells["ditto"][:4] == [pm([0.9, 0.7]), pm([0.9, 0.3]), pm([0.9, 0.3]), "2"]
    assert cells["ditto"][5] == "stopped at deadline |"
    assert cells["pfedme"][3:] == ["0", "-", "diverged |"]
    assert cells["fedprox"][5] == "failed (exit 1, see fedprox.log) |"


def test_a_rerun_resumes_only_unfinished_methods_from_their_last_checkpoint(tmp_path):
    workdir, seeds = str(tmp_path), ["0"]
    write_run(workdir, "fedavg", 0, [0.1, 0.2, 0.3, 0.4], {"status": "completed"})
    write_run(workdir, "fedper", 0, [0.1, 0.2], {"status": "completed"})  # an earlier, shorter run
    write_run(workdir, "ditto", 0, [0.1, 0.2, 0.3])  # stopped at a deadline
    write_run(workdir, "pfedme", 0, [], {"status": "diverged"})
    for step in ("2", "3", "tmp"):  # orbax step directories, and one that is not a step
        os.makedirs(os.path.join(workdir, "ditto", "ditto", "replica_checkpoints", step))

    assert [m for m in ("fedavg", "fedper", "ditto", "pfedme") if driver.finished(workdir, m, seeds, 4)] == [
        "fedavg",
        "pfedme",
    ]
    assert driver.checkpointed_round(workdir, "ditto") == 3
    assert driver.checkpointed_round(workdir, "fedper") == 0
    lines = driver.where_stopped(workdir, ["fedper", "ditto"], seeds, 4).splitlines()
    assert lines == [
        "fedper: 2 of 4 rounds logged, checkpoint at round 0, completed",
        "ditto: 3 of 4 rounds logged, checkpoint at round 3, stopped at deadline",
    ]
