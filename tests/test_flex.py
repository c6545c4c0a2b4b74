"""FlexAttention in NumPy (fa2edu.flex): exact against the dense definition, PyTorch's op and finite differences.

What these tests prove, claim by claim:

* exactness: for random masks (causal, windows, prefixes, packed documents, random block patterns per batch entry
  and head, unions, a mod only scalars can run) and score_mods (ALiBi, soft capping, relative bias, plain-Python
  mods, a mod that masks by returning −inf), with N_q ≠ N_k, blocks that divide nothing, fully masked rows, GQA and
  logits up to ±1e4, forward O and L and backward dQ, dK, dV equal the dense float64 definition (mods called once
  per element with Python scalars) within 1e-10, and float32 within the conventions' rule; the mask-only case
  equals fa2edu's own oracle; causal equals flash2 bit for bit, ledger included;
* the backward through a score_mod equals finite differences of the forward (softcap, ALiBi);
* PyTorch's ``torch.nn.attention.flex_attention`` (eager, CPU) gives the same O and log-sum-exp, and its
  ``create_block_mask`` the same partial and full blocks;
* the block classification: blocks skipped for every program are never read, full blocks never evaluate the mask,
  the classes equal a brute-force classification of the element mask;
* the ready mods keep exactly the keys their docstrings name; every bad input gets an error naming the argument.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from strategies import flex_problems
from tolerances import assert_close_to_oracle, baseline_error

import fa2edu
from fa2edu import flex
from fa2edu.flex import (
    FULL,
    PARTIAL,
    SKIPPED,
    BlockMask,
    and_masks,
    at_lengths,
    bind,
    create_block_mask,
    flex_attention,
    flex_attention_backward,
    or_masks,
)
from fa2edu.masks import BlockKind, causal_mask, classify_block
from fa2edu.memory import HBM

# -- the definition, densely -------------------------------------------------------------------------------------


def element_mask(mask_mod, B_arg, H_arg, shape) -> np.ndarray:
    """keep[b, h, i, j] = mask_mod(b, h, i, j), one Python call per element (b = 0 / h = 0 when broadcast)."""
    keep = np.ones(shape, dtype=bool)
    if mask_mod is not None:
        mod = at_lengths(mask_mod, shape[2], shape[3])
        for b, h, i, j in np.ndindex(*shape):
            keep[b, h, i, j] = bool(mod(b if B_arg else 0, h if H_arg else 0, i, j))
    return keep


def dense_flex(case, dtype=np.float64, score_mod_grad=None):
    """O, L, dQ, dK, dV by definition, in ``dtype``: S = τqkᵀ (GQA by repeating k, v), S' = score_mod(S) per element,
    −inf where mask_mod drops the score, P = softmax(S'), and dS = P ∘ (dP − D) ∘ score_mod_grad(S)."""
    q, k, v, dO = (case.q.astype(dtype), case.k.astype(dtype), case.v.astype(dtype), case.dO.astype(dtype))
    B, H_q, N_q, d = q.shape
    H_kv = k.shape[1]
    G = H_q // H_kv
    K, V = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    tau = dtype(1.0 / math.sqrt(d) if case.scale is None else case.scale)
    S = tau * np.einsum("bhid,bhjd->bhij", q, K)
    keep = element_mask(case.mask_mod, case.B, case.H, S.shape)
    S_mod, g = S.copy(), np.ones_like(S)
    if case.score_mod is not None:
        grad = score_mod_grad or case.score_mod.score_mod_grad
        for b, h, i, j in np.ndindex(*S.shape):
            S_mod[b, h, i, j] = case.score_mod(float(S[b, h, i, j]), b, h, i, j)
            g[b, h, i, j] = grad(float(S[b, h, i, j]), b, h, i, j)
    S_mod = np.where(keep, S_mod, -np.inf)
    m = S_mod.max(axis=-1, keepdims=True)
    empty = np.isneginf(m)
    E = np.exp(S_mod - np.where(empty, 0.0, m))
    l = E.sum(axis=-1, keepdims=True)
    P = E / np.where(empty, 1.0, l)
    with np.errstate(divide="ignore"):
        L = np.where(empty, np.inf, m + np.log(np.where(empty, 1.0, l)))[..., 0]
    O = P @ V
    dP = dO @ np.swapaxes(V, -1, -2)
    D = (dO * O).sum(axis=-1, keepdims=True)
    dS = P * (dP - D) * g
    dQ = tau * dS @ K
    group_sum = lambda x: x.reshape(B, H_kv, G, *x.shape[2:]).sum(axis=2)
    dK = group_sum(tau * np.swapaxes(dS, -1, -2) @ q)
    dV = group_sum(np.swapaxes(P, -1, -2) @ dO)
    return O, L, dQ, dK, dV


def run_flex(case, **extra):
    """Forward (O, L) and backward (dQ, dK, dV) of fa2edu.flex on a drawn case."""
    N_q, N_k = case.q.shape[2], case.k.shape[2]
    bm = create_block_mask(case.mask_mod, case.B, case.H, N_q, N_k, BLOCK_SIZE=case.BLOCK_SIZE)
    common = dict(score_mod=case.score_mod, block_mask=bm, scale=case.scale, enable_gqa=case.enable_gqa)
    O, L = flex_attention(case.q, case.k, case.v, return_lse=True, **common, **extra)
    grads = flex_attention_backward(case.q, case.k, case.v, O, L, case.dO, **common, **extra)
    return (O, L, *grads), bm


NAMES = ("O", "L", "dQ", "dK", "dV")


# -- exactness -------------------------------------------------------------------------------------------------------

@given(case=flex_problems())
def test_forward_and_backward_equal_the_dense_definition_float64(case):
    with np.errstate(invalid="raise", divide="raise", over="raise"):     # no 0/0, log 0, inf − inf, overflow
        got, _ = run_flex(case)
    for name, actual, expected in zip(NAMES, got, dense_flex(case)):
        assert_close_to_oracle(actual, expected, name)


def float32_check(case, names):
    got, _ = run_flex(case)
    assert all(x.dtype == np.float32 for x in got[:1] + got[2:])
    exact = dense_flex(case)
    with np.errstate(all="ignore"):
        low = dense_flex(case, dtype=np.float32)
    for name, actual, expected, baseline in zip(names, got, exact, low):
        assert_close_to_oracle(actual, expected, name, dtype=np.float32, baseline=baseline_error(baseline, expected))


@settings(max_examples=15)
@given(case=flex_problems(dtypes=(np.float32,), extreme=False))
def test_float32_within_twice_the_error_of_a_dense_float32_computation(case):
    float32_check(case, NAMES)


@settings(max_examples=15)
@given(case=flex_problems(dtypes=(np.float32,)))
def test_float32_forward_with_huge_logits_within_twice_the_dense_float32_error(case):
    """As for flash2: the forward keeps the rule at logits up to ~1e4; the backward rebuilds P = exp(S − L) from a
    float32 L (a relative error |L|·ε in P), so huge logits in the backward are left to float64."""
    float32_check(case, NAMES[:2])


@settings(max_examples=15)
@given(case=flex_problems(scores=("none",)))
def test_masks_alone_equal_fa2edus_oracle(case):
    """Without a score_mod, flex_attention is attention_reference with the element mask (an independent oracle)."""
    got, _ = run_flex(case)
    keep = element_mask(case.mask_mod, case.B, case.H, case.q.shape[:3] + (case.k.shape[2],))
    ref = fa2edu.attention_reference(case.q, case.k, case.v, scale=case.scale, mask=keep)
    ref_grads = fa2edu.attention_reference_backward(case.q, case.k, case.v, case.dO, scale=case.scale, mask=keep)
    for name, actual, expected in zip(NAMES, got, (*ref, *ref_grads)):
        assert_close_to_oracle(actual, expected, name)


@pytest.mark.parametrize("N_q, N_k, block", [(13, 13, 4), (9, 14, (3, 5)), (14, 9, (5, 3)), (7, 3, 2)])
def test_causal_equals_flash2_bit_for_bit_ledger_included(N_q, N_k, block):
    """The ready causal mod, aligned bottom-right, is flash2's causal=True: same O, L, gradients, same traffic."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, n, 5)) for n in (N_q, N_k, N_k))
    dO = rng.standard_normal((2, 3, N_q, 5))
    bm = create_block_mask(flex.causal, None, None, N_q, N_k, BLOCK_SIZE=block)
    bs = bm.BLOCK_SIZE
    flex_fwd, flash_fwd, flex_bwd, flash_bwd = HBM(), HBM(), HBM(), HBM()
    O, L = flex_attention(q, k, v, block_mask=bm, return_lse=True, hbm=flex_fwd)
    ref = fa2edu.flash2_forward(q, k, v, block_sizes=bs, causal=True, hbm=flash_fwd)
    grads = flex_attention_backward(q, k, v, O, L, dO, block_mask=bm, hbm=flex_bwd)
    ref_grads = fa2edu.flash2_backward(q, k, v, ref.O, ref.L, dO, block_sizes=bs, causal=True, hbm=flash_bwd)
    for actual, expected in zip((O, L, *grads), (*ref, *ref_grads)):
        np.testing.assert_array_equal(actual, expected)
    assert flex_fwd.by_tensor() == flash_fwd.by_tensor() and flex_bwd.by_tensor() == flash_bwd.by_tensor()
    assert flex_fwd.sram.peak == flash_fwd.sram.peak and flex_bwd.sram.peak == flash_bwd.sram.peak


def test_fully_masked_rows_give_zero_output_infinite_lse_and_zero_gradients():
    rng = np.random.default_rng(1)
    N_q, N_k = 9, 4                                       # causal: the first 5 queries see no key
    q, k, v = (rng.standard_normal((1, 2, n, 3)) for n in (N_q, N_k, N_k))
    bm = create_block_mask(flex.causal, None, None, N_q, N_k, BLOCK_SIZE=3)
    O, L = flex_attention(q, k, v, score_mod=flex.softcap(2.0), block_mask=bm, return_lse=True)
    dQ, dK, dV = flex_attention_backward(q, k, v, O, L, np.ones_like(O), score_mod=flex.softcap(2.0), block_mask=bm)
    assert (O[:, :, :5] == 0).all() and np.isposinf(L[:, :, :5]).all() and np.isfinite(L[:, :, 5:]).all()
    assert (dQ[:, :, :5] == 0).all() and not any(np.isnan(x).any() for x in (O, dQ, dK, dV))


@pytest.mark.parametrize("score_mod", [flex.softcap(1.5), flex.alibi([0.5, 2.0]),
                                       flex.relative_bias([0.3, -1.0, 0.7, 2.0, -0.4])],
                         ids=["softcap", "alibi", "relative_bias"])
def test_backward_through_score_mod_equals_finite_differences(score_mod):
    """d(sum(dO ∘ O))/dx by central differences, for every entry of q, k and v (GQA: 2 query heads, 1 key head)."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 1, 5, 3)), rng.standard_normal((1, 1, 5, 2))
    dO = rng.standard_normal((1, 2, 4, 2))
    bm = create_block_mask(flex.sliding_window(3), None, None, 4, 5, BLOCK_SIZE=(3, 2))
    kwargs = dict(score_mod=score_mod, block_mask=bm, enable_gqa=True)

    def loss(q, k, v):
        return float((flex_attention(q, k, v, **kwargs) * dO).sum())
    O, L = flex_attention(q, k, v, return_lse=True, **kwargs)
    analytic = flex_attention_backward(q, k, v, O, L, dO, **kwargs)
    eps = 1e-6
    inputs = [q, k, v]
    for which, grad in enumerate(analytic):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(*grad.shape):
            plus, minus = [x.copy() for x in inputs], [x.copy() for x in inputs]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric[index] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8, err_msg=NAMES[2 + which])


