"""fa2edu.torch on a real GPU: the dispatch table's kernels behind the registered operator, against PyTorch.

Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_torch_gpu.py -q -p no:cacheprovider

Checks, for CUDA float32 (``kernels_gpu.fast``), float16 and bfloat16 (``kernels_gpu.tensorcore``): the forward
output, L and the three gradients against a float64 oracle by flash-attn's rule (error ≤ 2 × the error of PyTorch's
own attention in the same dtype, plus a small floor); odd head dimensions 1 … 256 (padded inside the op); GQA;
causal with N_q ≠ N_k and fully masked rows; ``return_lse``; the teaching kernels by name; the tensor-core backward
and its float32 fallback; ``torch.library.opcheck`` and ``torch.compile(fullgraph=True)`` on CUDA; side streams,
non-contiguous inputs, autocast, and the small GPT training the same with either attention.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")]

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tolerances import assert_close_to_oracle  # noqa: E402

from fa2edu import _torch_ops as ops  # noqa: E402
from fa2edu.torch import flash_attention  # noqa: E402

F = torch.nn.functional
CUDA = "cuda"
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = [F32, F16, BF16]

# (q shape, k shape, d_v, causal): GQA, N_q ≠ N_k, ragged sizes, d_v ≠ d, d = 32, 64 and 128.
CASES = {
    "gqa-causal": ((2, 8, 200, 64), (2, 2, 200, 64), 64, True),
    "Nq<Nk-causal": ((1, 4, 77, 64), (1, 4, 300, 64), 64, True),
    "plain-Nq>Nk": ((3, 2, 129, 32), (3, 2, 95, 32), 32, False),
    "dv-differs": ((1, 4, 100, 64), (1, 2, 130, 64), 40, True),
    "d128": ((1, 2, 256, 128), (1, 2, 256, 128), 128, True),
}


@pytest.fixture(autouse=True)
def same_dtype_baselines():
    """SDPA's baseline must compute in the dtype it is the baseline of (flash-attn's rule compares with attention
    computed in the same dtype). float32: true float32 (TF32 would make it look worse than it is). float16 and
    bfloat16: SDPA's math backend — which it takes for head sizes its fused kernels refuse (d = 1, 7, 59, …) —
    computes in float32 and rounds once unless fp16/bf16 reductions are allowed, and would be a float32 baseline
    for a 16-bit kernel (on an H100 at d = 1, bfloat16, the op's gradients came out up to 1.8× over twice that
    float32-computed error, and within the rule against the bfloat16 one)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved[0]
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(saved[1])


def draw(q_shape, k_shape, d_v, dtype, seed=0):
    """q, k, v, dO drawn in float64 on the CPU (the same numbers for every dtype), moved and rounded."""
    generator = torch.Generator().manual_seed(seed)
    shapes = (q_shape, k_shape, k_shape[:-1] + (d_v,), q_shape[:-1] + (d_v,))
    return [torch.randn(s, generator=generator, dtype=F64).to(device=CUDA, dtype=dtype) for s in shapes]


def with_grads(attention, q, k, v, dO):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    O = attention(q, k, v)
    O.backward(dO)
    return [x.detach() for x in (O, q.grad, k.grad, v.grad)]


def sdpa(causal):
    """SDPA with fa2edu's bottom-right causal mask and GQA."""
    def attention(q, k, v):
        N_q, N_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(N_q, N_k, dtype=torch.bool, device=q.device).tril(N_k - N_q) if causal else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return attention


