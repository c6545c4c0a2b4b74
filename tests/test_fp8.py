"""FP8 attention in NumPy (fa2edu.fp8): what each claim of its docstrings rests on.

* the float8 rounding is exact: all 256 codes decode, and millions of float32 inputs (random bit patterns, ties,
  subnormals, overflow, inf, NaN) round, bit for bit as PyTorch's ``float8_e4m3fn`` / ``float8_e5m2`` casts do;
  the two overflow behaviours (saturating, and NaN / inf) are what the docstring says;
* rounding is monotone, idempotent, nearest, and breaks ties to the even code;
* the Hadamard rotation is orthogonal, the fast transform equals the matrix, and QKᵀ is unchanged;
* quantisation errs by at most 2⁻⁴ relative in e4m3's normal range (2⁻¹⁰·δ below it), per head or per block;
* FA2 Alg. 1 on FP8 inputs equals exact attention on the dequantised inputs up to P̃'s rounding, equals the oracle
  within fp8_error_bound, and its ledger counts the 1-byte tiles exactly as flash2_forward's;
* incoherent processing at least halves the error on inputs with outlier channels (fp8_error_study);
* bad input is refused with the argument's name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import attention_problems

from fa2edu import attention_reference, flash2_forward
from fa2edu.fp8 import (
    FORMATS,
    P_OFFSET,
    Fp8Tensor,
    flash2_forward_fp8,
    fp8_attention,
    fp8_error_bound,
    fp8_error_study,
    fp8_values,
    from_bits,
    fwht,
    hadamard_matrix,
    quantize_fp8,
    random_signs,
    rotate,
    rotation_matrix,
    round_to_fp8,
    to_bits,
    unrotate,
)
from fa2edu.memory import HBM

ALL_CODES = np.arange(256, dtype=np.uint8)


def torch_dtype(fmt: str):
    torch = pytest.importorskip("torch")
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]


def torch_bits(x: np.ndarray, fmt: str) -> np.ndarray:
    """PyTorch's float32 → float8 cast, as uint8 codes."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch_dtype(fmt)).view(torch.uint8).numpy()


#: PyTorch 2.13's CPU casts: float8_e4m3fn saturates (±inf too), float8_e5m2 overflows to ±inf (IEEE).
TORCH_SATURATES = {"e4m3": True, "e5m2": False}


def hard_float32_inputs(fmt: str, rng) -> np.ndarray:
    """Float32 values where a rounding goes wrong if it is going to: every tie between neighbouring float8 values
    and the float32 numbers either side of it, both signs, subnormals, the overflow thresholds, inf, NaN, random
    bit patterns and log-uniform magnitudes."""
    values = fp8_values(fmt)
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)        # exact in float32
    mid_up, mid_down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))
    top = FORMATS[fmt].max
    edge = np.array([top, top * 1.0625, top * 1.0625 * (1 + 2**-20), top * 1.07, top * 1.125, top * 1.2, 1e30,
                     np.inf, np.nan, 0.0, 2**-10, 2**-17, 1e-30, 1e-45], dtype=np.float32)
    bits = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    spread = (rng.standard_normal(400_000) * np.exp(rng.uniform(-25, 15, 400_000))).astype(np.float32)
    one_sign = np.concatenate([values.astype(np.float32), mids, mid_up, mid_down, edge])
    return np.concatenate([one_sign, -one_sign, bits, spread])


