"""PFLlib's Fashion-MNIST protocol for every method at once, under a wall-clock deadline.

    python -m experiments.pfllib.pfllib_fmnist --setting=dir --workdir=runs/pfllib_dir \\
        [--rounds=2000] [--deadline_s=540] [--jobs=0] [--methods=fedavg,ditto,...]
    python -m experiments.pfllib.pfllib_fmnist --table_only --workdir=runs/pfllib_dir

Each method runs as its own `experiments.compare` process (config
`pfllib_fmnist.py:<setting>`, seeds 0, 1, 2 as one vectorized program), into
<workdir>/<method>/<algorithm>/seed_<s>/. `--jobs=0` starts them all at once
(on one GPU they share the device; a tiny model leaves it idle between kernels),
`--jobs=N` at most N at a time. At `--deadline_s` every process still running is
stopped; the rounds it logged stay in its metrics.jsonl, so the table reports
the rounds each method reached, and the accuracies at the last round that every
method reached with every seed ("common round"), so rows compare like with like.

Resumable (e.g. a run cut by a time limit): each run checkpoints its
replica state every `--checkpoint_every` rounds, and running the same command again
into the same workdir resumes every unfinished method from its last checkpoint (the
rounds logged after it are run again); methods already completed are skipped. Each
launch ends with one line per method saying where it stopped.

METHODS maps a row name to an algorithm and config overrides: the pfljax
defaults, plus two rows for methods whose paper defaults diverge in round 1
under this protocol's plain SGD: `pfedme_pfllib`, pFedMe with PFLlib's main.py
values of lam (1) and the personal rate (0.01) instead of the pFedMe authors'
MNIST command (lam 15, 0.1; see experiments/studies/pfedme_stability.py), and
`federico_mean`, FedeRiCo with m_step="mean" (the gradient scale plain SGD
needs; the paper's "sum" is meant for Adam).
The table (markdown, to stdout): best and final sample-weighted mean test accuracy
(PFLlib's metric) over the rounds run, mean +- std over seeds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from pfljax.experiment.cli import parse_flags

METHODS = {
    "fedavg": ("fedavg", ()),
    "fedprox": ("fedprox", ()),
    "per_fedavg": ("per_fedavg", ()),
    "pfedme": ("pfedme", ()),
    "pfedme_pfllib": ("pfedme", ("--config.pfedme.lam=1.0", "--config.pfedme.personal_lr=0.01")),
    "fedfomo": ("fedfomo", ()),
    "fedper": ("fedper", ()),
    "fedrep": ("fedrep", ()),
    "fedrod": ("fedrod", ()),
    "fedbabu": ("fedbabu", ()),
    "ditto": ("ditto", ()),
    "apfl": ("apfl", ()),
    "fedala": ("fedala", ()),
    "fedamp": ("fedamp", ()),
    "apple": ("apple", ()),
    "fedproto": ("fedproto", ()),
    "feddistill": ("feddistill", ()),
    "fedgen": ("fedgen", ()),
    "feddbe": ("feddbe", ()),
    "fedcp": ("fedcp", ()),
    "gpfl": ("gpfl", ()),
    "fedfac": ("fedfac", ()),
    "factorized_fl": ("factorized_fl", ()),
    "pfedla": ("pfedla", ()),
    "federico": ("federico", ()),
    "federico_mean": ("federico", ("--config.federico.m_step=mean",)),
}

flags.DEFINE_enum("setting", "dir", ["dir", "pat"], "PFLlib split: Dirichlet 0.1 or pathological")
flags.DEFINE_string("workdir", None, "output directory (one subdirectory per method)")
flags.DEFINE_list("methods", list(METHODS), f"rows to run, from {', '.join(METHODS)}")
flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds")
flags.DEFINE_integer("rounds", 2000, "rounds (the protocol's 2000)")
flags.DEFINE_float("deadline_s", 0.0, "stop every run still going after this many seconds (0: none)")
flags.DEFINE_integer("checkpoint_every", 50, "rounds between checkpoints (what a stopped run resumes from)")
flags.DEFINE_integer("jobs", 0, "processes at a time (0: all methods at once)")
flags.DEFINE_list("extra", [], "further --config.* overrides for every run, e.g. config.eval_every=5")
flags.DEFINE_bool("table_only", False, "only print the table of an existing workdir")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def command(method: str) -> list[str]:
    algorithm, overrides = METHODS[method]
    return [
        sys.executable, "-m", "experiments.compare",
        f"--config=experiments/configs/pfllib_fmnist.py:{FLAGS.setting}",
        f"--config.rounds={FLAGS.rounds}", f"--config.checkpoint_every={FLAGS.checkpoint_every}",
        f"--algorithms={algorithm}", f"--seeds={','.join(FLAGS.seeds)}", "--vectorize",
        f"--workdir={os.path.join(FLAGS.workdir, method)}",
        *overrides, *(f"--{e}" for e in FLAGS.extra),
    ]  # fmt: skip


def launch(methods: list[str]) -> dict:
    """Runs the methods' processes, at most --jobs at a time, until done or the deadline."""
    os.makedirs(FLAGS.workdir, exist_ok=True)
    start, waiting, running, done = time.time(), list(methods), {}, {}
    limit = FLAGS.jobs or len(methods)
    while waiting or running:
        while waiting and len(running) < limit:
            m = waiting.pop(0)
            log = open(os.path.join(FLAGS.workdir, f"{m}.log"), "a")  # a resumed run appends
            running[m] = (subprocess.Popen(command(m), stdout=log, stderr=subprocess.STDOUT), time.time())
        time.sleep(5)
        late = FLAGS.deadline_s and time.time() - start > FLAGS.deadline_s
        for m, (proc, t0) in list(running.items()):
            if late and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if proc.poll() is not None:
                done[m] = {"returncode": proc.returncode, "seconds": time.time() - t0, "stopped": bool(late)}
                del running[m]
                print(f"{m}: exit {proc.returncode} after {done[m]['seconds']:.0f} s", flush=True)
        if late:
            waiting.clear()
        if int(time.time() - start) % 60 < 5:
            reached = (f"{m} r{rounds_run(FLAGS.workdir, m, FLAGS.seeds)}" for m in running)
            print(f"{time.time() - start:.0f} s: " + ", ".join(reached), flush=True)
    path = os.path.join(FLAGS.workdir, "launch.json")
    if os.path.exists(path):  # earlier launches into this workdir
        with open(path) as f:
            done = {**json.load(f), **done}
    with open(path, "w") as f:
        json.dump(done, f, indent=1)
    return done


