"""FlashAttention (FA1 Algorithms 1, 2, 4, 5): exact against the oracle, and its HBM ledger equals the closed forms.

What the book claims and this file proves:
* Alg. 1/2 return the oracle's O, and statistics with m + log ℓ = L ((ℓ, m) = (0, −inf) on fully masked rows);
  Alg. 4 returns the oracle's gradients, regenerating the forward's dropout mask; block sizes do not matter.
* The executed ledger equals the conventions' closed forms, reads 2Nd + T_c(2Nd + 2N), writes T_c(Nd + 2N) forward and
  reads 2Nd + T_c(4Nd + 2N), writes 2Nd + T_c·Nd backward, for ragged N; causal and block-sparse runs pay only for
  the blocks they visit (FA1 Proposition 4: traffic scales with the non-zero fraction s).
* FA1 does more non-matmul FLOPs than FA2 (FA2 tweak 1), and its SRAM never overflows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fa2edu.blocks import block_sizes_kv_outer, num_blocks, tiles
from fa2edu.flash1 import (
    flash1_backward,
    flash1_backward_working_set,
    flash1_block_sparse_backward,
    flash1_block_sparse_forward,
    flash1_forward,
    flash1_forward_working_set,
)
from fa2edu.flash2 import flash2_forward
from fa2edu.masks import block_sparse_to_mask, random_block_mask
from fa2edu.memory import HBM, FlopCounter, SRAMOverflowError
from fa2edu.reference import attention_reference, attention_reference_backward
from fa2edu.softmax import Stats, block_stats, logsumexp_from_stats
from fa2edu.standard import standard_attention, standard_attention_backward
from tests.strategies import attention_problems, block_sizes
from tests.tolerances import assert_close_to_oracle, baseline_error


def _gradient(case, seed: int = 1) -> np.ndarray:
    shape = case.Q.shape[:-1] + (case.V.shape[-1],)
    return np.random.default_rng(seed).standard_normal(shape).astype(case.Q.dtype)


def _lse(fwd) -> np.ndarray:
    """FA1's statistics as FA2's log-sum-exp: L = m + log ℓ, +inf on a fully masked row (ℓ = 0)."""
    return logsumexp_from_stats(Stats(fwd.m.astype(np.float64), fwd.l.astype(np.float64)))


def _assert_stats(fwd, ref, N_k: int, **tolerance) -> None:
    """ℓ, m against the oracle's L: m + log ℓ = L; (ℓ, m) = (0, −inf) exactly where the row is fully masked."""
    empty = np.isposinf(ref.L)
    assert (fwd.l[empty] == 0).all() and np.isneginf(fwd.m[empty]).all(), "fully masked rows: (ℓ, m) = (0, −inf)"
    assert np.isfinite(fwd.m[~empty]).all()
    # ℓ sums exp(S − m) over the N_k keys with m the row maximum: one term is 1, none exceeds 1.
    assert (fwd.l[~empty] >= 1 - 1e-3).all() and (fwd.l[~empty] <= N_k * (1 + 1e-3)).all()
    assert_close_to_oracle(_lse(fwd), ref.L, "L = m + log ℓ", **tolerance)


# -- exactness, float64 ------------------------------------------------------------------------------------------

@given(attention_problems())
def test_forward_equals_oracle(case):
    """O, ℓ, m equal the oracle for ragged blocks, N_q ≠ N_k, causal, masks with fully masked rows, GQA, ±1e4 logits."""
    fwd = flash1_forward(case.Q, case.K, case.V, block_sizes=case.block_sizes, **case.kwargs())
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs())
    assert_close_to_oracle(fwd.O, ref.O, "O")
    _assert_stats(fwd, ref, case.K.shape[-2])
    assert (fwd.O[np.isposinf(ref.L)] == 0).all()


@given(attention_problems(), block_sizes())
def test_backward_equals_oracle(case, backward_blocks):
    """dQ, dK, dV equal the oracle's, with backward block sizes unrelated to the forward's."""
    dO = _gradient(case)
    fwd = flash1_forward(case.Q, case.K, case.V, block_sizes=case.block_sizes, **case.kwargs())
    grads = flash1_backward(case.Q, case.K, case.V, fwd.O, fwd.l, fwd.m, dO, block_sizes=backward_blocks,
                            **case.kwargs())
    ref = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs())
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref):
        assert_close_to_oracle(got, want, name)


