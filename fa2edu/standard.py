"""Standard attention: FA1 Algorithm 0 (forward) and Algorithm 3 (backward), the baseline FlashAttention beats.

Standard attention *materialises* the N_q × N_k matrices in HBM: the forward pass writes the scores S and the
probabilities P, the backward pass reads P and writes dP and dS. Each line of the algorithms is a separate kernel
(a matrix multiply or an elementwise pass) that reads its inputs from HBM and writes its output back, so the traffic
is Θ(Nd + N²) per (batch, head) whatever the SRAM size (FA1 Theorem 2 and Theorem 5):

================  ==========  ==========
pass              HBM reads   HBM writes
================  ==========  ==========
forward (Alg 0)   3Nd + 2N²   Nd + 2N²
backward (Alg 3)  5Nd + 5N²   3Nd + 2N²
================  ==========  ==========

How this module streams through SRAM. The paper counts every operand of a line once. fa2edu follows that count
exactly: each line walks the rows of its N-row operands in blocks of B_r rows (only B_r matters; B_c is accepted for a
uniform interface and unused), while the operand that every row block multiplies (K in Alg. 0 line 1, V in line 3, …)
is read once and kept on chip for the whole line. The SRAM peak therefore shows what the paper's count quietly
assumes: about N_k·d + B_r·N_k elements on chip, more than M as soon as N_k·d > M. A real GEMM re-reads tiles of that
operand (and leans on the L2 cache); FlashAttention's count needs no such assumption.

Precision. The materialised matrices S, P, dP, dS and the outputs are stored in HBM in the *input* dtype, as a
float16 standard attention stores them, while every line computes in the compute dtype (float32 for float16 inputs):
this is the same-dtype baseline of the conventions' low-precision rule. (In float16, a score beyond ±65504 overflows to
±inf in S: FlashAttention's S never leaves chip, so it never has that problem.)

Masks, causal masking and dropout are FA1 Algorithm 2's: masked scores are a real −inf in S, fully masked rows give
P = 0 and O = 0, and dropout regenerates its keep-mask Z from the seed (:mod:`fa2edu.dropout`) on chip, so the
traffic is the same with or without it. GQA/MQA: query head h reads K/V head h // (H_q / H_kv); dK and dV sum over
the heads of a group.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fa2edu.blocks import block_sizes_q_outer, start_run
from fa2edu.dropout import check_dropout, keep_mask
from fa2edu.masks import block_visible
from fa2edu.memory import HBM, FlopCounter
from fa2edu.softmax import safe_softmax
from fa2edu.validation import AttentionOverflowError, cast_output, check_like, guard_overflow, prepare

__all__ = ["StandardForward", "StandardBackward", "standard_attention", "standard_attention_backward",
           "standard_forward_working_set", "standard_backward_working_set"]


class StandardForward(NamedTuple):
    """Alg. 0's output O and the probabilities P that Alg. 3 reads back, in the inputs' dtype.

    Attributes
    ----------
    O : ndarray, shape (..., N_q, d_v)
        The attention output; 0 on a fully masked row.
    P : ndarray, shape (..., N_q, N_k)
        The softmax probabilities softmax(τQKᵀ), masked and un-dropped; 0 on a fully masked row.
    """

    O: np.ndarray
    P: np.ndarray


class StandardBackward(NamedTuple):
    """What :func:`standard_attention_backward` (FA1 Alg. 3) returns, in the inputs' dtype.

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


def standard_forward_working_set(B_r: int, N_k: int, d: int, d_v: int | None = None) -> int:
    """Peak on-chip elements of Alg. 0 with row blocks of B_r: the largest of its three lines.

    Line 1 holds K, Q_i and S_i; line 2 holds S_i and P_i; line 3 holds V, P_i and O_i.
    """
    d_v = d if d_v is None else d_v
    return max(N_k * d + B_r * d + B_r * N_k, 2 * B_r * N_k, N_k * d_v + B_r * N_k + B_r * d_v)


def standard_backward_working_set(B_r: int, N_k: int, d: int, d_v: int | None = None) -> int:
    """Peak on-chip elements of Alg. 3 with row blocks of B_r: the largest of its five lines.

    Lines 1-2 hold dV (or V), P_i or dP_i, and dO_i; line 3 holds P_i, dP_i, dS_i and D_i; lines 4-5 hold K (or the
    dK accumulator), dS_i and Q_i or dQ_i.
    """
    d_v = d if d_v is None else d_v
    return max(N_k * d_v + B_r * N_k + B_r * d_v, 3 * B_r * N_k + B_r, N_k * d + B_r * N_k + B_r * d)


