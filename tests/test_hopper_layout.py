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


# -- one-byte elements (FP8) ----------------------------------------------------------------------------------------

def test_fp8_k_major_operand_reads_128_elements_per_panel():
    """An e4m3 tile stored as the FP8 kernel stores it (panels of 128 bytes = 128 elements): a 128-byte K-major
    descriptor at panel(kk)·R·128 + 32·(kk mod 4) bytes reads columns 32kk … 32kk + 31."""
    rng = np.random.default_rng(4)
    X = rng.integers(0, 256, size=(64, 256), dtype=np.uint8)
    memory = wl.store_tile_fp8(X, panels=2)
    for kk in range(8):
        desc = wl.encode_descriptor((kk // 4) * 64 * 128 + 32 * (kk % 4), 16, 1024, "128B")
        assert np.array_equal(wl.read_operand(memory, desc, 64, "K", element_bytes=1), X[:, 32 * kk:32 * kk + 32])


def test_fp8_unswizzled_core_matrices_are_8_rows_of_16_bytes():
    """Without a swizzle, element (r, k) of an 8-bit K-major operand is byte k % 16 of row r % 8 of the core
    matrix (r // 8, k // 16), core matrices LBO apart along K and SBO apart along M/N."""
    lbo, sbo = 128, 256
    memory = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()
    desc = wl.encode_descriptor(0, lbo, sbo, "none")
    got = wl.operand_byte_addresses(desc, 64, "K", element_bytes=1)
    r, k = np.meshgrid(np.arange(64), np.arange(32), indexing="ij")
    assert np.array_equal(got, (r // 8) * sbo + (k // 16) * lbo + (r % 8) * 16 + (k % 16))
    assert np.array_equal(wl.read_operand(memory, desc, 64, "K", element_bytes=1), memory[got])


def test_fp8_operands_are_k_major_only():
    with pytest.raises(ValueError, match="K-major only"):
        wl.operand_offsets(64, "MN", 1, 2048, 1024, element_bytes=1)


def test_fp8_a_fragment_is_mma_sync_k32_layout():
    """Thread (w, g, q): register 0 row g columns 4q … 4q + 3, register 1 row g + 8, registers 2 and 3 the same 16
    columns on; every element of the 64 × 32 tile held exactly once."""
    lay = wl.a_register_layout_fp8()
    assert np.array_equal(lay[5, :4], [[1, 4], [1, 5], [1, 6], [1, 7]])          # lane 5: g = 1, q = 1
    assert np.array_equal(lay[5, 12:], [[9, 20], [9, 21], [9, 22], [9, 23]])
    flat = lay[..., 0] * 32 + lay[..., 1]
    assert np.array_equal(np.sort(flat.ravel()), np.arange(64 * 32))
    A = np.random.default_rng(5).integers(0, 256, (64, 32)).astype(np.uint8)
    assert np.array_equal(wl.from_a_fragments_fp8(wl.a_fragments_fp8(A)), A)


def test_p_packing_holds_keys_in_the_permuted_order():
    """Packing each thread's accumulators by P_TO_A_FP8 puts, in A's column a of the same row, key π(a): the
    thread's accumulator rows match A's rows, and π is a permutation of 0 … 31."""
    acc = wl.accumulator_layout(32)                     # (128, 16, 2): (row, key) of accumulator i
    A = wl.a_register_layout_fp8()                      # (128, 16, 2): (row, column) of A element 4i + b
    packed = np.array(wl.P_TO_A_FP8).reshape(-1)        # A element e ← accumulator packed[e]
    held = acc[:, packed]                               # (row, key) of what lands in element e
    assert np.array_equal(held[..., 0], A[..., 0])
    assert np.array_equal(held[..., 1], wl.p_key_of_a_column(A[..., 1]))
    assert np.array_equal(np.sort(wl.p_key_of_a_column(np.arange(32))), np.arange(32))


@pytest.mark.parametrize("B_c, d", [(128, 128), (64, 256), (32, 64)])
def test_transposed_v_is_the_b_operand_of_the_permuted_p(B_c, d):
    """Vᵀ as the kernel's transpose writes it, read K-major (128-byte swizzle, SBO 1024) 32 keys at a time, times
    P̃ packed without shuffles (P_TO_A_FP8) equals P̃·V — the permutation of A's columns and B's rows cancel."""
    rng = np.random.default_rng(B_c + d)
    V = rng.integers(0, 256, (B_c, d)).astype(np.uint8)
    V[(V & 0x7F) == 0x7F] = 0                           # no NaN codes
    memory = wl.store_transposed_v(V, d)
    P = rng.uniform(0, 256, (64, B_c)).astype(np.float32)
    from fa2edu.fp8 import from_bits
    Vf = from_bits(V)
    total = np.zeros((64, d))
    for kk in range(B_c // 32):
        desc = wl.encode_descriptor(32 * kk, 16, 1024, "128B")
        B = from_bits(wl.read_operand(memory, desc, d, "K", element_bytes=1)).T          # (32, d)
        keys = 32 * kk + wl.p_key_of_a_column(np.arange(32))
        assert np.array_equal(B, Vf[keys])
        frags = wl.accumulator_fragments(P[:, 32 * kk:32 * kk + 32])                     # (128, 16) accumulators
        A = wl.from_a_fragments_fp8(frags[:, np.array(wl.P_TO_A_FP8).reshape(-1)])       # packed as they are
        total += A.astype(np.float64) @ B
    np.testing.assert_allclose(total, P.astype(np.float64) @ Vf, rtol=1e-12)