# -- the formats against PyTorch, bit for bit -----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_code_decodes_like_torch(fmt):
    import torch
    theirs = torch.from_numpy(ALL_CODES.copy()).view(torch_dtype(fmt)).float().numpy()
    ours = from_bits(ALL_CODES, fmt)
    nan = np.isnan(theirs)
    assert (np.isnan(ours) == nan).all()
    assert (ours[~nan].view(np.uint32) == theirs[~nan].view(np.uint32)).all()       # -0.0 included
    assert (np.signbit(ours[nan]) == (ALL_CODES[nan] >= 128)).all()                 # NaN keeps its sign bit


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_codes_round_trip(fmt):
    values = from_bits(ALL_CODES, fmt)
    back = to_bits(values, fmt, saturate=False)
    nan = np.isnan(values)
    assert (back[~nan] == ALL_CODES[~nan]).all()
    assert set(back[nan]) == {0x7F, 0xFF}                     # every NaN becomes S.1111…1, keeping the sign
    assert len(fp8_values(fmt)) == {"e4m3": 127, "e5m2": 124}[fmt]
    assert fp8_values(fmt)[-1] == FORMATS[fmt].max and fp8_values(fmt)[1] == FORMATS[fmt].min_subnormal


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_float32_rounding_matches_torch_bit_for_bit(fmt):
    x = hard_float32_inputs(fmt, np.random.default_rng(7))
    ours = to_bits(x, fmt, saturate=TORCH_SATURATES[fmt])
    theirs = torch_bits(x, fmt)
    wrong = np.flatnonzero(ours != theirs)
    assert wrong.size == 0, f"{wrong.size} differ, e.g. x = {x[wrong[:5]]}: ours {ours[wrong[:5]]}, torch " \
                            f"{theirs[wrong[:5]]}"
    # and round_to_fp8 gives the values of those codes
    r = round_to_fp8(x, fmt, saturate=TORCH_SATURATES[fmt])
    assert r.dtype == np.float32
    decoded = from_bits(theirs, fmt)
    assert ((r.view(np.uint32) == decoded.view(np.uint32)) | (np.isnan(r) & np.isnan(decoded))).all()


def test_float16_and_integer_inputs_round_like_their_float32_values():
    x16 = np.random.default_rng(3).standard_normal(5000).astype(np.float16) * np.float16(300)
    assert round_to_fp8(x16).dtype == np.float16
    assert (to_bits(x16) == torch_bits(x16.astype(np.float32), "e4m3")).all()
    ints = np.arange(-600, 601)
    assert round_to_fp8(ints).dtype == np.float64
    assert (to_bits(ints) == torch_bits(ints.astype(np.float32), "e4m3")).all()


def test_float64_is_rounded_once_where_torch_rounds_twice():
    # 1 + 2⁻⁴ is the tie between e4m3's 1 and 1.125; a hair above it, the correct rounding is 1.125. PyTorch
    # rounds float64 to float32 first (1 + 2⁻⁴ exactly, a tie, to even: 1.0). The docstring says so.
    x = np.array([1 + 2**-4 + 2**-40])
    assert round_to_fp8(x)[0] == 1.125
    torch = pytest.importorskip("torch")
    assert torch.from_numpy(x).to(torch.float8_e4m3fn).float().item() == 1.0


def test_the_two_overflow_behaviours():
    big = np.array([448.0, 463.9, 464.0, 464.1, 479.0, 480.0, 1e9, np.inf, np.nan])
    sat = round_to_fp8(big, "e4m3")
    assert sat[:-1].tolist() == [448.0] * 8 and np.isnan(sat[-1])
    non = round_to_fp8(big, "e4m3", saturate=False)
    assert non[:3].tolist() == [448.0] * 3                    # 464 is the tie 448 | (480): to even, 448
    assert np.isnan(non[3:]).all()                            # e4m3 has no inf: overflow is NaN
    neg = round_to_fp8(-big, "e4m3")
    assert neg[:-1].tolist() == [-448.0] * 8 and np.isnan(neg[-1]) and np.signbit(neg[-1])
    e5 = np.array([57344.0, 61439.0, 61440.0, 1e9, np.inf, -np.inf, np.nan])
    assert round_to_fp8(e5, "e5m2", saturate=False)[:6].tolist() == [57344.0, 57344.0, np.inf, np.inf, np.inf,
                                                                      -np.inf]
    assert round_to_fp8(e5, "e5m2")[:6].tolist() == [57344.0] * 5 + [-57344.0]
    assert np.isnan(round_to_fp8(e5, "e5m2")[-1])
    assert to_bits(np.array([np.inf, -np.inf]), "e5m2", saturate=False).tolist() == [0x7C, 0xFC]


