"""Tensor maps: the descriptors by which Hopper's copy engine (TMA) copies boxes of a tensor into shared memory.

A ``cp.async.bulk.tensor`` instruction (:func:`kernels_gpu.ptx.tensor_copy_4d`) names no addresses: it
names a *tensor map* — a 128-byte ``CUtensorMap`` that the driver encodes on the host (``cuTensorMapEncodeTiled``)
from the tensor's base address, sizes and byte strides, the box one copy moves, and how the box is laid out in
shared memory — and the coordinates of the box's first element. The copy engine then walks the strides itself,
fills elements past the tensor's edges with zeros, and signals an mbarrier with the bytes as they land: one
instruction from one lane per box, where ``cp.async`` takes one per 16 bytes and lane.

**The swizzle.** With ``CU_TENSOR_MAP_SWIZZLE_128B`` each 128-byte row of the box lands with its eight 16-byte
chunks permuted: chunk c of the row at shared address a goes to chunk ``c ^ ((a >> 7) & 7)``. A box of 16 rows ×
128 bytes at a 1024-byte aligned address therefore holds element chunk c of row r at ``r·128 + 16·(c ^ (r % 8))``,
and the eight rows an ``ldmatrix`` reads for one 8 × 8 tile (same logical chunk, rows r … r + 7) sit in eight
different chunks: all 32 banks, no conflict — what the padded rows of the ``cp.async`` programs buy with 16 unused
bytes per row. :func:`swizzled_word` is that address (and :func:`swizzled_step` a cheaper way to the same one);
the kernels compile these very functions, and the tests run them on the CPU.

The map lives in global memory (the PTX operand is its generic address); it holds the tensor's base address, so
it is encoded again for every tensor it describes (:class:`DeviceMaps` keeps the encodings it has uploaded).

**In numba's simulator** there is no driver to encode a map: :func:`simulated_map` makes a stand-in — 16 words
holding a token under which the tensor and its geometry are kept — and :func:`simulated_box` is what the copy
engine would write for it (zeros past the edges, the swizzle applied), for the twin of ``tensor_copy_4d``
(:mod:`kernels_gpu.ptx`). So the tensor-copy programs run in CI as they do on the GPU.
"""

from __future__ import annotations

import numpy as np

__all__ = ["encode_4d", "swizzled_word", "swizzled_step", "SWIZZLE_BYTES", "BOX_ROW_BYTES", "DeviceMaps",
           "simulated_map", "simulated_box"]

#: the swizzle span of ``CU_TENSOR_MAP_SWIZZLE_128B``: a box row may be at most this long
SWIZZLE_BYTES = 128
#: bytes of one box row (the innermost box extent × element size) used by fa2edu's maps
BOX_ROW_BYTES = 128
#: how much the L2 fetches around the bytes a copy asks for: "none", "64B", "128B" or "256B"
L2_PROMOTION = "256B"


def swizzled_word(base, row, chunk, box_words):
    """The 32-bit word of 16-byte chunk ``chunk`` of row ``row`` of a tile stored as boxes of 128-byte rows under the
    128-byte swizzle: the tile starts at word ``base`` (1024-byte aligned), chunk c lies in box c // 8 (each
    ``box_words`` long) at chunk c % 8 of its row, permuted to (c % 8) ⊕ (row % 8)."""
    return base + (chunk >> 3) * box_words + row * 32 + (((chunk & 7) ^ (row & 7)) << 2)


def swizzled_step(lane_word, chunk, box_words):
    """``swizzled_word(base, row, chunk, box_words)`` for an even ``chunk``, from ``lane_word`` = swizzled_word(
    base, row, c0, box_words) with c0 = 0 or 1 and ``base`` a multiple of 32 words: a row is 32 words, so the
    swizzle only flips bits 2-4 of the word's index, and an even chunk flips them by the constant (chunk % 8)·4 —
    one XOR with a constant and one add per ``ldmatrix``, where recomputing ``swizzled_word`` per (row, chunk) costs
    the compiler a register for each one it hoists out of the loop."""
    return (lane_word ^ ((chunk & 7) << 2)) + (chunk >> 3) * box_words


