"""The steps of the Hopper backward rungs: FA2 Algorithm 2's five products as warpgroup MMAs.

The work split is the mma.sync backward's (:mod:`kernels_gpu.tensorcore.backward_steps`): a block owns the key
block K_j, V_j of B_c = 64 · consumers keys, each consumer warpgroup 64 of them (warp w of it keys 16w … 16w + 15,
as a mma.sync warp), and loops over the query heads of its GQA group and the row blocks Q_i of B_r queries.
Every product a warpgroup accumulates has its keys as rows — the *transposed* products — except dQ:

=========================  =====================  ==============================  ==============================
Alg. 2 step                wgmma (per WG)         A                               B
=========================  =====================  ==============================  ==============================
line 11  Sᵀ = K_j Q_iᵀ     m64n{B_r}k16 × D/16    K_j's 64 rows, smem, K-major    Q_i, smem, K-major
line 16  dV_j += Pᵀ dO_i   m64n{D}k16 × B_r/16    Pᵀ, registers (packed)          dO_i, smem, MN-major
line 17  dPᵀ = V_j dO_iᵀ   m64n{B_r}k16 × D/16    V_j's 64 rows, smem, K-major    dO_i, smem, K-major
line 21  dK_j += dSᵀ Q_i   m64n{D}k16 × B_r/16    dSᵀ, registers (packed)         Q_i, smem, MN-major
line 20  dQ_i += dS K_j    m64n{D}k16 × 4         dS, smem, K-major (stored)      K_j's 64 rows, smem, MN-major
=========================  =====================  ==============================  ==============================

A wgmma accumulator is laid out warp by warp as mma.sync's (:mod:`kernels_gpu.wgmma_layout`), so the element-wise
steps — Pᵀ = 2^(Sᵀ·τlog₂e − L·log₂e) with the causal mask, dSᵀ = Pᵀ ∘ (dPᵀ − D), the stores of dK_j, dV_j — are
the mma.sync backward's own device functions, unchanged. dQ needs the queries as rows: each warpgroup writes its
64 × B_r slice of dSᵀ, transposed and rounded to 16 bits, into a 128-byte-swizzled panel of its own (queries as
rows, its 64 keys as columns: the K-major A operand of the next wgmma), and multiplies it by its 64 rows of K_j;
the two warpgroups' partial dQ_i are added to a float32 copy of dQ with atomic adds, as every key block's are.

Tiles in shared memory are the forward's panels (:mod:`kernels_gpu.hopper.steps`): 64-column panels of 128-byte
rows, swizzled, every tile on a 1024-byte boundary.
"""

from __future__ import annotations

import functools

from numba import uint16, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper.steps import SBO, SWIZZLE_128B

__all__ = ["make_products", "make_dq_share"]


