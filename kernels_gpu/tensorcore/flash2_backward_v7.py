"""Tensor-core FA2 backward, v7: Sᵀ and dPᵀ in one loop (v6 + one change).

Per row block the key-block kernel makes four products per warp: Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ (16 keys × B_r
queries, summed over d) and the two updates dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i (16 keys × d, summed over B_r). An
update has NC = d/8 accumulator tiles: d/8 independent MMAs per k-step. A score product has only NT = B_r/8 (4 at
the GPT shape's B_r = 32), each a chain of d/16 dependent MMAs — at two warps per scheduler, too few to cover the
tensor core's latency: Nsight Compute on v5 (``ncu_tensorcore_bwd_v5_d128.txt``) puts 38 % of the key-block
kernel's stall samples on HMMA instructions, most of them waiting on the previous MMA's result.

Sᵀ and dPᵀ do not depend on each other (FA2 Alg. 2 lines 11 and 17 read K_j, Q_i and V_j, dO_i). v7 computes
them in one loop over the k-steps (``product_transposed_pair`` of :mod:`~kernels_gpu.tensorcore.backward_steps`):
2·NT independent MMAs per k-step, in the order v6 summed them. dPᵀ is ready before dV_j's update and stays
live across it (4·NT registers). Same tiles, launch order and dQ kernel as v6; the gradients are bit-identical.

**Prediction (before the GPU run).** The score products are half the key-block kernel's MMAs; doubling their
independent chains removes most of their dependency stalls: the key-block kernel 4-10 % faster than v6 at the GPT
shape, unless the 16 more live registers make ptxas spill (v6 at d = 128 is near the 255 limit).

**Measured** (H100 80GB HBM3, 2026-11-26, the run of v6's header, ``tensorcore_backward_tiles_v7.json``). Key-block
kernel at d = 128 (B_r = 32): v6 0.998 → v7 0.945 ms (−5 %, inside the prediction; −21 % from v5's 1.203); at
d = 64 (B_r = 64, already 8 accumulators per score product) 0.487 → 0.493 ms, unchanged. Registers: 239 at
d = 128 (v6 246: fewer, not more), 245 at d = 64 (v6 236), no local memory. Nsight Compute at d = 128
(``ncu_tensorcore_bwd_v7_d128.txt`` against ``_v5_d128.txt``, clocks locked): 292.5 M instructions executed
against v5's 396.6 M, 1.20 ms against 1.53. On the ladder's bfloat16 grid (``tensorcore_backward_v7.json``,
beside v5 and SDPA flash in one run): +10-17 % over v5 causal, +5-14 % non-causal at d = 64, level (−1 to +1 %)
non-causal at d = 128, where v5's key-block kernel already spent per step what v7's causal one does
(``tensorcore_backward_tiles_full_v5.json``, ``_v7.json``: 1.959 and 1.952 ms for 64 × 128 steps per head); from
N = 4096, 174-206 TFLOP/s, 0.68-0.81× SDPA flash's backward. The GPT's bfloat16 training step at d = 128
(``python -m benchmarks.gpt_speed``, ``gpt_speed.json``): 0.82× SDPA's tokens/s, from 0.78 with v5. GPU tests:
``gpu_tests_tensorcore_backward_v6_v7.log`` (v7's cases, bit-identical to v3),
``gpu_tests_tensorcore_backward_fastest_v7.log`` (every shape of the fastest-rung test with v7 the default: 16 passed),
``gpu_tests_torch_op.log`` (the PyTorch op: 75 passed); compute-sanitizer memcheck of v6 and v7
(``sanitizer_tensorcore_bwd_v7_memcheck.log``): 0 errors.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore import flash2_backward_v6 as v6
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps

__all__ = ["flash2_backward", "make_kernel", "make_dq_kernel", "longest_first", "config_for", "shared_words",
           "dq_shared_words"]

#: the argument types of the two kernels (v3's), for ``kernels_gpu.tensorcore.inspect_ptx`` (``bwd_v7``, ``bwd_v7_dq``)
PTX_SIGNATURE, DQ_PTX_SIGNATURE = v6.PTX_SIGNATURE, v6.DQ_PTX_SIGNATURE
#: v3's tile shapes and shared memory, unchanged
config_for, shared_words, dq_shared_words = v6.config_for, v6.shared_words, v6.dq_shared_words
#: v5's dQ kernel and v4's launch grids
make_dq_kernel, longest_first = v6.make_dq_kernel, v6.longest_first


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig):
    """v7's key-block kernel (dK_j, dV_j) for one configuration (compiled on first launch): v6's, with Sᵀ and dPᵀ
    computed in one loop over the k-steps."""
    st = make_backward_steps(cfg)
    copy_kv, copy_q = st["copy_kv_async_inc"], st["copy_q_async_inc"]
    copy_stats, zero = st["copy_stats_async"], st["zero"]
    # v6 computed Sᵀ, then (after Pᵀ and dV_j's update) dPᵀ; both products in one loop give twice the
    # independent MMAs per k-step.
    product_pair, product_accumulate = st["product_transposed_pair"], st["product_accumulate"]
    probabilities, softmax_gradient, store_rows = st["probabilities_at"], st["softmax_gradient_at"], st["store_rows"]
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
    def flash2_backward_tc_v7(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2):
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
        t2 = uint32(2 * (lane % 4))           # the lane's first query column in a row block's L_i, D_i
        gq = 0                                # this step's query head (of the GQA group) and row block: v5
        i = i_first                           # divided them out of the step number, a 64-bit division per step
        for step in range(n_steps):
            stage = step & 1
            ptx.cp_async_wait_all()           # this step's tiles have landed (the only group in flight) ...
            cuda.syncthreads()                # ... for everyone, and nobody still reads the other stage
            # The next step's pair: the next row block, or the first one of the next query head.
            i_next = i + 1
            gq_next = gq
            if i_next == T_r:
                i_next = i_first
                gq_next = gq + 1
            # Lines 9-10 for the next step, into the other stage, land while this one is computed.
            if step + 1 < n_steps:
                h_next = hk * G + gq_next
                other = 1 - stage
                copy_q(sm, Q_OFF + other * STAGE, Q, z, h_next, i_next * B_r, N_q, tid)
                copy_q(sm, DO_OFF + other * STAGE, dO, z, h_next, i_next * B_r, N_q, tid)
                copy_stats(smf, L_OFF + other * FSTAGE, stats, z, h_next, i_next * B_r, tid)
            ptx.cp_async_commit()
            q_off = Q_OFF + stage * STAGE
            do_off = DO_OFF + stage * STAGE
            l_lane = uint32(L_OFF + stage * FSTAGE) + t2
            d_lane = uint32(D_OFF + stage * FSTAGE) + t2

            # Line 11: Sᵀ = K_j Q_iᵀ and line 17: dPᵀ = V_j dO_iᵀ, in one loop over the k-steps.
            product_pair(s, dp, sm, K_OFF, q_off, V_OFF, do_off, warp, lane)
            # Line 13: Pᵀ = exp(τSᵀ − L_i) (masked only where needed).
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, l_lane, key0 + lane // 4, i * B_r, N_k, scale_log2, diag, mask_tile)
            # Line 16: dV_j += Pᵀ dO_i.
            product_accumulate(dv, s, sm, do_off, col_word, lane)
            # Line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            softmax_gradient(s, dp, smf, d_lane)
            # Line 21: dK_j += dSᵀ Q_i. (Line 20, dQ_i, is the dQ kernel's.)
            product_accumulate(dk, s, sm, q_off, col_word, lane)
            i = i_next
            gq = gq_next

        ptx.cp_async_wait_all()
        # Line 24: write dK_j = τ Σ dSᵀQ, dV_j to HBM, once.
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flash2_backward_tc_v7


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, **tile):
    """FA2 backward on tensor cores, rung v7 (v6 with Sᵀ and dPᵀ in one loop). Same arguments and result as v1's
    (:func:`kernels_gpu.tensorcore.flash2_backward_v1.flash2_backward`), bit-identical to v3's … v6's; ``tile``:
    ``warps``, ``B_r``, ``chunks``."""
    return backward_launch.run_backward_dq_pass(make_kernel, make_dq_kernel, config_for, shared_words,
                                                dq_shared_words, Q, K, V, O, L, dO, causal=causal, scale=scale,
                                                grids_for=longest_first, **tile)
