"""fa2edu.torch.flex_attention and flash_attention's flash-attn keywords: exact, differentiable, compilable.

What these tests prove, claim by claim:

* every ready mod of fa2edu.flex (masks: causal, sliding_window, local_window, prefix_lm, document; score_mods:
  alibi, symmetric_alibi, softcap, relative_bias, a chain of two), with GQA and N_q ≠ N_k, gives O, L, dQ, dK, dV
  equal to a dense float64 PyTorch reference (the mask and the score applied elementwise, autograd for the
  gradients) within 1e-10; float32 inputs give float32 results; PyTorch's own ``torch.nn.attention.flex_attention``
  (eager, CPU) gives the same O and log-sum-exp, with fa2edu's BlockMask and with PyTorch's (converted);
* rows that keep no score give O = 0, L = +inf and zero gradients, never NaN (fa2edu's convention);
* ``torch.autograd.gradcheck`` (finite differences, float64) passes through soft capping, ALiBi and windows;
* a user score_mod differentiates with ``score_mod_grad=``, and without one the backward (only) raises an error
  naming score_mod_grad; a double backward is refused, as flash_attention's;
* flash_attention's ``window_size``, ``softcap`` and ``alibi_slopes`` follow flash-attn's definitions (its
  ``attention_ref``: cap, then window mask, then bias −slope·|i + N_k − N_q − j|), and change nothing when unset;
* the operators pass ``torch.library.opcheck``; ``torch.compile(fullgraph=True)`` (AOT-autograd backend, no code
  generation) traces both functions and equals eager mode, recompiling for other mods instead of reusing theirs;
  the eager road and the traced road give the same bits; the traced road's registry of mods does not grow with
  calls, lets mods die, and is thread-safe;
* bad input gets an error naming the argument, CUDA tensors included (fake CUDA tensors: no GPU needed).
"""

from __future__ import annotations

import gc
import math
import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tolerances import assert_close_to_oracle, baseline_error  # noqa: E402

import fa2edu  # noqa: E402
import fa2edu.torch as op  # noqa: E402
from fa2edu import _torch_ops as ops  # noqa: E402
from fa2edu import flex  # noqa: E402
from fa2edu.torch import flash_attention, flex_attention  # noqa: E402

INF = math.inf


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(q_shape, k_shape, d_v, dtype=torch.float64, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, dtype=dtype, generator=generator)
    k = torch.randn(k_shape, dtype=dtype, generator=generator)
    v = torch.randn(k_shape[:-1] + (d_v,), dtype=dtype, generator=generator)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


# -- the dense reference ---------------------------------------------------------------------------------------------

def dense(q, k, v, keep=None, score=None, scale=None):
    """(O, L) by definition, in PyTorch ops (autograd differentiates it): S = τ q kᵀ (GQA: k, v repeated per
    group), S' = score(S, b, h, i, j) on broadcast index tensors, −inf where ``keep`` is False, P = softmax(S');
    a row that keeps nothing has P = 0 and L = +inf. The shift by the row max is detached: the softmax does not
    depend on it, so the gradients are exact."""
    G = q.shape[-3] // k.shape[-3]
    K, V = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = tau * q @ K.transpose(-1, -2)
    B, H, N_q, N_k = S.shape
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    i, j = torch.arange(N_q).view(1, 1, N_q, 1), torch.arange(N_k).view(1, 1, 1, N_k)
    if score is not None:
        S = score(S, b, h, i, j)
    if keep is not None:
        S = S.masked_fill(~keep(b, h, i, j), -INF)
    m = S.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    E = torch.exp(S - m)
    l = E.sum(dim=-1, keepdim=True)
    O = (E / torch.where(l == 0, torch.ones_like(l), l)) @ V
    L = torch.where(l == 0, torch.full_like(l, INF), m + torch.log(l))[..., 0]
    return O, L