@functools.lru_cache(maxsize=None)
def make_products(d: int, B_r: int, B_c: int, dtype: str, simulated: bool):
    """The backward's wgmma products for head dimension ``d`` (D = d rounded up to 16), B_r queries a row block and
    B_c keys a key block (their tiles in the panel layout); device functions of (smem, accumulators, byte
    addresses…), each issued, committed and waited for before it returns."""
    from kernels_gpu.tensorcore import steps as tc_steps
    jit = tc_steps.device(simulated)
    D = -(-d // 16) * 16
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2
    descriptor = ptx.descriptor
    KS = D // 16                       # k-steps over d
    KR = B_r // 16                     # k-steps over a row block's queries
    transposed = ptx.make_wgmma(dtype, B_r, "smem", False)
    accumulate = ptx.make_wgmma(dtype, D, "regs", True)
    dq_wgmma = ptx.make_wgmma(dtype, D, "smem", True)
    fence_t, wait_t = ptx.make_wgmma_fence(B_r // 2), ptx.make_wgmma_wait(0, B_r // 2)
    fence_d, wait_d = ptx.make_wgmma_fence(D // 2), ptx.make_wgmma_wait(0, D // 2)

    @jit
    def product_transposed(sm, acc, x_byte, y_byte):
        """acc (64 × B_r) = X Yᵀ over d: X the warpgroup's 64 rows of K_j or V_j (``x_byte``: the byte address of
        its first row in panel 0 of a B_c-row tile), Y the B_r rows of Q_i or dO_i (``y_byte``). Alg. 2 lines 11
        and 17. 2·64·B_r·D FLOPs per warpgroup in D/16 instructions."""
        fence_t(acc)
        for kk in range(KS):
            panel, step = kk // 4, 32 * (kk % 4)
            desc_x = descriptor(x_byte + panel * (B_c * 128) + step, 16, SBO, SWIZZLE_128B)
            desc_y = descriptor(y_byte + panel * (B_r * 128) + step, 16, SBO, SWIZZLE_128B)
            transposed(sm, acc, desc_x, desc_y, uint32(kk > 0))
        ptx.wgmma_commit()
        wait_t(acc)

    @jit
    def product_accumulate(sm, acc, s, y_byte):
        """acc (64 × D) += S Y: S the warpgroup's 64 × B_r accumulators ``s`` (Pᵀ or dSᵀ), packed to 16 bits as the
        A registers — the accumulators of queries 16kk … 16kk + 15 are step kk's — and Y the B_r × D tile of dO_i or
        Q_i read MN-major (its rows are the sum's index). Alg. 2 lines 16 and 21."""
        fence_d(acc)
        for kk in range(KR):
            a0 = pack(s[8 * kk], s[8 * kk + 1])
            a1 = pack(s[8 * kk + 2], s[8 * kk + 3])
            a2 = pack(s[8 * kk + 4], s[8 * kk + 5])
            a3 = pack(s[8 * kk + 6], s[8 * kk + 7])
            desc_y = descriptor(y_byte + kk * (16 * 128), B_r * 128, SBO, SWIZZLE_128B)
            accumulate(sm, acc, a0, a1, a2, a3, desc_y, uint32(1))
        ptx.wgmma_commit()
        wait_d(acc)

    @jit
    def store_ds(sm16, ds_half, s, warp, lane):
        """The warpgroup's dSᵀ (keys 16w + g + 8h × queries 8n + 2t + e in ``s``) into its dS panel at 16-bit
        index ``ds_half``, transposed — row = query, column = key, 128 bytes a row, swizzled — rounded to 16 bits.
        (Two keys of one query are held by different lanes, so each element is a store of its own.)"""
        g = lane // 4
        t = lane % 4
        for n in range(B_r // 8):
            for h in range(2):
                key = 16 * warp + g + 8 * h
                for e in range(2):
                    q = 8 * n + 2 * t + e
                    bits = pack(s[4 * n + 2 * h + e], s[4 * n + 2 * h + e]) & uint32(0xFFFF)
                    sm16[ds_half + q * 64 + 8 * ((key // 8) ^ (q % 8)) + key % 8] = uint16(bits)

    @jit
    def dq_partial(sm, acc, ds_byte, k_byte):
        """acc (B_r × D, B_r = 64) = dS K_w: dS this warpgroup's 64 queries × 64 keys (its panel, K-major), K_w its
        64 rows of K_j read MN-major (``k_byte``: the byte address of its first row in panel 0). Alg. 2 line 20
        for this warpgroup's keys; the caller adds the result to dQ."""
        fence_d(acc)
        for kk in range(4):
            desc_ds = descriptor(ds_byte + 32 * kk, 16, SBO, SWIZZLE_128B)
            desc_k = descriptor(k_byte + kk * (16 * 128), B_c * 128, SBO, SWIZZLE_128B)
            dq_wgmma(sm, acc, desc_ds, desc_k, uint32(kk > 0))
        ptx.wgmma_commit()
        wait_d(acc)

    return dict(product_transposed=product_transposed, product_accumulate=product_accumulate, store_ds=store_ds,
                dq_partial=dq_partial)


@functools.lru_cache(maxsize=None)
def make_dq_share(d: int, B_c: int, dtype: str, simulated: bool):
    """dQ's share of a key block, a 64-column panel at a time (b2's scheme, shared by the rungs after it): for head
    dimension ``d`` (D = d rounded up to 16: one panel of min(64, D) columns, and a second of D − 64 when D > 64)
    and B_c keys a block. Returns the device functions ``dq_panel_0``, ``dq_panel_1`` (Alg. 2 line 20 for one
    warpgroup's 64 keys and one panel of d) and ``add_dq`` (that panel added into the float32 dQ in HBM by
    ``red.global.add.v4.f32``), and the constants ``PANELS`` and ``DQ_LEN`` (floats per thread of one panel)."""
    from kernels_gpu.tensorcore import steps as tc_steps
    jit = tc_steps.device(simulated)
    D = -(-d // 16) * 16
    PANELS = -(-D // 64)
    N0, N1 = min(64, D), D - 64
    DQ_LEN = N0 // 2
    dq_wgmma_0 = ptx.make_wgmma(dtype, N0, "smem", True)
    dq_wgmma_1 = ptx.make_wgmma(dtype, N1, "smem", True) if PANELS > 1 else dq_wgmma_0
    fence_0, wait_0 = ptx.make_wgmma_fence(N0 // 2), ptx.make_wgmma_wait(0, N0 // 2)
    fence_1 = ptx.make_wgmma_fence(max(N1, 8) // 2)
    wait_1 = ptx.make_wgmma_wait(0, max(N1, 8) // 2)
    descriptor, shfl_xor = ptx.descriptor, ptx.shfl_xor

    @jit
    def dq_panel_0(sm, acc, ds_byte, k_byte):
        """acc (64 × N0) = dS K_w[:, 0:N0]: dS the warpgroup's 64 queries × 64 keys (its panel, K-major), K_w its
        64 rows of K_j, panel 0, read MN-major (``k_byte``: its first row's byte address). Alg. 2 line 20, the
        first 64 columns of d."""
        fence_0(acc)
        for kk in range(4):
            desc_ds = descriptor(ds_byte + 32 * kk, 16, SBO, SWIZZLE_128B)
            desc_k = descriptor(k_byte + kk * (16 * 128), B_c * 128, SBO, SWIZZLE_128B)
            dq_wgmma_0(sm, acc, desc_ds, desc_k, uint32(kk > 0))
        ptx.wgmma_commit()
        wait_0(acc)

    @jit
    def dq_panel_1(sm, acc, ds_byte, k_byte):
        """:func:`dq_panel_0` for columns 64 … D − 1 (``k_byte``: the first row of panel 1)."""
        fence_1(acc)
        for kk in range(4):
            desc_ds = descriptor(ds_byte + 32 * kk, 16, SBO, SWIZZLE_128B)
            desc_k = descriptor(k_byte + kk * (16 * 128), B_c * 128, SBO, SWIZZLE_128B)
            dq_wgmma_1(sm, acc, desc_ds, desc_k, uint32(kk > 0))
        ptx.wgmma_commit()
        wait_1(acc)

    @jit
    def add_dq(dQacc, acc, z, h, row0, col0, N_q, lane):
        """Add a panel's share (``acc``: rows row0 + g, row0 + g + 8 of the warp, columns col0 + 8n + 2t + e) into
        the float32 dQ in HBM, four adjacent floats per ``red.global.add.v4``: lanes t and t ^ 1 swap halves, so
        that an even lane holds four columns of row g and an odd one four of row g + 8. Every lane of the warp
        takes part in the exchange (a warp-wide shuffle); the adds skip rows past N_q and columns past d."""
        g = lane // 4
        t = lane % 4
        odd = t % 2
        H, dd = dQacc.shape[1], dQacc.shape[3]
        row = row0 + g + 8 * odd
        base = ((z * H + h) * N_q + row) * dd
        for n in range(DQ_LEN // 4):
            mine0, mine1 = acc[4 * n], acc[4 * n + 1]            # row g
            other0, other1 = acc[4 * n + 2], acc[4 * n + 3]      # row g + 8
            r0 = shfl_xor(other0 if odd == 0 else mine0, 1)
            r1 = shfl_xor(other1 if odd == 0 else mine1, 1)
            col = col0 + 8 * n + 2 * (t - odd)
            if row < N_q and col < dd:
                if odd == 0:
                    ptx.red_add_v4_f32(dQacc, base + col, mine0, mine1, r0, r1)
                else:
                    ptx.red_add_v4_f32(dQacc, base + col, r0, r1, other0, other1)

    return dict(dq_panel_0=dq_panel_0, dq_panel_1=dq_panel_1, add_dq=add_dq, PANELS=PANELS, DQ_LEN=DQ_LEN)