def _start(algorithm: str, problem, working_set, M, block_sizes, hbm, flops):
    """Block sizes, ledger and SRAM of one run; only B_r (the row block) is used by standard attention."""
    N_k, d, d_v = problem.N_k, problem.d, problem.d_v
    return start_run(algorithm, problem.N_q, N_k, d, M=M, block_sizes=block_sizes, rule=block_sizes_q_outer,
                     working_set=lambda br, bc: working_set(br, N_k, d, d_v), hbm=hbm, flops=flops)


def _stored(x: np.ndarray, store: np.dtype, what: str, inputs: str) -> np.ndarray:
    """A tile of a materialised matrix in the dtype standard attention keeps it in HBM (the inputs' dtype).

    A finite value beyond that dtype's range (float16: ±65504) would be stored as inf and turn the next line's
    arithmetic into NaN: it raises an :class:`~fa2edu.validation.AttentionOverflowError` naming the inputs instead.
    """
    if x.dtype == store:
        return x
    with np.errstate(over="ignore"):                   # an overflow is reported below, naming the inputs
        stored = x.astype(store)
    if np.any(np.isinf(stored) & np.isfinite(x)):
        largest = float(np.max(np.abs(x[np.isfinite(x)])))
        name = what.split(" ")[0]
        raise AttentionOverflowError(
            f"{inputs} give {what} up to {largest:.3g}, beyond the largest {store.name} "
            f"({float(np.finfo(store).max):g}): standard attention stores {name} in HBM in the inputs' dtype, "
            f"where it would be inf. (FlashAttention keeps {name} on chip in float32.) Use float32 inputs, or "
            f"rescale {inputs}")
    return stored


def _dropout_scale(problem, dropout_p: float, seed: int, rows: slice) -> np.ndarray:
    """Z_i: the keep-mask of rows ``rows`` scaled by 1/(1 − p), regenerated from the seed (FA1 Alg. 4 line 14)."""
    lead = problem.lead
    keep = keep_mask(seed, dropout_p, lead, lead[1] * lead[2], rows, slice(0, problem.N_k))
    return keep / (1.0 - dropout_p)


