"""Chapter code fits the page: no line of code in a chapter is wider than 88 characters.

The book's content column is about 700 px wide, which shows some 88 characters of code before a code block
scrolls sideways (and a reader of a scrolled block loses the end of the line). So every line of every code cell
(```` ```{code-cell} ````), and every line of code quoted in the text (a fenced block such as ```` ```python ````,
solutions included), is at most :data:`LIMIT` characters.

Each chapter is one test that lists **all** its offending lines at once, with their line numbers, so one run
shows everything to reflow. The fences are parsed here (not by jupytext) to keep line numbers; the parse is
checked against jupytext's own count of code cells.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
CHAPTER_FILES = sorted(CHAPTERS.glob("[0-9][0-9]_*.md")) + sorted(CHAPTERS.glob("appendix_[0-9][0-9]_*.md"))
IDS = [path.stem for path in CHAPTER_FILES]

#: The widest line of code a chapter may show, in characters.
LIMIT = 88

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*?)\s*$")
#: MyST directives whose body is code (the rest, e.g. ``{note}``, hold Markdown: their lines are text).
_CODE_DIRECTIVES = ("{code-cell}", "{code-block}", "{code}", "{sourcecode}")


def code_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """The code blocks of a MyST Markdown text: (kind, first body line number, body lines).

    ``kind`` is ``"code cell"`` for ```` ```{code-cell} ```` and ``"code in the text"`` for any other fence
    whose body is code (no info string, a language name, or a code directive). Fences of other directives
    (``{note}``, ``{admonition}``, …) are transparent: their bodies are scanned for code blocks in turn.
    A code cell's option lines (``:tags: …`` or a ``---`` YAML block) are not code and are left out.
    """
    lines = text.splitlines()
    blocks: list[tuple[str, int, list[str]]] = []
    open_directives: list[tuple[str, int]] = []        # (fence character, fence length) of enclosing directives
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match["fence"], match["info"]
        if open_directives and not info and fence[0] == open_directives[-1][0] \
                and len(fence) >= open_directives[-1][1]:
            open_directives.pop()                        # the end of an enclosing directive
            i += 1
            continue
        directive = info.split()[0] if info.startswith("{") else ""
        if directive and not directive.startswith(_CODE_DIRECTIVES):
            open_directives.append((fence[0], len(fence)))
            i += 1
            continue
        # A code block: the body runs to the first closing fence of the same character, at least as long.
        kind = "code cell" if directive.startswith("{code-cell}") else "code in the text"
        body_start = i + 1
        j = body_start
        while j < len(lines):
            close = _FENCE.match(lines[j])
            if close and not close["info"] and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence):
                break
            j += 1
        body = lines[body_start:j]
        if directive:                                    # skip the directive's options
            if body and body[0].strip() == "---":
                end = next((k for k in range(1, len(body)) if body[k].strip() == "---"), 0)
                body_start, body = body_start + end + 1, body[end + 1:]
            while body and re.match(r"^:[\w-]+:", body[0]):
                body_start, body = body_start + 1, body[1:]
        blocks.append((kind, body_start + 1, body))
        i = j + 1
    return blocks


def offenders(path: Path, limit: int = LIMIT) -> list[str]:
    """Every code line of the chapter wider than ``limit``, as ``file:line: (width, kind) text``."""
    found = []
    for kind, first, body in code_blocks(path.read_text(encoding="utf-8")):
        for number, line in enumerate(body, start=first):
            if len(line) > limit:
                found.append(f"{path.name}:{number}: ({len(line)} > {limit}, {kind}) {line.strip()[:60]}…")
    return found


@pytest.mark.parametrize("path", CHAPTER_FILES, ids=IDS)
def test_chapter_code_fits_the_page(path: Path) -> None:
    """Every line of code the chapter shows is at most 88 characters; the failure lists every offender."""
    found = offenders(path)
    if found:
        pytest.fail(f"{len(found)} line(s) of code wider than {LIMIT} characters in {path.name} "
                    "(reflow them):\n" + "\n".join(found), pytrace=False)


@pytest.mark.parametrize("path", CHAPTER_FILES, ids=IDS)
def test_the_fence_parser_finds_every_code_cell(path: Path) -> None:
    """The parse above agrees with jupytext: the same code cells, with the same source lines."""
    jupytext = pytest.importorskip("jupytext")
    text = path.read_text(encoding="utf-8")
    cells = [cell.source.splitlines() for cell in jupytext.reads(text, fmt="md:myst").cells
             if cell.cell_type == "code"]
    parsed = [body for kind, _, body in code_blocks(text) if kind == "code cell"]
    assert len(parsed) == len(cells), f"{path.name}: parsed {len(parsed)} code cells, jupytext {len(cells)}"
    for ours, theirs in zip(parsed, cells):
        assert [line for line in ours if line.strip()] == [line for line in theirs if line.strip()]


def test_the_parser_on_a_sample(tmp_path: Path) -> None:
    """Options, nested directives and quoted code are told apart; a long line is reported with its number."""
    wide = "x = " + "1 + " * 25 + "1"                          # 104 characters
    sample = "\n".join([
        "text " * 30,                                          # 1: prose may be wide
        "```{code-cell} ipython3",                             # 2
        ":tags: [hide-input]",                                 # 3: an option, not code
        "",                                                    # 4
        "y = 2",                                               # 5
        "```",                                                 # 6
        "````{note}",                                          # 7: a directive holding Markdown ...
        "A note " * 20,                                        # 8: ... whose prose may be wide
        "```python",                                           # 9
        wide,                                                  # 10: ... and code that may not
        "```",                                                 # 11
        "````",                                                # 12
        "```{code-cell} ipython3",                             # 13
        "---",                                                 # 14
        "tags: [" + "a, " * 40 + "b]",                         # 15: YAML options, not code
        "---",                                                 # 16
        wide,                                                  # 17
        "```",                                                 # 18
    ])
    blocks = code_blocks(sample)
    assert [(kind, first) for kind, first, _ in blocks] == [("code cell", 4), ("code in the text", 10),
                                                            ("code cell", 17)]
    assert blocks[0][2] == ["", "y = 2"] and blocks[2][2] == [wide]
    path = tmp_path / "99_sample.md"
    path.write_text(sample, encoding="utf-8")
    found = offenders(path)
    assert [line.split(":")[1] for line in found] == ["10", "17"]
    assert all(f"({len(wide)} > {LIMIT}" in line for line in found)
