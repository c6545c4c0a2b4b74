"""The steps every Hopper forward rung shares, as small device functions.

A rung (``flash_forward_h1.py`` …) is one kernel that reads as FA2 Algorithm 1; what does not change between rungs
lives here: the tile geometry in shared memory, the copy of a tile by ``cp.async``, the matrix descriptors, and the
two products of the inner loop as warpgroup MMAs — S_ij = Q_i K_jᵀ with both operands in shared memory, and
Õ_i += P̃_ij V_j with P̃ in registers. The online softmax and the final rescale are the mma.sync ladder's own
(:mod:`kernels_gpu.tensorcore.steps`): a wgmma accumulator is laid out, warp by warp, exactly as mma.sync's
(:mod:`kernels_gpu.wgmma_layout`), so the same device functions update it.

**The work split.** A consumer warpgroup (128 threads) owns 64 query rows — warp w of it rows 16w … 16w + 15, as a
mma.sync warp owns 16 — and computes its 64 × B_c slice of S with one ``wgmma m64n{B_c}k16`` per 16 columns of d,
then its 64 × d slice of O with one ``wgmma m64n{D}k16`` per 16 keys. Register arrays per thread:

====== ============ ==========================================================================================
array  length       holds
====== ============ ==========================================================================================
s      B_c / 2      S_ij (then P̃_ij) of the thread's rows g and g + 8 of its warp: [4n + 2h + e] is row
                    16w + g + 8h, column 8n + 2q + e
o      D / 2        Õ_i the same way (D = d rounded up to 16)
m, l   2            m_i and the thread's partial ℓ_i for its two rows
====== ============ ==========================================================================================

**Shared memory.** Every tile of R rows (Q_i: B_r, K_j and V_j: B_c) is stored as ``panels`` = ⌈d/64⌉ panels of 64
columns: panel p holds columns 64p … 64p + 63 of all R rows, 128 bytes a row, each row's eight 16-byte chunks
permuted by the 128-byte swizzle (chunk c of row r at chunk c ⊕ (r mod 8)) — what a TMA box of 64 × R writes, and
what a 128-byte-swizzle descriptor reads (:func:`kernels_gpu.wgmma_layout.tile_word`). Columns from d to 64·panels
are zeros. Every tile starts on a 1024-byte boundary (the swizzle pattern's), so the kernels align the dynamic
shared memory's start themselves (:func:`aligned_base`).

**Descriptors** (:func:`kernels_gpu.ptx.descriptor`), all 128-byte swizzle, SBO = 1024 bytes (8 rows of 128 bytes):

=================  =========  ===============================================  ==================
operand            major      start for step kk (16 elements of K)              LBO
=================  =========  ===============================================  ==================
Q_i (A of S)       K          Q + panel(kk)·R·128 + 32·(kk mod 4)              (unused)
K_j (B of S)       K          K + panel(kk)·B_c·128 + 32·(kk mod 4)            (unused)
V_j (B of O)       MN         V + 16·kk·128  (keys 16kk … 16kk + 15)           B_c·128 (next panel)
=================  =========  ===============================================  ==================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from numba import cuda, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import steps as tc_steps

__all__ = ["HopperConfig", "make_steps", "SWIZZLE_128B", "SBO", "ALIGN_BYTES"]

#: descriptor swizzle mode of the tiles (PTX ISA: 1 = 128-byte)
SWIZZLE_128B = 1
#: stride byte offset: 8 rows of 128 bytes
SBO = 1024
#: alignment of every tile (the 128-byte swizzle pattern repeats every 1024 bytes)
ALIGN_BYTES = 1024
#: what slot e of a trace row T[block, warpgroup, tile, e] stamps. A consumer warpgroup: when it starts waiting for
#: tile j, when it may start (the tile has landed — and, with ping-pong, its turn has come), when S_ij is done, when
#: the softmax is, and when Õ_i += P̃_ij V_j is; a producer warpgroup: when it starts waiting for the stage, when
#: the stage is free, and when the tile's copies are issued (slots 3 and 4 unused).
TRACE_EVENTS = ("wait", "ready", "S", "softmax", "PV")


@dataclass(frozen=True)
class HopperConfig:
    """The compile-time constants of one Hopper kernel.

    ``consumers``: warpgroups that compute (64 query rows each: B_r = 64 · consumers); ``producer``: one more
    warpgroup that only copies (warp specialisation); ``B_c``: keys per K/V tile (a multiple of 16, at most 256);
    ``stages``: K/V tiles in flight (the ring's depth); ``trace``: ``""`` (no trace), ``"globaltimer"`` or
    ``"clock64"`` — the rungs that take a trace array stamp each tile's steps with that clock
    (:data:`TRACE_EVENTS`)."""

    d: int
    B_c: int
    dtype: str
    causal: bool
    simulated: bool
    consumers: int = 1
    producer: bool = False
    stages: int = 2
    trace: str = ""

    def __post_init__(self):
        if self.d % 8 or not 8 <= self.d <= 256:
            raise ValueError(f"d must be a multiple of 8 in [8, 256], got {self.d}")
        if self.B_c % 16 or not 16 <= self.B_c <= 256:
            raise ValueError(f"B_c must be a multiple of 16 in [16, 256], got {self.B_c}")
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.consumers not in (1, 2, 3):
            raise ValueError(f"consumers must be 1, 2 or 3, got {self.consumers}")
        if self.stages < 1:
            raise ValueError(f"stages must be at least 1, got {self.stages}")
        if self.trace not in ("", "globaltimer", "clock64"):
            raise ValueError(f"trace must be '', 'globaltimer' or 'clock64', got {self.trace!r}")

    @property
    def B_r(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + int(self.producer))

    @property
    def D(self) -> int:
        """d rounded up to 16: the K extent of S's products and the N of O's."""
        return -(-self.d // 16) * 16

    @property
    def panels(self) -> int:
        """64-column panels per tile row."""
        return -(-self.d // 64)

    def tile_words(self, rows: int) -> int:
        """32-bit words of a tile of ``rows`` rows."""
        return 32 * rows * self.panels

    @property
    def tc(self) -> tc_steps.Config:
        """The mma.sync ladder's configuration with the same per-warp arrays (16 rows a warp, B_c keys a tile): its
        softmax and final-rescale steps are this rung's."""
        return tc_steps.Config(d=self.d, warps=4, B_c=self.B_c, dtype=self.dtype, causal=self.causal,
                               simulated=self.simulated, row_tiles=1)


@functools.lru_cache(maxsize=None)
def make_steps(cfg: HopperConfig):
    """The device functions for ``cfg`` (sizes are compile-time constants of each)."""
    jit = tc_steps.device(cfg.simulated)
    shared = tc_steps.make_steps(cfg.tc)
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    descriptor = ptx.descriptor
    B_r, B_c, D, P = cfg.B_r, cfg.B_c, cfg.D, cfg.panels
    KS = D // 16                        # 16-wide steps of S = Q Kᵀ along d
    KV = B_c // 16                      # 16-wide steps of O += P V along the keys
    DW = cfg.d // 2                     # words of a row in HBM
    CHP = 8 * P                         # 16-byte chunks of a row in shared memory (zeros past d)
    wgmma_qk = ptx.make_wgmma(cfg.dtype, B_c, "smem", False)
    wgmma_pv = ptx.make_wgmma(cfg.dtype, D, "regs", True)
    wait_s = ptx.make_wgmma_wait(0, B_c // 2)
    wait_o = ptx.make_wgmma_wait(0, D // 2)
    fence_s = ptx.make_wgmma_fence(B_c // 2)
    fence_o = ptx.make_wgmma_fence(D // 2)

    @jit
    def aligned_base(sm):
        """The first word of ``sm`` (the dynamic shared memory) on a 1024-byte boundary: where the tiles start.
        The kernels ask for 1024 bytes more than the tiles need."""
        a = ptx.shared_byte_address(sm, 0)
        return ((uint32(1024) - (a & uint32(1023))) & uint32(1023)) >> uint32(2)

    def make_copy_tile(ROWS: int, THREADS: int):
        @jit
        def copy_tile(sm, off, X, z, h, row0, N, tid):
            """Start the ``cp.async`` copy of rows row0 … row0 + ROWS − 1 of X[z, h] (words, (N, d/2)) into the
            tile at word ``off`` (FA2 Alg. 1 lines 4 and 7: Q_i, K_j, V_j from HBM to SRAM), 16 bytes per
            thread and step, in the panel layout of the module's docstring. Rows past N and columns past d are
            zero-filled (source size 0, the address clamped to one that exists). Consecutive threads take
            consecutive chunks of a row: their swizzled destinations fill one 128-byte row, no bank conflict."""
            base = z * (X.strides[0] // 4) + h * (X.strides[1] // 4)
            SN = X.strides[2] // 4
            for e in range(tid, ROWS * CHP, THREADS):
                r = e // CHP
                c = e - r * CHP
                valid = row0 + r < N and 4 * c < DW
                src = base + min(row0 + r, N - 1) * SN + (4 * c if 4 * c < DW else 0)
                dst = off + (c // 8) * (32 * ROWS) + r * 32 + 4 * ((c % 8) ^ (r % 8))
                ptx.cp_async16(sm, dst, X, src, 16 if valid else 0)
        return copy_tile

    @jit
    def s_equals_q_kt(sm, s, q_byte, k_byte):
        """FA2 Alg. 1 line 8, S_ij = Q_i K_jᵀ for the warpgroup's 64 rows: one ``wgmma m64n{B_c}k16`` per 16
        columns of d, both operands read from shared memory through K-major descriptors (``q_byte``: the byte
        address of the warpgroup's first Q row in panel 0; ``k_byte``: the K tile's). The first product
        overwrites ``s`` (scale-d = 0), the others add to it. Issued, committed and waited for here."""
        fence_s(s)
        for kk in range(KS):
            panel, step = kk // 4, 32 * (kk % 4)
            desc_q = descriptor(q_byte + panel * (B_r * 128) + step, 16, SBO, SWIZZLE_128B)
            desc_k = descriptor(k_byte + panel * (B_c * 128) + step, 16, SBO, SWIZZLE_128B)
            wgmma_qk(sm, s, desc_q, desc_k, uint32(kk > 0))
        ptx.wgmma_commit()
        wait_s(s)

    @jit
    def o_plus_p_v(sm, o, s, v_byte):
        """FA2 Alg. 1 line 10 (second half), Õ_i += P̃_ij V_j: P̃ (in ``s``, float32) packed to 16 bits in pairs —
        the accumulators of keys 16kk … 16kk + 15 are the A registers of step kk — and V_j read MN-major
        (transposed by the tensor core) from shared memory, one ``wgmma m64n{D}k16`` per 16 keys."""
        fence_o(o)
        for kk in range(KV):
            a0 = pack(s[8 * kk], s[8 * kk + 1])
            a1 = pack(s[8 * kk + 2], s[8 * kk + 3])
            a2 = pack(s[8 * kk + 4], s[8 * kk + 5])
            a3 = pack(s[8 * kk + 6], s[8 * kk + 7])
            desc_v = descriptor(v_byte + kk * (16 * 128), B_c * 128, SBO, SWIZZLE_128B)
            wgmma_pv(sm, o, a0, a1, a2, a3, desc_v, uint32(1))
        ptx.wgmma_commit()
        wait_o(o)

    def make_tma_tile(ROWS: int):
        @jit
        def tma_tile(sm, dst, tmap, row0, h, z, bar):
            """Issue the TMA copies of rows row0 … row0 + ROWS − 1 of the tensor behind ``tmap`` (head h, batch z)
            into the tile at word ``dst``: one box of 64 columns × ROWS rows per panel, landing swizzled; their
            bytes complete the mbarrier at word ``bar`` (FA2 Alg. 1 lines 4 and 7, by the copy engine). One
            thread calls it; the caller announced the bytes first (``mbar_arrive_expect_tx``)."""
            for p in range(P):
                ptx.tensor_copy_4d(sm, dst + p * (32 * ROWS), tmap, 64 * p, row0, h, z, bar)
        return tma_tile

    if cfg.trace:
        clock = ptx.globaltimer if cfg.trace == "globaltimer" else ptx.clock64

        @jit
        def stamp(T, wg, j, event):
            """Thread 0 of warpgroup ``wg`` writes the clock into T[block, wg, j, event], for the first
            T.shape[0] blocks (numbered x fastest) and the first T.shape[2] tiles."""
            if cuda.threadIdx.x % 128 == 0:
                b = cuda.blockIdx.x + cuda.gridDim.x * (cuda.blockIdx.y + cuda.gridDim.y * cuda.blockIdx.z)
                if b < T.shape[0] and j < T.shape[2]:
                    T[b, wg, j, event] = clock()
    else:
        @jit
        def stamp(T, wg, j, event):
            """No trace: nothing (the call compiles away)."""
            pass

    @jit
    def wait_phase(sm, bar, parity):
        """Spin until the phase of parity ``parity`` of the mbarrier at word ``bar`` has completed."""
        while ptx.mbar_try_wait(sm, bar, parity) == 0:
            pass

    return dict(aligned_base=aligned_base, tma_q=make_tma_tile(B_r), tma_kv=make_tma_tile(B_c),
                wait_phase=wait_phase, stamp=stamp, copy_q=make_copy_tile(B_r, cfg.threads),
                copy_kv=make_copy_tile(B_c, cfg.threads),
                s_equals_q_kt=s_equals_q_kt, o_plus_p_v=o_plus_p_v, zero=shared["zero"],
                init_stats=shared["init_stats"], online_softmax=shared["online_softmax_f32"],
                finish_rows=shared["finish_rows_exp2"])


def shared_bytes(cfg: HopperConfig) -> int:
    """Dynamic shared memory of a rung that keeps Q_i and ``stages`` (K_j, V_j) pairs, plus the alignment slack
    and 8 bytes per mbarrier (two per stage, and one for Q)."""
    words = cfg.tile_words(cfg.B_r) + 2 * cfg.stages * cfg.tile_words(cfg.B_c)
    return 4 * words + ALIGN_BYTES + 8 * (2 * cfg.stages + 2)

