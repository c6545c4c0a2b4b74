"""Tensor-core FA2 forward, **split-Q** (FA2 Section 3.3): a block's warps split the row block Q_i, share K_j, V_j.

This is the partner of :mod:`~kernels_gpu.tensorcore.flash2_forward_splitk` in the measurement of FA2 Section 3.3,
built so that the two differ in the work partitioning between warps and in nothing else: the same block (4 warps,
B_r = 64 query rows, B_c = 64 keys per K/V tile, d ≤ 128), the same copies (``cp.async``, double-buffered K/V, v9's
copy addressing), ``ldmatrix`` operand loads, the same float32 base-2 softmax with the mask only on the
tiles that need it, P̃ kept in registers. It is v6's kernel with v8's float32 softmax and v9's copies — the ladder's
split-Q at one row tile per warp.

**Split-Q.** Warp w owns query rows 16w … 16w + 15 of Q_i for the whole run: it computes their 16 × B_c slice of
S_ij = Q_i K_jᵀ (all of K_j), their online softmax, and their 16 × d slice of Õ_i += P̃_ij V_j (all of V_j). Every
row's statistics (m, ℓ) and accumulator (Õ) live in one warp, so the warps never exchange anything: the only
shared-memory traffic is the tiles' copies in and the ``ldmatrix`` reads out (per warp and tile: its Q rows once,
all of K_j and V_j). :func:`~kernels_gpu.tensorcore.traffic.shared_memory_traffic` counts it.

**Prediction (written before any GPU run).** Between v6 (fp16, N ≥ 4096: 106-115 TFLOP/s at d = 64, 120-129 at
d = 128) and v9 (two row tiles per warp: 195-242, 201-294): the float32 softmax and the cheap copies were worth
1.4-1.8× and +10-45 % on top of v7, and most of that carries over to one row tile: **140-200 TFLOP/s at
d = 64 and d = 128, N ≥ 4096**, below v9 (each K/V fragment serves two MMAs here, four there).

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks/results/nvidia-h100/tensorcore_variants.json``; fp16,
non-causal, batch × N = 16k tokens, hidden 2048, TFLOP/s at N = 4096 / 16384): d = 64: 179.9 / 239.5; d = 128:
157.8 / 189.4 — 0.58 / 0.77× and 0.46 / 0.55× SDPA flash in the same run (309.2 / 310.0, 343.0 / 341.7). Within
the predicted 140-200 except d = 64 at N = 16384, which is above it and level with v9 (241.6 there); why one row
tile per warp matches two at that size is not established (no profile). Shared-memory traffic by
:func:`~kernels_gpu.tensorcore.traffic.shared_memory_traffic`: 88 / 176 KiB per K/V tile and block at d = 64 / 128,
0.086 bytes per FLOP, moved at 15.5 / 20.6 TB/s (d = 64) and 13.6 / 16.3 TB/s (d = 128). ptxas: 123 / 161
registers, no spills. Split-K in the same run: 0.27-0.50× of this rung (its module has the numbers). GPU tests
of both partitionings and TF32 (``gpu_tests_tensorcore_tf32_partitioning.log``): 31 passed.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import launch
from kernels_gpu.tensorcore.steps import LOG2E, Config, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for", "shared_words", "MAX_D", "WARPS", "B_R", "B_C"]

#: the tile shape both partitionings of FA2 Section 3.3 share
WARPS, B_R, B_C = 4, 64, 64
#: the largest head dimension of the comparison (beyond, split-K's exchange buffer and the tiles exceed 227 KiB)
MAX_D = 128


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> Config:
    """The comparison's tile shape: 4 warps of 16 rows (B_r = 64), B_c = 64 keys; d ≤ 128."""
    if d > MAX_D:
        raise ValueError(f"the split-Q / split-K comparison runs d ≤ {MAX_D} (got {d}); use "
                         f"kernels_gpu.tensorcore.flash2_forward for larger heads")
    return Config(d=d, warps=WARPS, B_c=B_C, dtype=dtype, causal=causal, simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, and two stages of K_j, V_j (RS words per row)."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The split-Q kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    copy_q, copy_kv, zero, init_stats = st["copy_q_async_inc"], st["copy_kv_async_inc"], st["zero"], st["init_stats"]
    online_softmax, finish_rows, mma_into = st["online_softmax_f32"], st["finish_rows_exp2"], st["mma_into"]
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
    def flash2_forward_tc_splitq(Q, K, V, O, L, N_q, N_k, G, scale):
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
        row0 = i * B_r + 16 * warp + g        # split-Q: this warp's rows are 16w … 16w + 15 of the block
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

            # Line 8: S_ij = Q_i K_jᵀ, the warp's 16 rows against all B_c keys, two 16 × 8 tiles per ldmatrix of K.
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

            # Lines 9-10: the online softmax of the warp's own rows — complete rows, so nothing to exchange; the mask
            # only where a key of the tile can be invisible to some row of the block.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, mask_tile)

            # Line 10 (second half): Õ_i += P̃_ij V_j for the warp's rows, 16 keys per k-step; A comes straight from
            # S's accumulators.
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

    return flash2_forward_tc_splitq


def flash2_forward(Q, K, V, causal=False, scale=None):
    """FA2 forward on tensor cores with FA2's split-Q work partitioning (Section 3.3): each warp owns 16 rows of the
    block. Q (…, N_q, d), K, V (…, N_k, d), float16 or bfloat16, d ≤ 128 (see :mod:`kernels_gpu.tensorcore.launch`
    for the kinds of arrays accepted). Returns ``Flash2Forward(O, L)``: O in the input dtype, L float32 (+inf on rows
    that see no key). ``causal``: bottom-right aligned; ``scale``: τ, default 1/√d."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale)