def test_gqa_equals_attention_over_copied_heads():
    """enable_gqa reads key/value head h // G, and dK, dV sum over the group: as if k, v were copied G times."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 6, 7, 4)), rng.standard_normal((2, 2, 9, 4)), rng.standard_normal((2, 2, 9, 3))
    dO = rng.standard_normal((2, 6, 7, 3))
    bm = create_block_mask(flex.prefix_lm(3), None, 6, 7, 9, BLOCK_SIZE=4)
    mods = dict(score_mod=flex.alibi(flex.alibi_slopes(6)), block_mask=bm)
    O, L = flex_attention(q, k, v, enable_gqa=True, return_lse=True, **mods)
    dQ, dK, dV = flex_attention_backward(q, k, v, O, L, dO, enable_gqa=True, **mods)
    K, V = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    O2, L2 = flex_attention(q, K, V, return_lse=True, **mods)
    dQ2, dK2, dV2 = flex_attention_backward(q, K, V, O2, L2, dO, **mods)
    np.testing.assert_allclose(O, O2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dQ, dQ2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dK, dK2.reshape(2, 2, 3, 9, 4).sum(axis=2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dV, dV2.reshape(2, 2, 3, 9, 3).sum(axis=2), rtol=1e-12, atol=1e-14)


def test_explicit_score_mod_grad_is_used_and_return_lse_false_returns_o_alone():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 1, 6, 3)) for _ in range(3))

    def double(score, b, h, q_idx, kv_idx):
        return 2.0 * score
    O = flex_attention(q, k, v, score_mod=double)
    assert isinstance(O, np.ndarray)
    O2, L2 = flex_attention(q, k, v, scale=2.0 / math.sqrt(3), return_lse=True)    # the same scores
    np.testing.assert_allclose(O, O2, rtol=1e-13)
    dO = rng.standard_normal(O.shape)
    grads = flex_attention_backward(q, k, v, O, L2, dO, score_mod=double, score_mod_grad=lambda s, b, h, i, j: 2.0)
    ref = flex_attention_backward(q, k, v, O2, L2, dO, scale=2.0 / math.sqrt(3))
    for a, e in zip(grads, ref):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-14)


# -- the block classification and the ledger --------------------------------------------------------------------

@settings(max_examples=20)
@given(case=flex_problems(scores=("none",)))
def test_classes_equal_a_brute_force_classification_of_the_element_mask(case):
    N_q, N_k = case.q.shape[2], case.k.shape[2]
    bm = create_block_mask(case.mask_mod, case.B, case.H, N_q, N_k, BLOCK_SIZE=case.BLOCK_SIZE)
    keep = element_mask(case.mask_mod, case.B, case.H, (case.B or 1, case.H or 1, N_q, N_k))
    for i, rows in enumerate(bm.row_tiles()):
        for j, cols in enumerate(bm.col_tiles()):
            tile = keep[:, :, rows, cols]
            expected = np.where(tile.all(axis=(2, 3)), FULL, np.where(tile.any(axis=(2, 3)), PARTIAL, SKIPPED))
            np.testing.assert_array_equal(bm.classes[:, :, i, j], expected)
    counts = bm.counts()
    assert counts["skipped"] + counts["partial"] + counts["full"] == counts["total"] == bm.classes.size
    assert bm.sparsity() == pytest.approx(100 * counts["skipped"] / counts["total"])
    assert bm.density() == pytest.approx(1 - bm.sparsity() / 100)


@pytest.mark.parametrize("N_q, N_k, B_r, B_c", [(10, 10, 3, 3), (7, 12, 2, 5), (12, 7, 5, 2), (5, 2, 4, 1)])
def test_causal_classes_are_fa2_section_3_1s(N_q, N_k, B_r, B_c):
    """For the causal mod, the BlockMask's kinds are fa2edu.masks.classify_block's (SKIP / MASK / PLAIN)."""
    bm = create_block_mask(flex.causal, None, None, N_q, N_k, BLOCK_SIZE=(B_r, B_c))
    for i, rows in enumerate(bm.row_tiles()):
        for j, cols in enumerate(bm.col_tiles()):
            assert bm.kind(0, 0, i, j) is classify_block(N_q, N_k, rows, cols, causal=True)[0]


class RecordingHBM(HBM):
    """An HBM that logs every read: (tensor, first row, line, share)."""

    def __init__(self) -> None:
        super().__init__()
        self.log = []

    def read(self, name, rows, *, line, **options):
        self.log.append((name, rows.start, line, options.get("share", 1.0)))
        return super().read(name, rows, line=line, **options)


@settings(max_examples=15)
@given(case=flex_problems(scores=("none", "softcap")))
def test_skipped_blocks_are_never_read(case):
    """Every inner-loop load of block (i, j) happens only where some program visits it, with share = the fraction
    of programs that do; the blocks skipped for everyone never appear in the log, forward or backward."""
    N_q, N_k = case.q.shape[2], case.k.shape[2]
    bm = create_block_mask(case.mask_mod, case.B, case.H, N_q, N_k, BLOCK_SIZE=case.BLOCK_SIZE)
    B_r, B_c = bm.BLOCK_SIZE
    visits = np.broadcast_to(bm.classes != SKIPPED, case.q.shape[:2] + (bm.T_r, bm.T_c)).mean(axis=(0, 1))
    fwd, bwd = RecordingHBM(), RecordingHBM()
    common = dict(score_mod=case.score_mod, block_mask=bm, scale=case.scale, enable_gqa=case.enable_gqa)
    O, L = flex_attention(case.q, case.k, case.v, return_lse=True, hbm=fwd, **common)
    flex_attention_backward(case.q, case.k, case.v, O, L, case.dO, hbm=bwd, **common)
    loaded = {}
    i = j = None
    for name, start, line, share in fwd.log:                   # Q_i (line 4) opens row block i; K_j (line 7) loads
        if line == "Alg 1 line 4":
            i = start // B_r
        elif name == "K":
            loaded[(i, start // B_c)] = share
    assert loaded == {(i, j): float(visits[i, j]) for i, j in zip(*np.nonzero(visits))}
    loaded = {}
    for name, start, line, share in bwd.log:                   # K_j (line 6) opens column block j; Q_i (line 9) loads
        if line == "Alg 2 line 6" and name == "K":
            j = start // B_c
        elif name == "Q" and line == "Alg 2 line 9":
            loaded[(start // B_r, j)] = share
    assert loaded == {(i, j): float(visits[i, j]) for i, j in zip(*np.nonzero(visits))}


def test_full_blocks_never_evaluate_the_mask():
    """During flex_attention, mask_mod runs only on the scores of partial blocks (create_block_mask saw them all)."""
    seen = []

    def window(b, h, q_idx, kv_idx):
        seen.append((np.broadcast_to(q_idx, np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx))),
                     np.broadcast_to(kv_idx, np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx)))))
        return (kv_idx <= q_idx) & (kv_idx > q_idx - 9)
    bm = create_block_mask(window, None, None, 40, 40, BLOCK_SIZE=(4, 3))
    assert bm.counts()["full"] > 0 and bm.counts()["partial"] > 0
    seen.clear()
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 1, 40, 4)) for _ in range(3))
    flex_attention(q, k, v, block_mask=bm)
    assert seen
    for rows, cols in seen:
        for i, j in zip(np.ravel(rows) // 4, np.ravel(cols) // 3):
            assert bm.classes[0, 0, i, j] == PARTIAL


def test_vectorised_and_elementwise_evaluation_agree():
    """A mod that only scalars can run (it raises on arrays) gives the same classes and output as its twin."""
    twin = and_masks(flex.causal, flex.document([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3]))

    def scalars_only(b, h, q_idx, kv_idx):
        if not isinstance(q_idx, int):
            raise TypeError("this mod runs on Python ints only")
        return bool(twin(b, h, q_idx, kv_idx))
    a = create_block_mask(twin, None, None, 11, 11, BLOCK_SIZE=3)
    b = create_block_mask(scalars_only, None, None, 11, 11, BLOCK_SIZE=3)
    np.testing.assert_array_equal(a.classes, b.classes)
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 11, 3)) for _ in range(3))
    np.testing.assert_array_equal(flex_attention(q, k, v, block_mask=a), flex_attention(q, k, v, block_mask=b))


def test_a_mod_whose_array_answer_differs_from_its_scalar_answer_is_evaluated_per_element():
    """np.all on a tile is not elementwise: the sampled scalar calls disagree and the scalar meaning wins."""
    def not_elementwise(b, h, q_idx, kv_idx):
        return bool(np.all(kv_idx <= q_idx))
    a = create_block_mask(not_elementwise, None, None, 8, 8, BLOCK_SIZE=4)
    b = create_block_mask(flex.causal, None, None, 8, 8, BLOCK_SIZE=4)
    np.testing.assert_array_equal(a.classes, b.classes)


def test_block_mask_describes_itself():
    bm = create_block_mask(flex.sliding_window(9), 2, None, 20, 24, BLOCK_SIZE=(4, 3))
    text = repr(bm)
    assert "sliding_window(9)" in text and "BLOCK_SIZE=(4, 3)" in text and "(2, 1, 20, 24)" in text
    assert text.splitlines()[-bm.T_r:] == bm.grid().splitlines() and len(bm.grid().splitlines()[0]) == bm.T_c
    assert bm.shape == (2, 1, 20, 24) and (bm.T_r, bm.T_c) == (5, 8)
    as_kind = {SKIPPED: BlockKind.SKIP, PARTIAL: BlockKind.MASK, FULL: BlockKind.PLAIN}
    for i in range(bm.T_r):
        for j in range(bm.T_c):                                               # head 7 broadcasts to head 0
            assert bm.kind(1, 7, i, j) is as_kind[int(bm.classes[1, 0, i, j])]
    assert {bm.kind(0, 0, i, j) for i in range(bm.T_r) for j in range(bm.T_c)} == set(BlockKind)
    assert (bm.skipped | bm.partial | bm.full).all() and not (bm.skipped & bm.full).any()
    dense = create_block_mask(None, None, None, 5, 5)
    assert dense.counts() == {"skipped": 0, "partial": 0, "full": 1, "total": 1} and dense.sparsity() == 0.0


# -- the ready mods --------------------------------------------------------------------------------------------------

def keys_seen(mask_mod, N_q, N_k) -> list[set[int]]:
    mod = at_lengths(mask_mod, N_q, N_k)
    return [{j for j in range(N_k) if mod(0, 0, i, j)} for i in range(N_q)]


@pytest.mark.parametrize("N_q, N_k", [(6, 6), (3, 8), (8, 3)])
def test_causal_is_aligned_bottom_right(N_q, N_k):
    mod = at_lengths(flex.causal, N_q, N_k)
    i, j = np.arange(N_q)[:, None], np.arange(N_k)[None, :]
    np.testing.assert_array_equal(mod(0, 0, i, j), causal_mask(N_q, N_k))
    assert flex.causal(0, 0, 3, 3) and not flex.causal(0, 0, 3, 4)          # called directly: square


@pytest.mark.parametrize("w", [1, 3, 20])
@pytest.mark.parametrize("N_q, N_k", [(7, 7), (3, 9), (9, 3)])
def test_sliding_window_keeps_the_w_most_recent_keys(w, N_q, N_k):
    for i, seen in enumerate(keys_seen(flex.sliding_window(w), N_q, N_k)):
        p = i + N_k - N_q
        assert seen == set(range(max(0, p - w + 1), min(p, N_k - 1) + 1))


def test_prefix_lm_document_and_combinations():
    for i, seen in enumerate(keys_seen(flex.prefix_lm(3), 6, 6)):
        assert seen == set(range(3)) | set(range(i + 1))
    ids = [0, 0, 1, 1, 1, 2]
    for i, seen in enumerate(keys_seen(flex.document(ids), 6, 6)):
        assert seen == {j for j in range(6) if ids[j] == ids[i]}
    for i, seen in enumerate(keys_seen(and_masks(flex.causal, flex.document(ids)), 6, 6)):
        assert seen == {j for j in range(i + 1) if ids[j] == ids[i]}
    both = or_masks(flex.sliding_window(2), lambda b, h, q_idx, kv_idx: kv_idx == 0)   # a window + a global key
    for i, seen in enumerate(keys_seen(both, 5, 7)):                          # offset 2 reaches or_masks' parts
        assert seen == {0, i + 1, i + 2}
    assert keys_seen(flex.document([5, 5, 6], kv_ids=[6, 5]), 3, 2) == [{1}, {1}, {0}]


@pytest.mark.parametrize("N_q, N_k", [(7, 7), (3, 9), (9, 3)])
@pytest.mark.parametrize("left, right", [(-1, -1), (-1, 0), (2, 0), (1, 2), (0, 0), (-1, 3), (4, -1)])
def test_local_window_keeps_flash_attns_band(left, right, N_q, N_k):
    """flash-attn's window_size: keys p − left … p + right (−1: unbounded), p = i + N_k − N_q."""
    for i, seen in enumerate(keys_seen(flex.local_window(left, right), N_q, N_k)):
        p = i + N_k - N_q
        low, high = (0 if left < 0 else p - left), (N_k - 1 if right < 0 else p + right)
        assert seen == set(range(max(low, 0), min(high, N_k - 1) + 1))
    if (left, right) == (-1, 0):
        assert keys_seen(flex.local_window(-1, 0), N_q, N_k) == keys_seen(flex.causal, N_q, N_k)
    if right == 0 and left >= 0:
        assert keys_seen(flex.local_window(left, 0), N_q, N_k) == keys_seen(flex.sliding_window(left + 1), N_q, N_k)


