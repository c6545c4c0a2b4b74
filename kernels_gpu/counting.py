"""Global-memory traffic of the kernels themselves, counted element by element in numba's CUDA simulator.

fa2edu's ledger (:class:`fa2edu.memory.HBM`) counts the elements the NumPy algorithms move between HBM and SRAM.
This module counts what the **kernels** move, so the two can be set side by side (tests/test_kernels_io.py asserts
they are equal for FA1 forward, FA2 forward and FA2 backward)::

    with count_global_memory() as traffic:
        kernels_gpu.flash2_forward(Q, K, V, block_sizes=(4, 3))
    traffic.by_tensor(programs=Z * H)      # {"Q": {"read": …, "write": 0, "init": 0}, "K": …, …}

How it works, and why this way. In the simulator a kernel argument that is already a (simulated) device array is
handed to the kernel body wrapped in ``FakeWithinKernelCUDAArray``, which forwards every ``x[i, j]`` and
``x[i, j] = v`` to the device array's ``__getitem__`` / ``__setitem__``. The kernels index global arrays only with
scalars, so each call is one element. While a count runs, :func:`kernels_gpu.runtime.tally` replaces each global
array with a :class:`CountingArray` (a subclass of the simulator's ``FakeCUDAArray`` over the same memory, with its
tensor name) that adds one to ``read`` or ``write`` per element. Shared and local arrays are plain NumPy arrays in
the simulator and are not counted: they are on chip. ``cuda.atomic.add`` is counted as what it is on the hardware,
one read and one write of the element (the simulator's own implementation would read it twice).

This needs no change to the kernels — the same source runs on the GPU, in the simulator and under the count — and
it cannot drift from them: every global access the kernel makes is counted, including ones it should not make.
Launches marked ``init`` ("Initialize … in HBM", e.g. dQ = 0, FA1's O = 0, ℓ = 0, m = −inf) are counted in their
own category, like fa2edu's ``init_writes``. Counting works in the simulator only (on hardware, Nsight Compute's
global load/store counters play this role). It is slow: keep shapes small.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from kernels_gpu import runtime as rt

__all__ = ["GlobalTraffic", "count_global_memory"]  # and CountingArray, built lazily (simulator only)


class GlobalTraffic:
    """Element reads and writes of global memory, per tensor name, summed over every thread of every launch."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = defaultdict(int)   # (kind, tensor) -> elements
        self._lock = threading.Lock()

    def add(self, kind: str, name: str, elements: int) -> None:
        with self._lock:                       # the simulator runs a block's threads as Python threads
            self._counts[(kind, name)] += elements

    def by_tensor(self, programs: int = 1) -> dict[str, dict[str, float]]:
        """``{tensor: {"read": n, "write": n, "init": n}}`` divided by ``programs`` (e.g. batch × heads), the same
        shape as :meth:`fa2edu.memory.HBM.by_tensor`."""
        table: dict[str, dict[str, float]] = defaultdict(lambda: {"read": 0, "write": 0, "init": 0})
        for (kind, name), count in self._counts.items():
            table[name][kind] += count / programs
        return {name: {k: (int(v) if float(v).is_integer() else v) for k, v in row.items()}
                for name, row in table.items()}

    def _total(self, kind: str) -> int:
        return sum(v for (k, _), v in self._counts.items() if k == kind)

    @property
    def reads(self) -> int:
        return self._total("read")

    @property
    def writes(self) -> int:
        """Writes, initialisation excluded (as in the papers' counts)."""
        return self._total("write")

    @property
    def init_writes(self) -> int:
        return self._total("init")

    def __repr__(self) -> str:
        return f"GlobalTraffic(reads={self.reads:,}, writes={self.writes:,}, init_writes={self.init_writes:,})"


def _fake_array_class():
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray


_COUNTING_CLASS = None


def _counting_class():
    """CountingArray is built on first use: the simulator's classes exist only when the simulator is in use."""
    global _COUNTING_CLASS
    if _COUNTING_CLASS is None:
        FakeCUDAArray = _fake_array_class()

        class CountingArray(FakeCUDAArray):
            """A simulated device array that counts the elements each ``[]`` reads or writes, under a tensor name."""

            def __init__(self, ary, traffic: GlobalTraffic, name: str, init: bool):
                super().__init__(ary)
                self._traffic, self._name, self._init = traffic, name, init

            def __getitem__(self, idx):
                value = self._ary[idx]
                self._traffic.add("read", self._name, int(np.size(value)))
                return value

            def __setitem__(self, idx, value):
                self._ary[idx] = value
                self._traffic.add("init" if self._init else "write", self._name, int(np.size(self._ary[idx])))

            def atomic_add(self, idx, value):
                """What ``cuda.atomic.add`` does to global memory: one read and one write of the element."""
                old = self._ary[idx]
                self._ary[idx] += value
                self._traffic.add("read", self._name, 1)
                self._traffic.add("write", self._name, 1)
                return old

        _COUNTING_CLASS = CountingArray
    return _COUNTING_CLASS


def __getattr__(name):  # ``kernels_gpu.counting.CountingArray``, resolved lazily (simulator only)
    if name == "CountingArray":
        return _counting_class()
    raise AttributeError(name)


@contextmanager
def count_global_memory():
    """Count the global-memory elements read and written by every kernel launched inside the ``with`` block.

    Yields a :class:`GlobalTraffic`. Simulator only (``NUMBA_ENABLE_CUDASIM=1`` before numba is imported).
    """
    if not rt.simulator_in_use():
        raise RuntimeError("count_global_memory counts in numba's CUDA simulator only: set NUMBA_ENABLE_CUDASIM=1 "
                           "before numba is imported (on a GPU, use Nsight Compute's global load/store counters)")
    if rt.tally_hook is not None:
        raise RuntimeError("count_global_memory does not nest")
    from numba.cuda.simulator import kernelapi

    CountingArray = _counting_class()
    traffic = GlobalTraffic()

    def wrap(name, array, init):
        return CountingArray(array._ary, traffic, name, init)

    original_add = kernelapi.FakeCUDAAtomic.add

    def counting_add(self, array, index, val):
        target = getattr(array, "_item", array)          # unwrap FakeWithinKernelCUDAArray
        if isinstance(target, CountingArray):
            with kernelapi.addlock:
                return target.atomic_add(index, val)
        return original_add(self, array, index, val)

    rt.tally_hook = wrap
    kernelapi.FakeCUDAAtomic.add = counting_add
    try:
        yield traffic
    finally:
        rt.tally_hook = None
        kernelapi.FakeCUDAAtomic.add = original_add