@settings(max_examples=12)
@given(attention_problems(max_n=16), block_sizes(), st.sampled_from([0.1, 0.4]), st.integers(0, 2**31))
def test_dropout_backward_regenerates_the_mask(case, backward_blocks, p, seed):
    """With dropout, O and the gradients equal the oracle's with the same (p, seed): Alg. 4 regenerates Alg. 2's
    mask from the seed alone, in another loop order and with other block sizes."""
    dO = _gradient(case)
    fwd = flash1_forward(case.Q, case.K, case.V, block_sizes=case.block_sizes, **case.kwargs(),
                         dropout_p=p, seed=seed)
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs(), dropout_p=p, seed=seed)
    assert_close_to_oracle(fwd.O, ref.O, "O")
    _assert_stats(fwd, ref, case.K.shape[-2])        # ℓ normalises the un-dropped P: dropout leaves L unchanged
    grads = flash1_backward(case.Q, case.K, case.V, fwd.O, fwd.l, fwd.m, dO, block_sizes=backward_blocks,
                            **case.kwargs(), dropout_p=p, seed=seed)
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs(), dropout_p=p, seed=seed)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref_grads):
        assert_close_to_oracle(got, want, name)


def test_dropout_with_a_different_seed_differs():
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((10, 4)) for _ in range(3))
    a = flash1_forward(Q, K, V, block_sizes=(3, 4), dropout_p=0.5, seed=1).O
    assert not np.allclose(a, flash1_forward(Q, K, V, block_sizes=(3, 4), dropout_p=0.5, seed=2).O)
    assert np.allclose(a, standard_attention(Q, K, V, dropout_p=0.5, seed=1).O, rtol=0, atol=1e-13)


@settings(max_examples=15)
@given(attention_problems(max_n=16), block_sizes(), block_sizes())
def test_result_does_not_depend_on_block_sizes(case, first, second):
    dO = _gradient(case)
    a = flash1_forward(case.Q, case.K, case.V, block_sizes=first, **case.kwargs())
    b = flash1_forward(case.Q, case.K, case.V, block_sizes=second, **case.kwargs())
    assert_close_to_oracle(a.O, b.O.astype(np.float64), "O")
    assert_close_to_oracle(_lse(a), _lse(b), "L")
    ga = flash1_backward(case.Q, case.K, case.V, a.O, a.l, a.m, dO, block_sizes=first, **case.kwargs())
    gb = flash1_backward(case.Q, case.K, case.V, a.O, a.l, a.m, dO, block_sizes=second, **case.kwargs())
    for name, x, y in zip(("dQ", "dK", "dV"), ga, gb):
        assert_close_to_oracle(x, y.astype(np.float64), name)


# -- exactness, low precision: within 2× standard attention's error in the same dtype -------------------------------

@settings(max_examples=15)
@given(st.one_of(attention_problems(dtypes=(np.float32,), max_n=16),
                 attention_problems(dtypes=(np.float16,), max_n=16, extreme=False)))
def test_low_precision_within_twice_standard_attention(case):
    """O, L and the gradients in float32/float16 are within 2× the error of standard attention in the same dtype
    (plus the conventions' floor). float16 is drawn without ±1e4 logits, which overflow a float16 S of standard
    attention (its baseline would be NaN)."""
    dtype = case.Q.dtype
    dO = _gradient(case)
    hbm = HBM()
    std = standard_attention(case.Q, case.K, case.V, **case.kwargs(), hbm=hbm)
    std_grads = standard_attention_backward(case.Q, case.K, case.V, std.P, dO, **case.kwargs())
    ref = attention_reference(case.Q, case.K, case.V, **case.kwargs())
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs())
    # Standard attention's L in the same dtype, from the S it materialised in HBM.
    std_L = logsumexp_from_stats(block_stats(hbm["S"])).reshape(ref.L.shape)

    fwd = flash1_forward(case.Q, case.K, case.V, block_sizes=case.block_sizes, **case.kwargs())
    assert fwd.O.dtype == dtype and fwd.l.dtype == fwd.m.dtype == np.float32
    assert_close_to_oracle(fwd.O, ref.O, "O", dtype=dtype, baseline=baseline_error(std.O, ref.O))
    _assert_stats(fwd, ref, case.K.shape[-2], dtype=dtype, baseline=baseline_error(std_L, ref.L))
    grads = flash1_backward(case.Q, case.K, case.V, fwd.O, fwd.l, fwd.m, dO, block_sizes=case.block_sizes,
                            **case.kwargs())
    # dQ and dK are sums of terms τ·dS·K and τ·dSᵀ·Q with dS = P ∘ (dP − D): where they cancel (one key, say),
    # standard attention's D = Σ P ∘ dP can cancel exactly while FA's D = rowsum(dO ∘ O) differs by a rounding.
    # So the absolute floor is taken relative to the size of those terms, not of the (possibly 0) result.
    tau = 1.0 / math.sqrt(case.Q.shape[-1]) if case.scale is None else abs(case.scale)
    terms = tau * float(np.abs(dO).max()) * float(np.abs(case.V).max())
    floors = {"dQ": terms * float(np.abs(case.K).max()), "dK": terms * float(np.abs(case.Q).max()), "dV": 1.0}
    for name, got, base, want in zip(("dQ", "dK", "dV"), grads, std_grads, ref_grads):
        assert got.dtype == dtype
        scale = max(1.0, float(np.abs(want).max()))
        assert_close_to_oracle(got, want, name, dtype=dtype, baseline=baseline_error(base, want),
                               floor=1e-5 * max(1.0, floors[name] / scale))


