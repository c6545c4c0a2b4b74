"""kernels_gpu.hopper on an H100/H200: each Hopper instruction against the NumPy specification its simulator twin
implements (so twin and hardware agree through one spec), and every forward rung against the float64 oracle with
flash-attn's rule, outputs poisoned first; the backward rungs the same way, gradients against the float64 oracle.

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_hopper_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")

import kernels_gpu.runtime as rt  # noqa: E402
from kernels_gpu.hopper import BACKWARD_VERSIONS, VERSIONS, selftest  # noqa: E402

if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Hopper kernels need an sm_90 GPU", allow_module_level=True)

from test_tensorcore_backward_gpu import _inputs  # noqa: E402  (tests/gpu is on sys.path)
from test_tensorcore_backward_gpu import check as check_gradients  # noqa: E402
from test_tensorcore_gpu import check  # noqa: E402  (the oracle and flash-attn's rule)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


WGMMA_CASES = [  # (N, A from, trans_b, swizzle of A, swizzle of B, A's start byte, B's start byte)
    (64, "smem", False, 1, 1, 0, 8192), (128, "smem", False, 1, 1, 32, 8192 + 64), (256, "smem", False, 1, 1, 96, 8192),
    (16, "smem", False, 0, 0, 0, 8192), (32, "smem", False, 2, 2, 0, 8192), (8, "smem", False, 1, 1, 0, 8192),
    (64, "regs", True, 1, 1, 0, 8192), (128, "regs", True, 1, 1, 0, 8192 + 2048), (256, "regs", True, 1, 1, 0, 0),
    (48, "regs", True, 1, 1, 0, 8192), (16, "regs", True, 0, 0, 0, 8192), (64, "regs", True, 1, 2, 0, 8192),
    (64, "regs", False, 1, 1, 0, 8192),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", WGMMA_CASES, ids=[f"n{c[0]}-{c[1]}-{'mn' if c[2] else 'k'}-sw{c[3]}{c[4]}"
                                                    for c in WGMMA_CASES])
def test_wgmma_instruction(dtype, case):
    N, a_from, trans_b, mode_a, mode_b, a_start, b_start = case
    got, expected = selftest.check_wgmma(dtype, N, a_from, trans_b, mode_a, mode_b, seed=N, a_start=a_start,
                                         b_start=b_start)
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6)


def test_named_barriers_and_elect():
    got, expected = selftest.check_named_barrier()
    np.testing.assert_array_equal(got, expected)


SHAPES = [  # (Q shape, K/V shape, causal)
    ((2, 4, 1000, 64), (2, 2, 1000, 64), False),      # GQA
    ((1, 8, 777, 128), (1, 8, 1029, 128), True),      # ragged, N_q < N_k, bottom-right causal
    ((1, 2, 300, 96), (1, 1, 200, 96), True),         # d = 96, N_q > N_k: 100 fully masked rows per head
    ((1, 2, 513, 256), (1, 2, 513, 256), False),      # the largest head dimension
    ((4, 1, 129, 8), (4, 1, 65, 8), False),           # the smallest
    ((1, 3, 200, 40), (1, 1, 333, 40), True),         # MQA, d = 40 (not a multiple of 16)
    ((1, 2, 260, 200), (1, 2, 260, 200), True),       # d = 200: four panels, the last part zero
]
CASES = [(v, shape) for v in VERSIONS for shape in SHAPES]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("version, shape", CASES,
                         ids=[f"{v}-{s[0]}x{s[1]}-{'causal' if s[2] else 'full'}" for v, s in CASES])
def test_rung_matches_oracle(version, dtype, shape):
    shape_q, shape_kv, causal = shape
    seed = (sorted(VERSIONS).index(version) * 1000 + SHAPES.index(shape) * 10 + (dtype == "bfloat16"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    Q = torch.randn(shape_q, device="cuda", generator=g).to(tdt)
    K = torch.randn(shape_kv, device="cuda", generator=g).to(tdt)
    V = torch.randn(shape_kv, device="cuda", generator=g).to(tdt)
    O, L = VERSIONS[version](Q, K, V, causal=causal)
    torch.cuda.synchronize()
    assert O.dtype == tdt and O.shape == Q.shape and L.shape == Q.shape[:-1]
    check(O, L, Q, K, V, causal)


@pytest.mark.parametrize("version", list(VERSIONS))
def test_extreme_logits(version):
    g = torch.Generator(device="cuda").manual_seed(7)
    Q, K, V = (torch.randn(1, 4, 600, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    Q = (Q.float() * 8).bfloat16()          # scores in the hundreds
    O, L = VERSIONS[version](Q, K, V, causal=True)
    check(O, L, Q, K, V, True)


@pytest.mark.parametrize("version", list(VERSIONS))
def test_forward_is_deterministic(version):
    """Bit-identical over 100 reruns (a result that changes between runs on the same inputs is a race)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    Q, K, V = (torch.randn(2, 8, 1024, 128, device="cuda", generator=g).half() for _ in range(3))
    O0, L0 = VERSIONS[version](Q, K, V, causal=True)
    for _ in range(99):
        O, L = VERSIONS[version](Q, K, V, causal=True)
        assert torch.equal(O, O0) and torch.equal(L, L0)