def forward_backward(fn, q, k, v, dO):
    """O, L and (dQ, dK, dV) of ``fn(q, k, v) -> (O, L)`` for the upstream gradient dO."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    O, L = fn(q, k, v)
    O.backward(dO)
    return [O.detach(), L.detach(), q.grad, k.grad, v.grad]


def assert_all_close(got, expected, label):
    for name, a, e in zip(("O", "L", "dQ", "dK", "dV"), got, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, f"{label} {name}: {a.dtype} {a.shape} vs {e.dtype} {e.shape}"
        assert_close_to_oracle(a.numpy(), e.numpy(), f"{label} {name}")


# -- every ready mod, against the dense reference ---------------------------------------------------------------------

N_Q, N_K = 7, 9                                          # N_q < N_k: bottom-right offset 2
OFFSET = N_K - N_Q
IDS_Q, IDS_K = np.array([0, 0, 0, 1, 1, 2, 2]), np.array([0, 0, 0, 0, 1, 1, 2, 2, 2])
SLOPES = flex.alibi_slopes(4)
SLOPES_BH = np.array([[0.5, 0.25, 0.125, 1.0], [0.3, 0.6, 0.9, 0.1]])
TABLE = np.linspace(-1.0, 1.0, 7)

# name: (mask_mod, the same mask on index tensors, score_mod, the same score on tensors); query i sits at key
# position p = i + OFFSET (fa2edu's bottom-right alignment).
MODS = {
    "causal": (flex.causal, lambda b, h, i, j: j <= i + OFFSET, None, None),
    "sliding_window": (flex.sliding_window(3), lambda b, h, i, j: (j <= i + OFFSET) & (j > i + OFFSET - 3), None,
                       None),
    "local_window": (flex.local_window(2, 1), lambda b, h, i, j: (j >= i + OFFSET - 2) & (j <= i + OFFSET + 1),
                     None, None),
    "prefix_lm": (flex.prefix_lm(3), lambda b, h, i, j: (j < 3) | (j <= i + OFFSET), None, None),
    "document": (flex.document(IDS_Q, IDS_K),
                 lambda b, h, i, j: torch.from_numpy(IDS_Q)[i] == torch.from_numpy(IDS_K)[j], None, None),
    "alibi+causal": (flex.causal, lambda b, h, i, j: j <= i + OFFSET, flex.alibi(SLOPES),
                     lambda S, b, h, i, j: S + torch.from_numpy(SLOPES)[h] * (j - i)),
    "symmetric_alibi(B,H)": (None, None, flex.symmetric_alibi(SLOPES_BH),
                             lambda S, b, h, i, j: S - torch.from_numpy(SLOPES_BH)[b, h] * (i + OFFSET - j).abs()),
    "softcap+sliding_window": (flex.sliding_window(4), lambda b, h, i, j: (j <= i + OFFSET) & (j > i + OFFSET - 4),
                               flex.softcap(1.5), lambda S, b, h, i, j: 1.5 * torch.tanh(S / 1.5)),
    "relative_bias": (None, None, flex.relative_bias(TABLE),
                      lambda S, b, h, i, j: S + torch.from_numpy(TABLE)[(j - i + 3).clamp(0, 6)]),
    "chain(softcap, symmetric_alibi)": (
        flex.local_window(3, 3), lambda b, h, i, j: (j >= i + OFFSET - 3) & (j <= i + OFFSET + 3),
        flex.chain_score_mods(flex.softcap(2.0), flex.symmetric_alibi(SLOPES)),
        lambda S, b, h, i, j: 2.0 * torch.tanh(S / 2.0) - torch.from_numpy(SLOPES)[h] * (i + OFFSET - j).abs()),
}


@pytest.mark.parametrize("name", list(MODS))
def test_every_ready_mod_equals_the_dense_reference(name):
    mask_mod, keep, score_mod, score = MODS[name]
    # GQA 4:2, N_q = 7 ≠ N_k = 9, d_v ≠ d, blocks (2, 4) that divide neither length, a custom scale
    q, k, v = make_inputs((2, 4, N_Q, 5), (2, 2, N_K, 5), 3, seed=1)
    dO = torch.randn(2, 4, N_Q, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    bm = None if mask_mod is None else fa2edu.create_block_mask(mask_mod, None, None, N_Q, N_K, BLOCK_SIZE=(2, 4))
    got = forward_backward(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=0.7,
                                                          enable_gqa=True, return_lse=True), q, k, v, dO)
    expected = forward_backward(lambda q, k, v: dense(q, k, v, keep, score, scale=0.7), q, k, v, dO)
    assert_all_close(got, expected, name)


def test_float32_in_float32_out():
    q, k, v = make_inputs((1, 2, 6, 4), (1, 2, 6, 4), 4, dtype=torch.float32, requires_grad=True)
    bm = fa2edu.create_block_mask(flex.causal, None, None, 6, 6, BLOCK_SIZE=4)
    O, L = flex_attention(q, k, v, score_mod=flex.softcap(3.0), block_mask=bm, return_lse=True)
    O.sum().backward()
    assert O.dtype == L.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float32
    O_ref, L_ref = dense(*(x.detach().double() for x in (q, k, v)), lambda b, h, i, j: j <= i,
                         lambda S, b, h, i, j: 3.0 * torch.tanh(S / 3.0))
    torch.testing.assert_close(O.detach().double(), O_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(L.double(), L_ref, rtol=1e-5, atol=1e-5)


def _torch_flex():
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError as error:                                             # pragma: no cover (older torch)
        pytest.skip(f"this torch has no torch.nn.attention.flex_attention: {error}")
    return module


@pytest.mark.parametrize("mask", ["fa2edu BlockMask", "PyTorch BlockMask"])
def test_forward_equals_pytorchs_flex_attention(mask):
    """torch.nn.attention.flex_attention, eager on the CPU (forward only: PyTorch has no CPU backward), with
    GQA; the same BlockMask object for both when it is PyTorch's (fa2edu converts it)."""
    tf = _torch_flex()
    q, k, v = make_inputs((2, 4, 12, 8), (2, 2, 12, 8), 8, seed=3)
    slopes = torch.from_numpy(SLOPES)
    if mask == "fa2edu BlockMask":
        ours = fa2edu.create_block_mask(flex.causal, None, None, 12, 12, BLOCK_SIZE=4)
        theirs = tf.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 12, 12, device="cpu",
                                      BLOCK_SIZE=4)
    else:
        ours = theirs = tf.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 3, 2, None, 12,
                                             12, device="cpu", BLOCK_SIZE=4)
    O, L = flex_attention(q, k, v, score_mod=flex.alibi(SLOPES), block_mask=ours, enable_gqa=True, return_lse=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                        # "flex_attention called without torch.compile"
            O_t, L_t = tf.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (
                kv_idx - q_idx), block_mask=theirs, enable_gqa=True, return_lse=True)
    except NotImplementedError as error:                                   # pragma: no cover (torch-dependent)
        pytest.skip(f"torch's flex_attention does not run eagerly on this CPU: {error}")
    assert_close_to_oracle(O.numpy(), O_t.numpy(), "O")
    assert_close_to_oracle(L.numpy(), L_t.numpy(), "L")


def test_pytorch_block_mask_is_converted_block_for_block():
    tf = _torch_flex()
    theirs = tf.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 16, 16, device="cpu",
                                  BLOCK_SIZE=4)
    ours = ops.from_torch_block_mask(theirs)
    assert ours is ops.from_torch_block_mask(theirs)                     # converted once while it lives
    reference = fa2edu.create_block_mask(flex.causal, None, None, 16, 16, BLOCK_SIZE=4)
    assert ours.shape == reference.shape and ours.BLOCK_SIZE == reference.BLOCK_SIZE
    assert np.array_equal(ours.classes, reference.classes)


