"""The counter-based dropout generator (FA1 Algorithm 2, Appendix B.4): the right rate, the same mask whatever the
loop order or tiling, and an output that is unbiased on average. Every bound here is a fixed function of fixed
seeds, so a test either always passes or always fails."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa2edu import attention_reference
from fa2edu.dropout import check_dropout, keep_mask, uniform


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_kept_fraction_is_one_minus_p_within_five_sigma(p, seed):
    lead, rows, cols = (2, 2, 2), slice(0, 100), slice(0, 50)     # 8 programs × 5000 = 40 000 draws
    keep = keep_mask(seed, p, lead, heads=4, rows=rows, cols=cols)
    n = keep.size
    assert keep.shape == lead + (100, 50) and keep.dtype == np.bool_
    assert abs(keep.sum() - n * (1 - p)) <= 5 * math.sqrt(n * p * (1 - p))


def test_uniform_lies_in_the_unit_interval_and_looks_uniform():
    u = uniform(3, 0, 0, np.arange(200)[:, None], np.arange(200)[None, :])
    assert (u >= 0).all() and (u < 1).all()
    counts, _ = np.histogram(u, bins=10, range=(0.0, 1.0))
    expected = u.size / 10
    assert (np.abs(counts - expected) <= 5 * math.sqrt(expected * 0.9)).all()


@given(seed=st.integers(0, 2**63 - 1), b=st.integers(0, 7), h=st.integers(0, 7), i=st.integers(0, 10**6),
       j=st.integers(0, 10**6))
def test_uniform_is_a_pure_function_of_seed_b_h_i_j(seed, b, h, i, j):
    first = uniform(seed, b, h, i, j)
    assert uniform(seed, b, h, i, j) == first
    # The same value when the index comes as part of an array (vectorised tiles read the same counter).
    assert uniform(seed, b, h, np.array([i, i + 1]), j)[0] == first


@given(p=st.sampled_from([0.1, 0.5]), seed=st.integers(0, 2**31), N_q=st.integers(1, 20), N_k=st.integers(1, 20),
       B_r=st.integers(1, 7), B_c=st.integers(1, 7))
def test_blocks_equal_the_slices_of_the_whole_mask(p, seed, N_q, N_k, B_r, B_c):
    """FA1 (K/V-outer) and FA2 (Q-outer), forward and backward, any tiling: all read the same Z."""
    lead, heads = (2, 2, 3), 6
    whole = keep_mask(seed, p, lead, heads, slice(0, N_q), slice(0, N_k))
    for r0 in range(0, N_q, B_r):
        for c0 in range(0, N_k, B_c):
            rows, cols = slice(r0, min(r0 + B_r, N_q)), slice(c0, min(c0 + B_c, N_k))
            np.testing.assert_array_equal(keep_mask(seed, p, lead, heads, rows, cols), whole[..., rows, cols])


def test_programs_map_to_batch_and_head():
    """Program z of the (Z, H_kv, G) layout is batch z // H_q, head z % H_q, whatever the GQA grouping."""
    seed, p = 5, 0.5
    rows, cols = slice(0, 6), slice(0, 7)
    gqa = keep_mask(seed, p, (2, 2, 3), 6, rows, cols)            # B = 2, H_q = 6 as (H_kv, G) = (2, 3)
    mha = keep_mask(seed, p, (2, 6, 1), 6, rows, cols)            # the same six heads, no grouping
    np.testing.assert_array_equal(gqa.reshape(2, 6, 6, 7), mha.reshape(2, 6, 6, 7))
    i, j = np.arange(6)[:, None], np.arange(7)[None, :]
    np.testing.assert_array_equal(mha[1, 4, 0], uniform(seed, 1, 4, i, j) >= p)


def test_different_seeds_heads_and_batches_give_different_masks():
    p, rows, cols = 0.5, slice(0, 64), slice(0, 64)
    a = keep_mask(1, p, (2, 2, 1), 2, rows, cols)
    b = keep_mask(2, p, (2, 2, 1), 2, rows, cols)
    # Independent masks disagree on 2p(1 − p) = 1/2 of the entries (identical ones on none), within 5 sigma.
    for x, y in ((a, b), (a[0, 0], a[0, 1]), (a[0], a[1])):         # seeds, heads, batch entries
        assert abs((x != y).mean() - 0.5) <= 5 * math.sqrt(0.25 / x.size)


def test_dropout_output_is_unbiased_on_average():
    """E[O] with dropout equals O without: the mean over S seeds lies within 6 standard errors, per entry.

    For a fixed row, O_i = Σ_j P_ij Z_ij/(1 − p) V_j with Z_ij ~ Bernoulli(1 − p) independent, so
    Var(O_i) = p/(1 − p) Σ_j P_ij² V_j² (entrywise), and the mean of S seeds has variance Var/S.
    """
    rng = np.random.default_rng(0)
    N, d, p, S = 6, 3, 0.3, 400
    Q, K, V = rng.standard_normal((3, N, d))
    O, _ = attention_reference(Q, K, V)
    mean = np.mean([attention_reference(Q, K, V, dropout_p=p, seed=s).O for s in range(S)], axis=0)
    scores = Q @ K.T / math.sqrt(d)
    P = np.exp(scores - scores.max(axis=1, keepdims=True))
    P /= P.sum(axis=1, keepdims=True)
    std_error = np.sqrt(p / (1 - p) * (P**2) @ (V**2) / S)
    assert (np.abs(mean - O) <= 6 * std_error + 1e-12).all()
    # And the masks do something: a single seed is far from the mean behaviour.
    assert np.abs(attention_reference(Q, K, V, dropout_p=p, seed=0).O - O).max() > 0.01


@pytest.mark.parametrize("dropout_p, seed, error, word", [
    (-0.1, 0, ValueError, "dropout_p"),
    (1.0, 0, ValueError, "dropout_p"),
    (float("nan"), 0, ValueError, "dropout_p"),
    ("0.5", 0, TypeError, "dropout_p"),
    (True, 0, TypeError, "dropout_p"),
    (0.5, -1, TypeError, "seed"),
    (0.5, 1.5, TypeError, "seed"),
    (0.5, True, TypeError, "seed"),
    (0.5, None, TypeError, "seed"),
])
def test_check_dropout_errors_name_the_argument(dropout_p, seed, error, word):
    with pytest.raises(error, match=word):
        check_dropout(dropout_p, seed)


def test_check_dropout_accepts_good_values():
    assert check_dropout(0, 0) == (0.0, 0)
    assert check_dropout(np.float32(0.25), np.int64(7)) == (0.25, 7)
