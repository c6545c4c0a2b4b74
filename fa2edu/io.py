"""HBM traffic of standard attention, FlashAttention and FlashAttention-2: executed, and in closed form.

The book's central claim (FA1 Theorem 2) is a count: standard attention moves Θ(Nd + N²) elements between HBM and
SRAM, FlashAttention Θ(N²d²/M). fa2edu counts by **executing** each algorithm on a :class:`~fa2edu.memory.HBM`
ledger, so the counts cannot drift from the code. :func:`simulate_io` runs the six (algorithm, pass) pairs and
tabulates the ledger: reads, writes, total, block sizes and peak SRAM, per (batch, head), in elements.

Executing a tiled pass costs one Python iteration per visited block, too slow for N = 65 536. So this module also
writes the ledger down as formulas, two ways:

* :func:`closed_form` — the conventions' table for N_q = N_k = N with no mask, term by term the paper's lines.
* :func:`visit_form` — the same lines summed over the blocks a pass *visits*, for causal masking (FA2 Section 3.1)
  and block-sparsity (FA1 Algorithm 5). :func:`block_visits` finds the visited blocks with vectorised NumPy: for
  causal masking in O(T_r + T_c) from the row and column indices alone, for a block mask from the mask itself.

``tests/test_io.py`` proves both equal to the executed ledger for ragged sizes, causal or not, sparse or not; then
``simulate_io(..., method="auto")`` executes when that is cheap and uses the formulas otherwise. Each row of the
report says which one produced it.

Units: elements per program (one (batch, head) pair), d_v = d; initialisation writes ("Initialize O = 0 in HBM")
are left out, as the papers leave them out (:attr:`fa2edu.memory.HBM.init_writes` keeps them apart).
"""

from __future__ import annotations

import html
import sys
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from fa2edu import flash1, flash2, flex, standard
from fa2edu.blocks import DEFAULT_M, block_sizes_kv_outer, block_sizes_q_outer, check_M, num_blocks, resolve_block_sizes
from fa2edu.hardware import itemsize
from fa2edu.masks import block_sparse_to_mask, check_block_mask, random_block_mask
from fa2edu.memory import HBM, SRAMOverflowError

__all__ = [
    "ALGORITHMS", "PASSES", "METHODS", "IORow", "IOReport", "BlockVisits", "simulate_io", "closed_form",
    "visit_form", "block_visits", "block_rule", "execute_io", "peak_sram_form", "standard_bound", "flash_bound",
    "flex_visit_form", "simulate_flex_io",
]

ALGORITHMS = ("standard", "flash1", "flash2")
#: What a report's rows may name: the three algorithms of :func:`simulate_io`, and FlexAttention's
#: (:func:`simulate_flex_io`).
REPORT_ALGORITHMS = ALGORITHMS + ("flex",)
PASSES = ("forward", "backward")
METHODS = ("auto", "execute", "closed_form")

#: "auto" executes when the runs visit at most this many blocks in all and S has at most this many entries.
EXECUTE_MAX_BLOCKS = 1_500
EXECUTE_MAX_SCORES = 128 * 128


# -- which blocks a pass visits -----------------------------------------------------------------------------------

def block_rule(algorithm: str, pass_: str):
    """The block-size rule of a pass: FA1's (K/V-outer) for flash1 and flash2 backward, Q-outer for flash2 forward
    (docs/conventions.md); standard attention uses the Q-outer rule's B_r to stream its rows (its counts do
    not depend on it)."""
    _check_pair(algorithm, pass_)
    if algorithm == "standard" or (algorithm == "flash2" and pass_ == "forward"):
        return block_sizes_q_outer
    return block_sizes_kv_outer


@dataclass(frozen=True)
class BlockVisits:
    """The (i, j) blocks of S that a tiled pass visits, summarised as the IO counts need them.

    ``row_sizes`` r_i (T_r,), ``col_sizes`` c_j (T_c,): every block has B rows except a ragged last one.
    ``row_visits`` v_i: visited blocks in row block i; ``col_visits`` u_j: visited blocks in column block j.
    ``grid``: the (T_r, T_c) visited grid when a block mask was given (causal alone needs no grid).
    """

    N_q: int
    N_k: int
    B_r: int
    B_c: int
    row_sizes: np.ndarray
    col_sizes: np.ndarray
    row_visits: np.ndarray
    col_visits: np.ndarray
    grid: np.ndarray | None = None

    @property
    def T_r(self) -> int:
        return len(self.row_sizes)

    @property
    def T_c(self) -> int:
        return len(self.col_sizes)

    @property
    def visited(self) -> int:
        """Number of visited blocks."""
        return int(self.row_visits.sum())

    @property
    def total(self) -> int:
        """Number of blocks, T_r · T_c."""
        return self.T_r * self.T_c

    @property
    def density(self) -> float:
        """Fraction of blocks visited: 1 for dense attention, about 1/2 for causal, s for block-sparse."""
        return self.visited / self.total

    @property
    def row_elements(self) -> int:
        """Σ over visited blocks of r_i: how many rows of Q-side tiles the inner loops stream in all."""
        return int(np.dot(self.row_sizes, self.row_visits))

    @property
    def col_elements(self) -> int:
        """Σ over visited blocks of c_j: how many rows of K/V-side tiles the inner loops stream in all."""
        return int(np.dot(self.col_sizes, self.col_visits))

    def size_classes(self) -> list[tuple[int, int]]:
        """The distinct tile shapes (r_i, c_j) among visited blocks (at most four: full or ragged, each way)."""
        shapes = []
        for r in np.unique(self.row_sizes):
            rows = self.row_sizes == r
            for c in np.unique(self.col_sizes):
                cols = self.col_sizes == c
                if self.grid is not None:
                    hit = bool(self.grid[np.ix_(rows, cols)].any())
                else:
                    # Causal visits form a prefix j < v_i of each row; the first column of size c is its smallest j.
                    first_j = int(np.argmax(cols))
                    hit = bool((self.row_visits[rows] > first_j).any())
                if hit:
                    shapes.append((int(r), int(c)))
        return shapes


def _sizes(N: int, B: int) -> np.ndarray:
    sizes = np.full(num_blocks(N, B), B, dtype=np.int64)
    sizes[-1] = N - B * (len(sizes) - 1)
    return sizes


