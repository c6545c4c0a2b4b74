"""The 3xTF32 backward (:mod:`kernels_gpu.tensorcore.flash2_backward_3xtf32`) in numba's CUDA simulator, against the
float64 oracle, with outputs poisoned (NaN) first:

* dQ, dK, dV within DESIGN.md's float32 rule on ragged shapes (N_q ≠ N_k, neither a multiple of B_c or B_r, several
  key blocks and row blocks), GQA (dK, dV summed over the group) and bottom-right causal with rows that see no key
  (dQ = 0 there, nothing NaN) — two warps in the simulator, the same code the GPU runs with four or eight;
* float32's accuracy, not TF32's: the same problem with its inputs rounded to tf32 misses the oracle by ~1e-3;
* tiles it cannot run and head dimensions it does not take are refused, naming the problem.

The GPU's cases (the ladder's shapes, the default tiles, extreme logits, flash-attn's rule against PyTorch's float32
backward) are in ``tests/gpu/test_tensorcore_3xtf32_backward_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_close_to_oracle, baseline_error

import fa2edu
from kernels_gpu import ptx
from kernels_gpu import runtime as rt
from kernels_gpu.tensorcore import TF32_BACKWARD
from kernels_gpu.tensorcore.flash2_backward_3xtf32 import config_for

if not rt.simulator_in_use():  # pragma: no cover
    pytest.skip("simulator tests: NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py sets it)", allow_module_level=True)

backward = TF32_BACKWARD["3xtf32"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


def _problem(seed, shape_q, shape_kv):
    rng = np.random.default_rng(seed)
    Q, dO = (rng.standard_normal(shape_q).astype(np.float32) for _ in range(2))
    K, V = (rng.standard_normal(shape_kv).astype(np.float32) for _ in range(2))
    return Q, K, V, dO


def _forward(Q, K, V, causal):
    O, L = fa2edu.flash2_forward(Q, K, V, causal=causal)[:2]
    return np.asarray(O, np.float32), np.asarray(L, np.float32)


CASES = [  # (Q shape, K/V shape, causal, paired): two warps (B_c = 32) and 16-query steps
    ((1, 1, 20, 16), (1, 1, 37, 16), False, True),   # ragged: two key blocks (one partial), two row blocks
    ((1, 2, 29, 16), (1, 1, 21, 16), True, False),   # GQA 2:1, causal with N_q > N_k: 8 rows per head see no key;
]                                                    # Sᵀ, dPᵀ one after the other (the d > 64 default)


@pytest.mark.parametrize("shape_q, shape_kv, causal, paired", CASES, ids=["ragged", "gqa-causal-masked-rows"])
def test_matches_oracle(shape_q, shape_kv, causal, paired):
    Q, K, V, dO = _problem(CASES.index((shape_q, shape_kv, causal, paired)), shape_q, shape_kv)
    O, L = _forward(Q, K, V, causal)
    grads = backward(Q, K, V, O, L, dO, causal=causal, warps=2, B_r=16, paired=paired)
    ref = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal)
    # the baseline error: float32 standard attention's backward (FA1 Alg. 3), same inputs
    P = fa2edu.standard_attention(Q, K, V, causal=causal).P
    low = fa2edu.standard_attention_backward(Q, K, V, P, dO, causal=causal)
    for name, got, want, base in zip(("dQ", "dK", "dV"), grads, ref[:3], low[:3]):
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.isfinite(got).all(), f"{name} has NaN/inf (an unwritten or poisoned element)"
        assert_close_to_oracle(got, want, name, dtype=np.float32, baseline=baseline_error(np.asarray(base), want))
    if causal:
        assert (grads[0][..., : shape_q[2] - shape_kv[2], :] == 0).all()   # rows that see no key: dQ = 0
    else:
        # float32's accuracy, not TF32's: the same problem with Q, K, V, dO rounded to tf32 first (what a
        # one-product TF32 backward would see) misses the oracle by ~1e-3; 3xTF32 by a hundred times less
        tf32 = fa2edu.attention_reference_backward(*(ptx.tf32_round(x) for x in (Q, K, V, dO)))
        for got, rounded, want in zip(grads, tf32, ref):
            err, err_tf32 = np.abs(got - want).max(), np.abs(rounded - want).max()
            assert err < 1e-5 and 100 * err < err_tf32, (err, err_tf32)


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="cannot share dQ_i's 2 × 2 tiles evenly"):
        config_for(16, "float32", False, True, warps=3, B_r=32)
    with pytest.raises(ValueError, match="B_r must be a positive multiple of 16"):
        config_for(16, "float32", False, True, warps=2, B_r=24)
    with pytest.raises(ValueError, match="takes float32 inputs"):
        config_for(16, "float16", False, True)
    x = np.zeros((1, 1, 4, 24), np.float32)
    with pytest.raises(ValueError, match="3xTF32 backward takes head dimensions that are multiples of 16 up to 128"):
        backward(x, x, x, x, np.zeros((1, 1, 4), np.float32), x)
