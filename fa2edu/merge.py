"""One merge operator for partial attentions: the (m, ℓ) rule of FA1 Section 3.1, in log-sum-exp form.

Split the keys of one query row into two disjoint sets a and b, and attend to each set alone. Each side gives a
normalised output and the log-sum-exp of its scores::

    O_a = Σ_{j∈a} e^{s_j − L_a} v_j,        L_a = log Σ_{j∈a} e^{s_j}        (and the same for b)

The attention over the union a ∪ b is a weighted average of the two sides, with weights from the two sums::

    L = log(e^{L_a} + e^{L_b}),             O = e^{L_a − L} O_a + e^{L_b − L} O_b

That is FA1's "algebraic aggregation" (Section 3.1): a side with log-sum-exp L is a row whose softmax statistics
are (m, ℓ) = (L, 1), and :func:`fa2edu.softmax.merge_stats` merges statistics. :func:`merge_attention_states`
uses that function, so the rule lives in one place: the larger log-sum-exp becomes the maximum m, every
exponential has a non-positive argument (never ``exp`` of a large positive number), and L = 1e4 or −1e4 cause no
overflow.

A side that saw no key (a fully masked row: O = 0, L = +inf, the project's convention) has statistics (−inf, 0),
the identity of the merge: merging with it returns the other side unchanged, and two empty sides give O = 0,
L = +inf. The merge is commutative (exactly) and associative (up to rounding), so partial results can be combined
in any order or tree: split-KV decoding (:func:`fa2edu.inference.decode_attention`), ring attention and
kernels_gpu's split launches all combine their pieces with this rule; this function is its specification.
"""

from __future__ import annotations

import numpy as np

from fa2edu.softmax import Stats, logsumexp_from_stats, merge_stats
from fa2edu.validation import FLOAT_DTYPES, AttentionOverflowError, cast_output, compute_dtype

__all__ = ["merge_attention_states", "stats_from_lse"]


