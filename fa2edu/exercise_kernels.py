"""The kernel exercises of chapters 9, 13 and 14: the reader writes one step of a numba.cuda kernel, a harness runs it.

In the manner of GPU-Puzzles, the reader fills in one step of a kernel — a device function (``@cuda.jit(device=True)``),
or for 9.2 a whole small kernel — and :func:`fa2edu.exercises.check` compiles it into a *harness kernel* that does
the rest of the algorithm around it, launches that in numba's CUDA simulator on small cases (sizes that divide no
block, N_q ≠ N_k, fully masked rows, logits of ±10⁴), compares what comes out with the float64 oracle, and shrinks a
failing case to the smallest one it can find.

**The memory budget.** Every global array the reader's step reads or writes is, in the simulator, a counting array
(:func:`_counting_class`): each element read or written is counted under the tensor's name. The checker sets the
counts beside the budget — the elements the algorithm has to move — and a launch that moves more than the budget
fails, with both numbers and the elements read or written too often (a second pass over S, an accumulator kept in
global memory, every lane of a group writing the same L). The harness's own arrays (what it records for the checks)
are not counted. A launch on a real GPU (the simulator off) is checked the same way, without the count.

==========  ======================================================  ==================================================
exercise    the reader writes                                       budget, per launch
==========  ======================================================  ==================================================
9.2         ``row_stats``: a kernel, one thread per row, (m, ℓ)     S read once; m and l written once
9.3         ``online_update``: a row's (m, ℓ, Õ) over a key block    S once, V once per row; nothing written
9.4         ``tile_kind``: skip / mask / plain from the corners     S and V of the tiles that are not skipped
13.3        ``merge_splits``: one row's (O, L) from S splits         O_part, L_part read once; O, L written once
14.1        ``fragment_coords``: (row, col) of a lane's register    A, B, C read once; D written once
14.2        ``ldmatrix_row``: the row a lane gives ``ldmatrix.x4``  the 16 × 16 tile (shared memory) read once
14.3        ``finish_rows``: O = Õ/ℓ, L = m + log ℓ for a lane      O and L written once, nothing read
==========  ======================================================  ==================================================

This module imports numba (after :func:`fa2edu.simulator.choose`), so :mod:`fa2edu.exercises` imports it only when a
kernel exercise is checked or its solution asked for. Like the rest of fa2edu it never imports ``kernels_gpu``
(DESIGN.md: arrows point one way); the fragment layouts it checks against are written out in
:mod:`fa2edu.exercises`, and a test checks them against ``kernels_gpu.fragments``.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np

from fa2edu import simulator

simulator.choose()      # numba's CUDA simulator on a machine with no CUDA driver, before numba.cuda is imported

from numba import cuda, float32  # noqa: E402

from fa2edu import exercises as ex  # noqa: E402  (the checkers' cases, comparisons and reports)
from fa2edu.blocks import num_blocks, tiles  # noqa: E402
from fa2edu.exercises import MASK, PLAIN, SKIP  # noqa: E402
from fa2edu.masks import causal_mask  # noqa: E402

__all__ = ["row_stats", "online_update", "tile_kind", "merge_splits", "fragment_coords", "ldmatrix_row",
           "finish_rows", "Traffic", "require_cuda"]

SIMULATED = simulator.choose(quiet=True)

#: Threads per block of the harnesses that give one thread to each row (9.3, 13.3): small, so that a case of a
#: few rows already has a second block and idle threads.
ROW_THREADS = 4


def require_cuda(exercise_id: str) -> None:
    """Raise a clear error when numba.cuda can run nothing here: no GPU and the simulator off."""
    if not cuda.is_available():
        raise RuntimeError(f"exercise {exercise_id} launches your code with numba.cuda, but there is no GPU and "
                           "numba's CUDA simulator is off: set the environment variable NUMBA_ENABLE_CUDASIM=1 "
                           "before numba is imported (at the top of the notebook, or restart the kernel)")


# -- counting the reader's global-memory traffic ----------------------------------------------------------------

class _Counts:
    """Element reads and writes per (kind, tensor, index); the simulator runs a block's threads as Python threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.elements: Counter = Counter()

    def add(self, kind: str, name: str, index: tuple) -> None:
        with self._lock:
            self.elements[kind, name, index] += 1

    def total(self, kind: str, name: str) -> int:
        return sum(n for (k, t, _), n in self.elements.items() if k == kind and t == name)

    def per_element(self, kind: str, name: str) -> dict:
        return {i: n for (k, t, i), n in self.elements.items() if k == kind and t == name}


@functools.cache
def _counting_class():
    """CountingArray, built on first use: the simulator's array classes exist only when the simulator is in use."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    class CountingArray(FakeCUDAArray):
        """A simulated global array over ``ary`` (written in place) that counts each element read or written, by
        its index in the whole tensor; a row taken with ``X[i]`` is a view that counts into the same tally."""

        def __init__(self, ary, counts: _Counts, name: str, base=None):
            super().__init__(ary)
            self._counts, self._name = counts, name
            self._base = ary if base is None else base

        def _element(self, idx) -> tuple:
            idx = idx if isinstance(idx, tuple) else (idx,)
            offset = self._ary.__array_interface__["data"][0] - self._base.__array_interface__["data"][0]
            for i, n, stride in zip(idx, self._ary.shape, self._ary.strides):
                offset += (int(i) % n) * stride
            return tuple(int(v) for v in np.unravel_index(offset // self._base.itemsize, self._base.shape))

        def __getitem__(self, idx):
            value = self._ary[idx]
            if isinstance(value, np.ndarray):
                return CountingArray(value, self._counts, self._name, self._base)
            self._counts.add("read", self._name, self._element(idx))
            return value

        def __setitem__(self, idx, value):
            self._ary[idx] = value
            target = self._ary[idx]
            if isinstance(target, np.ndarray):       # a slice assignment writes every element of the slice
                view = CountingArray(target, self._counts, self._name, self._base)
                for sub in np.ndindex(target.shape):
                    self._counts.add("write", self._name, view._element(sub))
            else:
                self._counts.add("write", self._name, self._element(idx))

    return CountingArray


@dataclass(frozen=True)
class Budget:
    """What one tensor the reader's code touches may cost: reads and writes per element (None: none at all)."""

    name: str
    reads: np.ndarray | None
    writes: np.ndarray | None
    rule: str                   # the budget in words, e.g. "each S[i, j] once"