# -- fully masked rows, derivatives --------------------------------------------------------------------------------

def test_rows_that_keep_no_score_give_zero_output_infinite_lse_and_zero_gradients():
    # causal with N_q = 8 > N_k = 5: the first 3 queries see no key; a document id no key has masks row 7 too
    q, k, v = make_inputs((1, 2, 8, 4), (1, 2, 5, 4), 4, seed=4)
    dO = torch.randn(1, 2, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ids_q, ids_k = np.array([0, 0, 0, 0, 0, 0, 0, 9]), np.zeros(5, dtype=int)
    mask_mod = flex.and_masks(flex.causal, flex.document(ids_q, ids_k))
    bm = fa2edu.create_block_mask(mask_mod, None, None, 8, 5, BLOCK_SIZE=(3, 2))
    got = forward_backward(lambda q, k, v: flex_attention(q, k, v, score_mod=flex.softcap(2.0), block_mask=bm,
                                                          return_lse=True), q, k, v, dO)
    empty = [0, 1, 2, 7]
    O, L, dQ = got[0], got[1], got[2]
    assert (O[..., empty, :] == 0).all() and torch.isposinf(L[..., empty]).all() and (dQ[..., empty, :] == 0).all()
    assert not any(torch.isnan(x).any() for x in got)
    keep = (lambda b, h, i, j: (j <= i - 3) & torch.from_numpy(ids_q[:, None] == ids_k[None, :]))
    expected = forward_backward(lambda q, k, v: dense(q, k, v, keep, lambda S, b, h, i, j: 2 * torch.tanh(S / 2)),
                                q, k, v, dO)
    assert_all_close(got, expected, "masked rows")


GRADCHECK = {
    "flex softcap + sliding window": lambda q, k, v: flex_attention(
        q, k, v, score_mod=flex.softcap(1.0),
        block_mask=fa2edu.create_block_mask(flex.sliding_window(2), None, None, 4, 5, BLOCK_SIZE=2)),
    "flash_attention softcap": lambda q, k, v: flash_attention(q, k, v, softcap=0.8, block_sizes=(2, 3)),
    "flash_attention alibi": lambda q, k, v: flash_attention(q, k, v, alibi_slopes=torch.tensor([0.5, 0.25]),
                                                             block_sizes=(3, 2)),
    "flash_attention sliding window": lambda q, k, v: flash_attention(q, k, v, window_size=(1, 1), causal=False,
                                                                      block_sizes=(2, 2)),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_gradcheck_float64(name):
    q, k, v = make_inputs((1, 2, 4, 3), (1, 2, 5, 3), 2, seed=6, requires_grad=True)
    assert torch.autograd.gradcheck(GRADCHECK[name], (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_a_user_score_mod_needs_its_derivative_for_the_backward_only():
    q, k, v = make_inputs((1, 2, 5, 4), (1, 2, 5, 4), 4, seed=7, requires_grad=True)

    def square_bias(score, b, h, q_idx, kv_idx):                 # a plain-Python mod: no score_mod_grad attribute
        return score + 0.1 * score * score

    O = flex_attention(q, k, v, score_mod=square_bias)                       # the forward pass needs no derivative
    with pytest.raises(ValueError, match="score_mod_grad"):
        O.sum().backward()
    dO = torch.ones(1, 2, 5, 4, dtype=torch.float64)
    got = forward_backward(lambda q, k, v: flex_attention(
        q, k, v, score_mod=square_bias, score_mod_grad=lambda score, b, h, q_idx, kv_idx: 1 + 0.2 * score,
        return_lse=True), q, k, v, dO)
    expected = forward_backward(lambda q, k, v: dense(q, k, v, None, lambda S, b, h, i, j: S + 0.1 * S * S),
                                q, k, v, dO)
    assert_all_close(got, expected, "user score_mod")


@pytest.mark.parametrize("function", ["flex_attention", "flash_attention"])
def test_double_backward_is_refused(function):
    q, k, v = make_inputs((1, 2, 4, 3), (1, 2, 5, 3), 3, seed=8, requires_grad=True)
    attention = (lambda: flex_attention(q, k, v, score_mod=flex.softcap(1.0))) if function == "flex_attention" else (
        lambda: flash_attention(q, k, v, softcap=1.0))
    (g,) = torch.autograd.grad(attention().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        (g ** 2).sum().backward()


# -- flash_attention's flash-attn keywords ---------------------------------------------------------------------------

def dense_flash_attn(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """flash-attn's definition (its tests' attention_ref): S = τ q kᵀ; S = softcap·tanh(S/softcap); keys outside
    [p − left, p + right], p = i + N_k − N_q, masked (a side ≥ N_k unbounded, as flash_api.cpp normalises it,
    then causal makes right 0); then −slope·|p − j| added."""
    N_q, N_k = q.shape[-2], k.shape[-2]
    left, right = (-1 if side >= N_k else side for side in window_size)
    right = 0 if causal else right

    def keep(b, h, i, j):
        p = i + N_k - N_q
        return (((j >= p - left) if left >= 0 else j >= 0) & ((j <= p + right) if right >= 0 else j >= 0))

    def score(S, b, h, i, j):
        if softcap > 0:
            S = softcap * torch.tanh(S / softcap)
        if alibi_slopes is not None:
            slopes = alibi_slopes.double().reshape(-1, alibi_slopes.shape[-1], 1, 1)         # (1 | B, H, 1, 1)
            S = S - slopes * (i + N_k - N_q - j).abs()
        return S
    return dense(q, k, v, keep, score)


FLASH_ATTN_CASES = {   # name: (N_q, N_k, keywords)
    "window (2, 1)": (7, 9, dict(window_size=(2, 1))),
    "window (3, -1) causal": (9, 6, dict(window_size=(3, -1), causal=True)),     # N_q > N_k: empty rows
    "window (-1, 2)": (6, 6, dict(window_size=(-1, 2))),
    "window (0, 0)": (5, 8, dict(window_size=(0, 0))),
    "window (1, N_k) with N_q > N_k": (9, 4, dict(window_size=(1, 4))),        # right ≥ N_k: unbounded
    "softcap": (7, 9, dict(softcap=2.5)),
    "alibi (H,)": (7, 9, dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))),
    "alibi (B, H) causal": (8, 8, dict(alibi_slopes=torch.rand(2, 4, generator=torch.Generator().manual_seed(9)),
                                       causal=True)),
    "all three": (7, 9, dict(window_size=(4, 0), softcap=3.0, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.4]))),
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_CASES))
def test_flash_attn_keywords_equal_flash_attns_definition(name):
    N_q, N_k, keywords = FLASH_ATTN_CASES[name]
    q, k, v = make_inputs((2, 4, N_q, 6), (2, 2, N_k, 6), 5, seed=10)
    dO = torch.randn(2, 4, N_q, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    got = forward_backward(lambda q, k, v: flash_attention(q, k, v, return_lse=True, block_sizes=(3, 4), **keywords),
                           q, k, v, dO)
    expected = forward_backward(lambda q, k, v: dense_flash_attn(q, k, v, **keywords), q, k, v, dO)
    assert_all_close(got, expected, name)


def test_flash_attn_keywords_unset_change_nothing_and_compose_with_the_layouts():
    q, k, v = make_inputs((2, 3, 6, 4), (2, 3, 8, 4), 4, seed=12)
    plain = flash_attention(q, k, v, causal=True, block_sizes=(4, 4))
    assert torch.equal(plain, flash_attention(q, k, v, causal=True, block_sizes=(4, 4), window_size=(-1, -1),
                                              softcap=0.0, alibi_slopes=None))
    # window (-1, 0) is the bottom-right causal mask, through the flex machinery (NumPy ints are ints too)
    assert_close_to_oracle(flash_attention(q, k, v, window_size=(np.int64(-1), 0)).numpy(), plain.numpy(),
                           "window (-1, 0)")
    # (…, H, N, d) with any leading axes, as flash_attention takes: 3-D, and 5-D with (B1, B2, H) slopes
    O3 = flash_attention(q[0], k[0], v[0], softcap=1.0)
    assert_close_to_oracle(O3.numpy(), flash_attention(q, k, v, softcap=1.0)[0].numpy(), "3-D")
    slopes = torch.rand(2, 1, 3, generator=torch.Generator().manual_seed(13))
    O5 = flash_attention(q[:, None], k[:, None], v[:, None], alibi_slopes=slopes)
    assert O5.shape == (2, 1, 3, 6, 4)
    assert_close_to_oracle(O5[:, 0].numpy(), flash_attention(q, k, v, alibi_slopes=slopes[:, 0]).numpy(), "5-D")


# -- the registered operators, torch.compile, the two roads ------------------------------------------------------------

@pytest.fixture
def registered():
    """Mods registered for the traced road, alive for the test."""
    score_mod = flex.softcap(2.0)
    bm = fa2edu.create_block_mask(flex.causal, None, None, 5, 7, BLOCK_SIZE=(2, 3))
    return score_mod, bm, ops.MODS.register(ops.flex_mods(score_mod, bm, None))


def test_opcheck_flex_operators(registered):
    *_, key = registered
    q, k, v = make_inputs((1, 4, 5, 3), (1, 2, 7, 3), 4, requires_grad=True)
    result = torch.library.opcheck(ops.flex_attention_fwd, (q, k, v, key, 0.4, True, "numpy"))
    assert set(result.values()) == {"SUCCESS"}, result
    O, L = ops.flex_attention_fwd(q.detach(), k.detach(), v.detach(), key, 0.4, True, "numpy")
    dO = torch.randn(O.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    result = torch.library.opcheck(ops.flex_attention_bwd, (dO, q.detach(), k.detach(), v.detach(), O, L, key, 0.4,
                                                            True, "numpy"))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("slopes", [None, torch.tensor([0.5, 0.4, 0.3, 0.2])])
def test_opcheck_flash_attn_keyword_operators(slopes):
    q, k, v = make_inputs((1, 4, 5, 3), (1, 2, 7, 3), 4, dtype=torch.float32, requires_grad=True)
    args = (slopes, True, 2, -1, 1.5, 0.4, [2, 3], "numpy")
    result = torch.library.opcheck(ops.flash_attention_flex_fwd, (q, k, v) + args)
    assert set(result.values()) == {"SUCCESS"}, result
    O, L = ops.flash_attention_flex_fwd(q.detach(), k.detach(), v.detach(), *args)
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1))
    result = torch.library.opcheck(ops.flash_attention_flex_bwd, (dO, q.detach(), k.detach(), v.detach(), O, L)
                                   + args)
    assert set(result.values()) == {"SUCCESS"}, result


class FlexLayer(torch.nn.Module):
    """Both functions in one layer, the mods kept as attributes (alive as long as the compiled code)."""

    def __init__(self, N):
        super().__init__()
        self.score_mod = flex.chain_score_mods(flex.softcap(5.0), flex.alibi(flex.alibi_slopes(4)))
        self.block_mask = fa2edu.create_block_mask(flex.sliding_window(4), None, None, N, N, BLOCK_SIZE=4)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]))

    def forward(self, q, k, v):
        O, L = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=self.block_mask, enable_gqa=True,
                              return_lse=True)
        return O + flash_attention(q, k, v, window_size=(2, 2), softcap=3.0, alibi_slopes=self.slopes), L


