"""Messages that say what to do: lists and rows as messages name them; the names closest to a misspelled one ("did you mean"), and
the line of a YAML file that is actually wrong when the parser reports a later one."""

from __future__ import annotations

import difflib
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import yaml

# a YAML file longer than this is not searched for the faulty line (the mark is reported)
_SEARCH_CHARS_MAX = 200_000
# content lines above the parser's mark tried as the faulty one
_SEARCH_LINES = 40
# the trials' parser: libyaml's when PyYAML has it (the same marks, 10 times faster)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# what PyYAML says of a bracket or quote left open (the fault is where it opens)
_UNCLOSED = ("while parsing a flow", "while scanning a quoted scalar")
# what PyYAML says of a line indented wrongly (the other errors are on the line they mark)
_LAYOUT_PROBLEMS = (
    "mapping values are not allowed here",
    "expected <block end>",
    "could not find expected ':'",
    "did not find expected key",
    "did not find expected '-' indicator",
    "expected '<document start>'",
)


def did_you_mean(name: str, choices: Iterable[object], n: int = 2) -> str:
    """The hint " (did you mean 'sex'?)" naming the one or two choices closest to name (the
    same name in another case first, then difflib's close matches, case ignored), or ""."""
    names = [str(c) for c in dict.fromkeys(choices) if str(c) != name]
    by_lower: dict[str, list[str]] = {}
    for c in names:
        by_lower.setdefault(c.lower(), []).append(c)
    hits = list(by_lower.get(name.lower(), []))
    if not hits:
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)
        hits = [c for low in close for c in by_lower[low]]
    if not hits:
        return ""
    return " (did you mean " + " or ".join(repr(h) for h in hits[:n]) + "?)"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    text = line.strip()
    return bool(text) and not text.startswith("#")


def _top_level(line: str) -> bool:
    """A top-level key ('stages:'): YAML's block structure starts afresh there."""
    return bool(line[:1].strip()) and not line.startswith(("#", "-", "]", "}", '"', "'"))


def _parses_past(lines: list[str], line: int, start: int) -> bool:
    """Whether YAML reads lines[start:] without an error before line + 2 (0-based). Only
    lines[start : line + 6] are read: start is a top-level key (column 0), where YAML's
    structure begins afresh."""
    try:
        for _ in yaml.parse("\n".join(lines[start : line + 6]), Loader=_LOADER):
            pass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        return mark is not None and start + mark.line > line + 1
    except yaml.YAMLError:
        return False
    return True


def _reindented(lines: list[str], i: int, problem: int, step: int, start: int) -> int | None:
    """The indentation that makes line i read without the error at line `problem`: that of the
    content line above it, below it, of the problem line, or of a line it may belong beside or
    under (the lines above with less indentation, and one step inside them); None when none."""
    above = next((lines[j] for j in range(i - 1, -1, -1) if _content(lines[j])), None)
    below = next((lines[j] for j in range(i + 1, len(lines)) if _content(lines[j])), None)
    tries = [_indent(x) for x in (above, below, lines[problem]) if x is not None]
    outer = _indent(lines[i]) + step
    for j in range(i - 1, -1, -1):  # the enclosing lines, innermost first
        if _content(lines[j]) and _indent(lines[j]) < outer:
            outer = _indent(lines[j])
            tries += [outer + step, outer]
            if outer == 0:
                break
    for width in dict.fromkeys(tries):
        if width == _indent(lines[i]):
            continue
        trial = list(lines)
        trial[i] = " " * width + lines[i].lstrip(" ")
        if _parses_past(trial, problem, start):
            return width
    return None


def _step(lines: list[str]) -> int:
    """The file's indentation step: the gcd of the widths used on two lines or more."""
    used = Counter(_indent(x) for x in lines if _content(x))
    return math.gcd(*[w for w, n in used.items() if n > 1 and w > 0]) or 2


def _opens_block(line: str) -> bool:
    """Whether a line opens a block for the lines below it ('key:' or a bare '-')."""
    text = line.split(" #")[0].strip()
    return text.endswith(":") or text == "-"


def _child_width(lines: list[str], i: int, width: int, step: int) -> bool:
    """Whether line i at this width sits one step inside the nearest line above that opens a
    block at a smaller width (its parent)."""
    for j in range(i - 1, -1, -1):
        if _content(lines[j]) and _indent(lines[j]) < width and _opens_block(lines[j]):
            return width == _indent(lines[j]) + step
    return width == 0


