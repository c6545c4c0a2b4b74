"""Tensor-core FA2 forward, v2: operands loaded with ``ldmatrix`` (v1 + one change).

v1 gathered every operand register with its own 32-bit shared-memory load, and had to store V_j transposed
(16-bit scattered stores) because P̃·V pairs two consecutive keys in one register. ``ldmatrix.x4`` loads four
8 × 8 tiles of 16-bit values for the whole warp in one instruction — each lane gives the address of one 16-byte
row, each lane receives exactly the fragment registers the ``mma`` wants — and its ``.trans`` form transposes on
the way, so V_j is stored as it is in HBM:

* A of S = Q_i K_jᵀ: one ``ldmatrix.x4`` per 16-wide k-step (the 16 × 16 block of Q_i: a0…a3);
* B from K_j: one ``ldmatrix.x4`` per pair of 16 × 8 tiles (b0, b1 of two n-tiles);
* B from V_j: one ``ldmatrix.x4.trans`` per 16 keys and pair of 8-wide output columns;
* A of O += P̃ V: P̃ still goes through shared memory (v3 removes that), read back with ``ldmatrix.x4``.

Loads per 16 × 8 × 16 MMA fall from 6 scalar loads (+ their address arithmetic) to 1.5 ldmatrix-quarters.
V_j no longer needs a transposing copy; K and V use the same row-major tile copy. With V no longer transposed the
tiles are the same size, so B_c = 64 up to d = 128 (shared memory beyond 48 KiB is dynamic).

**Prediction (before the first GPU run).** The instruction count of the inner loops falls ~3× and the transposed
16-bit V stores disappear: 1.5-2.5× v1's TFLOP/s.

**Measured** (H100 80GB HBM3, 2026-11-24, fp16, non-causal, batch × N = 16k tokens, hidden 2048, TFLOP/s at
N = 1024 / 4096 / 16384; ``benchmarks/results/nvidia-h100/tensorcore.json``, SDPA flash in the same run:
260.8 / 305.3 / 309.4 at d = 64, 308.7 / 340.1 / 341.5 at d = 128). d = 64: 17.6 / 23.2 / 26.8; d = 128: 20.0 / 24.6 /
30.4 (1.2-1.3× v1). The prediction (1.5-2.5×) failed for the reason v4 exposed: the tiles' synchronous HBM copies
dominate, so fewer instructions between them moved the total little.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import launch
from kernels_gpu.tensorcore.steps import Config, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> Config:
    """v2's tile shape: 4 warps (B_r = 64); B_c = 64 keys up to d = 128, 32 beyond."""
    B_c = 64 if d <= 128 else 32
    return Config(d=d, warps=4, B_c=B_c, dtype=dtype, causal=causal, simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, K_j, V_j (RS words per row), P̃_ij (B_c/2 + 4 words per row)."""
    return cfg.B_r * cfg.RS + 2 * cfg.B_c * cfg.RS + cfg.B_r * (cfg.B_c // 2 + 4)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The v2 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    load_q, load_kv, zero, init_stats = st["load_q"], st["load_kv"], st["zero"], st["init_stats"]
    online_softmax, finish_rows, mma_into = st["online_softmax"], st["finish_rows"], st["mma_into"]
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    B_r, B_c, RS, NT, NO = cfg.B_r, cfg.B_c, cfg.RS, cfg.NT, cfg.NO
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    KV = B_c // 16                           # 16-wide k-steps of O += P V
    PS = B_c // 2 + 4                        # words per row of P̃_ij (16-byte aligned rows, as ldmatrix needs)
    K_OFF = B_r * RS                         # word offsets of the tiles in the one shared array
    V_OFF = K_OFF + B_c * RS
    P_OFF = V_OFF + B_c * RS
    causal = cfg.causal
    S_LEN, O_LEN = 4 * NT, 4 * NO           # register-array lengths (compile-time constants)

    @cuda.jit
    def flash2_forward_tc_v2(Q, K, V, O, L, N_q, N_k, G, scale):
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

            # P̃_ij to shared memory as 16-bit pairs (rows g and g + 8 of the warp's slice) ...
            p_row = P_OFF + (16 * warp + g) * PS
            for n in range(NT):
                sm[p_row + 4 * n + lane % 4] = pack(s[4 * n], s[4 * n + 1])
                sm[p_row + 8 * PS + 4 * n + lane % 4] = pack(s[4 * n + 2], s[4 * n + 3])
            ptx.syncwarp()                    # ... read back by other lanes of the same warp only
            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step.
            for kk in range(KV):
                a0, a1, a2, a3 = ldmatrix(sm, P_OFF + (16 * warp + lane % 16) * PS + 8 * kk + 4 * (lane // 16))
                for p in range(NO // 2):
                    # B (transposed on the way): lanes 8u … 8u+7 address keys 16kk + 8(u % 2) + 0…7,
                    # columns 16p + 8(u // 2) …
                    v_row = V_OFF + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 8 * p + 4 * (lane // 16)
                    b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                    mma_into(o, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(o, 2 * p + 1, a0, a1, a2, a3, b2, b3)

        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale)

    return flash2_forward_tc_v2


def flash2_forward(Q, K, V, causal=False, scale=None):
    """FA2 forward on tensor cores, rung v2 (ldmatrix). Q (…, N_q, d), K, V (…, N_k, d), float16 or bfloat16 (see
    :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted). Returns ``Flash2Forward(O, L)``: O in
    the input dtype, L float32 (+inf on rows that see no key). ``causal``: bottom-right aligned; ``scale``: τ,
    default 1/√d."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale)
