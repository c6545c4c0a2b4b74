"""The exercise checkers (fa2edu.exercises): they pass the worked solutions and catch plausible wrong answers.

A checker that lets a wrong answer through teaches the wrong thing, so most of this file is wrong answers: the
mistakes a reader actually makes (online softmax without the rescaling, a merge that breaks on an empty side, a
causal classifier aligned top-left, a row-block update that forgets to rescale O, softmax that overflows, a kernel
without its bounds guard, the printed dK = Q dSᵀ). Each must fail, and the report must name a *small* failing case
with the feature that breaks it, not just "wrong".
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from numba import cuda  # the CUDA simulator in CI: tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1 first

from fa2edu import exercises, fp8
from fa2edu.softmax import Stats, exp_minus

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"


# -- wrong answers, by exercise -----------------------------------------------------------------------------------

# 1.3 standard attention's traffic
def io_square(N_q, N_k, d):                       # N_q² where the score matrix is N_q × N_k
    return N_q * d + 2 * N_k * d + 2 * N_q * N_q, 2 * N_q * N_q + N_q * d


def io_without_softmax_pass(N_q, N_k, d):         # forgets that line 2 reads S and writes P
    return N_q * d + 2 * N_k * d + N_q * N_k, N_q * N_k + N_q * d


# 2.2 the (m, ℓ) merge
def merge_without_rescaling(a, b):
    return np.maximum(a.m, b.m), a.l + b.l


def merge_unguarded(a, b):                        # −inf − (−inf) = NaN when both sides are empty
    m = np.maximum(a.m, b.m)
    return m, np.exp(a.m - m) * a.l + np.exp(b.m - m) * b.l


def merge_overflowing(a, b):                      # e^m itself: inf / inf once m > 709
    m = np.maximum(a.m, b.m)
    return m, (np.exp(a.m) * a.l + np.exp(b.m) * b.l) / np.exp(np.where(np.isneginf(m), 0.0, m))


def merge_keeping_first_max(a, b):
    return a.m, a.l + np.exp(b.m - a.m) * b.l


# 2.3 online softmax
def online_without_rescaling(x, block):
    m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    for s in range(0, x.shape[1], block):
        m = np.maximum(m, x[:, s:s + block].max(axis=1))
        l = l + exp_minus(x[:, s:s + block], m).sum(axis=1)      # old terms stay against the old maximum
    return exp_minus(x, m) / np.where(l == 0, 1, l)[:, None]


def online_overflowing(x, block):                  # no maximum subtracted (guarded division, so only overflow)
    l = np.zeros(x.shape[0])
    for s in range(0, x.shape[1], block):
        l = l + np.exp(x[:, s:s + block]).sum(axis=1)
    return np.exp(x) / np.where(l == 0, 1, l)[:, None]


def online_unguarded(x, block):
    m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
    for s in range(0, x.shape[1], block):
        m_new = np.maximum(m, x[:, s:s + block].max(axis=1))
        l = np.exp(m - m_new) * l + np.exp(x[:, s:s + block] - m_new[:, None]).sum(axis=1)
        m = m_new
    return np.exp(x - m[:, None]) / l[:, None]


# 3.3 FA1's update of the normalised O
def fa1_forgetting_old_normaliser(O, l, m, S, V):  # treats O as un-scaled: no diag(ℓ_i)
    m_t = S.max(axis=1)
    P = exp_minus(S, m_t)
    m_new = np.maximum(m, m_t)
    a, b = exp_minus(m[:, None], m_new)[:, 0], exp_minus(m_t[:, None], m_new)[:, 0]
    l_new = a * l + b * P.sum(axis=1)
    return (a[:, None] * O + b[:, None] * (P @ V)) / np.where(l_new == 0, 1, l_new)[:, None], l_new, m_new


def fa1_unguarded(O, l, m, S, V):
    m_t = S.max(axis=1)
    P = np.exp(S - m_t[:, None])
    m_new = np.maximum(m, m_t)
    a, b = np.exp(m - m_new), np.exp(m_t - m_new)
    l_new = a * l + b * P.sum(axis=1)
    return ((l * a)[:, None] * O + b[:, None] * (P @ V)) / l_new[:, None], l_new, m_new


# 4.3 FA1 forward's traffic
def flash1_io_floor(N, d, M):                     # N // B_c column blocks: none at all when N < B_c
    T_c = N // math.ceil(M / (4 * d))
    return 2 * N * d + T_c * (2 * N * d + 2 * N), T_c * (N * d + 2 * N)


def flash1_io_fa2_rule(N, d, M):                  # FA2's Q-outer rule gives the small block to K/V
    T_c = math.ceil(N / min(math.ceil(M / (4 * d)), d))
    return 2 * N * d + T_c * (2 * N * d + 2 * N), T_c * (N * d + 2 * N)


# 5.1 the softmax backward
def softmax_backward_without_D(P, dP):
    return P * dP


def softmax_backward_D_over_columns(P, dP):       # sums over the wrong axis; broadcasting hides it
    return P * (dP - (P * dP).sum(axis=0))


# 6.2 FA2's update of the un-scaled Õ
def fa2_not_rescaling_O(O, l, m, S, V):            # ℓ is rescaled, Õ is not
    m_new = np.maximum(m, S.max(axis=1))
    P = exp_minus(S, m_new)
    a = exp_minus(m[:, None], m_new)[:, 0]
    return O + P @ V, a * l + P.sum(axis=1), m_new


def fa2_printed_inverse(O, l, m, S, V):            # line 10 as printed: diag(e^{m_old − m_new})⁻¹ (erratum 4)
    m_new = np.maximum(m, S.max(axis=1))
    P = exp_minus(S, m_new)
    a = exp_minus(m[:, None], m_new)[:, 0]
    return O / np.where(a == 0, 1, a)[:, None] + P @ V, a * l + P.sum(axis=1), m_new


def fa2_unguarded(O, l, m, S, V):
    m_new = np.maximum(m, S.max(axis=1))
    P = np.exp(S - m_new[:, None])
    a = np.exp(m - m_new)
    return a[:, None] * O + P @ V, a * l + P.sum(axis=1), m_new


def fa2_in_place(O, l, m, S, V):                   # correct, and updates its arguments in place
    m_new = np.maximum(m, S.max(axis=1))
    P = exp_minus(S, m_new)
    a = exp_minus(m[:, None], m_new)[:, 0]
    O *= a[:, None]
    O += P @ V
    l *= a
    l += P.sum(axis=1)
    m[:] = m_new
    return O, l, m


# 7.4 split-K merge
def warps_without_rescaling(m, l, O):
    return m.max(axis=0), l.sum(axis=0), O.sum(axis=0)


def warps_unguarded(m, l, O):
    m_all = m.max(axis=0)
    s = np.exp(m - m_all)
    return m_all, (s * l).sum(axis=0), (s[..., None] * O).sum(axis=0)


def warps_overflowing(m, l, O):
    m_all = m.max(axis=0)
    s = np.exp(m) / np.exp(np.where(np.isneginf(m_all), 0.0, m_all))
    return m_all, (s * l).sum(axis=0), (s[..., None] * O).sum(axis=0)


# 8.1 causal block classification
def kind_top_left(N_q, N_k, rows, cols):          # j <= i: right only when N_q = N_k
    if cols.start > rows.stop - 1:
        return "skip"
    return "plain" if cols.stop - 1 <= rows.start else "mask"


def kind_strict(N_q, N_k, rows, cols):            # j < i + offset: the diagonal itself masked
    offset = N_k - N_q
    if cols.start >= rows.stop - 1 + offset:
        return "skip"
    return "plain" if cols.stop - 1 < rows.start + offset else "mask"


def kind_wrong_corner(N_q, N_k, rows, cols):      # skips by the top-left corner, not the bottom-left one
    offset = N_k - N_q
    if cols.start > rows.start + offset:
        return "skip"
    return "plain" if cols.stop - 1 <= rows.start + offset else "mask"


# 9.2 the row-statistics kernel (module level: the simulator swaps the `cuda` global)
@cuda.jit
def kernel_without_guard(S, m, l):
    i = cuda.grid(1)
    m_i, l_i = -math.inf, 0.0
    for j in range(S.shape[1]):
        x = S[i, j]
        if x != -math.inf:
            m_new = max(m_i, x)
            l_i = l_i * math.exp(m_i - m_new) + math.exp(x - m_new)
            m_i = m_new
    m[i], l[i] = m_i, l_i


@cuda.jit
def kernel_without_rescaling(S, m, l):
    i = cuda.grid(1)
    if i < S.shape[0]:
        m_i, l_i = -math.inf, 0.0
        for j in range(S.shape[1]):
            x = S[i, j]
            if x != -math.inf:
                m_i = max(m_i, x)
                l_i = l_i + math.exp(x - m_i)
        m[i], l[i] = m_i, l_i


@cuda.jit
def kernel_overflowing(S, m, l):
    i = cuda.grid(1)
    if i < S.shape[0]:
        m_i, total = -math.inf, 0.0
        for j in range(S.shape[1]):
            x = S[i, j]
            if x != -math.inf:
                m_i = max(m_i, x)
                total += math.exp(x)
        m[i] = m_i
        l[i] = total * math.exp(-m_i) if total > 0 else 0.0


# 10.1 TFLOP/s
_PASS_FACTOR = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}


def tflops_not_halving_causal(r):
    return 4 * r["N"] ** 2 * r["d"] * r["heads"] * r["batch"] * _PASS_FACTOR[r["pass"]] / (r["ms"] * 1e-3) / 1e12


def tflops_ms_as_seconds(r):
    flops = 4 * r["N"] ** 2 * r["d"] * r["heads"] * r["batch"] / (2 if r["causal"] else 1)
    return flops * _PASS_FACTOR[r["pass"]] / r["ms"] / 1e12


# 11.4 standard backward
def _probabilities(Q, K, causal, offset=None, guard=True):
    N_q, N_k = Q.shape[0], K.shape[0]
    tau = 1.0 / np.sqrt(Q.shape[1])
    S = tau * Q @ K.T
    if causal:
        offset = N_k - N_q if offset is None else offset
        S = np.where(np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + offset, S, -np.inf)
    if not guard:
        P = np.exp(S - S.max(axis=1, keepdims=True))
        return tau, P / P.sum(axis=1, keepdims=True)
    P = exp_minus(S, S.max(axis=1))
    return tau, P / np.where(P.sum(axis=1) == 0, 1, P.sum(axis=1))[:, None]


def _backward(tau, P, V, dO, K, Q, printed=False):
    dS = P * (dO @ V.T - (dO * (P @ V)).sum(axis=1, keepdims=True))
    return tau * dS @ K, (tau * Q @ dS.T if printed else tau * dS.T @ Q), P.T @ dO


def backward_printed_dK(Q, K, V, dO, causal=False):          # FA2 §2.2's dK = Q dSᵀ (erratum 1)
    tau, P = _probabilities(Q, K, causal)
    return _backward(tau, P, V, dO, K, Q, printed=True)


def backward_top_left(Q, K, V, dO, causal=False):
    tau, P = _probabilities(Q, K, causal, offset=0)
    return _backward(tau, P, V, dO, K, Q)


def backward_unguarded(Q, K, V, dO, causal=False):
    tau, P = _probabilities(Q, K, causal, guard=False)
    return _backward(tau, P, V, dO, K, Q)


# 13.2 merging partial attentions (O, L)
def merge_states_logaddexp(O_a, L_a, O_b, L_b):   # treats L = +inf (an empty side) as a dominant side
    L = np.logaddexp(L_a, L_b)
    return np.exp(L_a - L)[:, None] * O_a + np.exp(L_b - L)[:, None] * O_b, L


def merge_states_overflowing(O_a, L_a, O_b, L_b):  # empty sides handled, but e^L itself overflows
    w_a, w_b = (np.where(np.isposinf(L), 0.0, np.exp(L)) for L in (L_a, L_b))
    w = np.where(w_a + w_b == 0, 1.0, w_a + w_b)
    L = np.where(w_a + w_b == 0, np.inf, np.log(w))
    return (w_a[:, None] * O_a + w_b[:, None] * O_b) / w[:, None], L


def merge_states_averaging(O_a, L_a, O_b, L_b):    # weights ignored where both sides saw keys
    both = np.isfinite(L_a) & np.isfinite(L_b)
    O = np.where(both[:, None], (O_a + O_b) / 2, O_a + O_b)
    m = np.maximum(np.where(np.isposinf(L_a), -np.inf, L_a), np.where(np.isposinf(L_b), -np.inf, L_b))
    return O, np.where(np.isneginf(m), np.inf, np.logaddexp(np.where(np.isposinf(L_a), -np.inf, L_a),
                                                            np.where(np.isposinf(L_b), -np.inf, L_b)))


# 12.4 the SDPA mask
def mask_top_left(N_q, N_k):
    return np.tril(np.ones((N_q, N_k), dtype=bool))


def mask_additive(N_q, N_k):
    return np.where(np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + N_k - N_q, 0.0, -np.inf)


# 16.1-16.3 Hopper's layouts and protocol
def swizzle_forgotten(row, col):
    return 128 * row + 2 * col


def swizzle_by_element(row, col):          # XORs the element index, not the 16-byte chunk
    return 128 * row + 2 * (col ^ (row % 8))


def descriptor_without_units(start, lbo, sbo, swizzle):     # byte addresses, not 16-byte units
    mode = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]
    return (start & 0x3FFF) | ((lbo & 0x3FFF) << 16) | ((sbo & 0x3FFF) << 32) | (mode << 62)


def ring_parity_of_tile(j, stages):        # the tile's parity, not its stage's use count
    return j % stages, j % 2, None if j < stages else (j - 1) % 2


# 17.1-17.3 mods: a sliding window, packed documents, the soft cap's derivative
def window_w_plus_1(w, offset):            # PyTorch's example q_idx - kv_idx <= W: w + 1 keys
    def mask_mod(b, h, q_idx, kv_idx):
        p = q_idx + offset
        return (kv_idx <= p) & (kv_idx >= p - w)
    return mask_mod

def window_top_left(w, offset):            # ignores the offset: right only when N_q = N_k
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - w)
    return mask_mod

def window_two_sided(w, offset):           # |p − j| < w: sees w − 1 future keys too
    def mask_mod(b, h, q_idx, kv_idx):
        return abs(q_idx + offset - kv_idx) < w
    return mask_mod

def window_as_int(w, offset):              # True * True is the int 1, not a bool
    def mask_mod(b, h, q_idx, kv_idx):
        p = q_idx + offset
        return (kv_idx <= p) * (kv_idx > p - w)
    return mask_mod

def documents_bidirectional(b, h, q_idx, kv_idx, q_ids, kv_ids):   # forgets the causal part
    return (q_ids[q_idx] == kv_ids[kv_idx]) & (q_ids[q_idx] != -1)

def documents_padding_sees_padding(b, h, q_idx, kv_idx, q_ids, kv_ids):
    p = q_idx + len(kv_ids) - len(q_ids)
    return (kv_idx <= p) & (q_ids[q_idx] == kv_ids[kv_idx])

def documents_top_left(b, h, q_idx, kv_idx, q_ids, kv_ids):       # kv_idx <= q_idx
    return (kv_idx <= q_idx) & (q_ids[q_idx] == kv_ids[kv_idx]) & (q_ids[q_idx] != -1)

def documents_one_array(b, h, q_idx, kv_idx, q_ids, kv_ids):      # q_ids for both
    p = q_idx + len(kv_ids) - len(q_ids)
    return (kv_idx <= p) & (q_ids[q_idx] == q_ids[kv_idx]) & (q_ids[q_idx] != -1)

def softcap_grad_without_c(c):
    def score_mod_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - np.tanh(score) ** 2
    return score_mod_grad

def softcap_grad_times_c(c):               # forgets the inner derivative 1/c
    def score_mod_grad(score, b, h, q_idx, kv_idx):
        return c * (1.0 - np.tanh(score / c) ** 2)
    return score_mod_grad

def softcap_grad_unstable(c):              # 4e^{−2u}/(1 + e^{−2u})²: inf/inf for u ≪ 0
    def score_mod_grad(score, b, h, q_idx, kv_idx):
        e = np.exp(-2.0 * score / c)
        return 4.0 * e / (1.0 + e) ** 2
    return score_mod_grad


# 18.1 a tile to e4m3 with one scale per block of rows
def quantize_one_scale(x, block):                 # one scale for the whole tile, repeated per block
    amax = np.abs(x).max()
    descale = np.float32(amax / 448 if amax > 0 else 1.0)
    return fp8.to_bits(x / np.float64(descale), "e4m3"), np.full(-(-x.shape[0] // block), descale)

def _block_descales(amax):
    return np.where(amax != 0, amax / 448.0, 1.0).astype(np.float32)

def _codes(x, descale, block):
    rows = np.repeat(descale, block)[:x.shape[0]].astype(np.float64)
    with np.errstate(all="ignore"):
        return fp8.to_bits(x / rows[:, None], "e4m3")

def quantize_signed_max(x, block):                # amax of x, not of |x|
    descale = _block_descales(np.maximum.reduceat(x.max(axis=1), np.arange(0, x.shape[0], block)))
    return _codes(x, descale, block), descale

def quantize_zero_block_unguarded(x, block):      # amax = 0 gives δ = 0, and 0 / 0
    amax = np.maximum.reduceat(np.abs(x).max(axis=1), np.arange(0, x.shape[0], block))
    descale = (amax / 448.0).astype(np.float32)
    return _codes(x, descale, block), descale

def quantize_whole_blocks_only(x, block):         # N // block scales: the ragged last block gets none of its own
    n = max(1, x.shape[0] // block)
    descale = _block_descales(np.array([np.abs(x[b * block:(b + 1) * block]).max() for b in range(n)]))
    padded = np.concatenate([descale, np.full(x.shape[0], descale[-1])])
    return _codes(x, padded, block), descale

def quantize_by_amax(x, block):                   # divides by amax: every code within ±1, not ±448
    amax = np.maximum.reduceat(np.abs(x).max(axis=1), np.arange(0, x.shape[0], block))
    descale = _block_descales(amax)
    return _codes(x, np.where(amax > 0, amax, 1.0), block), descale

def quantize_values(x, block):                    # the e4m3 values, not their codes
    codes, descale = exercises.solution("18.1")(x, block)
    return fp8.from_bits(codes), descale

# 18.2 the rotation M = diag(signs)·H/√d
def rotation_unnormalised(signs):
    return signs[:, None] * fp8.hadamard_matrix(len(signs))

def rotation_signs_after(signs):                  # H·diag(signs): the signs flip outputs, magnitudes unchanged
    return fp8.hadamard_matrix(len(signs)) * signs[None, :] / np.sqrt(len(signs))

def rotation_without_signs(signs):
    return fp8.hadamard_matrix(len(signs)) / np.sqrt(len(signs))

def rotation_by_d(signs):                         # divides by d, not √d
    return signs[:, None] * fp8.hadamard_matrix(len(signs)) / len(signs)


def flat(report: str) -> str:
    """A report with its line wrapping undone, to look for a phrase in it."""
    return " ".join(report.split())


def _size(case, *names):
    return max(case[name] for name in names)


# (exercise, wrong answer, what the smallest failing case must show, a phrase the report must contain)
WRONG_ANSWERS = [
    ("1.3", io_square, lambda c: c["N_q"] != c["N_k"] and _size(c, "N_q", "N_k", "d") <= 2, "reads: expected"),
    ("1.3", io_without_softmax_pass, lambda c: _size(c, "N_q", "N_k", "d") == 1, "Alg 0 line 2"),
    ("2.2", merge_without_rescaling, lambda c: _size(c, "rows", "n_a", "n_b") == 1, "l: max |got − expected|"),
    ("2.2", merge_unguarded, lambda c: c["empty"] in ("both", "rows") and c["rows"] <= 2, "NaN"),
    ("2.2", merge_overflowing, lambda c: c["logits"] == "large" and c["rows"] == 1, "NaN"),
    ("2.2", merge_keeping_first_max, lambda c: c["rows"] == 1 and c["n_a"] + c["n_b"] <= 3, "m: max"),
    ("2.3", online_without_rescaling, lambda c: c["n"] == 2 and c["block"] == 1 and c["rows"] == 1, "p: max"),
    ("2.3", online_overflowing, lambda c: c["logits"] == "large" and c["n"] <= 2, "p: NaN"),
    ("2.3", online_unguarded, lambda c: c["masked"] in ("rows", "first block") and c["n"] == 1, "no visible key"),
    ("3.3", fa1_forgetting_old_normaliser, lambda c: c["N_q"] == 1 and c["N_k"] <= 3 and c["B_c"] == 1, "O: max"),
    ("3.3", fa1_unguarded, lambda c: c["mask"] != "none" and c["N_q"] <= 2 and c["N_k"] == 1, "all −inf"),
    ("4.3", flash1_io_floor, lambda c: c["N"] < math.ceil(c["M"] / (4 * c["d"])) and c["N"] <= 2, "T_c = 1"),
    ("4.3", flash1_io_fa2_rule, lambda c: c["N"] <= 2 and c["d"] == 1, "B_c = 2"),
    ("5.1", softmax_backward_without_D, lambda c: _size(c, "N_q", "N_k") == 1, "dS: max"),
    ("5.1", softmax_backward_D_over_columns, lambda c: c["N_q"] == 1 and c["N_k"] == 2, "dS: max"),
    ("6.2", fa2_not_rescaling_O, lambda c: c["N_q"] == 1 and c["N_k"] == 2 and c["B_c"] == 1, "O_tilde: max"),
    ("6.2", fa2_printed_inverse, lambda c: c["N_q"] == 1 and c["N_k"] == 2 and c["B_c"] == 1, "O_tilde: max"),
    ("6.2", fa2_unguarded, lambda c: c["mask"] != "none" and c["N_q"] <= 2 and c["N_k"] == 1, "NaN"),
    ("7.4", warps_without_rescaling, lambda c: c["r"] == 1 and c["c"] == 2 and c["W"] == 2, "l: max"),
    ("7.4", warps_unguarded, lambda c: c["mask"] != "none" and c["r"] <= 2 and c["W"] == 1, "NaN"),
    ("7.4", warps_overflowing, lambda c: c["logits"] == "large" and _size(c, "r", "c", "W") == 1, "NaN"),
    ("8.1", kind_top_left, lambda c: c["N_q"] != c["N_k"] and _size(c, "N_q", "N_k") <= 2, "j ≤ i + N_k − N_q"),
    ("8.1", kind_strict, lambda c: _size(c, "N_q", "N_k", "B_r", "B_c") == 1, "expected 'plain', got 'skip'"),
    ("8.1", kind_wrong_corner, lambda c: _size(c, "N_q", "N_k", "B_r", "B_c") <= 2, "expected 'mask', got 'skip'"),
    ("9.2", kernel_without_guard, lambda c: c["threads"] > c["rows"] == 1, "IndexError"),
    ("9.2", kernel_without_rescaling, lambda c: c["rows"] == 1 and c["cols"] == 2, "l: max"),
    ("9.2", kernel_overflowing, lambda c: c["logits"] == "large" and c["cols"] == 1, "OverflowError"),
    ("10.1", tflops_not_halving_causal, lambda c: c["causal"] and c["N"] == 1, "2 model FLOPs"),
    ("10.1", tflops_ms_as_seconds, lambda c: c["N"] == 1 and c["pass"] == "forward", "0.001"),
    ("11.4", backward_printed_dK, lambda c: _size(c, "N_q", "N_k") == 1, "raised ValueError"),
    ("11.4", backward_top_left, lambda c: c["causal"] and c["N_q"] < c["N_k"] <= 2, "dV: max"),
    ("11.4", backward_unguarded, lambda c: c["causal"] and c["N_q"] == 2 and c["N_k"] == 1, "see no key"),
    ("12.4", mask_top_left, lambda c: c["N_q"] < c["N_k"] <= 2, "expected visible"),
    ("13.2", merge_states_logaddexp, lambda c: c["split"] in (0, c["N_k"]) and _size(c, "N_q", "N_k") == 1,
     "saw no key"),
    ("13.2", merge_states_overflowing,                 # shrunk with both sides kept: the overflow needs no empty side
     lambda c: c["logits"] == "large" and c["N_q"] == 1 and 0 < c["split"] < c["N_k"], "side b saw keys"),
    ("13.2", merge_states_averaging, lambda c: 0 < c["split"] < c["N_k"] == 2, "O: max"),
    ("12.4", mask_additive, lambda c: _size(c, "N_q", "N_k") == 1, "boolean mask"),
    ("16.1", swizzle_forgotten, lambda c: c["rows"] == 2, "lands at chunk 1"),
    ("16.1", swizzle_by_element, lambda c: c["rows"] == 2, "expected byte"),
    ("16.2", descriptor_without_units, lambda c: True, "the fields that differ: start"),
    ("16.3", ring_parity_of_tile, lambda c: c["stages"] == 2 and c["tiles"] <= 3, "(stage, consumer's parity"),
    ("17.1", window_w_plus_1, lambda c: c["w"] == 1 and _size(c, "N_q", "N_k") <= 2, "expected masked, got kept"),
    ("17.1", window_top_left, lambda c: c["N_q"] != c["N_k"] and _size(c, "N_q", "N_k") <= 2, "p = i + N_k − N_q"),
    ("17.1", window_two_sided, lambda c: c["w"] == 2 and _size(c, "N_q", "N_k") <= 2, "fully masked"),
    ("17.1", window_as_int, lambda c: _size(c, "N_q", "N_k", "w") == 1, "must return a bool"),
    ("17.2", documents_bidirectional, lambda c: c["N_q"] == c["N_k"] == 2, "expected masked, got kept"),
    ("17.2", documents_padding_sees_padding, lambda c: c["docs"] == "padded" and _size(c, "N_q", "N_k") == 1,
     "padding (id −1, in no document)"),
    ("17.2", documents_top_left, lambda c: c["N_q"] < c["N_k"] <= 2, "expected kept, got masked"),
    ("17.2", documents_one_array, lambda c: c["N_q"] < c["N_k"] <= 2, "raised IndexError"),
    ("17.3", softcap_grad_without_c, lambda c: c["c"] != 1.0 and c["n"] == 1, "expected d/dscore c·tanh(score/c)"),
    ("17.3", softcap_grad_times_c, lambda c: c["c"] != 1.0 and c["n"] == 1, "a central difference"),
    ("17.3", softcap_grad_unstable, lambda c: c["scores"] == "large" and c["n"] <= 2, "got nan"),
    ("18.1", quantize_one_scale, lambda c: c["N"] == 2 and c["block"] == 1 and c["d"] == 1, "descale[0]"),
    ("18.1", quantize_signed_max, lambda c: _size(c, "N", "d") <= 2 and c["block"] == 1, "of |x|, not of x"),
    ("18.1", quantize_zero_block_unguarded, lambda c: c["values"] == "zeros" and _size(c, "N", "d", "block") == 1,
     "all zeros: its descale must be 1"),
    ("18.1", quantize_whole_blocks_only, lambda c: c["N"] % c["block"] and c["N"] <= 2 * c["block"] and c["d"] == 1,
     "the last block ragged"),
    ("18.1", quantize_by_amax, lambda c: _size(c, "N", "d", "block") == 1, "expected 0x7e (e4m3 448"),
    ("18.1", quantize_values, lambda c: _size(c, "N", "d", "block") == 1, "expected uint8, the e4m3 bit patterns"),
    ("18.2", rotation_unnormalised, lambda c: c["d"] == 2, "M·Mᵀ = 2·I, not I"),
    ("18.2", rotation_signs_after, lambda c: c["d"] == 2, "the signs act after H"),
    ("18.2", rotation_without_signs, lambda c: c["d"] == 1, "the random signs are missing"),
    ("18.2", rotation_by_d, lambda c: c["d"] == 2, "divide H by √d"),
]


@pytest.mark.parametrize("exercise_id", list(exercises.EXERCISES))
def test_worked_solution_passes(exercise_id: str) -> None:
    """Every checker accepts its worked solution on every case, and says what it checked."""
    result = exercises.check(exercise_id, exercises.solution(exercise_id), verbose=False)
    assert result, result.report
    assert result.attempted and result.failure is None
    assert result.cases == len(exercises._cases(exercises.EXERCISES[exercise_id])) >= 10
    assert any(line.startswith(f"✓ Passed all {result.cases} cases") for line in result.report.splitlines())


@pytest.mark.parametrize("exercise_id, wrong, minimal, phrase", WRONG_ANSWERS,
                         ids=[f"{e}-{w.__name__}" for e, w, _, _ in WRONG_ANSWERS])
def test_wrong_answer_fails_on_a_small_case(exercise_id, wrong, minimal, phrase) -> None:
    """A plausible mistake fails, and the report names a shrunk case that shows the mistake's trigger."""
    result = exercises.check(exercise_id, wrong, verbose=False)
    assert not result and result.attempted, f"{wrong.__name__} passed exercise {exercise_id}"
    failure = result.failure
    assert minimal(failure.case), f"{wrong.__name__}: not the expected small case: {failure.case}\n{result.report}"
    assert phrase in flat(result.report), result.report
    assert "Smallest failing case found" in result.report
    for name, spec in exercises.EXERCISES[exercise_id].params.items():
        if isinstance(spec, exercises.Size):
            assert f"{name} = {failure.case[name]}" in result.report        # the case is printed, size by size


