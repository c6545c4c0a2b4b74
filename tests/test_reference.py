"""The float64 oracle is itself checked: against a row-by-row computation from the definitions, and its gradients
against central finite differences. Everything else in fa2edu is tested against it, so it gets no free pass."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from strategies import attention_problems

from fa2edu import attention_reference, attention_reference_backward
from fa2edu.dropout import uniform


def direct_attention(Q, K, V, causal=False, scale=None, mask=None, dropout_p=0.0, seed=0):
    """softmax(τ·q_i·K_jᵀ) V one query row at a time, from the definitions, with explicit loops over heads.

    Query head h reads K/V head h // G; dropout keeps (b, h, i, j) when ``uniform(seed, b, h, i, j) >= p`` and
    scales it by 1/(1 − p). A row with no visible key gives o_i = 0 and L_i = +inf.
    """
    squeeze = Q.ndim == 2
    if squeeze:
        Q, K, V = Q[None, None], K[None, None], V[None, None]
    Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
    B, H_q, N_q, d = Q.shape
    H_kv, N_k = K.shape[1], K.shape[2]
    G = H_q // H_kv
    tau = 1.0 / math.sqrt(d) if scale is None else scale
    allowed = np.ones((B, H_q, N_q, N_k), dtype=bool) if mask is None else np.broadcast_to(mask, (B, H_q, N_q, N_k))
    O = np.zeros((B, H_q, N_q, V.shape[-1]))
    L = np.zeros((B, H_q, N_q))
    for b in range(B):
        for h in range(H_q):
            for i in range(N_q):
                keys = [j for j in range(N_k) if allowed[b, h, i, j] and (not causal or j <= i + N_k - N_q)]
                if not keys:
                    L[b, h, i] = np.inf
                    continue
                s = np.array([tau * Q[b, h, i] @ K[b, h // G, j] for j in keys])
                m = s.max()
                e = np.exp(s - m)
                L[b, h, i] = m + math.log(e.sum())
                p = e / e.sum()
                if dropout_p > 0.0:
                    kept = np.array([uniform(seed, b, h, i, j) >= dropout_p for j in keys])
                    p = np.where(kept, p / (1.0 - dropout_p), 0.0)
                O[b, h, i] = p @ V[b, h // G, keys]
    if squeeze:
        return O[0, 0], L[0, 0]
    return O, L


@given(case=attention_problems(max_n=10, max_d=5), p=st.sampled_from([0.0, 0.0, 0.4]), seed=st.integers(0, 99))
def test_oracle_equals_the_direct_computation(case, p, seed):
    O, L = attention_reference(case.Q, case.K, case.V, **case.kwargs(), dropout_p=p, seed=seed)
    O_direct, L_direct = direct_attention(case.Q, case.K, case.V, **case.kwargs(), dropout_p=p, seed=seed)
    assert O.dtype == np.float64 and L.dtype == np.float64
    assert not np.isnan(O).any() and not np.isnan(L).any()
    assert (np.isposinf(L) == np.isposinf(L_direct)).all()
    finite = np.isfinite(L_direct)
    scale_L = max(1.0, np.abs(L_direct[finite]).max(initial=0.0))
    assert np.abs(L[finite] - L_direct[finite]).max(initial=0.0) <= 1e-12 * scale_L
    assert np.abs(O - O_direct).max() <= 1e-12 * max(1.0, np.abs(O_direct).max())


def finite_difference_gradients(case, dO, eps=1e-5, **kwargs):
    """Central differences of f(Q, K, V) = sum(dO ∘ O), one input entry at a time."""
    def f(Q, K, V):
        return float((attention_reference(Q, K, V, **case.kwargs(), **kwargs).O * dO).sum())

    inputs = [case.Q.copy(), case.K.copy(), case.V.copy()]
    grads = []
    for x in inputs:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + eps
            up = f(*inputs)
            x[idx] = saved - eps
            down = f(*inputs)
            x[idx] = saved
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


@given(case=attention_problems(max_n=5, max_d=3, extreme=False), p=st.sampled_from([0.0, 0.5]),
       seed=st.integers(0, 99))
def test_oracle_gradients_equal_central_finite_differences(case, p, seed):
    """Covers causal, masks, GQA (dK, dV summed over the group) and dropout with a fixed seed (Z held fixed)."""
    dO = np.random.default_rng(seed).standard_normal(case.Q.shape[:-1] + (case.V.shape[-1],))
    grads = attention_reference_backward(case.Q, case.K, case.V, dO, **case.kwargs(), dropout_p=p, seed=seed)
    numeric = finite_difference_gradients(case, dO, dropout_p=p, seed=seed)
    for name, analytic, fd in zip(("dQ", "dK", "dV"), grads, numeric):
        assert analytic.shape == fd.shape, name
        err = np.abs(analytic - fd).max()
        assert err <= 1e-6 * max(1.0, np.abs(fd).max()), f"{name}: |analytic − finite difference| = {err:.2e}"


def test_fully_masked_rows_give_zero_output_infinite_L_and_zero_gradients():
    rng = np.random.default_rng(0)
    N_q, N_k, d = 7, 4, 3
    Q, dO = rng.standard_normal((2, 2, 3, N_q, d))
    K, V = rng.standard_normal((2, 2, 3, N_k, d))
    mask = np.ones((N_q, N_k), dtype=bool)
    mask[5] = False                                         # one more row with no key
    with np.errstate(all="raise"):
        O, L = attention_reference(Q, K, V, causal=True, mask=mask)
        dQ, dK, dV = attention_reference_backward(Q, K, V, dO, causal=True, mask=mask)
    empty = np.zeros(N_q, dtype=bool)
    empty[:N_q - N_k] = True                                # causal, bottom-right: rows 0..2 see no key
    empty[5] = True
    assert (O[..., empty, :] == 0).all() and np.isposinf(L[..., empty]).all()
    assert np.isfinite(L[..., ~empty]).all()
    assert (dQ[..., empty, :] == 0).all()
    # Keys only seen by masked rows get no gradient from them; here every key is seen by some row.
    assert not np.isnan(dK).any() and not np.isnan(dV).any()
    everything_masked = np.zeros((N_q, N_k), dtype=bool)
    O, L = attention_reference(Q, K, V, mask=everything_masked)
    grads = attention_reference_backward(Q, K, V, dO, mask=everything_masked)
    assert (O == 0).all() and np.isposinf(L).all()
    assert all((g == 0).all() for g in grads)


def test_oracle_computes_in_float64_whatever_the_input_dtype():
    rng = np.random.default_rng(1)
    Q, K, V = rng.standard_normal((3, 5, 4)).astype(np.float16)
    O, L = attention_reference(Q, K, V)
    O64, L64 = attention_reference(Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64))
    assert O.dtype == L.dtype == np.float64
    np.testing.assert_array_equal(O, O64)
    np.testing.assert_array_equal(L, L64)
