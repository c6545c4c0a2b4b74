"""What chapter 14 reads from the tensor-core results, computed in one place and tested.

Chapter 14 ("Tensor cores from Python") teaches from one GPU run of ``python -m benchmarks.tensorcore``, committed
as ``benchmarks/results/<device>/tensorcore.json``: a header (device, versions, date), ``mma_ceiling`` (the
TFLOP/s of a numba kernel that does nothing but ``mma.sync``) and one record per (impl, dtype, causal, d, N)
with its time and TFLOP/s. Beside it lie the logs of the GPU tests and of ``compute-sanitizer``. This module does
the reading and the arithmetic, so that the chapter asks each question in one line and
``tests/test_tensorcore_book.py`` checks the answers. Nothing here times anything or needs a GPU.

The rungs' module headers (``kernels_gpu/tensorcore/flash2_forward_v*.py``) state what each rung changed and what
it predicted before it was first measured; :func:`rung_header` returns those paragraphs as written, so the
chapter quotes them instead of retyping them.

Typical use (the chapter's)::

    from benchmarks import tensorcore_book as tcb
    run = tcb.load()                             # the committed H100 run
    tcb.series(run, "v5", d=64)                  # ([N, ...], [TFLOP/s, ...]) for a figure
    print(tcb.as_text(tcb.ladder_table(run, N=4096)))
    tcb.targets(run)                             # the project's forward targets: met or missed
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "RESULTS", "DEFAULT_RUN", "RUNGS", "BASELINE", "TARGET_TFLOPS", "TARGET_RATIO", "TARGET_MIN_N",
    "TensorCoreRun", "load", "forward_flops", "record", "tflops", "series", "LadderRow", "ladder_table",
    "PairRow", "pair_table", "causal_speedup", "TargetCheck", "targets", "as_text", "rung_header",
    "SanitizerReport", "sanitizer_report", "gpu_test_counts",
]

RESULTS = Path(__file__).resolve().parent / "results"
#: the run chapter 14 teaches from
DEFAULT_RUN = RESULTS / "nvidia-h100" / "tensorcore.json"
#: the forward rungs, in ladder order
RUNGS = ("v1", "v2", "v3", "v4", "v5")
#: what every rung is compared with in the same run: PyTorch's SDPA with its flash backend
BASELINE = "sdpa_flash"
#: the project's forward targets: TFLOP/s and fraction of SDPA flash, at sequence lengths N ≥ TARGET_MIN_N
TARGET_TFLOPS = 150.0
TARGET_RATIO = 0.5
TARGET_MIN_N = 4096

_KEYS = ("impl", "dtype", "causal", "d", "N", "batch", "heads", "ms", "tflops", "status")


class TensorCoreRun(NamedTuple):
    """One run of ``benchmarks.tensorcore``: where it was read from, its header, the mma.sync ceiling (TFLOP/s)
    and its records (dicts, every one with :data:`_KEYS`)."""

    path: Path
    header: dict
    ceiling: float
    records: list

    @property
    def device(self) -> str:
        return self.header.get("device", "unknown device")

    @property
    def date(self) -> str:
        """The run's date, ``YYYY-MM-DD``."""
        return str(self.header.get("date", "unknown date"))[:10]


def load(path=None) -> TensorCoreRun:
    """Read a tensor-core results file (default :data:`DEFAULT_RUN`); every record is checked for its keys."""
    import json

    path = Path(path) if path is not None else DEFAULT_RUN
    payload = json.loads(path.read_text())
    if not isinstance(payload, dict) or "records" not in payload or "mma_ceiling" not in payload:
        raise ValueError(f"{path}: not a tensor-core results file (needs 'records' and 'mma_ceiling')")
    for i, rec in enumerate(payload["records"]):
        missing = [key for key in _KEYS if key not in rec]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {missing}")
    return TensorCoreRun(path, payload.get("header", {}), float(payload["mma_ceiling"]["tflops"]),
                         list(payload["records"]))


def forward_flops(batch: int, heads: int, N: int, d: int, causal: bool) -> float:
    """The FA2 paper's forward FLOP count (Section 4.1): 4·N²·d per head, halved when causal."""
    return 4.0 * N * N * d * batch * heads / (2.0 if causal else 1.0)


