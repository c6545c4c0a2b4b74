"""The papers' errata, checked numerically: the printed formula against the corrected one, on random blocks.

The FA1 (arXiv 2205.14135) and FA2 (arXiv 2307.08691) texts carry thirteen known errata, numbered 1-13 as in
the papers' list that chapter 11 follows. Eleven of them say something a computer can check; the other two,
11 and 13, keep their numbers but have no function here (:data:`UNCHECKED` says why), so :data:`ERRATA` and
:func:`check_all` go 1-10, 12. For each checkable erratum, a function here evaluates the formula
**as printed** and **as corrected** on random data, and the quantity both are meant to equal (the float64 oracle
of :mod:`fa2edu.reference`, an exact softmax, an executed
HBM ledger or FLOP count). It returns an :class:`Erratum` that knows both errors, so a chapter can show
"printed: wrong, corrected: right", and ``tests/test_errata.py`` proves it for every erratum.

==  ============================  ===========================================================================
#   where                         what is wrong
==  ============================  ===========================================================================
1   FA2 §2.2                      ``dK = Q dSᵀ`` should be ``dK = dSᵀ Q``
2   FA2 §2.3.1                    two-block O⁽²⁾: an inverse too many and the max-correction e^{m⁽¹⁾−m⁽²⁾} missing
3   FA2 §3.1.1, tweak 1           Õ⁽²⁾ should rescale the *un-scaled* Õ⁽¹⁾ by e^{m⁽¹⁾−m⁽²⁾}, not divide O⁽¹⁾ by ℓ⁽¹⁾
4   FA2 Alg. 1 line 10            ``diag(e^{m_old − m_new})⁻¹``: the inverse scales the old accumulator *up*
5   FA2 Alg. 2 line 4             ``D ∈ R^d`` should be ``D ∈ R^N`` (one entry per row)
6   FA2 §3.1.1, causal            the blocks "that need no mask" are the ones that are fully masked
7   FA2 footnote 2                the scale is 1/√d, not 1/d
8   FA2 §2.3.1                    ``diag(ℓ)⁻¹ e^{S1−m}V1 + e^{S2−m}V2`` is missing parentheses around the sum
9   FA2 Alg. 2 line 9             loads O_i (unneeded) and dQ_i (loaded again at line 15): redundant traffic
10  FA1 Appendix B.4              the backward pass is O(N²d) FLOPs, not O(N²)
11  FA2 §4.2                      "1.3× compared to FlashAttention-2" means FlashAttention (not computed)
12  FA1 App. B vs FA2             L_i = Σ_j e^{S_ij} (a sum) is not FA2's L = m + log ℓ (a log-sum-exp)
13  lecture deck, FA1 Alg. 1      m split into T_c blocks of B_c; it is T_r blocks of B_r (not computed)
==  ============================  ===========================================================================

11 is a sentence about a speed-up and 13 a slip in a lecture deck's copy of an algorithm, not in the papers'
formulas: there is no printed formula to evaluate (chapter 11 shows 13 by the shapes it gets wrong).

Conventions: the papers' §2-§3 formulas omit the softmax scale, so blocks here use τ = 1 unless the erratum is about
τ; S blocks are (B_r, B_c), V blocks (B_c, d).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fa2edu.blocks import num_blocks
from fa2edu.flash1 import flash1_backward, flash1_forward
from fa2edu.flash2 import flash2_backward, flash2_forward
from fa2edu.io import closed_form
from fa2edu.masks import causal_mask
from fa2edu.memory import HBM, FlopCounter
from fa2edu.reference import attention_reference, attention_reference_backward
from fa2edu.softmax import safe_softmax

__all__ = ["Erratum", "ERRATA", "UNCHECKED", "check_all", "errata_table", "distance"] + [
    "erratum_1_dK", "erratum_2_two_block_output", "erratum_3_tweak_1", "erratum_4_line_10_inverse",
    "erratum_5_D_shape", "erratum_6_causal_blocks", "erratum_7_scale", "erratum_8_parentheses",
    "erratum_9_redundant_loads", "erratum_10_backward_flops", "erratum_12_L_sum_vs_logsumexp"]


def distance(value, expected) -> float:
    """Relative max-norm distance ``max|value − expected| / max(1, max|expected|)``; ``inf`` when the shapes differ
    or ``value`` has NaN or inf where ``expected`` is finite (a formula that cannot even be evaluated is wrong)."""
    value = np.asarray(value, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if value.shape != expected.shape or not np.isfinite(value).all():
        return float("inf")
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    return float(np.max(np.abs(value - expected), initial=0.0)) / scale


@dataclass(frozen=True)
class Erratum:
    """One erratum, evaluated: the printed formula's result, the corrected one's, and what both should equal.

    ``tolerance`` is the relative max-norm distance (:func:`distance`) within which a result counts as right:
    1e-10 for float64 identities, wider for statistical or asymptotic claims, 0 for exact counts.
    """

    number: int
    where: str
    printed_formula: str
    corrected_formula: str
    printed: Any
    corrected: Any
    expected: Any
    measure: str                          # what the three values are
    tolerance: float = 1e-10
    notes: dict = field(default_factory=dict)

    @property
    def printed_error(self) -> float:
        return distance(self.printed, self.expected)

    @property
    def corrected_error(self) -> float:
        return distance(self.corrected, self.expected)

    @property
    def printed_is_right(self) -> bool:
        return self.printed_error <= self.tolerance

    @property
    def corrected_is_right(self) -> bool:
        return self.corrected_error <= self.tolerance

    def __str__(self) -> str:
        def verdict(err: float, ok: bool) -> str:
            return f"error {err:.2e} ({'right' if ok else 'WRONG'})"
        return (f"Erratum {self.number} ({self.where}): {self.measure}\n"
                f"  printed:   {self.printed_formula}  → {verdict(self.printed_error, self.printed_is_right)}\n"
                f"  corrected: {self.corrected_formula}  → "
                f"{verdict(self.corrected_error, self.corrected_is_right)}")


# -- shared pieces ----------------------------------------------------------------------------------------------------

def _two_blocks(seed: int, B_r: int = 4, B_c: int = 5, d: int = 3):
    """Random S⁽¹⁾, S⁽²⁾ (B_r, B_c) and V⁽¹⁾, V⁽²⁾ (B_c, d); S⁽²⁾ shifted up so that the row maxima change."""
    rng = np.random.default_rng(seed)
    S1 = rng.standard_normal((B_r, B_c))
    S2 = rng.standard_normal((B_r, B_c)) + 1.0
    V1, V2 = rng.standard_normal((B_c, d)), rng.standard_normal((B_c, d))
    return S1, S2, V1, V2


def _exact_output(S1, S2, V1, V2) -> np.ndarray:
    """softmax([S⁽¹⁾ S⁽²⁾]) [V⁽¹⁾; V⁽²⁾], all at once (FA2 §2.3.1's "standard softmax")."""
    return safe_softmax(np.concatenate([S1, S2], axis=1)) @ np.concatenate([V1, V2], axis=0)


def _row_stats(S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = S.max(axis=1)
    return m, np.exp(S - m[:, None]).sum(axis=1)


# -- the errata -------------------------------------------------------------------------------------------------------

def erratum_1_dK(seed: int = 0, N: int = 6) -> Erratum:
    """FA2 §2.2 prints ``dK = Q dSᵀ``; the chain rule for S = QKᵀ gives ``dK = dSᵀ Q``.

    Q dSᵀ is (N, d)·(N, N): it does not even conform unless d = N, so the blocks here are square (d = N) to let
    the printed formula produce a number at all. Expected: the oracle's dK (τ = 1, as §2.2 omits the scale).
    """
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal((N, N)) for _ in range(4))
    P = safe_softmax(Q @ K.T)
    dP = dO @ V.T
    dS = P * (dP - (P * dP).sum(axis=1, keepdims=True))         # dsoftmax, FA2 §2.2
    expected = attention_reference_backward(Q, K, V, dO, scale=1.0).dK
    return Erratum(1, "FA2 §2.2", "dK = Q dSᵀ", "dK = dSᵀ Q", Q @ dS.T, dS.T @ Q, expected,
                   "the gradient dK (N × d) against the oracle",
                   notes={"why": "for Y = A Xᵀ, dX = dYᵀ A; here S = Q Kᵀ, so dK = dSᵀ Q",
                          "non_square": "with N ≠ d, Q dSᵀ multiplies (N, d) by (N, N) and fails to conform"})


def erratum_2_two_block_output(seed: int = 0) -> Erratum:
    """FA2 §2.3.1's two-block online softmax prints ``O⁽²⁾ = diag(ℓ⁽¹⁾/ℓ⁽²⁾)⁻¹ O⁽¹⁾ + P̃⁽²⁾V⁽²⁾``.

    O⁽¹⁾ = diag(ℓ⁽¹⁾)⁻¹ e^{S⁽¹⁾−m⁽¹⁾} V⁽¹⁾ is normalised by block 1's sum at block 1's max; to re-express it at the new
    max m⁽²⁾ with the new sum ℓ⁽²⁾ it must be multiplied by ℓ⁽¹⁾/ℓ⁽²⁾ (no inverse) **and** by e^{m⁽¹⁾−m⁽²⁾}.
    """
    S1, S2, V1, V2 = _two_blocks(seed)
    m1, l1 = _row_stats(S1)
    O1 = np.exp(S1 - m1[:, None]) @ V1 / l1[:, None]
    m2 = np.maximum(m1, S2.max(axis=1))
    l2 = np.exp(m1 - m2) * l1 + np.exp(S2 - m2[:, None]).sum(axis=1)
    P2 = np.exp(S2 - m2[:, None]) / l2[:, None]
    printed = (l2 / l1)[:, None] * O1 + P2 @ V2                    # diag(ℓ1/ℓ2)⁻¹ O1 + P̃2 V2
    corrected = ((l1 / l2) * np.exp(m1 - m2))[:, None] * O1 + P2 @ V2
    return Erratum(2, "FA2 §2.3.1", "O⁽²⁾ = diag(ℓ⁽¹⁾/ℓ⁽²⁾)⁻¹ O⁽¹⁾ + P̃⁽²⁾V⁽²⁾",
                   "O⁽²⁾ = diag(ℓ⁽¹⁾/ℓ⁽²⁾) diag(e^{m⁽¹⁾−m⁽²⁾}) O⁽¹⁾ + P̃⁽²⁾V⁽²⁾", printed, corrected,
                   _exact_output(S1, S2, V1, V2), "the output of two key blocks against softmax([S1 S2])[V1; V2]")


def erratum_3_tweak_1(seed: int = 0) -> Erratum:
    """FA2 §3.1.1 tweak 1 prints ``Õ⁽²⁾ = diag(ℓ⁽¹⁾)⁻¹ O⁽¹⁾ + e^{S⁽²⁾−m⁽²⁾}V⁽²⁾``.

    The un-scaled accumulator is Õ = e^{S−m} V summed over the blocks seen, at the current max m. From
    Õ⁽¹⁾ = e^{S⁽¹⁾−m⁽¹⁾}V⁽¹⁾ it takes the max-correction ``diag(e^{m⁽¹⁾−m⁽²⁾}) Õ⁽¹⁾``; no division by ℓ anywhere.
    Expected: e^{S⁽¹⁾−m⁽²⁾}V⁽¹⁾ + e^{S⁽²⁾−m⁽²⁾}V⁽²⁾ computed directly.
    """
    S1, S2, V1, V2 = _two_blocks(seed)
    m1, l1 = _row_stats(S1)
    O1_tilde = np.exp(S1 - m1[:, None]) @ V1                     # un-scaled
    O1 = O1_tilde / l1[:, None]                                   # §2.3's normalised O⁽¹⁾, the printed symbol
    m2 = np.maximum(m1, S2.max(axis=1))
    new_part = np.exp(S2 - m2[:, None]) @ V2
    printed = O1 / l1[:, None] + new_part
    corrected = np.exp(m1 - m2)[:, None] * O1_tilde + new_part
    expected = np.exp(S1 - m2[:, None]) @ V1 + new_part
    return Erratum(3, "FA2 §3.1.1 tweak 1", "Õ⁽²⁾ = diag(ℓ⁽¹⁾)⁻¹ O⁽¹⁾ + e^{S⁽²⁾−m⁽²⁾}V⁽²⁾",
                   "Õ⁽²⁾ = diag(e^{m⁽¹⁾−m⁽²⁾}) Õ⁽¹⁾ + e^{S⁽²⁾−m⁽²⁾}V⁽²⁾", printed, corrected, expected,
                   "the un-scaled accumulator Õ⁽²⁾ against e^{[S1 S2]−m⁽²⁾}[V1; V2]")


def erratum_4_line_10_inverse(seed: int = 0, N: int = 8, N_k: int = 20, d: int = 4,
                              B_c: int = 5) -> Erratum:
    """FA2 Algorithm 1 line 10 prints ``Õ_i^(j) = diag(e^{m^(j−1) − m^(j)})⁻¹ Õ_i^(j−1) + P̃_i^(j) V_j``.

    Since m^(j) ≥ m^(j−1), the factor e^{m^(j−1) − m^(j)} ≤ 1 scales the old accumulator *down* to the new max;
    its inverse scales it up. Taken literally at j = 1 (m^(0) = −inf) the inverse is e^{+inf}·0 = NaN; here the loop
    starts exactly at block 1 and applies the printed update from block 2 on, so it yields finite, wrong numbers.
    Expected: the oracle's O for one row block against all T_c key blocks (τ = 1).
    """
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((N, d))
    K, V = rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d))
    # Later key blocks are stretched so that the running maxima really move.
    K = K * (1.0 + np.arange(N_k) // B_c)[:, None] * 0.5

    def run(inverse: bool) -> np.ndarray:
        S = Q @ K[:B_c].T
        m = S.max(axis=1)
        O_tilde = np.exp(S - m[:, None]) @ V[:B_c]
        l = np.exp(S - m[:, None]).sum(axis=1)
        for start in range(B_c, N_k, B_c):
            S = Q @ K[start:start + B_c].T
            m_new = np.maximum(m, S.max(axis=1))
            P = np.exp(S - m_new[:, None])
            alpha = np.exp(m - m_new)
            l = alpha * l + P.sum(axis=1)
            factor = 1.0 / alpha if inverse else alpha
            O_tilde = factor[:, None] * O_tilde + P @ V[start:start + B_c]
            m = m_new
        return O_tilde / l[:, None]                               # Alg. 1 line 12

    expected = attention_reference(Q, K, V, scale=1.0).O
    return Erratum(4, "FA2 Alg. 1 line 10",
                   "Õ^(j) = diag(e^{m^(j−1) − m^(j)})⁻¹ Õ^(j−1) + P̃^(j) V_j",
                   "Õ^(j) = diag(e^{m^(j−1) − m^(j)}) Õ^(j−1) + P̃^(j) V_j",
                   run(True), run(False), expected,
                   f"the output O of one row block after T_c = {num_blocks(N_k, B_c)} key "
                   "blocks, against the oracle",
                   notes={"literal_first_step": "with m^(0) = −inf the printed factor is "
                                               "e^{+inf}, and e^{+inf}·0 = NaN"})


def erratum_5_D_shape(seed: int = 0, N: int = 7, d: int = 3) -> Erratum:
    """FA2 Algorithm 2 line 4 prints ``D = rowsum(dO ∘ O) ∈ R^d``; a row sum of an (N, d) matrix is in R^N.

    "Printed" here is the only R^d vector the formula could mean, the column sums; it has the wrong shape for the
    dS = P ∘ (dP − D) broadcast of line 14. Expected: D_i = Σ_j P_ij dP_ij, the quantity line 14 needs.
    """
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    P = safe_softmax(Q @ K.T / np.sqrt(d))
    O = P @ V
    expected = (P * (dO @ V.T)).sum(axis=1)                        # rowsum(P ∘ dP), shape (N,)
    return Erratum(5, "FA2 Alg. 2 line 4", "D = rowsum(dO ∘ O) ∈ R^d", "D = rowsum(dO ∘ O) ∈ R^N",
                   (dO * O).sum(axis=0), (dO * O).sum(axis=1), expected,
                   "D, the vector that dS = P ∘ (dP − D) subtracts row by row, against rowsum(P ∘ dP)")


def _causal_rule_output(Q, K, V, B: int, needs_no_mask: Callable[[slice, slice], bool]) -> np.ndarray:
    """Causal attention where the blocks ``needs_no_mask`` approves are computed without the causal mask."""
    N = Q.shape[0]
    visible = causal_mask(N, N)
    for r0 in range(0, N, B):
        for c0 in range(0, N, B):
            rows, cols = slice(r0, min(r0 + B, N)), slice(c0, min(c0 + B, N))
            if needs_no_mask(rows, cols):
                visible[rows, cols] = True
    S = np.where(visible, Q @ K.T / np.sqrt(Q.shape[1]), -np.inf)
    return safe_softmax(S) @ V


def erratum_6_causal_blocks(seed: int = 0, N: int = 12, d: int = 4, B: int = 4) -> Erratum:
    """FA2 §3.1.1 says no mask is needed "for blocks whose row indices are guaranteed to be strictly less than the
    column indices". Those blocks are entirely above the diagonal: every entry is masked, so they are *skipped*.
    The mask is unneeded where every row index is ≥ every column index (entirely below the diagonal).

    Both readings are applied to a causal attention computed block by block: blocks a rule calls "no mask needed"
    are computed unmasked. Expected: the causal oracle. (``fa2edu.masks.classify_block`` implements the correction.)
    """
    rng = np.random.default_rng(seed)
    Q, K, V = (rng.standard_normal((N, d)) for _ in range(3))
    printed = _causal_rule_output(Q, K, V, B, lambda rows, cols: rows.stop - 1 < cols.start)
    corrected = _causal_rule_output(Q, K, V, B, lambda rows, cols: rows.start >= cols.stop - 1)
    return Erratum(6, "FA2 §3.1.1 causal masking", "no mask where every row index < every column index",
                   "no mask where every row index ≥ every column index (row < column: skip the block)",
                   printed, corrected, attention_reference(Q, K, V, causal=True).O,
                   "causal attention with the unmasked blocks chosen by the rule, against the causal oracle")


def erratum_7_scale(seed: int = 0, N: int = 512, d: int = 256) -> Erratum:
    """FA2 footnote 2 says QKᵀ is "typically" scaled by 1/d; it is 1/√d (Vaswani et al., and every flash-attn).

    The reason for the scale, measured: for q, k with independent unit-variance entries, q·k has variance d, so
    τ = 1/√d gives scores of unit variance whatever d; τ = 1/d gives variance 1/d, and the softmax flattens towards
    uniform as d grows. Expected: variance 1 (within sampling error, tolerance 5%).
    """
    rng = np.random.default_rng(seed)
    Q, K = rng.standard_normal((N, d)), rng.standard_normal((N, d))
    scores = Q @ K.T
    return Erratum(7, "FA2 footnote 2", "τ = 1/d", "τ = 1/√d", float(np.var(scores / d)),
                   float(np.var(scores / np.sqrt(d))), 1.0,
                   f"the variance of the scores τ·q·k at d = {d} (it should be 1, independent of d)",
                   tolerance=0.05)


def erratum_8_parentheses(seed: int = 0) -> Erratum:
    """FA2 §2.3.1 prints ``O = diag(ℓ)⁻¹ e^{S⁽¹⁾−m}V⁽¹⁾ + e^{S⁽²⁾−m}V⁽²⁾``: only the first block is normalised.
    The normalisation applies to the whole sum: ``diag(ℓ)⁻¹ (e^{S⁽¹⁾−m}V⁽¹⁾ + e^{S⁽²⁾−m}V⁽²⁾)``."""
    S1, S2, V1, V2 = _two_blocks(seed)
    m = np.maximum(S1.max(axis=1), S2.max(axis=1))
    E1, E2 = np.exp(S1 - m[:, None]), np.exp(S2 - m[:, None])
    l = E1.sum(axis=1) + E2.sum(axis=1)
    printed = (E1 @ V1) / l[:, None] + E2 @ V2
    corrected = (E1 @ V1 + E2 @ V2) / l[:, None]
    return Erratum(8, "FA2 §2.3.1", "O = diag(ℓ)⁻¹ e^{S1−m}V1 + e^{S2−m}V2", "O = diag(ℓ)⁻¹ (e^{S1−m}V1 + e^{S2−m}V2)",
                   printed, corrected, _exact_output(S1, S2, V1, V2),
                   "the output of two key blocks against softmax([S1 S2])[V1; V2]")


def erratum_9_redundant_loads(seed: int = 0, N: int = 40, d: int = 4, M: int = 64) -> Erratum:
    """FA2 Algorithm 2 line 9 loads O_i and dQ_i besides Q_i, dO_i, L_i, D_i. O_i is not used once D is precomputed
    (line 4); dQ_i is loaded again at line 15, where it is updated. The loads change no number, only the traffic.

    Both versions of :func:`fa2edu.flash2.flash2_backward` run on one random problem; compared are their HBM reads
    with the minimal count of the conventions' table (:func:`fa2edu.io.closed_form`). ``notes`` records that their
    gradients are identical and the extra reads, 2·T_c·N·d.
    """
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    fwd = flash2_forward(Q, K, V, M=M)
    ledgers, grads = {}, {}
    for redundant in (True, False):
        hbm = HBM()
        grads[redundant] = flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=M, redundant_loads=redundant, hbm=hbm)
        ledgers[redundant] = hbm
    B_r, B_c = ledgers[False].block_sizes
    reads, _ = closed_form("flash2", "backward", N, d, B_r, B_c)
    identical = all(np.array_equal(a, b) for a, b in zip(grads[True], grads[False]))
    return Erratum(9, "FA2 Alg. 2 line 9", "load Q_i, O_i, dO_i, dQ_i, L_i, D_i (and dQ_i again at line 15)",
                   "load Q_i, dO_i, L_i, D_i (dQ_i only at line 15)", ledgers[True].reads, ledgers[False].reads,
                   reads, "HBM reads of the backward pass against 4Nd + T_c(3Nd + 2N) (exact counts)", tolerance=0.0,
                   notes={"gradients_identical": identical, "extra_reads": ledgers[True].reads - ledgers[False].reads,
                          "T_c": num_blocks(N, B_c), "block_sizes": (B_r, B_c)})


