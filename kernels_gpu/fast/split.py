"""How v7 and v8 share out the work of a call when it does not fill whole waves of blocks, and their merges.

A kernel whose blocks all cost the same runs in waves of ``slots`` blocks (SMs × resident blocks per SM). When the
block count is not a multiple of ``slots``, the last wave leaves SMs idle, and it costs a whole wave (measured:
:mod:`kernels_gpu.fast.flash2_forward_v8`). v7's plan: :func:`split_plan` keeps the whole waves
and cuts each remaining row block into S pieces, each a contiguous range of K/V tiles (FA2 Section 3.2's split of
the sequence, as decoding kernels do); :func:`merge_kernel` combines the pieces' outputs with the (m, ℓ) rule.
The kernel side (a 1-D grid, a key range per block, partial outputs) is ``tiled.make_forward(..., split=True)``.
Measured on an H200 it did not pay: see :mod:`kernels_gpu.fast.flash2_forward_v7`.

v8's plan: a grid of exactly the blocks the GPU holds at once (P), which take work units from a counter in order.
The first units are whole items, as many as fill whole waves (:func:`stream_plan`); the items left over, which in
v6 make up the half-empty last wave, are treated stream-K: their steps (one step: one K/V tile of one row block)
are cut into R ≤ P equal ranges (:func:`step_bound`), one unit each, so that the blocks finish together. A range
may begin or end inside an item; :func:`stream_pieces` lists every unit's pieces (host side: the specification,
used by the tests and the book) and :func:`stream_merge_kernel` merges the split items. The kernel side is
``tiled.make_forward(..., stream=True)``; see :mod:`kernels_gpu.fast.flash2_forward_v8`.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32

__all__ = ["split_plan", "merge_kernel", "step_bound", "stream_plan", "stream_pieces", "stream_merge_kernel",
           "zero_counter", "MERGE_ROWS", "MERGE_THREADS"]


def split_plan(items: int, T_c: int, slots: int, causal: bool, max_pieces: int = 8,
               overhead_tiles: float = 0.35) -> tuple[int, int, int]:
    """(v7) How to launch ``items`` equal blocks of ``T_c`` K/V tiles each on ``slots`` resident blocks (SMs ×
    blocks per SM) so that the last wave is not half empty: ``(n_full, n_split, S)``.

    The first ``n_full`` items (a whole number of waves) run as usual; each of the remaining ``n_split`` is cut into
    S pieces along the keys (FA2's split-K: S blocks, each a contiguous range of ~T_c/S tiles, merged afterwards by
    the (m, ℓ) rule), so the last wave is ⌈n_split·S / slots⌉ rounds of T_c/S tiles instead of one round of T_c. S
    (2 … ``max_pieces``, at least 2 tiles a piece) minimises that time, counting ``overhead_tiles`` per block for
    its prologue and epilogue; ``(items, 0, 1)``, no split, when nothing is gained, when the items fill whole
    waves, or when ``causal`` (causal items differ in cost, so equal pieces do not balance them)."""
    if causal or slots < 1 or items <= slots:
        return items, 0, 1
    waves, rest = divmod(items, slots)
    if rest == 0:
        return items, 0, 1
    best_S, best = 1, T_c + overhead_tiles
    for S in range(2, max_pieces + 1):
        if T_c < 2 * S:
            break
        cost = -(-rest * S // slots) * (T_c / S + overhead_tiles)
        if cost < best:
            best_S, best = S, cost
    if best_S == 1:
        return items, 0, 1
    return waves * slots, rest, best_S


def step_bound(r, W, R):
    """(v8) The first of range r's steps when W steps are cut into R ranges as evenly as integers allow: range r
    is steps [step_bound(r), step_bound(r + 1)), between ⌊W/R⌋ and ⌈W/R⌉ of them. (Compiled as a device function
    by the kernel and the merge, called as it is by the host.)"""
    return r * W // R


def stream_plan(items: int, T_c: int, slots: int) -> tuple[int, int]:
    """(v8) ``(n_whole, R)``: the first ``n_whole`` items are units of their own (a whole number of waves of
    ``slots`` blocks), the other ``items − n_whole`` (fewer than ``slots``) are cut into R = min(slots, their
    steps) equal ranges of steps, one unit each. Every item is a stream-K one when there are fewer than ``slots``."""
    rest = items % slots
    return items - rest, min(slots, rest * T_c)


def stream_pieces(items: int, T_c: int, slots: int) -> list[tuple[int, int, int, int, int]]:
    """(v8) Every work unit's pieces, in unit order: ``(unit, item, j_lo, j_hi, slot)``, the K/V tiles [j_lo, j_hi)
    of an item; ``slot`` is −1 for a whole item (written straight to O, L), else the row of Opart/Lpart its
    partial result goes to (range r: 2r for a piece of its first item, 2r + 1 for one of its last). The kernel
    and :func:`stream_merge_kernel` compute the same thing on the GPU; this is their specification."""
    n_whole, R = stream_plan(items, T_c, slots)
    out = [(u, u, 0, T_c, -1) for u in range(n_whole)]
    base, W = n_whole * T_c, (items - n_whole) * T_c
    for r in range(R):
        it, hi = base + step_bound(r, W, R), base + step_bound(r + 1, W, R)
        first = it // T_c
        while it < hi:
            item = it // T_c
            j_lo = it - item * T_c
            j_hi = min(T_c, j_lo + hi - it)
            whole = j_lo == 0 and j_hi == T_c
            out.append((n_whole + r, item, j_lo, j_hi, -1 if whole else 2 * r + (0 if item == first else 1)))
            it += j_hi - j_lo
    return out


@cuda.jit
def zero_counter(counter):
    """(v8) The work-unit counter back to 0 before a launch (one thread)."""
    counter[0] = 0


#: rows merged per block of the merge launches: one warp per row, 4 warps per block
MERGE_ROWS = 4
MERGE_THREADS = 32 * MERGE_ROWS
#: pieces whose values one lane loads together before using them
_GROUP = 4


@functools.lru_cache(maxsize=None)
def _row_merger(d_v: int):
    """A device function merging row r of one item (row block) from its n pieces' (O_p, L_p), which sit in
    Opart/Lpart rows s_first, then s_next, s_next + stride, …: L = log Σ_p e^{L_p}, O = Σ_p e^{L_p − L} O_p, FA2's
    (m, ℓ) merge (Alg. 1 lines 9-12 applied to whole pieces) written with log-sum-exps. One warp per row: lane k
    owns columns k, k + 32, … (coalesced). The loads of 4 pieces are issued together before any is used (the
    first form, one element per thread and one piece at a time, waited a memory latency per load: 246 µs for the
    d = 128, N = 1024 benchmark's 68 split items, 7 % of the call; one block per row, 65 µs)."""
    CPL = -(-d_v // 32)             # columns per lane
    GROUP, OV = _GROUP, _GROUP * CPL  # (local-array sizes must be compile-time constants)

    @cuda.jit(device=True)
    def merge_row(Opart, Lpart, O, L, item, T_r, r, n, s_first, s_next, stride):
        lane = cuda.threadIdx.x % 32
        B_r = Opart.shape[1]
        i = item % T_r
        h = (item // T_r) % O.shape[1]
        z = item // (T_r * O.shape[1])
        row = i * B_r + r
        if row >= O.shape[2]:
            return
        lp = cuda.local.array(GROUP, float32)
        ov = cuda.local.array(OV, float32)
        acc = cuda.local.array(CPL, float32)
        # the maximum of the L_p (a clamped index repeats the last piece: no change to a maximum)
        mx = float32(-math.inf)
        for p0 in range(0, n, _GROUP):
            for k in range(_GROUP):
                p = min(p0 + k, n - 1)
                lp[k] = Lpart[s_first if p == 0 else s_next + (p - 1) * stride, r]
            for k in range(_GROUP):
                mx = max(mx, lp[k])
        # Σ_p e^{L_p − max} and Σ_p e^{L_p − max} O_p
        tot = float32(0.0)
        for q in range(CPL):
            acc[q] = 0.0
        for p0 in range(0, n, _GROUP):
            for k in range(_GROUP):
                p = min(p0 + k, n - 1)
                sp = s_first if p == 0 else s_next + (p - 1) * stride
                lp[k] = Lpart[sp, r]
                for q in range(CPL):
                    ov[k * CPL + q] = Opart[sp, r, min(lane + 32 * q, d_v - 1)]
            for k in range(_GROUP):
                if p0 + k < n:
                    w = math.exp(lp[k] - mx)
                    tot += w
                    for q in range(CPL):
                        acc[q] += w * ov[k * CPL + q]
        for q in range(CPL):
            if lane + 32 * q < d_v:
                O[z, h, row, lane + 32 * q] = acc[q] / tot
        if lane == 0:
            L[z, h, row] = mx + math.log(tot)
    return merge_row


@functools.lru_cache(maxsize=None)
def merge_kernel(B_r: int, d_v: int):
    """(v7) O, L of the split items from their pieces' (O_p, L_p): the S pieces of split item g (item item0 + g)
    sit in rows g·S … g·S + S − 1 of Opart/Lpart. One warp per (split item, row), :data:`MERGE_ROWS` per block
    (grid ⌈n_split·B_r / MERGE_ROWS⌉); reads S·B_r·(d_v + 1) floats of partials per item, writes O and L."""
    merge_row = _row_merger(d_v)

    @cuda.jit
    def merge_pieces(Opart, Lpart, O, L, item0, S, T_r, n_split):
        w = cuda.blockIdx.x * MERGE_ROWS + cuda.threadIdx.x // 32
        if w < n_split * B_r:
            g = w // B_r
            merge_row(Opart, Lpart, O, L, item0 + g, T_r, w - g * B_r, S, g * S, g * S + 1, 1)
    return merge_pieces


@functools.lru_cache(maxsize=None)
def stream_merge_kernel(B_r: int, d_v: int):
    """(v8) O, L of the items that the R stream-K ranges split, from their pieces (slots as in
    :func:`stream_pieces`; the ranges cover the steps of items item0 … on). Warp (g, r) looks at the boundary
    between ranges g and g + 1: if it falls inside an item X and no earlier boundary does, it merges row r of X's
    pieces — from range g (slot 2g if X is its first item, else 2g + 1) and each later range that starts inside X
    (slot 2r'). Grid ⌈(R − 1)·B_r / MERGE_ROWS⌉; most warps have nothing to do. Reads n·(d_v + 1) floats of
    partials per merged row (n pieces), writes its d_v values of O and one of L."""
    merge_row = _row_merger(d_v)
    bound = cuda.jit(device=True)(step_bound)

    @cuda.jit
    def merge_stream(Opart, Lpart, O, L, T_r, T_c, R, item0):
        w = cuda.blockIdx.x * MERGE_ROWS + cuda.threadIdx.x // 32
        if w >= (R - 1) * B_r:
            return
        g = w // B_r
        W = (T_r * O.shape[0] * O.shape[1] - item0) * T_c
        base = item0 * T_c
        edge = base + bound(g + 1, W, R)
        X = edge // T_c
        start = base + bound(g, W, R)
        if edge - X * T_c == 0 or start > X * T_c:
            return                                      # no item split here, or an earlier boundary merges it
        n = 1
        while g + n < R and base + bound(g + n, W, R) < (X + 1) * T_c:
            n += 1
        merge_row(Opart, Lpart, O, L, X, T_r, w - g * B_r, n, 2 * g + (0 if start == X * T_c else 1), 2 * g + 2, 2)
    return merge_stream