def encode_4d(address: int, element_bytes: int, sizes: tuple, strides_bytes: tuple, box: tuple) -> np.ndarray:
    """A ``CUtensorMap`` (16 uint64 words) for a 4-D tensor of 16-bit elements (``element_bytes`` = 2) at device
    ``address``: ``sizes`` (innermost first), the byte strides of dimensions 1-3 (dimension 0 is contiguous), and the
    ``box`` one copy moves, its innermost extent 128 bytes, swizzled by 128 bytes, with the L2 asked to fetch
    :data:`L2_PROMOTION` around what a copy reads. Raises ValueError with the driver's reason where the driver
    refuses (an address or stride not a multiple of 16 bytes, a box past 256 elements per dimension, …)."""
    if element_bytes != 2:
        raise ValueError(f"encode_4d takes 16-bit elements, got {element_bytes}-byte ones")
    if box[0] * element_bytes != BOX_ROW_BYTES:
        raise ValueError(f"the box's innermost extent must be {BOX_ROW_BYTES} bytes, got {box[0] * element_bytes}")
    for s in strides_bytes:
        if s % 16 or s <= 0:
            raise ValueError(f"tensor-map strides must be positive multiples of 16 bytes, got {strides_bytes}")
    if address % 16:
        raise ValueError(f"a tensor map's base address must be 16-byte aligned, got {address:#x}")
    from cuda.bindings import driver as drv
    T = drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16
    err, tmap = drv.cuTensorMapEncodeTiled(
        T, 4, address, [drv.cuuint64_t(int(x)) for x in sizes], [drv.cuuint64_t(int(x)) for x in strides_bytes],
        [drv.cuuint32_t(int(x)) for x in box], [drv.cuuint32_t(1)] * 4,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        getattr(drv.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" +
                ("NONE" if L2_PROMOTION == "none" else "L2_" + L2_PROMOTION)),
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused sizes {sizes}, strides {strides_bytes} bytes, box {box}: "
                         f"{err.name}")
    return np.array([int(w) for w in tmap.opaque], dtype=np.uint64)


#: the simulator's stand-in maps by token: (flat array of 32-bit words, sizes, byte strides, box) — see simulated_map
_SIMULATED: dict = {}
#: the first word of a stand-in map ("fa2eduTM" as bytes)
SIMULATED_MAGIC = 0x4D54756465326166


def simulated_map(words, sizes: tuple, strides_bytes: tuple, box: tuple) -> np.ndarray:
    """The simulator's stand-in for :func:`encode_4d` (16-bit elements): the same sizes, byte strides and box, of a
    tensor held as ``words`` (a flat array of 32-bit words, two elements each — how the decoding kernels see a
    16-bit cache), kept under a token that the returned 16 words carry. The tensor is kept alive with it (the
    stand-ins live as long as the process; they are for tests)."""
    if box[0] * 2 != BOX_ROW_BYTES:
        raise ValueError(f"the box's innermost extent must be {BOX_ROW_BYTES} bytes, got {box[0] * 2}")
    token = len(_SIMULATED) + 1
    _SIMULATED[token] = (words, tuple(int(x) for x in sizes), tuple(int(x) for x in strides_bytes),
                         tuple(int(x) for x in box))
    out = np.zeros(16, dtype=np.uint64)
    out[0], out[1] = SIMULATED_MAGIC, token
    return out


