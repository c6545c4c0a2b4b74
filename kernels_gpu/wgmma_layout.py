"""Where ``wgmma`` finds its operands: shared-memory matrix descriptors, the swizzle modes, and the warpgroup's
register fragments — as tables and as NumPy functions.

Hopper's warpgroup MMA (``wgmma.mma_async.m64nNk16``, PTX ISA 9.7.15) is issued by a *warpgroup*, four
consecutive warps (128 threads) starting at a warp index divisible by 4, and computes D (64 × N, float32) =
A (64 × 16) · B (16 × N) + D. B is always read from shared memory, A from shared memory or from registers. An
operand in shared memory is not passed as addresses: it is named by a 64-bit **matrix descriptor** and the
hardware walks a *canonical layout* from it. Everything the Hopper kernels (:mod:`kernels_gpu.hopper`) and their
simulator twins (:mod:`kernels_gpu.ptx`) know about this lives here; the GPU tests check it against the
instruction.

**The descriptor** (PTX ISA 9.7.15.5.1.2.2, "Matrix Descriptor Format"), every byte quantity encoded as
``(x & 0x3FFFF) >> 4``:

=========  =====  =============================================================================
bits       width  field
=========  =====  =============================================================================
0-13       14     start address of the operand in shared memory (bytes / 16)
16-29      14     leading dimension byte offset, LBO (bytes / 16)
32-45      14     stride dimension byte offset, SBO (bytes / 16)
49-51      3      base offset (0 when the swizzle pattern starts at its natural boundary: fa2edu's
                  tiles are 1024-byte aligned)
62-63      2      swizzle mode: 0 none (interleaved), 1 128-byte, 2 64-byte, 3 32-byte
=========  =====  =============================================================================

**Core matrices and canonical layouts** (PTX ISA 9.7.15.5.1.2.1). Think of 16-bit elements in 16-byte chunks of
T = 8. An operand of R rows (M or N) by 16 columns of K is "K-major" when consecutive K elements are adjacent in
memory (Q and K of S = QKᵀ: rows of d), "MN-major" when consecutive rows are (V of O = PV: its rows are keys = K,
its contiguous axis is d = N; wgmma reads it with the transpose flag). The element (r, k) of the operand lies at
the element offset below from the descriptor's start address (W = the swizzle span in bytes, W/2 elements):

==========  ========  ====================================================================================
major       swizzle   element offset of (r, k) before the swizzle
==========  ========  ====================================================================================
K           none      (r % 8)·8 + (r // 8)·SBO + (k % 8) + (k // 8)·LBO        (core matrix = 8 rows × 16 B)
K           W bytes   (r % 8)·W/2 + (r // 8)·SBO + k                            (LBO unused; K contiguous)
MN          none      (r % 8) + (r // 8)·SBO + (k % 8)·8 + (k // 8)·LBO
MN          W bytes   (r % W/2) + (r // (W/2))·LBO + (k % 8)·W/2 + (k // 8)·SBO
==========  ========  ====================================================================================

(SBO and LBO in elements here, bytes in the descriptor.) These are the PTX ISA's CuTe forms, e.g. K-major
128-byte ``((8,m),(T,2k)):((8T,SBO),(1,T))``, MN-major 128-byte ``((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))``.

**The swizzle** permutes 16-byte chunks inside each W-byte row by the row's position in its 8-row atom:
``Swizzle<B,4,3>`` with B = log₂(W/16) XORs the byte address's bits 4 … 3+B with bits 7 … 6+B. For 128 bytes,
chunk c of the 128-byte row at byte a lands at chunk ``c ⊕ ((a >> 7) & 7)`` — exactly what the copy engine writes
for a tensor map with ``CU_TENSOR_MAP_SWIZZLE_128B`` (:mod:`kernels_gpu.tensor_map`), so a TMA box of 64
columns × R rows is, as it lands, the K-major operand of a 128-byte descriptor with SBO = 1024 bytes, and the
MN-major operand of one with SBO = 1024 and LBO = the box's size. Moving along K by 16 elements inside a
128-byte row is adding 32 bytes to the start address: the hardware swizzles the address it computes, so the
permutation follows.

**Registers** (PTX ISA 9.7.15.5.1.1.1, Figures 148 and 149). Thread ``t`` of the warpgroup is lane ``l = t % 32``
of warp ``w = t // 32``; ``g = l // 4``, ``q = l % 4``. Warp w owns rows 16w … 16w + 15 of A and D, laid out as
``mma.sync.m16n8k16``'s fragments (:mod:`kernels_gpu.fragments`):

================  ================  ============================================
register          row               column
================  ================  ============================================
d[4j + 2h + e]    16w + g + 8h      8j + 2q + e   (j = 0 … N/8 − 1; N/2 floats)
a0 (lo, hi)       16w + g           2q, 2q + 1
a1                16w + g + 8       2q, 2q + 1
a2                16w + g           2q + 8, 2q + 9
a3                16w + g + 8       2q + 8, 2q + 9
================  ================  ============================================

So, as with ``mma.sync``, the float32 accumulators of S for keys 16k … 16k + 15, packed in pairs, are the A
registers of P for the k-th step of O += P·V, and a row's elements live in one group of four lanes.

**One-byte elements: FP8** (``wgmma.mma_async.m64nNk32.f32.e4m3.e4m3``, PTX ISA 9.7.15.5.1.1.3 and Figure 152).
An instruction now covers K = 32 elements, still 32 bytes of a row: a 16-byte chunk is T = 16 elements, a core
matrix 8 rows × 16 elements, and a 128-byte swizzled row holds **128** e4m3 elements of K — so an FP8 tile of
d ≤ 128 columns is one panel, and moving along K by one instruction (32 elements) is again adding 32 bytes to the
start address. Both operands must be K-major (the instruction has no transpose flags for 8-bit types): V of
O = PV, whose rows are keys = K, has to be transposed into Vᵀ (d rows of keys) before it can be B. The element
offsets (in bytes) from the descriptor's start, before the swizzle:

==========  ========  ====================================================================================
major       swizzle   byte offset of (r, k), k = 0 … 31
==========  ========  ====================================================================================
K           none      (r % 8)·16 + (r // 8)·SBO + (k % 16) + (k // 16)·LBO
K           W bytes   (r % 8)·W + (r // 8)·SBO + k
==========  ========  ====================================================================================

A from registers is four 32-bit registers of four e4m3 bytes each (element 4i + b in byte b of register i, the
lowest byte first), laid out per warp as ``mma.sync.m16n8k32``'s 8-bit A:

================  ================  ============================================
register          row               columns (byte 0 … 3)
================  ================  ============================================
a0                16w + g           4q … 4q + 3
a1                16w + g + 8       4q … 4q + 3
a2                16w + g           16 + 4q … 16 + 4q + 3
a3                16w + g + 8       16 + 4q … 16 + 4q + 3
================  ================  ============================================

**P̃ in FP8: the permutation.** The accumulators of S that a thread holds for keys 32k … 32k + 31 of its row g
are keys 2q, 2q + 1, 8 + 2q, 9 + 2q, 16 + 2q, 17 + 2q, 24 + 2q, 25 + 2q (:func:`accumulator_layout`); the A
fragment wants columns 4q … 4q + 3 and 16 + 4q … 16 + 4q + 3. They are the same *number* of elements of the same
row in the same thread, only the columns differ — and P̃V sums over its columns. So fa2edu packs the thread's
accumulators as they are (:data:`P_TO_A_FP8`: no shuffle, no byte permute) and lets A's column a stand for key
``π(a) = 16·(a // 16) + 8·((a % 4) // 2) + 2·((a % 16) // 4) + a % 2`` (:func:`p_key_of_a_column`). The product is
unchanged if B's row a is V's key π(a): the in-kernel transpose of V writes Vᵀ with its keys in that order
(:func:`transposed_v_word`) — the permutation costs nothing, because the transpose moves every byte anyway.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["SWIZZLE_MODES", "SWIZZLE_BYTES", "encode_descriptor", "decode_descriptor", "swizzle",
           "operand_offsets", "operand_byte_addresses", "read_operand", "accumulator_layout", "a_register_layout",
           "accumulator_fragments", "from_accumulator_fragments", "a_fragments", "from_a_fragments",
           "wgmma_reference", "WARPGROUP", "store_tile", "tile_word", "a_register_layout_fp8", "a_fragments_fp8",
           "from_a_fragments_fp8", "P_TO_A_FP8", "p_key_of_a_column", "transposed_v_word", "store_tile_fp8",
           "store_transposed_v"]

#: threads of a warpgroup
WARPGROUP = 128
#: descriptor mode field → swizzle span in bytes (0: none)
SWIZZLE_BYTES = {0: 0, 1: 128, 2: 64, 3: 32}
#: swizzle name → descriptor mode field
SWIZZLE_MODES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}


def encode_descriptor(start: int, lbo: int, sbo: int, swizzle_mode: str | int) -> int:
    """The 64-bit matrix descriptor of an operand at shared-memory byte address ``start`` (16-byte aligned), with
    leading and stride byte offsets ``lbo``, ``sbo`` (multiples of 16) and a swizzle (``"none"``, ``"128B"``,
    ``"64B"``, ``"32B"`` or the mode number). The kernels compute the same value on the device
    (:func:`kernels_gpu.ptx.descriptor`)."""
    mode = SWIZZLE_MODES[swizzle_mode] if isinstance(swizzle_mode, str) else int(swizzle_mode)
    for name, x in (("start", start), ("lbo", lbo), ("sbo", sbo)):
        if x % 16 or x < 0:
            raise ValueError(f"{name} must be a non-negative multiple of 16 bytes, got {x}")
    enc = lambda x: (int(x) & 0x3FFFF) >> 4  # noqa: E731
    return enc(start) | (enc(lbo) << 16) | (enc(sbo) << 32) | (mode << 62)


def decode_descriptor(desc: int) -> dict:
    """The fields of a matrix descriptor: ``start``, ``lbo``, ``sbo`` in bytes, ``base_offset``, ``mode``."""
    desc = int(desc) & 0xFFFFFFFFFFFFFFFF
    return dict(start=(desc & 0x3FFF) << 4, lbo=((desc >> 16) & 0x3FFF) << 4, sbo=((desc >> 32) & 0x3FFF) << 4,
                base_offset=(desc >> 49) & 7, mode=(desc >> 62) & 3)


def swizzle(byte_address, mode: int):
    """The byte address a swizzled access really touches: ``Swizzle<B,4,3>`` — bits 4 … 3+B XOR bits 7 … 6+B, with
    B = 3, 2, 1 for the 128-, 64-, 32-byte modes (mode 0: unchanged)."""
    a = np.asarray(byte_address, dtype=np.int64)
    B = {0: 0, 1: 3, 2: 2, 3: 1}[int(mode)]
    if B == 0:
        return a
    mask = (1 << B) - 1
    return a ^ (((a >> 7) & mask) << 4)


def operand_offsets(rows: int, major: str, mode: int, lbo: int, sbo: int, element_bytes: int = 2) -> np.ndarray:
    """(rows, K) element offsets, before the swizzle, of the operand elements (r, k) from the descriptor's start
    (the module's tables); ``lbo``, ``sbo`` in bytes. ``element_bytes`` 2 (f16, bf16: K = 16) or 1 (e4m3: K = 32,
    K-major only; the offsets are then bytes)."""
    if element_bytes == 1:
        if major != "K":
            raise ValueError("8-bit wgmma operands are K-major only (PTX ISA: no transpose for .e4m3/.e5m2)")
        r = np.arange(rows)[:, None]
        k = np.arange(32)[None, :]
        if mode == 0:
            return (r % 8) * 16 + (r // 8) * sbo + (k % 16) + (k // 16) * lbo
        return (r % 8) * SWIZZLE_BYTES[int(mode)] + (r // 8) * sbo + k
    if element_bytes != 2:
        raise ValueError(f"element_bytes must be 1 or 2, got {element_bytes}")
    r = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    L, S = lbo // 2, sbo // 2
    W2 = SWIZZLE_BYTES[int(mode)] // 2
    if major == "K":
        if mode == 0:
            return (r % 8) * 8 + (r // 8) * S + (k % 8) + (k // 8) * L
        return (r % 8) * W2 + (r // 8) * S + k
    if major == "MN":
        if mode == 0:
            return (r % 8) + (r // 8) * S + (k % 8) * 8 + (k // 8) * L
        return (r % W2) + (r // W2) * L + (k % 8) * W2 + (k // 8) * S
    raise ValueError(f"major must be 'K' or 'MN', got {major!r}")


@functools.lru_cache(maxsize=4096)
def _addresses(desc: int, rows: int, major: str, element_bytes: int = 2) -> np.ndarray:
    f = decode_descriptor(desc)
    if f["base_offset"]:
        raise NotImplementedError("fa2edu's operands start at their swizzle pattern's boundary (base offset 0)")
    offsets = operand_offsets(rows, major, f["mode"], f["lbo"], f["sbo"], element_bytes)
    out = swizzle(f["start"] + element_bytes * offsets, f["mode"])
    out.setflags(write=False)
    return out


def operand_byte_addresses(desc: int, rows: int, major: str, element_bytes: int = 2) -> np.ndarray:
    """(rows, K) shared-memory byte addresses of the operand elements (r, k) that descriptor ``desc`` names
    (``major`` "K" or "MN"; K = 16 for 2-byte elements, 32 for 1-byte ones): what the tensor core reads."""
    return _addresses(int(desc) & 0xFFFFFFFFFFFFFFFF, int(rows), major, int(element_bytes))


def read_operand(memory, desc: int, rows: int, major: str, element_bytes: int = 2) -> np.ndarray:
    """The (rows, 16) 16-bit patterns (uint16) a wgmma operand reads from ``memory`` (shared memory as any NumPy
    array; byte 0 is the address the descriptor's start counts from) — or, with ``element_bytes=1``, the (rows, 32)
    8-bit patterns (uint8: e4m3 codes) of an FP8 operand."""
    units = np.ascontiguousarray(memory).reshape(-1).view(np.uint16 if element_bytes == 2 else np.uint8)
    addr = operand_byte_addresses(desc, rows, major, element_bytes)
    if (addr % element_bytes).any():
        raise RuntimeError("wgmma operand: odd byte address")
    if addr.max() // element_bytes >= units.size or addr.min() < 0:
        raise IndexError(f"wgmma operand: bytes {addr.min()} … {addr.max()} outside shared memory of "
                         f"{element_bytes * units.size} bytes")
    return units[addr // element_bytes]


def accumulator_layout(N: int) -> np.ndarray:
    """(128, N/2, 2): (row, column) of accumulator register i of warpgroup thread t for ``m64nNk16``."""
    t = np.arange(WARPGROUP)[:, None]
    i = np.arange(N // 2)[None, :]
    w, lane = t // 32, t % 32
    g, q = lane // 4, lane % 4
    j, h, e = i // 4, (i // 2) % 2, i % 2
    row = 16 * w + g + 8 * h
    col = 8 * j + 2 * q + e
    return np.stack(np.broadcast_arrays(row, col), axis=-1)


def a_register_layout() -> np.ndarray:
    """(128, 8, 2): (row, column) of element e (register e // 2, half e % 2) of warpgroup thread t's A fragment."""
    t = np.arange(WARPGROUP)[:, None]
    e = np.arange(8)[None, :]
    w, lane = t // 32, t % 32
    g, q = lane // 4, lane % 4
    reg, half = e // 2, e % 2
    row = 16 * w + g + 8 * (reg % 2)
    col = 2 * q + half + 8 * (reg // 2)
    return np.stack(np.broadcast_arrays(row, col), axis=-1)


def accumulator_fragments(D: np.ndarray) -> np.ndarray:
    """A (64, N) matrix → (128, N/2): each thread's accumulator registers."""
    D = np.asarray(D)
    lay = accumulator_layout(D.shape[1])
    return D[lay[..., 0], lay[..., 1]]


def from_accumulator_fragments(frags: np.ndarray) -> np.ndarray:
    """(128, N/2) accumulator registers → the (64, N) matrix."""
    frags = np.asarray(frags)
    N = 2 * frags.shape[1]
    lay = accumulator_layout(N)
    out = np.empty((64, N), dtype=frags.dtype)
    out[lay[..., 0], lay[..., 1]] = frags
    return out


def a_fragments(A: np.ndarray) -> np.ndarray:
    """A (64, 16) matrix → (128, 8): each thread's eight A elements, low half of register 0 first."""
    A = np.asarray(A)
    lay = a_register_layout()
    return A[lay[..., 0], lay[..., 1]]


def from_a_fragments(frags: np.ndarray) -> np.ndarray:
    """(128, 8) A elements → the (64, 16) matrix."""
    frags = np.asarray(frags)
    lay = a_register_layout()
    out = np.empty((64, 16), dtype=frags.dtype)
    out[lay[..., 0], lay[..., 1]] = frags
    return out


def wgmma_reference(A: np.ndarray, B: np.ndarray, C: np.ndarray | None) -> np.ndarray:
    """D = A·B + C in float32 for A (64, K), B (K, N) exact 16-bit (K = 16) or e4m3 (K = 32) values as float32 and
    C (64, N) float32 (None: D = A·B, wgmma's scale-d = 0): each dot product summed exactly (float64 holds sixteen
    products of 16-bit values exactly, and thirty-two of e4m3 values: a product has at most 8 significant bits
    between 2⁻¹⁸ and 2¹⁸), then rounded once, as the twins of :mod:`kernels_gpu.ptx` compute it. The tensor core's
    internal accumulation may differ in the last bits of float32 for 16-bit inputs; for e4m3 it keeps fewer bits
    (errors up to 2·10⁻⁴ of Σ|a·b| seen on the H200: :func:`kernels_gpu.hopper.selftest.check_wgmma_fp8`)."""
    prod = np.asarray(A, dtype=np.float64) @ np.asarray(B, dtype=np.float64)
    if C is not None:
        prod = prod + np.asarray(C, dtype=np.float64)
    return prod.astype(np.float32)


def tile_word(row, chunk, rows: int):
    """The 32-bit word (from the tile's start) of 16-byte chunk ``chunk`` of row ``row`` of a tile stored as
    fa2edu's Hopper kernels store Q, K and V tiles: panels of 64 columns (128-byte rows), panel p holding columns
    64p … 64p + 63 of all ``rows`` rows, each 128-byte row's chunks permuted by the 128-byte swizzle — the layout a
    TMA box of 64 × ``rows`` writes (:func:`kernels_gpu.tensor_map.swizzled_word` with ``box_words`` = 32 · rows)."""
    return (chunk // 8) * (32 * rows) + row * 32 + 4 * ((chunk % 8) ^ (row % 8))


def store_tile(X: np.ndarray, panels: int) -> np.ndarray:
    """A (rows, cols) array of 16-bit patterns (uint16; cols ≤ 64·panels, rows a multiple of 8) laid out as
    :func:`tile_word` says, as uint32 words (zeros past ``cols``): what the kernels' copies write to shared
    memory, for the tests."""
    X = np.asarray(X, dtype=np.uint16)
    rows, cols = X.shape
    padded = np.zeros((rows, 64 * panels), dtype=np.uint16)
    padded[:, :cols] = X
    words = padded.view(np.uint32)                       # (rows, 32·panels): word w of a row = columns 2w, 2w + 1
    out = np.zeros(32 * rows * panels, dtype=np.uint32)
    r = np.arange(rows)[:, None]
    c = np.arange(8 * panels)[None, :]
    base = tile_word(r, c, rows)
    for e in range(4):
        out[base + e] = words[r, 4 * c + e]
    return out


# -- one-byte elements (FP8) ------------------------------------------------------------------------------------------

def a_register_layout_fp8() -> np.ndarray:
    """(128, 16, 2): (row, column) of element e (register e // 4, byte e % 4) of warpgroup thread t's 8-bit A
    fragment of ``m64nNk32`` (the module's table)."""
    t = np.arange(WARPGROUP)[:, None]
    e = np.arange(16)[None, :]
    w, lane = t // 32, t % 32
    g, q = lane // 4, lane % 4
    reg, byte = e // 4, e % 4
    row = 16 * w + g + 8 * (reg % 2)
    col = 4 * q + byte + 16 * (reg // 2)
    return np.stack(np.broadcast_arrays(row, col), axis=-1)


def a_fragments_fp8(A: np.ndarray) -> np.ndarray:
    """A (64, 32) matrix → (128, 16): each thread's sixteen 8-bit A elements, byte 0 of register 0 first."""
    A = np.asarray(A)
    lay = a_register_layout_fp8()
    return A[lay[..., 0], lay[..., 1]]


def from_a_fragments_fp8(frags: np.ndarray) -> np.ndarray:
    """(128, 16) 8-bit A elements → the (64, 32) matrix."""
    frags = np.asarray(frags)
    lay = a_register_layout_fp8()
    out = np.empty((64, 32), dtype=frags.dtype)
    out[lay[..., 0], lay[..., 1]] = frags
    return out


#: which accumulator registers of S fill the FP8 A registers of P̃ for one step of 32 keys: A register i, byte b is
#: accumulator ``32k/2 + P_TO_A_FP8[i][b]`` (0 … 15 within the step's sixteen) — the thread's own values in their
#: own order, the two rows kept apart (registers 0 and 2: row g; 1 and 3: row g + 8)
P_TO_A_FP8 = ((0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15))


def p_key_of_a_column(a):
    """π(a): the key (0 … 31 within a step of 32) that column ``a`` of P̃'s FP8 A fragment holds when the
    accumulators are packed by :data:`P_TO_A_FP8` — ``16·(a // 16) + 8·((a % 4) // 2) + 2·((a % 16) // 4) +
    a % 2``, a permutation of 0 … 31 (the module's docstring)."""
    a = np.asarray(a)
    return 16 * (a // 16) + 8 * ((a % 4) // 2) + 2 * ((a % 16) // 4) + a % 2


def transposed_v_word(n, a):
    """The 32-bit word (from the tile's start) holding element (n, a) of Vᵀ as fa2edu's FP8 kernel stores it: d rows
    n of 128 bytes (up to 128 keys, one panel), the bytes a … of row n permuted by the 128-byte swizzle (16-byte
    chunk c of row n at chunk c ⊕ (n mod 8)); ``a`` a multiple of 4 (a word holds a … a + 3). Element (n, a) is
    V[32·(a // 32) + π(a % 32), n] (:func:`p_key_of_a_column`)."""
    n, a = np.asarray(n), np.asarray(a)
    return n * 32 + 4 * (((a // 16) ^ (n % 8)) % 8) + (a % 16) // 4


def store_tile_fp8(X: np.ndarray, panels: int) -> np.ndarray:
    """A (rows, cols) array of e4m3 codes (uint8; cols ≤ 128·panels, rows a multiple of 8) laid out as the FP8
    kernel's TMA boxes land (panels of 128 bytes, chunks swizzled: :func:`tile_word`, which counts 16-byte
    chunks whatever the element), as uint32 words: what the copies write to shared memory, for the tests."""
    X = np.asarray(X, dtype=np.uint8)
    rows, cols = X.shape
    padded = np.zeros((rows, 128 * panels), dtype=np.uint8)
    padded[:, :cols] = X
    return store_tile(padded.view(np.uint16), panels)


def store_transposed_v(V: np.ndarray, d: int) -> np.ndarray:
    """The Vᵀ panel the FP8 kernel's transpose writes for a V tile (B_c ≤ 128 keys × d, uint8 codes): (d · 32,)
    uint32 words, element (n, a) = V[32·(a // 32) + π(a % 32), n] at :func:`transposed_v_word` (n, a); keys past
    B_c zero."""
    V = np.asarray(V, dtype=np.uint8)
    B_c = V.shape[0]
    padded = np.zeros((128, d), dtype=np.uint8)
    padded[:B_c, :V.shape[1]] = V
    a = np.arange(128)
    keys = 32 * (a // 32) + p_key_of_a_column(a % 32)
    Vt = padded[keys].T                                   # (d, 128): Vt[n, a] = V[π'(a), n]
    words = np.ascontiguousarray(Vt).view(np.uint32)      # (d, 32): word j of row n = bytes 4j … 4j + 3
    out = np.zeros(32 * d, dtype=np.uint32)
    n = np.arange(d)[:, None]
    j = np.arange(32)[None, :]
    out[transposed_v_word(n, 4 * j)] = words[n, j]
    return out