@pytest.mark.parametrize("exercise_id", ["2.2", "6.2", "8.1"])
def test_shrunk_case_is_locally_minimal(exercise_id: str) -> None:
    """No single shrinking step from the reported case still fails: the report shows a local minimum."""
    wrong = next(w for e, w, _, _ in WRONG_ANSWERS if e == exercise_id)
    exercise = exercises.EXERCISES[exercise_id]
    failure = exercises.check(exercise_id, wrong, verbose=False).failure
    assert failure.shrink_steps >= 0 and exercises._attempt(exercise, wrong, failure.case) is not None
    for smaller in exercises._smaller_cases(exercise, failure.case):
        assert exercises._attempt(exercise, wrong, smaller) is None, (failure.case, smaller)


def test_in_place_update_is_judged_on_its_values() -> None:
    """The checker passes copies: a correct function that updates its arguments in place passes."""
    assert exercises.check("6.2", fa2_in_place, verbose=False)


def test_stub_is_not_attempted_and_does_not_raise(capsys) -> None:
    """The try cells of the chapters hold stubs that raise NotImplementedError; checking one must not raise."""
    def fa2_update(O_tilde, l, m, S_ij, V_j):
        raise NotImplementedError("your code here")

    result = exercises.check("6.2", fa2_update)
    printed = capsys.readouterr().out
    assert not result and not result.attempted and result.failure is None
    assert "Not attempted yet" in printed and "hint('6.2')" in printed


