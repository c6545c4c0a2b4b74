"""Context parallelism counted: what each rank of a ring computes, moves and waits for, step by step.

:func:`fa2edu.distributed.ring_attention` splits the sequence over W ranks. Rank r keeps its queries; at ring step
s = 0 … W − 1 it holds the K/V block of rank (r − s) mod W, computes one FA2 block step with it (FA2 Alg. 1 lines
6-11, whole blocks) and merges the result into its running (O, L) (FA1 Section 3.1), while it passes the block on
to rank r + 1 and receives the next one from rank r − 1. The network is the outer, slowest level of memory: the
ring is FA2's loop over K/V tiles with a hop between GPUs where FA2 has a load from HBM.

:func:`simulate_context_parallel` predicts, **without running anything and without PyTorch**, what every rank does
at every step, with the same conventions as ``fa2edu.distributed.trace()`` records them:

* ``flops``: matmul FLOPs, ``4·d·visible·batch·heads`` (two products, S = QKᵀ and O = PV, 2 FLOPs per
  multiply-add: :func:`fa2edu.flops.model_flops`'s convention), counted on the **visible** (query, key) pairs only:
  a causal step on the diagonal counts the triangle with its diagonal, c(c + 1)/2 pairs for a c × c chunk pair;
* ``elements_sent`` / ``elements_received``: the K and V elements of one block, ``batch·heads_kv·N_local·2d``, at
  steps 0 … W − 2, and 0 at the last step (nothing is left to pass on);
* ``skipped``: no query of the rank sees any key of the block (causal only); the block still travels on;
* ``hbm_reads`` / ``hbm_writes``: elements moved between HBM and SRAM by the step, on the book's memory model:
  FA2's forward pass (:func:`fa2edu.io.visit_form` over the blocks it visits, :func:`fa2edu.io.block_visits`) for
  each block computation of the step (:func:`ring_step_plan`), plus the merge of its result into the running
  (O, L) — read O, L and O_j, L_j, write O, L: ``2(d + 1)`` reads and ``d + 1`` writes per query row.

**Layouts** (:func:`chunk_ranges`). ``"contiguous"``: rank r holds tokens [r·N/W, (r+1)·N/W). Under a causal mask
rank r sees r whole blocks and its own diagonal: the last rank works about 2W − 1 times as long as the first, which
skips W − 1 of its W steps. ``"zigzag"``: 2W chunks of c = N/(2W) tokens, rank r holds chunks r and 2W − 1 − r;
every rank then computes (2W − 1)·c² + c(c + 1) visible pairs, the same number.

**Time** (a model, stated in :func:`simulate_context_parallel`). A step computes for ``flops / flop_rate`` seconds
and moves its block in ``bytes / link`` seconds; the transfer is posted before the computation, so it is **hidden**
when ``compute ≥ transfer``, i.e. when the link carries at least ``bytes / compute`` bytes per second. For a full
step of N_local queries against N_local keys that bound is ``e·R·H_kv / (2·N_local·H)`` for e-byte elements at R
FLOP/s — d cancels: the block and its work both grow with d. The ring couples the ranks: a rank moves to the next
step only when its computation, its send and its receive are done, and a transfer starts when both of its ends have
posted it. The report carries the resulting start and end of every step, the predicted run time, and the smallest
link bandwidth at which communication no longer lengthens the run.

**The backward** (``pass_="backward"`` or ``"forward+backward"``): FA2 Alg. 2 around the ring, as
``fa2edu.distributed`` runs it. The K/V blocks travel once more, and the dK, dV accumulators travel too, in
float32 (4-byte elements whatever the input dtype, 8 for float64), once per step: a backward step computes
2.5 times a forward step's FLOPs (``10·d`` per visible pair) and moves up to ``1 + 4/e`` times its bytes, so
with 2-byte inputs its overlap bound is ``(1 + 2)/2.5 = 1.2`` times the forward's; and the last accumulators
arrive after the last step, under no computation: the backward's communication is never entirely hidden.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import NamedTuple

import numpy as np

from fa2edu import hardware
from fa2edu.blocks import block_sizes_kv_outer, block_sizes_q_outer, resolve_block_sizes
from fa2edu.io import block_visits, visit_form

__all__ = ["LAYOUTS", "PASSES", "chunk_ranges", "BlockStep", "ring_step_plan", "visible_pairs", "RingStep", "RankTotal",
           "ContextParallelReport", "simulate_context_parallel"]

#: How the N tokens are dealt to the W ranks (the layouts of :mod:`fa2edu.distributed`).
LAYOUTS = ("contiguous", "zigzag")

_DTYPE_OF_SIZE = {2: "float16", 4: "float32", 8: "float64"}


# -- arguments ----------------------------------------------------------------------------------------------------

def _check_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_divisible(N: int, world_size: int, layout: str) -> None:
    parts = world_size if layout == "contiguous" else 2 * world_size
    if N % parts:
        what = "W" if layout == "contiguous" else "2W (2W equal chunks)"
        raise ValueError(f"the {layout} layout needs the sequence length N divisible by {what} = {parts}; "
                         f"got N = {N} with world_size W = {world_size}")


def _check_rate(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


# -- layouts and what a step computes -----------------------------------------------------------------------------

def chunk_ranges(N: int, rank: int, world_size: int, layout: str = "zigzag") -> list[tuple[int, int]]:
    """The global token ranges ``[(start, stop), ...]`` that ``rank`` holds, ascending (the order it stores them).

    Parameters
    ----------
    N : int
        The sequence length, divisible by W (contiguous) or 2W (zigzag).
    rank : int
        0 ≤ rank < world_size.
    world_size : int
        W, the number of ranks.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        ``"contiguous"``: one range [r·N/W, (r+1)·N/W). ``"zigzag"``: with c = N/(2W), chunks r and 2W − 1 − r,
        [r·c, (r+1)·c) then [(2W−1−r)·c, (2W−r)·c).

    Returns
    -------
    list of (int, int)
        Half-open ranges: one (contiguous) or two (zigzag).
    """
    layout = _check_layout(layout)
    N, world_size = _check_int(N, "N"), _check_int(world_size, "world_size")
    rank = _check_int(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    _check_divisible(N, world_size, layout)
    if layout == "contiguous":
        n = N // world_size
        return [(rank * n, (rank + 1) * n)]
    c = N // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return [(rank * c, (rank + 1) * c), (late * c, (late + 1) * c)]


def _triangle(x: int, width: int) -> int:
    """Σ_{v=1..x} min(v, width), 0 for x ≤ 0: the visible keys of consecutive query rows summed in closed form."""
    if x <= 0:
        return 0
    if x <= width:
        return x * (x + 1) // 2
    return width * (width + 1) // 2 + (x - width) * width


def _causal_pairs(q: tuple[int, int], k: tuple[int, int]) -> int:
    """Pairs (i, j), i in [q_a, q_b), j in [k_a, k_b), with j ≤ i: query i sees clip(i + 1 − k_a, 0, k_b − k_a)
    keys, summed over i in O(1)."""
    (q_a, q_b), (k_a, k_b) = q, k
    width = k_b - k_a
    return _triangle(q_b - k_a, width) - _triangle(q_a - k_a, width)


def visible_pairs(N: int, rank: int, source_rank: int, world_size: int, layout: str = "zigzag",
                  causal: bool = True) -> int:
    """The (query, key) score pairs a ring step computes: ``rank``'s queries against ``source_rank``'s keys.

    Per (batch, head). Not causal: N_local². Causal (query at global position i sees key j iff j ≤ i): summed over
    the two ranks' chunks in closed form, O(1) per chunk pair.

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
    layout : {"zigzag", "contiguous"}, default "zigzag"
        The layout of both ranks' tokens.
    causal : bool, default True
        Causal mask on global positions.

    Returns
    -------
    int
        The number of visible pairs; 0 means the step is skipped.
    """
    queries = chunk_ranges(N, rank, world_size, layout)
    keys = chunk_ranges(N, source_rank, world_size, layout)
    if not causal:
        n = N // world_size
        return n * n
    return sum(_causal_pairs(q, k) for q in queries for k in keys)


class BlockStep(NamedTuple):
    """One block computation of a ring step: an FA2 forward pass on a slice of the rank's queries.

    Attributes
    ----------
    rows : tuple of int
        ``(a, b)``: the local query rows [a, b) of the rank.
    keys : int
        The computation uses the first ``keys`` rows of the K/V block held (a prefix: both layouts store their
        tokens in ascending order).
    causal : bool
        A bottom-right causal mask inside (the query chunk's own diagonal is the last b − a of those keys).
    visible : int
        The visible (query, key) pairs, per (batch, head).
    """

    rows: tuple[int, int]
    keys: int
    causal: bool
    visible: int


def ring_step_plan(N: int, rank: int, source_rank: int, world_size: int, layout: str = "zigzag",
                   causal: bool = True) -> list[BlockStep]:
    """What ``rank`` computes at the step that holds ``source_rank``'s K/V block; an empty list: the step is skipped.

    FA2 Section 3.1.1's three kinds of blocks, one level up. For each query chunk [q_a, q_b) of the rank, the keys
    it can see are those at positions ≤ q_b − 1, a prefix of the block. If all of them lie at or before q_a the
    chunk sees them unmasked; otherwise the prefix ends with the chunk's own diagonal and the mask is the
    bottom-right causal one. Adjacent query chunks that see the same prefix unmasked make one computation. This is
    the plan ``fa2edu.distributed.ring_attention`` executes.

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
    layout : {"zigzag", "contiguous"}, default "zigzag"
        The layout of both ranks' tokens.
    causal : bool, default True
        Causal mask on global positions (else one unmasked computation of every query against every key).

    Returns
    -------
    list of BlockStep
        Disjoint computations covering exactly the visible (query, key) pairs. Cost: O(W) integer arithmetic.
    """
    query_chunks = chunk_ranges(N, rank, world_size, layout)
    key_chunks = chunk_ranges(N, source_rank, world_size, layout)
    n_local = N // world_size
    if not causal:
        return [BlockStep((0, n_local), n_local, False, n_local * n_local)]

    def keys_in(lo: int, hi: int) -> int:                  # keys of the block at global positions [lo, hi)
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in key_chunks)

    items: list[BlockStep] = []
    offset = 0
    for q_a, q_b in query_chunks:
        c = q_b - q_a
        rows = (offset, offset + c)
        offset += c
        seen = keys_in(0, q_b)                              # keys at positions ≤ q_b − 1
        if seen == 0:                                       # the chunk sees nothing of this block
            continue
        if keys_in(q_a + 1, q_b) == 0:                      # every visible key at or before the first query
            items.append(BlockStep(rows, seen, False, c * seen))
        else:                                               # the prefix ends with the chunk's own diagonal
            items.append(BlockStep(rows, seen, True, c * (seen - c) + c * (c + 1) // 2))
    merged: list[BlockStep] = []
    for item in items:
        last = merged[-1] if merged else None
        if (last is not None and not last.causal and not item.causal and last.keys == item.keys
                and last.rows[1] == item.rows[0]):
            merged[-1] = BlockStep((last.rows[0], item.rows[1]), item.keys, False, last.visible + item.visible)
        else:
            merged.append(item)
    return merged


# -- the report ---------------------------------------------------------------------------------------------------

class RingStep(NamedTuple):
    """One rank at one ring step: work, traffic, and its place in time.

    Attributes
    ----------
    rank : int
        The rank.
    step : int
        The ring step s, 0 … W − 1.
    source_rank : int
        Whose K/V block the step computes with: (rank − step) mod W.
    visible : int
        Visible (query, key) pairs per (batch, head).
    flops : int
        Matmul FLOPs over the batch and all query heads: 4·d·visible·batch·heads.
    hbm_reads : int
        Elements read from HBM by the step's FA2 block computations and its merges, over batch and heads.
    hbm_writes : int
        Elements written to HBM by the same.
    elements_sent : int
        K and V elements sent to rank + 1 during the step (0 at the last step).
    elements_received : int
        K and V elements received from rank − 1 during the step (0 at the last step).
    skipped : bool
        The rank sees no key of the block (causal): no computation.
    compute_s : float
        flops / flop_rate, seconds.
    transfer_s : float
        elements_sent × dtype_bytes / link bandwidth, seconds.
    hidden : bool
        compute_s ≥ transfer_s: the computation covers the transfer (True when nothing is sent).
    min_link_bandwidth : float
        The smallest link bandwidth (bytes/s per direction) at which the step's computation hides its transfer:
        bytes / compute_s; 0 when nothing is sent, inf when a transfer meets a skipped step.
    start_s : float
        When the rank starts the step (the time model: module docstring).
    end_s : float
        When the rank moves on: its computation, its send and its receive are all done.
    pass_ : str
        ``"forward"`` or ``"backward"``: which pass of the ring the step belongs to.
    grad_elements_sent : int
        Backward only: dK and dV accumulator elements sent to rank + 1 after the step's computation (every step
        when W > 1), in the compute dtype (``grad_dtype_bytes`` each); 0 in the forward.
    grad_elements_received : int
        Backward only: the accumulators received from rank − 1 in the same exchange.
    grad_transfer_s : float
        Backward only: grad_elements_sent × grad_dtype_bytes / link bandwidth; that transfer runs under the
        *next* step's computation (the last one under none).
    """

    rank: int
    step: int
    source_rank: int
    visible: int
    flops: int
    hbm_reads: int
    hbm_writes: int
    elements_sent: int
    elements_received: int
    skipped: bool
    compute_s: float
    transfer_s: float
    hidden: bool
    min_link_bandwidth: float
    start_s: float
    end_s: float
    pass_: str = "forward"
    grad_elements_sent: int = 0
    grad_elements_received: int = 0
    grad_transfer_s: float = 0.0


class RankTotal(NamedTuple):
    """One rank's totals over the ring.

    Attributes
    ----------
    rank : int
        The rank.
    tokens : tuple of (int, int)
        The global token ranges it holds.
    visible : int
        Visible pairs per (batch, head), over all steps.
    flops : int
        Matmul FLOPs, over all steps.
    hbm_reads : int
        HBM elements read, over all steps.
    hbm_writes : int
        HBM elements written, over all steps.
    elements_sent : int
        K/V elements sent, over all steps.
    elements_received : int
        K/V elements received, over all steps.
    skipped_steps : int
        Steps with nothing to compute.
    compute_s : float
        Time computing, flops / flop_rate.
    finish_s : float
        When the rank's last step ends (the time model).
    idle_fraction : float
        1 − compute / the busiest rank's compute: the share of the busiest rank's work time this rank has nothing
        to do (0 for the busiest rank).
    grad_elements_sent : int
        dK, dV accumulator elements sent, over the backward's steps (0 for a forward-only report).
    grad_elements_received : int
        dK, dV accumulator elements received, over the backward's steps.
    """

    rank: int
    tokens: tuple
    visible: int
    flops: int
    hbm_reads: int
    hbm_writes: int
    elements_sent: int
    elements_received: int
    skipped_steps: int
    compute_s: float
    finish_s: float
    idle_fraction: float
    grad_elements_sent: int = 0
    grad_elements_received: int = 0


def _gb(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x / 1e9:,.1f} GB/s"


def _time(x: float) -> str:
    """Seconds in the unit that reads best: s, ms or µs, 3 significant digits."""
    if x == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x * 1e6:.2g} µs"


def _num(x) -> str:
    """A count: with thousands separators below 10⁶, else 3 significant digits (3.36e7)."""
    if abs(x) < 1_000_000:
        return f"{int(x):,}"
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


@dataclass(frozen=True)
class ContextParallelReport:
    """What :func:`simulate_context_parallel` predicts for one ring: per rank and step, and per rank in total.

    ``str(report)`` is a table per rank (``report.to_text(steps=True)`` adds one line per step); a notebook shows
    it as HTML. :meth:`to_rows` gives plain dicts (one per rank and step) for plotting or JSON, :meth:`rank_rows`
    one per rank, :meth:`to_dataframe` either as a pandas DataFrame.

    Attributes
    ----------
    N : int
        Global sequence length.
    d : int
        Head dimension (d_v = d).
    world_size : int
        W, the ranks of the ring.
    causal : bool
        Causal mask on global positions.
    layout : str
        ``"contiguous"`` or ``"zigzag"``.
    batch : int
        Batch size.
    heads : int
        Query heads.
    heads_kv : int
        K/V heads (GQA: fewer than ``heads``; only they travel).
    dtype_bytes : int
        Bytes per element of Q, K, V.
    link_bandwidth : float
        Link bandwidth per direction, bytes/s.
    flop_rate : float
        FLOP/s of one rank's block computations.
    block_sizes : tuple of int
        FA2 forward's (B_r, B_c) of the HBM model.
    steps : tuple of RingStep
        Rank-major: ``steps[r * W + s]`` is rank r at step s.
    ranks : tuple of RankTotal
        One per rank.
    time_s : float
        Predicted run time of the ring: the last rank to finish.
    compute_time_s : float
        The same with an infinitely fast link: the ring's compute and synchronisation alone.
    bandwidth_to_hide : float
        The smallest link bandwidth (bytes/s per direction) at which the predicted run time equals
        ``compute_time_s``: communication costs nothing on top. 0 for W = 1; inf if no finite link does it (a
        backward with W > 1: its last dK, dV transfer runs after the last step, under no computation).
    pass_ : str, default "forward"
        ``"forward"``, ``"backward"`` or ``"forward+backward"``: the passes modelled.
    grad_dtype_bytes : int, default 4
        Bytes per element of the dK, dV accumulators that travel in the backward (4: float32; 8 for float64).
    backward_flop_rate : float, default None
        FLOP/s of one rank's backward block computations (the forward's ``flop_rate`` unless given; None in a
        report built by hand without one).
    backward_block_sizes : tuple of int, default None
        FA2 backward's (B_r, B_c) of the HBM model (its K/V-outer rule).
    """

    N: int
    d: int
    world_size: int
    causal: bool
    layout: str
    batch: int
    heads: int
    heads_kv: int
    dtype_bytes: int
    link_bandwidth: float
    flop_rate: float
    block_sizes: tuple
    steps: tuple
    ranks: tuple
    time_s: float
    compute_time_s: float
    bandwidth_to_hide: float
    pass_: str = "forward"
    grad_dtype_bytes: int = 4
    backward_flop_rate: float | None = None
    backward_block_sizes: tuple | None = None

    # -- views ---------------------------------------------------------------------------------------------------
    @property
    def N_local(self) -> int:
        """Tokens per rank, N / W."""
        return self.N // self.world_size

    @property
    def passes(self) -> tuple[str, ...]:
        """The passes in ``steps``, in order: ("forward",), ("backward",) or ("forward", "backward")."""
        return tuple(self.pass_.split("+"))

    def step(self, rank: int, step: int, pass_: str | None = None) -> RingStep:
        """The row of ``rank`` at ring step ``step`` of ``pass_`` (default: the report's first pass).

        ``steps`` holds each pass's W × W rows rank-major, the passes one after the other."""
        W = self.world_size
        if not (0 <= rank < W and 0 <= step < W):
            raise ValueError(f"rank and step must be in [0, {W}), got rank {rank}, step {step}")
        passes = self.passes
        pass_ = passes[0] if pass_ is None else pass_
        if pass_ not in passes:
            raise ValueError(f"pass_ must be one of {passes} for this report, got {pass_!r}")
        return self.steps[passes.index(pass_) * W * W + rank * W + step]

    @property
    def flops_per_rank(self) -> list[int]:
        """Each rank's FLOPs over the ring."""
        return [r.flops for r in self.ranks]

    @property
    def idle_fractions(self) -> list[float]:
        """Each rank's idle fraction against the busiest rank."""
        return [r.idle_fraction for r in self.ranks]

    @property
    def total_flops(self) -> int:
        """FLOPs over all ranks: single-device attention's 4·d·(visible pairs)·batch·heads."""
        return sum(self.flops_per_rank)

    @property
    def hides_communication(self) -> bool:
        """Every step's computation covers its transfer (the per-step condition)."""
        return all(s.hidden for s in self.steps)

    @property
    def min_link_bandwidth(self) -> float:
        """The per-step condition for the whole ring: the largest of the steps' ``min_link_bandwidth``."""
        return max(s.min_link_bandwidth for s in self.steps)

    def to_rows(self) -> list[dict]:
        """One dict per (pass, rank, step), with the fields of :class:`RingStep` and the run's parameters."""
        common = {"N": self.N, "d": self.d, "world_size": self.world_size, "layout": self.layout,
                  "causal": self.causal}
        return [dict(common, **s._asdict()) for s in self.steps]

    def rank_rows(self) -> list[dict]:
        """One dict per rank, with the fields of :class:`RankTotal` and the run's parameters."""
        common = {"N": self.N, "d": self.d, "world_size": self.world_size, "layout": self.layout,
                  "causal": self.causal}
        return [dict(common, **dict(r._asdict(), tokens=[list(t) for t in r.tokens])) for r in self.ranks]

    def to_dataframe(self, per: str = "step"):
        """:meth:`to_rows` (``per="step"``) or :meth:`rank_rows` (``per="rank"``) as a pandas DataFrame."""
        if per not in ("step", "rank"):
            raise ValueError(f"per must be 'step' or 'rank', got {per!r}")
        try:
            import pandas as pd
        except ModuleNotFoundError:
            raise ImportError("to_dataframe needs pandas (`pip install pandas`); to_rows() and rank_rows() give "
                              "the same rows as dicts") from None
        return pd.DataFrame(self.to_rows() if per == "step" else self.rank_rows())

    # -- display -------------------------------------------------------------------------------------------------
    def title(self) -> str:
        mask = "causal" if self.causal else "no mask"
        kv = f" ({self.heads_kv} K/V)" if self.heads_kv != self.heads else ""
        what = "" if self.pass_ == "forward" else f" ({self.pass_})"
        return (f"Ring attention{what}, {self.layout}, {mask}: N = {self.N:,} on W = {self.world_size} ranks, "
                f"chunks of {self._chunk_size():,} tokens\n"
                f"d = {self.d}, {self.batch} × {self.heads} heads{kv}, {self.dtype_bytes}-byte elements; "
                f"counts over batch and heads")

    def _notes(self) -> list[str]:
        hidden = sum(s.hidden for s in self.steps if s.elements_sent)
        moving = sum(1 for s in self.steps if s.elements_sent)
        return [f"link {_gb(self.link_bandwidth)} each way, {self.flop_rate / 1e12:,.1f} TFLOP/s per rank: "
                f"{hidden} of {moving} transfers hidden by their step",
                f"time {_time(self.time_s)} ({_time(self.compute_time_s)} on an infinitely fast link, "
                f"reached from {_gb(self.bandwidth_to_hide)})"]

    def _chunk_size(self) -> int:
        return self.N_local if self.layout == "contiguous" else self.N_local // 2

    def _rank_cells(self) -> tuple[list[str], list[list[str]]]:
        c = self._chunk_size()
        head = ["rank", "chunks", "pairs", "FLOPs", "HBM", "K/V sent", "skipped", "compute", "finish", "idle"]
        body = [[str(r.rank), ", ".join(str(a // c) for a, _ in r.tokens), _num(r.visible), _num(r.flops),
                 _num(r.hbm_reads + r.hbm_writes), _num(r.elements_sent), f"{r.skipped_steps}/{self.world_size}",
                 _time(r.compute_s), _time(r.finish_s), f"{r.idle_fraction:.1%}"] for r in self.ranks]
        return head, body

    def _step_cells(self) -> tuple[list[str], list[list[str]]]:
        head = ["rank", "step", "from", "FLOPs", "HBM", "K/V sent", "compute", "transfer", "hidden",
                "link to hide"]
        body = [[str(s.rank), str(s.step), str(s.source_rank), _num(s.flops),
                 _num(s.hbm_reads + s.hbm_writes), _num(s.elements_sent), _time(s.compute_s), _time(s.transfer_s),
                 "skipped" if s.skipped else ("yes" if s.hidden else "no"), _gb(s.min_link_bandwidth)]
                for s in self.steps]
        if "backward" in self.passes:              # which pass, and the dK, dV accumulators sent
            head = head[:2] + ["pass", "dK/dV sent"] + head[2:]
            for row, s in zip(body, self.steps):
                row[2:2] = [s.pass_[:3], _num(s.grad_elements_sent)]
        return head, body

    @staticmethod
    def _table(head: list[str], body: list[list[str]]) -> list[str]:
        widths = [max(len(row[k]) for row in [head] + body) for k in range(len(head))]
        return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in [head] + body]

    def to_text(self, steps: bool = False) -> str:
        """The report as text: the per-rank table, the notes, and with ``steps=True`` one line per (rank, step).

        Parameters
        ----------
        steps : bool, default False
            Add the per-step table.
        """
        lines = [self.title(), *self._table(*self._rank_cells()), *self._notes()]
        if steps:
            lines += ["", *self._table(*self._step_cells())]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        head, body = self._rank_cells()
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
        notes = "".join(f"<br>{html.escape(n)}" for n in self._notes())
        return (f"<div><b>{html.escape(self.title())}</b><table><thead><tr>{th}</tr></thead>"
                f"<tbody>{trs}</tbody></table><small>{notes}</small></div>")

    def __repr__(self) -> str:
        return (f"ContextParallelReport(N={self.N}, d={self.d}, world_size={self.world_size}, "
                f"layout={self.layout!r}, causal={self.causal}, time_s={self.time_s:.3g})")


# -- the time model -----------------------------------------------------------------------------------------------

def _schedule(compute: np.ndarray, transfer_s: float, start=None, grad_transfer_s: float | None = None):
    """Start and end times (W, W) of every (rank, step) of one pass, and each rank's finish (W,).

    ``compute`` (W, W) holds the step times; ``transfer_s`` the time of one K/V block on a link; ``start`` (W,)
    when each rank begins the pass (default 0). ``grad_transfer_s`` None: the forward. Else the backward, whose
    dK, dV accumulators (``grad_transfer_s`` each) leave after each step's computation.

    Forward, at step s < W − 1: rank r posts the exchange of its block (send to r + 1, receive from r − 1), then
    computes. Backward, at step s: the same K/V exchange, the computation, then the wait for the accumulators of
    step s − 1 (send and receive), then the post of this step's accumulators; after the last step, the wait for
    them. A transfer r → r + 1 runs once both ends have posted it and both ranks' previous exchanges are done
    (NCCL runs a rank's grouped sends and receives one exchange after the other): it ends at
    max(posts, both ranks free) + its time. A rank moves on when its computation, its send and its receive of
    the step's K/V exchange are done. The last forward step moves nothing.
    """
    W = compute.shape[0]
    starts, ends = np.zeros((W, W)), np.zeros((W, W))
    t = np.zeros(W) if start is None else np.asarray(start, dtype=float).copy()
    ranks = np.arange(W)
    nxt, prv = (ranks + 1) % W, (ranks - 1) % W
    free = np.zeros(W)                                   # when each rank's previous exchange is done

    def exchange(posted: np.ndarray, seconds: float):
        """Rank r's send to r + 1 and rank r's whole exchange (its send and its receive from r − 1) done."""
        sent = np.maximum(np.maximum(posted, posted[nxt]), np.maximum(free, free[nxt])) + seconds
        return sent, np.maximum(sent, sent[prv])

    grads_done = None                                   # the previous step's accumulator exchange, per rank
    for s in range(W):
        starts[:, s] = t
        done = t + compute[:, s]
        kv_done = None
        if s < W - 1:
            _, kv_done = exchange(t, transfer_s)
            free = kv_done
        if grad_transfer_s is not None and W > 1:
            posted = done if grads_done is None else np.maximum(done, grads_done)
            _, grads_done = exchange(posted, grad_transfer_s)
            free = np.maximum(free, grads_done)
            done = posted
        if kv_done is not None:
            done = np.maximum(done, kv_done)
        ends[:, s] = done
        t = done
    finish = t if grads_done is None else np.maximum(t, grads_done)
    return starts, ends, finish


def _run(passes, link_s_per_byte: float):
    """Each pass's (starts, ends, finish) at ``link_s_per_byte`` seconds per byte, the passes back to back: a
    rank starts its backward when its forward finishes. ``passes``: (compute, kv_bytes, grad_bytes or None)."""
    out, begin = [], None
    for compute, kv_bytes, grad_bytes in passes:
        grad_s = None if grad_bytes is None else grad_bytes * link_s_per_byte
        starts, ends, finish = _schedule(compute, kv_bytes * link_s_per_byte, begin, grad_s)
        out.append((starts, ends, finish))
        begin = finish
    return out


def _bandwidth_to_hide(passes) -> float:
    """The smallest bandwidth at which the ring's run time equals its run time with free transfers.

    The run time is a maximum of sums of compute times and transfer times (a max-plus expression), so it grows
    with the time per byte x, piecewise linearly. Bisect for the largest x at which it has not grown yet.
    """
    W = passes[0][0].shape[0]
    if W == 1 or all(kv == 0 and not grad for _, kv, grad in passes):
        return 0.0
    if any(grad for _, _, grad in passes):
        return math.inf               # the backward's last dK, dV transfer runs after its last step, exposed
    base = float(_run(passes, 0.0)[-1][2].max())
    tolerance = 1e-12 * max(base, 1e-300)
    largest = max(max(kv, grad or 0) for _, kv, grad in passes)

    def grows(x: float) -> bool:
        return float(_run(passes, x)[-1][2].max()) > base + tolerance

    lo, hi = 0.0, max(base, 1e-300) / largest          # at hi one transfer alone takes the whole run time
    if not grows(hi):                         # cannot happen with a transfer on the path, kept for safety
        return 1.0 / hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if grows(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-15 * hi:
            break
    return math.inf if lo == 0.0 else 1.0 / lo


# -- the simulation -----------------------------------------------------------------------------------------------

def _resolve_link(link) -> float:
    if isinstance(link, (str, hardware.Interconnect)):
        return hardware.interconnect(link).per_direction
    return _check_rate(link, "link (bytes/s per direction)")


def _resolve_rate(flop_rate, dtype_bytes: int) -> float:
    if isinstance(flop_rate, (str, hardware.DeviceProfile)):
        if dtype_bytes not in _DTYPE_OF_SIZE:
            raise ValueError(f"flop_rate names a device, whose peak needs dtype_bytes in "
                             f"{sorted(_DTYPE_OF_SIZE)}; got dtype_bytes = {dtype_bytes}: pass a FLOP/s number")
        return hardware.peak_flops(flop_rate, _DTYPE_OF_SIZE[dtype_bytes])
    return _check_rate(flop_rate, "flop_rate (FLOP/s)")


#: The passes :func:`simulate_context_parallel` models.
PASSES = ("forward", "backward", "forward+backward")


def _step_hbm(pass_: str, d: int, plan, n: int, step: int, world_size: int, blocks, cache: dict) -> tuple[int, int]:
    """HBM (reads, writes) per (batch, head) of one ring step on the book's memory model.

    Forward: FA2 Alg. 1 on each block computation (:func:`fa2edu.io.visit_form`) and its merge into the running
    (O, L): read O, L, O_j, L_j, write O, L, i.e. 2(d + 1) reads and d + 1 writes per query row. Backward: FA2
    Alg. 2 on each block computation (line 4's D pass included: the kernel recomputes it from O and dO), and the
    accumulation of its dQ_j, dK_j, dV_j into the running dQ and the block's dK, dV (read both, write the sum:
    2d reads and d writes per query row, 4d reads and 2d writes per key row); from step 1 on (W > 1), the
    accumulators received are added in too: 4·n·d reads and 2·n·d writes."""
    B_r, B_c = blocks
    reads = writes = 0
    for item in plan:
        rows = item.rows[1] - item.rows[0]
        key = (pass_, rows, item.keys, item.causal)
        if key not in cache:
            r_, w_ = visit_form("flash2", pass_, d, block_visits(rows, item.keys, B_r, B_c, causal=item.causal))
            if pass_ == "forward":
                cache[key] = (r_ + 2 * (d + 1) * rows, w_ + (d + 1) * rows)
            else:
                cache[key] = (r_ + 2 * d * rows + 4 * d * item.keys, w_ + d * rows + 2 * d * item.keys)
        reads += cache[key][0]
        writes += cache[key][1]
    if pass_ == "backward" and step > 0 and world_size > 1:
        reads, writes = reads + 4 * n * d, writes + 2 * n * d
    return reads, writes


def simulate_context_parallel(N: int, d: int, world_size: int, causal: bool = True, layout: str = "zigzag", *,
                              batch: int = 1, heads: int = 1, heads_kv: int | None = None, dtype_bytes: int = 2,
                              link="NVLink4-H100", flop_rate="H100-SXM", M: int | None = None,
                              block_sizes=None, pass_: str = "forward", grad_dtype_bytes: int | None = None,
                              backward_flop_rate=None) -> ContextParallelReport:
    """Predict ring attention's work, traffic and time, per rank and per ring step, without running it.

    The counts are those ``fa2edu.distributed.trace()`` records when :func:`fa2edu.distributed.ring_attention`
    runs (module docstring): per step, the visible pairs and FLOPs, the K/V elements sent and received, whether the
    step is skipped; and the HBM elements of the step's block computations on the book's memory model. Per rank,
    the totals and the idle fraction against the busiest rank, ``1 − compute / max compute``.

    The time model: a step computes for ``flops / flop_rate`` seconds and moves ``elements_sent · dtype_bytes``
    bytes at ``link`` bytes/s per direction. The transfer is posted before the step's computation, so the step
    hides it when compute ≥ transfer (``RingStep.hidden``); its ``min_link_bandwidth`` is the link that would just
    do it. Ranks move to the next step when their computation, send and receive are done; a transfer starts when
    both ends have posted it and both ranks' previous exchanges are done. No latency, no contention, one rate for
    every block shape: the real run adds kernel launch and merge overheads that grow with W, and small blocks run
    below the rate.

    **The backward** (``pass_="backward"``), as ``fa2edu.distributed`` runs it (FA2 Alg. 2 around the ring): at
    step s the rank posts the exchange of the K/V block (steps 0 … W − 2, as in the forward), computes its
    share of the gradients for the block it holds, ``10·d·visible·batch·heads`` FLOPs (five products, 2.5 times
    the forward's: :func:`fa2edu.flops.model_flops`), waits for the dK, dV accumulators of step s − 1 to arrive,
    adds its share and posts them on to rank + 1: ``batch·heads_kv·N_local·2d`` elements of ``grad_dtype_bytes``
    at every step (W transfers), the last of them after the last step, under no computation. A backward step is
    ``hidden`` when its computation covers both transfers that run under it: the K/V block and the accumulators
    of the step before. ``"forward+backward"``: the forward, then each rank's backward from the moment its
    forward finishes (autograd's ``ring_attention(...).backward(dO)``); ``steps`` holds the forward's rows, then
    the backward's.

    Parameters
    ----------
    N : int
        Global sequence length; divisible by W (contiguous) or 2W (zigzag).
    d : int
        Head dimension (d_v = d).
    world_size : int
        W, the ranks of the ring.
    causal : bool, default True
        Causal mask on global positions.
    layout : {"zigzag", "contiguous"}, default "zigzag"
        How the tokens are dealt to the ranks (:func:`chunk_ranges`).
    batch : int, default 1
        Batch size.
    heads : int, default 1
        Query heads.
    heads_kv : int, optional
        K/V heads, dividing ``heads`` (GQA/MQA: fewer K/V elements travel). Default None: ``heads``.
    dtype_bytes : int, default 2
        Bytes per element of Q, K, V (2 for fp16/bf16, 4 for fp32).
    link : str, Interconnect or float, default "NVLink4-H100"
        The link between neighbouring ranks: a name of :data:`fa2edu.hardware.INTERCONNECTS` (or an alias such as
        ``"pcie5"``) or a bandwidth in bytes/s **per direction**.
    flop_rate : str, DeviceProfile or float, default "H100-SXM"
        The FLOP/s of one rank's block computations: a device name (its dense peak for the element size:
        tensor cores for 2 bytes, TF32 for 4, :func:`fa2edu.hardware.peak_flops`) or a number, such as a measured
        single-GPU rate.
    M : int, optional
        SRAM size in elements for the HBM model's block sizes (FA2 forward's rule; the backward's K/V-outer rule).
        Default None: :data:`fa2edu.blocks.DEFAULT_M`.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)`` of the HBM model, overriding M's rule (both passes). Default None.
    pass_ : {"forward", "backward", "forward+backward"}, default "forward"
        The passes to model (keyword only).
    grad_dtype_bytes : int, optional
        Bytes per element of the travelling dK, dV accumulators. Default None: 8 when ``dtype_bytes`` is 8
        (float64), else 4 (float32: the ring accumulates in its compute dtype). Unused in the forward.
    backward_flop_rate : str, DeviceProfile or float, optional
        The FLOP/s of the backward's block computations (the backward kernels run at their own rate). Default
        None: ``flop_rate``.

    Returns
    -------
    ContextParallelReport
        ``steps`` (one :class:`RingStep` per pass, rank and step: each pass rank-major, the passes in order),
        ``ranks`` (one :class:`RankTotal` per rank, over the passes), ``time_s``, ``compute_time_s``,
        ``bandwidth_to_hide``. Cost: O(W²) block plans and HBM forms per pass, each O(N_local / B) NumPy, plus
        O(W²) per time-model evaluation (about 200 of them for ``bandwidth_to_hide``).

    Raises
    ------
    ValueError
        N not divisible by W (contiguous) or 2W (zigzag), a size below 1, ``heads`` not a multiple of
        ``heads_kv``, an unknown layout, link or pass, a non-positive rate or bandwidth. TypeError: a non-integer
        size, a non-bool ``causal``.
    """
    N, d, world_size = _check_int(N, "N"), _check_int(d, "d"), _check_int(world_size, "world_size")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    causal = bool(causal)
    layout = _check_layout(layout)
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    _check_divisible(N, world_size, layout)
    batch, heads = _check_int(batch, "batch"), _check_int(heads, "heads")
    heads_kv = heads if heads_kv is None else _check_int(heads_kv, "heads_kv")
    if heads % heads_kv:
        raise ValueError(f"heads = {heads} query heads must be a multiple of heads_kv = {heads_kv} K/V heads")
    dtype_bytes = _check_int(dtype_bytes, "dtype_bytes")
    grad_dtype_bytes = (8 if dtype_bytes == 8 else 4) if grad_dtype_bytes is None else \
        _check_int(grad_dtype_bytes, "grad_dtype_bytes")
    link_bandwidth = _resolve_link(link)
    rate = _resolve_rate(flop_rate, dtype_bytes)
    backward_rate = rate if backward_flop_rate is None else _resolve_rate(backward_flop_rate, dtype_bytes)
    forward_blocks = resolve_block_sizes(M, block_sizes, d, block_sizes_q_outer)
    backward_blocks = resolve_block_sizes(M, block_sizes, d, block_sizes_kv_outer)

    W, n = world_size, N // world_size
    programs = batch * heads
    # One K/V block: batch · heads_kv · N_local rows of K and of V, d wide each (the dK, dV accumulators alike).
    block_elements = batch * heads_kv * n * 2 * d
    block_bytes = block_elements * dtype_bytes
    grad_bytes = block_elements * grad_dtype_bytes
    passes = tuple(pass_.split("+"))

    hbm_cache: dict = {}
    counted = []                      # per pass: (counts, compute)
    for this in passes:
        backward = this == "backward"
        compute = np.zeros((W, W))
        counts = []                   # (rank, step, source, visible, flops, reads, writes, sent, grads, skipped)
        for rank in range(W):
            for step in range(W):
                source = (rank - step) % W
                plan = ring_step_plan(N, rank, source, W, layout, causal)
                visible = sum(item.visible for item in plan)
                reads, writes = _step_hbm(this, d, plan, n, step, W, backward_blocks if backward else
                                          forward_blocks, hbm_cache)
                sent = block_elements if step < W - 1 else 0
                grads = block_elements if backward and W > 1 else 0
                # FA2's products per visible pair: S = QKᵀ and O = PV (4d); the backward's five (10d).
                flops = (10 if backward else 4) * d * visible * programs
                compute[rank, step] = flops / (backward_rate if backward else rate)
                counts.append((rank, step, source, visible, flops, reads * programs, writes * programs, sent, grads,
                               not plan))
        counted.append((counts, compute))

    model = [(compute, block_bytes, grad_bytes if this == "backward" else None)
             for this, (_, compute) in zip(passes, counted)]
    timed = _run(model, 1.0 / link_bandwidth)
    transfer_s, grad_transfer_s = block_bytes / link_bandwidth, grad_bytes / link_bandwidth
    steps = []
    for this, (counts, compute), (start, end, _) in zip(passes, counted, timed):
        for rank, step, source, visible, flops, reads, writes, sent, grads, skipped in counts:
            c_s = float(compute[rank, step])
            t_s = transfer_s if sent else 0.0
            # What runs on the link under this step: its K/V block, and in the backward the accumulators posted
            # at the end of the step before.
            under_bytes = sent * dtype_bytes + (block_elements * grad_dtype_bytes if grads and step > 0 else 0)
            under_s = t_s + (grad_transfer_s if grads and step > 0 else 0.0)
            if not under_bytes:
                need = 0.0
            else:
                need = math.inf if c_s == 0.0 else under_bytes / c_s
            steps.append(RingStep(rank, step, source, visible, flops, reads, writes, sent, sent, skipped, c_s, t_s,
                                  c_s >= under_s, need, float(start[rank, step]), float(end[rank, step]), this,
                                  grads, grads, grad_transfer_s if grads else 0.0))
    finish = timed[-1][2]
    totals = [sum(float(compute[r].sum()) for _, compute in counted) for r in range(W)]
    busiest = max(totals)
    ranks = []
    for rank in range(W):
        mine = [s for s in steps if s.rank == rank]
        ranks.append(RankTotal(
            rank, tuple(chunk_ranges(N, rank, W, layout)), sum(s.visible for s in mine), sum(s.flops for s in mine),
            sum(s.hbm_reads for s in mine), sum(s.hbm_writes for s in mine), sum(s.elements_sent for s in mine),
            sum(s.elements_received for s in mine), sum(s.skipped for s in mine), totals[rank],
            float(finish[rank]), 0.0 if busiest == 0 else 1.0 - totals[rank] / busiest,
            sum(s.grad_elements_sent for s in mine), sum(s.grad_elements_received for s in mine)))
    return ContextParallelReport(
        N=N, d=d, world_size=W, causal=causal, layout=layout, batch=batch, heads=heads, heads_kv=heads_kv,
        dtype_bytes=dtype_bytes, link_bandwidth=link_bandwidth, flop_rate=rate, block_sizes=forward_blocks,
        steps=tuple(steps), ranks=tuple(ranks), time_s=float(finish.max()),
        compute_time_s=float(_run(model, 0.0)[-1][2].max()), bandwidth_to_hide=_bandwidth_to_hide(model),
        pass_=pass_, grad_dtype_bytes=grad_dtype_bytes, backward_flop_rate=backward_rate,
        backward_block_sizes=backward_blocks)
