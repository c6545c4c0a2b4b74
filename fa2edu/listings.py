"""Read code beside the algorithm it implements: a function cut into the steps its comments cite.

Every algorithm in fa2edu and every kernel in kernels_gpu marks each step with a comment that cites the paper's
pseudo-code, ``# Alg. 1 line 9: …``. This module reads those comments back (defined for chapter 9, which sets the
NumPy forward pass beside its numba.cuda kernel):

* :func:`algorithm_steps` cuts a function's source into steps (:class:`Step`), one per citing comment (or run
  of consecutive citing comments);
* :func:`correspondence` pairs the steps of two implementations of one algorithm, line by line of the algorithm,
  and :func:`correspondence_markdown` renders the pairs as a Markdown table;
* :func:`listing` gives a function's source ready to print at a given width: the docstring shortened to its first
  line and the comments re-wrapped, the code itself untouched.

Everything is computed from the source files, so a table or a listing in the book cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import textwrap
import tokenize
from typing import Callable, NamedTuple

__all__ = ["Step", "Row", "algorithm_steps", "correspondence", "correspondence_markdown", "listing"]


class Step(NamedTuple):
    """One step of a function: a comment citing algorithm lines, and the code under it.

    Attributes
    ----------
    lines : tuple of int
        The algorithm lines the step's comments cite, ascending (``(13, 15)`` for ``# Alg. 1 lines 13, 15``).
    first : int
        Line number, in the source file, of the step's first comment line.
    last : int
        Line number, in the source file, of the step's last line.
    code : list of str
        The step's code lines, comments removed, indentation kept relative to the step's comment.
    """

    lines: tuple[int, ...]
    first: int
    last: int
    code: list[str]


class Row(NamedTuple):
    """One algorithm line and the steps of two implementations that cite it.

    Attributes
    ----------
    line : int
        The algorithm line.
    left : list of Step
        The steps of the first implementation that cite it, in source order (empty if none does).
    right : list of Step
        The steps of the second implementation that cite it.
    """

    line: int
    left: list[Step]
    right: list[Step]


def _citation(algorithm: int) -> re.Pattern:
    """``# Alg. 1 line 9``, ``# Alg. 1 lines 12-13``, ``# Alg. 1 lines 13, 15``, with or without a colon."""
    return re.compile(rf"^\s*#\s*Alg\.? {algorithm} lines? (\d+(?:\s*[-–,]\s*\d+)*)")


def _cited_lines(text: str) -> set[int]:
    """The algorithm line numbers of a citation's number list, ranges expanded: ``"12-13, 15"`` → {12, 13, 15}."""
    lines = set()
    for part in re.split(r"\s*,\s*", text.strip()):
        bounds = [int(b) for b in re.split(r"\s*[-–]\s*", part)]
        lines |= set(range(bounds[0], bounds[-1] + 1))
    return lines