# -- fully masked rows -----------------------------------------------------------------------------------------------

def test_rows_that_see_no_key():
    """Causal with N_q > N_k: the first N_q − N_k rows end with O = 0, ℓ = 0, m = −inf and zero gradients."""
    rng = np.random.default_rng(3)
    Q, dO = rng.standard_normal((2, 11, 4)), rng.standard_normal((2, 11, 4))
    K, V = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4))
    fwd = flash1_forward(Q, K, V, block_sizes=(3, 2), causal=True)
    assert (fwd.O[:, :6] == 0).all() and (fwd.l[:, :6] == 0).all() and np.isneginf(fwd.m[:, :6]).all()
    grads = flash1_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, block_sizes=(2, 3), causal=True)
    assert (grads.dQ[:, :6] == 0).all() and all(np.isfinite(g).all() for g in grads)


# -- HBM traffic -------------------------------------------------------------------------------------------------

def _visited_form(N_q, N_k, d, d_v, B_r, B_c, visit):
    """Per-program traffic of Alg. 1 and Alg. 4 when the blocks with ``visit(i, j)`` are the visited ones.

    Forward: K_j, V_j once per j; per visited block, Q_i, O_i, ℓ_i, m_i in and O_i, ℓ_i, m_i out.
    Backward: K_j, V_j once; per visited block, Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i in and dQ_i out; dK_j, dV_j once.
    """
    rows = [s.stop - s.start for s in tiles(N_q, B_r)]
    T_c = num_blocks(N_k, B_c)
    R = sum(r for i, r in enumerate(rows) for j in range(T_c) if visit(i, j))      # Σ over visited blocks of r_i
    forward = (N_k * (d + d_v) + R * (d + d_v + 2), R * (d_v + 2))
    backward = (N_k * (d + d_v) + R * (2 * d + 2 * d_v + 2), N_k * (d + d_v) + R * d)
    return forward, backward


def _run_ledgers(Q, K, V, dO, **kw):
    h_f, h_b = HBM(), HBM()
    fwd = flash1_forward(Q, K, V, hbm=h_f, **kw)
    flash1_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, hbm=h_b, **kw)
    return h_f, h_b


@settings(max_examples=30)
@given(st.integers(1, 70), st.integers(1, 12), st.integers(0, 400))
def test_ledger_equals_design_closed_form(N, d, extra):
    """the conventions' table with Alg. 1 line 1's block sizes, for ragged N and M = 4d + extra (N_q = N_k, d_v = d)."""
    M = 4 * d + extra
    B_r, B_c = block_sizes_kv_outer(M, d)
    T_c = math.ceil(N / B_c)
    assume(num_blocks(N, B_r) * T_c <= 600)
    rng = np.random.default_rng(N)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    h_f, h_b = _run_ledgers(Q, K, V, dO, M=M)
    assert h_f.block_sizes == (B_r, B_c)
    assert (h_f.reads, h_f.writes) == (2 * N * d + T_c * (2 * N * d + 2 * N), T_c * (N * d + 2 * N))
    assert (h_b.reads, h_b.writes) == (2 * N * d + T_c * (4 * N * d + 2 * N), 2 * N * d + T_c * N * d)
    # The initialisations (Alg. 1 line 2, Alg. 4 line 5) are counted apart, not in the totals.
    assert h_f.init_writes == N * (d + 2) and h_b.init_writes == 3 * N * d