def run_and_backward(fn, *inputs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    O, L = fn(*leaves)
    (O * torch.linspace(-1, 1, O.numel(), dtype=O.dtype).view(O.shape)).sum().backward()
    return [O.detach(), L] + [x.grad for x in leaves]


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    q, k, v = make_inputs((1, 4, 9, 4), (1, 2, 9, 4), 4, seed=14)
    layer = FlexLayer(9)
    eager = run_and_backward(layer, q, k, v)
    compiled = run_and_backward(torch.compile(layer, fullgraph=True, backend="aot_eager"), q, k, v)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_compile_recompiles_for_other_mods_and_traces_the_operator():
    # Two softcap closures share their code: the compiled code must guard on which one it got (its key), and the
    # graph must hold the registered operator, opaque, not the eager road's Function.
    torch._dynamo.reset()
    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    def attention(q, k, v, score_mod):
        return flex_attention(q, k, v, score_mod=score_mod)

    compiled = torch.compile(attention, fullgraph=True, backend=backend)
    q, k, v = make_inputs((1, 2, 6, 4), (1, 2, 6, 4), 4, seed=15)
    for c in (0.5, 4.0, 0.5):
        score_mod = flex.softcap(c)
        assert torch.equal(compiled(q, k, v, score_mod), attention(q, k, v, score_mod)), c
    assert any("flex_attention_fwd" in t for t in targets) and not any("_Flex" in t for t in targets), targets


def test_a_compiled_backward_finds_mods_the_caller_let_go_of():
    torch._dynamo.reset()
    q, k, v = make_inputs((1, 2, 6, 4), (1, 2, 6, 4), 4, seed=16, requires_grad=True)
    compiled = torch.compile(lambda q, k, v, mod: flex_attention(q, k, v, score_mod=mod), fullgraph=True,
                             backend="aot_eager")
    O = compiled(q, k, v, flex.softcap(1.0))                   # nothing but the graph refers to the mod now
    gc.collect()
    O.sum().backward()                                            # the mods live with L, which the backward saved
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("function", ["flex_attention", "flash_attention"])
def test_the_eager_and_traced_roads_return_the_same_bits(monkeypatch, function):
    q, k, v = make_inputs((2, 4, 7, 5), (2, 2, 9, 5), 3, seed=17)
    bm = fa2edu.create_block_mask(flex.prefix_lm(2), None, None, 7, 9, BLOCK_SIZE=(3, 4))
    score_mod = flex.relative_bias(TABLE)
    if function == "flex_attention":
        def run(q, k, v):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True)
    else:
        def run(q, k, v):
            return flash_attention(q, k, v, causal=True, window_size=(3, 2), softcap=2.0, return_lse=True,
                                   alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4]))
    eager = run_and_backward(run, q, k, v)
    monkeypatch.setattr(op, "_eager", lambda *tensors: False)
    traced = run_and_backward(run, q, k, v)
    for a, b in zip(eager, traced):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_registry_does_not_grow_with_calls_and_lets_mods_die(monkeypatch):
    q, k, v = make_inputs((1, 2, 6, 4), (1, 2, 6, 4), 4, seed=18)
    gc.collect()
    before = len(ops.MODS)
    score_mod = flex.softcap(2.0)
    for _ in range(3):                                       # the eager road never registers
        flex_attention(q, k, v, score_mod=score_mod)
    assert len(ops.MODS) == before
    monkeypatch.setattr(op, "_eager", lambda *tensors: False)
    outputs = [flex_attention(q, k, v, score_mod=score_mod) for _ in range(3)]
    assert len(ops.MODS) == before + 1                          # the same mods, the same key
    del outputs, score_mod
    gc.collect()
    assert len(ops.MODS) == before                              # gone with the mods
    with pytest.raises(RuntimeError, match="are gone"):
        ops.MODS.lookup(10 ** 9)


