"""The steps every tensor-core FA2 forward rung shares, as small device functions.

A rung of the ladder (``flash2_forward_v1.py`` …) is one kernel: read it top to bottom and you see FA2 Algorithm 1.
What does not change between rungs lives here — the sizes of the work split, the copy of a tile from HBM to
shared memory, the online-softmax update of a warp's 16 rows, and the last rescale and store — so that each rung's
file shows only what that rung changes.

**The work split (FA2 Section 3.3, "split-Q").** A thread block owns the row block Q_i of B_r = 16·W query rows; its
W warps own 16 rows each and never exchange anything. Each warp computes its 16 × B_c slice of S_ij = Q_i K_jᵀ as
B_c / 8 accumulator tiles of 16 × 8 (``mma.sync.m16n8k16``), the online softmax of its rows, and its 16 × d slice
of O_i as d / 8 tiles. Lane l of a warp holds rows ``g = l // 4`` and ``g + 8`` of each tile, columns
``2t, 2t + 1`` (``t = l % 4``) — :mod:`kernels_gpu.fragments` has the tables. Register arrays, per lane:

====== ===================== ========================================================
array  length                holds
====== ===================== ========================================================
s      4 · B_c / 8           S_ij (then P_ij) of the lane's 2 rows: [4n + 2h + e] is row g + 8h, column 8n + 2t + e
o      4 · D / 8             Õ_i the same way, D = d rounded up to 16
m, l   2                     m_i and the lane's partial ℓ_i for rows g (h = 0) and g + 8 (h = 1)
====== ===================== ========================================================

ℓ stays a per-lane partial sum until the end (each lane adds only its own columns; one reduction over the four
lanes of a group at the end, not one per tile): FA2's "fewer non-matmul FLOPs".

**Shared memory.** Rows of Q, K, V tiles are stored as 32-bit words (two halves each), ``RS = D/2 + 4`` words per
row: the 4 words (16 bytes) of padding put the 8 rows that one ``ldmatrix`` 8 × 8 tile reads (or 8 lanes' scalar
loads) in 8 different groups of 4 banks, so no two collide.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, uint32

from kernels_gpu import ptx

__all__ = ["Config", "make_steps", "device", "LOG2E", "LN2"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def device(simulated: bool):
    """The decorator of the rungs' device functions: force-inlined on the GPU (their register arrays must stay in
    registers: a call boundary would put them in local memory), plain in the simulator."""
    return cuda.jit(device=True) if simulated else cuda.jit(device=True, forceinline=True)


def repeat(jit, body, count: int):
    """A device function ``f(*args)`` that calls ``body(0, *args)``, …, ``body(count − 1, *args)`` as straight-line
    code: each call's first argument is a compile-time constant, so register-array indices computed from it stay
    constants where LLVM would leave a long loop over it rolled (and put the arrays in local memory)."""
    if count == 0:
        @jit
        def nothing(*args):
            pass
        return nothing
    before, last = repeat(jit, body, count - 1), count - 1

    @jit
    def calls(*args):
        before(*args)
        body(last, *args)
    return calls


@dataclass(frozen=True)
class Config:
    """The compile-time constants of one kernel: head dimension, tile shape, element type, causal or not.

    ``warps`` W: warps per block; ``row_tiles`` R: 16-row MMA tiles per warp (B_r = 16 R W query rows; R = 1 up
    to v6, R = 2 from v7 on); ``B_c``: keys per K/V tile (a multiple of 16)."""

    d: int
    warps: int
    B_c: int
    dtype: str                 # "float16" or "bfloat16"
    causal: bool
    simulated: bool
    row_tiles: int = 1

    def __post_init__(self):
        if self.d % 8 or not 8 <= self.d <= 256:
            raise ValueError(f"d must be a multiple of 8 in [8, 256], got {self.d}")
        if self.B_c % 16 or self.B_c < 16:
            raise ValueError(f"B_c must be a positive multiple of 16, got {self.B_c}")
        if self.warps < 1 or 32 * self.warps > 1024:
            raise ValueError(f"warps must be in [1, 32], got {self.warps}")
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.row_tiles not in (1, 2):
            raise ValueError(f"row_tiles must be 1 or 2, got {self.row_tiles}")

    @property
    def B_r(self) -> int:
        return 16 * self.row_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def D(self) -> int:
        """d rounded up to 16, the k-extent of Q Kᵀ's 16-wide steps (the extra columns are zeros in shared memory)."""
        return -(-self.d // 16) * 16

    @property
    def RS(self) -> int:
        """Words per row of a Q, K or V tile in shared memory (D/2 words of data + 4 of padding)."""
        return self.D // 2 + 4

    @property
    def NT(self) -> int:
        """16 × 8 tiles of S per warp (B_c / 8)."""
        return self.B_c // 8

    @property
    def NO(self) -> int:
        """16 × 8 tiles of O per warp (D / 8)."""
        return self.D // 8


@functools.lru_cache(maxsize=None)
def make_steps(cfg: Config):
    """The shared device functions for ``cfg`` (tile sizes are compile-time constants of each function)."""
    jit = device(cfg.simulated)
    T, RS, NT, NO = cfg.threads, cfg.RS, cfg.NT, cfg.NO
    DW, DWP = cfg.d // 2, cfg.D // 2                     # words of a row: real, and padded to 16 halves
    causal = cfg.causal
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    shfl_xor = ptx.shfl_xor
    neg_inf = -math.inf

    def make_load_rows(ROWS: int):
        @jit
        def load_rows(sm, off, X, z, h, row0, N, tid):
            """Rows row0 … row0 + ROWS − 1 of X[z, h] (words, (N, d/2)) into ``sm`` from word ``off`` on (row
            stride RS), one 32-bit word per thread and step, coalesced; rows past N and the columns between d and
            D are zeros (FA2 Alg. 1 lines 4, 6: load Q_i, K_j, V_j from HBM to on-chip SRAM)."""
            for e in range(tid, ROWS * DWP, T):
                r = e // DWP
                w = e - r * DWP
                value = uint32(0)
                if row0 + r < N and w < DW:
                    value = uint32(X[z, h, row0 + r, w])
                sm[off + r * RS + w] = value
        return load_rows

    mma = ptx.mma_f16 if cfg.dtype == "float16" else ptx.mma_bf16

    @jit
    def mma_into(acc, n, a0, a1, a2, a3, b0, b1):
        """acc[4n … 4n+3] += A·B for one 16 × 8 × 16 product (``mma.sync.m16n8k16``, f32 accumulators): the
        accumulator tile n of S or O, updated in place."""
        c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])
        acc[4 * n] = c0
        acc[4 * n + 1] = c1
        acc[4 * n + 2] = c2
        acc[4 * n + 3] = c3

    CH = cfg.D // 8                                      # 16-byte chunks per (padded) row

    def make_copy_rows_async(ROWS: int):
        @jit
        def copy_rows_async(sm, off, X, z, h, row0, N, tid):
            """Start the copy of rows row0 … row0 + ROWS − 1 of X[z, h] into ``sm`` (word ``off`` on, row stride
            RS) with ``cp.async``: 16 bytes per thread and step, straight from global to shared memory, no
            registers on the way; nothing waits here (the caller commits the group and waits for it later). Rows
            past N and chunks between d and D are filled with zeros (source size 0; the address is clamped to a
            valid one, never read). X may be strided (its rows 16-byte aligned)."""
            base = z * (X.strides[0] // 4) + h * (X.strides[1] // 4)    # X[z, h, 0, 0], in words
            SN = X.strides[2] // 4                                      # words from a row to the next
            for e in range(tid, ROWS * CH, T):
                r = e // CH
                c = e - r * CH
                valid = row0 + r < N and 4 * c < DW
                rr = min(row0 + r, N - 1)
                cc = c if 4 * c < DW else 0
                src = base + rr * SN + 4 * cc
                ptx.cp_async16(sm, off + r * RS + 4 * c, X, src, 16 if valid else 0)
        return copy_rows_async

    def make_copy_rows_async_inc(ROWS: int):
        DR = T // CH                             # rows between a thread's consecutive copies
        if T % CH or ROWS % DR:                  # (d = 40, 48, 80, …: chunks per row do not divide the threads)
            return make_copy_rows_async(ROWS)
        STEPS = ROWS // DR

        @jit
        def copy_rows_async_inc(sm, off, X, z, h, row0, N, tid):
            """:func:`copy_rows_async` (same effect) with the index arithmetic taken out of the loop: a thread
            always copies chunk ``tid % CH`` of rows ``tid // CH + k·DR``, so its two addresses are computed once
            and stepped by constants, where ``copy_rows_async`` paid a division, a remainder, a clamp and a dozen
            64-bit operations per 16-byte copy. Rows past N and chunks between d and D are zero-filled (source
            size 0, the source address then row0's, which exists). Head dimensions whose chunk count does not
            divide the block's threads fall back to ``copy_rows_async``."""
            c = tid % CH
            r0 = tid // CH
            col_ok = 4 * c < DW
            rem = N - row0 - r0                  # copy k reads a row of X iff k·DR < rem
            SN = X.strides[2] // 4               # words from a row of X to the next (X may be strided)
            first = z * (X.strides[0] // 4) + h * (X.strides[1] // 4) + row0 * SN   # X[z, h, row0, 0]: it exists
            src = first + r0 * SN + (4 * c if col_ok else 0)
            dst = off + r0 * RS + 4 * c
            for k in range(STEPS):
                valid = col_ok and k * DR < rem
                ptx.cp_async16(sm, dst + k * DR * RS, X, src + k * DR * SN if valid else first,
                               16 if valid else 0)
        return copy_rows_async_inc

    @jit
    def zero(x, n):
        """x[0 … n−1] = 0."""
        for k in range(n):
            x[k] = float32(0.0)

    @jit
    def init_stats(m, l):
        """FA2 Alg. 1 line 5 (per lane): m_i = −∞, ℓ_i = 0 for the lane's two rows."""
        for h in range(2):
            m[h] = neg_inf
            l[h] = float32(0.0)

    @jit
    def row_softmax(s, o, m, l, h, row, col0, N_k, scale, diag):
        """FA2 Alg. 1 lines 8-10 for one of the lane's two rows (h = 0: row g, h = 1: row g + 8), in place. A
        function of its own, called with a constant h: every register-array index is then a compile-time constant
        once the short loops unroll (a loop over h stayed rolled at d = 64, and the arrays went to local memory)."""
        # Alg. 1 line 9 (first half): mask, then the row maximum of the tile — 2·NT values in this lane, the rest
        # of the row in the other three lanes of the group (xor 1, xor 2 reach exactly those).
        mx = neg_inf
        for n in range(NT):
            for e in range(2):
                col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                if col >= N_k or (causal and col > row + diag):
                    s[4 * n + 2 * h + e] = neg_inf
                mx = max(mx, s[4 * n + 2 * h + e])
        mx = max(mx, shfl_xor(mx, 1))
        mx = max(mx, shfl_xor(mx, 2))
        m_new = max(m[h], mx)
        # Guard (fully masked so far): P̃ = 0 for the whole row, nothing to rescale.
        if m_new == neg_inf:
            for n in range(NT):
                for e in range(2):
                    s[4 * n + 2 * h + e] = float32(0.0)
            return
        # Alg. 1 line 10: α = exp(m_old − m_new) rescales what came before (0 on the first tile: m_old = −∞).
        alpha = float32(math.exp((m[h] - m_new) * scale))
        # Alg. 1 line 9 (second half): P̃_ij = exp(S_ij − m_new), and the lane's part of its row sum.
        rowsum = float32(0.0)
        for n in range(NT):
            for e in range(2):
                p = float32(math.exp((s[4 * n + 2 * h + e] - m_new) * scale))
                s[4 * n + 2 * h + e] = p
                rowsum += p
        l[h] = alpha * l[h] + rowsum
        m[h] = m_new
        for n in range(NO):
            for e in range(2):
                o[4 * n + 2 * h + e] *= alpha

    @jit
    def online_softmax(s, o, m, l, row0, col0, N_k, scale, diag):
        """FA2 Alg. 1 lines 8-10 on one warp's 16 rows, in place: S_ij (in ``s``) becomes P̃_ij, m and the lane's
        partial ℓ are updated, and Õ_i (in ``o``) is rescaled by exp(m_old − m_new).

        ``row0``: the lane's row g (global index); ``col0``: the tile's first key; ``diag`` = N_k − N_q, so query
        row r sees key c iff c ≤ r + diag (bottom-right causal). Keys past N_k and (causal) above the diagonal get
        S = −∞. A row that has seen no key keeps m = −∞: its P̃ is 0 and nothing is rescaled (the guard DESIGN.md
        asks for, named here: exp(x − m) with m = −∞ would be NaN)."""
        row_softmax(s, o, m, l, 0, row0, col0, N_k, scale, diag)
        row_softmax(s, o, m, l, 1, row0 + 8, col0, N_k, scale, diag)

    @jit
    def finish_row(o, m, l, h, O, L, z, head, row, N_q, scale):
        """FA2 Alg. 1 lines 12-15 for one of the lane's two rows (constant h, as in :func:`row_softmax`)."""
        t = cuda.laneid % 4
        # the group's four partial sums of ℓ (two shuffles)
        total = l[h] + shfl_xor(l[h], 1)
        total = total + shfl_xor(total, 2)
        # Guard: ℓ = 0 only for a row that saw no key (its Õ is 0): store 0, not 0/0.
        inv = float32(0.0) if total == float32(0.0) else float32(1.0) / total
        if row < N_q:
            for n in range(NO):
                if 8 * n < 2 * DW:
                    O[z, head, row, 4 * n + t] = pack(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv)
            if t == 0:
                L[z, head, row] = math.inf if total == float32(0.0) else float32(m[h] * scale + math.log(total))

    @jit
    def finish_rows(o, m, l, O, L, z, head, row0, N_q, scale):
        """FA2 Alg. 1 lines 12-15 for the lane's two rows: the group's partial ℓ summed, O_i = diag(ℓ_i)⁻¹ Õ_i
        rounded to 16 bits and stored as word pairs, L_i = m_i + log ℓ_i (natural units; +∞ for a row that saw
        no key, whose O row is 0, never NaN)."""
        finish_row(o, m, l, 0, O, L, z, head, row0, N_q, scale)
        finish_row(o, m, l, 1, O, L, z, head, row0 + 8, N_q, scale)

    ex2 = ptx.ex2

    def make_online_softmax_exp2(neg_inf):
        """The base-2 online softmax with ``neg_inf`` as its −∞. v5-v7 passed Python's ``-math.inf``: numba types a
        Python float as float64, so the row maximum, its comparisons and the exponent's argument ran in double
        precision (a conversion per score and FP64 arithmetic — on an H100, 64 FP64 operations per clock and SM
        against 128 FP32, conversions slower still). v8 passes ``float32(-inf)`` and everything stays float32."""

        @jit
        def row_softmax_exp2(s, o, m, l, h, row, col0, N_k, scale_log2, diag, mask_tile):
            """:func:`row_softmax` in base 2 with the scale folded in: exp(τ(x − m)) = 2^(x·τlog₂e − m·τlog₂e), one
            FMA and one ``ex2.approx`` per element (the ``MUFU.EX2`` unit) instead of a subtract, a multiply and
            libdevice's expf; and Õ, ℓ are rescaled only when the row maximum moved (α = 1 otherwise: skip 4·D/8
            multiplies per row). ``mask_tile``: False when the caller knows every key of the tile is visible to every
            row of the block (then no column test at all)."""
            mx = neg_inf
            for n in range(NT):
                for e in range(2):
                    if mask_tile:
                        col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                        if col >= N_k or (causal and col > row + diag):
                            s[4 * n + 2 * h + e] = neg_inf
                    mx = max(mx, s[4 * n + 2 * h + e])
            mx = max(mx, shfl_xor(mx, 1))
            mx = max(mx, shfl_xor(mx, 2))
            m_new = max(m[h], mx)
            # Guard (fully masked so far): P̃ = 0 for the whole row, nothing to rescale.
            if m_new == neg_inf:
                for n in range(NT):
                    for e in range(2):
                        s[4 * n + 2 * h + e] = float32(0.0)
                return
            m_scaled = m_new * scale_log2
            # Alg. 1 line 10: rescale only if the maximum moved (uniform over the row's group of four lanes).
            if m_new != m[h]:
                alpha = ex2(m[h] * scale_log2 - m_scaled)
                l[h] *= alpha
                for n in range(NO):
                    for e in range(2):
                        o[4 * n + 2 * h + e] *= alpha
            # Alg. 1 line 9: P̃_ij = 2^(S·τlog₂e − m·τlog₂e), and the lane's part of its row sum.
            rowsum = float32(0.0)
            for n in range(NT):
                for e in range(2):
                    p = ex2(s[4 * n + 2 * h + e] * scale_log2 - m_scaled)
                    s[4 * n + 2 * h + e] = p
                    rowsum += p
            l[h] += rowsum
            m[h] = m_new

        @jit
        def online_softmax_exp2(s, o, m, l, row0, col0, N_k, scale_log2, diag, mask_tile):
            """:func:`online_softmax` with :func:`row_softmax_exp2` (``scale_log2`` = τ·log₂e)."""
            row_softmax_exp2(s, o, m, l, 0, row0, col0, N_k, scale_log2, diag, mask_tile)
            row_softmax_exp2(s, o, m, l, 1, row0 + 8, col0, N_k, scale_log2, diag, mask_tile)

        return online_softmax_exp2, row_softmax_exp2

    #: v5-v7's softmax (float64 statistics, kept so that their measurements stay reproducible); v8 on: float32
    online_softmax_exp2, _ = make_online_softmax_exp2(neg_inf)
    online_softmax_f32, row_softmax_f32 = make_online_softmax_exp2(float32(neg_inf))

    @jit
    def finish_rows_exp2(o, m, l, O, L, z, head, row0, N_q, scale_log2):
        """:func:`finish_rows` for base-2 statistics: L = (m·τlog₂e + log₂ ℓ)·ln 2, in natural units."""
        finish_row(o, m, l, 0, O, L, z, head, row0, N_q, scale_log2 * LN2)
        finish_row(o, m, l, 1, O, L, z, head, row0 + 8, N_q, scale_log2 * LN2)

    return dict(online_softmax_exp2=online_softmax_exp2, online_softmax_f32=online_softmax_f32,
                row_softmax_f32=row_softmax_f32,
                finish_rows_exp2=finish_rows_exp2,
                load_q=make_load_rows(cfg.B_r), load_kv=make_load_rows(cfg.B_c), zero=zero, mma_into=mma_into,
                copy_q_async=make_copy_rows_async(cfg.B_r), copy_kv_async=make_copy_rows_async(cfg.B_c),
                copy_q_async_inc=make_copy_rows_async_inc(cfg.B_r), copy_kv_async_inc=make_copy_rows_async_inc(cfg.B_c),
                init_stats=init_stats, online_softmax=online_softmax, finish_rows=finish_rows)


def causal_tiles(i: int, B_r: int, B_c: int, N_q: int, N_k: int) -> int:
    """How many K/V tiles row block i visits under bottom-right causal masking (FA2 Section 3.1.1: the tiles right
    of the diagonal are skipped): keys 0 … min(N_k, (i + 1)·B_r + N_k − N_q) − 1. Host-side twin of the kernels'
    loop bound, for tests and FLOP counts."""
    last = min(N_k, (i + 1) * B_r + N_k - N_q)
    return max(0, -(-last // B_c))