def test_symmetric_alibi_and_chained_score_mods():
    slopes, per_batch = np.array([0.25, 0.5]), np.array([[0.25, 0.5], [1.0, 2.0]])
    # −slope·|i + KV_LEN − Q_LEN − j|: symmetric, bottom-right aligned, per head or per (batch entry, head)
    mod = at_lengths(flex.symmetric_alibi(slopes), 3, 5)                       # offset 2
    assert [mod(1.0, 0, 1, 0, j) for j in (0, 2, 4)] == [1.0 - 0.5 * 2, 1.0, 1.0 - 0.5 * 2]
    assert at_lengths(flex.symmetric_alibi(per_batch), 3, 5)(0.0, 1, 1, 0, 0) == -2.0 * 2
    assert flex.symmetric_alibi(slopes).score_mod_grad(3.0, 0, 0, 0, 0) == 1.0
    # a causal mask: alibi and symmetric_alibi differ by a row constant, so O is the same (L is not)
    q, k, v = (np.random.default_rng(3).standard_normal((1, 2, 5, 4)) for _ in range(3))
    bm = create_block_mask(flex.causal, None, None, 5, 5, BLOCK_SIZE=2)
    np.testing.assert_allclose(flex_attention(q, k, v, score_mod=flex.alibi(slopes), block_mask=bm),
                               flex_attention(q, k, v, score_mod=flex.symmetric_alibi(slopes), block_mask=bm),
                               rtol=1e-12, atol=1e-12)
    # chain: applied first to last; its derivative is the chain rule, checked against finite differences
    chain = flex.chain_score_mods(flex.softcap(2.0), flex.symmetric_alibi(slopes))
    s = np.linspace(-6.0, 6.0, 13)
    np.testing.assert_allclose(chain(s, 0, 1, 3, 1), 2.0 * np.tanh(s / 2.0) - 0.5 * 2)
    h = 1e-6
    numeric = (chain(s + h, 0, 1, 3, 1) - chain(s - h, 0, 1, 3, 1)) / (2 * h)
    np.testing.assert_allclose(chain.score_mod_grad(s, 0, 1, 3, 1), numeric, rtol=1e-8, atol=1e-9)
    # the diagonal of its parts reaches the chain and its derivative (the backward specialises the derivative)
    shifted = at_lengths(chain, 3, 5)
    assert shifted(0.0, 0, 1, 0, 0) == -0.5 * 2 and at_lengths(chain.score_mod_grad, 3, 5)(0.0, 0, 1, 0, 0) == 1.0
    assert chain.mods[0].__name__ == "softcap(2)" and chain.combine is flex.chain_score_mods
    # a part without a derivative: the chain has none either (the backward then asks for score_mod_grad)
    assert not hasattr(flex.chain_score_mods(flex.softcap(1.0), lambda s, b, h, q_idx, kv_idx: s), "score_mod_grad")


