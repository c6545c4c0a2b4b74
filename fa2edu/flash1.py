"""FlashAttention (FA1): forward (Algorithms 1 and 2), backward (Algorithm 4), block-sparse (Algorithm 5).

FA1 never writes the N_q × N_k matrices S and P to HBM. It tiles Q into T_r blocks of B_r rows and K, V into T_c
blocks of B_c rows, and computes the softmax one tile at a time with the running statistics (m, ℓ) (FA1 Section 3.1):

* The **outer loop runs over K/V blocks j** (Alg. 1 line 5), the inner loop over Q blocks i (line 7). Because every
  row block of O is touched once per j, O_i and its statistics ℓ_i, m_i live in HBM and are read and written back on
  every inner step (lines 8, 12, 13): T_c passes over Q and O. FA2 swaps the loops to avoid exactly this.
* The output is kept **normalised** at every step (line 12): O_i ← diag(ℓ_new)⁻¹(diag(ℓ_i) e^{m_i − m_new} O_i +
  e^{m̃_ij − m_new} P̃_ij V_j), a rescale of O_i by diag(ℓ)⁻¹ per step that FA2's tweak 1 removes.
* Both statistics ℓ and m are saved for the backward pass (FA2 saves only L = m + log ℓ).

Block sizes (Alg. 1 line 1): ``B_c = ceil(M/4d)``, ``B_r = min(ceil(M/4d), d)``
(:func:`fa2edu.blocks.block_sizes_kv_outer`). HBM traffic per (batch, head), N_q = N_k = N, d_v = d, no mask
(exact for ragged N):

================  ===================  ============
pass              HBM reads            HBM writes
================  ===================  ============
forward (Alg 1)   2Nd + T_c(2Nd + 2N)  T_c(Nd + 2N)
backward (Alg 4)  2Nd + T_c(4Nd + 2N)  2Nd + T_c·Nd
================  ===================  ============

The initialisations "O = 0, ℓ = 0, m = −inf in HBM" (Alg. 1 line 2) and "dQ = 0, dK = 0, dV = 0 in HBM" (Alg. 4
line 5) are counted apart, as ``init`` writes. Causal and masked runs skip the (i, j) blocks that no query sees (FA2
Section 3.1's classification): no load, no FLOP. Block-sparse FlashAttention (Alg. 5) skips the zero blocks of a
given block mask in the same place, so its traffic scales with the fraction s of non-zero blocks (Proposition 4).

Fully masked rows end with O = 0, ℓ = 0, m = −inf and zero gradients: the guards are named steps below.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fa2edu.blocks import block_sizes_kv_outer, start_run
from fa2edu.dropout import check_dropout, keep_mask
from fa2edu.masks import BlockKind, check_block_mask, classify_block
from fa2edu.memory import HBM, FlopCounter
from fa2edu.softmax import exp_minus
from fa2edu.validation import cast_output, check_like, guard_overflow, prepare

__all__ = ["Flash1Forward", "Flash1Backward", "flash1_forward", "flash1_backward", "flash1_block_sparse_forward",
           "flash1_block_sparse_backward", "flash1_forward_working_set", "flash1_backward_working_set"]


class Flash1Forward(NamedTuple):
    """FA1 Alg. 1's outputs: O and the softmax statistics that Alg. 4 reads back.

    They relate to FA2's log-sum-exp by L = m + log ℓ; a fully masked row has (ℓ, m) = (0, −inf).

    Attributes
    ----------
    O : ndarray, shape (..., N_q, d_v)
        The attention output, in the inputs' dtype; 0 on a fully masked row.
    l : ndarray, shape (..., N_q)
        The softmax row sums ℓ, in the compute dtype.
    m : ndarray, shape (..., N_q)
        The softmax row maxima m, in the compute dtype.
    """

    O: np.ndarray
    l: np.ndarray  # noqa: E741 (the paper's ℓ)
    m: np.ndarray


class Flash1Backward(NamedTuple):
    """What FA1 Alg. 4 (:func:`flash1_backward`) returns, in the inputs' dtype.

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
    dK: np.ndarray  # (..., N_k, d), summed over each GQA group
    dV: np.ndarray  # (..., N_k, d_v)


def flash1_forward_working_set(B_r: int, B_c: int, d: int, d_v: int | None = None) -> int:
    """Peak on-chip elements of FA1 Alg. 1 for full blocks: K_j, V_j, Q_i, O_i, S_ij (P̃_ij in its place), and the
    row statistics ℓ_i, m_i, m̃_ij, ℓ̃_ij, m_new, ℓ_new."""
    d_v = d if d_v is None else d_v
    return B_c * (d + d_v) + B_r * (d + d_v) + B_r * B_c + 6 * B_r


