"""Tensor-core FA2 backward, v4: under causal masking, the longest blocks first in both kernels (v3 + one change).

Causal blocks of the backward are as unequal as the forward's (v11's header): key block j of v3's key-block kernel
visits the row blocks from its diagonal down, about T_r − j·B_c/B_r of them, and query block i of the dQ kernel
visits the key tiles up to its diagonal, about i + 1 of them. v3 launches both kernels with the block index in
blockIdx.x, fastest, so the GPU hands out one head after another: the key-block kernel starts each head's longest
block (j = 0) after the previous head's shortest, and the dQ kernel, light to heavy within each head, launches
the heaviest block of all — the last head's last query block — last, while the other SMs run dry. v4 launches
(heads, batch, blocks) and reads the block from blockIdx.z, slowest: key block j = blockIdx.z in ascending order
(key block 0 is the longest), query block i = T − 1 − blockIdx.z (the last is the longest). Every head's longest
block goes first, the one-tile blocks fill the gaps at the end — the order of v11's forward, and of FA2's own
code for both passes. Non-causal launches keep v3's grids (every block equally long). The kernels' arithmetic is
v3's: the same blocks compute the same sums, so dQ, dK, dV are bit-identical to v3's.

**Prediction (before the first GPU run).** A list-scheduling model (blocks handed out in linear order to the
resident slots, each block's time its tiles plus one for its prologue) at the GPT benchmark's training shape
(batch 4, 8 heads, N = 4096, d = 128, causal; 264 slots for the key-block kernel, 396 for the dQ kernel) puts v3's
key-block kernel 14 % and its dQ kernel 25 % above their ideal time (work / slots), v4's within 1 % and 3 %:
12 % and 18 % less time. Measured GPU time will gain less (the model's slots are uniform, the real ones share SMs):
causal backward 8-15 % faster at N ≥ 4096, within noise at N = 1024; non-causal unchanged; bf16 training at
d = 128 (``benchmarks.gpt_speed``) 3-5 % more tokens/s.

**Measured** (H100 80GB HBM3, 2026-11-26). The ladder's grid in bfloat16 (``tensorcore_backward_v4.json``:
``python -m benchmarks.tensorcore_backward --impls v3,v4,sdpa_flash --dtypes bfloat16``, batch × N = 16k tokens,
hidden 2048), causal, TFLOP/s at N = 1024 / 4096 / 8192: d = 64: v3 101.9 / 125.9 / 134.7, v4 103.0 / 131.2 /
137.2; d = 128: v3 113.2 / 136.8 / 145.9, v4 120.2 / 151.6 / 156.3 — +1-4 % at d = 64, +6-11 % at d = 128
(predicted 8-15 % from N = 4096: met at d = 128, N = 4096 only; with 2048 / d heads, d = 64 has twice as many
blocks, which leaves a smaller tail to remove). Non-causal within ±2 % but for one +5 % at d = 128, N = 1024 (the
same kernels in the same order: noise). At the training shape, PyTorch's profiler over a bfloat16 GPT step
(``gpt_bf16_d128_profile_bwd_v4.log`` against v3's ``gpt_bf16_d128_profile_bwd_v3.log``): key-block kernel 1.586 →
1.431 ms per call (−10 %, predicted −12 %), dQ kernel 1.004 → 0.786 ms (−22 %, predicted −18 %); the GPT's
bfloat16 training at d = 128 (``gpt_speed_bwd_v4.json``) ran 588 k tokens/s against v3's 558 k in
``gpt_speed_bwd_v3.json`` (+5 %, predicted 3-5 %; not one machine).
GPU tests (``gpu_tests_tensorcore_backward_v4.log``): 40 passed; compute-sanitizer memcheck of v4
(``sanitizer_tensorcore_bwd_v4_memcheck.log``): 0 errors.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, uint32

import kernels_gpu.runtime as rt
from kernels_gpu import ptx
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore import flash2_backward_v3 as v3
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps

__all__ = ["flash2_backward", "make_kernel", "make_dq_kernel", "longest_first", "config_for", "shared_words",
           "dq_shared_words"]

#: the argument types of the two kernels (v3's), for ``kernels_gpu.tensorcore.inspect_ptx`` (``bwd_v4``, ``bwd_v4_dq``)
PTX_SIGNATURE, DQ_PTX_SIGNATURE = v3.PTX_SIGNATURE, v3.DQ_PTX_SIGNATURE
#: v3's tile shapes and shared memory, unchanged
config_for, shared_words, dq_shared_words = v3.config_for, v3.shared_words, v3.dq_shared_words


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig):
    """v4's key-block kernel (dK_j, dV_j) for one configuration (compiled on first launch): v3's, its block
    indices read from the longest-first grid when causal."""
    st = make_backward_steps(cfg)
    copy_kv, copy_q, copy_stats, zero = st["copy_kv_async"], st["copy_q_async"], st["copy_stats_async"], st["zero"]
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
    def flash2_backward_tc_v4(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2):
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

    return flash2_backward_tc_v4


@functools.lru_cache(maxsize=None)
def make_dq_kernel(cfg: BackwardConfig):
    """v4's dQ kernel for one configuration: v3's (one block per query block of 16·W rows, looping over key tiles
    of B_r keys), its block indices read from the longest-first grid when causal."""
    st = make_backward_steps(cfg)
    copy_rows, copy_tile, zero = st["copy_kv_async"], st["copy_q_async"], st["zero"]     # 16·W rows; B_r rows
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
    def flash2_backward_dq_tc_v4(Q, K, V, dO, stats, dQ, N_q, N_k, G, scale, scale_log2):
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

    return flash2_backward_dq_tc_v4


def longest_first(cfg: BackwardConfig, p) -> tuple:
    """v4's launch grids: causal → (H_kv, Z, key blocks · chunks), key block j = blockIdx.z // chunks (key block 0,
    the longest, first), and (H_q, Z, query blocks · chunks) read from the end (the last query block first);
    otherwise v3's grids."""
    if not cfg.causal:
        return backward_launch.block_major_grids(cfg, p)
    kv = rt.grid_size(p.N_k, cfg.B_c) * cfg.chunks
    dq = rt.grid_size(p.N_q, cfg.B_c) * cfg.chunks
    return (p.H_kv, p.Z, kv), (p.H_q, p.Z, dq)


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, **tile):
    """FA2 backward on tensor cores, rung v4 (v3's two kernels; causal: the longest blocks first). Same arguments
    and result as v1's (:func:`kernels_gpu.tensorcore.flash2_backward_v1.flash2_backward`); dQ bit-reproducible,
    and bit-identical to v3's (the same blocks compute the same sums, only in another order). Cost: v3's;
    ``tile``: ``warps``, ``B_r``, ``chunks``."""
    return backward_launch.run_backward_dq_pass(make_kernel, make_dq_kernel, config_for, shared_words,
                                                dq_shared_words, Q, K, V, O, L, dO, causal=causal, scale=scale,
                                                grids_for=longest_first, **tile)
