"""Work partitioning: between thread blocks (FA2 Section 3.2) and between the warps of one block (FA2 Section 3.3).

**Thread blocks (FA2 Section 3.2).** FA1 launches one thread block per (batch, head): ``batch · heads`` blocks. FA2's
forward pass also splits the sequence: one thread block per block of B_r query rows, ``batch · heads · T_r`` blocks.
A GPU with ``sms`` streaming multiprocessors runs at most ``sms · resident`` blocks at once; the grid runs in
*waves*, and a last wave that is only partly full leaves SMs idle. :func:`grid_blocks`, :func:`waves` and
:func:`sm_utilisation` turn this into arithmetic.

**Warps (FA2 Section 3.3, Figure 3).** Inside one thread block, W warps (4 or 8) share the work of one inner-loop
step, ``S = τ Q_i K_jᵀ``, the softmax update and ``P̃ V_j``. There are two ways to split it:

* **split-K** (FA1, Figure 3a): every warp reads all of Q_i and a *slice of the columns* of K_j and V_j. Each warp
  then holds a partial result for every row, normalised to its own row maximum: ``(m_w, ℓ_w, Õ_w)``. The partials
  must be added up, so every warp writes them to shared memory, the block synchronises, and the warps read them
  back and merge them with the (m, ℓ) rule of :func:`fa2edu.softmax.merge_stats`.
* **split-Q** (FA2, Figure 3b): every warp reads all of K_j and V_j and a *slice of the rows* of Q_i. Rows of the
  output never depend on other rows, so each warp owns its rows' ``(m, ℓ, Õ)`` from start to finish: no exchange.

The simulation here executes both schemes warp by warp on one shared memory object that counts every element
stored or loaded and every barrier (``__syncthreads()``), and computes O and L, which the tests check against the
float64 oracle. To isolate Section 3.3's change, both schemes run the same loop: one thread block per row block
Q_i, streaming the K/V tiles (FA2's loop order). The counting rules, kept deliberately simple:

1. Tiles arrive from HBM into shared memory once: Q_i at the start, K_j and V_j at each step (``tile_writes``).
   A barrier follows each arrival so that every warp sees the whole tile.
2. A warp reads from shared memory every operand element it multiplies, at the step that uses it
   (``operand_reads``): nothing but a warp's own running statistics and accumulator stays in registers.
3. Partial results meant for another warp travel through shared memory (``exchange_writes``/``exchange_reads``),
   with a barrier between the writes and the reads.
4. A barrier ends each step, so that no warp overwrites K_j, V_j (or the exchange buffers) while another warp
   still reads them. A warp that got no rows (or no columns) of a tile sits the step out.

Closed forms per thread block of r rows, T_c tiles of c_j columns (Σ c_j = N_k), W warps, ``W_q = min(W, r)``
warps with rows and ``W_k(j) = min(W, c_j)`` warps with columns (:func:`thread_block_counts`):

=================  ===========================  ====================================
count              split-Q (FA2)                split-K (FA1)
=================  ===========================  ====================================
tile writes        r·d + N_k(d + d_v)           r·d + N_k(d + d_v)
operand reads      T_c·r·d + W_q·N_k(d + d_v)   r·d·Σ W_k(j) + N_k(d + d_v)
exchange writes    0                            r(d_v + 2)·Σ W_k(j)
exchange reads     0                            r(d_v + 2)·Σ W_k(j)
barriers           2·T_c                        3·T_c
=================  ===========================  ====================================

Split-Q always saves the exchange and one barrier per step. In raw operand reads the two schemes trade places: split-Q
reads K_j and V_j once per warp, split-K reads Q_i once per warp. When every tile has at most as many columns as the
block has rows (c_j ≤ r: square or tall tiles, which the Q-outer block-size rule gives) and d_v = d, split-Q's
total shared-memory traffic is strictly lower; for wide tiles over few rows it need not be (``tests/test_partition.py``
proves both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Integral
from typing import NamedTuple

import numpy as np

from fa2edu.blocks import block_sizes_q_outer, num_blocks, resolve_block_sizes, tiles
from fa2edu.memory import tile_elements
from fa2edu.softmax import Stats, exp_minus, logsumexp_from_stats, merge_stats
from fa2edu.validation import prepare

__all__ = [
    "SCHEMES", "SharedMemoryCounts", "SharedMemory", "PartitionedForward", "warp_slices",
    "split_q_thread_block", "split_k_thread_block", "partitioned_forward", "thread_block_counts",
    "shared_memory_counts", "grid_blocks", "waves", "sm_utilisation",
]

#: The two ways of splitting one thread block's work between warps (FA2 Figure 3).
SCHEMES = ("split_q", "split_k")


# -- the shared memory of one thread block ------------------------------------------------------------------------

@dataclass
class SharedMemoryCounts:
    """Shared-memory traffic of a thread block (or a sum of them), in elements per program, and its barriers."""

    tile_writes: int = 0       # Q_i, K_j, V_j arriving from HBM
    operand_reads: int = 0     # tiles read by warps for their matmuls
    exchange_writes: int = 0   # partial results written for other warps (split-K)
    exchange_reads: int = 0    # partial results read back (split-K)
    barriers: int = 0          # __syncthreads() calls

    @property
    def reads(self) -> int:
        return self.operand_reads + self.exchange_reads

    @property
    def writes(self) -> int:
        return self.tile_writes + self.exchange_writes

    @property
    def total(self) -> int:
        """All shared-memory element accesses, reads plus writes."""
        return self.reads + self.writes

    def __add__(self, other: SharedMemoryCounts) -> SharedMemoryCounts:
        return SharedMemoryCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class SharedMemory:
    """One thread block's shared memory: named tiles, every element stored or loaded counted, and barriers.

    Arrays carry the leading (batch, head) axes; as in :class:`fa2edu.memory.HBM`, counts are per program: a tile
    (..., rows, cols) counts rows·cols elements, a vector (..., rows) counts rows.
    """

    def __init__(self) -> None:
        self._tiles: dict[str, tuple[np.ndarray, bool]] = {}
        self.counts = SharedMemoryCounts()

    def store(self, name: str, value: np.ndarray, *, vector: bool = False, exchange: bool = False) -> None:
        """Write ``value`` under ``name``: a tile arriving from HBM, or (``exchange=True``) a partial for others."""
        self._tiles[name] = (np.array(value), vector)
        n = tile_elements(value, vector)
        if exchange:
            self.counts.exchange_writes += n
        else:
            self.counts.tile_writes += n

    def load(self, name: str, rows: slice = slice(None), *, exchange: bool = False) -> np.ndarray:
        """Read rows ``rows`` of ``name`` into a warp's registers (a copy); counts the elements read."""
        array, vector = self._tiles[name]
        block = np.array(array[..., rows] if vector else array[..., rows, :])
        n = tile_elements(block, vector)
        if exchange:
            self.counts.exchange_reads += n
        else:
            self.counts.operand_reads += n
        return block

    def barrier(self) -> None:
        """``__syncthreads()``: every warp of the block waits here until all have arrived."""
        self.counts.barriers += 1