def lse_reference(q, k, causal):
    """L = logsumexp(τ q kᵀ + mask) in float64, +inf on rows that see no key."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    S = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        N_q, N_k = q.shape[-2], k.shape[-2]
        S = S.masked_fill(~torch.ones(N_q, N_k, dtype=torch.bool, device=q.device).tril(N_k - N_q), -math.inf)
    L = torch.logsumexp(S, -1)
    return torch.where(torch.isneginf(L), torch.full_like(L, math.inf), L)


def assert_flash_attn_rule(ours, q, k, v, dO, causal, label, floor=1e-5):
    """ours = (O, dQ, dK, dV) against SDPA in float64, within 2 × SDPA's own error in q's dtype + a floor
    (``floor`` × the largest |value| in float32: see ``tests/tolerances.py``)."""
    oracle = with_grads(sdpa(causal), *(x.double() for x in (q, k, v, dO)))
    baseline = with_grads(sdpa(causal), q, k, v, dO)
    like = np.float32 if q.dtype == F32 else np.float16
    for name, x, ref, low in zip(("O", "dQ", "dK", "dV"), ours, oracle, baseline):
        assert x.device.type == "cuda" and x.dtype == q.dtype and x.shape == ref.shape, name
        expected = ref.cpu().numpy()
        error = float(np.max(np.abs(low.double().cpu().numpy() - expected)))
        assert_close_to_oracle(x.double().cpu().numpy(), expected, f"{label} {name}", dtype=like, baseline=error,
                               floor=floor)


# -- the default backends: float32 → fast, float16/bfloat16 → tensorcore -------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_matches_sdpa(case, dtype):
    q_shape, k_shape, d_v, causal = CASES[case]
    q, k, v, dO = draw(q_shape, k_shape, d_v, dtype)
    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dO)
    assert_flash_attn_rule(ours, q, k, v, dO, causal, f"{case} {dtype}")


@pytest.mark.parametrize("d", [64, 128])
def test_float32_extreme_logits(d):
    """Scores in the hundreds (q, k scaled by 4, GQA 2:1, causal), float32: the fast backward recomputes P from the
    forward's L, so its scores must be rounded as the forward's (``kernels_gpu.fast.flash2_backward_v4``; v3 missed
    the rule here, dK at 3.7× SDPA's error). The floor is float32's (2⁻²⁰ of the largest value), not the default
    1e-5, which would hide a 3× miss at these magnitudes."""
    q, k, v, dO = draw((1, 4, 600, d), (1, 2, 600, d), d, F32, seed=5)
    q, k = q * 4, k * 4
    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    assert_flash_attn_rule(ours, q, k, v, dO, True, f"extreme logits d = {d}", floor=2.0 ** -20)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 7, 8, 40, 59, 111, 160, 200, 256])
def test_odd_head_dimensions_are_padded(d, dtype):
    q, k, v, dO = draw((1, 4, 150, d), (1, 2, 170, d), d, dtype, seed=d)
    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    assert_flash_attn_rule(ours, q, k, v, dO, True, f"d = {d} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_return_lse_and_fully_masked_rows(dtype):
    # causal with N_q = 90 > N_k = 60: the first 30 rows see no key: O = 0, L = +inf, dQ = 0, no NaN anywhere
    q, k, v, dO = draw((2, 4, 90, 64), (2, 2, 60, 64), 64, dtype, seed=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    O, L = flash_attention(*leaves, causal=True, return_lse=True)
    O.backward(dO)
    assert L.dtype == F32 and L.shape == (2, 4, 90) and not L.requires_grad
    assert not any(torch.isnan(x).any() for x in (O, L, *(t.grad for t in leaves)))
    assert (O[..., :30, :] == 0).all() and torch.isposinf(L[..., :30]).all()
    assert (leaves[0].grad[..., :30, :] == 0).all()
    L_ref = lse_reference(q, k, True)
    seen = torch.isfinite(L_ref)
    assert float((L.double() - L_ref)[seen].abs().max()) <= 1e-4 * max(1.0, float(L_ref[seen].abs().max()))


def test_the_default_is_never_the_teaching_kernel(monkeypatch):
    calls = []
    for name in ("_fast_forward", "_tensor_core_forward"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    q, k, v, _ = draw((1, 2, 64, 64), (1, 2, 64, 64), 64, F32)
    flash_attention(q, k, v)
    flash_attention(q.half(), k.half(), v.half())
    flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert calls == ["_fast_forward", "_tensor_core_forward", "_tensor_core_forward"]


# -- the teaching kernels by name, and the tensor-core backward and its fallback ------------------------------------

@pytest.mark.parametrize("algorithm", ["flash2", "standard"])
@pytest.mark.parametrize("case", ["gqa-causal", "plain-Nq>Nk"])
def test_teaching_kernels_by_name(case, algorithm):
    q_shape, k_shape, d_v, causal = CASES[case]
    q, k, v, dO = draw(q_shape, k_shape, d_v, F32, seed=3)
    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal, algorithm=algorithm,
                                                      backend="teaching"), q, k, v, dO)
    assert_flash_attn_rule(ours, q, k, v, dO, causal, f"teaching {algorithm} {case}")


@pytest.mark.parametrize("which", ["tensor cores", "float32 fallback"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_16_bit_backward_both_ways(dtype, which, monkeypatch):
    tensorcore = ops._tensorcore()
    if which == "tensor cores" and not hasattr(tensorcore, "flash2_backward"):
        pytest.skip("kernels_gpu.tensorcore has no flash2_backward yet: the op uses the float32 fallback")
    if which == "float32 fallback":
        monkeypatch.setattr(ops, "_tensorcore", lambda: SimpleNamespace(flash2_forward=tensorcore.flash2_forward))
    q, k, v, dO = draw((2, 8, 300, 128), (2, 2, 300, 128), 128, dtype, seed=4)
    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    assert_flash_attn_rule(ours, q, k, v, dO, True, f"{which} {dtype}")


# -- the registered operator: opcheck and torch.compile on CUDA ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_on_cuda(dtype):
    q, k, v, dO = draw((1, 4, 70, 40), (1, 2, 90, 40), 40, dtype, seed=5)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    backend = ops.choose_backend("cuda", dtype)
    result = torch.library.opcheck(ops.flash_attention_fwd, (q, k, v, True, 40 ** -0.5, backend, None, None))
    assert set(result.values()) == {"SUCCESS"}, result
    O, L = ops.flash_attention_fwd(q.detach(), k.detach(), v.detach(), True, 40 ** -0.5, backend, None, None)
    args = (dO, q.detach(), k.detach(), v.detach(), O, L, True, 40 ** -0.5, backend, None, None)
    result = torch.library.opcheck(ops.flash_attention_bwd, args)
    assert set(result.values()) == {"SUCCESS"}, result


class Attention(torch.nn.Module):
    """One GPT attention layer (non-contiguous q, k, v views of one projection) calling the op."""

    def __init__(self, d_model=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = (t.view(B, N, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        return self.proj(flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("precision", ["float32", "bfloat16 autocast"])
def test_compile_fullgraph_on_cuda(precision):
    try:
        import triton  # noqa: F401
        backend = "inductor"
    except ImportError:
        backend = "aot_eager"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Attention().to(CUDA)
    x = torch.randn(2, 300, 256, device=CUDA)
    runs = []
    for run in (model, torch.compile(model, fullgraph=True, backend=backend)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=BF16, enabled=precision != "float32"):
            y = run(x)
        y.float().square().mean().backward()
        runs.append([y.detach().float()] + [p.grad.clone() for p in model.parameters()])
    tolerance = dict(rtol=1e-4, atol=1e-5) if precision == "float32" else dict(rtol=2e-2, atol=2e-3)
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, **tolerance)


# -- streams, layouts, errors and a model ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs_and_a_side_stream(dtype):
    # (B, N, H, d) projections viewed as (B, H, N, d), computed while PyTorch works on a side stream.
    generator = torch.Generator().manual_seed(3)
    q, k, v, dO = (torch.randn(2, 150, 4, 64, generator=generator).to(CUDA, dtype).transpose(1, 2)
                   for _ in range(4))
    expected = with_grads(lambda q, k, v: flash_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                          causal=True), q, k, v, dO)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    torch.cuda.synchronize()
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        assert float((a.float() - b.float()).abs().max()) <= 1e-5 * max(1.0, float(b.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_eager_and_traced_roads_on_cuda(dtype, monkeypatch):
    # flash_attention's eager road (its autograd Function, no dispatcher) and its traced road (the registered
    # operators, as torch.compile runs them) launch the same kernels on the same arguments: the same bits.
    import fa2edu.torch as op
    q, k, v, dO = gpt_views(2, 150, 4, 64, dtype, seed=5)
    eager = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    monkeypatch.setattr(op, "_eager", lambda *tensors: False)
    traced = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    for a, b in zip(eager, traced):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_call_from_a_new_thread(dtype):
    # A thread that has made no CUDA call has no current CUDA context; the kernels launch through the driver,
    # which needs one (kernels_gpu.driver_launch binds it): the thread's forward and backward equal this thread's.
    import threading
    q, k, v, dO = gpt_views(1, 70, 2, 64, dtype, seed=6)
    expected = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    got, errors = [], []

    def work():
        try:
            # first the forward alone: on the tensor cores the thread's first CUDA work is the kernel's launch
            got.append(flash_attention(q, k, v, causal=True))
            got.extend(with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO))
        except Exception as error:           # re-raised below, in the test's thread
            errors.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the call did not return within 120 s"
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    assert len(got) == 5
    for a, b in zip(got, [expected[0]] + expected):
        assert torch.equal(a, b)


def gpt_views(B, N, H, d, dtype, seed):
    """q, k, v as a GPT makes them — (B, H, N, d) views of one (B, N, 3·H·d) projection — and dO as its backward
    brings it — a (B, H, N, d) view of a (B, N, H·d) gradient."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3 * H * d, generator=generator).to(CUDA, dtype)
    q, k, v = (t.view(B, N, H, d).transpose(1, 2) for t in qkv.split(H * d, dim=2))
    dO = torch.randn(B, N, H * d, generator=generator).to(CUDA, dtype).view(B, N, H, d).transpose(1, 2)
    return q, k, v, dO


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("d", [64, 128, 40])
def test_tensor_cores_read_strided_inputs_in_place(dtype, d):
    """GPT-shaped strided q, k, v, dO give the bits of their contiguous copies; O and the gradients come back laid
    out like q, k, v ((B, N, H, d) in memory), so the model's transpose-and-reshape copies nothing; at d = 64 and
    128 (no padding) the forward and backward run no copy kernel at all."""
    from kernels_gpu.tensorcore.launch import layout_strides
    q, k, v, dO = gpt_views(2, 300, 4, d, dtype, seed=d)
    got = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    expected = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True),
                          *(x.contiguous() for x in (q, k, v)), dO.contiguous())
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for out, like in zip(got, (q, q, k, v)):
        assert out.stride() == layout_strides(like) and out.transpose(1, 2).is_contiguous()
    if d % 8 == 0:                                               # the two operators alone, as autograd calls them
        from torch.profiler import ProfilerActivity, profile

        def both():
            O, L = ops.flash_attention_fwd(q, k, v, True, d ** -0.5, "tensorcore", None, None)
            return ops.flash_attention_bwd(dO, q, k, v, O, L, True, d ** -0.5, "tensorcore", None, None)

        both()                                                   # plans made outside the profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            both()
            torch.cuda.synchronize()
        kernels = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
        assert len(kernels) == 4, kernels                        # forward; preprocess, key-block, dQ
        assert not [k for k in kernels if "elementwise" in k or "copy" in k.lower()], kernels


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_opcheck_on_strided_inputs(dtype):
    """The fakes promise the strides the tensor-core kernels deliver for GPT-shaped views (opcheck compares)."""
    q, k, v, dO = gpt_views(1, 130, 2, 64, dtype, seed=9)
    result = torch.library.opcheck(ops.flash_attention_fwd, (q, k, v, True, 0.125, "tensorcore", None, None))
    assert set(result.values()) == {"SUCCESS"}, result
    O, L = ops.flash_attention_fwd(q, k, v, True, 0.125, "tensorcore", None, None)
    result = torch.library.opcheck(ops.flash_attention_bwd, (dO, q, k, v, O, L, True, 0.125, "tensorcore", None,
                                                             None))
    assert set(result.values()) == {"SUCCESS"}, result