def test_the_registry_is_thread_safe():
    shared = ops.flex_mods(flex.softcap(2.0), None, None)
    own = [ops.flex_mods(flex.softcap(1.0 + n), None, None) for n in range(8)]
    keys, errors = [[] for _ in own], []

    def work(n):
        try:
            for _ in range(50):
                keys[n].append((ops.MODS.register(shared), ops.MODS.register(own[n])))
                assert ops.MODS.lookup(keys[n][-1][1]).score_mod is own[n].score_mod
        except Exception as error:                              # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(own))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len({key for run in keys for key, _ in run}) == 1                 # one key for the shared mods
    assert all(len({mine for _, mine in run}) == 1 for run in keys)
    assert len({run[0][1] for run in keys}) == len(own)


# -- errors --------------------------------------------------------------------------------------------------------

def test_flex_errors_name_the_argument():
    q, k, v = make_inputs((1, 2, 4, 3), (1, 2, 4, 3), 3)
    bm = fa2edu.create_block_mask(flex.causal, None, None, 4, 4)
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        flex_attention(q, k, v, score_mod=2.0)
    with pytest.raises(TypeError, match="score_mod_grad must be a callable"):
        flex_attention(q, k, v, score_mod=flex.softcap(1.0), score_mod_grad="1")
    with pytest.raises(ValueError, match="score_mod_grad was given without a score_mod"):
        flex_attention(q, k, v, score_mod_grad=lambda *args: 1.0)
    with pytest.raises(TypeError, match="block_mask must be a fa2edu.flex.BlockMask"):
        flex_attention(q, k, v, block_mask=np.ones((4, 4), dtype=bool))
    with pytest.raises(ValueError, match="block_mask was made for Q_LEN = 4, KV_LEN = 4"):
        flex_attention(q, k[:, :, :3], v[:, :, :3], block_mask=bm)
    with pytest.raises(ValueError, match=r"block_mask covers \(B, H\) = \(3, 1\)"):
        flex_attention(q, k, v, block_mask=fa2edu.create_block_mask(flex.causal, 3, None, 4, 4))
    with pytest.raises(ValueError, match="q must have 4 axes"):
        flex_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        flex_attention(q.repeat(1, 2, 1, 1), k, v)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        flex_attention(q, k, v, enable_gqa=1)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flex_attention(q, k, v, return_lse="yes")
    with pytest.raises(TypeError, match="on the CPU fa2edu.torch.flex_attention takes float32 or float64"):
        flex_attention(q.half(), k.half(), v.half())
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flex_attention(q, k.numpy(), v)
    with pytest.raises(ValueError, match="score_mod .* returned NaN or \\+inf"):
        flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score * np.inf)