def seed_rows(workdir: str, method: str, seeds) -> dict[int, list[dict]]:
    """seed -> metric rows logged by that method's run."""
    out, algorithm = {}, METHODS[method][0]
    for s in seeds:
        path = os.path.join(workdir, method, algorithm, f"seed_{s}", "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                out[int(s)] = [r for r in map(json.loads, filter(str.strip, f)) if "mean_accuracy" in r]
    return out


def rounds_run(workdir: str, method: str, seeds) -> int:
    """Rounds that every seed of the method logged (0 if a seed logged none)."""
    rows = seed_rows(workdir, method, seeds)
    return min((len(r) for r in rows.values()), default=0) if len(rows) == len(seeds) else 0


def status(workdir: str, method: str, seeds) -> str:
    algorithm = METHODS[method][0]
    path = os.path.join(workdir, method, algorithm, f"seed_{seeds[0]}", "summary.json")
    if not os.path.exists(path):
        launched = os.path.join(workdir, "launch.json")
        code = None
        if os.path.exists(launched):
            with open(launched) as f:
                code = json.load(f).get(method, {}).get("returncode")
        if code not in (None, -signal.SIGTERM, -signal.SIGKILL):
            return f"failed (exit {code}, see {method}.log)"
        return "stopped at deadline" if rounds_run(workdir, method, seeds) else "no round"
    with open(path) as f:
        return json.load(f).get("status", "?")


def pm(values) -> str:
    v = 100 * np.asarray(values, float)
    return f"{v.mean():.2f} +- {v.std():.2f}" if len(v) else "-"


def table(workdir: str, methods: list[str], seeds) -> str:
    """Markdown rows: best / final / common-round accuracy (mean +- std over seeds), rounds, s / round."""
    reached = {m: rounds_run(workdir, m, seeds) for m in methods}
    common = min((r for r in reached.values() if r), default=0)
    lines = [
        f"| method | best mean acc (%) | final mean acc (%) | acc at round {common} (%) | rounds run "
        "| s / round | status |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in methods:
        rows = seed_rows(workdir, m, seeds)
        runs = [[r["mean_accuracy"] for r in rs[: reached[m]]] for rs in rows.values()]
        if not reached[m]:
            lines.append(f"| {m} | - | - | - | 0 | - | {status(workdir, m, seeds)} |")
            continue
        at_common = [a[common - 1] for a in runs] if common else []
        seconds = np.median([r.get("seconds", np.nan) for r in next(iter(rows.values()))[: reached[m]]])
        lines.append(
            f"| {m} | {pm([max(a) for a in runs])} | {pm([a[-1] for a in runs])} | {pm(at_common)} "
            f"| {reached[m]} | {seconds:.2f} | {status(workdir, m, seeds)} |"
        )
    return "\n".join(lines)


def finished(workdir: str, method: str, seeds, rounds: int) -> bool:
    """Diverged, or completed with `rounds` rounds logged: nothing left to resume."""
    state = status(workdir, method, seeds)
    return state == "diverged" or (state == "completed" and rounds_run(workdir, method, seeds) >= rounds)


def checkpointed_round(workdir: str, method: str) -> int:
    """The round of the method's last replica checkpoint (0: none), what a rerun resumes from."""
    path = os.path.join(workdir, method, METHODS[method][0], "replica_checkpoints")
    steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
    return max(steps, default=0)


def where_stopped(workdir: str, methods: list[str], seeds, rounds: int) -> str:
    """One line per method: rounds logged, the checkpoint a rerun resumes from, status."""
    return "\n".join(
        f"{m}: {rounds_run(workdir, m, seeds)} of {rounds} rounds logged, checkpoint at round "
        f"{checkpointed_round(workdir, m)}, {status(workdir, m, seeds)}"
        for m in methods
    )


def main(argv):
    del argv
    unknown = [m for m in FLAGS.methods if m not in METHODS]
    if unknown:
        print(f"--methods: {unknown} not in {', '.join(METHODS)}", file=sys.stderr)
        sys.exit(2)
    if not FLAGS.table_only:
        todo = [m for m in FLAGS.methods if not finished(FLAGS.workdir, m, FLAGS.seeds, FLAGS.rounds)]
        for m in sorted(set(FLAGS.methods) - set(todo)):
            print(f"{m}: finished earlier, skipped", flush=True)
        launch(todo)
        print(where_stopped(FLAGS.workdir, FLAGS.methods, FLAGS.seeds, FLAGS.rounds), flush=True)
    present = [m for m in FLAGS.methods if os.path.isdir(os.path.join(FLAGS.workdir, m))]
    print(table(FLAGS.workdir, present, FLAGS.seeds))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
