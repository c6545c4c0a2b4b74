"""3xTF32 backward: FA2 Alg. 2 in float32 on tensor cores, each product as three TF32 MMAs (first form).

The float32 forward has two 3xTF32 forms (:mod:`~kernels_gpu.tensorcore.flash2_forward_3xtf32`, ``_planes``); this is
the backward they lacked. PyTorch's float32 memory-efficient SDPA computes its backward the same way (three
``mma.m16n8k8`` per float32 product, counted by Nsight Compute in ``ncu_sdpa_fp32_pipes.txt``), and the backward is
about three quarters of fa2edu's float32 op time — so this kernel is what can bring the float32 op level with it.

**The algorithm** is FA2 Alg. 2 with one block per key block j (line 5), looping over the row blocks i (line 8) and,
for GQA, over the query heads that read K_j and V_j. W warps, each owning 16 keys of K_j and V_j (B_c = 16·W); a
step is one row block of B_r queries. Per warp and step, five products, every one in 3xTF32 (each operand split
into a big and a small tf32 value, :func:`~kernels_gpu.ptx.split_tf32`;
A·B ≈ A_small·B_big + A_big·B_small + A_big·B_big):

====================  =====================================  =========================================================
Alg. 2 line           product (per warp)                     operands
====================  =====================================  =========================================================
11: Sᵀ = K_j Q_iᵀ     16 keys × B_r queries, summed over d    A = the warp's K rows, B = Q_i's rows (``ldmatrix``)
17: dPᵀ = V_j dO_iᵀ   16 keys × B_r queries, summed over d    A = the warp's V rows, B = dO_i's rows (``ldmatrix``)
16: dV_j += Pᵀ dO_i   16 keys × d, summed over B_r queries    A = Pᵀ from the accumulators, B = dO_i by scalar loads
21: dK_j += dSᵀ Q_i   16 keys × d, summed over B_r queries    A = dSᵀ from the accumulators, B = Q_i by scalar loads
20: dQ_i += dS K_j    a 1/W share of B_r × d, over B_c keys   A = τ·dS from shared memory, B = K_j by scalar loads
====================  =====================================  =========================================================

Pᵀ and dSᵀ are C fragments (rows: the warp's keys; columns: queries 2t, 2t + 1 of each 8-query tile). Used as the A
operand of the next products their columns are taken in the order 0, 2, 4, 6, 1, 3, 5, 7
(:data:`~kernels_gpu.fragments.KEY_ORDER_TF32`, as the forward does with P̃), so a0 … a3 = c0, c2, c1,
c3 and the B operand's k-rows are queries 2t and 2t + 1: lane (g, t) loads X[2t][g] and X[2t + 1][g] of Q_i or
dO_i. dQ_i needs dS with queries as rows — the transpose of what a warp holds — so the warps write τ·dS into a
B_r × B_c tile of shared memory, and after a barrier each warp multiplies its share of dQ_i's tiles and adds it into
dQ in HBM (float32 atomic additions, as kernels_gpu.fast's backward does; dQ starts at zero).

**Float32 accuracy.** Each operand is split where it is used (Q_i, dO_i, K_j, V_j from their float32 tiles in shared
memory, Pᵀ and dSᵀ once per step from the registers). The tensor core adds an MMA's products into its accumulator
with truncation, so every sum is staged as in the forwards: chains of at most 3·4 MMAs into zeroed registers, added
to the running value by float32 additions (the dK_j, dV_j sums over all row blocks included).

**Shared memory** (words): K_j and V_j (B_c rows of d + 4), two stages of Q_i and dO_i (B_r rows each, ``cp.async``:
step i + 1's tiles land while step i is computed), the τ·dS tile (B_r × (B_c + 4)), two stages of L_i and D_i.
At d = 128 with W = 8, B_r = 32: 215 KiB, one block per SM.

Cost per (batch, head), N_q = N_k = N, not causal: 10·N²·d FLOPs as 30·N²·d tensor-core FLOPs; HBM reads of K, V once
and Q, dO, L, D once per key block (T_c·N·(2d + 2) floats), writes of dK, dV once, N·d·T_c atomic additions into dQ.

**Prediction** (written before the first GPU run). Per warp and step at d = 128, B_r = 32, W = 8, counted from this
code: 960 MMAs (192 per product); for the two score products per k-step one ``ldmatrix`` and four splits for each A
(K, V), one ``ldmatrix`` and four splits per pair of query tiles for each B; the update products two scalar loads
and two splits per MMA triple; the dQ product one ``ldmatrix`` + four splits per k-step and two scalar loads + two
splits per triple. A split is five instructions (two integer, one subtraction, two integer): ~5800 instructions per
960 MMAs, about six per MMA — the planes forward's ratio (~5.4), which runs at 34-41 TFLOP/s on an H200 with one
8-warp block per SM. If the backward issues as well: **28-36 TFLOP/s at d = 128, N = 2048-4096** — level with
kernels_gpu.fast's FFMA backward v3 (29.5-30.2 on an H100) and below SDPA memory-efficient's 35.7; d = 64 lower
(half the work per shared-memory byte).

**Measured** (H200, 2026-11-27, ``python -m benchmarks.fast_backward --impls 3xtf32,…,v3,sdpa_efficient``, batch × N
= 16k tokens, heads × d = 2048, kernels_gpu.fast's FFMA backward v3 and SDPA memory-efficient float32 in every run).

1. **First version** (all three MMAs of a product in one accumulator; tiles explored,
   ``fast_backward_3xtf32_explore.json``): d = 128 32.2 / 32.6 TFLOP/s at N = 2048 / 4096 with W = 8, B_r = 32
   (31.7 / 32.2 with B_r = 16; 18.5 with four warps), v3 29.5 / 30.3, SDPA 36.5 / 37.2 — inside the prediction;
   d = 64 38.4 / 38.8 with four warps (36.7 / 37.2 with eight), v3 31.5 / 32.0, SDPA 35.3 / 35.7: faster than
   SDPA's own 3xTF32. ptxas: 255 registers and 32 bytes of spill at d = 128, 252 at d = 64. But at extreme logits
   (Q, K scaled by 4: scores in the hundreds) dV missed flash-attn's rule: 1.0e-4 against SDPA's 3.4e-5
   (``tf32_backward_extreme_logits_one_chain.log``). Recomputing P as exp(τS − L) in natural units (one fused
   rounding) changed nothing (kept); with the oracle's own L (rounded to float32) the errors grew — the error was in
   S, the tensor core truncating the small cross terms against the big terms' running sum.
2. **Cross terms in their own accumulators** for Sᵀ and dPᵀ (this file; as the planes forward does): at extreme
   logits dQ, dK, dV 4.6e-5 / 4.4e-5 / 3.8e-5 against SDPA memory-efficient's 6.4e-5 / 5.5e-5 / 3.4e-5 and its
   math backend's 1.4e-4 / 9.3e-5 / 2.3e-5 (d = 64; d = 128 3.0-5.6e-5 against 3.0e-5-1.2e-4;
   ``python -m benchmarks.backward_accuracy``, ``tf32_backward_extreme_logits.log``) — now within the rule, and
   more accurate than kernels_gpu.fast's FFMA backward there (1.5e-4 / 2.0e-4 / 7.2e-5). Speed
   (``fast_backward_3xtf32_cross.json``, N = 4096): d = 128 32.7 (spilling 252 bytes), d = 64 37.7 with four
   warps, 36.1 with eight (−3 %). The grid (``fast_backward_3xtf32_cross_grid.json``, N = 2048 / 4096 / 8192):

   ==========  ==================  ==================  ==================
   d, mask     3xTF32 (this)       v3 (FFMA)           SDPA mem.-eff.
   ==========  ==================  ==================  ==================
   128         32.3 / 33.0 / 33.3  29.6 / 30.3 / 30.6  36.7 / 37.2 / 37.3
   128 causal  27.6 / 29.1 / 30.3  27.4 / 29.3 / 31.0  33.7 / 35.9 / 37.4
   64          37.3 / 37.7 / 37.8  31.6 / 32.0 / 32.2  35.5 / 35.7 / 35.0
   64 causal   33.6 / 34.8 / 35.8  29.1 / 30.3 / 31.0  32.9 / 34.1 / 34.7
   ==========  ==================  ==================  ==================

   GPU tests (``gpu_tests_3xtf32_backward.log``, with the 3xTF32 forwards' own): 21 passed; compute-sanitizer
   (``sanitizer_3xtf32_memcheck.log``, ``_racecheck.log``): 0 errors, 0 hazards. Nsight Compute at d = 128
   (``ncu_3xtf32_bwd_d128.txt``, N = 2048, 21.0 ms): issue slots 47 % busy at 1.95 instructions per cycle; one
   8-warp block per SM (occupancy 12.5 %, limited by registers and shared memory), 0.64 eligible warps per
   scheduler, 4.1 cycles between a warp's instructions of which 1.7 wait on fixed-latency dependencies — the splits'
   chains of integer and floating-point steps, with two warps per scheduler to hide them.
3. **The mask only where a tile needs it, causal blocks longest first** (this file): P's per-element tests of key
   against N_k and the diagonal run only in a step whose tiles hold such a key (as the forwards do), and causal
   launches put the key-block index last in the grid, so that every head's key block 0 — the one with the most row
   blocks to visit — starts in the first waves. Predicted (before the run): causal +2-5 %, the rest unchanged.
   Measured (``fast_backward_3xtf32_mask_tiles.json``, v3 and SDPA in the same run): causal d = 128 30.1 / 32.0 /
   33.1, d = 64 36.8 / 37.9 / 38.9 (+9-10 %, more than predicted; the two changes were not measured apart),
   non-causal d = 128 32.4 / 33.1 / 33.6 (unchanged), d = 64 38.3 / 38.7 / 38.9 (+3 %); SDPA memory-efficient
   33.5 / 35.8 / 37.1 causal and 36.5 / 36.9 / 36.8 at d = 128, 32.6 / 33.8 / 34.5 and 35.2 / 35.6 / 34.9 at
   d = 64. GPU tests
   (``gpu_tests_3xtf32_backward_mask_tiles.log``): 8 passed; memcheck (``sanitizer_3xtf32_bwd_mask_tiles_memcheck
   .log``): 0 errors. ptxas: 284 bytes of spill at d = 128 (252 before), none at d = 64 (251 registers).
4. **Sᵀ and dPᵀ one after the other at d = 128** (``paired``): in one loop the two products' part and cross
   accumulators (64 registers at B_r = 32) were what ptxas spilled at d = 128; one after the other they share one
   part and one cross array: 4 bytes of spill. No prediction was written before this run. Measured with every d
   sequential (``fast_backward_3xtf32_sequential.json``): d = 128 +3-4 % (33.5 / 34.1 / 34.4, causal 31.3 / 33.1 /
   34.0), d = 64 −2-3 % (fewer independent MMA chains, no spill to remove) — so paired up to d = 64, one after the
   other above. The final grid (``fast_backward_3xtf32.json``; v3 and SDPA memory-efficient in the same run):

   ==========  ======================  ========================  ===========
   d, mask     TFLOP/s, N = 2k/4k/8k   × SDPA memory-efficient   × v3 (FFMA)
   ==========  ======================  ========================  ===========
   128         33.2 / 33.9 / 34.1      0.91 / 0.92 / 0.92        1.11-1.12
   128 causal  31.0 / 32.7 / 33.7      0.93 / 0.92 / 0.90        1.09-1.13
   64          38.3 / 38.4 / 38.9      1.08 / 1.08 / 1.11        1.20-1.21
   64 causal   36.5 / 38.2 / 38.7      1.12 / 1.13 / 1.12        1.25
   ==========  ======================  ========================  ===========

   GPU tests (``gpu_tests_3xtf32_backward_final.log``): 8 passed; compute-sanitizer
   (``sanitizer_3xtf32_bwd_final_memcheck.log``, ``_racecheck.log``): 0 errors, 0 hazards. After the review
   (the two score products' k-step written once, ``score_step``; same registers, same sums): N = 4096
   34.1 / 32.9 at d = 128, 38.4 / 37.8 at d = 64, without and with the mask (``fast_backward_3xtf32_review.json``).

Tried, not run: Q_i and dO_i split once per step into big and small planes (one raw stage for the next step's
copies, the planes read by ``ldmatrix`` and scalar loads with no split left in the warps' loops; at d = 128 with
B_r = 16, 190 KiB): ptxas spilled 1.6 KB per thread (544 bytes with the score products' operands planed and the
updates' still split), against 16 bytes for the same tile split per use. The likely cause, not yet checked in the
SASS: without the splits' arithmetic between them, ptxas schedules a whole unrolled group's loads early.

So the float32-accurate backward is faster than PyTorch's own at d = 64 (1.08-1.13×) and at 0.90-0.93× of it at
d = 128, 9-25 % faster than the FFMA kernel everywhere. Through the op (``backend="3xtf32"``, forward and
backward, ``gpt_speed_op_float32_3xtf32.json``): 0.91× SDPA at d = 128 and 0.92× causal, 1.06-1.09× at d = 64;
the default float32 path, ``kernels_gpu.fast``, 0.83× and 0.92-0.93× in the run beside it
(``gpt_speed_op_float32_fast.json``). What holds the backward at d = 128 is latency with two warps per scheduler
(step 2's profile). The levers left: fewer registers per warp (dK_j, dV_j's accumulators are half of them) for a
second block, and the splits of Q_i, dO_i shared by the block instead of repeated by each warp (the planes tried
above spilled).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, types, uint32

import kernels_gpu.runtime as rt
from kernels_gpu import driver_launch, ptx
from kernels_gpu.fast.flash2_backward_v2 import warp_preprocess
from kernels_gpu.flash2 import Flash2Backward
from kernels_gpu.tensorcore.flash2_forward_3xtf32_planes import stage_steps
from kernels_gpu.tensorcore.flash2_forward_tf32 import _contiguous, make_accumulators, make_copy_rows, make_splits
from kernels_gpu.tensorcore.steps import LOG2E, device, repeat

__all__ = ["flash2_backward_3xtf32", "Backward3xTF32Config", "config_for", "make_kernel", "shared_words",
           "MAX_HEAD_DIM", "PTX_SIGNATURE"]

MAX_HEAD_DIM = 128

#: the kernel's argument types, for ``python -m kernels_gpu.tensorcore.inspect_ptx bwd_3xtf32 --dtype float32``
PTX_SIGNATURE = ((types.float32[:, :, :, ::1],) * 4 + (types.float32[:, :, ::1],) * 2 +
                 (types.float32[:, :, :, ::1],) * 3 + (types.int32,) * 3 + (types.float32,))


@dataclass(frozen=True)
class Backward3xTF32Config:
    """Compile-time constants: head dimension d (a multiple of 16 up to 128), W warps of 16 keys (B_c = 16·W), B_r
    query rows per step (a multiple of 16), causal or not, simulator or GPU."""

    d: int
    warps: int
    B_r: int
    causal: bool
    simulated: bool
    #: Sᵀ and dPᵀ in one loop over the k-steps (twice the independent MMA chains) rather than one after the other
    #: (half the registers of their partial sums)
    paired: bool = True

    def __post_init__(self):
        if self.d % 16 or not 16 <= self.d <= MAX_HEAD_DIM:
            raise ValueError(f"d must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {self.d}")
        if self.B_r % 16 or self.B_r < 16:
            raise ValueError(f"B_r must be a positive multiple of 16, got {self.B_r}")
        if self.warps < 1 or self.warps % self.MT or (self.NK * self.MT) % self.warps:
            raise ValueError(f"{self.warps} warps cannot share dQ_i's {self.MT} × {self.NK} tiles evenly (B_r = "
                             f"{self.B_r}, d = {self.d}): the warps must be a multiple of B_r / 16 and divide the "
                             f"tiles")

    @property
    def B_c(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def RS(self) -> int:
        """Words per row of a Q, K, V or dO tile: d + 4 (16-byte rows; ``ldmatrix``'s eight rows on all banks)."""
        return self.d + 4

    @property
    def DSS(self) -> int:
        """Words per row of the τ·dS tile: B_c + 4."""
        return self.B_c + 4

    @property
    def NT(self) -> int:
        """8-query tiles of Sᵀ per warp; the k-steps of the update products."""
        return self.B_r // 8

    @property
    def NK(self) -> int:
        """8-wide k-steps of Sᵀ and dPᵀ; the 8-column tiles of dK_j, dV_j and dQ_i."""
        return self.d // 8

    @property
    def MT(self) -> int:
        """16-row tiles of dQ_i."""
        return self.B_r // 16

    @property
    def NQW(self) -> int:
        """dQ_i tiles (16 × 8) per warp."""
        return self.MT * self.NK // self.warps


def config_for(d: int, dtype: str, causal: bool, simulated: bool, warps: int | None = None,
               B_r: int | None = None, paired: bool | None = None) -> Backward3xTF32Config:
    """By default B_r = 32 and eight warps (B_c = 128) at d > 64, four (B_c = 64: two blocks per SM) up to d = 64 —
    the fastest of the tiles measured (``fast_backward_3xtf32_explore.json``); Sᵀ and dPᵀ ``paired`` up to d = 64
    (at d = 128 one after the other: ``fast_backward_3xtf32_sequential.json``). ``dtype``: the inputs' type,
    "float32" (the rungs' signature, for :mod:`~kernels_gpu.tensorcore.inspect_ptx`)."""
    if dtype != "float32":
        raise ValueError(f"the 3xTF32 backward takes float32 inputs (dtype 'float32'), got {dtype!r}")
    warps = (4 if d <= 64 else 8) if warps is None else warps
    paired = d <= 64 if paired is None else paired
    return Backward3xTF32Config(d=d, warps=warps, B_r=32 if B_r is None else B_r, paired=paired,
                                causal=causal, simulated=simulated)


def shared_words(cfg: Backward3xTF32Config) -> int:
    """32-bit words of shared memory: K_j, V_j; two stages of Q_i, dO_i; the τ·dS tile; two stages of L_i, D_i."""
    return 2 * cfg.B_c * cfg.RS + 4 * cfg.B_r * cfg.RS + cfg.B_r * cfg.DSS + 4 * cfg.B_r


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Backward3xTF32Config):
    """The kernel for one configuration (compiled on first launch)."""
    jit = device(cfg.simulated)
    d, B_r, B_c, T, RS, DSS = cfg.d, cfg.B_r, cfg.B_c, cfg.threads, cfg.RS, cfg.DSS
    NT, NK, MT, NQW = cfg.NT, cfg.NK, cfg.MT, cfg.NQW
    K_OFF = 0                                 # word offsets in the one shared array: K_j, V_j, stage 0 (Q_i, dO_i),
    V_OFF = B_c * RS                          # stage 1, the τ·dS tile, then (floats) stage 0 (L_i, D_i),
    Q_OFF = 2 * B_c * RS                      # stage 1
    STAGE = 2 * B_r * RS
    DS_OFF = Q_OFF + 2 * STAGE
    ST_OFF = DS_OFF + B_r * DSS
    S_LEN, C_LEN, PA_LEN = 4 * NT, 4 * NK, 8 * NT    # register-array lengths (compile-time constants)
    KS = stage_steps(NK)                      # k-steps per staged sum: Sᵀ and dPᵀ (over d) ...
    KU = stage_steps(NT)                      # ... the updates (over B_r) ...
    KQ = stage_steps(B_c // 8)                # ... dQ_i (over B_c)
    UG = 4 if NK % 4 == 0 else 2              # column tiles per group of an update (independent chains)
    U_LEN, Q_LEN = 4 * UG, 4 * NQW
    PAIRED = cfg.paired
    causal = cfg.causal
    inf = float32(math.inf)
    ldmatrix, ex2 = ptx.ldmatrix_x4, ptx.ex2

    copy_q, copy_kv = make_copy_rows(jit, d, RS, T, B_r), make_copy_rows(jit, d, RS, T, B_c)
    zero, add_into, mma_into = make_accumulators(jit)
    a_operands, b_operands = make_splits(jit)

    @jit
    def product(acc, n, a, b):
        """acc tile n += A·B in 3xTF32 (``a``: A's 4 big, then 4 small registers; ``b``: B's 2 big, then 2 small):
        the small terms first, while the (zeroed) accumulator is small; A_small·B_small (~2⁻²² of A·B) left out."""
        mma_into(acc, n, a[4], a[5], a[6], a[7], b[0], b[1])
        mma_into(acc, n, a[0], a[1], a[2], a[3], b[2], b[3])
        mma_into(acc, n, a[0], a[1], a[2], a[3], b[0], b[1])

    @jit
    def product_parts(big, cross, n, a, b):
        """The same product with A_big·B_big into ``big`` and the two cross terms into ``cross``: the cross terms
        (~2⁻¹¹ of the product) are summed among themselves, not truncated against the big terms' running sum."""
        mma_into(cross, n, a[4], a[5], a[6], a[7], b[0], b[1])
        mma_into(cross, n, a[0], a[1], a[2], a[3], b[2], b[3])
        mma_into(big, n, a[0], a[1], a[2], a[3], b[0], b[1])

    @jit
    def score_step(kk, part, cross, sm, a_at, b_at):
        """k-step kk of line 11 (Sᵀ = K_w Q_iᵀ: A the warp's K rows at word ``a_at``, B Q_i's rows at ``b_at``) or of
        line 17 (dPᵀ = V_w dO_iᵀ), both by ``ldmatrix``: the big terms into ``part``, the cross terms into
        ``cross``."""
        x0, x1, x2, x3 = ldmatrix(sm, a_at + 8 * kk)
        a = a_operands(x0, x1, x2, x3)
        for np_ in range(NT // 2):
            y0, y1, y2, y3 = ldmatrix(sm, b_at + 16 * np_ * RS + 8 * kk)
            product_parts(part, cross, 2 * np_, a, b_operands(y0, y1))
            product_parts(part, cross, 2 * np_ + 1, a, b_operands(y2, y3))

    @jit
    def score_group(kg, acc, part, cross, sm, a_at, b_at):
        """k-steps KS·kg … of one score product, summed in zeroed ``part`` and ``cross``, then added to ``acc``."""
        zero(part, S_LEN)
        zero(cross, S_LEN)
        for k4 in range(KS):
            score_step(kg * KS + k4, part, cross, sm, a_at, b_at)
        add_into(part, cross, S_LEN)
        add_into(acc, part, S_LEN)

    @jit
    def score_pair_group(kg, s, dp, s_part, dp_part, s_cross, dp_cross, sm, a_at, b_at, q_off):
        """The same for lines 11 and 17 in one loop (up to d = 64: twice the independent MMA chains; at d = 128 the
        second product's part and cross registers make ptxas spill)."""
        zero(s_part, S_LEN)
        zero(dp_part, S_LEN)
        zero(s_cross, S_LEN)
        zero(dp_cross, S_LEN)
        for k4 in range(KS):
            score_step(kg * KS + k4, s_part, s_cross, sm, K_OFF + a_at, q_off + b_at)
            score_step(kg * KS + k4, dp_part, dp_cross, sm, V_OFF + a_at, q_off + B_r * RS + b_at)
        add_into(s_part, s_cross, S_LEN)
        add_into(dp_part, dp_cross, S_LEN)
        add_into(s, s_part, S_LEN)
        add_into(dp, dp_part, S_LEN)

    # The loops whose index picks a register array's element must unroll, or the arrays go to local memory; LLVM
    # leaves the outer loops of the d = 128 products rolled, so they are written as straight-line calls with
    # constant indices (:func:`~kernels_gpu.tensorcore.steps.repeat`).
    score_products = repeat(jit, score_group, NK // KS)
    score_pairs = repeat(jit, score_pair_group, NK // KS)

    @jit
    def split_a(pa, s):
        """Pᵀ or dSᵀ as A fragments of the update products, split once: k-step kk (queries 8kk …, in the order 0, 2,
        4, 6, 1, 3, 5, 7) from accumulator tile kk, a0 … a3 = c0, c2, c1, c3; 8 words per k-step."""
        for kk in range(NT):
            a = a_operands(s[4 * kk], s[4 * kk + 2], s[4 * kk + 1], s[4 * kk + 3])
            for e in range(8):
                pa[8 * kk + e] = a[e]

    @jit
    def update_group(ng, acc, part, pa, sm, x_at):
        """Column tiles UG·ng … of lines 16 and 21: acc (16 keys × d) += Aᵀ X_i over the B_r queries, A split in
        ``pa``; X_i's B fragments by scalar loads (lane (g, t): X[8kk + 2t][8n + g] and X[8kk + 2t + 1][8n + g],
        from word ``x_at``); KU k-steps at a time staged in ``part``."""
        for kg in range(NT // KU):
            zero(part, U_LEN)
            for k4 in range(KU):
                kk = kg * KU + k4
                a = (pa[8 * kk], pa[8 * kk + 1], pa[8 * kk + 2], pa[8 * kk + 3], pa[8 * kk + 4],
                     pa[8 * kk + 5], pa[8 * kk + 6], pa[8 * kk + 7])
                row = x_at + 8 * kk * RS
                for u in range(UG):
                    col = 8 * (ng * UG + u)
                    product(part, u, a, b_operands(sm[row + col], sm[row + RS + col]))
            for u in range(UG):
                for e in range(4):
                    acc[4 * (ng * UG + u) + e] += part[4 * u + e]

    update = repeat(jit, update_group, NK // UG)

    @jit
    def dq_group(kg, qacc, qpart, sm, ds_at, kb_at):
        """Keys 8·KQ·kg … of line 20: this warp's NQW tiles of τ·dS K_j (16 rows × 8 columns each), summed in
        ``qpart`` and added to ``qacc``; A (τ·dS's rows) by ``ldmatrix`` from the dS tile, B (K_j: lane (g, t) reads
        K[8kk + t][8n + g], K[8kk + t + 4][8n + g]) by scalar loads from word ``kb_at``."""
        zero(qpart, Q_LEN)
        for k4 in range(KQ):
            kk = kg * KQ + k4
            x0, x1, x2, x3 = ldmatrix(sm, ds_at + 8 * kk)
            a = a_operands(x0, x1, x2, x3)
            for u in range(NQW):
                at = kb_at + 8 * kk * RS + 8 * u
                product(qpart, u, a, b_operands(sm[at], sm[at + 4 * RS]))
        add_into(qacc, qpart, Q_LEN)

    dq_product = repeat(jit, dq_group, B_c // 8 // KQ)

    @cuda.jit
    def flash2_backward_3xtf32_kernel(Q, K, V, dO, L, D, dQ, dK, dV, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        t = lane % 4
        if causal:                            # grid (H_kv, batch, key blocks): key block 0, the longest, first
            hk = cuda.blockIdx.x
            z = cuda.blockIdx.y
            j = cuda.blockIdx.z
        else:                                 # grid (key blocks, H_kv, batch)
            j = cuda.blockIdx.x               # key block j (Alg. 2 line 5: one block per j, in parallel)
            hk = cuda.blockIdx.y
            z = cuda.blockIdx.z
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory: float32 tiles, read as bits by ldmatrix
        smf = cuda.shared.array(0, float32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        s_part = cuda.local.array(S_LEN, float32)
        s_cross = cuda.local.array(S_LEN, float32)
        dp_part = cuda.local.array(S_LEN if PAIRED else 1, float32)
        dp_cross = cuda.local.array(S_LEN if PAIRED else 1, float32)
        dk = cuda.local.array(C_LEN, float32)
        dv = cuda.local.array(C_LEN, float32)
        pa = cuda.local.array(PA_LEN, uint32)
        part = cuda.local.array(U_LEN, float32)
        qacc = cuda.local.array(Q_LEN, float32)
        qpart = cuda.local.array(Q_LEN, float32)
        diag = N_k - N_q
        key_w = 16 * warp                     # the warp's first key in K_j
        key0 = j * B_c + key_w
        # ldmatrix row addresses (lanes 8q … 8q + 7 give matrix q's rows). A (16 rows × 8 columns): matrix q = rows
        # 8·(q % 2) …, columns 4·(q // 2) … → a0 … a3. B for two 8-query tiles: matrix q = rows 8·(q // 2) …,
        # columns 4·(q % 2) … → b0, b1 of the first tile, b0, b1 of the second.
        a_at = (key_w + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 4 * (lane // 16)
        b_at = (lane % 8 + 8 * (lane // 16)) * RS + 4 * ((lane // 8) % 2)
        u_at = 2 * t * RS + g                 # the update products' scalar B loads: X[2t][g]
        mq = warp % MT                        # dQ_i: this warp's row tile and first column tile
        n_first = (warp // MT) * NQW
        ds_at = DS_OFF + (16 * mq + lane % 8 + 8 * ((lane // 8) % 2)) * DSS + 4 * (lane // 16)
        kb_at = K_OFF + t * RS + g + 8 * n_first

        # Alg. 2 line 8's loop over (query head of the GQA group, row block i), flattened; causal: the row blocks
        # before the first that sees key block j are skipped.
        T_r = (N_q + B_r - 1) // B_r
        i_first = 0
        if causal and j * B_c - diag > 0:
            i_first = min(T_r, (j * B_c - diag) // B_r)
        n_steps = G * (T_r - i_first)
        # Line 6: K_j, V_j; lines 9-10 for the first step: Q_i, dO_i, and L_i, D_i (plain loads).
        copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        if n_steps > 0:
            copy_q(sm, Q_OFF, Q, z, hk * G, i_first * B_r, N_q, tid)
            copy_q(sm, Q_OFF + B_r * RS, dO, z, hk * G, i_first * B_r, N_q, tid)
            if tid < B_r:
                row = i_first * B_r + tid
                smf[ST_OFF + tid] = L[z, hk * G, row] if row < N_q else inf
                smf[ST_OFF + B_r + tid] = D[z, hk * G, row] if row < N_q else float32(0.0)
        ptx.cp_async_commit()
        # Line 7: dK_j = 0, dV_j = 0.
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        gq = 0
        i = i_first
        l_next = inf
        d_next = float32(0.0)
        for step in range(n_steps):
            stage = step & 1
            ptx.cp_async_wait_all()           # this step's tiles have landed (the only group in flight) ...
            cuda.syncthreads()                # ... for everyone; nobody reads the other stage any more
            i_next = i + 1
            gq_next = gq
            if i_next == T_r:
                i_next = i_first
                gq_next = gq + 1
            if step + 1 < n_steps:            # lines 9-10 for the next step, into the other stage
                other = 1 - stage
                h_next = hk * G + gq_next
                copy_q(sm, Q_OFF + other * STAGE, Q, z, h_next, i_next * B_r, N_q, tid)
                copy_q(sm, Q_OFF + other * STAGE + B_r * RS, dO, z, h_next, i_next * B_r, N_q, tid)
                if tid < B_r:
                    row = i_next * B_r + tid
                    l_next = L[z, h_next, row] if row < N_q else inf
                    d_next = D[z, h_next, row] if row < N_q else float32(0.0)
            ptx.cp_async_commit()
            h = hk * G + gq
            q0 = i * B_r
            q_off = Q_OFF + stage * STAGE
            l_off = ST_OFF + stage * 2 * B_r

            # Lines 11 and 17: Sᵀ = K_j Q_iᵀ, dPᵀ = V_j dO_iᵀ.
            zero(s, S_LEN)
            zero(dp, S_LEN)
            if PAIRED:
                score_pairs(s, dp, s_part, dp_part, s_cross, dp_cross, sm, a_at, b_at, q_off)
            else:
                score_products(s, s_part, s_cross, sm, K_OFF + a_at, q_off + b_at)
                score_products(dp, s_part, s_cross, sm, V_OFF + a_at, q_off + B_r * RS + b_at)
            # Line 13: Pᵀ = exp(τSᵀ − L_i) (τS − L in one fused rounding, then base 2), 0 for keys past N_k and
            # (causal) keys after the query's diagonal — tested only where the block holds such keys.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > q0 + diag)
            for n in range(NT):
                for e in range(4):
                    key = key0 + g + 8 * (e // 2)
                    col = 8 * n + 2 * t + e % 2
                    p = ex2(cuda.fma(s[4 * n + e], scale, -smf[l_off + col]) * float32(LOG2E))
                    if mask_tile and (key >= N_k or (causal and key > q0 + col + diag)):
                        p = float32(0.0)
                    s[4 * n + e] = p
            # Line 16: dV_j += Pᵀ dO_i (Pᵀ split first; line 19, dSᵀ = Pᵀ ∘ (dPᵀ − D_i), then replaces it in s,
            # so that dPᵀ's registers are free during the update).
            split_a(pa, s)
            for n in range(NT):
                for e in range(4):
                    s[4 * n + e] *= dp[4 * n + e] - smf[l_off + B_r + 8 * n + 2 * t + e % 2]
            update(dv, part, pa, sm, q_off + B_r * RS + u_at)
            # Line 21: dK_j += dSᵀ Q_i (τ applied once, at the end).
            split_a(pa, s)
            update(dk, part, pa, sm, q_off + u_at)
            # τ·dS into the dS tile, queries as rows; the next step's statistics into the other stage.
            for n in range(NT):
                for e in range(4):
                    smf[DS_OFF + (8 * n + 2 * t + e % 2) * DSS + key_w + g + 8 * (e // 2)] = scale * s[4 * n + e]
            if tid < B_r and step + 1 < n_steps:
                smf[ST_OFF + (1 - stage) * 2 * B_r + tid] = l_next
                smf[ST_OFF + (1 - stage) * 2 * B_r + B_r + tid] = d_next
            cuda.syncthreads()
            # Line 20: dQ_i += τ dS K_j, this warp's tiles, added into HBM.
            zero(qacc, Q_LEN)
            dq_product(qacc, qpart, sm, ds_at, kb_at)
            for u in range(NQW):
                for e in range(4):
                    row = q0 + 16 * mq + g + 8 * (e // 2)
                    if row < N_q:
                        cuda.atomic.add(dQ, (z, h, row, 8 * (n_first + u) + 2 * t + e % 2), qacc[4 * u + e])
            i = i_next
            gq = gq_next

        ptx.cp_async_wait_all()
        # Line 24: dK_j = τ Σ dSᵀ Q_i and dV_j to HBM, once.
        for n in range(NK):
            for e in range(4):
                key = key0 + g + 8 * (e // 2)
                if key < N_k:
                    col = 8 * n + 2 * t + e % 2
                    dK[z, hk, key, col] = scale * dk[4 * n + e]
                    dV[z, hk, key, col] = dv[4 * n + e]

    return flash2_backward_3xtf32_kernel


def flash2_backward_3xtf32(Q, K, V, O, L, dO, causal=False, scale=None, warps=None, B_r=None,
                           paired=None) -> Flash2Backward:
    """FA2 backward (Alg. 2) in 3xTF32 on tensor cores: float32 Q (…, N_q, d), K, V (…, N_k, d), the forward's O and
    L (natural log, +inf on rows that see no key) and dO — NumPy arrays or CUDA arrays (C-contiguous) — d a
    multiple of 16 up to 128, d_v = d; GQA by head mapping (dK, dV summed over each group); ``causal``
    bottom-right; ``scale`` τ (default 1/√d); ``warps``, ``B_r``, ``paired``: the tile (:func:`config_for`). Returns
    ``Flash2Backward(dQ, dK, dV)``, float32, NumPy in → NumPy out. Cost per (batch, head): 10·N_q·N_k·d FLOPs
    (half of it skipped when causal) as three times as many tensor-core FLOPs; HBM reads of K, V once and of Q, dO,
    L, D once per key block, writes of dK, dV once, N_q·d·⌈N_k / B_c⌉ atomic additions into dQ. Launches:
    D = rowsum(dO ∘ O) (a warp per row),
    dQ = 0, then this kernel on a grid of (key blocks, H_kv, batch) — causal, (H_kv, batch, key blocks): the
    blocks with the most row blocks to visit start first."""
    layout, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale)
    N_q, N_k, d, d_v = layout.N_q, layout.N_k, layout.d, layout.d_v
    if d_v != d:
        raise ValueError(f"V's head dimension must equal Q's for the 3xTF32 backward: d = {d}, d_v = {d_v}")
    if d % 16 or d > MAX_HEAD_DIM:
        raise ValueError(f"the 3xTF32 backward takes head dimensions that are multiples of 16 up to {MAX_HEAD_DIM}, "
                         f"got d = {d}")
    O4 = rt.prepare_like(O, "O", layout, (N_q, d))
    L4 = rt.prepare_like(L, "L", layout, (N_q,), finite=False)
    dO4 = rt.prepare_like(dO, "dO", layout, (N_q, d))
    Q4, K4, V4, dO4 = (_contiguous(x, name) for x, name in ((Q4, "Q"), (K4, "K"), (V4, "V"), (dO4, "dO")))
    cfg = config_for(d, "float32", bool(causal), rt.simulator_in_use(), warps, B_r, paired)
    Z, H_q, H_kv = layout.Z, layout.H_q, layout.H_kv
    # Alg. 2 line 4: D = rowsum(dO ∘ O); line 3: dQ = 0 (the kernel's atomic additions accumulate into it).
    D = rt.device_empty((Z, H_q, N_q))
    warp_preprocess(O4, dO4, D, d)
    dQ = rt.device_zeros((Z, H_q, N_q, d))
    dK = rt.device_empty((Z, H_kv, N_k, d))
    dV = rt.device_empty((Z, H_kv, N_k, d))
    args = (Q4, K4, V4, dO4, L4, D, dQ, dK, dV, np.int32(N_q), np.int32(N_k), np.int32(layout.G), np.float32(tau))
    T_c = rt.grid_size(N_k, cfg.B_c)
    grid = (H_kv, Z, T_c) if causal else (T_c, H_kv, Z)
    driver_launch.launch(make_kernel(cfg), grid, cfg.threads, 0, args, 4 * shared_words(cfg))
    return Flash2Backward(rt.finish(dQ, layout, (N_q, d)),
                          rt.finish(dK, layout, (N_k, d), per_query=False),
                          rt.finish(dV, layout, (N_k, d), per_query=False))