def flash1_backward_working_set(B_r: int, B_c: int, d: int, d_v: int | None = None) -> int:
    """Peak on-chip elements of FA1 Alg. 4 for full blocks: K_j, V_j and the accumulators d̃K_j, d̃V_j; Q_i, O_i,
    dO_i, dQ_i; P_ij and dS_ij (dP_ij in its place); ℓ_i, m_i, D_i."""
    d_v = d if d_v is None else d_v
    return 2 * B_c * (d + d_v) + 2 * B_r * (d + d_v) + 2 * B_r * B_c + 3 * B_r


# -- shared by the dense and the block-sparse algorithms -----------------------------------------------------------

def _start(algorithm: str, problem, working_set, M, block_sizes, hbm, flops):
    """One run with FA1's K/V-outer block rule (Alg. 1 line 1, Alg. 4 line 2)."""
    d, d_v = problem.d, problem.d_v
    return start_run(algorithm, problem.N_q, problem.N_k, d, M=M, block_sizes=block_sizes,
                     rule=block_sizes_kv_outer, working_set=lambda br, bc: working_set(br, bc, d, d_v),
                     hbm=hbm, flops=flops)


def _classify(problem, rows: slice, cols: slice, i: int, j: int, block_mask: np.ndarray | None):
    """What tile (i, j) of S needs: Alg. 5 line 8 skips a zero block of the block mask; otherwise FA2 Section 3.1's
    classification (skip fully masked blocks, mask straddling ones) with the share of programs that visit it."""
    if block_mask is not None and not block_mask[i, j]:
        return BlockKind.SKIP, 0.0, None
    return classify_block(problem.N_q, problem.N_k, rows, cols, problem.causal, problem.mask)


def _exp_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """e^{a − b} for row statistics, 0 where a = −inf; guarded where b = −inf (a row that has seen no key yet)."""
    return exp_minus(a[..., None], b)[..., 0]


def _dropout_scale(problem, dropout_p: float, seed: int, rows: slice, cols: slice) -> np.ndarray:
    """Z_ij: keep-mask of tile (rows, cols) scaled by 1/(1 − p), a pure function of the seed (FA1 Alg. 4 line 14)."""
    lead = problem.lead
    return keep_mask(seed, dropout_p, lead, lead[1] * lead[2], rows, cols) / (1.0 - dropout_p)


def _check_saved(problem, O, l, m, dO):
    """The forward pass's O, ℓ, m and the incoming gradient dO, checked against Q's shape; in the compute dtype."""
    stats_shape = problem.q_shape[:-1]
    O = check_like(O, "O", stats_shape + (problem.d_v,))
    dO = check_like(dO, "dO", stats_shape + (problem.d_v,))
    l = check_like(l, "l", stats_shape)
    if (l < 0).any():
        raise ValueError("l (the softmax row sums ℓ) must be non-negative")
    m = check_like(m, "m", stats_shape, finite=False)
    if np.isnan(m).any() or np.isposinf(m).any():
        raise ValueError("m (the softmax row maxima) must be finite or −inf (a fully masked row), not NaN or +inf")
    return tuple(problem.to_q_layout(x).astype(problem.dtype, copy=False) for x in (O, l, m, dO))


