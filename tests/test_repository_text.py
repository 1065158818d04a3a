"""The repository's text speaks of the software only: what it does, the device, the
command and the commit a figure came from; never how or when the work was done.

A results file names the device and the command, and the commit where a figure came
from an earlier version of the code; a resumable run says that rerunning the same
command resumes. Legitimate technical uses of a flagged phrase go in ALLOWED.
"""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# FLAGGED: numbered work steps and tracker items, words for machines held on loan or for
# periods of work, and ISO dates; case-insensitive, whole words. Each alternative is spelled
# with a character class so that the pattern itself is not a phrase it flags.
FLAGGED = re.compile(
    r"\bst[o]ps?[- ]?[0-9]+"
    r"|\bi[s]sues?[ #-]*[0-9]+"
    r"|\b(?:l[e]nt|l[e]ases?|l[e]ased)\b"
    r"|\bs[e]ssions?\b"
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


def test_text_speaks_of_the_software_only():
    hits, used = [], set()
    for rel in tracked_files():
        path = os.path.join(ROOT, rel)
        if not is_text(rel) or not os.path.isfile(path):
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
        "text about how or when the work was done "
        "(say what the software does; name a commit, the device and the command instead; "
        "or add a (file, phrase) entry with its reason to ALLOWED):\n" + "\n".join(hits)
    )
    assert not set(ALLOWED) - used, f"ALLOWED entries that match nothing: {sorted(set(ALLOWED) - used)}"


def test_the_pattern_flags_what_it_should():
    # Samples joined from pieces, so that this file holds none of them whole.
    flagged = ["st" + "op 40", "St" + "op-41", "is" + "sue 14", "is" + "sue #7", "le" + "nt machine",
               "GPU le" + "ases", "this se" + "ssion", "2026" + "-11-26"]  # fmt: skip
    assert all(FLAGGED.search(text) for text in flagged), [t for t in flagged if not FLAGGED.search(t)]
    kept = ["stopping rule", "tissue 14", "silent", "release", "2026 runs"]
    assert not any(FLAGGED.search(text) for text in kept), [t for t in kept if FLAGGED.search(t)]
