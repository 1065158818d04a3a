"""Sphinx extension: pfljax's plain-text docstrings as reStructuredText.

The docstrings are written to be read as plain text (Google-style sections,
`code` in backticks, "- " lists right after the line that introduces them,
formulas and examples indented under a line). On `autodoc-process-docstring`,
before napoleon reads the Google sections, this turns that convention into
valid reStructuredText, so that the build needs no change to the code:

- a list that starts or ends without a blank line gets one (nested lists too);
- an indented block (a formula under a line, an example after a blank line)
  becomes a literal block, shown as written;
- outside `code` spans, characters that reStructuredText reads as markup in
  plain text (`*`, `|`, a trailing `_`, a backslash) are escaped.

The lines of napoleon's sections ("Args:", "Returns:", ...) are only escaped:
napoleon lays them out. NamedTuple fields' generated docstrings ("Alias for field
number 0") are left out: the class's Attributes section describes the fields.
"""

from __future__ import annotations

import re

SECTIONS = re.compile(
    r"\s*(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters|Returns|Return|"
    r"Yields|Yield|Raises|Raise|Attributes|Methods|Warns|Example|Examples|Note|Notes|Warning|"
    r"Warnings|See Also|References|Todo):\s*$"
)
ITEM = re.compile(r"(\s*)([-+*]|\d+\.|\([a-z]\))\s+\S")
CODE_SPAN = re.compile(r"``.*?``|`[^`]*`")
ESCAPE = re.compile(r"\\|\*|\||(?<=[\w\]])_(?!\w)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _kind(marker: str) -> str:
    """A list marker's kind: items of one list share it ("-", "1.", "(a)")."""
    return "1." if marker[0].isdigit() else "(a)" if marker.startswith("(") else marker


def escape(text: str, in_code: bool = False) -> tuple[str, bool]:
    """`text` with markup characters escaped outside `code` spans; `in_code`: whether
    the line starts (and returns whether the next one starts) inside a span that
    crosses a line end."""
    out, pos = [], 0
    if in_code:
        end = text.find("`")
        if end < 0:
            return text, True
        out.append(text[: end + 1])
        pos = end + 1
    while pos < len(text):
        match = CODE_SPAN.search(text, pos)
        plain_end = match.start() if match else len(text)
        plain = text[pos:plain_end]
        tick = plain.find("`")
        if tick >= 0:  # a span opened here and closed on a later line
            out.append(ESCAPE.sub(lambda m: "\\" + m.group(0), plain[:tick]) + text[pos + tick :])
            return "".join(out), True
        out.append(ESCAPE.sub(lambda m: "\\" + m.group(0), plain))
        if not match:
            break
        out.append(match.group(0))
        pos = match.end()
    return "".join(out), False


def to_rst(lines: list[str]) -> list[str]:
    """The docstring `lines` (already dedented) as reStructuredText lines."""
    out: list[str] = []
    items: list[tuple[int, int, str]] = []  # (marker indent, text indent, kind) of the open items
    literal: int | None = None  # indent that a literal block's lines exceed
    section: int | None = None  # indent of an open napoleon section header
    in_code, prev_blank = False, True

    def blank() -> None:
        if out and out[-1].strip():
            out.append("")

    def open_literal(base: int) -> None:
        nonlocal literal
        blank()
        out.extend([" " * base + "::", ""])
        literal = base

    for line in lines:
        if not line.strip():
            out.append(line)
            in_code, prev_blank = False, True
            continue
        d = _indent(line)
        if literal is not None:
            if d > literal:
                out.append(line)
                continue
            literal, prev_blank = None, True
            blank()
        if section is not None:
            if d > section:
                text, in_code = escape(line, in_code)
                out.append(text)
                prev_blank = False
                continue
            section, prev_blank = None, True
            blank()
        if not items and SECTIONS.fullmatch(line):
            blank()
            out.append(line)
            section, in_code, prev_blank = d, False, False
            continue
        item = ITEM.match(line)
        kind = _kind(item.group(2)) if item else None
        popped = False
        while items and (d < items[-1][1]) and not (item and d == items[-1][0] and kind == items[-1][2]):
            items.pop()
            popped = True
        if popped and not (item and items and d == items[-1][0] and kind == items[-1][2]):
            blank()
            prev_blank = True
        if item:
            text_indent = item.end() - 1
            if items and d == items[-1][0] and kind == items[-1][2]:
                items[-1] = (d, text_indent, kind)
            else:
                if not prev_blank:
                    blank()
                items.append((d, text_indent, kind))
        elif items:
            if d > items[-1][1]:
                open_literal(items[-1][1])
        elif d > 0:
            open_literal(0)
        if literal is not None:
            out.append(line)
        else:
            head = item.end() - 1 if item else 0  # a list item's marker stays markup
            text, in_code = escape(line[head:], in_code)
            out.append(line[:head] + text)
        prev_blank = False
    return out


def _process(app, what, name, obj, options, lines) -> None:
    lines[:] = to_rst(list(lines))


def _skip(app, what, name, obj, skip, options):
    """Leaves out NamedTuple fields' generated docstrings ("Alias for field number 0"):
    the class's Attributes section says what each field is."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip)
    # Before napoleon (priority 500), which reads the Google sections.
    app.connect("autodoc-process-docstring", _process, priority=400)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