def test_score_mods_and_their_derivatives():
    slopes = np.array([0.25, 0.5])
    alibi, cap, bias = flex.alibi(slopes), flex.softcap(3.0), flex.relative_bias([10.0, 20.0, 30.0, 40.0, 50.0])
    assert alibi(1.0, 0, 1, 4, 1) == 1.0 + 0.5 * (1 - 4)
    assert alibi.score_mod_grad(7.0, 0, 1, 4, 1) == 1.0
    s = np.linspace(-50, 50, 11)
    assert (np.abs(cap(s, 0, 0, 0, 0)) < 3.0).all()
    np.testing.assert_allclose(cap.score_mod_grad(s, 0, 0, 0, 0), 1 - np.tanh(s / 3.0) ** 2)
    # relative_bias: distance 0 is the middle entry; beyond the table the ends repeat (scalars and arrays alike)
    distances = [-9, -2, -1, 0, 1, 2, 9]
    expected = [10.0, 10.0, 20.0, 30.0, 40.0, 50.0, 50.0]
    assert [bias(0.0, 0, 0, 10, 10 + t) for t in distances] == expected
    np.testing.assert_array_equal(bias(0.0, 0, 0, 10, 10 + np.array(distances)), expected)
    assert flex.relative_bias([1.0, 2.0], offset=0)(0.0, 0, 0, 3, 4) == 2.0
    np.testing.assert_allclose(flex.alibi_slopes(8), 2.0 ** -np.arange(1, 9))


