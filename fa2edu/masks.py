"""Masks: causal (bottom-right aligned), key padding, block classification, block-sparse (FA1 Alg. 5).

Convention: a boolean mask is ``True`` where query i may attend to key j, ``False`` where the score is set to −inf
(a real −inf, never a finite sentinel: see chapter 2). Causal masking is aligned to the bottom-right corner
(flash-attn ≥ 2.1): query i sees key j iff ``j <= i + N_k - N_q``. With N_q > N_k the first ``N_q - N_k`` rows see
no key at all; such fully masked rows give O = 0 and L = +inf.

FA2 Section 3.1 classifies each (B_r × B_c) block of S: blocks that are entirely masked are *skipped* (no loads, no
FLOPs), blocks that straddle the diagonal are *masked*, the rest are *plain*. The paper's sentence about which
blocks need no mask is reversed (erratum 6, chapter 11): blocks whose row indices are all *smaller* than
their column indices are the skipped ones.
"""

from __future__ import annotations

import enum

import numpy as np

from fa2edu.blocks import num_blocks

__all__ = [
    "BlockKind", "causal_mask", "causal_offset", "key_padding_mask", "block_visible", "classify_block",
    "block_sparse_to_mask", "check_block_mask", "butterfly_block_mask", "random_block_mask",
]


class BlockKind(enum.Enum):
    """What a tile of S needs: nothing (PLAIN), an elementwise mask (MASK), or nothing at all (SKIP)."""

    SKIP = "skip"
    MASK = "mask"
    PLAIN = "plain"


def causal_offset(N_q: int, N_k: int) -> int:
    """Bottom-right alignment: query i sees key j iff j <= i + (N_k - N_q)."""
    return N_k - N_q


def causal_mask(N_q: int, N_k: int, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
    """Boolean (rows × cols) tile of the causal mask, ``True`` where ``j <= i + N_k - N_q`` (default: all of it)."""
    rows = rows or slice(0, N_q)
    cols = cols or slice(0, N_k)
    i = np.arange(rows.start, rows.stop)[:, None]
    j = np.arange(cols.start, cols.stop)[None, :]
    return j <= i + causal_offset(N_q, N_k)


def key_padding_mask(lengths, N_q: int, N_k: int) -> np.ndarray:
    """Mask of shape (B, 1, N_q, N_k) letting batch entry b attend to its first ``lengths[b]`` keys only.

    ``lengths[b] = 0`` makes every row of entry b fully masked. Broadcasts over heads (axis 1 has size 1).
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"lengths must be a 1-D integer array, got dtype {lengths.dtype} and shape {lengths.shape}")
    if (lengths < 0).any() or (lengths > N_k).any():
        raise ValueError(f"lengths must lie in [0, N_k = {N_k}], got {lengths.tolist()}")
    keep = np.arange(N_k)[None, :] < lengths[:, None]                      # (B, N_k)
    return np.broadcast_to(keep[:, None, None, :], (len(lengths), 1, N_q, N_k)).copy()


def block_visible(N_q: int, N_k: int, rows: slice, cols: slice, causal: bool,
                  mask: np.ndarray | None = None) -> np.ndarray | None:
    """The (…, rows, cols) boolean tile of "may attend", or ``None`` when nothing is masked in this tile.

    ``mask`` is the algorithm-layout mask (Z, H_kv, G, N_q, N_k) or ``None``.
    """
    visible = None
    if causal and cols.stop - 1 > rows.start + causal_offset(N_q, N_k):  # some j > i + offset in this tile
        visible = causal_mask(N_q, N_k, rows, cols)
    if mask is not None:
        tile = mask[..., rows, cols]
        visible = tile if visible is None else (tile & visible)
    return visible


def classify_block(N_q: int, N_k: int, rows: slice, cols: slice, causal: bool,
                   mask: np.ndarray | None = None) -> tuple[BlockKind, float, np.ndarray | None]:
    """FA2 Section 3.1's block classification of tile (rows, cols) of S.

    Returns ``(kind, share, visible)``: ``kind`` is SKIP when no program has a visible entry in the tile, PLAIN when
    nothing is masked, MASK otherwise; ``share`` is the fraction of programs (batch, head) that visit the block
    (1.0 unless a per-program mask differs between them); ``visible`` is the boolean tile to apply (``None`` for
    PLAIN). Cost: O(1) for causal alone; O(B_r·B_c) per program with an explicit mask.
    """
    # Causal alone: the tile is skipped when even its bottom-left entry (largest i, smallest j) is masked.
    if causal and cols.start > rows.stop - 1 + causal_offset(N_q, N_k):
        return BlockKind.SKIP, 0.0, None
    visible = block_visible(N_q, N_k, rows, cols, causal, mask)
    if visible is None:
        return BlockKind.PLAIN, 1.0, None
    any_visible = visible.any(axis=(-2, -1))        # per program
    share = float(np.mean(np.broadcast_to(any_visible, mask.shape[:-2]))) if mask is not None else 1.0
    if share == 0.0:
        return BlockKind.SKIP, 0.0, None
    if visible.all():
        return BlockKind.PLAIN, share, None
    return BlockKind.MASK, share, visible


# -- block-sparse FlashAttention (FA1 Section 3.3, Algorithm 5) -----------------------------------------------------

def check_block_mask(block_mask, N_q: int, N_k: int, B_r: int, B_c: int) -> np.ndarray:
    """A block mask M̃ is a bool (T_r, T_c) array; True marks a non-zero block that the algorithm visits."""
    T_r, T_c = num_blocks(N_q, B_r), num_blocks(N_k, B_c)
    if not isinstance(block_mask, np.ndarray) or block_mask.dtype != np.bool_:
        raise TypeError("block_mask must be a numpy bool array of shape (T_r, T_c)")
    if block_mask.shape != (T_r, T_c):
        raise ValueError(f"block_mask must have shape (T_r, T_c) = ({T_r}, {T_c}) for N_q = {N_q}, N_k = {N_k}, "
                         f"B_r = {B_r}, B_c = {B_c}; got {block_mask.shape}")
    return block_mask


def block_sparse_to_mask(block_mask: np.ndarray, N_q: int, N_k: int, B_r: int, B_c: int) -> np.ndarray:
    """Expand a (T_r, T_c) block mask to the (N_q, N_k) element mask it stands for (FA1 Section 3.3)."""
    check_block_mask(block_mask, N_q, N_k, B_r, B_c)
    return np.repeat(np.repeat(block_mask, B_r, axis=0), B_c, axis=1)[:N_q, :N_k]


def butterfly_block_mask(T_r: int, T_c: int) -> np.ndarray:
    """A butterfly-style block pattern (FA1 Section 3.3 uses a fixed butterfly sparsity): block (i, j) is non-zero
    when i == j or i XOR j is a power of two, plus the first column (global tokens)."""
    i = np.arange(T_r)[:, None]
    j = np.arange(T_c)[None, :]
    x = i ^ j
    return (x == 0) | ((x & (x - 1)) == 0) | (j == 0)


def random_block_mask(T_r: int, T_c: int, density: float, seed: int = 0) -> np.ndarray:
    """A random (T_r, T_c) block mask with about ``density`` of its blocks non-zero (the diagonal always kept)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must lie in [0, 1], got {density}")
    rng = np.random.default_rng(seed)
    keep = rng.random((T_r, T_c)) < density
    keep[np.arange(min(T_r, T_c)), np.arange(min(T_r, T_c))] = True
    return keep

