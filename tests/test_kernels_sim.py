"""kernels_gpu in numba's CUDA simulator: every kernel against the float64 oracle, plus interop and input errors.

What these tests prove (the GPU chapter's claims, on any laptop):

* exactness: FA2 forward (O, L), FA1 forward (O, ℓ, m), FA2 backward (dQ, dK, dV; atomic and deterministic),
  standard attention forward (O, P) and backward equal :func:`fa2edu.attention_reference` and its gradients within
  the conventions' float32 rule (2× the error of a same-dtype standard computation, plus a small floor), on ragged
  shapes: N_q ≠ N_k, block sizes dividing nothing, causal on and off, GQA/MQA, d_v ≠ d, 2-D/3-D/4-D inputs, large
  logits;
* fully masked rows (causal with N_q > N_k) give exactly O = 0, L = +inf, (ℓ, m) = (0, −inf), zero gradients;
* interop: device arrays in → device arrays out (zero-copy, strided 4-D views accepted), NumPy in → NumPy out;
* bad input is refused with TypeError/ValueError naming the argument, and a kernel call with neither a GPU nor the
  simulator raises NoGPUError saying how to use the simulator.

The simulator runs one Python thread per CUDA thread: shapes are tiny (N ≤ 14, d ≤ 8) and tiles small.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from tolerances import assert_close_to_oracle, baseline_error

import fa2edu
import kernels_gpu
from kernels_gpu import runtime as rt

if not rt.simulator_in_use() and os.environ.get("FA2EDU_GPU") != "1":  # pragma: no cover
    pytest.skip("the simulator tests need NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py sets it)", allow_module_level=True)



@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output starts as NaN, so an element a kernel never writes cannot pass as stale or zero memory."""
    monkeypatch.setattr(rt, "poison_outputs", True)

# -- problems -------------------------------------------------------------------------------------------------------

CASES = {
    # GQA (2 query heads share 1 K/V head), N_q < N_k, d_v ≠ d, blocks dividing nothing.
    "gqa": dict(lead_q=(1, 2), lead_kv=(1, 1), N_q=7, N_k=9, d=5, d_v=3, causal=False, bs=(3, 4)),
    "gqa-causal": dict(lead_q=(1, 2), lead_kv=(1, 1), N_q=7, N_k=9, d=5, d_v=3, causal=True, bs=(3, 4)),
    # Causal with N_q > N_k: the first 5 rows see no key (fully masked); a batch of 2.
    "masked-rows": dict(lead_q=(2, 1), lead_kv=(2, 1), N_q=11, N_k=6, d=4, d_v=4, causal=True, bs=(4, 3)),
    # Plain (N, d) matrices, square causal, B_c = 2.
    "2d-causal": dict(lead_q=(), lead_kv=(), N_q=10, N_k=10, d=8, d_v=8, causal=True, bs=(5, 2)),
    # (H, N, d) inputs, MQA (3 query heads, 1 K/V head), N_q > N_k, not causal, one K/V block.
    "3d-mqa": dict(lead_q=(3,), lead_kv=(1,), N_q=13, N_k=5, d=3, d_v=6, causal=False, bs=(4, 5)),
    # Large logits (scores of order 10³), causal with N_q < N_k, a block as large as the problem.
    "large-logits": dict(lead_q=(1, 1), lead_kv=(1, 1), N_q=6, N_k=14, d=4, d_v=4, causal=True, bs=(6, 7),
                         spread=30.0),
}


def make_problem(name: str, seed: int = 0):
    c = CASES[name]
    rng = np.random.default_rng(seed)
    spread = c.get("spread", 1.0)
    Q = (rng.standard_normal(c["lead_q"] + (c["N_q"], c["d"])) * spread).astype(np.float32)
    K = (rng.standard_normal(c["lead_kv"] + (c["N_k"], c["d"])) * spread).astype(np.float32)
    V = rng.standard_normal(c["lead_kv"] + (c["N_k"], c["d_v"])).astype(np.float32)
    dO = rng.standard_normal(c["lead_q"] + (c["N_q"], c["d_v"])).astype(np.float32)
    return Q, K, V, dO, c


