"""fa2edu.torch.flash_attention: autograd-correct, equal to PyTorch's SDPA, and saving only what the paper saves.

* ``torch.autograd.gradcheck`` (float64, finite differences) passes for every algorithm, with causal masks,
  N_q ≠ N_k (fully masked rows included), GQA, a custom scale and ragged blocks.
* The forward output and the three gradients equal ``F.scaled_dot_product_attention``'s within the conventions' rule:
  1e-10 relative in float64; in float32, 2× the error of SDPA's own float32 result plus a floor, both measured
  against SDPA in float64. SDPA's ``is_causal`` is top-left aligned, so the bottom-right mask is built explicitly.
* What each autograd Function keeps for the backward pass, read through ``saved_tensors_hooks``: FA2 keeps Q, K, V,
  O, L, FA1 Q, K, V, O, ℓ, m, and only the standard algorithm keeps an N_q × N_k tensor (P).
* ``return_lse=True`` returns the log-sum-exp L of every algorithm (+inf on rows that see no key), and the
  ``autograd.Function`` form (``Flash2Attention.apply``) is the same op as the registered operator.
* Bad input gets a clear error naming the argument, and ``import fa2edu`` does not import torch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tolerances import assert_close_to_oracle  # noqa: E402

import fa2edu  # noqa: E402
import fa2edu.torch as op  # noqa: E402
from fa2edu.torch import ALGORITHMS, flash_attention  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    # These tensors are tiny: extra intra-op threads only spin-wait, badly so on a busy shared CI machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# name: (q shape, k shape, d_v, causal, scale, block_sizes); GQA when q has more heads than k.
CASES = {
    "gqa-causal-Nq<Nk": ((1, 4, 5, 3), (1, 2, 7, 3), 4, True, None, (2, 3)),
    "causal-Nq>Nk": ((2, 1, 6, 3), (2, 1, 4, 3), 3, True, 0.8, (4, 3)),   # two fully masked rows
    "plain-2d": ((5, 4), (6, 4), 2, False, None, (3, 4)),
}


def make_inputs(q_shape, k_shape, d_v, dtype=torch.float64, seed=0, requires_grad=True):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, dtype=dtype, generator=generator)
    k = torch.randn(k_shape, dtype=dtype, generator=generator)
    v = torch.randn(k_shape[:-1] + (d_v,), dtype=dtype, generator=generator)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def run_op(q, k, v, dO, **options):
    """O and (dQ, dK, dV) of flash_attention for the upstream gradient dO."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    O = flash_attention(q, k, v, **options)
    O.backward(dO)
    return O.detach(), (q.grad, k.grad, v.grad)


