"""TF32 on tensor cores in numba's CUDA simulator: the m16n8k8 tf32 fragment tables, ``cvt.rna.tf32.f32`` and the
tf32 ``mma`` twins against their NumPy specification, and the TF32 forward against the float64 oracle — within the
error bound that tf32's unit roundoff u = 2⁻¹¹ gives (:func:`~kernels_gpu.tensorcore.flash2_forward_tf32.
tf32_error_bound`), and measurably worse than float32, as TF32 must be."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import fa2edu
import kernels_gpu.runtime as rt
from kernels_gpu import fragments, ptx
from kernels_gpu.tensorcore import TF32, selftest
from kernels_gpu.tensorcore.flash2_forward_tf32 import (
    UNIT_ROUNDOFF_TF32,
    Flash2ForwardTF32,
    error_against_fp32,
    tf32_error_bound,
)

forward_tf32 = TF32["tf32"]
u = UNIT_ROUNDOFF_TF32


# -- fragments and rounding -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, shape", [(fragments.a_layout_tf32, (16, 8)), (fragments.b_layout_tf32, (8, 8))])
def test_tf32_tables_hold_each_element_once(layout, shape):
    lay = layout().reshape(-1, 2)
    assert len({tuple(x) for x in lay}) == shape[0] * shape[1]
    assert lay[:, 0].max() == shape[0] - 1 and lay[:, 1].max() == shape[1] - 1


def test_tf32_fragments_round_trip_and_reference():
    rng = np.random.default_rng(0)
    A, B, C = rng.standard_normal((16, 8)), rng.standard_normal((8, 8)), rng.standard_normal((16, 8))
    assert np.array_equal(fragments.from_a_fragments_tf32(fragments.a_fragments_tf32(A)), A)
    assert np.array_equal(fragments.from_b_fragments_tf32(fragments.b_fragments_tf32(B)), B)
    At, Bt = (ptx.tf32_round(x) for x in (A, B))
    C32 = C.astype(np.float32)
    D = fragments.from_c_fragments(fragments.mma_tf32_reference(fragments.a_fragments_tf32(At),
                                                                 fragments.b_fragments_tf32(Bt),
                                                                 fragments.c_fragments(C32)))
    exact = At.astype(np.float64) @ Bt.astype(np.float64) + C32
    assert np.array_equal(D, exact.astype(np.float32))          # one rounding of the exact sum


def test_accumulators_are_a_with_the_key_order():
    """S's C fragments, lane by lane, are P's tf32 A fragments once the k-step's keys are taken as 0, 2, 4, 6, 1, 3,
    5, 7; and the B fragments that load V's rows in that order make P·V right."""
    rng = np.random.default_rng(1)
    S, V = rng.standard_normal((16, 8)), rng.standard_normal((8, 8))
    a = fragments.c_to_a_tf32(fragments.c_fragments(S))
    assert np.array_equal(fragments.from_a_fragments_tf32(a), S[:, fragments.KEY_ORDER_TF32])
    b = fragments.b_fragments_tf32(V[fragments.KEY_ORDER_TF32])
    np.testing.assert_allclose(fragments.from_a_fragments_tf32(a) @ fragments.from_b_fragments_tf32(b), S @ V,
                               rtol=1e-12, atol=1e-12)
    # the kernel's V loads: b0 = V[2t][g], b1 = V[2t + 1][g]
    g, t = fragments.lane_coords(np.arange(32))
    assert np.array_equal(b, np.stack([V[2 * t, g], V[2 * t + 1, g]], axis=1))


def test_tf32_round():
    one = np.float32(1.0)
    ulp = 2.0 ** -10
    x = np.array([1 + ulp / 2, -(1 + ulp / 2), 1 + 3 * ulp / 2, 1 + ulp / 2 - 2.0 ** -23, 1 + ulp, np.inf, -np.inf,
                  3.0e38, 1e-40], dtype=np.float32)
    got = ptx.tf32_round(x)
    # ties go away from zero (RNA, unlike float16's ties-to-even: 1 + 3·ulp/2 → 1 + 2·ulp either way)
    assert got[0] == one + ulp and got[1] == -(one + ulp) and got[2] == one + 2 * ulp and got[3] == one
    assert got[4] == one + ulp and np.isinf(got[5]) and got[5] > 0 and got[6] < 0
    assert (got.view(np.uint32) & 0x1FFF == 0).all() and np.isnan(ptx.tf32_round(np.float32(np.nan)))
    r = np.random.default_rng(2).standard_normal(10_000).astype(np.float32) * 1e3
    rr = ptx.tf32_round(r)
    assert (np.abs(rr.astype(np.float64) - r) <= u * np.abs(r)).all()      # u = 2⁻¹¹ relative
    assert np.array_equal(ptx.tf32_round(rr), rr)                         # tf32 values are fixed points
    assert (np.diff(ptx.tf32_round(np.sort(r))) >= 0).all()              # monotone


def test_cvt_tf32_twin():
    got, expected = selftest.check_cvt_tf32()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 1e3)])
def test_mma_tf32_twin(seed, scale):
    got, expected, magnitude = selftest.check_mma_tf32(seed=seed, scale=scale)
    np.testing.assert_array_equal(got, expected)
    assert magnitude.shape == (32, 4) and (magnitude > 0).all()


@cuda.jit
def _mma_of_a_raw_float(d):
    lane = cuda.threadIdx.x
    r = ptx.mma_tf32(np.uint32(0x3F800001), 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)    # 1 + 2⁻²³: not a tf32 value
    d[lane] = r[0]


