"""Tensor-core FA2 backward, v1: FA2 Algorithm 2 on mma.sync, one thread block per key block, dQ by atomic adds.

The backward pass recomputes what the forward threw away: for every pair (row block Q_i, key block K_j) it rebuilds
S = τ Q_i K_jᵀ and P = exp(S − L_i) from the saved log-sum-exp, then runs the chain rule through the two products
of the forward (FA2 Algorithm 2, the FA1 backward of Algorithm 4 with FA2's single statistic L and precomputed D):

    dV_j += Pᵀ dO_i      dP = dO_i V_jᵀ      dS = P ∘ (dP − D_i)      dK_j += τ dSᵀ Q_i      dQ_i += τ dS K_j

**Parallel over key blocks (FA2 Section 3.2).** dK_j and dV_j are sums over all row blocks i; dQ_i is a sum over
all key blocks j. One of the two sums must cross thread blocks. As FA2, v1 gives each thread block one key block
(grid T_c × H_kv × batch), keeps dK_j and dV_j in registers for the whole loop over i — and over the G query heads
of a GQA group, so that each key/value head's gradients are summed inside one block, deterministically — and adds
its share of dQ_i into a float32 copy of dQ in HBM with atomic adds. Around the main kernel: a preprocessing launch
(D = rowsum(dO ∘ O), L·log₂e, dQ zeroed) and a conversion launch (dQ rounded to the input dtype).

**On tensor cores** (:mod:`~kernels_gpu.tensorcore.backward_steps` has the table): each warp owns 16 keys and
computes the *transposed* tiles Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ (16 × B_r), so that Pᵀ and dSᵀ — the A operands
of dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i — are its own accumulators, packed to 16 bits in registers (the forward
v3's C → A reuse). dQ_i = dS K_j sums over the keys of all four warps: dSᵀ goes through shared memory once
(16 bits), and ``ldmatrix.trans`` reads it back as dS. Sizes: 4 warps, B_c = 64 keys per block; B_r = 64 queries
per row block up to d = 64, 32 beyond (dK_j, dV_j take 2·4·d/8 registers per lane); above d = 128 a block
computes one half of dK_j, dV_j's columns (two blocks per key block; each recomputes Sᵀ and dPᵀ).

**Skipped and masked tiles (FA2 Section 3.1.1, bottom-right causal).** A key block never visits the row blocks
whose queries all precede its first key (the loop starts where
:func:`~kernels_gpu.tensorcore.backward_steps.first_row_block` says); the key/causal test runs only on tiles that
can hold a masked pair (keys past N_k, or a key after the diagonal of the tile's first query). Queries past N_q
and fully masked rows read L = +∞ (P = 0, dS = 0), so they need no test at all.

v1 loads Q_i, dO_i, L_i, D_i with ``cp.async`` and waits for them at once: every row block starts with the full
latency of its copy, nothing overlapped (the forward v1-v3's schedule; v2 double-buffers).

**Prediction (written before the first GPU run).** Reasoning from the forward ladder measured on the same H100:
the forward v3 (same 16-row warps, copies waited for at once) made 22 (d = 64) / 25 (d = 128) TFLOP/s at
N = 4096; v4 (the same, double-buffered) 57 / 86, so the unhidden copy cost v3 about 60-70 % of its time. Per
copied row block the backward does 5 matrix products against the forward's 2 per copied key block (2.5× the
work per byte: the copy latency is a smaller share), but it adds two block-wide barriers per row block (dSᵀ
through shared memory) and B_r·d atomic adds, and at d = 128 its row blocks are half as tall (B_r = 32: a copy
per 5·2·32·64·128 FLOPs). Expected at N = 4096, fp16, non-causal: 35-50 TFLOP/s at d = 64 and 35-50 at d = 128,
0.13-0.2× SDPA flash's backward (254 / 276 TFLOP/s on this H100 in GPU.md), far from the project's ≥ 90 and ≥ 0.4×.
Registers (ptxas, sm_90, read before any run: ``python -m kernels_gpu.tensorcore.inspect_ptx bwd_v1 --d 64 128
256``): 248 at d = 64 (capped; uncapped 255 with a 4-byte spill), 255 at d = 128 and 256 — two blocks (8 warps)
per SM at d ≤ 128; no spills except 8 bytes at d = 128 causal (4 at d = 256 causal). Shared memory 45.5 / 56.3 /
104 KiB per block at d = 64 / 128 / 256.

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks/results/nvidia-h100/tensorcore_backward.json``; fp16, non-causal,
batch × N = 16k tokens, hidden 2048, TFLOP/s by the model backward = 2.5 × forward, at N = 1024 / 4096 / 8192;
SDPA flash's backward in the same run: 200.8 / 248.0 / 276.0 at d = 64, 198.9 / 271.3 / 290.6 at d = 128).
d = 64: 93.3 / 112.6 / 120.3 (0.46 / 0.45 / 0.44× SDPA flash); d = 128: 75.7 / 104.1 / 112.1 (0.38 / 0.38 / 0.39×).
Largest relative error of dQ, dK, dV against the float64 oracle 3.0e-4, SDPA flash's in the same run. The prediction
failed by 2-3×, in the good direction: at N = 4096, 113 / 104 TFLOP/s where 35-50 were expected, and at d = 64
already past the project's ≥ 90 TFLOP/s and ≥ 0.4× (d = 128 reaches 0.38-0.39×). The extrapolation from the forward
v3 → v4 step overstated what the unhidden copy costs the backward — v2, which hides it, gains nothing (below). Why
it costs so little here is not established (no profile); a plausible reason is that the 5 products and two
barriers per copied row block, with a second resident block per SM, leave the copy's latency covered. Registers and
shared memory as predicted (248 / 255; 45.5 / 56.3 KiB at d = 64 / 128, no local memory). bf16 and causal were not
timed in this run.
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
    """v1's tile shape: 4 warps (B_c = 64 keys); B_r = 64 queries up to d = 64, 32 beyond; two column chunks of
    dK_j, dV_j above d = 128. Registers (ptxas, sm_90): uncapped, ptxas takes 255 at d = 64 with a 4-byte spill;
    capped at 248 it spills nothing, causal or not (two blocks per SM either way; capped at 168, for three blocks,
    it spills 264 bytes). The keywords override the shape (a specialisation, not another algorithm: the tests run
    small shapes in the simulator with 2 warps and B_r = 16)."""
    B_r = B_r or (64 if d <= 64 else 32)
    return BackwardConfig(d=d, warps=warps, B_r=B_r, dtype=dtype, causal=causal, simulated=simulated,
                          chunks=chunks or (1 if d <= 128 else 2),
                          max_registers=248 if d <= 64 and B_r == 64 and warps == 4 else None)


def shared_words(cfg: BackwardConfig) -> int:
    """32-bit words of shared memory: K_j, V_j, Q_i, dO_i (RS words per row), dSᵀ (RSS per row), L_i, D_i."""
    return 2 * cfg.B_c * cfg.RS + 2 * cfg.B_r * cfg.RS + cfg.B_c * cfg.RSS + 2 * cfg.B_r


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig):
    """The v1 kernel for one configuration (compiled on first launch)."""
    st = make_backward_steps(cfg)
    copy_kv, copy_q, copy_stats, zero = st["copy_kv_async"], st["copy_q_async"], st["copy_stats_async"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    probabilities, softmax_gradient = st["probabilities"], st["softmax_gradient"]
    store_transposed, dq_update, store_rows = st["store_transposed"], st["dq_update"], st["store_rows"]
    B_r, B_c, RS, RSS = cfg.B_r, cfg.B_c, cfg.RS, cfg.RSS
    CHUNKS, DC = cfg.chunks, cfg.DC
    K_OFF = 0                                # word offsets in the one shared array: K_j, V_j, Q_i, dO_i, dSᵀ,
    V_OFF = B_c * RS                         # then (as floats) L_i·log₂e and D_i
    Q_OFF = 2 * B_c * RS
    DO_OFF = Q_OFF + B_r * RS
    DS_OFF = DO_OFF + B_r * RS
    L_OFF = DS_OFF + B_c * RSS
    D_OFF = L_OFF + B_r
    S_LEN, C_LEN, A_LEN = 4 * cfg.NT, 4 * cfg.NC, 4 * (B_c // 16)
    causal = cfg.causal

    @cfg.jit()
    def flash2_backward_tc_v1(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2):
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

        # Alg. 2 line 6: load K_j, V_j from HBM to SRAM (they stay for the whole block).
        copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 2 line 7: dK_j = 0, dV_j = 0 (in registers).
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        # Alg. 2 line 8: for i = 1 … T_r — from the first row block that sees a key of K_j (causal), and for
        # each of the G query heads that read this key/value head (their dK_j, dV_j add up: GQA).
        T_r = (N_q + B_r - 1) // B_r
        i_first = 0
        if causal and j * B_c - diag > 0:
            i_first = min(T_r, (j * B_c - diag) // B_r)
        n_i = T_r - i_first
        for step in range(G * n_i):
            gq = step // n_i
            i = i_first + step - gq * n_i
            h = hk * G + gq
            # Lines 9-10: load Q_i, dO_i, L_i, D_i to SRAM — and wait for them (and, the first time, K_j, V_j).
            copy_q(sm, Q_OFF, Q, z, h, i * B_r, N_q, tid)
            copy_q(sm, DO_OFF, dO, z, h, i * B_r, N_q, tid)
            copy_stats(smf, L_OFF, stats, z, h, i * B_r, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_all()
            cuda.syncthreads()

            # Line 11: Sᵀ = K_j Q_iᵀ, the warp's 16 keys × B_r queries (τ is folded into line 13).
            product_transposed(s, sm, K_OFF, Q_OFF, warp, lane)
            # Line 13: Pᵀ = exp(τSᵀ − L_i); the mask only where a key can be invisible to a query of the tile.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, L_OFF, key0 + lane // 4, i * B_r, N_k, scale_log2, diag, mask_tile)
            # Line 16: dV_j += Pᵀ dO_i, A straight from Pᵀ's accumulators.
            product_accumulate(dv, s, sm, DO_OFF, col_word, lane)
            # Line 17: dPᵀ = V_j dO_iᵀ.
            product_transposed(dp, sm, V_OFF, DO_OFF, warp, lane)
            # Line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            softmax_gradient(s, dp, smf, D_OFF)
            # Line 21: dK_j += dSᵀ Q_i (τ applied once, when dK_j is written).
            product_accumulate(dk, s, sm, Q_OFF, col_word, lane)
            # Line 20: dQ_i += dS K_j sums over the keys of every warp: dSᵀ through shared memory, then the warps
            # split dQ_i's tiles and add them into HBM atomically.
            store_transposed(sm, DS_OFF, s, warp, lane)
            cuda.syncthreads()
            dq_update(dQacc, sm, DS_OFF, K_OFF, col_word, afrag, acc, z, h, i * B_r, c * DC, N_q, warp, lane)
            # (No barrier here: nobody reads Q_i, dO_i, L_i, D_i after the one above, and the next dSᵀ is written
            # only after the next row block's barrier, which every warp reaches after its dQ update.)

        ptx.cp_async_wait_all()               # (a block with no row block to visit still started K_j, V_j)
        # Line 24: write dK_j = τ dSᵀQ summed, dV_j to HBM, once.
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flash2_backward_tc_v1


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, **tile):
    """FA2 backward on tensor cores, rung v1 (dQ by atomic adds, copies waited for at once). Q, O, dO (…, N_q, d),
    K, V (…, N_k, d), float16 or bfloat16, L (…, N_q) float32 from the forward (natural log, +∞ on rows that see
    no key); see :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted. Returns
    ``Flash2Backward(dQ, dK, dV)`` in the input dtype; dK, dV summed over each GQA group. ``causal``:
    bottom-right aligned; ``scale``: τ, default 1/√d. Cost: the FA2 paper's 10·N_q·N_k·d FLOPs per head (halved
    by causal skipping; above d = 128 the two column chunks recompute Sᵀ and dPᵀ: 14·N_q·N_k·d); dQ's atomic
    adds: T_c·N_q·d per head. ``tile``: ``warps``, ``B_r``, ``chunks`` override :func:`config_for`'s shape."""
    return backward_launch.run_backward(make_kernel, config_for, shared_words, Q, K, V, O, L, dO, causal=causal,
                                        scale=scale, **tile)
