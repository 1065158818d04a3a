"""Runs the real binaries many times, cheaply: one warm process, one fork per run.

    python -m tests.experiment.forkrun < cases.json > results.json

Each case is {"module": "experiments.main", "args": [...], "cwd": ..., "hide": [...]}
("hide": modules the child cannot import, as if not installed; optional). This
process imports JAX, absl, ml_collections and pfljax.experiment once (no JAX
backend is started here, so forking is safe), then for each case forks a child
that runs the module exactly as `python -m <module> <args>` would
(`runpy.run_module(..., run_name="__main__")` with that argv; the binaries'
flags are defined in the child, on a fresh import of the binary), with its
stdout and stderr sent to files, and reports {"rc", "stdout", "stderr"}. Two
children run at a time. A run costs about a tenth of a second instead of the
seconds of a fresh interpreter importing JAX.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import time


def _child(case: dict, out_path: str, err_path: str) -> None:
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 0
    try:
        os.chdir(case.get("cwd") or os.getcwd())
        for name in case.get("hide", ()):  # as if not installed: `import name` fails
            sys.modules[name] = None
        sys.argv = [case["module"], *case["args"]]
        runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  as an uncaught exception in `python -m`
        import traceback  # pylint: disable=import-outside-toplevel

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_cases(cases: list[dict], parallel: int = 2) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="forkrun_")
    results: list[dict | None] = [None] * len(cases)
    running: dict[int, int] = {}  # pid -> case index
    started: dict[int, float] = {}
    pending = list(range(len(cases)))

    def paths(i):
        return os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")

    def reap():
        pid, status = os.wait()
        i = running.pop(pid)
        out, err = paths(i)
        results[i] = {
            "rc": os.waitstatus_to_exitcode(status),
            "stdout": open(out).read(),
            "stderr": open(err).read(),
            "seconds": time.perf_counter() - started.pop(i),
        }

    while pending or running:
        while pending and len(running) < parallel:
            i = pending.pop(0)
            started[i] = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                _child(cases[i], *paths(i))
            running[pid] = i
        reap()
    return results


def main() -> None:
    # Warm up: what every binary imports before it parses its flags.
    import absl.app  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    import ml_collections.config_flags  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel

    import pfljax.experiment  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    from pfljax.experiment.config import base_config  # pylint: disable=import-outside-toplevel

    base_config()  # imports every algorithm module
    cases = json.load(sys.stdin)
    parallel = int(os.environ.get("FORKRUN_PARALLEL", "2"))
    json.dump(run_cases(cases, parallel), sys.stdout)


if __name__ == "__main__":
    main()
