"""Finite inputs too large for the arithmetic, and ndarray subclasses: a correct result or a clear error, never NaN.

The conventions ask for a clear ValueError/TypeError naming the argument and never a NaN. Two kinds of input pass
the ordinary checks (right shapes, finite values) and still broke that rule:

* inputs whose scores τ·q·k overflow the compute dtype (Q·1e307 in float64, Q·1e37 in float32), which turned into
  inf − inf = NaN with only a RuntimeWarning; and values whose later products overflow (a huge V, a float16 gradient
  beyond ±65504);
* ndarray subclasses: ``numpy.matrix`` (always 2-D) crashed with an IndexError, and a masked array's mask was
  silently ignored.

Every public algorithm, forward and backward, is run on each case. Each test also checks a control: the same call
on inputs one step inside the limit returns a finite, correct result, so a test cannot pass by refusing everything.
"""

from __future__ import annotations

import numpy as np
import pytest

import fa2edu
from fa2edu.validation import AttentionOverflowError

# np.matrix is built on purpose here, to be refused.
pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

B, H, N_q, N_k, d = 1, 2, 5, 7, 4


def problem(dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((B, H, N_q, d))
    K = rng.standard_normal((B, H, N_k, d))
    V = rng.standard_normal((B, H, N_k, d))
    dO = rng.standard_normal((B, H, N_q, d))
    return tuple(x.astype(dtype) for x in (Q, K, V, dO))


def saved(Q, K, V, **kw):
    """What the forward passes saved: O and L (the oracle's), FA1's (ℓ, m) = (1, L) (the same softmax), standard's P.
    Inputs that no forward pass accepts get those of clipped inputs instead, so that only the case under test is
    out of range."""
    try:
        O, L = fa2edu.attention_reference(Q, K, V, **kw)
        P = fa2edu.standard_attention(Q, K, V, **kw).P
    except AttentionOverflowError:
        small = [np.clip(x, -4, 4) for x in (Q, K, V)]
        O, L = fa2edu.attention_reference(*small, **kw)
        P = fa2edu.standard_attention(*small, **kw).P
    cdt = np.float64 if Q.dtype == np.float64 else np.float32
    return {"O": O.astype(Q.dtype), "L": L.astype(cdt), "l": np.ones_like(L, dtype=cdt), "m": L.astype(cdt), "P": P}


def fa1_saved(Q, K, V, **kw):
    s = saved(Q, K, V, **kw)
    return s["O"], s["l"], s["m"]


def block_mask():
    return np.ones((1, 1), dtype=bool)


# name: call(Q, K, V, dO, **kwargs) for every public algorithm; the backward passes get saved tensors of the right
# shapes and dtypes, so that the only thing wrong is the case under test.
CALLS = {
    "attention_reference": lambda Q, K, V, dO, **kw: fa2edu.attention_reference(Q, K, V, **kw),
    "attention_reference_backward": lambda Q, K, V, dO, **kw: fa2edu.attention_reference_backward(Q, K, V, dO, **kw),
    "standard_attention": lambda Q, K, V, dO, **kw: fa2edu.standard_attention(Q, K, V, **kw),
    "standard_attention_backward": lambda Q, K, V, dO, **kw: fa2edu.standard_attention_backward(
        Q, K, V, saved(Q, K, V, **kw)["P"], dO, **kw),
    "flash1_forward": lambda Q, K, V, dO, **kw: fa2edu.flash1_forward(Q, K, V, block_sizes=(2, 3), **kw),
    "flash1_backward": lambda Q, K, V, dO, **kw: fa2edu.flash1_backward(
        Q, K, V, *fa1_saved(Q, K, V, **kw), dO, block_sizes=(2, 3), **kw),
    "flash1_block_sparse_forward": lambda Q, K, V, dO, **kw: fa2edu.flash1_block_sparse_forward(
        Q, K, V, block_mask(), block_sizes=(N_q, N_k), **kw),
    "flash1_block_sparse_backward": lambda Q, K, V, dO, **kw: fa2edu.flash1_block_sparse_backward(
        Q, K, V, *fa1_saved(Q, K, V, **kw), dO, block_mask(),
        block_sizes=(N_q, N_k), **kw),
    "flash2_forward": lambda Q, K, V, dO, **kw: fa2edu.flash2_forward(Q, K, V, block_sizes=(2, 3), **kw),
    "flash2_backward": lambda Q, K, V, dO, **kw: fa2edu.flash2_backward(
        Q, K, V, saved(Q, K, V, **kw)["O"], saved(Q, K, V, **kw)["L"], dO, block_sizes=(2, 3), **kw),
}
BACKWARD = {name for name in CALLS if name.endswith("backward")}
FORWARD = [name for name in CALLS if name not in BACKWARD]
FLOAT32_ALGORITHMS = [name for name in CALLS if not name.startswith("attention_reference")]


def assert_overflow_error(excinfo, *names):
    """The error is both a ValueError (bad input) and an OverflowError, and its message names the arguments."""
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, OverflowError)
    for name in names:
        assert name in str(excinfo.value), f"{name!r} not named in: {excinfo.value}"