def record(run: TensorCoreRun, impl: str, d: int, N: int, dtype: str = "float16", causal: bool = False) -> dict:
    """The one successful record of ``impl`` at (dtype, causal, d, N); KeyError if none, ValueError if several."""
    found = [r for r in run.records if r["impl"] == impl and r["d"] == d and r["N"] == N
             and r["dtype"] == dtype and bool(r["causal"]) == bool(causal) and r["status"] == "ok"]
    if not found:
        raise KeyError(f"no ok record of {impl!r} at dtype={dtype}, causal={causal}, d={d}, N={N} in {run.path}")
    if len(found) > 1:
        raise ValueError(f"{len(found)} records of {impl!r} at dtype={dtype}, causal={causal}, d={d}, N={N}")
    return found[0]


def tflops(run: TensorCoreRun, impl: str, d: int, N: int, dtype: str = "float16", causal: bool = False) -> float:
    """TFLOP/s of one record (see :func:`record`)."""
    return float(record(run, impl, d, N, dtype, causal)["tflops"])


def series(run: TensorCoreRun, impl: str, d: int, dtype: str = "float16",
           causal: bool = False) -> tuple[list, list]:
    """``(Ns, TFLOP/s)`` of ``impl`` over every measured N, in increasing N: one line of a figure."""
    Ns = sorted({r["N"] for r in run.records if r["impl"] == impl and r["d"] == d and r["dtype"] == dtype
                 and bool(r["causal"]) == bool(causal) and r["status"] == "ok"})
    return Ns, [tflops(run, impl, d, N, dtype, causal) for N in Ns]


class LadderRow(NamedTuple):
    """One rung at one (d, N): TFLOP/s, the gain over the rung below (None for v1), the fraction of SDPA flash
    and of the mma.sync ceiling, all from the same run."""

    impl: str
    d: int
    N: int
    tflops: float
    gain: float | None
    of_sdpa: float
    of_ceiling: float


def ladder_table(run: TensorCoreRun, N: int = 4096, ds=(64, 128), dtype: str = "float16",
                 causal: bool = False) -> list[LadderRow]:
    """Every rung of :data:`RUNGS` at sequence length N, for each head dimension in ``ds``."""
    rows = []
    for d in ds:
        sdpa = tflops(run, BASELINE, d, N, dtype, causal)
        previous = None
        for impl in RUNGS:
            value = tflops(run, impl, d, N, dtype, causal)
            rows.append(LadderRow(impl, d, N, value, None if previous is None else value / previous,
                                  value / sdpa, value / run.ceiling))
            previous = value
    return rows


class PairRow(NamedTuple):
    """``impl`` beside ``other`` at one (dtype, causal, d, N): their TFLOP/s and the ratio impl / other."""

    dtype: str
    causal: bool
    d: int
    N: int
    tflops: float
    other: float
    ratio: float


def pair_table(run: TensorCoreRun, impl: str = "v5", other: str = BASELINE, N=None) -> list[PairRow]:
    """Every (dtype, causal, d, N) where both were measured (only sequence length ``N`` if given), sorted."""
    keys = sorted({(r["dtype"], bool(r["causal"]), r["d"], r["N"]) for r in run.records
                   if r["impl"] == impl and r["status"] == "ok" and (N is None or r["N"] == N)})
    rows = []
    for dtype, causal, d, n in keys:
        try:
            theirs = tflops(run, other, d, n, dtype, causal)
        except KeyError:
            continue
        ours = tflops(run, impl, d, n, dtype, causal)
        rows.append(PairRow(dtype, causal, d, n, ours, theirs, ours / theirs))
    return rows


def causal_speedup(run: TensorCoreRun, impl: str, d: int, N: int, dtype: str = "float16") -> float:
    """Wall-time ratio non-causal / causal of ``impl`` (the ideal is 2: a causal mask skips half the tiles)."""
    return (float(record(run, impl, d, N, dtype, False)["ms"])
            / float(record(run, impl, d, N, dtype, True)["ms"]))


