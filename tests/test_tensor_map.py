"""kernels_gpu.tensor_map on the CPU: the 128-byte swizzle the decoding program's tiles are stored in (its address
formulas, the very functions the kernels compile), and the simulator's stand-in for the copy engine."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu import tensor_map as tm

BOX = 16 * 32            # words of a box of 16 rows × 128 bytes


def test_swizzle_permutes_each_row_and_keeps_ldmatrix_free_of_bank_conflicts():
    """Within a tile of two boxes (16 rows × 16 chunks), every (row, chunk) has its own 16-byte slot in its own row
    and box; the 8 rows an ldmatrix reads for one 8 × 8 matrix (rows 8k … 8k + 7, one logical chunk) fall in 8
    different groups of 4 banks — all 32 banks, no conflict."""
    words = {(r, c): tm.swizzled_word(0, r, c, BOX) for r in range(16) for c in range(16)}
    assert sorted(words.values()) == list(range(0, 2 * BOX, 4))
    for (r, c), w in words.items():
        assert w // BOX == c // 8 and (w % BOX) // 32 == r
    for r0 in (0, 8):
        for c in range(16):
            groups = {(words[r0 + i, c] // 4) % 8 for i in range(8)}
            assert len(groups) == 8


@pytest.mark.parametrize("base", [0, 256, 1024, 4096 + 512])
def test_the_step_from_a_lanes_word_is_the_address(base):
    """swizzled_step (one XOR with a constant and an add) from the word of chunk 0 or 1 gives swizzled_word for every
    even chunk: the identity the kernel's ldmatrix loops rely on."""
    for r in range(16):
        for c0 in (0, 1):
            lane = tm.swizzled_word(base, r, c0, BOX)
            for c in range(0, 16, 2):
                assert tm.swizzled_step(lane, c, BOX) == tm.swizzled_word(base, r, c + c0, BOX)


def test_simulated_box_is_what_the_copy_engine_writes():
    """A box of 16 rows × 64 elements of a (2 sequences, 3 heads, 40 rows, 64 + 16 elements) tensor: rows past the
    tensor's 40 read zeros; each row's 16-byte chunks are permuted by the swizzle of their shared-memory address
    (chunk c → c ⊕ ((address >> 7) mod 8)), so the layout agrees with swizzled_word at a 1024-byte aligned
    destination and shifts with the address otherwise."""
    B, H, N, W = 2, 3, 40, 80                      # W elements per row (40 words), 64 of them in the box
    src = np.arange(B * H * N * W // 2, dtype=np.uint32)
    sizes, strides = (W, N, H, B), (W * 2, N * W * 2, H * N * W * 2)
    tmap = tm.simulated_map(src, sizes, strides, (64, 16, 1, 1))
    out = tm.simulated_box(tmap, (0, 30, 2, 1), 0).reshape(16, 32)
    for r in range(16):
        for c in range(8):
            got = out[r].reshape(8, 4)[c ^ (r % 8)]
            if 30 + r < N:
                start = (1 * H * N + 2 * N + 30 + r) * W // 2 + 4 * c
                np.testing.assert_array_equal(got, src[start:start + 4])
            else:
                assert not got.any()
    assert np.array_equal(out.reshape(-1)[tm.swizzled_word(0, 3, 5, BOX):][:4],
                          src[(1 * H * N + 2 * N + 33) * W // 2 + 20:][:4])
    shifted = tm.simulated_box(tmap, (0, 30, 2, 1), 128).reshape(16, 32)
    assert np.array_equal(shifted[0].reshape(8, 4)[2 ^ 1], out[0].reshape(8, 4)[2])
    with pytest.raises(RuntimeError, match="not a simulated tensor map"):
        tm.simulated_box(np.zeros(16, np.uint64), (0, 0, 0, 0), 0)


def test_encode_4d_refuses_what_the_copy_engine_cannot_walk():
    with pytest.raises(ValueError, match="16-bit elements"):
        tm.encode_4d(0, 4, (64, 16, 1, 1), (256, 4096, 8192), (32, 16, 1, 1))
    with pytest.raises(ValueError, match="innermost extent"):
        tm.encode_4d(0, 2, (64, 16, 1, 1), (256, 4096, 8192), (32, 16, 1, 1))
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        tm.encode_4d(0, 2, (64, 16, 1, 1), (264, 4096, 8192), (64, 16, 1, 1))
    with pytest.raises(ValueError, match="16-byte aligned"):
        tm.encode_4d(8, 2, (64, 16, 1, 1), (256, 4096, 8192), (64, 16, 1, 1))