def assert_finite(result):
    """No NaN and no inf anywhere (none of these problems has a fully masked row, whose L would be +inf)."""
    for field, x in zip(result._fields, result):
        assert np.isfinite(x).all(), f"{field} is not finite"


# -- scores beyond the compute dtype ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CALLS)
def test_scores_beyond_float64_name_q_and_k(name):
    """Q·1e307: τ·q·k overflows float64 (and so would S − max S): an AttentionOverflowError naming Q and K."""
    Q, K, V, dO = problem()
    with pytest.raises(AttentionOverflowError, match=r"^Q and K are too large for float64") as excinfo:
        CALLS[name](Q * 1e307, K * 10, V, dO)
    assert_overflow_error(excinfo, "Q and K", "rescale Q or K")
    # Control: scores of 1e4 (inputs ×100, far beyond exp's range but inside float64's) still compute, finite.
    assert_finite(CALLS[name](Q * 100, K * 100, V, dO))


@pytest.mark.parametrize("name", FLOAT32_ALGORITHMS)
def test_scores_beyond_float32_name_q_and_k_and_suggest_float64(name):
    Q, K, V, dO = problem(np.float32)
    with pytest.raises(AttentionOverflowError, match=r"^Q and K are too large for float32") as excinfo:
        CALLS[name](Q * np.float32(1e37), K * np.float32(10), V, dO)
    assert_overflow_error(excinfo, "Q and K", "pass float64 inputs")
    assert_finite(CALLS[name](Q * 30, K * 30, V, dO))


@pytest.mark.parametrize("name", ["attention_reference", "attention_reference_backward"])
def test_the_float64_oracle_computes_float32_inputs_whose_scores_only_overflow_float32(name):
    """The oracle computes in float64 whatever the input dtype, so it answers where float32 arithmetic cannot."""
    Q, K, V, dO = problem(np.float32)
    result = CALLS[name](Q * np.float32(1e37), K * np.float32(10), V, dO)
    assert_finite(result)
    if name == "attention_reference":                  # scores of ~1e37: softmax is one-hot, O is one row of V
        O = result.O
        hits = (np.abs(O[..., None, :] - V[..., None, :, :].astype(np.float64)).max(axis=-1) == 0).any(axis=-1)
        assert hits.all()


@pytest.mark.parametrize("name", CALLS)
def test_a_large_scale_is_named_as_the_remedy(name):
    Q, K, V, dO = problem()
    with pytest.raises(AttentionOverflowError, match=r"pass a smaller scale=") as excinfo:
        CALLS[name](Q, K, V, dO, scale=1e308)
    assert_overflow_error(excinfo, "Q and K", "τ = 1e+308")
    assert_finite(CALLS[name](Q, K, V, dO, scale=1e3))


@pytest.mark.parametrize("name", CALLS)
def test_the_exact_check_accepts_what_the_cheap_bound_cannot(name):
    """Q's huge entries sit in column 0 and K's in column 1: d·max|Q|·max|K| = 4e400 fails the cheap bound, but no
    product q_l·k_l is huge, so the exact Σ_l |q_l k_l| passes, and the scores (~1e200) are representable: the
    algorithms must compute them, and agree with the oracle (softmax is one-hot at such scores)."""
    Q, K, V, dO = problem()
    Q[..., 0] *= 1e200
    K[..., 1] *= 1e200
    result = CALLS[name](Q, K, V, dO)
    assert_finite(result)
    if not name.endswith("backward"):
        O_ref, _ = fa2edu.attention_reference(Q, K, V)
        np.testing.assert_allclose(result.O, O_ref, rtol=1e-12, atol=1e-12)