def masked_scores(Q, K, causal, dtype):
    """τQKᵀ with −inf where causally masked, in ``dtype`` (GQA by repeating K heads: test code only)."""
    if K.ndim >= 3 and K.shape[-3] != Q.shape[-3]:
        K = np.repeat(K, Q.shape[-3] // K.shape[-3], axis=-3)
    Q, K = Q.astype(dtype), K.astype(dtype)
    S = (Q @ np.swapaxes(K, -1, -2)) * dtype(1.0 / math.sqrt(Q.shape[-1]))
    if causal:
        S = np.where(fa2edu.masks.causal_mask(Q.shape[-2], K.shape[-2]), S, -np.inf)
    return S


def row_stats(Q, K, causal, dtype):
    """(m, ℓ, L) of each row of the masked scores: m = rowmax, ℓ = Σ exp(S − m), L = m + log ℓ (+inf if ℓ = 0)."""
    S = masked_scores(Q, K, causal, dtype)
    m = S.max(axis=-1)
    safe_m = np.where(np.isneginf(m), 0, m)
    l = np.exp(S - safe_m[..., None]).sum(axis=-1)  # noqa: E741
    with np.errstate(divide="ignore"):
        L = np.where(l == 0, np.inf, m + np.log(np.where(l == 0, 1, l)))
    return m, l, L


def check(actual, expected, low, name):
    """the conventions' float32 rule: within 2× the error of the same-dtype computation ``low``, plus a floor."""
    assert_close_to_oracle(np.asarray(actual), expected, name, dtype=np.float32,
                           baseline=baseline_error(np.asarray(low), expected))


# -- exactness ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_flash2_forward_matches_oracle(name):
    Q, K, V, _, c = make_problem(name)
    O_ref, L_ref = fa2edu.attention_reference(Q, K, V, causal=c["causal"])
    O32 = fa2edu.standard_attention(Q, K, V, causal=c["causal"]).O
    L32 = row_stats(Q, K, c["causal"], np.float32)[2]
    out = kernels_gpu.flash2_forward(Q, K, V, block_sizes=c["bs"], causal=c["causal"])
    assert isinstance(out, fa2edu.flash2.Flash2Forward) and isinstance(out.O, np.ndarray)
    assert out.O.dtype == np.float32
    check(out.O, O_ref, O32, "O")
    check(out.L, L_ref, L32, "L")


@pytest.mark.parametrize("name", list(CASES))
def test_flash1_forward_matches_oracle(name):
    Q, K, V, _, c = make_problem(name)
    O_ref, _ = fa2edu.attention_reference(Q, K, V, causal=c["causal"])
    m_ref, l_ref, _ = row_stats(Q, K, c["causal"], np.float64)
    m32, l32, _ = row_stats(Q, K, c["causal"], np.float32)
    out = kernels_gpu.flash1_forward(Q, K, V, block_sizes=c["bs"], causal=c["causal"])
    assert type(out).__name__ == "Flash1Forward" and out._fields == ("O", "l", "m")
    check(out.O, O_ref, fa2edu.standard_attention(Q, K, V, causal=c["causal"]).O, "O")
    check(out.m, m_ref, m32, "m")
    check(out.l, l_ref, l32, "l")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("name", list(CASES))
def test_flash2_backward_matches_oracle(name, deterministic):
    Q, K, V, dO, c = make_problem(name)
    causal = c["causal"]
    grads_ref = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal)
    std = fa2edu.standard_attention(Q, K, V, causal=causal)
    grads32 = fa2edu.standard_attention_backward(Q, K, V, std.P, dO, causal=causal)
    fwd = kernels_gpu.flash2_forward(Q, K, V, block_sizes=c["bs"], causal=causal)
    grads = kernels_gpu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=c["bs"], causal=causal,
                                        deterministic=deterministic)
    assert isinstance(grads, fa2edu.flash2.Flash2Backward)
    for name_, actual, expected, low in zip(("dQ", "dK", "dV"), grads, grads_ref, grads32):
        check(actual, expected, low, name_)


