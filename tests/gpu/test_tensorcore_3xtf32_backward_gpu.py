"""The 3xTF32 backward on a real GPU: dQ, dK, dV against the float64 oracle by flash-attn's rule — at most twice the
error of PyTorch's own float32 backward (SDPA memory-efficient, CUTLASS's 3xTF32) plus float32's slack, not
TF32's — on the ladder's shapes it takes (GQA, ragged, N_q ≠ N_k, fully masked rows), several tiles, extreme
logits; outputs poisoned first.

Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_tensorcore_3xtf32_backward_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":  # the conftest skips these too; never compile for the simulator here
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")

from test_tensorcore_backward_gpu import oracle, torch_gradients  # noqa: E402  (float64 and PyTorch gradients)
from test_tensorcore_gpu import SHAPES  # noqa: E402  (the ladder's shapes)

import kernels_gpu.runtime as rt  # noqa: E402
from kernels_gpu.tensorcore import TF32, TF32_BACKWARD  # noqa: E402

#: the ladder's shapes this kernel takes (d a multiple of 16 up to 128), each with the default tile, and the
#: d = 64 shape with four warps and with 16-query steps
CASES = ([(shape, None, None) for shape in SHAPES if shape[0][-1] % 16 == 0 and shape[0][-1] <= 128] +
         [(SHAPES[0], 4, None), (SHAPES[0], 8, 16), (SHAPES[1], 8, 16)])
IDS = [f"{s[0]}x{s[1]}-{'causal' if s[2] else 'full'}-w{w}-br{b}" for s, w, b in CASES]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


def _inputs(shape, seed, scale=1.0):
    shape_q, shape_kv, causal = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = torch.randn(shape_q, device="cuda", generator=g) * scale
    K = torch.randn(shape_kv, device="cuda", generator=g) * scale
    V = torch.randn(shape_kv, device="cuda", generator=g)
    dO = torch.randn(shape_q, device="cuda", generator=g)
    return Q, K, V, dO, causal


def _run(Q, K, V, dO, causal, **tile):
    O, L = (torch.as_tensor(x, device="cuda") for x in TF32["3xtf32-planes"](Q, K, V, causal=causal))
    grads = TF32_BACKWARD["3xtf32"](Q, K, V, O, L, dO, causal=causal, **tile)
    torch.cuda.synchronize()
    return [torch.as_tensor(g, device="cuda") for g in grads]


def _check(grads, Q, K, V, dO, causal):
    """flash-attn's rule against PyTorch's float32 attention: SDPA's memory-efficient kernel (its own 3xTF32; the
    math backend where that one does not take the shape)."""
    exact = oracle(Q, K, V, dO, causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        theirs = torch_gradients(Q, K, V, dO, causal)
    for name, ours, pt, ex, x in zip(("dQ", "dK", "dV"), grads, theirs, exact, (Q, K, V)):
        assert ours.dtype == torch.float32 and ours.shape == x.shape, name
        assert not ours.isnan().any(), name
        err = (ours.double() - ex).abs().max().item()
        err_pt = (pt.double() - ex).abs().max().item()
        # flash-attn's rule with float32's absolute slack (TF32 would miss it by ~1000×)
        assert err <= 2 * err_pt + 2.0 ** -20 * (1 + ex.abs().max().item()), (name, err, err_pt)
    if causal and Q.shape[-2] > K.shape[-2]:
        assert (grads[0][..., : Q.shape[-2] - K.shape[-2], :] == 0).all()


@pytest.mark.parametrize("shape, warps, B_r", CASES, ids=IDS)
def test_3xtf32_backward_flash_attn_rule(shape, warps, B_r):
    Q, K, V, dO, causal = _inputs(shape, seed=hash(shape[0]) % 2**31)
    _check(_run(Q, K, V, dO, causal, warps=warps, B_r=B_r), Q, K, V, dO, causal)


def test_3xtf32_backward_extreme_logits():
    """Scores in the hundreds (inputs scaled by 4): the splits keep float32's relative accuracy at any magnitude."""
    Q, K, V, dO, causal = _inputs(((1, 4, 600, 64), (1, 2, 600, 64), True), seed=5, scale=4.0)
    _check(_run(Q, K, V, dO, causal), Q, K, V, dO, causal)


def test_3xtf32_backward_dk_dv_deterministic():
    """dK and dV are summed in a fixed order (bit-identical over reruns); dQ by atomic additions, close."""
    Q, K, V, dO, causal = _inputs(((2, 8, 1024, 64), (2, 4, 1024, 64), True), seed=7)
    dQ0, dK0, dV0 = (g.clone() for g in _run(Q, K, V, dO, causal))
    for _ in range(20):
        dQ, dK, dV = _run(Q, K, V, dO, causal)
        assert torch.equal(dK, dK0) and torch.equal(dV, dV0)
        assert (dQ - dQ0).abs().max().item() <= 1e-5 * dQ0.abs().max().item()
