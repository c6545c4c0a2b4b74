"""Tensor-core FA2 forward, v10: the tile shape chosen per head dimension (v9 + one change).

A warp's register budget — at most 255 per thread — is shared by its Õ accumulators (4·d/8 per row tile), its
S accumulators (4·B_c/8 per row tile) and everything else, and the registers per thread decide how many blocks an
SM holds (65 536 registers). v9 used one shape everywhere (two row tiles, B_c = 64) and handed d > 128 to v6 — so
the largest head dimensions ran without v8's float32 softmax and v9's cheap copies. v10 picks, per d:

======== ========== ===== ===================================================================================
d        row tiles  B_c   why
======== ========== ===== ===================================================================================
≤ 64     2          32    162 registers: three blocks (12 warps) per SM instead of two at B_c = 64 (211)
≤ 128    2          64    ~250 registers, two blocks per SM; B_c = 32 measured slower (more per-tile overhead)
≤ 256    1          32    two Õ tiles would not fit; one row tile per warp (v6's shape) with v8 and v9's changes
======== ========== ===== ===================================================================================

(`benchmarks.profilers.tensorcore_tiles` measured the first two rows on v9: d = 64, N = 4096: 193 TFLOP/s at B_c = 32
against 184 at 64; d = 128: 193 against 211.)

**Prediction (before the first GPU run).** d = 64: +3-6 % (the tile sweep); d = 128 unchanged; d = 256: well above
v6 (the float64 softmax and the copy arithmetic weighed more per FLOP there): 1.5-2×.

**Measured** (H100, 2026-11-24, ``tensorcore_v11.json``, v6, v9, v10, v11 and SDPA flash in one run; fp16,
non-causal, TFLOP/s at N = 1024 / 2048 / 4096 / 8192 / 16384): d = 64: 131.0 / 171.2 / 199.4 / 217.8 / 238.5 (v9
in the same run: 102.0 / 126.8 / 200.5 / 223.3 / 238.1) — the third block per SM pays at N ≤ 2048, where a block
has few tiles to hide its start behind, and not beyond; d = 128 (same shape as v9): 106.9 / 188.8 / 233.6 / 273.9 /
273.1 against v9's 104.5 / 191.9 / 233.2 / 253.8 / 299.0 — equal within this run's noise (±10 % between
identical kernels at N = 16384). d = 256 (``tensorcore_v11_d256.json``, v11 = v10's kernel when non-causal,
beside v6): 118.9 / 150.9 / 182.9 / 202.1 / 213.1 against v6's 96.9 / 117.7 / 131.4 / 139.7 / 149.5 — 1.2-1.45×,
below the predicted 1.5-2×.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import launch
from kernels_gpu.tensorcore.steps import LOG2E, Config, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool, B_c: int | None = None,
               row_tiles: int | None = None) -> Config:
    """v10's tile shape for head dimension ``d`` (the table above); ``B_c``, ``row_tiles`` override it."""
    R, Bc = (2, 32) if d <= 64 else (2, 64) if d <= 128 else (1, 32)
    return Config(d=d, warps=4, row_tiles=row_tiles or R, B_c=B_c or Bc, dtype=dtype, causal=causal,
                  simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, and two stages of K_j, V_j (RS words per row)."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The v10 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    copy_q, copy_kv, zero, init_stats = st["copy_q_async_inc"], st["copy_kv_async_inc"], st["zero"], st["init_stats"]
    online_softmax, finish_rows, mma_into = st["online_softmax_f32"], st["finish_rows_exp2"], st["mma_into"]
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    B_r, B_c, RS, NT, NO, R = cfg.B_r, cfg.B_c, cfg.RS, cfg.NT, cfg.NO, cfg.row_tiles
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    KV = B_c // 16                           # 16-wide k-steps of O += P V
    K_OFF = B_r * RS                         # word offsets of the tiles in the one shared array: Q_i, then
    V_OFF = K_OFF + B_c * RS                 # stage 0 (K, V), then stage 1 (K, V)
    STAGE = 2 * B_c * RS
    causal = cfg.causal
    S_LEN, O_LEN = 4 * NT, 4 * NO           # register-array lengths (compile-time constants)
    S1_LEN, O1_LEN = (S_LEN, O_LEN) if R == 2 else (1, 1)   # the second row tile's arrays (a stub when R = 1)

    @cuda.jit
    def flash2_forward_tc_v10(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, as 32-bit words
        # The warp's R row tiles (R = 1 or 2, a compile-time constant: every `if R == 2` below disappears when
        # R = 1), each with its own S/P̃ and Õ accumulators and statistics: rows 16R·w … 16R·w + 15 (suffix 0),
        # and 16 more (suffix 1).
        s0 = cuda.local.array(S_LEN, float32)
        s1 = cuda.local.array(S1_LEN, float32)
        o0 = cuda.local.array(O_LEN, float32)
        o1 = cuda.local.array(O1_LEN, float32)
        m0 = cuda.local.array(2, float32)
        m1 = cuda.local.array(2, float32)
        l0 = cuda.local.array(2, float32)
        l1 = cuda.local.array(2, float32)
        row0 = i * B_r + 16 * R * warp + g    # this lane's first row of tile 0; tile 1's is row0 + 16
        q_row = (16 * R * warp + lane % 16) * RS   # the row this lane addresses in ldmatrix of Q (tile 0)
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
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers), for each row tile.
        zero(o0, O_LEN)
        init_stats(m0, l0)
        if R == 2:
            zero(o1, O_LEN)
            init_stats(m1, l1)
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

            # Line 8: S_ij = Q_i K_jᵀ for the warp's rows: each K fragment (two 16 × 8 tiles of keys) is
            # multiplied into every row tile.
            zero(s0, S_LEN)
            if R == 2:
                zero(s1, S_LEN)
            for kk in range(KS):
                # A: lanes 0-15 address rows 0-15 of the tile at word 8kk, lanes 16-31 the same rows 4 words on.
                a0, a1, a2, a3 = ldmatrix(sm, q_row + 8 * kk + 4 * (lane // 16))
                if R == 2:
                    c0, c1, c2, c3 = ldmatrix(sm, q_row + 16 * RS + 8 * kk + 4 * (lane // 16))
                for p in range(NT // 2):
                    # B: lanes 8u … 8u+7 address keys 16p + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                    k_row = K_OFF + stage + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                    b0, b1, b2, b3 = ldmatrix(sm, k_row)
                    mma_into(s0, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(s0, 2 * p + 1, a0, a1, a2, a3, b2, b3)
                    if R == 2:
                        mma_into(s1, 2 * p, c0, c1, c2, c3, b0, b1)
                        mma_into(s1, 2 * p + 1, c0, c1, c2, c3, b2, b3)

            # Lines 9-10: the online softmax of each row tile; the mask only where a key of the tile can be
            # invisible to some row of the block: past N_k, or (causal) past the first row's diagonal.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            online_softmax(s0, o0, m0, l0, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            if R == 2:
                online_softmax(s1, o1, m1, l1, row0 + 16, j * B_c, N_k, scale_log2, diag, mask_tile)

            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step; A comes straight from S's accumulators,
            # and each V fragment serves every row tile.
            for kk in range(KV):
                a0 = pack(s0[8 * kk], s0[8 * kk + 1])
                a1 = pack(s0[8 * kk + 2], s0[8 * kk + 3])
                a2 = pack(s0[8 * kk + 4], s0[8 * kk + 5])
                a3 = pack(s0[8 * kk + 6], s0[8 * kk + 7])
                if R == 2:
                    c0 = pack(s1[8 * kk], s1[8 * kk + 1])
                    c1 = pack(s1[8 * kk + 2], s1[8 * kk + 3])
                    c2 = pack(s1[8 * kk + 4], s1[8 * kk + 5])
                    c3 = pack(s1[8 * kk + 6], s1[8 * kk + 7])
                for p in range(NO // 2):
                    # B (transposed on the way): lanes 8u … 8u+7 address keys 16kk + 8(u % 2) + 0…7,
                    # columns 16p + 8(u // 2) …
                    v_row = V_OFF + stage + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 8 * p + 4 * (lane // 16)
                    b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                    mma_into(o0, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(o0, 2 * p + 1, a0, a1, a2, a3, b2, b3)
                    if R == 2:
                        mma_into(o1, 2 * p, c0, c1, c2, c3, b0, b1)
                        mma_into(o1, 2 * p + 1, c0, c1, c2, c3, b2, b3)
            cuda.syncthreads()                # stage j mod 2 is free for tile j + 2

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once, per row tile.
        finish_rows(o0, m0, l0, O, L, z, h, row0, N_q, scale_log2)
        if R == 2:
            finish_rows(o1, m1, l1, O, L, z, h, row0 + 16, N_q, scale_log2)

    return flash2_forward_tc_v10


def flash2_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on tensor cores, rung v10 (tile shape per head dimension). Q (…, N_q, d), K, V (…, N_k, d),
    float16 or bfloat16 (see :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted). Returns
    ``Flash2Forward(O, L)``: O in the input dtype, L float32 (+inf on rows that see no key). ``causal``:
    bottom-right aligned; ``scale``: τ, default 1/√d; ``options`` (``B_c``, ``row_tiles``) go to
    :func:`config_for`."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale, **options)
