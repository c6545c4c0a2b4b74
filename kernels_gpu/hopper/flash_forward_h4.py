"""Hopper FA2 forward, h4: ping-pong — the two consumer warpgroups take turns on the tensor cores, so that one's
softmax runs while the other's S = QKᵀ does (h3 + one change).

In h3 the consumers drift apart only by chance: both issue S = QKᵀ for the same tile at about the same time,
wait for it together, then both run the softmax on the CUDA cores while the tensor cores sit idle. FA3 (Shah et
al., 2024, §3.1, "pingpong scheduling") orders them with two named hardware barriers, one per consumer: a
consumer issues S = QKᵀ only once the other has finished issuing its own, and signals the other's barrier right
after. The softmax (exp2 of 64 × B_c scores a warpgroup, the SFU's slowest work) of one consumer then overlaps
the GEMM of the other, tile after tile:

    consumer 0:  S_0 | softmax_0 | PV_0 |  S_1 | softmax_1 | …
    consumer 1:       S_0 (turn) | softmax_0 | PV_0 | S_1 …

The protocol is three lines per consumer and tile, on barrier ids 1 and 2 (``bar.sync`` by the owner's 128 threads
and ``bar.arrive`` by the other's 128: 256 a phase): *wait for my turn* (``named_barrier_sync(1 + me, 256)``),
issue and finish S_ij, *pass the turn* (``named_barrier_arrive(1 + other, 256)``). Consumer 1 passes the first
turn to consumer 0 before its loop; the last turn is not passed (no phase is left open at exit). Everything else
is h3's: the producer warpgroup, setmaxnreg 24/240, full and empty mbarriers.

**Prediction (written before the first GPU run).** At d = 128 the softmax of a 64 × 128 tile takes roughly as long
as one of its two GEMMs; hiding it behind the other consumer's S = QKᵀ should lift h3 by 10-25 %, to 400-480
TFLOP/s bf16 non-causal at N ≥ 4096 — above h2 if the cause of h3's gap to h2 is not what limits both.

**Measured** (H200, 2026-12-02, ``hopper_forward_h4_bf16.json``: h2, h3, h4 in one run): no gain over h3 —
d = 128 non-causal 281 / 382 TFLOP/s at N = 4096 / 16384 (h3 283 / 385, h2 365 / 455); d = 64 226 / 238 (h3
198 / 244). The protocol works as written (the stamps of ``hopper_timeline.json`` show consumer 1 starting S_ij
only after consumer 0 finished it, tile after tile), but it cannot pay here: a consumer's own chain S → softmax →
PV is the critical path, and the softmax (2600-2800 cycles a tile, inherited from h3) is three times the S = QKᵀ
it was meant to hide behind. Ordering the two consumers moves their softmaxes apart; it does not shorten either.
What would: a softmax as fast as h2's (h3's header: the register budget), then the next tile's S = QKᵀ issued
before this tile's softmax (intra-warpgroup overlap), so that each consumer's own GEMM runs under its softmax.
Why h3's softmax is slow was then read from the SASS (h3's header, h5's): the column masks of every tile, not the
register budget. h5 and h6 are those two changes.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper import launch
from kernels_gpu.hopper.steps import HopperConfig, make_steps
from kernels_gpu.tensorcore.steps import LOG2E

__all__ = ["flash_forward", "make_kernel", "config_for"]

#: registers per thread after setmaxnreg: producer, consumers
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240


def config_for(d: int, dtype: str, causal: bool, simulated: bool, B_c: int | None = None,
               stages: int | None = None) -> HopperConfig:
    """h4's tile shape for head dimension ``d`` (``B_c``, ``stages`` override it)."""
    Bc = B_c or (128 if d <= 128 else 64)
    return HopperConfig(d=d, B_c=Bc, dtype=dtype, causal=causal, simulated=simulated, consumers=2,
                        producer=True, stages=stages or 2)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: HopperConfig):
    """The h4 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    jit = cuda.jit(device=True) if cfg.simulated else cuda.jit(device=True, forceinline=True)
    aligned_base, tma_q, tma_kv, wait_phase = st["aligned_base"], st["tma_q"], st["tma_kv"], st["wait_phase"]
    stamp = st["stamp"]
    s_equals_q_kt, o_plus_p_v = st["s_equals_q_kt"], st["o_plus_p_v"]
    zero, init_stats, online_softmax, finish_rows = st["zero"], st["init_stats"], st["online_softmax"], \
        st["finish_rows"]
    B_r, B_c, STAGES = cfg.B_r, cfg.B_c, cfg.stages
    Q_WORDS, KV_WORDS = cfg.tile_words(B_r), cfg.tile_words(B_c)
    STAGE = 2 * KV_WORDS
    Q_BYTES, STAGE_BYTES = 4 * Q_WORDS, 4 * STAGE
    S_LEN, O_LEN = B_c // 2, cfg.D // 2
    CONSUMER_THREADS = 128 * cfg.consumers
    causal = cfg.causal
    give_registers = ptx.make_setmaxnreg(False, PRODUCER_REGISTERS)
    take_registers = ptx.make_setmaxnreg(True, CONSUMER_REGISTERS)

    @jit
    def producer(sm, q_off, kv_off, full, empty, q_bar, q_map, k_map, v_map, i, h, hk, z, n_tiles, T):
        """Warpgroup 0: one elected thread copies Q_i, then each K_j, V_j into stage j mod STAGES once the
        consumers have emptied it (FA2 Alg. 1 lines 4 and 7, by the copy engine)."""
        if cuda.threadIdx.x // 32 == 0 and ptx.elect_one() == 1:
            ptx.mbar_arrive_expect_tx(sm, q_bar, Q_BYTES)
            tma_q(sm, q_off, q_map, i * B_r, h, z, q_bar)
            for j in range(n_tiles):
                stage = j % STAGES
                stamp(T, 0, j, 0)
                if j >= STAGES:               # wait until both consumers released tile j − STAGES
                    wait_phase(sm, empty + 2 * stage, (j // STAGES - 1) % 2)
                stamp(T, 0, j, 1)
                k_off = kv_off + stage * STAGE
                ptx.mbar_arrive_expect_tx(sm, full + 2 * stage, STAGE_BYTES)
                tma_kv(sm, k_off, k_map, j * B_c, hk, z, full + 2 * stage)
                tma_kv(sm, k_off + KV_WORDS, v_map, j * B_c, hk, z, full + 2 * stage)
                stamp(T, 0, j, 2)

    @jit
    def consumer(sm, q_off, kv_off, full, empty, q_bar, O, L, i, h, z, n_tiles, N_q, N_k, scale_log2, wg, T):
        """Warpgroups 1 … consumers: 64 query rows each, FA2 Alg. 1 lines 5-15 over the stages the producer
        fills."""
        sm_byte = ptx.shared_byte_address(sm, 0)
        s = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        warp = (cuda.threadIdx.x % 128) // 32
        row0 = i * B_r + 64 * wg + 16 * warp + cuda.laneid // 4
        diag = N_k - N_q
        # Alg. 1 line 5.
        zero(o, O_LEN)
        init_stats(m, l)
        if wg == 1 and n_tiles > 0:                         # consumer 0 takes the first turn
            ptx.named_barrier_arrive(1, 256)
        wait_phase(sm, q_bar, 0)
        for j in range(n_tiles):               # Alg. 1 line 6
            stage = j % STAGES
            k_off = kv_off + stage * STAGE
            stamp(T, wg + 1, j, 0)
            wait_phase(sm, full + 2 * stage, (j // STAGES) % 2)
            ptx.named_barrier_sync(1 + wg, 256)            # my turn on the tensor cores
            stamp(T, wg + 1, j, 1)
            # Line 8: S_ij = Q_i K_jᵀ.
            s_equals_q_kt(sm, s, sm_byte + 4 * q_off + 64 * 128 * wg, sm_byte + 4 * k_off)
            if wg == 0 or j + 1 < n_tiles:                  # the other's turn (the last turn is not passed)
                ptx.named_barrier_arrive(2 - wg, 256)
            stamp(T, wg + 1, j, 2)
            # Lines 9-10: the online softmax.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            stamp(T, wg + 1, j, 3)
            # Line 10 (second half): Õ_i += P̃_ij V_j; then the stage is released to the producer.
            o_plus_p_v(sm, o, s, sm_byte + 4 * (k_off + KV_WORDS))
            stamp(T, wg + 1, j, 4)
            ptx.mbar_arrive(sm, empty + 2 * stage)
        # Lines 12-15.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2)

    jit_kernel = cuda.jit if cfg.simulated else cuda.jit(launch_bounds=(cfg.threads, 1))

    @jit_kernel
    def flash_forward_h4(Q, K, V, O, L, N_q, N_k, G, scale, q_map, k_map, v_map, T):
        tid = cuda.threadIdx.x
        if causal:
            h = cuda.blockIdx.x
            z = cuda.blockIdx.y
            i = cuda.gridDim.z - 1 - cuda.blockIdx.z
        else:
            i = cuda.blockIdx.x
            h = cuda.blockIdx.y
            z = cuda.blockIdx.z
        hk = h // G
        sm = cuda.shared.array(0, uint32)
        q_off = aligned_base(sm)              # words: Q_i, the stages, full[·], empty[·], Q's barrier
        kv_off = q_off + Q_WORDS
        full = kv_off + STAGES * STAGE
        empty = full + 2 * STAGES
        q_bar = empty + 2 * STAGES
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + N_k - N_q)
            n_tiles = max(0, (last + B_c - 1) // B_c)
        if tid == 0:
            for k in range(STAGES):
                ptx.mbar_init(sm, full + 2 * k, 1)                  # the producer's expect-tx, then the bytes
                ptx.mbar_init(sm, empty + 2 * k, CONSUMER_THREADS)   # every consumer thread, done with it
            ptx.mbar_init(sm, q_bar, 1)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        wg = tid // 128
        if wg == 0:
            give_registers()
            producer(sm, q_off, kv_off, full, empty, q_bar, q_map, k_map, v_map, i, h, hk, z, n_tiles, T)
        else:
            take_registers()
            consumer(sm, q_off, kv_off, full, empty, q_bar, O, L, i, h, z, n_tiles, N_q, N_k,
                     scale * float32(LOG2E), wg - 1, T)

    return flash_forward_h4


def flash_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on wgmma and TMA, warp-specialised, with ping-pong consumers, rung h4. Arguments and results as
    :func:`kernels_gpu.hopper.flash_forward_h1.flash_forward`; ``options``: ``B_c``, ``stages``."""
    return launch.run(make_kernel, config_for, Q, K, V, causal=causal, scale=scale, maps=True, **options)
