"""Context parallelism: ring attention across the ranks of a ``torch.distributed`` process group.

When the sequence outgrows one device, split it. Each of W ranks keeps its own block of queries and its own block
of keys and values; the K/V blocks travel around a ring (rank r sends to r + 1 and receives from r − 1), so after
W steps every query block has met every key block. Each step is one FA2 block step (FA2 Alg. 1 lines 6-11) on
whole blocks, with the network as the outer, slowest level of memory; the partial results (O, L) of the steps
merge by the log-sum-exp rule of :func:`fa2edu.merge_attention_states` (FA1 Section 3.1), in float32 (float64 for
float64 inputs) whatever the input dtype::

    from fa2edu import distributed as cp
    q_local = cp.shard(q, rank, world_size, layout="zigzag")     # this rank's part of the sequence axis (-2)
    o_local = cp.ring_attention(q_local, k_local, v_local, causal=True, layout="zigzag")
    o = cp.unshard([o_0, o_1, ...], layout="zigzag")              # the full sequence back, in order

**Layouts.** ``"contiguous"``: rank r holds tokens [r·N/W, (r+1)·N/W). Under a causal mask the last rank's
queries see every key and the first rank's only its own: the last rank works about 2W − 1 times as long as the
first and everyone waits for it. ``"zigzag"``: the sequence is cut into 2W equal chunks and rank r holds chunks
r and 2W − 1 − r (an early one and a late one), so every rank has the same causal work.

**Steps.** At step s = 0 … W − 1, rank r holds the K/V block of rank (r − s) mod W. The transfer of that block to
rank r + 1 (and of the next block from rank r − 1) is posted *before* the step's computation, so the two
overlap; the last step sends nothing. With a causal mask, what a step computes follows from the global positions
of the two blocks (FA2 Section 3.1.1's three kinds of blocks, one level up): a query chunk sees a key chunk
entirely (no mask), on the diagonal (the causal triangle), or not at all — and a step where no query of the rank
sees any key of the block computes nothing (the block still travels on).

**Backward.** FA2 Alg. 2 around the ring: each rank keeps Q, its O and L (FA2 saves only O and L), and
D = rowsum(dO ∘ O). The K/V blocks travel around once more; at each step the rank recomputes P = exp(S − L) for
the block it holds, adds its share to dQ locally, and adds its share to the block's dK, dV accumulators, which
travel with the blocks (float32, or float64 for float64 inputs) and reach their owners after W hops.

**Where it runs.** CPU tensors (float32, float64) on the gloo backend, computing each step with
:func:`block_attention` (PyTorch, float32 or float64). CUDA tensors on NCCL: every step, forward and backward,
runs the kernels that ``fa2edu.torch.flash_attention`` dispatches to for its dtype (:func:`step_backend`):
float16/bfloat16 on tensor cores (``kernels_gpu.hopper``'s forward on an sm_90 GPU where it measured faster, the
mma.sync ladder elsewhere and for the backward), float32 in 3xTF32.

**Instrumentation.** :func:`trace` records what each forward step did (FLOPs, elements sent and received,
skipped or not), and with ``backward=True`` each backward step too (its FLOPs, the K/V block and the dK, dV
accumulators sent and received): the figures :func:`fa2edu.simulate_context_parallel` predicts without running
anything.

This module needs PyTorch; ``import fa2edu`` never imports it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import NamedTuple

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as error:  # pragma: no cover - exercised only where torch is absent
    if error.name != "torch":
        raise
    raise ImportError("fa2edu.distributed needs PyTorch, which is not installed: `pip install torch` "
                      "(or `pip install 'fa2edu[torch]'`); the rest of fa2edu works without it") from error

import numpy as np

__all__ = ["LAYOUTS", "shard", "unshard", "chunk_ranges", "ring_attention", "trace", "block_attention",
           "block_attention_backward", "merge_attention_states", "step_plan", "PlanItem"]

#: the sequence layouts: how the N tokens are dealt to the W ranks
LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------------------------------------
# Layouts: which tokens a rank holds
# ----------------------------------------------------------------------------------------------------------------

def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_count(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _check_divisible(N: int, world_size: int, layout: str) -> None:
    parts = world_size if layout == "contiguous" else 2 * world_size
    if N % parts:
        what = "W" if layout == "contiguous" else "2W (2W equal chunks)"
        raise ValueError(f"the {layout} layout needs the sequence length N divisible by {what} = {parts}; "
                         f"got N = {N} with world_size W = {world_size}")


def chunk_ranges(N: int, rank: int, world_size: int, layout: str = "zigzag") -> list[tuple[int, int]]:
    """The global token ranges ``[(start, stop), ...]`` that ``rank`` holds, in the order it stores them.

    ``"contiguous"``: one range, [r·N/W, (r+1)·N/W). ``"zigzag"``: with c = N/(2W), chunks r and 2W − 1 − r,
    i.e. [r·c, (r+1)·c) then [(2W−1−r)·c, (2W−r)·c). Either way the stored order is ascending in position.

    Parameters
    ----------
    N : int
        Sequence length, positive.
    rank : int
        The rank, 0 ≤ rank < world_size.
    world_size : int
        W, the number of ranks, positive.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        How the tokens are dealt.

    Returns
    -------
    list of (int, int)
        One range (contiguous) or two (zigzag), half-open.

    Raises
    ------
    ValueError
        N not divisible by W (contiguous) or 2W (zigzag), rank outside [0, world_size), an unknown layout.
    """
    layout = _check_layout(layout)
    N = _check_count(N, "N", 1)
    world_size = _check_count(world_size, "world_size", 1)
    rank = _check_count(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    _check_divisible(N, world_size, layout)
    if layout == "contiguous":
        n = N // world_size
        return [(rank * n, (rank + 1) * n)]
    c = N // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return [(rank * c, (rank + 1) * c), (late * c, (late + 1) * c)]


def _is_torch(x) -> bool:
    return isinstance(x, torch.Tensor)


def shard(x, rank: int, world_size: int, layout: str = "zigzag"):
    """This rank's part of ``x`` along the sequence axis (−2), as a contiguous copy.

    Parameters
    ----------
    x : torch.Tensor or numpy.ndarray, shape (..., N, d)
        The full sequence (queries, keys, values, or a gradient of the output).
    rank, world_size : int
        0 ≤ rank < world_size.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        ``"contiguous"``: tokens [r·N/W, (r+1)·N/W). ``"zigzag"``: chunks r and 2W − 1 − r of 2W equal chunks,
        concatenated in that order.

    Returns
    -------
    The shard, shape (..., N/W, d), the same kind (tensor or array) as ``x``; a tensor keeps its autograd
    history (slicing and concatenation are differentiable).

    Raises
    ------
    ValueError
        N not divisible by W (contiguous) or 2W (zigzag), a rank outside [0, W), an unknown layout, or ``x`` with
        fewer than 2 axes. TypeError: ``x`` neither a tensor nor an array.
    """
    if not (_is_torch(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"x must be a torch.Tensor or a numpy.ndarray, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., N, d) with at least 2 axes, got shape {tuple(x.shape)}")
    ranges = chunk_ranges(x.shape[-2], rank, world_size, layout)
    pieces = [x[..., a:b, :] for a, b in ranges]
    if _is_torch(x):
        return torch.cat(pieces, dim=-2).contiguous()
    return np.ascontiguousarray(np.concatenate(pieces, axis=-2))


def unshard(shards, layout: str = "zigzag"):
    """The full sequence from the shards of ranks 0 … W − 1 (W = ``len(shards)``): the inverse of :func:`shard`.

    Parameters
    ----------
    shards : sequence of torch.Tensor or numpy.ndarray, each shape (..., N/W, d)
        Rank r's shard at position r; all of one kind and one shape.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        The layout the shards were cut with.

    Returns
    -------
    Shape (..., N, d), tokens in their global order.

    Raises
    ------
    ValueError
        No shards, shards of different shapes, an odd shard length under ``"zigzag"``, an unknown layout.
    """
    layout = _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold one shard per rank, got none")
    torch_kind = _is_torch(shards[0])
    for r, s in enumerate(shards):
        if not (_is_torch(s) or isinstance(s, np.ndarray)) or _is_torch(s) != torch_kind:
            raise TypeError(f"shards must be all torch.Tensor or all numpy.ndarray; shard {r} is "
                            f"{type(s).__name__}")
        if s.ndim < 2:
            raise ValueError(f"shard {r} must have shape (..., N_local, d), got {tuple(s.shape)}")
        if tuple(s.shape) != tuple(shards[0].shape):
            raise ValueError(f"shards must all have one shape; shard 0 has {tuple(shards[0].shape)}, shard {r} "
                             f"has {tuple(s.shape)}")
    W, n = len(shards), shards[0].shape[-2]
    if layout == "contiguous":
        pieces = shards
    else:
        if n % 2:
            raise ValueError(f"zigzag shards hold two equal chunks, so their length must be even; got N_local = {n}")
        c = n // 2
        # Global chunk j < W is the first half of shard j; chunk j ≥ W the second half of shard 2W − 1 − j.
        pieces = [shards[j][..., :c, :] if j < W else shards[2 * W - 1 - j][..., c:, :] for j in range(2 * W)]
    if torch_kind:
        return torch.cat(pieces, dim=-2)
    return np.concatenate(pieces, axis=-2)


# ----------------------------------------------------------------------------------------------------------------
# Instrumentation
# ----------------------------------------------------------------------------------------------------------------

_TRACES = threading.local()


class _Trace:
    """One active :func:`trace`: its list of records, whether it records backward steps, whether it is open."""

    __slots__ = ("records", "backward", "open")

    def __init__(self, backward: bool):
        self.records: list[dict] = []
        self.backward = backward
        self.open = True


def _active_traces() -> list:
    if not hasattr(_TRACES, "stack"):
        _TRACES.stack = []
    return _TRACES.stack


@contextlib.contextmanager
def trace(backward: bool = False):
    """Record, for the calling rank, one dict per ring step of every :func:`ring_attention` call.

    ::

        with cp.trace() as steps:
            o = cp.ring_attention(q_local, k_local, v_local, causal=True)
        # steps: W dicts for this rank, in step order

        with cp.trace(backward=True) as steps:
            o = cp.ring_attention(q_local, k_local, v_local, causal=True)
            o.backward(dO)
        # steps: W forward dicts, then W backward dicts, each with a "pass" key

    Parameters
    ----------
    backward : bool, default False
        Also record the steps of the backward passes (the autograd backward of a ring run inside the trace, or
        run while it is open), and give every record a ``"pass"`` key, ``"forward"`` or ``"backward"``.

    The context yields a list; each forward call made while it is active appends W dicts (one per step
    s = 0 … W − 1, in order) with exactly these keys:

    ``"rank"`` : int
        The calling rank, in the group (0 ≤ rank < W).
    ``"step"`` : int
        The ring step s, 0 … W − 1.
    ``"source_rank"`` : int
        The rank (in the group) whose K/V block this step computes with: (rank − step) mod W. Step 0 is the
        rank's own block.
    ``"flops"`` : int
        Matmul FLOPs this step actually computed, over the whole local batch and all query heads:
        ``2·(d + d_v)·visible·B·H_q`` — the project's convention (:func:`fa2edu.flops.model_flops`: 4·d per score
        when d_v = d, for S = QKᵀ and O = PV), counted on the **visible** score entries only: on a causal diagonal
        block the masked half is not counted (the triangle including its diagonal, c(c+1)/2 entries for a c × c
        chunk), and a skipped step counts 0. With B = H_q = 1 it is the count per (batch, head).
    ``"visible"`` : int
        The visible (unmasked) (query, key) score entries of this step, per (batch, query head): c² for a fully
        visible c × c chunk pair, c(c+1)/2 for a diagonal one, 0 when skipped.
    ``"elements_sent"`` : int
        K and V elements this rank sends to rank (rank + 1) mod W during this step (the block it holds, posted
        before the step's computation so the two overlap): ``B·H_kv·N_local·(d + d_v)`` at steps 0 … W − 2, and 0
        at the last step (nothing left to pass on) and when W = 1.
    ``"elements_received"`` : int
        K and V elements this rank receives from rank (rank − 1) mod W during this step (the block of the next
        step): the same figure as ``"elements_sent"``.
    ``"skipped"`` : bool
        True when no query of this rank sees any key of the block (causal only): the step computes nothing, its
        ``"flops"`` and ``"visible"`` are 0, and the block still travels on.

    With ``backward=True`` each backward pass appends W more dicts, one per step of the backward ring, with the
    keys above (``"elements_sent"``/``"elements_received"``: the K/V block again, at steps 0 … W − 2) meaning the
    same, except:

    ``"flops"`` : int
        The backward's matmul FLOPs on the visible entries, ``(6·d + 4·d_v)·visible·B·H_q``: five products
        (S = QKᵀ, dV = PᵀdO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀQ), 2.5 times the forward's when d_v = d.
    ``"grad_elements_sent"`` : int
        dK and dV accumulator elements sent to rank + 1 after the step's computation, ``B·H_kv·N_local·(d + d_v)``
        at every step when W > 1 (W transfers: the last one brings every block's gradients home), 0 when W = 1.
        They travel in the compute dtype: float32 (4 bytes), float64 for float64 inputs.
    ``"grad_elements_received"`` : int
        The accumulators received from rank − 1 in the same exchange: the same figure.
    ``"pass"`` : str
        ``"backward"`` (and ``"forward"`` on the forward records of such a trace).

    Traces nest: every active trace receives every record. Per thread for the forward; a backward is recorded by
    the traces that were open around its forward call and are still open, and by those open in the thread that
    runs it (PyTorch runs the backward of CUDA tensors on a thread of its own).
    """
    if not isinstance(backward, (bool, np.bool_)):
        raise TypeError(f"backward must be a bool, got {type(backward).__name__}")
    entry = _Trace(bool(backward))
    stack = _active_traces()
    stack.append(entry)
    try:
        yield entry.records
    finally:
        entry.open = False
        # Remove this very trace (by identity).
        del stack[next(i for i, t in enumerate(stack) if t is entry)]


def _record(entry: dict, pass_: str = "forward", traces=()) -> None:
    """Append ``entry`` to the open traces of this thread and to ``traces`` (those open around the forward call
    of a backward); backward steps go only to traces opened with ``backward=True``."""
    targets, seen = [], set()
    for t in list(_active_traces()) + list(traces):
        if t.open and id(t) not in seen:
            seen.add(id(t))
            targets.append(t)
    for t in targets:
        if t.backward:
            t.records.append(dict(entry, **{"pass": pass_}))
        elif pass_ == "forward":
            t.records.append(dict(entry))


# ----------------------------------------------------------------------------------------------------------------
# Which part of a step is computed: FA2 Section 3.1.1's three kinds of blocks, between ranks
# ----------------------------------------------------------------------------------------------------------------

class PlanItem(NamedTuple):
    """One block computation of a ring step.

    Attributes
    ----------
    rows : tuple of int
        ``(a, b)``: the local query rows [a, b) of this rank.
    keys : int
        The computation uses the first ``keys`` rows of the K/V block held.
    causal : bool
        A bottom-right causal mask inside (the query chunk's own diagonal is the last b − a of those keys).
    visible : int
        The visible (query, key) score entries, per (batch, head).
    """
    rows: tuple[int, int]
    keys: int
    causal: bool
    visible: int


def step_plan(N: int, rank: int, source_rank: int, world_size: int, layout: str, causal: bool) -> list[PlanItem]:
    """What ``rank`` computes at the ring step that holds ``source_rank``'s K/V block (an empty list: skipped).

    Parameters
    ----------
    N : int
        The global sequence length.
    rank : int
        The rank whose queries are computed.
    source_rank : int
        The rank whose K/V block is held.
    world_size : int
        W.
    layout : {"zigzag", "contiguous"}
        The layout of both ranks' tokens.
    causal : bool
        Causal mask on global positions (else every query sees every key).

    Returns
    -------
    list of PlanItem
        Disjoint block computations that together cover exactly the visible (query, key) pairs.

    Not causal: every query sees every key, one item. Causal (query at global position i sees key j iff j ≤ i):
    for each query chunk [q_a, q_b) the rank holds, the keys of the block it can see are those at positions
    ≤ q_b − 1; both ranks store their tokens in ascending order, so these are a *prefix* of the block. If every one
    of them is at a position ≤ q_a the chunk sees them all (no mask); otherwise the block holds the chunk's own
    diagonal [q_a, q_b) as the prefix's last q_b − q_a keys, and the mask is the bottom-right causal one. Adjacent
    query chunks that see the same prefix unmasked are merged into one item. Cost: O(W) integer arithmetic.
    """
    query_chunks = chunk_ranges(N, rank, world_size, layout)
    key_chunks = chunk_ranges(N, source_rank, world_size, layout)
    n_local = sum(b - a for a, b in query_chunks)
    if not causal:
        return [PlanItem((0, n_local), n_local, False, n_local * n_local)]

    def keys_in(lo: int, hi: int) -> int:                 # keys of the block at global positions [lo, hi)
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in key_chunks)

    items: list[PlanItem] = []
    offset = 0
    for q_a, q_b in query_chunks:
        c = q_b - q_a
        rows = (offset, offset + c)
        offset += c
        n_visible = keys_in(0, q_b)                       # keys at positions ≤ q_b − 1: a prefix of the block
        if n_visible == 0:                                 # the chunk sees nothing: skipped
            continue
        if keys_in(q_a + 1, q_b) == 0:                     # every visible key is at or before the first query
            items.append(PlanItem(rows, n_visible, False, c * n_visible))
            continue
        # The diagonal: the block must hold all of [q_a, q_b) (true for both layouts: chunks are aligned).
        if keys_in(q_a, q_b) != c:
            raise RuntimeError(f"internal: query chunk {(q_a, q_b)} meets a key chunk that is not aligned with it "
                               f"({key_chunks})")
        items.append(PlanItem(rows, n_visible, True, c * (n_visible - c) + c * (c + 1) // 2))
    # Adjacent chunks seeing the same keys without a mask: one call instead of two.
    merged: list[PlanItem] = []
    for item in items:
        last = merged[-1] if merged else None
        if (last is not None and not last.causal and not item.causal and last.keys == item.keys
                and last.rows[1] == item.rows[0]):
            merged[-1] = PlanItem((last.rows[0], item.rows[1]), item.keys, False, last.visible + item.visible)
        else:
            merged.append(item)
    return merged


# ----------------------------------------------------------------------------------------------------------------
# One step's arithmetic: a whole-block FA2 step in PyTorch, and the merge
# ----------------------------------------------------------------------------------------------------------------

def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The project's rule: float64 computes in float64, every other dtype in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bottom_right_visible(n_q: int, n_k: int, device) -> torch.Tensor:
    """(n_q, n_k) booleans: query i sees key j iff j ≤ i + n_k − n_q (the project's causal convention)."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


def block_attention(q, k, v, causal: bool = False, scale=None):
    """One whole-block attention step, returning the normalised output and its log-sum-exp: ``(O, L)``.

    ``S = τ·Q Kᵀ`` (masked bottom-right causal when ``causal``), ``m = rowmax(S)``, ``P̃ = exp(S − m)``,
    ``ℓ = rowsum(P̃)``, ``O = P̃V / ℓ``, ``L = m + log ℓ`` (FA2 Alg. 1 lines 8-10 and 12-13 on one block pair).
    A row that sees no key gets O = 0 and L = +inf (the project's convention), never NaN.

    Parameters
    ----------
    q : torch.Tensor, shape (B, H_q, n, d)
        The block's queries.
    k : torch.Tensor, shape (B, H_kv, m, d)
        The block's keys, H_q a multiple of H_kv (GQA: query head h reads K/V head h // (H_q / H_kv); K and V are
        not copied).
    v : torch.Tensor, shape (B, H_kv, m, d_v)
        The block's values.
    causal : bool, default False
        Bottom-right aligned: query i sees key j iff j ≤ i + m − n.
    scale : float, optional
        τ, default None: 1/√d.

    Returns
    -------
    (O, L) : tuple of torch.Tensor
        O (B, H_q, n, d_v) and L (B, H_q, n), both in the compute dtype (float64 for float64 inputs, else
        float32).

    Cost: 2·n·m·(d + d_v) FLOPs per (batch, head) and an n × m score tile in memory (the whole block at once:
    the GPU kernels tile it, this one does not).
    """
    work = _work_dtype(q.dtype)
    B, H_q, n, d = q.shape
    H_kv, m, d_v = k.shape[1], k.shape[2], v.shape[-1]
    tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # GQA: query heads grouped by the K/V head they read, (B, H_kv, G, n, d); K, V broadcast over the group.
    qg = q.to(work).reshape(B, H_kv, H_q // H_kv, n, d)
    kg, vg = k.to(work).unsqueeze(2), v.to(work).unsqueeze(2)
    # Line 8: S = τ Q Kᵀ, −inf where masked.
    S = tau * (qg @ kg.transpose(-1, -2))
    if causal:
        S = S.masked_fill(~_bottom_right_visible(n, m, q.device), -math.inf)
    # Line 9: m = rowmax(S); guard m = −inf (a row that sees nothing) before exp(S − m).
    row_max = S.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    P = torch.exp(S - row_max)
    ell = P.sum(dim=-1, keepdim=True)
    # Line 12: O = P̃V / ℓ; guard ℓ = 0 before dividing (O = 0 there).
    empty = ell == 0
    O = (P @ vg) / torch.where(empty, torch.ones_like(ell), ell)
    # Line 13: L = m + log ℓ, +inf on rows that saw no key.
    L = torch.where(empty, torch.full_like(ell, math.inf), row_max + torch.log(ell))
    return O.reshape(B, H_q, n, d_v), L.reshape(B, H_q, n)


def block_attention_backward(q, k, v, dO, L, D, causal: bool = False, scale=None):
    """One block's share of the gradients, FA2 Alg. 2 lines 11-20 on a whole block pair: ``(dQ, dK, dV)``.

    ``P = exp(τ·Q Kᵀ − L)`` from the **global** log-sum-exp L of the rows (so P is this block's part of the full
    softmax), ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP − D)`` with the global ``D = rowsum(dO ∘ O)``,
    ``dQ = τ dS K``, ``dK = τ dSᵀ Q``. Rows with L = +inf have P = 0 and get zero gradients.

    Parameters
    ----------
    q : torch.Tensor, shape (B, H_q, n, d)
        The block's queries.
    k : torch.Tensor, shape (B, H_kv, m, d)
        The block's keys (H_q a multiple of H_kv).
    v : torch.Tensor, shape (B, H_kv, m, d_v)
        The block's values.
    dO : torch.Tensor, shape (B, H_q, n, d_v)
        The gradient of the rows' final output.
    L : torch.Tensor, shape (B, H_q, n)
        The rows' log-sum-exp over *all* keys (+inf on rows that see none).
    D : torch.Tensor, shape (B, H_q, n)
        rowsum(dO ∘ O) with the rows' final output O.
    causal : bool, default False
        Bottom-right aligned, as in :func:`block_attention`.
    scale : float, optional
        τ, default None: 1/√d.

    Returns
    -------
    (dQ, dK, dV) : tuple of torch.Tensor
        dQ (B, H_q, n, d) and dK, dV (B, H_kv, m, ·) summed over each GQA group, in the compute dtype.

    Cost: 4·n·m·(d + d_v) + 2·n·m·d FLOPs per (batch, head) (five matmuls when d_v = d), an n × m tile in memory.
    """
    work = _work_dtype(q.dtype)
    B, H_q, n, d = q.shape
    H_kv, m, d_v = k.shape[1], k.shape[2], v.shape[-1]
    G = H_q // H_kv
    tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qg = q.to(work).reshape(B, H_kv, G, n, d)
    kg, vg = k.to(work).unsqueeze(2), v.to(work).unsqueeze(2)
    dOg = dO.to(work).reshape(B, H_kv, G, n, d_v)
    Lg = L.to(work).reshape(B, H_kv, G, n, 1)
    Dg = D.to(work).reshape(B, H_kv, G, n, 1)
    # Lines 11-13: S = τ Q Kᵀ (masked), P = exp(S − L); exp(−inf) = 0 covers masked entries and L = +inf rows.
    S = tau * (qg @ kg.transpose(-1, -2))
    if causal:
        S = S.masked_fill(~_bottom_right_visible(n, m, q.device), -math.inf)
    P = torch.exp(S - Lg)
    # Line 14: dV_j += Pᵀ dO (summed over the query heads of the group).
    dV = (P.transpose(-1, -2) @ dOg).sum(dim=2)
    # Lines 15-16: dP = dO Vᵀ, dS = P ∘ (dP − D).
    dS = P * (dOg @ vg.transpose(-1, -2) - Dg)
    # Line 18: dQ_i += τ dS K.   Line 19: dK_j += τ dSᵀ Q (FA2 prints Q dSᵀ: erratum 1).
    dQ = tau * (dS @ kg)
    dK = tau * (dS.transpose(-1, -2) @ qg).sum(dim=2)
    return dQ.reshape(B, H_q, n, d), dK, dV


def merge_attention_states(O_a, L_a, O_b, L_b):
    """The torch twin of :func:`fa2edu.merge_attention_states` (its specification), same rule, same guards.

    ``L = log(e^{L_a} + e^{L_b})``, ``O = e^{L_a − L}·O_a + e^{L_b − L}·O_b``, computed as (m, ℓ) statistics:
    the larger log-sum-exp is the maximum m, so every exponential has a non-positive argument. A side with
    L = +inf (it saw no key) is empty: the merge returns the other side; two empty sides give O = 0, L = +inf.

    Parameters
    ----------
    O_a, O_b : torch.Tensor, shape (..., N, d_v)
        The two sides' normalised outputs (0 on rows where a side saw no key).
    L_a, L_b : torch.Tensor, shape (..., N)
        Their log-sum-exps, +inf on rows where a side saw no key.

    Returns
    -------
    (O, L) : tuple of torch.Tensor
        In float64 when any input is float64, else float32 (the merge's compute dtype).

    Cost per row: 2 exponentials, 1 logarithm, about 3·d_v + 8 other FLOPs.
    """
    work = torch.float64 if torch.float64 in (O_a.dtype, L_a.dtype, O_b.dtype, L_b.dtype) else torch.float32
    O_a, L_a, O_b, L_b = (t.to(work) for t in (O_a, L_a, O_b, L_b))
    # A side's statistics: (m, ℓ) = (L, 1), or (−inf, 0) when it is empty (L = +inf).
    m_a = torch.where(torch.isposinf(L_a), torch.full_like(L_a, -math.inf), L_a)
    m_b = torch.where(torch.isposinf(L_b), torch.full_like(L_b, -math.inf), L_b)
    # FA1 Alg. 1 line 11: m = max(m_a, m_b), guarded where both sides are empty (m = −inf).
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e_a, e_b = torch.exp(m_a - m_safe), torch.exp(m_b - m_safe)      # e^{m_a − m}·ℓ_a with ℓ_a = 1 (or 0)
    ell = e_a + e_b
    ell_safe = torch.where(ell == 0, torch.ones_like(ell), ell)       # guard ℓ = 0 before dividing
    # FA1 Alg. 1 line 12 on whole partials, weights e^{L_a − L} and e^{L_b − L}.
    O = (e_a / ell_safe).unsqueeze(-1) * O_a + (e_b / ell_safe).unsqueeze(-1) * O_b
    # FA2 Alg. 1 line 13: L = m + log ℓ, +inf where both sides are empty.
    L = torch.where(ell == 0, torch.full_like(ell, math.inf), m_safe + torch.log(ell_safe))
    return O, L


# ----------------------------------------------------------------------------------------------------------------
# CUDA tensors: the step on kernels_gpu's fastest kernels (needs a GPU; isolated here)
# ----------------------------------------------------------------------------------------------------------------

def step_backend(device: torch.device, dtype: torch.dtype) -> str | None:
    """The backend of ``fa2edu.torch.flash_attention`` that computes a ring step on ``device`` in ``dtype``: the op's
    own choice for CUDA tensors (``fa2edu._torch_ops.DISPATCH``: float16/bfloat16 → ``"tensorcore"``, which runs
    ``kernels_gpu.hopper``'s forward on an sm_90 GPU where it measured faster and the mma.sync ladder elsewhere,
    forward and backward on tensor cores; float32 → ``"3xtf32"``); None for CPU tensors and float64, which the
    PyTorch step (:func:`block_attention`) computes. So the ring runs the kernels the op runs, and gets faster when
    they do."""
    if device.type != "cuda":
        return None
    from fa2edu import _torch_ops
    return _torch_ops.DISPATCH.get(("cuda", dtype))


def _on_backend(pass_: str, backend: str, tensors, causal: bool, scale):
    """One step on the op's ``backend`` (:func:`step_backend`). Forward: ``tensors`` = (q, k, v) → (O, L), L float32
    in natural-log units, +inf on rows that see no key, the same bottom-right causal mask and GQA as
    :func:`block_attention`. Backward: (q, k, v, O, L, dO) with the *global* O and L of the rows, so that
    D = rowsum(dO ∘ O) and P = exp(S − L) are this block's part of the full softmax → (dQ, dK, dV), dK and dV
    summed over each GQA group. CPU tensors work too, in numba's CUDA simulator (how the tests run it)."""
    from fa2edu import _torch_ops
    q = tensors[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if pass_ == "forward":
        return _torch_ops.flash2_forward(backend, *tensors, causal, scale, None, None)
    q, k, v, O, L, dO = tensors
    return _torch_ops.flash2_backward(backend, q, k, v, O, L.to(torch.float32), dO, causal, scale, None, None)


def _step_forward(q, k, v, causal: bool, scale):
    """(O, L) of one plan item, on the op's kernels for CUDA tensors, else in PyTorch."""
    backend = step_backend(q.device, q.dtype)
    if backend is not None:
        return _on_backend("forward", backend, (q, k, v), causal, scale)
    return block_attention(q, k, v, causal=causal, scale=scale)


def _step_backward(q, k, v, O, L, D, dO, causal: bool, scale):
    """(dQ, dK, dV) of one plan item, on the op's kernels for CUDA tensors, else in PyTorch."""
    backend = step_backend(q.device, q.dtype)
    if backend is not None:
        return _on_backend("backward", backend, (q, k, v, O, L, dO), causal, scale)
    return block_attention_backward(q, k, v, dO, L, D, causal=causal, scale=scale)


# ----------------------------------------------------------------------------------------------------------------
# The ring: point-to-point exchanges with the neighbours
# ----------------------------------------------------------------------------------------------------------------

class _Ring:
    """A process group seen as a ring: this rank sends to (rank + 1) mod W and receives from (rank − 1) mod W."""

    def __init__(self, group):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = (self.rank + 1) % self.world_size
        self.prev = (self.rank - 1) % self.world_size

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def exchange(self, tensors, tag: int) -> "_Pending":
        """Post, without waiting, the send of ``tensors`` to the next rank and the receive of as many tensors of
        the same shapes from the previous rank (tags ``tag``, ``tag + 1``, …)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self._global(self.next), self.group, tag + i)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self._global(self.prev), self.group, tag + i)
                for i, t in enumerate(received)]
        return _Pending(dist.batch_isend_irecv(ops), received)


class _Pending:
    """Transfers in flight; ``wait()`` returns the received tensors once the sends and receives are done."""

    def __init__(self, works, received):
        self.works, self.received = works, received

    def wait(self):
        for work in self.works:
            work.wait()
        return self.received


_KV_TAG, _GRAD_TAG = 0, 2          # K, V travel with tags 0, 1; the dK, dV accumulators with tags 2, 3


# ----------------------------------------------------------------------------------------------------------------
# Forward and backward around the ring
# ----------------------------------------------------------------------------------------------------------------

def _ring_forward(q, k, v, causal: bool, scale, ring: _Ring, layout: str):
    """The forward ring: returns O in q's dtype and L (B, H_q, n) in the compute dtype."""
    B, H_q, n, _ = q.shape
    H_kv, d, d_v = k.shape[1], k.shape[-1], v.shape[-1]
    W, rank = ring.world_size, ring.rank
    N = n * W
    work = _work_dtype(q.dtype)
    # FA2 Alg. 1 line 5, one level up: O = 0, L = +inf (the empty partial, the merge's identity).
    O = torch.zeros(B, H_q, n, d_v, dtype=work, device=q.device)
    L = torch.full((B, H_q, n), math.inf, dtype=work, device=q.device)
    block = (k.contiguous(), v.contiguous())
    kv_elements = B * H_kv * n * (d + d_v)
    for step in range(W):
        source = (rank - step) % W
        # Send the block held to the next rank and receive the next one, posted before this step's compute so
        # the transfer runs under it (the last step has nothing to pass on).
        pending = ring.exchange(block, _KV_TAG) if step < W - 1 else None
        # FA2 Alg. 1 lines 6-11 with the K/V block of `source`: only the parts the causal mask leaves visible.
        plan = step_plan(N, rank, source, W, layout, causal)
        for item in plan:
            a, b = item.rows
            O_j, L_j = _step_forward(q[:, :, a:b], block[0][:, :, :item.keys], block[1][:, :, :item.keys],
                                     item.causal, scale)
            # Merge the step's partial into the running one (FA1 Section 3.1), in the compute dtype.
            O[:, :, a:b], L[:, :, a:b] = merge_attention_states(O[:, :, a:b], L[:, :, a:b], O_j.to(work),
                                                                L_j.to(work))
        visible = sum(item.visible for item in plan)
        sent = kv_elements if pending is not None else 0
        _record({"rank": rank, "step": step, "source_rank": source, "flops": 2 * (d + d_v) * visible * B * H_q,
                 "visible": visible, "elements_sent": sent, "elements_received": sent, "skipped": not plan})
        if pending is not None:
            block = tuple(pending.wait())
    return O.to(q.dtype), L


def _ring_backward(dO, q, k, v, O, L, causal: bool, scale, ring: _Ring, layout: str, traces=()):
    """The backward ring: dQ computed locally, dK, dV accumulated as they travel back to their owners. Each step
    is recorded (:func:`trace` with ``backward=True``) in the traces of this thread and in ``traces``."""
    B, H_q, n, _ = q.shape
    H_kv, d, d_v = k.shape[1], k.shape[-1], v.shape[-1]
    W, rank = ring.world_size, ring.rank
    N = n * W
    work = _work_dtype(q.dtype)
    dO = dO.contiguous()
    # FA2 Alg. 2 line 4 (once per rank, over its own rows): D = rowsum(dO ∘ O).
    D = (dO.to(work) * O.to(work)).sum(dim=-1)
    dQ = torch.zeros(q.shape, dtype=work, device=q.device)
    block = (k.contiguous(), v.contiguous())
    grads_in_flight = None
    for step in range(W):
        source = (rank - step) % W
        pending = ring.exchange(block, _KV_TAG) if step < W - 1 else None
        # This step's share of the gradients of `source`'s K and V, in the compute dtype.
        dK = torch.zeros(block[0].shape, dtype=work, device=q.device)
        dV = torch.zeros(block[1].shape, dtype=work, device=q.device)
        plan = step_plan(N, rank, source, W, layout, causal)
        for item in plan:
            a, b, m = item.rows[0], item.rows[1], item.keys
            dQ_j, dK_j, dV_j = _step_backward(q[:, :, a:b], block[0][:, :, :m], block[1][:, :, :m],
                                              O[:, :, a:b], L[:, :, a:b], D[:, :, a:b], dO[:, :, a:b],
                                              item.causal, scale)
            # FA2 Alg. 2 line 18 (dQ_i += τ dS K, kept here) and line 19-20's dK_j, dV_j (sent on).
            dQ[:, :, a:b] += dQ_j.to(work)
            dK[:, :, :m] += dK_j.to(work)
            dV[:, :, :m] += dV_j.to(work)
        # The block's accumulators arrive from the previous rank (the shares of the ranks it visited before);
        # add this rank's share and pass them on, again overlapping the next step's compute.
        if grads_in_flight is not None:
            dK_in, dV_in = grads_in_flight.wait()
            dK, dV = dK + dK_in, dV + dV_in
        if W > 1:
            grads_in_flight = ring.exchange((dK, dV), _GRAD_TAG)
        visible = sum(item.visible for item in plan)
        sent = B * H_kv * n * (d + d_v) if pending is not None else 0
        grads_sent = B * H_kv * n * (d + d_v) if W > 1 else 0
        # FA2 Alg. 2's five products per visible entry: S, dV, dP, dQ, dK (2·d, 2·d_v, 2·d_v, 2·d, 2·d FLOPs).
        _record({"rank": rank, "step": step, "source_rank": source, "flops": (6 * d + 4 * d_v) * visible * B * H_q,
                 "visible": visible, "elements_sent": sent, "elements_received": sent, "skipped": not plan,
                 "grad_elements_sent": grads_sent, "grad_elements_received": grads_sent}, "backward", traces)
        if pending is not None:
            block = tuple(pending.wait())
    # After W hops the accumulators that arrive are those of this rank's own block, complete.
    if grads_in_flight is not None:
        dK, dV = grads_in_flight.wait()
    return dQ.to(q.dtype), dK.to(k.dtype), dV.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention as an autograd Function: the forward saves q, k, v, O and L (FA2 saves only O and L of
    the attention itself); the backward runs the ring again."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, ring, layout):
        O, L = _ring_forward(q, k, v, causal, scale, ring, layout)
        ctx.save_for_backward(q, k, v, O, L)
        ctx.config = (causal, scale, ring, layout)
        # The traces that record backward steps, open now: the backward may run on another thread.
        ctx.traces = tuple(t for t in _active_traces() if t.backward)
        return O

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO):
        q, k, v, O, L = ctx.saved_tensors
        dQ, dK, dV = _ring_backward(dO, q, k, v, O, L, *ctx.config, traces=ctx.traces)
        return dQ, dK, dV, None, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# The public entry point
# ----------------------------------------------------------------------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _local_problem(q, k, v, causal, scale, layout) -> str | None:
    """What is wrong with this rank's arguments (a message), or None."""
    for name, t in (("q_local", q), ("k_local", k), ("v_local", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.ndim < 3:
            return f"{name} must have shape (B, H, N_local, d) (at least 3 axes), got {tuple(t.shape)}"
        if t.dtype not in _DTYPES:
            return f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q_local, k_local, v_local must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q_local, k_local, v_local must be on one device, got {q.device}, {k.device}, {v.device}"
    if not (q.ndim == k.ndim == v.ndim) or not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        return (f"q_local, k_local, v_local must share their batch axes (..., H, N_local, d); got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        return f"k_local's head dimension d = {k.shape[-1]} differs from q_local's d = {q.shape[-1]}"
    if k.shape[-2] != v.shape[-2] or k.shape[-3] != v.shape[-3]:
        return f"k_local {tuple(k.shape)} and v_local {tuple(v.shape)} must have the same heads and length"
    if k.shape[-2] != q.shape[-2]:
        return (f"q_local and k_local must hold the same number of tokens (N_q = N_k globally, one layout); got "
                f"N_local = {q.shape[-2]} and {k.shape[-2]}")
    if q.shape[-3] % k.shape[-3]:
        return f"H_q = {q.shape[-3]} query heads must be a multiple of H_kv = {k.shape[-3]} key/value heads"
    if min(q.shape[-2], q.shape[-1], v.shape[-1]) < 1 or 0 in (q.numel(), k.numel(), v.numel()):
        return f"empty shards: q_local {tuple(q.shape)}, k_local {tuple(k.shape)}, v_local {tuple(v.shape)}"
    if not isinstance(causal, (bool, np.bool_)):
        return f"causal must be a bool, got {type(causal).__name__}"
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if layout == "zigzag" and q.shape[-2] % 2:
        return (f"the zigzag layout gives each rank two equal chunks, so N_local must be even (N divisible by "
                f"2W); got N_local = {q.shape[-2]}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            return f"scale must be a positive float or None, got {type(scale).__name__}"
        if not (math.isfinite(scale) and scale > 0):
            return f"scale must be a positive finite float or None, got {scale}"
    return None


_NAMES = ("q_local", "k_local", "v_local")
_CHECK_TAG = 4                     # the exact score check's K blocks (tags 0-3 are the ring's own)
_HEADER_AXES = 8                   # shape entries per tensor in the numeric header (more axes: the leading folded)
_AGREED = ("shapes", "dtype", "device", "causal", "scale", "layout", "grad")


def _summary(q, k, v, causal, scale, layout, problem) -> dict:
    """What this rank tells the others before the ring starts: its arguments' metadata, which of its shards hold
    NaN or inf, and the largest |q| and |k| (for the overflow bound). One pass over each shard (``amax`` of |x|,
    which is NaN or inf exactly when x holds one) and, on a GPU, one synchronisation."""
    if problem:
        return {"problem": problem, **{key: None for key in _AGREED}, "nonfinite": (), "max_q": 0.0,
                "max_k": 0.0}
    tensors = (q, k, v)
    largest = torch.stack([t.detach().abs().amax().double() for t in tensors]).tolist()
    return {"problem": None,
            "shapes": tuple(tuple(t.shape) for t in tensors),
            "dtype": str(q.dtype),
            "device": q.device.type,
            "causal": bool(causal),
            "scale": None if scale is None else float(scale),
            "layout": layout,
            "grad": bool(torch.is_grad_enabled() and any(t.requires_grad for t in tensors)),
            "nonfinite": tuple(name for name, x in zip(_NAMES, largest) if not math.isfinite(x)),
            "max_q": largest[0] if math.isfinite(largest[0]) else 0.0,
            "max_k": largest[1] if math.isfinite(largest[1]) else 0.0}


def _header_device(group) -> torch.device:
    """Where a tensor for a collective of ``group`` must live: the CPU for gloo, this rank's GPU for NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _axes(shape: tuple) -> list[float]:
    """A shape in the header: its rank, then _HEADER_AXES entries (leading axes folded into their product)."""
    if len(shape) > _HEADER_AXES:
        shape = (math.prod(shape[:len(shape) - _HEADER_AXES + 1]),) + tuple(shape[-(_HEADER_AXES - 1):])
    return [float(len(shape))] + [float(n) for n in shape] + [-1.0] * (_HEADER_AXES - len(shape))


def _encode(summary: dict) -> list[float]:
    """A summary as a fixed-length row of float64 (all exact: small integers, codes, the scale, two maxima)."""
    if summary["problem"]:
        return [1.0] + [0.0] * (_HEADER_FIELDS - 1)
    dtypes, layouts, devices = [str(t) for t in _DTYPES], list(LAYOUTS), ["cpu", "cuda"]
    scale = summary["scale"]
    row = [0.0, float(dtypes.index(summary["dtype"])),
           float(devices.index(summary["device"])) if summary["device"] in devices else 2.0,
           float(summary["causal"]), float(scale is not None), 0.0 if scale is None else scale,
           float(layouts.index(summary["layout"])), float(summary["grad"]),
           float(sum(1 << i for i, name in enumerate(_NAMES) if name in summary["nonfinite"])),
           summary["max_q"], summary["max_k"]]
    for shape in summary["shapes"]:
        row += _axes(shape)
    return row


_HEADER_FIELDS = 11 + 3 * (1 + _HEADER_AXES)


def _decode(row: list[float]) -> dict:
    """The inverse of :func:`_encode` (shapes with more than _HEADER_AXES axes come back folded)."""
    if row[0]:
        return {"problem": "its own error names them", **{key: None for key in _AGREED},
                "nonfinite": (), "max_q": 0.0, "max_k": 0.0}
    shapes = []
    for i in range(3):
        at = 11 + i * (1 + _HEADER_AXES)
        shapes.append(tuple(int(n) for n in row[at + 1:at + 1 + int(row[at])]))
    return {"problem": None, "shapes": tuple(shapes), "dtype": str(_DTYPES[int(row[1])]),
            "device": ("cpu", "cuda", "other")[int(row[2])], "causal": bool(row[3]),
            "scale": row[5] if row[4] else None, "layout": LAYOUTS[int(row[6])], "grad": bool(row[7]),
            "nonfinite": tuple(name for i, name in enumerate(_NAMES) if int(row[8]) >> i & 1),
            "max_q": row[9], "max_k": row[10]}


def _exchange_summaries(mine: dict, ring: "_Ring", group, check: bool) -> list[dict]:
    """Every rank's summary, in group order. ``check=True``: gathered as Python objects (each rank's problem in
    its own words); else as one fixed-size float64 header per rank (one small ``all_gather``), where another
    rank's problem is only flagged. Either way one collective, before any point-to-point transfer, so ranks that
    disagree raise instead of meeting mismatched buffers inside the ring (which gloo answers by aborting)."""
    if check:
        everyone: list = [None] * ring.world_size
        dist.all_gather_object(everyone, mine, group=group)
        return everyone
    device = _header_device(group)
    row = torch.tensor(_encode(mine), dtype=torch.float64, device=device)
    rows = [torch.empty_like(row) for _ in range(ring.world_size)]
    dist.all_gather(rows, row, group=group)
    everyone = [_decode(r.tolist()) for r in rows]
    everyone[ring.rank] = mine                       # this rank's problem in its own words
    return everyone


def _score_reach(q, k, ring: "_Ring", grow: float) -> float:
    """``max(1, τ)·max Σ_l |q_l k_l|`` over this rank's queries and **every** rank's keys: the exact quantity of
    :func:`fa2edu.validation.check_score_range`, with the K blocks passed once around the ring (float64, on the
    host). Run only when the cheap bound fails on every rank (it is computed from all-reduced maxima)."""
    from fa2edu.validation import largest_abs_dot
    B, H_q, n, d = q.shape
    H_kv = k.shape[1]
    Q = q.detach().double().cpu().numpy().reshape(B, H_kv, H_q // H_kv, n, d)    # GQA: head h·G + g meets h
    block, reach = k.detach().contiguous(), 0.0
    for step in range(ring.world_size):
        pending = ring.exchange((block,), _CHECK_TAG) if step < ring.world_size - 1 else None
        reach = max(reach, largest_abs_dot(Q, block.double().cpu().numpy()[:, :, None]))
        if pending is not None:
            (block,) = pending.wait()
    return grow * reach


def _check_agreement(everyone: list[dict]) -> None:
    """Raise the same ValueError on every rank (they all hold the same summaries) for bad arguments on any rank
    and for ranks that disagree on shapes, dtype, device kind, options or whether gradients are needed."""
    problems = [f"rank {r}: {p['problem']}" for r, p in enumerate(everyone) if p["problem"]]
    if problems:
        raise ValueError("ring_attention: bad arguments on " + "; ".join(problems))
    for key in _AGREED:
        values = [p[key] for p in everyone]
        if any(value != values[0] for value in values):
            listed = ", ".join(f"rank {r}: {value}" for r, value in enumerate(values))
            raise ValueError(f"ring_attention: the ranks disagree on {key} ({listed}); every rank must pass "
                             f"shards of one shape and dtype, with the same options")


def _check_values(everyone: list[dict], q, k, ring: "_Ring", group) -> None:
    """Raise the same error on every rank for NaN or inf in any rank's shards, and for scores τ·q·k (any rank's
    queries against any rank's keys) that would overflow the compute dtype — the contract of
    :func:`fa2edu.validation.check_score_range`, cheap bound first (from the ranks' largest |q| and |k|), exact
    only where it fails (one more pass of K around the ring and one all_reduce, on every rank alike)."""
    bad = [f"{' and '.join(p['nonfinite'])} on rank {r}" for r, p in enumerate(everyone) if p["nonfinite"]]
    if bad:
        raise ValueError(f"ring_attention: NaN or infinite values in {'; '.join(bad)}; attention inputs must be "
                         f"finite (every rank of the ring raises this error)")
    from fa2edu.validation import score_range_error
    work = np.float64 if q.dtype == torch.float64 else np.float32
    limit = float(np.finfo(work).max) / 2
    tau = 1.0 / math.sqrt(q.shape[-1]) if everyone[0]["scale"] is None else everyone[0]["scale"]
    grow = max(1.0, abs(tau))
    max_q, max_k = max(p["max_q"] for p in everyone), max(p["max_k"] for p in everyone)
    if q.shape[-1] * max_q * max_k * grow <= limit:
        return
    reach = torch.tensor([_score_reach(q, k, ring, grow)], dtype=torch.float64, device=_header_device(group))
    dist.all_reduce(reach, op=dist.ReduceOp.MAX, group=group)
    if float(reach) > limit:
        raise score_range_error(float(reach), tau, work, names=("q_local", "k_local"),
                                context=" (over every rank's shards)")


def ring_attention(q_local, k_local, v_local, causal: bool = False, scale=None, group=None,
                   layout: str = "zigzag", *, check: bool = True):
    """Attention over a sequence sharded across the ranks of a process group, K/V blocks passed around a ring.

    Call it on **every** rank of ``group`` with that rank's shards (cut by :func:`shard` with the same
    ``layout``); each rank gets its shard of ``softmax(τ·QKᵀ + mask)·V`` over the *whole* sequence — the result
    of single-device attention on the unsharded inputs, sharded the same way. Differentiable: the backward pass
    runs the ring again and returns to each rank the gradients of its own shards.

    Parameters
    ----------
    q_local : torch.Tensor, shape (B, H_q, N_local, d)
        This rank's queries (more leading batch axes are allowed). N_local = N / W.
    k_local : torch.Tensor, shape (B, H_kv, N_local, d)
        This rank's keys; H_q a multiple of H_kv (GQA/MQA: query head h reads K/V head h // (H_q / H_kv)).
    v_local : torch.Tensor, shape (B, H_kv, N_local, d_v)
        This rank's values.
    causal : bool, default False
        Causal mask on *global* positions (query i sees key j iff j ≤ i; N_q = N_k, so bottom-right and top-left
        alignment agree). Steps whose K/V block no query of the rank can see are skipped.
    scale : float, optional
        τ, default 1/√d.
    group : torch.distributed.ProcessGroup, optional
        The ranks of the ring, in their group order. Default: the world.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        How the sequence was sharded (see :func:`shard`); it decides which blocks a causal step can skip.
    check : bool, default True (keyword only)
        Before the ring, every rank always shares its shapes, dtype, device kind, options and a look at its values
        (whether each shard is finite, its largest ``|q|`` and ``|k|``), in one collective under the group's
        timeout, so that every rank raises the same clear error — never a hang, never an abort on mismatched
        buffers. ``True`` gathers them as Python objects (``all_gather_object``: every rank's bad arguments in
        its own words); ``False`` as one small float64 header per rank (``all_gather`` of a tensor, cheaper: a
        benchmark's choice), where the ranks see only *that* another rank's arguments are bad and that rank says
        which.

    Returns
    -------
    torch.Tensor, shape (B, H_q, N_local, d_v), in the inputs' dtype.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised. (With NCCL, also set each rank's CUDA device first,
        ``torch.cuda.set_device``: the agreement check gathers Python objects through it.)
    ValueError
        On every rank: bad arguments on any rank (each rank's problem is reported), ranks that disagree on
        shapes, dtype, device kind, causal, scale, layout or whether gradients are needed, an odd N_local
        under ``"zigzag"``, NaN or inf in any rank's q_local, k_local or v_local (naming the shard and rank).
    fa2edu.validation.AttentionOverflowError
        On every rank: finite shards whose scores τ·q·k (any rank's queries against any rank's keys) would
        overflow the compute dtype (float32, float64 for float64 inputs), naming q_local and k_local — as
        ``flash2_forward`` raises. A ValueError and an OverflowError.

    Notes
    -----
    Per rank and step: one block step of 2·N_local²·(d + d_v) FLOPs per (batch, head) at most (the causal plan
    computes only what is visible, see :func:`step_plan`), and B·H_kv·N_local·(d + d_v) K/V elements sent and
    received while it runs (W − 1 transfers in all). The backward pass: W steps of 5 matmuls, the same K/V
    transfers, and W transfers of the dK, dV accumulators (float32, float64 for float64 inputs). Partial results
    merge in float32 (float64 for float64 inputs). Memory per rank: two K/V blocks (the one computed on and the
    one arriving), and on CPU one N_local × N_local score tile per (batch, head) of a step. Before the ring, the
    checks read each shard once (``amax`` of its magnitudes: NaN or inf shows there, and the largest ``|q|``,
    ``|k|`` give the overflow bound; on a GPU, one synchronisation) and make one collective; only when the cheap
    bound ``d·max|q|·max|k|`` fails does K go once more around the ring for the exact check (float64, on the host).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention runs on a torch.distributed process group: call "
                           "torch.distributed.init_process_group(...) on every rank first")
    ring = _Ring(group)
    problem = _local_problem(q_local, k_local, v_local, causal, scale, layout)
    # One collective before any transfer, always: every rank's shapes, dtype and options, and a look at its values,
    # so that every rank raises the same clear error (never a hang, never gloo's abort on mismatched buffers).
    everyone = _exchange_summaries(_summary(q_local, k_local, v_local, causal, scale, layout, problem), ring,
                                   group, check)
    _check_agreement(everyone)
    # (..., H, N_local, d) → (B, H, N_local, d): the ring works on one flat batch axis.
    batch_shape = q_local.shape[:-3]
    q, k, v = (t.reshape((-1,) + tuple(t.shape[-3:])) for t in (q_local, k_local, v_local))
    _check_values(everyone, q, k, ring, group)
    O = _RingAttention.apply(q, k, v, bool(causal), None if scale is None else float(scale), ring, layout)
    return O.reshape(tuple(batch_shape) + tuple(O.shape[-3:]))
