"""The book from the README's own route: a fresh virtual environment, the README's notebook commands, every chapter.

The chapter test (``test_chapters.py``) runs in the test environment, which has every extra installed and the CUDA
simulator switched on by ``conftest.py``; a learner has neither. This test is the learner: it copies the tracked
files of this checkout (what a fresh clone holds) into a temporary folder, makes a new virtual environment there,
runs the ``pip install`` commands of the README's "Reading the book" block (and nothing else: no torch, no
``NUMBA_ENABLE_CUDASIM``, no ``PYTHONPATH``), and executes every chapter and appendix top to bottom in that
environment's Jupyter kernel, as JupyterLab would. Cells that need PyTorch must skip themselves (``%%needs torch``),
and kernels_gpu must choose numba's simulator by itself on a machine without a GPU.

It takes several minutes (an install and a full run of the book), so it runs only when asked:
``FA2EDU_BOOK_ROUTE=1 python3 -m pytest tests/test_book_route.py``. CI asks for it on every run (``.ci/run``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

slow_route = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("FA2EDU_BOOK_ROUTE") != "1",
                       reason="the README's notebook route in a fresh venv takes minutes: FA2EDU_BOOK_ROUTE=1 runs it"),
]

#: Seconds one cell may run (the simulator chapters are slow on a 2-core machine).
CELL_TIMEOUT_S = 600


def route_commands(readme: str) -> list[str]:
    """The shell commands of the README's book route: the ```bash block that follows "## Reading the book"."""
    section = readme.split("## Reading the book", 1)
    if len(section) != 2:
        raise AssertionError("README.md has no '## Reading the book' section")
    block = re.search(r"```bash\n(.*?)```", section[1], re.S)
    if block is None:
        raise AssertionError("README.md's 'Reading the book' section has no ```bash block")
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def test_route_commands_are_read_from_the_readme() -> None:
    """The parser finds the install and the lab command, so the route below is the one the README prints."""
    commands = route_commands(README.read_text(encoding="utf-8"))
    assert any("pip install" in command and ".[notebooks]" in command for command in commands), commands
    assert any("scripts/lab.sh" in command for command in commands), commands


EXECUTE = textwrap.dedent('''
    """Execute one notebook in this environment's python3 kernel; print its time, exit 1 with the error."""
    import os, sys, tempfile, time
    from pathlib import Path
    import jupyter_client, jupytext, nbclient
    path = Path(sys.argv[1])
    notebook = jupytext.read(path)
    start = time.perf_counter()
    # The kernel's sockets are files in a folder of its own (ipc), not TCP ports: two chapters start kernels side
    # by side, and with TCP one kernel can take the port the other was just given.
    with tempfile.TemporaryDirectory(prefix="fa2edu-kernel-") as sockets:
        manager = jupyter_client.KernelManager(kernel_name="python3", transport="ipc",
                                               ip=os.path.join(sockets, "kernel"))
        client = nbclient.NotebookClient(notebook, km=manager, timeout=int(sys.argv[2]), kernel_name="python3",
                                         resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
        except nbclient.exceptions.CellExecutionError as error:
            print(f"{path.name} FAILED:\\n{error}"[:6000])
            sys.exit(1)
    print(f"{path.name}: {time.perf_counter() - start:.0f} s")
''')


def _learner_environment(home: Path) -> dict:
    """The environment a learner's shell has: none of the test suite's settings."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("NUMBA_", "PYTHON", "FA2EDU_", "HYPOTHESIS", "PYTEST", "MPLBACKEND", "VIRTUAL_ENV",
                                  "JUPYTER"))}
    env["HOME"] = str(home)
    return env


@slow_route[0]
@slow_route[1]
def test_every_chapter_runs_on_the_readme_route(tmp_path: Path) -> None:
    commands = route_commands(README.read_text(encoding="utf-8"))
    # What a fresh clone holds: the tracked files (with this checkout's changes to them).
    clone = tmp_path / "fa2edu"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in files.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file() and not source.is_symlink():
            target = clone / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
        elif name and source.is_symlink():
            target = clone / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.readlink(source))
    venv = tmp_path / "venv"
    home = tmp_path / "home"
    home.mkdir()
    env = _learner_environment(home)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    for command in commands:
        if "scripts/lab.sh" in command:
            continue       # starts a server: the chapters are executed below in the kernel it would start
        result = subprocess.run(command, shell=True, cwd=clone, env=env, capture_output=True, text=True)
        assert result.returncode == 0, \
            f"README command failed: {command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    python = venv / "bin" / "python"
    # The route installs no PyTorch: the chapters' torch cells must skip themselves.
    probe = subprocess.run([str(python), "-c", "import importlib.util; print(importlib.util.find_spec('torch'))"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "None", "the README's notebook route should not install PyTorch"
    # JupyterLab opens the chapters' .md files as notebooks through jupytext (scripts/jupyter/labconfig).
    lab = subprocess.run([str(venv / "bin" / "jupyter"), "lab", "--version"], env=env, capture_output=True, text=True)
    assert lab.returncode == 0, lab.stderr
    script = tmp_path / "execute.py"
    script.write_text(EXECUTE)
    book = sorted((clone / "chapters").glob("[0-9][0-9]_*.md")) + sorted((clone / "chapters").glob("appendix_*.md"))
    # Two chapters at a time (CI has two cores); each in its own kernel.
    failures, running, times = [], [], []
    pending = list(book)
    while pending or running:
        while pending and len(running) < 2:
            path = pending.pop(0)
            running.append((path, subprocess.Popen([str(python), str(script), str(path), str(CELL_TIMEOUT_S)],
                                                   cwd=path.parent, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True)))
        path, process = running.pop(0)
        output = process.communicate()[0].strip()
        if process.returncode:
            failures.append(f"{path.name}:\n{output}")
        else:
            times.append(output.splitlines()[-1])
    print("\n".join(times))
    assert not failures, "\n\n".join(failures)
