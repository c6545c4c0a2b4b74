"""Block sizes and tiles: FA1 Algorithm 1 line 1, and the loops over T_r row blocks and T_c column blocks.

FA1 sizes its blocks so that the four tiles it keeps on chip (K_j, V_j of B_c × d and Q_i, O_i of B_r × d) fill the
SRAM of M elements: ``B_c = ceil(M / (4d))``, ``B_r = min(ceil(M / (4d)), d)``. The large block goes to the loop
that is *outer* (FA1: K/V). FA2's forward loop is Q-outer, so fa2edu mirrors the rule there (docs/conventions.md):
``B_r = ceil(M / (4d))``, ``B_c = min(ceil(M / (4d)), d)``. FA2's backward is K/V-outer again and uses FA1's rule.

The rule is asymptotic: with its constants the on-chip working set (tiles, the score tile S_ij, the statistics) is
Θ(M), a small multiple of M, not at most M. fa2edu's SRAM therefore holds as much as the rule's own working set at
that M (:func:`sram_capacity`), never less than M: the rule's block sizes always fit, and explicit block sizes fit
exactly when they need no more on-chip memory than the rule's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Callable

from fa2edu.memory import HBM, SRAM, FlopCounter, SRAMOverflowError

__all__ = [
    "DEFAULT_M", "block_sizes_kv_outer", "block_sizes_q_outer", "resolve_block_sizes", "tiles", "num_blocks",
    "sram_capacity", "check_M", "TiledRun", "start_run",
]

#: The default SRAM size in **elements**: 49 152 fp16 elements are 96 KiB, "around 100KB" (FA1 Section 3.2).
DEFAULT_M = 49_152


def check_M(M, d: int) -> int:
    """M must be an integer with room for the four d-wide tiles of one row each: ``M >= 4d``."""
    if isinstance(M, bool) or not isinstance(M, Integral):
        raise TypeError(f"M (SRAM size in elements) must be an int, got {type(M).__name__}")
    if M < 4 * d:
        raise ValueError(f"M = {M} is too small for d = {d}: the SRAM must hold at least four rows of d "
                         f"elements (M >= 4d = {4 * d})")
    return int(M)


def block_sizes_kv_outer(M: int, d: int) -> tuple[int, int]:
    """FA1 Alg. 1 line 1 (also FA1 Alg. 4, FA2 Alg. 2): ``(B_r, B_c) = (min(ceil(M/4d), d), ceil(M/4d))``.

    The K/V-outer rule: the outer loop's block B_c gets the large size.

    Parameters
    ----------
    M : int
        SRAM size in elements, at least 4d.
    d : int
        Head dimension.

    Returns
    -------
    tuple of int
        ``(B_r, B_c)``.
    """
    B = math.ceil(check_M(M, d) / (4 * d))
    return min(B, d), B


def block_sizes_q_outer(M: int, d: int) -> tuple[int, int]:
    """FA2 Alg. 1 (Q-outer), mirroring FA1's rule: ``(B_r, B_c) = (ceil(M/4d), min(ceil(M/4d), d))``.

    The Q-outer rule: the outer loop's block B_r gets the large size.

    Parameters
    ----------
    M : int
        SRAM size in elements, at least 4d.
    d : int
        Head dimension.

    Returns
    -------
    tuple of int
        ``(B_r, B_c)``.
    """
    B = math.ceil(check_M(M, d) / (4 * d))
    return B, min(B, d)


def _check_block_sizes(block_sizes) -> tuple[int, int]:
    if not isinstance(block_sizes, (tuple, list)) or len(block_sizes) != 2:
        raise TypeError(f"block_sizes must be a pair (B_r, B_c), got {block_sizes!r}")
    for name, b in zip(("B_r", "B_c"), block_sizes):
        if isinstance(b, bool) or not isinstance(b, Integral):
            raise TypeError(f"block_sizes {name} must be an int, got {type(b).__name__}")
        if b < 1:
            raise ValueError(f"block_sizes {name} must be at least 1, got {b}")
    return int(block_sizes[0]), int(block_sizes[1])


def resolve_block_sizes(M, block_sizes, d: int, rule: Callable[[int, int], tuple[int, int]]) -> tuple[int, int]:
    """``block_sizes`` if given, else ``rule(M, d)`` with M defaulting to :data:`DEFAULT_M`."""
    if block_sizes is not None:
        if M is not None:
            check_M(M, d)
        return _check_block_sizes(block_sizes)
    return rule(DEFAULT_M if M is None else M, d)


def sram_capacity(M, d: int, rule: Callable[[int, int], tuple[int, int]],
                  working_set: Callable[[int, int], int]) -> int | None:
    """SRAM capacity for a run at SRAM size M: the larger of M and the rule's own working set (module docstring).

    ``working_set(B_r, B_c)`` gives an algorithm's peak on-chip elements for full blocks. ``M=None`` (block sizes
    given without M) means an unbounded SRAM that still records its peak.
    """
    if M is None:
        return None
    return max(M, working_set(*rule(M, d)))


def num_blocks(N: int, B: int) -> int:
    """T = ceil(N / B): the number of blocks, the last one ragged when B does not divide N."""
    return -(-N // B)


def tiles(N: int, B: int) -> list[slice]:
    """The T = ceil(N/B) row ranges of blocks of B rows; the last is shorter when B does not divide N."""
    return [slice(start, min(start + B, N)) for start in range(0, N, B)]


# -- one run of a tiled algorithm --------------------------------------------------------------------------------

@dataclass
class TiledRun:
    """What a tiled algorithm needs besides its inputs: block sizes, tiles and the memory it counts on."""

    B_r: int
    B_c: int
    row_tiles: list[slice]   # the T_r blocks of rows of Q (and O, L, dQ, ...)
    col_tiles: list[slice]   # the T_c blocks of rows of K and V
    hbm: HBM
    sram: SRAM
    flops: FlopCounter

    @property
    def T_r(self) -> int:
        return len(self.row_tiles)

    @property
    def T_c(self) -> int:
        return len(self.col_tiles)


def start_run(algorithm: str, N_q: int, N_k: int, d: int, *, M, block_sizes,
              rule: Callable[[int, int], tuple[int, int]], working_set: Callable[[int, int], int],
              hbm: HBM | None, flops: FlopCounter | None) -> TiledRun:
    """Resolve the block sizes, create (or adopt) the HBM ledger, the SRAM and the FLOP counter of one run.

    ``working_set(B_r, B_c)`` is the algorithm's peak on-chip elements for full blocks; explicit block sizes whose
    working set exceeds the SRAM of size M raise :class:`~fa2edu.memory.SRAMOverflowError` before any work.
    """
    B_r, B_c = resolve_block_sizes(M, block_sizes, d, rule)
    capacity = sram_capacity(M, d, rule, working_set)
    need = working_set(min(B_r, N_q), min(B_c, N_k))
    if capacity is not None and need > capacity:
        raise SRAMOverflowError(
            f"block_sizes (B_r, B_c) = ({B_r}, {B_c}) need {need} elements of SRAM for {algorithm} with d = {d}, "
            f"but M = {M} gives {capacity} (the working set of the paper's block-size rule, "
            f"{rule(M, d)}); choose smaller block_sizes or a larger M")
    hbm = HBM() if hbm is None else hbm
    if not isinstance(hbm, HBM):
        raise TypeError(f"hbm must be a fa2edu.memory.HBM, got {type(hbm).__name__}")
    flops = FlopCounter() if flops is None else flops
    if not isinstance(flops, FlopCounter):
        raise TypeError(f"flops must be a fa2edu.memory.FlopCounter, got {type(flops).__name__}")
    sram = SRAM(capacity, M=M)
    hbm.sram, hbm.flops, hbm.block_sizes, hbm.algorithm = sram, flops, (B_r, B_c), algorithm
    return TiledRun(B_r, B_c, tiles(N_q, B_r), tiles(N_k, B_c), hbm, sram, flops)