def _check_state(O, L, name_O: str, name_L: str) -> None:
    for name, x in ((name_O, O), (name_L, L)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a floating dtype (float16, float32 or float64), got {x.dtype}")
    if O.ndim < 2:
        raise ValueError(f"{name_O} must have shape (..., N, d_v) with at least 2 axes, got shape {O.shape}")
    if L.shape != O.shape[:-1]:
        raise ValueError(f"{name_L} must have shape {name_O}.shape[:-1] = {O.shape[:-1]} (one log-sum-exp per "
                         f"row), got {L.shape}")
    if not np.isfinite(O).all():
        raise ValueError(f"{name_O} contains NaN or infinite values; a partial output is finite (0 on rows "
                         f"that saw no key)")
    # L = +inf marks a row that saw no key; NaN or −inf cannot come out of an attention.
    if np.isnan(L).any() or np.isneginf(L).any():
        raise ValueError(f"{name_L} contains NaN or -inf; a log-sum-exp is finite, or +inf on a row that saw "
                         f"no key")


def stats_from_lse(L: np.ndarray) -> Stats:
    """Softmax statistics (m, ℓ) of a *normalised* partial with log-sum-exp L: (L, 1), or (−inf, 0) where L = +inf.

    Shapes: L (..., N) → m, ℓ (..., N). Cost: 2N selects.
    """
    empty = np.isposinf(L)
    return Stats(np.where(empty, -np.inf, L), np.where(empty, 0.0, 1.0).astype(L.dtype))


def merge_attention_states(O_a, L_a, O_b, L_b) -> tuple[np.ndarray, np.ndarray]:
    """Combine two partial attentions over disjoint key sets into the attention over their union.

    ``L = log(e^{L_a} + e^{L_b})`` and ``O = e^{L_a − L} O_a + e^{L_b − L} O_b``, computed stably through
    :func:`fa2edu.softmax.merge_stats` (FA1 Section 3.1; FA1 Alg. 1 lines 11-12 applied to whole partials).

    Parameters
    ----------
    O_a : numpy.ndarray, shape (..., N, d_v)
        Normalised output of side a (0 on rows where side a saw no key).
    L_a : numpy.ndarray, shape (..., N)
        Log-sum-exp of side a's scores per row; +inf on rows where side a saw no key (the empty side).
    O_b : numpy.ndarray, shape (..., N, d_v)
        Normalised output of side b, the same shape as ``O_a``.
    L_b : numpy.ndarray, shape (..., N)
        Log-sum-exp of side b's scores per row, the same shape as ``L_a``.

    Returns
    -------
    (O, L) : tuple of numpy.ndarray
        O (..., N, d_v) in the outputs' common dtype and L (..., N) in the compute dtype (float64 when any input is
        float64, else float32); O = 0, L = +inf on rows where both sides are empty.

    Raises
    ------
    TypeError
        A non-array or non-float input.
    ValueError
        Mismatched shapes, a non-finite O, or an L holding NaN or −inf (each names O_a, L_a, O_b or L_b).
    AttentionOverflowError
        Finite outputs too close to the largest value of the dtype for their weighted sum to stay finite (a
        ValueError and an OverflowError, as everywhere in fa2edu), never an inf.

    Notes
    -----
    Cost per row: 2 exponentials, 1 logarithm, about 3·d_v + 8 other FLOPs; it reads both sides once.
    Commutative exactly, associative up to rounding; the empty side (O = 0, L = +inf) is its identity, exactly.
    """
    _check_state(O_a, L_a, "O_a", "L_a")
    _check_state(O_b, L_b, "O_b", "L_b")
    if O_a.shape != O_b.shape:
        raise ValueError(f"O_a and O_b must have the same shape (..., N, d_v), got {O_a.shape} and {O_b.shape}")
    work = compute_dtype(np.result_type(O_a, L_a, O_b, L_b))
    out_dtype = np.result_type(O_a, O_b)
    a = stats_from_lse(L_a.astype(work, copy=False))
    b = stats_from_lse(L_b.astype(work, copy=False))
    # (m_a − m can pass −max for L's of opposite signs near the dtype's limits: −inf there, and e^{−inf} = 0, the
    # right weight; only O itself is checked for overflow below.)
    with np.errstate(over="ignore", invalid="ignore"):
        # FA1 Alg. 1 line 11: m = max(m_a, m_b), ℓ = e^{m_a − m} ℓ_a + e^{m_b − m} ℓ_b (every exponent ≤ 0).
        merged = merge_stats(a, b)
        # Guard m = −inf (both sides empty) before exp(m_a − m), and ℓ = 0 before dividing: both weights become 0.
        m_safe = np.where(np.isneginf(merged.m), 0.0, merged.m)
        l_safe = np.where(merged.l == 0.0, 1.0, merged.l)
        w_a = np.exp(a.m - m_safe) * a.l / l_safe          # e^{L_a − L}: 1 exactly when b is empty
        w_b = np.exp(b.m - m_safe) * b.l / l_safe          # e^{L_b − L}: 0 exactly when b is empty
        # FA1 Alg. 1 line 12 on whole partials: the outputs, reweighted to the union's normaliser.
        O = w_a[..., None] * O_a.astype(work, copy=False) + w_b[..., None] * O_b.astype(work, copy=False)
    if not np.isfinite(O).all():
        # The weights sum to 1 up to rounding, so only outputs within a rounding of the dtype's largest value
        # can get here: an error naming them, as fa2edu reports every overflow, rather than an inf.
        raise AttentionOverflowError(
            f"O_a and O_b are too large for {work.name}: their weighted sum overflows (max |O_a| = "
            f"{float(np.max(np.abs(O_a))):.3g}, max |O_b| = {float(np.max(np.abs(O_b))):.3g}, the largest "
            f"{work.name} is {float(np.finfo(work).max):.3g}); rescale the values"
            + ("" if work == np.float64 else ", or pass float64 partials"))
    # FA2 Alg. 1 line 13: L = m + log ℓ, +inf where both sides are empty.
    L = logsumexp_from_stats(merged)
    return cast_output(O, out_dtype, "the merged O"), L
