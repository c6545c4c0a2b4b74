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
:func:`block_attention` (PyTorch, float32 or float64). CUDA tensors on NCCL: float32 steps run
``kernels_gpu.fast``'s fastest forward, float16/bfloat16 steps ``kernels_gpu.tensorcore.flash2_forward``
(see :func:`_gpu_block_forward`); the backward steps run :func:`block_attention_backward` in float32.

**Instrumentation.** :func:`trace` records what each forward step did (FLOPs, elements sent and received,
skipped or not): the figures :func:`fa2edu.simulate_context_parallel` predicts without running anything.

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

    Raises ValueError when N is not divisible by W (contiguous) or 2W (zigzag), when rank is outside
    [0, world_size), or for an unknown layout.
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
    layout : {"zigzag", "contiguous"}
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
    layout : {"zigzag", "contiguous"}
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


def _active_traces() -> list:
    if not hasattr(_TRACES, "stack"):
        _TRACES.stack = []
    return _TRACES.stack


@contextlib.contextmanager
def trace():
    """Record, for the calling rank, one dict per ring step of every :func:`ring_attention` forward pass.

    ::

        with cp.trace() as steps:
            o = cp.ring_attention(q_local, k_local, v_local, causal=True)
        # steps: W dicts for this rank, in step order

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

    Only forward passes are recorded (the backward pass recomputes the same steps and sends the dK, dV
    accumulators as well). Traces nest: every active trace receives every record. Per thread.
    """
    records: list[dict] = []
    stack = _active_traces()
    stack.append(records)
    try:
        yield records
    finally:
        # Remove this very list (by identity: two empty lists compare equal).
        del stack[next(i for i, r in enumerate(stack) if r is records)]


def _record(entry: dict) -> None:
    for records in _active_traces():
        records.append(dict(entry))