def test_misaligned_views_are_copied_and_still_laid_out_like_q():
    """Rows 16-byte aligned is what cp.async needs: a view whose rows are not (d = 8 columns out of 12) is copied
    for the kernels, and O still comes back in q's layout, equal to the contiguous result."""
    from kernels_gpu.tensorcore.launch import layout_strides, zero_copy
    base = torch.randn(2, 3, 50, 12, device=CUDA, dtype=BF16)
    q = k = v = base[..., :8]
    assert not zero_copy(q)
    O = flash_attention(q, k, v)
    assert O.stride() == layout_strides(q)
    assert torch.equal(O, flash_attention(q.contiguous(), k.contiguous(), v.contiguous()))


def test_autocast_runs_the_tensor_core_kernels():
    q, k, v, _ = draw((1, 2, 64, 64), (1, 2, 64, 64), 64, F32)
    with torch.autocast("cuda", dtype=BF16):
        O = flash_attention(q, k, v, causal=True)
    assert O.dtype == BF16
    torch.testing.assert_close(O, flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True))


def test_cuda_matches_the_cpu_path():
    q, k, v, dO = draw(*CASES["gqa-causal"][:3], F32, seed=1)
    gpu = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    cpu = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), *(x.cpu() for x in (q, k, v, dO)))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), gpu, cpu):
        scale = max(1.0, float(b.abs().max()))
        assert float((a.cpu() - b).abs().max()) <= 1e-4 * scale, name


