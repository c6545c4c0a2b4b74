"""kernels_gpu.tensorcore on a real GPU: the instructions against their NumPy specification (the same checks the
simulator twins pass in CI, so twin and hardware agree through one spec), and every forward rung against the float64
oracle with flash-attn's rule, at benchmark-like sizes.

Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_tensorcore_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":  # the conftest skips these too; never compile for the simulator here
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")

import kernels_gpu.runtime as rt  # noqa: E402
from kernels_gpu.tensorcore import VERSIONS, selftest  # noqa: E402


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


# -- the real instructions against the specification the twins implement --------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_instruction(dtype, seed):
    got, expected = selftest.check_mma(dtype, seed=seed)
    # the twin rounds once after an exact sum; the tensor core's internal accumulation may differ in the last bits
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_instruction(trans):
    got, expected = selftest.check_ldmatrix(trans, seed=3)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pack_instruction(dtype):
    (words, back), (exp_words, exp_back) = selftest.check_pack(dtype, seed=4)
    np.testing.assert_array_equal(words, exp_words)
    np.testing.assert_array_equal(back, exp_back)


def test_cp_async_instruction():
    got, expected = selftest.check_cp_async(seed=5)
    np.testing.assert_array_equal(got, expected)


def test_bulk_copy_instruction():
    got, expected = selftest.check_bulk_copy(seed=7)
    np.testing.assert_array_equal(got, expected)


def test_shfl_and_ex2_instructions():
    (shuffled, powers), (exp_shuffled, exp_powers) = selftest.check_shfl_ex2(seed=6)
    np.testing.assert_array_equal(shuffled, exp_shuffled)
    np.testing.assert_allclose(powers, exp_powers, rtol=2.0**-21, atol=0)    # ex2.approx: ~2 ulp


# -- every rung against the oracle ---------------------------------------------------------------------------------

def reference(Q, K, V, causal):
    """float64 attention on the GPU (O, L), GQA by head mapping, bottom-right causal, fully masked rows O = 0,
    L = +inf."""
    G = Q.shape[-3] // K.shape[-3]
    q, k, v = Q.double(), K.double().repeat_interleave(G, -3), V.double().repeat_interleave(G, -3)
    S = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        N_q, N_k = S.shape[-2:]
        S = S.masked_fill(~torch.ones(N_q, N_k, dtype=torch.bool, device=S.device).tril(N_k - N_q), -torch.inf)
    L = torch.logsumexp(S, -1)
    P = torch.exp(S - L[..., None]).nan_to_num(0.0)
    return P @ v, L


def check(O, L, Q, K, V, causal):
    O_ref, L_ref = reference(Q, K, V, causal)
    G = Q.shape[-3] // K.shape[-3]
    kr, vr = K.repeat_interleave(G, -3), V.repeat_interleave(G, -3)
    N_q, N_k = Q.shape[-2], K.shape[-2]
    mask = torch.ones(N_q, N_k, dtype=torch.bool, device=Q.device).tril(N_k - N_q) if causal else None
    O_pt = torch.nn.functional.scaled_dot_product_attention(Q, kr, vr, attn_mask=mask).nan_to_num(0.0)
    err = (O.double() - O_ref).abs().max().item()
    err_pt = (O_pt.double() - O_ref).abs().max().item()
    assert not O.isnan().any() and not L.isnan().any()
    assert err <= 2 * err_pt + 1e-3, (err, err_pt)
    finite = torch.isfinite(L_ref)
    assert torch.equal(torch.isinf(L), ~finite)
    torch.testing.assert_close(L[finite].double(), L_ref[finite], rtol=1e-4, atol=1e-4)
    assert (O[~finite] == 0).all()


SHAPES = [  # (Q shape, K/V shape, causal)
    ((2, 4, 1000, 64), (2, 2, 1000, 64), False),      # GQA
    ((1, 8, 777, 128), (1, 8, 1029, 128), True),      # ragged, N_q < N_k, bottom-right causal
    ((1, 2, 300, 96), (1, 1, 200, 96), True),         # d = 96, N_q > N_k: 100 fully masked rows per head
    ((1, 2, 513, 256), (1, 2, 513, 256), False),      # the largest head dimension
    ((4, 1, 129, 8), (4, 1, 65, 8), False),           # the smallest
]


# every shape for the fastest rung; the first two (d = 64 and 128, GQA, causal ragged) for every rung
CASES = [(v, shape) for v in list(VERSIONS) for shape in (SHAPES if v == list(VERSIONS)[-1] else SHAPES[:2])]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("version, shape", CASES,
                         ids=[f"{v}-{s[0]}x{s[1]}-{'causal' if s[2] else 'full'}" for v, s in CASES])
def test_rung_matches_oracle(version, dtype, shape):
    shape_q, shape_kv, causal = shape
    g = torch.Generator(device="cuda").manual_seed(hash((version, dtype, shape_q)) % 2**31)
    tdt = getattr(torch, dtype)
    Q = torch.randn(shape_q, device="cuda", generator=g).to(tdt)
    K = torch.randn(shape_kv, device="cuda", generator=g).to(tdt)
    V = torch.randn(shape_kv, device="cuda", generator=g).to(tdt)
    O, L = VERSIONS[version](Q, K, V, causal=causal)
    torch.cuda.synchronize()
    assert O.dtype == tdt and O.shape == Q.shape and L.shape == Q.shape[:-1]
    check(O, L, Q, K, V, causal)


def test_extreme_logits():
    Q, K, V = (torch.randn(1, 4, 600, 64, device="cuda").half() for _ in range(3))
    Q = (Q.float() * 8).half()          # scores in the hundreds
    for version in list(VERSIONS):
        O, L = VERSIONS[version](Q, K, V, causal=True)
        check(O, L, Q, K, V, True)


@pytest.mark.parametrize("version", list(VERSIONS))
def test_forward_is_deterministic(version):
    """Bit-identical over 100 reruns (a result that changes between runs on the same inputs is a race)."""
    Q, K, V = (torch.randn(2, 8, 1024, 64, device="cuda").half() for _ in range(3))
    O0, L0 = VERSIONS[version](Q, K, V, causal=True)
    for _ in range(99):
        O, L = VERSIONS[version](Q, K, V, causal=True)
        assert torch.equal(O, O0) and torch.equal(L, L0)


# -- the driver-level launch against numba's ordinary one ------------------------------------------------------------

def test_lean_launch_equals_numba_launch(monkeypatch):
    """The hand-packed parameters (kernels_gpu.driver_launch) launch the same kernel on the same memory as numba's
    own call: bit-identical results, forward and backward, for CUDA tensors and numba device arrays."""
    from numba import cuda

    from kernels_gpu import driver_launch, tensorcore
    Q = torch.randn(2, 4, 333, 128, device="cuda").half()
    K, V = (torch.randn(2, 2, 517, 128, device="cuda").half() for _ in range(2))
    dO = torch.randn_like(Q)
    assert driver_launch.enabled()
    from kernels_gpu.tensorcore import backward_launch, launch
    launch._PLANS.clear()
    backward_launch._PLANS.clear()
    O1, L1 = tensorcore.flash2_forward(Q, K, V, causal=True)       # the full road; leaves a plan
    g1 = tensorcore.flash2_backward(Q, K, V, O1, L1, dO, causal=True)
    assert len(launch._PLANS) == 1 and len(backward_launch._PLANS) == 1
    O1b, L1b = tensorcore.flash2_forward(Q, K, V, causal=True)     # the plan's road
    g1b = tensorcore.flash2_backward(Q, K, V, O1, L1, dO, causal=True)
    O_nc, _ = tensorcore.flash2_forward(Q, K, V, causal=False)     # another key: not the causal plan
    assert len(launch._PLANS) == 2
    torch.cuda.synchronize()
    assert torch.equal(O1, O1b) and torch.equal(L1, L1b) and not torch.equal(O_nc, O1)
    for a, b in zip(g1, g1b):
        assert torch.equal(a, b)
    Od1, Ld1 = tensorcore.flash2_forward(*(cuda.to_device(x.cpu().numpy()) for x in (Q, K, V)), causal=True)
    monkeypatch.setenv("FA2EDU_LEAN_LAUNCH", "0")
    assert not driver_launch.enabled()
    O2, L2 = tensorcore.flash2_forward(Q, K, V, causal=True)
    g2 = tensorcore.flash2_backward(Q, K, V, O1, L1, dO, causal=True)
    Od2, Ld2 = tensorcore.flash2_forward(*(cuda.to_device(x.cpu().numpy()) for x in (Q, K, V)), causal=True)
    torch.cuda.synchronize()
    assert torch.equal(O1, O2) and torch.equal(L1, L2)
    for a, b in zip(g1, g2):                      # v3 computes dQ in a pass of its own: no atomics
        assert torch.equal(a, b)
    np.testing.assert_array_equal(Od1.copy_to_host(), Od2.copy_to_host())
    np.testing.assert_array_equal(Ld1.copy_to_host(), Ld2.copy_to_host())
    check(O1, L1, Q, K, V, True)


def test_launch_follows_pytorch_current_stream():
    """Launched on a side stream, the kernel is ordered after the work queued there before it: Q is written on
    the side stream just before the call, and the result is that of the new Q."""
    from kernels_gpu import tensorcore
    Q, K, V = (torch.randn(4, 8, 1024, 64, device="cuda").half() for _ in range(3))
    expected, _ = tensorcore.flash2_forward(Q * 2, K, V)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        Q2 = torch.empty_like(Q)
        for _ in range(20):                       # keep the side stream busy before Q2 holds its final value
            Q2.copy_(Q)
        Q2.mul_(2)
        O, _ = tensorcore.flash2_forward(Q2, K, V)
    side.synchronize()
    assert torch.equal(O, expected)
