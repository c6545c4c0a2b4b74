"""Hopper FA2 backward, b1: FA2 Algorithm 2 on warpgroup MMAs — two consumer warpgroups per key block, dQ by
atomic adds (the mma.sync backward v1's algorithm, every product a wgmma).

A block owns the key block K_j, V_j of B_c = 128 keys (grid T_c × H_kv × batch); warpgroup w computes for keys
64w … 64w + 63, keeping dK_j and dV_j of its keys in registers for the whole loop over the query heads of the GQA
group and the row blocks Q_i of B_r = 64 queries (so a key/value head's gradients are summed in one block,
deterministically). Per row block, five products per warpgroup (:mod:`kernels_gpu.hopper.backward_steps` has the
table): Sᵀ and dPᵀ with both operands in shared memory, dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i with Pᵀ and dSᵀ taken
from the accumulators as A registers, and dQ_i's share with dS, transposed through shared memory, as A. Each
warpgroup adds its 64 × d share of dQ_i into a float32 copy of dQ in HBM with atomic adds (as every key block
does), and one small kernel rounds it at the end; D = rowsum(dO ∘ O) and L·log₂e come from the mma.sync backward's
preprocessing launch (:func:`kernels_gpu.tensorcore.backward_launch.run_backward`: the same three launches).

Q_i, dO_i, L_i, D_i are copied with ``cp.async`` into one buffer and waited for at once, behind a block barrier
(both warpgroups read them): no copy overlaps a product yet. Head dimensions up to 128 (dK_j and dV_j take d
registers a thread; beyond, the op keeps the mma.sync backward).

**Deterministic mode** (``deterministic=True``): the key-block kernel computes dK_j and dV_j only, and a second
kernel computes dQ the other way round — one block per query block of 128 rows, looping over key tiles of 64,
recomputing S and dP (three products per tile: S, dP, dQ += dS K_j with dS from the accumulators) and writing dQ
once. No atomic adds, so every gradient is the same bits on every run; 7 products per (row block, key block) pair
instead of 5.

**Prediction (written before the first GPU run, none yet).** Per row block a warpgroup issues 5 products of
2·64·64·d FLOPs each (d = 128: 5.2 MFLOP), about 1.4 µs of the SM's tensor cores for the block's two warpgroups
at the 913 TFLOP/s the forward's ceiling measured; the unhidden copy of Q_i and dO_i (32 KiB at d = 128) adds
about 1 µs of latency per row block, and the 8 192 atomic adds of dQ_i's two shares, two block barriers and the
element-wise steps (two exp2-free passes over 64 × 64 values) add about as much again. Expected at d = 128,
N ≥ 4096, bf16, non-causal: 150-250 TFLOP/s by the model backward = 2.5 × forward — below the mma.sync v7
backward's figures on the same GPU if the copies dominate, above them if the products do; the next rung
double-buffers Q_i and dO_i through TMA.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, uint16, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper import launch as hopper_launch
from kernels_gpu.hopper.backward_steps import make_products
from kernels_gpu.hopper.steps import ALIGN_BYTES, HopperConfig, make_steps
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps
from kernels_gpu.tensorcore.steps import device as tc_device

__all__ = ["flash_backward", "make_kernel", "make_dq_kernel", "config_for", "shared_words", "dq_shared_words"]

#: queries per row block Q_i (the M of dQ_i's wgmma) and consumer warpgroups per key block (64 keys each)
B_R, CONSUMERS = 64, 2


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> BackwardConfig:
    """b1's tile shape: 8 warps (two warpgroups, B_c = 128 keys), B_r = 64 queries, d ≤ 128."""
    if d > 128:
        raise ValueError(f"kernels_gpu.hopper.flash_backward takes head dimensions up to 128, got d = {d}: "
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
    """The b1 key-block kernel for one configuration (compiled on first launch). ``atomic_dq``: it also adds its
    share of dQ into the float32 accumulator (the default, three launches); without, it computes dK_j and dV_j
    only and :func:`make_dq_kernel`'s pass computes dQ (``deterministic=True``)."""
    bst = make_backward_steps(cfg)
    copy_stats, zero = bst["copy_stats_async"], bst["zero"]
    probabilities, softmax_gradient, store_rows = bst["probabilities"], bst["softmax_gradient"], bst["store_rows"]
    hst = make_steps(_tiles(cfg))
    aligned_base, copy_kv, copy_q = hst["aligned_base"], hst["copy_q"], hst["copy_kv"]   # 128- and 64-row tiles
    pr = make_products(cfg.d, cfg.B_r, cfg.B_c, cfg.dtype, cfg.simulated)
    product_transposed, product_accumulate = pr["product_transposed"], pr["product_accumulate"]
    store_ds, dq_partial = pr["store_ds"], pr["dq_partial"]
    K_OFF, V_OFF, Q_OFF, DO_OFF, DS_OFF, DS_WORDS, L_OFF, D_OFF = _layout(cfg)
    B_r, B_c, D = cfg.B_r, cfg.B_c, cfg.D
    ATOMIC_DQ = atomic_dq
    jit = tc_device(cfg.simulated)
    S_LEN, C_LEN = B_r // 2, D // 2
    DW = cfg.d // 2
    causal = cfg.causal

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
        dq = cuda.local.array(C_LEN, float32)
        diag = N_k - N_q
        key0 = j * B_c + 64 * wg + 16 * warp  # the warp's first key
        kw_byte = sm_byte + 4 * K_OFF + 64 * 128 * wg      # this warpgroup's rows of K_j (and of V_j below)
        vw_byte = sm_byte + 4 * V_OFF + 64 * 128 * wg
        ds_byte = sm_byte + 4 * (DS_OFF + wg * DS_WORDS)
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
            copy_q(sm, base + Q_OFF, Q, z, h, i * B_r, N_q, tid)
            copy_q(sm, base + DO_OFF, dO, z, h, i * B_r, N_q, tid)
            copy_stats(smf, base + L_OFF, stats, z, h, i * B_r, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_all()
            ptx.fence_proxy_async()           # cp.async's writes, visible to the tensor cores' reads
            cuda.syncthreads()

            # Line 11: Sᵀ = K_j Q_iᵀ, the warpgroup's 64 keys × B_r queries (τ is folded into line 13).
            product_transposed(sm, s, kw_byte, sm_byte + 4 * Q_OFF)
            # Line 13: Pᵀ = exp(τSᵀ − L_i); the mask only where a key can be invisible to a query of the tile.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, base + L_OFF, key0 + lane // 4, i * B_r, N_k, scale_log2, diag, mask_tile)
            # Line 16: dV_j += Pᵀ dO_i, A straight from Pᵀ's accumulators.
            product_accumulate(sm, dv, s, sm_byte + 4 * DO_OFF)
            # Line 17: dPᵀ = V_j dO_iᵀ.
            product_transposed(sm, dp, vw_byte, sm_byte + 4 * DO_OFF)
            # Line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            softmax_gradient(s, dp, smf, base + D_OFF)
            # Line 21: dK_j += dSᵀ Q_i (τ applied once, when dK_j is written).
            product_accumulate(sm, dk, s, sm_byte + 4 * Q_OFF)
            if ATOMIC_DQ:
                # Line 20: dQ_i += dS K_j for this warpgroup's keys: dS through its own panel, then one wgmma,
                # then atomic adds into HBM (τ applied when dQ is rounded).
                store_ds(sm16, ds_half, s, warp, lane)
                ptx.fence_proxy_async()           # the stores, visible to the tensor cores' reads
                ptx.named_barrier_sync(1 + wg, 128)
                dq_partial(sm, dq, ds_byte, kw_byte)
                g = lane // 4
                t = lane % 4
                for hh in range(2):
                    row = i * B_r + 16 * warp + g + 8 * hh
                    if row < N_q:
                        for n in range(D // 8):
                            for e in range(2):
                                col = 8 * n + 2 * t + e
                                if col < 2 * DW:
                                    cuda.atomic.add(dQacc, (z, h, row, col), dq[4 * n + 2 * hh + e])
                ptx.named_barrier_sync(1 + wg, 128)   # the panel is read before the next row block's stores
        # Alg. 2 line 24: write dK_j (times τ) and dV_j to HBM.
        store_rows(dk, dK, z, hk, key0, N_k, 0, scale, lane)
        store_rows(dv, dV, z, hk, key0, N_k, 0, float32(1.0), lane)

    if atomic_dq:
        @cfg.jit()
        def flash_backward_b1(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2):
            key_block(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2)
        return flash_backward_b1

    @cfg.jit()
    def flash_backward_b1_kv(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2):
        key_block(Q, K, V, dO, stats, stats, dK, dV, N_q, N_k, G, scale, scale_log2)   # (stats: never written)
    return flash_backward_b1_kv


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
    def flash_backward_b1_dq(Q, K, V, dO, stats, dQ, N_q, N_k, G, scale, scale_log2):
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

    return flash_backward_b1_dq


def dq_pass_grids(cfg: BackwardConfig, p) -> tuple:
    """The deterministic mode's two grids: (key blocks of 128, H_kv, Z) and (query blocks of 128, H_q, Z)."""
    return ((-(-p.N_k // cfg.B_c), p.H_kv, p.Z), (-(-p.N_q // DQ_ROWS), p.H_q, p.Z))


def flash_backward(Q, K, V, O, L, dO, causal=False, scale=None, deterministic=False):
    """FA2 backward on wgmma, rung b1: ``Flash2Backward(dQ, dK, dV)`` in the inputs' kind and dtype (float16 or
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
