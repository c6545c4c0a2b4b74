"""Tensor-core FA2 backward, v2: Q_i, dO_i, L_i, D_i copied with ``cp.async``, double-buffered (v1 + one change).

v1 started every row block by copying Q_i, dO_i, L_i and D_i into shared memory and waiting for the copy: for
the whole latency of an L2 or HBM read the block's tensor cores had nothing to do, and only the other resident
blocks could fill the gap. v2 does for the backward what the forward v4 did for K_j, V_j: two shared-memory
stages, and the copy of the *next* row block (of the same query head, or the first of the next head of the GQA
group) started before the current one is computed::

    start copy(K_j, V_j, Q_1, dO_1, L_1, D_1) into stage 0; commit
    for each row block:
        start copy(next Q_i, dO_i, L_i, D_i) into the other stage; commit     (an empty group on the last one)
        wait until ≤ 1 group in flight; __syncthreads                   → this row block's tiles have landed
        Sᵀ, Pᵀ, dV_j, dPᵀ, dSᵀ, dK_j                                    (v1's code, on this stage)
        dSᵀ to shared memory; __syncthreads; dQ_i += dS K_j (atomics)

The barrier after the dSᵀ store is also what frees the stage: no warp reads Q_i, dO_i, L_i, D_i after it, so the
copy that the next step starts into this stage cannot overwrite anything still in use.

**Prediction (written before the first GPU run).** The forward gained 2.3-2.9× from the same change (v3 → v4),
where the copy of each K/V tile fed 2 products; here a copied row block feeds 5, so the exposed latency was a
smaller share of v1's time: +40-100 % over v1, i.e. 60-80 TFLOP/s at d = 64 and 65-85 at d = 128 (fp16,
N = 4096, non-causal), 0.25-0.3× SDPA flash's backward (254 / 276 TFLOP/s on the H100 in GPU.md). What would then
bound it is what bounds the forward v6: a warp owns 16 keys, so every Q_i and dO_i fragment it loads from shared
memory serves one 16-row MMA tile (about one ldmatrix per two MMAs), plus two barriers and B_r·d atomic adds per
row block. Below the project's target (≥ 90 TFLOP/s, ≥ 0.4× SDPA flash). Registers (ptxas, sm_90, before any
run): 246-248 at d = 64 (capped at 248), 255 at d = 128 and 256, no spills, fp16 and bf16, causal or not; shared
memory 64 / 73.5 / 137.5 KiB per block at d = 64 / 128 / 256: two blocks (8 warps) per SM up to d = 128.

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks/results/nvidia-h100/tensorcore_backward.json``; fp16, non-causal,
batch × N = 16k tokens, hidden 2048, TFLOP/s by the model backward = 2.5 × forward, at N = 1024 / 4096 / 8192;
SDPA flash's backward in the same run: 200.8 / 248.0 / 276.0 at d = 64, 198.9 / 271.3 / 290.6 at d = 128).
d = 64: 92.3 / 111.4 / 123.1 (0.46 / 0.45 / 0.45× SDPA flash); d = 128: 76.3 / 105.6 / 101.0 (0.38 / 0.39 / 0.35×)
— within −10 … +3 % of v1 (−10 % at d = 128, N = 8192), where +40-100 % was predicted. The prediction failed:
the exposed copy latency was not what bound v1 (v1 itself ran 2-3× faster than its prediction), so hiding it
bought nothing, and the larger shared-memory footprint (64 / 73.5 KiB) is not free. What does bind v1 and v2 is
not established by this run alone; v3, which removes the atomics and the dSᵀ round trip, gains 24-54 %, which
points there. Largest relative error 3.0e-4, as v1 and SDPA flash. bf16 and causal were not timed in this run.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps

__all__ = ["flash2_backward", "make_kernel", "config_for", "shared_words"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool, *, warps: int = 4, B_r: int | None = None,
               chunks: int | None = None) -> BackwardConfig:
    """v2's tile shape (v1's): 4 warps (B_c = 64 keys); B_r = 64 queries up to d = 64, 32 beyond; two column
    chunks of dK_j, dV_j above d = 128; registers capped at 248 up to d = 64 (no spill, two blocks per SM). The
    keywords override the shape (the tests run small shapes in the simulator with 2 warps and B_r = 16)."""
    B_r = B_r or (64 if d <= 64 else 32)
    return BackwardConfig(d=d, warps=warps, B_r=B_r, dtype=dtype, causal=causal, simulated=simulated,
                          chunks=chunks or (1 if d <= 128 else 2),
                          max_registers=248 if d <= 64 and B_r == 64 and warps == 4 else None)


def shared_words(cfg: BackwardConfig) -> int:
    """32-bit words of shared memory: K_j, V_j, two stages of Q_i, dO_i (RS words per row), dSᵀ (RSS per row),
    two stages of L_i, D_i."""
    return 2 * cfg.B_c * cfg.RS + 4 * cfg.B_r * cfg.RS + cfg.B_c * cfg.RSS + 4 * cfg.B_r


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig):
    """The v2 kernel for one configuration (compiled on first launch)."""
    st = make_backward_steps(cfg)
    copy_kv, copy_q, copy_stats, zero = st["copy_kv_async"], st["copy_q_async"], st["copy_stats_async"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    probabilities, softmax_gradient = st["probabilities"], st["softmax_gradient"]
    store_transposed, dq_update, store_rows = st["store_transposed"], st["dq_update"], st["store_rows"]
    B_r, B_c, RS, RSS = cfg.B_r, cfg.B_c, cfg.RS, cfg.RSS
    CHUNKS, DC = cfg.chunks, cfg.DC
    K_OFF = 0                                # word offsets in the one shared array: K_j, V_j, stage 0 (Q_i,
    V_OFF = B_c * RS                         # dO_i), stage 1 (Q_i, dO_i), dSᵀ, then (as floats) stage 0 (L_i·log₂e,
    Q_OFF = 2 * B_c * RS                     # D_i) and stage 1 (L_i·log₂e, D_i)
    DO_OFF = Q_OFF + B_r * RS
    STAGE = 2 * B_r * RS
    DS_OFF = Q_OFF + 2 * STAGE
    L_OFF = DS_OFF + B_c * RSS
    D_OFF = L_OFF + B_r
    FSTAGE = 2 * B_r
    S_LEN, C_LEN, A_LEN = 4 * cfg.NT, 4 * cfg.NC, 4 * (B_c // 16)
    causal = cfg.causal

    @cfg.jit()
    def flash2_backward_tc_v2(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        j = cuda.blockIdx.x // CHUNKS         # key block j (Alg. 2 line 5: one block per j, in parallel)
        c = cuda.blockIdx.x - j * CHUNKS      # the column chunk of dK_j, dV_j, dQ_i this block computes
        hk = cuda.blockIdx.y
        z = cuda.blockIdx.z
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory as 32-bit words ...
        smf = cuda.shared.array(0, float32)   # ... and the same memory as floats (for L_i, D_i)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dk = cuda.local.array(C_LEN, float32)
        dv = cuda.local.array(C_LEN, float32)
        afrag = cuda.local.array(A_LEN, uint32)
        acc = cuda.local.array(8, float32)
        diag = N_k - N_q
        key0 = j * B_c + 16 * warp            # the warp's first key
        col_word = c * (DC // 2)

        # Alg. 2 line 8's loop, flattened: step = (query head gq of the GQA group, row block i), from the first
        # row block that sees a key of K_j (causal).
        T_r = (N_q + B_r - 1) // B_r
        i_first = 0
        if causal and j * B_c - diag > 0:
            i_first = min(T_r, (j * B_c - diag) // B_r)
        n_i = T_r - i_first
        n_steps = G * n_i
        # Alg. 2 line 6, and lines 9-10 for the first step: K_j, V_j and the first Q_i, dO_i, L_i, D_i, one group.
        copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        if n_steps > 0:
            copy_q(sm, Q_OFF, Q, z, hk * G, i_first * B_r, N_q, tid)
            copy_q(sm, DO_OFF, dO, z, hk * G, i_first * B_r, N_q, tid)
            copy_stats(smf, L_OFF, stats, z, hk * G, i_first * B_r, tid)
        ptx.cp_async_commit()
        # Alg. 2 line 7: dK_j = 0, dV_j = 0 (in registers).
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        for step in range(n_steps):
            gq = step // n_i
            i = i_first + step - gq * n_i
            h = hk * G + gq
            stage = step % 2
            # Lines 9-10 for the next step, started now, land while this one is computed.
            if step + 1 < n_steps:
                gq_next = (step + 1) // n_i
                i_next = i_first + step + 1 - gq_next * n_i
                h_next = hk * G + gq_next
                other = 1 - stage
                copy_q(sm, Q_OFF + other * STAGE, Q, z, h_next, i_next * B_r, N_q, tid)
                copy_q(sm, DO_OFF + other * STAGE, dO, z, h_next, i_next * B_r, N_q, tid)
                copy_stats(smf, L_OFF + other * FSTAGE, stats, z, h_next, i_next * B_r, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_one()           # this thread's copies of this step have landed ...
            cuda.syncthreads()                # ... and everyone's
            q_off = Q_OFF + stage * STAGE
            do_off = DO_OFF + stage * STAGE
            l_off = L_OFF + stage * FSTAGE
            d_off = D_OFF + stage * FSTAGE

            # Line 11: Sᵀ = K_j Q_iᵀ, the warp's 16 keys × B_r queries (τ is folded into line 13).
            product_transposed(s, sm, K_OFF, q_off, warp, lane)
            # Line 13: Pᵀ = exp(τSᵀ − L_i); the mask only where a key can be invisible to a query of the tile.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, l_off, key0 + lane // 4, i * B_r, N_k, scale_log2, diag, mask_tile)
            # Line 16: dV_j += Pᵀ dO_i, A straight from Pᵀ's accumulators.
            product_accumulate(dv, s, sm, do_off, col_word, lane)
            # Line 17: dPᵀ = V_j dO_iᵀ.
            product_transposed(dp, sm, V_OFF, do_off, warp, lane)
            # Line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            softmax_gradient(s, dp, smf, d_off)
            # Line 21: dK_j += dSᵀ Q_i (τ applied once, when dK_j is written).
            product_accumulate(dk, s, sm, q_off, col_word, lane)
            # Line 20: dQ_i += dS K_j, summed over every warp's keys: dSᵀ through shared memory, then the warps
            # split dQ_i's tiles and add them into HBM atomically. After this barrier nobody reads the stage.
            store_transposed(sm, DS_OFF, s, warp, lane)
            cuda.syncthreads()
            dq_update(dQacc, sm, DS_OFF, K_OFF, col_word, afrag, acc, z, h, i * B_r, c * DC, N_q, warp, lane)

        ptx.cp_async_wait_all()               # (a block with no row block to visit still started K_j, V_j)
        # Line 24: write dK_j = τ Σ dSᵀQ, dV_j to HBM, once.
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flash2_backward_tc_v2


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, **tile):
    """FA2 backward on tensor cores, rung v2 (v1 with Q_i, dO_i, L_i, D_i double-buffered). Same arguments and
    result as :func:`kernels_gpu.tensorcore.flash2_backward_v1.flash2_backward`: ``Flash2Backward(dQ, dK, dV)``
    in the input dtype, dK, dV summed over each GQA group; ``tile``: ``warps``, ``B_r``, ``chunks``."""
    return backward_launch.run_backward(make_kernel, config_for, shared_words, Q, K, V, O, L, dO, causal=causal,
                                        scale=scale, **tile)
