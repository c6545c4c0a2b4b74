"""3xTF32 forward, second form: K_j and V_j split once per tile into big and small **planes** in shared memory, every
operand fed to the MMAs by ``ldmatrix`` (the 3xTF32 rung, :mod:`~kernels_gpu.tensorcore.flash2_forward_3xtf32`, +
one change).

**What limited the first form.** Every warp split every K and V value it multiplied, on its way from shared memory
into registers: four instructions (cvt, and, sub, cvt) for each of its two tf32 halves' registers, per warp and per
use, plus a scalar shared load with its address arithmetic — ~2050 instructions per warp and 32-key tile at d = 128
for 384 MMAs. It ran at 25-28 TFLOP/s where PyTorch's own 3xTF32 (SDPA memory-efficient, float32) runs at 44-46.

**What changes.**

* **Split once.** Q_i is split once per block, K_j and V_j once per tile, by all the block's threads together, each
  value once, into big and small **planes** in shared memory: Q_big, Q_small and K_big, K_small row-major as the
  tensors, V_big, V_small stored **transposed**, Vᵀ[column][key], with each 8-key group's keys in the order 0, 2,
  4, 6, 1, 3, 5, 7 (:data:`~kernels_gpu.fragments.KEY_ORDER_TF32`, the order P̃'s accumulators give).
  K_j and V_j still arrive as float32 (``cp.async``, two raw stages, tile j + 2 on its way while tile j is used);
  Q_i's float32 rows land in the space of the K/V stages before the first tile and are split from there.
* **Every operand by ``ldmatrix``.** ``ldmatrix`` moves 8 × 8 matrices of 16-bit elements; read as 32-bit data, an
  8 × 8 b16 matrix is an 8-row × 4-column tile of tf32 values of which lane (g, t) receives row g, column t — exactly
  a0 of an m16n8k8 A fragment and b0 of a B fragment. So one ``ldmatrix.x4`` gives a whole A fragment (Q_i's rows
  r … r + 15, columns c … c + 7, as four 8 × 4 tiles), or the B fragments of two 8-key tiles of S (K's rows n … n + 15
  — K is Bᵀ — columns c … c + 7), or of two 8-column tiles of Õ (Vᵀ's rows, the permuted keys as columns): per
  8-wide k-step and pair of tiles, four ``ldmatrix`` (Q's and K's big and small) and six MMAs, where the first form
  issued ten scalar loads, ten splits and six MMAs.
* **The split's roundings on the bits** (:func:`kernels_gpu.ptx.split_tf32`): cvt.rna's rounding as an
  integer addition and a mask, two instructions, where ptxas expands ``cvt.rna.tf32.f32`` on sm_90 into five.
* **Eight warps, B_r = 128, B_c = 16**, d a multiple of 16 up to 128: at d = 128 Q_i's planes 132 KB, two raw
  stages 33 KB, the K/V planes 37 KB — 202 KB, one block per SM (d = 64: 104 KB, two).
* Staged accumulation as in the first form (chains of at most 12 MMAs, summed by float32 additions), with each
  product's big·big MMA and its two cross-term MMAs in separate accumulators (two independent chains per tile);
  Õ += P̃V runs over pairs of Õ tiles, each pair's products summed in zeroed registers.

Cost per (batch, head): the first form's HBM traffic with B_r = 128 (half the K/V reads); per warp and 16-key tile
at d = 128, ~1030 instructions for 192 MMAs (SASS), and per block and tile one split pass of 2·B_c·d values (16
per thread).

**Prediction** (written before the first GPU run, for the first version of this design: Q_i split per use by every
warp, two plane stages). The split of K and V leaves the warps' loops (~60 % of the first form's instructions) and
the loads become ``ldmatrix``; what is left per MMA is ~4.4 instructions, against ~10.7. If time follows
instructions, 2.4× the first form: 60-65 TFLOP/s at d = 128; the MMA rate (three tf32 MMAs per product, ~120-150
TFLOP/s of tf32 MMAs sustained by mma.sync on Hopper) caps it at 40-50. So **40-50 TFLOP/s at d = 128, N ≥ 4096**
— level with SDPA memory-efficient float32 (44-46) — and at d = 64 35-45 (SDPA 35); error as the first form's.

**Measured** (H200, 2026-11-26, ``python -m benchmarks.profilers.tensorcore_variants --parts precision``, batch × N =
16k tokens, non-causal, TFLOP/s at N = 2048 / 4096 / 16384, kernels_gpu.fast's float32 forward and SDPA
memory-efficient float32 in every run):

1. **First version** (Q_i split per use, two plane stages, ``cvt.rna`` in the split;
   ``tensorcore_3xtf32_planes_first.json``): d = 128 20.5 / 22.0 / 22.8, d = 64 17.9 / 19.2 / 20.4 — *slower* than
   the first form (25.5 / 26.5 / 27.6): the prediction failed. Nsight Compute (``ncu_3xtf32_planes_first_d128.txt``,
   N = 4096): 2.34 instructions per cycle, issue slots 57 % busy — the kernel issued far more than counted. Per
   opcode (its SASS source page, ``ncu_3xtf32_planes_first_d128_loops.txt``) HMMA was 6 % of the instructions
   executed: each ``cvt.rna.tf32.f32`` is five instructions on sm_90 (an addition of 0x1000, a test for infinity, a
   select, a mask), the split pass indexed shared memory in 64-bit arithmetic behind numba's negative-index tests,
   and the staging test ``kk % 4`` ran in 64-bit uniform arithmetic inside the loop.
2. **The roundings on the bits, the staging as a loop of constant trip count** (``tensorcore_3xtf32_planes_intsplit
   .json``): d = 128 24.4 / 26.3 / 28.5, d = 64 21.8 / 23.3 / 25.0 (the first form with the same split: 24.9 / 26.4
   / 28.8 and 28.8 / 29.9 / 32.8).
3. **Q_i split once into planes** (one plane stage for K, V to make room) **and the split pass at fixed per-thread
   offsets with unsigned indices** (``tensorcore_3xtf32_planes_one_chain.json``): d = 128 32.7 / 35.1 / 40.0,
   d = 64 30.4 / 33.0 / 37.5 — faster than kernels_gpu.fast's float32 forward in the same run (28.9 / 33.4 / 37.3
   and 27.6 / 28.9 / 33.9) at every point, and than SDPA at d = 64, N = 16384 (35.0); SDPA memory-efficient at d = 128:
   44.6 / 45.9 / 44.4 (0.73-0.90× of it). Error at N = 2048: 6.2e-7 (d = 128) and 3.7e-7 (d = 64), SDPA 5.5e-7 and
   5.3e-7. GPU tests (``gpu_tests_tensorcore_3xtf32_planes.log``; both forms, the shapes of the tensor-core ladder
   that each takes, within :func:`error_bound` and flash-attn's rule against SDPA float32, extreme logits, 100
   identical reruns): 13 passed. ptxas: 173 registers at d = 128, 130 at d = 64, no spills. What limited it
   (Nsight Compute, ``ncu_3xtf32_planes_one_chain_d128.txt``, d = 128, N = 4096): 1.24 instructions per cycle,
   0.38 eligible warps per scheduler, 6.5 cycles between a warp's instructions, the tensor pipe 38 % busy —
   latency, not issue: two warps per scheduler, each warp's MMAs in two dependent chains (S's two 8-key tiles; Õ's
   two tiles of a pair), three MMAs deep per k-step.
4. **Two chains per tile** (the cross terms in their own accumulators; this file, ``tensorcore_3xtf32_planes
   .json``). Predicted: the tensor pipe toward 50 %, d = 128 at N = 4096 35.1 → 40-45. Measured: d = 128 **34.2 /
   38.1 / 41.2**, d = 64 **31.4 / 32.3 / 35.8**; kernels_gpu.fast 30.5 / 33.3 / 38.0 and 29.2 / 31.5 / 34.2, SDPA
   memory-efficient 45.5 / 45.6 / 44.9 and 35.1 / 35.6 / 35.8 in the same run — +3-9 % at d = 128, a third of the
   prediction, −2 to +3 % at d = 64; kept (faster at d = 128, and the error fell: 4.7e-7 at d = 128, 2.2e-7 at
   d = 64, below SDPA's 5.5e-7 and 5.3e-7). Two pairs of Õ tiles per step as well (eight chains) took 255
   registers with spills at d = 128 and was not run. GPU tests (``gpu_tests_3xtf32_planes_chains.log``,
   this form's cases): 5 passed. ptxas: 185 registers at d = 128, 132 at d = 64, no spills.

So the float32-accurate tensor-core forward is now the fastest float32 forward fa2edu has at d = 64 and 128 on this
H200, at 0.75-0.92× SDPA's own 3xTF32 kernel at d = 128 (1.0× at d = 64, N = 16384). What is left is the gap at
d = 128 — one block of eight warps per SM, and the block's split pass between two barriers with nothing to overlap
it — and the backward: fa2edu's float32 op spends about three quarters of its time there, so a 3xTF32 backward (five
products, the same planes) is what would move ``fa2edu.torch.flash_attention``'s float32 speed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore.flash2_forward_3xtf32 import Flash2Forward3xTF32, error_bound
from kernels_gpu.tensorcore.flash2_forward_tf32 import PTX_SIGNATURE as PTX_SIGNATURE_TF32
from kernels_gpu.tensorcore.flash2_forward_tf32 import (
    TF32Config,
    launch_forward,
    make_accumulators,
    make_copy_rows,
    make_softmax,
    make_splits,
)
from kernels_gpu.tensorcore.steps import LOG2E, device

__all__ = ["flash2_forward_3xtf32_planes", "PlanesConfig", "config_for", "make_kernel",
           "shared_words", "error_bound", "MAX_HEAD_DIM", "PTX_SIGNATURE"]

MAX_HEAD_DIM = 128


#: the kernel's argument types (the TF32 rung's), for ``python -m kernels_gpu.tensorcore.inspect_ptx 3xtf32_planes
#: --dtype float32``
PTX_SIGNATURE = PTX_SIGNATURE_TF32


@dataclass(frozen=True)
class PlanesConfig(TF32Config):
    """The TF32 rung's compile-time constants (d, B_c, causal, simulated, W warps of 16 query rows, B_r = 16·W;
    ``products`` is 3) with this form's limits: d a multiple of 16 up to 128, B_c a multiple of 16."""

    warps: int = 8
    products: int = 3
    STEP: ClassVar[int] = 16
    MAX_D: ClassVar[int] = MAX_HEAD_DIM
    PRODUCTS: ClassVar[tuple] = (3,)

    @property
    def VS(self) -> int:
        """Words per row of a Vᵀ plane (one row per column of V): B_c + 4."""
        return self.B_c + 4

    @property
    def raw_stage(self) -> int:
        return 2 * self.B_c * self.RS

    @property
    def plane_stage(self) -> int:
        return 2 * self.B_c * self.RS + 2 * self.d * self.VS

    @property
    def q_planes(self) -> int:
        return 2 * self.B_r * self.RS


