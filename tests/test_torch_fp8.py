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


# -- flash_attention on float8 inputs -------------------------------------------------------------------------------

from fa2edu.torch import flash_attention  # noqa: E402


def _fp8_inputs(shape_q=(2, 4, 50, 64), shape_kv=(2, 2, 70, 64), d_v=None, seed=3, incoherent=True):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(shape_q, generator=g), torch.randn(shape_kv, generator=g)
    v = torch.randn(shape_kv[:-1] + (d_v or shape_kv[-1],), generator=g)
    return quantize_fp8(q, incoherent=incoherent), quantize_fp8(k, incoherent=incoherent), \
        quantize_fp8(v, incoherent=False)


@pytest.mark.parametrize("causal", [False, True])
def test_float8_op_on_the_cpu_is_the_numpy_emulation(causal):
    """CPU float8 → fa2edu.fp8.flash2_forward_fp8 on the same codes: O its float32 result rounded to bfloat16, L
    its L; GQA, N_q ≠ N_k, causal with rows that see no key (N_q > N_k: 20 of them per head)."""
    (q8, dq), (k8, dk), (v8, dv) = _fp8_inputs(shape_q=(2, 4, 90, 64), shape_kv=(2, 2, 70, 64))
    O, L = flash_attention(q8, k8, v8, causal=causal, return_lse=True, descale_q=dq, descale_k=dk, descale_v=dv)
    assert O.dtype == torch.bfloat16 and O.shape == (2, 4, 90, 64) and L.dtype == torch.float32
    ref = fp8.flash2_forward_fp8(*(fp8.Fp8Tensor(x.view(torch.uint8).numpy(), d.numpy(), "e4m3", None, None)
                                   for x, d in ((q8, dq), (k8, dk), (v8, dv))), causal=causal)
    assert torch.equal(O, torch.from_numpy(ref.O).to(torch.bfloat16))
    assert torch.equal(L, torch.from_numpy(ref.L))
    if causal:
        assert torch.isinf(L[..., :20]).all() and (O[..., :20, :] == 0).all()
        assert torch.isfinite(L[..., 20:]).all()


