"""Tensor-core FA2 forward, v1: ``mma.sync`` on tiles in shared memory, operands gathered by plain loads.

The first rung puts FA2 Algorithm 1 on tensor cores and changes nothing else. A block of W = 4 warps owns
B_r = 64 query rows (16 per warp: split-Q, FA2 Section 3.3). Per K/V tile:

1. the block copies K_j and V_j from HBM to shared memory, word by word (V *transposed*, V_jᵀ[dim][key], as
   16-bit values: the B operand of P·V pairs two consecutive *keys* in one register, and in V's own layout those
   are a row apart);
2. each warp computes its 16 × B_c slice of S_ij with ``mma.sync.m16n8k16``: every operand register is one 32-bit
   shared-memory load at the address the fragment table gives (A from Q_i, B from K_j);
3. the online softmax (shared step), then P̃_ij is rounded to 16 bits and written to shared memory, and read back
   as A fragments of O_i += P̃_ij V_j (B from V_jᵀ: two 16-bit loads per register).

Nothing is asynchronous and nothing is reused across tiles: the point is a correct kernel whose every operand
load can be read against :mod:`kernels_gpu.fragments`.

**Prediction (written before the first GPU run).** Per 16 × 8 × 16 MMA a lane issues 6 scalar shared loads for
A and B (4 + 2) plus address arithmetic: about 10 instructions per ``mma`` where the tensor core needs ~2 issue
slots, so the kernel is bound by instruction issue and shared-memory bandwidth, not by the tensor cores. The
transposed V stores are 16-bit scattered stores with bank conflicts. Expected: 40-80 TFLOP/s at d = 64, N = 4096
(2-4× the fp32 CUDA-core kernels, 15-25 % of SDPA flash).

**Measured** (H100 80GB HBM3, 2026-11-24, fp16, non-causal, batch × N = 16k tokens, hidden 2048, TFLOP/s at
N = 1024 / 4096 / 16384; ``benchmarks/results/nvidia-h100/tensorcore.json``, SDPA flash in the same run:
260.8 / 305.3 / 309.4 at d = 64, 308.7 / 340.1 / 341.5 at d = 128). d = 64: 14.9 / 18.9 / 20.7; d = 128: 16.7 / 20.1 /
23.0. The prediction failed: a third of what was expected, below the fp32 CUDA-core kernels (30-36 on the same GPU).
v4 later showed why: the synchronous copy of each K/V tile (load, store, barrier, with only a few blocks per SM
to cover it) costs more than all the arithmetic; operand gathering was not yet the limit.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint16, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import launch
from kernels_gpu.tensorcore.steps import Config, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> Config:
    """v1's tile shape: 4 warps (B_r = 64); B_c = 64 keys up to d = 64, 32 up to 128, 16 beyond (shared memory)."""
    B_c = 64 if d <= 64 else 32 if d <= 128 else 16
    return Config(d=d, warps=4, B_c=B_c, dtype=dtype, causal=causal, simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, K_j (RS words per row), V_jᵀ (D rows of B_c + 8 halves), P̃_ij."""
    return cfg.B_r * cfg.RS + cfg.B_c * cfg.RS + cfg.D * (cfg.B_c + 8) // 2 + cfg.B_r * (cfg.B_c // 2 + 4)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The v1 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    load_q, load_kv, zero, init_stats = st["load_q"], st["load_kv"], st["zero"], st["init_stats"]
    online_softmax, finish_rows = st["online_softmax"], st["finish_rows"]
    mma = ptx.mma_f16 if cfg.dtype == "float16" else ptx.mma_bf16
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    B_r, B_c, T, RS, NT, NO = cfg.B_r, cfg.B_c, cfg.threads, cfg.RS, cfg.NT, cfg.NO
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    KV = B_c // 16                           # 16-wide k-steps of O += P V
    DW = cfg.d // 2
    VT = B_c + 8                             # halves per row of V_jᵀ (8 of padding)
    PS = B_c // 2 + 4                        # words per row of P̃_ij
    K_OFF = B_r * RS                         # word offsets of the tiles in the one shared array
    V_OFF = K_OFF + B_c * RS
    P_OFF = V_OFF + cfg.D * VT // 2
    causal = cfg.causal
    S_LEN, O_LEN = 4 * NT, 4 * NO           # register-array lengths (compile-time constants)

    @cuda.jit
    def flash2_forward_tc_v1(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        g = cuda.laneid // 4
        t = cuda.laneid % 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, as words ...
        sm16 = cuda.shared.array(0, uint16)   # ... and the same bytes as halves (for V_jᵀ)
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
            # Line 7: load K_j, V_j from HBM to SRAM; V_j transposed, half by half.
            load_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
            for e in range(tid, B_c * DW, T):
                c = e // DW
                w = e - c * DW
                word = uint32(0)
                if j * B_c + c < N_k:
                    word = uint32(V[z, hk, j * B_c + c, w])
                sm16[2 * V_OFF + (2 * w) * VT + c] = uint16(word & 0xFFFF)
                sm16[2 * V_OFF + (2 * w + 1) * VT + c] = uint16(word >> 16)
            cuda.syncthreads()

            # Line 8: S_ij = Q_i K_jᵀ, the warp's 16 rows, one 16 × 8 tile per n, 16 columns of d per k-step.
            zero(s, S_LEN)
            for kk in range(KS):
                q_row = (16 * warp + g) * RS + 8 * kk + t          # A: rows g, g+8; words 8kk + t, + 4
                a0 = sm[q_row]
                a1 = sm[q_row + 8 * RS]
                a2 = sm[q_row + 4]
                a3 = sm[q_row + 8 * RS + 4]
                for n in range(NT):
                    k_row = K_OFF + (8 * n + g) * RS + 8 * kk + t  # B: key 8n + g, words 8kk + t, + 4
                    c0, c1, c2, c3 = mma(a0, a1, a2, a3, sm[k_row], sm[k_row + 4],
                                         s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3])
                    s[4 * n] = c0
                    s[4 * n + 1] = c1
                    s[4 * n + 2] = c2
                    s[4 * n + 3] = c3

            # Lines 9-10: the online softmax (mask, m, P̃, ℓ, rescale Õ).
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale, diag)

            # P̃_ij to shared memory as 16-bit pairs (rows g and g + 8 of the warp's slice) ...
            p_row = P_OFF + (16 * warp + g) * PS
            for n in range(NT):
                sm[p_row + 4 * n + t] = pack(s[4 * n], s[4 * n + 1])
                sm[p_row + 8 * PS + 4 * n + t] = pack(s[4 * n + 2], s[4 * n + 3])
            ptx.syncwarp()                    # ... read back by other lanes of the same warp only
            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step.
            for kk in range(KV):
                a0 = sm[p_row + 8 * kk + t]
                a1 = sm[p_row + 8 * PS + 8 * kk + t]
                a2 = sm[p_row + 8 * kk + 4 + t]
                a3 = sm[p_row + 8 * PS + 8 * kk + 4 + t]
                for n in range(NO):
                    v_row = 2 * V_OFF + (8 * n + g) * VT + 16 * kk + 2 * t   # B: keys 2t, 2t+1 of dim 8n + g
                    b0 = uint32(sm16[v_row]) | (uint32(sm16[v_row + 1]) << 16)
                    b1 = uint32(sm16[v_row + 8]) | (uint32(sm16[v_row + 9]) << 16)
                    c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1,
                                         o[4 * n], o[4 * n + 1], o[4 * n + 2], o[4 * n + 3])
                    o[4 * n] = c0
                    o[4 * n + 1] = c1
                    o[4 * n + 2] = c2
                    o[4 * n + 3] = c3

        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale)

    return flash2_forward_tc_v1


def flash2_forward(Q, K, V, causal=False, scale=None):
    """FA2 forward on tensor cores, rung v1. Q (…, N_q, d), K, V (…, N_k, d), float16 or bfloat16 (see
    :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted). Returns ``Flash2Forward(O, L)``: O in
    the input dtype, L float32 (+inf on rows that see no key). ``causal``: bottom-right aligned; ``scale``: τ,
    default 1/√d."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale)
