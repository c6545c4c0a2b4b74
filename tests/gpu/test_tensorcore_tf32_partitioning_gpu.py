"""TF32 and FA2 Section 3.3 on a real GPU: ``mma.m16n8k8`` tf32 and ``cvt.rna.tf32.f32`` against the NumPy
specification their simulator twins implement (so twin and hardware agree through one spec), the TF32 forward
against the float64 oracle within the bound tf32's unit roundoff gives, and the split-K / split-Q forwards against
the oracle by flash-attn's rule; every one bit-identical over 100 reruns.

Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_tensorcore_tf32_partitioning_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":  # the conftest skips these too; never compile for the simulator here
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")

from test_tensorcore_gpu import check, reference  # noqa: E402  (the ladder's oracle rule)

import kernels_gpu.runtime as rt  # noqa: E402
from kernels_gpu.tensorcore import PARTITIONING, TF32, selftest  # noqa: E402
from kernels_gpu.tensorcore.flash2_forward_tf32 import error_against_fp32, tf32_error_bound  # noqa: E402


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


# -- the instructions against the specification -----------------------------------------------------------------

def test_cvt_tf32_instruction():
    """Round to nearest, ties away from zero, on the 13 dropped bits: bit for bit."""
    got, expected = selftest.check_cvt_tf32(seed=8)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 1.0), (2, 1e3), (3, 1e-3)])
def test_mma_tf32_instruction(seed, scale):
    """The specification sums the eight exact products and C exactly and rounds once; the tensor core's order and
    intermediate rounding are its own. Each of its at most nine additions errs by at most one float32 ulp of the
    running magnitude, so |got − spec| ≤ 10·2⁻²³·(Σ|a·b| + |c|) (one more ulp for the spec's own rounding)."""
    got, expected, magnitude = selftest.check_mma_tf32(seed=seed, scale=scale)
    assert (np.abs(got.astype(np.float64) - expected) <= 10 * 2.0 ** -23 * magnitude).all()


# -- the TF32 forward ---------------------------------------------------------------------------------------------

SHAPES = [  # (Q shape, K/V shape, causal)
    ((2, 4, 1000, 64), (2, 2, 1000, 64), False),      # GQA
    ((1, 8, 777, 128), (1, 8, 1029, 128), True),      # ragged, N_q < N_k, bottom-right causal
    ((1, 2, 300, 96), (1, 1, 200, 96), True),         # d = 96, N_q > N_k: 100 fully masked rows per head
    ((1, 2, 513, 256), (1, 2, 513, 256), False),      # the largest head dimension
    ((4, 1, 129, 8), (4, 1, 65, 8), False),           # the smallest
]
IDS = [f"{s[0]}x{s[1]}-{'causal' if s[2] else 'full'}" for s in SHAPES]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_tf32_forward_within_bound(shape):
    shape_q, shape_kv, causal = shape
    g = torch.Generator(device="cuda").manual_seed(hash(shape_q) % 2**31)
    Q = torch.randn(shape_q, device="cuda", generator=g)
    K, V = (torch.randn(shape_kv, device="cuda", generator=g) for _ in range(2))
    res = TF32["tf32"](Q, K, V, causal=causal)
    torch.cuda.synchronize()
    assert res.precision == "tf32"
    O, L = (torch.as_tensor(x, device="cuda") for x in res)
    O_ref, L_ref = reference(Q, K, V, causal)
    seen = torch.isfinite(L_ref)
    assert not O.isnan().any() and not L.isnan().any()
    assert torch.equal(torch.isinf(L), ~seen) and (O[~seen] == 0).all()
    bound_O, bound_L = (torch.as_tensor(b, device="cuda") for b in tf32_error_bound(*(x.cpu().numpy()
                                                                                         for x in (Q, K, V))))
    err = (O.double() - O_ref.nan_to_num(0.0)).abs()
    assert (err <= bound_O).all(), (err.max().item(), bound_O.min().item())
    slack = 2.0 ** -20 * (1 + L_ref[seen].abs())
    assert ((L.double()[seen] - L_ref[seen]).abs() <= bound_L[seen] + slack).all()


def test_tf32_error_beside_fp32():
    """The report the benchmark records: TF32 ~1e-3, kernels_gpu.fast's float32 ~1e-6, on the same inputs."""
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((2, 4, 512, 64)).astype(np.float32) for _ in range(3))
    report = error_against_fp32(Q, K, V, causal=True)
    print(report)
    assert report["fp32"] < 1e-5 and 100 * report["fp32"] < report["tf32"] <= report["tf32_bound"]


# -- split-K and split-Q -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["split-k", "split-q"])
@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:], ids=IDS[:3] + IDS[4:])
def test_partitioning_matches_oracle(variant, dtype, shape):
    shape_q, shape_kv, causal = shape
    g = torch.Generator(device="cuda").manual_seed(hash((variant, dtype, shape_q)) % 2**31)
    tdt = getattr(torch, dtype)
    Q = torch.randn(shape_q, device="cuda", generator=g).to(tdt)
    K, V = (torch.randn(shape_kv, device="cuda", generator=g).to(tdt) for _ in range(2))
    O, L = PARTITIONING[variant](Q, K, V, causal=causal)
    torch.cuda.synchronize()
    check(O, L, Q, K, V, causal)


def test_partitioning_extreme_logits():
    Q, K, V = (torch.randn(1, 4, 600, 64, device="cuda").half() for _ in range(3))
    Q = (Q.float() * 8).half()          # scores in the hundreds
    for variant in PARTITIONING:
        O, L = PARTITIONING[variant](Q, K, V, causal=True)
        check(O, L, Q, K, V, True)


@pytest.mark.parametrize("name", ["split-k", "split-q", "tf32"])
def test_deterministic(name):
    """Bit-identical over 100 reruns (a result that changes between runs on the same inputs is a race: split-K's
    exchange buffer is the place one would hide)."""
    dtype = torch.float32 if name == "tf32" else torch.float16
    forward = TF32["tf32"] if name == "tf32" else PARTITIONING[name]
    Q, K, V = (torch.randn(2, 8, 1024, 64, device="cuda").to(dtype) for _ in range(3))
    O0, L0 = (torch.as_tensor(x, device="cuda").clone() for x in forward(Q, K, V, causal=True))
    for _ in range(99):
        O, L = (torch.as_tensor(x, device="cuda") for x in forward(Q, K, V, causal=True))
        assert torch.equal(O, O0) and torch.equal(L, L0)
