"""v7's launch plan: the last, partly filled wave of blocks cut into pieces along the keys, and the merge.

A kernel whose blocks all cost the same runs in waves of ``slots`` blocks (SMs × resident blocks per SM). When the
block count is not a multiple of ``slots``, the last wave leaves SMs idle. :func:`split_plan` keeps the whole waves
and cuts each remaining row block into S pieces, each a contiguous range of K/V tiles (FA2 Section 3.2's split of
the sequence, as decoding kernels do); :func:`merge_kernel` combines the pieces' outputs with the (m, ℓ) rule.
The kernel side (a 1-D grid, a key range per block, partial outputs) is ``tiled.make_forward(..., split=True)``.
Measured on an H200 it did not pay: see :mod:`kernels_gpu.fast.flash2_forward_v7`.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32

__all__ = ["split_plan", "merge_kernel"]


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


@functools.lru_cache(maxsize=None)
def merge_kernel(B_r: int, d_v: int):
    """(v7) O, L of the split items from their pieces' (O_p, L_p): L = log Σ_p e^{L_p}, O = Σ_p e^{L_p − L} O_p,
    which is FA2's (m, ℓ) merge (Alg. 1 lines 9-12 applied to whole pieces) written with log-sum-exps. One block
    per split item; reads S·B_r·(d_v + 1) floats of partials, writes its B_r rows of O and L."""

    @cuda.jit
    def merge_pieces(Opart, Lpart, O, L, item0, S, T_r):
        g = cuda.blockIdx.x
        item = item0 + g
        i = item % T_r
        h = (item // T_r) % O.shape[1]
        z = item // (T_r * O.shape[1])
        N_q = O.shape[2]
        for e in range(cuda.threadIdx.x, B_r * d_v, cuda.blockDim.x):
            r = e // d_v
            c = e - r * d_v
            row = i * B_r + r
            if row < N_q:
                mx = float32(-math.inf)
                for p in range(S):
                    mx = max(mx, Lpart[g * S + p, r])
                tot = float32(0.0)
                acc = float32(0.0)
                for p in range(S):
                    w = math.exp(Lpart[g * S + p, r] - mx)
                    tot += w
                    acc += w * Opart[g * S + p, r, c]
                O[z, h, row, c] = acc / tot
                if c == 0:
                    L[z, h, row] = mx + math.log(tot)
    return merge_pieces
