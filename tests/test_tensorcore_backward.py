"""Tensor-core backward rungs (FA2 Algorithm 2 on mma.sync) in numba's CUDA simulator, against the float64 oracle.

The simulator twins emulate every warp-level instruction, so each rung's own source runs here; the shapes are small
and most cases use a small tile shape (2 warps, B_r = 16: several key blocks and row blocks on a few dozen rows),
the default shape once. ``tests/gpu/test_tensorcore_backward_gpu.py`` runs the same checks on the real instructions
at benchmark-like sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

import fa2edu
import kernels_gpu.runtime as rt
from kernels_gpu.tensorcore import BACKWARD_VERSIONS, backward_steps, flash2_backward

torch = pytest.importorskip("torch")


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


def _problem(shape_q, shape_kv, dtype, causal, seed, scale=1.0):
    """Q, K, V, dO in ``dtype`` (CPU tensors), and O, L from the float64 oracle as a forward would return them: O
    rounded to ``dtype``, L float32 in natural units, +inf on rows that see no key."""
    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    Q = (torch.randn(shape_q, generator=g) * scale).to(tdt)
    K = (torch.randn(shape_kv, generator=g) * scale).to(tdt)
    V = torch.randn(shape_kv, generator=g).to(tdt)
    dO = torch.randn(shape_q, generator=g).to(tdt)
    O_ref, L_ref = fa2edu.attention_reference(*(x.double().numpy() for x in (Q, K, V)), causal=causal)
    O = torch.from_numpy(np.nan_to_num(O_ref)).to(tdt)
    L = torch.from_numpy(np.where(np.isfinite(L_ref), L_ref, np.inf).astype(np.float32))
    return Q, K, V, O, L, dO


def torch_gradients(Q, K, V, dO, causal):
    """PyTorch's attention backward in the inputs' own dtype (autograd through ``scaled_dot_product_attention``,
    which PyTorch runs in float16 and bfloat16 on the CPU too): flash-attn's reference. Not the float32 stand-in of
    the forward tests: a float32 backward keeps P and dS unrounded, where PyTorch's 16-bit attention and every FA2
    kernel round them to 16 bits before the next product — with bf16 and large logits that alone is 4× the
    float32 error. Rows that see no key (causal, N_q > N_k) are left out — PyTorch gives them NaN, which would
    spread into every dK, dV — and get dQ = 0, their exact gradient."""
    G = Q.shape[-3] // K.shape[-3]
    N_q, N_k = Q.shape[-2], K.shape[-2]
    cut = max(0, N_q - N_k) if causal else 0
    q, k, v = (x.detach().clone().requires_grad_() for x in (Q[..., cut:, :], K, V))
    mask = torch.ones(N_q - cut, N_k, dtype=torch.bool).tril(N_k - N_q + cut) if causal else None
    O = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(G, -3), v.repeat_interleave(G, -3),
                                                         attn_mask=mask)
    O.backward(dO[..., cut:, :])
    dQ = torch.zeros(Q.shape, dtype=Q.dtype)
    dQ[..., cut:, :] = q.grad
    return dQ, k.grad, v.grad


def flash_attn_rule(grads, Q, K, V, dO, causal):
    """flash-attn's test rule for gradients: each of dQ, dK, dV within 2 × PyTorch's error in the same dtype (+ a
    small slack) of the float64 oracle; no NaN; rows that see no key get dQ = 0 exactly."""
    ref = fa2edu.attention_reference_backward(*(x.double().numpy() for x in (Q, K, V, dO)), causal=causal)
    pt = torch_gradients(Q, K, V, dO, causal)
    for name, ours, theirs, exact, x in zip(("dQ", "dK", "dV"), grads, pt, ref, (Q, K, V)):
        assert ours.dtype == Q.dtype and ours.shape == x.shape, name
        assert not torch.isnan(ours).any(), name
        err = np.abs(ours.double().numpy() - exact).max()
        err_pt = np.abs(theirs.double().numpy() - exact).max()
        assert err <= 2 * err_pt + 1e-3, (name, err, err_pt)
    if causal and Q.shape[-2] > K.shape[-2]:
        assert (grads[0][..., : Q.shape[-2] - K.shape[-2], :] == 0).all()


CASES = {  # (Q shape, K/V shape, causal, dtype, tile options, logit scale)
    # GQA (2 query heads per K/V head), N_q < N_k, bottom-right causal, d = 40 (not a multiple of 16), ragged;
    # two key blocks and two row blocks, the second key block skipping the first row block
    "causal-gqa-d40-f16": ((1, 2, 29, 40), (1, 1, 45, 40), True, "float16", dict(warps=2, B_r=16), 1.0),
    # N_q > N_k causal: 17 rows see no key (L = +inf), a whole row block among them; scores in the tens; bf16
    "masked-rows-bf16": ((1, 2, 28, 24), (1, 1, 11, 24), True, "bfloat16", dict(warps=2, B_r=16), 3.0),
    # the default tile shape (4 warps, B_c = B_r = 64) at d = 64, N not a multiple of 64
    "default-d64": ((1, 1, 20, 64), (1, 1, 30, 64), False, "float16", {}, 1.0),
    # dK, dV in two column chunks (the d > 128 scheme) on a small d: chunk 1 holds only columns 32-39; batch 2
    "chunks-d40": ((2, 1, 30, 40), (2, 1, 20, 40), False, "bfloat16", dict(warps=2, B_r=16, chunks=2), 1.0),
    # the smallest head dimension; two K/V heads (the only case here with more than one)
    "d8": ((1, 2, 19, 8), (1, 2, 21, 8), True, "float16", dict(warps=1, B_r=16), 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fastest_rung_matches_oracle(case, poisoned):
    shape_q, shape_kv, causal, dtype, tile, scale = CASES[case]
    Q, K, V, O, L, dO = _problem(shape_q, shape_kv, dtype, causal, seed=len(case), scale=scale)
    grads = flash2_backward(Q, K, V, O, L, dO, causal=causal, **tile)
    flash_attn_rule(grads, Q, K, V, dO, causal)


@pytest.mark.parametrize("version", sorted(v for v, f in BACKWARD_VERSIONS.items() if f is not flash2_backward))
def test_every_other_rung_matches_oracle(version, poisoned):
    """Every other rung on one case with several key blocks and row blocks, GQA, causal with N_q ≠ N_k (the
    second key block skips the first row block)."""
    Q, K, V, O, L, dO = _problem((1, 2, 30, 16), (1, 1, 45, 16), "float16", True, seed=7)
    grads = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True, warps=2, B_r=16)
    flash_attn_rule(grads, Q, K, V, dO, True)


@pytest.mark.parametrize("versions, batch, heads, d, chunks", [
    (("v5",), 2, 1, 16, 1),                         # a batch
    (("v5", "v7"), 1, 1, 24, 2),                    # column chunks (v7: the fastest rung)
    (("v6", "v7"), 1, 3, 16, 1)])                   # a GQA group of 3: the step counter crosses query heads
def test_later_rungs_are_v3_bit_for_bit(versions, batch, heads, d, chunks, poisoned):
    """v5 runs v3's kernels in v4's order (causal: the longest blocks first, every block index read from the other
    grid) with copies that step their addresses; v6 counts the key-block kernel's (query head, row block) steps
    instead of dividing them out and reads L_i, D_i at unsigned indices; v7 computes Sᵀ and dPᵀ in one loop.
    Every block still runs once and computes the same sums — gradients bit-identical to v3's, with two key blocks,
    two query blocks (the second key block skipping the first), N_q ≠ N_k, a batch, column chunks, and a GQA group
    of 3 (v6's counter moves to the next query head after the last row block).
    (Non-causal, d = 64 and 128: ``tests/gpu/test_tensorcore_backward_gpu.py``.)"""
    Q, K, V, O, L, dO = _problem((batch, heads, 30, d), (batch, 1, 40, d), "bfloat16", True, seed=11)
    tile = dict(warps=2, B_r=16, chunks=chunks)
    v3 = BACKWARD_VERSIONS["v3"](Q, K, V, O, L, dO, causal=True, **tile)     # once for the rungs of a case
    for version in versions:
        ours = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True, **tile)
        for name, a, b in zip("dQ dK dV".split(), v3, ours):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{version}'s {name} differs from v3's"
        flash_attn_rule(ours, Q, K, V, dO, True)


def test_numpy_float16_in_and_out():
    Q, K, V, O, L, dO = (x.numpy() for x in _problem((1, 13, 16), (1, 15, 16), "float16", False, seed=4))
    dQ, dK, dV = flash2_backward(Q, K, V, O, L, dO, warps=1, B_r=16)
    assert all(isinstance(x, np.ndarray) and x.dtype == np.float16 for x in (dQ, dK, dV))
    ref = fa2edu.attention_reference_backward(*(x.astype(np.float64) for x in (Q, K, V, dO)))
    for ours, exact in zip((dQ, dK, dV), ref):
        assert np.abs(ours - exact).max() < 3e-3


def test_first_row_block_is_the_first_that_sees_the_key_block():
    """The causal loop start of the kernels: row blocks before it see no key of key block j, it sees one."""
    for N_q, N_k, B_r, B_c in ((37, 70, 16, 32), (50, 17, 16, 16), (64, 64, 64, 64), (100, 300, 32, 64)):
        visible = np.tril(np.ones((N_q, N_k), dtype=bool), N_k - N_q)       # query r sees key c iff c ≤ r + N_k − N_q
        for j in range(-(-N_k // B_c)):
            i0 = backward_steps.first_row_block(j, B_r, B_c, N_q, N_k)
            seen = [visible[i * B_r:(i + 1) * B_r, j * B_c:(j + 1) * B_c].any() for i in range(-(-N_q // B_r))]
            assert not any(seen[:i0])
            assert i0 == len(seen) or seen[i0] or not any(seen)


def _args(**changes):
    z = np.zeros((1, 2, 8, 16), np.float16)
    args = dict(Q=z, K=z, V=z, O=z, L=np.zeros((1, 2, 8), np.float32), dO=z)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, match", [
    (dict(O=np.zeros((1, 2, 9, 16), np.float16)), "O must have Q's shape"),
    (dict(dO=np.zeros((1, 2, 8, 16), np.float32)), "dO must have Q's dtype"),
    (dict(L=np.zeros((1, 2, 8), np.float64)), "L must be float32"),
    (dict(L=np.zeros((1, 2, 9), np.float32)), "L must have shape"),
    (dict(L=np.full((1, 2, 8), np.nan, np.float32)), "NaN"),
    (dict(dO=np.full((1, 2, 8, 16), np.inf, np.float16)), "dO must be finite"),
    (dict(O=torch.zeros(1, 2, 8, 16, dtype=torch.float16)), "same kind"),
    (dict((x, np.zeros((1, 2, 8, 12), np.float16)) for x in ("Q", "K", "V", "O", "dO")), "multiples of 8"),
    (dict(K=np.zeros((1, 3, 8, 16), np.float16), V=np.zeros((1, 3, 8, 16), np.float16)),
     "multiple of the number of key/value heads"),
])
def test_bad_input(changes, match):
    args = _args(**changes)
    with pytest.raises((TypeError, ValueError), match=match):
        flash2_backward(**args)


def test_benchmark_parses_its_grid_without_a_gpu():
    from benchmarks import tensorcore_backward as bench
    args = bench.parse_args(["--out", "x.json", "--N", "1024,4096", "--d", "64"])
    assert args.impls.split(",") == sorted(BACKWARD_VERSIONS) + ["sdpa_flash"] and args.causal == "0,1"
