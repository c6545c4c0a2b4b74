"""FlashAttention-2 (FA2 Algorithms 1 and 2) against the float64 oracle, and its HBM ledger against the closed forms.

What these tests prove, claim by claim of the book:

* exactness: forward O and L, backward dQ, dK, dV equal the oracle for N_q ≠ N_k, ragged blocks, causal on and off,
  masks with fully masked rows, logits up to ±1e4, GQA/MQA, dropout; float64 within 1e-10, float32/float16 within
  2× the error of a same-dtype standard computation (the conventions' rule);
* the result does not depend on the block sizes;
* the executed ledger equals the conventions' closed forms for ragged N, and the printed Algorithm 2's redundant loads
  (erratum 9) cost exactly 2·T_c·N·d reads;
* the SRAM never holds more than its capacity, explicit block sizes that do not fit are refused, and causal block
  skipping visits T(T + 1)/2 of the T² blocks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import attention_problems, block_sizes
from tolerances import assert_close_to_oracle, baseline_error

from fa2edu import attention_reference, attention_reference_backward, flash2_backward, flash2_forward
from fa2edu.blocks import block_sizes_kv_outer, block_sizes_q_outer, sram_capacity
from fa2edu.flash2 import flash2_backward_working_set, flash2_forward_working_set
from fa2edu.memory import HBM, FlopCounter, SRAMOverflowError


def upstream_gradient(case, seed: int = 0) -> np.ndarray:
    """A random dO shaped like O, (…, N_q, d_v), in the inputs' dtype."""
    shape = case.Q.shape[:-1] + (case.V.shape[-1],)
    return np.random.default_rng(seed).standard_normal(shape).astype(case.Q.dtype)


def flash2_both(case, dO, block_sizes_fwd, block_sizes_bwd, **extra):
    fwd = flash2_forward(case.Q, case.K, case.V, block_sizes=block_sizes_fwd, **case.kwargs(), **extra)
    grads = flash2_backward(case.Q, case.K, case.V, fwd.O, fwd.L, dO, block_sizes=block_sizes_bwd,
                            **case.kwargs(), **extra)
    return fwd, grads


def assert_all_close(fwd, grads, ref, ref_grads, *, dtype=np.float64, baselines=None):
    names = ("O", "L", "dQ", "dK", "dV")
    for name, actual, expected in zip(names, (*fwd, *grads), (*ref, *ref_grads)):
        baseline = None if baselines is None else baselines[name]
        assert_close_to_oracle(actual, expected, name, dtype=dtype, baseline=baseline)


# -- exactness, float64 --------------------------------------------------------------------------------------------

@given(case=attention_problems(), bwd_blocks=block_sizes())
def test_forward_and_backward_equal_the_oracle_float64(case, bwd_blocks):
    dO = upstream_gradient(case)
    with np.errstate(invalid="raise", divide="raise", over="raise"):   # no 0/0, log 0, inf − inf, overflow
        fwd, grads = flash2_both(case, dO, case.block_sizes, bwd_blocks)
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs())
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs())
    assert fwd.O.dtype == np.float64 and all(g.dtype == np.float64 for g in grads)
    assert_all_close(fwd, grads, ref, ref_grads)


@given(case=attention_problems(), other=block_sizes())
def test_result_does_not_depend_on_block_sizes(case, other):
    dO = upstream_gradient(case)
    fwd_a, grads_a = flash2_both(case, dO, case.block_sizes, other)
    fwd_b, grads_b = flash2_both(case, dO, other, case.block_sizes)
    for name, a, b in zip(("O", "L", "dQ", "dK", "dV"), (*fwd_a, *grads_a), (*fwd_b, *grads_b)):
        assert_close_to_oracle(a, b, name)   # the same rule, with one tiling as the "oracle" of the other


