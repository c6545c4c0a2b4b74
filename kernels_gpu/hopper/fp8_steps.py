"""The steps of the FP8 forward rung (``flash_forward_fp8.py``) that differ from the 16-bit rungs', as small device
functions: FA3 Section 3.3 on Hopper's FP8 tensor cores.

What changes when Q, K, V are float8 e4m3 (one byte an element), step by step:

* **Tiles.** A 128-byte swizzled panel holds 128 elements of a row (not 64): Q_i, K_j, V_j of d ≤ 128 are one
  panel, d = 256 two. The TMA copies them as they copy 16-bit tiles — a box of 128 bytes × R rows (the tensor map
  sees each row as d/2 16-bit units: the copy engine moves bytes, the swizzle is of byte addresses,
  :mod:`kernels_gpu.hopper.launch`).
* **S = Q Kᵀ**: one ``wgmma m64n{B_c}k32 .e4m3`` per 32 columns of d, both operands K-major from shared memory, the
  descriptors' byte arithmetic that of the 16-bit rungs (32 bytes a step).
* **Vᵀ in shared memory.** ``O += P̃ V`` reduces over keys, so V_j is its K × N operand with the keys as K — and V
  arrives with d contiguous (MN-major). The 8-bit wgmma reads K-major only, so every V_j tile is **transposed in
  shared memory** after its copy lands (:func:`transpose_v`): the 256 threads each move 4 × 4-byte blocks (four
  32-bit loads, a byte transpose in registers, four 32-bit stores) into Vᵀ, d rows of 128 bytes, swizzled. Its
  keys go in the order π of :func:`kernels_gpu.wgmma_layout.p_key_of_a_column`, which lets P̃ go to the tensor
  core as the accumulators hold it.
* **P̃ in FP8.** ``P̃ = 2⁸·exp(S − m)`` (FA3's ``Max_offset`` = 8: P̃ fills [0, 256], small probabilities stay
  above e4m3's subnormals; the factor cancels in ℓ), then four accumulators at a time rounded to e4m3 and packed
  into one register (:func:`kernels_gpu.ptx.pack_e4m3x4`), the A operand of ``wgmma m64n{d}k32 .e4m3`` with Vᵀ
  as B.
* **Descales.** ``S = (Q₈K₈ᵀ)·τ·δ_q·δ_k``: the product of the descales joins τ·log₂e (one scalar per (batch,
  head)); ``O = δ_v·Õ/ℓ``: δ_v joins 1/ℓ in the final rescale. L = m + log(ℓ/2⁸), O rounded to bfloat16.

Register arrays per thread (a consumer warpgroup's 64 rows, as :mod:`kernels_gpu.hopper.steps`): ``s`` B_c/2
floats (S, then P̃), ``o`` d/2 floats (Õ), ``m``, ``l`` 2 each — the accumulator layout of ``m64nNk32`` is that of
``m64nNk16``.

Shared memory (32-bit words from a 1024-byte boundary): Q_i (32·B_r·panels), ``stages`` × (K_j, V_j) (32·B_c·panels
each), Vᵀ (32·d: d rows of 128 bytes), then the mbarriers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper.steps import ALIGN_BYTES, SBO, SWIZZLE_128B
from kernels_gpu.tensorcore import steps as tc_steps
from kernels_gpu.tensorcore.steps import LN2

__all__ = ["Fp8Config", "make_fp8_steps", "shared_bytes", "P_OFFSET"]

#: FA3's Max_offset for FP8 (``fa2edu.fp8.P_OFFSET``): P̃ = 2^P_OFFSET · exp(S − m)
P_OFFSET = 8


@dataclass(frozen=True)
class Fp8Config:
    """The compile-time constants of the FP8 rung: head dimension ``d`` (a multiple of 16, 16 … 256), ``B_c`` keys
    per K/V tile (a multiple of 32, at most 128: Vᵀ's rows are one 128-byte panel), causal or not, simulated or
    not, ``stages`` K/V tiles in flight. Two consumer warpgroups: B_r = 128, 256 threads."""

    d: int
    B_c: int
    causal: bool
    simulated: bool
    stages: int = 2

    def __post_init__(self):
        if self.d % 16 or not 16 <= self.d <= 256:
            raise ValueError(f"d must be a multiple of 16 in [16, 256], got {self.d}")
        if self.B_c % 32 or not 32 <= self.B_c <= 128:
            raise ValueError(f"B_c must be 32, 64, 96 or 128 (whole 32-key steps, one 128-byte row of Vᵀ), "
                             f"got {self.B_c}")
        if self.stages < 1:
            raise ValueError(f"stages must be at least 1, got {self.stages}")

    B_r = 128
    threads = 256

    @property
    def D(self) -> int:
        """The N of O's products: d (a multiple of 16)."""
        return self.d

    @property
    def panels(self) -> int:
        """128-byte (128-element) panels per tile row."""
        return -(-self.d // 128)

    def tile_words(self, rows: int) -> int:
        """32-bit words of a Q, K or V tile of ``rows`` rows."""
        return 32 * rows * self.panels

    @property
    def vt_words(self) -> int:
        """32-bit words of Vᵀ: d rows of 128 bytes."""
        return 32 * self.d

    @property
    def tc(self) -> tc_steps.Config:
        """The mma.sync ladder's configuration with the same per-warp arrays (its ``zero`` and ``init_stats``)."""
        return tc_steps.Config(d=self.d, warps=4, B_c=self.B_c, dtype="bfloat16", causal=self.causal,
                               simulated=self.simulated, row_tiles=1)


def shared_bytes(cfg: Fp8Config) -> int:
    """Dynamic shared memory of the rung: Q_i, the stages, Vᵀ, the alignment slack and the mbarriers."""
    words = cfg.tile_words(cfg.B_r) + 2 * cfg.stages * cfg.tile_words(cfg.B_c) + cfg.vt_words
    return 4 * words + ALIGN_BYTES + 8 * (cfg.stages + 2)


@functools.lru_cache(maxsize=None)
def make_fp8_steps(cfg: Fp8Config):
    """The FP8 rung's device functions for ``cfg`` (sizes are compile-time constants of each)."""
    jit = tc_steps.device(cfg.simulated)
    shared = tc_steps.make_steps(cfg.tc)
    descriptor = ptx.descriptor
    pack8 = ptx.pack_e4m3x4
    ex2 = ptx.ex2
    shfl_xor = ptx.shfl_xor
    B_r, B_c, D, P = cfg.B_r, cfg.B_c, cfg.D, cfg.panels
    KS = -(-cfg.d // 32)                  # 32-wide steps of S = Q Kᵀ along d (zeros past d in the panel)
    KV = B_c // 32                        # 32-key steps of O += P̃ V
    NT, NO = B_c // 8, D // 8             # 8-column accumulator tiles of S and of O per thread row
    DW = cfg.d // 2                       # 32-bit words of a bfloat16 O row in HBM
    BLOCKS = (B_c // 4) * (D // 4)        # 4 × 4-byte blocks of one V tile
    THREADS = cfg.threads
    causal = cfg.causal
    neg_inf = float32(-math.inf)
    offset = float32(P_OFFSET)
    wgmma_qk = ptx.make_wgmma_fp8(B_c, "smem")
    wgmma_pv = ptx.make_wgmma_fp8(D, "regs")
    wait_s = ptx.make_wgmma_wait(0, B_c // 2)
    wait_o = ptx.make_wgmma_wait(0, D // 2)
    fence_s = ptx.make_wgmma_fence(B_c // 2)
    fence_o = ptx.make_wgmma_fence(D // 2)
    pack_bf16 = ptx.pack_bf16x2

    @jit
    def aligned_base(sm):
        """The first word of the dynamic shared memory on a 1024-byte boundary (the swizzle pattern's)."""
        a = ptx.shared_byte_address(sm, 0)
        return ((uint32(1024) - (a & uint32(1023))) & uint32(1023)) >> uint32(2)

    def make_tma_tile(ROWS: int):
        @jit
        def tma_tile(sm, dst, tmap, row0, h, z, bar):
            """Issue the TMA copies of rows row0 … row0 + ROWS − 1 (head h, batch z) of the e4m3 tensor behind
            ``tmap`` into the tile at word ``dst``: one box of 128 bytes (128 elements) × ROWS rows per panel,
            landing swizzled, zeros past N and d; the bytes complete the mbarrier at word ``bar`` (FA2 Alg. 1
            lines 4 and 7). The map counts a row in 16-bit units, so panel p starts at unit 64p."""
            for p in range(P):
                ptx.tensor_copy_4d(sm, dst + p * (32 * ROWS), tmap, 64 * p, row0, h, z, bar)
        return tma_tile

    @jit
    def s_equals_q_kt(sm, s, q_byte, k_byte):
        """FA2 Alg. 1 line 8 on FP8, S_ij = Q₈,i K₈,jᵀ (unscaled: τ·δ_q·δ_k is applied in the softmax) for the
        warpgroup's 64 rows: one ``wgmma m64n{B_c}k32 .e4m3`` per 32 columns of d, both operands K-major from
        shared memory (128-byte swizzle, SBO 1024: the step kk's start is 32·(kk mod 4) bytes into panel
        kk // 4). Issued, committed and waited for here."""
        fence_s(s)
        for kk in range(KS):
            panel, step = kk // 4, 32 * (kk % 4)
            desc_q = descriptor(q_byte + panel * (B_r * 128) + step, 16, SBO, SWIZZLE_128B)
            desc_k = descriptor(k_byte + panel * (B_c * 128) + step, 16, SBO, SWIZZLE_128B)
            wgmma_qk(sm, s, desc_q, desc_k, uint32(kk > 0))
        ptx.wgmma_commit()
        wait_s(s)

    @jit
    def transpose_v(sm, v_off, vt_off, tid):
        """FA3 §3.3's in-kernel transpose: V_j (B_c keys × d bytes, as the TMA landed it: panels of 128-byte rows,
        swizzled) → Vᵀ (d rows × B_c keys, one 128-byte swizzled row each), the K-major B operand of O += P̃ V.
        The keys of each 32-key step go in the order π (Vᵀ's byte a of a step holds key π(a),
        :func:`kernels_gpu.wgmma_layout.p_key_of_a_column`), so that P̃'s accumulators need no shuffle.

        Each of the block's 256 threads takes 4 × 4-byte blocks in turn: Vᵀ's word (row n0 … n0 + 3, bytes a0 …
        a0 + 3) needs keys π(a0 … a0 + 3) = k0, k0 + 1, k0 + 8, k0 + 9 (k0 = 32kk + 16·(a0 // 16 mod 2) + a0 mod 16 / 2)
        at columns n0 … n0 + 3: four word loads (one per key), byte j of each into Vᵀ word j (four word stores).
        Cost per tile: B_c·d/16 loads and stores per thread group of 256, no arithmetic beyond shifts."""
        for e in range(tid, BLOCKS, THREADS):
            n4 = e // (B_c // 4)           # consecutive threads take consecutive key groups of one Vᵀ row group
            a0 = 4 * (e - n4 * (B_c // 4))
            n0 = 4 * n4
            step, aa = a0 // 32, a0 % 32
            k0 = 32 * step + 16 * (aa // 16) + (aa % 16) // 2
            chunk = n0 // 16               # 16-byte chunk of V's row that holds columns n0 … n0 + 3
            within = (n0 % 16) // 4
            base = v_off + (chunk // 8) * (32 * B_c)
            w0 = sm[base + k0 * 32 + 4 * ((chunk % 8) ^ (k0 % 8)) + within]
            w1 = sm[base + (k0 + 1) * 32 + 4 * ((chunk % 8) ^ ((k0 + 1) % 8)) + within]
            w2 = sm[base + (k0 + 8) * 32 + 4 * ((chunk % 8) ^ ((k0 + 8) % 8)) + within]
            w3 = sm[base + (k0 + 9) * 32 + 4 * ((chunk % 8) ^ ((k0 + 9) % 8)) + within]
            for j in range(4):
                n = n0 + j
                sh = uint32(8 * j)
                word = (((w0 >> sh) & uint32(0xFF)) | (((w1 >> sh) & uint32(0xFF)) << uint32(8))
                        | (((w2 >> sh) & uint32(0xFF)) << uint32(16)) | (((w3 >> sh) & uint32(0xFF)) << uint32(24)))
                sm[vt_off + n * 32 + 4 * ((a0 // 16) ^ (n % 8)) + (a0 % 16) // 4] = word

    @jit
    def o_plus_p_v(sm, o, s, vt_byte):
        """FA2 Alg. 1 line 10 (second half) on FP8, Õ_i += fp8(P̃_ij) V_j: per 32-key step kk, the thread's
        sixteen accumulators 16kk … 16kk + 15 rounded to e4m3 and packed four to a register as they lie
        (:data:`kernels_gpu.wgmma_layout.P_TO_A_FP8`: registers 0, 2 row g, 1, 3 row g + 8), and Vᵀ's keys
        32kk … 32kk + 31 (32 bytes into each row) read K-major: one ``wgmma m64n{d}k32 .e4m3`` per step."""
        fence_o(o)
        for kk in range(KV):
            b = 16 * kk
            a0 = pack8(s[b], s[b + 1], s[b + 4], s[b + 5])
            a1 = pack8(s[b + 2], s[b + 3], s[b + 6], s[b + 7])
            a2 = pack8(s[b + 8], s[b + 9], s[b + 12], s[b + 13])
            a3 = pack8(s[b + 10], s[b + 11], s[b + 14], s[b + 15])
            desc_v = descriptor(vt_byte + 32 * kk, 16, SBO, SWIZZLE_128B)
            wgmma_pv(sm, o, a0, a1, a2, a3, desc_v, uint32(1))
        ptx.wgmma_commit()
        wait_o(o)

    @jit
    def row_softmax(s, o, m, l, h, row, col0, N_k, scale_log2, diag, mask_tile):
        """FA2 Alg. 1 lines 9-10 for one of the thread's two rows (constant h), base 2, with FA3's FP8 offset:
        P̃ = 2^(S·c − m·c + 8) = 2⁸·exp(S − m) where c = τ·δ_q·δ_k·log₂e (``scale_log2``: the descales folded
        into the softmax scale). S and m stay in the units of Q₈K₈ᵀ. As :mod:`kernels_gpu.tensorcore.steps`'
        base-2 softmax otherwise: the mask only on tiles that need it, Õ and ℓ rescaled only when the maximum
        moved, the m = −∞ guard for a row that has seen no key."""
        mx = neg_inf
        for n in range(NT):
            for e in range(2):
                if mask_tile:
                    col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                    if col >= N_k or (causal and col > row + diag):
                        s[4 * n + 2 * h + e] = neg_inf
                mx = max(mx, s[4 * n + 2 * h + e])
        mx = max(mx, shfl_xor(mx, 1))
        mx = max(mx, shfl_xor(mx, 2))
        m_new = max(m[h], mx)
        # Guard (fully masked so far): P̃ = 0 for the whole row, nothing to rescale.
        if m_new == neg_inf:
            for n in range(NT):
                for e in range(2):
                    s[4 * n + 2 * h + e] = float32(0.0)
            return
        m_scaled = m_new * scale_log2
        # Alg. 1 line 10: α = exp(m_old − m_new) rescales ℓ and Õ, only if the maximum moved.
        if m_new != m[h]:
            alpha = ex2(m[h] * scale_log2 - m_scaled)
            l[h] *= alpha
            for n in range(NO):
                for e in range(2):
                    o[4 * n + 2 * h + e] *= alpha
        # Alg. 1 line 9 (FA3 FP8): P̃ = 2⁸·exp(S − m) in [0, 256], and the thread's part of ℓ (float32, before
        # P̃ is rounded to e4m3 — as fa2edu.fp8 sums it).
        shifted = m_scaled - offset
        rowsum = float32(0.0)
        for n in range(NT):
            for e in range(2):
                p = ex2(s[4 * n + 2 * h + e] * scale_log2 - shifted)
                s[4 * n + 2 * h + e] = p
                rowsum += p
        l[h] += rowsum
        m[h] = m_new

    @jit
    def online_softmax(s, o, m, l, row0, col0, N_k, scale_log2, diag, mask_tile):
        """FA2 Alg. 1 lines 9-10 on the thread's rows g and g + 8 (:func:`row_softmax`)."""
        row_softmax(s, o, m, l, 0, row0, col0, N_k, scale_log2, diag, mask_tile)
        row_softmax(s, o, m, l, 1, row0 + 8, col0, N_k, scale_log2, diag, mask_tile)

    @jit
    def finish_row(o, m, l, h, O, L, z, head, row, N_q, scale_log2, descale_v):
        """FA2 Alg. 1 lines 12-15 for one row (constant h): ℓ summed over the row's four lanes; O = δ_v·Õ/ℓ
        rounded to bfloat16, stored as word pairs; L = m·τδ_qδ_k + log ℓ − 8·ln 2 (the 2⁸ of P̃ taken back
        out), natural units; a row that saw no key: O = 0, L = +∞."""
        t = cuda.laneid % 4
        total = l[h] + shfl_xor(l[h], 1)
        total = total + shfl_xor(total, 2)
        # Guard: ℓ = 0 only for a row that saw no key (its Õ is 0): store 0, not 0/0.
        inv = float32(0.0) if total == float32(0.0) else descale_v / total
        if row < N_q:
            for n in range(NO):
                if 8 * n < 2 * DW:
                    O[z, head, row, 4 * n + t] = pack_bf16(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv)
            if t == 0:
                L[z, head, row] = math.inf if total == float32(0.0) else float32(
                    (m[h] * scale_log2 - offset) * float32(LN2) + math.log(total))

    @jit
    def finish_rows(o, m, l, O, L, z, head, row0, N_q, scale_log2, descale_v):
        """FA2 Alg. 1 lines 12-15 for the thread's two rows (:func:`finish_row`)."""
        finish_row(o, m, l, 0, O, L, z, head, row0, N_q, scale_log2, descale_v)
        finish_row(o, m, l, 1, O, L, z, head, row0 + 8, N_q, scale_log2, descale_v)

    @jit
    def wait_phase(sm, bar, parity):
        """Spin until the phase of parity ``parity`` of the mbarrier at word ``bar`` has completed."""
        while ptx.mbar_try_wait(sm, bar, parity) == 0:
            pass

    return dict(aligned_base=aligned_base, tma_q=make_tma_tile(B_r), tma_kv=make_tma_tile(B_c),
                wait_phase=wait_phase, s_equals_q_kt=s_equals_q_kt, transpose_v=transpose_v,
                o_plus_p_v=o_plus_p_v, zero=shared["zero"], init_stats=shared["init_stats"],
                online_softmax=online_softmax, finish_rows=finish_rows)