def _forward(problem, run, block_mask, dropout_p: float, seed: int) -> Flash1Forward:
    """FA1 Algorithm 1 with Alg. 2's τ, MASK and dropout; with ``block_mask``, Algorithm 5."""
    N_q, d, d_v, tau = problem.N_q, problem.d, problem.d_v, problem.scale
    mem, sram, count = run.hbm, run.sram, run.flops
    lead, dtype = problem.lead, problem.dtype
    mem.put("Q", problem.Q)
    mem.put("K", problem.K)
    mem.put("V", problem.V)
    # Alg. 1 line 2: initialise O = (0), ℓ = (0), m = (−inf) in HBM. A row no block ever touches keeps these values.
    mem.allocate("O", lead + (N_q, d_v), 0.0, dtype, line="Alg 1 line 2")
    mem.allocate("l", lead + (N_q,), 0.0, dtype, line="Alg 1 line 2", vector=True)
    mem.allocate("m", lead + (N_q,), -np.inf, dtype, line="Alg 1 line 2", vector=True)

    # Alg. 1 line 5: the outer loop runs over the T_c blocks of K and V.
    for j, cols in enumerate(run.col_tiles):
        c = cols.stop - cols.start
        # Alg. 1 line 6: load K_j, V_j from HBM to on-chip SRAM (once per j; Alg. 5 does so for zero blocks too).
        K_j = sram.hold("K_j", mem.read("K", cols, line="Alg 1 line 6"))                  # (…, B_c, d)
        V_j = sram.hold("V_j", mem.read("V", cols, line="Alg 1 line 6"))                  # (…, B_c, d_v)

        # Alg. 1 line 7: the inner loop runs over the T_r blocks of Q (and O, ℓ, m).
        for i, rows in enumerate(run.row_tiles):
            r = rows.stop - rows.start
            # Alg. 5 line 8 (and FA2 Section 3.1 for causal/masks): a block nobody sees costs nothing at all.
            kind, share, visible = _classify(problem, rows, cols, i, j, block_mask)
            if kind is BlockKind.SKIP:
                continue
            # Alg. 1 line 8: load Q_i, O_i, ℓ_i, m_i from HBM to on-chip SRAM.
            Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 1 line 8", share=share))   # (…, B_r, d)
            O_i = sram.hold("O_i", mem.read("O", rows, line="Alg 1 line 8", share=share))   # (…, B_r, d_v)
            l_i = sram.hold("l_i", mem.read("l", rows, line="Alg 1 line 8", share=share), vector=True)
            m_i = sram.hold("m_i", mem.read("m", rows, line="Alg 1 line 8", share=share), vector=True)

            # Alg. 1 line 9 (Alg. 2 line 10, with the scale τ): S_ij = τ Q_i K_jᵀ.
            S_ij = sram.hold("S_ij", tau * (Q_i @ np.swapaxes(K_j, -1, -2)))                 # (…, B_r, B_c)
            count.add_matmul(r, c, d, line="Alg 1 line 9", share=share)
            count.add_nonmatmul(r * c, line="Alg 1 line 9", share=share)
            if kind is BlockKind.MASK:
                # Alg. 2 line 11: MASK(S_ij), a real −inf; only blocks straddling the diagonal or a padding edge.
                S_ij = np.where(visible, S_ij, -np.inf)
                count.add_nonmatmul(r * c, line="Alg 2 line 11", share=share)

            # Alg. 1 line 10: m̃_ij = rowmax(S_ij), P̃_ij = exp(S_ij − m̃_ij), ℓ̃_ij = rowsum(P̃_ij): this block alone.
            m_tilde = sram.hold("m_tilde", S_ij.max(axis=-1), vector=True)
            # (exp_minus guards m̃_ij = −inf, a row with no visible key in this block: its P̃ row is 0, not NaN.)
            P_ij = sram.hold("S_ij", exp_minus(S_ij, m_tilde))                                 # P̃_ij replaces S_ij
            l_tilde = sram.hold("l_tilde", P_ij.sum(axis=-1), vector=True)
            count.add_nonmatmul(4 * r * c, line="Alg 1 line 10", share=share)

            # Alg. 1 line 11: merge with the running statistics (the (m, ℓ) merge of FA1 Section 3.1):
            # m_new = max(m_i, m̃_ij), ℓ_new = e^{m_i − m_new} ℓ_i + e^{m̃_ij − m_new} ℓ̃_ij.
            m_new = sram.hold("m_new", np.maximum(m_i, m_tilde), vector=True)
            alpha = _exp_diff(m_i, m_new)           # e^{m_i − m_new}: 0 while m_i = −inf (nothing seen yet)
            beta = _exp_diff(m_tilde, m_new)        # e^{m̃_ij − m_new}: 0 where this block's row is fully masked
            l_new = sram.hold("l_new", alpha * l_i + beta * l_tilde, vector=True)
            count.add_nonmatmul(8 * r, line="Alg 1 line 11", share=share)

            if dropout_p > 0.0:
                # Alg. 2 line 14: drop entries of P̃_ij after ℓ̃_ij was taken (ℓ normalises the un-dropped P);
                # the mask is regenerated from the seed, never stored.
                P_ij = P_ij * _dropout_scale(problem, dropout_p, seed, rows, cols)
                count.add_nonmatmul(r * c, line="Alg 2 line 14", share=share)

            # Alg. 1 line 12: O_i ← diag(ℓ_new)⁻¹ (diag(ℓ_i) e^{m_i − m_new} O_i + e^{m̃_ij − m_new} P̃_ij V_j):
            # undo the old normalisation, rescale both parts to the new max, normalise again (every step).
            # Guard ℓ_new = 0 (no key seen yet in this row): the bracket is 0 there, and O_i must stay 0, not 0/0.
            l_new_safe = np.where(l_new == 0.0, 1.0, l_new)
            O_i = ((l_i * alpha)[..., None] * O_i + beta[..., None] * (P_ij @ V_j)) / l_new_safe[..., None]
            count.add_matmul(r, d_v, c, line="Alg 1 line 12", share=share)
            count.add_nonmatmul(4 * r * d_v + r, line="Alg 1 line 12", share=share)
            mem.write("O", rows, O_i, line="Alg 1 line 12", share=share)
            # Alg. 1 line 13: write ℓ_i ← ℓ_new, m_i ← m_new to HBM.
            mem.write("l", rows, l_new, line="Alg 1 line 13", share=share)
            mem.write("m", rows, m_new, line="Alg 1 line 13", share=share)
            sram.free("Q_i", "O_i", "l_i", "m_i", "S_ij", "m_tilde", "l_tilde", "m_new", "l_new")
        sram.free("K_j", "V_j")

    O = cast_output(problem.from_q_layout(mem["O"]), problem.in_dtype, "O")
    return Flash1Forward(O, problem.from_q_layout(mem["l"]), problem.from_q_layout(mem["m"]))


