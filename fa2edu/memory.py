"""The two-level memory model of FlashAttention (FA1 Section 2.1, Theorem 2).

A GPU has a large, slow **HBM** and a small, fast on-chip **SRAM** of ``M`` elements. FlashAttention's whole
argument is about how many elements cross between the two, so fa2edu's algorithms move every tile through the
objects below, and the objects keep the books:

* :class:`HBM` holds named tensors (``Q``, ``K``, ``V``, ``O``, ``l``, ``m``, ``L``, ``S``, ``P``, ...) and a
  *ledger* of element reads and writes, per tensor and per algorithm line (``"Alg 1 line 8"``).
* :class:`SRAM` holds the on-chip tiles of one program (one (batch, head) pair), tracks the peak occupancy and
  refuses a tile that does not fit.
* :class:`FlopCounter` counts floating-point operations, matrix-multiply and non-matmul apart (FA2 Section 3.1).

Units. All counts are **elements per program**: a program is one (batch, query-head) pair, the unit the papers'
theorems talk about. The algorithms are vectorised over the leading (batch, head) axes, so a tile of shape
``(..., B_r, d)`` counts ``B_r * d`` elements. When a block is visited by only some programs (a padding mask that
differs between batch entries), the caller passes ``share`` = the fraction of programs that visit it, and the ledger
holds the average per program.

Initialisation writes ("Initialize O = 0, l = 0, m = -inf in HBM", FA1 Alg. 1 line 2) are counted in their own
category, :attr:`HBM.init_writes`, and left out of :attr:`HBM.writes`, as the papers' totals leave them out.

Example::

    >>> import numpy as np
    >>> from fa2edu.memory import HBM
    >>> hbm = HBM()
    >>> hbm.put("Q", np.ones((8, 4)))
    >>> Q_1 = hbm.read("Q", slice(0, 2), line="Alg 1 line 8")   # two rows of d = 4
    >>> hbm.reads
    8
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

__all__ = ["HBM", "SRAM", "FlopCounter", "SRAMOverflowError", "tile_elements"]


class SRAMOverflowError(ValueError):
    """A tile was loaded into an SRAM that has no room for it (block sizes too large for M)."""


def tile_elements(array: np.ndarray, vector: bool = False) -> int:
    """Elements one program holds of ``array``: its last two axes (a tile) or its last axis (``vector=True``)."""
    if vector:
        return int(array.shape[-1])
    return int(array.shape[-2] * array.shape[-1])


def _as_number(count: float) -> int | float:
    """Integers stay integers in the ledger (the common case); averages over programs may be fractional."""
    return int(count) if float(count).is_integer() else float(count)


class HBM:
    """High-bandwidth memory: named tensors plus a ledger of element reads and writes.

    Tensors are stored whole, with leading (batch, head) axes; rows are the second-to-last axis of a matrix
    (``(..., N, d)``) and the last axis of a vector (``(..., N)``, e.g. ``l``, ``m``, ``L``, ``D``).

    Attributes set by the algorithm that ran on this memory (for reports): ``sram`` (its :class:`SRAM`),
    ``flops`` (its :class:`FlopCounter`), ``block_sizes`` (``(B_r, B_c)`` or ``None``), ``algorithm``.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, np.ndarray] = {}
        self._vector: dict[str, bool] = {}
        # ledger[(kind, tensor, line)] = elements per program; kind is "read", "write" or "init"
        self.ledger: dict[tuple[str, str, str], float] = defaultdict(float)
        self.sram: SRAM | None = None
        self.flops: FlopCounter | None = None
        self.block_sizes: tuple[int, int] | None = None
        self.algorithm: str | None = None

    # -- placing tensors -------------------------------------------------------------------------------------
    def put(self, name: str, array: np.ndarray, *, vector: bool = False) -> None:
        """Place an input tensor in HBM. Inputs are already there when an algorithm starts: not counted."""
        self._tensors[name] = array
        self._vector[name] = vector

    def allocate(self, name: str, shape: tuple[int, ...], fill: float, dtype, *, line: str,
                 vector: bool = False) -> np.ndarray:
        """Allocate and initialise an output in HBM ("Initialize O = 0 in HBM"); counted as ``init`` writes."""
        array = np.full(shape, fill, dtype=dtype)
        self.put(name, array, vector=vector)
        per_program = shape[-1] if vector else shape[-2] * shape[-1]
        self.ledger[("init", name, line)] += per_program
        return array

    def __getitem__(self, name: str) -> np.ndarray:
        """The whole tensor, for returning results to the caller (not a memory access of the algorithm)."""
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    # -- counted traffic ------------------------------------------------------------------------------------
    def _index(self, name: str, rows: slice, cols: slice | None):
        if self._vector[name]:
            if cols is not None:
                raise ValueError(f"tensor {name!r} is a vector: it has no columns to select")
            return (Ellipsis, rows)
        return (Ellipsis, rows, slice(None) if cols is None else cols)

    def read(self, name: str, rows: slice, *, line: str, cols: slice | None = None,
             share: float = 1.0) -> np.ndarray:
        """Load rows ``rows`` (and columns ``cols``) of tensor ``name`` from HBM: a copy, its elements counted."""
        block = np.array(self._tensors[name][self._index(name, rows, cols)])
        self.ledger[("read", name, line)] += tile_elements(block, self._vector[name]) * share
        return block

    def write(self, name: str, rows: slice, value: np.ndarray, *, line: str, cols: slice | None = None,
              share: float = 1.0) -> None:
        """Store ``value`` into rows ``rows`` (and columns ``cols``) of tensor ``name`` in HBM; counts its elements."""
        target = self._tensors[name]
        index = self._index(name, rows, cols)
        target[index] = value
        self.ledger[("write", name, line)] += tile_elements(target[index], self._vector[name]) * share

    # -- the books ----------------------------------------------------------------------------------------------
    def _total(self, kind: str) -> int | float:
        return _as_number(sum(v for (k, _, _), v in self.ledger.items() if k == kind))

    @property
    def reads(self) -> int | float:
        """Elements read from HBM, per program."""
        return self._total("read")

    @property
    def writes(self) -> int | float:
        """Elements written to HBM, per program, initialisation excluded (as in the papers' counts)."""
        return self._total("write")

    @property
    def init_writes(self) -> int | float:
        """Elements written by "Initialize ... in HBM" steps, per program (kept apart from :attr:`writes`)."""
        return self._total("init")

    @property
    def total(self) -> int | float:
        """Reads plus writes, per program: the paper's "HBM accesses"."""
        return self.reads + self.writes

    def by_tensor(self) -> dict[str, dict[str, int | float]]:
        """``{tensor: {"read": n, "write": n, "init": n}}`` per program."""
        table: dict[str, dict[str, float]] = defaultdict(lambda: {"read": 0, "write": 0, "init": 0})
        for (kind, name, _), count in self.ledger.items():
            table[name][kind] += count
        return {name: {k: _as_number(v) for k, v in row.items()} for name, row in table.items()}

    def by_line(self) -> dict[str, dict[str, int | float]]:
        """``{algorithm line: {"read": n, "write": n, "init": n}}`` per program, in the order lines first ran."""
        table: dict[str, dict[str, float]] = {}
        for (kind, _, line), count in self.ledger.items():
            table.setdefault(line, {"read": 0, "write": 0, "init": 0})[kind] += count
        return {line: {k: _as_number(v) for k, v in row.items()} for line, row in table.items()}

    def report(self) -> str:
        """The ledger as a text table, one row per (line, tensor), in execution order."""
        rows = [f"{'line':<28} {'tensor':<8} {'reads':>14} {'writes':>14} {'init':>10}"]
        merged: dict[tuple[str, str], dict[str, float]] = {}
        for (kind, name, line), count in self.ledger.items():
            merged.setdefault((line, name), {"read": 0, "write": 0, "init": 0})[kind] += count
        for (line, name), c in merged.items():
            rows.append(f"{line:<28} {name:<8} {_as_number(c['read']):>14,} {_as_number(c['write']):>14,}"
                        f" {_as_number(c['init']):>10,}")
        rows.append(f"{'total':<37} {self.reads:>14,} {self.writes:>14,} {self.init_writes:>10,}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"HBM(reads={self.reads:,}, writes={self.writes:,}, tensors={sorted(self._tensors)})"


class SRAM:
    """On-chip memory of one program: named tiles, current and peak occupancy in elements.

    Parameters
    ----------
    capacity : int, optional
        Elements the SRAM holds: :meth:`hold` raises :class:`SRAMOverflowError` when a tile would push the occupancy
        past it. Default None: unbounded (the caller chose block sizes without giving M), the peak is still recorded.
    M : int, optional
        The SRAM size M that the run was given, kept for error messages and reports (``capacity`` may exceed it: the
        block-size rule's own working set). Default None.
    """

    def __init__(self, capacity: int | None = None, *, M: int | None = None) -> None:
        self.capacity = capacity
        self.M = M
        self.occupancy = 0
        self.peak = 0
        self._held: dict[str, int] = {}

    def hold(self, name: str, array: np.ndarray, *, vector: bool = False) -> np.ndarray:
        """Keep ``array`` on chip under ``name`` (replacing an older tile of that name); returns ``array``."""
        size = tile_elements(array, vector)
        new_occupancy = self.occupancy - self._held.get(name, 0) + size
        if self.capacity is not None and new_occupancy > self.capacity:
            raise SRAMOverflowError(
                f"SRAM overflow: holding {name!r} ({size} elements) needs {new_occupancy} elements on chip, "
                f"but the SRAM holds {self.capacity} (M = {self.M}); choose smaller block_sizes or a larger M")
        self._held[name] = size
        self.occupancy = new_occupancy
        self.peak = max(self.peak, self.occupancy)
        return array

    def free(self, *names: str) -> None:
        """Drop tiles from chip (their space is reusable)."""
        for name in names:
            self.occupancy -= self._held.pop(name, 0)

    def __repr__(self) -> str:
        return f"SRAM(capacity={self.capacity}, occupancy={self.occupancy}, peak={self.peak})"


@dataclass
class FlopCounter:
    """Floating-point operations per program, split as FA2 Section 3.1 splits them.

    Attributes
    ----------
    matmul : int, default 0
        FLOPs of matrix products, 2 per multiply-add (``2 * m * n * k`` for an (m, k) @ (k, n) product).
    nonmatmul : int, default 0
        Everything else, one FLOP per elementwise operation (exp, max, sum, scale, divide, ...).
    by_line : dict of str to dict, default {}
        Both counts per algorithm line: ``by_line[line]["matmul"]`` and ``by_line[line]["nonmatmul"]``.
    """

    matmul: int = 0
    nonmatmul: int = 0
    by_line: dict[str, dict[str, int]] = field(default_factory=dict)

    def add_matmul(self, m: int, n: int, k: int, *, line: str, share: float = 1.0) -> None:
        """Count one (m, k) @ (k, n) product: 2·m·n·k FLOPs."""
        self._add("matmul", 2 * m * n * k * share, line)

    def add_nonmatmul(self, count: int, *, line: str, share: float = 1.0) -> None:
        """Count ``count`` elementwise or reduction operations."""
        self._add("nonmatmul", count * share, line)

    def _add(self, kind: str, count: float, line: str) -> None:
        count = _as_number(count)
        setattr(self, kind, _as_number(getattr(self, kind) + count))
        row = self.by_line.setdefault(line, {"matmul": 0, "nonmatmul": 0})
        row[kind] = _as_number(row[kind] + count)

    @property
    def total(self) -> int | float:
        return self.matmul + self.nonmatmul