@given(st.integers(1, 20), st.integers(1, 20), st.integers(1, 6), st.integers(1, 6), block_sizes(7), st.booleans(),
       st.integers(1, 3))
def test_ledger_general_shapes_and_causal(N_q, N_k, d, d_v, bs, causal, G):
    """N_q ≠ N_k, d_v ≠ d, GQA (counts per query head), causal or not: the ledger is the per-block form exactly,
    and a causal run visits only blocks with some j ≤ i + N_k − N_q (FA2 Section 3.1)."""
    B_r, B_c = bs
    rng = np.random.default_rng(0)
    Q, dO = rng.standard_normal((2 * G, N_q, d)), rng.standard_normal((2 * G, N_q, d_v))
    K, V = rng.standard_normal((2, N_k, d)), rng.standard_normal((2, N_k, d_v))
    h_f, h_b = _run_ledgers(Q, K, V, dO, block_sizes=bs, causal=causal)

    def visit(i, j):
        return not causal or j * B_c <= min((i + 1) * B_r, N_q) - 1 + N_k - N_q

    forward, backward = _visited_form(N_q, N_k, d, d_v, B_r, B_c, visit)
    assert (h_f.reads, h_f.writes) == forward
    assert (h_b.reads, h_b.writes) == backward
    if causal:
        dense_f, dense_b = _visited_form(N_q, N_k, d, d_v, B_r, B_c, lambda i, j: True)
        assert h_f.reads <= dense_f[0] and h_b.reads <= dense_b[0]


