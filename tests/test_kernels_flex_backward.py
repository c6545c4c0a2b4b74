"""kernels_gpu.flex.flex_backward in numba's CUDA simulator: the FlexAttention backward with the mods compiled in.

The oracle is :func:`fa2edu.flex.flex_attention_backward` on float64 inputs (the same O and L the kernel gets).
The kernel must be within flash-attn's rule of it, as tests/test_tensorcore_backward.py applies it: each of dQ,
dK, dV within 2× the error of the same computation in float16 (NumPy's flex_attention_backward on the float16
inputs) plus a floor (tests/tolerances.py). O and L come from NumPy's forward (float64, O rounded to float16), so
that only the backward runs in the simulator. Tiles are (16, 16), one warp: the simulator runs each CUDA thread
as a Python thread.
"""

from __future__ import annotations

import numpy as np
import pytest

import kernels_gpu.flex as kflex
from fa2edu import flex as F
from tests.tolerances import assert_close_to_oracle, baseline_error


def _problem(B, H_q, H_kv, N_q, N_k, d, seed, score_mod, block_mask, enable_gqa):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H_q, N_q, d)).astype(np.float16)
    k = rng.standard_normal((B, H_kv, N_k, d)).astype(np.float16)
    v = rng.standard_normal((B, H_kv, N_k, d)).astype(np.float16)
    dO = rng.standard_normal((B, H_q, N_q, d)).astype(np.float16)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    O64, L64 = F.flex_attention(q64, k64, v64, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                                return_lse=True)
    return q, k, v, O64.astype(np.float16), L64.astype(np.float32), dO


def check_backward(q, k, v, O, L, dO, score_mod, block_mask, enable_gqa=False):
    grads = kflex.flex_backward(q, k, v, O, L, dO, score_mod=score_mod, block_mask=block_mask,
                                enable_gqa=enable_gqa)
    f64 = [x.astype(np.float64) for x in (q, k, v, O, L, dO)]
    exact = F.flex_attention_backward(*f64, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
    half = F.flex_attention_backward(q, k, v, O, L.astype(np.float16), dO, score_mod=score_mod,
                                     block_mask=block_mask, enable_gqa=enable_gqa)
    for name, ours, ref, low, x in zip(("dQ", "dK", "dV"), grads, exact, half, (q, k, v)):
        assert ours.dtype == np.float16 and ours.shape == x.shape, name
        assert np.isfinite(ours).all(), name
        assert_close_to_oracle(ours, ref, name, dtype=np.float16, baseline=baseline_error(low, ref))
    return grads


DOC_IDS = np.array([0] * 7 + [1] * 13 + [2] * 12)

CASES = {  # (B, H_q, H_kv, N_q, N_k, d), mask_mod, score_mod, GQA
    # N_q < N_k, bottom-right causal: partial diagonal blocks, skipped blocks above them, ragged edges
    "causal": ((1, 1, 1, 20, 30, 16), F.causal, None, False),
    "sliding_window": ((1, 1, 1, 30, 30, 16), F.sliding_window(6), None, False),
    # a bound mask (two id arrays): partial blocks on document boundaries, skipped blocks between documents
    "document": ((1, 1, 1, 32, 32, 16), F.document(DOC_IDS), None, False),
    # softcap's derivative 1 − tanh²(τs / c) multiplies dS; no mask (every block full)
    "softcap": ((1, 1, 1, 16, 16, 16), None, F.softcap(2.0), False),
    # ALiBi (bound slopes, bound again for its derivative) under causal, two query heads on one K/V head: dK, dV
    # summed over the group
    "alibi-gqa": ((1, 2, 1, 20, 20, 16), F.causal, F.alibi(F.alibi_slopes(2)), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ready_mods_match_the_numpy_backward(case):
    shape, mask_mod, score_mod, gqa = CASES[case]
    B, H_q, H_kv, N_q, N_k, d = shape
    bm = None if mask_mod is None else F.create_block_mask(mask_mod, None, None, N_q, N_k, BLOCK_SIZE=16)
    check_backward(*_problem(B, H_q, H_kv, N_q, N_k, d, 3, score_mod, bm, gqa), score_mod, bm, enable_gqa=gqa)


def test_fully_masked_rows_get_zero_dq():
    """N_q > N_k causal: the first 14 queries see no key (L = +inf), a whole row block among them: dQ = 0 there."""
    bm = F.create_block_mask(F.causal, None, None, 26, 12, BLOCK_SIZE=16)
    problem = _problem(1, 1, 1, 26, 12, 16, 5, None, bm, False)
    assert np.isposinf(problem[4][0, 0, :14]).all()
    dQ, _, _ = check_backward(*problem, None, bm)
    assert (dQ[0, 0, :14] == 0).all()


def test_a_score_mod_without_a_derivative_is_refused():
    def shifted(score, b, h, q_idx, kv_idx):
        return score + 0.5
    q, k, v, O, L, dO = _problem(1, 1, 1, 16, 16, 16, 7, shifted, None, False)
    with pytest.raises(ValueError, match="carries no score_mod_grad"):
        kflex.flex_backward(q, k, v, O, L, dO, score_mod=shifted)
    with pytest.raises(ValueError, match="score_mod_grad was given without a score_mod"):
        kflex.flex_backward(q, k, v, O, L, dO, score_mod_grad=shifted)


def test_block_size_the_backward_cannot_run():
    with pytest.raises(ValueError, match="the flex backward runs tiles"):
        kflex.backward_config_for(16, "float16", (24, 16), True)