def test_the_check_costs_a_product_only_when_the_cheap_bound_fails(monkeypatch):
    """Ordinary inputs never reach the exact check (an O(N_q·N_k·d) product); Q·1e200 does."""
    from fa2edu import validation
    calls = []
    exact = validation._largest_abs_dot
    monkeypatch.setattr(validation, "_largest_abs_dot", lambda A, B: calls.append(1) or exact(A, B))
    Q, K, V, _ = problem()
    fa2edu.flash2_forward(Q * 1000, K * 1000, V)
    assert calls == []
    with pytest.raises(AttentionOverflowError):
        fa2edu.flash2_forward(Q * 1e200, K * 1e200, V)
    assert calls == [1]


@pytest.mark.parametrize("name", CALLS)
def test_underflow_is_never_an_error_even_where_the_caller_raises_on_it(name):
    """exp of a very negative score underflows to 0 by design: inside the algorithms underflow is ignored, even under
    a caller's ``np.errstate(all="raise")``; overflow and invalid operations are what the algorithms report."""
    Q, K, V, dO = problem()
    expected = CALLS[name](Q * 100, K * 100, V, dO)
    with np.errstate(all="raise"):
        result = CALLS[name](Q * 100, K * 100, V, dO)
    for got, want in zip(result, expected):
        np.testing.assert_array_equal(got, want)


# -- other values out of range: a correct result, or an error naming the inputs -----------------------------------

@pytest.mark.parametrize("name", FORWARD)
def test_a_huge_v_gives_a_correct_output_or_an_error_naming_v(name):
    """V ≈ 1e38 in float32 with equal scores: O (the mean of V's rows) is representable, but FA2's un-normalised
    accumulator Õ sums N_k rows of V before dividing by ℓ, and overflows. Each algorithm either returns the oracle's
    O or says so, naming V; nothing returns inf or NaN."""
    Q, K, V, dO = problem(np.float32)
    V = (1 + V / 100) * np.float32(1e38)
    try:
        result = CALLS[name](Q * 0, K, V, dO)
    except AttentionOverflowError as error:
        assert name in str(error) and "max |V|" in str(error)
        assert name.startswith("flash")                # standard attention normalises P first: it cannot overflow
        return
    O_ref, _ = fa2edu.attention_reference(*(x.astype(np.float64) for x in (Q * 0, K, V)))
    assert np.isfinite(result.O).all()
    np.testing.assert_allclose(result.O, O_ref, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(BACKWARD - {"attention_reference_backward"}))
def test_a_float16_gradient_beyond_65504_is_refused_naming_it(name):
    """dV = Pᵀ dO sums dO over the queries: with dO = 30 000 and five queries on one key, dV ≈ 150 000 cannot be a
    float16. The backward passes say which gradient, rather than returning inf."""
    Q, K, V, dO = problem(np.float16)
    Q, K = np.ones_like(Q), np.zeros_like(K)
    K[..., 0, :] = 4                                            # every query attends key 0 (P ≈ 1 there)
    dO = np.full_like(dO, 30000)
    with pytest.raises(AttentionOverflowError) as excinfo:
        CALLS[name](Q, K, V, dO)
    assert_overflow_error(excinfo, "dV", "float16")
    assert_finite(CALLS[name](Q, K, V, dO / 100))


def test_standard_attention_in_float16_refuses_to_store_scores_beyond_65504_where_flash_computes_them():
    """Standard attention writes S to HBM in the inputs' dtype: float16 S overflows at 65504. FlashAttention keeps S
    on chip in float32 and computes the same inputs correctly."""
    Q, K, V, _ = problem(np.float16)
    Q, K = Q * np.float16(200), K * np.float16(200)           # scores up to ~1e5
    with pytest.raises(AttentionOverflowError, match=r"^Q and K give S = τQKᵀ up to") as excinfo:
        fa2edu.standard_attention(Q, K, V)
    assert_overflow_error(excinfo, "float16", "standard attention stores S")
    O_ref, _ = fa2edu.attention_reference(Q, K, V)
    for forward in (fa2edu.flash1_forward, fa2edu.flash2_forward):
        O = forward(Q, K, V, block_sizes=(2, 3)).O
        np.testing.assert_allclose(O, O_ref, atol=1e-2)


def test_standard_backward_in_float16_names_do_and_v_when_dp_cannot_be_stored():
    Q, K, V, dO = problem(np.float16)
    V = np.full_like(V, 300)
    dO = np.full_like(dO, 300)                                  # dP = dO Vᵀ = 4 · 300 · 300 = 360 000
    P = saved(Q, K, V)["P"]
    with pytest.raises(AttentionOverflowError, match=r"^dO and V give dP = dO Vᵀ") as excinfo:
        fa2edu.standard_attention_backward(Q, K, V, P, dO)
    assert_overflow_error(excinfo, "float16")
    assert_finite(fa2edu.standard_attention_backward(Q, K, V, P, dO / 10))


