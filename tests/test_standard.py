"""Standard attention (FA1 Algorithms 0 and 3): exact against the oracle, and its HBM ledger equals the closed forms.

The claims tested here are the baseline of the book: standard attention computes the same O and gradients as the
oracle, materialises S, P, dP, dS in HBM, and moves exactly 3Nd + 2N² / Nd + 2N² (forward) and 5Nd + 5N² /
3Nd + 2N² (backward) elements per (batch, head), whatever the SRAM size.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa2edu.memory import HBM, FlopCounter, SRAMOverflowError
from fa2edu.reference import attention_reference, attention_reference_backward
from fa2edu.standard import (
    standard_attention,
    standard_attention_backward,
    standard_backward_working_set,
    standard_forward_working_set,
)
from tests.strategies import attention_problems
from tests.tolerances import assert_close_to_oracle


def _gradient(case, seed: int = 1) -> np.ndarray:
    """An upstream gradient dO shaped like O, in the problem's dtype."""
    shape = case.Q.shape[:-1] + (case.V.shape[-1],)
    return np.random.default_rng(seed).standard_normal(shape).astype(case.Q.dtype)


def _expected_P(case) -> tuple[np.ndarray, np.ndarray]:
    """softmax(τQKᵀ + mask) in float64 and the "may attend" pattern, written out independently of fa2edu (GQA by
    repeating K heads)."""
    Q, K = case.Q.astype(np.float64), case.K.astype(np.float64)
    if Q.ndim == 4 and Q.shape[1] != K.shape[1]:
        K = np.repeat(K, Q.shape[1] // K.shape[1], axis=1)
    N_q, N_k, d = Q.shape[-2], K.shape[-2], Q.shape[-1]
    tau = 1.0 / np.sqrt(d) if case.scale is None else case.scale
    S = tau * Q @ np.swapaxes(K, -1, -2)
    visible = np.ones(S.shape, dtype=bool)
    if case.causal:
        visible &= np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + N_k - N_q
    if case.mask is not None:
        visible &= case.mask
    S = np.where(visible, S, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    E = np.where(visible, np.exp(S - np.where(np.isneginf(m), 0.0, m)), 0.0)
    l = E.sum(axis=-1, keepdims=True)
    return E / np.where(l == 0.0, 1.0, l), visible


# -- exactness ---------------------------------------------------------------------------------------------------

@given(attention_problems())
def test_forward_equals_oracle(case):
    """Alg. 0's O and its materialised P equal the oracle (fully masked rows: P = 0, O = 0, no NaN)."""
    hbm = HBM()
    fwd = standard_attention(case.Q, case.K, case.V, **case.kwargs(), block_sizes=case.block_sizes, hbm=hbm)
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs())
    assert_close_to_oracle(fwd.O, ref.O, "O")
    P, visible = _expected_P(case)
    assert_close_to_oracle(fwd.P, P, "P")
    empty = np.isposinf(ref.L)
    assert (fwd.P[empty] == 0).all() and (fwd.O[empty] == 0).all()
    # P is in HBM, as Alg. 0 line 2 writes it; S holds real −inf where P = 0 because of the mask.
    assert np.array_equal(hbm["P"].reshape(fwd.P.shape), fwd.P)
    S = hbm["S"].reshape(fwd.P.shape)
    assert np.array_equal(np.isneginf(S), ~np.broadcast_to(visible, S.shape)) and not np.isnan(S).any()


@given(attention_problems())
def test_backward_equals_oracle(case):
    """Alg. 3's dQ, dK, dV equal the oracle's gradients (GQA: dK, dV summed over the group)."""
    dO = _gradient(case)
    fwd = standard_attention(case.Q, case.K, case.V, **case.kwargs())
    grads = standard_attention_backward(case.Q, case.K, case.V, fwd.P, dO, **case.kwargs(),
                                        block_sizes=case.block_sizes)
    ref = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs())
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref):
        assert_close_to_oracle(got, want, name)


