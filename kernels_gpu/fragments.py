"""Which lane of a warp holds which matrix element: the fragment layouts of ``mma.sync.m16n8k16`` and ``ldmatrix``.

A warp-level matrix instruction does not see a matrix in memory: each of the warp's 32 lanes passes a few
registers, and the hardware fixes which elements those registers must hold. These layouts are the whole
difficulty of programming tensor cores by hand, so they are written out here once, as tables and as NumPy
functions. The simulator twins in :mod:`kernels_gpu.ptx` are built on these functions, and the GPU tests
check them against the real instructions.

Notation (PTX ISA, section "Matrix Fragments for mma.m16n8k16 with floating point type"): for lane ``l``,
``g = l // 4`` (the *group*, 0…7) and ``t = l % 4`` (the thread in the group, 0…3). A 32-bit register of a 16-bit
operand holds two elements, the lower-numbered one in its low half.

**A** (16 × 16, row-major, f16 or bf16): four registers ``a0 … a3``, eight elements per lane.

====== ================ ===================
reg    row              columns (low, high)
====== ================ ===================
a0     g                2t, 2t + 1
a1     g + 8            2t, 2t + 1
a2     g                2t + 8, 2t + 9
a3     g + 8            2t + 8, 2t + 9
====== ================ ===================

**B** (16 × 8, "col": element (k, n) with consecutive k packed together): two registers, four elements per lane.

====== ===================== ===================
reg    rows k (low, high)      column n
====== ===================== ===================
b0     2t, 2t + 1              g
b1     2t + 8, 2t + 9          g
====== ===================== ===================

**C, D** (16 × 8, f32): four registers, one element each.

====== ======= ========
reg    row     column
====== ======= ========
c0     g       2t
c1     g       2t + 1
c2     g + 8   2t
c3     g + 8   2t + 1
====== ======= ========

Two facts the FlashAttention kernels are built on follow from the tables:

* **C of two neighbouring n-tiles is A.** The accumulators of S's n-tiles 2k and 2k + 1 (keys 16k … 16k + 15),
  packed to 16 bits in pairs, are exactly the A registers of P for the k-th 16-key step of O += P·V:
  ``a0 = (c0, c1)`` and ``a1 = (c2, c3)`` of tile 2k, ``a2``, ``a3`` the same of tile 2k + 1. P never has to leave
  the registers (FA2's point that S and P stay on chip, one level further down). :func:`c_to_a` is that map.
* **A row's elements live in one group of four lanes.** Lane l holds rows g and g + 8 only, so a row maximum or a
  row sum is a reduction over the four lanes of a group: two butterfly shuffles (xor 1, xor 2).

**ldmatrix** ``.m8n8.x4.b16``: lanes 8i … 8i + 7 each give the address of one 16-byte row of the 8 × 8 matrix i
(i = 0…3). Register ``r_i`` of lane l then holds elements (row g, columns 2t, 2t + 1) of matrix i; with ``.trans``
it holds (rows 2t, 2t + 1, column g), the matrix transposed on the way. So a 16 × 16 tile stored row-major loads as
an A operand (matrices: rows 0–7 / 8–15 × columns 0–7 / 8–15 in the order of a0…a3), K stored [key][d] loads as B
operands of S = Q·Kᵀ, and V stored [key][d] loads *transposed* as the B operands of O = P·V.

**TF32: mma.m16n8k8 with .tf32 operands** (PTX ISA 9.7.14.5.7, "Matrix Fragments for mma.m16n8k8", the
``.tf32`` case). A tf32 value is a float32 whose low 13 mantissa bits are zero (1 sign, 8 exponent, 10 mantissa
bits), one per 32-bit register, so the k-extent halves to 8 and the tables change:

====== ======= ========      ====== ======= ========
A reg  row     column        B reg  row k   column n
====== ======= ========      ====== ======= ========
a0     g       t             b0     t       g
a1     g + 8   t             b1     t + 4   g
a2     g       t + 4
a3     g + 8   t + 4
====== ======= ========      ====== ======= ========

C and D are the m16n8k16 table above. Here **C is not A**: a lane holds columns 2t, 2t + 1 of S but would need
columns t, t + 4 of P as an A operand. Because P·V sums over the keys, any order of the 8 keys of a k-step serves
as long as A and B agree: :data:`KEY_ORDER_TF32` lets A's column t be key 2t and column t + 4 be key 2t + 1, and
then ``a0, a1, a2, a3 = c0, c2, c1, c3`` of S's accumulators, no exchange between lanes (:func:`c_to_a_tf32`);
B's rows follow (b0 = V[2t][g], b1 = V[2t + 1][g]).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "lane_coords", "a_layout", "b_layout", "c_layout", "a_fragments", "b_fragments", "c_fragments",
    "from_a_fragments", "from_b_fragments", "from_c_fragments", "mma_reference", "c_to_a", "ldmatrix_layout",
    "ldmatrix_reference", "layout_table",
    "a_layout_tf32", "b_layout_tf32", "a_fragments_tf32", "b_fragments_tf32", "from_a_fragments_tf32",
    "from_b_fragments_tf32", "mma_tf32_reference", "c_to_a_tf32", "KEY_ORDER_TF32",
]

WARP = 32


def lane_coords(lane):
    """``(g, t)`` of a lane (or an array of lanes): its group ``lane // 4`` and its place in the group."""
    lane = np.asarray(lane)
    return lane // 4, lane % 4


