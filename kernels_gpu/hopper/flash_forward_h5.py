"""Hopper FA2 forward, h5: h4's ping-pong with a softmax specialised per tile — the column mask compiled only
into the tiles that need it (h4 + one change).

h3 and h4 run the softmax of h2, the same source, and yet spend 1.6× h2's time in it (2600-2800 cycles a tile
against 1700: ``hopper_timeline.json``), with the integer ALU their busiest pipe (``hopper_ncu.log``). Their
SASS says why (``python -m benchmarks.profilers.hopper_sass h4 h5``, which compiles a rung for sm_90a on any
machine). The softmax takes ``mask_tile`` as a run-time flag, and for each of the thread's 64 scores tests
``col >= N_k or col > row + diag`` under it. In h3 and h4 the compiler turned those branches into selects: it
computes all 64 column indices (64-bit: numba's loop counters are int64, so two instructions each), compares
them, packs the 64 results into a predicate register (``P2R``, ``LOP3``), and only then looks at the flag, on
every tile. At d = 128 the main loop's segment between S = QKᵀ and the row maximum holds 306 instructions (82
``ISETP``, 77 ``LOP3``) that an unmasked tile does not need, about 350 a tile per thread in all. h2's build of the
same source kept the tests inside the branch, which is why h2's softmax is the faster one.

The change: the consumer calls the softmax twice in source, under ``if mask_tile:``, once with the flag the
constant True and once with False, so that each call is compiled for its own case. The unmasked call has no
column arithmetic at all; the masked one (the last, ragged tile, and the causal diagonal: one or two tiles of a
row block) keeps the tests. Every other line is h4's: the producer warpgroup, setmaxnreg 24/240, full and empty
mbarriers, the two named barriers of ping-pong.

**Prediction (written before the first GPU run; nothing here is measured).** SASS, d = 128, bf16: the segment
after S = QKᵀ of an unmasked tile falls from 4 + 306 + 70 + 99 + 246 + 99 + 50 = 874 instructions to
12 + 27 + 73 + 99 + 140 + 100 + 69 = 520; registers and spills unchanged (168 at entry, no local memory). The
softmax should then take about h2's 1700 cycles a tile. With the softmax shorter than the two GEMMs of a
tile (S about 900 cycles, PV about 780), ping-pong can do what h4 could not: while one consumer runs its
softmax the other's GEMMs keep the tensor cores busy, and the tile period should fall from h4's 5050 cycles to
3400-3700 (each consumer's own chain, S + softmax + PV, about 3400). Expect 1.35-1.5× h4: bf16, non-causal,
d = 128, 380-420 TFLOP/s at N = 4096 and 500-560 at N = 16384, above h2 (365 / 455 in h4's run) — the first rung
to pass h2, if the prediction holds. If it misses, read the stamps first: ``benchmarks.hopper_timeline`` with h5
names the step that did not shrink.

**Measured** (H200, 2026-12-02; ``benchmarks/results/nvidia-h200/hopper_forward_h5_{bf16,fp16}.json`` and
``hopper_forward_h5_causal_bf16.json``, calls queued back to back; TFLOP/s at N = 4096 / 8192 / 16384, bf16):
d = 128 non-causal 502 / 534 / 486 (h2 in the same run 476 / 491 / 494; cuDNN 669 / 679 / 636), causal
438 / 504 / 538 (cuDNN 578 / 615 / 626); d = 64 333 / 340 / 339 (h2 292 / 304 / 311); d = 256 578 / 607 / 568
(h2 539 / 532 / 536). The fastest rung, and what ``hopper.flash_forward`` runs: 0.75-0.79× cuDNN at d = 128
non-causal, 0.76-0.86× causal, 0.78-0.92× at d = 256. Against the prediction: at N = 4096 above it (502 against
380-420), at N = 16384 just under it (486 against 500-560), because h4's run, which the prediction scaled from,
measured h2 lower than this one did (365 / 455). The stamps (``hopper_timeline_h5.json``: N = 16384, d = 128,
block 0, medians over tiles, SM cycles at 1.98 GHz) say which part held: the softmax fell to 1700-1810 cycles a
tile, h2's, as predicted; the tile period fell to 3976, not 3400-3700. A consumer's tile is still one chain —
waiting for its stage and its turn 330-510, S = QKᵀ 740-880, softmax 1700-1810, PV 750-770, release 220-280 —
and the period is that chain, while the two consumers' GEMMs need about 2530 cycles of tensor pipe a tile (8.4
MFLOP at the 866 TFLOP/s ceiling the same run measured, shared by 132 SMs): 64 % busy. To go faster, a
consumer's chain must get shorter than the tensor pipe's 2530: a shorter softmax, or one that its own GEMMs
run under (h6).
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
    """h5's tile shape for head dimension ``d`` (``B_c``, ``stages`` override it)."""
    Bc = B_c or (128 if d <= 128 else 64)
    return HopperConfig(d=d, B_c=Bc, dtype=dtype, causal=causal, simulated=simulated, consumers=2,
                        producer=True, stages=stages or 2)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: HopperConfig):
    """The h5 kernel for one configuration (compiled on first launch)."""
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
            # Lines 9-10: the online softmax, compiled once for the tiles that need the column mask (the ragged
            # last tile; with causal, those that cross the diagonal) and once for the rest, which test nothing.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            if mask_tile:
                online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, True)
            else:
                online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, False)
            stamp(T, wg + 1, j, 3)
            # Line 10 (second half): Õ_i += P̃_ij V_j; then the stage is released to the producer.
            o_plus_p_v(sm, o, s, sm_byte + 4 * (k_off + KV_WORDS))
            stamp(T, wg + 1, j, 4)
            ptx.mbar_arrive(sm, empty + 2 * stage)
        # Lines 12-15.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2)

    jit_kernel = cuda.jit if cfg.simulated else cuda.jit(launch_bounds=(cfg.threads, 1))

    @jit_kernel
    def flash_forward_h5(Q, K, V, O, L, N_q, N_k, G, scale, q_map, k_map, v_map, T):
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

    return flash_forward_h5


def flash_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on wgmma and TMA, warp-specialised, ping-pong consumers, the softmax specialised per tile, rung
    h5. Arguments and results as :func:`kernels_gpu.hopper.flash_forward_h1.flash_forward`; ``options``: ``B_c``,
    ``stages``."""
    return launch.run(make_kernel, config_for, Q, K, V, causal=causal, scale=scale, maps=True, **options)
