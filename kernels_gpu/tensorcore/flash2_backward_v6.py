"""Tensor-core FA2 backward, v6: the key-block kernel's per-step integer work cut (v5 + one change).

Nsight Compute on v5 at the GPT training shape (batch 4, 8 heads, N = 4096, d = 128, causal, bfloat16;
``ncu_tensorcore_bwd_v5_d128.txt``, ``python -m benchmarks.profilers.profile_tensorcore_backward``) finds the key-block
kernel issuing in only 34 % of its cycles, two warps per scheduler, 0.42 of them eligible, and its machine code spending
more on integers than on matrices: per warp and step about 745 instructions, of them 128 HMMA and 80 LDSM but
~300 integer ones. Two sources stand out in the SASS, both v5's loop bookkeeping rather than its algorithm:

* the step's (query head of the GQA group, row block) pair was divided out of the step number — ``step // n_i``
  for this step and ``(step + 1) // n_i`` for the next one's copies: two 64-bit unsigned divisions per step, ~35
  instructions each, a dependent chain through MUFU.RCP, F2I and R2UR at the top of the step, before the copies and
  the first MMA;
* L_i·log₂e and D_i were read from shared memory at *signed* indices, which numba gives Python's negative-index
  fix-up (a compare, a shift, an and, an add) on each of the 2·NT + 2·NT loads per step.

v6 counts the pair instead (the next row block, or the first row block of the next query head: a compare and an
add) and reads L_i, D_i at the lane's unsigned index (``probabilities_at``, ``softmax_gradient_at`` of
:mod:`~kernels_gpu.tensorcore.backward_steps`). The products, the tiles, the launch order and the dQ kernel are v5's:
the gradients are bit-identical.

**Prediction (before the GPU run).** About 160 of ~745 instructions per warp-step go (−20 %); the kernel is bound by
latency rather than issue (34 % issue slots), so the time falls less than the count, but the divisions sit on the
critical path at the top of every step: the key-block kernel 5-12 % faster at the GPT shape (1.19 → 1.05-1.13 ms at
d = 128), the dQ kernel unchanged.

**Measured** (H100 80GB HBM3, 2026-11-26, one machine, v5 then v6 then v7: ``tensorcore_backward_tiles_v5_again.json``,
``_v6.json``, ``_v7.json``; batch 4, 8 heads, N = 4096, causal, bfloat16, each kernel's GPU time per call from
PyTorch's profiler, ``python -m benchmarks.profilers.tensorcore_backward_tiles --rung v6 --tiles 4x32 4x64 --d 128
64``). Key-block kernel at the default shapes: d = 128 (4 warps, B_r = 32) 1.203 → 0.998 ms (−17 %), d = 64 (B_r = 64)
0.687 → 0.487 ms (−29 %); the dQ kernel (v5's) 0.672 and 0.326 ms in both runs. Past the prediction, most at
d = 64, where B_r = 64 doubles the L_i, D_i loads per step (2·NT each) and with them the fix-ups v6 removed (the
products per step are the same: 16·B_r·d per warp and product). Registers (numba's report in the same
files): 246 at d = 128 (v5 241), 236 at d = 64 (v5 248), no local memory (ptxas alone, without a GPU, reports a
few fewer: ``inspect_ptx_bwd_v5_v6_v7.txt``). GPU tests
(``gpu_tests_tensorcore_backward_v6_v7.log``): every v6 case, and v6 bit-identical to v3 at d = 64 and 128, causal
and not: passed.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore import flash2_backward_v5 as v5
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps

__all__ = ["flash2_backward", "make_kernel", "make_dq_kernel", "longest_first", "config_for", "shared_words",
           "dq_shared_words"]

#: the argument types of the two kernels (v3's), for ``kernels_gpu.tensorcore.inspect_ptx`` (``bwd_v6``, ``bwd_v6_dq``)
PTX_SIGNATURE, DQ_PTX_SIGNATURE = v5.PTX_SIGNATURE, v5.DQ_PTX_SIGNATURE
#: v3's tile shapes and shared memory, unchanged
config_for, shared_words, dq_shared_words = v5.config_for, v5.shared_words, v5.dq_shared_words
#: v5's dQ kernel (its loop has no division: one key tile per step) and v4's launch grids
make_dq_kernel, longest_first = v5.make_dq_kernel, v5.longest_first


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig):
    """v6's key-block kernel (dK_j, dV_j) for one configuration (compiled on first launch): v5's, with the step's
    (query head, row block) pair counted instead of divided out, and L_i, D_i read at unsigned indices."""
    st = make_backward_steps(cfg)
    copy_kv, copy_q = st["copy_kv_async_inc"], st["copy_q_async_inc"]
    copy_stats, zero = st["copy_stats_async"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    # v5's probabilities and softmax_gradient index shared memory with signed integers (a negative-index fix-up
    # per load); these take the lane's unsigned index.
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
    def flash2_backward_tc_v6(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2):
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

            # Line 11: Sᵀ = K_j Q_iᵀ; line 13: Pᵀ = exp(τSᵀ − L_i) (masked only where needed).
            product_transposed(s, sm, K_OFF, q_off, warp, lane)
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, l_lane, key0 + lane // 4, i * B_r, N_k, scale_log2, diag, mask_tile)
            # Line 16: dV_j += Pᵀ dO_i.
            product_accumulate(dv, s, sm, do_off, col_word, lane)
            # Line 17: dPᵀ = V_j dO_iᵀ; line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            product_transposed(dp, sm, V_OFF, do_off, warp, lane)
            softmax_gradient(s, dp, smf, d_lane)
            # Line 21: dK_j += dSᵀ Q_i. (Line 20, dQ_i, is the dQ kernel's.)
            product_accumulate(dk, s, sm, q_off, col_word, lane)
            i = i_next
            gq = gq_next

        ptx.cp_async_wait_all()
        # Line 24: write dK_j = τ Σ dSᵀQ, dV_j to HBM, once.
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flash2_backward_tc_v6


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, **tile):
    """FA2 backward on tensor cores, rung v6 (v5 with the key-block kernel's step bookkeeping cut). Same arguments
    and result as v1's (:func:`kernels_gpu.tensorcore.flash2_backward_v1.flash2_backward`), bit-identical to v3's,
    v4's and v5's; ``tile``: ``warps``, ``B_r``, ``chunks``."""
    return backward_launch.run_backward_dq_pass(make_kernel, make_dq_kernel, config_for, shared_words,
                                                dq_shared_words, Q, K, V, O, L, dO, causal=causal, scale=scale,
                                                grids_for=longest_first, **tile)