def erratum_10_backward_flops(seed: int = 0, N: int = 64, dims=(8, 16, 32, 64), block_sizes=(16, 16)) -> Erratum:
    """FA1 Appendix B.4 says the backward pass "requires O(N²) FLOPs"; like the forward pass it is O(N²d).

    FA1 Alg. 4's FLOPs are counted by execution at fixed N for several d, and the exponent of d is fitted on a log-log
    scale. The printed claim predicts exponent 0, the correction exponent 1; the measured one is just under 1 (the
    O(N²) non-matmul work weighs a little at small d). Tolerance 0.1.
    """
    rng = np.random.default_rng(seed)
    totals = []
    for d in dims:
        Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
        fwd = flash1_forward(Q, K, V, block_sizes=block_sizes)
        counter = FlopCounter()
        flash1_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, block_sizes=block_sizes, flops=counter)
        totals.append(counter.total)
    slope = float(np.polyfit(np.log(dims), np.log(totals), 1)[0])
    return Erratum(10, "FA1 Appendix B.4", "backward FLOPs O(N²): exponent of d = 0",
                   "backward FLOPs O(N²d): exponent of d = 1", 0.0, 1.0, slope,
                   f"the exponent of d in FA1 Alg. 4's executed FLOP count at N = {N}, d in {tuple(dims)}",
                   tolerance=0.1, notes={"flops": dict(zip(dims, totals))})


