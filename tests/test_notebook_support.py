"""What the book's route relies on: the simulator chosen without a GPU, and cells that need PyTorch skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fa2edu import notebook, simulator


def _fresh_python(code: str, env_extra: dict | None = None, drop=("NUMBA_ENABLE_CUDASIM",)) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout + "\n" + result.stderr


def test_choose_turns_the_simulator_on_only_without_a_driver(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "numba.cuda", raising=False)
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.setattr(simulator, "driver_present", lambda: True)
    assert simulator.choose(quiet=True) is False
    assert "NUMBA_ENABLE_CUDASIM" not in os.environ       # a driver: numba decides, nothing is set
    monkeypatch.setattr(simulator, "driver_present", lambda: False)
    assert simulator.choose(quiet=True) is True
    assert os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")                     # the user's own choice is kept
    assert simulator.choose(quiet=True) is False


@pytest.mark.skipif(simulator.driver_present(), reason="this machine has a CUDA driver")
def test_import_kernels_gpu_picks_the_simulator_without_a_driver() -> None:
    """A learner's Python with no variable set: kernels_gpu runs in the simulator and says so once."""
    out = _fresh_python("""
        import kernels_gpu
        print("simulator:", kernels_gpu.simulator_in_use())
    """)
    assert "simulator: True" in out
    assert out.count("numba's CUDA simulator") == 1


@pytest.mark.skipif(simulator.driver_present(), reason="this machine has a CUDA driver")
def test_the_choice_holds_after_numba_was_imported() -> None:
    """``import numba`` first (a learner's own cell) and kernels_gpu still gets the simulator."""
    out = _fresh_python("""
        import numba
        import kernels_gpu
        print("simulator:", kernels_gpu.simulator_in_use())
    """)
    assert "simulator: True" in out


def test_a_users_choice_is_left_alone() -> None:
    out = _fresh_python("""
        import os, kernels_gpu
        print("variable:", os.environ["NUMBA_ENABLE_CUDASIM"])
    """, env_extra={"NUMBA_ENABLE_CUDASIM": "1"})
    assert "variable: 1" in out and "no CUDA driver" not in out


def test_needs_skips_a_cell_whose_package_is_missing(capsys) -> None:
    IPython = pytest.importorskip("IPython")
    shell = IPython.core.interactiveshell.InteractiveShell.instance()
    notebook.load_ipython_extension(shell)
    shell.user_ns.pop("ran", None)
    shell.run_cell("%%needs no_such_package_fa2edu\nran = True")
    assert "ran" not in shell.user_ns
    printed = capsys.readouterr().out
    assert "Skipped: this cell needs no_such_package_fa2edu" in printed
    assert all(len(line) <= 96 for line in printed.splitlines())
    shell.run_cell("%%needs numpy\nran = True")
    assert shell.user_ns["ran"] is True
    # An error inside a cell that runs still fails it.
    result = shell.run_cell("%%needs numpy\n1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    with pytest.raises(ValueError, match="%%needs takes the packages"):
        notebook.needs("", "x = 1")


def test_the_torch_recipe_is_the_cpu_only_build() -> None:
    assert "download.pytorch.org/whl/cpu" in notebook.INSTALL["torch"]
    assert notebook.missing(["numpy", "no_such_package_fa2edu"]) == ["no_such_package_fa2edu"]