def test_bind_passes_arrays_and_binds_the_derivative():
    def shift(score, b, h, q_idx, kv_idx, table):
        return score + table[h]
    shift.score_mod_grad = lambda score, b, h, q_idx, kv_idx, table: 0 * score + table[h]
    bound = bind(shift, [1.0, 2.0])
    assert bound(0.5, 0, 1, 0, 0) == 2.5 and bound.score_mod_grad(0.5, 0, 1, 0, 0) == 2.0
    assert bound.mod is shift and isinstance(bound.arrays[0], np.ndarray)
    assert at_lengths(bound, 3, 5) is bound                                   # no diagonal: unchanged


# -- PyTorch's FlexAttention as a second reference --------------------------------------------------------------

def _torch_flex():
    torch = pytest.importorskip("torch")
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError as error:                                             # pragma: no cover (older torch)
        pytest.skip(f"this torch has no torch.nn.attention.flex_attention: {error}")
    return torch, module


def _torch_twin(mod, torch):
    """The same mod on torch tensors: bound arrays become tensors (the mods' operators work on both)."""
    if hasattr(mod, "mods"):                                                # or_masks / and_masks of parts
        return mod.combine(*(_torch_twin(part, torch) for part in mod.mods))
    if hasattr(mod, "arrays"):
        return bind(mod.mod, *(torch.as_tensor(a) for a in mod.arrays))
    return mod