@settings(max_examples=10)
@given(attention_problems(max_n=16), st.sampled_from([0.1, 0.5]), st.integers(0, 2**31))
def test_dropout_equals_oracle(case, p, seed):
    """With dropout, O uses P ∘ Z and the backward pass regenerates the same Z from the seed."""
    dO = _gradient(case)
    fwd = standard_attention(case.Q, case.K, case.V, **case.kwargs(), dropout_p=p, seed=seed)
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs(), dropout_p=p, seed=seed)
    assert_close_to_oracle(fwd.O, ref.O, "O")
    assert_close_to_oracle(fwd.P, _expected_P(case)[0], "P (un-dropped)")
    grads = standard_attention_backward(case.Q, case.K, case.V, fwd.P, dO, **case.kwargs(), dropout_p=p, seed=seed)
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs(), dropout_p=p, seed=seed)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref_grads):
        assert_close_to_oracle(got, want, name)


def test_dropout_changes_the_output():
    """The dropout path is live: the same seed reproduces O, another seed does not."""
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((12, 4)) for _ in range(3))
    a = standard_attention(Q, K, V, dropout_p=0.3, seed=5).O
    assert np.array_equal(a, standard_attention(Q, K, V, dropout_p=0.3, seed=5).O)
    assert not np.allclose(a, standard_attention(Q, K, V, dropout_p=0.3, seed=6).O)
    assert not np.allclose(a, standard_attention(Q, K, V).O)


@settings(max_examples=15)
@given(st.one_of(attention_problems(dtypes=(np.float32,), max_n=16),
                 attention_problems(dtypes=(np.float16,), max_n=16, extreme=False)))