def test_report_details() -> None:
    """The report says what kind of wrong it is: a wrong shape, a missing result, an exception and its line."""
    right = exercises.solution("5.1")
    shape = exercises.check("5.1", lambda P, dP: right(P, dP).T, verbose=False)
    assert "dS: wrong shape (2, 1); expected (1, 2)" in shape.report
    nothing = exercises.check("6.2", lambda O, l, m, S, V: None, verbose=False)
    assert "returned None; expected a tuple (O_tilde, l, m)" in nothing.report

    def crashes(x, block):
        return x[:, block * 100]

    crash = exercises.check("2.3", crashes, verbose=False)
    assert "raised IndexError" in crash.report and "return x[:, block * 100]" in crash.report
    wrong = exercises.check("6.2", fa2_not_rescaling_O, verbose=False)
    assert wrong.failure.inputs["S_ij"].shape == (1, 1)                   # the failing call's arguments are kept
    assert isinstance(wrong.failure.expected, np.ndarray) and wrong.failure.got is not None
    assert "S_ij = [[" in wrong.report                                    # small inputs are printed with values


def test_cases_are_fixed_and_reach_the_edges() -> None:
    """The cases are deterministic and cover what the book insists on: ragged tiles, N smaller than a tile,
    N_q ≠ N_k with causal, fully masked rows, extreme logits."""
    exercise = exercises.EXERCISES["6.2"]
    cases = exercises._cases(exercise)
    assert cases == exercises._cases(exercise)
    assert any(c["N_k"] % c["B_c"] and c["N_k"] > c["B_c"] for c in cases)           # a ragged last tile
    assert any(c["B_c"] > c["N_k"] for c in cases)                                  # one tile, wider than N_k
    assert any(c["mask"] == "causal" and c["N_q"] > c["N_k"] for c in cases)        # fully masked rows
    assert any(c["mask"] == "causal" and c["N_q"] < c["N_k"] for c in cases)
    assert any(c["logits"] == "large" for c in cases) and any(c["mask"] == "random" for c in cases)
    assert {c["N_q"] for c in cases} - {1, 2, 4, 8}                                 # not only powers of two