def test_mma_tf32_twin_refuses_values_that_are_not_tf32():
    # the lane that sees the bad register raises; the simulator may report a lane left waiting for it first
    with pytest.raises(RuntimeError, match="not a tf32 value|all 32 lanes"):
        _mma_of_a_raw_float[1, 32](np.zeros(32, dtype=np.float32))


# -- the TF32 forward against the float64 oracle ----------------------------------------------------------------

CASES = [  # (Q shape, K/V shape, causal)
    ((1, 2, 37, 24), (1, 1, 50, 24), True),       # GQA, bottom-right causal with N_q < N_k, d % 16 = 8
    ((1, 1, 20, 40), (1, 1, 45, 40), False),      # ragged: a partial row block, two K/V tiles (one partial), d = 40
    ((2, 1, 64, 16), (2, 1, 4, 16), True),        # N_q > N_k causal: 60 rows see no key (O = 0, L = +inf), batch 2
]
IDS = ["gqa-causal", "ragged-d40", "masked-rows"]


def _inputs(shape_q, shape_kv, seed, scale=1.0, tf32_exact=False):
    rng = np.random.default_rng(seed)
    Q = (rng.standard_normal(shape_q) * scale).astype(np.float32)
    K = (rng.standard_normal(shape_kv) * scale).astype(np.float32)
    V = rng.standard_normal(shape_kv).astype(np.float32)
    if tf32_exact:
        Q, K, V = (ptx.tf32_round(x) for x in (Q, K, V))
    return Q, K, V


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


def check_against_oracle(res, Q, K, V, causal, bound=tf32_error_bound, kind=Flash2ForwardTF32, precision="tf32"):
    """O and L within ``bound``'s worst case (:func:`tf32_error_bound` here; the 3xTF32 tests pass theirs) of the
    float64 oracle; rows that see no key O = 0, L = +inf; ``res`` a ``kind`` labelled ``precision``."""
    assert isinstance(res, kind) and res.precision == precision
    O, L = res
    assert O.dtype == np.float32 and L.dtype == np.float32 and O.shape == Q.shape and L.shape == Q.shape[:-1]
    O_ref, L_ref = fa2edu.attention_reference(*(x.astype(np.float64) for x in (Q, K, V)), causal=causal)
    seen = np.isfinite(L_ref)
    assert not np.isnan(O).any() and not np.isnan(L).any()
    assert np.array_equal(np.isinf(L), ~seen) and (O[~seen] == 0).all()
    bound_O, bound_L = bound(Q, K, V)
    err = np.abs(O - np.where(seen[..., None], O_ref, 0.0))
    assert (err <= bound_O).all(), (err.max(), bound_O.min())
    assert (np.abs(L[seen] - L_ref[seen]) <= bound_L[seen] + 2.0 ** -20 * (1 + np.abs(L_ref[seen]))).all()
    return float(err.max())


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_tf32_forward_within_bound(case, poisoned):
    shape_q, shape_kv, causal = CASES[case]
    Q, K, V = _inputs(shape_q, shape_kv, seed=case)
    err = check_against_oracle(forward_tf32(Q, K, V, causal=causal), Q, K, V, causal)
    # tf32, not float32: the inputs' rounding shows (float32 kernels stay near 1e-6 on these inputs)
    assert err > 20 * 2.0 ** -24 * np.abs(V).max()


def test_tf32_inputs_lose_only_the_rounding_of_p(poisoned):
    """Q, K, V already tf32: the bound tightens to about u·max|v| (P̃'s rounding for the product with V, plus
    float32 accumulation of scores in the hundreds: extreme logits), 20× tighter than for float32 inputs, and the
    kernel meets it."""
    Q, K, V = _inputs((1, 1, 40, 16), (1, 1, 75, 16), seed=7, scale=6.0, tf32_exact=True)
    bound_O, _ = tf32_error_bound(Q, K, V)
    assert bound_O.max() < 2 * u * np.abs(V).max()
    assert 20 * bound_O.max() < tf32_error_bound(Q + np.float32(1e-4), K, V)[0].max()
    check_against_oracle(forward_tf32(Q, K, V, causal=False), Q, K, V, False)


def test_error_beside_float32():
    """The honest comparison: on the same inputs TF32's error is ~1000× float32's (kernels_gpu.fast)."""
    Q, K, V = _inputs((1, 1, 30, 32), (1, 1, 45, 32), seed=11)
    report = error_against_fp32(Q, K, V, causal=True)
    print(report)
    assert report["fp32"] < 1e-5 < 1e-4 < report["tf32"] <= report["tf32_bound"]
    assert report["tf32"] > 100 * report["fp32"]


@pytest.mark.parametrize("bad, match", [
    (dict(Q=np.zeros((4, 12), np.float32), K=np.zeros((4, 12), np.float32), V=np.zeros((4, 12), np.float32)),
     "multiples of 8"),
    (dict(V=np.zeros((4, 24), np.float32)), "V's head dimension"),
    (dict(K=np.zeros((5, 8), np.float32)), "head dimension"),
    (dict(Q=np.full((4, 16), np.nan, np.float32)), "finite"),
])
def test_bad_input(bad, match):
    args = dict(Q=np.zeros((4, 16), np.float32), K=np.zeros((4, 16), np.float32), V=np.zeros((4, 16), np.float32))
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        forward_tf32(args["Q"], args["K"], args["V"])


def test_device_arrays_must_be_contiguous():
    x = cuda.to_device(np.zeros((1, 1, 8, 32), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        forward_tf32(x[..., ::2], x[..., ::2], x[..., ::2])