# -- rounding properties ----------------------------------------------------------------------------------------------

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(x=finite32, y=finite32, fmt=st.sampled_from(["e4m3", "e5m2"]), saturate=st.booleans())
def test_rounding_is_monotone_idempotent_and_nearest(x, y, fmt, saturate):
    lo, hi = sorted((x, y))
    r_lo, r_hi = round_to_fp8(np.array([lo, hi]), fmt)                       # saturating: always comparable
    assert r_lo <= r_hi
    r = round_to_fp8(np.float64(x), fmt, saturate=saturate)
    if np.isfinite(r):
        assert round_to_fp8(r, fmt, saturate=saturate) == r                  # idempotent
        values = np.concatenate([-fp8_values(fmt)[::-1], fp8_values(fmt)])
        assert r in values
        if abs(x) <= FORMATS[fmt].max:                                       # nearest: no value is closer
            assert abs(r - x) <= np.min(np.abs(values - x))


@given(index=st.integers(0, 122), fmt=st.sampled_from(["e4m3", "e5m2"]), negative=st.booleans())
def test_ties_go_to_the_even_code(index, fmt, negative):
    values = fp8_values(fmt)
    if index + 1 >= len(values):
        index = len(values) - 2
    tie = (values[index] + values[index + 1]) / 2
    tie = -tie if negative else tie
    code = int(to_bits(np.float64(tie), fmt)) & 0x7F
    assert code in (index, index + 1) and code % 2 == 0                      # the mantissa's last bit is 0


# -- the Hadamard rotation ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 64, 128])
def test_hadamard_is_orthogonal_and_the_fast_transform_equals_the_matrix(d):
    H = hadamard_matrix(d)
    assert np.array_equal(H, H.T) and np.array_equal(H @ H.T, d * np.eye(d))
    x = np.random.default_rng(d).standard_normal((3, 5, d))
    assert np.allclose(fwht(x), x @ H, rtol=0, atol=1e-12 * d)
    Mx = rotation_matrix(d, seed=5)
    assert np.allclose(Mx @ Mx.T, np.eye(d), atol=1e-14)
    assert np.allclose(rotate(x, random_signs(d, 5)), x @ Mx, atol=1e-12)
    assert np.allclose(unrotate(rotate(x, random_signs(d, 5)), random_signs(d, 5)), x, atol=1e-12)


@given(seed=st.integers(0, 2**31), log_d=st.integers(0, 7), n=st.integers(1, 9))
def test_rotation_preserves_QKt(seed, log_d, n):
    d = 1 << log_d
    rng = np.random.default_rng(seed)
    Q, K = rng.standard_normal((2, n, d)) * 10
    signs = random_signs(d, seed)
    np.testing.assert_allclose(rotate(Q, signs) @ rotate(K, signs).T, Q @ K.T, rtol=0, atol=1e-11 * d)


def test_rotation_spreads_an_outlier_channel_over_every_channel():
    x = np.zeros((1, 64))
    x[0, 10] = 100.0
    assert np.allclose(np.abs(rotate(x, random_signs(64, 0))), 100.0 / 8)       # |x·M| = 100/√64 everywhere


# -- quantisation -----------------------------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**31), shape=st.sampled_from([(7, 4), (2, 9, 8), (2, 3, 17, 16), (1, 1, 1, 1)]),
       block=st.sampled_from([None, 1, 3, 8]), incoherent=st.booleans(), spread=st.sampled_from([1e-6, 1.0, 1e4]),
       fmt=st.sampled_from(["e4m3", "e5m2"]))