def _backward(problem, run, saved, block_mask, dropout_p: float, seed: int) -> Flash1Backward:
    """FA1 Algorithm 4; with ``block_mask``, its block-sparse version (Alg. 5's skip in Alg. 4's loops)."""
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    mem, sram, count = run.hbm, run.sram, run.flops
    lead, dtype = problem.lead, problem.dtype
    O, l, m, dO = saved
    for name, value in (("Q", problem.Q), ("K", problem.K), ("V", problem.V), ("O", O), ("dO", dO)):
        mem.put(name, value)
    mem.put("l", l, vector=True)
    mem.put("m", m, vector=True)
    # Alg. 4 line 5: initialise dQ = (0), dK = (0), dV = (0) in HBM (dK, dV per query head; the GQA sum comes last).
    mem.allocate("dQ", lead + (N_q, d), 0.0, dtype, line="Alg 4 line 5")
    mem.allocate("dK", lead + (N_k, d), 0.0, dtype, line="Alg 4 line 5")
    mem.allocate("dV", lead + (N_k, d_v), 0.0, dtype, line="Alg 4 line 5")

    # Alg. 4 line 6: the outer loop runs over the T_c blocks of K and V.
    for j, cols in enumerate(run.col_tiles):
        c = cols.stop - cols.start
        # Alg. 4 line 7: load K_j, V_j from HBM to on-chip SRAM.
        K_j = sram.hold("K_j", mem.read("K", cols, line="Alg 4 line 7"))                  # (…, B_c, d)
        V_j = sram.hold("V_j", mem.read("V", cols, line="Alg 4 line 7"))                  # (…, B_c, d_v)
        # Alg. 4 line 8: initialise d̃K_j = (0), d̃V_j = (0) on SRAM; they never leave chip until line 24.
        dK_j = sram.hold("dK_j", np.zeros(lead + (c, d), dtype=dtype))
        dV_j = sram.hold("dV_j", np.zeros(lead + (c, d_v), dtype=dtype))

        # Alg. 4 line 9: the inner loop runs over the T_r blocks of Q.
        for i, rows in enumerate(run.row_tiles):
            r = rows.stop - rows.start
            kind, share, visible = _classify(problem, rows, cols, i, j, block_mask)
            if kind is BlockKind.SKIP:
                continue
            # Alg. 4 line 10: load Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i from HBM to on-chip SRAM.
            Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 4 line 10", share=share))     # (…, B_r, d)
            O_i = sram.hold("O_i", mem.read("O", rows, line="Alg 4 line 10", share=share))     # (…, B_r, d_v)
            dO_i = sram.hold("dO_i", mem.read("dO", rows, line="Alg 4 line 10", share=share))  # (…, B_r, d_v)
            dQ_i = sram.hold("dQ_i", mem.read("dQ", rows, line="Alg 4 line 10", share=share))  # (…, B_r, d)
            l_i = sram.hold("l_i", mem.read("l", rows, line="Alg 4 line 10", share=share), vector=True)
            m_i = sram.hold("m_i", mem.read("m", rows, line="Alg 4 line 10", share=share), vector=True)

            # Alg. 4 line 11: S_ij = τ Q_i K_jᵀ (recomputed: S was never stored).
            S_ij = tau * (Q_i @ np.swapaxes(K_j, -1, -2))                                        # (…, B_r, B_c)
            count.add_matmul(r, c, d, line="Alg 4 line 11", share=share)
            count.add_nonmatmul(r * c, line="Alg 4 line 11", share=share)
            if kind is BlockKind.MASK:
                # Alg. 4 line 12: MASK(S_ij), a real −inf.
                S_ij = np.where(visible, S_ij, -np.inf)
                count.add_nonmatmul(r * c, line="Alg 4 line 12", share=share)
            # Alg. 4 line 13: P_ij = diag(ℓ_i)⁻¹ exp(S_ij − m_i), the forward's probabilities from its statistics.
            # Guard m_i = −inf (exp_minus) and ℓ_i = 0 (divide by 1): a fully masked row gives P_ij = 0.
            l_safe = np.where(l_i == 0.0, 1.0, l_i)
            P_ij = sram.hold("P_ij", exp_minus(S_ij, m_i) / l_safe[..., None])
            count.add_nonmatmul(3 * r * c, line="Alg 4 line 13", share=share)

            # Alg. 4 lines 14-15: regenerate the dropout mask Z_ij from the seed; P_ij^dropped = P_ij ∘ Z_ij.
            Z_ij = _dropout_scale(problem, dropout_p, seed, rows, cols) if dropout_p > 0.0 else None
            P_dropped = P_ij if Z_ij is None else P_ij * Z_ij
            if Z_ij is not None:
                count.add_nonmatmul(r * c, line="Alg 4 line 15", share=share)
            # Alg. 4 line 16: d̃V_j ← d̃V_j + (P_ij^dropped)ᵀ dO_i.
            dV_j = sram.hold("dV_j", dV_j + np.swapaxes(P_dropped, -1, -2) @ dO_i)
            count.add_matmul(c, d_v, r, line="Alg 4 line 16", share=share)
            count.add_nonmatmul(c * d_v, line="Alg 4 line 16", share=share)
            # Alg. 4 line 17: dP_ij^dropped = dO_i V_jᵀ.
            dP_ij = sram.hold("dS_ij", dO_i @ np.swapaxes(V_j, -1, -2))                         # (…, B_r, B_c)
            count.add_matmul(r, c, d_v, line="Alg 4 line 17", share=share)
            if Z_ij is not None:
                # Alg. 4 line 18: dP_ij = dP_ij^dropped ∘ Z_ij (a dropped entry passes no gradient).
                dP_ij = dP_ij * Z_ij
                count.add_nonmatmul(r * c, line="Alg 4 line 18", share=share)
            # Alg. 4 line 19: D_i = rowsum(dO_i ∘ O_i), on chip (recomputed for every j: FA2 precomputes it once).
            D_i = sram.hold("D_i", (dO_i * O_i).sum(axis=-1), vector=True)
            count.add_nonmatmul(2 * r * d_v, line="Alg 4 line 19", share=share)
            # Alg. 4 line 20: dS_ij = P_ij ∘ (dP_ij − D_i).
            dS_ij = sram.hold("dS_ij", P_ij * (dP_ij - D_i[..., None]))                          # dS over dP
            count.add_nonmatmul(2 * r * c, line="Alg 4 line 20", share=share)
            # Alg. 4 line 21: write dQ_i ← dQ_i + τ dS_ij K_j to HBM (read-modify-write on every step).
            dQ_i = dQ_i + tau * (dS_ij @ K_j)
            count.add_matmul(r, d, c, line="Alg 4 line 21", share=share)
            count.add_nonmatmul(2 * r * d, line="Alg 4 line 21", share=share)
            mem.write("dQ", rows, dQ_i, line="Alg 4 line 21", share=share)
            # Alg. 4 line 22: d̃K_j ← d̃K_j + τ dS_ijᵀ Q_i (the correct order; FA2 §2.2's `Q dSᵀ` is erratum 1).
            dK_j = sram.hold("dK_j", dK_j + tau * (np.swapaxes(dS_ij, -1, -2) @ Q_i))
            count.add_matmul(c, d, r, line="Alg 4 line 22", share=share)
            count.add_nonmatmul(2 * c * d, line="Alg 4 line 22", share=share)
            sram.free("Q_i", "O_i", "dO_i", "dQ_i", "l_i", "m_i", "P_ij", "dS_ij", "D_i")

        # Alg. 4 line 24: write dK_j ← d̃K_j, dV_j ← d̃V_j to HBM, once per j.
        mem.write("dK", cols, dK_j, line="Alg 4 line 24")
        mem.write("dV", cols, dV_j, line="Alg 4 line 24")
        sram.free("K_j", "V_j", "dK_j", "dV_j")

    out = problem.in_dtype
    return Flash1Backward(cast_output(problem.from_q_layout(mem["dQ"]), out, "dQ"),
                          cast_output(problem.from_kv_layout(mem["dK"]), out, "dK"),
                          cast_output(problem.from_kv_layout(mem["dV"]), out, "dV"))