def test_catalogue_hint_and_errors() -> None:
    catalogue = exercises.list_exercises()
    assert [e.id for e in catalogue] == list(exercises.EXERCISES)
    assert all(e.id in repr(catalogue) and e.title in repr(catalogue) for e in catalogue)
    assert [e.id for e in exercises.list_exercises(2)] == ["2.2", "2.3"]
    assert [e.id for e in exercises.list_exercises(9)] == ["9.2", "9.3", "9.4"]
    assert [e.id for e in exercises.list_exercises(14)] == ["14.1", "14.2", "14.3"]
    text = exercises.hint("6.2")
    assert "fa2_update(O_tilde, l, m, S_ij, V_j)" in text and "erratum 4" in text and repr(text) == str(text)
    with pytest.raises(ValueError, match="exercise must be one of 1.3, 2.2"):
        exercises.check("6.9", fa2_in_place)
    with pytest.raises(TypeError, match="fn must be your function for exercise 6.2"):
        exercises.check("6.2", 42)


def test_every_checker_is_used_in_its_chapter() -> None:
    """Each checked exercise has a try cell in the chapter of its number that calls exercises.check on it."""
    for exercise_id in exercises.EXERCISES:
        chapter = next(CHAPTERS.glob(f"{int(exercise_id.split('.')[0]):02d}_*.md"))
        text = chapter.read_text(encoding="utf-8")
        assert re.search(rf"\*\*Exercise {re.escape(exercise_id)}\.\*\*", text), (exercise_id, chapter.name)
        assert f'exercises.check("{exercise_id}",' in text, (exercise_id, chapter.name)