def test_fully_masked_rows_give_zero_output_infinite_L_and_zero_gradients():
    rng = np.random.default_rng(3)
    # Causal with N_q > N_k: the first N_q − N_k = 4 rows see no key (bottom-right alignment).
    # Key padding with length 0 for batch entry 1: all of its rows are fully masked.
    B, H, N_q, N_k, d = 2, 2, 11, 7, 5
    Q, dO = rng.standard_normal((2, B, H, N_q, d))
    K, V = rng.standard_normal((2, B, H, N_k, d))
    lengths = np.array([5, 0])
    mask = np.broadcast_to((np.arange(N_k) < lengths[:, None])[:, None, None, :], (B, 1, N_q, N_k))
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        fwd = flash2_forward(Q, K, V, block_sizes=(3, 2), causal=True, mask=mask)
        grads = flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=(3, 2), causal=True, mask=mask)
    empty = np.zeros((B, H, N_q), dtype=bool)
    empty[:, :, :N_q - N_k] = True
    empty[1] = True
    assert (fwd.O[empty] == 0).all() and np.isposinf(fwd.L[empty]).all()
    assert np.isfinite(fwd.L[~empty]).all()
    assert (grads.dQ[empty] == 0).all()
    assert (grads.dK[1] == 0).all() and (grads.dV[1] == 0).all()
    ref_grads = attention_reference_backward(Q, K, V, dO, causal=True, mask=mask)
    assert_all_close(fwd, grads, attention_reference(Q, K, V, causal=True, mask=mask), ref_grads)


@given(case=attention_problems(batch=False, extreme=False), target=st.sampled_from([1e3, 1e4]))
def test_logits_of_ten_thousand(case, target):
    """Scores up to ±1e4 (exp overflows float64 at ~709): the online softmax and exp(S − L) stay finite and exact."""
    tau = 1.0 / math.sqrt(case.Q.shape[-1]) if case.scale is None else case.scale
    largest = np.abs(tau * case.Q @ case.K.T).max()
    case = type(case)(case, Q=case.Q * (target / max(largest, 1e-300)))
    assert np.abs(tau * case.Q @ case.K.T).max() == pytest.approx(target)
    dO = upstream_gradient(case)
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        fwd, grads = flash2_both(case, dO, case.block_sizes, case.block_sizes[::-1])
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs())
    assert_all_close(fwd, grads, ref, attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs()))


def test_gqa_and_mqa_equal_attention_with_repeated_kv_heads():
    """Index mapping (no copy of K, V) equals running every query head on its own copy of the K/V head;
    dK, dV of a shared head are the sums of the copies' gradients."""
    rng = np.random.default_rng(7)
    B, N_q, N_k, d, d_v = 2, 9, 13, 4, 3
    for H_q, H_kv in [(6, 3), (4, 1), (3, 3)]:
        G = H_q // H_kv
        Q = rng.standard_normal((B, H_q, N_q, d))
        K = rng.standard_normal((B, H_kv, N_k, d))
        V = rng.standard_normal((B, H_kv, N_k, d_v))
        dO = rng.standard_normal((B, H_q, N_q, d_v))
        K_rep, V_rep = np.repeat(K, G, axis=1), np.repeat(V, G, axis=1)
        fwd = flash2_forward(Q, K, V, block_sizes=(4, 5), causal=True)
        grads = flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=(4, 5), causal=True)
        fwd_rep = flash2_forward(Q, K_rep, V_rep, block_sizes=(4, 5), causal=True)
        grads_rep = flash2_backward(Q, K_rep, V_rep, fwd_rep.O, fwd_rep.L, dO, block_sizes=(4, 5), causal=True)
        assert grads.dK.shape == K.shape and grads.dV.shape == V.shape
        np.testing.assert_allclose(fwd.O, fwd_rep.O, rtol=0, atol=1e-12)
        np.testing.assert_allclose(grads.dQ, grads_rep.dQ, rtol=0, atol=1e-12)
        np.testing.assert_allclose(grads.dK, grads_rep.dK.reshape(B, H_kv, G, N_k, d).sum(axis=2), atol=1e-12)
        np.testing.assert_allclose(grads.dV, grads_rep.dV.reshape(B, H_kv, G, N_k, d_v).sum(axis=2), atol=1e-12)


# -- exactness, float32 and float16 -----------------------------------------------------------------------------------