# -- the public algorithms ---------------------------------------------------------------------------------------

@guard_overflow
def flash1_forward(Q, K, V, M=None, block_sizes=None, causal=False, scale=None, mask=None, *,
                   dropout_p: float = 0.0, seed: int = 0, hbm: HBM | None = None,
                   flops: FlopCounter | None = None) -> Flash1Forward:
    """FlashAttention forward pass, FA1 Algorithm 1, with Algorithm 2's scale τ, masking and dropout.

    Cost per (batch, head), N_q = N_k = N, no mask: 4N²d matmul FLOPs; HBM reads 2Nd + T_c(2Nd + 2N), writes
    T_c(Nd + 2N), plus N(d + 2) initialisation writes.

    Parameters
    ----------
    Q : ndarray, shape (..., N_q, d)
        Queries, float16, float32 or float64 (float16 and float32 compute in float32), finite. Leading axes are
        batch axes and, with three or more axes, the H_q query heads on the axis before N_q.
    K : ndarray, shape (..., N_k, d)
        Keys in Q's dtype, with Q's batch axes and H_kv heads; H_q must be a multiple of H_kv (GQA/MQA: query head
        h reads K/V head h // (H_q / H_kv)).
    V : ndarray, shape (..., N_k, d_v)
        Values in Q's dtype, with K's leading axes and N_k rows; d_v may differ from d.
    M : int, optional
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by FA1 Alg. 1 line 1,
        ``B_c = ceil(M/4d)``, ``B_r = min(ceil(M/4d), d)``; explicit ``block_sizes`` that need more SRAM than M holds
        raise :class:`~fa2edu.memory.SRAMOverflowError`. Default None: the block sizes of
        :data:`~fa2edu.blocks.DEFAULT_M` (or ``block_sizes``) and an unbounded SRAM that records its peak.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``: rows of Q and rows of K/V per block; N_q and N_k need not be multiples (the last block is
        ragged). Default None: the rule applied to ``M``.
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
    hbm : HBM, optional
        Ledger that records this run: its tensors and every element read or written, per algorithm line, per
        (batch, head); afterwards also ``hbm.sram``, ``hbm.flops`` and ``hbm.block_sizes``. Default None: a fresh
        ledger, discarded.
    flops : FlopCounter, optional
        Counter that this run's FLOPs are added to (matmul and non-matmul, per algorithm line, per (batch, head)).
        Default None: a fresh counter (kept as ``hbm.flops`` when ``hbm`` is given).

    Returns
    -------
    Flash1Forward
        ``(O, l, m)``: O (..., N_q, d_v) in Q's dtype; ℓ and m (..., N_q) in the compute dtype. A fully masked row
        has O = 0 and (ℓ, m) = (0, −inf).
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    run = _start("flash1_forward", problem, flash1_forward_working_set, M, block_sizes, hbm, flops)
    return _forward(problem, run, None, dropout_p, seed)


@guard_overflow
def flash1_backward(Q, K, V, O, l, m, dO, M=None, block_sizes=None, causal=False, scale=None, mask=None, *,
                    dropout_p: float = 0.0, seed: int = 0, hbm: HBM | None = None,
                    flops: FlopCounter | None = None) -> Flash1Backward:
    """FlashAttention backward pass, FA1 Algorithm 4: recompute S and P from (ℓ, m), never read them from HBM.

    With ``dropout_p > 0`` the mask is regenerated from ``seed`` (FA1 Appendix B.4).

    Cost per (batch, head), N_q = N_k = N, no mask: 10N²d matmul FLOPs (five products: S recomputed, dV, dP,
    dQ, dK); HBM reads 2Nd + T_c(4Nd + 2N), writes 2Nd + T_c·Nd, plus 3Nd initialisation writes (dQ, dK, dV).

    Parameters
    ----------
    Q : ndarray, shape (..., N_q, d)
        Queries, float16, float32 or float64 (float16 and float32 compute in float32), finite. Leading axes are
        batch axes and, with three or more axes, the H_q query heads on the axis before N_q.
    K : ndarray, shape (..., N_k, d)
        Keys in Q's dtype, with Q's batch axes and H_kv heads; H_q must be a multiple of H_kv (GQA/MQA: query head
        h reads K/V head h // (H_q / H_kv)).
    V : ndarray, shape (..., N_k, d_v)
        Values in Q's dtype, with K's leading axes and N_k rows; d_v may differ from d.
    O : ndarray, shape (..., N_q, d_v)
        The output of the forward pass, as :func:`flash1_forward` returned it.
    l : ndarray, shape (..., N_q)
        The forward pass's softmax row sums ℓ, non-negative (0 on a fully masked row).
    m : ndarray, shape (..., N_q)
        The forward pass's softmax row maxima m, finite or −inf (a fully masked row).
    dO : ndarray, shape (..., N_q, d_v)
        Gradient of the loss with respect to O, finite.
    M : int, optional
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by FA1 Alg. 1 line 1,
        ``B_c = ceil(M/4d)``, ``B_r = min(ceil(M/4d), d)``; explicit ``block_sizes`` that need more SRAM than M holds
        raise :class:`~fa2edu.memory.SRAMOverflowError`. Default None: the block sizes of
        :data:`~fa2edu.blocks.DEFAULT_M` (or ``block_sizes``) and an unbounded SRAM that records its peak.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``: rows of Q and rows of K/V per block; N_q and N_k need not be multiples (the last block is
        ragged). They need not match the forward pass's.
        Default None: the rule applied to ``M``.
    causal : bool, default False
        Apply the causal mask aligned to the bottom-right corner: query i sees key j iff j ≤ i + N_k − N_q.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.
    mask : ndarray of bool, shape (N_q, N_k) or (..., N_q, N_k), optional
        True where a query may attend a key, False where it may not (that score becomes −inf); each leading axis is
        Q's or 1. With ``causal``, a query attends only the keys both allow. Default None: no mask.
    dropout_p : float, default 0.0
        Dropout probability in [0, 1), as in the forward pass; kept entries are scaled by 1/(1 − p).
    seed : int, default 0
        Non-negative key of the counter-based dropout mask (FA1 Alg. 2's PRNG state R); pass the forward pass's
        seed to regenerate its mask. Unused when ``dropout_p = 0``.
    hbm : HBM, optional
        Ledger that records this run: its tensors and every element read or written, per algorithm line, per
        (batch, head); afterwards also ``hbm.sram``, ``hbm.flops`` and ``hbm.block_sizes``. Default None: a fresh
        ledger, discarded.
    flops : FlopCounter, optional
        Counter that this run's FLOPs are added to (matmul and non-matmul, per algorithm line, per (batch, head)).
        Default None: a fresh counter (kept as ``hbm.flops`` when ``hbm`` is given).

    Returns
    -------
    Flash1Backward
        ``(dQ, dK, dV)`` in Q's dtype, shaped like Q, K and V; dK and dV are summed over the query heads of a GQA
        group, and fully masked rows get zero gradients, never NaN.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    saved = _check_saved(problem, O, l, m, dO)
    run = _start("flash1_backward", problem, flash1_backward_working_set, M, block_sizes, hbm, flops)
    return _backward(problem, run, saved, None, dropout_p, seed)


@guard_overflow
def flash1_block_sparse_forward(Q, K, V, block_mask, M=None, block_sizes=None, causal=False, scale=None, mask=None,
                                *, dropout_p: float = 0.0, seed: int = 0, hbm: HBM | None = None,
                                flops: FlopCounter | None = None) -> Flash1Forward:
    """Block-sparse FlashAttention forward pass, FA1 Algorithm 5: Algorithm 1 that skips the zero blocks.

    Cost: as Alg. 1 with only the non-zero blocks visited: HBM reads N_k(d + d_v) + s·T_c·N_q(d + d_v + 2) and
    writes s·T_c·N_q(d_v + 2) when the blocks are full, s the fraction of non-zero blocks (Proposition 4:
    Θ(Nd + N²d²s/M)). K_j, V_j are loaded for every j, as Alg. 5 line 6 does.

    Parameters
    ----------
    Q : ndarray, shape (..., N_q, d)
        Queries, float16, float32 or float64 (float16 and float32 compute in float32), finite. Leading axes are
        batch axes and, with three or more axes, the H_q query heads on the axis before N_q.
    K : ndarray, shape (..., N_k, d)
        Keys in Q's dtype, with Q's batch axes and H_kv heads; H_q must be a multiple of H_kv (GQA/MQA: query head
        h reads K/V head h // (H_q / H_kv)).
    V : ndarray, shape (..., N_k, d_v)
        Values in Q's dtype, with K's leading axes and N_k rows; d_v may differ from d.
    block_mask : ndarray of bool, shape (T_r, T_c)
        The block mask M̃ for this run's block sizes, T_r = ceil(N_q/B_r) and T_c = ceil(N_k/B_c): block (i, j) is
        computed only where M̃_ij is True (Alg. 5 line 8). The result is exact attention with the element mask
        :func:`fa2edu.masks.block_sparse_to_mask` (combined with ``causal`` and ``mask``).
    M : int, optional
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by FA1 Alg. 1 line 1,
        ``B_c = ceil(M/4d)``, ``B_r = min(ceil(M/4d), d)``; explicit ``block_sizes`` that need more SRAM than M holds
        raise :class:`~fa2edu.memory.SRAMOverflowError`. Default None: the block sizes of
        :data:`~fa2edu.blocks.DEFAULT_M` (or ``block_sizes``) and an unbounded SRAM that records its peak.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``: rows of Q and rows of K/V per block; N_q and N_k need not be multiples (the last block is
        ragged). Default None: the rule applied to ``M``.
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
    hbm : HBM, optional
        Ledger that records this run: its tensors and every element read or written, per algorithm line, per
        (batch, head); afterwards also ``hbm.sram``, ``hbm.flops`` and ``hbm.block_sizes``. Default None: a fresh
        ledger, discarded.
    flops : FlopCounter, optional
        Counter that this run's FLOPs are added to (matmul and non-matmul, per algorithm line, per (batch, head)).
        Default None: a fresh counter (kept as ``hbm.flops`` when ``hbm`` is given).

    Returns
    -------
    Flash1Forward
        ``(O, l, m)``: O (..., N_q, d_v) in Q's dtype; ℓ and m (..., N_q) in the compute dtype. A fully masked row
        has O = 0 and (ℓ, m) = (0, −inf).
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    run = _start("flash1_block_sparse_forward", problem, flash1_forward_working_set, M, block_sizes, hbm, flops)
    block_mask = check_block_mask(block_mask, problem.N_q, problem.N_k, run.B_r, run.B_c)
    return _forward(problem, run, block_mask, dropout_p, seed)


@guard_overflow
def flash1_block_sparse_backward(Q, K, V, O, l, m, dO, block_mask, M=None, block_sizes=None, causal=False,
                                 scale=None, mask=None, *, dropout_p: float = 0.0, seed: int = 0,
                                 hbm: HBM | None = None, flops: FlopCounter | None = None) -> Flash1Backward:
    """Block-sparse FlashAttention backward pass: Algorithm 4 that skips the zero blocks of ``block_mask``.

    FA1 prints no listing for it ("similar to Algorithm 5"): the same test as Alg. 5 line 8 sits in Alg. 4's inner
    loop. Traffic scales with the fraction s of non-zero blocks (FA1 Proposition 4).

    Parameters
    ----------
    Q : ndarray, shape (..., N_q, d)
        Queries, float16, float32 or float64 (float16 and float32 compute in float32), finite. Leading axes are
        batch axes and, with three or more axes, the H_q query heads on the axis before N_q.
    K : ndarray, shape (..., N_k, d)
        Keys in Q's dtype, with Q's batch axes and H_kv heads; H_q must be a multiple of H_kv (GQA/MQA: query head
        h reads K/V head h // (H_q / H_kv)).
    V : ndarray, shape (..., N_k, d_v)
        Values in Q's dtype, with K's leading axes and N_k rows; d_v may differ from d.
    O : ndarray, shape (..., N_q, d_v)
        The output of the forward pass, as :func:`flash1_forward` returned it.
    l : ndarray, shape (..., N_q)
        The forward pass's softmax row sums ℓ, non-negative (0 on a fully masked row).
    m : ndarray, shape (..., N_q)
        The forward pass's softmax row maxima m, finite or −inf (a fully masked row).
    dO : ndarray, shape (..., N_q, d_v)
        Gradient of the loss with respect to O, finite.
    block_mask : ndarray of bool, shape (T_r, T_c)
        The block mask M̃ for this run's block sizes, T_r = ceil(N_q/B_r) and T_c = ceil(N_k/B_c): block (i, j) is
        computed only where M̃_ij is True (Alg. 5 line 8). The result is exact attention with the element mask
        :func:`fa2edu.masks.block_sparse_to_mask` (combined with ``causal`` and ``mask``).
    M : int, optional
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by FA1 Alg. 1 line 1,
        ``B_c = ceil(M/4d)``, ``B_r = min(ceil(M/4d), d)``; explicit ``block_sizes`` that need more SRAM than M holds
        raise :class:`~fa2edu.memory.SRAMOverflowError`. Default None: the block sizes of
        :data:`~fa2edu.blocks.DEFAULT_M` (or ``block_sizes``) and an unbounded SRAM that records its peak.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``: rows of Q and rows of K/V per block; N_q and N_k need not be multiples (the last block is
        ragged). Default None: the rule applied to ``M``.
    causal : bool, default False
        Apply the causal mask aligned to the bottom-right corner: query i sees key j iff j ≤ i + N_k − N_q.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.
    mask : ndarray of bool, shape (N_q, N_k) or (..., N_q, N_k), optional
        True where a query may attend a key, False where it may not (that score becomes −inf); each leading axis is
        Q's or 1. With ``causal``, a query attends only the keys both allow. Default None: no mask.
    dropout_p : float, default 0.0
        Dropout probability in [0, 1), as in the forward pass; kept entries are scaled by 1/(1 − p).
    seed : int, default 0
        Non-negative key of the counter-based dropout mask (FA1 Alg. 2's PRNG state R); pass the forward pass's
        seed to regenerate its mask. Unused when ``dropout_p = 0``.
    hbm : HBM, optional
        Ledger that records this run: its tensors and every element read or written, per algorithm line, per
        (batch, head); afterwards also ``hbm.sram``, ``hbm.flops`` and ``hbm.block_sizes``. Default None: a fresh
        ledger, discarded.
    flops : FlopCounter, optional
        Counter that this run's FLOPs are added to (matmul and non-matmul, per algorithm line, per (batch, head)).
        Default None: a fresh counter (kept as ``hbm.flops`` when ``hbm`` is given).

    Returns
    -------
    Flash1Backward
        ``(dQ, dK, dV)`` in Q's dtype, shaped like Q, K and V; dK and dV are summed over the query heads of a GQA
        group, and fully masked rows get zero gradients, never NaN.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    saved = _check_saved(problem, O, l, m, dO)
    run = _start("flash1_block_sparse_backward", problem, flash1_backward_working_set, M, block_sizes, hbm, flops)
    block_mask = check_block_mask(block_mask, problem.N_q, problem.N_k, run.B_r, run.B_c)
    return _backward(problem, run, saved, block_mask, dropout_p, seed)