def erratum_12_L_sum_vs_logsumexp(seed: int = 0, B_r: int = 5, N_k: int = 9) -> Erratum:
    """FA1 Appendix B writes L_i = Σ_j e^{S_ij} (a sum of exponentials); FA2 writes L = m + log ℓ (a log-sum-exp).

    FA2's backward rebuilds P = exp(S − L) from its L. Fed FA1's L (the sum) instead, the same formula is wrong; with
    FA2's L it is exact. (FA1's sum itself overflows for logits above ~709 in float64; m + log ℓ never does.)
    Expected: softmax(S).
    """
    rng = np.random.default_rng(seed)
    S = rng.standard_normal((B_r, N_k)) * 2.0
    L_sum = np.exp(S).sum(axis=1)                                  # FA1 App. B's L_i
    m, l = _row_stats(S)
    L_lse = m + np.log(l)                                          # FA2's L_i
    return Erratum(12, "FA1 Appendix B vs FA2 Alg. 1-2", "P = exp(S − L) with L_i = Σ_j e^{S_ij}",
                   "P = exp(S − L) with L_i = m_i + log ℓ_i", np.exp(S - L_sum[:, None]),
                   np.exp(S - L_lse[:, None]), safe_softmax(S), "the probabilities P against softmax(S)",
                   notes={"relation": "L_lse = log(L_sum): the names collide, the quantities differ"})


