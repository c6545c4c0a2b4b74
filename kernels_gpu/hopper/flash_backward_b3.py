"""Hopper FA2 backward, b3: Q_i, dO_i, L_i and D_i brought in by the copy engine (TMA) into a ring of two stages,
the copy of the next row block issued before the products of this one (b2 + one change: the row blocks' copies).

In b2 every row block starts the same way: a block barrier, 256 threads issue the ``cp.async`` copies of Q_i and
dO_i (64 rows × d each, 16 bytes per instruction: 2048 of them at d = 128) and of L_i, D_i, wait for all of them,
and only then does the first product start; while the copies travel the tensor cores are idle, and while the
products run the copy engine is. b3 does what the forward's h2 does with K_j and V_j, for the tiles that change
per row block:

* **A ring of two stages**, each with Q_i, dO_i (64-column panels of 128-byte swizzled rows, as a TMA box lands
  them), L_i·log₂e and D_i (64 floats each), and two mbarriers: *full* (one arrival — the expect-tx of the thread
  that issues the copies — and the stage's bytes: the copy engine counts them down as they land) and *empty*
  (256 arrivals: every consumer thread, once its last read of the stage, Alg. 2 line 21's dK_j += dSᵀ Q_i, is
  done).
* **The next row block first.** At the top of row block i, thread 0 waits until the other stage is empty (row block
  i − 1 released it) and issues its refill with row block i + 1: one ``cp.async.bulk.tensor`` per 64-column panel
  of Q_i and of dO_i (tensor maps with a box of 64 × 64, rows past N_q zero-filled by the copy engine), one
  ``cp.async.bulk`` of 256 bytes each for L_i and D_i. Then everyone waits for this row block's *full* phase and
  computes: row block i + 1's copies run under row block i's seven products. No block barrier is left in the
  loop; the two warpgroups meet only through the stages' barriers.

**Who issues the copies.** h2's way (one elected consumer thread), not h3's (a producer warpgroup with
``setmaxnreg``): with a third warpgroup a block has 384 threads, and the register file's 65 536 registers give the
consumers at most 240 each (24 · 128 + 240 · 256 = 64 512; setmaxnreg counts go in steps of 8), where b2 already
needs all 255 and spills 20 bytes at d = 128. The issuing thread's extra work is a few dozen instructions per row
block; its wait on *empty* is for the other warpgroup's release of row block i − 1, which b2's barrier at the top
of the loop waited for too.

Everything else is b2's: K_j, V_j by ``cp.async`` once per block, the five products, dQ's share a panel at a time by
``red.global.add.v4`` (:func:`kernels_gpu.hopper.backward_steps.make_dq_share`), the addresses recomputed per row
block from opaque copies, and the deterministic mode's dQ pass (b2's kernel, unchanged; b3's dK/dV-only kernel
before it).

**What ptxas reports** (CUDA 13.0's ptxas, numba-cuda 0.30.4, bf16, ``python -m benchmarks.profilers.hopper_sass
b3 b3-kv --d 128``, read on a machine without a GPU): the key-block kernel at d = 128 uses 255 registers and
spills 4 bytes (one value; b2: 20), and its loop over row blocks is 2441 instructions (b2: 3135: the copies'
address arithmetic is gone); the dK/dV-only kernel 242 registers, no spills (b2: 232). At d = 64 nothing spills
and the key-block kernel needs 168 registers (b2: 255). The exception is causal at d = 128: 20 bytes (b2: none).
A first build spilled 40 bytes (56 of loads) at d = 128: the refill computed the next row block as
``(step + 1) // n_i`` — a 64-bit division (numba's integers are int64) whose temporaries ptxas found no room for
at the top of the loop; the next row block is now stepped from this one (i + 1, or the first row block of head
h + 1), which brought the spills to 4 bytes.

**Prediction (written before the first GPU run; nothing here is measured on a GPU).** Per row block at d = 128 a
block computes five products of 2·64·64·128 FLOPs per warpgroup, 10.5 MFLOP: ~4.6 µs at 300 TFLOP/s over 132
SMs. Its copies are 2 × 16 KB + 512 bytes, mostly from L2 (every key block reads the same Q_i, dO_i): ~1-1.5 µs
of latency and transfer that b2 waits for at every row block. Hiding them should be worth 15-30 % over b2 at
d = 128 (bf16, N ≥ 4096, non-causal): b3 290-490 TFLOP/s where b2 is predicted at 250-380. At d = 64 the products
halve and the copies' latency does not, so the share hidden, and the gain, should be larger (20-40 %). What stays:
each warpgroup's softmax and dS still wait for its products (no overlap of the element-wise steps with the
tensor cores inside a warpgroup), and dQ's atomic adds.

**Measured** (H200, 2026-12-02, ``benchmarks/results/nvidia-h200/tensorcore_backward_hopper_b3.json``, bf16, d = 128,
calls queued; TFLOP/s by the FA2 model, backward = 2.5 × forward): non-causal N = 4096 / 16384: 217 / 221, causal
184 / 204 — beside chapter 14's mma.sync v7 at 202 / 206 and 197 / 213, PyTorch's FlashAttention-2 289 / 307 and
253 / 310, and cuDNN (SDPA's default) 521 / 540 and 489 / 523. Below the prediction (290-490) and at 0.41× cuDNN:
the Hopper backward is, so far, no faster than the mma.sync one, and ``fa2edu.torch.flash_attention`` keeps the
mma.sync backward. b1 and b2 were not timed in this run, so how much the ring itself bought is not known; the
missing factor is the next run's question (the timeline of stamps, Nsight Compute's pipe utilisation), not a
guess here.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

import kernels_gpu.runtime as rt
from kernels_gpu import ptx, tensor_map
from kernels_gpu.driver_launch import Buffer
from kernels_gpu.hopper import flash_backward_b2 as b2
from kernels_gpu.hopper import launch as hopper_launch
from kernels_gpu.hopper.backward_steps import make_dq_share, make_products
from kernels_gpu.hopper.steps import ALIGN_BYTES, HopperConfig, make_steps
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore.backward_steps import (
    CONVERT_THREADS,
    BackwardConfig,
    convert_dq_kernel,
    make_backward_steps,
)
from kernels_gpu.tensorcore.steps import device as tc_device

__all__ = ["flash_backward", "make_kernel", "make_dq_kernel", "config_for", "shared_words", "dq_shared_words",
           "TENSOR_MAPS", "STAGES"]

#: queries per row block Q_i and consumer warpgroups per key block (64 keys each): b2's
B_R, CONSUMERS = b2.B_R, b2.CONSUMERS
#: stages of the ring of row blocks
STAGES = 2
#: tensor maps the key-block kernels take after b2's arguments: Q's and dO's (boxes of 64 columns × B_r rows)
TENSOR_MAPS = 2

#: b3's tile shape is b2's (d ≤ 128), and so is its deterministic mode's dQ pass
config_for = b2.config_for
make_dq_kernel = b2.make_dq_kernel
dq_shared_words = b2.dq_shared_words


def _tiles(cfg: BackwardConfig) -> HopperConfig:
    """The forward's tile geometry for these sizes: 128-row tiles (K_j, V_j) and 64-row tiles (Q_i, dO_i)."""
    return HopperConfig(d=cfg.d, B_c=cfg.B_r, dtype=cfg.dtype, causal=cfg.causal, simulated=cfg.simulated,
                        consumers=CONSUMERS)


