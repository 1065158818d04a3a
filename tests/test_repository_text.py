"""The repository's text speaks of the software: no work-step numbers, tracker numbers,
borrowed machines, working sessions or dates of work in code, docs and results files.

A results file names the device and the command, and the commit where a figure came
from an earlier version of the code; a resumable run says that rerunning the same
command resumes. Legitimate technical uses of a flagged phrase go in ALLOWED.
"""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = os.path.relpath(os.path.abspath(__file__), ROOT).replace(os.sep, "/")  # spells the patterns

# What is flagged (case-insensitive, whole words): "stop 40", "stop-41", "issue 14",
# "issues 16", "issue #7", "issue-8"; a machine "lent" or "leased", a "lease"; "session";
# an ISO date such as 2026-11-26.
FLAGGED = re.compile(
    r"\bstops?[- ]?[0-9]+"
    r"|\bissues?[ #-]*[0-9]+"
    r"|\b(?:lent|leases?|leased)\b"
    r"|\bsessions?\b"
    r"|\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b",
    re.IGNORECASE,
)

# (path from the repository root, the flagged phrase in lower case) -> why it stays.
ALLOWED: dict[tuple[str, str], str] = {}

SUFFIXES = (".py", ".md", ".ipynb", ".toml", ".txt", ".cc", ".h")
NAMES = ("Makefile",)
PATHS = (".ci/run",)
SKIP_DIRS = set(
    ".git .venv venv runs build dist __pycache__ .jax_cache .pytest_cache .ruff_cache .mypy_cache"
    " node_modules .whl .gpudata".split()
)


def is_text(path: str) -> bool:
    return path.endswith(SUFFIXES) or os.path.basename(path) in NAMES or path in PATHS


def tracked_files() -> list[str]:
    """`git ls-files` when git and the repository are there; else a walk of the tree that
    skips virtual environments, git's own directory, run outputs and build directories."""
    try:
        out = subprocess.run(
            ["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True, timeout=30
        ).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        files = []
    if files:
        return files
    found = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = os.path.relpath(top, ROOT)
        found += [n if rel == "." else f"{rel}/{n}".replace(os.sep, "/") for n in names]
    return found


def test_text_names_no_work_steps_borrowed_machines_or_dates():
    hits, used = [], set()
    for rel in tracked_files():
        path = os.path.join(ROOT, rel)
        if rel == SELF or not is_text(rel) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for m in FLAGGED.finditer(text):
            key = (rel, m.group(0).lower())
            if key in ALLOWED:
                used.add(key)
                continue
            line = text.count("\n", 0, m.start()) + 1
            start, end = text.rfind("\n", 0, m.start()) + 1, text.find("\n", m.end())
            hits.append(
                f"{rel}:{line}: [{m.group(0)}] {text[start : end if end >= 0 else None].strip()[:160]}"
            )
    assert not hits, (
        "text that names work steps, tracker numbers, borrowed machines, sessions or dates "
        "(say what the software does; name a commit, the device and the command instead; "
        "or add a (file, phrase) entry with its reason to ALLOWED):\n" + "\n".join(hits)
    )
    assert not set(ALLOWED) - used, f"ALLOWED entries that match nothing: {sorted(set(ALLOWED) - used)}"