def _likelihood(
    lines: list[str], fix: tuple[int, int], problem: int, step: int
) -> tuple[int, int, int]:
    """How likely re-indenting line fix[0] to fix[1] is the fix, when two lines that disagree
    both make the file read: first the line off the file's indentation step moved onto it, then
    the line moved to one step inside its parent, then a line above the mark aligned with the
    marked line (the parser marks the sibling after a mis-indented key that opens a mapping)."""
    i, width = fix
    old = _indent(lines[i])
    onto_step = old % step != 0 and width % step == 0
    onto_child = _child_width(lines, i, width, step) and not _child_width(lines, i, old, step)
    aligned = i < problem and width == _indent(lines[problem])
    return int(onto_step), int(onto_child), int(aligned)


def faulty_yaml_line(text: str, err: yaml.MarkedYAMLError) -> tuple[int, int, int | None]:
    """(line, column, indentation that fixes it or None), 0-based, of the line that is wrong.

    The parser marks where it could not go on: after a mis-indented key that opens a mapping,
    that is the next, correctly indented sibling (a key at 5 spaces among keys at 4 is marked on
    the key below it). The faulty line is the last content line, from the marked one back,
    whose re-indentation (as the line above, the line below, or the marked line) lets the
    file read past the mark; when no single re-indentation does, the marked line."""
    mark = err.problem_mark or err.context_mark
    lines = text.splitlines()
    if mark is None or not lines:
        return 0, 0, None
    problem = min(mark.line, len(lines) - 1)
    layout = any(p in str(err.problem) for p in _LAYOUT_PROBLEMS)
    if layout and len(text) <= _SEARCH_CHARS_MAX and "\t" not in lines[problem]:
        above = [i for i in range(problem - 1, -1, -1) if _content(lines[i])][:_SEARCH_LINES]
        step = _step(lines)
        top = [j for j in range(min([*above, problem]) - 1, -1, -1) if _top_level(lines[j])]
        start = top[0] if top else 0
        fixes = []  # (line, width): each single re-indentation that reads past the mark
        for i in [*above, problem]:  # the lines above first: the mark is on or after the fault
            width = _reindented(lines, i, problem, step, start)
            if width is not None:
                fixes.append((i, width))
        if fixes:
            i, width = max(fixes, key=lambda f: _likelihood(lines, f, problem, step))
            return i, _indent(lines[i]), width
    return problem, mark.column if mark.line == problem else 0, None


def yaml_error_text(text: str, err: yaml.YAMLError, name: str) -> str:
    """'spec.yaml:35: what is wrong; the fix', then the line and a caret under the fault."""
    if not isinstance(err, yaml.MarkedYAMLError) or (err.problem_mark or err.context_mark) is None:
        return f"{name}: not valid YAML: {err}"
    line, col, width = faulty_yaml_line(text, err)
    lines = text.splitlines() or [""]
    opened = err.context_mark
    if width is None and opened is not None and str(err.context).startswith(_UNCLOSED):
        if opened.line < line and opened.line < len(lines):  # the bracket or quote left open
            line, col = opened.line, opened.column
    mark = err.problem_mark or err.context_mark
    said = f"YAML stopped at line {mark.line + 1}: {err.problem or err.context}".rstrip()
    if width is not None:
        what = (
            f"this line is indented by {col} spaces where its block needs {width}; indent it by "
            f"{width} spaces, as the lines beside it ({said})"
        )
    elif "\t" in lines[line]:
        what = f"a tab in the indentation; indent with spaces only ({said})"
    elif line == (opened.line if opened is not None else -1) and line != mark.line:
        sign = lines[line][col : col + 1]
        ends = {"[": "list", "{": "mapping"}.get(sign, "text")
        what = f"this {sign} is never closed; close it where its {ends} ends ({said})"
    else:
        what = f"{said}; correct this line (quotes and brackets must pair up, ': ' after a key)"
    shown = lines[line].rstrip().replace("\t", " ")
    gutter = f"{line + 1} | "
    return (
        f"{name}:{line + 1}: {what}\n"
        f"      {gutter}{shown}\n"
        f"      {' ' * (len(gutter) - 2)}| {' ' * col}^"
    )


def short_list(items: Any, n: int = 12) -> str:
    """'a, b, c, ... (40 in all)': the first n items of a list, for a message."""
    items = [str(x) for x in items]
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def rows_text(mask: np.ndarray | pd.Series, values: pd.Series | None = None, n: int = 5) -> str:
    """'rows 3, 17 (values 'abc', 'x')': the first n records where mask holds, numbered from 1
    in file order (CSV line = row + 1), never by identifier (messages reach logs)."""
    pos = np.flatnonzero(np.asarray(mask, dtype=bool))
    more = f", ... ({len(pos)} in all)" if len(pos) > n else ""
    text = "rows " + ", ".join(str(int(i) + 1) for i in pos[:n]) + more
    if values is not None:
        vals = values.iloc[pos[:n]].tolist()
        text += " (values " + ", ".join(repr(v) for v in vals) + ")"
    return text