# -- the backward ladder --------------------------------------------------------------------------------------------

BACKWARD_SHAPES = [  # (Q shape, K/V shape, causal): every head dimension class the backward takes (d ≤ 128)
    ((2, 4, 1000, 64), (2, 2, 1000, 64), False),      # GQA
    ((1, 8, 777, 128), (1, 8, 1029, 128), True),      # ragged, N_q < N_k, bottom-right causal
    ((1, 2, 300, 96), (1, 1, 200, 96), True),         # d = 96, N_q > N_k: 100 rows per head see no key
    ((4, 1, 129, 8), (4, 1, 65, 8), False),           # the smallest
    ((1, 3, 200, 40), (1, 1, 333, 40), True),         # MQA, d = 40 (not a multiple of 16)
    ((1, 16, 2048, 128), (1, 16, 2048, 128), False),  # benchmark-like: hidden 2048 at d = 128
]
BACKWARD_CASES = [(v, s) for v in BACKWARD_VERSIONS for s in BACKWARD_SHAPES]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("version, shape", BACKWARD_CASES,
                         ids=[f"{v}-{s[0]}x{s[1]}-{'causal' if s[2] else 'full'}" for v, s in BACKWARD_CASES])
def test_backward_rung_matches_oracle(version, dtype, shape):
    shape_q, shape_kv, causal = shape
    Q, K, V, dO = _inputs(shape_q, shape_kv, dtype, seed=hash((version, dtype, shape_q)) % 2**31)
    O, L = VERSIONS["h2"](Q, K, V, causal=causal)
    grads = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=causal)
    torch.cuda.synchronize()
    check_gradients(grads, Q, K, V, dO, causal)


@pytest.mark.parametrize("version", list(BACKWARD_VERSIONS))
def test_backward_extreme_logits(version):
    """Scores ×30: P = exp(S − L) recomputed from L as the forward computed it, never from an overflowing exp(S)."""
    Q, K, V, dO = _inputs((1, 4, 600, 64), (1, 4, 600, 64), "bfloat16", seed=11, scale=30 ** 0.5)
    O, L = VERSIONS["h2"](Q, K, V, causal=True)
    check_gradients(BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True), Q, K, V, dO, True)


@pytest.mark.parametrize("version", list(BACKWARD_VERSIONS))
def test_backward_dk_dv_bit_identical_over_reruns(version):
    """dK, dV are sums inside one block in a fixed order: bit-identical over 20 reruns; dQ, a sum of atomic adds in
    varying order, within float32 rounding of the first run."""
    Q, K, V, dO = _inputs((2, 8, 1024, 64), (2, 4, 1024, 64), "float16", seed=12)
    O, L = VERSIONS["h2"](Q, K, V, causal=True)
    dQ0, dK0, dV0 = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True)
    scale = dQ0.float().abs().max().item()
    for _ in range(19):
        dQ, dK, dV = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True)
        assert torch.equal(dK, dK0) and torch.equal(dV, dV0)
        assert (dQ.float() - dQ0.float()).abs().max().item() <= 2e-3 * scale


@pytest.mark.parametrize("version", list(BACKWARD_VERSIONS))
def test_backward_deterministic_mode(version):
    """``deterministic=True``: the oracle's rule on a ragged causal GQA case, and dQ, dK, dV bit-identical over 100
    reruns."""
    Q, K, V, dO = _inputs((2, 8, 777, 128), (2, 4, 1029, 128), "bfloat16", seed=13)
    O, L = VERSIONS["h2"](Q, K, V, causal=True)
    first = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True, deterministic=True)
    check_gradients(first, Q, K, V, dO, True)
    for _ in range(99):
        again = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
