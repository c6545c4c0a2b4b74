"""The Hopper layouts as NumPy (kernels_gpu.wgmma_layout), checked against each other and against the layouts the
rest of kernels_gpu already uses — no kernel runs here. That the hardware reads them so is tests/gpu/test_hopper_gpu.py
(every swizzle and major-ness of wgmma against the same functions)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu import fragments as frag
from kernels_gpu import tensor_map
from kernels_gpu import wgmma_layout as wl


@pytest.mark.parametrize("start, lbo, sbo, mode", [(0, 16, 1024, "128B"), (8192 + 32, 2048, 1024, 1),
                                                   (1024, 128, 256, "none"), (240, 1024, 512, "64B")])
def test_descriptor_round_trip(start, lbo, sbo, mode):
    f = wl.decode_descriptor(wl.encode_descriptor(start, lbo, sbo, mode))
    assert (f["start"], f["lbo"], f["sbo"], f["base_offset"]) == (start, lbo, sbo, 0)
    assert f["mode"] == (wl.SWIZZLE_MODES[mode] if isinstance(mode, str) else mode)


def test_descriptor_refuses_unaligned_offsets():
    with pytest.raises(ValueError, match="multiple of 16"):
        wl.encode_descriptor(8, 16, 1024, "128B")


def test_128b_swizzle_is_the_copy_engines():
    """The address swizzle wgmma applies is the permutation the TMA writes (tensor_map.swizzled_word)."""
    rows, chunks = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    linear = rows * 128 + chunks * 16
    assert np.array_equal(wl.swizzle(linear, 1) // 4, tensor_map.swizzled_word(0, rows, chunks, 16 * 32))


def test_k_major_operand_reads_the_tile_layout():
    """A 128-byte K-major descriptor with SBO = 1024 at 32·kk bytes into a panel reads columns 16kk … 16kk + 15 of
    the tile stored as the kernels store it (wgmma_layout.store_tile)."""
    rng = np.random.default_rng(0)
    X = rng.integers(0, 2**16, size=(64, 128), dtype=np.uint16)
    memory = wl.store_tile(X, panels=2)
    for kk in range(8):
        desc = wl.encode_descriptor((kk // 4) * 64 * 128 + 32 * (kk % 4), 16, 1024, "128B")
        assert np.array_equal(wl.read_operand(memory, desc, 64, "K"), X[:, 16 * kk:16 * kk + 16])


def test_mn_major_operand_reads_v_transposed():
    """V (keys × d) stored as the kernels store it, read MN-major at 16·kk·128 bytes with LBO = one panel:
    element (n, k) is V[16kk + k, n] for n across panels."""
    rng = np.random.default_rng(1)
    B_c, d = 32, 192
    V = rng.integers(0, 2**16, size=(B_c, d), dtype=np.uint16)
    memory = wl.store_tile(V, panels=3)
    for kk in range(B_c // 16):
        desc = wl.encode_descriptor(16 * kk * 128, B_c * 128, 1024, "128B")
        assert np.array_equal(wl.read_operand(memory, desc, d, "MN"), V[16 * kk:16 * kk + 16].T)


def test_store_tile_is_what_a_tma_box_writes():
    rng = np.random.default_rng(2)
    X = rng.integers(0, 2**16, size=(16, 64), dtype=np.uint16)
    words = X.view(np.uint32).reshape(-1)
    tmap = tensor_map.simulated_map(words, (64, 16, 1, 1), (128, 2048, 2048), (64, 16, 1, 1))
    assert np.array_equal(tensor_map.simulated_box(tmap, (0, 0, 0, 0), 0), wl.store_tile(X, panels=1))


def test_accumulators_are_mma_sync_fragments_warp_by_warp():
    """Warp w's accumulators of m64nNk16 are mma.sync's C fragments of rows 16w … 16w + 15, n-tile after n-tile —
    why the mma.sync ladder's softmax steps update a wgmma accumulator unchanged."""
    lay = wl.accumulator_layout(32)                                   # (128, 16, 2)
    c = frag.c_layout()                                               # (32, 4, 2): (row, col) of c0 … c3
    for w in range(4):
        for j in range(4):
            got = lay[32 * w:32 * w + 32, 4 * j:4 * j + 4]
            assert np.array_equal(got[..., 0], c[..., 0] + 16 * w)
            assert np.array_equal(got[..., 1], c[..., 1] + 8 * j)


def test_a_registers_are_mma_sync_a_fragments():
    lay = wl.a_register_layout()                                      # (128, 8, 2)
    a = frag.a_layout()                                               # (32, 8, 2)
    for w in range(4):
        got = lay[32 * w:32 * w + 32]
        assert np.array_equal(got[..., 0], a[..., 0] + 16 * w) and np.array_equal(got[..., 1], a[..., 1])


def test_fragments_round_trip():
    rng = np.random.default_rng(3)
    D = rng.standard_normal((64, 48)).astype(np.float32)
    assert np.array_equal(wl.from_accumulator_fragments(wl.accumulator_fragments(D)), D)
    A = rng.standard_normal((64, 16)).astype(np.float32)
    assert np.array_equal(wl.from_a_fragments(wl.a_fragments(A)), A)


def test_read_operand_refuses_addresses_outside_memory():
    with pytest.raises(IndexError, match="outside shared memory"):
        wl.read_operand(np.zeros(64, np.uint32), wl.encode_descriptor(0, 16, 1024, "128B"), 64, "K")
