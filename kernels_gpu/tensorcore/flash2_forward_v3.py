"""Tensor-core FA2 forward, v3: P̃ stays in registers (v2 + one change: FA2's own trick, one level down).

In v2 every warp wrote P̃_ij to shared memory and read it back with ``ldmatrix`` as the A operand of
O += P̃ V. The fragment tables say that round trip is unnecessary: the accumulators of S's n-tiles 2k and 2k + 1
(keys 16k … 16k + 15), rounded to 16 bits and packed in pairs, *are* the A registers of the k-th 16-key step of
P̃·V, lane by lane (:func:`kernels_gpu.fragments.c_to_a`)::

    a0 = pack(s[8k + 0], s[8k + 1])    # row g,     keys 16k + 2t, +1      (tile 2k: c0, c1)
    a1 = pack(s[8k + 2], s[8k + 3])    # row g + 8, same keys              (tile 2k: c2, c3)
    a2 = pack(s[8k + 4], s[8k + 5])    # row g,     keys 16k + 8 + 2t, +1  (tile 2k + 1: c0, c1)
    a3 = pack(s[8k + 6], s[8k + 7])    # row g + 8                         (tile 2k + 1: c2, c3)

FA2 keeps S and P out of HBM; this keeps them out of shared memory too. The P̃ region of shared memory and the
``syncwarp`` between its writes and reads are gone.

**Prediction (before the first GPU run).** Per tile and warp, B_c/8 × 2 shared stores and B_c/16 ldmatrix go,
and the warp no longer waits for its own stores: +10-25 % over v2.

**Measured** (H100 80GB HBM3, 2026-11-24, fp16, non-causal, batch × N = 16k tokens, hidden 2048, TFLOP/s at
N = 1024 / 4096 / 16384; ``benchmarks/results/nvidia-h100/tensorcore.json``, SDPA flash in the same run:
260.8 / 305.3 / 309.4 at d = 64, 308.7 / 340.1 / 341.5 at d = 128). d = 64: 17.1 / 22.2 / 25.3; d = 128: 19.7 / 25.1 /
30.8: level with v2 (−4 % to +2 %). The prediction (+10-25 %) failed: while each tile waits for its synchronous copy,
the P̃ round trip through shared memory is not on the critical path. The change stays: it is what makes v4's and v5's
gains possible without shared-memory traffic for P̃ (and it frees B_r·B_c/2 words of shared memory).
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import launch
from kernels_gpu.tensorcore.steps import Config, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> Config:
    """v3's tile shape (v2's): 4 warps (B_r = 64); B_c = 64 keys up to d = 128, 32 beyond."""
    B_c = 64 if d <= 128 else 32
    return Config(d=d, warps=4, B_c=B_c, dtype=dtype, causal=causal, simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, K_j, V_j (RS words per row)."""
    return cfg.B_r * cfg.RS + 2 * cfg.B_c * cfg.RS


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The v3 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    load_q, load_kv, zero, init_stats = st["load_q"], st["load_kv"], st["zero"], st["init_stats"]
    online_softmax, finish_rows, mma_into = st["online_softmax"], st["finish_rows"], st["mma_into"]
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    B_r, B_c, RS, NT, NO = cfg.B_r, cfg.B_c, cfg.RS, cfg.NT, cfg.NO
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    KV = B_c // 16                           # 16-wide k-steps of O += P V
    K_OFF = B_r * RS                         # word offsets of the tiles in the one shared array
    V_OFF = K_OFF + B_c * RS
    causal = cfg.causal
    S_LEN, O_LEN = 4 * NT, 4 * NO           # register-array lengths (compile-time constants)

    @cuda.jit
    def flash2_forward_tc_v3(Q, K, V, O, L, N_q, N_k, G, scale):
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

        # Alg. 1 line 4: load Q_i from HBM to SRAM.
        load_q(sm, 0, Q, z, h, i * B_r, N_q, tid)
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers).
        zero(o, O_LEN)
        init_stats(m, l)
        # Causal: the tiles right of the block's last row's diagonal are never visited (all masked).
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)
        # Alg. 1 line 6: for j = 1 … T_c.
        for j in range(n_tiles):
            cuda.syncthreads()                # everyone is done with the previous K_j, V_j, P̃
            # Line 7: load K_j, V_j from HBM to SRAM (both row-major, as in HBM).
            load_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
            load_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
            cuda.syncthreads()

            # Line 8: S_ij = Q_i K_jᵀ, the warp's 16 rows, two 16 × 8 tiles per ldmatrix of K.
            zero(s, S_LEN)
            for kk in range(KS):
                # A: lanes 0-15 address rows 0-15 at word 8kk, lanes 16-31 the same rows 4 words on.
                a0, a1, a2, a3 = ldmatrix(sm, (16 * warp + lane % 16) * RS + 8 * kk + 4 * (lane // 16))
                for p in range(NT // 2):
                    # B: lanes 8u … 8u+7 address keys 16p + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                    k_row = K_OFF + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                    b0, b1, b2, b3 = ldmatrix(sm, k_row)
                    mma_into(s, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(s, 2 * p + 1, a0, a1, a2, a3, b2, b3)

            # Lines 9-10: the online softmax (mask, m, P̃, ℓ, rescale Õ).
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale, diag)

            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step; A comes straight from S's accumulators.
            for kk in range(KV):
                a0 = pack(s[8 * kk], s[8 * kk + 1])
                a1 = pack(s[8 * kk + 2], s[8 * kk + 3])
                a2 = pack(s[8 * kk + 4], s[8 * kk + 5])
                a3 = pack(s[8 * kk + 6], s[8 * kk + 7])
                for p in range(NO // 2):
                    # B (transposed on the way): lanes 8u … 8u+7 address keys 16kk + 8(u % 2) + 0…7,
                    # columns 16p + 8(u // 2) …
                    v_row = V_OFF + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 8 * p + 4 * (lane // 16)
                    b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                    mma_into(o, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(o, 2 * p + 1, a0, a1, a2, a3, b2, b3)

        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale)

    return flash2_forward_tc_v3


def flash2_forward(Q, K, V, causal=False, scale=None):
    """FA2 forward on tensor cores, rung v3 (P̃ in registers). Q (…, N_q, d), K, V (…, N_k, d), float16 or bfloat16 (see
    :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted). Returns ``Flash2Forward(O, L)``: O in
    the input dtype, L float32 (+inf on rows that see no key). ``causal``: bottom-right aligned; ``scale``: τ,
    default 1/√d."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale)