#: The errata with nothing to compute, by number: (where, what is wrong, why no function checks it). They keep
#: their numbers so that 1-13 mean the same erratum everywhere (the papers' list, chapter 11, this module).
UNCHECKED: dict[int, tuple[str, str, str]] = {
    11: ("FA2 §4.2", "\"1.3× speedup compared to FlashAttention-2\" means compared to FlashAttention (1)",
         "a sentence about a speed-up, no formula"),
    13: ("lecture deck, FA1 Alg. 1", "m divided into T_c blocks of size B_c; it is T_r blocks of size B_r",
         "a lecture deck's slip (chapter 11 checks its shapes)"),
}

#: Every checkable erratum, by its number in chapter 11's list (11 and 13 are in :data:`UNCHECKED`).
ERRATA: dict[int, Callable[..., Erratum]] = {
    1: erratum_1_dK, 2: erratum_2_two_block_output, 3: erratum_3_tweak_1, 4: erratum_4_line_10_inverse,
    5: erratum_5_D_shape, 6: erratum_6_causal_blocks, 7: erratum_7_scale, 8: erratum_8_parentheses,
    9: erratum_9_redundant_loads, 10: erratum_10_backward_flops, 12: erratum_12_L_sum_vs_logsumexp,
}


def check_all(seed: int = 0) -> list[Erratum]:
    """Every checkable erratum evaluated with ``seed``, in README order."""
    return [ERRATA[number](seed=seed) for number in sorted(ERRATA)]


def errata_table(seed: int = 0) -> str:
    """A text table of all thirteen errata: where, printed error, corrected error (or why there is none)."""
    rows = {e.number: f"{e.where:<32} {e.printed_error:>14.2e} {e.corrected_error:>16.2e}"
            for e in check_all(seed)}
    rows.update({number: f"{where:<32}   not computed: {why}" for number, (where, _, why) in UNCHECKED.items()})
    lines = [f"{'#':>3}  {'where':<32} {'printed error':>14} {'corrected error':>16}"]
    lines += [f"{number:>3}  {rows[number]}" for number in sorted(rows)]
    return "\n".join(lines)