# -- ndarray subclasses ----------------------------------------------------------------------------------------------

class Tagged(np.ndarray):
    """A subclass that means something fa2edu cannot know about (units, say)."""


SUBCLASSES = {
    "matrix": (lambda x: np.matrix(x[0, 0]), r"is a numpy\.matrix"),
    "masked": (lambda x: np.ma.masked_array(x, mask=x > 1), r"is a numpy\.ma\.MaskedArray"),
    "subclass": (lambda x: x.view(Tagged), r"must be a plain numpy\.ndarray, got the subclass Tagged"),
}
ARGUMENTS = {"Q": 0, "K": 1, "V": 2, "dO": 3}


def two_d():
    """A single-head problem (2-D arrays): what np.matrix can hold."""
    Q, K, V, dO = problem()
    return Q[0, 0], K[0, 0], V[0, 0], dO[0, 0]


@pytest.mark.parametrize("kind", SUBCLASSES)
@pytest.mark.parametrize("name, argument", [(name, argument) for name in CALLS for argument in ARGUMENTS
                                            if argument != "dO" or name in BACKWARD])
def test_ndarray_subclasses_are_refused_naming_the_argument(name, argument, kind):
    make, pattern = SUBCLASSES[kind]
    args = list(problem())
    args[ARGUMENTS[argument]] = make(args[ARGUMENTS[argument]])
    with pytest.raises(TypeError, match=rf"^{argument} " + pattern):
        CALLS[name](*args)
    assert_finite(CALLS[name](*problem()))                 # control: plain arrays


@pytest.mark.parametrize("name", ["flash2_backward", "flash1_backward", "standard_attention_backward"])
def test_saved_tensors_as_matrix_are_refused_naming_them(name):
    Q, K, V, dO = two_d()
    s = {key: np.asarray(value)[0, 0] for key, value in saved(*problem()[:3]).items()}
    call = {
        "flash2_backward": lambda s: fa2edu.flash2_backward(Q, K, V, s["O"], s["L"], dO),
        "flash1_backward": lambda s: fa2edu.flash1_backward(Q, K, V, s["O"], s["l"], s["m"], dO),
        "standard_attention_backward": lambda s: fa2edu.standard_attention_backward(Q, K, V, s["P"], dO),
    }[name]
    tensor = {"flash2_backward": "O", "flash1_backward": "O", "standard_attention_backward": "P"}[name]
    bad = dict(s, **{tensor: np.matrix(s[tensor])})
    with pytest.raises(TypeError, match=rf"^{tensor} is a numpy\.matrix"):
        call(bad)
    assert_finite(call(s))


@pytest.mark.parametrize("name", ["flash2_forward", "standard_attention", "attention_reference"])
def test_a_masked_array_as_mask_is_refused(name):
    Q, K, V, dO = problem()
    mask = np.ma.masked_array(np.ones((N_q, N_k), dtype=bool), mask=np.eye(N_q, N_k, dtype=bool))
    with pytest.raises(TypeError, match=r"^mask is a numpy\.ma\.MaskedArray"):
        CALLS[name](Q, K, V, dO, mask=mask)
    assert_finite(CALLS[name](Q, K, V, dO, mask=np.asarray(mask)))


@pytest.mark.parametrize("name", CALLS)
def test_a_memmap_is_read_as_a_plain_array(name, tmp_path):
    """A numpy.memmap is an ndarray subclass with plain numbers in it (a file on disk): accepted, same result."""
    Q, K, V, dO = problem()
    mapped = np.memmap(tmp_path / "q.bin", dtype=Q.dtype, mode="w+", shape=Q.shape)
    mapped[...] = Q
    for got, want in zip(CALLS[name](mapped, K, V, dO), CALLS[name](Q, K, V, dO)):
        assert type(got) is np.ndarray
        np.testing.assert_array_equal(got, want)


def test_kernels_gpu_share_the_checks():
    """kernels_gpu checks NumPy inputs with the same fa2edu.validation.prepare (run here in the CUDA simulator)."""
    kernels_gpu = pytest.importorskip("kernels_gpu")
    Q, K, V, _ = (x[0, 0] for x in problem(np.float32))
    with pytest.raises(TypeError, match=r"^Q is a numpy\.matrix"):
        kernels_gpu.flash2_forward(np.matrix(Q), K, V)
    with pytest.raises(AttentionOverflowError, match=r"^Q and K are too large for float32"):
        kernels_gpu.flash2_forward(Q * np.float32(1e37), K * np.float32(10), V)