def test_flash_attn_keyword_errors_name_the_argument():
    q, k, v = make_inputs((1, 2, 4, 3), (1, 2, 4, 3), 3)
    for bad in [3, (1, 2, 3), (1.0, 2), (True, 0), "(-1, -1)"]:
        with pytest.raises(TypeError, match="window_size must be a pair of ints"):
            flash_attention(q, k, v, window_size=bad)
    with pytest.raises(ValueError, match="window_size must hold -1"):
        flash_attention(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        flash_attention(q, k, v, softcap=-1.0)
    with pytest.raises(TypeError, match="softcap must be a real number"):
        flash_attention(q, k, v, softcap="1")
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor"):
        flash_attention(q, k, v, alibi_slopes=[0.5, 0.25])
    with pytest.raises(TypeError, match="alibi_slopes must have dtype torch.float32"):
        flash_attention(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.float64))
    for shape in [(3,), (2, 2), (1, 2, 1)]:
        with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(2,\) or \(B, H\)"):
            flash_attention(q, k, v, alibi_slopes=torch.ones(shape))
    with pytest.raises(ValueError, match="alibi_slopes contains NaN"):
        flash_attention(q, k, v, alibi_slopes=torch.tensor([0.5, math.nan]))
    with pytest.raises(ValueError, match="algorithm must be 'flash2'"):
        flash_attention(q, k, v, algorithm="flash1", softcap=1.0)
    with pytest.raises(ValueError, match="runs on the 'numpy' or 'tensorcore' backend"):
        flash_attention(q, k, v, backend="fast", window_size=(1, 1))
    with pytest.raises(ValueError, match="M .* applies to the NumPy backend"):
        flash_attention(q.half(), k.half(), v.half(), backend="tensorcore", window_size=(1, 1), M=4096)


def test_cuda_float32_gets_a_clear_error_and_16_bit_cuda_tensors_trace():
    # Fake CUDA tensors (no GPU, no data). float32: no FlexAttention kernel of float32's accuracy, so an error that
    # names the two honest choices (cast to bfloat16, or the CPU), never a silent cast or copy. bfloat16 and
    # float16: the traced road's operators, whose fakes give the shapes the kernels return.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(1, 2, 4, 3, device="cuda")
        with pytest.raises(TypeError, match="fa2edu.torch.flex_attention on CUDA takes float16 or bfloat16.*"
                                            "Cast q, k, v to torch.bfloat16"):
            flex_attention(q, q, q)
        with pytest.raises(TypeError, match="window_size, softcap or alibi_slopes on CUDA takes float16"):
            flash_attention(q, q, q, softcap=30.0)
        with pytest.raises(ValueError, match="backend='numpy' runs on cpu, but q, k, v are on cuda"):
            flex_attention(q, q, q, backend="numpy")
        h = torch.empty(1, 4, 5, 12, device="cuda", dtype=torch.bfloat16)
        kv = torch.empty(1, 2, 7, 12, device="cuda", dtype=torch.bfloat16)
        v8 = torch.empty(1, 2, 7, 8, device="cuda", dtype=torch.bfloat16)
        O, L = flex_attention(h, kv, v8, score_mod=flex.softcap(2.0), enable_gqa=True, return_lse=True)
        assert (O.shape, O.dtype, O.device.type) == ((1, 4, 5, 8), torch.bfloat16, "cuda")
        assert (L.shape, L.dtype) == ((1, 4, 5), torch.float32)
        O = flash_attention(h.half(), kv.half(), kv.half(), window_size=(2, 0), alibi_slopes=torch.ones(4,
                            device="cuda"))
        assert (O.shape, O.dtype) == ((1, 4, 5, 12), torch.float16)
    with pytest.raises(TypeError, match="on the CPU fa2edu.torch.flex_attention takes float32 or float64"):
        flex_attention(*(torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16) for _ in range(3)))


# -- the GPU route (kernels_gpu.flex) in numba's CUDA simulator: CPU tensors, backend="tensorcore" -------------------
#
# Each case is one small problem (16 × 16 tiles: one warp per block), forward and backward, against the float64 dense
# reference (checked against fa2edu.flex's NumPy result first) by flash-attn's rule: within 2× the error of the same
# computation in the inputs' own dtype, plus a floor (tests/tolerances.py). The simulator runs every CUDA thread as a
# Python thread: a case takes a few seconds.

_skip_without_simulator = pytest.mark.skipif(
    not ops.simulator_enabled(), reason="CPU tensors reach the CUDA backends only in numba's CUDA simulator "
    "(NUMBA_ENABLE_CUDASIM=1, the tests' default)")


def needs_simulator(test):
    """Simulator cases: skipped without the simulator, and in the `slow` tier (conftest.py; about 45 s here)."""
    return pytest.mark.slow(_skip_without_simulator(test))