def test_float8_op_is_close_to_attention_on_the_dequantised_inputs():
    (q8, dq), (k8, dk), (v8, dv) = _fp8_inputs(shape_q=(1, 2, 40, 32), shape_kv=(1, 2, 40, 32), d_v=24)
    O = flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    deq = [x.float() * d[..., None, None] for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    exact = torch.softmax(deq[0] @ deq[1].transpose(-1, -2) / 32 ** 0.5, dim=-1) @ deq[2]
    assert O.shape == (1, 2, 40, 24)
    err = (O.float() - exact).abs().max().item()
    assert 0 < err < 2 ** -4 * exact.abs().max().item()          # P̃ in e4m3 (2⁻⁴) and O in bfloat16, no worse
    # without descales the op attends over the codes themselves (descale 1)
    O1 = flash_attention(q8, k8, v8, scale=1.0)
    raw = torch.softmax(q8.float() @ k8.float().transpose(-1, -2), dim=-1) @ v8.float()
    assert (O1.float() - raw).abs().max().item() < 2 ** -4 * raw.abs().max().item()


def test_float8_backward_is_refused_by_name():
    (q8, dq), (k8, dk), (v8, dv) = _fp8_inputs(shape_q=(1, 1, 8, 16), shape_kv=(1, 1, 8, 16), incoherent=False)
    q8.requires_grad_()
    O = flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    assert O.requires_grad
    with pytest.raises(RuntimeError, match="float8_e4m3fn inputs is forward only"):
        O.float().sum().backward()


def test_float8_op_compiles_and_passes_opcheck():
    (q8, dq), (k8, dk), (v8, dv) = _fp8_inputs(shape_q=(1, 2, 16, 16), shape_kv=(1, 1, 24, 16), incoherent=False)

    def f(q, k, v, a, b, c):
        return flash_attention(q, k, v, causal=True, descale_q=a, descale_k=b, descale_v=c)
    eager = f(q8, k8, v8, dq, dk, dv)
    compiled = torch.compile(f, fullgraph=True, backend="eager")(q8, k8, v8, dq, dk, dv)
    assert torch.equal(eager, compiled)
    # the fake implementation against the real one (opcheck's schema test compares outputs with float8
    # arithmetic that PyTorch's CPU kernels do not implement: "mul_cpu_reduced_float" for Float8_e4m3fn)
    torch.library.opcheck(torch.ops.fa2edu.flash_attention_fp8_fwd.default,
                          (q8, k8, v8, dq, dk, dv, True, 0.25, "numpy"), test_utils=("test_faketensor",))


def test_float8_bad_inputs_are_refused_by_name():
    (q8, dq), (k8, dk), (v8, dv) = _fp8_inputs(shape_q=(1, 2, 8, 16), shape_kv=(1, 1, 8, 16), incoherent=False)
    with pytest.raises(TypeError, match="k has dtype torch.bfloat16.*float8_e4m3fn"):
        flash_attention(q8, k8.to(torch.bfloat16), v8)
    with pytest.raises(TypeError, match="q has dtype torch.float32: descale_q"):
        flash_attention(q8.float(), k8.float(), v8.float(), descale_q=dq)
    with pytest.raises(ValueError, match="descale_k must have shape \\(1, 1\\)"):
        flash_attention(q8, k8, v8, descale_k=dq)
    with pytest.raises(TypeError, match="descale_v must be float32"):
        flash_attention(q8, k8, v8, descale_v=dv.double())
    with pytest.raises(TypeError, match="descale_q must be a float32 torch.Tensor"):
        flash_attention(q8, k8, v8, descale_q=0.5)
    with pytest.raises(ValueError, match="algorithm must be 'flash2'"):
        flash_attention(q8, k8, v8, algorithm="flash1")
    with pytest.raises(ValueError, match="block_sizes and M do not apply"):
        flash_attention(q8, k8, v8, block_sizes=(16, 16))
    with pytest.raises(ValueError, match="backend for float8 inputs"):
        flash_attention(q8, k8, v8, backend="tensorcore")
    with pytest.raises(ValueError, match="multiple of k's and v's H_kv"):
        flash_attention(q8[:, :1].expand(1, 3, 8, 16).contiguous(), torch.cat([k8.view(torch.uint8)] * 2, 1)
                        .view(torch.float8_e4m3fn), torch.cat([v8.view(torch.uint8)] * 2, 1)
                        .view(torch.float8_e4m3fn))


def test_float8_op_runs_the_hopper_kernel_in_the_simulator(monkeypatch):
    """backend='hopper' on CPU tensors (numba's simulator): d = 40, d_v = 24 padded to 48 inside the op, sliced
    back; O against the CPU emulation within bfloat16's rounding (both on the same codes)."""
    import fa2edu._torch_ops as ops
    if not ops.simulator_enabled():
        pytest.skip("runs the kernel in numba's CUDA simulator")
    (q8, dq), (k8, dk), (v8, dv) = _fp8_inputs(shape_q=(1, 2, 20, 40), shape_kv=(1, 1, 40, 40), d_v=24,
                                               incoherent=False)
    kw = dict(causal=True, return_lse=True, descale_q=dq, descale_k=dk, descale_v=dv)
    O, L = flash_attention(q8, k8, v8, backend="hopper", **kw)
    O_cpu, L_cpu = flash_attention(q8, k8, v8, **kw)
    assert O.dtype == torch.bfloat16 and O.shape == (1, 2, 20, 24) and O.is_contiguous()
    diff = (O.float() - O_cpu.float()).abs()
    assert (diff <= 2 ** -7 * O_cpu.float().abs() + 1e-6).float().mean() > 0.995
    assert diff.max() <= 2 ** -3 * (v8.float() * dv[..., None, None]).abs().max()
    torch.testing.assert_close(L, L_cpu, rtol=1e-6, atol=1e-5)