def same_dtype_attention(Q, K, V, dO, causal=False, scale=None, mask=None):
    """Standard attention and its gradients with every step in the inputs' own dtype: the low-precision baseline.

    Returns a dict O, L, dQ, dK, dV. GQA by repeating K/V heads. Fully masked rows give O = 0, L = +inf.
    """
    dtype = Q.dtype
    G = Q.shape[-3] // K.shape[-3] if Q.ndim >= 3 else 1
    if G > 1:
        K, V = np.repeat(K, G, axis=-3), np.repeat(V, G, axis=-3)
    N_q, N_k, d = Q.shape[-2], K.shape[-2], Q.shape[-1]
    tau = dtype.type(1.0 / math.sqrt(d) if scale is None else scale)
    visible = np.ones((N_q, N_k), dtype=bool)
    if causal:
        visible &= np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + (N_k - N_q)
    if mask is not None:
        visible = visible & mask
    S = np.where(visible, tau * (Q @ np.swapaxes(K, -1, -2)), dtype.type(-np.inf)).astype(dtype)
    m = S.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), dtype.type(0), m)
    E = np.exp(S - m)
    l = E.sum(axis=-1, keepdims=True)
    P = E / np.where(l == 0, dtype.type(1), l)
    O = P @ V
    with np.errstate(divide="ignore"):
        L = np.where(l == 0, dtype.type(np.inf), m + np.log(l))[..., 0]
    dV = np.swapaxes(P, -1, -2) @ dO
    dS = P * (dO @ np.swapaxes(V, -1, -2) - (dO * O).sum(axis=-1, keepdims=True))
    dQ = tau * (dS @ K)
    dK = tau * (np.swapaxes(dS, -1, -2) @ Q)
    if G > 1:
        dK = dK.reshape(dK.shape[:-3] + (-1, G) + dK.shape[-2:]).sum(axis=-3)
        dV = dV.reshape(dV.shape[:-3] + (-1, G) + dV.shape[-2:]).sum(axis=-3)
    return {"O": O, "L": L, "dQ": dQ, "dK": dK, "dV": dV}


def low_precision_check(case, *, gradients: bool):
    dtype = case.Q.dtype
    dO = upstream_gradient(case)
    fwd, grads = flash2_both(case, dO, case.block_sizes, case.block_sizes[::-1])
    assert fwd.O.dtype == dtype and all(g.dtype == dtype for g in grads)
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs())
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs())
    with np.errstate(all="ignore"):
        low = same_dtype_attention(case.Q, case.K, case.V, dO, **case.kwargs())
    names = ("O", "L", "dQ", "dK", "dV") if gradients else ("O", "L")
    for name, actual, expected in zip(names, (*fwd, *grads), (*ref, *ref_grads)):
        assert_close_to_oracle(actual, expected, name, dtype=dtype, baseline=baseline_error(low[name], expected))


@given(data=st.data())
def test_low_precision_forward_and_backward_within_twice_the_same_dtype_error(data):
    dtype = data.draw(st.sampled_from([np.float32, np.float16]))
    low_precision_check(data.draw(attention_problems(dtypes=(dtype,), extreme=False)), gradients=True)


@given(case=attention_problems(dtypes=(np.float32,), extreme=True))
def test_float32_forward_with_huge_logits_within_twice_the_same_dtype_error(case):
    """The forward pass keeps the rule at logits up to ~1e4. The backward pass does not, by design of FA2: it
    rebuilds P = exp(S − L) from L stored in float32, whose rounding (ulp(L) ≈ 6e-5 at |L| ≈ 1e3) becomes a relative
    error of P, where the standard computation rounds S − m, a small number. That case is left to float64."""
    low_precision_check(case, gradients=False)


# -- dropout ---------------------------------------------------------------------------------------------------------

@given(case=attention_problems(max_n=16), p=st.sampled_from([0.1, 0.5, 0.9]), seed=st.integers(0, 2**31 - 1),
       bwd_blocks=block_sizes())
def test_dropout_backward_regenerates_the_forward_mask(case, p, seed, bwd_blocks):
    """The backward pass regenerates Z from the seed: both passes equal the oracle's dropout variants."""
    dO = upstream_gradient(case)
    fwd, grads = flash2_both(case, dO, case.block_sizes, bwd_blocks, dropout_p=p, seed=seed)
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs(), dropout_p=p, seed=seed)
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs(), dropout_p=p, seed=seed)
    assert_all_close(fwd, grads, ref, ref_grads)