def test_fragment_layouts_match_the_kernels() -> None:
    """Exercises 14.1-14.3's ground truth writes the PTX layouts out on its own (fa2edu never imports kernels_gpu);
    they equal kernels_gpu's tables, which the GPU tests check against the hardware."""
    fragments = pytest.importorskip("kernels_gpu.fragments")
    S = np.random.default_rng(3).standard_normal((16, 16))
    assert np.array_equal(exercises._a_fragments(S), fragments.a_fragments(S))
    assert np.array_equal(exercises._b_fragments(S[:, 8:]), fragments.b_fragments(S[:, 8:]))
    assert np.array_equal(exercises._c_fragments(S[:, 8:]), fragments.c_fragments(S[:, 8:]))
    for name, layout in (("A", fragments.a_layout()), ("B", fragments.b_layout()), ("C", fragments.c_layout())):
        assert np.array_equal(exercises._fragment_layout(name), layout), name


def test_solution_kernel_is_a_kernel() -> None:
    """9.2's worked solution is a numba.cuda kernel (launched in the simulator here), not a Python function."""
    kernel = exercises.solution("9.2")
    S = np.array([[0.5, -np.inf, 2.0], [-np.inf, -np.inf, -np.inf]], dtype=np.float32)
    m, l = np.zeros(2, np.float32), np.zeros(2, np.float32)
    kernel[1, 4](S, m, l)
    assert m[0] == 2.0 and np.isclose(l[0], 1 + np.exp(-1.5)) and np.isneginf(m[1]) and l[1] == 0.0
    assert isinstance(exercises.solution("2.2")(Stats(np.zeros(1), np.ones(1)), Stats(np.zeros(1), np.ones(1))),
                      Stats)