@dataclass(frozen=True)
class Traffic:
    """One launch's elements read and written by the reader's code, beside the budget."""

    reads: int
    writes: int
    budget_reads: int
    budget_writes: int

    def __str__(self) -> str:
        return (f"your code read {self.reads:,} elements (budget {self.budget_reads:,}) and wrote {self.writes:,} "
                f"(budget {self.budget_writes:,})")


class _Launch:
    """The arrays of one launch: the reader's are counted (simulator), the harness's own are plain NumPy."""

    def __init__(self) -> None:
        self.counts = _Counts() if SIMULATED else None

    def counted(self, name: str, host: np.ndarray):
        """``host`` as the kernel argument ``name``; the kernel writes into ``host`` itself."""
        return _counting_class()(host, self.counts, name) if self.counts is not None else host

    def traffic(self, budgets: list[Budget]) -> Traffic | None:
        if self.counts is None:
            return None
        return Traffic(sum(self.counts.total("read", b.name) for b in budgets),
                       sum(self.counts.total("write", b.name) for b in budgets),
                       sum(int(b.reads.sum()) for b in budgets if b.reads is not None),
                       sum(int(b.writes.sum()) for b in budgets if b.writes is not None))

    def check(self, budgets: list[Budget], explain=()) -> Traffic | None:
        """The launch's :class:`Traffic`; a mismatch of kind "budget" when the reader's code read or wrote more
        than the budget, naming the tensors and the elements moved too often."""
        traffic = self.traffic(budgets)
        if traffic is None:
            return None
        lines = []
        for kind, verb in (("read", "read"), ("write", "wrote")):
            for b in budgets:
                allowed = b.reads if kind == "read" else b.writes
                total, limit = self.counts.total(kind, b.name), 0 if allowed is None else int(allowed.sum())
                if total <= limit:
                    continue
                lines.append(f"{b.name}: your code {verb} {total:,} elements, the budget is {limit:,} ({b.rule})")
                often = []
                for index, n in sorted(self.counts.per_element(kind, b.name).items()):
                    if allowed is None or n > allowed[index]:
                        often.append(f"{b.name}{ex._index(index)} {_times(n)}"
                                     + ("" if allowed is None else f" (budget {int(allowed[index])})"))
                shown = ", ".join(often[:4]) + (f" and {len(often) - 4} more" if len(often) > 4 else "")
                if often:
                    lines.append(f"  {verb}: {shown}")
        if lines:
            raise ex._Mismatch([f"global memory over the budget: {traffic}", *lines, *explain,
                                "each X[i] in your code is one access to global memory: keep a value you need "
                                "again in a local variable (a register)"], kind="budget")
        return traffic


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _value_failure(mismatch: ex._Mismatch, launch: _Launch, budgets: list[Budget]) -> ex._Mismatch:
    """A wrong value still reports the launch's traffic beside its budget."""
    traffic = launch.traffic(budgets)
    if traffic is not None:
        mismatch.traffic = str(traffic)
    return mismatch


# -- the reader's step, as the harness calls it ------------------------------------------------------------------

def _simulated_kernel_class():
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    return FakeCUDAKernel


def _is_device_function(fn) -> bool | None:
    """True for @cuda.jit(device=True), False for a kernel (@cuda.jit), None for anything else."""
    if SIMULATED:
        if isinstance(fn, _simulated_kernel_class()):
            return bool(fn._device)
        return None
    options = getattr(fn, "targetoptions", None)
    return None if options is None else bool(options.get("device", False))


def _guarded(call):
    """In the simulator, a thread that raises SystemExit (``sys.exit``) would end silently: the harness calls the
    reader's code through this, which turns it into an exception the launch reports. NumPy's warnings are off in
    each simulated thread (float32 arithmetic on −inf is part of the exercises)."""
    def guarded(*args):
        try:
            with np.errstate(all="ignore"):
                return call(*args)
        except Exception:
            raise
        except BaseException as error:  # noqa: BLE001  (SystemExit; KeyboardInterrupt never reaches a thread)
            code = f"({error.code!r})" if isinstance(error, SystemExit) else ""
            where = " ".join(line.strip() for line in ex._raising_line(error))
            raise ex._LearnerExit(f"{type(error).__name__}{code} {where}".strip()) from None
    return guarded


@functools.lru_cache(maxsize=64)
def _device_step(fn, exercise_id: str):
    """The reader's step as a device function the harness can call: a ``@cuda.jit(device=True)`` function as
    written, or a plain Python function compiled here as one."""
    kind = _is_device_function(fn)
    if kind is False:
        raise ex._Mismatch([f"exercise {exercise_id} asks for a device function, @cuda.jit(device=True), that the "
                            "harness kernel calls; you passed a kernel (@cuda.jit)"], kind="type")
    if kind is None:
        if not callable(fn):
            raise ex._Mismatch([f"expected a device function; got {type(fn).__name__}"], kind="type")
        fn = cuda.jit(device=True)(fn)
    return cuda.jit(device=True)(_guarded(fn)) if SIMULATED else fn


def _step(fn, exercise_id: str):
    try:
        return _device_step(fn, exercise_id)
    except TypeError:                           # an unhashable callable: no cache
        return _device_step.__wrapped__(fn, exercise_id)


def _note_contract(mismatch: ex._Mismatch, contract: str) -> ex._Mismatch:
    """An exception in a simulated thread: what the step must return, and what the simulator does differently."""
    first = mismatch.lines[0] if mismatch.lines else ""
    if "OverflowError" in first or "math domain error" in first:
        mismatch.lines.append("the simulator runs your step as Python: math.exp overflows with OverflowError and "
                              "math.log(0) raises ValueError where a GPU returns inf and −inf (then NaN)")
    elif "raised" in first and contract:
        mismatch.lines.append(contract)
    return mismatch


def _launch(calls: ex._Calls, contract: str, *named, where: str = ""):
    """``calls(*named)``: the harness's launch, with an exception's report completed by the step's contract."""
    try:
        return calls(*named, where=where)
    except ex._Mismatch as mismatch:
        raise _note_contract(mismatch, contract) from None


# -- 9.2 a whole kernel: one thread per row computes (m, ℓ) ----------------------------------------------------------