@pytest.mark.parametrize("name, tile", [("gqa-causal", 4), ("masked-rows", 4), ("2d-causal", 4)])
def test_standard_attention_matches_oracle(name, tile):
    Q, K, V, dO, c = make_problem(name)
    causal = c["causal"]
    O_ref, _ = fa2edu.attention_reference(Q, K, V, causal=causal)
    grads_ref = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal)
    std32 = fa2edu.standard_attention(Q, K, V, causal=causal)
    grads32 = fa2edu.standard_attention_backward(Q, K, V, std32.P, dO, causal=causal)
    P_ref = np.exp(masked_scores(Q, K, causal, np.float64)
                   - np.nan_to_num(fa2edu.attention_reference(Q, K, V, causal=causal).L[..., None], posinf=0.0))
    P_ref = np.where(np.isposinf(fa2edu.attention_reference(Q, K, V, causal=causal).L)[..., None], 0.0, P_ref)

    out = kernels_gpu.standard_attention(Q, K, V, causal=causal, tile=tile)
    assert isinstance(out, fa2edu.standard.StandardForward)
    check(out.O, O_ref, std32.O, "O")
    check(out.P, P_ref, std32.P, "P")
    grads = kernels_gpu.standard_attention_backward(Q, K, V, out.P, dO, causal=causal, tile=tile)
    for name_, actual, expected, low in zip(("dQ", "dK", "dV"), grads, grads_ref, grads32):
        check(actual, expected, low, name_)


def test_fully_masked_rows_are_exact():
    """Causal with N_q = 11 > N_k = 6: rows 0-4 see no key. O = 0, L = +inf, (ℓ, m) = (0, −inf), dQ = 0, no NaN."""
    Q, K, V, dO, c = make_problem("masked-rows")
    empty = slice(0, c["N_q"] - c["N_k"])
    fwd = kernels_gpu.flash2_forward(Q, K, V, block_sizes=c["bs"], causal=True)
    fa1 = kernels_gpu.flash1_forward(Q, K, V, block_sizes=c["bs"], causal=True)
    std = kernels_gpu.standard_attention(Q, K, V, causal=True, tile=4)
    for deterministic in (False, True):
        grads = kernels_gpu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=c["bs"], causal=True,
                                            deterministic=deterministic)
        assert np.all(grads.dQ[..., empty, :] == 0.0)
        assert not any(np.isnan(g).any() for g in grads)
    assert np.all(fwd.O[..., empty, :] == 0.0) and np.all(np.isposinf(fwd.L[..., empty]))
    assert np.all(np.isfinite(fwd.L[..., empty.stop:]))
    assert np.all(fa1.O[..., empty, :] == 0.0) and np.all(fa1.l[..., empty] == 0.0)
    assert np.all(np.isneginf(fa1.m[..., empty]))
    assert np.all(std.O[..., empty, :] == 0.0) and np.all(std.P[..., empty, :] == 0.0)
    assert not np.isnan(fwd.O).any() and not np.isnan(fa1.O).any() and not np.isnan(std.P).any()


def test_flash1_and_flash2_statistics_agree():
    """FA2 saves only L = m + log ℓ (FA2 tweak 2): the FA1 kernel's (ℓ, m) give the FA2 kernel's L."""
    Q, K, V, _, c = make_problem("gqa-causal", seed=3)
    fa1 = kernels_gpu.flash1_forward(Q, K, V, block_sizes=(2, 5), causal=True)
    fa2 = kernels_gpu.flash2_forward(Q, K, V, block_sizes=(4, 2), causal=True)
    np.testing.assert_allclose(fa1.m + np.log(fa1.l), fa2.L, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fa1.O, fa2.O, rtol=1e-5, atol=1e-5)


# -- interop --------------------------------------------------------------------------------------------------------