# -- the fixes: exact differences, shrinking that keeps the failure, any exception of the reader's code ------------

def test_off_by_is_exact() -> None:
    """A non-integer count is reported with its exact difference: off by -4.5, never a rounded -4."""
    right = exercises.solution("1.3")
    result = exercises.check("1.3", lambda N_q, N_k, d: (right(N_q, N_k, d)[0] - 4.5, right(N_q, N_k, d)[1]),
                             verbose=False)
    assert "reads: expected 5, got 0.5 (off by -4.5)" in result.report, result.report
    assert exercises._exact(-4.0, "+") == "-4" and exercises._exact(1234567.5, "+") == "+1,234,567.5"
    assert exercises._exact(float("inf"), "+") == "+inf" and exercises._exact(float("nan")) == "nan"


def test_merge_states_overflow_is_not_shrunk_to_an_empty_side() -> None:
    """13.2: an overflowing merge fails on rows where both sides saw keys; the shrunk case keeps both sides, and
    the note describes the wrong row (no note about empty sides that are not there)."""
    result = exercises.check("13.2", merge_states_overflowing, verbose=False)
    case = result.failure.case
    assert 0 < case["split"] < case["N_k"], result.report
    assert "row 0, the first wrong one: side a saw keys (L_a = " in flat(result.report)
    assert "saw no key" not in result.report, result.report
    empty = exercises.check("13.2", merge_states_logaddexp, verbose=False)       # this one needs an empty side
    assert "side b saw no key (O_b = 0, L_b = +inf)" in flat(empty.report), empty.report


