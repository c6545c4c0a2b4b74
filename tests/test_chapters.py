"""The book executes: every chapter in ``chapters/`` runs top to bottom in a fresh kernel, and keeps the book's format.

Each chapter is a MyST Markdown notebook paired by jupytext (``chapters/NN_slug.md``). This test reads it with
jupytext, executes it with nbclient in a new ``python3`` kernel whose working directory is ``chapters/``, with
``MPLBACKEND=Agg`` (no display) and ``NUMBA_ENABLE_CUDASIM=1`` (numba's CUDA simulator: no GPU in CI). A chapter's
claims are assertions in its code cells, so executing it checks them; a cell that raises fails the test with the
cell's source and traceback. What the cells print must fit the page: no printed line wider than 96 characters.

A second, cheap test checks the format every chapter shares: the jupytext header, no stored outputs, and 2–4
exercises, each with a cell to try it in, a folded hint, and a worked solution whose code and output are folded
away in the built book (a ``hide-cell`` code cell, still executed here); an exercise that asks for code checks
it with ``fa2edu.exercises.check`` in both cells.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
jupyter_client = pytest.importorskip("jupyter_client")
yaml = pytest.importorskip("yaml")

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
CHAPTER_FILES = sorted(CHAPTERS.glob("[0-9][0-9]_*.md"))
IDS = [path.stem for path in CHAPTER_FILES]
#: A chapter's lab notebook: the history of its rungs, attempts and re-runs (``appendix_NN_slug.md``), executed as
#: the chapters are, with no exercises of its own.
APPENDIX_FILES = sorted(CHAPTERS.glob("appendix_[0-9][0-9]_*.md"))
BOOK_FILES = CHAPTER_FILES + APPENDIX_FILES
BOOK_IDS = [path.stem for path in BOOK_FILES]

#: Seconds one cell may run before the chapter fails (a chapter should take well under a minute in all).
CELL_TIMEOUT_S = 180
#: The widest line a cell may print (the built book's code width).
PRINT_WIDTH = 96


def ipc_kernel_manager(folder: str):
    """A manager for a ``python3`` kernel whose sockets are files in ``folder`` (ZeroMQ's ipc transport).

    With TCP, jupyter_client picks free ports, closes them and lets the kernel bind them a moment later; the test
    workers start kernels side by side, and one worker's kernel can take a port another's was just given ("Address
    already in use", "Kernel died before replying to kernel_info"). A folder of its own per kernel has no such race.
    ``folder`` should be short (a socket's path is limited to about 100 characters): a fresh ``/tmp`` folder is.
    """
    return jupyter_client.KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, "kernel"))


@pytest.mark.parametrize("path", BOOK_FILES, ids=BOOK_IDS)
def test_chapter_executes(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every code cell of the chapter in order in a clean kernel; any exception fails the test."""
    # The kernel is a child process: it inherits this environment.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    notebook = jupytext.read(path)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fa2edu-kernel-") as sockets:
        client = nbclient.NotebookClient(notebook, km=ipc_kernel_manager(sockets), timeout=CELL_TIMEOUT_S,
                                         kernel_name="python3", resources={"metadata": {"path": str(CHAPTERS)}})
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
    # What the cells print fits the built book's page.
    long = [(line[:60] + "…", len(line)) for cell in code_cells for out in cell.get("outputs", [])
            if out.get("output_type") == "stream" and out.get("name") == "stdout"
            for line in out.get("text", "").splitlines() if len(line) > PRINT_WIDTH]
    assert not long, f"{path.name}: printed lines wider than {PRINT_WIDTH} characters: {long}"


_HEADER = re.compile(r"\A---\n(?P<yaml>.*?)\n---\n", re.S)
_EXERCISE = re.compile(r"^\*\*Exercise (\d+)\.(\d+)\.\*\*", re.M)
_HINT = re.compile(r"<details>\s*<summary>\s*Hint\s*</summary>", re.I)
_SOLUTION = re.compile(r"<details>\s*<summary>\s*Solution\s*</summary>", re.I)
_CHECK = re.compile(r"""exercises\.check\(["']([\d.]+)["']""")
_HIDING_TAGS = {"hide-cell", "hide-input", "hide-output", "remove-cell", "remove-input", "remove-output"}


def _exercise_cells(notebook) -> list[tuple[str, list]]:
    """The "## Exercises" section split into exercises: [(id, the cells from its question to the next one)].

    A markdown cell may hold the end of the previous section, the heading and the first question; each piece of
    markdown is kept as a markdown pseudo-cell so that the checks below can read the section in order.
    """
    cells, inside = [], False
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            for piece in re.split(r"(?m)^(?=## )", cell.source):
                if piece.startswith("## "):
                    inside = piece.startswith("## Exercises")
                if inside:
                    for part in re.split(r"(?m)^(?=\*\*Exercise \d+\.\d+\.\*\*)", piece):
                        if part.strip():
                            cells.append(("markdown", part, {}))
        elif inside:
            cells.append(("code", cell.source, cell.metadata))
    exercises = []
    for kind, source, meta in cells:
        match = _EXERCISE.match(source) if kind == "markdown" else None
        if match:
            exercises.append((f"{match.group(1)}.{match.group(2)}", []))
        if exercises:
            exercises[-1][1].append((kind, source, meta))
    return exercises


def _check_exercise(name: str, exercise_id: str, cells: list) -> None:
    """Question, a try cell, a folded hint, a folded solution, and the solution's code hidden behind a toggle."""
    from fa2edu import exercises as checkers

    where = f"{name}, exercise {exercise_id}"
    kinds = [kind for kind, _, _ in cells]
    assert kinds[:2] == ["markdown", "code"], f"{where}: the question must be followed by a code cell to try it in"
    try_source, try_meta = cells[1][1], cells[1][2]
    assert not _HIDING_TAGS & set(try_meta.get("tags", [])), f"{where}: the try cell must be visible"
    assert "assert" not in try_source, f"{where}: the try cell is the reader's, not the solution"
    markdown = "\n".join(source for kind, source, _ in cells[2:] if kind == "markdown")
    assert _HINT.search(markdown), f"{where}: needs a folded hint (<details><summary>Hint</summary>)"
    assert _SOLUTION.search(markdown), f"{where}: needs a folded solution (<details><summary>Solution</summary>)"
    hidden = [(source, meta) for kind, source, meta in cells[2:] if kind == "code"]
    assert hidden, f"{where}: needs the solution's code in a code cell after the folded solution"
    for _source, meta in hidden:
        assert "hide-cell" in meta.get("tags", []), f"{where}: the solution's code cell must be tagged hide-cell"
        folded = meta.get("jupyter", {})
        assert folded.get("source_hidden") is True and folded.get("outputs_hidden") is True, \
            f"{where}: the solution's code cell must be folded in JupyterLab (jupyter: source_hidden, outputs_hidden)"
        prompt = meta.get("mystnb", {}).get("code_prompt_show", "")
        assert "solution" in prompt.lower(), f"{where}: the hidden cell's toggle must say it shows the solution"
    checked = set(_CHECK.findall(try_source))
    assert checked <= {exercise_id}, f"{where}: the try cell checks exercise {checked}"
    if checked:
        assert exercise_id in checkers.EXERCISES, f"{where}: fa2edu.exercises has no checker for {exercise_id}"
        assert "NotImplementedError" in try_source, f"{where}: the try cell's stub must raise NotImplementedError"
        assert any(f'assert exercises.check("{exercise_id}"' in source for source, _ in hidden), \
            f"{where}: the solution must pass its own checker (assert exercises.check(...))"


@pytest.mark.parametrize("path", BOOK_FILES, ids=BOOK_IDS)
def test_chapter_format(path: Path) -> None:
    """The shared format: a jupytext MyST header with the python3 kernel, no outputs, 2–4 exercises."""
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
    # Every folded cell is folded in JupyterLab too: the site reads the tags, JupyterLab the cell's "jupyter"
    # metadata (a hide-cell folds code and output, a hide-input its code).
    for cell in notebook.cells:
        tags = set(cell.metadata.get("tags", []))
        shown = cell.metadata.get("jupyter", {})
        if cell.cell_type == "code" and tags & {"hide-cell", "hide-input"}:
            assert shown.get("source_hidden") is True, \
                f"{path.name}: a {sorted(tags)} cell needs jupyter: {{source_hidden: true}} ({cell.source[:40]!r}…)"
        if cell.cell_type == "code" and "hide-cell" in tags:
            assert shown.get("outputs_hidden") is True, \
                f"{path.name}: a hide-cell cell needs jupyter: {{outputs_hidden: true}} ({cell.source[:40]!r}…)"
    # The preface is a map, not a lesson, and an appendix is a lab notebook: neither has exercises.
    if path.stem.startswith(("00_", "appendix_")):
        return
    exercises = _exercise_cells(notebook)
    ids = [exercise_id for exercise_id, _ in exercises]
    number = int(path.stem[:2])
    assert 2 <= len(ids) <= 4, f"{path.name} has {len(ids)} exercises in its Exercises section; a chapter has 2-4"
    assert ids == [f"{number}.{k}" for k in range(1, len(ids) + 1)], f"{path.name}: exercises numbered {ids}"
    for exercise_id, cells in exercises:
        _check_exercise(path.name, exercise_id, cells)


def test_format_check_rejects_a_broken_exercise() -> None:
    """The exercise check above is not a rubber stamp: each missing part of an exercise fails it."""
    good = """## Exercises

**Exercise 3.1.** Question.

```{code-cell} ipython3
# Your code here.
```

<details><summary>Hint</summary>

A hint.

</details>

<details><summary>Solution</summary>

The answer.

</details>

```{code-cell} ipython3
---
jupyter:
  outputs_hidden: true
  source_hidden: true
mystnb:
  code_prompt_show: Show the solution's code and output
tags: [hide-cell]
---
print(42)
```
"""
    def check(text):
        (exercise_id, cells), = _exercise_cells(jupytext.reads(text, fmt="md:myst"))
        _check_exercise("synthetic", exercise_id, cells)

    check(good)
    broken = {
        "no try cell": good.replace("```{code-cell} ipython3\n# Your code here.\n```\n", ""),
        "no hint": good.replace("<summary>Hint</summary>", "<summary>Note</summary>"),
        "solution not hidden": good.replace("tags: [hide-cell]", "tags: [hide-input]"),
        "solution not folded in JupyterLab": good.replace("  source_hidden: true\n", ""),
        "unchecked id": good.replace("# Your code here.", 'exercises.check("3.1", f)\nraise NotImplementedError'),
    }
    for what, text in broken.items():
        with pytest.raises(AssertionError):
            check(text)
            pytest.fail(f"the format check accepted an exercise with {what}")


def test_there_are_chapters() -> None:
    """The parametrised tests above would silently collect nothing if the chapters went missing."""
    assert CHAPTER_FILES, f"no chapters found in {CHAPTERS}"
    numbers = [path.stem[:2] for path in CHAPTER_FILES]
    assert len(set(numbers)) == len(numbers), f"two chapters share a number: {numbers}"
