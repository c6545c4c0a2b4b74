"""Tensor-core FA2 forward, v7: two 16-row MMA tiles per warp (v6 + one change).

Up to v6 a warp owned 16 query rows: every K fragment it loaded from shared memory with ``ldmatrix`` fed two MMAs
and every V fragment two — one per 16 × 8 output tile of its single row tile. Shared memory delivers 128 bytes
per clock per SM and an ``ldmatrix.x4`` moves 512, so at d = 128 (8 k-steps of S, 4 of P̃V per 64-key tile) a
warp issued 72 ldmatrix for 128 MMAs: about 290 clocks of shared-memory bandwidth against about 200 clocks of
mma.sync work per tile — the shared-memory pipe, not the tensor cores, set v6's pace.

v7 gives each warp two row tiles (32 rows; B_r = 128 with 4 warps, as FlashAttention-2's own kernels at d ≤ 128).
Each K and V fragment now serves four MMAs — two row tiles × two 8-column halves — so the same 256 MMAs of a
warp's tile need 80 ldmatrix instead of 144 (Q's fragments are still loaded per tile: 16 of the 80). The price is
registers: each lane holds two S tiles and two Õ tiles (at d = 128, B_c = 64: 64 + 128 accumulators), which is
why v7 stops at d = 128 — beyond, two Õ tiles alone would take every register a thread may have, and v6's kernel
runs instead.

**Prediction (before the first GPU run).** If the shared-memory pipe is the limit, ldmatrix per MMA falls from
0.56 to 0.31 and the forward should gain 1.4-1.7× at d = 128 (v6: 120 TFLOP/s at N = 4096 → 170-200) and a little
less at d = 64 (where the exp work per FLOP is twice as large): 1.3-1.5×. Occupancy falls from 3 to 2 blocks
(8 warps) per SM at d = 128 (≈ 200 registers × 128 threads, 104 KiB of shared memory per block); if latency
rather than bandwidth bounded v6, the gain will be smaller.

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks/results/nvidia-h100/tensorcore_v7.json``, v6 and SDPA
flash in the same run; fp16, non-causal, TFLOP/s at N = 1024 / 4096 / 16384): d = 128: 82.0 / 135.2 / 162.2 (v6:
71.4 / 109.4 / 129.6), +15-25 %; d = 64: 59.7 / 91.0 / 105.4 (v6: 68.4 / 100.1 / 117.3), slower. Both below the
prediction. ptxas gives v7 255 registers at d = 128 and 225 at d = 64 (v6: 172 and 126), so an SM holds two blocks
(8 warps) — at d = 64 half of v6's 16. Nsight Compute at d = 128, N = 4096
(``ncu_tensorcore_v6_v7_d128.txt``): issue slots 40 % busy, 0.5 eligible warps per scheduler, 1 287 million
instructions for 134 million MMAs — ten instructions per MMA — and 36 million FP64 instructions, which no rung
was meant to have: the shared-memory pipe was not the limit; instruction overhead was (v8, v9).
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import flash2_forward_v6, launch
from kernels_gpu.tensorcore.steps import LOG2E, Config, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for", "MAX_D"]

#: the largest head dimension v7 runs itself (beyond, two Õ tiles do not fit in registers: v6 runs)
MAX_D = 128


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> Config:
    """v7's tile shape: 4 warps of two row tiles (B_r = 128), B_c = 64 keys."""
    if d > MAX_D:
        raise ValueError(f"v7 runs d ≤ {MAX_D} (got {d}); flash2_forward hands larger d to v6")
    return Config(d=d, warps=4, row_tiles=2, B_c=64, dtype=dtype, causal=causal, simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, and two stages of K_j, V_j (RS words per row)."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The v7 kernel for one configuration (compiled on first launch)."""
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
    def flash2_forward_tc_v7(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, as 32-bit words
        # The warp's two row tiles, each with its own S/P̃ and Õ accumulators and statistics (suffix 0: rows
        # 32w … 32w + 15 of the block, suffix 1: rows 32w + 16 … 32w + 31).
        s0 = cuda.local.array(S_LEN, float32)
        s1 = cuda.local.array(S_LEN, float32)
        o0 = cuda.local.array(O_LEN, float32)
        o1 = cuda.local.array(O_LEN, float32)
        m0 = cuda.local.array(2, float32)
        m1 = cuda.local.array(2, float32)
        l0 = cuda.local.array(2, float32)
        l1 = cuda.local.array(2, float32)
        row0 = i * B_r + 32 * warp + g        # this lane's first row of tile 0; tile 1's is row0 + 16
        q_row = (32 * warp + lane % 16) * RS  # the row this lane addresses in ldmatrix of Q (tile 0)
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
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers), for both row tiles.
        zero(o0, O_LEN)
        zero(o1, O_LEN)
        init_stats(m0, l0)
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

            # Line 8: S_ij = Q_i K_jᵀ for the warp's 32 rows: each K fragment (two 16 × 8 tiles of keys) is
            # multiplied into both row tiles — four MMAs per ldmatrix of K.
            zero(s0, S_LEN)
            zero(s1, S_LEN)
            for kk in range(KS):
                # A: lanes 0-15 address rows 0-15 of the tile at word 8kk, lanes 16-31 the same rows 4 words on.
                a0, a1, a2, a3 = ldmatrix(sm, q_row + 8 * kk + 4 * (lane // 16))
                c0, c1, c2, c3 = ldmatrix(sm, q_row + 16 * RS + 8 * kk + 4 * (lane // 16))
                for p in range(NT // 2):
                    # B: lanes 8u … 8u+7 address keys 16p + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                    k_row = K_OFF + stage + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                    b0, b1, b2, b3 = ldmatrix(sm, k_row)
                    mma_into(s0, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(s0, 2 * p + 1, a0, a1, a2, a3, b2, b3)
                    mma_into(s1, 2 * p, c0, c1, c2, c3, b0, b1)
                    mma_into(s1, 2 * p + 1, c0, c1, c2, c3, b2, b3)

            # Lines 9-10: the online softmax of each row tile; the mask only where a key of the tile can be
            # invisible to some row of the block: past N_k, or (causal) past the first row's diagonal.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            online_softmax(s0, o0, m0, l0, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            online_softmax(s1, o1, m1, l1, row0 + 16, j * B_c, N_k, scale_log2, diag, mask_tile)

            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step; A comes straight from S's accumulators,
            # and each V fragment serves both row tiles.
            for kk in range(KV):
                a0 = pack(s0[8 * kk], s0[8 * kk + 1])
                a1 = pack(s0[8 * kk + 2], s0[8 * kk + 3])
                a2 = pack(s0[8 * kk + 4], s0[8 * kk + 5])
                a3 = pack(s0[8 * kk + 6], s0[8 * kk + 7])
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
                    mma_into(o1, 2 * p, c0, c1, c2, c3, b0, b1)
                    mma_into(o1, 2 * p + 1, c0, c1, c2, c3, b2, b3)
            cuda.syncthreads()                # stage j mod 2 is free for tile j + 2

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once, per row tile.
        finish_rows(o0, m0, l0, O, L, z, h, row0, N_q, scale_log2)
        finish_rows(o1, m1, l1, O, L, z, h, row0 + 16, N_q, scale_log2)

    return flash2_forward_tc_v7


def _head_dim(Q) -> int:
    shape = getattr(Q, "shape", None)
    return int(shape[-1]) if shape else 0


def flash2_forward(Q, K, V, causal=False, scale=None):
    """FA2 forward on tensor cores, rung v7 (two row tiles per warp). Q (…, N_q, d), K, V (…, N_k, d), float16 or
    bfloat16 (see :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted). Returns
    ``Flash2Forward(O, L)``: O in the input dtype, L float32 (+inf on rows that see no key). ``causal``:
    bottom-right aligned; ``scale``: τ, default 1/√d. Head dimensions above 128 run v6's kernel."""
    if _head_dim(Q) > MAX_D:
        return flash2_forward_v6.flash2_forward(Q, K, V, causal=causal, scale=scale)
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale)