def simulated_box(tmap, coords: tuple, dst_byte: int) -> np.ndarray:
    """What ``cp.async.bulk.tensor`` writes for stand-in map ``tmap`` (:func:`simulated_map`) at element
    coordinates ``coords`` into shared memory from byte ``dst_byte`` on: the box's rows (dimension 1, then 2, then 3)
    as 32-bit words, elements outside the tensor zero, each 128-byte row's chunks permuted by the 128-byte swizzle
    of its shared-memory address (chunk c → c ⊕ ((address >> 7) mod 8))."""
    tmap = np.asarray(tmap).reshape(-1)
    if int(tmap[0]) != SIMULATED_MAGIC or int(tmap[1]) not in _SIMULATED:
        raise RuntimeError("tensor_copy_4d: the map is not a simulated tensor map (kernels_gpu.tensor_map)")
    words, sizes, strides, box = _SIMULATED[int(tmap[1])]
    flat = np.asarray(getattr(words, "_ary", words)).reshape(-1)
    c0, c1, c2, c3 = (int(c) for c in coords)
    if c0 % 2:
        raise RuntimeError("tensor_copy_4d (simulated): the innermost coordinate must be even (whole words)")
    row_words = box[0] // 2
    rows = []
    for i3 in range(c3, c3 + box[3]):
        for i2 in range(c2, c2 + box[2]):
            for i1 in range(c1, c1 + box[1]):
                row = np.zeros(row_words, dtype=np.uint32)
                if 0 <= i1 < sizes[1] and 0 <= i2 < sizes[2] and 0 <= i3 < sizes[3]:
                    start = (i1 * strides[0] + i2 * strides[1] + i3 * strides[2]) // 4 + c0 // 2
                    cols = [w for w in range(row_words) if 0 <= c0 + 2 * w < sizes[0]]
                    row[cols] = flat[[start + w for w in cols]]
                rows.append(row)
    out = np.empty((len(rows), row_words), dtype=np.uint32)
    for r, row in enumerate(rows):
        phase = ((dst_byte + r * BOX_ROW_BYTES) >> 7) & 7
        for chunk in range(row_words // 4):
            out[r, 4 * (chunk ^ phase):4 * (chunk ^ phase) + 4] = row[4 * chunk:4 * chunk + 4]
    return out.reshape(-1)


class DeviceMaps:
    """Tensor maps in device memory, one per tensor a kernel reads by tensor copies, kept per encoding: ``get(key,
    encode)`` returns the device copy (a PyTorch tensor of 16 int64 words) of the maps ``encode()`` makes, encoding
    and uploading them the first time ``key`` (the tensors' addresses and geometry) is seen. A map holds its
    tensor's address, so a cache that moves gets new maps; the 64 most recently used are kept.

    The upload is stream-ordered on PyTorch's current stream, from pinned memory kept with the maps: a launch
    queued after it finds them written, and a CUDA graph that captures it replays the copy. Maps first uploaded
    inside a capture (where nothing runs) are uploaded again at their next use outside one."""

    def __init__(self, capacity: int = 64):
        from collections import OrderedDict
        self.entries, self.capacity = OrderedDict(), capacity

    def get(self, key, encode, device) -> list:
        """The maps of ``key`` as device tensors of 16 words each (encoded and uploaded by ``encode()`` if new)."""
        return self._entry(key, encode, device)["rows"]

    def pointers(self, key, encode, device) -> tuple:
        """The device addresses of :meth:`get`'s tensors (what a prepared launch takes)."""
        return self._entry(key, encode, device)["pointers"]

    def _entry(self, key, encode, device) -> dict:
        import torch
        entry = self.entries.get(key)
        capturing = torch.cuda.is_current_stream_capturing()
        if entry is None or (entry["in_capture"] and not capturing):
            host = np.stack(encode()).view(np.int64)
            staged = torch.from_numpy(host).pin_memory()
            buffer = torch.empty(host.shape, dtype=torch.int64, device=device) if entry is None else entry["buffer"]
            buffer.copy_(staged, non_blocking=True)
            rows = [buffer[i] for i in range(buffer.shape[0])]
            entry = dict(buffer=buffer, staged=staged, in_capture=capturing, rows=rows,
                         pointers=tuple(r.data_ptr() for r in rows))
            self.entries[key] = entry
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
        return entry