@cuda.jit
def row_stats(S, m, l):
    """Thread i writes m[i] = max_j S[i, j] and l[i] = Σ_j exp(S[i, j] − m[i]), reading
    row i once (chapter 2's online softmax, one key at a time)."""
    i = cuda.grid(1)
    if i >= S.shape[0]:               # threads past the last row have nothing to do
        return
    m_i = -math.inf                   # registers: the merge's identity (−inf, 0)
    l_i = 0.0
    for j in range(S.shape[1]):
        x = S[i, j]                   # each S[i, j] read once
        if x == -math.inf:            # a masked entry adds e^{−inf} = 0 (skip its −inf − −inf)
            continue
        m_new = max(m_i, x)
        # Rescale the running sum to the new maximum, then add this entry.
        l_i = l_i * math.exp(m_i - m_new) + math.exp(x - m_new)
        m_i = m_new
    m[i] = m_i                        # written once
    l[i] = l_i


@functools.lru_cache(maxsize=64)
def _row_stats_harness(kernel):
    """The reader's kernel, launched through the guard in the simulator (a kernel called inside a running kernel
    runs as this thread's code)."""
    return cuda.jit(_guarded(kernel)) if SIMULATED else kernel


def run_row_stats(kernel, case):
    if not hasattr(kernel, "__getitem__"):
        raise ex._Mismatch([f"expected a kernel decorated with @cuda.jit (launched as kernel[blocks, threads](S, m, "
                            f"l)); got {type(kernel).__name__}"], None, kernel, kind="type")
    if _is_device_function(kernel):
        raise ex._Mismatch(["expected a kernel, @cuda.jit; you passed a device function (device=True), which "
                            "cannot be launched"], None, kernel, kind="type")
    rng = np.random.default_rng(case["seed"])
    rows, cols, threads = case["rows"], case["cols"], case["threads"]
    S = ex._logits(rng, (rows, cols), case["logits"])
    if case["masked"] == "entries":
        hide = rng.random((rows, cols)) < 0.3
        hide[:, 0] = False
        S[hide] = -np.inf
    elif case["masked"] == "rows":
        S[0] = -np.inf
        S[rows // 2, :cols // 2] = -np.inf
    S = S.astype(np.float32)
    expected = ex.block_stats(S.astype(np.float64))
    blocks = num_blocks(rows, threads)
    launch = _Launch()
    harness = _row_stats_harness(kernel)

    def launched(S, m, l):
        harness[blocks, threads](launch.counted("S", S), launch.counted("m", m), launch.counted("l", l))
        return m, l

    # m and l start as NaN: a row the kernel never writes shows up as NaN.
    unwritten = np.full(rows, np.nan, dtype=np.float32)
    calls = ex._Calls(launched, "row_stats")
    m, l = _launch(calls, "", ("S", S), ("m", unwritten), ("l", unwritten),
                   where=f"launched as row_stats[{blocks}, {threads}]")
    budgets = [Budget("S", np.ones(S.shape), None, "each S[i, j] once"),
               Budget("m", None, np.ones(rows), "each m[i] written once"),
               Budget("l", None, np.ones(rows), "each l[i] written once")]
    try:
        ex._expect_close("m", m, expected.m, rtol=1e-6)
        ex._expect_close("l", l, expected.l, rtol=2e-5, atol=1e-6)
    except ex._Mismatch as mismatch:
        mismatch.lines.append(f"the grid has {blocks} × {threads} threads for {rows} rows; m and l start as NaN, "
                              "so a NaN row was never written (or was computed as NaN)")
        mismatch.lines += ex._row_note(S.astype(np.float64))
        raise _value_failure(mismatch, launch, budgets) from None
    return launch.check(budgets, ["one pass over each row is enough: online softmax rescales ℓ as the maximum "
                                  "grows"])


# -- 9.3 a device function: one row's online-softmax update over one block of keys --------------------------------

@cuda.jit(device=True)
def online_update(S, V, i, j0, j1, s, o, ml):
    """FA2 Alg. 1 lines 8-10 for row i and the keys j0 … j1 − 1: update the row's running
    maximum m = ml[0], its sum ℓ = ml[1] and its un-normalised output Õ = o (registers,
    d_v entries). S (N_q, N_k) and V (N_k, d_v) are in global memory; s is a register
    array of at least j1 − j0 entries, to keep the block's scores in."""
    m_old = ml[0]
    # Line 8: row i of S_ij, read from global memory once and kept in s; its maximum.
    m_new = m_old
    for j in range(j0, j1):
        s[j - j0] = S[i, j]
        m_new = max(m_new, s[j - j0])
    if m_new == -math.inf:            # every key so far masked: P̃ = 0, nothing to rescale
        return
    # Line 9: α = e^{m_old − m_new} (0 on the first visible block), P̃_ij = e^{S_ij − m_new},
    # ℓ = α ℓ + rowsum(P̃_ij).
    alpha = math.exp(m_old - m_new)
    l_new = alpha * ml[1]
    for c in range(o.shape[0]):
        o[c] *= alpha                 # line 10: Õ moved to the new maximum (erratum 4) ...
    for j in range(j0, j1):
        p = math.exp(s[j - j0] - m_new)
        l_new += p
        for c in range(o.shape[0]):
            o[c] += p * V[j, c]       # ... then Õ += P̃_ij V_j
    ml[0] = m_new
    ml[1] = l_new


@functools.lru_cache(maxsize=64)
def _online_update_harness(step, D_V: int, B_C: int):
    @cuda.jit
    def online_update_harness(S, V, m_trace, l_trace, o_trace):
        i = cuda.grid(1)                          # one thread per query row (the teaching kernel of chapter 9)
        if i >= S.shape[0]:
            return
        s = cuda.local.array(B_C, float32)        # registers for the block's scores
        o = cuda.local.array(D_V, float32)        # Õ_i's row
        ml = cuda.local.array(2, float32)         # (m_i, ℓ_i)
        for c in range(D_V):                      # Alg. 1 line 5: Õ = 0, ℓ = 0, m = −inf
            o[c] = 0.0
        ml[0] = -math.inf
        ml[1] = 0.0
        N_k = S.shape[1]
        for b in range((N_k + B_C - 1) // B_C):   # line 6: the key blocks, in order
            j0 = b * B_C
            step(S, V, i, j0, min(j0 + B_C, N_k), s, o, ml)     # lines 8-10: the reader's step
            m_trace[i, b] = ml[0]                 # what the checker compares, block by block
            l_trace[i, b] = ml[1]
            for c in range(D_V):
                o_trace[i, b, c] = o[c]
    return online_update_harness


def run_online_update(fn, case):
    step = _step(fn, "9.3")
    S, V = ex._tile_problem(case)
    S32, V32 = S.astype(np.float32), V.astype(np.float32)
    S64, V64 = S32.astype(np.float64), V32.astype(np.float64)
    N_q, N_k = S.shape
    d_v, B_c = V.shape[1], case["B_c"]
    T_c = num_blocks(N_k, B_c)
    harness = _online_update_harness(step, d_v, B_c)
    launch = _Launch()
    traces = (np.full((N_q, T_c), np.nan, np.float32), np.full((N_q, T_c), np.nan, np.float32),
              np.full((N_q, T_c, d_v), np.nan, np.float32))
    blocks = num_blocks(N_q, ROW_THREADS)

    def launched(S, V):
        harness[blocks, ROW_THREADS](launch.counted("S", S), launch.counted("V", V), *traces)
        return traces

    calls = ex._Calls(launched, "online_update")
    m_trace, l_trace, o_trace = _launch(calls, "", ("S", S32), ("V", V32),
                                        where=f"one thread per row, {_plural(T_c, 'key block')} of {B_c}")
    budgets = [Budget("S", np.ones(S.shape), None, "each S[i, j] once: keep the block's scores in s"),
               Budget("V", np.full(V.shape, N_q), None, f"each V[j, c] once per row: {N_q} times")]
    for b, cols in enumerate(tiles(N_k, B_c)):
        m_exp, l_exp, O_exp, _ = ex._prefix_state(S64, V64, cols.stop)
        try:
            ex._expect_close("m", m_trace[:, b], m_exp, rtol=1e-6)
            ex._expect_close("l", l_trace[:, b], l_exp, rtol=2e-5)
            ex._expect_close("O_tilde", o_trace[:, b], O_exp, rtol=2e-5)
        except ex._Mismatch as mismatch:
            mismatch.lines.insert(0, f"after key block {b + 1} of {T_c} (keys {cols.start}:{cols.stop}):")
            mismatch.lines += ex._row_note(S64[:, :cols.stop], S64[:, cols])
            raise _value_failure(mismatch, launch, budgets) from None
    return launch.check(budgets)


# -- 9.4 a device function: the causal tile test ------------------------------------------------------------------

@cuda.jit(device=True)
def tile_kind(row0, row1, col0, col1, N_q, N_k):
    """SKIP, MASK or PLAIN for the tile of query rows row0 … row1 − 1 and keys col0 …
    col1 − 1 under the bottom-right causal mask (query i sees key j iff j ≤ i + N_k − N_q),
    from the tile's corners alone."""
    diagonal = N_k - N_q
    if col0 > row1 - 1 + diagonal:    # even the bottom-left corner (row1 − 1, col0) is masked
        return SKIP
    if col1 - 1 <= row0 + diagonal:   # even the top-right corner (row0, col1 − 1) is visible
        return PLAIN
    return MASK


@functools.lru_cache(maxsize=64)
def _tile_kind_harness(step, B_R: int, B_C: int, D_V: int):
    @cuda.jit
    def tile_kind_harness(S, V, O, L, kinds):
        N_q = S.shape[0]
        N_k = S.shape[1]
        r0 = cuda.blockIdx.x * B_R                # this block's rows: r0 … r1 − 1
        r1 = min(r0 + B_R, N_q)
        i = r0 + cuda.threadIdx.x
        o = cuda.local.array(D_V, float32)
        for c in range(D_V):
            o[c] = 0.0
        m = -math.inf
        l = 0.0
        for b in range((N_k + B_C - 1) // B_C):
            c0 = b * B_C
            c1 = min(c0 + B_C, N_k)
            kind = step(r0, r1, c0, c1, N_q, N_k)          # the reader's step
            if cuda.threadIdx.x == 0:
                kinds[cuda.blockIdx.x, b] = kind
            if kind == SKIP or i >= N_q:
                continue
            for j in range(c0, c1):                         # the tile's S and V, each element once
                x = S[i, j]
                if kind == MASK and j > i + N_k - N_q:
                    x = -math.inf
                m_new = max(m, x)
                alpha = 1.0 if m_new == -math.inf else math.exp(m - m_new)
                p = 0.0 if m_new == -math.inf else math.exp(x - m_new)
                l = l * alpha + p
                for c in range(D_V):
                    o[c] = o[c] * alpha + p * V[j, c]
                m = m_new
        if i < N_q:
            for c in range(D_V):
                O[i, c] = 0.0 if l == 0.0 else o[c] / l
            L[i] = math.inf if l == 0.0 else m + math.log(l)
    return tile_kind_harness


_KIND_NAMES = {SKIP: "SKIP", MASK: "MASK", PLAIN: "PLAIN"}
_TILE_CONTRACT = "tile_kind must return SKIP, MASK or PLAIN (exercises.SKIP, MASK, PLAIN: the numbers 0, 1, 2)"


def _kind_name(value) -> str:
    try:
        return _KIND_NAMES.get(int(value), repr(value))
    except (TypeError, ValueError, OverflowError):
        return repr(value)


def run_tile_kind(fn, case):
    step = _step(fn, "9.4")
    N_q, N_k, B_r, B_c, d_v = case["N_q"], case["N_k"], case["B_r"], case["B_c"], 2
    rng = np.random.default_rng(case["seed"])
    S = rng.standard_normal((N_q, N_k)).astype(np.float32)
    V = rng.standard_normal((N_k, d_v)).astype(np.float32)
    visible = causal_mask(N_q, N_k)
    O_ref, L_ref = ex._oracle(np.where(visible, S.astype(np.float64), -np.inf), V.astype(np.float64))
    T_r, T_c = num_blocks(N_q, B_r), num_blocks(N_k, B_c)
    harness = _tile_kind_harness(step, B_r, B_c, d_v)
    launch = _Launch()
    O, L = np.full((N_q, d_v), np.nan, np.float32), np.full(N_q, np.nan, np.float32)
    kinds = np.full((T_r, T_c), np.nan)

    def launched(S, V):
        harness[T_r, B_r](launch.counted("S", S), launch.counted("V", V), O, L, kinds)
        return O, L, kinds

    calls = ex._Calls(launched, "tile_kind")
    _launch(calls, _TILE_CONTRACT, ("S", S), ("V", V),
            where=f"{T_r} × {T_c} tiles of {B_r} × {B_c}, causal, bottom-right")
    # The budget: S and V of every tile that has a visible entry, read by each of the tile's rows.
    S_reads, V_reads = np.zeros(S.shape), np.zeros(V.shape)
    wrong, extra = [], []
    for bi, rows in enumerate(tiles(N_q, B_r)):
        for bj, cols in enumerate(tiles(N_k, B_c)):
            tile = causal_mask(N_q, N_k, rows, cols)
            expected = SKIP if not tile.any() else (PLAIN if tile.all() else MASK)
            if expected != SKIP:
                S_reads[rows, cols] = 1
                V_reads[cols] += rows.stop - rows.start
            got = kinds[bi, bj]
            where = f"the tile of rows {rows.start}:{rows.stop}, keys {cols.start}:{cols.stop}"
            if got != expected:
                wrong.append((where, expected, got, tile))
            if expected == SKIP and got != SKIP:
                extra.append(f"{where} is fully masked (SKIP), yet tile_kind said {_kind_name(got)}: its S and V "
                             "were read for nothing")
    budgets = [Budget("S", S_reads, None, "each S[i, j] of the tiles not skipped, once"),
               Budget("V", V_reads, None, "each V[j, c] once per row of each tile not skipped")]

    def picture(where, expected, got, tile):
        return [f"{where}: expected {_KIND_NAMES[expected]}, got {_kind_name(got)}; query i sees key j iff "
                f"j ≤ i + N_k − N_q = {ex._offset(N_k - N_q)} (■ visible, · masked):", *ex._picture(tile)]

    try:
        ex._expect_close("L", L, L_ref, rtol=1e-5, atol=1e-6)
        ex._expect_close("O", O, O_ref, rtol=1e-5, atol=1e-6)
    except ex._Mismatch as mismatch:
        if wrong:
            mismatch.lines += picture(*wrong[0])
        raise _value_failure(mismatch, launch, budgets) from None
    traffic = launch.check(budgets, extra[:2])
    if wrong:
        where, expected, got, tile = wrong[0]
        lines = picture(*wrong[0])
        if expected == PLAIN and got == MASK:
            lines.append("O and L are right, but every entry of a PLAIN tile then pays for a mask test it "
                         "cannot fail")
        raise ex._Mismatch(lines, expected, got, kind="tile kind")
    return traffic


# -- 13.3 a device function: the split-KV merge of a decode kernel -------------------------------------------------

@cuda.jit(device=True)
def merge_splits(O_part, L_part, r, acc, O, L):
    """Row r's attention over all its keys from the S splits' partials: O_part[r, s] (d_v)
    normalised over split s, L_part[r, s] its log-sum-exp, +inf for a split that saw no
    key. Writes O[r] and L[r] (O = 0, L = +inf when every split is empty), reading each
    partial once: chapter 2's merge of (m, ℓ), split by split, each split being (L_s, 1).
    acc: a register array of d_v entries."""
    m = -math.inf                     # the largest L_s so far
    l = 0.0                           # Σ_s e^{L_s − m}
    for c in range(acc.shape[0]):
        acc[c] = 0.0
    for s in range(L_part.shape[1]):
        L_s = L_part[r, s]
        if L_s == math.inf:           # an empty split: weight 0 (its O_part is never read)
            continue
        m_new = max(m, L_s)
        alpha = math.exp(m - m_new)   # rescale what came before; every exponent is ≤ 0
        w = math.exp(L_s - m_new)
        l = l * alpha + w
        for c in range(acc.shape[0]):
            acc[c] = acc[c] * alpha + w * O_part[r, s, c]
        m = m_new
    if l == 0.0:                      # every split empty: the row saw no key
        for c in range(acc.shape[0]):
            O[r, c] = 0.0
        L[r] = math.inf
        return
    for c in range(acc.shape[0]):
        O[r, c] = acc[c] / l
    L[r] = m + math.log(l)


@functools.lru_cache(maxsize=64)
def _merge_splits_harness(step, D_V: int):
    @cuda.jit
    def merge_splits_harness(O_part, L_part, O, L):
        r = cuda.grid(1)                          # one thread per (sequence, query head) row
        if r >= O.shape[0]:
            return
        acc = cuda.local.array(D_V, float32)
        for c in range(D_V):
            acc[c] = math.nan                     # registers start undefined: the step sets what it uses
        step(O_part, L_part, r, acc, O, L)
    return merge_splits_harness


def run_merge_splits(fn, case):
    step = _step(fn, "13.3")
    rng = np.random.default_rng(case["seed"])
    rows, n, splits, d_v = case["rows"], case["n"], case["splits"], case["d_v"]
    S = ex._masked(ex._logits(rng, (rows, n), case["logits"]), ex._visible(rng, rows, n, case["mask"]))
    V = rng.standard_normal((n, d_v))
    chunk = -(-n // splits)                       # a decode kernel's split of n keys: ceil(n / S) each
    ranges = [slice(min(s * chunk, n), min((s + 1) * chunk, n)) for s in range(splits)]
    partials = [ex._partial(S, V, keys) for keys in ranges]
    O_part = np.stack([p[0] for p in partials], axis=1).astype(np.float32)      # (rows, S, d_v)
    L_part = np.stack([p[1] for p in partials], axis=1).astype(np.float32)      # (rows, S)
    O_ref, L_ref = ex._oracle(S, V)
    harness = _merge_splits_harness(step, d_v)
    launch = _Launch()
    O, L = np.full((rows, d_v), np.nan, np.float32), np.full(rows, np.nan, np.float32)
    blocks = num_blocks(rows, ROW_THREADS)

    def launched(O_part, L_part):
        harness[blocks, ROW_THREADS](launch.counted("O_part", O_part), launch.counted("L_part", L_part),
                                     launch.counted("O", O), launch.counted("L", L))
        return O, L

    calls = ex._Calls(launched, "merge_splits")
    _launch(calls, "", ("O_part", O_part), ("L_part", L_part),
            where=f"one thread per row; splits of {_plural(chunk, 'key')}: " + ", ".join(
                f"{k.start}:{k.stop}" for k in ranges))
    budgets = [Budget("O_part", np.ones(O_part.shape), None, "each partial O once"),
               Budget("L_part", np.ones(L_part.shape), None, "each partial L once"),
               Budget("O", None, np.ones(O.shape), "each O[r, c] written once: accumulate in acc"),
               Budget("L", None, np.ones(L.shape), "each L[r] written once")]
    try:
        ex._expect_close("L", L, L_ref, rtol=1e-6, atol=1e-6)
        ex._expect_close("O", O, O_ref, rtol=1e-5, atol=1e-6)
    except ex._Mismatch as mismatch:
        row = mismatch.index[0] if mismatch.index else 0
        empty = [s for s in range(splits) if np.isposinf(L_part[row, s])]
        mismatch.lines.append(f"row {row}: L_part = {ex._show_array(L_part[row])}"
                              + (f" (split{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} saw no "
                                 "key: O_part = 0, L_part = +inf)" if empty else ""))
        mismatch.lines.append("O and L start as NaN: a NaN that was not computed was never written")
        raise _value_failure(mismatch, launch, budgets) from None
    return launch.check(budgets, ["one pass over the splits is enough: keep a running maximum and rescale "
                                  "the sum and acc when it grows"])


# -- 14.1 a device function: mma.sync.m16n8k16's fragment layouts ----------------------------------------------------

@cuda.jit(device=True)
def fragment_coords(operand, lane, e):
    """(row, col) of element e of lane's fragment of mma.sync.m16n8k16 (PTX ISA, "Matrix
    Fragments for mma.m16n8k16"): operand 0 = A (16 × 16, e = 0 … 7: register a_{e // 2},
    half e % 2), 1 = B (16 × 8, (k, n), e = 0 … 3: b_{e // 2}, half e % 2), 2 = C and D
    (16 × 8, e = 0 … 3: c_e)."""
    g = lane // 4                     # the group: rows g and g + 8 of A, C; column g of B
    t = lane % 4                      # its place in it: columns 2t, 2t + 1 of A, C; rows of B
    if operand == 0:                  # a1, a3: rows + 8; a2, a3: columns + 8
        reg = e // 2
        return g + 8 * (reg % 2), 2 * t + 8 * (reg // 2) + e % 2
    if operand == 1:                  # b0: k = 2t, 2t + 1; b1: the same + 8; column n = g
        return 2 * t + 8 * (e // 2) + e % 2, g
    return g + 8 * (e // 2), 2 * t + e % 2       # c0, c1: row g; c2, c3: row g + 8


@functools.lru_cache(maxsize=64)
def _fragment_harness(step):
    @cuda.jit
    def fragment_harness(A, B, C, D, where):
        lane = cuda.threadIdx.x
        g = lane // 4
        t = lane % 4
        a = cuda.local.array(8, float32)
        b = cuda.local.array(4, float32)
        c = cuda.local.array(4, float32)
        # Each lane loads its registers from where the reader's map says their elements are.
        for e in range(8):
            row, col = step(0, lane, e)
            where[0, lane, e, 0] = row
            where[0, lane, e, 1] = col
            a[e] = A[row, col] if 0 <= row < 16 and 0 <= col < 16 else math.nan
        for e in range(4):
            row, col = step(1, lane, e)
            where[1, lane, e, 0] = row
            where[1, lane, e, 1] = col
            b[e] = B[row, col] if 0 <= row < 16 and 0 <= col < 8 else math.nan
            row, col = step(2, lane, e)
            where[2, lane, e, 0] = row
            where[2, lane, e, 1] = col
            c[e] = C[row, col] if 0 <= row < 16 and 0 <= col < 8 else math.nan
        # The tensor core (the harness's stand-in for mma.sync): it takes A[r, k] from lane 4(r % 8) + (k % 8) // 2,
        # element 2(r // 8 + 2(k // 8)) + k % 2, and so on: the layouts of the PTX ISA, whatever the lanes meant.
        ra = cuda.shared.array((32, 8), float32)
        rb = cuda.shared.array((32, 4), float32)
        rc = cuda.shared.array((32, 4), float32)
        for e in range(8):
            ra[lane, e] = a[e]
        for e in range(4):
            rb[lane, e] = b[e]
            rc[lane, e] = c[e]
        cuda.syncthreads()
        d = cuda.local.array(4, float32)
        for e in range(4):
            row = g + 8 * (e // 2)
            col = 2 * t + e % 2
            total = rc[4 * (row % 8) + col // 2, 2 * (row // 8) + col % 2]
            for k in range(16):
                total += (ra[4 * (row % 8) + (k % 8) // 2, 2 * (row // 8 + 2 * (k // 8)) + k % 2]
                          * rb[4 * col + (k % 8) // 2, 2 * (k // 8) + k % 2])
            d[e] = total
        # D leaves the way C came in: where the reader's map says c0 … c3 are.
        for e in range(4):
            row, col = step(2, lane, e)
            if 0 <= row < 16 and 0 <= col < 8:
                D[row, col] = d[e]
    return fragment_harness


_OPERANDS = (("A", 8, (16, 16), "row, col"), ("B", 4, (16, 8), "k, n"), ("C", 4, (16, 8), "row, col"))


def _register(operand: str, e: int) -> str:
    return f"register c{e}" if operand == "C" else \
        f"register {operand.lower()}{e // 2}, {'low' if e % 2 == 0 else 'high'} half"


def run_fragment_coords(fn, case):
    step = _step(fn, "14.1")
    rng = np.random.default_rng(case["seed"])
    if case["values"] == "distinct":              # small integers: every product and sum exact in float32
        A = rng.integers(-4, 5, (16, 16)).astype(np.float32)
        B = rng.integers(-4, 5, (16, 8)).astype(np.float32)
        C = rng.integers(-4, 5, (16, 8)).astype(np.float32)
    else:
        A, B, C = (rng.standard_normal(shape).astype(np.float32) for shape in ((16, 16), (16, 8), (16, 8)))
    harness = _fragment_harness(step)
    launch = _Launch()
    D = np.full((16, 8), np.nan, np.float32)
    where = np.full((3, 32, 8, 2), -1, np.int64)

    def launched(A, B, C):
        harness[1, 32](launch.counted("A", A), launch.counted("B", B), launch.counted("C", C),
                       launch.counted("D", D), where)
        return D, where

    calls = ex._Calls(launched, "fragment_coords")
    _launch(calls, "fragment_coords must return a pair (row, col) of integers", ("A", A), ("B", B), ("C", C),
            where="one warp: each lane loads its A, B, C registers, the tensor core computes D = A·B + C")
    budgets = [Budget("A", np.ones(A.shape), None, "each element once"),
               Budget("B", np.ones(B.shape), None, "each element once"),
               Budget("C", np.ones(C.shape), None, "each element once"),
               Budget("D", None, np.ones(D.shape), "each element written once")]
    for k, (name, count, shape, coords) in enumerate(_OPERANDS):
        expected, got = ex._fragment_layout(name), where[k, :, :count]
        wrong = np.argwhere((got != expected).any(axis=-1))
        if len(wrong):
            lane, e = (int(v) for v in wrong[0])
            inside = 0 <= got[lane, e, 0] < shape[0] and 0 <= got[lane, e, 1] < shape[1]
            raise _value_failure(ex._Mismatch(
                [f"{name} ({shape[0]} × {shape[1]}): lane {lane} (g = {lane // 4}, t = {lane % 4}), "
                 f"{_register(name, e)} (e = {e}): expected ({coords}) = {tuple(int(v) for v in expected[lane, e])}"
                 f", got {tuple(int(v) for v in got[lane, e])}"
                 + ("" if inside else f", outside {name}") + f"; {len(wrong)} of {32 * count} {name} entries "
                 "differ"], expected, got, kind="layout"), launch, budgets)
    try:
        ex._expect_close("D", D, A.astype(np.float64) @ B.astype(np.float64) + C, rtol=1e-6)
    except ex._Mismatch as mismatch:
        raise _value_failure(mismatch, launch, budgets) from None
    return launch.check(budgets)


# -- 14.2 a device function: the row address each lane gives ldmatrix.x4 -------------------------------------------

@cuda.jit(device=True)
def ldmatrix_row(operand, lane, row0, col0, stride):
    """The index of the first of the 8 16-bit elements (one 16-byte row) that lane gives
    ``ldmatrix.x4`` to load the 16 × 16 tile whose top-left element is (row0, col0) of a
    row-major buffer of ``stride`` elements per row. Lanes 8i … 8i + 7 give the rows of
    8 × 8 matrix i, and register r_i of every lane is filled from matrix i.
    operand 0: A from Q (r_0 … r_3 = a0 … a3); 1: B from K (b0, b1 of keys 0-7, then of
    keys 8-15)."""
    matrix = lane // 8
    row = lane % 8
    if operand == 0:                  # a0 … a3: rows 0-7, 8-15, 0-7, 8-15 × columns 0-7, 8-15
        r = row + 8 * (matrix % 2)
        c = 8 * (matrix // 2)
    else:                             # B = K_jᵀ: d 0-7, then 8-15, of keys 0-7, then 8-15
        r = row + 8 * (matrix // 2)
        c = 8 * (matrix % 2)
    return (row0 + r) * stride + col0 + c


@functools.lru_cache(maxsize=64)
def _ldmatrix_harness(step):
    @cuda.jit
    def ldmatrix_harness(tile_memory, regs, addresses, operand, row0, col0, stride):
        lane = cuda.threadIdx.x
        address = step(operand, lane, row0, col0, stride)      # the reader's step
        addresses[lane] = address
        # ldmatrix.x4 (the harness's stand-in): each lane's 16-byte row ...
        rows = cuda.shared.array((32, 8), float32)
        inside = 0 <= address and address + 8 <= tile_memory.shape[0] and address % 8 == 0
        for k in range(8):
            rows[lane, k] = tile_memory[address + k] if inside else math.nan
        cuda.syncthreads()
        # ... and register r_i of lane (g, t): row g, elements 2t and 2t + 1 of matrix i (the rows of lanes 8i …).
        g = lane // 4
        t = lane % 4
        for i in range(4):
            for half in range(2):
                regs[lane, 2 * i + half] = rows[8 * i + g, 2 * t + half]
    return ldmatrix_harness


_LD_MATRICES = {"A": ["rows 0-7, columns 0-7 (a0)", "rows 8-15, columns 0-7 (a1)", "rows 0-7, columns 8-15 (a2)",
                      "rows 8-15, columns 8-15 (a3)"],
                "K": ["keys 0-7, d 0-7 (b0 of keys 0-7)", "keys 0-7, d 8-15 (b1 of keys 0-7)",
                      "keys 8-15, d 0-7 (b0 of keys 8-15)", "keys 8-15, d 8-15 (b1 of keys 8-15)"]}


def run_ldmatrix_row(fn, case):
    step = _step(fn, "14.2")
    operand, row0, col0, stride = case["operand"], case["row0"], case["col0"], case["stride"]
    rows_in_buffer = row0 + 17                    # the tile and one more row
    memory = np.arange(rows_in_buffer * stride, dtype=np.float32)    # an element's value is its own index
    tile = memory.reshape(rows_in_buffer, stride)[row0:row0 + 16, col0:col0 + 16].astype(np.float64)
    expected = ex._a_fragments(tile) if operand == "A" else np.concatenate(
        [ex._b_fragments(tile[:8].T), ex._b_fragments(tile[8:].T)], axis=1)
    harness = _ldmatrix_harness(step)
    launch = _Launch()
    regs = np.full((32, 8), np.nan, np.float32)
    addresses = np.full(32, -1, np.int64)
    code = 0 if operand == "A" else 1
    name = "Q" if operand == "A" else "K"

    def launched(operand, row0, col0, stride):
        harness[1, 32](launch.counted("tile", memory), regs, addresses, operand, row0, col0, stride)
        return regs, addresses

    calls = ex._Calls(launched, "ldmatrix_row")
    _launch(calls, "ldmatrix_row must return an element index (an integer)", ("operand", code), ("row0", row0),
            ("col0", col0), ("stride", stride), where=f"one warp (lanes 0-31), ldmatrix.x4 of {name}'s tile")
    reads = np.zeros(memory.shape)
    reads[(tile.astype(np.int64)).ravel()] = 1
    budgets = [Budget("tile", reads, None, "each element of the 16 × 16 tile once (shared memory on a GPU)")]

    def place(value) -> str:
        if math.isnan(value):
            return "nothing (the lane's address was refused)"
        r, c = divmod(int(value), stride)
        if row0 <= r < row0 + 16 and col0 <= c < col0 + 16:
            return f"{name}[{r - row0}, {c - col0}]"
        return f"buffer[{r}, {c}], outside the tile"

    size = memory.size
    for lane, address in enumerate(addresses):
        if not (0 <= address and address + 8 <= size) or address % 8:
            why = ("not a multiple of 8: a row address must be 16-byte aligned" if 0 <= address < size
                   else f"outside the buffer of {size} elements")
            raise _value_failure(ex._Mismatch([f"lane {lane} gave address {int(address)}: {why}"], kind="address"),
                                 launch, budgets)
    wrong = np.argwhere(regs != expected)
    if len(wrong):
        lane, e = (int(v) for v in wrong[0])
        i = e // 2
        register = (f"a{i}" if operand == "A" else f"b{i % 2} of keys {8 * (i // 2)}-{8 * (i // 2) + 7}")
        source = 8 * i + lane // 4
        r, c = divmod(int(addresses[source]), stride)
        raise _value_failure(ex._Mismatch(
            [f"lane {lane} (g = {lane // 4}, t = {lane % 4}), {register}, {'low' if e % 2 == 0 else 'high'} half: "
             f"expected {place(expected[lane, e])}, got {place(regs[lane, e])}; {len(wrong)} of 256 differ",
             f"r{i} of every lane comes from matrix {i}, which must be {name}'s {_LD_MATRICES[operand][i]}; its row "
             f"{lane // 4} is the row lane {source} gives: address {int(addresses[source])} = buffer row {r}, "
             f"columns {c}-{c + 7}"], expected, regs, kind="registers"), launch, budgets)
    return launch.check(budgets)


# -- 14.3 a device function: the final rescale of O from a lane's fragments ------------------------------------------

@cuda.jit(device=True)
def finish_rows(o, m, l, lane, O, L):
    """FA2 Alg. 1 lines 12-15 for one lane of a warp's 16 rows: O = diag(ℓ)⁻¹ Õ and
    L = m + log ℓ, stored to global memory. The lane holds rows g = lane // 4 (h = 0) and
    g + 8 (h = 1): o[4n + 2h + e] is Õ's column 8n + 2t + e (t = lane % 4), m[h] and l[h]
    the row's maximum and its whole ℓ. O (N_q, d_v), L (N_q,): rows past N_q do not exist
    (the last tile's padding)."""
    g = lane // 4
    t = lane % 4
    for h in range(2):
        row = g + 8 * h
        if row >= O.shape[0]:         # a padding row: nothing to store
            continue
        # Guard: ℓ = 0 only on a row that saw no key (its Õ is 0): O = 0 and L = +inf,
        # not 0/0 and log 0.
        inv = 0.0 if l[h] == 0.0 else 1.0 / l[h]
        for n in range(O.shape[1] // 8):          # the row's 8-column tiles
            for e in range(2):
                O[row, 8 * n + 2 * t + e] = o[4 * n + 2 * h + e] * inv
        if t == 0:                    # one of the four lanes that share the row writes its L
            L[row] = math.inf if l[h] == 0.0 else m[h] + math.log(l[h])


@functools.lru_cache(maxsize=64)
def _finish_harness(step, TILES: int):
    O_REGS = 4 * TILES                            # a compile-time constant: the lane's registers of Õ

    @cuda.jit
    def finish_rows_harness(o_state, m_state, l_state, O, L):
        lane = cuda.threadIdx.x
        g = lane // 4
        t = lane % 4
        o = cuda.local.array(O_REGS, float32)     # the lane's registers after the last key block
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        for h in range(2):
            m[h] = m_state[g + 8 * h]
            l[h] = l_state[g + 8 * h]
            for n in range(TILES):
                for e in range(2):
                    o[4 * n + 2 * h + e] = o_state[g + 8 * h, 8 * n + 2 * t + e]
        step(o, m, l, lane, O, L)                 # lines 12-15: the reader's step
    return finish_rows_harness


def run_finish_rows(fn, case):
    step = _step(fn, "14.3")
    rng = np.random.default_rng(case["seed"])
    N_q, N_k, d_v = case["N_q"], case["N_k"], 8 * case["tiles"]
    # The warp's 16 rows: N_q real ones, then padding rows (zero queries: scores 0, every key visible).
    S = np.zeros((16, N_k))
    S[:N_q] = ex._masked(ex._logits(rng, (N_q, N_k), case["logits"]), ex._visible(rng, N_q, N_k, case["mask"]))
    V = rng.standard_normal((N_k, d_v))
    m_state, l_state, o_state, _ = ex._prefix_state(S, V, N_k)
    m_state, l_state, o_state = (x.astype(np.float32) for x in (m_state, l_state, o_state))
    l64 = l_state[:N_q].astype(np.float64)
    l_safe = np.where(l64 == 0, 1.0, l64)
    O_exp = o_state[:N_q].astype(np.float64) / l_safe[:, None]
    with np.errstate(divide="ignore"):
        L_exp = np.where(l64 == 0, np.inf, m_state[:N_q].astype(np.float64) + np.log(l_safe))
    harness = _finish_harness(step, case["tiles"])
    launch = _Launch()
    O, L = np.full((N_q, d_v), np.nan, np.float32), np.full(N_q, np.nan, np.float32)

    def launched(o, m, l):
        harness[1, 32](o, m, l, launch.counted("O", O), launch.counted("L", L))
        return O, L

    calls = ex._Calls(launched, "finish_rows")
    _launch(calls, "", ("o_state", o_state), ("m_state", m_state), ("l_state", l_state),
            where=f"one warp, 16 rows of which the first {N_q} are stored")
    budgets = [Budget("O", None, np.ones(O.shape), "each O[row, col] written once"),
               Budget("L", None, np.ones(L.shape), "each L[row] written once, by one lane of the row's four")]
    try:
        ex._expect_close("L", L, L_exp, rtol=1e-6, atol=1e-6)
        ex._expect_close("O", O, O_exp, rtol=1e-6, atol=1e-7)
    except ex._Mismatch as mismatch:
        if mismatch.index is not None:
            row = mismatch.index[0]
            col = mismatch.index[1] if len(mismatch.index) > 1 else 0
            owner = 4 * (row % 8) + (col % 8) // 2
            what = f"O[{row}, {col}]: lane {owner} holds it" if len(mismatch.index) > 1 else \
                f"L[{row}]: lanes {4 * (row % 8)}-{4 * (row % 8) + 3} hold the row"
            mismatch.lines.append(f"{what} (h = {row // 8}), with m = {ex._fmt(m_state[row])}, ℓ = "
                                  f"{ex._fmt(l_state[row])}")
        mismatch.lines.append("O and L start as NaN: a NaN that was not computed was never written")
        raise _value_failure(mismatch, launch, budgets) from None
    return launch.check(budgets)
