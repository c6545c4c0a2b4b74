"""The book executes: every chapter in ``chapters/`` runs top to bottom in a fresh kernel, and keeps the book's format.

Each chapter is a MyST Markdown notebook paired by jupytext (``chapters/NN_slug.md``). This test reads it with
jupytext, executes it with nbclient in a new ``python3`` kernel whose working directory is ``chapters/``, with
``MPLBACKEND=Agg`` (no display) and ``NUMBA_ENABLE_CUDASIM=1`` (numba's CUDA simulator: no GPU in CI). A chapter's
claims are assertions in its code cells, so executing it checks them; a cell that raises fails the test with the
cell's source and traceback.

A second, cheap test checks the format every chapter shares: the jupytext header, no stored outputs, and 2–4
exercises, each with a worked solution a reader can reveal.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
CHAPTER_FILES = sorted(CHAPTERS.glob("[0-9][0-9]_*.md"))
IDS = [path.stem for path in CHAPTER_FILES]

#: Seconds one cell may run before the chapter fails (a chapter should take well under a minute in all).
CELL_TIMEOUT_S = 180


@pytest.mark.parametrize("path", CHAPTER_FILES, ids=IDS)
def test_chapter_executes(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every code cell of the chapter in order in a clean kernel; any exception fails the test."""
    # The kernel is a child process: it inherits this environment.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    notebook = jupytext.read(path)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(CHAPTERS)}})
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed to execute:\n{error}", pytrace=False)
    elapsed = time.perf_counter() - start
    print(f"{path.name}: executed in {elapsed:.1f} s")
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells, f"{path.name} has no code cell: a chapter teaches by running code"
    # Every code cell ran (nbclient numbers them as it executes).
    assert all(cell.get("execution_count") for cell in code_cells if cell.source.strip()), \
        f"{path.name}: some code cells were not executed"


_HEADER = re.compile(r"\A---\n(?P<yaml>.*?)\n---\n", re.S)
_SOLUTION = re.compile(r"<details>\s*<summary>\s*Solution\b", re.I)


@pytest.mark.parametrize("path", CHAPTER_FILES, ids=IDS)
def test_chapter_format(path: Path) -> None:
    """The shared format: a jupytext MyST header with the python3 kernel, no outputs, 2–4 revealable solutions."""
    text = path.read_text(encoding="utf-8")
    header = _HEADER.match(text)
    assert header, f"{path.name} must start with a YAML front-matter block (the jupytext header)"
    meta = yaml.safe_load(header.group("yaml")) or {}
    fmt = meta.get("jupytext", {}).get("text_representation", {}).get("format_name")
    assert fmt == "myst", f"{path.name}: the jupytext header must say format_name: myst, got {fmt!r}"
    kernel = meta.get("kernelspec", {}).get("name")
    assert kernel == "python3", f"{path.name}: the kernelspec must be python3, got {kernel!r}"
    notebook = jupytext.reads(text, fmt="md:myst")
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{path.name} stores outputs: chapters are kept without them so that diffs stay readable"
    solutions = len(_SOLUTION.findall(text))
    # The preface is a map, not a lesson: it needs no exercises.
    if not path.stem.startswith("00_"):
        assert 2 <= solutions <= 4, f"{path.name} has {solutions} revealable solutions; a chapter has 2-4 exercises"


def test_there_are_chapters() -> None:
    """The parametrised tests above would silently collect nothing if the chapters went missing."""
    assert CHAPTER_FILES, f"no chapters found in {CHAPTERS}"
    numbers = [path.stem[:2] for path in CHAPTER_FILES]
    assert len(set(numbers)) == len(numbers), f"two chapters share a number: {numbers}"