def block_visits(N_q: int, N_k: int, B_r: int, B_c: int, causal: bool = False,
                 block_mask: np.ndarray | None = None) -> BlockVisits:
    """The blocks a tiled pass visits, as :func:`fa2edu.masks.classify_block` decides (SKIP = not visited).

    Causal (bottom-right aligned, offset = N_k − N_q): block (i, j) is skipped iff its first key index j·B_c lies
    beyond the last query row's horizon, ``j·B_c > (stop_i − 1) + offset``. So row block i visits the prefix
    ``v_i = clip(floor((stop_i − 1 + offset)/B_c) + 1, 0, T_c)`` of column blocks, and column block j is visited by
    every row block whose horizon reaches j·B_c. Cost O(T_r + T_c) without a block mask, O(T_r·T_c) with one.
    """
    row_sizes, col_sizes = _sizes(N_q, B_r), _sizes(N_k, B_c)
    T_r, T_c = len(row_sizes), len(col_sizes)
    if causal:
        horizon = np.cumsum(row_sizes) - 1 + (N_k - N_q)          # last key index the block's last row may see
        row_visits = np.clip(np.floor_divide(horizon, B_c) + 1, 0, T_c)
    else:
        row_visits = np.full(T_r, T_c, dtype=np.int64)
    if block_mask is None:
        if causal:
            col_starts = np.arange(T_c, dtype=np.int64) * B_c
            col_visits = T_r - np.searchsorted(horizon, col_starts, side="left")
        else:
            col_visits = np.full(T_c, T_r, dtype=np.int64)
        return BlockVisits(N_q, N_k, B_r, B_c, row_sizes, col_sizes, row_visits.astype(np.int64),
                           col_visits.astype(np.int64))
    grid = check_block_mask(block_mask, N_q, N_k, B_r, B_c).copy()
    if causal:
        grid &= np.arange(T_c)[None, :] < row_visits[:, None]
    return BlockVisits(N_q, N_k, B_r, B_c, row_sizes, col_sizes, grid.sum(axis=1).astype(np.int64),
                       grid.sum(axis=0).astype(np.int64), grid)


# -- the ledger as formulas ---------------------------------------------------------------------------------------

def closed_form(algorithm: str, pass_: str, N: int, d: int, B_r: int | None = None,
                B_c: int | None = None) -> tuple[int, int]:
    """HBM ``(reads, writes)`` per (batch, head) for N_q = N_k = N, no mask: the conventions' table, exact for ragged N.

    T_r = ceil(N/B_r), T_c = ceil(N/B_c). Each pass over the rows of a tensor moves exactly N rows whatever the
    block sizes, so a ragged last block changes nothing but T_r and T_c:

    ==============================  ========================  =====================
    (algorithm, pass)               reads                     writes
    ==============================  ========================  =====================
    standard forward (FA1 Alg 0)    3Nd + 2N²                 Nd + 2N²
    standard backward (FA1 Alg 3)   5Nd + 5N²                 3Nd + 2N²
    flash1 forward (FA1 Alg 1)      2Nd + T_c(2Nd + 2N)       T_c(Nd + 2N)
    flash1 backward (FA1 Alg 4)     2Nd + T_c(4Nd + 2N)       2Nd + T_c·Nd
    flash2 forward (FA2 Alg 1)      Nd + 2Nd·T_r              Nd + N
    flash2 backward (FA2 Alg 2)     4Nd + T_c(3Nd + 2N)       N + 2Nd + T_c·Nd
    ==============================  ========================  =====================

    (FA2 backward without the redundant loads of its line 9, erratum 9.)
    """
    _check_pair(algorithm, pass_)
    if algorithm == "standard":
        if pass_ == "forward":
            return 3 * N * d + 2 * N * N, N * d + 2 * N * N
        return 5 * N * d + 5 * N * N, 3 * N * d + 2 * N * N
    if B_r is None or B_c is None:
        raise ValueError(f"closed_form({algorithm!r}, {pass_!r}) needs the block sizes B_r and B_c")
    T_r, T_c = num_blocks(N, B_r), num_blocks(N, B_c)
    table = {
        ("flash1", "forward"): (2 * N * d + T_c * (2 * N * d + 2 * N), T_c * (N * d + 2 * N)),
        ("flash1", "backward"): (2 * N * d + T_c * (4 * N * d + 2 * N), 2 * N * d + T_c * N * d),
        ("flash2", "forward"): (N * d + 2 * N * d * T_r, N * d + N),
        ("flash2", "backward"): (4 * N * d + T_c * (3 * N * d + 2 * N), N + 2 * N * d + T_c * N * d),
    }
    return table[(algorithm, pass_)]


def visit_form(algorithm: str, pass_: str, d: int, visits: BlockVisits, *,
               redundant_loads: bool = False) -> tuple[int, int]:
    """HBM ``(reads, writes)`` per (batch, head) summed over the blocks a pass visits (causal, block-sparse, ragged).

    With RV = Σ_visited r_i (Q-side rows streamed) and CV = Σ_visited c_j (K/V-side rows streamed), d_v = d:

    * flash1 forward (FA1 Alg 1/2/5): K_j, V_j once per column (line 6): 2N_k·d; per visited block Q_i, O_i, ℓ_i, m_i
      in (line 8) and O_i, ℓ_i, m_i out (lines 12-13): reads (2d + 2)·RV, writes (d + 2)·RV.
    * flash1 backward (FA1 Alg 4): K_j, V_j in, dK_j, dV_j out once per column (lines 7, 23): 2N_k·d each way; per
      visited block Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i in (lines 9-10), dQ_i out (line 21): (4d + 2)·RV and d·RV.
    * flash2 forward (FA2 Alg 1): Q_i in, O_i, L_i out once per row (lines 4, 14-15): N_q·d and (d + 1)·N_q; per
      visited block K_j, V_j in (line 7): 2d·CV.
    * flash2 backward (FA2 Alg 2): line 4 reads dO, O and writes D: 2N_q·d and N_q; K_j, V_j in and dK_j, dV_j out
      once per column (lines 6, 18): 2N_k·d each way; per visited block Q_i, dO_i, L_i, D_i, dQ_i in (lines 9, 15)
      and dQ_i out (line 15): (3d + 2)·RV and d·RV. ``redundant_loads`` adds line 9's printed O_i and dQ_i: 2d·RV.
    * standard (FA1 Alg 0 and 3) materialises S, P (and dP, dS) whatever the mask: see :func:`closed_form`.
    """
    _check_pair(algorithm, pass_)
    N_q, N_k, RV, CV = visits.N_q, visits.N_k, visits.row_elements, visits.col_elements
    if algorithm == "standard":
        # FA1 Alg 0: read Q, K; write S; read S; write P; read P, V; write O.  Alg 3: P, dO → dV; dO, V → dP;
        # P, dP → dS; dS, K → dQ; dS, Q → dK.  Masks do not shrink a materialised N_q × N_k matrix.
        if pass_ == "forward":
            return (N_q + 2 * N_k) * d + 2 * N_q * N_k, 2 * N_q * N_k + N_q * d
        return 5 * N_q * N_k + (3 * N_q + 2 * N_k) * d, 2 * N_q * N_k + (N_q + 2 * N_k) * d
    if (algorithm, pass_) == ("flash1", "forward"):
        # FA1 Alg 1 line 6: K_j, V_j | line 8: Q_i, O_i, ℓ_i, m_i in | lines 12-13: O_i, ℓ_i, m_i out (per visit).
        return 2 * N_k * d + (2 * d + 2) * RV, (d + 2) * RV
    if (algorithm, pass_) == ("flash1", "backward"):
        # FA1 Alg 4 line 7: K_j, V_j | line 10: Q_i, O_i, dO_i, dQ_i, ℓ_i, m_i | line 21: dQ_i | line 24: dK_j, dV_j.
        return 2 * N_k * d + (4 * d + 2) * RV, 2 * N_k * d + d * RV
    if (algorithm, pass_) == ("flash2", "forward"):
        # FA2 Alg 1 line 4: Q_i once | line 7: K_j, V_j per visit | lines 14-15: O_i, L_i once.
        return N_q * d + 2 * d * CV, (d + 1) * N_q
    # FA2 Alg 2 line 4: dO, O in, D out | line 6: K_j, V_j | line 9: Q_i, dO_i, L_i, D_i | line 15: dQ_i in and out
    # | line 18: dK_j, dV_j.  The printed line 9 also loads O_i and dQ_i (erratum 9).
    extra = 2 * d * RV if redundant_loads else 0
    return 2 * N_q * d + 2 * N_k * d + (3 * d + 2) * RV + extra, N_q + 2 * N_k * d + d * RV


