"""The float64 oracle: ``O = softmax(τ·QKᵀ + mask)·V``, its log-sum-exp ``L``, and its exact gradients.

Everything else in fa2edu is tested against these two functions. They are written for clarity, not memory: the
full N_q × N_k score matrix is formed, GQA is done by repeating K/V heads, and the arithmetic is float64 whatever
the input dtype.

Conventions (docs/conventions.md): causal masking is bottom-right aligned; a fully masked row has O = 0,
L = +inf and zero gradients; dropout (``dropout_p > 0``) uses :mod:`fa2edu.dropout`'s counter-based mask
keyed on ``seed``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fa2edu.dropout import check_dropout, keep_mask
from fa2edu.masks import causal_mask
from fa2edu.validation import check_like, guard_overflow, prepare

__all__ = ["ReferenceResult", "Gradients", "attention_reference", "attention_reference_backward"]


class ReferenceResult(NamedTuple):
    """What :func:`attention_reference` returns.

    Attributes
    ----------
    O : ndarray, shape (..., N_q, d_v)
        The attention output, float64.
    L : ndarray, shape (..., N_q)
        The log-sum-exp of each row of τ·QKᵀ (masked), float64; +inf for a fully masked row.
    """

    O: np.ndarray  # (..., N_q, d_v) float64
    L: np.ndarray  # (..., N_q) float64, log-sum-exp of each row of τ·QKᵀ (+inf for a fully masked row)


class Gradients(NamedTuple):
    """What :func:`attention_reference_backward` returns: the exact gradients, float64.

    Attributes
    ----------
    dQ : ndarray, shape (..., N_q, d)
        Gradient with respect to Q.
    dK : ndarray, shape (..., N_k, d)
        Gradient with respect to K, summed over the query heads of each GQA group.
    dV : ndarray, shape (..., N_k, d_v)
        Gradient with respect to V, summed likewise.
    """

    dQ: np.ndarray  # (..., N_q, d)
    dK: np.ndarray  # (..., N_k, d), summed over the query heads of each group (GQA)
    dV: np.ndarray  # (..., N_k, d_v)


def _scores(problem, dropout_p: float, seed: int):
    """S = τQKᵀ with −inf where masked; P = softmax(S) (0 on fully masked rows); L; the scaled dropout mask."""
    Q, K = (problem.Q.astype(np.float64), problem.K.astype(np.float64))
    S = problem.scale * np.einsum("zkgid,zkhjd->zkgij", Q, K)           # (Z, H_kv, G, N_q, N_k)
    visible = np.ones(S.shape, dtype=bool)
    if problem.causal:
        visible &= causal_mask(problem.N_q, problem.N_k)
    if problem.mask is not None:
        visible &= problem.mask
    S = np.where(visible, S, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    empty = np.isneginf(m)                                                  # fully masked rows
    E = np.exp(S - np.where(empty, 0.0, m))
    l = E.sum(axis=-1, keepdims=True)
    P = E / np.where(empty, 1.0, l)
    with np.errstate(divide="ignore"):
        L = np.where(empty, np.inf, m + np.log(np.where(empty, 1.0, l)))[..., 0]
    scaled_keep = None
    if dropout_p > 0.0:
        keep = keep_mask(seed, dropout_p, problem.lead, problem.lead[1] * problem.lead[2],
                         slice(0, problem.N_q), slice(0, problem.N_k))
        scaled_keep = keep / (1.0 - dropout_p)
    return P, L, scaled_keep


@guard_overflow
def attention_reference(Q, K, V, causal: bool = False, scale=None, mask=None, *, dropout_p: float = 0.0,
                        seed: int = 0) -> ReferenceResult:
    """softmax(τ·QKᵀ + mask)·V in float64, and ``L = logsumexp(τ·QKᵀ + mask)`` per row.

    Cost: 4·N_q·N_k·d FLOPs (2·N_q·N_k·(d + d_v) with d_v ≠ d) and N_q·N_k memory per (batch, head).

    Parameters
    ----------
    Q : ndarray, shape (..., N_q, d)
        Queries, float16, float32 or float64 (every dtype computes in float64), finite. Leading axes are
        batch axes and, with three or more axes, the H_q query heads on the axis before N_q.
    K : ndarray, shape (..., N_k, d)
        Keys in Q's dtype, with Q's batch axes and H_kv heads; H_q must be a multiple of H_kv (GQA/MQA: query head
        h reads K/V head h // (H_q / H_kv)).
    V : ndarray, shape (..., N_k, d_v)
        Values in Q's dtype, with K's leading axes and N_k rows; d_v may differ from d.
    causal : bool, default False
        Apply the causal mask aligned to the bottom-right corner: query i sees key j iff j ≤ i + N_k − N_q.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.
    mask : ndarray of bool, shape (N_q, N_k) or (..., N_q, N_k), optional
        True where a query may attend a key, False where it may not (that score becomes −inf); each leading axis is
        Q's or 1. With ``causal``, a query attends only the keys both allow. Default None: no mask.
    dropout_p : float, default 0.0
        Dropout probability in [0, 1), applied to P (FA1 Alg. 2); kept entries are scaled by 1/(1 − p).
    seed : int, default 0
        Non-negative key of the counter-based dropout mask (FA1 Alg. 2's PRNG state R); the backward pass
        regenerates the same mask from the same seed. Unused when ``dropout_p = 0``.

    Returns
    -------
    ReferenceResult
        ``(O, L)``, both float64: O (..., N_q, d_v) and L (..., N_q), +inf on a fully masked row (whose O is 0).
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask, score_dtype=np.float64)
    P, L, scaled_keep = _scores(problem, dropout_p, seed)
    if scaled_keep is not None:
        P = P * scaled_keep
    O = np.einsum("zkgij,zkhjd->zkgid", P, problem.V.astype(np.float64))
    return ReferenceResult(problem.from_q_layout(O), problem.from_q_layout(L))


@guard_overflow
def attention_reference_backward(Q, K, V, dO, causal: bool = False, scale=None, mask=None, *,
                                 dropout_p: float = 0.0, seed: int = 0) -> Gradients:
    """Exact gradients of ``sum(dO ∘ O)`` with respect to Q, K, V, in float64 (FA1 Alg. 3's equations).

    dV = P_dᵀ dO, dP = (dO Vᵀ) ∘ Z/(1−p), dS = P ∘ (dP − D) with D = rowsum(dO ∘ O), dQ = τ dS K, dK = τ dSᵀ Q
    (the FA2 text's ``dK = Q dSᵀ`` is erratum 1). dK, dV sum over the query heads that share a K/V head.

    Parameters
    ----------
    Q : ndarray, shape (..., N_q, d)
        Queries, float16, float32 or float64 (every dtype computes in float64), finite. Leading axes are
        batch axes and, with three or more axes, the H_q query heads on the axis before N_q.
    K : ndarray, shape (..., N_k, d)
        Keys in Q's dtype, with Q's batch axes and H_kv heads; H_q must be a multiple of H_kv (GQA/MQA: query head
        h reads K/V head h // (H_q / H_kv)).
    V : ndarray, shape (..., N_k, d_v)
        Values in Q's dtype, with K's leading axes and N_k rows; d_v may differ from d.
    dO : ndarray, shape (..., N_q, d_v)
        Gradient of the loss with respect to the output O, any floating dtype, finite.
    causal : bool, default False
        Apply the causal mask aligned to the bottom-right corner: query i sees key j iff j ≤ i + N_k − N_q.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.
    mask : ndarray of bool, shape (N_q, N_k) or (..., N_q, N_k), optional
        True where a query may attend a key, False where it may not (that score becomes −inf); each leading axis is
        Q's or 1. With ``causal``, a query attends only the keys both allow. Default None: no mask.
    dropout_p : float, default 0.0
        Dropout probability in [0, 1), applied to P (FA1 Alg. 2); kept entries are scaled by 1/(1 − p).
    seed : int, default 0
        Non-negative key of the counter-based dropout mask (FA1 Alg. 2's PRNG state R); the backward pass
        regenerates the same mask from the same seed. Unused when ``dropout_p = 0``.

    Returns
    -------
    Gradients
        ``(dQ, dK, dV)``, float64, shaped like Q, K and V; fully masked rows contribute zero gradients.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask, score_dtype=np.float64)
    dO = check_like(dO, "dO", problem.q_shape[:-1] + (problem.d_v,))
    dO5 = problem.to_q_layout(dO).astype(np.float64)
    Q5, K5, V5 = (x.astype(np.float64) for x in (problem.Q, problem.K, problem.V))
    P, _, scaled_keep = _scores(problem, dropout_p, seed)
    P_d = P if scaled_keep is None else P * scaled_keep
    O = np.einsum("zkgij,zkhjd->zkgid", P_d, V5)
    dV = np.einsum("zkgij,zkgid->zkgjd", P_d, dO5)
    dP = np.einsum("zkgid,zkhjd->zkgij", dO5, V5)
    if scaled_keep is not None:
        dP = dP * scaled_keep
    D = (dO5 * O).sum(axis=-1, keepdims=True)
    dS = P * (dP - D)
    dQ = problem.scale * np.einsum("zkgij,zkhjd->zkgid", dS, K5)
    dK = problem.scale * np.einsum("zkgij,zkgid->zkgjd", dS, Q5)
    return Gradients(problem.from_q_layout(dQ), problem.from_kv_layout(dK), problem.from_kv_layout(dV))
