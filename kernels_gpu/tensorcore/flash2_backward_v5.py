"""Tensor-core FA2 backward, v5: the copies' index arithmetic taken out of the loop (v4 + one change).

v3 and v4 start every 16-byte ``cp.async`` of a tile — Q_i and dO_i in the key-block kernel, K_j and V_j in the
dQ kernel, and each kernel's resident rows — with ``copy_rows_async``, which derives the copy's row and chunk from
its index (a division and a remainder), clamps the row and rebuilds the 64-bit address: the forward's v8 schedule,
which its v9 replaced. Nsight Compute on v4's key-block kernel (batch 4, 8 heads, N = 4096, d = 128, causal,
bfloat16: ``ncu_tensorcore_bwd_v4_d128.txt``) finds the integer pipe (ALU) the busiest, at 38 % of its peak,
with two blocks of four warps per SM issuing 1.75 instructions per cycle and no warp eligible in 56 % of the
cycles. v5 takes the forward v9's copy (``copy_rows_async_inc`` of :mod:`~kernels_gpu.tensorcore.backward_steps`):
a thread always copies the same chunk of rows ``tid // CH + k·DR``, so its two addresses are computed once per
tile and stepped by constants. Nothing else changes: same tiles, same launch order (v4's), same sums — the
gradients are bit-identical to v4's.

**Prediction (before the first GPU run).** At d = 128 a thread of the key-block kernel makes 8 copies per row
block (Q_i and dO_i: 32 rows × 16 chunks each over 128 threads) against about 128 MMAs per warp; the dQ kernel
makes 8 per key tile. If issue slots bind as they did the forward v8 (+10-45 % from v9), the key-block kernel
gains 5-15 % and the dQ kernel 5-10 % at the GPT training shape (``benchmarks.profilers.tensorcore_backward_tiles``).

**Measured** (H100 80GB HBM3, 2026-11-26, one machine, v4 then v5: ``tensorcore_backward_tiles_v4.json`` and
``_v5.json``; batch 4, 8 heads, N = 4096, causal, bfloat16; each kernel's GPU time per call from PyTorch's
profiler). d = 128 (4 warps, B_r = 32): key-block kernel 1.419 → 1.189 ms (−16 %), dQ kernel 0.779 → 0.674 ms
(−13 %) — both a little past the prediction; d = 64 (B_r = 64): 0.839 → 0.681 ms (−19 %) and 0.427 → 0.330 ms
(−23 %). A whole call (CUDA events): 2.350 → 2.039 ms at d = 128, 1.494 → 1.143 ms at d = 64; cuDNN's backward
in the same run 0.909 and 0.617 ms. ptxas: the key-block kernel at d = 128 from 255 to 247 registers, the dQ
kernel unchanged (166). The tile sweep of the same run (4 and 8 warps, B_r = 32 and 64) found no shared shape
faster than the default by more than 1 %: the kernels prefer different shapes (at d = 64 the key-block kernel
B_r = 32, 0.638 ms, the dQ kernel B_r = 64). GPU tests (``gpu_tests_tensorcore_backward_v5.log``: every v5 case,
the fastest rung's, and v4, v5 bit-identical to v3 at d = 64 and 128): 26 passed; compute-sanitizer memcheck
(``sanitizer_tensorcore_bwd_v5_memcheck.log``): 0 errors. On the ladder's grid (``tensorcore_backward_v5.json``:
fp16 and bf16, causal and not, d = 64 and 128, N = 1024 / 4096 / 8192, batch × N = 16k tokens): +9-27 % over v3
in the same run; from N = 4096, 146-195 TFLOP/s, 0.65-0.73× SDPA flash's backward (v3: 0.52-0.58× non-causal in
``tensorcore_backward.json``).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore import flash2_backward_v3 as v3
from kernels_gpu.tensorcore import flash2_backward_v4 as v4
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps

__all__ = ["flash2_backward", "make_kernel", "make_dq_kernel", "longest_first", "config_for", "shared_words",
           "dq_shared_words"]

#: the argument types of the two kernels (v3's), for ``kernels_gpu.tensorcore.inspect_ptx`` (``bwd_v5``, ``bwd_v5_dq``)
PTX_SIGNATURE, DQ_PTX_SIGNATURE = v3.PTX_SIGNATURE, v3.DQ_PTX_SIGNATURE
#: v3's tile shapes and shared memory, unchanged
config_for, shared_words, dq_shared_words = v3.config_for, v3.shared_words, v3.dq_shared_words


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig):
    """v5's key-block kernel (dK_j, dV_j) for one configuration (compiled on first launch): v4's, with the copies
    that step their addresses."""
    st = make_backward_steps(cfg)
    # The copies of v3 and v4 recomputed a (row, chunk) per 16-byte copy; these compute it once per tile and step
    # it by constants (the forward v9's change: ``copy_rows_async_inc``).
    copy_kv, copy_q = st["copy_kv_async_inc"], st["copy_q_async_inc"]
    copy_stats, zero = st["copy_stats_async"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    probabilities, softmax_gradient, store_rows = st["probabilities"], st["softmax_gradient"], st["store_rows"]
    B_r, B_c, RS = cfg.B_r, cfg.B_c, cfg.RS
    CHUNKS, DC = cfg.chunks, cfg.DC
    K_OFF = 0                                # word offsets: K_j, V_j, stage 0 (Q_i, dO_i), stage 1 (Q_i, dO_i),
    V_OFF = B_c * RS                         # then (as floats) stage 0 (L_i·log₂e, D_i), stage 1
    Q_OFF = 2 * B_c * RS
    DO_OFF = Q_OFF + B_r * RS
    STAGE = 2 * B_r * RS
    L_OFF = Q_OFF + 2 * STAGE
    D_OFF = L_OFF + B_r
    FSTAGE = 2 * B_r
    S_LEN, C_LEN = 4 * cfg.NT, 4 * cfg.NC
    causal = cfg.causal

    @cfg.jit()
    def flash2_backward_tc_v5(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        if causal:                            # grid (H_kv, batch, key blocks · chunks): key block 0 first
            hk = cuda.blockIdx.x
            z = cuda.blockIdx.y
            j = cuda.blockIdx.z // CHUNKS     # key block j (Alg. 2 line 5: one block per j, in parallel) ...
            c = cuda.blockIdx.z - j * CHUNKS  # ... and the column chunk of dK_j, dV_j this block computes
        else:                                 # grid (key blocks · chunks, H_kv, batch), as v3
            j = cuda.blockIdx.x // CHUNKS
            c = cuda.blockIdx.x - j * CHUNKS
            hk = cuda.blockIdx.y
            z = cuda.blockIdx.z
        sm = cuda.shared.array(0, uint32)
        smf = cuda.shared.array(0, float32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dk = cuda.local.array(C_LEN, float32)
        dv = cuda.local.array(C_LEN, float32)
        diag = N_k - N_q
        key0 = j * B_c + 16 * warp
        col_word = c * (DC // 2)

        # Alg. 2 line 8's loop over (query head of the GQA group, row block i), flattened, as in v2.
        T_r = (N_q + B_r - 1) // B_r
        i_first = 0
        if causal and j * B_c - diag > 0:
            i_first = min(T_r, (j * B_c - diag) // B_r)
        n_i = T_r - i_first
        n_steps = G * n_i
        # Alg. 2 line 6, and lines 9-10 for the first step, as one group.
        copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        if n_steps > 0:
            copy_q(sm, Q_OFF, Q, z, hk * G, i_first * B_r, N_q, tid)
            copy_q(sm, DO_OFF, dO, z, hk * G, i_first * B_r, N_q, tid)
            copy_stats(smf, L_OFF, stats, z, hk * G, i_first * B_r, tid)
        ptx.cp_async_commit()
        # Alg. 2 line 7: dK_j = 0, dV_j = 0.
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        for step in range(n_steps):
            gq = step // n_i
            i = i_first + step - gq * n_i
            stage = step % 2
            ptx.cp_async_wait_all()           # this step's tiles have landed (the only group in flight) ...
            cuda.syncthreads()                # ... for everyone, and nobody still reads the other stage
            # Lines 9-10 for the next step, into the other stage, land while this one is computed.
            if step + 1 < n_steps:
                gq_next = (step + 1) // n_i
                i_next = i_first + step + 1 - gq_next * n_i
                h_next = hk * G + gq_next
                other = 1 - stage
                copy_q(sm, Q_OFF + other * STAGE, Q, z, h_next, i_next * B_r, N_q, tid)
                copy_q(sm, DO_OFF + other * STAGE, dO, z, h_next, i_next * B_r, N_q, tid)
                copy_stats(smf, L_OFF + other * FSTAGE, stats, z, h_next, i_next * B_r, tid)
            ptx.cp_async_commit()
            q_off = Q_OFF + stage * STAGE
            do_off = DO_OFF + stage * STAGE

            # Line 11: Sᵀ = K_j Q_iᵀ; line 13: Pᵀ = exp(τSᵀ − L_i) (masked only where needed).
            product_transposed(s, sm, K_OFF, q_off, warp, lane)
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, L_OFF + stage * FSTAGE, key0 + lane // 4, i * B_r, N_k, scale_log2, diag,
                          mask_tile)
            # Line 16: dV_j += Pᵀ dO_i.
            product_accumulate(dv, s, sm, do_off, col_word, lane)
            # Line 17: dPᵀ = V_j dO_iᵀ; line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            product_transposed(dp, sm, V_OFF, do_off, warp, lane)
            softmax_gradient(s, dp, smf, D_OFF + stage * FSTAGE)
            # Line 21: dK_j += dSᵀ Q_i. (Line 20, dQ_i, is the dQ kernel's.)
            product_accumulate(dk, s, sm, q_off, col_word, lane)

        ptx.cp_async_wait_all()
        # Line 24: write dK_j = τ Σ dSᵀQ, dV_j to HBM, once.
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flash2_backward_tc_v5


@functools.lru_cache(maxsize=None)
def make_dq_kernel(cfg: BackwardConfig):
    """v5's dQ kernel for one configuration: v4's (one block per query block of 16·W rows, looping over key tiles
    of B_r keys), with the copies that step their addresses."""
    st = make_backward_steps(cfg)
    # 16·W rows, B_r rows: the copies with their addresses stepped by constants (as in the key-block kernel)
    copy_rows, copy_tile, zero = st["copy_kv_async_inc"], st["copy_q_async_inc"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    probabilities, softmax_gradient, store_rows = st["probabilities_rows"], st["softmax_gradient_rows"], \
        st["store_rows"]
    B_r, B_q, RS = cfg.B_r, cfg.B_c, cfg.RS  # keys per tile; queries per block (16 per warp)
    CHUNKS, DC = cfg.chunks, cfg.DC
    Q_OFF = 0                                # word offsets: Q_i, dO_i, stage 0 (K_j, V_j), stage 1 (K_j, V_j)
    DO_OFF = B_q * RS
    K_OFF = 2 * B_q * RS
    V_OFF = K_OFF + B_r * RS
    STAGE = 2 * B_r * RS
    S_LEN, C_LEN = 4 * cfg.NT, 4 * cfg.NC
    causal = cfg.causal

    @cfg.jit(dq=True)
    def flash2_backward_dq_tc_v5(Q, K, V, dO, stats, dQ, N_q, N_k, G, scale, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        if causal:                            # grid (H_q, batch, query blocks · chunks), read from the end:
            h = cuda.blockIdx.x               # the last query block (the most key tiles) first
            z = cuda.blockIdx.y
            ic = cuda.gridDim.z - 1 - cuda.blockIdx.z
            i = ic // CHUNKS                  # query block i: one block per i (FA2 Section 3.2, as the forward) ...
            c = ic - i * CHUNKS               # ... and the column chunk of dQ_i this block computes
        else:                                 # grid (query blocks · chunks, H_q, batch), as v3
            i = cuda.blockIdx.x // CHUNKS
            c = cuda.blockIdx.x - i * CHUNKS
            h = cuda.blockIdx.y
            z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dq = cuda.local.array(C_LEN, float32)
        lrow = cuda.local.array(2, float32)
        drow = cuda.local.array(2, float32)
        diag = N_k - N_q
        first_row = i * B_q + 16 * warp
        row0 = first_row + lane // 4          # this lane's first row; its second is row0 + 8
        col_word = c * (DC // 2)
        # Alg. 2 line 10 for the lane's two rows: L·log₂e and D (+∞ and 0 past N_q: P = 0, dS = 0).
        for hh in range(2):
            lrow[hh] = stats[z, h, 0, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(math.inf)
            drow[hh] = stats[z, h, 1, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(0.0)

        # Causal: the key tiles right of the block's last row's diagonal are never visited.
        n_tiles = (N_k + B_r - 1) // B_r
        if causal:
            last = min(N_k, (i + 1) * B_q + diag)
            n_tiles = max(0, (last + B_r - 1) // B_r)
        copy_rows(sm, Q_OFF, Q, z, h, i * B_q, N_q, tid)
        copy_rows(sm, DO_OFF, dO, z, h, i * B_q, N_q, tid)
        if n_tiles > 0:
            copy_tile(sm, K_OFF, K, z, hk, 0, N_k, tid)
            copy_tile(sm, V_OFF, V, z, hk, 0, N_k, tid)
        ptx.cp_async_commit()
        zero(dq, C_LEN)                       # Alg. 2 line 3 for this block's rows: dQ_i = 0, in registers
        for jt in range(n_tiles):
            stage = (jt % 2) * STAGE
            ptx.cp_async_wait_all()           # this tile (and Q_i, dO_i) has landed ...
            cuda.syncthreads()                # ... for everyone, and nobody still reads the other stage
            if jt + 1 < n_tiles:              # the next tile's copy runs under this tile's products
                copy_tile(sm, K_OFF + STAGE - stage, K, z, hk, (jt + 1) * B_r, N_k, tid)
                copy_tile(sm, V_OFF + STAGE - stage, V, z, hk, (jt + 1) * B_r, N_k, tid)
            ptx.cp_async_commit()
            # Alg. 2 lines 11, 13: S = Q_i K_jᵀ (the warp's 16 rows × B_r keys), P = exp(τS − L_i).
            product_transposed(s, sm, Q_OFF, K_OFF + stage, warp, lane)
            mask_tile = (jt + 1) * B_r > N_k or (causal and (jt + 1) * B_r - 1 > i * B_q + diag)
            probabilities(s, lrow, row0, jt * B_r, N_k, scale_log2, diag, mask_tile)
            # Lines 17, 19: dP = dO_i V_jᵀ, dS = P ∘ (dP − D_i).
            product_transposed(dp, sm, DO_OFF, V_OFF + stage, warp, lane)
            softmax_gradient(s, dp, drow)
            # Line 20: dQ_i += dS K_j — dS's accumulators are the A operand, K_j the B operand (transposed load).
            product_accumulate(dq, s, sm, K_OFF + stage, col_word, lane)

        ptx.cp_async_wait_all()
        # dQ_i = τ Σ_j dS K_j, written once in the input dtype (no float32 copy, no atomics).
        store_rows(dq, dQ, z, h, first_row, N_q, col_word, scale, lane)

    return flash2_backward_dq_tc_v5


#: v4's launch grids (causal: the longest blocks first)
longest_first = v4.longest_first


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, **tile):
    """FA2 backward on tensor cores, rung v5 (v4 with copies that step their addresses). Same arguments and
    result as v1's (:func:`kernels_gpu.tensorcore.flash2_backward_v1.flash2_backward`), bit-identical to v3's and
    v4's; ``tile``: ``warps``, ``B_r``, ``chunks``."""
    return backward_launch.run_backward_dq_pass(make_kernel, make_dq_kernel, config_for, shared_words,
                                                dq_shared_words, Q, K, V, O, L, dO, causal=causal, scale=scale,
                                                grids_for=longest_first, **tile)