def test_quantize_errs_by_at_most_the_unit_roundoff(seed, shape, block, incoherent, spread, fmt):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * spread * np.exp(rng.uniform(-4, 4, shape))
    t = quantize_fp8(x.astype(np.float32), incoherent=incoherent, block=block, seed=seed, fmt=fmt)
    spec = FORMATS[fmt]
    lead, N = shape[:-2], shape[-2]
    assert t.codes.dtype == np.uint8 and t.codes.shape == shape and t.descale.dtype == np.float32
    assert t.descale.shape == (lead if block is None else lead + (math.ceil(N / block),))
    assert t.nbytes == x.size + 4 * t.descale.size
    target = rotate(x.astype(np.float32), t.signs) if incoherent else x.astype(np.float32).astype(np.float64)
    x_hat = t.dequantize()
    delta = np.broadcast_to(t.row_descale()[..., None].astype(np.float64), shape)
    err = np.abs(x_hat - target)
    normal = np.abs(target) / delta >= spec.min_normal
    assert (err[normal] <= spec.unit_roundoff * np.abs(target[normal]) * (1 + 1e-6)).all()   # ≤ 2⁻⁴ (e4m3)
    assert (err[~normal] <= (spec.min_subnormal / 2 * delta)[~normal] * (1 + 1e-6)).all()  # ≤ 2⁻¹⁰·δ (e4m3)
    # each scale's largest entry lands on (or, by δ's float32 rounding, next to) the format's max
    top = np.abs(t.values).max(axis=-1)
    top = top.max(axis=-1) if block is None else np.maximum.reduceat(top, np.arange(0, N, block), axis=-1)
    assert np.all(np.abs(top - spec.max) <= spec.max * 2 * spec.unit_roundoff)
    # back through Mᵀ: an orthogonal map keeps each row's error norm
    if incoherent:
        back = t.dequantize(unrotate_back=True)
        row_err = np.linalg.norm(back - x.astype(np.float32), axis=-1)
        assert (row_err <= np.linalg.norm(err, axis=-1) * (1 + 1e-9) + 1e-12 * spread).all()


def test_e4m3_relative_error_is_at_most_one_sixteenth():
    x = np.random.default_rng(0).uniform(1, 2, size=(1, 4096)).astype(np.float32)   # all in the normal range
    t = quantize_fp8(x)
    rel = np.abs(t.dequantize() - x) / np.abs(x)
    assert rel.max() <= 2.0**-4 and rel.max() > 2.0**-5                              # the bound, nearly reached


def test_a_zero_head_or_block_gets_descale_one():
    x = np.zeros((2, 6, 4), np.float32)
    x[1, 3:] = 5.0
    t = quantize_fp8(x, block=3)
    assert t.descale.tolist() == [[1.0, 1.0], [1.0, np.float32(5.0 / 448)]]
    assert (t.codes[0] == 0).all() and (t.codes[1, 3:] == 0x7E).all()               # 0x7E = 448


# -- FA2 Algorithm 1 on FP8 inputs -------------------------------------------------------------------------------------

def _power_of_two(d: int) -> bool:
    return d & (d - 1) == 0


fp8_problems = attention_problems(max_n=20, max_d=8, dtypes=(np.float32,), masks=False)


