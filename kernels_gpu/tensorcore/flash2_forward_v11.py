"""Tensor-core FA2 forward, v11: under causal masking, the longest row blocks first (v10 + one change).

Causal row blocks are unequal: row block i visits about i + 1 K/V tiles (FA2 Section 3.1.1 skips the rest), so
the last row block of a head does T_r times the work of the first. The GPU hands out blocks in the order of
their linear index, x fastest: with v10's grid (row blocks, heads, batch) each head's blocks come light to heavy,
and the very last blocks launched — the last head's last row blocks — are the heaviest of all: while they run, the
other SMs have nothing left to take. FA2's paper (Section 3.2, "work partitioning" for long sequences) and its
code order the work so that long rows start first. v11 launches the grid (heads, batch, row blocks) and reads row
block i = T_r − 1 − blockIdx.z: every head's longest row block first, the one-tile blocks last, where they fill the
gaps — longest-processing-time-first scheduling. Non-causal launches keep v10's order (every block is equally
long, and consecutive blocks of one head share its K and V in L2).

**Prediction (before the first GPU run).** Causal: +5-15 % at N ≥ 4096 (the tail of the heavy-last order is about
one block's time, ~T_r tiles, out of roughly waves × T_r / 2); the causal/non-causal wall-time ratio at N = 8192
rises from v9's 1.41 (d = 128) towards 1.6. Non-causal: unchanged.

**Measured** (H100, 2026-11-24, first with numba's ordinary launch, ``tensorcore_v11_numba_call.json``; causal
fp16, TFLOP/s at N = 1024 / 2048 / 4096 / 8192 / 16384): d = 64: 78.0 / 118.6 / 128.0 / 186.2 / 206.8; d = 128:
57.7 / 102.6 / 152.4 / 197.9 / 248.6 (v9, causal, the previous run: 59.8 / 96.8 / 137.8 / 177.0 / 193.4 and 55.4 /
95.5 / 133.0 / 183.4 / 216.0): +5-15 % from N = 4096 as predicted, within run-to-run noise below. Causal against
non-causal wall time at N = 8192, same run: 1.65× (d = 64), 1.46× (d = 128) in fp16; 1.86× and 1.82× in bf16.
Non-causal is v10's kernel (same numbers within noise). What limits it now: SDPA flash runs 264-341 TFLOP/s in the
same run; v11 reaches 0.45-0.5× at N = 1024, 0.58-0.68× at 2048-4096 and 0.8-0.87× at 16384, one call between two
CUDA events as the harness times it. ``benchmarks.profilers.launch_overhead`` (``tensorcore_launch_overhead.json``)
separates the host from the GPU: a v11 call spent 400 µs (d = 64) to 900 µs (d = 128) on the host — argument checks,
five zero-copy array views and numba's launch, which types every argument — against SDPA's 110-170 µs, and a single
call's GPU waits for it. Twenty calls queued between two events (the GPU never waits) gave v11 218 / 235 TFLOP/s at
d = 64 (N = 1024 / 4096) and 168 / 309 at d = 128: 0.75-0.9× SDPA flash queued the same way (291 / 303, 332 / 343)
— the kernel was above the targets' 0.5× everywhere; the Python launch path was what missed them at short N.

Then, same day, with the planned driver-level launch (``kernels_gpu.driver_launch``: compiled once per argument
types, parameters packed by hand, a plan per shape for PyTorch CUDA tensors): the host cost is gone — 64-96 µs per
call against SDPA's own 80-167 µs (``tensorcore_launch_overhead.json``). One run of every rung
(``tensorcore_ladder.json``, fp16 non-causal, N = 1024 / 2048 / 4096 / 8192 / 16384): d = 64: 207.8 / 230.7 / 240.7
/ 245.3 / 255.7 TFLOP/s (0.80-0.94× SDPA flash); d = 128: 237.3 / 287.2 / 291.2 / 308.4 / 296.4 (0.86-0.96×). v11's
full grid (``tensorcore_v11.json``, fp16 and bf16, causal and not) meets every forward target: ≥ 218 TFLOP/s at N ≥
4096, ≥ 0.81× SDPA flash at every N from 1024, causal 1.74-1.98× faster than non-causal at N = 8192. What limits it
now: d = 64 at ~0.82× SDPA flash, the register spill at d = 128, and mma.sync itself (near 630 TFLOP/s on this GPU;
Hopper's full rate needs ``wgmma``, sm_90's warpgroup MMA).
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
    """v10's tile shape for head dimension ``d`` (see v10's table); ``B_c``, ``row_tiles`` override it."""
    R, Bc = (2, 32) if d <= 64 else (2, 64) if d <= 128 else (1, 32)
    return Config(d=d, warps=4, row_tiles=row_tiles or R, B_c=B_c or Bc, dtype=dtype, causal=causal,
                  simulated=simulated)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, and two stages of K_j, V_j (RS words per row)."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The v11 kernel for one configuration (compiled on first launch)."""
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
    def flash2_forward_tc_v11(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        if causal:                            # grid (heads, batch, row blocks): the longest row blocks first
            h = cuda.blockIdx.x
            z = cuda.blockIdx.y
            i = cuda.gridDim.z - 1 - cuda.blockIdx.z
        else:                                 # grid (row blocks, heads, batch), as up to v10
            i = cuda.blockIdx.x               # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
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

    return flash2_forward_tc_v11


def longest_first(cfg: Config, p) -> tuple:
    """v11's launch grid: causal → (heads, batch, row blocks), the kernel reading row block T_r − 1 − blockIdx.z;
    otherwise v10's (row blocks, heads, batch)."""
    T_r = -(-p.N_q // cfg.B_r)
    return (p.H_q, p.Z, T_r) if cfg.causal else (T_r, p.H_q, p.Z)


def flash2_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on tensor cores, rung v11 (causal: longest row blocks first). Q (…, N_q, d), K, V (…, N_k, d),
    float16 or bfloat16 (see :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted). Returns
    ``Flash2Forward(O, L)``: O in the input dtype, L float32 (+inf on rows that see no key). ``causal``:
    bottom-right aligned; ``scale``: τ, default 1/√d; ``options`` (``B_c``, ``row_tiles``) go to
    :func:`config_for`."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale,
                      grid_for=longest_first, **options)
