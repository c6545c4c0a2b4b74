"""kernels_gpu computes in float32 whatever the inputs' dtype: float64 NumPy inputs whose scores, or values, do not
fit float32 get a clear error naming them, never NaN (run here in the CUDA simulator).

fa2edu's NumPy algorithms compute float64 inputs in float64, so Q·1e30 and K·1e30 (scores near 1e60) are fine there;
the kernels would form those scores in float32, overflow to inf and return NaN (inf − inf). Each case has a control
one step inside the limit that must come back finite and equal to the float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import fa2edu
from fa2edu.validation import AttentionOverflowError

kernels_gpu = pytest.importorskip("kernels_gpu")

# Ragged on purpose: N_q ≠ N_k, neither a multiple of the tiles; bottom-right causal leaves rows 0-1 without a key.
N_q, N_k, d = 9, 7, 4
BLOCKS = (4, 3)


def problem(seed=0):
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal(shape) for shape in ((N_q, d), (N_k, d), (N_k, d), (N_q, d)))
    return Q, K, V, dO


FORWARDS = {
    "flash2_forward": lambda Q, K, V, causal: kernels_gpu.flash2_forward(Q, K, V, causal=causal,
                                                                         block_sizes=BLOCKS).O,
    "flash1_forward": lambda Q, K, V, causal: kernels_gpu.flash1_forward(Q, K, V, causal=causal,
                                                                         block_sizes=BLOCKS).O,
    "standard_attention": lambda Q, K, V, causal: kernels_gpu.standard_attention(Q, K, V, causal=causal).O,
}


@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_scores_beyond_float32_are_refused_naming_q_and_k_without_suggesting_float64(name):
    Q, K, V, _ = problem()
    with pytest.raises(AttentionOverflowError, match=r"^Q and K are too large for float32") as error:
        FORWARDS[name](Q * 1e30, K * 1e30, V, False)       # scores ~1e60: fine in float64, inf in float32
    assert "float64" not in str(error.value)                   # the kernels would still compute in float32


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_large_scores_that_fit_float32_give_the_oracle(name, causal):
    Q, K, V, _ = problem()
    Q, K = Q * 1e8, K * 1e8                                    # scores ~1e16: far from float32's 3.4e38
    O = FORWARDS[name](Q, K, V, causal)
    O_ref = fa2edu.attention_reference(Q, K, V, causal=causal).O
    assert np.all(np.isfinite(O))
    if causal:
        assert np.all(O[:N_q - N_k] == 0.0)                    # rows that see no key
    # Scores this large make the softmax one-hot: O is (nearly) the V row of each query's largest score.
    np.testing.assert_allclose(O, O_ref, atol=1e-5)


def test_the_backward_kernel_refuses_scores_beyond_float32():
    Q, K, V, dO = problem()
    O, L = fa2edu.attention_reference(Q, K, V)
    with pytest.raises(AttentionOverflowError, match=r"^Q and K are too large for float32"):
        kernels_gpu.flash2_backward(Q * 1e30, K * 1e30, V, O, L, dO)


def test_a_value_beyond_float32_is_refused_naming_its_argument():
    Q, K, V, _ = problem()
    with pytest.raises(ValueError, match=r"^V has values beyond the range of float32"):
        kernels_gpu.flash2_forward(Q, K, V * 1e300)
    O = kernels_gpu.flash2_forward(Q, K, V * 1e30).O          # control: 1e30 is a float32 number
    np.testing.assert_allclose(O, fa2edu.attention_reference(Q, K, V * 1e30).O, rtol=1e-5, atol=1e25)


def test_numpy_float32_still_suggests_float64_inputs():
    """fa2edu computes float64 inputs in float64: there the remedy is right, and stays in the message."""
    Q, K, V, _ = (x.astype(np.float32) for x in problem())
    with pytest.raises(AttentionOverflowError, match="pass float64 inputs"):
        fa2edu.flash2_forward(Q * np.float32(1e20), K * np.float32(1e20), V)