def _working_set(algorithm: str, pass_: str, d: int, redundant_loads: bool = False):
    """The algorithm's peak on-chip elements for an (r, c) tile, as its module defines it."""
    if algorithm == "standard":
        if pass_ == "forward":
            return lambda r, n_k: standard.standard_forward_working_set(r, n_k, d, d)
        return lambda r, n_k: standard.standard_backward_working_set(r, n_k, d, d)
    if algorithm == "flash2":
        if pass_ == "forward":
            return lambda r, c: flash2.flash2_forward_working_set(r, c, d, d)
        return lambda r, c: flash2.flash2_backward_working_set(r, c, d, d, redundant_loads=redundant_loads)
    if pass_ == "forward":
        return lambda r, c: flash1.flash1_forward_working_set(r, c, d, d)
    return lambda r, c: flash1.flash1_backward_working_set(r, c, d, d)


def peak_sram_form(algorithm: str, pass_: str, d: int, visits: BlockVisits, *,
                   redundant_loads: bool = False) -> int:
    """Peak SRAM occupancy (elements) of a tiled pass: its working set at the largest tile shape it visits.

    Working sets grow with the tile shape (r, c), so the peak is the largest working set over the (at most four)
    tile shapes among visited blocks. Standard attention (B_r = ``visits.B_r``, B_c unused) holds a whole operand
    (K or V, N_k × d) beside row blocks of N_k columns: :func:`fa2edu.standard.standard_forward_working_set`.
    """
    working_set = _working_set(algorithm, pass_, d, redundant_loads)
    if algorithm == "standard":
        # Standard attention streams row blocks of B_r rows against whole rows of N_k: its peak is at a full block.
        return int(working_set(int(visits.row_sizes.max()), visits.N_k))
    shapes = visits.size_classes()
    busy = max((int(working_set(r, c)) for r, c in shapes), default=0)
    return max(busy, _idle_peak(algorithm, pass_, d, visits))


def _idle_peak(algorithm: str, pass_: str, d: int, visits: BlockVisits) -> int:
    """On-chip elements held by an outer-loop step whose inner loop visits nothing (causal with N_q > N_k: rows that
    see no key). Smaller than any visited step's working set; it matters only where few blocks are visited."""
    r, c = int(visits.row_sizes.max()), int(visits.col_sizes.max())
    if (algorithm, pass_) == ("flash2", "forward"):
        return 2 * r * d + 2 * r                     # Alg 1 lines 4-5: Q_i, Õ_i, ℓ_i, m_i
    if (algorithm, pass_) == ("flash2", "backward"):
        return max(4 * c * d, r * (2 * d + 1))       # Alg 2 lines 6-7: K_j, V_j, dK_j, dV_j; line 4: dO_i, O_i, D_i
    if (algorithm, pass_) == ("flash1", "forward"):
        return 2 * c * d                             # FA1 Alg 1 line 6: K_j, V_j (loaded for every j)
    return 4 * c * d                                 # FA1 Alg 4 lines 7-8: K_j, V_j, dK_j, dV_j


def standard_bound(N: int, d: int) -> int:
    """FA1 Theorem 2's order for standard attention: Nd + N² (constants dropped)."""
    return N * d + N * N


def flash_bound(N: int, d: int, M: int) -> float:
    """FA1 Theorem 2's order for FlashAttention: N²d²/M (constants dropped)."""
    return N * N * d * d / M


# -- executing the ledger -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IORow:
    """One (algorithm, pass) of an :class:`IOReport`: HBM elements per (batch, head), and how they were obtained."""

    algorithm: str
    pass_: str
    reads: int | float
    writes: int | float
    block_sizes: tuple[int, int] | None
    peak_sram: int | None
    method: str                      # "execute" or "closed_form"
    blocks_visited: int | None = None
    blocks_total: int | None = None
    by_line: dict | None = field(default=None, compare=False, repr=False)

    @property
    def total(self) -> int | float:
        """Reads plus writes: FA1 Theorem 2's "HBM accesses"."""
        return self.reads + self.writes

    def record(self) -> dict:
        return {"algorithm": self.algorithm, "pass": self.pass_, "reads": self.reads, "writes": self.writes,
                "total": self.total, "block_sizes": self.block_sizes, "peak_sram": self.peak_sram,
                "method": self.method, "blocks_visited": self.blocks_visited, "blocks_total": self.blocks_total}


