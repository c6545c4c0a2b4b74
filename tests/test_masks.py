"""Masks: causal bottom-right alignment, key padding, FA2 Section 3.1's block classification, block-sparse masks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa2edu.blocks import tiles
from fa2edu.masks import (
    BlockKind,
    block_sparse_to_mask,
    butterfly_block_mask,
    causal_mask,
    check_block_mask,
    classify_block,
    key_padding_mask,
    random_block_mask,
)


def causal_by_definition(N_q: int, N_k: int) -> np.ndarray:
    """Query i sees key j iff j ≤ i + N_k − N_q: the last query sees every key (bottom-right corner)."""
    return np.array([[j <= i + N_k - N_q for j in range(N_k)] for i in range(N_q)], dtype=bool)


@pytest.mark.parametrize("N_q, N_k", [(5, 5), (3, 8), (8, 3), (1, 4), (4, 1), (7, 6)])
def test_causal_mask_is_aligned_bottom_right(N_q, N_k):
    mask = causal_mask(N_q, N_k)
    np.testing.assert_array_equal(mask, causal_by_definition(N_q, N_k))
    assert mask[-1].all()                                   # the last query sees all keys
    # N_q > N_k: the first N_q − N_k queries see no key at all; otherwise every query sees at least one.
    assert (~mask.any(axis=1)).sum() == max(0, N_q - N_k)
    # Each query sees one more key than the one before it, until all keys are seen.
    seen = mask.sum(axis=1)
    assert (np.diff(seen) <= 1).all() and (np.diff(seen) >= 0).all()


def test_causal_mask_for_n_q_less_than_n_k_shows_the_past_in_full():
    # Decoding 2 new queries against 5 keys: query 0 sees keys 0..3, query 1 sees 0..4.
    np.testing.assert_array_equal(causal_mask(2, 5), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(causal_mask(4, 2), [[0, 0], [0, 0], [1, 0], [1, 1]])


@given(N_q=st.integers(1, 20), N_k=st.integers(1, 20), data=st.data())
def test_causal_mask_tiles_are_slices_of_the_whole(N_q, N_k, data):
    r0 = data.draw(st.integers(0, N_q - 1))
    r1 = data.draw(st.integers(r0 + 1, N_q))
    c0 = data.draw(st.integers(0, N_k - 1))
    c1 = data.draw(st.integers(c0 + 1, N_k))
    np.testing.assert_array_equal(causal_mask(N_q, N_k, slice(r0, r1), slice(c0, c1)),
                                  causal_mask(N_q, N_k)[r0:r1, c0:c1])


@st.composite
def layout_masks(draw):
    """An optional mask in the algorithms' layout (Z, H_kv, G, N_q, N_k), shared or differing between programs."""
    N_q, N_k = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    kind = draw(st.sampled_from(["none", "shared", "per-program", "padding"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    density = draw(st.sampled_from([0.0, 0.2, 0.8, 1.0]))
    if kind == "none":
        mask = None
    elif kind == "shared":
        mask = np.broadcast_to(rng.random((N_q, N_k)) < density, (2, 1, 2, N_q, N_k))
    elif kind == "per-program":
        mask = rng.random((2, 1, 2, N_q, N_k)) < density
    else:
        lengths = rng.integers(0, N_k + 1, size=2)
        mask = np.broadcast_to((np.arange(N_k) < lengths[:, None])[:, None, None, None, :], (2, 1, 2, N_q, N_k))
    return N_q, N_k, mask


@given(problem=layout_masks(), causal=st.booleans(), B_r=st.integers(1, 7), B_c=st.integers(1, 7))
def test_classify_block_agrees_with_the_element_mask_on_every_tile(problem, causal, B_r, B_c):
    N_q, N_k, mask = problem
    visible_all = np.ones((2, 1, 2, N_q, N_k), dtype=bool)
    if causal:
        visible_all &= causal_by_definition(N_q, N_k)
    if mask is not None:
        visible_all &= mask
    for rows in tiles(N_q, B_r):
        for cols in tiles(N_k, B_c):
            kind, share, visible = classify_block(N_q, N_k, rows, cols, causal, mask)
            tile = visible_all[..., rows, cols]
            any_per_program = tile.any(axis=(-2, -1))
            if kind is BlockKind.SKIP:
                assert not tile.any() and share == 0.0 and visible is None
            elif kind is BlockKind.PLAIN:
                assert tile.all() and share == 1.0 and visible is None
            else:
                assert tile.any() and not tile.all()
                np.testing.assert_array_equal(np.broadcast_to(visible, tile.shape), tile)
                assert share == pytest.approx(any_per_program.mean())
            # SKIP ⇔ all masked, PLAIN ⇔ none masked (for every program)
            assert (kind is BlockKind.SKIP) == (not tile.any())
            assert (kind is BlockKind.PLAIN) == bool(tile.all())


def test_causal_classification_skips_above_the_diagonal_and_masks_only_the_diagonal():
    kinds = [[classify_block(12, 12, r, c, True)[0] for c in tiles(12, 4)] for r in tiles(12, 4)]
    S, M, P = BlockKind.SKIP, BlockKind.MASK, BlockKind.PLAIN
    assert kinds == [[M, S, S], [P, M, S], [P, P, M]]      # erratum 6: the skipped blocks are those with i < j


def test_key_padding_mask():
    mask = key_padding_mask(np.array([3, 0, 5]), N_q=4, N_k=5)
    assert mask.shape == (3, 1, 4, 5) and mask.dtype == np.bool_
    np.testing.assert_array_equal(mask[0, 0], np.tile([1, 1, 1, 0, 0], (4, 1)))
    assert not mask[1].any()                                # length 0: every row fully masked
    assert mask[2].all()
    with pytest.raises(ValueError, match="lengths"):
        key_padding_mask(np.array([6]), N_q=2, N_k=5)
    with pytest.raises(ValueError, match="lengths"):
        key_padding_mask(np.array([-1]), N_q=2, N_k=5)
    with pytest.raises(TypeError, match="lengths"):
        key_padding_mask(np.array([1.5]), N_q=2, N_k=5)


@given(N_q=st.integers(1, 20), N_k=st.integers(1, 20), B_r=st.integers(1, 6), B_c=st.integers(1, 6),
       seed=st.integers(0, 1000), density=st.sampled_from([0.0, 0.3, 1.0]))
def test_block_sparse_expansion(N_q, N_k, B_r, B_c, seed, density):
    T_r, T_c = -(-N_q // B_r), -(-N_k // B_c)
    block_mask = random_block_mask(T_r, T_c, density, seed)
    assert block_mask.shape == (T_r, T_c)
    assert block_mask[np.arange(min(T_r, T_c)), np.arange(min(T_r, T_c))].all()
    mask = block_sparse_to_mask(block_mask, N_q, N_k, B_r, B_c)
    assert mask.shape == (N_q, N_k)
    i, j = np.arange(N_q)[:, None], np.arange(N_k)[None, :]
    np.testing.assert_array_equal(mask, block_mask[i // B_r, j // B_c])
    # Classification of the expanded mask recovers the block mask: zero blocks are skipped, the rest are plain.
    for bi, rows in enumerate(tiles(N_q, B_r)):
        for bj, cols in enumerate(tiles(N_k, B_c)):
            kind, _, _ = classify_block(N_q, N_k, rows, cols, False, mask)
            assert kind is (BlockKind.PLAIN if block_mask[bi, bj] else BlockKind.SKIP)


def test_block_mask_checks_and_butterfly():
    with pytest.raises(ValueError, match="block_mask"):
        check_block_mask(np.ones((2, 2), dtype=bool), 10, 10, 4, 4)      # needs (3, 3)
    with pytest.raises(TypeError, match="block_mask"):
        check_block_mask(np.ones((3, 3)), 10, 10, 4, 4)
    bf = butterfly_block_mask(8, 8)
    expected = [[i == j or bin(i ^ j).count("1") == 1 or j == 0 for j in range(8)] for i in range(8)]
    np.testing.assert_array_equal(bf, expected)             # diagonal, i XOR j a power of two, global column 0
    with pytest.raises(ValueError, match="density"):
        random_block_mask(2, 2, 1.5)
