"""Softmax three ways and the (m, ℓ) merge (FA2 Section 2.3.1, FA1 Section 3.1), and the finite-sentinel pitfall."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fa2edu.softmax import (
    Stats,
    block_stats,
    exp_minus,
    logsumexp_from_stats,
    merge_stats,
    naive_softmax,
    online_softmax,
    online_stats,
    safe_softmax,
)

rows = hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 30)),
                  elements=st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False))


def stats_of(x: np.ndarray) -> Stats:
    """(m, ℓ) straight from the definition, for rows that may be entirely −inf."""
    m = x.max(axis=-1)
    with np.errstate(invalid="ignore"):
        l = np.where(np.isneginf(m), 0.0, np.exp(x - np.where(np.isneginf(m), 0.0, m)[..., None]).sum(axis=-1))
    return Stats(m, l)


def softmax_float64_by_logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return np.exp(x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))))


def test_naive_softmax_overflows_where_safe_softmax_does_not():
    for dtype, big in ((np.float32, 100.0), (np.float64, 1000.0)):
        x = np.array([[big, big - 1.0, 0.0]], dtype=dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            naive = naive_softmax(x)
        assert np.isnan(naive).any()                          # inf / inf
        safe = safe_softmax(x)
        assert np.isfinite(safe).all()
        np.testing.assert_allclose(safe, softmax_float64_by_logsumexp(x.astype(np.float64)), rtol=1e-6, atol=1e-30)
    # Where nothing overflows, the two agree.
    x = np.array([[1.0, -2.0, 0.5]])
    np.testing.assert_allclose(naive_softmax(x), safe_softmax(x), rtol=1e-15)


@given(x=rows)
def test_safe_softmax_is_a_distribution_equal_to_the_logsumexp_form(x):
    p = safe_softmax(x)
    assert (p >= 0).all() and np.allclose(p.sum(axis=-1), 1.0, rtol=1e-13)
    np.testing.assert_allclose(p, softmax_float64_by_logsumexp(x), rtol=1e-9, atol=1e-300)


@given(x=rows)
def test_online_softmax_equals_safe_softmax_for_every_block_size(x):
    expected = safe_softmax(x)
    for block in range(1, x.shape[-1] + 2):
        np.testing.assert_allclose(online_softmax(x, block), expected, rtol=1e-12, atol=1e-300)
        m, l = online_stats(x[..., s:s + block] for s in range(0, x.shape[-1], block))
        np.testing.assert_array_equal(m, x.max(axis=-1))       # the running max is exact
        np.testing.assert_allclose(l, stats_of(x).l, rtol=1e-12)


def test_online_softmax_rejects_block_below_one():
    with pytest.raises(ValueError, match="block"):
        online_softmax(np.zeros((1, 3)), 0)


def masked_rows():
    """Rows with some −inf entries (masked scores); sometimes every entry."""
    return st.tuples(rows, st.integers(0, 2**32 - 1)).map(_mask_some)


def _mask_some(drawn):
    x, seed = drawn
    rng = np.random.default_rng(seed)
    x = x.copy()
    x[rng.random(x.shape) < rng.choice([0.0, 0.5, 1.0])] = -np.inf
    return x


@given(x=masked_rows(), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_merge_is_exact_on_random_splits(x, cuts):
    """Merging the statistics of any split of a row gives the statistics of the whole row."""
    n = x.shape[-1]
    edges = sorted({0, n, *(c % (n + 1) for c in cuts)})
    parts = [stats_of(x[..., a:b]) for a, b in zip(edges[:-1], edges[1:])]
    merged = parts[0]
    for part in parts[1:]:
        merged = merge_stats(merged, part)
    whole = stats_of(x)
    np.testing.assert_array_equal(merged.m, whole.m)
    np.testing.assert_allclose(merged.l, whole.l, rtol=1e-12)
    assert not np.isnan(merged.l).any()


@given(a=masked_rows(), b=masked_rows(), c=masked_rows())
def test_merge_is_associative_and_commutative_with_identity(a, b, c):
    n_rows = min(a.shape[0], b.shape[0], c.shape[0])
    sa, sb, sc = (block_stats(x[:n_rows]) for x in (a, b, c))
    identity = Stats(np.full(n_rows, -np.inf), np.zeros(n_rows))
    for left, right in ((merge_stats(sa, sb), merge_stats(sb, sa)),
                        (merge_stats(merge_stats(sa, sb), sc), merge_stats(sa, merge_stats(sb, sc)))):
        np.testing.assert_array_equal(left.m, right.m)
        np.testing.assert_allclose(left.l, right.l, rtol=1e-12)
    for merged in (merge_stats(sa, identity), merge_stats(identity, sa)):
        np.testing.assert_array_equal(merged.m, sa.m)
        np.testing.assert_array_equal(merged.l, sa.l)
    both_empty = merge_stats(identity, identity)
    assert np.isneginf(both_empty.m).all() and (both_empty.l == 0).all()


def test_exp_minus_guards_a_fully_masked_row():
    x = np.array([[-np.inf, -np.inf], [0.0, -np.inf]])
    with np.errstate(invalid="raise"):
        e = exp_minus(x, x.max(axis=-1))
    np.testing.assert_array_equal(e, [[0.0, 0.0], [1.0, 0.0]])
    with np.errstate(invalid="ignore"):
        unguarded = np.exp(x - x.max(axis=-1)[:, None])
    assert np.isnan(unguarded[0]).all()                       # what the guard prevents: −inf − (−inf) = NaN
    assert (safe_softmax(x)[0] == 0).all() and not np.isnan(safe_softmax(x)).any()
    L = logsumexp_from_stats(block_stats(x))
    assert np.isposinf(L[0]) and L[1] == 0.0


def sentinel_softmax(x: np.ndarray, sentinel: float) -> np.ndarray:
    """Softmax that writes ``sentinel`` where a score is masked (−inf in the input): the pitfall under test."""
    return safe_softmax(np.where(np.isneginf(x), sentinel, x))


def test_finite_sentinel_is_wrong_where_real_minus_inf_is_right():
    # A fully masked row: −inf gives P = 0 (no key to attend to); −1e9 gives a uniform 1/n over masked keys.
    row = np.full((1, 4), -np.inf)
    assert (sentinel_softmax(row, -np.inf) == 0).all()
    assert np.allclose(sentinel_softmax(row, -1e9), 0.25)
    # Very negative real logits (below the sentinel): the sentinel now *outranks* the real scores, and the masked
    # key gets all the weight; with −inf the masked key gets none.
    x = np.array([[-2e9, -3e9, -np.inf]])
    right = sentinel_softmax(x, -np.inf)
    wrong = sentinel_softmax(x, -1e9)
    np.testing.assert_allclose(right, [[1.0, 0.0, 0.0]])
    assert right[0, 2] == 0.0 and wrong[0, 2] == 1.0
    # For ordinary logits, the sentinel and −inf agree: the pitfall hides until a row is extreme.
    x = np.array([[0.3, -1.2, -np.inf]])
    np.testing.assert_allclose(sentinel_softmax(x, -1e9), sentinel_softmax(x, -np.inf), atol=1e-300)


def test_logsumexp_from_stats_is_m_plus_log_l():
    x = np.array([[1.0, 2.0, 3.0], [-np.inf, -np.inf, -np.inf]])
    L = logsumexp_from_stats(block_stats(x))
    assert L[0] == pytest.approx(np.log(np.exp(x[0]).sum()), rel=1e-15)
    assert np.isposinf(L[1])                                  # exp(S − L) = 0 in the backward pass
