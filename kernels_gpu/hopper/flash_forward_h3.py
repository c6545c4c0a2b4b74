"""Hopper FA2 forward, h3: warp specialisation — a producer warpgroup that only copies, two consumer warpgroups that
only compute, registers moved to them with ``setmaxnreg`` (h2 + one change).

In h2 the thread that refills a stage is one of the consumers, and it may refill only after a block barrier: the
faster warpgroup waits for the slower one at every tile, and the copy of tile j + 2 starts only once both have
finished tile j. FA3 (Shah et al., 2024, §3.1) splits the block's warps by role instead:

* the **producer** (warpgroup 0) gives most of its registers back (``setmaxnreg.dec`` to 24 per thread) and one
  elected thread of its first warp issues, for each tile, the TMA copies of K_j and V_j into the next stage as soon
  as that stage's **empty** mbarrier says both consumers have released it;
* the **consumers** (warpgroups 1 and 2, 64 query rows each) take the registers (``setmaxnreg.inc`` to 240), wait on
  the stage's **full** mbarrier, compute S, the softmax and O += PV, and arrive on **empty** — no block barrier
  anywhere in the loop, so each consumer runs at its own pace, up to ``stages`` tiles apart.

The producer's and the consumers' programs are the two named device functions below, the kernel dispatching on
the warpgroup index (STYLE.md's "Hopper kernels"). 384 threads, compiled with ``launch_bounds=(384, 1)`` (ptxas
honours ``setmaxnreg`` only then); 24 · 128 + 240 · 256 = 64 512 of the SM's 65 536 registers.

**Prediction (written before the first GPU run).** The copies run fully under the compute, and the two consumers
drift apart, so one's softmax overlaps the other's wgmma now and then (not yet by design: that is ping-pong's
rung). Expect +5-15 % over h2 at d = 128, N ≥ 4096 (400-500 TFLOP/s, bf16, non-causal).

**Measured** (H200, 2026-12-02, ``hopper_forward_bf16.json``, non-causal): slower than h2, not faster — d = 128:
352 / 371 / 402 TFLOP/s at N = 4096 / 8192 / 16384 (h2: 399 / 438 / 474); d = 64: 233 / 247 / 255 (h2: 265 / 286 /
289); equal at d = 256 (401 / 474 / 496). The prediction missed. Candidates from that run: ptxas allocated the
consumers under the 168-register entry cap of ``launch_bounds=(384, 1)`` (the resource report: 168 registers,
against h2's 212 at d = 128), so the 240 that setmaxnreg grants may go unused; and every one of the 256 consumer
threads arrives on a stage's empty barrier where one arrival per warpgroup would do.

**Why, measured** (H200, 2026-12-02, bf16, d = 128, N = 4096, one launch each). The rungs' clock stamps
(``benchmarks.hopper_timeline``, ``hopper_timeline.json``, block 0, median over tiles, SM cycles): a consumer's
tile takes wait 260-460 · S 880-930 · softmax 2580-2800 · PV 770-790, a period of 5050 cycles, against h2's
230 · 820-1050 · 1700 · 740-910, a period of 4335. The copies are not late (the consumers wait little; the
producer waits 4400 cycles a tile for a free stage): the loss is the softmax, 1.6× slower than h2's on the same
source. Nsight Compute (``hopper_ncu.log``) says of what kind: h3 issues about 1.4× h2's instructions (IPC 1.90
against 1.62, over a 1.37 ms launch against 1.16 ms), and its busiest pipeline is the integer ALU (42 %), where
h2's is the tensor cores' (49 %): the softmax compiled for 168 registers recomputes what h2's keeps. The next
change is the consumers' register budget (or a cheaper softmax), not the copies.

**The SASS, read later** (``python -m benchmarks.profilers.hopper_sass h2 h3``, without a GPU; committed in
``benchmarks/results/sm90a_offline/``): not the register budget — after ``setmaxnreg`` the consumers' code uses
registers up to R210, past the 168 the launch reports. The extra instructions are the softmax's column tests:
h3's build computes the 64 column indices of every tile in 64-bit arithmetic, compares them and packs the results
into predicates before it looks at ``mask_tile``, about 250 integer instructions ahead of each S = QKᵀ and more
after it, where h2's build keeps them inside the branch. h5 is the change that follows.
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
    """h3's tile shape for head dimension ``d`` (``B_c``, ``stages`` override it)."""
    Bc = B_c or (128 if d <= 128 else 64)
    return HopperConfig(d=d, B_c=Bc, dtype=dtype, causal=causal, simulated=simulated, consumers=2,
                        producer=True, stages=stages or 2)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: HopperConfig):
    """The h3 kernel for one configuration (compiled on first launch)."""
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
    def producer(sm, q_off, kv_off, full, empty, q_bar, q_map, k_map, v_map,
                 i, h, hk, z, n_tiles, T):
        """Warpgroup 0: one elected thread copies Q_i, then each K_j, V_j
        into stage j mod STAGES once the consumers have emptied it (FA2 Alg. 1
        lines 4 and 7, by the copy engine)."""
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
    def consumer(sm, q_off, kv_off, full, empty, q_bar, O, L, i, h, z, n_tiles,
                 N_q, N_k, scale_log2, wg, T):
        """Warpgroups 1 … consumers: 64 query rows each, FA2 Alg. 1 lines 5-15
        over the stages the producer fills."""
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
        wait_phase(sm, q_bar, 0)
        for j in range(n_tiles):               # Alg. 1 line 6
            stage = j % STAGES
            k_off = kv_off + stage * STAGE
            stamp(T, wg + 1, j, 0)
            wait_phase(sm, full + 2 * stage, (j // STAGES) % 2)
            stamp(T, wg + 1, j, 1)
            # Line 8: S_ij = Q_i K_jᵀ.
            s_equals_q_kt(sm, s, sm_byte + 4 * q_off + 64 * 128 * wg, sm_byte + 4 * k_off)
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
    def flash_forward_h3(Q, K, V, O, L, N_q, N_k, G, scale, q_map, k_map, v_map, T):
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

    return flash_forward_h3


def flash_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on wgmma and TMA, warp-specialised, rung h3. Arguments and results as
    :func:`kernels_gpu.hopper.flash_forward_h1.flash_forward`; ``options``: ``B_c``, ``stages``."""
    return launch.run(make_kernel, config_for, Q, K, V, causal=causal, scale=scale, maps=True, **options)