def test_low_precision_error_is_rounding_sized(case):
    """float32/float16 inputs compute in float32 and store S, P, dP, dS and the outputs in their own dtype: the error
    against the oracle (on the same rounded inputs) stays within a forward-error bound of that storage precision.
    (float16 is drawn without ±1e4 logits: its S would overflow at 65504, as a float16 standard attention does.)"""
    dO = _gradient(case)
    fwd = standard_attention(case.Q, case.K, case.V, **case.kwargs())
    grads = standard_attention_backward(case.Q, case.K, case.V, fwd.P, dO, **case.kwargs())
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs())
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs())
    assert fwd.O.dtype == fwd.P.dtype == case.Q.dtype and all(g.dtype == case.Q.dtype for g in grads)
    eps = np.finfo(case.Q.dtype).eps
    d = case.Q.shape[-1]
    tau = 1.0 / np.sqrt(d) if case.scale is None else case.scale
    Q, K = case.Q.astype(np.float64), case.K.astype(np.float64)
    if Q.ndim == 4:
        K = np.repeat(K, Q.shape[1] // K.shape[1], axis=1)
    logit = abs(tau) * (np.abs(Q) @ np.abs(np.swapaxes(K, -1, -2))).max()     # bounds |S| and its rounding
    inputs = max(1.0, np.abs(case.V).max()) * max(1.0, np.abs(dO).max())
    for name, got, want in [("O", fwd.O, ref.O)] + list(zip(("dQ", "dK", "dV"), grads, ref_grads)):
        err = np.abs(got.astype(np.float64) - want).max()
        size = max(1.0, np.abs(want).max())
        # A stored score carries a relative error ~eps, which exp turns into ~eps·|S| in P; then the output rounding.
        bound = 2 * eps * (1.0 + logit) * size * inputs + 2 * eps * size
        assert err <= bound, f"{name}: error {err:.3e} above the rounding bound {bound:.3e}"


# -- HBM traffic -------------------------------------------------------------------------------------------------

def _forward_form(N_q, N_k, d, d_v):
    """Alg. 0 per (batch, head): line 1 reads Q, K, writes S; line 2 reads S, writes P; line 3 reads P, V, writes O."""
    return N_q * d + N_k * d + 2 * N_q * N_k + N_k * d_v, 2 * N_q * N_k + N_q * d_v


def _backward_form(N_q, N_k, d, d_v):
    """Alg. 3 per (batch, head): lines 1-5 each read their two operands and write their result once."""
    reads = (N_q * N_k + N_q * d_v) + (N_q * d_v + N_k * d_v) + 2 * N_q * N_k + (N_q * N_k + N_k * d) \
        + (N_q * N_k + N_q * d)
    writes = N_k * d_v + N_q * N_k + N_q * N_k + N_q * d + N_k * d
    return reads, writes


@pytest.mark.parametrize("N, d", [(1, 1), (7, 3), (33, 8), (64, 16), (100, 5)])
def test_ledger_equals_closed_form_square(N, d):
    """the conventions' table: forward 3Nd + 2N² reads, Nd + 2N² writes; backward 5Nd + 5N², 3Nd + 2N²."""
    rng = np.random.default_rng(N)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    hbm = HBM()
    fwd = standard_attention(Q, K, V, hbm=hbm)
    assert (hbm.reads, hbm.writes, hbm.init_writes) == (3 * N * d + 2 * N * N, N * d + 2 * N * N, 0)
    hbm = HBM()
    standard_attention_backward(Q, K, V, fwd.P, dO, hbm=hbm)
    assert (hbm.reads, hbm.writes, hbm.init_writes) == (5 * N * d + 5 * N * N, 3 * N * d + 2 * N * N, 0)


@given(st.integers(1, 30), st.integers(1, 30), st.integers(1, 8), st.integers(1, 8), st.integers(1, 3),
       st.booleans(), st.one_of(st.none(), st.integers(1, 12)))
def test_ledger_general_shapes_ignores_tiling_and_masks(N_q, N_k, d, d_v, G, causal, B_r):
    """N_q ≠ N_k, d_v ≠ d, GQA, causal or not, any row block: per-program traffic is the closed form, exactly
    (standard attention materialises every score, so masks save nothing)."""
    rng = np.random.default_rng(0)
    Q = rng.standard_normal((2, 2 * G, N_q, d))
    K = rng.standard_normal((2, 2, N_k, d))
    V = rng.standard_normal((2, 2, N_k, d_v))
    dO = rng.standard_normal((2, 2 * G, N_q, d_v))
    tiling = {} if B_r is None else {"block_sizes": (B_r, 5)}
    hbm = HBM()
    fwd = standard_attention(Q, K, V, causal=causal, hbm=hbm, **tiling)
    assert (hbm.reads, hbm.writes) == _forward_form(N_q, N_k, d, d_v)
    assert {"S", "P", "O"} <= set(hbm.by_tensor())
    assert hbm.by_tensor()["S"] == {"read": N_q * N_k, "write": N_q * N_k, "init": 0}
    hbm = HBM()
    standard_attention_backward(Q, K, V, fwd.P, dO, causal=causal, hbm=hbm, **tiling)
    assert (hbm.reads, hbm.writes) == _backward_form(N_q, N_k, d, d_v)
    assert hbm.by_tensor()["dS"] == {"read": 2 * N_q * N_k, "write": N_q * N_k, "init": 0}


def test_ledger_by_line():
    """Each line of Alg. 0 moves what the paper says it moves (N = 10, d = 4)."""
    N, d = 10, 4
    rng = np.random.default_rng(1)
    Q, K, V = (rng.standard_normal((N, d)) for _ in range(3))
    hbm = HBM()
    standard_attention(Q, K, V, hbm=hbm)
    lines = hbm.by_line()
    assert lines["Alg 0 line 1"] == {"read": 2 * N * d, "write": N * N, "init": 0}
    assert lines["Alg 0 line 2"] == {"read": N * N, "write": N * N, "init": 0}
    assert lines["Alg 0 line 3"] == {"read": N * N + N * d, "write": N * d, "init": 0}


def test_flops():
    """Matmul FLOPs: 2·N_q·N_k·(d + d_v) forward (QKᵀ and PV), twice that backward (dV, dP, dQ, dK)."""
    N_q, N_k, d, d_v = 9, 13, 4, 6
    rng = np.random.default_rng(2)
    Q, K, V = rng.standard_normal((N_q, d)), rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d_v))
    count = FlopCounter()
    fwd = standard_attention(Q, K, V, flops=count, block_sizes=(4, 4))
    assert count.matmul == 2 * N_q * N_k * (d + d_v) and count.nonmatmul >= 5 * N_q * N_k
    count = FlopCounter()
    standard_attention_backward(Q, K, V, fwd.P, rng.standard_normal((N_q, d_v)), flops=count)
    assert count.matmul == 4 * N_q * N_k * (d + d_v)


