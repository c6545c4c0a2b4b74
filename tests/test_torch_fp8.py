"""fa2edu.torch.quantize_fp8: FA3's FP8 quantisation of PyTorch tensors against the NumPy reference (fa2edu.fp8)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fa2edu import fp8  # noqa: E402
from fa2edu.torch import quantize_fp8  # noqa: E402


def _inputs(shape=(2, 3, 300, 64), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-2] + (1, shape[-1])))
    x[..., :2] *= 100.0                                     # two outlier channels
    return x.astype(np.float32)


@pytest.mark.parametrize("incoherent", [False, True])
@pytest.mark.parametrize("block", [None, 64, 77])
def test_codes_and_descales_match_the_numpy_reference(incoherent, block):
    x = _inputs()
    x8, descale = quantize_fp8(torch.from_numpy(x), incoherent=incoherent, block=block)
    ref = fp8.quantize_fp8(x, incoherent=incoherent, block=block)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape and descale.dtype == torch.float32
    assert descale.shape == ref.descale.shape
    np.testing.assert_allclose(descale.numpy(), ref.descale, rtol=1e-6)
    codes = x8.view(torch.uint8).numpy()
    ours, theirs = fp8.from_bits(codes), fp8.from_bits(ref.codes)
    differ = ours != theirs
    assert differ.mean() < 1e-4                              # float32 quotient vs float64: ties only
    grid = np.sort(fp8.fp8_values("e4m3"))
    steps = np.abs(np.searchsorted(grid, ours[differ]) - np.searchsorted(grid, theirs[differ]))
    assert (steps <= 1).all()


def test_dequantised_values_are_close_and_the_rotation_keeps_scores():
    x = _inputs(seed=1)
    q, k = torch.from_numpy(x), torch.from_numpy(_inputs(seed=2))
    for incoherent in (False, True):
        (q8, dq), (k8, dk) = quantize_fp8(q, incoherent=incoherent), quantize_fp8(k, incoherent=incoherent)
        s = (q8.float() * dq[..., None, None]) @ (k8.float() * dk[..., None, None]).transpose(-1, -2)
        exact = q @ k.transpose(-1, -2)
        assert ((s - exact).norm() / exact.norm()).item() < 0.1
    # the rotation alone (before rounding) leaves QKᵀ unchanged
    M = torch.from_numpy(fp8.rotation_matrix(64, 0)).float()
    assert torch.allclose((q @ M) @ (k @ M).transpose(-1, -2), q @ k.transpose(-1, -2), rtol=1e-4, atol=1e-2)


def test_bad_input_is_refused():
    x = torch.ones(1, 1, 4, 64)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_fp8(np.ones((4, 64), np.float32))
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        quantize_fp8(x.double())
    with pytest.raises(ValueError, match="at least 2 axes"):
        quantize_fp8(torch.ones(64))
    with pytest.raises(ValueError, match="block must be a positive int"):
        quantize_fp8(x, block=0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp8(torch.full((1, 1, 4, 64), float("inf")))
    with pytest.raises(ValueError, match="not a power of two"):
        quantize_fp8(torch.ones(1, 1, 4, 48))
    assert quantize_fp8(torch.ones(1, 1, 4, 48), incoherent=False)[0].shape == (1, 1, 4, 48)
    zero8, zero_descale = quantize_fp8(torch.zeros(1, 2, 4, 64))
    assert (zero_descale == 1).all() and (zero8.float() == 0).all()
