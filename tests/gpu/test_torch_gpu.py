"""fa2edu.torch on a real GPU: kernels_gpu behind ``autograd``, zero-copy, checked against PyTorch's SDPA.

Run on the device (``pytest -m gpu tests/gpu/test_torch_gpu.py``). Checks: the forward output and the gradients of
``flash_attention(..., algorithm="flash2")`` (and ``"standard"``) on CUDA tensors equal SDPA's within the conventions'
float32 rule against a float64 oracle; the CUDA path agrees with the CPU path; outputs stay on the GPU; side
streams and non-contiguous inputs are handled; and the small GPT trains the same with either attention.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")]

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tolerances import assert_close_to_oracle  # noqa: E402

from fa2edu.torch import flash_attention  # noqa: E402

F = torch.nn.functional
CUDA = "cuda"

# (q shape, k shape, d_v, causal): GQA, N_q ≠ N_k, ragged sizes, d = 64 and 128.
CASES = {
    "gqa-causal": ((2, 8, 200, 64), (2, 2, 200, 64), 64, True),
    "Nq<Nk-causal": ((1, 4, 77, 64), (1, 4, 300, 64), 64, True),
    "plain": ((3, 2, 129, 32), (3, 2, 95, 32), 32, False),
    "d128": ((1, 2, 256, 128), (1, 2, 256, 128), 128, True),
}


@pytest.fixture(autouse=True)
def no_tf32():
    # SDPA's float32 baseline must be true float32 (TF32 would make it look worse than it is).
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def inputs(case, seed=0, device=CUDA, dtype=torch.float32):
    q_shape, k_shape, d_v, causal = CASES[case]
    generator = torch.Generator().manual_seed(seed)
    q, k, v, dO = (torch.randn(shape, generator=generator, dtype=torch.float64)
                   for shape in (q_shape, k_shape, k_shape[:-1] + (d_v,), q_shape[:-1] + (d_v,)))
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dO)], causal


def with_grads(attention, q, k, v, dO):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    O = attention(q, k, v)
    O.backward(dO)
    return [x.detach() for x in (O, q.grad, k.grad, v.grad)]


def sdpa(causal):
    def attention(q, k, v):
        N_q, N_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(N_q, N_k, dtype=torch.bool, device=q.device).tril(N_k - N_q) if causal else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return attention


@pytest.mark.parametrize("algorithm", ["flash2", "standard"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_matches_sdpa(case, algorithm):
    (q, k, v, dO), causal = inputs(case)
    oracle = with_grads(sdpa(causal), *(x.double() for x in (q, k, v, dO)))        # float64 on the GPU
    baseline = with_grads(sdpa(causal), q, k, v, dO)                                 # SDPA in float32
    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal, algorithm=algorithm), q, k, v, dO)
    for name, x, ref, low in zip(("O", "dQ", "dK", "dV"), ours, oracle, baseline):
        assert x.device.type == "cuda" and x.dtype == torch.float32 and x.shape == ref.shape
        expected = ref.cpu().numpy()
        error = float(np.max(np.abs(low.double().cpu().numpy() - expected)))
        assert_close_to_oracle(x.cpu().numpy(), expected, f"{algorithm} {case} {name}", dtype=np.float32,
                               baseline=error)


def test_cuda_matches_the_cpu_path():
    (q, k, v, dO), causal = inputs("gqa-causal", seed=1)
    gpu = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    cpu = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), *(x.cpu() for x in (q, k, v, dO)))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), gpu, cpu):
        scale = max(1.0, float(b.abs().max()))
        assert float((a.cpu() - b).abs().max()) <= 1e-4 * scale, name


def test_fully_masked_rows_on_cuda():
    # causal with N_q > N_k: the first N_q − N_k rows see no key: O = 0 and dQ = 0 there, no NaN anywhere.
    generator = torch.Generator().manual_seed(2)
    q, dO = (torch.randn(1, 2, 70, 64, generator=generator).to(CUDA) for _ in range(2))
    k, v = (torch.randn(1, 2, 40, 64, generator=generator).to(CUDA) for _ in range(2))
    O, dQ, dK, dV = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    assert all(not torch.isnan(x).any() for x in (O, dQ, dK, dV))
    assert (O[..., :30, :] == 0).all() and (dQ[..., :30, :] == 0).all()


def test_non_contiguous_inputs_and_a_side_stream():
    # (B, N, H, d) projections viewed as (B, H, N, d), computed while PyTorch works on a side stream.
    generator = torch.Generator().manual_seed(3)
    q, k, v, dO = (torch.randn(2, 150, 4, 64, generator=generator).to(CUDA).transpose(1, 2) for _ in range(4))
    expected = with_grads(lambda q, k, v: flash_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                          causal=True), q, k, v, dO)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
    torch.cuda.synchronize()
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))


def test_cuda_errors():
    (q, k, v, _), _ = inputs("plain")
    with pytest.raises(TypeError, match="on CUDA flash_attention takes float32"):
        flash_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="runs on the CPU only"):
        flash_attention(q, k, v, algorithm="flash1")
    with pytest.raises(ValueError, match="M .* applies to the CPU path"):
        flash_attention(q, k, v, M=4096)
    with pytest.raises(ValueError, match="one device"):
        flash_attention(q, k.cpu(), v)


def test_gpt_trains_the_same_on_the_gpu():
    from examples.gpt import train

    result = train.compare(200, device=CUDA, block_sizes=None)
    losses = result["runs"]["fa2edu"]["loss"]
    assert result["same_initial_weights"] and result["within_bound"], result["max_abs_diff"]
    assert sum(losses[-10:]) / 10 < losses[0] - 1.0
