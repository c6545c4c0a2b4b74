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


# -- the newer paths hold the same contract: decode, varlen, merge, the PyTorch op, kernels_gpu on host data ------
#
# Each case below returned NaN, inf, a silently wrong answer or an error naming an internal variable before
# (issue 35); each test also runs a control that must compute, so that no test passes by refusing everything.

def decode_case(paged: bool, dtype=np.float32, seed=3):
    """q and a KV cache for decode_attention: 2 sequences of 11 and 6 keys, GQA 2, and NaN in every entry that
    no sequence reads (past a length, and pages no sequence owns): a check of the used part only must pass them."""
    rng = np.random.default_rng(seed)
    B, H_kv, G, N_new, d, page = 2, 2, 2, 1, 4, 4
    lengths = np.array([11, 6])
    q = rng.standard_normal((B, H_kv * G, N_new, d)).astype(dtype)
    keys = [rng.standard_normal((H_kv, n, d)).astype(dtype) for n in lengths]
    values = [rng.standard_normal((H_kv, n, d)).astype(dtype) for n in lengths]
    if not paged:
        k_cache = np.full((B, H_kv, 16, d), np.nan, dtype)
        v_cache = np.full((B, H_kv, 16, d), np.nan, dtype)
        for b, n in enumerate(lengths):
            k_cache[b, :, :n], v_cache[b, :, :n] = keys[b], values[b]
        return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths, block_table=None)
    table = np.array([[5, 0, 3, -1], [2, 6, -1, -1]])                 # shuffled pages, -1 where unused
    k_cache = np.full((8, H_kv, page, d), np.nan, dtype)
    v_cache = np.full((8, H_kv, page, d), np.nan, dtype)
    for b, n in enumerate(lengths):
        for p in range(-(-n // page)):
            rows = slice(p * page, min((p + 1) * page, n))
            k_cache[table[b, p], :, :rows.stop - rows.start] = keys[b][:, rows]
            v_cache[table[b, p], :, :rows.stop - rows.start] = values[b][:, rows]
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths, block_table=table)


def used_entry(case, name, b, j, h=1):
    """(index into case[name]) of key j of sequence b, head h: through the block table when paged."""
    if case["block_table"] is None:
        return (b, h, j)
    return (case["block_table"][b, j // 4], h, j % 4)


def decode(case, **kw):
    return fa2edu.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                   case["block_table"], **kw)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_refuses_nan_or_inf_where_the_cache_is_read(paged, name, value, num_splits):
    """A NaN or inf among the keys or values a sequence reads gave NaN/inf O and L (and with 2+ splits the error
    "O_b contains NaN", a name from inside the merge): now a ValueError naming the cache and the entry."""
    case = decode_case(paged)
    control = decode(case, num_splits=num_splits)                     # NaN past the lengths: never read
    assert np.isfinite(control.O).all() and np.isfinite(control.L).all()
    case[name][used_entry(case, name, 0, 9)] = value                  # key 9 of sequence 0 (11 keys)
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or infinite values among the keys sequence 0 "
                                         rf"reads") as excinfo:
        decode(case, num_splits=num_splits)
    assert "O_a" not in str(excinfo.value) and "O_b" not in str(excinfo.value)
    where = used_entry(case, name, 0, 9)
    assert f"{name}[{where[0]}, {where[1]}, {where[2]}]" in str(excinfo.value)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_scores_beyond_float32_raise_attention_overflow_error(paged, num_splits):
    """q, k × 1e20 in float32: scores ~1e40 returned NaN; now AttentionOverflowError naming q and k_cache (and the
    sequence), as flash2_forward raises. float64 has room for them (control), and so do scores of 1e3."""
    case = decode_case(paged)
    big = dict(case, q=case["q"] * np.float32(1e20), k_cache=case["k_cache"] * np.float32(1e20))
    with pytest.raises(AttentionOverflowError, match=r"^q and k_cache \(sequence 0\) are too large for float32")\
            as excinfo:
        decode(big, num_splits=num_splits)
    assert_overflow_error(excinfo, "rescale q or k_cache", "pass float64 inputs")
    wide = {key: (x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype == np.float32 else x)
            for key, x in big.items()}
    assert_finite(decode(wide, num_splits=num_splits))
    assert_finite(decode(dict(case, q=case["q"] * 30, k_cache=case["k_cache"] * 30), num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_a_huge_v_cache_is_named_not_the_merge_partials(num_splits):
    """v_cache ≈ 3e38 in float32 with equal scores: the accumulator Õ (a sum of 11 such rows) overflows. The error
    names decode_attention and v_cache, never the merge's O_a/O_b; a v_cache 10⁴ times smaller computes."""
    case = decode_case(paged=True)
    huge = dict(case, q=case["q"] * 0, v_cache=(1 + case["v_cache"] / 100) * np.float32(3e38))
    with pytest.raises(AttentionOverflowError, match=r"^decode_attention: an intermediate result left the range "
                                                     r"of float32") as excinfo:
        decode(huge, num_splits=num_splits)
    assert "max |v_cache| = 3" in str(excinfo.value) and "O_b" not in str(excinfo.value)
    assert_finite(decode(dict(huge, v_cache=huge["v_cache"] / np.float32(1e4)), num_splits=num_splits))


def varlen_case(dtype=np.float32, seed=4):
    """Three packed sequences (5, 0 and 15 queries; 10, 2 and 13 keys), GQA 2."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, 20, 8)).astype(dtype)
    k = rng.standard_normal((2, 25, 8)).astype(dtype)
    v = rng.standard_normal((2, 25, 8)).astype(dtype)
    return q, k, v, np.array([0, 5, 5, 20]), np.array([0, 10, 12, 25])


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_varlen_refuses_nan_naming_the_packed_argument(name):
    """A NaN anywhere in q, k or v (here in sequence 1, which has no query, so FA2 never ran on it and nothing was
    checked) is a ValueError naming the caller's argument, not FA2's internal Q, K, V."""
    q, k, v, cu_q, cu_k = varlen_case()
    args = {"q": q, "k": k, "v": v}
    assert_finite(fa2edu.varlen_attention(q, k, v, cu_q, cu_k))
    args[name][0, 3 if name == "q" else 11, 0] = np.nan
    with pytest.raises(ValueError, match=rf"^{name} contains NaN or infinite values"):
        fa2edu.varlen_attention(args["q"], args["k"], args["v"], cu_q, cu_k)


def test_varlen_scores_beyond_float32_name_q_k_and_the_sequence():
    q, k, v, cu_q, cu_k = varlen_case()
    with pytest.raises(AttentionOverflowError, match=r"^q and k \(sequence 0: q\[:, 0:5\] and k\[:, 0:10\]\) "
                                                     r"are too large for float32") as excinfo:
        fa2edu.varlen_attention(q * np.float32(1e20), k * np.float32(1e20), v, cu_q, cu_k)
    assert_overflow_error(excinfo, "rescale q or k")
    # Huge queries in sequence 0 and huge keys in sequence 2 never meet: the exact check lets them through.
    q2, k2 = q.astype(np.float64), k.astype(np.float64)
    q2[:, :5] *= 1e200
    k2[:, 12:] *= 1e200
    assert_finite(fa2edu.varlen_attention(q2, k2, v.astype(np.float64), cu_q, cu_k))


def test_varlen_a_huge_v_names_the_sequence_and_its_slices():
    q, k, v, cu_q, cu_k = varlen_case()
    huge = (1 + v / 100) * np.float32(3e38)
    with pytest.raises(AttentionOverflowError, match=r"^varlen_attention, sequence 0 \(Q, K, V below are "
                                                     r"q\[:, 0:5\], k and v\[:, 0:10\]\)") as excinfo:
        fa2edu.varlen_attention(q * 0, k, huge, cu_q, cu_k)
    assert "max |V| = 3" in str(excinfo.value)
    assert_finite(fa2edu.varlen_attention(q * 0, k, huge / np.float32(1e4), cu_q, cu_k))


def test_merge_an_overflowing_weighted_sum_is_an_error_naming_its_arguments():
    """O_a = O_b = the largest float32 with different L's: the weights sum to 1 only up to rounding, and about a
    sixth of the rows came back inf. Now an AttentionOverflowError naming O_a and O_b; a quarter of it merges."""
    rng = np.random.default_rng(0)
    L_a, L_b = (rng.uniform(-3, 3, 1000).astype(np.float32) for _ in range(2))
    O = np.full((1000, 1), np.finfo(np.float32).max, np.float32)
    with pytest.raises(AttentionOverflowError, match=r"^O_a and O_b are too large for float32") as excinfo:
        fa2edu.merge_attention_states(O, L_a, O, L_b)
    assert_overflow_error(excinfo, "max |O_a| = 3.4e+38", "pass float64 partials")
    merged, _ = fa2edu.merge_attention_states(O / 4, L_a, O / 4, L_b)
    assert np.isfinite(merged).all()
    with pytest.raises(ValueError, match="^O_b contains NaN"):
        fa2edu.merge_attention_states(O / 4, L_a, np.full_like(O, np.nan), L_b)


# -- the PyTorch op ---------------------------------------------------------------------------------------------------

def torch_inputs(dtype_name="float32"):
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(5)
    dtype = getattr(torch, dtype_name)
    q = torch.randn(1, 4, 5, 8, generator=generator, dtype=dtype)
    k = torch.randn(1, 2, 7, 8, generator=generator, dtype=dtype)
    v = torch.randn(1, 2, 7, 8, generator=generator, dtype=dtype)
    return torch, q, k, v


@pytest.mark.parametrize("algorithm", ["flash2", "flash1", "standard"])
def test_torch_op_scores_beyond_float32_name_q_and_k(algorithm):
    torch, q, k, v = torch_inputs()
    from fa2edu.torch import flash_attention
    with pytest.raises(AttentionOverflowError, match=r"^q and k are too large for float32") as excinfo:
        flash_attention(q * 1e20, k * 1e20, v, algorithm=algorithm)
    assert_overflow_error(excinfo, "rescale q or k", "pass float64 inputs")
    assert torch.isfinite(flash_attention(q * 30, k * 30, v, algorithm=algorithm)).all()
    # q's huge column meets only k's small one (GQA included): the exact check computes it, finite
    q2, k2 = q.double().clone(), k.double().clone()
    q2[..., 0] *= 1e200
    k2[..., 1] *= 1e200
    assert torch.isfinite(flash_attention(q2, k2, v.double(), algorithm=algorithm)).all()


def test_torch_op_keywords_are_validated_as_the_numpy_api_validates_them():
    """scale=np.float32(0.5) was refused (the NumPy API takes it); block_sizes=(2.5, 4) was truncated to (2, 4) and
    (True, 4) read as (1, 4) where the NumPy API raises; ('a', 'b') failed with "invalid literal for int()"."""
    torch, q, k, v = torch_inputs("float64")
    from fa2edu.torch import flash_attention
    assert torch.equal(flash_attention(q, k, v, scale=np.float32(0.5)), flash_attention(q, k, v, scale=0.5))
    assert torch.equal(flash_attention(q, k, v, block_sizes=(np.int64(2), 3)), flash_attention(q, k, v,
                                                                                                block_sizes=(2, 3)))
    Q, K, V = (x.numpy() for x in (q, k, v))
    for sizes, got in (((2.5, 4), "float"), ((True, 4), "bool"), (("a", "b"), "str")):
        with pytest.raises(TypeError, match=rf"^block_sizes B_r must be an int, got {got}"):
            fa2edu.flash2_forward(Q, K, V, block_sizes=sizes)                  # the NumPy API's answer ...
        with pytest.raises(TypeError, match=rf"^block_sizes B_r must be an int, got {got}"):
            flash_attention(q, k, v, block_sizes=sizes)                         # ... is the op's
    with pytest.raises(TypeError, match=r"^block_sizes must be a pair"):
        flash_attention(q, k, v, block_sizes=4)
    with pytest.raises(TypeError, match=r"^M \(SRAM size in elements\) must be an int"):
        flash_attention(q, k, v, M=1000.5)
    with pytest.raises(TypeError, match=r"^scale must be a real number or None, got str"):
        flash_attention(q, k, v, scale="0.5")


# -- kernels_gpu on host (NumPy) data: checked before the copy, as fa2edu checks ------------------------------------

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kernels_gpu_decode_checks_host_caches_before_the_copy(paged):
    """A NaN key in host data was silently dropped and overflowing scores came back O = 0, L = +inf: now the errors
    of fa2edu.decode_attention. (Device data is documented as unchecked: a pass over the cache in HBM.)"""
    kernels_gpu = pytest.importorskip("kernels_gpu")
    case = decode_case(paged)
    args = lambda c: (c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"])  # noqa: E731
    control = kernels_gpu.decode_attention(*args(case), num_splits=2)      # NaN past the lengths: never read
    assert np.isfinite(control.O).all() and np.isfinite(control.L).all()
    bad = dict(case, k_cache=case["k_cache"].copy())
    bad["k_cache"][used_entry(case, "k_cache", 1, 4)] = np.nan
    with pytest.raises(ValueError, match=r"^k_cache contains NaN or infinite values among the keys sequence 1"):
        kernels_gpu.decode_attention(*args(bad), num_splits=2)
    big = dict(case, q=case["q"] * np.float32(1e20), k_cache=case["k_cache"] * np.float32(1e20))
    with pytest.raises(AttentionOverflowError, match=r"^q and k_cache \(sequence 0\) are too large for float32"):
        kernels_gpu.decode_attention(*args(big), num_splits=2)
    wide = dict(case, k_cache=case["k_cache"].astype(np.float64), v_cache=case["v_cache"].astype(np.float64),
                q=case["q"].astype(np.float64))
    wide["v_cache"][used_entry(case, "v_cache", 0, 2)] = 1e39                # float64, stored as float32: inf
    with pytest.raises(ValueError, match=r"^v_cache has values beyond the range of float32"):
        kernels_gpu.decode_attention(*args(wide))


def test_kernels_gpu_varlen_checks_host_k_and_v_before_the_copy():
    kernels_gpu = pytest.importorskip("kernels_gpu")
    q, k, v, cu_q, cu_k = varlen_case()
    bad = k.copy()
    bad[1, 20, 3] = np.inf
    with pytest.raises(ValueError, match=r"^k contains NaN or infinite values"):
        kernels_gpu.varlen_attention(q, bad, v, cu_q, cu_k)
    with pytest.raises(AttentionOverflowError, match=r"^q and k \(sequence 0: q\[:, 0:5\] and k\[:, 0:10\]\) "
                                                     r"are too large for float32"):
        kernels_gpu.varlen_attention(q * np.float32(1e20), k * np.float32(1e20), v, cu_q, cu_k)