def _random_problem(N_q: int, N_k: int, d: int, seed: int):
    """Random Q, K, V, dO in float32. The ledger counts elements, whatever their type, so float32 changes no
    count; it only halves the memory and time of the arithmetic the algorithms do on the way."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((N, d), dtype=np.float32) for N in (N_q, N_k, N_k, N_q))


class _ProgressHBM(HBM):
    """An :class:`~fa2edu.memory.HBM` that also advances a progress bar by every element its ledger records."""

    def __init__(self, bar) -> None:
        super().__init__()
        self._bar = bar

    def read(self, name: str, rows: slice, *, line: str, **options) -> np.ndarray:
        key = ("read", name, line)
        before = self.ledger[key]
        block = super().read(name, rows, line=line, **options)
        self._bar.update(self.ledger[key] - before)
        return block

    def write(self, name: str, rows: slice, value: np.ndarray, *, line: str, **options) -> None:
        key = ("write", name, line)
        before = self.ledger[key]
        super().write(name, rows, value, line=line, **options)
        self._bar.update(self.ledger[key] - before)


def _flash2_mask(block_mask, pass_: str, N_q: int, N_k: int, d: int, M, block_sizes):
    """FA2 takes an element mask: a (T_r, T_c) block mask on this pass's grid, expanded (None stays None)."""
    if block_mask is None:
        return None
    B_r, B_c = resolve_block_sizes(M, block_sizes, d, block_rule("flash2", pass_))
    return block_sparse_to_mask(block_mask, N_q, N_k, B_r, B_c)


def _run_pass(algorithm: str, pass_: str, problem, M, tiling: dict, mask, hbm: HBM, saved=None,
              redundant_loads: bool = False):
    """Run one counted pass on ``hbm``; returns the forward result (the backward pass's inputs).

    ``mask`` is what the algorithm takes: None, FA1 Alg 5's block mask (flash1) or an element mask (flash2).
    A backward pass uses ``saved``, the forward result of the same problem, or runs that forward pass uncounted.
    """
    Q, K, V, dO = problem
    forward = pass_ == "forward"
    fwd = saved
    if algorithm == "standard":
        # FA1 Alg 0 and 3 materialise all of S and P whatever the mask: a block mask changes no count.
        # Only the row block B_r = ceil(M/4d) of its streaming depends on M; the counts do not.
        if fwd is None or forward:
            fwd = standard.standard_attention(Q, K, V, causal=tiling["causal"], M=M, hbm=hbm if forward else None)
        if not forward:
            standard.standard_attention_backward(Q, K, V, fwd.P, dO, causal=tiling["causal"], M=M, hbm=hbm)
    elif algorithm == "flash1":
        if fwd is None or forward:
            run = hbm if forward else None
            fwd = (flash1.flash1_forward(Q, K, V, **tiling, hbm=run) if mask is None
                   else flash1.flash1_block_sparse_forward(Q, K, V, mask, **tiling, hbm=run))
        if not forward:
            if mask is None:
                flash1.flash1_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, **tiling, hbm=hbm)
            else:
                flash1.flash1_block_sparse_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, mask, **tiling, hbm=hbm)
    else:
        if forward:
            fwd = flash2.flash2_forward(Q, K, V, **tiling, mask=mask, hbm=hbm)
        else:
            if fwd is None:
                # The forward pass only supplies O and L here; any tiling gives the same ones.
                fwd_bs = resolve_block_sizes(M, tiling["block_sizes"], Q.shape[-1], block_rule("flash2", pass_))
                fwd = flash2.flash2_forward(Q, K, V, block_sizes=fwd_bs, causal=tiling["causal"], mask=mask)
            flash2.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, **tiling, mask=mask,
                                   redundant_loads=redundant_loads, hbm=hbm)
    return fwd


def _ledger_row(algorithm: str, pass_: str, hbm: HBM, N_q: int, N_k: int, causal: bool, block_mask) -> IORow:
    """The report's row of a counted pass: its ledger, and the blocks it visited."""
    if algorithm == "standard":
        return IORow(algorithm, pass_, hbm.reads, hbm.writes, None, hbm.sram.peak, "execute", by_line=hbm.by_line())
    visits = block_visits(N_q, N_k, *hbm.block_sizes, causal=causal, block_mask=block_mask)
    return IORow(algorithm, pass_, hbm.reads, hbm.writes, hbm.block_sizes, hbm.sram.peak, "execute",
                 visits.visited, visits.total, hbm.by_line())


def execute_io(algorithm: str, pass_: str, N_q: int, N_k: int, d: int, M: int | None, *, causal: bool = False,
               block_sizes: tuple[int, int] | None = None, block_mask: np.ndarray | None = None,
               redundant_loads: bool = False, seed: int = 0) -> IORow:
    """Run one (algorithm, pass) on random float32 data with an :class:`~fa2edu.memory.HBM` and read its ledger.

    The backward pass first runs its own forward pass uncounted, for the statistics it needs (P, or O and ℓ, m, or
    O and L). ``block_mask`` (T_r, T_c) is on this pass's block grid: FA1 Algorithm 5 for flash1; for flash2 it is
    expanded to the element mask, whose zero blocks FA2's block classification skips.
    Cost: the algorithm's own, one NumPy step per visited block (seconds for the six passes at N = 8192, d = 64).
    """
    _check_pair(algorithm, pass_)
    hbm = HBM()
    mask = _flash2_mask(block_mask, pass_, N_q, N_k, d, M, block_sizes) if algorithm == "flash2" else block_mask
    tiling = {"M": M, "block_sizes": block_sizes, "causal": causal}
    _run_pass(algorithm, pass_, _random_problem(N_q, N_k, d, seed), M, tiling, mask, hbm,
              redundant_loads=redundant_loads)
    return _ledger_row(algorithm, pass_, hbm, N_q, N_k, causal, block_mask)


def _same_mask(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                         and bool(np.array_equal(a, b)))


