"""Tensor-core FA2 forward, v5: the softmax in base 2 with the scale folded in, rescaling only when needed
(v4 + one change).

With the matrix products on tensor cores, the online softmax's elementwise work is what the CUDA cores still do
per score, and FA2 Section 3.1 asks to keep it small ("tweak the algorithm to reduce the non-matmul FLOPs"):

* exp(τ(x − m)) becomes 2^(x·τlog₂e − m·τlog₂e): one FMA and one ``ex2.approx.ftz`` (a single ``MUFU.EX2``) per
  score, where v4 paid a subtract, a multiply and libdevice's ``expf`` (a range reduction around the same
  instruction);
* Õ_i and ℓ_i are rescaled only when the row maximum moved: after the first few tiles of a long row the maximum
  rarely moves, and each skipped rescale saves D/8 · 2 multiplies per row and lane.

The statistics stay in raw score units (m) and L is converted back to natural units at the end.

**Prediction (before the first GPU run).** The softmax is about a third of the instructions of v4's inner loop at
d = 64 (fewer at 128): +10-20 % at d = 64, +5-10 % at d = 128.

**Measured** (H100 80GB HBM3, 2026-11-24, fp16, non-causal, batch × N = 16k tokens, hidden 2048, TFLOP/s at
N = 1024 / 4096 / 16384; ``benchmarks/results/nvidia-h100/tensorcore.json``, SDPA flash in the same run:
260.8 / 305.3 / 309.4 at d = 64, 308.7 / 340.1 / 341.5 at d = 128). d = 64: 65.0 / 94.3 / 99.7; d = 128: 81.9 / 108.6 /
115.4 (+34-72 % at d = 64, +26-29 % at d = 128 over v4); causal at N = 8192: 1.82× (d = 64) and 1.76× (d = 128) faster
in wall time than non-causal; bf16 within a few % of fp16. The prediction (+10-20 % / +5-10 %) was too low: libdevice's
``expf`` and the per-tile rescale were a larger share of v4's instructions than counted.

**What limits it, and what would come next.** v5 reaches 0.25-0.34× SDPA flash and 16-18 % of the mma.sync
ceiling measured in the same run (624 TFLOP/s): below the project's targets (≥ 150 TFLOP/s, ≥ 0.5× SDPA flash).
Each warp owns 16 rows, so every K and V fragment it loads from shared memory (one ldmatrix per two MMAs) serves
a single MMA row tile: shared-memory traffic per FLOP is twice that of FlashAttention-2's kernels, whose warps own
32 or more rows. Next: two row tiles per warp (B_r = 128 with 4 warps), masks computed only on the tiles that
need them, and wgmma on Hopper (mma.sync itself tops out at about 60 % of the tensor cores' peak).
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import launch
from kernels_gpu.tensorcore.steps import LOG2E, Config, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> Config:
    """v5's tile shape (v2's): 4 warps (B_r = 64); B_c = 64 keys up to d = 128, 32 beyond."""
    B_c = 64 if d <= 128 else 32
    return Config(d=d, warps=4, B_c=B_c, dtype=dtype, causal=causal, simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, and two stages of K_j, V_j (RS words per row)."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The v5 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    copy_q, copy_kv, zero, init_stats = st["copy_q_async"], st["copy_kv_async"], st["zero"], st["init_stats"]
    online_softmax, finish_rows, mma_into = st["online_softmax_exp2"], st["finish_rows_exp2"], st["mma_into"]
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    B_r, B_c, RS, NT, NO = cfg.B_r, cfg.B_c, cfg.RS, cfg.NT, cfg.NO
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    KV = B_c // 16                           # 16-wide k-steps of O += P V
    K_OFF = B_r * RS                         # word offsets of the tiles in the one shared array: Q_i, then
    V_OFF = K_OFF + B_c * RS                 # stage 0 (K, V), then stage 1 (K, V)
    STAGE = 2 * B_c * RS
    causal = cfg.causal
    S_LEN, O_LEN = 4 * NT, 4 * NO           # register-array lengths (compile-time constants)

    @cuda.jit
    def flash2_forward_tc_v5(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, as 32-bit words
        s = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        row0 = i * B_r + 16 * warp + g        # this lane's first row; its second is row0 + 8
        diag = N_k - N_q
        scale_log2 = scale * float32(LOG2E)   # τ·log₂e: exp(τx) = 2^(x·τlog₂e)

        # Causal: the tiles right of the block's last row's diagonal are never visited (all masked).
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)
        # Alg. 1 lines 4 and 7 (j = 1): start the copies of Q_i, K_1, V_1, as one group.
        copy_q(sm, 0, Q, z, h, i * B_r, N_q, tid)
        if n_tiles > 0:
            copy_kv(sm, K_OFF, K, z, hk, 0, N_k, tid)
            copy_kv(sm, V_OFF, V, z, hk, 0, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers).
        zero(o, O_LEN)
        init_stats(m, l)
        # Alg. 1 line 6: for j = 1 … T_c.
        for j in range(n_tiles):
            stage = (j % 2) * STAGE
            # Line 7 for tile j + 1, started now, lands while tile j is computed.
            if j + 1 < n_tiles:
                copy_kv(sm, K_OFF + STAGE - stage, K, z, hk, (j + 1) * B_c, N_k, tid)
                copy_kv(sm, V_OFF + STAGE - stage, V, z, hk, (j + 1) * B_c, N_k, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_one()           # this thread's copies of tile j (and Q_i) have landed ...
            cuda.syncthreads()                # ... and everyone's

            # Line 8: S_ij = Q_i K_jᵀ, the warp's 16 rows, two 16 × 8 tiles per ldmatrix of K.
            zero(s, S_LEN)
            for kk in range(KS):
                # A: lanes 0-15 address rows 0-15 at word 8kk, lanes 16-31 the same rows 4 words on.
                a0, a1, a2, a3 = ldmatrix(sm, (16 * warp + lane % 16) * RS + 8 * kk + 4 * (lane // 16))
                for p in range(NT // 2):
                    # B: lanes 8u … 8u+7 address keys 16p + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                    k_row = K_OFF + stage + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                    b0, b1, b2, b3 = ldmatrix(sm, k_row)
                    mma_into(s, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(s, 2 * p + 1, a0, a1, a2, a3, b2, b3)

            # Lines 9-10: the online softmax (mask, m, P̃, ℓ, rescale Õ).
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, True)

            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step; A comes straight from S's accumulators.
            for kk in range(KV):
                a0 = pack(s[8 * kk], s[8 * kk + 1])
                a1 = pack(s[8 * kk + 2], s[8 * kk + 3])
                a2 = pack(s[8 * kk + 4], s[8 * kk + 5])
                a3 = pack(s[8 * kk + 6], s[8 * kk + 7])
                for p in range(NO // 2):
                    # B (transposed on the way): lanes 8u … 8u+7 address keys 16kk + 8(u % 2) + 0…7,
                    # columns 16p + 8(u // 2) …
                    v_row = V_OFF + stage + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 8 * p + 4 * (lane // 16)
                    b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                    mma_into(o, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(o, 2 * p + 1, a0, a1, a2, a3, b2, b3)
            cuda.syncthreads()                # stage j mod 2 is free for tile j + 2

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2)

    return flash2_forward_tc_v5


def flash2_forward(Q, K, V, causal=False, scale=None):
    """FA2 forward on tensor cores, rung v5 (base-2 softmax, scale folded, lazy rescale). Q (…, N_q, d), K, V
    (…, N_k, d), float16 or bfloat16 (see :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted).
    Returns ``Flash2Forward(O, L)``: O in the input dtype, L float32 (+inf on rows that see no key). ``causal``:
    bottom-right aligned; ``scale``: τ, default 1/√d."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale)
