"""Hopper FA2 forward, h2: two consumer warpgroups share each K/V tile, and the copy engine (TMA) fills a ring of
stages that mbarriers guard (h1 + two changes).

h1's blocks are one warpgroup of 64 rows: every K_j and V_j tile copied into shared memory serves 64 queries, and
the 128 threads that compute also issue every 16-byte ``cp.async`` (a tile of 64 keys × d = 128 is 1024 of them).
h2 makes the block two warpgroups (B_r = 128, FA3's tile for d ≤ 128): each tile now serves twice the rows — half
the shared-memory traffic per FLOP. And the copies go to the Tensor Memory Accelerator: one thread issues one
``cp.async.bulk.tensor`` per 64-column panel of a tile (a box described by a tensor map,
:mod:`kernels_gpu.hopper.launch`), the copy engine walks the strides, zero-fills past N and d, writes the 128-byte
swizzle wgmma reads, and counts the bytes down on the stage's mbarrier ("full"); the warpgroups wait on its phase
instead of on their own copies. When both warpgroups have finished with a stage (a block barrier), thread 0 refills
it with the tile ``stages`` ahead. Not yet specialised: the thread that issues the copies also computes, and the
refill waits for the slower warpgroup.

Tile shape: B_c = 128 for d ≤ 128 (Q_i 32 KB and two stages of K_j, V_j of 32 KB each at d = 128), 64 above.

**Prediction (written before the first GPU run).** Against h1: the doubled reuse of each tile and the copy engine
free the issue slots h1 spent on cp.async address arithmetic, but one block per SM (160 KB of shared memory at
d = 128) and synchronous softmax leave the tensor cores idle during each warpgroup's exponentials. Expect +10-30 %
over h1 at d = 128 (360-450 TFLOP/s at N ≥ 4096, bf16, non-causal).

**Measured** (H200, 2026-12-02, ``hopper_forward_bf16.json`` / ``_fp16.json``, TFLOP/s at N = 4096 / 8192 / 16384,
bf16): d = 128 non-causal 399 / 438 / 474 (2.3-2.7× h1; SDPA flash 316-342, SDPA default = cuDNN 595-651, v11
301-323), causal 313 / 408 / 440; d = 256 403 / 471 / 502; d = 64 265 / 286 / 289. Within the prediction at
d = 128, above it against h1. Against the issue's targets: 0.61-0.80× cuDNN at d = 128 (target 0.85×), 1.26-1.39×
SDPA flash (target 1.5×), 0.59-0.69× cuDNN at d = 256 (target 0.75×): missed. What limits it: the softmax is not
overlapped with the MMAs (each warpgroup waits for its S before its exponentials, and for its O before the next
S), which ping-pong and intra-warpgroup pipelining address (FA3 §3.1-3.2); 212 registers at d = 128, no spills.
The first run (without cached tensor maps: a synchronous upload of three maps per call) measured 117 TFLOP/s at
N = 1024 where the cached maps give 246.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper import launch
from kernels_gpu.hopper.steps import HopperConfig, make_steps
from kernels_gpu.tensorcore.steps import LOG2E

__all__ = ["flash_forward", "make_kernel", "config_for"]


def config_for(d: int, dtype: str, causal: bool, simulated: bool, B_c: int | None = None,
               stages: int | None = None) -> HopperConfig:
    """h2's tile shape for head dimension ``d`` (``B_c``, ``stages`` override it)."""
    Bc = B_c or (128 if d <= 128 else 64)
    return HopperConfig(d=d, B_c=Bc, dtype=dtype, causal=causal, simulated=simulated, consumers=2,
                        stages=stages or 2)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: HopperConfig):
    """The h2 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    aligned_base, tma_q, tma_kv, wait_phase = st["aligned_base"], st["tma_q"], st["tma_kv"], st["wait_phase"]
    stamp = st["stamp"]
    s_equals_q_kt, o_plus_p_v = st["s_equals_q_kt"], st["o_plus_p_v"]
    zero, init_stats, online_softmax, finish_rows = st["zero"], st["init_stats"], st["online_softmax"], \
        st["finish_rows"]
    B_r, B_c, STAGES = cfg.B_r, cfg.B_c, cfg.stages
    Q_WORDS, KV_WORDS = cfg.tile_words(B_r), cfg.tile_words(B_c)
    STAGE = 2 * KV_WORDS                      # one stage: K_j, then V_j
    Q_BYTES, STAGE_BYTES = 4 * Q_WORDS, 4 * STAGE
    S_LEN, O_LEN = B_c // 2, cfg.D // 2
    causal = cfg.causal

    @cuda.jit
    def flash_forward_h2(Q, K, V, O, L, N_q, N_k, G, scale, q_map, k_map, v_map, T):
        tid = cuda.threadIdx.x
        wg = tid // 128                       # the consumer warpgroup: rows 64·wg … 64·wg + 63 of the block
        warp = (tid % 128) // 32
        g = cuda.laneid // 4
        if causal:                            # grid (heads, batch, row blocks): the longest row blocks first
            h = cuda.blockIdx.x
            z = cuda.blockIdx.y
            i = cuda.gridDim.z - 1 - cuda.blockIdx.z
        else:
            i = cuda.blockIdx.x               # row block i (FA2 Alg. 1 line 3)
            h = cuda.blockIdx.y
            z = cuda.blockIdx.z
        hk = h // G
        sm = cuda.shared.array(0, uint32)
        q_off = aligned_base(sm)              # words: Q_i, then the stages (K_j, V_j), then the mbarriers
        kv_off = q_off + Q_WORDS
        full = kv_off + STAGES * STAGE        # full[s] at full + 2s ("stage s holds its tile"), Q's after them
        q_bar = full + 2 * STAGES
        sm_byte = ptx.shared_byte_address(sm, 0)
        s = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        row0 = i * B_r + 64 * wg + 16 * warp + g
        diag = N_k - N_q
        scale_log2 = scale * float32(LOG2E)
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)

        if tid == 0:                          # one arrival (the expect-tx) and the bytes complete each phase
            for k in range(STAGES + 1):
                ptx.mbar_init(sm, full + 2 * k, 1)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        # Alg. 1 lines 4 and 7: Q_i and the first tiles, by the copy engine.
        if tid == 0:
            ptx.mbar_arrive_expect_tx(sm, q_bar, Q_BYTES)
            tma_q(sm, q_off, q_map, i * B_r, h, z, q_bar)
            for k in range(min(STAGES, n_tiles)):
                ptx.mbar_arrive_expect_tx(sm, full + 2 * k, STAGE_BYTES)
                tma_kv(sm, kv_off + k * STAGE, k_map, k * B_c, hk, z, full + 2 * k)
                tma_kv(sm, kv_off + k * STAGE + KV_WORDS, v_map, k * B_c, hk, z, full + 2 * k)
        # Alg. 1 line 5.
        zero(o, O_LEN)
        init_stats(m, l)
        wait_phase(sm, q_bar, 0)
        for j in range(n_tiles):               # Alg. 1 line 6
            stage = j % STAGES
            k_off = kv_off + stage * STAGE
            stamp(T, wg, j, 0)
            wait_phase(sm, full + 2 * stage, (j // STAGES) % 2)     # tile j has landed in its stage
            stamp(T, wg, j, 1)
            # Line 8: S_ij = Q_i K_jᵀ for this warpgroup's 64 rows.
            s_equals_q_kt(sm, s, sm_byte + 4 * q_off + 64 * 128 * wg, sm_byte + 4 * k_off)
            stamp(T, wg, j, 2)
            # Lines 9-10: the online softmax.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            stamp(T, wg, j, 3)
            # Line 10 (second half): Õ_i += P̃_ij V_j.
            o_plus_p_v(sm, o, s, sm_byte + 4 * (k_off + KV_WORDS))
            stamp(T, wg, j, 4)
            cuda.syncthreads()                # both warpgroups are done with the stage ...
            if tid == 0 and j + STAGES < n_tiles:     # ... which takes tile j + STAGES
                ptx.mbar_arrive_expect_tx(sm, full + 2 * stage, STAGE_BYTES)
                tma_kv(sm, k_off, k_map, (j + STAGES) * B_c, hk, z, full + 2 * stage)
                tma_kv(sm, k_off + KV_WORDS, v_map, (j + STAGES) * B_c, hk, z, full + 2 * stage)
        # Lines 12-15.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2)

    return flash_forward_h2


def flash_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on wgmma with TMA copies into a ring of stages, rung h2 (two consumer warpgroups). Arguments and
    results as :func:`kernels_gpu.hopper.flash_forward_h1.flash_forward`; ``options``: ``B_c``, ``stages``."""
    return launch.run(make_kernel, config_for, Q, K, V, causal=causal, scale=scale, maps=True, **options)
