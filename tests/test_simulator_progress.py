"""Simulated launches report their progress: a tqdm bar over the grid's thread blocks (kernels_gpu.runtime)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import kernels_gpu  # noqa: F401  (installs the block counter when the simulator is in use)
from kernels_gpu import runtime as rt

pytestmark = pytest.mark.skipif(not rt.simulator_in_use(), reason="the progress bar belongs to the CUDA simulator")


class Recording(rt.tqdm):
    """tqdm, remembering every bar's description, total and final count."""

    closed: list = []

    def close(self):
        if not self.disable and self.total is not None:
            Recording.closed.append((self.desc, self.n, self.total))
        super().close()


@pytest.fixture
def progress(monkeypatch):
    """Bars shown at once (no delay) and recorded, the setting restored afterwards."""
    monkeypatch.setattr(rt, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(rt, "tqdm", Recording)
    Recording.closed = []
    previous = rt.simulator_progress(True)
    yield Recording.closed
    rt.simulator_progress(previous)


@cuda.jit
def add_one(x, fail_at):
    # One thread per element; the grid may not cover x exactly, so guard the tail.
    k = cuda.grid(1)
    if k == fail_at:
        raise ValueError("a deliberate failure inside block 1")
    if k < x.shape[0]:
        x[k] += 1.0


@cuda.jit
def touch(x):
    # One thread per block marks its block's cell.
    x[cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z] = 1.0


def test_bar_counts_every_block_and_the_result_is_unchanged(progress, capsys):
    x = cuda.to_device(np.arange(37, dtype=np.float32))
    add_one[rt.grid_size(37, 8), 8](x, -1)             # 5 blocks of 8 threads
    np.testing.assert_array_equal(x.copy_to_host(), np.arange(37) + 1.0)
    assert "simulating add_one" in capsys.readouterr().err
    assert progress == [("simulating add_one", 5, 5)]            # closed at the last block, every block counted
    assert rt._bar is None


def test_a_multi_dimensional_grid_counts_all_of_its_blocks(progress):
    x = cuda.to_device(np.zeros((3, 2, 2), dtype=np.float32))
    touch[(3, 2, 2), 1](x)
    assert np.all(x.copy_to_host() == 1.0)
    assert progress == [("simulating touch", 12, 12)]


def test_a_failing_launch_closes_its_bar_and_the_next_launch_starts_fresh(progress):
    kernel = add_one
    x = cuda.to_device(np.zeros(32, dtype=np.float32))
    with pytest.raises(ValueError, match="deliberate failure"):
        kernel[4, 8](x, 9)                                       # block 1 raises
    assert rt._bar is None and progress == [("simulating add_one", 1, 4)]   # block 0 done, block 1 failed
    kernel[4, 8](x, -1)
    assert progress[1:] == [("simulating add_one", 4, 4)]


def test_off_and_automatic_print_nothing_where_nobody_watches(monkeypatch, capsys):
    monkeypatch.setattr(rt, "PROGRESS_DELAY_S", 0.0)
    kernel = add_one
    x = cuda.to_device(np.zeros(16, dtype=np.float32))
    for show in (False, None):                                   # None: pytest's captured stderr is no terminal
        previous = rt.simulator_progress(show)
        try:
            kernel[2, 8](x, -1)
        finally:
            rt.simulator_progress(previous)
        assert capsys.readouterr().err == "", show
    assert np.all(x.copy_to_host() == 2.0)


def test_the_setting_is_a_bool_or_none():
    with pytest.raises(TypeError, match="show must be True, False or None"):
        rt.simulator_progress("yes")


def test_a_simulated_block_runs_with_a_short_switch_interval():
    """The block's threads see the lowered interval; the caller's is restored after the launch."""
    import sys

    @cuda.jit
    def record(out):
        out[cuda.threadIdx.x] = sys.getswitchinterval()

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        out = np.zeros(4)
        record[1, 4](out)
        assert (out == rt.SIMULATOR_SWITCH_S).all()
        assert sys.getswitchinterval() == 0.004
    finally:
        sys.setswitchinterval(before)