def test_cuda_errors():
    q, k, v, _ = draw(*CASES["plain-Nq>Nk"][:3], F32)
    with pytest.raises(TypeError, match="on CUDA flash_attention takes float32 or float16 or bfloat16"):
        flash_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="runs on the CPU only"):
        flash_attention(q, k, v, algorithm="flash1")
    with pytest.raises(ValueError, match="M .* applies to the NumPy backend"):
        flash_attention(q, k, v, M=4096)
    with pytest.raises(ValueError, match="block_sizes apply to the 'numpy' and 'teaching' backends"):
        flash_attention(q, k, v, block_sizes=(64, 64))
    with pytest.raises(ValueError, match="one device"):
        flash_attention(q, k.cpu(), v)
    with pytest.raises(ValueError, match="q has head dimension 320"):
        flash_attention(*(torch.zeros(1, 1, 8, 320, device=CUDA) for _ in range(3)))


def test_gpt_trains_the_same_on_the_gpu():
    from examples.gpt import train

    result = train.compare(200, device=CUDA, block_sizes=None)
    losses = result["runs"]["fa2edu"]["loss"]
    assert result["same_initial_weights"] and result["within_bound"], result["max_abs_diff"]
    assert sum(losses[-10:]) / 10 < losses[0] - 1.0