def run_sdpa(q, k, v, dO, causal, scale):
    """SDPA with the bottom-right causal mask of docs/conventions.md, GQA by ``enable_gqa``; O and gradients."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    N_q, N_k = q.shape[-2], k.shape[-2]
    # query i sees key j iff j ≤ i + N_k − N_q: a lower triangle shifted right by N_k − N_q.
    mask = torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q) if causal else None
    O = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.dim() >= 3)
    O.backward(dO)
    return O.detach(), (q.grad, k.grad, v.grad)


# -- gradcheck ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck_float64(algorithm, case):
    q_shape, k_shape, d_v, causal, scale, block_sizes = CASES[case]
    q, k, v = make_inputs(q_shape, k_shape, d_v)
    tiled = {} if algorithm == "standard" else {"block_sizes": block_sizes}

    def attention(q, k, v):
        return flash_attention(q, k, v, causal=causal, scale=scale, algorithm=algorithm, **tiled)

    assert torch.autograd.gradcheck(attention, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


# -- equality with PyTorch's attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_float64(algorithm, causal):
    # N_q < N_k, GQA, d_v ≠ d, ragged blocks: no fully masked row, so SDPA is defined everywhere.
    q, k, v = make_inputs((2, 4, 13, 8), (2, 2, 19, 8), 6, seed=1, requires_grad=False)
    dO = torch.randn(2, 4, 13, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tiled = {} if algorithm == "standard" else {"block_sizes": (5, 7)}
    O, grads = run_op(q, k, v, dO, causal=causal, algorithm=algorithm, **tiled)
    O_ref, grads_ref = run_sdpa(q, k, v, dO, causal, None)
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), (O,) + grads, (O_ref,) + grads_ref):
        assert_close_to_oracle(x.numpy(), ref.numpy(), f"{algorithm} {name}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_matches_sdpa_float32(algorithm):
    # the conventions' low-precision rule: error ≤ 2 × (SDPA float32's own error) + floor, both against float64 SDPA.
    q, k, v = make_inputs((2, 4, 33, 16), (2, 1, 40, 16), 16, seed=3, requires_grad=False)
    dO = torch.randn(2, 4, 33, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    oracle = run_sdpa(q, k, v, dO, True, 0.3)
    low = run_sdpa(q.float(), k.float(), v.float(), dO.float(), True, 0.3)
    tiled = {} if algorithm == "standard" else {"block_sizes": (8, 12)}
    ours = run_op(q.float(), k.float(), v.float(), dO.float(), causal=True, scale=0.3, algorithm=algorithm,
                  **tiled)
    assert ours[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in ours[1])
    flat = [(run[0],) + tuple(run[1]) for run in (oracle, low, ours)]            # (O, dQ, dK, dV) of each
    for name, expected, same_dtype, actual in zip(("O", "dQ", "dK", "dV"), *flat):
        expected = expected.numpy()
        baseline = float(np.max(np.abs(same_dtype.double().numpy() - expected)))
        assert_close_to_oracle(actual.numpy(), expected, f"{algorithm} {name}", dtype=np.float32,
                               baseline=baseline)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fully_masked_rows_match_the_oracle(algorithm):
    # causal with N_q > N_k: the first N_q − N_k rows see no key. SDPA gives NaN there; the conventions say O = 0 and
    # zero gradients, which is what fa2edu's float64 oracle computes.
    q, k, v = make_inputs((1, 2, 9, 4), (1, 2, 5, 4), 4, seed=5, requires_grad=False)
    dO = torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    tiled = {} if algorithm == "standard" else {"block_sizes": (2, 3)}
    O, grads = run_op(q, k, v, dO, causal=True, algorithm=algorithm, **tiled)
    arrays = [x.numpy() for x in (q, k, v)]
    O_ref, _ = fa2edu.attention_reference(*arrays, causal=True)
    grads_ref = fa2edu.attention_reference_backward(*arrays, dO.numpy(), causal=True)
    assert (O[..., :4, :] == 0).all() and (grads[0][..., :4, :] == 0).all()
    for name, x, ref in zip(("O", "dQ", "dK", "dV"), (O,) + grads, (O_ref,) + tuple(grads_ref)):
        assert_close_to_oracle(x.numpy(), ref, f"{algorithm} {name}")


def test_non_contiguous_inputs_give_the_same_result():
    # A (B, N, H, d) projection viewed as (B, H, N, d) is not contiguous: the op copies it and agrees exactly.
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 11, 3, 5, dtype=torch.float64, generator=generator).transpose(1, 2)
               for _ in range(3))
    assert not q.is_contiguous()
    dO = torch.randn(2, 3, 11, 5, dtype=torch.float64, generator=generator)
    strided = run_op(q, k, v, dO, causal=True, block_sizes=(4, 3))
    dense = run_op(q.contiguous(), k.contiguous(), v.contiguous(), dO, causal=True, block_sizes=(4, 3))
    assert torch.equal(strided[0], dense[0])
    for a, b in zip(strided[1], dense[1]):
        assert a.shape == b.shape and torch.equal(a, b)


# -- what is saved for the backward pass ---------------------------------------------------------------------------

def saved_shapes(algorithm, q, k, v, **options):
    """The shapes of every tensor the Function packs for its backward pass (``save_for_backward``)."""
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        flash_attention(q, k, v, algorithm=algorithm, **options)
    return shapes


@pytest.mark.parametrize("algorithm, extra", [
    ("flash2", [(2, 4, 6, 3), (2, 4, 6)]),              # O (…, N_q, d_v) and L (…, N_q)
    ("flash1", [(2, 4, 6, 3), (2, 4, 6), (2, 4, 6)]),   # O, ℓ and m
    ("standard", [(2, 4, 6, 10)]),                      # P (…, N_q, N_k): the N × N matrix
])
def test_saved_for_backward(algorithm, extra):
    # Distinct sizes (N_q = 6, N_k = 10, d = 5, d_v = 3, H_q = 4, H_kv = 2) make each shape identify its tensor.
    q, k, v = make_inputs((2, 4, 6, 5), (2, 2, 10, 5), 3)
    tiled = {} if algorithm == "standard" else {"block_sizes": (4, 4)}
    shapes = saved_shapes(algorithm, q, k, v, causal=True, **tiled)
    assert sorted(shapes) == sorted([(2, 4, 6, 5), (2, 2, 10, 5), (2, 2, 10, 3)] + extra)
    has_score_matrix = any(shape[-2:] == (6, 10) for shape in shapes)
    assert has_score_matrix == (algorithm == "standard")


def test_flash2_saves_linear_memory():
    # Doubling N: FA2's saved elements exactly double (all O(N d)); the standard algorithm's grow by the extra
    # (2N)² − 2N² = 2N² entries of P per head (H = 2 heads here).
    def saved_elements(algorithm, N):
        q, k, v = make_inputs((1, 2, N, 4), (1, 2, N, 4), 4)
        return sum(int(np.prod(s)) for s in saved_shapes(algorithm, q, k, v, causal=True))

    for N in (16, 32):
        assert saved_elements("flash2", 2 * N) - 2 * saved_elements("flash2", N) == 0
        assert saved_elements("flash1", 2 * N) - 2 * saved_elements("flash1", N) == 0
        assert saved_elements("standard", 2 * N) - 2 * saved_elements("standard", N) == 2 * 2 * N * N


@pytest.mark.parametrize("road", ["eager", "traced"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_double_backward_is_refused(monkeypatch, algorithm, road):
    """A gradient penalty: the gradient taken with ``create_graph=True``, then a backward through a loss built from
    it. The op's backward runs outside autograd, so its gradient used to come back with no history: the penalty's
    backward then ran without error and silently dropped the op's second-order term (q.grad held only the other
    term's 2q). Now the gradient carries a history whose backward raises, on both roads (the autograd Function
    of eager mode, and the registered operators that torch.compile traces)."""
    if road == "traced":
        monkeypatch.setattr(op, "_eager", lambda *tensors: False)
    q, k, v = make_inputs((1, 2, 4, 3), (1, 1, 5, 3), 3)
    O = flash_attention(q, k, v, causal=True, algorithm=algorithm)
    (g,) = torch.autograd.grad(O.sum(), q, create_graph=True)
    assert g.grad_fn is not None, "the gradient must keep a history, or the penalty's backward cannot refuse"
    penalty = (g ** 2).sum() + (q ** 2).sum()
    with pytest.raises(RuntimeError, match="^fa2edu.torch.flash_attention does not support double backward"):
        penalty.backward()
    # One backward, even one that records its graph, is unaffected: the same gradient as without create_graph.
    (g1,) = torch.autograd.grad(flash_attention(q, k, v, causal=True, algorithm=algorithm).sum(), q)
    assert torch.equal(g.detach(), g1)


# -- return_lse and the autograd.Function form -----------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_return_lse_is_the_log_sum_exp(algorithm):
    # FA2 returns its L; FA1's (ℓ, m) become m + log ℓ; the standard algorithm's L is computed from the scores.
    # Rows that see no key (causal, N_q > N_k) have L = +inf, as in the oracle.
    q, k, v = make_inputs((2, 4, 9, 5), (2, 2, 6, 5), 3, requires_grad=False)
    tiled = {} if algorithm == "standard" else {"block_sizes": (4, 4)}
    O, L = flash_attention(q, k, v, causal=True, scale=0.7, algorithm=algorithm, return_lse=True, **tiled)
    assert torch.equal(O, flash_attention(q, k, v, causal=True, scale=0.7, algorithm=algorithm, **tiled))
    _, L_ref = fa2edu.attention_reference(*(x.numpy() for x in (q, k, v)), causal=True, scale=0.7)
    assert L.shape == (2, 4, 9) and L.dtype == torch.float64 and torch.isposinf(L[..., :3]).all()
    assert_close_to_oracle(L.numpy(), L_ref, f"{algorithm} L")
    L32 = flash_attention(*(x.float() for x in (q, k, v)), algorithm=algorithm, return_lse=True, **tiled)[1]
    assert L32.dtype == torch.float32


def test_the_function_form_is_the_same_op():
    # Flash2Attention.apply (the autograd.Function form) and flash_attention (the registered operator) share the
    # forward operator and the backward formula: equal outputs and gradients.
    q, k, v = make_inputs((1, 2, 7, 4), (1, 1, 5, 4), 3)
    dO = torch.randn(1, 2, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    via_op = run_op(q, k, v, dO, causal=True, block_sizes=(3, 2))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    O = op.Flash2Attention.apply(*leaves, True, None, (3, 2), None)
    O.backward(dO)
    assert torch.equal(O.detach(), via_op[0])
    for a, b in zip((x.grad for x in leaves), via_op[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_eager_and_traced_roads_return_the_same_bits(monkeypatch, algorithm):
    # flash_attention applies the algorithm's Function outside torch.compile (the eager road) and the registered
    # operators inside it (the traced road): the same outputs, L and gradients, bit for bit; the eager road never
    # reaches the dispatcher.
    q, k, v = make_inputs((2, 4, 7, 5), (2, 2, 9, 5), 3)
    dO = torch.randn(2, 4, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tiled = {} if algorithm == "standard" else {"block_sizes": (3, 4)}

    def run():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        O, L = flash_attention(*leaves, causal=True, scale=0.6, algorithm=algorithm, return_lse=True, **tiled)
        O.backward(dO)
        return [O.detach(), L] + [x.grad for x in leaves]

    def refuse(*args):
        raise AssertionError("the eager road called a registered operator")

    with monkeypatch.context() as patch:
        patch.setitem(op._OPERATORS, algorithm, refuse)
        eager = run()
    with monkeypatch.context() as patch:
        patch.setattr(op, "_eager", lambda *tensors: False)
        traced = run()
    for a, b in zip(eager, traced):
        assert a.dtype == b.dtype and torch.equal(a, b)


# -- errors -------------------------------------------------------------------------------------------------------

def test_errors_name_the_argument():
    q, k, v = make_inputs((1, 2, 4, 3), (1, 2, 4, 3), 3, requires_grad=False)
    with pytest.raises(TypeError, match="float16"):
        flash_attention(q.half(), k.half(), v.half())
    with pytest.raises(TypeError, match="float32 or float64"):
        flash_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, k.float(), v)
    with pytest.raises(TypeError, match="q has dtype torch.int64"):
        flash_attention(q.long(), k.long(), v.long())
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attention(q, k.numpy(), v)
    with pytest.raises(ValueError, match="one device"):
        flash_attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="runs on 'cpu' and 'cuda'"):
        flash_attention(q.to("meta"), k.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match="v contains NaN"):
        flash_attention(q, k, torch.where(v > 0, v, torch.nan))
    with pytest.raises(ValueError, match="at least 2 axes"):
        flash_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
    with pytest.raises(ValueError, match="algorithm must be one of"):
        flash_attention(q, k, v, algorithm="flash3")
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="multiple of"):
        flash_attention(q.repeat(1, 2, 1, 1)[:, :3], k, v)           # H_q = 3, H_kv = 2
    with pytest.raises(ValueError, match="not tiled"):
        flash_attention(q, k, v, algorithm="standard", block_sizes=(2, 2))
    with pytest.raises(ValueError, match="M = 4 is too small"):
        flash_attention(q, k, v, M=4)
    with pytest.raises(ValueError, match="q has head dimension 300"):
        flash_attention(*(torch.zeros(1, 2, 4, 300, dtype=torch.float64) for _ in range(3)))
    with pytest.raises(ValueError, match="k must have q's head dimension"):
        flash_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="v must have k's leading axes"):
        flash_attention(q, k, v[..., :3, :])
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_attention(q, k, v, backend="cudnn")
    with pytest.raises(ValueError, match="scale must be finite"):
        flash_attention(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="scale must be a real number or None, got str"):
        flash_attention(q, k, v, scale="0.5")


def test_import_fa2edu_does_not_need_torch():
    # fa2edu alone never imports torch; fa2edu.torch without torch says how to install it.
    code = ("import sys; import fa2edu; assert 'torch' not in sys.modules, 'fa2edu imported torch'\n"
            "sys.modules['torch'] = None\n"
            "try:\n    import fa2edu.torch\nexcept ImportError as error:\n    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install torch" in result.stdout


def test_module_named_torch_imports_the_real_torch():
    import fa2edu.torch as op

    assert op.torch is torch and hasattr(op.torch, "autograd")
