"""kernels_gpu.hopper.flash_forward_fp8 in numba's CUDA simulator: the FP8 instruction twins against their NumPy
specification, the kernel against fa2edu.fp8's emulation (the same e4m3 values, the same algorithm) and against
the float64 oracle within fa2edu.fp8's proven error bound, on small ragged shapes; and every bad input refused by
name. The simulator is slow: four launches, a few seconds each.

**The tolerance against the emulation.** Both compute on the same e4m3 codes: S = Q₈K₈ᵀ exactly (the twin sums
exactly; NumPy in float32 — products of e4m3 values have 8 significant bits, sums of d of them are exact or
within float32's rounding), P̃ = 2⁸·exp(S − m) in float32 (``ex2`` against ``np.exp``: a few ulps apart), then
P̃ rounded to e4m3, whose spacing is 2⁻³ relative. A float32 difference of ~2⁻²² relative moves P̃ across an e4m3
rounding boundary with probability ~2⁻¹⁹ per score: almost never in these shapes, but when it does the entry
moves by one e4m3 step, at most 2⁻³·P̃ — so O may move by at most 2⁻³·max|V̂| on a row, rarely. The kernel then
rounds O to bfloat16 (unit roundoff 2⁻⁸) where the emulation keeps float32. Hence: every entry within
2⁻⁸·|O| + 2⁻²⁰·max|O| of the emulation except at most 0.5 % of them, and those within 2⁻³·max|V̂|; L (float32 in
both) within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

import fa2edu
import kernels_gpu.runtime as rt
from fa2edu import fp8
from kernels_gpu import hopper
from kernels_gpu import wgmma_layout as wl
from kernels_gpu.hopper import selftest
from kernels_gpu.hopper.flash_forward_fp8 import config_for  # (the module: its name is also the function's)


@pytest.mark.parametrize("case", [dict(N=64), dict(N=32, mode_a=0, mode_b=0), dict(N=16, mode_a=2, mode_b=2),
                                  dict(N=64, a_from="regs"), dict(N=8, a_start=96, b_start=8192 + 32)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_fp8_wgmma_twin_is_the_specification(case):
    got, expected, size = selftest.check_wgmma_fp8(**case, seed=7)
    np.testing.assert_array_equal(got, expected)
    assert np.all(size >= np.abs(expected)) and np.all(size > 0)       # the GPU test's scale of each sum


def test_pack_e4m3_twin_rounds_like_fa2edu_fp8():
    got, expected = selftest.check_pack_e4m3()
    np.testing.assert_array_equal(got, expected)
    # the packing order: x0 in the lowest byte
    assert int(selftest.ptx.pack_e4m3x4(1.0, 2.0, -0.5, 448.0)) == 0x7EB04038


def _quantised(shape_q, shape_kv, seed, incoherent=False, spread=1.0):
    """Random inputs (heads of different magnitudes, so the descales differ), quantised per (batch, head)."""
    rng = np.random.default_rng(seed)
    scales = np.exp(spread * rng.standard_normal(shape_q[:-2] + (1, 1)))
    q = rng.standard_normal(shape_q) * scales
    k = rng.standard_normal(shape_kv) * np.exp(spread * rng.standard_normal(shape_kv[:-2] + (1, 1)))
    v = rng.standard_normal(shape_kv) * np.exp(spread * rng.standard_normal(shape_kv[:-2] + (1, 1)))
    q8, k8 = fp8.quantize_fp8(q, incoherent=incoherent, seed=seed), fp8.quantize_fp8(k, incoherent=incoherent,
                                                                                     seed=seed)
    return (q, k, v), (q8, k8, fp8.quantize_fp8(v))


def _emulation_rule(O, L, ref, V8):
    """The module docstring's tolerance: the kernel against fa2edu.fp8's emulation on the same codes."""
    O64, R = O.astype(np.float64), ref.O.astype(np.float64)
    big = np.abs(R).max()
    close = np.abs(O64 - R) <= 2.0 ** -8 * np.abs(R) + 2.0 ** -20 * big
    v_max = float(np.max(np.abs(V8.dequantize())))
    assert close.mean() >= 0.995, f"{(~close).sum()} of {close.size} entries beyond bfloat16's rounding"
    assert np.abs(O64 - R).max() <= 2.0 ** -3 * v_max
    assert np.array_equal(np.isinf(L), np.isinf(ref.L)) and not np.isnan(L).any()
    finite = np.isfinite(ref.L)
    np.testing.assert_allclose(L[finite], ref.L[finite], rtol=1e-6, atol=1e-5)
    assert (O[~finite] == 0).all()


CASES = [  # (Q shape, K/V shape, causal, options): small, ragged against every tile
    # GQA 2:1, causal with N_q > N_k: 25 rows per head see no key; 45 keys = two 32-key tiles (the second ragged)
    ((1, 2, 70, 64), (1, 1, 45, 64), True, dict(B_c=32)),
    # d = 128, N_q < N_k causal: five 32-key tiles through a two-stage ring (both parities of each barrier)
    ((1, 1, 30, 128), (1, 1, 150, 128), True, dict(B_c=32)),
    # d = 256: two 128-byte panels per row, the default B_c = 64, one ragged tile
    ((1, 1, 20, 256), (1, 1, 50, 256), False, {}),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0][2]}x{c[1][2]}-d{c[0][3]}-{'causal' if c[2] else 'full'}"
                                             for c in CASES])
def test_kernel_matches_the_emulation_and_the_oracle(case, monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)
    shape_q, shape_kv, causal, options = case
    (q, k, v), (q8, k8, v8) = _quantised(shape_q, shape_kv, seed=CASES.index(case))
    O, L = hopper.flash_forward_fp8(q8.codes, k8.codes, v8.codes, causal=causal, descale_q=q8.descale,
                                    descale_k=k8.descale, descale_v=v8.descale, incoherent=False, **options)
    assert O.dtype == np.float32 and O.shape == shape_q and L.shape == shape_q[:-1]
    assert np.array_equal(O, ptx_bf16(O)), "O must hold bfloat16 values"
    assert not np.allclose(q8.descale, 1) and not np.allclose(v8.descale, 1)
    ref = fp8.flash2_forward_fp8(q8, k8, v8, causal=causal, block_sizes=(128, options.get("B_c", 64)))
    _emulation_rule(O, L, ref, v8)
    # against the float64 oracle on the original inputs, GQA spelled out: within the proven worst-case bound
    # (which covers the quantisation of q, k, v and of P̃) plus bfloat16's rounding of O
    G = shape_q[-3] // shape_kv[-3]
    k_, v_ = (np.repeat(x, G, axis=-3) for x in (k, v))
    O_ref, L_ref = fa2edu.attention_reference(q, k_, v_, causal=causal)
    bound = fp8.fp8_error_bound(q, k_, v_, causal=causal)
    err = np.abs(O.astype(np.float64) - O_ref).max()
    assert err <= bound + 2.0 ** -8 * np.abs(O_ref).max(), (err, bound)
    assert np.array_equal(np.isinf(L), np.isinf(L_ref))


def ptx_bf16(x):
    from kernels_gpu.ptx import bf16_bits_to_f32, f32_to_bf16_bits
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def test_rotated_inputs_and_torch_tensors(monkeypatch):
    """incoherent=True inputs (Q, K rotated by one random Hadamard matrix: QKᵀ unchanged) as torch.float8_e4m3fn CPU
    tensors from fa2edu.torch.quantize_fp8: O comes back a bfloat16 tensor, as close to the oracle on the
    unrotated inputs as the emulation is (twice its error, plus bfloat16's rounding)."""
    torch = pytest.importorskip("torch")
    from fa2edu.torch import quantize_fp8
    monkeypatch.setattr(rt, "poison_outputs", True)
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, n, 64)).astype(np.float32) for n in (40, 70, 70))
    q[..., :2] *= 20.0                                         # two outlier channels
    k[..., :2] *= 20.0
    (q8, dq), (k8, dk) = quantize_fp8(torch.from_numpy(q)), quantize_fp8(torch.from_numpy(k))
    v8, dv = quantize_fp8(torch.from_numpy(v), incoherent=False)
    O, L = hopper.flash_forward_fp8(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, B_c=32)
    assert O.dtype == torch.bfloat16 and L.dtype == torch.float32 and O.shape == (1, 2, 40, 64)
    O_ref = fa2edu.attention_reference(*(x.astype(np.float64) for x in (q, k, v))).O
    emulated = fp8.flash2_forward_fp8(*(fp8.Fp8Tensor(x.view(torch.uint8).numpy(), d.numpy(), "e4m3", None, None)
                                        for x, d in ((q8, dq), (k8, dk), (v8, dv))), scale=1 / 8)
    emulation_error = np.abs(emulated.O - O_ref).max()
    err = np.abs(O.float().numpy() - O_ref).max()
    assert err <= 2 * emulation_error + 2.0 ** -8 * np.abs(O_ref).max(), (err, emulation_error)