def test_causal_visits_fewer_blocks_and_flops():
    """Causal FA1 at N = 64 skips the blocks above the diagonal: less traffic and fewer matmul FLOPs."""
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((64, 8)) for _ in range(3))
    runs = {}
    for causal in (False, True):
        hbm, count = HBM(), FlopCounter()
        flash1_forward(Q, K, V, block_sizes=(8, 8), causal=causal, hbm=hbm, flops=count)
        runs[causal] = (hbm.reads, count.matmul)
    assert runs[True][0] < runs[False][0]
    assert runs[False][1] == 4 * 64 * 64 * 8
    assert runs[True][1] == 4 * 8 * 8 * 8 * (8 * 9 // 2)      # 36 of 64 blocks visited


def test_padding_mask_counts_the_share_of_programs():
    """A key-padding mask that differs between batch entries: a block skipped by half the programs counts half."""
    rng = np.random.default_rng(5)
    Q, K, V = (rng.standard_normal((2, 1, 8, 4)) for _ in range(3))
    keep = np.zeros((2, 1, 8, 8), dtype=bool)
    keep[0, ..., :8] = True                     # entry 0 sees every key
    keep[1, ..., :4] = True                     # entry 1 sees the first 4 keys: block j = 1 is skipped for it
    hbm = HBM()
    fwd = flash1_forward(Q, K, V, block_sizes=(8, 4), mask=keep, hbm=hbm)
    assert hbm.by_line()["Alg 1 line 8"]["read"] == 8 * (4 + 4 + 2) * (1 + 0.5)
    assert_close_to_oracle(fwd.O, attention_reference(Q, K, V, mask=keep).O, "O")


def test_ledger_by_line():
    """Each step of Alg. 1 moves what its line says (N = 12, d = 4, B_r = 3, B_c = 5: T_c = 3)."""
    N, d = 12, 4
    rng = np.random.default_rng(6)
    Q, K, V = (rng.standard_normal((N, d)) for _ in range(3))
    hbm = HBM()
    flash1_forward(Q, K, V, block_sizes=(3, 5), hbm=hbm)
    lines = hbm.by_line()
    assert lines["Alg 1 line 2"] == {"read": 0, "write": 0, "init": N * d + 2 * N}
    assert lines["Alg 1 line 6"] == {"read": 2 * N * d, "write": 0, "init": 0}
    assert lines["Alg 1 line 8"] == {"read": 3 * (2 * N * d + 2 * N), "write": 0, "init": 0}
    assert lines["Alg 1 line 12"] == {"read": 0, "write": 3 * N * d, "init": 0}
    assert lines["Alg 1 line 13"] == {"read": 0, "write": 3 * 2 * N, "init": 0}


# -- block-sparse FlashAttention (Alg. 5) ---------------------------------------------------------------------------

@settings(max_examples=20)
@given(attention_problems(max_n=20), st.sampled_from([0.0, 0.3, 0.6, 1.0]), st.integers(0, 1000))
def test_block_sparse_equals_oracle_with_the_element_mask(case, density, seed):
    """Alg. 5 equals exact attention with the block mask expanded to elements (and combined with causal/mask)."""
    N_q, N_k = case.Q.shape[-2], case.K.shape[-2]
    B_r, B_c = case.block_sizes
    block_mask = random_block_mask(num_blocks(N_q, B_r), num_blocks(N_k, B_c), density, seed)
    element = block_sparse_to_mask(block_mask, N_q, N_k, B_r, B_c)
    combined = element if case.mask is None else (case.mask & element)
    dO = _gradient(case)
    kw = {"causal": case.causal, "scale": case.scale}
    fwd = flash1_block_sparse_forward(case.Q, case.K, case.V, block_mask, block_sizes=(B_r, B_c), mask=case.mask,
                                      **kw)
    ref = attention_reference(case.Q, case.K, case.V, mask=combined, **kw)
    assert_close_to_oracle(fwd.O, ref.O, "O")
    _assert_stats(fwd, ref, case.K.shape[-2])
    grads = flash1_block_sparse_backward(case.Q, case.K, case.V, fwd.O, fwd.l, fwd.m, dO, block_mask,
                                         block_sizes=(B_r, B_c), mask=case.mask, **kw)
    ref_grads = attention_reference_backward(case.Q, case.K, case.V, dO, mask=combined, **kw)
    for name, got, want in zip(("dQ", "dK", "dV"), grads, ref_grads):
        assert_close_to_oracle(got, want, name)


@pytest.mark.parametrize("density", [0.1, 0.25, 0.5, 0.75, 1.0])
def test_block_sparse_ledger_scales_with_s(density):
    """Proposition 4: beyond the N(d + d_v) of K and V, the traffic is s × the dense traffic, s the non-zero
    fraction of the block mask, exactly (N divisible by B_r here, so every row block weighs the same)."""
    N, d, B_r, B_c = 48, 4, 4, 6
    rng = np.random.default_rng(7)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    block_mask = random_block_mask(N // B_r, N // B_c, density, seed=3)
    s = block_mask.mean()
    h_f, h_b = HBM(), HBM()
    fwd = flash1_block_sparse_forward(Q, K, V, block_mask, block_sizes=(B_r, B_c), hbm=h_f)
    flash1_block_sparse_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, block_mask, block_sizes=(B_r, B_c), hbm=h_b)
    dense_f, dense_b = _run_ledgers(Q, K, V, dO, block_sizes=(B_r, B_c))
    kv = 2 * N * d
    assert h_f.reads - kv == pytest.approx(s * (dense_f.reads - kv)) and h_f.writes == pytest.approx(
        s * dense_f.writes)
    assert h_b.reads - kv == pytest.approx(s * (dense_b.reads - kv))
    assert h_b.writes - kv == pytest.approx(s * (dense_b.writes - kv))
    forward, backward = _visited_form(N, N, d, d, B_r, B_c, lambda i, j: block_mask[i, j])
    assert (h_f.reads, h_f.writes) == forward and (h_b.reads, h_b.writes) == backward


def test_block_sparse_all_zero_row_block():
    """A row block with no non-zero block is never touched: it keeps the initial O = 0, ℓ = 0, m = −inf."""
    rng = np.random.default_rng(8)
    Q, K, V, dO = (rng.standard_normal((9, 3)) for _ in range(4))
    block_mask = np.ones((3, 2), dtype=bool)
    block_mask[1] = False
    fwd = flash1_block_sparse_forward(Q, K, V, block_mask, block_sizes=(3, 5))
    assert (fwd.O[3:6] == 0).all() and (fwd.l[3:6] == 0).all() and np.isneginf(fwd.m[3:6]).all()
    grads = flash1_block_sparse_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, block_mask, block_sizes=(3, 5))
    assert (grads.dQ[3:6] == 0).all() and all(np.isfinite(g).all() for g in grads)


# -- FLOPs and SRAM --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N, d, bs", [(32, 8, (8, 8)), (50, 4, (4, 16)), (17, 16, (5, 3))])
def test_fa1_does_more_nonmatmul_flops_than_fa2(N, d, bs):
    """FA2 tweak 1: FA1 rescales O_i by diag(ℓ)⁻¹ on every step; FA2 once per row block. Same matmul FLOPs."""
    rng = np.random.default_rng(9)
    Q, K, V = (rng.standard_normal((N, d)) for _ in range(3))
    fa1, fa2 = FlopCounter(), FlopCounter()
    flash1_forward(Q, K, V, block_sizes=bs, flops=fa1)
    flash2_forward(Q, K, V, block_sizes=bs, flops=fa2)
    assert fa1.matmul == fa2.matmul == 4 * N * N * d
    assert fa1.nonmatmul > fa2.nonmatmul


