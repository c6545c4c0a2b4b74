"""Softmax three ways, and the (m, ℓ) merge that makes it streamable (FA2 Section 2.3.1, FA1 Section 3.1).

* :func:`naive_softmax` — ``exp(x) / sum(exp(x))``: overflows to inf/inf = NaN once a logit exceeds ~88 (float32)
  or ~709 (float64).
* :func:`safe_softmax` — subtract the row maximum m(x) first: every exponent is ≤ 0, nothing overflows.
* :func:`online_softmax` — the same result, reading the row in blocks and keeping only the running maximum m and
  the running sum ℓ of ``exp(x - m)``. When a new block raises the maximum from m_old to m_new, the old sum is
  rescaled by ``exp(m_old - m_new)``.

:func:`merge_stats` is that rescaling as a standalone operator ("algebraic aggregation", FA1 Section 3.1)::

    m = max(m₁, m₂),    ℓ = e^{m₁ − m} ℓ₁ + e^{m₂ − m} ℓ₂

It is associative and commutative with identity (m, ℓ) = (−inf, 0), so blocks can be merged in any order or tree.

A row with no visible entry has m = −inf. Then ``x - m`` is ``-inf - (-inf) = NaN``; the guard
:func:`exp_minus` treats m = −inf as 0 (every x in such a row is −inf, so every exponential is exactly 0).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import numpy as np

__all__ = [
    "Stats", "naive_softmax", "safe_softmax", "exp_minus", "block_stats", "merge_stats", "online_stats",
    "online_softmax", "logsumexp_from_stats",
]


class Stats(NamedTuple):
    """Softmax statistics of a row (or a batch of rows): running max ``m`` and running sum ``l`` of exp(x − m)."""

    m: np.ndarray
    l: np.ndarray  # noqa: E741 (the paper's ℓ)


def naive_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``exp(x) / sum(exp(x))``: correct in exact arithmetic, overflows in floating point (the motivating bug)."""
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def exp_minus(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``exp(x - m[..., None])`` with the fully-masked guard: where m = −inf use 0 instead (all x are −inf there).

    Shapes: x (..., n), m (...). Cost: n subtractions and n exponentials per row.
    """
    # Guard m = −inf before exp(x − m): −inf − (−inf) would be NaN; with m := 0 the result is exp(−inf) = 0.
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return np.exp(x - m_safe[..., None])


def safe_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax along the last axis with the max subtracted; a row that is entirely −inf gives all zeros (not NaN)."""
    m = x.max(axis=-1)
    p = exp_minus(x, m)
    l = p.sum(axis=-1)
    # Guard ℓ = 0 before dividing: a fully masked row has ℓ = 0 and P = 0.
    return p / np.where(l == 0.0, 1.0, l)[..., None]


def block_stats(x: np.ndarray) -> Stats:
    """Statistics of one block: ``m = rowmax(x)``, ``ℓ = rowsum(exp(x − m))`` (FA1 Alg. 1 line 10)."""
    m = x.max(axis=-1)
    return Stats(m, exp_minus(x, m).sum(axis=-1))


def merge_stats(a: Stats, b: Stats) -> Stats:
    """The (m, ℓ) merge: ``m = max(m_a, m_b)``, ``ℓ = e^{m_a − m} ℓ_a + e^{m_b − m} ℓ_b`` (FA1 Alg. 1 line 11).

    Associative and commutative; identity (−inf, 0). Rows where both maxima are −inf stay (−inf, 0).
    """
    m = np.maximum(a.m, b.m)
    # Guard m = −inf (both inputs empty): use 0 so that e^{−inf − 0} = 0 rather than e^{NaN}.
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return Stats(m, np.exp(a.m - m_safe) * a.l + np.exp(b.m - m_safe) * b.l)


def online_stats(blocks: Iterable[np.ndarray]) -> Stats:
    """Stream over blocks of a row (each (..., n_b)) keeping only (m, ℓ): one pass, O(1) extra memory per row."""
    stats = None
    for x in blocks:
        s = block_stats(x)
        stats = s if stats is None else merge_stats(stats, s)
    if stats is None:
        raise ValueError("online_stats needs at least one block")
    return stats


def online_softmax(x: np.ndarray, block: int) -> np.ndarray:
    """Softmax of the last axis computed by streaming blocks of ``block`` columns, then normalising.

    Equals :func:`safe_softmax` up to rounding. Cost: one pass for the statistics and one for the output.
    """
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    n = x.shape[-1]
    m, l = online_stats(x[..., s:s + block] for s in range(0, n, block))
    l_safe = np.where(l == 0.0, 1.0, l)
    return exp_minus(x, m) / l_safe[..., None]


def logsumexp_from_stats(stats: Stats) -> np.ndarray:
    """``L = m + log ℓ`` (FA2 Alg. 1 line 13); +inf for a fully masked row (ℓ = 0) so that ``exp(S − L) = 0``."""
    m, l = stats
    with np.errstate(divide="ignore"):
        return np.where(l == 0.0, np.inf, m + np.log(np.where(l == 0.0, 1.0, l)))
