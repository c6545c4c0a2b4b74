"""Dropout without storing the mask: a counter-based generator (FA1 Algorithm 2 and Appendix B.4).

FA1 saves only the PRNG *state* R in the forward pass and regenerates the dropout mask Z in the backward pass.
fa2edu's generator is counter-based: the keep/drop decision for score (i, j) of head h in batch entry b is a pure
function of ``(seed, b, h, i, j)``. The forward and backward passes, FA1's K/V-outer and FA2's Q-outer loop orders,
any block sizes, and the GPU kernels therefore all see the same mask, element for element.

The hash is SplitMix64's finaliser applied to the key one field at a time (five rounds of xor-shift-multiply on
64-bit unsigned integers), which a CUDA kernel can compute in a few instructions. The top 24 bits give a uniform
``u`` in [0, 1); the entry is **kept** when ``u >= p``, so it is kept with probability ``1 - p``, and kept entries are
scaled by ``1 / (1 - p)`` so that the expectation of the output is unchanged.
"""

from __future__ import annotations

from numbers import Integral, Real

import numpy as np

__all__ = ["mix64", "uniform", "keep_mask", "check_dropout"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function: a bijection of uint64 that scrambles every input bit into every output bit."""
    with np.errstate(over="ignore"):
        x = (x + _GOLDEN).astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def uniform(seed: int, batch, head, rows, cols) -> np.ndarray:
    """u(seed, b, h, i, j) in [0, 1), broadcast over the index arrays ``batch, head, rows, cols``."""
    x = mix64(np.uint64(seed))
    for field in (batch, head, rows, cols):
        x = mix64(x ^ np.asarray(field, dtype=np.uint64))
    return (x >> np.uint64(40)).astype(np.float64) / float(1 << 24)


def keep_mask(seed: int, p: float, lead: tuple[int, ...], heads: int, rows: slice, cols: slice) -> np.ndarray:
    """Boolean keep-mask Z of shape ``(*lead, rows, cols)`` for the programs laid out as ``lead``.

    ``lead`` are the algorithm-layout leading axes (Z, H_kv, G); the flat program index z = b·H_q + h gives the
    batch entry b = z // heads and head h = z % heads, with ``heads`` = H_q.
    """
    programs = int(np.prod(lead))
    z = np.arange(programs, dtype=np.int64).reshape(lead + (1, 1))
    i = np.arange(rows.start, rows.stop)[:, None]
    j = np.arange(cols.start, cols.stop)[None, :]
    return uniform(seed, z // heads, z % heads, i, j) >= p


def check_dropout(dropout_p, seed) -> tuple[float, int]:
    """``dropout_p`` must be a real in [0, 1); ``seed`` a non-negative int (the PRNG state R of FA1 Alg. 2)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
        raise TypeError(f"seed must be a non-negative int, got {seed!r}")
    return float(dropout_p), int(seed)
