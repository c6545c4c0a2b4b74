"""fa2edu.torch's dispatch table, every head dimension, and the GPU paths run in numba's CUDA simulator.

* The chooser (``choose_backend``) is tested directly, without a GPU: CUDA float32 → ``3xtf32``, float16/bfloat16 →
  ``tensorcore``, CPU → ``numpy``; the teaching kernels only by name; clear errors otherwise.
* Every head dimension the op accepts (1 … 256, sampled) against PyTorch's SDPA in float64 on the CPU: O, L and the
  three gradients within 1e-10, with GQA, causal and N_q ≠ N_k.
* The CUDA backends on CPU tensors in the simulator (how CI runs the GPU paths): padding of odd head dimensions,
  GQA, causal N_q ≠ N_k with fully masked rows, ``return_lse``, float16/bfloat16 on the tensor-core kernels with
  the float32 fallback backward, and the tensor-core backward used as soon as it exists.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tolerances import assert_close_to_oracle, baseline_error  # noqa: E402

import fa2edu  # noqa: E402
from fa2edu import _torch_ops as ops  # noqa: E402
from fa2edu.torch import BACKENDS, DISPATCH, choose_backend, flash_attention  # noqa: E402

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the dispatch table ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device, dtype, expected", [
    ("cuda", F32, "3xtf32"), ("cuda", F16, "tensorcore"), ("cuda", BF16, "tensorcore"),
    ("cpu", F32, "numpy"), ("cpu", F64, "numpy"),
])
def test_default_backend_per_device_and_dtype(device, dtype, expected):
    assert choose_backend(device, dtype) == expected == DISPATCH[(device, dtype)]
    assert device in BACKENDS[expected].devices and dtype in BACKENDS[expected].dtypes


@pytest.mark.parametrize("capability, d, N_k, causal, expected", [
    ((9, 0), 128, 4096, False, True), ((9, 0), 128, 2048, True, True), ((9, 0), 128, 1024, False, False),
    ((9, 0), 256, 1024, True, False), ((9, 0), 256, 2048, False, True), ((9, 0), 64, 16384, True, True),
    ((9, 0), 64, 2047, False, False),
    ((8, 0), 256, 16384, False, False), ((10, 0), 128, 16384, False, False),
])
def test_hopper_forward_only_on_sm90_where_it_measured_faster(monkeypatch, capability, d, N_k, causal, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert ops.hopper_forward_applies(torch.device("cuda", 0), d, N_k, causal) is expected
    assert ops.hopper_forward_applies(torch.device("cpu"), d, N_k, causal) is False


def test_teaching_kernels_only_by_name():
    assert "teaching" not in DISPATCH.values()
    assert choose_backend("cuda", F32, backend="teaching") == "teaching"
    # the standard algorithm exists on CUDA only as a teaching kernel: naming the algorithm names the kernel
    assert choose_backend("cuda", F32, "standard") == "teaching"
    assert choose_backend("cpu", F64, "flash1") == "numpy" and choose_backend("cpu", F32, "standard") == "numpy"


@pytest.mark.parametrize("args, error, match", [
    (("cuda", F64), TypeError, "on CUDA flash_attention takes float32 or float16 or bfloat16.*move the tensors"),
    (("cpu", F16), TypeError, "on the CPU flash_attention takes float32 or float64.*tensor cores"),
    (("cpu", BF16), TypeError, "bfloat16"),
    (("cuda", torch.int32), TypeError, "q has dtype torch.int32"),
    (("cuda", F32, "flash1"), ValueError, "runs on the CPU only"),
    (("cuda", F16, "flash2", "teaching"), TypeError, "backend='teaching' takes float32"),
    (("cuda", F32, "standard", "fast"), ValueError, "does not implement algorithm='standard'"),
    (("cuda", F32, "flash2", "numpy"), ValueError, "backend='numpy' runs on cpu"),
    (("cuda", F32, "flash2", "triton"), ValueError, "backend must be one of"),
    (("cuda", F32, "flash3"), ValueError, "algorithm must be one of"),
    (("meta", F32), ValueError, "runs on 'cpu' and 'cuda'"),
])
def test_chooser_errors_name_the_problem(args, error, match):
    with pytest.raises(error, match=match):
        choose_backend(*args, simulator=False)


def test_cuda_backends_take_cpu_tensors_only_in_the_simulator():
    with pytest.raises(ValueError, match="only in numba's CUDA simulator"):
        choose_backend("cpu", F32, backend="fast", simulator=False)
    assert choose_backend("cpu", F32, backend="fast", simulator=True) == "fast"
    assert choose_backend("cpu", F16, backend="tensorcore", simulator=True) == "tensorcore"
    with pytest.raises(TypeError, match="takes float16 or bfloat16"):
        choose_backend("cpu", F32, backend="tensorcore", simulator=True)


@pytest.mark.parametrize("d, d_v, forward, backward, tensor_core", [
    (1, 1, 32, 64, 8), (7, 5, 32, 64, 8), (32, 32, 32, 64, 32), (40, 40, 64, 64, 40), (59, 64, 64, 64, 64),
    (64, 64, 64, 64, 64), (111, 111, 128, 128, 112), (128, 96, 128, 128, 128), (129, 8, 192, 192, 136),
    (200, 200, 256, 256, 200), (256, 256, 256, 256, 256),
])
def test_padded_widths(d, d_v, forward, backward, tensor_core):
    # the fast kernels split a row over 8 (width ≤ 64) or 16 threads of 4 columns; the tensor cores read 8 halves
    assert ops.fast_width(d, d_v, "forward") == forward
    assert ops.fast_width(d, d_v, "backward") == backward
    assert ops.tensorcore_width(d, d_v) == tensor_core


# -- every head dimension, against SDPA in float64 ----------------------------------------------------------------

def sdpa_reference(q, k, v, dO, causal, scale=None):
    """SDPA in float64 with the bottom-right causal mask and GQA: O, L and (dQ, dK, dV)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    N_q, N_k = q.shape[-2], k.shape[-2]
    mask = torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q) if causal else None
    O = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    O.backward(dO)
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = tau * (q.detach() @ k.detach().repeat_interleave(q.shape[-3] // k.shape[-3], -3).transpose(-1, -2))
    if causal:
        S = S.masked_fill(~mask, -math.inf)
    return O.detach(), torch.logsumexp(S, -1), (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("d", [1, 2, 7, 8, 13, 33, 40, 59, 64, 100, 111, 128, 160, 200, 255, 256])
def test_every_head_dimension_matches_sdpa(d):
    # GQA (4 query heads on 2 KV heads), causal, N_q = 5 < N_k = 7, and d_v = d or a different width
    generator = torch.Generator().manual_seed(d)
    d_v = d if d % 2 else max(1, 256 - d)
    q = torch.randn(1, 4, 5, d, dtype=F64, generator=generator)
    k = torch.randn(1, 2, 7, d, dtype=F64, generator=generator)
    v = torch.randn(1, 2, 7, d_v, dtype=F64, generator=generator)
    dO = torch.randn(1, 4, 5, d_v, dtype=F64, generator=generator)
    O_ref, L_ref, grads_ref = sdpa_reference(q, k, v, dO, True)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    O, L = flash_attention(q, k, v, causal=True, return_lse=True, block_sizes=(2, 3))
    O.backward(dO)
    assert L.dtype == F64 and not L.requires_grad
    for name, x, ref in zip(("O", "L", "dQ", "dK", "dV"), (O, L, q.grad, k.grad, v.grad),
                            (O_ref, L_ref) + grads_ref):
        assert_close_to_oracle(x.detach().numpy(), ref.numpy(), f"d = {d}, d_v = {d_v}: {name}")


@pytest.mark.parametrize("d", [257, 512])
def test_head_dimensions_above_256_are_refused(d):
    q = torch.zeros(1, 2, 3, d)
    with pytest.raises(ValueError, match="q has head dimension .* 1 to 256"):
        flash_attention(q, q, q)
    with pytest.raises(ValueError, match="v has head dimension .* 1 to 256"):
        flash_attention(q[..., :8], q[..., :8], q)


# -- the CUDA backends, in the simulator, on CPU tensors ------------------------------------------------------------

needs_simulator = pytest.mark.skipif(not ops.simulator_enabled(), reason="CPU tensors reach the CUDA backends only "
                                     "in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, the tests' default)")


def problem(d, d_v, dtype, *, N_q=6, N_k=4, H_q=2, H_kv=1, seed=0):
    """q, k, v, dO of one small GQA problem, drawn in float64 and rounded to ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    shapes = ((1, H_q, N_q, d), (1, H_kv, N_k, d), (1, H_kv, N_k, d_v), (1, H_q, N_q, d_v))
    return [torch.randn(shape, dtype=F64, generator=generator).to(dtype) for shape in shapes]


def oracle(q, k, v, dO, causal):
    """fa2edu's float64 oracle: O, L (+inf on fully masked rows) and the gradients (0 there)."""
    arrays = [x.double().numpy() for x in (q, k, v, dO)]
    O, L = fa2edu.attention_reference(*arrays[:3], causal=causal)
    return O, L, fa2edu.attention_reference_backward(*arrays, causal=causal)


def same_dtype_standard(q, k, v, dO, causal):
    """Standard attention in the inputs' own dtype (PyTorch ops, float32 softmax for 16-bit inputs as the
    tensor-core kernels do): the baseline error of the flash-attn rule. Fully masked rows give 0."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    kk, vv = (x.repeat_interleave(q.shape[-3] // k.shape[-3], -3) for x in (k, v))
    S = (q @ kk.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    if causal:
        N_q, N_k = q.shape[-2], k.shape[-2]
        S = S.masked_fill(~torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q), -math.inf)
    P = torch.nan_to_num(torch.softmax(S, -1)).to(q.dtype)
    O = P @ vv
    O.backward(dO)
    return [x.detach() for x in (O, q.grad, k.grad, v.grad)]


def check_against_oracle(q, k, v, dO, causal, backend, label):
    """Run the op with ``backend``: O, L (return_lse) and the gradients against the oracle by flash-attn's rule."""
    O_ref, L_ref, grads_ref = oracle(q, k, v, dO, causal)
    baseline = same_dtype_standard(q, k, v, dO, causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    O, L = flash_attention(*leaves, causal=causal, return_lse=True, backend=backend)
    O.backward(dO)
    assert O.dtype == q.dtype and L.dtype == F32 and O.shape == dO.shape and L.shape == dO.shape[:-1]
    assert all(x.grad.dtype == q.dtype and x.grad.shape == x.shape for x in leaves)
    like = np.float16 if q.dtype in (F16, BF16) else np.float32
    # L against the oracle in float32's own rule: its error is a few ulps of the largest |L| (no baseline needed)
    assert_close_to_oracle(L.numpy(), L_ref, f"{label} L", dtype=np.float32, baseline=0.0, floor=1e-5)
    for name, x, ref, low in zip(("O", "dQ", "dK", "dV"), (O,) + tuple(t.grad for t in leaves),
                                 (O_ref,) + tuple(grads_ref), baseline):
        assert_close_to_oracle(x.detach().double().numpy(), ref, f"{label} {name}", dtype=like,
                               baseline=baseline_error(low.double().numpy(), ref))
    return O, L, [t.grad for t in leaves]


@needs_simulator
def test_fast_backend_pads_odd_head_dimensions():
    # d = 7, d_v = 5: widths 32 forward, 64 backward. Causal with N_q = 6 > N_k = 4: two fully masked rows
    # (O = 0, L = +inf, dQ = 0); GQA 2:1
    d, d_v = 7, 5
    q, k, v, dO = problem(d, d_v, F32, seed=d)
    O, L, (dQ, _, _) = check_against_oracle(q, k, v, dO, True, "fast", f"fast d = {d}, d_v = {d_v}")
    assert (O[..., :2, :] == 0).all() and torch.isposinf(L[..., :2]).all() and (dQ[..., :2, :] == 0).all()


@needs_simulator
def test_3xtf32_backend_pads_to_16_and_matches_oracle(monkeypatch):
    # backend="3xtf32" (float32 on tensor cores, three TF32 products each): d = 7, d_v = 5 padded to 16, causal
    # with N_q = 6 > N_k = 4 (two rows see no key: O = 0, L = +inf, dQ = 0), GQA 2:1; both 3xTF32 kernels run,
    # each handed the padded width (here on smaller tiles than the GPU's: the simulator's time grows with the
    # threads and with the MMAs per step)
    real, widths = ops._tensorcore(), []

    def spy(kernel, **tile):
        return lambda *args, **kw: widths.append(args[0].shape[-1]) or kernel(*args, **kw, **tile)
    monkeypatch.setattr(ops, "_tensorcore", lambda: SimpleNamespace(
        TF32={"3xtf32-planes": spy(real.TF32["3xtf32-planes"], warps=2)},
        TF32_BACKWARD={"3xtf32": spy(real.TF32_BACKWARD["3xtf32"], warps=2, B_r=16)}))
    q, k, v, dO = problem(7, 5, F32, seed=3)
    O, L, (dQ, _, _) = check_against_oracle(q, k, v, dO, True, "3xtf32", "3xtf32 d = 7, d_v = 5")
    assert widths == [16, 16]
    assert (O[..., :2, :] == 0).all() and torch.isposinf(L[..., :2]).all() and (dQ[..., :2, :] == 0).all()


def test_3xtf32_backend_runs_heads_wider_than_128_on_the_fast_kernels(monkeypatch):
    monkeypatch.setattr(ops, "_fast_forward", lambda *args: "fast forward")
    monkeypatch.setattr(ops, "_fast_backward", lambda *args: "fast backward")
    x = torch.zeros(1, 1, 4, 129)
    assert ops._three_tf32_forward(x, x, x, False, 1.0) == "fast forward"
    assert ops._three_tf32_backward(x, x, x, x, x[..., 0], x, False, 1.0) == "fast backward"
    assert ops.three_tf32_width(7, 5) == 16 and ops.three_tf32_width(128, 128) == 128


@needs_simulator
def test_fast_backend_wide_tiles_above_128():
    # d = 200 runs at width 256 on the tile shapes that fit a block's shared memory there
    q, k, v, dO = problem(200, 200, F32, N_q=3, N_k=5, H_q=1, seed=1)
    check_against_oracle(q, k, v, dO, False, "fast", "fast d = 200")


@needs_simulator
def test_teaching_backend_by_name():
    # (the standard algorithm's teaching kernels take seconds per launch in the simulator: the GPU tests run them)
    algorithm = "flash2"
    q, k, v, dO = problem(5, 3, F32, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    O = flash_attention(*leaves, causal=True, algorithm=algorithm, backend="teaching")
    O.backward(dO)
    O_ref, _, grads_ref = oracle(q, k, v, dO, True)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), (O.detach(),) + tuple(t.grad for t in leaves),
                            (O_ref,) + tuple(grads_ref)):
        np.testing.assert_allclose(x.numpy(), ref, rtol=0, atol=1e-5, err_msg=f"teaching {algorithm} {name}")


@pytest.fixture
def tensor_core_without_backward(monkeypatch):
    """kernels_gpu.tensorcore as it is before its backward kernel exists: the real forward, no backward."""
    real = ops._tensorcore()
    monkeypatch.setattr(ops, "_tensorcore", lambda: SimpleNamespace(flash2_forward=real.flash2_forward))


@needs_simulator
def test_tensorcore_backend_with_the_float32_fallback_backward(tensor_core_without_backward, monkeypatch):
    # bfloat16, d = 12 padded to 16; the backward runs kernels_gpu.fast in float32 and casts the gradients back
    # (float16 goes through the same code: the test below runs it)
    dtype = BF16
    calls = []
    real_fast_backward = ops._fast_backward
    monkeypatch.setattr(ops, "_fast_backward", lambda *args: calls.append([a.dtype for a in args[:6]])
                        or real_fast_backward(*args))
    q, k, v, dO = problem(12, 12, dtype, N_q=3, N_k=5, seed=5)
    check_against_oracle(q, k, v, dO, True, "tensorcore", f"tensorcore {dtype}")
    assert calls == [[F32] * 6]


@needs_simulator
def test_tensor_core_backward_is_used_once_it_exists(monkeypatch):
    # A stand-in for kernels_gpu.tensorcore.flash2_backward that checks what it is handed (a width that is a
    # multiple of 8, zero padding, float32 L, the caller's τ) and answers with the float64 oracle.
    seen = {}
    real = ops._tensorcore()

    def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None):
        seen.update(width=Q.shape[-1], dtypes={x.dtype for x in (Q, K, V, O, dO)}, L=L.dtype, scale=scale)
        assert all((x[..., 12:] == 0).all() for x in (Q, K, V, O, dO))
        grads = fa2edu.attention_reference_backward(*(x.double().numpy() for x in (Q, K, V, dO)), causal=causal,
                                                    scale=scale)
        return tuple(torch.from_numpy(g).to(Q.dtype) for g in grads)

    monkeypatch.setattr(ops, "_tensorcore", lambda: SimpleNamespace(flash2_forward=real.flash2_forward,
                                                                     flash2_backward=flash2_backward))
    q, k, v, dO = problem(12, 12, F16, N_q=3, N_k=5, seed=6)
    _, _, grads = check_against_oracle(q, k, v, dO, True, "tensorcore", "tensor-core backward")
    assert seen == dict(width=16, dtypes={F16}, L=F32, scale=1 / math.sqrt(12))
    assert [g.shape[-1] for g in grads] == [12, 12, 12]


@needs_simulator
def test_gpu_backends_keep_every_argument_error():
    q, k, v, _ = problem(8, 8, F32)
    with pytest.raises(ValueError, match="block_sizes apply to the 'numpy' and 'teaching' backends"):
        flash_attention(q, k, v, backend="fast", block_sizes=(16, 16))
    with pytest.raises(ValueError, match="M .* applies to the NumPy backend"):
        flash_attention(q, k, v, backend="teaching", M=4096)
    with pytest.raises(ValueError, match="multiple of k's and v's H_kv"):
        flash_attention(q, k.expand(1, 2, 4, 8)[:, :1].repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1), backend="fast")