# -- SRAM -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N, d, M", [(40, 4, 64), (40, 4, 1000), (17, 8, 200)])
def test_sram_peak_is_the_working_set(N, d, M):
    """The peak on-chip occupancy is the documented working set (a whole K or V beside a row block), ≤ capacity."""
    rng = np.random.default_rng(3)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    hbm = HBM()
    fwd = standard_attention(Q, K, V, M=M, hbm=hbm)
    B_r = min(hbm.block_sizes[0], N)
    assert hbm.sram.peak == standard_forward_working_set(B_r, N, d) <= hbm.sram.capacity
    hbm = HBM()
    standard_attention_backward(Q, K, V, fwd.P, dO, M=M, hbm=hbm)
    assert hbm.sram.peak == standard_backward_working_set(B_r, N, d) <= hbm.sram.capacity


def test_block_sizes_too_large_for_M_raise():
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((64, 4)) for _ in range(3))
    with pytest.raises(SRAMOverflowError, match="block_sizes"):
        standard_attention(Q, K, V, M=64, block_sizes=(64, 1))
    assert issubclass(SRAMOverflowError, ValueError)


def test_row_block_does_not_change_the_result():
    rng = np.random.default_rng(5)
    Q, K, V, dO = (rng.standard_normal((2, 3, 11, 5)) for _ in range(4))
    a = standard_attention(Q, K, V, causal=True, block_sizes=(1, 1))
    b = standard_attention(Q, K, V, causal=True, block_sizes=(7, 1))
    assert np.allclose(a.O, b.O, rtol=0, atol=1e-14) and np.allclose(a.P, b.P, rtol=0, atol=1e-14)
    ga = standard_attention_backward(Q, K, V, a.P, dO, causal=True, block_sizes=(2, 3))
    gb = standard_attention_backward(Q, K, V, a.P, dO, causal=True, block_sizes=(11, 3))
    for x, y in zip(ga, gb):
        assert np.allclose(x, y, rtol=0, atol=1e-13)


# -- fully masked rows and bad input -------------------------------------------------------------------------------

def test_causal_rows_that_see_no_key():
    """Causal with N_q > N_k (bottom-right): the first N_q − N_k rows see nothing: P = 0, O = 0, dQ = 0, no NaN."""
    rng = np.random.default_rng(6)
    Q, dO = rng.standard_normal((9, 3)), rng.standard_normal((9, 3))
    K, V = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    fwd = standard_attention(Q, K, V, causal=True)
    assert (fwd.P[:5] == 0).all() and (fwd.O[:5] == 0).all() and np.allclose(fwd.P[5:].sum(-1), 1)
    grads = standard_attention_backward(Q, K, V, fwd.P, dO, causal=True)
    assert (grads.dQ[:5] == 0).all() and all(np.isfinite(g).all() for g in grads)


def test_bad_inputs_name_the_argument():
    rng = np.random.default_rng(7)
    Q, K, V, dO = (rng.standard_normal((2, 6, 4)) for _ in range(4))
    P = standard_attention(Q, K, V).P
    with pytest.raises(ValueError, match="P must have shape"):
        standard_attention_backward(Q, K, V, P[..., :5], dO)
    with pytest.raises(ValueError, match="P must have shape"):
        standard_attention_backward(Q, K, V, P[0], dO)
    with pytest.raises(TypeError, match="P must be a numpy.ndarray"):
        standard_attention_backward(Q, K, V, P.tolist(), dO)
    with pytest.raises(ValueError, match="P contains NaN"):
        standard_attention_backward(Q, K, V, np.full_like(P, np.nan), dO)
    with pytest.raises(ValueError, match="dO must have shape"):
        standard_attention_backward(Q, K, V, P, dO[:, :3])
    with pytest.raises(ValueError, match="dropout_p"):
        standard_attention(Q, K, V, dropout_p=1.0)
    with pytest.raises(ValueError, match="M = 8 is too small"):
        standard_attention(Q, K, V, M=8)
    with pytest.raises(ValueError, match="mask"):
        standard_attention(Q, K, V, mask=np.ones((6, 5), dtype=bool))