class _BadArray:
    """What a reader's function might return: an object whose conversion to an array raises."""

    def __init__(self, error: BaseException):
        self.error = error

    def __array__(self, dtype=None, copy=None):
        raise self.error


def test_any_exception_of_the_reader_is_a_failure_of_the_case() -> None:
    """ZeroDivisionError from __array__ (not only TypeError/ValueError/RuntimeError) is reported, named, with its
    line; so is one from __float__ or __len__."""
    right = exercises.solution("6.2")

    def fa2_update(O, l, m, S, V):
        _, l, m = right(O, l, m, S, V)
        return _BadArray(ZeroDivisionError("division by zero in __array__")), l, m

    result = exercises.check("6.2", fa2_update, verbose=False)
    assert not result and result.attempted
    assert "O_tilde: what came back (_BadArray) is not an array of numbers: converting it raised " \
           "ZeroDivisionError: division by zero in __array__" in flat(result.report), result.report
    assert "raise self.error" in result.report                            # the line that raised

    class Count:
        def __float__(self):
            raise ZeroDivisionError("no count")

    count = exercises.check("10.1", lambda record: Count(), verbose=False)
    assert "float() of it raised ZeroDivisionError: no count" in flat(count.report), count.report

    class Pair(tuple):
        def __len__(self):
            raise LookupError("no length")

    pair = exercises.check("6.2", lambda O, l, m, S, V: Pair((O, l, m)), verbose=False)
    assert "checking what your function returned raised LookupError: no length" in flat(pair.report), pair.report