def dense_low(q, k, v, keep=None, score=None, scale=None):
    """The same function in the inputs' 16-bit dtype, as PyTorch's attention computes it: q kᵀ and P V in that
    dtype, the scores, the mods and the softmax in float32 (the baseline of flash-attn's rule)."""
    G = q.shape[-3] // k.shape[-3]
    K, V = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = (q @ K.transpose(-1, -2)).float() * tau
    B, H, N_q, N_k = S.shape
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    i, j = torch.arange(N_q).view(1, 1, N_q, 1), torch.arange(N_k).view(1, 1, 1, N_k)
    if score is not None:
        S = score(S, b, h, i, j).float()
    if keep is not None:
        S = S.masked_fill(~keep(b, h, i, j), -INF)
    P = torch.nan_to_num(torch.softmax(S, dim=-1)).to(q.dtype)
    return P @ V


def low_forward_backward(fn, q, k, v, dO):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    O = fn(q, k, v)
    O.backward(dO)
    return [O.detach(), q.grad, k.grad, v.grad]


def check_gpu_route(fn_gpu, fn_numpy, keep, score, q, k, v, dO, scale=None, masked_rows=()):
    """O, L, dQ, dK, dV of ``fn_gpu`` (16-bit CPU tensors, backend="tensorcore") against the float64 dense
    reference, which must equal ``fn_numpy`` (fa2edu.flex on float64 tensors) first."""
    wide = [x.detach().double() for x in (q, k, v, dO)]
    expected = forward_backward(lambda q, k, v: dense(q, k, v, keep, score, scale=scale), *wide)
    assert_all_close(forward_backward(fn_numpy, *wide), expected, "NumPy flex")
    low = low_forward_backward(lambda q, k, v: dense_low(q, k, v, keep, score, scale=scale), q, k, v, dO)
    got = forward_backward(fn_gpu, q, k, v, dO)
    O, L = got[0], got[1]
    assert O.dtype == q.dtype and L.dtype == torch.float32 and O.shape == dO.shape and L.shape == dO.shape[:-1]
    assert [g.dtype for g in got[2:]] == [q.dtype] * 3 and [g.shape for g in got[2:]] == [q.shape, k.shape, v.shape]
    finite = torch.isfinite(expected[1])
    assert torch.equal(torch.isposinf(L), ~finite), "L = +inf exactly on the rows that keep no score"
    np.testing.assert_allclose(L[finite].numpy(), expected[1][finite].numpy(), rtol=1e-4, atol=1e-4)
    for name, ours, ref, base in zip(("O", "dQ", "dK", "dV"), [O] + got[2:], [expected[0]] + expected[2:], low):
        ref = ref.numpy()
        assert_close_to_oracle(ours.double().numpy(), ref, name, dtype=np.float16,
                               baseline=baseline_error(base.double().numpy(), ref))
    for row in masked_rows:
        assert not finite[..., row].any() and (O[..., row, :] == 0).all() and (got[2][..., row, :] == 0).all()
    return got


def _low_inputs(q_shape, k_shape, d_v, dtype, seed):
    q, k, v = make_inputs(q_shape, k_shape, d_v, dtype=torch.float64, seed=seed)
    dO = torch.randn(q_shape[:-1] + (d_v,), dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return [x.to(dtype) for x in (q, k, v, dO)]


OFF_GPU = 13 - 20        # causal case: N_q = 20 > N_k = 13, offset −7: queries 0 … 6 see no key
DOCS_Q, DOCS_K = np.repeat(np.arange(3), [7, 9, 8]), np.repeat(np.arange(3), [5, 12, 7])
TABLE_GPU = np.linspace(-1.0, 1.0, 9)
GPU_CASES = {  # name: (q shape, k shape, d_v, dtype, mask_mod, keep, score_mod, score, masked rows)
    # GQA 2:1, N_q > N_k (bottom-right causal: 7 rows see nothing, a whole partial/skipped first row block)
    "causal-gqa-ragged": ((1, 2, 20, 16), (1, 1, 13, 16), 16, torch.bfloat16, flex.causal,
                          lambda b, h, i, j: j <= i + OFF_GPU, None, None, range(7)),
    # d = 12, d_v = 8: both padded to 16 inside the op
    "sliding_window-padded": ((1, 1, 24, 12), (1, 1, 24, 12), 8, torch.float16, flex.sliding_window(5),
                              lambda b, h, i, j: (j <= i) & (j > i - 5), None, None, ()),
    "prefix_lm": ((1, 1, 18, 16), (1, 1, 22, 16), 16, torch.bfloat16, flex.prefix_lm(6),
                  lambda b, h, i, j: (j < 6) | (j <= i + 4), None, None, ()),
    "document": ((1, 1, 24, 16), (1, 1, 24, 16), 16, torch.bfloat16, flex.document(DOCS_Q, DOCS_K),
                 lambda b, h, i, j: torch.from_numpy(DOCS_Q)[i] == torch.from_numpy(DOCS_K)[j], None, None, ()),
    "alibi-causal-gqa": ((1, 2, 17, 16), (1, 1, 17, 16), 16, torch.float16, flex.causal,
                         lambda b, h, i, j: j <= i, flex.alibi(flex.alibi_slopes(2)),
                         lambda S, b, h, i, j: S + torch.from_numpy(flex.alibi_slopes(2))[h] * (j - i), ()),
    "softcap": ((1, 1, 16, 16), (1, 1, 20, 16), 16, torch.bfloat16, None, None, flex.softcap(1.5),
                lambda S, b, h, i, j: 1.5 * torch.tanh(S / 1.5), ()),
    "relative_bias-window": ((1, 1, 20, 16), (1, 1, 20, 16), 16, torch.bfloat16, flex.sliding_window(9),
                             lambda b, h, i, j: (j <= i) & (j > i - 9), flex.relative_bias(TABLE_GPU),
                             lambda S, b, h, i, j: S + torch.from_numpy(TABLE_GPU)[(j - i + 4).clamp(0, 8)], ()),
}


@needs_simulator
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_route_every_ready_mod_forward_and_gradients(name):
    q_shape, k_shape, d_v, dtype, mask_mod, keep, score_mod, score, masked = GPU_CASES[name]
    q, k, v, dO = _low_inputs(q_shape, k_shape, d_v, dtype, seed=len(name))
    # a BlockMask of 16 × 16 blocks (one warp per block); none with a score_mod alone: every block full
    bm = fa2edu.create_block_mask(mask_mod, None, None, q_shape[2], k_shape[2], BLOCK_SIZE=16)
    gqa = q_shape[1] != k_shape[1]

    def run(backend):
        return lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                              return_lse=True, backend=backend)
    check_gpu_route(run("tensorcore"), run(None), keep, score, q, k, v, dO, masked_rows=masked)


