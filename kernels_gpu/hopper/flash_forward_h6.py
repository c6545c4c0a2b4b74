"""Hopper FA2 forward, h6: intra-warpgroup overlap — each consumer issues the next tile's S = QKᵀ and this tile's
Õ += P̃V before it runs the softmax, so that its own GEMMs run under its own softmax (h5 + one change).

In h5 a consumer's tile is a chain: S_ij = Q_i K_jᵀ, wait; softmax; Õ_i += P̃_ij V_j, wait. Its tensor cores are
idle during its softmax, and ping-pong fills that gap only with the other consumer's GEMMs. FA3 (Shah et al.,
2024, §3.2, "intra-warpgroup overlapping") breaks the chain inside one warpgroup, because a wgmma is asynchronous:
issued, it runs while the issuing threads go on until they wait for it. At tile j (j ≥ 1) a consumer

1. issues S_ij (into the registers ``s``) and then Õ_i += P̃_i,j−1 V_j−1 (P̃ of the previous tile, kept packed to
   16 bits in ``p``), two commit groups in that order;
2. waits until one group at most is in flight (``wgmma.wait_group 1``): S_ij is done, the PV product may not be;
3. runs the softmax of tile j on ``s`` — m_i, ℓ_i and P̃_ij, but not yet the rescale of Õ_i, which the PV product
   is still adding into: the softmax returns α = exp(m_old − m_new) per row instead of applying it;
4. waits for the PV product (``wgmma.wait_group 0``), rescales Õ_i by α, releases stage j − 1 to the producer and
   packs P̃_ij into ``p`` for the next tile.

The PV product of tile j − 1 runs under the softmax of tile j. Tile 0 has only its S (and its softmax); after the
last tile, its PV product runs alone. Registers: ``s`` (B_c/2 floats), ``p`` (B_c/4 words), ``o`` (D/2 floats):
160 a thread at d = B_c = 128, against h5's 128. A stage is released one tile later than in h5, so the ring keeps
three stages where shared memory has room (d ≤ 128: 225 KB of the 227 KB a block may have) and two at d = 256.
Everything else is h5's: producer warpgroup, setmaxnreg 24/240, full and empty mbarriers, the ping-pong turns
around S = QKᵀ, the softmax compiled per tile kind.

**Prediction (written before the first GPU run; nothing here is measured).** If h5 reaches its own prediction (a
tile period of 3400-3700 cycles at d = 128, each consumer's chain S + softmax + PV ≈ 900 + 1700 + 780), taking
the PV product off the chain shortens it to about S + softmax ≈ 2600-2900 cycles, and the tensor pipe, busy
2 × 1680 ≈ 3360 cycles a tile for the two consumers, becomes the limit: expect h6 ≥ 1.1× h5, bf16 non-causal,
d = 128, N = 16384 about 560-620 TFLOP/s (cuDNN 595-650 in the same runs). If h5 misses its prediction, h6's gain
is bounded by what h5 left.

**What ptxas reports** (read without a GPU: ``python -m benchmarks.profilers.hopper_sass h6``, bf16;
``benchmarks/results/sm90a_offline/``): the loop as designed — S_ij and the PV product issued back to back,
``WARPGROUP.DEPBAR.LE gsb0, 0x1`` before the softmax, ``0x0`` before the rescale — with no wait injected by ptxas;
consumers up to R236 after ``setmaxnreg``; no local memory at d = 64, 128, 256, except causal d = 128: 16 bytes
stored, 28 loaded (after the row and diagonal indices were made 32-bit: 40 / 52 before).

**Measured** (H200, 2026-12-02, ``benchmarks/results/nvidia-h200/hopper_forward_h5_{bf16,fp16}.json``, calls
queued; TFLOP/s at N = 4096 / 8192 / 16384, bf16 non-causal): d = 128 508 / 514 / 505, h5 in the same run
502 / 534 / 486 — a tie (0.96-1.04×), not the predicted ≥ 1.1× and 560-620; d = 64 318 / 330 / 337 (h5 333 /
340 / 339); d = 256 405 / 404 / 399, 0.68-0.70× h5. The prediction assumed h5 would reach its own; it did not
(period 3976 cycles, not 3400-3700), and the stamps of h6 (``hopper_timeline_h5.json``, the same shape, block 0,
medians) show the overlap moving time rather than removing it: the period grew to 4160 cycles; the softmax of one
consumer shrank (1340 against h5's 1700) but the wait from issuing S_ij to its completion grew from 740-880 to
1260-1400 — S_ij now queues on the tensor pipe behind this consumer's PV product and the other consumer's GEMMs,
which ping-pong still orders around S. At d = 256 the ring has two stages, and h6 frees a stage one tile later
than h5: the producer cannot load tile j + 1 until tile j − 1's PV product is done, so the copy's latency is
exposed once a tile — the likely cause of the 30 % loss, not yet seen in stamps (the timeline ran at d = 128).
Three stages do not fit at d = 256 (Q_i's 64 KB and three 64 KB stages of K_j, V_j pass the 227 KB), so there
``hopper.flash_forward`` runs h5. What would help next, each a rung of its own with its own prediction: drop the
ping-pong turns around S when the overlap is on, and at d = 256 free K_j's half of a stage right after S_ij (it
is not read again) so the producer can refill it a tile early.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, uint32

from kernels_gpu import ptx
from kernels_gpu.driver_launch import MAX_DYNAMIC_BYTES
from kernels_gpu.hopper import launch
from kernels_gpu.hopper.steps import SBO, SWIZZLE_128B, HopperConfig, make_steps, shared_bytes
from kernels_gpu.tensorcore.steps import LOG2E

__all__ = ["flash_forward", "make_kernel", "config_for"]

#: registers per thread after setmaxnreg: producer, consumers
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240


def config_for(d: int, dtype: str, causal: bool, simulated: bool, B_c: int | None = None,
               stages: int | None = None) -> HopperConfig:
    """h6's tile shape for head dimension ``d`` (``B_c``, ``stages`` override it): three stages where they fit in
    a block's shared memory, else two."""
    Bc = B_c or (128 if d <= 128 else 64)
    cfg = HopperConfig(d=d, B_c=Bc, dtype=dtype, causal=causal, simulated=simulated, consumers=2, producer=True,
                       stages=stages or 3)
    if stages is None and shared_bytes(cfg) > MAX_DYNAMIC_BYTES:
        cfg = HopperConfig(d=d, B_c=Bc, dtype=dtype, causal=causal, simulated=simulated, consumers=2,
                           producer=True, stages=2)
    return cfg


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: HopperConfig):
    """The h6 kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    jit = cuda.jit(device=True) if cfg.simulated else cuda.jit(device=True, forceinline=True)
    aligned_base, tma_q, tma_kv, wait_phase = st["aligned_base"], st["tma_q"], st["tma_kv"], st["wait_phase"]
    stamp = st["stamp"]
    zero, init_stats, finish_rows = st["zero"], st["init_stats"], st["finish_rows"]
    B_r, B_c, STAGES = cfg.B_r, cfg.B_c, cfg.stages
    Q_WORDS, KV_WORDS = cfg.tile_words(B_r), cfg.tile_words(B_c)
    STAGE = 2 * KV_WORDS
    Q_BYTES, STAGE_BYTES = 4 * Q_WORDS, 4 * STAGE
    S_LEN, O_LEN, P_LEN = B_c // 2, cfg.D // 2, B_c // 4
    KS, KV, NT, NO = cfg.D // 16, B_c // 16, B_c // 8, cfg.D // 8
    CONSUMER_THREADS = 128 * cfg.consumers
    causal = cfg.causal
    give_registers = ptx.make_setmaxnreg(False, PRODUCER_REGISTERS)
    take_registers = ptx.make_setmaxnreg(True, CONSUMER_REGISTERS)
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    descriptor, shfl_xor, ex2 = ptx.descriptor, ptx.shfl_xor, ptx.ex2
    wgmma_qk = ptx.make_wgmma(cfg.dtype, B_c, "smem", False)
    wgmma_pv = ptx.make_wgmma(cfg.dtype, cfg.D, "regs", True)
    fence_s, fence_o = ptx.make_wgmma_fence(S_LEN), ptx.make_wgmma_fence(O_LEN)
    wait_s_all, wait_s_but_one = ptx.make_wgmma_wait(0, S_LEN), ptx.make_wgmma_wait(1, S_LEN)
    wait_o = ptx.make_wgmma_wait(0, O_LEN)
    NEG_INF = float32(-math.inf)

    @jit
    def issue_s(sm, s, q_byte, k_byte):
        """FA2 Alg. 1 line 8, S_ij = Q_i K_jᵀ, issued and committed, not waited for: one ``wgmma m64n{B_c}k16``
        per 16 columns of d, both operands K-major in shared memory (the steps' ``s_equals_q_kt`` without its
        wait)."""
        fence_s(s)
        for kk in range(KS):
            panel, step = kk // 4, 32 * (kk % 4)
            desc_q = descriptor(q_byte + panel * (B_r * 128) + step, 16, SBO, SWIZZLE_128B)
            desc_k = descriptor(k_byte + panel * (B_c * 128) + step, 16, SBO, SWIZZLE_128B)
            wgmma_qk(sm, s, desc_q, desc_k, uint32(kk > 0))
        ptx.wgmma_commit()

    @jit
    def issue_pv(sm, o, p, v_byte):
        """FA2 Alg. 1 line 10 (second half), Õ_i += P̃ V_j, issued and committed, not waited for: P̃ already packed
        (``p``: the A registers of step kk are p[4kk] … p[4kk + 3]), V_j MN-major, one ``wgmma m64n{D}k16`` per
        16 keys."""
        fence_o(o)
        for kk in range(KV):
            desc_v = descriptor(v_byte + kk * (16 * 128), B_c * 128, SBO, SWIZZLE_128B)
            wgmma_pv(sm, o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], desc_v, uint32(1))
        ptx.wgmma_commit()

    @jit
    def pack_p(p, s):
        """P̃ (float32 in ``s``) to 16-bit pairs in ``p``, in the order the PV product's A registers take them."""
        for w in range(P_LEN):
            p[w] = pack(s[2 * w], s[2 * w + 1])

    @jit
    def row_softmax(s, m, l, alpha, h, row, col0, N_k, scale_log2, diag, mask_tile):
        """FA2 Alg. 1 lines 9-10 for one of the thread's two rows (h = 0, 1: a constant), in base 2 with the scale
        folded in, as the steps' ``row_softmax_exp2`` — except that Õ_i is not touched: the factor
        α = 2^(m_old·τlog₂e − m_new·τlog₂e) that rescales it is left in ``alpha[h]`` (1 when the maximum did not
        move), because the PV product of the previous tile is still adding into Õ_i."""
        mx = NEG_INF
        for n in range(NT):
            for e in range(2):
                if mask_tile:
                    col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                    if col >= N_k or (causal and col > row + diag):
                        s[4 * n + 2 * h + e] = NEG_INF
                mx = max(mx, s[4 * n + 2 * h + e])
        mx = max(mx, shfl_xor(mx, 1))
        mx = max(mx, shfl_xor(mx, 2))
        m_new = max(m[h], mx)
        alpha[h] = float32(1.0)
        # Guard (fully masked so far): P̃ = 0 for the whole row, nothing to rescale.
        if m_new == NEG_INF:
            for n in range(NT):
                for e in range(2):
                    s[4 * n + 2 * h + e] = float32(0.0)
            return
        m_scaled = m_new * scale_log2
        if m_new != m[h]:
            a = ex2(m[h] * scale_log2 - m_scaled)
            alpha[h] = a
            l[h] *= a
        rowsum = float32(0.0)
        for n in range(NT):
            for e in range(2):
                x = ex2(s[4 * n + 2 * h + e] * scale_log2 - m_scaled)
                s[4 * n + 2 * h + e] = x
                rowsum += x
        l[h] += rowsum
        m[h] = m_new

    @jit
    def softmax(s, m, l, alpha, row0, col0, N_k, scale_log2, diag, mask_tile):
        """:func:`row_softmax` for the thread's rows g and g + 8."""
        row_softmax(s, m, l, alpha, 0, row0, col0, N_k, scale_log2, diag, mask_tile)
        row_softmax(s, m, l, alpha, 1, row0 + 8, col0, N_k, scale_log2, diag, mask_tile)

    @jit
    def rescale(o, alpha):
        """Õ_i ← diag(α) Õ_i (Alg. 1 line 10's rescale), once the PV product that adds into Õ_i is done."""
        for h in range(2):
            if alpha[h] != float32(1.0):
                for n in range(NO):
                    for e in range(2):
                        o[4 * n + 2 * h + e] *= alpha[h]

    @jit
    def tile_softmax(s, m, l, alpha, row0, j, N_k, scale_log2, diag, mask_tile):
        """The softmax of tile j, compiled once with the column mask (the ragged last tile; with causal, those
        that cross the diagonal) and once without (h5's change)."""
        if mask_tile:
            softmax(s, m, l, alpha, row0, j * B_c, N_k, scale_log2, diag, True)
        else:
            softmax(s, m, l, alpha, row0, j * B_c, N_k, scale_log2, diag, False)

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
        fills, the PV product of tile j − 1 in flight during the softmax of tile j."""
        sm_byte = ptx.shared_byte_address(sm, 0)
        s = cuda.local.array(S_LEN, float32)
        p = cuda.local.array(P_LEN, uint32)
        o = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        warp = (cuda.threadIdx.x % 128) // 32
        # (32-bit: numba's integers are 64-bit, two registers each, and at d = 128 causal those spilled)
        row0 = int32(i * B_r + 64 * wg + 16 * warp + cuda.laneid // 4)
        diag = int32(N_k - N_q)
        q_byte = sm_byte + 4 * q_off + 64 * 128 * wg
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
            # Line 8: S_ij = Q_i K_jᵀ issued; then (from the second tile on) Õ_i += P̃_i,j−1 V_j−1 behind it.
            issue_s(sm, s, q_byte, sm_byte + 4 * k_off)
            if j > 0:
                prev = kv_off + ((j - 1) % STAGES) * STAGE
                issue_pv(sm, o, p, sm_byte + 4 * (prev + KV_WORDS))
                wait_s_but_one(s)                           # S_ij done; the PV product may still run
            else:
                wait_s_all(s)
            if wg == 0 or j + 1 < n_tiles:                  # the other's turn (the last turn is not passed)
                ptx.named_barrier_arrive(2 - wg, 256)
            stamp(T, wg + 1, j, 2)
            # Lines 9-10: the online softmax of tile j, under the PV product of tile j − 1.
            jj = int32(j)
            mask_tile = (jj + 1) * B_c > N_k or (causal and (jj + 1) * B_c - 1 > int32(i * B_r) + diag)
            tile_softmax(s, m, l, alpha, row0, jj, N_k, scale_log2, diag, mask_tile)
            stamp(T, wg + 1, j, 3)
            # Line 10: the PV product done, Õ_i rescaled by α; stage j − 1 goes back to the producer.
            wait_o(o)
            rescale(o, alpha)
            if j > 0:
                ptx.mbar_arrive(sm, empty + 2 * ((j - 1) % STAGES))
            pack_p(p, s)
            stamp(T, wg + 1, j, 4)
        # Line 10 for the last tile: its PV product, alone.
        if n_tiles > 0:
            last = kv_off + ((n_tiles - 1) % STAGES) * STAGE
            issue_pv(sm, o, p, sm_byte + 4 * (last + KV_WORDS))
            wait_o(o)
            ptx.mbar_arrive(sm, empty + 2 * ((n_tiles - 1) % STAGES))
        # Lines 12-15.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2)

    jit_kernel = cuda.jit if cfg.simulated else cuda.jit(launch_bounds=(cfg.threads, 1))

    @jit_kernel
    def flash_forward_h6(Q, K, V, O, L, N_q, N_k, G, scale, q_map, k_map, v_map, T):
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

    return flash_forward_h6


def flash_forward(Q, K, V, causal=False, scale=None, **options):
    """FA2 forward on wgmma and TMA, warp-specialised, ping-pong consumers, each consumer's PV product under its
    next softmax, rung h6. Arguments and results as :func:`kernels_gpu.hopper.flash_forward_h1.flash_forward`;
    ``options``: ``B_c``, ``stages``."""
    return launch.run(make_kernel, config_for, Q, K, V, causal=causal, scale=scale, maps=True, **options)
