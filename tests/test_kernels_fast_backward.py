"""kernels_gpu.fast's FA2 backward (``BACKWARD_VERSIONS``) in numba's CUDA simulator, against the float64 oracle.

What these tests prove, on tiny ragged shapes (N_q, N_k not multiples of any tile side, N_q ≠ N_k), with outputs
poisoned (NaN) before each run:

* dQ, dK, dV within DESIGN.md's float32 rule of ``fa2edu.attention_reference_backward``, causal and not, with GQA
  (dK, dV summed over the group), several thread tilings (NX of 1, 2, 4; KC = B_c / NY of 1, 2, 4), several row
  blocks per column block, so the register prefetch of the next Q_i, dO_i, L_i, D_i (and its clamp on the last
  step and across the GQA heads) runs;
* fully masked rows (causal, N_q > N_k: L = +inf) give exactly dQ = 0 there and no NaN anywhere; key rows no query
  sees give dK = dV = 0;
* v4 recomputes exactly the forward's P (its scores rounded as the forward's: Q scaled, not K), to the last bit
  at scores in the hundreds, where v3's are off by several ulps;
* the dynamic shared-memory declaration computes the same as the static one;
* tile shapes the kernel cannot run are refused with a ValueError naming the problem.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from tolerances import assert_close_to_oracle, baseline_error

import fa2edu
from kernels_gpu import runtime as rt
from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS, flash2_backward_v1, flash2_backward_v2
from kernels_gpu.fast.flash2_backward_v1 import BackwardTiling

if not rt.simulator_in_use():  # pragma: no cover
    pytest.skip("simulator tests: NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py sets it)", allow_module_level=True)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Outputs start as NaN: an element the kernel never writes cannot pass."""
    monkeypatch.setattr(rt, "poison_outputs", True)


def _problem(seed, Z, H_q, H_kv, N_q, N_k, d, scale=1.0):
    rng = np.random.default_rng(seed)
    Q = (scale * rng.standard_normal((Z, H_q, N_q, d))).astype(np.float32)
    K = (scale * rng.standard_normal((Z, H_kv, N_k, d))).astype(np.float32)
    V = rng.standard_normal((Z, H_kv, N_k, d)).astype(np.float32)
    dO = rng.standard_normal((Z, H_q, N_q, d)).astype(np.float32)
    return Q, K, V, dO


def _check(Q, K, V, dO, causal, tiling, version="v1"):
    O, L = fa2edu.flash2_forward(Q, K, V, causal=causal)[:2]
    O, L = np.asarray(O, np.float32), np.asarray(L, np.float32)
    grads = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=causal, tiling=tiling)
    ref = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal)
    # the baseline error: float32 standard attention's backward (FA1 Alg. 3), same inputs
    P = fa2edu.standard_attention(Q, K, V, causal=causal).P
    low = fa2edu.standard_attention_backward(Q, K, V, P, dO, causal=causal)
    for name, got, want, base in zip(("dQ", "dK", "dV"), grads, ref[:3], low[:3]):
        assert np.isfinite(got).all(), f"{name} has NaN/inf (an unwritten or poisoned element)"
        assert_close_to_oracle(got, want, name, dtype=np.float32, baseline=baseline_error(np.asarray(base), want))
    return grads


#: gradients of v2, v3 and v4 on a case's inputs, by (version, case): each rung is checked against the oracle once
#: and then serves as the reference of the rung after it (a worker of pytest-xdist that lacks one computes it)
_GRADS: dict = {}


def _rung(version, case):
    """``version``'s gradients on ``case`` (its inputs from :func:`_problem` with a seed of the case alone, so every
    rung sees the same ones), checked against the oracle (:func:`_check`) when first computed."""
    if (version, case) not in _GRADS:
        tiling, Z, H_q, H_kv, N_q, N_k, d, causal = case
        Q, K, V, dO = _problem(hash((N_q, N_k, d, causal)) % 2**32, Z, H_q, H_kv, N_q, N_k, d)
        _GRADS[version, case] = tuple(np.asarray(g) for g in _check(Q, K, V, dO, causal, tiling, version=version))
    return _GRADS[version, case]


def _against_previous(version, previous, case, atol):
    """``version`` against the oracle (:func:`_check`) and against the rung before it on the same inputs, to float32
    rounding (``rtol`` 1e-5 and ``atol``)."""
    _GRADS.pop((version, case), None)                     # computed here, under the test's spies
    got = _rung(version, case)
    for a, b in zip(got, _rung(previous, case)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)


