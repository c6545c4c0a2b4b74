"""The steps every tensor-core FA2 backward rung shares: the work split, the tile products of FA2 Algorithm 2 as
small device functions, and the two small kernels around the main one (D before it, dQ's rounding after it).

A backward rung (``flash2_backward_v1.py`` …) is one kernel: read it top to bottom and you see FA2 Algorithm 2.
What does not change between rungs lives here, as :mod:`~kernels_gpu.tensorcore.steps` does for the forward.

**The work split (FA2 Section 3.2: the backward is parallel over key blocks).** A thread block owns the key/value
block K_j, V_j of B_c = 16·W keys; its W warps own 16 keys each. The block loops over the G query heads that read
this key/value head (GQA) and over the row blocks Q_i of B_r queries (Alg. 2 line 8). For each (head, i) a warp
computes, for its 16 keys, the *transposed* products — keys are the rows of everything the warp accumulates:

==========================  =====================  ==============================  ============================
Alg. 2 step                 product (16 × n)       A operand (16 keys × k)         B operand (k × n)
==========================  =====================  ==============================  ============================
line 11  Sᵀ = K_j Q_iᵀ      16 × B_r, k = d        K_j rows (ldmatrix)             Q_i rows (ldmatrix)
line 13  Pᵀ = exp(Sᵀ − L)   in registers           —                               —
line 16  dV_j += Pᵀ dO_i    16 × d,  k = B_r       Pᵀ's accumulators, packed       dO_i (ldmatrix.trans)
line 17  dPᵀ = V_j dO_iᵀ    16 × B_r, k = d        V_j rows (ldmatrix)             dO_i rows (ldmatrix)
line 19  dSᵀ = Pᵀ∘(dPᵀ−D)   in registers           —                               —
line 21  dK_j += dSᵀ Q_i    16 × d,  k = B_r       dSᵀ's accumulators, packed      Q_i (ldmatrix.trans)
==========================  =====================  ==============================  ============================

The operand addressing is the forward's, with roles exchanged: K_j and V_j are loaded as the forward loads Q_i
(A, row-major), Q_i and dO_i as the forward loads K_j (B of a product with a transposed matrix) or V_j (B loaded
transposed). Pᵀ and dSᵀ never leave the registers for dV and dK: the accumulators of two neighbouring 16 × 8 tiles
are, packed, the A fragment of the next product (:func:`kernels_gpu.fragments.c_to_a`, the forward
v3's reuse).

**dQ (Alg. 2 line 20, dQ_i += dS K_j) needs the other orientation.** Its rows are queries and its sum runs over
the keys — over all four warps. So every warp writes its 16 × B_r slice of dSᵀ to shared memory (rounded to
16 bits), the block synchronises, and the warps split dQ_i's row tiles and column tiles between them: the A
operand dS = (dSᵀ)ᵀ comes back by ``ldmatrix.trans`` (the transpose is free), the B operand K_j by
``ldmatrix.trans`` as V in the forward. The block's partial dQ_i is added to a float32 copy of dQ in HBM with
atomic adds (other key blocks add to the same rows at the same time: FA2 Section 3.2), and one small kernel
rounds it to the input dtype at the end, multiplying by τ on the way (:func:`convert_dq_kernel`).

**Large head dimensions.** A lane holds dK_j and dV_j of its two rows: 2 · 4 · D/8 = D floats, 128 registers at
d = 128. Beyond, a block computes dK_j, dV_j (and its share of dQ) for one *chunk* of DC = D/2 output columns
only — the grid has a block per (key block, chunk) — and recomputes Sᵀ and dPᵀ (which need all d columns) in each
chunk: 7 matrix products' work instead of 5 at d > 128, correct and slower.

**Row statistics.** The preprocessing kernel (:func:`preprocess_kernel`, Alg. 2 line 4) writes, per row, L·log₂e
(so that P = 2^(S·τlog₂e − L·log₂e): one FMA and one ``ex2``) and D = rowsum(dO ∘ O), padded to a multiple of B_r
with L = +∞ and D = 0: a padding row, like a fully masked row of the forward (L = +∞), gets P = 0 and dS = 0, so
the main kernel needs no row test. It also zeroes dQ's float32 accumulator (Alg. 2 line 3).

Register arrays, per lane (n-tile n holds rows g + 8h, columns 8n + 2t + e at [4n + 2h + e], as in the forward):

========= ============= =================================================================
array     length        holds
========= ============= =================================================================
s         4 · B_r/8     Sᵀ, then Pᵀ, then dSᵀ of the warp's 16 keys × B_r queries
dp        4 · B_r/8     dPᵀ
dk, dv    4 · DC/8      dK_j, dV_j of the warp's 16 keys × DC columns (summed over i and over the GQA group)
========= ============= =================================================================
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore.steps import LOG2E, Config, device, make_steps

__all__ = ["BackwardConfig", "make_backward_steps", "preprocess_kernel", "convert_dq_kernel", "PRE_WARPS",
           "first_row_block"]

#: rows (one warp each) per block of the preprocessing kernel
PRE_WARPS = 4
#: threads per block of dQ's conversion kernel
CONVERT_THREADS = 256


@dataclass(frozen=True)
class BackwardConfig:
    """The compile-time constants of one backward kernel.

    ``warps`` W: warps per block, 16 keys each (B_c = 16 W); ``B_r``: queries per row block Q_i (a multiple of
    16); ``chunks``: how many column chunks dK_j, dV_j are split into (1, or 2 beyond d = 128);
    ``max_registers``: a cap on ptxas's registers per thread (None: ptxas's choice; ignored in the simulator);
    ``max_registers_dq``: the same for a rung's separate dQ kernel, if it has one."""

    d: int
    warps: int
    B_r: int
    dtype: str                 # "float16" or "bfloat16"
    causal: bool
    simulated: bool
    chunks: int = 1
    max_registers: int | None = None
    max_registers_dq: int | None = None

    def __post_init__(self):
        if self.d % 8 or not 8 <= self.d <= 256:
            raise ValueError(f"d must be a multiple of 8 in [8, 256], got {self.d}")
        if self.B_r % 16 or self.B_r < 16:
            raise ValueError(f"B_r must be a positive multiple of 16, got {self.B_r}")
        if not 1 <= self.warps <= 8:
            raise ValueError(f"warps must be in [1, 8], got {self.warps}")
        rt = self.B_r // 16
        if self.warps % rt and rt % self.warps:
            raise ValueError(f"dQ's {rt} row tiles must divide or be divisible by the {self.warps} warps")
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.chunks not in (1, 2):
            raise ValueError(f"chunks must be 1 or 2, got {self.chunks}")

    @property
    def B_c(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def D(self) -> int:
        """d rounded up to 16 per chunk (the extra columns are zeros in shared memory)."""
        step = 16 * self.chunks
        return -(-self.d // step) * step

    @property
    def DC(self) -> int:
        """Columns of dK_j, dV_j (and dQ_i) one block computes."""
        return self.D // self.chunks

    @property
    def RS(self) -> int:
        """Words per row of a Q, K, V or dO tile in shared memory (D/2 words of data + 4 of padding)."""
        return self.D // 2 + 4

    @property
    def RSS(self) -> int:
        """Words per row of the dSᵀ tile in shared memory (B_r/2 words + 4 of padding: conflict-free ldmatrix)."""
        return self.B_r // 2 + 4

    @property
    def NT(self) -> int:
        """16 × 8 tiles of Sᵀ (and dPᵀ) per warp (B_r / 8)."""
        return self.B_r // 8

    @property
    def NC(self) -> int:
        """16 × 8 tiles of dK_j (and dV_j) per warp (DC / 8)."""
        return self.DC // 8

    def jit(self, dq: bool = False):
        """The kernel decorator: ``cuda.jit``, with the register cap when there is one (GPU only); ``dq``: the
        decorator of the separate dQ kernel."""
        cap = self.max_registers_dq if dq else self.max_registers
        if self.simulated or cap is None:
            return cuda.jit
        return cuda.jit(max_registers=cap)

    def padded_rows(self, N_q: int) -> int:
        """N_q rounded up to B_r: the length of the row statistics (L·log₂e, D) the kernels read by tile."""
        return -(-N_q // self.B_r) * self.B_r


def first_row_block(j: int, B_r: int, B_c: int, N_q: int, N_k: int) -> int:
    """The first row block i that sees a key of key block j under bottom-right causal masking (query r sees key
    c iff c ≤ r + N_k − N_q): the row blocks before it are skipped whole (FA2 Section 3.1.1). Host-side twin of
    the kernels' loop start, for tests."""
    first = j * B_c - (N_k - N_q)
    return first // B_r if first > 0 else 0


@functools.lru_cache(maxsize=None)
def make_backward_steps(cfg: BackwardConfig):
    """The shared device functions for ``cfg`` (tile sizes are compile-time constants of each function)."""
    jit = device(cfg.simulated)
    fwd = make_steps(Config(d=cfg.d, warps=cfg.warps, B_c=16, dtype=cfg.dtype, causal=cfg.causal,
                            simulated=cfg.simulated))
    mma_into, zero = fwd["mma_into"], fwd["zero"]          # the forward's: one 16 × 8 × 16 MMA, x[:n] = 0
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2
    T, RS, RSS, NT, NC = cfg.threads, cfg.RS, cfg.RSS, cfg.NT, cfg.NC
    W, B_r, B_c = cfg.warps, cfg.B_r, cfg.B_c
    DW = cfg.d // 2                                         # words of a row
    CH = cfg.D // 8                                         # 16-byte chunks per (padded) row
    KS = cfg.D // 16                                        # 16-wide k-steps over d
    KR = B_r // 16                                          # 16-wide k-steps over a row block's queries
    KB = B_c // 16                                          # 16-wide k-steps over a key block's keys
    RT = B_r // 16                                          # dQ_i's 16-row tiles
    WR = max(1, W // RT)                                    # warps per dQ row tile
    NPQ = cfg.DC // 16                                      # dQ_i's 16-column pairs of tiles in a chunk
    S_LEN = 4 * NT
    causal = cfg.causal

    def make_copy_rows_async(ROWS: int):
        @jit
        def copy_rows_async(sm, off, X, z, h, row0, N, tid):
            """Start the copy of rows row0 … row0 + ROWS − 1 of X[z, h] into ``sm`` (word ``off`` on, row stride
            RS) with ``cp.async``, 16 bytes per thread and step; rows past N and chunks between d and D are
            zero-filled (source size 0, a valid source address). FA2 Alg. 2 lines 6, 9: load K_j, V_j, Q_i, dO_i
            from HBM to SRAM. The caller commits and waits. A rolled loop: few registers, ~30 integer
            instructions per 16-byte copy."""
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
        DR = T // CH                                    # rows between a thread's consecutive copies
        if T % CH or ROWS % DR:                         # (d = 40, 48, 80, …: chunks per row do not divide T)
            return make_copy_rows_async(ROWS)
        STEPS = ROWS // DR

        @jit
        def copy_rows_async_inc(sm, off, X, z, h, row0, N, tid):
            """:func:`copy_rows_async` (same effect) with the index arithmetic out of the loop, as the forward's
            ``copy_rows_async_inc``: a thread always copies chunk ``tid % CH`` of rows ``tid // CH + k·DR``, its
            addresses computed once and stepped by constants (a few instructions per copy; the unrolled copies
            keep more values live). Head dimensions whose chunk count does not divide the threads fall back to
            ``copy_rows_async``."""
            c = tid % CH
            r0 = tid // CH
            col_ok = 4 * c < DW
            rem = N - row0 - r0                         # copy k reads a row of X iff k·DR < rem
            SN = X.strides[2] // 4                      # words from a row of X to the next (X may be strided)
            first = z * (X.strides[0] // 4) + h * (X.strides[1] // 4) + row0 * SN
            src = first + r0 * SN + (4 * c if col_ok else 0)
            dst = off + r0 * RS + 4 * c
            for k in range(STEPS):
                valid = col_ok and k * DR < rem
                ptx.cp_async16(sm, dst + k * DR * RS, X, src + k * DR * SN if valid else first, 16 if valid else 0)
        return copy_rows_async_inc

    @jit
    def copy_stats_async(smf, off, stats, z, h, row0, tid):
        """Start the copy of L_i·log₂e and D_i (B_r floats each, from the padded statistics of
        :func:`preprocess_kernel`) into the float view ``smf`` of shared memory: L at ``off``, D at ``off + B_r``.
        No bounds test: the statistics are padded to a multiple of B_r (Alg. 2 line 10: load ℓ_i, D_i)."""
        H = stats.shape[1]
        N_pad = stats.shape[3]
        for e in range(tid, 2 * (B_r // 4), T):
            which = e // (B_r // 4)
            c = e - which * (B_r // 4)
            src = ((z * H + h) * 2 + which) * N_pad + row0 + 4 * c
            ptx.cp_async16(smf, off + which * B_r + 4 * c, stats, src, 16)

    @jit
    def product_transposed(acc, sm, x_off, y_off, warp, lane):
        """acc (the warp's 16 × B_r tile, 4·NT floats) = X_w Yᵀ over all D columns: X_w the warp's 16 rows of the
        tile at word ``x_off`` (A: ldmatrix, row-major), Y the B_r rows at ``y_off`` (B: ldmatrix of Y's rows, as
        K in the forward's S = Q Kᵀ). Alg. 2 line 11 (Sᵀ = K_j Q_iᵀ) and line 17 (dPᵀ = V_j dO_iᵀ). Cost per
        warp: 2·16·B_r·D FLOPs in KS·NT MMAs, KS·(1 + NT/2) ldmatrix."""
        zero(acc, S_LEN)
        for kk in range(KS):
            # A: lanes 0-15 address rows 0-15 at word 8kk, lanes 16-31 the same rows 4 words on.
            a0, a1, a2, a3 = ldmatrix(sm, x_off + (16 * warp + lane % 16) * RS + 8 * kk + 4 * (lane // 16))
            for p in range(NT // 2):
                # B: lanes 8u … 8u+7 address Y rows 16p + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                y_row = y_off + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                b0, b1, b2, b3 = ldmatrix(sm, y_row)
                mma_into(acc, 2 * p, a0, a1, a2, a3, b0, b1)
                mma_into(acc, 2 * p + 1, a0, a1, a2, a3, b2, b3)

    @jit
    def product_transposed_pair(acc, acc2, sm, x_off, y_off, x2_off, y2_off, warp, lane):
        """Two :func:`product_transposed` in one loop over the k-steps: acc = X_w Yᵀ and acc2 = X2_w Y2ᵀ (same
        sums, bit for bit). Alg. 2 lines 11 and 17 together (Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ): each k-step issues
        2·NT independent MMAs where one product alone has NT accumulators, each a chain of KS dependent MMAs.
        Cost per warp: 4·16·B_r·D FLOPs in 2·KS·NT MMAs, 2·KS·(1 + NT/2) ldmatrix; 4·NT more accumulator
        registers live than one product's."""
        zero(acc, S_LEN)
        zero(acc2, S_LEN)
        for kk in range(KS):
            x_row = (16 * warp + lane % 16) * RS + 8 * kk + 4 * (lane // 16)
            a0, a1, a2, a3 = ldmatrix(sm, x_off + x_row)
            c0, c1, c2, c3 = ldmatrix(sm, x2_off + x_row)
            for p in range(NT // 2):
                y_row = (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                b0, b1, b2, b3 = ldmatrix(sm, y_off + y_row)
                mma_into(acc, 2 * p, a0, a1, a2, a3, b0, b1)
                mma_into(acc, 2 * p + 1, a0, a1, a2, a3, b2, b3)
                b0, b1, b2, b3 = ldmatrix(sm, y2_off + y_row)
                mma_into(acc2, 2 * p, c0, c1, c2, c3, b0, b1)
                mma_into(acc2, 2 * p + 1, c0, c1, c2, c3, b2, b3)

    @jit
    def product_accumulate(acc, f, sm, y_off, col_word, lane):
        """acc (the warp's 16 × DC tile, 4·NC floats) += F Y[:, chunk]: F the warp's 16 × B_r accumulators ``f``
        rounded to 16 bits and packed into A fragments (C → A, no exchange between lanes), Y the B_r rows at word
        ``y_off``, columns from word ``col_word`` on, loaded transposed (as V in the forward's O += P̃ V).
        Alg. 2 line 16 (dV_j += Pᵀ dO_i) and line 21 (dK_j += dSᵀ Q_i). Cost per warp: 2·16·B_r·DC FLOPs in
        KR·NC MMAs, KR·NC/2 ldmatrix."""
        for kk in range(KR):
            a0 = pack(f[8 * kk], f[8 * kk + 1])
            a1 = pack(f[8 * kk + 2], f[8 * kk + 3])
            a2 = pack(f[8 * kk + 4], f[8 * kk + 5])
            a3 = pack(f[8 * kk + 6], f[8 * kk + 7])
            for p in range(NC // 2):
                # B (transposed on the way): lanes 8u … 8u+7 address rows 16kk + 8(u % 2) + 0…7,
                # columns 16p + 8(u // 2) … of the chunk.
                y_row = y_off + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + col_word + 8 * p + 4 * (lane // 16)
                b0, b1, b2, b3 = ldmatrix_trans(sm, y_row)
                mma_into(acc, 2 * p, a0, a1, a2, a3, b0, b1)
                mma_into(acc, 2 * p + 1, a0, a1, a2, a3, b2, b3)

    @jit
    def probabilities(s, smf, l_off, key0, col0, N_k, scale_log2, diag, mask_tile):
        """Alg. 2 line 13, transposed: Pᵀ = exp(τSᵀ − L) = 2^(Sᵀ·τlog₂e − L·log₂e), in place, for the lane's keys
        ``key0`` (row g) and ``key0 + 8`` and the tile's queries ``col0`` … (L·log₂e from shared memory at
        ``l_off``; +∞ on padding and fully masked rows, so their P is 0). ``mask_tile``: the tile holds a key past
        N_k or (causal) a key after some query's diagonal (``diag`` = N_k − N_q): those P are 0."""
        t = cuda.laneid % 4
        for n in range(NT):
            for h in range(2):
                for e in range(2):
                    col = 8 * n + 2 * t + e
                    p = ex2(s[4 * n + 2 * h + e] * scale_log2 - smf[l_off + col])
                    if mask_tile:
                        key = key0 + 8 * h
                        if key >= N_k or (causal and key > col0 + col + diag):
                            p = float32(0.0)
                    s[4 * n + 2 * h + e] = p

    @jit
    def probabilities_at(s, smf, l_lane, key0, col0, N_k, scale_log2, diag, mask_tile):
        """:func:`probabilities` (same values) with the lane's L·log₂e read at an *unsigned* index: ``l_lane`` =
        uint32(l_off + 2·(lane % 4)), the lane's first query column. numba gives a signed index Python's
        negative-index fix-up (a compare, a shift, an and, an add: ~6 integer instructions per shared load, 2·NT
        loads per step); an unsigned one is used as it is."""
        t = cuda.laneid % 4
        for n in range(NT):
            for e in range(2):
                ell = smf[l_lane + uint32(8 * n + e)]
                for h in range(2):
                    p = ex2(s[4 * n + 2 * h + e] * scale_log2 - ell)
                    if mask_tile:
                        key = key0 + 8 * h
                        if key >= N_k or (causal and key > col0 + 8 * n + 2 * t + e + diag):
                            p = float32(0.0)
                    s[4 * n + 2 * h + e] = p

    @jit
    def softmax_gradient_at(s, dp, smf, d_lane):
        """:func:`softmax_gradient` (same values) with D_i read at the lane's unsigned index ``d_lane`` =
        uint32(d_off + 2·(lane % 4)), as :func:`probabilities_at` reads L."""
        for n in range(NT):
            for e in range(2):
                dee = smf[d_lane + uint32(8 * n + e)]
                for h in range(2):
                    k = 4 * n + 2 * h + e
                    s[k] = s[k] * (dp[k] - dee)

    @jit
    def probabilities_rows(s, lrow, row0, col0, N_k, scale_log2, diag, mask_tile):
        """Alg. 2 line 13 in the forward's orientation (a warp's 16 *query* rows × a tile of B_r keys, for the
        separate dQ pass): P = 2^(S·τlog₂e − L·log₂e), in place; ``lrow`` holds L·log₂e of the lane's rows
        ``row0`` (g) and ``row0 + 8`` (+∞ for rows past N_q or that see no key: P = 0). ``mask_tile``: the tile
        holds a key past N_k or (causal) after some row's diagonal; those P are 0."""
        t = cuda.laneid % 4
        for n in range(NT):
            for h in range(2):
                for e in range(2):
                    p = ex2(s[4 * n + 2 * h + e] * scale_log2 - lrow[h])
                    if mask_tile:
                        col = col0 + 8 * n + 2 * t + e
                        if col >= N_k or (causal and col > row0 + 8 * h + diag):
                            p = float32(0.0)
                    s[4 * n + 2 * h + e] = p

    @jit
    def softmax_gradient_rows(s, dp, drow):
        """Alg. 2 line 19 in the forward's orientation: dS = P ∘ (dP − D), in place in ``s``, ``drow`` holding D of
        the lane's two rows."""
        for n in range(NT):
            for h in range(2):
                for e in range(2):
                    k = 4 * n + 2 * h + e
                    s[k] = s[k] * (dp[k] - drow[h])

    @jit
    def softmax_gradient(s, dp, smf, d_off):
        """Alg. 2 line 19, transposed: dSᵀ = Pᵀ ∘ (dPᵀ − D), in place in ``s`` (D_i per query column, from shared
        memory at ``d_off``). The softmax's Jacobian applied without forming it."""
        t = cuda.laneid % 4
        for n in range(NT):
            for h in range(2):
                for e in range(2):
                    k = 4 * n + 2 * h + e
                    s[k] = s[k] * (dp[k] - smf[d_off + 8 * n + 2 * t + e])

    @jit
    def store_transposed(sm, ds_off, s, warp, lane):
        """The warp's 16 × B_r slice of dSᵀ, rounded to 16 bits, into shared memory (row = key, RSS words per
        row): one word (two queries) per register pair. Row stride RSS puts the 8 groups of a store in 8
        different groups of 4 banks."""
        g = lane // 4
        t = lane % 4
        for n in range(NT):
            for h in range(2):
                sm[ds_off + (16 * warp + g + 8 * h) * RSS + 4 * n + t] = pack(s[4 * n + 2 * h],
                                                                              s[4 * n + 2 * h + 1])

    @jit
    def dq_update(dQacc, sm, ds_off, k_off, col_word, afrag, acc, z, h, row0, col0, N_q, warp, lane):
        """Alg. 2 line 20: dQ_i += dS K_j for the block's keys, added atomically into the float32 accumulator
        (τ is applied when dQ is rounded, :func:`convert_dq_kernel`). The warps split dQ_i's RT row tiles and
        NPQ column-tile pairs: warp w takes row tile w mod RT and every WR-th pair. A = dS (16 queries × 16 keys
        per k-step) by ``ldmatrix.trans`` of the stored dSᵀ — lanes 8u … 8u+7 address keys 16kk + 8(u // 2) + 0…7
        at queries 16r + 8(u % 2) — kept in ``afrag`` (4·KB words) for all the warp's pairs; B = K_j by
        ``ldmatrix.trans``. Cost per block: 2·B_r·B_c·DC FLOPs, B_r·DC atomic adds."""
        g = lane // 4
        t = lane % 4
        for r in range(warp % RT, RT, W):
            for kk in range(KB):
                a_row = ds_off + (16 * kk + lane % 8 + 8 * (lane // 16)) * RSS + 8 * r + 4 * ((lane // 8) % 2)
                a0, a1, a2, a3 = ldmatrix_trans(sm, a_row)
                afrag[4 * kk] = a0
                afrag[4 * kk + 1] = a1
                afrag[4 * kk + 2] = a2
                afrag[4 * kk + 3] = a3
            for p in range(warp // RT, NPQ, WR):
                zero(acc, 8)
                for kk in range(KB):
                    k_row = (k_off + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + col_word + 8 * p
                             + 4 * (lane // 16))
                    b0, b1, b2, b3 = ldmatrix_trans(sm, k_row)
                    a0, a1, a2, a3 = afrag[4 * kk], afrag[4 * kk + 1], afrag[4 * kk + 2], afrag[4 * kk + 3]
                    mma_into(acc, 0, a0, a1, a2, a3, b0, b1)
                    mma_into(acc, 1, a0, a1, a2, a3, b2, b3)
                for hh in range(2):
                    row = row0 + 16 * r + g + 8 * hh
                    if row < N_q:
                        for n in range(2):
                            col = col0 + 16 * p + 8 * n + 2 * t
                            if col < 2 * DW:
                                cuda.atomic.add(dQacc, (z, h, row, col), acc[4 * n + 2 * hh])
                                cuda.atomic.add(dQacc, (z, h, row, col + 1), acc[4 * n + 2 * hh + 1])

    @jit
    def store_rows(acc, X, z, h, row0, N, col_word, scale, lane):
        """Alg. 2 line 24: write the warp's 16 × DC accumulator tile (dK_j or dV_j) to X[z, h] (words) from word
        ``col_word`` on, times ``scale``, rounded to 16 bits: rows row0 + g and row0 + g + 8 (those below N),
        columns below d."""
        g = lane // 4
        t = lane % 4
        for hh in range(2):
            row = row0 + g + 8 * hh
            if row < N:
                for n in range(NC):
                    if 2 * col_word + 8 * n < 2 * DW:
                        X[z, h, row, col_word + 4 * n + t] = pack(acc[4 * n + 2 * hh] * scale,
                                                                  acc[4 * n + 2 * hh + 1] * scale)

    return dict(copy_kv_async=make_copy_rows_async(B_c), copy_q_async=make_copy_rows_async(B_r),
                copy_kv_async_inc=make_copy_rows_async_inc(B_c), copy_q_async_inc=make_copy_rows_async_inc(B_r),
                copy_stats_async=copy_stats_async, zero=zero, product_transposed=product_transposed,
                product_transposed_pair=product_transposed_pair,
                product_accumulate=product_accumulate, probabilities=probabilities,
                softmax_gradient=softmax_gradient, store_transposed=store_transposed, dq_update=dq_update,
                store_rows=store_rows, probabilities_rows=probabilities_rows,
                softmax_gradient_rows=softmax_gradient_rows, probabilities_at=probabilities_at,
                softmax_gradient_at=softmax_gradient_at)


@functools.lru_cache(maxsize=None)
def preprocess_kernel(d: int, dtype: str, zero_dq: bool = True):
    """FA2 Alg. 2 lines 3-4 as one launch, a warp per row: D_i = rowsum(dO_i ∘ O_i) (float32 products of the
    16-bit values), L_i·log₂e, and dQ's float32 accumulator zeroed (``zero_dq``; rungs that compute dQ in a
    pass of their own pass a placeholder and leave it). Writes ``stats`` (Z, H, 2, N_pad): [0] the
    scaled L, [1] D, padded past N_q with L = +∞, D = 0 (rows that then give P = 0, dS = 0). Grid
    (⌈N_pad / PRE_WARPS⌉, H, Z), PRE_WARPS warps per block. Cost: reads 2·N·d halves + N floats, writes 2·N_pad
    + N·d floats."""
    unpack = ptx.unpack_f16x2 if dtype == "float16" else ptx.unpack_bf16x2
    shfl_xor = ptx.shfl_xor
    DW = d // 2
    inf = math.inf

    @cuda.jit
    def flash2_backward_preprocess_tc(O, dO, L, stats, dQacc, N_q):
        lane = cuda.laneid
        row = cuda.blockIdx.x * PRE_WARPS + cuda.threadIdx.x // 32
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        acc = float32(0.0)
        if row < N_q:                                  # uniform over the warp: one row per warp
            for w in range(lane, DW, 32):
                o0, o1 = unpack(O[z, h, row, w])
                g0, g1 = unpack(dO[z, h, row, w])
                acc += o0 * g0 + o1 * g1
            if zero_dq:
                for c in range(lane, d, 32):           # Alg. 2 line 3: dQ = 0 (it is accumulated atomically)
                    dQacc[z, h, row, c] = float32(0.0)
        for m in (16, 8, 4, 2, 1):                     # the row's 32 partial sums, five butterfly shuffles
            acc += shfl_xor(acc, m)
        if lane == 0 and row < stats.shape[3]:
            if row < N_q:
                stats[z, h, 0, row] = L[z, h, row] * float32(LOG2E)
                stats[z, h, 1, row] = acc
            else:
                stats[z, h, 0, row] = inf
                stats[z, h, 1, row] = float32(0.0)

    return flash2_backward_preprocess_tc


@functools.lru_cache(maxsize=None)
def convert_dq_kernel(dtype: str):
    """dQ = τ · dQ_acc rounded to ``dtype``, one word (two elements) per thread: the float32 accumulator of the
    atomic adds (flat, 2n floats) → n words of packed halves. Cost: reads 4, writes 2 bytes per element."""
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2

    @cuda.jit
    def flash2_backward_convert_dq_tc(dQacc, dQ, scale):
        k = cuda.grid(1)
        if k < dQ.shape[0]:
            dQ[k] = pack(dQacc[2 * k] * scale, dQacc[2 * k + 1] * scale)

    return flash2_backward_convert_dq_tc