def test_device_arrays_in_device_arrays_out():
    from numba import cuda
    Q, K, V, dO, c = make_problem("gqa-causal", seed=1)
    host = kernels_gpu.flash2_forward(Q, K, V, block_sizes=c["bs"], causal=True)
    dQ_, dK_, dV_ = (cuda.to_device(x) for x in (Q, K, V))
    out = kernels_gpu.flash2_forward(dQ_, dK_, dV_, block_sizes=c["bs"], causal=True)
    assert not isinstance(out.O, np.ndarray) and rt.is_device_array(out.O)
    assert tuple(out.O.shape) == host.O.shape and tuple(out.L.shape) == host.L.shape
    np.testing.assert_array_equal(out.O.copy_to_host(), host.O)
    np.testing.assert_array_equal(out.L.copy_to_host(), host.L)
    grads = kernels_gpu.flash2_backward(dQ_, dK_, dV_, out.O, out.L, cuda.to_device(dO), block_sizes=c["bs"],
                                        causal=True, deterministic=True)
    host_grads = kernels_gpu.flash2_backward(Q, K, V, host.O, host.L, dO, block_sizes=c["bs"], causal=True,
                                             deterministic=True)
    for g, h in zip(grads, host_grads):
        assert rt.is_device_array(g)
        np.testing.assert_array_equal(g.copy_to_host(), h)
    np.testing.assert_array_equal(dQ_.copy_to_host(), Q)            # inputs untouched


def test_strided_4d_device_views_are_used_in_place():
    """A 4-D device view with gaps (every other head of a larger array) is read through its strides, not copied."""
    from numba import cuda
    Q, K, V, _, c = make_problem("gqa")
    rng = np.random.default_rng(5)
    Q_big = rng.standard_normal((1, 4) + Q.shape[2:]).astype(np.float32)
    Q_big[:, ::2] = Q
    Q_view = cuda.to_device(Q_big)[:, ::2]
    assert not Q_view.is_c_contiguous()
    out = kernels_gpu.flash2_forward(Q_view, cuda.to_device(K), cuda.to_device(V), block_sizes=c["bs"])
    np.testing.assert_array_equal(out.O.copy_to_host(), kernels_gpu.flash2_forward(Q, K, V, block_sizes=c["bs"]).O)


# -- errors ---------------------------------------------------------------------------------------------------------

def test_bad_inputs_are_refused_with_named_errors():
    from numba import cuda
    Q, K, V, dO, c = make_problem("gqa")
    with pytest.raises(TypeError, match="Q must have a floating dtype"):
        kernels_gpu.flash2_forward(Q.astype(np.int32), K, V)
    with pytest.raises(ValueError, match="B_r must be at least 1"):
        kernels_gpu.flash2_forward(Q, K, V, block_sizes=(0, 3))
    with pytest.raises(ValueError, match="shared memory"):
        kernels_gpu.flash2_forward(Q, K, V, block_sizes=(2, 2000))
    with pytest.raises(ValueError, match="threads per block"):
        kernels_gpu.flash1_forward(Q, K, V, block_sizes=(2048, 2))
    with pytest.raises(TypeError, match="not a mix"):
        kernels_gpu.flash2_forward(cuda.to_device(Q), K, V)
    with pytest.raises(TypeError, match="Q must be float32"):
        kernels_gpu.flash2_forward(cuda.to_device(Q.astype(np.float64)), cuda.to_device(K), cuda.to_device(V))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        kernels_gpu.flash2_forward(cuda.to_device(np.zeros((1, 3, 4, 5), np.float32)),
                                   cuda.to_device(np.zeros((1, 2, 4, 5), np.float32)),
                                   cuda.to_device(np.zeros((1, 2, 4, 5), np.float32)))
    fwd = kernels_gpu.flash2_forward(Q, K, V, block_sizes=c["bs"])
    with pytest.raises(ValueError, match="L must have shape"):
        kernels_gpu.flash2_backward(Q, K, V, fwd.O, fwd.L[..., :-1], dO)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        kernels_gpu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, deterministic="yes")
    with pytest.raises(ValueError, match="tile must be a power of two"):
        kernels_gpu.standard_attention(Q, K, V, tile=3)
    with pytest.raises(TypeError, match="scale must be a real number"):
        kernels_gpu.flash2_forward(Q, K, V, scale="big")


