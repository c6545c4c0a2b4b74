"""Hopper FA2 forward, h1: one warpgroup, both products on ``wgmma`` from shared memory, tiles copied by ``cp.async``.

The first rung of the FlashAttention-3 ladder changes one thing against the mma.sync ladder
(:mod:`kernels_gpu.tensorcore`): the matrix instruction. A thread block is one warpgroup (128 threads, B_r = 64
query rows); S_ij = Q_i K_jᵀ is one ``wgmma m64n{B_c}k16`` per 16 columns of d with Q_i and K_j read by the tensor
cores straight from shared memory (no ``ldmatrix``, no operand registers), and Õ_i += P̃_ij V_j one ``wgmma
m64n{d}k16`` per 16 keys, with P̃ from the registers that held S (as in v3 of the mma.sync ladder) and V_j
transposed by the tensor core on the way in. Everything else is v11's: two stages of K/V copied by ``cp.async``
(issued by the same threads that compute), the base-2 online softmax in float32, the longest causal row blocks
first. The tiles are stored in the 128-byte swizzled panels that wgmma's descriptors (and, from h2 on, the TMA)
use — :mod:`kernels_gpu.hopper.steps`.

Tile shape: B_c = 128 keys for d ≤ 64, 64 for d ≤ 128, 32 above (two blocks of at most ~100 KB of shared memory
per SM: Q_i plus two stages of K_j, V_j).

**Prediction (written before the first GPU run).** One warpgroup per block and everything synchronous: each
warpgroup waits for its wgmma, then does its softmax while its tensor cores idle, and the cp.async issue costs
the same threads. With two blocks per SM, one's softmax can overlap the other's MMAs. Expect about v11's speed
or a little more — 300-380 TFLOP/s at d = 128, N ≥ 4096, non-causal, bf16 (v11: 290-317 on an H200): wgmma
removes the ldmatrix and register pressure of mma.sync, but nothing yet overlaps the softmax with the MMAs.

**Measured** (H200, 2026-12-02, ``python -m benchmarks.hopper``, ``benchmarks/results/nvidia-h200/
hopper_forward_bf16.json``; bf16, non-causal, N = 1024 … 16384): 152-175 TFLOP/s at d = 128 (v11 in the same run:
264-323), 158-175 at d = 64, 153-182 at d = 256 — flat in N, about half the prediction. 165 registers, no local
memory, 12 HGMMA in the SASS (``benchmarks.profilers.hopper_resources``). Why it misses, not yet measured with
Nsight Compute: every wgmma is waited for at once (``wgmma.wait_group 0``), so a warpgroup's tensor cores idle during
its whole softmax and its cp.async issue, and one 64-row warpgroup per tile halves each tile's reuse against v11's
128 rows.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper import launch
from kernels_gpu.hopper.steps import HopperConfig, make_steps
from kernels_gpu.tensorcore.steps import LOG2E

__all__ = ["flash_forward", "make_kernel", "config_for"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool, B_c: int | None = None) -> HopperConfig:
    """h1's tile shape for head dimension ``d`` (``B_c`` overrides it)."""
    Bc = B_c or (128 if d <= 64 else 64 if d <= 128 else 32)
    return HopperConfig(d=d, B_c=Bc, dtype=dtype, causal=causal, simulated=simulated, consumers=1, stages=2)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: HopperConfig):
    """The h1 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    aligned_base, copy_q, copy_kv = st["aligned_base"], st["copy_q"], st["copy_kv"]
    s_equals_q_kt, o_plus_p_v = st["s_equals_q_kt"], st["o_plus_p_v"]
    zero, init_stats, online_softmax, finish_rows = st["zero"], st["init_stats"], st["online_softmax"], \
        st["finish_rows"]
    B_r, B_c = cfg.B_r, cfg.B_c
    Q_WORDS, KV_WORDS = cfg.tile_words(B_r), cfg.tile_words(B_c)
    STAGE = 2 * KV_WORDS                      # one stage: K_j, then V_j
    S_LEN, O_LEN = B_c // 2, cfg.D // 2
    causal = cfg.causal

    @cuda.jit
    def flash_forward_h1(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        g = cuda.laneid // 4
        if causal:                            # grid (heads, batch, row blocks): the longest row blocks first
            h = cuda.blockIdx.x
            z = cuda.blockIdx.y
            i = cuda.gridDim.z - 1 - cuda.blockIdx.z
        else:                                 # grid (row blocks, heads, batch)
            i = cuda.blockIdx.x               # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
            h = cuda.blockIdx.y
            z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)
        q_off = aligned_base(sm)              # word offsets: Q_i, then stage 0 (K, V), then stage 1 (K, V)
        kv_off = q_off + Q_WORDS
        sm_byte = ptx.shared_byte_address(sm, 0)
        s = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        row0 = i * B_r + 16 * warp + g        # this thread's first row (its second is row0 + 8)
        diag = N_k - N_q
        scale_log2 = scale * float32(LOG2E)

        # Causal: the tiles right of the block's last row's diagonal are never visited (all masked).
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)
        # Alg. 1 lines 4 and 7 (j = 1): start the copies of Q_i, K_1, V_1, as one group.
        copy_q(sm, q_off, Q, z, h, i * B_r, N_q, tid)
        if n_tiles > 0:
            copy_kv(sm, kv_off, K, z, hk, 0, N_k, tid)
            copy_kv(sm, kv_off + KV_WORDS, V, z, hk, 0, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers).
        zero(o, O_LEN)
        init_stats(m, l)
        # Alg. 1 line 6: for j = 1 … T_c.
        for j in range(n_tiles):
            stage = kv_off + (j % 2) * STAGE
            # Line 7 for tile j + 1, started now, lands while tile j is computed.
            if j + 1 < n_tiles:
                other = kv_off + ((j + 1) % 2) * STAGE
                copy_kv(sm, other, K, z, hk, (j + 1) * B_c, N_k, tid)
                copy_kv(sm, other + KV_WORDS, V, z, hk, (j + 1) * B_c, N_k, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_one()           # this thread's copies of tile j (and Q_i) have landed ...
            ptx.fence_proxy_async()           # ... visible to the tensor cores' (async-proxy) reads ...
            cuda.syncthreads()                # ... and everyone's

            # Line 8: S_ij = Q_i K_jᵀ (wgmma, both operands in shared memory).
            s_equals_q_kt(sm, s, sm_byte + 4 * q_off, sm_byte + 4 * stage)
            # Lines 9-10: the online softmax; the mask only on tiles that can hold an invisible key.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            # Line 10 (second half): Õ_i += P̃_ij V_j (wgmma, P̃ from registers, V_j from shared memory).
            o_plus_p_v(sm, o, s, sm_byte + 4 * (stage + KV_WORDS))
            cuda.syncthreads()                # stage j mod 2 is free for tile j + 2

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2)

    return flash_forward_h1


def flash_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on Hopper's warpgroup MMA, rung h1. Q (…, N_q, d), K, V (…, N_k, d), float16 or bfloat16 (the
    kinds of arrays of :mod:`kernels_gpu.tensorcore.launch`). Returns ``Flash2Forward(O, L)``: O in the input
    dtype, L float32 (+inf on rows that see no key). ``options``: ``B_c``."""
    return launch.run(make_kernel, config_for, Q, K, V, causal=causal, scale=scale, **options)