def warp_slices(n: int, warps: int) -> list[slice]:
    """Split ``n`` rows (or columns) into contiguous slices for the warps that get any: sizes differ by at most one.

    With n < warps only n warps get work (one row each); the others sit the step out.
    """
    base, extra = divmod(n, warps)
    slices, start = [], 0
    for w in range(warps):
        size = base + (1 if w < extra else 0)
        if size:
            slices.append(slice(start, start + size))
        start += size
    return slices


def _empty_state(lead: tuple[int, ...], rows: slice, d_v: int, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A warp's running (m, ℓ, Õ) for ``rows`` before any key: (−inf, 0, 0), as FA2 Alg. 1 line 5 initialises them."""
    n = rows.stop - rows.start
    return np.full(lead + (n,), -np.inf, dtype), np.zeros(lead + (n,), dtype), np.zeros(lead + (n, d_v), dtype)


def _rescale(O: np.ndarray, m_old: np.ndarray, m_new: np.ndarray) -> np.ndarray:
    """diag(e^{m_old − m_new}) O: an accumulator normalised to m_old, re-expressed relative to m_new."""
    # Guard m_old = −inf (an empty accumulator): its factor is 0, never e^{NaN}.
    return exp_minus(m_old[..., None], m_new)[..., 0][..., None] * O


# -- one thread block, split-Q (FA2, Figure 3b) --------------------------------------------------------------------

def split_q_thread_block(Q_i: np.ndarray, K: np.ndarray, V: np.ndarray, *, B_c: int, warps: int,
                         scale: float) -> tuple[np.ndarray, np.ndarray, SharedMemoryCounts]:
    """FA2 Alg. 1 lines 4-15 for one row block, its work split between warps by rows of Q_i (FA2 Figure 3b).

    Shapes: Q_i (..., r, d), K (..., N_k, d), V (..., N_k, d_v). Returns ``(O_i, L_i, counts)``, O_i (..., r, d_v),
    L_i (..., r). Shared memory (module docstring): T_c·r·d + W_q·N_k(d + d_v) operand reads, no exchange,
    2·T_c barriers.
    """
    smem = SharedMemory()
    r, d_v = Q_i.shape[-2], V.shape[-1]
    lead = Q_i.shape[:-2]
    own = warp_slices(r, warps)           # warp w owns rows own[w] of Q_i, O_i, ℓ_i, m_i
    # Alg. 1 line 4: Q_i arrives in shared memory once.
    smem.store("Q_i", Q_i)
    # Alg. 1 line 5, per warp and in its registers: Õ = 0, ℓ = 0, m = −inf for the warp's own rows.
    state = [_empty_state(lead, rows, d_v, Q_i.dtype) for rows in own]
    # Alg. 1 line 6: stream the K/V tiles.
    for cols in tiles(K.shape[-2], B_c):
        # Alg. 1 line 7: K_j, V_j arrive in shared memory; barrier so that every warp sees the whole tile.
        smem.store("K_j", K[..., cols, :])
        smem.store("V_j", V[..., cols, :])
        smem.barrier()
        for w, rows in enumerate(own):
            m, l, O = state[w]
            # Figure 3b: the warp reads its own rows of Q_i and *all* of K_j and V_j.
            Q_w = smem.load("Q_i", rows)
            K_j, V_j = smem.load("K_j"), smem.load("V_j")
            # Alg. 1 line 8: the warp's horizontal slice of S_i^(j) = τ Q_i K_jᵀ.
            S_w = scale * (Q_w @ np.swapaxes(K_j, -1, -2))                      # (…, r_w, c)
            # Alg. 1 line 9: new running max, P̃ = exp(S − m_new), ℓ rescaled and summed.
            m_new = np.maximum(m, S_w.max(axis=-1))
            P_w = exp_minus(S_w, m_new)
            l = exp_minus(m[..., None], m_new)[..., 0] * l + P_w.sum(axis=-1)
            # Alg. 1 line 10: Õ ← diag(e^{m_old − m_new}) Õ + P̃ V_j. All of it the warp's own: no exchange.
            state[w] = (m_new, l, _rescale(O, m, m_new) + P_w @ V_j)
        # End of step: no warp may overwrite K_j, V_j before every warp has finished reading them.
        smem.barrier()
    # Alg. 1 lines 12-13, each warp for its own rows: O_i = diag(ℓ)⁻¹ Õ, L_i = m + log ℓ.
    O_i = np.concatenate([O / l[..., None] for m, l, O in state], axis=-2)
    L_i = np.concatenate([logsumexp_from_stats(Stats(m, l)) for m, l, O in state], axis=-1)
    return O_i, L_i, smem.counts


# -- one thread block, split-K (FA1, Figure 3a) --------------------------------------------------------------------

def split_k_thread_block(Q_i: np.ndarray, K: np.ndarray, V: np.ndarray, *, B_c: int, warps: int,
                         scale: float) -> tuple[np.ndarray, np.ndarray, SharedMemoryCounts]:
    """The same row block with the work split between warps by columns of K_j and V_j (FA1, FA2 Figure 3a).

    Shapes as :func:`split_q_thread_block`. Each warp's partial (m_w, ℓ_w, Õ_w) covers every row, so the partials
    go out to shared memory, the block synchronises, and the warp that owns a row merges them. Shared memory:
    r·d·Σ W_k(j) + N_k(d + d_v) operand reads, r(d_v + 2)·Σ W_k(j) exchange writes and as many exchange reads,
    3·T_c barriers.
    """
    smem = SharedMemory()
    r, d_v = Q_i.shape[-2], V.shape[-1]
    lead = Q_i.shape[:-2]
    own = warp_slices(r, warps)           # after the exchange, warp u merges and keeps rows own[u]
    smem.store("Q_i", Q_i)
    state = [_empty_state(lead, rows, d_v, Q_i.dtype) for rows in own]
    for cols in tiles(K.shape[-2], B_c):
        smem.store("K_j", K[..., cols, :])
        smem.store("V_j", V[..., cols, :])
        smem.barrier()
        parts = warp_slices(cols.stop - cols.start, warps)    # warp w takes columns parts[w] of the tile
        for w, kcols in enumerate(parts):
            # Figure 3a: the warp reads *all* of Q_i and its own slice of K_j and V_j.
            Q = smem.load("Q_i")
            K_w, V_w = smem.load("K_j", kcols), smem.load("V_j", kcols)
            # A vertical slice of S_i^(j): every row, but only the warp's columns.
            S_w = scale * (Q @ np.swapaxes(K_w, -1, -2))                        # (…, r, c_w)
            # Softmax statistics of the slice, relative to the warp's own row max (it cannot see the others).
            m_w = S_w.max(axis=-1)
            P_w = exp_minus(S_w, m_w)
            # The partial output P̃_w V_w: one term of the sum P̃ V_j, for every row of the block.
            # It must reach the warp that owns each row: out through shared memory.
            smem.store(f"m_{w}", m_w, vector=True, exchange=True)
            smem.store(f"l_{w}", P_w.sum(axis=-1), vector=True, exchange=True)
            smem.store(f"O_{w}", P_w @ V_w, exchange=True)
        # Every partial must be in shared memory before any warp starts adding them up.
        smem.barrier()
        for u, rows in enumerate(own):
            m, l, O = state[u]
            for w in range(len(parts)):
                m_w = smem.load(f"m_{w}", rows, exchange=True)
                l_w = smem.load(f"l_{w}", rows, exchange=True)
                O_w = smem.load(f"O_{w}", rows, exchange=True)
                # The (m, ℓ) merge (FA1 Section 3.1, fa2edu.softmax.merge_stats), and Õ rescaled alike.
                merged = merge_stats(Stats(m, l), Stats(m_w, l_w))
                O = _rescale(O, m, merged.m) + _rescale(O_w, m_w, merged.m)
                m, l = merged
            state[u] = (m, l, O)
        # End of step: K_j, V_j and the exchange buffers are reused by the next step.
        smem.barrier()
    O_i = np.concatenate([O / l[..., None] for m, l, O in state], axis=-2)
    L_i = np.concatenate([logsumexp_from_stats(Stats(m, l)) for m, l, O in state], axis=-1)
    return O_i, L_i, smem.counts


# -- the whole forward pass: one thread block per row block ----------------------------------------------------------

class PartitionedForward(NamedTuple):
    """O (..., N_q, d_v), L (..., N_q), the shared-memory counts summed over all T_r thread blocks, the grid."""

    O: np.ndarray
    L: np.ndarray
    counts: SharedMemoryCounts
    thread_blocks: int


def _check_scheme_warps(scheme, warps) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if isinstance(warps, bool) or not isinstance(warps, Integral):
        raise TypeError(f"warps must be an int, got {type(warps).__name__}")
    if warps < 1:
        raise ValueError(f"warps must be at least 1, got {warps}")


def partitioned_forward(Q, K, V, *, scheme: str = "split_q", warps: int = 4, M=None, block_sizes=None,
                        scale=None) -> PartitionedForward:
    """FA2's forward pass (no mask), one thread block per row block, each block's work split between ``warps`` warps.

    ``scheme="split_q"`` (FA2, Figure 3b) or ``"split_k"`` (FA1, Figure 3a). Shapes: Q (..., N_q, d),
    K (..., N_k, d), V (..., N_k, d_v), GQA allowed. Block sizes as :func:`fa2edu.flash2_forward`. The result is the
    same attention either way (float64 inputs: to 1e-10 of the oracle); only ``counts`` differ.
    """
    _check_scheme_warps(scheme, warps)
    problem = prepare(Q, K, V, scale=scale)
    B_r, B_c = resolve_block_sizes(M, block_sizes, problem.d, block_sizes_q_outer)
    run_block = split_q_thread_block if scheme == "split_q" else split_k_thread_block
    O_parts, L_parts, counts = [], [], SharedMemoryCounts()
    row_tiles = tiles(problem.N_q, B_r)
    # FA2 Section 3.2: the row blocks are independent thread blocks (here: one after another).
    for rows in row_tiles:
        O_i, L_i, c = run_block(problem.Q[..., rows, :], problem.K, problem.V, B_c=B_c, warps=warps,
                                scale=problem.scale)
        O_parts.append(O_i)
        L_parts.append(L_i)
        counts = counts + c
    O = np.concatenate(O_parts, axis=-2).astype(problem.dtype, copy=False)
    L = np.concatenate(L_parts, axis=-1).astype(problem.dtype, copy=False)
    O = problem.from_q_layout(O).astype(problem.in_dtype, copy=False)
    return PartitionedForward(O, problem.from_q_layout(L), counts, len(row_tiles))


# -- the counts in closed form ----------------------------------------------------------------------------------------

def _check_positive(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")


def thread_block_counts(scheme: str, r: int, N_k: int, d: int, d_v: int, B_c: int, warps: int) -> SharedMemoryCounts:
    """The closed forms of the module docstring's table for one thread block of ``r`` rows."""
    _check_scheme_warps(scheme, warps)
    _check_positive(r=r, N_k=N_k, d=d, d_v=d_v, B_c=B_c)
    widths = [c.stop - c.start for c in tiles(N_k, B_c)]
    T_c = len(widths)
    tile_writes = r * d + N_k * (d + d_v)
    if scheme == "split_q":
        W_q = min(warps, r)
        return SharedMemoryCounts(tile_writes, T_c * r * d + W_q * N_k * (d + d_v), 0, 0, 2 * T_c)
    busy = sum(min(warps, c) for c in widths)                 # Σ_j W_k(j)
    exchange = r * (d_v + 2) * busy
    return SharedMemoryCounts(tile_writes, r * d * busy + N_k * (d + d_v), exchange, exchange, 3 * T_c)


def shared_memory_counts(scheme: str, N_q: int, N_k: int, d: int, B_r: int, B_c: int, warps: int,
                         d_v: int | None = None) -> SharedMemoryCounts:
    """Closed-form counts summed over the T_r = ceil(N_q/B_r) thread blocks of a forward pass (per program)."""
    d_v = d if d_v is None else d_v
    _check_positive(N_q=N_q, B_r=B_r)
    total = SharedMemoryCounts()
    for rows in tiles(N_q, B_r):
        total = total + thread_block_counts(scheme, rows.stop - rows.start, N_k, d, d_v, B_c, warps)
    return total


# -- thread blocks on the GPU: grid, waves, utilisation (FA2 Section 3.2) --------------------------------------------

def grid_blocks(algorithm: str, batch: int, heads: int, N: int | None = None, B_r: int | None = None) -> int:
    """Thread blocks a forward pass launches: FA1 ``batch·heads``; FA2 ``batch·heads·T_r`` with T_r = ceil(N/B_r)."""
    _check_positive(batch=batch, heads=heads)
    if algorithm == "flash1":
        return batch * heads
    if algorithm == "flash2":
        if N is None or B_r is None:
            raise ValueError("flash2's grid needs the sequence length N and the block size B_r")
        _check_positive(N=N, B_r=B_r)
        return batch * heads * num_blocks(N, B_r)
    raise ValueError(f"algorithm must be 'flash1' or 'flash2', got {algorithm!r}")


def waves(blocks: int, sms: int, resident: int = 1) -> int:
    """Rounds needed to run ``blocks`` equal thread blocks on ``sms`` SMs holding ``resident`` blocks each."""
    _check_positive(blocks=blocks, sms=sms, resident=resident)
    return math.ceil(blocks / (sms * resident))


def sm_utilisation(blocks: int, sms: int, resident: int = 1) -> float:
    """Fraction of the SM slots busy over the whole run, if every block takes the same time: blocks / (waves·slots).

    1.0 when the grid fills every wave; a grid of fewer blocks than SMs leaves ``1 − blocks/sms`` of the GPU idle
    (FA2 Section 3.2: FA1 is efficient once batch·heads is large, "say ≥ 80" on an A100's 108 SMs).
    """
    return blocks / (waves(blocks, sms, resident) * sms * resident)
