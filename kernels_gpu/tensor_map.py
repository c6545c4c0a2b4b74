"""Tensor maps: the descriptors by which Hopper's copy engine (TMA) copies boxes of a tensor into shared memory.

A ``cp.async.bulk.tensor`` instruction (:func:`kernels_gpu.tensorcore.ptx.tensor_copy_4d`) names no addresses: it
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
bytes per row. :func:`swizzled_word` is that address, for the kernels and their tests.

The map lives in global memory (the PTX operand is its generic address); it holds the tensor's base address, so
it is encoded again for every tensor it describes (:class:`DeviceMaps` keeps the encodings it has uploaded).
"""

from __future__ import annotations

import numpy as np

__all__ = ["encode_4d", "swizzled_word", "SWIZZLE_BYTES", "BOX_ROW_BYTES", "DeviceMaps"]

#: the swizzle span of ``CU_TENSOR_MAP_SWIZZLE_128B``: a box row may be at most this long
SWIZZLE_BYTES = 128
#: bytes of one box row (the innermost box extent × element size) used by fa2edu's maps
BOX_ROW_BYTES = 128
#: how much the L2 fetches around the bytes a copy asks for: "none", "64B", "128B" or "256B"
L2_PROMOTION = "256B"


def swizzled_word(row: int, chunk: int) -> int:
    """The 32-bit word (from the box's start) of 16-byte chunk ``chunk`` (0-7) of box row ``row`` under the 128-byte
    swizzle, for a box at a 1024-byte aligned shared address (the same formula the kernels use)."""
    return row * (BOX_ROW_BYTES // 4) + 4 * (chunk ^ (row % 8))


def encode_4d(address: int, element_bytes: int, sizes: tuple, strides_bytes: tuple, box: tuple) -> np.ndarray:
    """A ``CUtensorMap`` (16 uint64 words) for a 4-D tensor of 16-bit elements (``element_bytes`` = 2) at device
    ``address``: ``sizes`` (innermost first), the byte strides of dimensions 1-3 (dimension 0 is contiguous), and the
    ``box`` one copy moves, its innermost extent 128 bytes, swizzled by 128 bytes, with the L2 asked to fetch
    :data:`L2_PROMOTION` around what a copy reads. Raises ValueError with the driver's reason where the driver
    refuses (an address or stride not a multiple of 16 bytes, a box past 256 elements per dimension, …)."""
    from cuda.bindings import driver as drv

    if element_bytes != 2:
        raise ValueError(f"encode_4d takes 16-bit elements, got {element_bytes}-byte ones")
    if box[0] * element_bytes != BOX_ROW_BYTES:
        raise ValueError(f"the box's innermost extent must be {BOX_ROW_BYTES} bytes, got {box[0] * element_bytes}")
    for s in strides_bytes:
        if s % 16 or s <= 0:
            raise ValueError(f"tensor-map strides must be positive multiples of 16 bytes, got {strides_bytes}")
    if address % 16:
        raise ValueError(f"a tensor map's base address must be 16-byte aligned, got {address:#x}")
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
        import torch
        entry = self.entries.get(key)
        capturing = torch.cuda.is_current_stream_capturing()
        if entry is None or (entry["in_capture"] and not capturing):
            host = np.stack(encode()).view(np.int64)
            staged = torch.from_numpy(host).pin_memory()
            buffer = torch.empty(host.shape, dtype=torch.int64, device=device) if entry is None else entry["buffer"]
            buffer.copy_(staged, non_blocking=True)
            entry = dict(buffer=buffer, staged=staged, in_capture=capturing)
            self.entries[key] = entry
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return [entry["buffer"][i] for i in range(entry["buffer"].shape[0])]