def _codes(shape):
    return np.zeros(shape, np.uint8)


def test_bad_inputs_are_refused_by_name():
    Q = _codes((1, 2, 8, 64))
    with pytest.raises(TypeError, match="Q must hold float8 e4m3 codes"):
        hopper.flash_forward_fp8(Q.astype(np.float16), Q, Q)
    with pytest.raises(TypeError, match="K must be a torch.float8_e4m3fn tensor"):
        hopper.flash_forward_fp8(Q, [1, 2], Q)
    with pytest.raises(ValueError, match="head dimension d = 40.*multiples of 16"):
        hopper.flash_forward_fp8(*(_codes((1, 1, 8, 40)),) * 3)
    with pytest.raises(ValueError, match="d = 272"):
        hopper.flash_forward_fp8(*(_codes((1, 1, 8, 272)),) * 3)
    with pytest.raises(ValueError, match="H_q = 3 must be a multiple"):
        hopper.flash_forward_fp8(_codes((1, 3, 8, 64)), Q, Q)
    with pytest.raises(ValueError, match="descale_q must have shape \\(1, 2\\)"):
        hopper.flash_forward_fp8(Q, Q, Q, descale_q=np.ones((1, 2, 8), np.float32))
    with pytest.raises(TypeError, match="descale_k must be float32"):
        hopper.flash_forward_fp8(Q, Q, Q, descale_k=np.ones((1, 2)))
    with pytest.raises(ValueError, match="descale_v must be positive and finite"):
        hopper.flash_forward_fp8(Q, Q, Q, descale_v=np.array([[1.0, -1.0]], np.float32))
    with pytest.raises(TypeError, match="descale_v must be None"):
        hopper.flash_forward_fp8(Q, Q, Q, descale_v=2.0)
    with pytest.raises(TypeError, match="incoherent must be a bool"):
        hopper.flash_forward_fp8(Q, Q, Q, incoherent="yes")
    with pytest.raises(TypeError, match="causal must be a bool"):
        hopper.flash_forward_fp8(Q, Q, Q, causal=1)
    with pytest.raises(ValueError, match="B_c must be"):
        hopper.flash_forward_fp8(Q, Q, Q, B_c=48)


def test_bad_torch_inputs_are_refused_by_name():
    torch = pytest.importorskip("torch")
    x = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="Q must be float8 e4m3 .*torch.bfloat16"):
        hopper.flash_forward_fp8(x, x, x)
    x8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="descale_q must be float32"):
        hopper.flash_forward_fp8(x8, x8, x8, descale_q=torch.ones(1, 1, dtype=torch.float64))


def test_rung_layout_constants():
    """The rung's Vᵀ word address is the layout module's (the kernel compiles its own copy of the formula)."""
    cfg = config_for(128, False, True)
    assert (cfg.B_r, cfg.B_c, cfg.panels, cfg.threads) == (128, 128, 1, 256)
    assert config_for(256, False, True).B_c == 64 and config_for(256, False, True).panels == 2
    n, a = np.meshgrid(np.arange(128), np.arange(0, 128, 4), indexing="ij")
    w = wl.transposed_v_word(n, a)
    assert np.array_equal(np.sort(w.ravel()), np.arange(128 * 32))      # every word of Vᵀ written once
