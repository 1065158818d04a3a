"""Sphinx extension: one page per algorithm, written at build time into docs/algorithms/.

On `builder-inited` it writes `algorithms/<name>.md` for every name of
`pfljax.algorithms.available()` (the module docstring through autodoc, then a table of
the options of its `build`: name, default, domain and the `Args:` line of `build`'s
docstring; whether it supports client-level DP and host storage) and
`algorithms/index.md` (a table of all of them). A page is rewritten only when its
text changes, and pages of algorithms that no longer exist are removed. The
directory is generated: docs/.gitignore keeps it out of the repository.
"""

from __future__ import annotations

import inspect
import os
import re

from pfljax import algorithms
from pfljax.experiment.config import COMMON_BUILD_ARGS

OUT_DIR = "algorithms"
MARKUP = re.compile(r"[\\*_\[\]<>|]")


def options(name: str) -> list[inspect.Parameter]:
    """The options of `<name>.build` that are config fields `config.<name>.<option>`: its
    keyword-only arguments other than those every build takes (pfljax.experiment.config)."""
    params = inspect.signature(algorithms.get(name).build).parameters.values()
    return [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in COMMON_BUILD_ARGS]


def arg_docs(function) -> dict[str, str]:
    """{argument: its description, on one line} from a Google-style `Args:` section."""
    lines = (inspect.getdoc(function) or "").splitlines()
    if "Args:" not in [line.strip() for line in lines]:
        return {}
    start = [line.strip() for line in lines].index("Args:") + 1
    docs, current, indent = {}, None, None
    for line in lines[start:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            break
        match = re.match(r"(\*{0,2}\w+)(?: \([^)]*\))?:\s*(.*)", line.strip())
        if width == indent and match:
            current = match.group(1)
            docs[current] = match.group(2)
        elif current is not None:
            docs[current] += " " + line.strip()
    return docs


def cell(text: str) -> str:
    """Plain docstring `text` safe inside a Markdown table cell: one line, and outside
    `code` spans the characters Markdown reads as markup escaped."""
    parts = re.split(r"(`[^`]*`)", text.replace("\n", " "))
    return "".join(p.replace("|", "\\|") if p.startswith("`") else MARKUP.sub(r"\\\g<0>", p) for p in parts)


def code(text: str) -> str:
    """`text` as inline code in a Markdown table cell."""
    text = text.replace("\n", " ").replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def server_optimizer_text(name: str) -> str:
    if algorithms.takes(name, "server_optimizer"):
        return (
            "any optax transformation (`build(..., server_optimizer=optax.adam(1e-2))`; "
            "`config.server_optimizer`), in place of `server_lr`"
        )
    return "none (no server step on an average)"


def privacy_text(name: str) -> str:
    if algorithms.supports_privacy(name):
        return "supported (`config.dp.*`; from Python `build(..., privacy=ClientDP(...))`)"
    return "not supported (a config with `dp.enabled` is refused)"


def host_storage_text(name: str) -> str:
    declared = vars(algorithms.get(name)).get("HOST_STORAGE_REFUSED")
    refusal = algorithms.host_storage_refusal(name)
    if callable(declared):
        with_defaults = f"refused with the defaults: {refusal}" if refusal else "allowed with the defaults"
        return f"depends on the options; {with_defaults}"
    return f"refused: {refusal}" if refusal else "allowed"


def algorithm_page(name: str) -> str:
    """The Markdown page of algorithm `name`."""
    module = algorithms.get(name)
    domains = algorithms.domains(name)
    docs = arg_docs(module.build)
    rows = []
    for p in options(name):
        domain = domains.get(p.name)
        rows.append(
            f"| `{p.name}` | {code(repr(p.default))} | {cell(domain.describe()) if domain else ''} "
            f"| {cell(docs.get(p.name, ''))} |"
        )
    table = (
        ["| option | default | domain | what |", "| --- | --- | --- | --- |", *rows]
        if rows
        else ["This algorithm has no options of its own."]
    )
    return "\n".join(
        [
            f"# {name}",
            "",
            "```{eval-rst}",
            f".. automodule:: pfljax.algorithms.{name}",
            "   :no-members:",
            "```",
            "",
            "## Options",
            "",
            f"Keyword arguments of `pfljax.{name}.build(model, local, ...)`; in the binaries "
            f"`--config.{name}.<option>=value`. A numeric option outside its domain is refused "
            "(`ValueError` from `build`, exit 2 from the binaries).",
            "",
            *table,
            "",
            f"- Client-level differential privacy: {privacy_text(name)}.",
            f"- Server optimizer: {server_optimizer_text(name)}.",
            f"- Clients in host memory (`config.client_storage=host`): {host_storage_text(name)}.",
            "",
        ]
    )


def index_page() -> str:
    """The Markdown index of every algorithm page."""
    rows = [
        f"| [`{n}`]({n}.md) | {cell(algorithms.summary_line(n))} "
        f"| {'yes' if algorithms.supports_privacy(n) else 'no'} "
        f"| {'no' if algorithms.host_storage_refusal(n) else 'yes'} |"
        for n in algorithms.available()
    ]
    return "\n".join(
        [
            "# Algorithms",
            "",
            "Every algorithm is a module `pfljax.algorithms.<name>` (also `pfljax.<name>`) whose "
            "`build(model, local, **options)` returns an `Algorithm(init, round, evaluate)`; the "
            "binaries run it with `--config.algorithm=<name>`. These pages are generated from the "
            "modules: their docstrings, `build`'s signature and the options' domains. "
            "DP: client-level differential privacy; host: clients kept in host memory "
            "(with the default options).",
            "",
            "| algorithm | what | DP | host |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
            "```{toctree}",
            ":hidden:",
            "",
            *algorithms.available(),
            "```",
            "",
        ]
    )


def write_if_changed(path: str, text: str) -> None:
    """Writes `text` to `path` unless the file already holds it (keeps incremental builds)."""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def generate(srcdir: str) -> list[str]:
    """Writes the pages into `srcdir`/algorithms; returns the algorithm names."""
    out = os.path.join(srcdir, OUT_DIR)
    os.makedirs(out, exist_ok=True)
    names = algorithms.available()
    keep = {f"{n}.md" for n in names} | {"index.md"}
    for stale in set(os.listdir(out)) - keep:
        if stale.endswith(".md"):
            os.remove(os.path.join(out, stale))
    for n in names:
        write_if_changed(os.path.join(out, f"{n}.md"), algorithm_page(n))
    write_if_changed(os.path.join(out, "index.md"), index_page())
    return names


def _on_builder_inited(app) -> None:
    generate(app.srcdir)


def setup(app):
    app.connect("builder-inited", _on_builder_inited)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