class TargetCheck(NamedTuple):
    """One measured configuration against the project's two forward targets."""

    dtype: str
    causal: bool
    d: int
    N: int
    tflops: float
    of_sdpa: float
    meets_tflops: bool
    meets_ratio: bool


def targets(run: TensorCoreRun, impl: str = "v5", min_N: int = TARGET_MIN_N,
            target_tflops: float = TARGET_TFLOPS, target_ratio: float = TARGET_RATIO) -> list[TargetCheck]:
    """``impl`` at every measured configuration with N ≥ ``min_N``: ≥ ``target_tflops`` TFLOP/s? ≥
    ``target_ratio`` × SDPA flash of the same run?"""
    return [TargetCheck(row.dtype, row.causal, row.d, row.N, row.tflops, row.ratio,
                        row.tflops >= target_tflops, row.ratio >= target_ratio)
            for row in pair_table(run, impl, BASELINE) if row.N >= min_N]


def as_text(rows, digits: int = 2) -> str:
    """A list of NamedTuples as an aligned text table (floats to ``digits`` places, None as '–')."""
    rows = list(rows)
    if not rows:
        return "(no rows)"

    def cell(value):
        if value is None:
            return "–"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
        return str(value)
    header = list(rows[0]._fields)
    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def rung_header(version: str) -> dict:
    """The module header of ``kernels_gpu/tensorcore/flash2_forward_<version>.py`` in parts: ``title`` (its
    first line), ``prediction`` and ``measured`` (the paragraphs that begin with those bold words), and
    ``limits`` (the paragraph on what limits it, if any). Read from the source file; nothing is imported."""
    if version not in RUNGS:
        raise ValueError(f"version must be one of {RUNGS}, got {version!r}")
    spec = importlib.util.find_spec("kernels_gpu.tensorcore")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("kernels_gpu.tensorcore is not importable")
    source = Path(list(spec.submodule_search_locations)[0], f"flash2_forward_{version}.py").read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc)]
    out = {"title": paragraphs[0] if paragraphs else "", "prediction": "", "measured": "", "limits": ""}
    for p in paragraphs:
        for key, word in (("prediction", "**Prediction"), ("measured", "**Measured"), ("limits", "**What limits")):
            if p.startswith(word) and not out[key]:
                out[key] = p
    return out


class SanitizerReport(NamedTuple):
    """A ``compute-sanitizer --tool memcheck`` log of ``kernels_gpu.tensorcore.sanitize``: the checked launches
    (lines ending in ``ok``), the ERROR SUMMARY count, how many of the reported errors were failed host API calls
    (by call name) and how many were accesses by a kernel (``Invalid __global__/__shared__/__local__ ...``)."""

    cases_ok: int
    errors_reported: int | None
    api_errors: dict
    kernel_errors: int


def sanitizer_report(path=None) -> SanitizerReport:
    """Read a memcheck log (default: ``sanitizer_tensorcore_memcheck.log`` beside :data:`DEFAULT_RUN`)."""
    path = Path(path) if path is not None else DEFAULT_RUN.parent / "sanitizer_tensorcore_memcheck.log"
    text = path.read_text(errors="replace")
    cases = len(re.findall(r"^v\d .*: max error \S+ ok$", text, re.M))
    summary = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
    api = Counter(re.findall(r"Program hit \S+ .*? on CUDA API call to (\w+)\.", text))
    kernel = len(re.findall(r"^=+ Invalid __(?:global|shared|local)__ ", text, re.M))
    return SanitizerReport(cases, int(summary[-1]) if summary else None, dict(api), kernel)


def gpu_test_counts(path=None) -> dict:
    """``{'passed': n, 'failed': n, ..., 'seconds': s}`` from the last pytest summary line of a GPU test log
    (default: ``gpu_tests_tensorcore.log`` beside :data:`DEFAULT_RUN`)."""
    from benchmarks.book import pytest_counts

    path = Path(path) if path is not None else DEFAULT_RUN.parent / "gpu_tests_tensorcore.log"
    return pytest_counts(path.read_text(errors="replace"))