@guard_overflow
def standard_attention(Q, K, V, causal=False, scale=None, mask=None, *, dropout_p: float = 0.0, seed: int = 0,
                       M=None, block_sizes=None, hbm: HBM | None = None,
                       flops: FlopCounter | None = None) -> StandardForward:
    """Standard attention, FA1 Algorithm 0: S = τQKᵀ and P = softmax(S) are written to HBM, then O = PV.

    ``M``/``block_sizes`` only set the row block B_r that streams rows through SRAM; the traffic does not depend on
    them. With ``dropout_p > 0`` O is computed from the dropped P ∘ Z; the returned P is the un-dropped softmax
    (Alg. 3 regenerates Z from ``seed``).

    Cost per (batch, head): 2·N_q·N_k·(d + d_v) matmul FLOPs; HBM reads N_q·d + N_k·d + 2·N_q·N_k + N_k·d_v,
    writes 2·N_q·N_k + N_q·d_v (= 3Nd + 2N² and Nd + 2N² when N_q = N_k, d_v = d).

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
    M : int, optional
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by FA2's Q-outer rule, of which only
        B_r = ceil(M/4d) is used; explicit ``block_sizes`` that need more SRAM than M holds raise
        :class:`~fa2edu.memory.SRAMOverflowError`. Default None: the block sizes of :data:`~fa2edu.blocks.DEFAULT_M` (or
        ``block_sizes``) and an unbounded SRAM that records its peak.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``; only B_r, the rows streamed through SRAM per block, is used (B_c is accepted for a uniform
        interface). The traffic does not depend on it. Default None: the rule applied to ``M``.
    hbm : HBM, optional
        Ledger that records this run: its tensors and every element read or written, per algorithm line, per
        (batch, head); afterwards also ``hbm.sram``, ``hbm.flops`` and ``hbm.block_sizes``. Default None: a fresh
        ledger, discarded.
    flops : FlopCounter, optional
        Counter that this run's FLOPs are added to (matmul and non-matmul, per algorithm line, per (batch, head)).
        Default None: a fresh counter (kept as ``hbm.flops`` when ``hbm`` is given).

    Returns
    -------
    StandardForward
        ``(O, P)``, both in Q's dtype: O (..., N_q, d_v) and P (..., N_q, N_k); a fully masked row has P = 0 and
        O = 0.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    run = _start("standard_attention", problem, standard_forward_working_set, M, block_sizes, hbm, flops)
    mem, sram, count = run.hbm, run.sram, run.flops
    lead, all_keys = problem.lead, slice(0, N_k)
    mem.put("Q", problem.Q)
    mem.put("K", problem.K)
    mem.put("V", problem.V)
    # S, P and O are outputs of their lines, every element written once (no initialisation), stored in HBM in the
    # input dtype; tiles are computed on chip in the compute dtype.
    store, work = problem.in_dtype, problem.dtype
    mem.put("S", np.zeros(lead + (N_q, N_k), dtype=store))
    mem.put("P", np.zeros(lead + (N_q, N_k), dtype=store))
    mem.put("O", np.zeros(lead + (N_q, d_v), dtype=store))

    # Alg. 0 line 1: load Q, K by blocks from HBM, compute S = τQKᵀ, write S to HBM.
    K_all = sram.hold("K", mem.read("K", all_keys, line="Alg 0 line 1"))             # (…, N_k, d), read once
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 0 line 1"))              # (…, B_r, d)
        S_i = sram.hold("S_i", tau * (Q_i @ np.swapaxes(K_all, -1, -2)))               # (…, B_r, N_k)
        count.add_matmul(r, N_k, d, line="Alg 0 line 1")
        count.add_nonmatmul(r * N_k, line="Alg 0 line 1")
        # FA1 Alg. 2's MASK: a real −inf where query i may not see key j (causal or an explicit mask).
        visible = block_visible(N_q, N_k, rows, all_keys, problem.causal, problem.mask)
        if visible is not None:
            S_i = np.where(visible, S_i, -np.inf)
            count.add_nonmatmul(r * N_k, line="Alg 0 line 1 (mask)")
        mem.write("S", rows, _stored(S_i, store, "S = τQKᵀ", "Q and K"), line="Alg 0 line 1")
        sram.free("Q_i", "S_i")
    sram.free("K")

    # Alg. 0 line 2: read S from HBM, compute P = softmax(S), write P to HBM. A softmax needs whole rows of S.
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        S_i = sram.hold("S_i", mem.read("S", rows, line="Alg 0 line 2").astype(work))  # (…, B_r, N_k)
        # Safe softmax (max subtracted); a fully masked row (all −inf) gives P_i = 0, guarded in safe_softmax.
        P_i = sram.hold("P_i", safe_softmax(S_i))
        count.add_nonmatmul(5 * r * N_k, line="Alg 0 line 2")                           # max, −, exp, sum, ÷
        mem.write("P", rows, P_i, line="Alg 0 line 2")
        sram.free("S_i", "P_i")

    # Alg. 0 line 3: load P and V by blocks from HBM, compute O = PV, write O to HBM.
    V_all = sram.hold("V", mem.read("V", all_keys, line="Alg 0 line 3"))             # (…, N_k, d_v), read once
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        P_i = sram.hold("P_i", mem.read("P", rows, line="Alg 0 line 3").astype(work))  # (…, B_r, N_k)
        if dropout_p > 0.0:
            # FA1 Alg. 2 line 14: O uses the dropped P ∘ Z; Z is regenerated on chip, so no extra traffic.
            P_i = P_i * _dropout_scale(problem, dropout_p, seed, rows)
            count.add_nonmatmul(r * N_k, line="Alg 0 line 3 (dropout)")
        O_i = sram.hold("O_i", P_i @ V_all)                                              # (…, B_r, d_v)
        count.add_matmul(r, d_v, N_k, line="Alg 0 line 3")
        mem.write("O", rows, O_i, line="Alg 0 line 3")
        sram.free("P_i", "O_i")
    sram.free("V")

    return StandardForward(problem.from_q_layout(mem["O"]), problem.from_q_layout(mem["P"]))


@guard_overflow
def standard_attention_backward(Q, K, V, P, dO, causal=False, scale=None, mask=None, *, dropout_p: float = 0.0,
                                seed: int = 0, M=None, block_sizes=None, hbm: HBM | None = None,
                                flops: FlopCounter | None = None) -> StandardBackward:
    """Standard attention backward pass, FA1 Algorithm 3: dP and dS are materialised in HBM.

    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D) with D_i = Σ_l P_il dP_il, dQ = τ dS K, dK = τ dSᵀ Q (FA1 Appendix B.2;
    the FA2 text's ``dK = Q dSᵀ`` is erratum 1). With dropout, Z is regenerated from ``seed``: dV = (P ∘ Z)ᵀ dO and
    dP = (dO Vᵀ) ∘ Z, and D_i = Σ_l P_il dP_il still equals rowsum(dO_i ∘ O_i).

    Cost per (batch, head): 4·N_q·N_k·(d + d_v) matmul FLOPs; HBM reads 5Nd + 5N², writes 3Nd + 2N² (N_q = N_k,
    d_v = d; in general reads N_q(N_k·5 + 2d_v + d) + N_k(d + d_v), writes 2·N_q·N_k + N_q·d + N_k·(d + d_v)).

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
    P : ndarray, shape (..., N_q, N_k)
        The un-dropped probabilities that :func:`standard_attention` returned for these inputs (Alg. 3 reads them
        back from HBM).
    dO : ndarray, shape (..., N_q, d_v)
        Gradient of the loss with respect to the output O, finite.
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
    M : int, optional
        SRAM size in elements (FA1 Theorem 2). Without ``block_sizes`` it sets them by FA2's Q-outer rule, of which only
        B_r = ceil(M/4d) is used; explicit ``block_sizes`` that need more SRAM than M holds raise
        :class:`~fa2edu.memory.SRAMOverflowError`. Default None: the block sizes of :data:`~fa2edu.blocks.DEFAULT_M` (or
        ``block_sizes``) and an unbounded SRAM that records its peak.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``; only B_r, the rows streamed through SRAM per block, is used (B_c is accepted for a uniform
        interface). The traffic does not depend on it. Default None: the rule applied to ``M``.
    hbm : HBM, optional
        Ledger that records this run: its tensors and every element read or written, per algorithm line, per
        (batch, head); afterwards also ``hbm.sram``, ``hbm.flops`` and ``hbm.block_sizes``. Default None: a fresh
        ledger, discarded.
    flops : FlopCounter, optional
        Counter that this run's FLOPs are added to (matmul and non-matmul, per algorithm line, per (batch, head)).
        Default None: a fresh counter (kept as ``hbm.flops`` when ``hbm`` is given).

    Returns
    -------
    StandardBackward
        ``(dQ, dK, dV)`` in Q's dtype, shaped like Q, K and V; dK and dV are summed over the query heads of a GQA
        group.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    problem = prepare(Q, K, V, causal=causal, scale=scale, mask=mask)
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    P = check_like(P, "P", problem.q_shape[:-1] + (N_k,))
    dO = check_like(dO, "dO", problem.q_shape[:-1] + (d_v,))
    run = _start("standard_attention_backward", problem, standard_backward_working_set, M, block_sizes, hbm, flops)
    mem, sram, count = run.hbm, run.sram, run.flops
    lead, all_keys = problem.lead, slice(0, N_k)
    mem.put("Q", problem.Q)
    mem.put("K", problem.K)
    mem.put("V", problem.V)
    store, work = problem.in_dtype, problem.dtype
    mem.put("P", problem.to_q_layout(P).astype(store, copy=False))
    mem.put("dO", problem.to_q_layout(dO).astype(work, copy=False))
    # Outputs of their lines, every element written once, stored in the input dtype. dK, dV are per query head;
    # the GQA group sum comes last.
    for name, rows_, cols_ in (("dV", N_k, d_v), ("dP", N_q, N_k), ("dS", N_q, N_k), ("dQ", N_q, d), ("dK", N_k, d)):
        mem.put(name, np.zeros(lead + (rows_, cols_), dtype=store))

    # Alg. 3 line 1: load P, dO by blocks from HBM, compute dV = Pᵀ dO, write dV to HBM.
    dV = sram.hold("dV", np.zeros(lead + (N_k, d_v), dtype=work))            # accumulator, on chip
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        P_i = sram.hold("P_i", mem.read("P", rows, line="Alg 3 line 1").astype(work))  # (…, B_r, N_k)
        dO_i = sram.hold("dO_i", mem.read("dO", rows, line="Alg 3 line 1"))           # (…, B_r, d_v)
        if dropout_p > 0.0:
            # The forward pass multiplied V by P ∘ Z, so dV = (P ∘ Z)ᵀ dO (Z regenerated, FA1 Appendix B.4).
            P_i = P_i * _dropout_scale(problem, dropout_p, seed, rows)
            count.add_nonmatmul(r * N_k, line="Alg 3 line 1 (dropout)")
        dV = sram.hold("dV", dV + np.swapaxes(P_i, -1, -2) @ dO_i)
        count.add_matmul(N_k, d_v, r, line="Alg 3 line 1")
        count.add_nonmatmul(N_k * d_v, line="Alg 3 line 1")
        sram.free("P_i", "dO_i")
    mem.write("dV", all_keys, _stored(dV, store, "dV = Pᵀ dO", "dO"), line="Alg 3 line 1")
    sram.free("dV")

    # Alg. 3 line 2: load dO, V by blocks from HBM, compute dP = dO Vᵀ, write dP to HBM.
    V_all = sram.hold("V", mem.read("V", all_keys, line="Alg 3 line 2"))             # (…, N_k, d_v), read once
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        dO_i = sram.hold("dO_i", mem.read("dO", rows, line="Alg 3 line 2"))
        dP_i = sram.hold("dP_i", dO_i @ np.swapaxes(V_all, -1, -2))                    # (…, B_r, N_k)
        count.add_matmul(r, N_k, d_v, line="Alg 3 line 2")
        if dropout_p > 0.0:
            # Dropped entries pass no gradient: dP = (dO Vᵀ) ∘ Z (FA1 Alg. 4 line 18).
            dP_i = dP_i * _dropout_scale(problem, dropout_p, seed, rows)
            count.add_nonmatmul(r * N_k, line="Alg 3 line 2 (dropout)")
        mem.write("dP", rows, _stored(dP_i, store, "dP = dO Vᵀ", "dO and V"), line="Alg 3 line 2")
        sram.free("dO_i", "dP_i")
    sram.free("V")

    # Alg. 3 line 3: read P, dP from HBM, compute dS_ij = P_ij (dP_ij − Σ_l P_il dP_il), write dS to HBM.
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        P_i = sram.hold("P_i", mem.read("P", rows, line="Alg 3 line 3").astype(work))
        dP_i = sram.hold("dP_i", mem.read("dP", rows, line="Alg 3 line 3").astype(work))
        D_i = sram.hold("D_i", (P_i * dP_i).sum(axis=-1), vector=True)                 # (…, B_r)
        dS_i = sram.hold("dS_i", P_i * (dP_i - D_i[..., None]))                         # (…, B_r, N_k)
        count.add_nonmatmul(4 * r * N_k, line="Alg 3 line 3")                           # ∘, Σ, −, ∘
        mem.write("dS", rows, _stored(dS_i, store, "dS = P ∘ (dP − D)", "dO and V"), line="Alg 3 line 3")
        sram.free("P_i", "dP_i", "D_i", "dS_i")

    # Alg. 3 line 4: load dS and K by blocks from HBM, compute dQ = τ dS K, write dQ to HBM.
    K_all = sram.hold("K", mem.read("K", all_keys, line="Alg 3 line 4"))             # (…, N_k, d), read once
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        dS_i = sram.hold("dS_i", mem.read("dS", rows, line="Alg 3 line 4").astype(work))
        dQ_i = sram.hold("dQ_i", tau * (dS_i @ K_all))                                  # (…, B_r, d)
        count.add_matmul(r, d, N_k, line="Alg 3 line 4")
        count.add_nonmatmul(r * d, line="Alg 3 line 4")
        mem.write("dQ", rows, _stored(dQ_i, store, "dQ = τ dS K", "dO, V and K"), line="Alg 3 line 4")
        sram.free("dS_i", "dQ_i")
    sram.free("K")

    # Alg. 3 line 5: load dS and Q by blocks from HBM, compute dK = τ dSᵀ Q, write dK to HBM.
    dK = sram.hold("dK", np.zeros(lead + (N_k, d), dtype=work))              # accumulator, on chip
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        dS_i = sram.hold("dS_i", mem.read("dS", rows, line="Alg 3 line 5").astype(work))
        Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 3 line 5"))
        dK = sram.hold("dK", dK + tau * (np.swapaxes(dS_i, -1, -2) @ Q_i))
        count.add_matmul(N_k, d, r, line="Alg 3 line 5")
        count.add_nonmatmul(2 * N_k * d, line="Alg 3 line 5")
        sram.free("dS_i", "Q_i")
    mem.write("dK", all_keys, _stored(dK, store, "dK = τ dSᵀ Q", "dO, V and Q"), line="Alg 3 line 5")
    sram.free("dK")

    # GQA: dK, dV of the query heads in a group are summed in the compute dtype, then stored as the input dtype.
    return StandardBackward(problem.from_q_layout(mem["dQ"]),
                            cast_output(problem.from_kv_layout(mem["dK"].astype(work)), store, "dK"),
                            cast_output(problem.from_kv_layout(mem["dV"].astype(work)), store, "dV"))