def _block_table(b, h, q_idx, kv_idx, table):
    return table[b, h, q_idx // 4, kv_idx // 8]


TORCH_CASES = {
    "causal, N_q < N_k": dict(N_q=37, N_k=53, mask=flex.causal),
    "causal, N_q > N_k (empty rows)": dict(N_q=53, N_k=37, mask=flex.causal),
    "sliding window + ALiBi, GQA": dict(N_q=45, N_k=45, H_kv=2, mask=flex.sliding_window(10),
                                        score=flex.alibi(flex.alibi_slopes(4))),
    "causal documents + relative bias": dict(
        N_q=40, N_k=40, mask=and_masks(flex.causal, flex.document(np.repeat([0, 1, 2, 3], [9, 14, 3, 14]))),
        score=flex.relative_bias(np.linspace(-2, 2, 31))),
    "prefix LM + softcap": dict(N_q=30, N_k=50, mask=flex.prefix_lm(7), score="softcap"),
    "block table per (b, h)": dict(N_q=32, N_k=48, per_program=True),
}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_equals_pytorch_flex_attention(name):
    """O and the log-sum-exp of torch.nn.attention.flex_attention (eager on CPU, float64) for the same mods;
    PyTorch marks a fully masked row's LSE −inf where fa2edu writes +inf."""
    torch, tf = _torch_flex()
    spec = TORCH_CASES[name]
    B, H_q, H_kv, d, block = 2, 4, spec.get("H_kv", 4), 8, 16
    N_q, N_k = spec["N_q"], spec["N_k"]
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s) * 2 for s in ((B, H_q, N_q, d), (B, H_kv, N_k, d), (B, H_kv, N_k, d)))
    if spec.get("per_program"):
        table = rng.random((B, H_q, -(-N_q // 4), -(-N_k // 8))) < 0.5
        mask_mod, B_arg, H_arg = bind(_block_table, table), B, H_q
    else:
        mask_mod, B_arg, H_arg = spec["mask"], None, None
    score = spec.get("score")
    if score == "softcap":
        score_mod, torch_score = flex.softcap(2.0), (lambda s, b, h, q_idx, kv_idx: 2.0 * torch.tanh(s / 2.0))
    else:
        score_mod, torch_score = score, None if score is None else _torch_twin(score, torch)
    bm = create_block_mask(mask_mod, B_arg, H_arg, N_q, N_k, BLOCK_SIZE=block)
    O, L = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=H_q != H_kv, return_lse=True)
    torch_mask = _torch_twin(at_lengths(mask_mod, N_q, N_k), torch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tbm = tf.create_block_mask(torch_mask, B_arg, H_arg, N_q, N_k, device="cpu", BLOCK_SIZE=block)
            O_t, L_t = tf.flex_attention(*(torch.from_numpy(x) for x in (q, k, v)), score_mod=torch_score,
                                         block_mask=tbm, enable_gqa=H_q != H_kv, return_lse=True)
    except NotImplementedError as error:                                   # pragma: no cover (torch-dependent)
        pytest.skip(f"torch's flex_attention does not run eagerly on this CPU: {error}")
    L_t = L_t.numpy()
    assert_close_to_oracle(O, O_t.numpy(), "O")
    assert (np.isposinf(L) == np.isneginf(L_t)).all()
    finite = np.isfinite(L)
    np.testing.assert_allclose(L[finite], L_t[finite], rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("mask_mod", [flex.causal, flex.sliding_window(20), flex.prefix_lm(24)],
                         ids=["causal", "window", "prefix"])
def test_partial_and_full_blocks_equal_pytorchs(mask_mod):
    """torch's BlockMask counts, per query block, partial blocks (kv_num_blocks) and full ones
    (full_kv_num_blocks): the same as fa2edu's (sizes that divide BLOCK_SIZE, where torch pads nothing)."""
    torch, tf = _torch_flex()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbm = tf.create_block_mask(at_lengths(mask_mod, 64, 96), None, None, 64, 96, device="cpu", BLOCK_SIZE=16)
    bm = create_block_mask(mask_mod, None, None, 64, 96, BLOCK_SIZE=16)
    np.testing.assert_array_equal(bm.partial.sum(axis=-1), tbm.kv_num_blocks.numpy())
    np.testing.assert_array_equal(bm.full.sum(axis=-1), tbm.full_kv_num_blocks.numpy())


# -- bad input ---------------------------------------------------------------------------------------------------

def _inputs(B=1, H_q=2, H_kv=2, N_q=5, N_k=6, d=3):
    rng = np.random.default_rng(8)
    return rng.standard_normal((B, H_q, N_q, d)), rng.standard_normal((B, H_kv, N_k, d)), \
        rng.standard_normal((B, H_kv, N_k, d))


def _bad_calls():
    q, k, v = _inputs()
    bm = create_block_mask(flex.causal, None, None, 5, 6, BLOCK_SIZE=2)
    O, L = flex_attention(q, k, v, block_mask=bm, return_lse=True)

    def no_grad_mod(score, b, h, q_idx, kv_idx):
        return score * 2.0

    def non_bool(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def nan_mod(score, b, h, q_idx, kv_idx):
        return score * np.nan

    def shout(b, h, q_idx, kv_idx):
        raise KeyError("no such document")
    yield "q not an array", lambda: flex_attention(q.tolist(), k, v), TypeError, "q must be a numpy.ndarray"
    yield "q 3-D", lambda: flex_attention(q[0], k, v), ValueError, r"q must have 4 axes \(B, H, N_q, d\)"
    yield "k int", lambda: flex_attention(q, k.astype(int), v), TypeError, "k must have a floating dtype"
    yield "v NaN", lambda: flex_attention(q, k, v * np.nan), ValueError, "v contains NaN"
    yield "batch", lambda: flex_attention(q, np.concatenate([k, k]), np.concatenate([v, v])), ValueError, \
        "same batch size"
    yield "d", lambda: flex_attention(q, k[..., :2], v), ValueError, "k's head dimension must equal q's"
    yield "v keys", lambda: flex_attention(q, k, v[:, :, :4]), ValueError, "k and v must have the same heads"
    q4 = np.concatenate([q, q], axis=1)
    yield "GQA off", lambda: flex_attention(q4, k, v), ValueError, "enable_gqa=True"
    yield "GQA ratio", lambda: flex_attention(q4[:, :3], k, v, enable_gqa=True), ValueError, "multiple of k's"
    yield "enable_gqa", lambda: flex_attention(q, k, v, enable_gqa=1), TypeError, "enable_gqa must be a bool"
    yield "return_lse", lambda: flex_attention(q, k, v, return_lse="yes"), TypeError, "return_lse must be a bool"
    yield "score_mod", lambda: flex_attention(q, k, v, score_mod=3.0), TypeError, "score_mod must be a callable"
    yield "block_mask type", lambda: flex_attention(q, k, v, block_mask=np.ones((3, 3), bool)), TypeError, \
        "block_mask must be a fa2edu.flex.BlockMask"
    yield "block_mask lengths", lambda: flex_attention(q, k[:, :, :5], v[:, :, :5], block_mask=bm), ValueError, \
        "block_mask was made for Q_LEN = 5, KV_LEN = 6"
    bm3 = create_block_mask(flex.causal, 3, None, 5, 6)
    yield "block_mask batch", lambda: flex_attention(q, k, v, block_mask=bm3), ValueError, "block_mask covers"
    yield "scale", lambda: flex_attention(q, k, v, scale="big"), TypeError, "scale must be a real number"
    yield "hbm", lambda: flex_attention(q, k, v, hbm={}), TypeError, "hbm must be a fa2edu.memory.HBM"
    yield "NaN score", lambda: flex_attention(q, k, v, score_mod=nan_mod), ValueError, "returned NaN or \\+inf"
    yield "no derivative", lambda: flex_attention_backward(q, k, v, O, L, O, score_mod=no_grad_mod), ValueError, \
        "pass score_mod_grad="
    yield "derivative type", lambda: flex_attention_backward(q, k, v, O, L, O, score_mod=no_grad_mod,
                                                             score_mod_grad=2.0), TypeError, \
        "score_mod_grad must be a callable"
    yield "grad without mod", lambda: flex_attention_backward(q, k, v, O, L, O, score_mod_grad=lambda *a: 1.0), \
        ValueError, "score_mod_grad was given without a score_mod"
    yield "L shape", lambda: flex_attention_backward(q, k, v, O, L[..., :3], O), ValueError, "L must have shape"
    yield "dO dtype", lambda: flex_attention_backward(q, k, v, O, L, O.astype(np.float32)), TypeError, \
        "dO must have Q's dtype"
    yield "mask_mod", lambda: create_block_mask("causal", None, None, 5, 6), TypeError, "mask_mod must be a callable"
    yield "mask_mod result", lambda: create_block_mask(non_bool, None, None, 5, 6), TypeError, \
        "mask_mod non_bool must return a bool"
    yield "mask_mod raises", lambda: create_block_mask(shout, None, None, 5, 6), KeyError, \
        r"mask_mod shout raised KeyError at \(0, 0, 0, 0\)"
    yield "bind arity", lambda: bind(lambda b, h: b, [1], [2], [3]), TypeError, "fewer than the 3 arrays"
    yield "BLOCK_SIZE 0", lambda: create_block_mask(None, None, None, 5, 6, BLOCK_SIZE=0), ValueError, \
        "BLOCK_SIZE must be at least 1"
    yield "BLOCK_SIZE float", lambda: create_block_mask(None, None, None, 5, 6, BLOCK_SIZE=2.5), TypeError, \
        "BLOCK_SIZE must be an int"
    yield "BLOCK_SIZE triple", lambda: create_block_mask(None, None, None, 5, 6, BLOCK_SIZE=(2, 2, 2)), TypeError, \
        r"BLOCK_SIZE must be an int or a pair"
    yield "Q_LEN", lambda: create_block_mask(None, None, None, 0, 6), ValueError, "Q_LEN must be at least 1"
    yield "B", lambda: create_block_mask(None, 1.5, None, 5, 6), TypeError, "B must be an int"
    yield "classes", lambda: BlockMask(None, 1, 1, 5, 6, 2, np.zeros((1, 1, 2, 2))), ValueError, \
        r"classes must be an array of shape \(B, H, T_r, T_c\) = \(1, 1, 3, 3\)"
    yield "bind", lambda: bind(None, [1]), TypeError, "mod must be a callable"
    yield "or_masks empty", lambda: or_masks(), ValueError, "or_masks needs at least one mask_mod"
    yield "and_masks item", lambda: and_masks(flex.causal, 4), TypeError, "and_masks argument 1 must be a callable"
    yield "window", lambda: flex.sliding_window(0), ValueError, "w must be at least 1"
    yield "prefix", lambda: flex.prefix_lm(-1), ValueError, "n must be at least 0"
    yield "ids", lambda: flex.document([0.5, 1.0]), TypeError, "ids must be a non-empty 1-D integer array"
    yield "slopes", lambda: flex.alibi([[1.0]]), TypeError, "slopes must be a non-empty 1-D array"
    yield "softcap", lambda: flex.softcap(-1.0), ValueError, "c must be positive"
    yield "table", lambda: flex.relative_bias([np.inf]), ValueError, "table must be finite"
    yield "offset", lambda: flex.relative_bias([1.0, 2.0], offset=2), ValueError, "offset must index table"
    yield "local_window side", lambda: flex.local_window(-2, 0), ValueError, "left must be -1 \\(no bound\\)"
    yield "local_window type", lambda: flex.local_window(1, 1.5), TypeError, "right must be an int"
    yield "symmetric slopes", lambda: flex.symmetric_alibi(np.ones((1, 1, 2))), TypeError, \
        r"slopes must be a non-empty array of real numbers of shape \(H,\) or \(B, H\)"
    yield "chain empty", lambda: flex.chain_score_mods(), ValueError, "chain_score_mods needs at least one"
    yield "chain item", lambda: flex.chain_score_mods(flex.softcap(1.0), 2), TypeError, \
        "chain_score_mods argument 1 must be a callable"


BAD = {name: (call, error, match) for name, call, error, match in _bad_calls()}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gets_a_clear_error(name):
    call, error, match = BAD[name]
    with pytest.raises(error, match=match):
        call()


def test_exports():
    assert {"flex_attention", "flex_attention_backward", "create_block_mask", "BlockMask"} <= set(fa2edu.__all__)
    assert fa2edu.flex_attention is flex.flex_attention and fa2edu.BlockMask is flex.BlockMask