@given(case=fp8_problems, block=st.sampled_from([None, 1, 4, 7]), incoherent=st.booleans(), seed=st.integers(0, 9))
def test_fp8_forward_is_exact_attention_of_the_dequantised_inputs(case, block, incoherent, seed):
    """Given its quantised inputs, the algorithm adds only P̃'s rounding: |ΔO| ≤ (u + ν·N_k/2⁸)·max|v̂| (plus
    float32's), and L, which P̃'s rounding does not touch, is exact to float32."""
    incoherent = incoherent and _power_of_two(case.Q.shape[-1])
    q8, k8, v8 = (quantize_fp8(x, incoherent=inc, block=block, seed=seed)
                  for x, inc in ((case.Q, incoherent), (case.K, incoherent), (case.V, False)))
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        O, L = flash2_forward_fp8(q8, k8, v8, causal=case.causal, scale=case.scale, block_sizes=case.block_sizes)
    q_hat, k_hat, v_hat = q8.dequantize(), k8.dequantize(), v8.dequantize()
    ref = attention_reference(q_hat, k_hat, v_hat, causal=case.causal,
                              scale=case.scale if case.scale is not None else 1 / math.sqrt(case.Q.shape[-1]))
    assert O.dtype == np.float32 and L.dtype == np.float32 and O.shape == ref.O.shape
    assert (np.isposinf(L) == np.isposinf(ref.L)).all() and not np.isnan(O).any()
    assert (O[np.isposinf(ref.L)] == 0).all()                                        # fully masked rows: O = 0
    N_k = case.K.shape[-2]
    spec = FORMATS["e4m3"]
    v_max = float(np.abs(v_hat).max())
    bound = (spec.unit_roundoff + spec.min_subnormal / 2 * N_k / 2.0**P_OFFSET + 1e-5) * v_max
    assert np.abs(O - ref.O).max() <= bound
    seen = np.isfinite(ref.L)
    assert np.allclose(L[seen], ref.L[seen], rtol=1e-5, atol=1e-4)


@given(case=attention_problems(max_n=16, max_d=8, dtypes=(np.float32,), masks=False, extreme=False),
       block=st.sampled_from([None, 3]), incoherent=st.booleans(), shrink=st.sampled_from([0.05, 0.3, 1.0]))
def test_fp8_attention_is_within_the_predicted_bound_of_the_oracle(case, block, incoherent, shrink):
    incoherent = incoherent and _power_of_two(case.Q.shape[-1])
    Q, K = case.Q * np.float32(shrink), case.K * np.float32(shrink)
    O, _ = fp8_attention(Q, K, case.V, causal=case.causal, scale=case.scale, incoherent=incoherent, block=block,
                         block_sizes=case.block_sizes)
    ref = attention_reference(Q, K, case.V, causal=case.causal, scale=case.scale)
    bound = fp8_error_bound(Q, K, case.V, causal=case.causal, scale=case.scale, incoherent=incoherent, block=block)
    err = float(np.abs(O - ref.O).max())
    assert err <= bound
    if shrink == 0.05:                   # small scores: the bound is near first order, u·max|v| plus a little
        assert bound <= 0.3 * float(np.abs(case.V).max())


def test_fp8_ledger_counts_the_same_elements_as_flash2_plus_the_descales():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 2, 2, 37, 16)).astype(np.float32)
    bs = (8, 5)
    T_r, T_c = math.ceil(37 / bs[0]), math.ceil(37 / bs[1])
    for block in (None, 4):
        mem, ref_mem = HBM(), HBM()
        fp8_attention(q, k, v, block=block, incoherent=True, hbm=mem, block_sizes=bs)
        flash2_forward(q, k, v, block_sizes=bs, hbm=ref_mem)
        ours, theirs = mem.by_tensor(), ref_mem.by_tensor()
        for name in ("Q", "K", "V", "O", "L"):
            assert ours[name] == theirs[name], name
        assert mem["Q"].dtype == mem["K"].dtype == mem["V"].dtype == np.uint8     # 1 byte per element
        if block is None:                 # one descale per tile, and δ_v once per row block (the epilogue)
            assert (ours["descale_Q"]["read"], ours["descale_K"]["read"], ours["descale_V"]["read"]) == (
                T_r, T_r * T_c, T_r)
        else:                             # the scale blocks each tile covers
            assert ours["descale_Q"]["read"] == sum(len(range(s // 4, (min(s + 8, 37) - 1) // 4 + 1))
                                                    for s in range(0, 37, 8))
        assert mem.total == ref_mem.total + sum(ours[n]["read"] for n in ("descale_Q", "descale_K", "descale_V"))


def test_fp8_forward_accepts_M_and_gqa_and_causal_with_more_queries_than_keys():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 9, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 2, 5, 8)).astype(np.float32)
    O, L = fp8_attention(q, k, v, causal=True, M=256)
    ref = attention_reference(q, k, v, causal=True)
    assert np.isposinf(L[..., :4]).all() and (O[..., :4, :] == 0).all()      # rows that see no key
    assert np.abs(O - ref.O).max() <= fp8_error_bound(q, k, v, causal=True)