def config_for(d: int, dtype: str, causal: bool, simulated: bool, warps: int = 8) -> PlanesConfig:
    """Eight warps (B_r = 128) and 16-key tiles. ``dtype``: the inputs' type, "float32" (for ``inspect_ptx``)."""
    if dtype != "float32":
        raise ValueError(f"the 3xTF32 kernels take float32 inputs (dtype 'float32'), got {dtype!r}")
    return PlanesConfig(d=d, B_c=16, causal=causal, simulated=simulated, warps=warps)


def shared_words(cfg: PlanesConfig) -> int:
    """32-bit words of shared memory: Q_i's two planes, two raw K/V stages, one stage of K's and Vᵀ's four planes
    (Q_i's float32 rows land in the last two, before the first tile, and are split from there)."""
    assert cfg.B_r * cfg.RS <= 2 * cfg.raw_stage + cfg.plane_stage
    return cfg.q_planes + 2 * cfg.raw_stage + cfg.plane_stage


def stage_steps(k_steps: int) -> int:
    """3xTF32's staged sums of S: the k-steps per stage, 4 where they divide the head dimension's k-steps (else 2,
    else 1), so that the stages are a loop of constant trip count (no test of the step index inside it)."""
    return 4 if k_steps % 4 == 0 else 2 if k_steps % 2 == 0 else 1


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: PlanesConfig):
    """The kernel for one configuration (compiled on first launch)."""
    jit = device(cfg.simulated)
    B_r, B_c, T, RS, VS, NT, NO, d = cfg.B_r, cfg.B_c, cfg.threads, cfg.RS, cfg.VS, cfg.NT, cfg.NO, cfg.d
    RAW_STAGE = cfg.raw_stage
    Q_SMALL = B_r * RS                        # word offsets in the one shared array: Q_big, Q_small, the raw
    RAW = 2 * B_r * RS                        # stages, the planes of K_j and V_j
    PLANES = RAW + 2 * RAW_STAGE
    K_SMALL = B_c * RS                        # within a plane stage: K_big, K_small, Vᵀ_big, Vᵀ_small
    V_BIG = 2 * B_c * RS
    V_SMALL = V_BIG + d * VS
    S_LEN, O_LEN, PA_LEN = 4 * NT, 4 * NO, 8 * NT
    KG = stage_steps(NO)                      # k-steps of S per staged sum
    causal = cfg.causal
    neg_inf = float32(-math.inf)
    split, ldmatrix = ptx.split_tf32, ptx.ldmatrix_x4

    copy_q, copy_kv = make_copy_rows(jit, d, RS, T, B_r), make_copy_rows(jit, d, RS, T, B_c)
    row_softmax, finish_row = make_softmax(jit, NT, NO, causal)
    zero, add_into, mma_into = make_accumulators(jit)

    @jit
    def product_parts(big, cross, n, a, bh0, bh1, bl0, bl1):
        """Tile n of A·B in 3xTF32 (``a``: A's 4 big, then 4 small registers; B's big and small halves): A_big·B_big
        into ``big``, the cross terms A_small·B_big + A_big·B_small into ``cross`` — two independent chains of
        MMAs, summed by the caller."""
        mma_into(cross, n, a[4], a[5], a[6], a[7], bh0, bh1)
        mma_into(cross, n, a[0], a[1], a[2], a[3], bl0, bl1)
        mma_into(big, n, a[0], a[1], a[2], a[3], bh0, bh1)

    a_operands, _ = make_splits(jit)

    # The split pass's work per thread: K element by element (consecutive threads on consecutive words: no bank
    # conflicts), V transposed (consecutive threads on consecutive keys of one column); key r of a tile goes to
    # position 8·(r // 8) + (r % 8) // 2 + 4·(r % 2) of Vᵀ's row (the k-step order 0, 2, 4, 6, 1, 3, 5, 7). When the
    # threads divide a row of K (T % d = 0) and a column of V (T % B_c = 0), each thread's elements are one fixed
    # offset plus constant steps: the offsets are computed once per kernel and the indices are unsigned (numba
    # tests a signed index for a negative value before every access).
    STRIDED = T % d == 0 and T % B_c == 0
    PASSES = B_c * d // T                     # elements of K (and of V) per thread and tile, when STRIDED
    Q_PASSES = B_r * d // T
    K_STEP = (T // d) * RS if STRIDED else 0  # words between a thread's K elements
    V_STEP = T // B_c if STRIDED else 0       # V's columns between a thread's V elements

    @jit
    def split_offsets(tid):
        """(K's offset, V's source offset, Vᵀ's destination offset) of this thread's first element."""
        r, c = tid // d, tid % d
        v_r, v_c = tid % B_c, tid // B_c
        return (r * RS + c, B_c * RS + v_r * RS + v_c,
                v_c * VS + 8 * (v_r // 8) + (v_r % 8) // 2 + 4 * (v_r % 2))

    @jit
    def split_q(sm, tid, k_off):
        """The block splits Q_i's float32 rows (landed at word RAW) into its two planes, once per block."""
        if STRIDED:
            for p in range(Q_PASSES):
                big, small = split(sm[uint32(RAW + k_off + p * K_STEP)])
                sm[uint32(k_off + p * K_STEP)] = big
                sm[uint32(Q_SMALL + k_off + p * K_STEP)] = small
        else:
            for e in range(tid, B_r * d, T):
                r = e // d
                c = e - r * d
                big, small = split(sm[RAW + r * RS + c])
                sm[r * RS + c] = big
                sm[Q_SMALL + r * RS + c] = small

    @jit
    def split_tile(sm, raw, planes, tid, k_off, v_src, v_dst):
        """The block splits the raw K_j, V_j at word ``raw`` into the four planes at word ``planes``, each value
        once."""
        if STRIDED:
            for p in range(PASSES):
                big, small = split(sm[uint32(raw + k_off + p * K_STEP)])
                sm[uint32(planes + k_off + p * K_STEP)] = big
                sm[uint32(planes + K_SMALL + k_off + p * K_STEP)] = small
            for p in range(PASSES):
                big, small = split(sm[uint32(raw + v_src + p * V_STEP)])
                sm[uint32(planes + V_BIG + v_dst + p * V_STEP * VS)] = big
                sm[uint32(planes + V_SMALL + v_dst + p * V_STEP * VS)] = small
        else:
            for e in range(tid, B_c * d, T):
                r = e // d
                c = e - r * d
                big, small = split(sm[raw + r * RS + c])
                sm[planes + r * RS + c] = big
                sm[planes + K_SMALL + r * RS + c] = small
            for e in range(tid, B_c * d, T):
                c = e // B_c
                r = e - c * B_c
                big, small = split(sm[raw + B_c * RS + r * RS + c])
                at = c * VS + 8 * (r // 8) + (r % 8) // 2 + 4 * (r % 2)
                sm[planes + V_BIG + at] = big
                sm[planes + V_SMALL + at] = small

    @cuda.jit
    def flash2_forward_3xtf32_planes_kernel(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, 32-bit words: float32 tiles and tf32 planes
        s = cuda.local.array(S_LEN, float32)
        s_part = cuda.local.array(S_LEN, float32)
        s_cross = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        o_part = cuda.local.array(8, float32)
        o_cross = cuda.local.array(8, float32)
        pa = cuda.local.array(PA_LEN, uint32)  # P̃'s split A fragments, one k-step per 8 words
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        row0 = i * B_r + 16 * warp + g
        # This lane's ldmatrix row addresses (lanes 8q … 8q + 7 give matrix q's eight rows):
        # A (Q_i's 16 × 8 block of a k-step): matrix q = rows 8·(q % 2) …, columns 4·(q // 2) … → a0, a1, a2, a3.
        q_at = (16 * warp + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 4 * (lane // 16)
        # B for a pair of tiles (K's rows, or Vᵀ's): matrix q = rows 8·(q // 2) …, columns 4·(q % 2) … → b0, b1 of
        # the first tile, b0, b1 of the second.
        b_row = lane % 8 + 8 * (lane // 16)
        b_col = 4 * ((lane // 8) % 2)
        diag = N_k - N_q
        scale_log2 = scale * float32(LOG2E)
        k_off, v_src, v_dst = split_offsets(tid)

        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)
        # Alg. 1 line 4: Q_i into the space of the K/V stages, split there into its planes once; then (line 7)
        # K_1, V_1 as one group of copies, K_2, V_2 as the next.
        copy_q(sm, RAW, Q, z, h, i * B_r, N_q, tid)
        ptx.cp_async_commit()
        ptx.cp_async_wait_all()
        cuda.syncthreads()
        split_q(sm, tid, k_off)
        cuda.syncthreads()
        if n_tiles > 0:
            copy_kv(sm, RAW, K, z, hk, 0, N_k, tid)
            copy_kv(sm, RAW + B_c * RS, V, z, hk, 0, N_k, tid)
        ptx.cp_async_commit()
        if n_tiles > 1:
            copy_kv(sm, RAW + RAW_STAGE, K, z, hk, B_c, N_k, tid)
            copy_kv(sm, RAW + RAW_STAGE + B_c * RS, V, z, hk, B_c, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 1 line 5.
        zero(o, O_LEN)
        for e in range(2):
            m[e] = neg_inf
            l[e] = float32(0.0)
        for j in range(n_tiles):
            raw = RAW + (j % 2) * RAW_STAGE
            planes = PLANES
            ptx.cp_async_wait_one()           # tile j landed for this thread ...
            cuda.syncthreads()                # ... and for everyone; every warp is done with tile j − 1's planes
            split_tile(sm, raw, planes, tid, k_off, v_src, v_dst)
            cuda.syncthreads()                # the planes are written; the raw stage is free
            # Line 7 for tile j + 2, into the stage tile j leaves.
            if j + 2 < n_tiles:
                copy_kv(sm, raw, K, z, hk, (j + 2) * B_c, N_k, tid)
                copy_kv(sm, raw + B_c * RS, V, z, hk, (j + 2) * B_c, N_k, tid)
            ptx.cp_async_commit()

            # Line 8: S_ij = Q_i K_jᵀ, 8-wide k-steps; Q_i split per use, K_j's halves by ldmatrix; the products
            # of each KG k-steps summed in s_part, then added to s in float32.
            zero(s, S_LEN)
            for kg in range(NO // KG):
                zero(s_part, S_LEN)
                zero(s_cross, S_LEN)
                for k4 in range(KG):
                    kk = kg * KG + k4
                    qb0, qb1, qb2, qb3 = ldmatrix(sm, q_at + 8 * kk)
                    qs0, qs1, qs2, qs3 = ldmatrix(sm, q_at + Q_SMALL + 8 * kk)
                    a = (qb0, qb1, qb2, qb3, qs0, qs1, qs2, qs3)
                    for np_ in range(NT // 2):
                        k_at = planes + (16 * np_ + b_row) * RS + 8 * kk + b_col
                        kb0, kb1, kb2, kb3 = ldmatrix(sm, k_at)
                        ks0, ks1, ks2, ks3 = ldmatrix(sm, k_at + K_SMALL)
                        product_parts(s_part, s_cross, 2 * np_, a, kb0, kb1, ks0, ks1)
                        product_parts(s_part, s_cross, 2 * np_ + 1, a, kb2, kb3, ks2, ks3)
                add_into(s_part, s_cross, S_LEN)
                add_into(s, s_part, S_LEN)

            # Lines 9-10: the online softmax (masks only where a key can be invisible to some row of the block).
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            row_softmax(s, o, m, l, 0, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            row_softmax(s, o, m, l, 1, row0 + 8, j * B_c, N_k, scale_log2, diag, mask_tile)

            # Line 10 (second half): Õ_i += P̃_ij V_j. P̃'s A fragments from the lane's accumulators (keys in the
            # order 0, 2, 4, 6, 1, 3, 5, 7: a0 … a3 = c0, c2, c1, c3), split once; then per pair of Õ tiles the
            # tile's k-steps summed in o_part and added to Õ in float32.
            for kk in range(NT):
                a = a_operands(s[4 * kk], s[4 * kk + 2], s[4 * kk + 1], s[4 * kk + 3])
                for e in range(8):
                    pa[8 * kk + e] = a[e]
            for np_ in range(NO // 2):
                zero(o_part, 8)
                zero(o_cross, 8)
                for kk in range(NT):
                    a = (pa[8 * kk], pa[8 * kk + 1], pa[8 * kk + 2], pa[8 * kk + 3], pa[8 * kk + 4],
                         pa[8 * kk + 5], pa[8 * kk + 6], pa[8 * kk + 7])
                    v_at = planes + V_BIG + (16 * np_ + b_row) * VS + b_col + 8 * kk
                    vb0, vb1, vb2, vb3 = ldmatrix(sm, v_at)
                    vs0, vs1, vs2, vs3 = ldmatrix(sm, v_at + d * VS)
                    product_parts(o_part, o_cross, 0, a, vb0, vb1, vs0, vs1)
                    product_parts(o_part, o_cross, 1, a, vb2, vb3, vs2, vs3)
                for e in range(8):
                    o[8 * np_ + e] += o_part[e] + o_cross[e]

        ptx.cp_async_wait_all()
        # Lines 12-15.
        finish_row(o, m, l, 0, O, L, z, h, row0, N_q, scale_log2)
        finish_row(o, m, l, 1, O, L, z, h, row0 + 8, N_q, scale_log2)

    return flash2_forward_3xtf32_planes_kernel


def flash2_forward_3xtf32_planes(Q, K, V, causal=False, scale=None, warps=8) -> Flash2Forward3xTF32:
    """FA2 forward in 3xTF32 with K and V split once per tile: float32 Q (…, N_q, d), K, V (…, N_k, d) — NumPy,
    numba device arrays or CUDA tensors (C-contiguous) — d a multiple of 16 up to 128, d_v = d; GQA by head mapping;
    ``causal`` bottom-right; ``scale`` τ (default 1/√d); ``warps``: W warps of 16 query rows (B_r = 16·W; the
    simulator tests take 2). Returns ``(O, L)`` as the first form does, with its error bound
    (:func:`~kernels_gpu.tensorcore.flash2_forward_3xtf32.error_bound`). Cost: 4·N_q·N_k·d FLOPs per (batch, head),
    as 3× as many tensor-core FLOPs; HBM reads N_q·d + 2·N_k·d·⌈N_q / B_r⌉ floats, writes N_q·(d + 1)."""
    return Flash2Forward3xTF32(*launch_forward(Q, K, V, causal, scale, "3xTF32 planes", 16, MAX_HEAD_DIM,
                                               lambda d, c, sim: config_for(d, "float32", c, sim, warps), make_kernel,
                                               shared_words))