def a_layout() -> np.ndarray:
    """(32, 8, 2) int array: ``[lane, e] = (row, col)`` of element e of lane's A fragment (e = 2·reg + half)."""
    out = np.zeros((WARP, 8, 2), dtype=np.int64)
    for lane in range(WARP):
        g, t = lane_coords(lane)
        for reg in range(4):
            row = g + 8 * (reg % 2)              # a1, a3: the lower eight rows
            col = 2 * t + 8 * (reg // 2)         # a2, a3: the right eight columns
            for half in range(2):
                out[lane, 2 * reg + half] = (row, col + half)
    return out


def b_layout() -> np.ndarray:
    """(32, 4, 2) int array: ``[lane, e] = (k, n)`` of element e of lane's B fragment (e = 2·reg + half)."""
    out = np.zeros((WARP, 4, 2), dtype=np.int64)
    for lane in range(WARP):
        g, t = lane_coords(lane)
        for reg in range(2):
            for half in range(2):
                out[lane, 2 * reg + half] = (2 * t + 8 * reg + half, g)
    return out


def c_layout() -> np.ndarray:
    """(32, 4, 2) int array: ``[lane, e] = (row, col)`` of accumulator register e of lane's C/D fragment."""
    out = np.zeros((WARP, 4, 2), dtype=np.int64)
    for lane in range(WARP):
        g, t = lane_coords(lane)
        for e in range(4):
            out[lane, e] = (g + 8 * (e // 2), 2 * t + e % 2)
    return out


def _gather(matrix: np.ndarray, layout: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    matrix = np.asarray(matrix)
    if matrix.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {matrix.shape}")
    return matrix[layout[..., 0], layout[..., 1]]


def _scatter(fragments: np.ndarray, layout: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    fragments = np.asarray(fragments)
    if fragments.shape != layout.shape[:2]:
        raise ValueError(f"{name} must have shape {layout.shape[:2]}, got {fragments.shape}")
    out = np.zeros(shape, dtype=fragments.dtype)
    out[layout[..., 0], layout[..., 1]] = fragments
    return out


def a_fragments(A: np.ndarray) -> np.ndarray:
    """A (16, 16) → (32, 8): what each lane passes as a0…a3 (two elements per register, low half first)."""
    return _gather(A, a_layout(), (16, 16), "A")


def b_fragments(B: np.ndarray) -> np.ndarray:
    """B (16, 8) → (32, 4): what each lane passes as b0, b1."""
    return _gather(B, b_layout(), (16, 8), "B")


def c_fragments(C: np.ndarray) -> np.ndarray:
    """C (16, 8) → (32, 4): what each lane passes (and gets back) as c0…c3."""
    return _gather(C, c_layout(), (16, 8), "C")


def from_a_fragments(frags: np.ndarray) -> np.ndarray:
    """The inverse of :func:`a_fragments`: (32, 8) → (16, 16)."""
    return _scatter(frags, a_layout(), (16, 16), "A fragments")


def from_b_fragments(frags: np.ndarray) -> np.ndarray:
    """The inverse of :func:`b_fragments`: (32, 4) → (16, 8)."""
    return _scatter(frags, b_layout(), (16, 8), "B fragments")


def from_c_fragments(frags: np.ndarray) -> np.ndarray:
    """The inverse of :func:`c_fragments`: (32, 4) → (16, 8)."""
    return _scatter(frags, c_layout(), (16, 8), "C fragments")


def mma_reference(a_frags: np.ndarray, b_frags: np.ndarray, c_frags: np.ndarray) -> np.ndarray:
    """What ``mma.sync.m16n8k16`` returns, per lane: D = A·B + C with every product exact and one rounding to
    float32 at the end (the sum in float64 first). Inputs and output are fragments ((32, 8), (32, 4), (32, 4))."""
    A = from_a_fragments(a_frags).astype(np.float64)
    B = from_b_fragments(b_frags).astype(np.float64)
    C = from_c_fragments(c_frags).astype(np.float64)
    return c_fragments((A @ B + C).astype(np.float32))


def c_to_a(c_left: np.ndarray, c_right: np.ndarray) -> np.ndarray:
    """The register reuse of FA2 kernels: the C fragments (32, 4) of two neighbouring 16 × 8 tiles (columns
    0–7 and 8–15 of a 16 × 16 block) → that block's A fragments (32, 8), lane by lane, no exchange between lanes.
    a0 = (c0, c1) and a1 = (c2, c3) of the left tile; a2, a3 the same of the right tile."""
    c_left, c_right = np.asarray(c_left), np.asarray(c_right)
    return np.concatenate([c_left[:, 0:2], c_left[:, 2:4], c_right[:, 0:2], c_right[:, 2:4]], axis=1)


def ldmatrix_layout(trans: bool = False) -> np.ndarray:
    """(32, 4, 2, 2) int array: ``[lane, i, half] = (row, col)`` within 8 × 8 matrix i of the element that lane's
    register r_i holds in its low (half 0) or high (half 1) 16 bits, after ``ldmatrix.m8n8.x4`` (``.trans``)."""
    out = np.zeros((WARP, 4, 2, 2), dtype=np.int64)
    for lane in range(WARP):
        g, t = lane_coords(lane)
        for i in range(4):
            for half in range(2):
                out[lane, i, half] = (2 * t + half, g) if trans else (g, 2 * t + half)
    return out


def ldmatrix_reference(memory: np.ndarray, row_addresses: np.ndarray, trans: bool = False) -> np.ndarray:
    """What ``ldmatrix.m8n8.x4(.trans).b16`` gives each lane: ``memory`` a 1-D array of 16-bit values,
    ``row_addresses`` (32,) the element index each lane passes (lanes 8i…8i+7: the 8 rows of matrix i, each 8
    contiguous elements). Returns (32, 4, 2): lane, register r_i, low/high half."""
    memory = np.asarray(memory)
    rows = np.asarray(row_addresses, dtype=np.int64)
    if rows.shape != (WARP,):
        raise ValueError(f"row_addresses must have shape (32,), got {rows.shape}")
    matrices = np.stack([memory[rows[8 * i:8 * i + 8, None] + np.arange(8)] for i in range(4)])   # (4, 8, 8)
    lay = ldmatrix_layout(trans)
    return matrices[np.arange(4)[None, :, None], lay[..., 0], lay[..., 1]]


def layout_table(which: str) -> str:
    """The fragment table of ``"A"``, ``"B"``, ``"C"`` as text: one line per lane, its registers' elements."""
    lay = {"A": a_layout(), "B": b_layout(), "C": c_layout()}.get(which)
    if lay is None:
        raise ValueError(f"which must be 'A', 'B' or 'C', got {which!r}")
    per_reg = 1 if which == "C" else 2
    lines = []
    for lane in range(WARP):
        regs = []
        for r in range(lay.shape[1] // per_reg):
            elems = ", ".join(f"({a},{b})" for a, b in lay[lane, per_reg * r:per_reg * (r + 1)])
            regs.append(f"{which.lower()}{r}={elems}")
        lines.append(f"lane {lane:2d}: " + "  ".join(regs))
    return "\n".join(lines)


# -- TF32: mma.m16n8k8 with .tf32 operands -------------------------------------------------------------------------

#: the key of an 8-key k-step that column k of P's tf32 A operand holds, when A comes from S's accumulators:
#: columns t and t + 4 are keys 2t and 2t + 1 (so B's row k must be V's row ``KEY_ORDER_TF32[k]``)
KEY_ORDER_TF32 = np.array([0, 2, 4, 6, 1, 3, 5, 7])


def a_layout_tf32() -> np.ndarray:
    """(32, 4, 2) int array: ``[lane, reg] = (row, col)`` of tf32 A register a0…a3 (A 16 × 8, one value each)."""
    out = np.zeros((WARP, 4, 2), dtype=np.int64)
    for lane in range(WARP):
        g, t = lane_coords(lane)
        for reg in range(4):
            out[lane, reg] = (g + 8 * (reg % 2), t + 4 * (reg // 2))   # a1, a3: rows + 8; a2, a3: columns + 4
    return out


def b_layout_tf32() -> np.ndarray:
    """(32, 2, 2) int array: ``[lane, reg] = (k, n)`` of tf32 B register b0, b1 (B 8 × 8, one value each)."""
    out = np.zeros((WARP, 2, 2), dtype=np.int64)
    for lane in range(WARP):
        g, t = lane_coords(lane)
        for reg in range(2):
            out[lane, reg] = (t + 4 * reg, g)
    return out


def a_fragments_tf32(A: np.ndarray) -> np.ndarray:
    """A (16, 8) → (32, 4): what each lane passes as a0…a3 of ``mma.m16n8k8`` with tf32 operands."""
    return _gather(A, a_layout_tf32(), (16, 8), "A")


def b_fragments_tf32(B: np.ndarray) -> np.ndarray:
    """B (8, 8) → (32, 2): what each lane passes as b0, b1 of ``mma.m16n8k8`` with tf32 operands."""
    return _gather(B, b_layout_tf32(), (8, 8), "B")


def from_a_fragments_tf32(frags: np.ndarray) -> np.ndarray:
    """The inverse of :func:`a_fragments_tf32`: (32, 4) → (16, 8)."""
    return _scatter(frags, a_layout_tf32(), (16, 8), "A fragments")


def from_b_fragments_tf32(frags: np.ndarray) -> np.ndarray:
    """The inverse of :func:`b_fragments_tf32`: (32, 2) → (8, 8)."""
    return _scatter(frags, b_layout_tf32(), (8, 8), "B fragments")


def mma_tf32_reference(a_frags: np.ndarray, b_frags: np.ndarray, c_frags: np.ndarray) -> np.ndarray:
    """What ``mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32`` returns, per lane, as this module specifies it: D = A·B + C
    with every product of two tf32 values exact (11-bit significands: 22 bits, exact in float64), the eight
    products and C summed exactly (float64, then rounded once to float32). Inputs: fragments (32, 4), (32, 2) of tf32
    values (float32 with the low 13 bits zero) and C (32, 4) float32. The tensor core's own summation order and
    intermediate rounding are not documented and may differ from this in the last bits of float32: the GPU test
    bounds the difference by ``10·2⁻²³·(Σ|a·b| + |c|)`` per element (nine addends, each step's error at most one
    float32 ulp of the running magnitude, whatever the rounding mode)."""
    A = from_a_fragments_tf32(a_frags).astype(np.float64)
    B = from_b_fragments_tf32(b_frags).astype(np.float64)
    C = from_c_fragments(c_frags).astype(np.float64)
    return c_fragments((A @ B + C).astype(np.float32))


def c_to_a_tf32(c: np.ndarray) -> np.ndarray:
    """FA2's register reuse for TF32: the C fragments (32, 4) of one 16 × 8 tile of S (columns = 8 keys) → the A
    fragments (32, 4) of P for the 8-key k-step of O += P·V, lane by lane, no exchange between lanes, with the keys
    in the order :data:`KEY_ORDER_TF32` (A's column k is key ``KEY_ORDER_TF32[k]``): a0 = c0 (row g, key 2t),
    a1 = c2 (row g + 8, key 2t), a2 = c1 (row g, key 2t + 1), a3 = c3 (row g + 8, key 2t + 1)."""
    c = np.asarray(c)
    if c.shape != (WARP, 4):
        raise ValueError(f"c must have shape (32, 4), got {c.shape}")
    return c[:, [0, 2, 1, 3]]