# -- the error study --------------------------------------------------------------------------------------------------

def test_incoherent_processing_at_least_halves_the_error_on_outlier_channels():
    """Measured (N = 256, d = 64, 4 channels × 100, seeds 0-5): RMSE per_head ≈ 0.24, incoherent ≈ 0.095 (about
    0.40×, FA3 reports 2.6× lower, i.e. 0.38×); block scales alone change little (FP8's error is relative)."""
    study = fp8_error_study(N=256, d=64, outlier_channels=4, outlier_scale=100.0, seeds=range(6))
    plain = study.mean_rmse("per_head")
    assert study.mean_rmse("incoherent") <= 0.5 * plain
    assert study.mean_rmse("block_incoherent") <= 0.5 * plain
    assert 0.75 * plain <= study.mean_rmse("block") <= 1.1 * plain
    assert set(study.rmse) == {"per_head", "block", "incoherent", "block_incoherent"}
    assert "incoherent" in str(study) and study.seeds == tuple(range(6))


def test_without_outliers_the_recipes_agree():
    study = fp8_error_study(N=64, d=16, outlier_channels=0, outlier_scale=1.0, seeds=(0,))
    rmse = [study.mean_rmse(m) for m in study.rmse]
    assert max(rmse) <= 1.5 * min(rmse) and max(rmse) < 0.05


# -- bad input --------------------------------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="fmt"):
        round_to_fp8(x, "e3m4")
    with pytest.raises(ValueError, match="fmt"):
        quantize_fp8(x, fmt="fp8")
    with pytest.raises(ValueError, match="block must be positive"):
        quantize_fp8(x, block=0)
    with pytest.raises(TypeError, match="block"):
        quantize_fp8(x, block=2.5)
    with pytest.raises(ValueError, match="incoherent"):
        quantize_fp8(np.ones((4, 6), np.float32), incoherent=True)
    with pytest.raises(ValueError, match="incoherent"):
        fp8_attention(*np.ones((3, 4, 6), np.float32), incoherent=True)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[1, 2] = bad
        with pytest.raises(ValueError, match="x contains NaN or infinite"):
            quantize_fp8(y)
        with pytest.raises(ValueError, match="q contains NaN or infinite"):
            fp8_attention(y, x, x)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        quantize_fp8(np.ones((4, 8), np.int32))
    with pytest.raises(ValueError, match="x must have shape"):
        quantize_fp8(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="seed"):
        quantize_fp8(x, seed=-1)
    with pytest.raises(TypeError, match="codes must have dtype uint8"):
        from_bits(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
    q8, k8 = quantize_fp8(x, incoherent=True, seed=1), quantize_fp8(x, incoherent=True, seed=2)
    with pytest.raises(ValueError, match="Q8 and K8 must share one rotation"):
        flash2_forward_fp8(q8, k8, quantize_fp8(x))
    with pytest.raises(ValueError, match="V8 must not be rotated"):
        flash2_forward_fp8(q8, q8, q8)
    with pytest.raises(TypeError, match="K8 must be an Fp8Tensor"):
        flash2_forward_fp8(q8, x, q8)
    assert isinstance(q8, Fp8Tensor)
    with pytest.raises(ValueError, match="outlier_channels"):
        fp8_error_study(N=8, d=4, outlier_channels=5)