def _comment_columns(text: str) -> dict[int, int]:
    """{line number in ``text`` (from 1): the column where its comment starts}, found by Python's tokenizer."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {tok.start[0]: tok.start[1] for tok in tokens if tok.type == tokenize.COMMENT}


def _opens_cited_block(source: list[str], k: int) -> bool:
    """Whether line ``k`` heads a block (``if active:``) whose body starts with a citing comment of its own.

    Such a header belongs to the step its body cites, not to the step above it; it is left out of both.
    """
    if not source[k].split("#")[0].rstrip().endswith(":"):
        return False
    following = next((line for line in source[k + 1:] if line.strip()), "")
    return re.match(r"\s*#\s*Alg\.? \d+ lines? \d", following) is not None


def algorithm_steps(function: Callable, algorithm: int = 1) -> list[Step]:
    """Cut a function's source into the steps that its comments attribute to lines of an algorithm.

    A step starts at a comment citing ``Alg. {algorithm} line(s) …``; consecutive citing comments start one step
    that cites all their lines. It runs to the next citing comment, a blank line, or the end of the block it is in
    (a line indented less than the comment). Code that no comment cites (set-up, the kernel's index arithmetic)
    belongs to no step.

    Parameters
    ----------
    function : callable
        A Python function (or a ``functools`` wrapper of one) whose source is available to :mod:`inspect`.
    algorithm : int, default 1
        The algorithm number the comments cite (``1`` for FA2 Algorithm 1, the forward pass).

    Returns
    -------
    list of Step
        In source order.
    """
    source, first_number = inspect.getsourcelines(inspect.unwrap(function))
    comments = _comment_columns("".join(source))
    citation = _citation(algorithm)
    steps: list[Step] = []
    current: dict | None = None
    previous_was_citation = False
    for number, text in enumerate(source, start=first_number):
        text = text.rstrip("\n")
        indent = len(text) - len(text.lstrip())
        match = citation.match(text)
        if match:
            if current is not None and previous_was_citation:
                current["lines"] |= _cited_lines(match.group(1))       # "line 8: …" then "line 9 (first part): …"
            else:
                current = {"lines": _cited_lines(match.group(1)), "first": number, "indent": indent, "code": []}
                steps.append(current)
            current["last"] = number
            previous_was_citation = True
            continue
        previous_was_citation = False
        if current is None:
            continue
        if not text.strip() or indent < current["indent"] or _opens_cited_block(source, number - first_number):
            current = None
            continue
        current["last"] = number
        code = text[:comments.get(number - first_number + 1, len(text))].rstrip()
        if code.strip():
            current["code"].append(code[current["indent"]:])
    return [Step(tuple(sorted(s["lines"])), s["first"], s["last"], s["code"]) for s in steps]


def correspondence(left: Callable, right: Callable, algorithm: int = 1) -> list[Row]:
    """Pair two implementations of one algorithm by the algorithm lines their comments cite.

    Parameters
    ----------
    left : callable
        The first implementation (chapter 9: :func:`fa2edu.flash2.flash2_forward`).
    right : callable
        The second implementation (chapter 9: the kernel factory ``kernels_gpu.flash2.forward_kernel``).
    algorithm : int, default 1
        The algorithm number both cite.

    Returns
    -------
    list of Row
        One row per algorithm line that either side cites, in order of the line.
    """
    left_steps, right_steps = algorithm_steps(left, algorithm), algorithm_steps(right, algorithm)
    cited = sorted({n for s in left_steps + right_steps for n in s.lines})
    return [Row(n, [s for s in left_steps if n in s.lines], [s for s in right_steps if n in s.lines])
            for n in cited]


def _cell(line: int, steps: list[Step], path: str, missing: str) -> str:
    """A table cell: each step's file lines, then its code lines as code spans, indentation kept.

    A step that cites several algorithm lines is shown once, in the row of the first; later rows point up to it.
    """
    if not steps:
        return f"*{missing}*"
    parts = []
    for step in steps:
        where = f"{path}:{step.first}" if step.last == step.first else f"{path}:{step.first}–{step.last}"
        if step.lines[0] < line:
            parts.append(f"<sub>{where}</sub><br>*the step of line {step.lines[0]}, above*")
            continue
        code = []
        for text in step.code:
            stripped = text.lstrip(" ")
            pad = "&nbsp;" * (len(text) - len(stripped))
            code.append(pad + "`" + stripped.replace("|", "\\|") + "`")
        parts.append(f"<sub>{where}</sub><br>" + "<br>".join(code))
    return "<br>".join(parts)


def correspondence_markdown(left: Callable, right: Callable, algorithm: int = 1, *, titles: tuple[str, str],
                            missing: dict[int, tuple[str, str]] | None = None) -> str:
    """:func:`correspondence` as a Markdown table: one row per algorithm line, each side's code for it.

    Parameters
    ----------
    left : callable
        The first implementation.
    right : callable
        The second implementation.
    algorithm : int, default 1
        The algorithm number both cite.
    titles : tuple of str
        The two code columns' headings, e.g. ``("NumPy", "numba.cuda kernel")``.
    missing : dict of int to tuple of str, optional
        For an algorithm line one side does not cite, what to say instead, ``{line: (left text, right text)}``
        (chapter 9: the kernel's outer loop is the launch grid). Default None: "(not cited)".

    Returns
    -------
    str
        The table, in GitHub-flavoured Markdown (code cells as code spans, rows separated by ``<br>``).
    """
    missing = missing or {}
    paths = [inspect.getsourcefile(inspect.unwrap(f)) for f in (left, right)]
    paths = ["/".join(re.split(r"[\\/]", p)[-2:]) for p in paths]
    header = f"| Alg. {algorithm} | {titles[0]} | {titles[1]} |\n| ---: | :--- | :--- |"
    rows = []
    for row in correspondence(left, right, algorithm):
        says = missing.get(row.line, ("(not cited)", "(not cited)"))
        left, right = _cell(row.line, row.left, paths[0], says[0]), _cell(row.line, row.right, paths[1], says[1])
        rows.append(f"| {row.line} | {left} | {right} |")
    return "\n".join([header] + rows)


def _reflow(code: str, width: int) -> str:
    """Fit the comments of ``code`` in ``width`` columns; the code lines stay as they are.

    A run of comment lines (one indentation, no citation ``Alg. …`` inside the run) that overflows is re-wrapped as
    one paragraph. A trailing comment that overflows moves two spaces after its code if it fits there, else above
    its code line, together with the comments that continue it on the next lines (``#  …``, one more space).
    """
    comments = _comment_columns(code + "\n")
    lines = code.splitlines()
    parsed = []                                                  # (indent, code part, comment text or None)
    for number, line in enumerate(lines, start=1):
        column = comments.get(number)
        body = line if column is None else line[:column].rstrip()
        text = None if column is None else line[column + 1:]
        parsed.append((line[:len(line) - len(line.lstrip())], body, text))

    def wrap(pad: str, text: str) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=f"{pad}# ", subsequent_indent=f"{pad}# ",
                             break_on_hyphens=False, break_long_words=False)

    out, k = [], 0
    while k < len(lines):
        pad, body, text = parsed[k]
        if text is not None and not body.strip():                # a run of comment lines
            end = k + 1
            while (end < len(lines) and parsed[end][2] is not None and not parsed[end][1].strip()
                   and parsed[end][0] == pad and not parsed[end][2].strip().startswith("Alg.")):
                end += 1
            if any(len(line) > width for line in lines[k:end]):
                out += wrap(pad, " ".join(parsed[j][2].strip() for j in range(k, end)))
            else:
                out += lines[k:end]
            k = end
        elif text is not None and len(lines[k]) > width and len(f"{body}  # {text.strip()}") <= width:
            out.append(f"{body}  # {text.strip()}")                # the comment fits closer to its code
            k += 1
        elif text is not None and len(lines[k]) > width:         # code, then a comment that overflows
            end, merged = k + 1, text.strip()
            while end < len(lines) and parsed[end][2] is not None and parsed[end][2].startswith("  "):
                merged += " " + parsed[end][2].strip()             # "#  …" continues the comment above
                end += 1
            out += wrap(pad, merged) + [body] + [parsed[j][1] for j in range(k + 1, end)]
            k = end
        else:
            out.append(lines[k])
            k += 1
    return "\n".join(out)


def listing(function: Callable, width: int = 88) -> tuple[str, int, int]:
    """A function's source, to print at ``width``: the docstring cut to its first line, comments re-wrapped.

    The code is the same program (the tests compare syntax trees); only comments, the docstring and whitespace
    inside comments change. Code lines longer than ``width`` are left as they are.

    Parameters
    ----------
    function : callable
        A Python function (or a ``functools`` wrapper of one).
    width : int, default 88
        The longest line wanted, in characters.

    Returns
    -------
    tuple
        ``(text, first, last)``: the dedented source, and the file line numbers it spans.
    """
    function = inspect.unwrap(function)
    source, first = inspect.getsourcelines(function)
    text = textwrap.dedent("".join(source))
    tree = ast.parse(text)
    node = tree.body[0]
    doc = ast.get_docstring(node, clean=False)
    lines = text.splitlines()
    start = node.body[0].lineno - 1 if doc is not None else 0
    if doc is not None and ("\n" in doc.strip() or len(lines[start]) > width):
        end = node.body[0].end_lineno                                   # 0-based start, end exclusive
        pad = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
        summary = inspect.cleandoc(doc).splitlines()[0]
        if "\n" in doc.strip():
            summary += " (Full docstring: the API reference.)"
        wrapped = textwrap.wrap(summary, width - 3, initial_indent=pad + '"""', subsequent_indent=pad)
        lines[start:end] = wrapped[:-1] + [wrapped[-1] + '"""']
    return _reflow("\n".join(lines), width), first, first + len(source) - 1
