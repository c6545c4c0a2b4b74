"""Hopper FA2 backward, b2: b1 within the register file — dQ's share a 64-column panel at a time, added four floats
per instruction, and the loop's addresses recomputed per row block rather than held (b1 + one change: the
registers).

b1 has not run on a GPU, but what ptxas makes of it can be read without one (``python -m
benchmarks.profilers.hopper_sass b1 b1-kv b1-dq``, sm_90a, bf16). At d = 128 the key-block kernel needs more than
the 255 registers a thread may have and spills: a 592-byte stack frame, 648 bytes of spill stores and 824 of
loads per thread, local-memory traffic inside the loop over row blocks; its dK/dV-only kernel spills 48 bytes,
and at d = 64 the key-block kernel 60. A consumer thread holds, for the whole loop, dK_j and dV_j of its 64 keys
(d/2 floats each) and, per row block, Sᵀ and dPᵀ (B_r/2 each): 192 floats at d = 128. Two things come on top:

* **dQ's share.** b1 computes the 64 × d share of dQ_i as one more accumulator of d/2 floats and adds it into HBM
  one float at a time (``cuda.atomic.add``: 64-bit index arithmetic per element, and a generic atomic that first
  asks which memory space the address is in — ``QSPC``, ``ATOM`` and a retry loop per float). b2 computes it one
  64-column panel of K_j at a time (``wgmma m64n64k16`` × 4 into 32 floats, added, then the next panel into the
  same registers; at d ≤ 64 one panel, b1's product), and adds it by ``red.global.add.v4.f32``: one exchange with
  the neighbouring lane (two ``shfl.sync.bfly``) gives each lane four adjacent columns of one row, so a quarter of
  b1's atomic instructions and no address-space test.
* **Loop invariants.** Every address the loop body computes from the thread index alone — the destinations of
  the ``cp.async`` copies of Q_i and dO_i, the 64 swizzled 16-bit addresses of the dSᵀ stores, the SRAM addresses
  of L_i and D_i, the descriptors' byte addresses — is the same for every row block, so the compiler computes
  them once before the loop and keeps them, about 60 registers' worth: those are what spilled. b2 derives them
  each row block from an opaque copy of the thread index and of the shared-memory base
  (:func:`kernels_gpu.ptx.opaque_u32`, a ``mov`` the compiler cannot hoist): a few integer instructions per row
  block instead of spills.

Everything else is b1's: two consumer warpgroups per key block of 128, B_r = 64, the five products, the
deterministic mode's dQ pass (b1's, unchanged: no atomics, 164 registers, no spills).

**What ptxas reports** (CUDA 13.0's ptxas, numba-cuda 0.30.4, bf16, read on a machine without a GPU;
``benchmarks/results/sm90a_offline/hopper_sass_*.txt``): the key-block kernel at d = 128 spills 20 bytes (stores and
loads: five values, outside the products), against b1's 648 / 824; at d = 64, and in the dK/dV-only kernel at d =
128, nothing (b1: 60 and 48 bytes).

**Prediction (written before the first GPU run; nothing here is measured on a GPU).** The spills' local-memory
round trips and the per-float atomics sit in the loop of every row block, so removing them should be worth
1.3-2× over b1 at d = 128 (bf16, N ≥ 4096), where b1 is predicted at 150-250 TFLOP/s: b2 250-380, beside the
mma.sync backward v7 and SDPA's default on the same GPU (GPU.md: fa2edu's op forward + backward 211-234 TFLOP/s,
SDPA's default 494-620 at d = 128). Q_i and dO_i are still copied and waited for at once: the next rung's change.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, uint16, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper import launch as hopper_launch
from kernels_gpu.hopper.backward_steps import make_dq_share, make_products
from kernels_gpu.hopper.steps import ALIGN_BYTES, HopperConfig, make_steps
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps
from kernels_gpu.tensorcore.steps import device as tc_device

__all__ = ["flash_backward", "make_kernel", "make_dq_kernel", "config_for", "shared_words", "dq_shared_words"]

#: queries per row block Q_i (the M of dQ_i's wgmma) and consumer warpgroups per key block (64 keys each)
B_R, CONSUMERS = 64, 2


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> BackwardConfig:
    """b2's tile shape (b1's): 8 warps (two warpgroups, B_c = 128 keys), B_r = 64 queries, d ≤ 128."""
    if d > 128:
        raise ValueError(f"kernels_gpu.hopper's backward rungs take head dimensions up to 128, got d = {d}: "
                         f"kernels_gpu.tensorcore.flash2_backward runs every d up to 256")
    return BackwardConfig(d=d, warps=4 * CONSUMERS, B_r=B_R, dtype=dtype, causal=causal, simulated=simulated)


def _tiles(cfg: BackwardConfig) -> HopperConfig:
    """The forward's tile geometry for these sizes: 128-row tiles (K_j, V_j) and 64-row tiles (Q_i, dO_i)."""
    return HopperConfig(d=cfg.d, B_c=cfg.B_r, dtype=cfg.dtype, causal=cfg.causal, simulated=cfg.simulated,
                        consumers=CONSUMERS)


