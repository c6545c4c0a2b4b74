"""3xTF32 on a real GPU: ``split_tf32`` (cvt, and, sub, cvt) bit for bit against its simulator twin, and the 3xTF32
forward against the float64 oracle — within :func:`~kernels_gpu.tensorcore.flash2_forward_3xtf32.error_bound`,
and by flash-attn's rule against PyTorch's float32 SDPA (memory-efficient: CUTLASS's own 3xTF32) with float32's
slack, not TF32's; bit-identical over 100 reruns.

Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_tensorcore_3xtf32_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":  # the conftest skips these too; never compile for the simulator here
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")

from numba import cuda  # noqa: E402
from test_tensorcore_gpu import SHAPES, reference  # noqa: E402  (the ladder's oracle and shapes)

import kernels_gpu.runtime as rt  # noqa: E402
from kernels_gpu import ptx  # noqa: E402
from kernels_gpu.tensorcore import TF32  # noqa: E402
from kernels_gpu.tensorcore.flash2_forward_3xtf32 import error_bound  # noqa: E402

FORMS = ("3xtf32", "3xtf32-planes")


def _takes(form, shape) -> bool:
    """The planes form takes head dimensions that are multiples of 16 up to 128."""
    d = shape[0][-1]
    return form == "3xtf32" or (d % 16 == 0 and d <= 128)


RUNS = [(form, shape) for form in FORMS for shape in SHAPES if _takes(form, shape)]
IDS = [f"{form}-{s[0]}x{s[1]}-{'causal' if s[2] else 'full'}" for form, s in RUNS]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


@cuda.jit
def _split_kernel(x, big, small):
    i = cuda.grid(1)
    if i < x.size:
        b, s = ptx.split_tf32(x[i])
        big[i] = b
        small[i] = s


def test_split_instruction_matches_its_twin():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(4096), rng.standard_normal(512) * 1e30, rng.standard_normal(512) * 1e-30,
                        [0.0, -0.0, 1.0, -1.5, 3.4e38, -3.4e38]]).astype(np.float32)
    big, small = cuda.device_array(x.size, np.uint32), cuda.device_array(x.size, np.uint32)
    _split_kernel[(x.size + 127) // 128, 128](cuda.to_device(x), big, small)
    twin = [ptx._split_tf32_twin(v) for v in x]
    np.testing.assert_array_equal(big.copy_to_host(), np.array([t[0] for t in twin], np.uint32))
    np.testing.assert_array_equal(small.copy_to_host(), np.array([t[1] for t in twin], np.uint32))


def _inputs(shape, seed, scale=1.0):
    shape_q, shape_kv, causal = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = torch.randn(shape_q, device="cuda", generator=g) * scale
    K = torch.randn(shape_kv, device="cuda", generator=g) * scale
    V = torch.randn(shape_kv, device="cuda", generator=g)
    return Q, K, V, causal


def _sdpa_fp32(Q, K, V, causal):
    """PyTorch's float32 SDPA, memory-efficient backend, GQA by repetition, bottom-right causal mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    G = Q.shape[-3] // K.shape[-3]
    kr, vr = K.repeat_interleave(G, -3), V.repeat_interleave(G, -3)
    N_q, N_k = Q.shape[-2], K.shape[-2]
    mask = torch.ones(N_q, N_k, dtype=torch.bool, device=Q.device).tril(N_k - N_q) if causal else None
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(Q, kr, vr, attn_mask=mask).nan_to_num(0.0)


@pytest.mark.parametrize("form, shape", RUNS, ids=IDS)
def test_3xtf32_forward_within_bound_and_flash_attn_rule(form, shape):
    Q, K, V, causal = _inputs(shape, seed=hash(shape[0]) % 2**31)
    res = TF32[form](Q, K, V, causal=causal)
    torch.cuda.synchronize()
    assert res.precision == "3xtf32"
    O, L = (torch.as_tensor(x, device="cuda") for x in res)
    O_ref, L_ref = reference(Q, K, V, causal)
    seen = torch.isfinite(L_ref)
    assert not O.isnan().any() and not L.isnan().any()
    assert torch.equal(torch.isinf(L), ~seen) and (O[~seen] == 0).all()
    bound_O, bound_L = (torch.as_tensor(b, device="cuda") for b in error_bound(*(x.cpu().numpy() for x in (Q, K, V))))
    err = (O.double() - O_ref.nan_to_num(0.0)).abs()
    assert (err <= bound_O).all(), (err.max().item(), bound_O.min().item())
    slack = 2.0 ** -20 * (1 + L_ref[seen].abs())
    assert ((L.double()[seen] - L_ref[seen]).abs() <= bound_L[seen] + slack).all()
    # flash-attn's rule, with float32's absolute slack (TF32 would miss it by ~100×)
    err_pt = (_sdpa_fp32(Q, K, V, causal).double() - O_ref.nan_to_num(0.0)).abs().max().item()
    assert err.max().item() <= 2 * err_pt + 2.0 ** -20, (err.max().item(), err_pt)


@pytest.mark.parametrize("form", FORMS)
def test_3xtf32_extreme_logits(form):
    """Scores in the hundreds: the split keeps float32's relative accuracy at any magnitude."""
    Q, K, V, causal = _inputs(((1, 4, 600, 64), (1, 4, 600, 64), True), seed=5, scale=4.0)
    O = torch.as_tensor(TF32[form](Q, K, V, causal=True).O, device="cuda")
    O_ref, _ = reference(Q, K, V, True)
    err = (O.double() - O_ref).abs().max().item()
    err_pt = (_sdpa_fp32(Q, K, V, True).double() - O_ref).abs().max().item()
    assert err <= 2 * err_pt + 2.0 ** -20, (err, err_pt)


@pytest.mark.parametrize("form", FORMS)
def test_3xtf32_deterministic(form):
    """Bit-identical over 100 reruns (the planes form's two plane stages are where a race would hide)."""
    Q, K, V = (torch.randn(2, 8, 1024, 64, device="cuda") for _ in range(3))
    O0, L0 = (torch.as_tensor(x, device="cuda").clone() for x in TF32[form](Q, K, V, causal=True))
    for _ in range(99):
        O, L = (torch.as_tensor(x, device="cuda") for x in TF32[form](Q, K, V, causal=True))
        assert torch.equal(O, O0) and torch.equal(L, L0)