def test_dropout_changes_the_result_and_a_wrong_seed_in_the_backward_is_wrong():
    rng = np.random.default_rng(11)
    Q, K, V, dO = rng.standard_normal((4, 1, 2, 12, 4))
    fwd = flash2_forward(Q, K, V, block_sizes=(5, 3), dropout_p=0.5, seed=1)
    assert not np.allclose(fwd.O, flash2_forward(Q, K, V, block_sizes=(5, 3)).O)
    right = flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=(3, 5), dropout_p=0.5, seed=1)
    wrong = flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=(3, 5), dropout_p=0.5, seed=2)
    ref = attention_reference_backward(Q, K, V, dO, dropout_p=0.5, seed=1)
    np.testing.assert_allclose(right.dV, ref.dV, atol=1e-12)
    assert not np.allclose(wrong.dV, ref.dV)


# -- the HBM ledger ----------------------------------------------------------------------------------------------------

def ledger_of(N, d, M, *, batch_heads=(), redundant_loads=False, causal=False):
    rng = np.random.default_rng(N * 1000 + d)
    Q, K, V, dO = rng.standard_normal((4,) + batch_heads + (N, d))
    fwd_hbm, bwd_hbm = HBM(), HBM()
    fwd = flash2_forward(Q, K, V, M=M, causal=causal, hbm=fwd_hbm)
    grads = flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=M, causal=causal, hbm=bwd_hbm,
                            redundant_loads=redundant_loads)
    return fwd_hbm, bwd_hbm, grads


LEDGER_CASES = [(1, 1, 4), (7, 3, 12), (37, 5, 100), (50, 4, 70), (64, 8, 256), (33, 8, 97), (41, 2, 8),
                (29, 6, 240), (45, 3, 1000)]


@pytest.mark.parametrize("N, d, M", LEDGER_CASES)
def test_ledger_equals_the_closed_forms(N, d, M):
    fwd_hbm, bwd_hbm, _ = ledger_of(N, d, M)
    # Forward (Q-outer rule): reads Nd + 2Nd·T_r, writes Nd + N; nothing initialised in HBM.
    B_r, _ = block_sizes_q_outer(M, d)
    T_r = math.ceil(N / B_r)
    assert fwd_hbm.block_sizes == block_sizes_q_outer(M, d)
    assert (fwd_hbm.reads, fwd_hbm.writes, fwd_hbm.init_writes) == (N * d + 2 * N * d * T_r, N * d + N, 0)
    # Backward (K/V-outer rule): reads 4Nd + T_c(3Nd + 2N), writes N + 2Nd + T_c·Nd; dQ = 0 initialised apart.
    _, B_c = block_sizes_kv_outer(M, d)
    T_c = math.ceil(N / B_c)
    assert bwd_hbm.block_sizes == block_sizes_kv_outer(M, d)
    assert bwd_hbm.reads == 4 * N * d + T_c * (3 * N * d + 2 * N)
    assert bwd_hbm.writes == N + 2 * N * d + T_c * N * d
    assert bwd_hbm.init_writes == N * d


@given(N=st.integers(1, 40), d=st.integers(1, 6), factor=st.integers(4, 40), extra=st.integers(0, 7))
def test_ledger_closed_forms_for_drawn_sizes(N, d, factor, extra):
    M = factor * d + extra
    fwd_hbm, bwd_hbm, _ = ledger_of(N, d, M, batch_heads=(2, 3))   # counts are per (batch, head)
    T_r = math.ceil(N / block_sizes_q_outer(M, d)[0])
    T_c = math.ceil(N / block_sizes_kv_outer(M, d)[1])
    assert (fwd_hbm.reads, fwd_hbm.writes) == (N * d + 2 * N * d * T_r, N * d + N)
    assert (bwd_hbm.reads, bwd_hbm.writes) == (4 * N * d + T_c * (3 * N * d + 2 * N), N + 2 * N * d + T_c * N * d)


