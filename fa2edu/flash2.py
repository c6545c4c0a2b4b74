"""FlashAttention-2: forward (FA2 Algorithm 1) and backward (FA2 Algorithm 2), with causal block skipping and GQA.

FA2 keeps FA1's tiling and online softmax and changes three things (FA2 Section 3.1):

1. The loops are swapped for the forward pass: the **outer loop runs over blocks of Q**, so a block's output O_i,
   its running max m_i and running sum ℓ_i stay on chip for the whole inner loop over K/V blocks, and O_i is
   written once. (FA1 reads and writes O_i, ℓ_i, m_i back to HBM on every inner step.)
2. The accumulator is kept **un-scaled**: Õ_i is only multiplied by ``e^{m_old − m_new}`` when the maximum moves,
   and divided by ℓ_i once, after the loop (tweak 1: fewer non-matmul FLOPs).
3. Only the log-sum-exp ``L = m + log ℓ`` is saved for the backward pass, not both m and ℓ (tweak 2).

GQA/MQA: query head h reads K/V head h // (H_q / H_kv) by index mapping (broadcasting here), never a copy;
dK and dV are summed over the heads of a group (FA2 Section 3.1, "Multi-query attention").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fa2edu.blocks import block_sizes_kv_outer, block_sizes_q_outer, start_run
from fa2edu.dropout import check_dropout, keep_mask
from fa2edu.masks import BlockKind, classify_block
from fa2edu.memory import HBM, FlopCounter
from fa2edu.softmax import exp_minus
from fa2edu.validation import cast_output, check_like, guard_overflow, prepare

__all__ = ["Flash2Forward", "Flash2Backward", "flash2_forward", "flash2_backward",
           "flash2_forward_working_set", "flash2_backward_working_set"]


class Flash2Forward(NamedTuple):
    """FA2 Alg. 1's outputs: O and the log-sum-exp L saved for the backward pass.

    Attributes
    ----------
    O : ndarray, shape (..., N_q, d_v)
        The attention output, in the inputs' dtype; 0 on a fully masked row.
    L : ndarray, shape (..., N_q)
        The log-sum-exp L = m + log ℓ of each row of τQKᵀ (masked), in the compute dtype; +inf on a fully masked
        row, so that exp(S − L) = 0 in the backward pass.
    """

    O: np.ndarray
    L: np.ndarray


class Flash2Backward(NamedTuple):
    """What FA2 Alg. 2 (:func:`flash2_backward`) returns, in the inputs' dtype.

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


def flash2_forward_working_set(B_r: int, B_c: int, d: int, d_v: int | None = None) -> int:
    """Peak on-chip elements of FA2 Alg. 1 for full blocks: Q_i, Õ_i, K_j, V_j, S_i^(j) and m_i, ℓ_i, m_new."""
    d_v = d if d_v is None else d_v
    return B_r * d + B_r * d_v + B_c * d + B_c * d_v + B_r * B_c + 3 * B_r