CASES = [  # (tiling (NY, NX, TR, TC), Z, H_q, H_kv, N_q, N_k, d, causal)
    (BackwardTiling(2, 2, 2, 2), 1, 1, 1, 9, 7, 8, False),        # KC = 2, several row and column blocks
    (BackwardTiling(2, 2, 2, 2), 1, 2, 1, 11, 13, 8, True),       # GQA, causal, N_q < N_k
    (BackwardTiling(4, 1, 2, 4), 1, 2, 2, 7, 10, 4, True),        # NX = 1, KC = 1
    (BackwardTiling(2, 4, 3, 2), 2, 1, 1, 10, 9, 16, False),      # KC = 4, T % d != 0 (general tile move), batch
]


@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, causal", CASES)
def test_matches_oracle_on_ragged_shapes(tiling, Z, H_q, H_kv, N_q, N_k, d, causal):
    Q, K, V, dO = _problem(hash((N_q, N_k, d, causal)) % 2**32, Z, H_q, H_kv, N_q, N_k, d)
    _check(Q, K, V, dO, causal, tiling)


@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, causal", [CASES[1], CASES[3]])
def test_v2_matches_oracle(tiling, Z, H_q, H_kv, N_q, N_k, d, causal):
    """v2 (D by a warp per row) on a GQA causal case and a batch of two, against the oracle."""
    case = (tiling, Z, H_q, H_kv, N_q, N_k, d, causal)
    _GRADS.pop(("v2", case), None)
    _rung("v2", case)


@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, causal", [CASES[1], CASES[3]])
def test_v3_matches_oracle_and_v2(tiling, Z, H_q, H_kv, N_q, N_k, d, causal, ptx_calls):
    """v3 (dQ by vector reductions, four floats each) against the oracle, on cases where several column blocks add
    into the same rows of dQ; its gradients are v2's up to the order of float32 additions; the reductions really
    were four-wide, 16-byte aligned, and as many as the scalar ones over four."""
    reductions = ptx_calls("red_add_v4_f32")             # (gmem, index, x0, x1, x2, x3)
    _against_previous("v3", "v2", (tiling, Z, H_q, H_kv, N_q, N_k, d, causal), atol=1e-6)
    calls = [int(c[1]) for c in reductions]
    assert calls and all(i % 4 == 0 for i in calls)
    assert len(calls) <= Z * H_q * N_q * d * -(-N_k // tiling.B_c) // 4


@pytest.mark.parametrize("d_v, N", [(40, 11), (8, 5), (64, 9)])
def test_warp_per_row_D_equals_rowsum(d_v, N):
    """v2's D pass against NumPy's rowsum(dO ∘ O) in float64: widths above, below and at a multiple of the 32
    lanes, a row count that leaves the last block's warps partly idle, and rows past N never written (poisoned
    ``D`` beyond N would show as NaN: D has exactly N rows per head, all of them checked). Two batches of two heads:
    each block (256 simulated threads) costs, so no more of them than the grid's three axes need."""
    rng = np.random.default_rng(d_v)
    O, dO = (rng.standard_normal((2, 2, N, d_v)).astype(np.float32) for _ in range(2))
    D = cuda.to_device(np.full((2, 2, N), np.nan, dtype=np.float32))
    flash2_backward_v2.warp_preprocess(cuda.to_device(O), cuda.to_device(dO), D, d_v)
    want = (O.astype(np.float64) * dO.astype(np.float64)).sum(axis=-1)
    np.testing.assert_allclose(D.copy_to_host(), want, rtol=1e-5, atol=1e-5 * d_v)


def test_fully_masked_rows_give_zero_dQ_and_unseen_keys_zero_dK_dV():
    # causal with N_q > N_k: the first N_q − N_k = 6 rows see no key (L = +inf); every key is seen by some row
    Q, K, V, dO = _problem(7, 1, 1, 1, 11, 5, 8)
    dQ, dK, dV = _check(Q, K, V, dO, True, BackwardTiling(2, 2, 2, 2))
    assert np.all(dQ[..., :6, :] == 0.0)
    assert np.abs(dQ[..., 6:, :]).max() > 0
    # causal with N_q < N_k, bottom-right: keys beyond the last row's reach do not exist; all are seen here too, so
    # check a non-causal problem's dV is the plain sum of P·dO (nonzero) and a causal one's last key row is seen
    # by the last query only: dV[-1] = P[-1, -1] dO[-1] (P = e^{S−L} ≤ 1)
    Q, K, V, dO = _problem(8, 1, 1, 1, 4, 9, 8)
    dQ, dK, dV = _check(Q, K, V, dO, True, BackwardTiling(2, 2, 2, 2))
    O, L = fa2edu.flash2_forward(Q, K, V, causal=True)[:2]
    p_last = np.exp(Q[0, 0, -1] @ K[0, 0, -1] / np.sqrt(8) - L[0, 0, -1])
    np.testing.assert_allclose(dV[0, 0, -1], p_last * dO[0, 0, -1], rtol=1e-4, atol=1e-6)


def test_dynamic_shared_memory_path_matches_static(monkeypatch):
    Q, K, V, dO = _problem(5, 1, 2, 1, 10, 9, 8)
    O, L = fa2edu.flash2_forward(Q, K, V, causal=True)[:2]
    O, L = np.asarray(O, np.float32), np.asarray(L, np.float32)
    tiling = BackwardTiling(2, 2, 2, 2)
    static = flash2_backward_v1.flash2_backward(Q, K, V, O, L, dO, causal=True, tiling=tiling)
    flash2_backward_v1.make_backward.cache_clear()
    monkeypatch.setattr(flash2_backward_v1.tiled, "STATIC_FLOATS", 16)   # force the dynamic declaration
    dynamic = flash2_backward_v1.flash2_backward(Q, K, V, O, L, dO, causal=True, tiling=tiling)
    flash2_backward_v1.make_backward.cache_clear()
    for a, b in zip(static, dynamic):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)   # dQ's atomics may add in another order