@pytest.mark.parametrize("N, d, M", LEDGER_CASES[1:6])
def test_redundant_loads_cost_exactly_two_Tc_N_d_reads_and_change_nothing_else(N, d, M):
    _, minimal, grads = ledger_of(N, d, M)
    _, printed, grads_printed = ledger_of(N, d, M, redundant_loads=True)
    T_c = math.ceil(N / block_sizes_kv_outer(M, d)[1])
    assert printed.reads - minimal.reads == 2 * T_c * N * d
    assert printed.by_line()["Alg 2 line 9 (redundant)"]["read"] == 2 * T_c * N * d
    assert (printed.writes, printed.init_writes) == (minimal.writes, minimal.init_writes)
    for a, b in zip(grads, grads_printed):
        np.testing.assert_array_equal(a, b)


def test_flop_counts_forward_4N2d_backward_2_5_times_that():
    N, d = 24, 8
    rng = np.random.default_rng(0)
    Q, K, V, dO = rng.standard_normal((4, N, d))
    fwd_flops, bwd_flops = FlopCounter(), FlopCounter()
    fwd = flash2_forward(Q, K, V, block_sizes=(5, 7), flops=fwd_flops)
    flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=(7, 5), flops=bwd_flops)
    assert fwd_flops.matmul == 4 * N * N * d                 # FA2 Section 4.1
    assert bwd_flops.matmul == 10 * N * N * d                # 2.5× the forward: five N×N×d products
    assert fwd_flops.nonmatmul > 0 and bwd_flops.nonmatmul > 0


# -- SRAM --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N, d, M", LEDGER_CASES)
def test_sram_peak_within_capacity(N, d, M):
    fwd_hbm, bwd_hbm, _ = ledger_of(N, d, M)
    for hbm, rule, working_set in ((fwd_hbm, block_sizes_q_outer, flash2_forward_working_set),
                                   (bwd_hbm, block_sizes_kv_outer, flash2_backward_working_set)):
        capacity = sram_capacity(M, d, rule, lambda br, bc, ws=working_set: ws(br, bc, d, d))
        assert hbm.sram.capacity == capacity and capacity >= M
        assert 0 < hbm.sram.peak <= capacity
        B_r, B_c = rule(M, d)
        if N % B_r == 0 and N % B_c == 0:        # full blocks: the working set is reached exactly
            assert hbm.sram.peak == working_set(B_r, B_c, d, d)
        assert hbm.sram.occupancy == 0           # every tile freed


def test_explicit_block_sizes_that_do_not_fit_raise():
    rng = np.random.default_rng(0)
    Q, K, V, dO = rng.standard_normal((4, 64, 8))
    fwd = flash2_forward(Q, K, V, M=256)
    with pytest.raises(SRAMOverflowError, match="block_sizes"):
        flash2_forward(Q, K, V, M=256, block_sizes=(64, 64))
    with pytest.raises(SRAMOverflowError, match="block_sizes"):
        flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=256, block_sizes=(64, 64))
    # The rule's own sizes always fit, and so do smaller ones.
    flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=256, block_sizes=block_sizes_kv_outer(256, 8))
    flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=256, block_sizes=(1, 1))


# -- causal block skipping (FA2 Section 3.1) --------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 4, 8])
def test_causal_visits_T_times_T_plus_1_over_2_blocks(T):
    B, d = 6, 4
    N = B * T
    rng = np.random.default_rng(T)
    Q, K, V, dO = rng.standard_normal((4, N, d))
    runs = {}
    for causal in (False, True):
        f_hbm, b_hbm, f_flops, b_flops = HBM(), HBM(), FlopCounter(), FlopCounter()
        fwd = flash2_forward(Q, K, V, block_sizes=(B, B), causal=causal, hbm=f_hbm, flops=f_flops)
        flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=(B, B), causal=causal, hbm=b_hbm, flops=b_flops)
        runs[causal] = (f_hbm, b_hbm, f_flops, b_flops)
    visited = T * (T + 1) // 2
    f_hbm, b_hbm, f_flops, b_flops = runs[True]
    # Forward: each visited block loads K_j (B × d); backward: each visited block loads Q_i (B × d).
    assert f_hbm.by_line()["Alg 1 line 7"]["read"] == 2 * visited * B * d
    assert b_hbm.by_tensor()["Q"]["read"] == visited * B * d
    for full, skipped in ((runs[False][2], f_flops), (runs[False][3], b_flops)):
        assert skipped.matmul * T * T == full.matmul * visited      # about half: (T + 1) / 2T of the work