@guard_overflow
def flash2_forward(Q, K, V, M=None, block_sizes=None, causal=False, scale=None, mask=None, *,
                   dropout_p: float = 0.0, seed: int = 0, hbm: HBM | None = None,
                   flops: FlopCounter | None = None) -> Flash2Forward:
    """FlashAttention-2 forward pass (FA2 Algorithm 1), with FA1 Alg. 2's scale τ, mask and dropout.

    Cost per (batch, head), N_q = N_k = N, no mask: 4N²d matmul FLOPs; HBM reads Nd + 2Nd·T_r, writes Nd + N.

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
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by the Q-outer rule
        ``B_r = ceil(M/4d)``, ``B_c = min(ceil(M/4d), d)`` (:func:`~fa2edu.blocks.block_sizes_q_outer`); explicit
        ``block_sizes`` that need more SRAM than M holds raise :class:`~fa2edu.memory.SRAMOverflowError`. Default None:
        the block sizes of :data:`~fa2edu.blocks.DEFAULT_M` (or ``block_sizes``) and an unbounded SRAM that records its
        peak.
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
    Flash2Forward
        ``(O, L)``: O (..., N_q, d_v) in Q's dtype and L (..., N_q) in the compute dtype. A fully masked row has
        O = 0 and L = +inf.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    # Alg. 1 line 1: choose B_r, B_c; divide Q into T_r row blocks, K and V into T_c blocks (run's tiles).
    run = start_run("flash2_forward", N_q, N_k, d, M=M, block_sizes=block_sizes,
                    rule=block_sizes_q_outer,
                    working_set=lambda br, bc: flash2_forward_working_set(br, bc, d, d_v),
                    hbm=hbm, flops=flops)
    mem, sram, count = run.hbm, run.sram, run.flops
    lead = problem.lead                                        # (Z, H_kv, G)
    heads = lead[1] * lead[2]
    mem.put("Q", problem.Q)
    mem.put("K", problem.K)
    mem.put("V", problem.V)
    # Alg. 1 line 2: O and L are outputs in HBM, each row block written exactly once (no initialisation needed).
    mem.put("O", np.zeros(lead + (N_q, d_v), dtype=problem.dtype))
    mem.put("L", np.zeros(lead + (N_q,), dtype=problem.dtype), vector=True)

    # Alg. 1 line 3: the outer loop runs over the T_r row blocks of Q (one thread block each on a GPU).
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        # Alg. 1 line 4: load Q_i from HBM to on-chip SRAM.
        Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 1 line 4"))              # (…, B_r, d)
        # Alg. 1 line 5: on chip, Õ_i = 0, ℓ_i = 0, m_i = −inf.
        O_i = sram.hold("O_i", np.zeros(lead + (r, d_v), dtype=problem.dtype))        # (…, B_r, d_v)
        l_i = sram.hold("l_i", np.zeros(lead + (r,), dtype=problem.dtype), vector=True)
        m_i = sram.hold("m_i", np.full(lead + (r,), -np.inf, dtype=problem.dtype), vector=True)

        # Alg. 1 line 6: the inner loop streams the T_c blocks of K and V through SRAM.
        for cols in run.col_tiles:
            c = cols.stop - cols.start
            # FA2 Section 3.1 (causal masking): blocks entirely above the diagonal are skipped: no load, no FLOP.
            kind, share, visible = classify_block(N_q, N_k, rows, cols, problem.causal,
                                                  problem.mask)
            if kind is BlockKind.SKIP:
                continue
            # Alg. 1 line 7: load K_j, V_j from HBM to on-chip SRAM.
            K_j = sram.hold("K_j", mem.read("K", cols, line="Alg 1 line 7", share=share))    # (…, B_c, d)
            V_j = sram.hold("V_j", mem.read("V", cols, line="Alg 1 line 7", share=share))    # (…, B_c, d_v)
            # Alg. 1 line 8: S_i^(j) = τ Q_i K_jᵀ (the scale τ as in FA1 Alg. 2 line 9).
            S_ij = sram.hold("S_ij", tau * (Q_i @ np.swapaxes(K_j, -1, -2)))            # (…, B_r, B_c)
            count.add_matmul(r, c, d, line="Alg 1 line 8", share=share)
            count.add_nonmatmul(r * c, line="Alg 1 line 8", share=share)
            if kind is BlockKind.MASK:
                # Only blocks that straddle the diagonal (or the padding edge) pay for the elementwise mask.
                S_ij = np.where(visible, S_ij, -np.inf)
                count.add_nonmatmul(r * c, line="Alg 1 line 8 (mask)", share=share)
            # Alg. 1 line 9: m_i^(j) = max(m_i^(j−1), rowmax(S_i^(j))).
            m_new = sram.hold("m_new", np.maximum(m_i, S_ij.max(axis=-1)), vector=True)
            # Alg. 1 line 9: P̃_i^(j) = exp(S_i^(j) − m_i^(j)), guarded where a row has seen no key yet (m = −inf).
            P_ij = exp_minus(S_ij, m_new)
            # Alg. 1 line 9: ℓ_i^(j) = e^{m_i^(j−1) − m_i^(j)} ℓ_i^(j−1) + rowsum(P̃_i^(j)).
            alpha = exp_minus(m_i[..., None], m_new)[..., 0]          # e^{m_old − m_new}, 0 while m_old = −inf
            l_i = alpha * l_i + P_ij.sum(axis=-1)
            count.add_nonmatmul(r * c * 4 + r * 5, line="Alg 1 line 9", share=share)
            if dropout_p > 0.0:
                # FA1 Alg. 2 line 14: drop entries of P̃ (ℓ keeps the un-dropped sum), regenerated from the seed.
                keep = keep_mask(seed, dropout_p, lead, heads, rows, cols)
                P_ij = np.where(keep, P_ij / (1.0 - dropout_p), 0.0)
                count.add_nonmatmul(r * c, line="Alg 1 line 9 (dropout)", share=share)
            # Alg. 1 line 10: Õ_i^(j) = diag(e^{m_old − m_new}) Õ_i^(j−1) + P̃_i^(j) V_j.
            # (The paper prints diag(…)^{-1}: erratum 4. The old accumulator is scaled *down*.)
            O_i = alpha[..., None] * O_i + P_ij @ V_j
            count.add_matmul(r, d_v, c, line="Alg 1 line 10", share=share)
            count.add_nonmatmul(2 * r * d_v, line="Alg 1 line 10", share=share)
            m_i = sram.hold("m_i", m_new, vector=True)
            sram.free("m_new", "S_ij")

        # Alg. 1 line 12: O_i = diag(ℓ_i^(T_c))^{-1} Õ_i^(T_c): the one and only normalisation.
        # Guard ℓ = 0 (a row that saw no key): its Õ_i is 0, and O_i must be 0, not 0/0.
        l_safe = np.where(l_i == 0.0, 1.0, l_i)
        O_i = O_i / l_safe[..., None]
        # Alg. 1 line 13: L_i = m_i + log ℓ_i; +inf for a fully masked row so that exp(S − L) = 0 in the backward.
        with np.errstate(divide="ignore"):
            L_i = np.where(l_i == 0.0, np.inf, m_i + np.log(l_safe))
        count.add_nonmatmul(r * d_v + 2 * r, line="Alg 1 lines 12-13")
        # Alg. 1 lines 14-15: write O_i and L_i to HBM, once per row block.
        mem.write("O", rows, O_i, line="Alg 1 line 14")
        mem.write("L", rows, L_i, line="Alg 1 line 15")
        sram.free("Q_i", "O_i", "l_i", "m_i", "K_j", "V_j")

    # Alg. 1 line 17: return O and L, in the caller's layout (and O in the input dtype).
    O = cast_output(problem.from_q_layout(mem["O"]), problem.in_dtype, "O")
    return Flash2Forward(O, problem.from_q_layout(mem["L"]))


def flash2_backward_working_set(B_r: int, B_c: int, d: int, d_v: int | None = None, *,
                                redundant_loads: bool = False) -> int:
    """Peak on-chip elements of FA2 Alg. 2 for full blocks.

    Outer loop: K_j, V_j, dK_j, dV_j (B_c × (2d + 2d_v)). Inner loop: Q_i, dO_i, dQ_i (B_r × (2d + d_v)), L_i and D_i
    (2B_r), P_i^(j) and dP_i^(j)/dS_i^(j) (2·B_r·B_c); the printed version's O_i adds B_r × d_v. The line 4 pass holds
    dO_i, O_i and D_i (B_r × (2d_v + 1)) when nothing else is on chip; the larger of the two phases is the peak.
    """
    d_v = d if d_v is None else d_v
    main_loop = B_c * (2 * d + 2 * d_v) + B_r * (2 * d + d_v) + 2 * B_r + 2 * B_r * B_c
    if redundant_loads:
        main_loop += B_r * d_v
    d_pass = B_r * (2 * d_v + 1)
    return max(main_loop, d_pass)


def _check_saved(problem, O, L, dO) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """O, dO (..., N_q, d_v) in Q's dtype and L (..., N_q) as the forward pass returned them; internal layout."""
    o_shape = problem.q_shape[:-1] + (problem.d_v,)
    O = check_like(O, "O", o_shape)
    dO = check_like(dO, "dO", o_shape)
    L = check_like(L, "L", problem.q_shape[:-1], finite=False)
    for name, x in (("O", O), ("dO", dO)):
        if x.dtype != problem.in_dtype:
            raise TypeError(f"{name} must have Q's dtype {problem.in_dtype}, got {x.dtype}")
    # L = +inf marks a fully masked row (exp(S − L) = 0); NaN or −inf cannot come out of the forward pass.
    if np.isnan(L).any() or np.isneginf(L).any():
        raise ValueError("L contains NaN or -inf; it must be the log-sum-exp saved by the forward pass "
                         "(finite, or +inf on fully masked rows)")
    O, L, dO = (problem.to_q_layout(x).astype(problem.dtype, copy=False) for x in (O, L, dO))
    return O, L, dO


