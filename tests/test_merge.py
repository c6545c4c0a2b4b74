"""fa2edu.merge_attention_states: the one rule that combines partial attentions over disjoint key sets.

What these tests prove:

* merging the partial attentions of contiguous chunks of the keys (some chunks empty) gives the oracle's attention
  over all the keys, O and L, in any order (left fold, right fold, a tree);
* the merge is commutative exactly, associative up to rounding, and the empty side (O = 0, L = +inf) is its
  identity exactly; two empty sides give O = 0, L = +inf;
* log-sum-exps near +1e4 and −1e4 neither overflow nor lose the answer, in float32 and float64 (the naive
  ``log(e^{L_a} + e^{L_b})`` overflows or underflows there);
* bad shapes, dtypes, NaN and −inf get a clear error naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import attention_states, key_splits
from tolerances import assert_same_nan_and_inf

import fa2edu
from fa2edu.merge import merge_attention_states


def _partials(Q, K, V, cuts):
    """(O, L) of each chunk [cuts[i], cuts[i+1]) of the keys; an empty chunk is the identity (O = 0, L = +inf)."""
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi == lo:
            out.append((np.zeros(Q.shape[:-1] + (V.shape[-1],)), np.full(Q.shape[:-1], np.inf)))
        else:
            out.append(fa2edu.attention_reference(Q, K[..., lo:hi, :], V[..., lo:hi, :]))
    return out


def _fold(states):
    O, L = states[0]
    for O_b, L_b in states[1:]:
        O, L = merge_attention_states(O, L, O_b, L_b)
    return O, L


def _assert_state_close(actual, expected, rtol, name="", *, O_rtol=None):
    """L within ``rtol`` relative to max |L|; O within ``O_rtol`` (default ``rtol``) relative to max |O|."""
    (O, L), (O_ref, L_ref) = actual, expected
    assert_same_nan_and_inf(L, L_ref, f"L{name}")
    finite = np.isfinite(L_ref)
    scale_L = max(1.0, float(np.abs(L_ref[finite]).max(initial=0.0)))
    assert np.abs(L[finite] - L_ref[finite]).max(initial=0.0) <= rtol * scale_L, f"L{name}"
    scale_O = max(1.0, float(np.abs(O_ref).max(initial=0.0)))
    O_rtol = rtol if O_rtol is None else O_rtol
    assert np.abs(O.astype(np.float64) - O_ref).max(initial=0.0) <= O_rtol * scale_O, f"O{name}"


@given(key_splits())
def test_merging_chunks_equals_attention_over_the_concatenated_keys(case):
    Q, K, V, cuts = case
    parts = _partials(Q, K, V, cuts)
    expected = fa2edu.attention_reference(Q, K, V)
    _assert_state_close(_fold(parts), expected, 1e-10, " (left fold)")
    _assert_state_close(_fold(parts[::-1]), expected, 1e-10, " (reversed order)")
    if len(parts) >= 3:
        left = _fold(parts[:2])
        right = _fold(parts[2:])
        _assert_state_close(merge_attention_states(*right, *left), expected, 1e-10, " (a tree)")


@given(st.data())
def test_merging_disjoint_random_key_sets_equals_their_union(data):
    """Key sets given by masks (not contiguous), with fully masked rows from a causal mask with N_q > N_k."""
    Q, K, V, _ = data.draw(key_splits())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    causal = data.draw(st.booleans())
    owner = rng.integers(0, 3, size=K.shape[-2])                      # which of 3 sets holds each key
    parts = [fa2edu.attention_reference(Q, K, V, causal=causal, mask=np.broadcast_to(owner == s, (Q.shape[-2],
                                        K.shape[-2]))) for s in range(3)]
    expected = fa2edu.attention_reference(Q, K, V, causal=causal)
    _assert_state_close(_fold(parts), expected, 1e-10)


@given(attention_states(count=3))
def test_merge_is_commutative_and_associative(states):
    (O_a, L_a), (O_b, L_b), (O_c, L_c) = states
    ab = merge_attention_states(O_a, L_a, O_b, L_b)
    ba = merge_attention_states(O_b, L_b, O_a, L_a)
    np.testing.assert_array_equal(ab[0], ba[0])                        # commutative: bit for bit
    np.testing.assert_array_equal(ab[1], ba[1])
    left = merge_attention_states(*ab, O_c, L_c)
    right = merge_attention_states(O_a, L_a, *merge_attention_states(O_b, L_b, O_c, L_c))
    assert left[0].dtype == O_a.dtype and left[1].dtype == L_a.dtype
    # A merged L is rounded to the ulp of |L| (about 1e-3 at 1e4 in float32), and the next merge's weights
    # e^{L_a − L} inherit that absolute error: O agrees to a few eps · max |L|.
    eps = float(np.finfo(O_a.dtype).eps)
    Ls = np.concatenate([L_a.ravel(), L_b.ravel(), L_c.ravel()])
    L_size = max(1.0, float(np.abs(Ls[np.isfinite(Ls)]).max(initial=0.0)))
    _assert_state_close(left, (right[0].astype(np.float64), right[1]), 8 * eps, O_rtol=8 * eps * L_size)


@given(attention_states(count=2))
def test_empty_side_is_the_identity(states):
    (O, L), (O_other, _) = states
    empty_O, empty_L = np.zeros_like(O), np.full_like(L, np.inf)
    for merged in (merge_attention_states(O, L, empty_O, empty_L), merge_attention_states(empty_O, empty_L, O, L)):
        # An empty row of (O, L) stays empty; every other row comes back exactly.
        expected_O = np.where(np.isposinf(L)[..., None], 0.0, O)
        np.testing.assert_array_equal(merged[0], expected_O)
        np.testing.assert_array_equal(merged[1], L)
    both = merge_attention_states(empty_O, empty_L, np.zeros_like(O_other), empty_L)
    np.testing.assert_array_equal(both[0], 0.0)
    assert np.isposinf(both[1]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("centre", [1e4, -1e4])
def test_no_overflow_at_large_log_sum_exps(dtype, centre):
    """L_a = c, L_b = c + δ: L = c + log(1 + e^δ), O = σ(−δ)·O_a + σ(δ)·O_b, computed without e^{±1e4}."""
    delta = np.array([0.0, 1.0, -3.0, 40.0])
    L_a = np.full(4, centre, dtype=dtype)
    L_b = (centre + delta).astype(dtype)
    O_a = np.ones((4, 2), dtype=dtype)
    O_b = -np.ones((4, 2), dtype=dtype)
    with np.errstate(over="raise", under="ignore", invalid="raise"):
        O, L = merge_attention_states(O_a, L_a, O_b, L_b)
    exact_L = L_a.astype(np.float64) + np.logaddexp(0.0, L_b.astype(np.float64) - L_a.astype(np.float64))
    w_b = 1.0 / (1.0 + np.exp(-(L_b.astype(np.float64) - L_a.astype(np.float64))))
    eps = np.finfo(dtype).eps
    assert np.all(np.isfinite(L)) and np.all(np.isfinite(O))
    np.testing.assert_allclose(L, exact_L, rtol=4 * eps, atol=0)
    np.testing.assert_allclose(O[:, 0], 1.0 - 2.0 * w_b, rtol=0, atol=8 * eps)
    # The naive formula overflows (or underflows to log 0) at these magnitudes: the test is not vacuous.
    with np.errstate(over="ignore", divide="ignore"):
        naive = np.log(np.exp(L_a) + np.exp(L_b))
    assert not np.isfinite(naive).all()


def test_float16_outputs_keep_their_dtype_and_compute_in_float32():
    O_a, O_b = np.ones((3, 4), np.float16), np.zeros((3, 4), np.float16)
    L_a, L_b = np.zeros(3, np.float16), np.zeros(3, np.float16)
    O, L = merge_attention_states(O_a, L_a, O_b, L_b)
    assert O.dtype == np.float16 and L.dtype == np.float32
    np.testing.assert_array_equal(O, 0.5)
    np.testing.assert_allclose(L, np.log(2.0), rtol=1e-6)


@pytest.mark.parametrize("args, error, message", [
    ((np.ones((2, 3)), np.zeros(2), np.ones((2, 4)), np.zeros(2)), ValueError, "O_a and O_b"),
    ((np.ones((2, 3)), np.zeros(3), np.ones((2, 3)), np.zeros(2)), ValueError, "L_a must have shape"),
    ((np.ones((2, 3)), np.zeros(2), np.ones((2, 3)), np.zeros((2, 1))), ValueError, "L_b must have shape"),
    ((np.ones(3), np.zeros(()), np.ones(3), np.zeros(())), ValueError, "O_a must have shape"),
    ((np.ones((2, 3)), np.array([0.0, np.nan]), np.ones((2, 3)), np.zeros(2)), ValueError, "L_a contains NaN"),
    ((np.ones((2, 3)), np.zeros(2), np.ones((2, 3)), np.array([-np.inf, 0])), ValueError, "L_b contains"),
    ((np.full((2, 3), np.inf), np.zeros(2), np.ones((2, 3)), np.zeros(2)), ValueError, "O_a contains"),
    ((np.ones((2, 3), int), np.zeros(2), np.ones((2, 3)), np.zeros(2)), TypeError, "O_a must have a floating"),
    (([[1.0]], np.zeros(1), np.ones((1, 1)), np.zeros(1)), TypeError, "O_a must be a numpy.ndarray"),
])
def test_bad_inputs_are_refused_by_name(args, error, message):
    with pytest.raises(error, match=message):
        merge_attention_states(*args)