def test_sys_exit_is_reported_and_does_not_stop_the_check() -> None:
    """sys.exit in the reader's function, or in its result's __array__, is a failure of that case."""
    import sys

    def online_softmax(x, block):
        sys.exit(3)

    result = exercises.check("2.3", online_softmax, verbose=False)
    assert not result and result.attempted
    assert "your function raised SystemExit (3): sys.exit() stops the whole program" in flat(result.report)
    assert "sys.exit(3)" in result.report                                 # the reader's line
    right = exercises.solution("6.2")
    inside = exercises.check("6.2", lambda O, l, m, S, V: (_BadArray(SystemExit(0)), *right(O, l, m, S, V)[1:]),
                             verbose=False)
    assert "converting it raised SystemExit (0)" in flat(inside.report), inside.report


def test_keyboard_interrupt_still_stops_the_check() -> None:
    def fa2_update(O, l, m, S, V):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        exercises.check("6.2", fa2_update, verbose=False)


def test_show_solution_prints_readable_code(capsys) -> None:
    """show_solution prints the worked solution's source under the name the exercise asks for, within the page
    (96 characters), for every exercise — the kernel ones with their @cuda.jit line."""
    exercises.show_solution("6.2")
    text = capsys.readouterr().out
    assert text.startswith("# Exercise 6.2: FA2 Algorithm 1 lines 9-10")
    assert "def fa2_update(O_tilde, l, m, S_ij, V_j):" in text and "_solution" not in text
    assert "erratum 4" in text and "return alpha[:, None] * O_tilde + P_tilde @ V_j, l_new, m_new" in text
    exercises.show_solution("9.4")
    kernel = capsys.readouterr().out
    assert "@cuda.jit(device=True)\ndef tile_kind(row0, row1, col0, col1, N_q, N_k):" in kernel
    assert "return SKIP" in kernel
    for exercise_id in exercises.EXERCISES:
        exercises.show_solution(exercise_id)
        lines = capsys.readouterr().out.splitlines()
        name = re.search(r"(?:^|\s)(\w+)\(", exercises.EXERCISES[exercise_id].signature).group(1)
        assert any(line.startswith(f"def {name}(") for line in lines), (exercise_id, name)
        assert max(map(len, lines)) <= 96, (exercise_id, max(lines, key=len))
    assert exercises.solution("6.2") is exercises._solution_fa2_update          # solution() stays a function