def _layout(cfg: BackwardConfig) -> tuple:
    """Word offsets, from the aligned base, of K_j, V_j, Q_i, dO_i, the two dS panels, L_i·log₂e and D_i."""
    t = _tiles(cfg)
    kv, q = t.tile_words(cfg.B_c), t.tile_words(cfg.B_r)
    ds = 32 * cfg.B_r                                   # one 64 × 64 panel of 16-bit values
    K_OFF, V_OFF = 0, kv
    Q_OFF, DO_OFF = 2 * kv, 2 * kv + q
    DS_OFF = 2 * kv + 2 * q
    L_OFF = DS_OFF + CONSUMERS * ds
    return K_OFF, V_OFF, Q_OFF, DO_OFF, DS_OFF, ds, L_OFF, L_OFF + cfg.B_r


def shared_words(cfg: BackwardConfig) -> int:
    """32-bit words of dynamic shared memory: the tiles, the dS panels, the statistics, the alignment slack."""
    return _layout(cfg)[-1] + cfg.B_r + ALIGN_BYTES // 4


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig, atomic_dq: bool = True):
    """The b2 key-block kernel for one configuration (compiled on first launch). ``atomic_dq``: it also adds its
    share of dQ into the float32 accumulator (the default, three launches); without, it computes dK_j and dV_j
    only and :func:`make_dq_kernel`'s pass computes dQ (``deterministic=True``)."""
    bst = make_backward_steps(cfg)
    copy_stats, zero = bst["copy_stats_async"], bst["zero"]
    probabilities, softmax_gradient, store_rows = bst["probabilities"], bst["softmax_gradient"], bst["store_rows"]
    hst = make_steps(_tiles(cfg))
    aligned_base, copy_kv, copy_q = hst["aligned_base"], hst["copy_q"], hst["copy_kv"]   # 128- and 64-row tiles
    pr = make_products(cfg.d, cfg.B_r, cfg.B_c, cfg.dtype, cfg.simulated)
    product_transposed, product_accumulate = pr["product_transposed"], pr["product_accumulate"]
    store_ds = pr["store_ds"]
    K_OFF, V_OFF, Q_OFF, DO_OFF, DS_OFF, DS_WORDS, L_OFF, D_OFF = _layout(cfg)
    B_r, B_c, D = cfg.B_r, cfg.B_c, cfg.D
    ATOMIC_DQ = atomic_dq
    jit = tc_device(cfg.simulated)
    S_LEN, C_LEN = B_r // 2, D // 2
    causal = cfg.causal
    # dQ's share, a panel of at most 64 columns at a time (D ≤ 128: one or two panels; the second may be narrower):
    # the two panel products and the four-float adds (kernels_gpu.hopper.backward_steps.make_dq_share)
    dqs = make_dq_share(cfg.d, B_c, cfg.dtype, cfg.simulated)
    dq_panel_0, dq_panel_1, add_dq = dqs["dq_panel_0"], dqs["dq_panel_1"], dqs["add_dq"]
    PANELS, DQ_LEN = dqs["PANELS"], dqs["DQ_LEN"]

    @jit
    def key_block(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2):
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

        # Alg. 2 line 6: load K_j, V_j from HBM to SRAM (they stay for the whole block).
        copy_kv(sm, base + K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, base + V_OFF, V, z, hk, j * B_c, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 2 line 7: dK_j = 0, dV_j = 0 (in registers).
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        # Alg. 2 line 8: for i = 1 … T_r — from the first row block that sees a key of K_j (causal), and for each
        # of the G query heads that read this key/value head (their dK_j, dV_j add up: GQA).
        T_r = (N_q + B_r - 1) // B_r
        i_first = 0
        if causal and j * B_c - diag > 0:
            i_first = min(T_r, (j * B_c - diag) // B_r)
        n_i = T_r - i_first
        for step in range(G * n_i):
            gq = step // n_i
            i = i_first + step - gq * n_i
            h = hk * G + gq
            # Lines 9-10: load Q_i, dO_i, L_i, D_i to SRAM — and wait for them (and, the first time, K_j, V_j).
            cuda.syncthreads()                # both warpgroups are done with the previous row block
            me = int32(ptx.opaque_u32(tid))   # (opaque: the copies' per-thread offsets are not held across rows)
            copy_q(sm, base + Q_OFF, Q, z, h, i * B_r, N_q, me)
            copy_q(sm, base + DO_OFF, dO, z, h, i * B_r, N_q, me)
            copy_stats(smf, base + L_OFF, stats, z, h, i * B_r, me)
            ptx.cp_async_commit()
            ptx.cp_async_wait_all()
            ptx.fence_proxy_async()           # cp.async's writes, visible to the tensor cores' reads
            cuda.syncthreads()
            # The tiles' byte addresses, made anew each row block (an opaque copy of the base): the descriptors
            # computed from them stay in the loop instead of being hoisted and held in registers.
            at = ptx.opaque_u32(sm_byte)
            stats_at = int32(ptx.opaque_u32(base))          # (and so are the addresses of L_i, D_i in SRAM)
            kw_byte, vw_byte, ds_byte = at + 4 * K_OFF + 64 * 128 * wg, at + 4 * V_OFF + 64 * 128 * wg, \
                at + 4 * (DS_OFF + wg * DS_WORDS)

            # Line 11: Sᵀ = K_j Q_iᵀ, the warpgroup's 64 keys × B_r queries (τ is folded into line 13).
            product_transposed(sm, s, kw_byte, at + 4 * Q_OFF)
            # Line 13: Pᵀ = exp(τSᵀ − L_i); the mask only where a key can be invisible to a query of the tile.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, stats_at + L_OFF, key0 + lane // 4, i * B_r, N_k, scale_log2, diag, mask_tile)
            # Line 16: dV_j += Pᵀ dO_i, A straight from Pᵀ's accumulators.
            product_accumulate(sm, dv, s, at + 4 * DO_OFF)
            # Line 17: dPᵀ = V_j dO_iᵀ.
            product_transposed(sm, dp, vw_byte, at + 4 * DO_OFF)
            # Line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            softmax_gradient(s, dp, smf, stats_at + D_OFF)
            # Line 21: dK_j += dSᵀ Q_i (τ applied once, when dK_j is written).
            product_accumulate(sm, dk, s, at + 4 * Q_OFF)
            if ATOMIC_DQ:
                # Line 20: dQ_i += dS K_j for this warpgroup's keys: dS through its own panel, then one wgmma,
                # then atomic adds into HBM (τ applied when dQ is rounded).
                store_ds(sm16, ds_half, s, warp, int32(ptx.opaque_u32(lane)))   # (opaque: see the copies)
                ptx.fence_proxy_async()           # the stores, visible to the tensor cores' reads
                ptx.named_barrier_sync(1 + wg, 128)
                # One 64-column panel of K_j at a time (Alg. 2 line 20 split over d), each added at once.
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
        def flash_backward_b2(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2):
            key_block(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2)
        return flash_backward_b2

    @cfg.jit()
    def flash_backward_b2_kv(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2):
        key_block(Q, K, V, dO, stats, stats, dK, dV, N_q, N_k, G, scale, scale_log2)   # (stats: never written)
    return flash_backward_b2_kv


#: query rows per block of the dQ pass (64 per consumer warpgroup) and keys per tile
DQ_ROWS, DQ_KEYS = 64 * CONSUMERS, B_R


def _dq_layout(cfg: BackwardConfig) -> tuple:
    """Word offsets, from the aligned base, of the dQ pass's Q_i, dO_i (128 rows), K_j and V_j (64 rows)."""
    t = _tiles(cfg)
    rows, keys = t.tile_words(DQ_ROWS), t.tile_words(DQ_KEYS)
    return 0, rows, 2 * rows, 2 * rows + keys, 2 * rows + 2 * keys


def dq_shared_words(cfg: BackwardConfig) -> int:
    """32-bit words of the dQ pass's dynamic shared memory, with the alignment slack."""
    return _dq_layout(cfg)[-1] + ALIGN_BYTES // 4


@functools.lru_cache(maxsize=None)
def make_dq_kernel(cfg: BackwardConfig):
    """The dQ pass (Alg. 2 line 20 as its own pass, FA2 Section 3.2's other order): one block per query block of
    128 rows (64 per consumer warpgroup, the forward's split), looping over key tiles of 64. Per tile and warpgroup
    three wgmma products — S = Q_i K_jᵀ and dP = dO_i V_jᵀ with both operands in shared memory, then dQ_i += dS K_j
    with dS from its accumulators as A registers (the forward's O += P̃V, with K_j in V's place) — and no atomic
    add: dQ_i is summed inside one block in a fixed order and written once, so it is the same bits on every run."""
    bst = make_backward_steps(cfg)
    zero, store_rows = bst["zero"], bst["store_rows"]
    probabilities, softmax_gradient = bst["probabilities_rows"], bst["softmax_gradient_rows"]
    hst = make_steps(_tiles(cfg))
    aligned_base, copy_rows, copy_keys = hst["aligned_base"], hst["copy_q"], hst["copy_kv"]  # 128 and 64 rows
    pr = make_products(cfg.d, cfg.B_r, cfg.B_c, cfg.dtype, cfg.simulated)
    product_transposed, product_accumulate = pr["product_transposed"], pr["product_accumulate"]
    Q_OFF, DO_OFF, K_OFF, V_OFF, _ = _dq_layout(cfg)
    S_LEN, C_LEN = DQ_KEYS // 2, cfg.D // 2
    causal = cfg.causal

    @cfg.jit(dq=True)
    def flash_backward_b2_dq(Q, K, V, dO, stats, dQ, N_q, N_k, G, scale, scale_log2):
        tid = cuda.threadIdx.x
        wg = tid // 128                       # the consumer warpgroup: rows 64·wg … 64·wg + 63 of the block
        warp = (tid % 128) // 32
        lane = cuda.laneid
        i = cuda.blockIdx.x                   # query block i (one block per i, as the forward)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)
        base = aligned_base(sm)
        sm_byte = ptx.shared_byte_address(sm, 0) + 4 * base
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dq = cuda.local.array(C_LEN, float32)
        lrow = cuda.local.array(2, float32)
        drow = cuda.local.array(2, float32)
        diag = N_k - N_q
        first_row = i * DQ_ROWS + 64 * wg + 16 * warp
        row0 = first_row + lane // 4          # this lane's first row; its second is row0 + 8
        qw_byte = sm_byte + 4 * Q_OFF + 64 * 128 * wg      # this warpgroup's rows of Q_i and dO_i
        dow_byte = sm_byte + 4 * DO_OFF + 64 * 128 * wg
        # Alg. 2 line 10 for the lane's two rows: L·log₂e and D (+∞ and 0 past N_q: P = 0, dS = 0).
        for hh in range(2):
            lrow[hh] = stats[z, h, 0, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(math.inf)
            drow[hh] = stats[z, h, 1, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(0.0)
        # Causal: the key tiles right of the block's last row's diagonal are never visited.
        n_tiles = (N_k + DQ_KEYS - 1) // DQ_KEYS
        if causal:
            last = min(N_k, (i + 1) * DQ_ROWS + diag)
            n_tiles = max(0, (last + DQ_KEYS - 1) // DQ_KEYS)
        copy_rows(sm, base + Q_OFF, Q, z, h, i * DQ_ROWS, N_q, tid)
        copy_rows(sm, base + DO_OFF, dO, z, h, i * DQ_ROWS, N_q, tid)
        zero(dq, C_LEN)                       # Alg. 2 line 3 for this block's rows: dQ_i = 0, in registers
        for jt in range(n_tiles):
            # Alg. 2 line 6 (this order's): K_j, V_j to SRAM, waited for at once.
            cuda.syncthreads()                # both warpgroups are done with the previous tile
            copy_keys(sm, base + K_OFF, K, z, hk, jt * DQ_KEYS, N_k, tid)
            copy_keys(sm, base + V_OFF, V, z, hk, jt * DQ_KEYS, N_k, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_all()
            ptx.fence_proxy_async()
            cuda.syncthreads()
            # Line 11: S_ij = Q_i K_jᵀ; line 13: P_ij = exp(τS_ij − L_i), masked where a key can be invisible.
            product_transposed(sm, s, qw_byte, sm_byte + 4 * K_OFF)
            mask_tile = (jt + 1) * DQ_KEYS > N_k or (causal and (jt + 1) * DQ_KEYS - 1 > i * DQ_ROWS + diag)
            probabilities(s, lrow, row0, jt * DQ_KEYS, N_k, scale_log2, diag, mask_tile)
            # Line 17: dP_ij = dO_i V_jᵀ; line 19: dS_ij = P_ij ∘ (dP_ij − D_i).
            product_transposed(sm, dp, dow_byte, sm_byte + 4 * V_OFF)
            softmax_gradient(s, dp, drow)
            # Line 20: dQ_i += dS_ij K_j, dS straight from the accumulators.
            product_accumulate(sm, dq, s, sm_byte + 4 * K_OFF)
        # dQ_i = τ · Σ_j dS_ij K_j, written once in the input dtype.
        store_rows(dq, dQ, z, h, first_row, N_q, 0, scale, lane)

    return flash_backward_b2_dq


def dq_pass_grids(cfg: BackwardConfig, p) -> tuple:
    """The deterministic mode's two grids: (key blocks of 128, H_kv, Z) and (query blocks of 128, H_q, Z)."""
    return ((-(-p.N_k // cfg.B_c), p.H_kv, p.Z), (-(-p.N_q // DQ_ROWS), p.H_q, p.Z))


def flash_backward(Q, K, V, O, L, dO, causal=False, scale=None, deterministic=False):
    """FA2 backward on wgmma, rung b2: ``Flash2Backward(dQ, dK, dV)`` in the inputs' kind and dtype (float16 or
    bfloat16), from the forward's O and L (natural log, +∞ on rows that see no key) and dO; Q (…, N_q, d), K, V
    (…, N_k, d), d a multiple of 8 up to 128, GQA by head mapping, ``causal`` bottom-right aligned. Cost: the
    model's 2.5 × the forward's FLOPs, dQ's 2·N_q·d·T_c atomic adds.

    dK and dV are summed inside one block in a fixed order, so they are the same bits on every run; dQ is a sum of
    atomic adds whose order varies. ``deterministic=True`` gives bit-identical gradients every run: dQ in a pass
    of its own (:func:`make_dq_kernel`), which recomputes S and dP per query block instead of adding into HBM —
    7 products per (row block, key block) pair instead of 5, and no atomics."""
    hopper_launch.require_hopper()
    if deterministic:
        return backward_launch.run_backward_dq_pass(
            functools.partial(make_kernel, atomic_dq=False), make_dq_kernel, config_for, shared_words,
            dq_shared_words, Q, K, V, O, L, dO, causal=causal, scale=scale, grids_for=dq_pass_grids)
    return backward_launch.run_backward(make_kernel, config_for, shared_words, Q, K, V, O, L, dO, causal=causal,
                                        scale=scale)