@needs_simulator
def test_gpu_route_flash_attn_keywords_all_three():
    """window_size, softcap and alibi_slopes together on the tensor cores: the window's BlockMask, and softcap then
    ALiBi as one chain of two score_mods, its derivative the chain rule (compiled part by part)."""
    q, k, v, dO = _low_inputs((1, 2, 18, 16), (1, 2, 21, 16), 16, torch.bfloat16, seed=21)
    keywords = dict(window_size=(6, 1), softcap=2.0, alibi_slopes=torch.tensor([0.3, 0.1]))

    def run(backend, sizes):
        return lambda q, k, v: flash_attention(q, k, v, return_lse=True, backend=backend, block_sizes=sizes,
                                               **keywords)
    wide = [x.detach().double() for x in (q, k, v, dO)]
    expected = forward_backward(lambda q, k, v: dense_flash_attn(q, k, v, **keywords), *wide)
    assert_all_close(forward_backward(run(None, (4, 8)), *wide), expected, "NumPy flash-attn keywords")
    got = forward_backward(run("tensorcore", (16, 16)), q, k, v, dO)
    low = low_forward_backward(lambda q, k, v: _dense_flash_attn_low(q, k, v, **keywords), q, k, v, dO)
    np.testing.assert_allclose(got[1].numpy(), expected[1].numpy(), rtol=1e-4, atol=1e-4)
    for name, ours, ref, base in zip(("O", "dQ", "dK", "dV"), [got[0]] + got[2:], [expected[0]] + expected[2:], low):
        assert_close_to_oracle(ours.double().numpy(), ref.numpy(), name, dtype=np.float16,
                               baseline=baseline_error(base.double().numpy(), ref.numpy()))


def _dense_flash_attn_low(q, k, v, window_size, softcap, alibi_slopes):
    N_q, N_k = q.shape[-2], k.shape[-2]
    left, right = window_size

    def keep(b, h, i, j):
        p = i + N_k - N_q
        return (j >= p - left) & (j <= p + right)

    def score(S, b, h, i, j):
        S = softcap * torch.tanh(S / softcap)
        return S - alibi_slopes.reshape(-1, 1, 1) * (i + N_k - N_q - j).abs()
    return dense_low(q, k, v, keep, score)


@needs_simulator
def test_gpu_route_retiles_a_block_mask_and_compiles():
    """A BlockMask of 4 × 8 blocks (which the kernels cannot run) is retiled from its classes alone; the traced road
    (torch.compile, fullgraph) runs the same kernels and gives the eager road's bits."""
    torch._dynamo.reset()
    q, k, v, dO = _low_inputs((1, 2, 16, 16), (1, 2, 16, 16), 16, torch.bfloat16, seed=30)
    bm = fa2edu.create_block_mask(flex.sliding_window(6), None, None, 16, 16, BLOCK_SIZE=(4, 8))
    retiled = ops.retile_block_mask(bm, (16, 16))
    assert retiled.BLOCK_SIZE == (16, 16) and (retiled.classes == flex.PARTIAL).all()
    exact = fa2edu.create_block_mask(flex.sliding_window(6), None, None, 16, 16, BLOCK_SIZE=(16, 16))
    assert np.array_equal(retiled.classes, exact.classes)

    capped = flex.softcap(3.0)                       # the mods made outside the traced code, kept alive by it

    def attention(q, k, v):
        return flex_attention(q, k, v, score_mod=capped, block_mask=bm, return_lse=True, backend="tensorcore")
    eager = run_and_backward(attention, q, k, v)
    compiled = run_and_backward(torch.compile(attention, fullgraph=True, backend="aot_eager"), q, k, v)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)
    wide = [x.double() for x in (q, k, v)]
    O_ref = flex_attention(*wide, score_mod=capped, block_mask=bm)
    assert (eager[0].double() - O_ref).abs().max() < 2e-2


def test_retile_block_mask_is_exact_for_full_and_skipped_blocks():
    """Retiling keeps every score the mask keeps: a block is full or skipped only when every block it overlaps is,
    and finer, coarser and unrelated tiles all cover the same mask (checked element by element)."""
    mask_mod = flex.or_masks(flex.sliding_window(7), flex.prefix_lm(5))
    bm = fa2edu.create_block_mask(mask_mod, None, None, 37, 45, BLOCK_SIZE=(8, 12))
    truth = np.array([[bool(flex.at_lengths(mask_mod, 37, 45)(0, 0, i, j)) for j in range(45)] for i in range(37)])
    for sizes in [(16, 16), (4, 4), (5, 7), (64, 64), (8, 12)]:
        new = ops.retile_block_mask(bm, sizes)
        assert new.BLOCK_SIZE == sizes and new.mask_mod is bm.mask_mod
        for (i, rows), (j, cols) in ((a, b) for a in enumerate(new.row_tiles()) for b in enumerate(new.col_tiles())):
            tile, kind = truth[rows, cols], new.classes[0, 0, i, j]
            assert kind != flex.FULL or tile.all()
            assert kind != flex.SKIPPED or not tile.any()
