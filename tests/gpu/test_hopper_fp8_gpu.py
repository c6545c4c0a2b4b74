"""kernels_gpu.hopper.flash_forward_fp8 on an H100/H200: the FP8 instructions against the NumPy specification their
simulator twins implement, and the rung against the float64 oracle on the dequantised inputs with flash-attn's rule
adapted to FP8 — the error at most twice fa2edu.fp8's emulation's (same codes, float32 O) plus bfloat16's rounding
of O —, outputs poisoned first, reruns bit-identical.

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_hopper_fp8_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")

import fa2edu  # noqa: E402
import kernels_gpu.runtime as rt  # noqa: E402
from fa2edu import fp8  # noqa: E402
from fa2edu.torch import quantize_fp8  # noqa: E402
from kernels_gpu.hopper import flash_forward_fp8, selftest  # noqa: E402

if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Hopper kernels need an sm_90 GPU", allow_module_level=True)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


FP8_WGMMA_CASES = [  # (N, A from, swizzle of A, swizzle of B, A's start byte, B's start byte)
    (64, "smem", 1, 1, 0, 8192), (128, "smem", 1, 1, 32, 8192 + 64), (256, "smem", 1, 1, 96, 8192),
    (16, "smem", 0, 0, 0, 8192), (32, "smem", 2, 2, 0, 8192), (8, "smem", 1, 1, 0, 8192),
    (64, "regs", 1, 1, 0, 8192), (128, "regs", 1, 1, 0, 8192 + 2048), (256, "regs", 1, 1, 0, 0),
    (48, "regs", 1, 0, 0, 8192),
]


@pytest.mark.parametrize("case", FP8_WGMMA_CASES, ids=[f"n{c[0]}-{c[1]}-sw{c[2]}{c[3]}" for c in FP8_WGMMA_CASES])
def test_fp8_wgmma_instruction(case):
    N, a_from, mode_a, mode_b, a_start, b_start = case
    got, expected, size = selftest.check_wgmma_fp8(N, a_from, mode_a, mode_b, seed=N, a_start=a_start,
                                                   b_start=b_start)
    # Not exact: FP8 wgmma adds its products in an accumulator narrower than float32 (the first H200 run of
    # this test, 2026-12-02, saw errors of 1e-6 to 2e-4 of Σ|a·b|; this bound is not yet run); a wrong layout
    # errs by ~Σ|a·b| itself.
    assert np.all(np.isfinite(got))
    err = np.abs(got.astype(np.float64) - expected)
    assert np.all(err <= 2.0 ** -8 * size), f"worst error {np.max(err / size):.3g} of the sum's size"


def test_pack_e4m3_instruction():
    got, expected = selftest.check_pack_e4m3(seed=3, n=4096)
    np.testing.assert_array_equal(got, expected)


SHAPES = [  # (Q shape, K/V shape, causal)
    ((2, 4, 1000, 64), (2, 2, 1000, 64), False),      # GQA
    ((1, 8, 777, 128), (1, 8, 1029, 128), True),      # ragged, N_q < N_k, bottom-right causal
    ((1, 2, 300, 128), (1, 1, 200, 128), True),       # N_q > N_k: 100 fully masked rows per head
    ((1, 2, 513, 256), (1, 2, 513, 256), False),      # the largest head dimension
    ((1, 3, 200, 48), (1, 1, 333, 48), True),         # MQA, d = 48 (not a multiple of 32)
]


def _quantised(shape_q, shape_kv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(s, device="cuda", generator=g) for s in (shape_q, shape_kv, shape_kv))
    incoherent = (shape_q[-1] & (shape_q[-1] - 1)) == 0        # the rotation needs a power of two
    return quantize_fp8(q, incoherent=incoherent), quantize_fp8(k, incoherent=incoherent), \
        quantize_fp8(v, incoherent=False)


def _host(x8, d):
    return fp8.Fp8Tensor(x8.view(torch.uint8).cpu().numpy(), d.cpu().numpy(), "e4m3", None, None)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}-{'causal' if s[2] else 'full'}" for s in SHAPES])
def test_fp8_forward_matches_oracle(shape):
    shape_q, shape_kv, causal = shape
    (q8, dq), (k8, dk), (v8, dv) = _quantised(shape_q, shape_kv, seed=SHAPES.index(shape))
    O, L = flash_forward_fp8(q8, k8, v8, causal=causal, descale_q=dq, descale_k=dk, descale_v=dv)
    torch.cuda.synchronize()
    assert O.dtype == torch.bfloat16 and O.shape == shape_q and L.shape == shape_q[:-1]
    Q8, K8, V8 = _host(q8, dq), _host(k8, dk), _host(v8, dv)
    G = shape_q[-3] // shape_kv[-3]
    q, k, v = Q8.dequantize(), np.repeat(K8.dequantize(), G, axis=-3), np.repeat(V8.dequantize(), G, axis=-3)
    O_ref, L_ref = fa2edu.attention_reference(q, k, v, causal=causal)
    emulated = fp8.flash2_forward_fp8(Q8, K8, V8, causal=causal)
    finite = np.isfinite(L_ref)
    emulation_error = np.abs(emulated.O - O_ref).max()
    got = O.float().cpu().numpy()
    err = np.abs(got - O_ref).max()
    assert not np.isnan(got).any()
    assert err <= 2 * emulation_error + 2.0 ** -8 * np.abs(O_ref).max() + 1e-5, (err, emulation_error)
    L = L.cpu().numpy()
    assert np.array_equal(np.isinf(L), ~finite) and (got[~finite] == 0).all()
    np.testing.assert_allclose(L[finite], L_ref[finite], rtol=1e-3, atol=1e-3)


def test_fp8_forward_is_deterministic():
    """Bit-identical over 100 reruns (a result that changes between runs on the same inputs is a race)."""
    (q8, dq), (k8, dk), (v8, dv) = _quantised((2, 8, 1024, 128), (2, 8, 1024, 128), seed=11)
    O0, L0 = flash_forward_fp8(q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
    for _ in range(99):
        O, L = flash_forward_fp8(q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
        assert torch.equal(O, O0) and torch.equal(L, L0)


def test_the_op_runs_the_fp8_kernel_and_refuses_backward():
    """fa2edu.torch.flash_attention on CUDA float8: the kernel's bits (d = 72 padded to 80 inside the op), bfloat16
    out, and a clear error for a backward."""
    from fa2edu.torch import flash_attention
    (q8, dq), (k8, dk), (v8, dv) = _quantised((1, 4, 300, 72), (1, 2, 500, 72), seed=5)
    O = flash_attention(q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
    O_cpu = flash_attention(q8.cpu(), k8.cpu(), v8.cpu(), causal=True, descale_q=dq.cpu(), descale_k=dk.cpu(),
                            descale_v=dv.cpu())
    assert O.dtype == torch.bfloat16 and O.is_cuda and O.shape == (1, 4, 300, 72)
    diff = (O.float().cpu() - O_cpu.float()).abs()
    assert (diff <= 2 ** -7 * O_cpu.float().abs() + 1e-6).float().mean() > 0.995
    q8.requires_grad_()
    with pytest.raises(RuntimeError, match="forward only"):
        flash_attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv).float().sum().backward()