def _execute_plan(plan, N_q: int, N_k: int, d: int, M, causal: bool, block_sizes, seed: int, progress) -> list:
    """Execute every (algorithm, pass) of ``plan`` (see :func:`simulate_io`), one fresh ledger each.

    Each backward pass reuses its own algorithm's forward result when the forward pass ran the same problem (same
    mask), rather than running it again uncounted. ``progress``: a bar on stderr, in HBM elements, whose length
    is the formulas' count (:func:`visit_form`), so it ends exactly full when the ledger agrees with them.
    """
    problem = _random_problem(N_q, N_k, d, seed)
    tiling = {"M": M, "block_sizes": block_sizes, "causal": causal}
    total = None
    if progress is not False:
        total = sum(_formula_row(algorithm, pass_, N_q, N_k, d, bs, causal, mask).total
                    for algorithm, pass_, bs, mask in plan)
    rows, forwards = [], {}
    bar = tqdm(total=total, desc="executing", unit=" elements", unit_scale=True, file=sys.stderr, leave=False,
               dynamic_ncols=True, disable=None if progress is None else not progress)
    # One BLAS thread: the products are tile-sized (B_r × d by d × B_c), where extra threads only wait for each
    # other, and on a machine busy with other work that waiting made N = 8192 run 10× slower.
    with threadpool_limits(limits=1, user_api="blas"), bar:
        for algorithm, pass_, _, block_mask in plan:
            bar.set_description(f"executing {algorithm} {pass_}")
            mask = (_flash2_mask(block_mask, pass_, N_q, N_k, d, M, block_sizes) if algorithm == "flash2"
                    else block_mask)
            saved_mask, saved = forwards.get(algorithm, (None, None))
            if saved is not None and not _same_mask(saved_mask, mask):
                saved = None
            hbm = _ProgressHBM(bar)
            fwd = _run_pass(algorithm, pass_, problem, M, tiling, mask, hbm, saved=saved)
            if pass_ == "forward":
                forwards[algorithm] = (mask, fwd)
            rows.append(_ledger_row(algorithm, pass_, hbm, N_q, N_k, causal, block_mask))
    return rows


def _formula_row(algorithm: str, pass_: str, N_q: int, N_k: int, d: int, block_sizes, causal: bool,
                 block_mask, redundant_loads: bool = False) -> IORow:
    """The same row as :func:`execute_io`, from :func:`visit_form` and :func:`peak_sram_form`."""
    if algorithm == "standard":
        visits = block_visits(N_q, N_k, block_sizes[0], N_k)    # row blocks of B_r rows, all N_k columns at once
        reads, writes = visit_form(algorithm, pass_, d, visits)
        return IORow(algorithm, pass_, reads, writes, None, peak_sram_form(algorithm, pass_, d, visits),
                     "closed_form")
    visits = block_visits(N_q, N_k, *block_sizes, causal=causal, block_mask=block_mask)
    reads, writes = visit_form(algorithm, pass_, d, visits, redundant_loads=redundant_loads)
    peak = peak_sram_form(algorithm, pass_, d, visits, redundant_loads=redundant_loads)
    return IORow(algorithm, pass_, reads, writes, tuple(block_sizes), peak, "closed_form", visits.visited,
                 visits.total)


# -- the report ---------------------------------------------------------------------------------------------------