@pytest.mark.skipif(os.environ.get("FA2EDU_GPU") == "1", reason="this machine may have a GPU")
def test_import_works_without_gpu_and_a_call_says_how_to_use_the_simulator():
    """With the simulator turned off by hand (without the variable, kernels_gpu would choose it on a machine with
    no CUDA driver: tests/test_notebook_support.py), a call with no GPU says how to turn it on."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    code = ("import numpy as np, kernels_gpu\n"
            "x = np.ones((4, 2), np.float32)\n"
            "try:\n    kernels_gpu.flash2_forward(x, x, x)\n"
            "except kernels_gpu.NoGPUError as e:\n    print('NoGPUError:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if "NoGPUError" not in result.stdout:  # pragma: no cover (a machine with a GPU)
        pytest.skip("a CUDA GPU is present")
    assert "NUMBA_ENABLE_CUDASIM=1" in result.stdout


def test_one_compiled_kernel_per_tile_shape():
    from kernels_gpu import flash2
    Q, K, V, _, c = make_problem("3d-mqa")
    kernels_gpu.flash2_forward(Q, K, V, block_sizes=(4, 5))
    before = flash2.forward_kernel.cache_info()
    kernels_gpu.flash2_forward(Q[..., :9, :], K, V, block_sizes=(4, 5))    # same tiles, other N: same kernel
    after = flash2.forward_kernel.cache_info()
    assert after.hits == before.hits + 1 and after.currsize == before.currsize
    assert flash2.forward_kernel(4, 5, 3, 6) is flash2.forward_kernel(4, 5, 3, 6)


def test_default_block_sizes_fit_a_block():
    for d in (16, 32, 64, 128, 256):
        for algorithm in ("flash1_forward", "flash2_forward"):
            B_r, B_c = kernels_gpu.default_block_sizes(algorithm, d)
            assert B_r <= rt.MAX_THREADS and B_c * 2 * d <= rt.SHARED_FLOATS and B_c >= 1
        B_r, B_c = kernels_gpu.default_block_sizes("flash2_backward", d)
        assert B_c <= rt.MAX_THREADS and rt.flash2_backward_shared(B_r, B_c, d, d) <= rt.SHARED_FLOATS
    assert kernels_gpu.default_block_sizes("flash2_forward", 64) == (64, 64)


def test_outputs_start_poisoned():
    """The autouse fixture's poison is real: a fresh output holds NaN until a kernel writes it."""
    assert np.isnan(rt.device_empty((2, 3)).copy_to_host()).all()


def test_device_arrays_without_batch_axes():
    """Plain (N, d) device matrices: L is a 1-D device vector, and the backward pass takes it as it came."""
    from numba import cuda
    Q, K, V, dO, c = make_problem("2d-causal", seed=2)
    host = kernels_gpu.flash2_forward(Q, K, V, block_sizes=c["bs"], causal=True)
    dev = kernels_gpu.flash2_forward(*(cuda.to_device(x) for x in (Q, K, V)), block_sizes=c["bs"], causal=True)
    assert tuple(dev.L.shape) == (c["N_q"],)
    grads = kernels_gpu.flash2_backward(*(cuda.to_device(x) for x in (Q, K, V)), dev.O, dev.L, cuda.to_device(dO),
                                        block_sizes=c["bs"], causal=True, deterministic=True)
    host_grads = kernels_gpu.flash2_backward(Q, K, V, host.O, host.L, dO, block_sizes=c["bs"], causal=True,
                                             deterministic=True)
    for g, h in zip(grads, host_grads):
        np.testing.assert_array_equal(g.copy_to_host(), h)