@pytest.mark.parametrize("tiling, message", [(BackwardTiling(2, 3, 2, 4), "NX"),
                                              (BackwardTiling(3, 2, 2, 2), "multiple of NY"),
                                              (BackwardTiling(1024, 2, 1, 2), "threads"),
                                              (BackwardTiling(2, 4, 2, 2), "4·NX")])
def test_bad_tilings_are_refused(tiling, message):
    Q, K, V, dO = _problem(0, 1, 1, 1, 4, 4, 8)
    O, L = fa2edu.flash2_forward(Q, K, V)[:2]
    with pytest.raises(ValueError, match=message):
        flash2_backward_v1.flash2_backward(Q, K, V, np.asarray(O, np.float32), np.asarray(L, np.float32), dO,
                                           tiling=tiling)


def _forward_scores_log2(Q, K, tau):
    """S₂ = (τ·log₂e·Q) Kᵀ as the fast forward computes it in the simulator: Q rounded after scaling, then one
    float32 product and one float32 sum per k, k ascending (the simulator does not fuse them)."""
    Qs = Q * np.float32(tau * flash2_backward_v1.LOG2E)
    S2 = np.zeros((Q.shape[0], K.shape[0]), np.float32)
    for k in range(Q.shape[1]):
        S2 = S2 + Qs[:, k, None] * K[None, :, k]
    return S2


def test_v4_recomputes_the_forwards_P():
    """v4's P = exp2(S₂ − L·log₂e) is the fast forward's normalised P: its S₂ is rounded as the forward's (Q scaled by
    τ·log₂e, not K), checked to the last bit of the exponential's argument at scores in the hundreds, where v3's
    differently rounded S₂ is off by several ulps. P is read off dV: with dO_i the i-th unit row, dV_j = P_:jᵀ."""
    rng = np.random.default_rng(3)
    d, N_q, N_k = 16, 8, 21                                   # 2 row blocks, 6 ragged key blocks: all it needs
    tiling = BackwardTiling(2, 2, 2, 2)
    Q, K = (8 * rng.standard_normal((1, 1, n, d)).astype(np.float32) for n in (N_q, N_k))
    V = rng.standard_normal((1, 1, N_k, d)).astype(np.float32)
    dO = np.eye(N_q, d, dtype=np.float32)[None, None]
    O, L = (np.asarray(x, np.float32) for x in VERSIONS["v6"](Q, K, V, tiling=tiling))
    tau = d ** -0.5
    l2 = L[0, 0] * np.float32(flash2_backward_v1.LOG2E)
    want = np.exp2((_forward_scores_log2(Q[0, 0], K[0, 0], tau) - l2[:, None]).astype(np.float64))
    got = {v: np.asarray(BACKWARD_VERSIONS[v](Q, K, V, O, L, dO, tiling=tiling)[2])[0, 0, :, :N_q].T
           for v in ("v3", "v4")}
    assert np.abs(want.max(axis=1) - 1).max() < 0.5           # scores spread: rows led by one key, not uniform
    np.testing.assert_allclose(got["v4"], want, rtol=2.0 ** -23, atol=1e-45)
    assert np.max(np.abs(got["v3"] - want) / np.maximum(want, 1e-30)) > 1e-6   # the mismatch v4 removes
    assert abs(got["v4"].astype(np.float64).sum(axis=1) - 1).max() < 4e-5       # rows of P sum to one


@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, causal", [CASES[1], CASES[3]])
def test_v4_matches_oracle_and_v3(tiling, Z, H_q, H_kv, N_q, N_k, d, causal):
    """v4 against the oracle, GQA and causal; at ordinary scales its gradients are v3's to float32 rounding."""
    _against_previous("v4", "v3", (tiling, Z, H_q, H_kv, N_q, N_k, d, causal), atol=1e-5)