@pytest.mark.parametrize("N, d, M", [(40, 4, 16), (40, 4, 100), (33, 8, 500), (64, 16, 4096)])
def test_sram_peak_fits(N, d, M):
    """The SRAM peak is the documented working set (full blocks) and never exceeds the capacity for M."""
    rng = np.random.default_rng(10)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    h_f, h_b = _run_ledgers(Q, K, V, dO, M=M)
    B_r, B_c = (min(b, N) for b in h_f.block_sizes)
    assert h_f.sram.peak == flash1_forward_working_set(B_r, B_c, d) <= h_f.sram.capacity
    assert h_b.sram.peak == flash1_backward_working_set(B_r, B_c, d) <= h_b.sram.capacity
    assert h_f.sram.capacity >= M


def test_block_sizes_too_large_for_M_raise():
    rng = np.random.default_rng(11)
    Q, K, V, dO = (rng.standard_normal((64, 8)) for _ in range(4))
    with pytest.raises(SRAMOverflowError, match="block_sizes"):
        flash1_forward(Q, K, V, M=64, block_sizes=(32, 32))
    fwd = flash1_forward(Q, K, V, M=64)
    with pytest.raises(ValueError, match="block_sizes"):
        flash1_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, M=64, block_sizes=(16, 64))


# -- bad input -------------------------------------------------------------------------------------------------------

def test_bad_saved_statistics_and_gradients():
    rng = np.random.default_rng(12)
    Q, K, V, dO = (rng.standard_normal((2, 7, 4)) for _ in range(4))
    O, l, m = flash1_forward(Q, K, V, block_sizes=(2, 3))
    cases = [
        ((O[:, :6], l, m, dO), ValueError, "O must have shape"),
        ((O, l[:, :6], m, dO), ValueError, "l must have shape"),
        ((O, l, m[0], dO), ValueError, "m must have shape"),
        ((O, l, m, dO[..., :3]), ValueError, "dO must have shape"),
        ((O, l.tolist(), m, dO), TypeError, "l must be a numpy.ndarray"),
        ((O, -l, m, dO), ValueError, "l .* non-negative"),
        ((O, l, np.full_like(m, np.nan), dO), ValueError, "m .* NaN"),
        ((O, l, np.full_like(m, np.inf), dO), ValueError, r"m .* \+inf"),
        ((O, np.full_like(l, np.nan), m, dO), ValueError, "l contains NaN"),
        ((O, l, m, dO.astype(np.int64)), TypeError, "dO must have a floating dtype"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            flash1_backward(Q, K, V, *args, block_sizes=(2, 3))


def test_bad_block_masks():
    rng = np.random.default_rng(13)
    Q, K, V = (rng.standard_normal((10, 4)) for _ in range(3))
    with pytest.raises(ValueError, match=r"block_mask must have shape \(T_r, T_c\) = \(4, 2\)"):
        flash1_block_sparse_forward(Q, K, V, np.ones((3, 2), dtype=bool), block_sizes=(3, 5))
    with pytest.raises(TypeError, match="block_mask must be a numpy bool array"):
        flash1_block_sparse_forward(Q, K, V, np.ones((4, 2)), block_sizes=(3, 5))
    fwd = flash1_forward(Q, K, V)
    with pytest.raises(TypeError, match="block_mask"):
        flash1_block_sparse_backward(Q, K, V, *fwd, Q, [[True]], block_sizes=(3, 5))


def test_bad_problem_inputs():
    rng = np.random.default_rng(14)
    Q, K, V = (rng.standard_normal((10, 4)) for _ in range(3))
    with pytest.raises(ValueError, match="M = 15 is too small"):
        flash1_forward(Q, K, V, M=15)
    with pytest.raises(ValueError, match="B_c must be at least 1"):
        flash1_forward(Q, K, V, block_sizes=(2, 0))
    with pytest.raises(ValueError, match="K's head dimension"):
        flash1_forward(Q, K[:, :3], V)
    with pytest.raises(ValueError, match="dropout_p"):
        flash1_forward(Q, K, V, dropout_p=-0.1)