@dataclass
class IOReport:
    """HBM traffic of each (algorithm, pass) at one problem size: what :func:`simulate_io` returns.

    ``str(report)`` is a table; in a notebook it renders as HTML; :meth:`to_records` gives plain dicts (for pandas
    or JSON); :meth:`to_bytes` converts to bytes for a dtype and a number of (batch, head) programs.

    Attributes
    ----------
    N : int
        Sequence length of the queries, N_q.
    N_k : int
        Sequence length of the keys and values.
    d : int
        Head dimension.
    M : int or None
        SRAM size in elements; None for explicit block sizes on an unbounded SRAM.
    causal : bool
        Whether the runs were causal.
    rows : list of IORow
        One row per (algorithm, pass), in elements per (batch, head).
    block_density : float or None
        The requested block sparsity s; default None (dense).
    mask : str or None
        The mask_mod a FlexAttention report counts (:func:`simulate_flex_io`); default None (none).
    """

    N: int
    N_k: int
    d: int
    M: int | None                                # None: explicit block sizes on an unbounded SRAM
    causal: bool
    rows: list[IORow]
    block_density: float | None = None          # the requested block-sparsity s, if any
    mask: str | None = None                     # the mask_mod of a FlexAttention report

    def row(self, algorithm: str, pass_: str) -> IORow:
        """The row of ``(algorithm, pass_)``, e.g. ``report.row("flash2", "forward")``."""
        _check_pair(algorithm, pass_, REPORT_ALGORITHMS)
        for r in self.rows:
            if r.algorithm == algorithm and r.pass_ == pass_:
                return r
        raise KeyError(f"this report has no row for ({algorithm!r}, {pass_!r})")

    def ratio(self, algorithm: str, pass_: str, baseline: str = "standard") -> float:
        """How many times fewer HBM accesses ``algorithm`` makes than ``baseline`` in the same pass."""
        return self.row(baseline, pass_).total / self.row(algorithm, pass_).total

    def to_records(self) -> list[dict]:
        """One dict per row: algorithm, pass, reads, writes, total, block_sizes, peak_sram, method, blocks_*."""
        return [r.record() for r in self.rows]

    def to_bytes(self, dtype="float16", batch: int = 1, heads: int = 1) -> list[dict]:
        """Rows in bytes for ``batch × heads`` programs of ``dtype`` elements: keys as :meth:`to_records`, plus
        ``reads_bytes``, ``writes_bytes``, ``total_bytes``, ``dtype``, ``batch``, ``heads``."""
        for name, value in (("batch", batch), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        factor = itemsize(dtype) * batch * heads
        records = []
        for rec in self.to_records():
            rec.update(reads_bytes=rec["reads"] * factor, writes_bytes=rec["writes"] * factor,
                       total_bytes=rec["total"] * factor, dtype=str(np.dtype(dtype)) if not isinstance(dtype, str)
                       else dtype, batch=batch, heads=heads)
            records.append(rec)
        return records

    # -- display -------------------------------------------------------------------------------------------------
    def title(self) -> str:
        shape = f"N = {self.N:,}" if self.N_k == self.N else f"N_q = {self.N:,}, N_k = {self.N_k:,}"
        mask = "causal" if self.causal else "no mask"
        if self.mask is not None:
            mask = f"mask_mod {self.mask}"
        if self.block_density is not None:
            mask += f", block-sparse s = {self.block_density:g}"
        sram = "unbounded" if self.M is None else f"{self.M:,}"
        return f"HBM traffic per (batch, head), in elements: {shape}, d = {self.d}, M = {sram} ({mask})"

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        head = ["algorithm", "pass", "B_r × B_c", "blocks", "reads", "writes", "total", "vs standard",
                "peak SRAM", "method"]
        body = []
        for r in self.rows:
            try:
                ratio = self.ratio(r.algorithm, r.pass_)
                versus = f"{ratio:.2f}× less" if ratio >= 1 else f"{1 / ratio:.2f}× more"
                versus = "baseline" if r.algorithm == "standard" else versus
            except KeyError:
                versus = "—"
            body.append([
                r.algorithm, r.pass_, "—" if r.block_sizes is None else f"{r.block_sizes[0]} × {r.block_sizes[1]}",
                "—" if r.blocks_visited is None else f"{r.blocks_visited:,}/{r.blocks_total:,}",
                f"{r.reads:,}", f"{r.writes:,}", f"{r.total:,}", versus,
                "—" if r.peak_sram is None else f"{r.peak_sram:,}", r.method.replace("_", " ")])
        return head, body

    def _notes(self) -> list[str]:
        notes = []
        for pass_ in PASSES:
            try:
                notes.append(f"flash2 {pass_} / flash1 {pass_} traffic: "
                             f"{self.row('flash2', pass_).total / self.row('flash1', pass_).total:.3f}")
            except KeyError:
                pass
        return notes

    def __str__(self) -> str:
        head, body = self._cells()
        widths = [max(len(row[k]) for row in [head] + body) for k in range(len(head))]
        numeric = {3, 4, 5, 6, 7, 8}
        lines = [self.title()]
        for row in [head] + body:
            lines.append("  ".join(cell.rjust(w) if k in numeric else cell.ljust(w)
                                   for k, (cell, w) in enumerate(zip(row, widths))).rstrip())
        lines.extend(self._notes())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head, body = self._cells()
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
        notes = "".join(f"<br>{html.escape(n)}" for n in self._notes())
        return (f"<div><b>{html.escape(self.title())}</b><table><thead><tr>{th}</tr></thead>"
                f"<tbody>{trs}</tbody></table><small>{notes}</small></div>")

    def __repr__(self) -> str:
        return (f"IOReport(N={self.N}, N_k={self.N_k}, d={self.d}, M={self.M}, causal={self.causal}, "
                f"rows={len(self.rows)})")


# -- simulate_io --------------------------------------------------------------------------------------------------

def _check_pair(algorithm: str, pass_: str, algorithms=ALGORITHMS) -> None:
    if algorithm not in algorithms:
        raise ValueError(f"algorithm must be one of {algorithms}, got {algorithm!r}")
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def _block_mask_for(block_sparsity, algorithm: str, pass_: str, N_q: int, N_k: int, block_sizes, seed: int):
    """The (T_r, T_c) block mask of one pass: the given array, or a random mask of density s on its own grid."""
    if block_sparsity is None or algorithm == "standard":
        return None
    if isinstance(block_sparsity, np.ndarray):
        return check_block_mask(block_sparsity, N_q, N_k, *block_sizes)
    T_r, T_c = num_blocks(N_q, block_sizes[0]), num_blocks(N_k, block_sizes[1])
    return random_block_mask(T_r, T_c, float(block_sparsity), seed=seed)


def _check_block_sparsity(block_sparsity, block_sizes):
    if block_sparsity is None:
        return None
    if isinstance(block_sparsity, np.ndarray):
        if block_sparsity.dtype != np.bool_:
            raise TypeError("block_sparsity must be a float s in (0, 1] or a bool (T_r, T_c) block mask")
        if block_sizes is None:
            raise ValueError("a block_sparsity mask lives on one block grid: pass block_sizes=(B_r, B_c) with it")
        return float(block_sparsity.mean())
    if isinstance(block_sparsity, bool) or not isinstance(block_sparsity, Real):
        raise TypeError(f"block_sparsity must be a float s in (0, 1] or a bool block mask, "
                        f"got {type(block_sparsity).__name__}")
    if not 0.0 < float(block_sparsity) <= 1.0:
        raise ValueError(f"block_sparsity (the fraction s of non-zero blocks) must lie in (0, 1], got {block_sparsity}")
    return float(block_sparsity)


def simulate_io(N: int, d: int, M: int | None, causal: bool = False, *, N_k: int | None = None, block_sizes=None,
                block_sparsity=None, method: str = "auto", algorithms=ALGORITHMS, passes=PASSES,
                seed: int = 0, progress: bool | None = False) -> IOReport:
    """HBM reads and writes of standard attention, FlashAttention and FlashAttention-2, forward and backward.

    ``simulate_io(65536, 64, 98304)`` answers in milliseconds (closed forms); executing costs one NumPy step per
    visited block (several seconds at N = 8192, d = 64, M = 49152).

    Parameters
    ----------
    N : int
        Sequence length of the queries, N_q, positive.
    d : int
        Head dimension of Q, K and V, positive.
    M : int or None
        SRAM size in **elements** (FA1 Theorem 2; :func:`fa2edu.hardware.M_for` converts from a GPU). Each tiled pass
        takes its block sizes from M by its own rule (the conventions page). None is allowed only with explicit
        ``block_sizes``: an unbounded SRAM that still records its peak.
    causal : bool, default False
        Count causal attention: blocks above the diagonal are skipped.
    N_k : int, optional
        Sequence length of the keys and values. Default None: N_k = N.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)`` for every tiled pass. Default None: each pass's own rule applied to ``M``.
    block_sparsity : float or ndarray of bool, optional
        Block-sparse attention (FA1 Algorithm 5): a fraction s in (0, 1], for a random block mask of that density on
        each pass's block grid (diagonal kept), or a bool (T_r, T_c) block mask, which needs ``block_sizes``. Default
        None: dense.
    method : {"auto", "execute", "closed_form"}, default "auto"
        ``"execute"`` runs the algorithms on random data and reads their ledgers (the ground truth); ``"closed_form"``
        evaluates :func:`visit_form`, proven equal by the tests; ``"auto"`` executes when the runs are small (a few
        thousand blocks) and uses the formulas otherwise.
    algorithms : collection of str, optional
        Which of ``"standard"``, ``"flash1"``, ``"flash2"`` to count. Default: all three.
    passes : collection of str, optional
        Which of ``"forward"``, ``"backward"`` to count. Default: both.
    seed : int, default 0
        Seed of the random inputs of executed runs and of random block masks.
    progress : bool or None, default False
        While executing, show a progress bar on stderr counting the HBM elements moved (True), none (False), or one only
        when stderr is a terminal (None).

    Returns
    -------
    IOReport
        One :class:`IORow` per (algorithm, pass): HBM reads and writes in elements per (batch, head).
    """
    N = _check_positive_int(N, "N")
    d = _check_positive_int(d, "d")
    N_k = N if N_k is None else _check_positive_int(N_k, "N_k")
    if M is None:
        if block_sizes is None:
            raise ValueError("M (the SRAM size in elements) is required unless block_sizes=(B_r, B_c) is given")
    else:
        M = check_M(M, d)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for name, chosen, allowed in (("algorithms", algorithms, ALGORITHMS), ("passes", passes, PASSES)):
        if isinstance(chosen, str) or not set(chosen) <= set(allowed) or not chosen:
            raise ValueError(f"{name} must be a non-empty collection drawn from {allowed}, got {chosen!r}")
    density = _check_block_sparsity(block_sparsity, block_sizes)
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool or None, got {type(progress).__name__}")

    plan = []                               # (algorithm, pass, block sizes, block mask)
    for algorithm in ALGORITHMS:
        if algorithm not in algorithms:
            continue
        for pass_ in PASSES:
            if pass_ not in passes:
                continue
            rule = block_rule(algorithm, pass_)
            # Standard attention always streams with its rule's B_r: explicit block sizes are for the tiled passes.
            bs = (rule(DEFAULT_M if M is None else M, d) if algorithm == "standard"
                  else resolve_block_sizes(M, block_sizes, d, rule))
            mask = _block_mask_for(block_sparsity, algorithm, pass_, N, N_k, bs, seed)
            plan.append((algorithm, pass_, bs, mask))

    if method == "auto":
        blocks = sum(block_visits(N, N_k, *bs, causal=causal, block_mask=mask).visited
                     for algorithm, _, bs, mask in plan if algorithm != "standard")
        method = "execute" if blocks <= EXECUTE_MAX_BLOCKS and N * N_k <= EXECUTE_MAX_SCORES else "closed_form"

    if method == "execute":
        rows = _execute_plan(plan, N, N_k, d, M, causal, block_sizes, seed, progress)
        return IOReport(N, N_k, d, M, bool(causal), rows, density)
    rows = []
    for algorithm, pass_, bs, mask in plan:
        if algorithm != "standard" and M is not None:
            _check_fits(algorithm, pass_, d, M, bs, N, N_k)
        rows.append(_formula_row(algorithm, pass_, N, N_k, d, bs, causal, mask))
    return IOReport(N, N_k, d, M, bool(causal), rows, density)


def _check_fits(algorithm: str, pass_: str, d: int, M: int, block_sizes, N_q: int, N_k: int) -> None:
    """Explicit block sizes must fit the SRAM as the executed run would demand (:func:`fa2edu.blocks.start_run`)."""
    rule = block_rule(algorithm, pass_)
    working_set = _working_set(algorithm, pass_, d)
    capacity = max(M, working_set(*rule(M, d)))
    need = working_set(min(block_sizes[0], N_q), min(block_sizes[1], N_k))
    if need > capacity:
        raise SRAMOverflowError(
            f"block_sizes (B_r, B_c) = {tuple(block_sizes)} need {need} elements of SRAM for {algorithm} {pass_} "
            f"with d = {d}, but M = {M} gives {capacity}; choose smaller block_sizes or a larger M")



# -- FlexAttention: the traffic of a block mask ------------------------------------------------------------------

def _flex_rows_streamed(block_mask: flex.BlockMask) -> tuple[float, float, float]:
    """(RV, CV, blocks) per program: Σ over the blocks it visits of their query rows r_i, of their key rows c_j,
    and their number, averaged over the BlockMask's (batch, head) programs (a size-1 axis is one program for all)."""
    visited = block_mask.classes != flex.SKIPPED                               # (B, H, T_r, T_c)
    r = _sizes(block_mask.Q_LEN, block_mask.BLOCK_SIZE[0])[:, None]
    c = _sizes(block_mask.KV_LEN, block_mask.BLOCK_SIZE[1])[None, :]

    def per_program(x) -> float:
        return float((visited * x).sum(axis=(2, 3)).mean())
    return per_program(r), per_program(c), per_program(1)


def flex_visit_form(pass_: str, block_mask, d: int, d_v: int | None = None) -> tuple[int | float, int | float]:
    """HBM ``(reads, writes)`` per (batch, head) of :func:`fa2edu.flex.flex_attention` (``"forward"``) or
    :func:`~fa2edu.flex.flex_attention_backward` (``"backward"``) over ``block_mask``, in closed form.

    FA2's lines summed over the blocks the BlockMask visits (partial or full), as :func:`visit_form` sums them for
    flash2, with d_v apart from d. RV = Σ over visited blocks of their query rows, CV = of their key rows, per
    program (an average when the classes differ between batch entries or heads):

    * forward (FA2 Alg 1): Q_i once per query block (line 4): N_q·d; K_j, V_j per visited block (line 7):
      (d + d_v)·CV. Writes O_i, L_i once (lines 14-15): N_q·(d_v + 1).
    * backward (FA2 Alg 2): line 4 reads dO, O (2N_q·d_v) and writes D (N_q); K_j, V_j in, dK_j, dV_j out once per
      key block (lines 6, 18): N_k·(d + d_v) each way; per visited block Q_i, dO_i, L_i, D_i (line 9) and dQ_i
      (line 15) in, dQ_i out: (2d + d_v + 2)·RV reads, d·RV writes.

    Skipped blocks cost nothing, so a sliding window of w keys moves Θ(N·w·d) elements, not Θ(N²·d).
    :func:`simulate_flex_io` checks this against the executed ledger; so do the tests.

    Parameters
    ----------
    pass_ : {"forward", "backward"}
        Which pass.
    block_mask : BlockMask
        The classification the pass runs over (:func:`fa2edu.flex.create_block_mask`).
    d : int
        Head dimension of q and k.
    d_v : int, optional
        Head dimension of v. Default None: d.

    Returns
    -------
    tuple
        ``(reads, writes)`` in elements per (batch, head): ints, or floats when programs differ.
    """
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    if not isinstance(block_mask, flex.BlockMask):
        raise TypeError(f"block_mask must be a fa2edu.flex.BlockMask, got {type(block_mask).__name__}")
    d = _check_positive_int(d, "d")
    d_v = d if d_v is None else _check_positive_int(d_v, "d_v")
    N_q, N_k = block_mask.Q_LEN, block_mask.KV_LEN
    RV, CV, _ = _flex_rows_streamed(block_mask)
    if pass_ == "forward":
        # FA2 Alg 1 line 4: Q_i once | line 7: K_j, V_j per visited block | lines 14-15: O_i, L_i once.
        return _as_count(N_q * d + (d + d_v) * CV), N_q * (d_v + 1)
    # FA2 Alg 2 line 4: dO, O in, D out | lines 6, 18: K_j, V_j in, dK_j, dV_j out | lines 9, 15 per visited block.
    reads = 2 * N_q * d_v + N_k * (d + d_v) + (2 * d + d_v + 2) * RV
    writes = N_q + N_k * (d + d_v) + d * RV
    return _as_count(reads), _as_count(writes)


def _as_count(x: float) -> int | float:
    return int(round(x)) if abs(x - round(x)) < 1e-9 * max(1.0, abs(x)) else float(x)


def _flex_grid_visits(block_mask) -> BlockVisits:
    """The blocks some program visits, as a :class:`BlockVisits` (for the peak SRAM: the tile shapes loaded)."""
    grid = (block_mask.classes != flex.SKIPPED).any(axis=(0, 1))
    B_r, B_c = block_mask.BLOCK_SIZE
    return BlockVisits(block_mask.Q_LEN, block_mask.KV_LEN, B_r, B_c, _sizes(block_mask.Q_LEN, B_r),
                       _sizes(block_mask.KV_LEN, B_c), grid.sum(axis=1).astype(np.int64),
                       grid.sum(axis=0).astype(np.int64), grid)


def simulate_flex_io(mask, N: int, d: int, M: int | None = None, *, N_k: int | None = None, B: int | None = None,
                     H: int | None = None, BLOCK_SIZE=128, method: str = "auto", passes=PASSES,
                     seed: int = 0) -> IOReport:
    """HBM reads and writes of FlexAttention (:mod:`fa2edu.flex`) over a mask, forward and backward.

    ``"execute"`` runs :func:`~fa2edu.flex.flex_attention` (and its backward) on random float32 data and reads the
    ledger, the ground truth: a block the mask skips is never read. ``"closed_form"`` evaluates
    :func:`flex_visit_form` (equal to it: tests/test_flex_io.py) and the peak SRAM of the tiles loaded. Either way
    the mask is first classified by :func:`~fa2edu.flex.create_block_mask`, one mask_mod evaluation per score.

    Parameters
    ----------
    mask : callable or BlockMask or None
        A ``mask_mod(b, h, q_idx, kv_idx) -> bool``, classified here with ``B``, ``H`` and ``BLOCK_SIZE``; or a
        BlockMask, whose own B, H and BLOCK_SIZE are used; None: no mask (dense, every block full).
    N : int
        Number of queries, N_q (a BlockMask's Q_LEN).
    d : int
        Head dimension (d_v = d).
    M : int, optional
        SRAM size in elements: BLOCK_SIZE tiles that need more on-chip memory than M holds (by FA2's block-size
        rule, as :func:`simulate_io` checks) raise :class:`~fa2edu.memory.SRAMOverflowError`. Default None: an
        unbounded SRAM whose peak is reported.
    N_k : int, optional
        Number of keys. Default None: N_k = N.
    B : int, optional
        Batch size for a mask_mod that depends on b. Default None: broadcast (b = 0).
    H : int, optional
        Number of heads for a mask_mod that depends on h. Default None: broadcast (h = 0).
    BLOCK_SIZE : int or tuple of int, default 128
        Block size (B_r, B_c) for a mask_mod (a BlockMask has its own).
    method : {"auto", "execute", "closed_form"}, default "auto"
        Execute, evaluate the closed form, or execute only when the runs are small (as :func:`simulate_io`).
    passes : collection of str, optional
        Which of ``"forward"``, ``"backward"`` to count. Default: both.
    seed : int, default 0
        Seed of the random inputs of executed runs.

    Returns
    -------
    IOReport
        One :class:`IORow` per pass, algorithm ``"flex"``, in elements per (batch, head); ``blocks_visited`` is the
        average number of blocks a program visits; ``block_density`` the BlockMask's fraction visited.
    """
    N = _check_positive_int(N, "N")
    d = _check_positive_int(d, "d")
    N_k = N if N_k is None else _check_positive_int(N_k, "N_k")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(passes, str) or not passes or not set(passes) <= set(PASSES):
        raise ValueError(f"passes must be a non-empty collection drawn from {PASSES}, got {passes!r}")
    if isinstance(mask, flex.BlockMask):
        block_mask = mask
        if (block_mask.Q_LEN, block_mask.KV_LEN) != (N, N_k):
            raise ValueError(f"the BlockMask was made for Q_LEN = {block_mask.Q_LEN}, KV_LEN = {block_mask.KV_LEN}, "
                             f"not N = {N}, N_k = {N_k}")
    elif mask is None or callable(mask):
        block_mask = flex.create_block_mask(mask, B, H, N, N_k, BLOCK_SIZE=BLOCK_SIZE)
    else:
        raise TypeError(f"mask must be a mask_mod, a fa2edu.flex.BlockMask or None, got {type(mask).__name__}")
    if M is not None:
        M = check_M(M, d)
        for pass_ in passes:
            _check_fits("flash2", pass_, d, M, block_mask.BLOCK_SIZE, N, N_k)
    chosen = [p for p in PASSES if p in passes]
    _, _, blocks = _flex_rows_streamed(block_mask)
    if method == "auto":
        visited = int((block_mask.classes != flex.SKIPPED).any(axis=(0, 1)).sum())
        small = visited * len(chosen) <= EXECUTE_MAX_BLOCKS and N * N_k <= EXECUTE_MAX_SCORES
        method = "execute" if small else "closed_form"
    total = block_mask.T_r * block_mask.T_c
    rows = []
    if method == "execute":
        rng = np.random.default_rng(seed)
        shape = (block_mask.B, block_mask.H)
        q, k, v, dO = (rng.standard_normal(shape + (n, d), dtype=np.float32) for n in (N, N_k, N_k, N))
        with threadpool_limits(limits=1, user_api="blas"):
            hbm = HBM()
            O, L = flex.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                       hbm=hbm if "forward" in chosen else None)
            if "forward" in chosen:
                rows.append(IORow("flex", "forward", hbm.reads, hbm.writes, block_mask.BLOCK_SIZE, hbm.sram.peak,
                                  "execute", _as_count(blocks), total, hbm.by_line()))
            if "backward" in chosen:
                hbm = HBM()
                flex.flex_attention_backward(q, k, v, O, L, dO, block_mask=block_mask, hbm=hbm)
                rows.append(IORow("flex", "backward", hbm.reads, hbm.writes, block_mask.BLOCK_SIZE, hbm.sram.peak,
                                  "execute", _as_count(blocks), total, hbm.by_line()))
    else:
        visits = _flex_grid_visits(block_mask)
        for pass_ in chosen:
            reads, writes = flex_visit_form(pass_, block_mask, d)
            rows.append(IORow("flex", pass_, reads, writes, block_mask.BLOCK_SIZE,
                              peak_sram_form("flash2", pass_, d, visits), "closed_form", _as_count(blocks), total))
    name = getattr(block_mask.mask_mod, "__name__", "None" if block_mask.mask_mod is None else "mask_mod")
    return IOReport(N, N_k, d, M, False, rows, block_mask.density(), name)