def _layout(cfg: BackwardConfig) -> dict:
    """Word offsets, from the aligned base: K_j, V_j; stage s's Q_i at Q + s·STAGE_TILES and dO_i right after it
    (every tile on a 1024-byte boundary); the two dS panels; stage s's L_i·log₂e at STATS + s·2B_r and D_i B_r words
    on; full[s] at BARS + 2s and empty[s] at BARS + 2·STAGES + 2s (8 bytes each); and the end."""
    t = _tiles(cfg)
    kv, q = t.tile_words(cfg.B_c), t.tile_words(cfg.B_r)
    ds = 32 * cfg.B_r                                   # one 64 × 64 panel of 16-bit values
    Q = 2 * kv
    DS = Q + STAGES * 2 * q
    STATS = DS + CONSUMERS * ds
    BARS = STATS + STAGES * 2 * cfg.B_r
    return dict(K=0, V=kv, Q=Q, STAGE_TILES=2 * q, DO=q, DS=DS, DS_WORDS=ds, STATS=STATS, BARS=BARS,
                END=BARS + 4 * STAGES)


def shared_words(cfg: BackwardConfig) -> int:
    """32-bit words of dynamic shared memory: the tiles, the two stages, the dS panels, the statistics, the
    barriers, the alignment slack (at d = 128: 64 + 64 + 16 KB and change)."""
    return _layout(cfg)["END"] + ALIGN_BYTES // 4


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig, atomic_dq: bool = True):
    """The b3 key-block kernel for one configuration (compiled on first launch). ``atomic_dq``: it also adds its
    share of dQ into the float32 accumulator (the default, three launches); without, it computes dK_j and dV_j
    only and :func:`make_dq_kernel`'s pass computes dQ (``deterministic=True``)."""
    bst = make_backward_steps(cfg)
    zero = bst["zero"]
    probabilities, softmax_gradient, store_rows = bst["probabilities"], bst["softmax_gradient"], bst["store_rows"]
    hst = make_steps(_tiles(cfg))
    aligned_base, copy_kv, tma_rows = hst["aligned_base"], hst["copy_q"], hst["tma_kv"]   # 128- and 64-row tiles
    wait_phase = hst["wait_phase"]
    pr = make_products(cfg.d, cfg.B_r, cfg.B_c, cfg.dtype, cfg.simulated)
    product_transposed, product_accumulate = pr["product_transposed"], pr["product_accumulate"]
    store_ds = pr["store_ds"]
    dqs = make_dq_share(cfg.d, cfg.B_c, cfg.dtype, cfg.simulated)
    dq_panel_0, dq_panel_1, add_dq = dqs["dq_panel_0"], dqs["dq_panel_1"], dqs["add_dq"]
    PANELS, DQ_LEN = dqs["PANELS"], dqs["DQ_LEN"]
    lay = _layout(cfg)
    K_OFF, V_OFF, Q_OFF, STAGE_TILES, DO_OFF = lay["K"], lay["V"], lay["Q"], lay["STAGE_TILES"], lay["DO"]
    DS_OFF, DS_WORDS, STATS_OFF, BARS = lay["DS"], lay["DS_WORDS"], lay["STATS"], lay["BARS"]
    FULL, EMPTY = BARS, BARS + 2 * STAGES
    B_r, B_c, D = cfg.B_r, cfg.B_c, cfg.D
    STAGE_BYTES = 4 * STAGE_TILES + 2 * 4 * B_r         # Q_i, dO_i (whole boxes, zero fill included), L_i, D_i
    ATOMIC_DQ = atomic_dq
    CONSUMER_THREADS = 128 * CONSUMERS
    jit = tc_device(cfg.simulated)
    S_LEN, C_LEN = B_r // 2, D // 2
    causal = cfg.causal

    @jit
    def load_row_block(sm, smf, stage, q_map, do_map, stats, z, h, row0, base):
        """Alg. 2 lines 9-10 by the copy engine: Q_i, dO_i (rows row0 … row0 + B_r − 1 of head h, batch z) and L_i,
        D_i into ring stage ``stage``, their bytes counted down on its full barrier. One thread calls it, after the
        stage's empty barrier said both warpgroups are done with it."""
        bar = base + FULL + 2 * stage
        q_off = base + Q_OFF + stage * STAGE_TILES
        ptx.mbar_arrive_expect_tx(sm, bar, STAGE_BYTES)
        tma_rows(sm, q_off, q_map, row0, h, z, bar)
        tma_rows(sm, q_off + DO_OFF, do_map, row0, h, z, bar)
        # L_i·log₂e and D_i: two runs of B_r floats of the statistics (padded to whole row blocks: no bounds test)
        H, N_pad = stats.shape[1], stats.shape[3]
        src = (z * H + h) * 2 * N_pad + row0
        s_off = base + STATS_OFF + stage * 2 * B_r
        ptx.bulk_copy(smf, s_off, stats, src, 4 * B_r, bar)
        ptx.bulk_copy(smf, s_off + B_r, stats, src + N_pad, 4 * B_r, bar)

    @jit
    def key_block(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2, q_map, do_map):
        """FA2 Alg. 2 lines 5-24 for key block j = blockIdx.x (line 20 only when ``atomic_dq``)."""
        tid = cuda.threadIdx.x
        wg = tid // 128                       # the consumer warpgroup: keys 64·wg … 64·wg + 63 of the block
        warp = (tid % 128) // 32
        lane = cuda.laneid
        j = cuda.blockIdx.x                   # key block j (Alg. 2 line 5: one block per j, in parallel)
        hk = cuda.blockIdx.y
        z = cuda.blockIdx.z
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory as words, halves and floats
        sm16 = cuda.shared.array(0, uint16)
        smf = cuda.shared.array(0, float32)
        base = aligned_base(sm)
        sm_byte = ptx.shared_byte_address(sm, 0) + 4 * base
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dk = cuda.local.array(C_LEN, float32)
        dv = cuda.local.array(C_LEN, float32)
        dq = cuda.local.array(DQ_LEN, float32)
        diag = N_k - N_q
        key0 = j * B_c + 64 * wg + 16 * warp  # the warp's first key
        ds_half = 2 * (base + DS_OFF + wg * DS_WORDS)
        # Alg. 2 line 8's range: i = 1 … T_r, from the first row block that sees a key of K_j (causal), for each of
        # the G query heads that read this key/value head (their dK_j, dV_j add up: GQA) — n_steps row blocks.
        T_r = (N_q + B_r - 1) // B_r
        i_first = 0
        if causal and j * B_c - diag > 0:
            i_first = min(T_r, (j * B_c - diag) // B_r)
        n_i = T_r - i_first
        n_steps = G * n_i

        if tid == 0:                          # the ring's barriers, then the first row block into stage 0
            for k in range(STAGES):
                ptx.mbar_init(sm, base + FULL + 2 * k, 1)
                ptx.mbar_init(sm, base + EMPTY + 2 * k, CONSUMER_THREADS)
            ptx.fence_mbarrier_init()
            if n_steps > 0:
                load_row_block(sm, smf, 0, q_map, do_map, stats, z, hk * G, i_first * B_r, base)
        # Alg. 2 line 6: load K_j, V_j from HBM to SRAM (they stay for the whole block).
        copy_kv(sm, base + K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, base + V_OFF, V, z, hk, j * B_c, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 2 line 7: dK_j = 0, dV_j = 0 (in registers).
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        ptx.cp_async_wait_all()
        ptx.fence_proxy_async()               # cp.async's writes, visible to the tensor cores' reads
        cuda.syncthreads()                    # K_j, V_j and the barriers' initialisation, seen by every thread
        for step in range(n_steps):           # Alg. 2 line 8: row block i of query head h
            gq = step // n_i
            i = i_first + step - gq * n_i
            h = hk * G + gq
            stage = step % STAGES
            # Lines 9-10 for the next row block, into the other stage, before this one's products: its copies run
            # under them. The stage is free once both warpgroups have released the row block before this one.
            if tid == 0 and step + 1 < n_steps:
                nxt = step + 1                # row block i + 1 of head h, or the first of head h + 1 (no division)
                i_next, h_next = i + 1, h
                if i_next == T_r:
                    i_next, h_next = i_first, h + 1
                if nxt >= STAGES:
                    wait_phase(sm, base + EMPTY + 2 * (nxt % STAGES), (nxt // STAGES - 1) % 2)
                # (opaque: the copies' addresses are recomputed here, by this thread, not held by all across rows)
                load_row_block(sm, smf, nxt % STAGES, q_map, do_map, stats, int32(ptx.opaque_u32(z)),
                               int32(ptx.opaque_u32(h_next)), int32(ptx.opaque_u32(i_next * B_r)),
                               int32(ptx.opaque_u32(base)))
            # The tiles' and barriers' addresses, made anew each row block (opaque copies of the base): the
            # descriptors computed from them stay in the loop instead of being hoisted and held in registers (b2).
            at = ptx.opaque_u32(sm_byte)
            words = int32(ptx.opaque_u32(base))
            # Lines 9-10 for this row block: wait until its stage has landed.
            wait_phase(sm, words + FULL + 2 * stage, (step // STAGES) % 2)
            q_byte = at + 4 * (Q_OFF + stage * STAGE_TILES)
            do_byte = q_byte + 4 * DO_OFF
            stats_at = words + STATS_OFF + stage * 2 * B_r      # L_i·log₂e here, D_i B_r words on
            kw_byte, vw_byte, ds_byte = at + 4 * K_OFF + 64 * 128 * wg, at + 4 * V_OFF + 64 * 128 * wg, \
                at + 4 * (DS_OFF + wg * DS_WORDS)

            # Line 11: Sᵀ = K_j Q_iᵀ, the warpgroup's 64 keys × B_r queries (τ is folded into line 13).
            product_transposed(sm, s, kw_byte, q_byte)
            # Line 13: Pᵀ = exp(τSᵀ − L_i); the mask only where a key can be invisible to a query of the tile.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, stats_at, key0 + lane // 4, i * B_r, N_k, scale_log2, diag, mask_tile)
            # Line 16: dV_j += Pᵀ dO_i, A straight from Pᵀ's accumulators.
            product_accumulate(sm, dv, s, do_byte)
            # Line 17: dPᵀ = V_j dO_iᵀ.
            product_transposed(sm, dp, vw_byte, do_byte)
            # Line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            softmax_gradient(s, dp, smf, stats_at + B_r)
            # Line 21: dK_j += dSᵀ Q_i (τ applied once, when dK_j is written) — the stage's last read: release it.
            product_accumulate(sm, dk, s, q_byte)
            ptx.mbar_arrive(sm, words + EMPTY + 2 * stage)
            if ATOMIC_DQ:
                # Line 20: dQ_i += dS K_j for this warpgroup's keys: dS through its own panel, then one wgmma
                # per 64-column panel of K_j, each added into HBM at once (τ applied when dQ is rounded).
                store_ds(sm16, ds_half, s, warp, int32(ptx.opaque_u32(lane)))
                ptx.fence_proxy_async()           # the stores, visible to the tensor cores' reads
                ptx.named_barrier_sync(1 + wg, 128)
                dq_panel_0(sm, dq, ds_byte, kw_byte)
                add_dq(dQacc, dq, z, h, i * B_r + 16 * warp, 0, N_q, lane)
                if PANELS > 1:
                    dq_panel_1(sm, dq, ds_byte, kw_byte + B_c * 128)
                    add_dq(dQacc, dq, z, h, i * B_r + 16 * warp, 64, N_q, lane)
                ptx.named_barrier_sync(1 + wg, 128)   # the panel is read before the next row block's stores
        # Alg. 2 line 24: write dK_j (times τ) and dV_j to HBM.
        store_rows(dk, dK, z, hk, key0, N_k, 0, scale, lane)
        store_rows(dv, dV, z, hk, key0, N_k, 0, float32(1.0), lane)

    if atomic_dq:
        @cfg.jit()
        def flash_backward_b3(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2, q_map, do_map):
            key_block(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2, q_map, do_map)
        return flash_backward_b3

    @cfg.jit()
    def flash_backward_b3_kv(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2, q_map, do_map):
        # (stats in dQacc's place: never written)
        key_block(Q, K, V, dO, stats, stats, dK, dV, N_q, N_k, G, scale, scale_log2, q_map, do_map)
    return flash_backward_b3_kv


# -- the launches ----------------------------------------------------------------------------------------------------

_MAPS = None


def _geometry(X, d: int) -> tuple:
    """(sizes, byte strides, box) of a tensor map over X's (Z, H, N, d/2) words: 16-bit elements, innermost first,
    a box of 64 columns × B_r rows."""
    Z, H, N, _ = X.shape
    st = X.strides
    return (d, N, H, Z), (st[2], st[1], st[0]), (64, B_R, 1, 1)


def _tensor_maps(bp) -> tuple:
    """The tensor maps of Q and dO (the words the kernels read) as device arrays of 16 uint64 words each, in the
    launch's kind; on PyTorch CUDA tensors encoded once per (addresses, geometry) and uploaded stream-ordered
    (:class:`kernels_gpu.tensor_map.DeviceMaps`), as the forward's."""
    global _MAPS
    p = bp.fwd
    inputs = [(X, _geometry(X, p.d)) for X in (p.Q, bp.dO)]
    if rt.simulator_in_use():
        return tuple(cuda.to_device(tensor_map.simulated_map(X, *geometry)) for X, geometry in inputs)
    ptrs = [X.ptr if isinstance(X, Buffer) else X.device_ctypes_pointer.value for X, _ in inputs]

    def encode():
        return [tensor_map.encode_4d(ptr, 2, *geometry) for ptr, (_, geometry) in zip(ptrs, inputs)]
    if p.kind == "torch-cuda":
        if _MAPS is None:
            _MAPS = tensor_map.DeviceMaps()
        rows = _MAPS.get((tuple(ptrs), tuple(g for _, g in inputs)), encode, p.O_user.device)
        return tuple(Buffer.of_torch(r, np.uint64) for r in rows)
    return tuple(cuda.to_device(words) for words in encode())


def flash_backward(Q, K, V, O, L, dO, causal=False, scale=None, deterministic=False):
    """FA2 backward on wgmma with the row blocks copied by TMA into a ring of two stages, rung b3:
    ``Flash2Backward(dQ, dK, dV)`` in the inputs' kind and dtype (float16 or bfloat16), from the forward's O and L
    (natural log, +∞ on rows that see no key) and dO; Q (…, N_q, d), K, V (…, N_k, d), d a multiple of 8 up to
    128, GQA by head mapping, ``causal`` bottom-right aligned. Cost: the model's 2.5 × the forward's FLOPs, dQ's
    2·N_q·d·T_c atomic adds.

    dK and dV are summed inside one block in a fixed order, so they are the same bits on every run; dQ is a sum of
    atomic adds whose order varies. ``deterministic=True`` gives bit-identical gradients every run: b3's dK/dV
    kernel, then b2's dQ pass over query blocks (no atomics). Launches: preprocess, the key-block kernel, and
    either dQ's conversion or the dQ pass, on the inputs' stream."""
    hopper_launch.require_hopper()
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    bp = backward_launch.prepare_backward(Q, K, V, O, L, dO, causal=causal, scale=scale)
    p = bp.fwd
    cfg = config_for(p.d, p.dtype, p.causal, rt.simulator_in_use())
    common = (np.int32(p.N_q), np.int32(p.N_k), np.int32(p.H_q // p.H_kv), np.float32(p.scale),
              np.float32(p.scale * math.log2(math.e)))
    kv_grid = (rt.grid_size(p.N_k, cfg.B_c), p.H_kv, p.Z)
    if deterministic:
        # Alg. 2 lines 3-4 (D, L·log₂e), then lines 5-24 without line 20, then line 20 as a pass over query blocks.
        stats, _ = backward_launch._preprocess(bp, cfg, None)
        backward_launch._launch(make_kernel(cfg, atomic_dq=False), kv_grid, cfg.threads, 4 * shared_words(cfg),
                                p.stream, (p.Q, p.K, p.V, bp.dO, stats, bp.dK, bp.dV) + common + _tensor_maps(bp))
        backward_launch._launch(make_dq_kernel(cfg), b2.dq_pass_grids(cfg, p)[1], cfg.threads,
                                4 * dq_shared_words(cfg), p.stream, (p.Q, p.K, p.V, bp.dO, stats, p.O) + common)
        return backward_launch.finish_backward(bp)
    if not getattr(p.O, "contiguous", True):     # dQ laid out like a strided Q: the conversion writes flat runs
        p.O_user = p.O_user.contiguous()
        p.O = Buffer.of_torch(p.O_user, np.uint32)
    # Alg. 2 lines 3-4: dQ_acc = 0; D = rowsum(dO ∘ O); L·log₂e.
    dQacc = backward_launch._empty_f32(p, (p.Z, p.H_q, p.N_q, p.d))
    stats, _ = backward_launch._preprocess(bp, cfg, dQacc)
    # Alg. 2 lines 5-24: one block per key block j.
    backward_launch._launch(make_kernel(cfg), kv_grid, cfg.threads, 4 * shared_words(cfg), p.stream,
                            (p.Q, p.K, p.V, bp.dO, stats, dQacc, bp.dK, bp.dV) + common + _tensor_maps(bp))
    # dQ = τ · dQ_acc, rounded once to the input dtype.
    n_words = p.Z * p.H_q * p.N_q * p.d // 2
    backward_launch._launch(convert_dq_kernel(p.dtype), rt.grid_size(n_words, CONVERT_THREADS), CONVERT_THREADS, 0,
                            p.stream, (dQacc.reshape(-1), p.O.reshape(-1), np.float32(p.scale)))
    return backward_launch.finish_backward(bp)