@guard_overflow
def flash2_backward(Q, K, V, O, L, dO, M=None, block_sizes=None, causal=False, scale=None, mask=None, *,
                    dropout_p: float = 0.0, seed: int = 0, redundant_loads: bool = False,
                    hbm: HBM | None = None, flops: FlopCounter | None = None) -> Flash2Backward:
    """FlashAttention-2 backward pass (FA2 Algorithm 2), with FA1 Alg. 4's scale τ, mask and dropout.

    GQA: dK, dV are summed over the query heads that share a K/V head. Dropout regenerates the forward pass's mask
    from ``seed`` (nothing stored).

    Cost per (batch, head), N_q = N_k = N, d_v = d, no mask: 10N²d matmul FLOPs (2.5× the forward's 4N²d);
    HBM reads 4Nd + T_c(3Nd + 2N), writes N + 2Nd + T_c·Nd, plus N·d initialisation writes of dQ (line 3).

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
        The output of the forward pass, in Q's dtype, as :func:`flash2_forward` returned it.
    L : ndarray, shape (..., N_q)
        The forward pass's log-sum-exp L = m + log ℓ: finite, or +inf on a fully masked row.
    dO : ndarray, shape (..., N_q, d_v)
        Gradient of the loss with respect to O, in Q's dtype, finite.
    M : int, optional
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by the K/V-outer rule of FA1 Alg. 1
        line 1, ``B_c = ceil(M/4d)``, ``B_r = min(ceil(M/4d), d)`` (:func:`~fa2edu.blocks.block_sizes_kv_outer`), since
        the outer loop runs over K/V blocks; explicit ``block_sizes`` that need more SRAM than M holds raise
        :class:`~fa2edu.memory.SRAMOverflowError`. Default None: the block sizes of :data:`~fa2edu.blocks.DEFAULT_M` (or
        ``block_sizes``) and an unbounded SRAM that records its peak.
    block_sizes : tuple of int or "forward", optional
        ``(B_r, B_c)``: rows of Q and rows of K/V per block; N_q and N_k need not be multiples (the last block is
        ragged). They need not match the forward pass's, but where they do, line 10 recomputes S = τQ_iK_jᵀ with
        the very products that made L, bit for bit; with other tiles NumPy's matrix products may round S
        differently, and exp(S − L) turns that into a relative error of about ``|S|·ε`` in P: in float32 at scores of
        a few thousand, dV comes out several times less accurate (chapter 5, "Recomputation and rounding").
        ``"forward"``: the forward pass's default tiles for this M, :func:`~fa2edu.blocks.block_sizes_q_outer`
        (pass the forward's own tuple if it was given one); their smaller B_c costs more passes over Q, dO, L, D.
        Default None: the K/V-outer rule applied to ``M``.
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
    redundant_loads : bool, default False
        Perform the loads exactly as printed: line 9 also loads O_i (unneeded once D is precomputed) and dQ_i (loaded
        again at line 15), erratum 9. They cost 2·T_c·N_q·d_v extra reads and change nothing else.
    hbm : HBM, optional
        Ledger that records this run: its tensors and every element read or written, per algorithm line, per
        (batch, head); afterwards also ``hbm.sram``, ``hbm.flops`` and ``hbm.block_sizes``. Default None: a fresh
        ledger, discarded.
    flops : FlopCounter, optional
        Counter that this run's FLOPs are added to (matmul and non-matmul, per algorithm line, per (batch, head)).
        Default None: a fresh counter (kept as ``hbm.flops`` when ``hbm`` is given).

    Returns
    -------
    Flash2Backward
        ``(dQ, dK, dV)`` in Q's dtype, shaped like Q, K and V; dK and dV are summed over the query heads of a GQA
        group, and fully masked rows get zero gradients, never NaN.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    if not isinstance(redundant_loads, (bool, np.bool_)):
        raise TypeError(f"redundant_loads must be a bool, got {type(redundant_loads).__name__}")
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    O5, L5, dO5 = _check_saved(problem, O, L, dO)
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    # The K/V-outer rule (the large block to the outer loop), or the forward pass's Q-outer tiles on request, so
    # that line 10 recomputes S exactly as Alg. 1 line 8 computed it.
    rule = block_sizes_kv_outer
    if isinstance(block_sizes, str):
        if block_sizes != "forward":
            raise ValueError(f"block_sizes must be a pair (B_r, B_c) or 'forward', got {block_sizes!r}")
        block_sizes, rule = None, block_sizes_q_outer
    run = start_run("flash2_backward", N_q, N_k, d, M=M, block_sizes=block_sizes, rule=rule,
                    working_set=lambda br, bc: flash2_backward_working_set(br, bc, d, d_v,
                                                                           redundant_loads=redundant_loads),
                    hbm=hbm, flops=flops)
    mem, sram, count = run.hbm, run.sram, run.flops
    lead = problem.lead                                        # (Z, H_kv, G)
    heads = lead[1] * lead[2]
    for name, x in (("Q", problem.Q), ("K", problem.K), ("V", problem.V), ("O", O5), ("dO", dO5)):
        mem.put(name, x)
    mem.put("L", L5, vector=True)
    # Alg. 2 line 3: initialise dQ = 0 in HBM: every column block j adds its share to it (line 15).
    mem.allocate("dQ", lead + (N_q, d), 0.0, problem.dtype, line="Alg 2 line 3")
    # Alg. 2 line 3: dK, dV are per query head (GQA sums them at the end); each block is written once (line 18).
    mem.put("dK", np.zeros(lead + (N_k, d), dtype=problem.dtype))
    mem.put("dV", np.zeros(lead + (N_k, d_v), dtype=problem.dtype))
    # Alg. 2 line 4: D ∈ R^N (the paper prints R^d: erratum 5), one entry per row of O.
    mem.put("D", np.zeros(lead + (N_q,), dtype=problem.dtype), vector=True)

    # Alg. 2 line 4: D = rowsum(dO ∘ O), its own pass over the row blocks: reads dO and O once, writes D.
    # With dropout, O is the dropped output, and D_i = rowsum(dO_i ∘ O_i) still equals rowsum(P ∘ dP) row by row.
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        dO_i = sram.hold("dO_i", mem.read("dO", rows, line="Alg 2 line 4"))          # (…, B_r, d_v)
        O_i = sram.hold("O_i", mem.read("O", rows, line="Alg 2 line 4"))            # (…, B_r, d_v)
        D_i = sram.hold("D_i", (dO_i * O_i).sum(axis=-1), vector=True)             # (…, B_r)
        count.add_nonmatmul(2 * r * d_v, line="Alg 2 line 4")
        mem.write("D", rows, D_i, line="Alg 2 line 4")
        sram.free("dO_i", "O_i", "D_i")

    # Alg. 2 line 5: the outer loop runs over the T_c column blocks of K and V (one thread block each on a GPU).
    for cols in run.col_tiles:
        c = cols.stop - cols.start
        # Alg. 2 line 6: load K_j, V_j from HBM to on-chip SRAM.
        K_j = sram.hold("K_j", mem.read("K", cols, line="Alg 2 line 6"))                # (…, B_c, d)
        V_j = sram.hold("V_j", mem.read("V", cols, line="Alg 2 line 6"))                # (…, B_c, d_v)
        # Alg. 2 line 7: dK_j = 0, dV_j = 0 on chip; one per query head, so the shape carries the group axis G.
        dK_j = sram.hold("dK_j", np.zeros(lead + (c, d), dtype=problem.dtype))          # (…, B_c, d)
        dV_j = sram.hold("dV_j", np.zeros(lead + (c, d_v), dtype=problem.dtype))        # (…, B_c, d_v)

        # Alg. 2 line 8: the inner loop streams the T_r row blocks of Q, dO, L, D (and dQ) through SRAM.
        for rows in run.row_tiles:
            r = rows.stop - rows.start
            # FA2 Section 3.1 (causal masking): blocks with every entry masked are skipped: no load, no FLOP.
            kind, share, visible = classify_block(N_q, N_k, rows, cols, problem.causal, problem.mask)
            if kind is BlockKind.SKIP:
                continue
            # Alg. 2 line 9: load Q_i, dO_i, L_i, D_i from HBM to on-chip SRAM.
            Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 2 line 9", share=share))       # (…, B_r, d)
            dO_i = sram.hold("dO_i", mem.read("dO", rows, line="Alg 2 line 9", share=share))    # (…, B_r, d_v)
            L_i = sram.hold("L_i", mem.read("L", rows, line="Alg 2 line 9", share=share), vector=True)
            D_i = sram.hold("D_i", mem.read("D", rows, line="Alg 2 line 9", share=share), vector=True)
            if redundant_loads:
                # Alg. 2 line 9 as printed also loads O_i (D_i already holds all it was needed for) and dQ_i
                # (loaded again at line 15 before it is used): erratum 9. Pure traffic, never read on chip.
                sram.hold("O_i", mem.read("O", rows, line="Alg 2 line 9 (redundant)", share=share))
                sram.hold("dQ_i", mem.read("dQ", rows, line="Alg 2 line 9 (redundant)", share=share))
            # Alg. 2 line 10: S_i^(j) = τ Q_i K_jᵀ (the scale τ as in FA1 Alg. 4 line 11). Bit for bit the
            # forward's S only with the forward's tiles: line 11 has no normalisation to absorb a difference.
            S_ij = sram.hold("S_ij", tau * (Q_i @ np.swapaxes(K_j, -1, -2)))                     # (…, B_r, B_c)
            count.add_matmul(r, c, d, line="Alg 2 line 10", share=share)
            count.add_nonmatmul(r * c, line="Alg 2 line 10", share=share)
            if kind is BlockKind.MASK:
                # Only blocks that straddle the diagonal (or the padding edge) pay for the elementwise mask.
                S_ij = np.where(visible, S_ij, -np.inf)
                count.add_nonmatmul(r * c, line="Alg 2 line 10 (mask)", share=share)
            # Alg. 2 line 11: P_i^(j) = exp(S_i^(j) − L_i): the forward's softmax, rebuilt from one statistic.
            # No guard is needed: a fully masked row has L_i = +inf, and exp(S − inf) = exp(−inf) = 0 for every S,
            # finite or −inf (−inf − (+inf) is −inf, not NaN).
            P_ij = np.exp(S_ij - L_i[..., None])                                                  # (…, B_r, B_c)
            sram.free("S_ij")
            sram.hold("P_ij", P_ij)
            count.add_nonmatmul(2 * r * c, line="Alg 2 line 11", share=share)
            P_dropped = P_ij
            if dropout_p > 0.0:
                # FA1 Alg. 4 line 13: regenerate the forward pass's keep mask Z from the seed (never stored).
                scaled_keep = keep_mask(seed, dropout_p, lead, heads, rows, cols) / (1.0 - dropout_p)
                P_dropped = P_ij * scaled_keep
                count.add_nonmatmul(r * c, line="Alg 2 line 11 (dropout)", share=share)
            # Alg. 2 line 12: dV_j ← dV_j + (P_i^(j))ᵀ dO_i (with dropout, the dropped P that made O).
            dV_j = sram.hold("dV_j", dV_j + np.swapaxes(P_dropped, -1, -2) @ dO_i)
            count.add_matmul(c, d_v, r, line="Alg 2 line 12", share=share)
            count.add_nonmatmul(c * d_v, line="Alg 2 line 12", share=share)
            # Alg. 2 line 13: dP_i^(j) = dO_i V_jᵀ; with dropout ∘ Z/(1 − p): the gradient flows through kept entries.
            dP_ij = dO_i @ np.swapaxes(V_j, -1, -2)                                               # (…, B_r, B_c)
            count.add_matmul(r, c, d_v, line="Alg 2 line 13", share=share)
            if dropout_p > 0.0:
                dP_ij = dP_ij * scaled_keep
                count.add_nonmatmul(r * c, line="Alg 2 line 13 (dropout)", share=share)
            sram.hold("dP_ij", dP_ij)
            # Alg. 2 line 14: dS_i^(j) = P_i^(j) ∘ (dP_i^(j) − D_i), the softmax Jacobian with D_i = rowsum(P ∘ dP).
            dS_ij = P_ij * (dP_ij - D_i[..., None])                                               # (…, B_r, B_c)
            sram.free("dP_ij")
            sram.hold("dS_ij", dS_ij)
            count.add_nonmatmul(2 * r * c, line="Alg 2 line 14", share=share)
            # Alg. 2 line 15: load dQ_i, add τ dS_i^(j) K_j on chip (τ from S = τQKᵀ), write it back to HBM.
            # On a GPU, thread blocks of different j do this with atomic adds (FA2 Section 3.2).
            dQ_i = sram.hold("dQ_i", mem.read("dQ", rows, line="Alg 2 line 15", share=share))   # (…, B_r, d)
            dQ_i = dQ_i + tau * (dS_ij @ K_j)
            count.add_matmul(r, d, c, line="Alg 2 line 15", share=share)
            count.add_nonmatmul(2 * r * d, line="Alg 2 line 15", share=share)
            mem.write("dQ", rows, dQ_i, line="Alg 2 line 15", share=share)
            # Alg. 2 line 16: dK_j ← dK_j + τ dS_i^(j)ᵀ Q_i (the FA2 text's dK = Q dSᵀ is erratum 1).
            dK_j = sram.hold("dK_j", dK_j + tau * (np.swapaxes(dS_ij, -1, -2) @ Q_i))
            count.add_matmul(c, d, r, line="Alg 2 line 16", share=share)
            count.add_nonmatmul(2 * c * d, line="Alg 2 line 16", share=share)
            sram.free("Q_i", "dO_i", "L_i", "D_i", "O_i", "dQ_i", "P_ij", "dS_ij")

        # Alg. 2 line 18: write dK_j, dV_j to HBM, once per column block.
        mem.write("dK", cols, dK_j, line="Alg 2 line 18")
        mem.write("dV", cols, dV_j, line="Alg 2 line 18")
        sram.free("K_j", "V_j", "dK_j", "dV_j")

    # GQA/MQA (FA2 Section 3.1): the query heads of a group each computed their own dK, dV: sum them.
    dQ = cast_output(problem.from_q_layout(mem["dQ"]), problem.in_dtype, "dQ")
    dK = cast_output(problem.from_kv_layout(mem["dK"]), problem.in_dtype, "dK")
    dV = cast_output(problem.from_kv_layout(mem["dV"]), problem.in_dtype, "dV")
    return Flash2Backward(dQ, dK, dV)
