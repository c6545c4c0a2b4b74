"""What chapter 14 reads from the tensor-core results, computed in one place and tested.

Chapter 14 ("Tensor cores from Python") teaches from the GPU runs of ``python -m benchmarks.tensorcore`` committed
under ``benchmarks/results/nvidia-h100/``. ``tensorcore_ladder.json`` is one run of every rung v1-v11 (fp16,
non-causal) with the planned driver-level launch (``kernels_gpu.driver_launch``): the ladder's figure and tables
read it (:data:`RUNG_FILE`). The runs that first measured each rung, with numba's ordinary launch, stay for the
history and the predictions (:data:`FIRST_RUN`): ``tensorcore.json`` (v1-v5), ``tensorcore_v6.json`` (v5, v6),
``tensorcore_v7.json`` (v6, v7), ``tensorcore_v9.json`` (v6-v9), ``tensorcore_v11_numba_call.json`` (v6, v9, v10,
v11) and ``tensorcore_v11_d256.json``. ``tensorcore_v11.json`` (:data:`NEWEST`) is v11 on the full grid (fp16 and
bf16, causal and not) with the planned launch. Each run has a header (device, versions, date), ``mma_ceiling`` (the
TFLOP/s of a numba kernel that does nothing but ``mma.sync``) and one record per (impl, dtype, causal, d, N) with
its time and TFLOP/s, SDPA flash (``sdpa_flash``) included: every rung is compared with SDPA *of its own run*.
Beside them lie the tile-width sweep (``tensorcore_tiles_v9.json``), the host-cost measurement before and after the
planned launch (``tensorcore_launch_overhead_numba_call.json``, ``tensorcore_launch_overhead.json``), two Nsight
Compute reports (``ncu_tensorcore_*_d128.txt``) and the logs of the GPU tests and of ``compute-sanitizer``; and two
runs beside the forward ladder, read by :func:`backward_table` (``tensorcore_backward.json``: v3 beside SDPA
flash's backward, fp16 and bf16, causal and not, planned launch; ``tensorcore_backward_ladder.json``: the rungs
v1-v3, fp16 non-causal, numba's ordinary launch), :func:`partitioning_table` and :func:`precision_table`
(``tensorcore_variants.json``: split-Q against split-K with their shared-memory bytes; TF32 against the float32
forwards, with errors against float64). This module does the reading and the arithmetic, so that the chapter asks
each question in one line and ``tests/test_tensorcore_book.py`` checks the answers. Nothing here times anything or
needs a GPU.

The rungs' module headers (``kernels_gpu/tensorcore/flash2_forward_v*.py``) state what each rung changed and what
it predicted before it was first measured; :func:`rung_header` returns those paragraphs as written, and
:data:`PREDICTIONS` types each prediction's range as the header states it (the only numbers typed here), so that
:func:`check_predictions` can set it beside the measurement.

Typical use (the chapter's)::

    from benchmarks.harness import tensorcore_book as tcb
    runs = tcb.load_runs()                         # every committed run, by file name
    tcb.rung_series(runs, "v9", d=64)              # ([N, ...], [TFLOP/s, ...], file): the one-run ladder
    print(tcb.format_predictions(tcb.check_predictions(runs)))
    tcb.targets(runs[tcb.NEWEST], "v11")           # the project's forward targets: met or missed
    tcb.ncu_report("ncu_tensorcore_v8_v9_d128.txt")["v9"].instructions
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "RESULTS", "FOLDER", "DEFAULT_RUN", "NEWEST", "RUNGS", "LATEST", "RUNG_FILE", "BASELINE", "CUDA_CORE",
    "TARGET_TFLOPS", "TARGET_TFLOPS_MIN_N", "TARGET_RATIO", "TARGET_RATIO_MIN_N", "TARGET_CAUSAL",
    "TARGET_CAUSAL_N", "MMA_FLOPS", "LADDER_RUN", "FIRST_RUN", "BACKWARD_LADDER_RUN",
    "TensorCoreRun", "load", "load_runs", "forward_flops", "record", "tflops", "series", "rung_below",
    "rung_series", "RungPoint", "rung_points", "baseline_range", "cuda_core_series", "LadderRow", "ladder_table",
    "PairRow", "pair_table", "causal_speedup", "TargetCheck", "targets", "CausalCheck", "causal_targets",
    "as_text", "rung_header", "Prediction", "PREDICTIONS", "PredictionCheck", "check_predictions",
    "format_predictions", "NcuKernel", "parse_ncu_text", "ncu_report", "INTEGER_OPCODES", "sass_opcodes",
    "mma_count", "instructions_per_mma",
    "blocks_by_registers", "TileRow", "tile_sweep", "LaunchRow", "launch_overhead",
    "SanitizerReport", "sanitizer_report", "gpu_test_counts", "gpu_test_progress",
    "BACKWARD_RUN", "VARIANTS_RUN", "BACKWARD_RUNGS", "BACKWARD_LATEST", "TARGET_BWD_TFLOPS", "TARGET_BWD_RATIO",
    "BACKWARD_LADDER_RUNGS", "BACKWARD_RUN_RUNG", "BACKWARD_ORDER_RUN", "BACKWARD_V5_RUN", "BACKWARD_KERNEL_RUNS",
    "BACKWARD_V7_RUN", "BACKWARD_V7_KERNEL_RUNS",
    "KernelTimeRow",
    "backward_kernel_times",
    "TARGET_BWD_MIN_N", "load_results", "BackwardRow", "backward_table", "PartitionRow", "partitioning_table",
    "precision_label", "PrecisionRow", "precision_table",
]

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: the device folder chapter 14 teaches from
FOLDER = RESULTS / "nvidia-h100"
#: the first run (v1-v5 and SDPA flash on the full grid, bf16 and causal for v5)
DEFAULT_RUN = FOLDER / "tensorcore.json"
#: the newest run of the fastest rung: v11 and SDPA flash, fp16 and bf16, causal and not (planned launch)
NEWEST = "tensorcore_v11.json"
#: one run of every rung v1-v11 and SDPA flash, fp16, non-causal (planned launch): the ladder's figure
LADDER_RUN = "tensorcore_ladder.json"
#: the forward rungs, in ladder order
RUNGS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11")
#: the fastest rung (``kernels_gpu.tensorcore.flash2_forward``)
LATEST = "v11"
#: the run the ladder's figure and tables read for each rung: the one run of every rung
RUNG_FILE = {v: LADDER_RUN for v in RUNGS}
#: the run in which each rung was first measured (beside the rung below it, and SDPA flash), with numba's
#: ordinary launch: what each header's prediction is judged against
FIRST_RUN = {"v1": "tensorcore.json", "v2": "tensorcore.json", "v3": "tensorcore.json", "v4": "tensorcore.json",
             "v5": "tensorcore.json", "v6": "tensorcore_v6.json", "v7": "tensorcore_v7.json",
             "v8": "tensorcore_v9.json", "v9": "tensorcore_v9.json", "v10": "tensorcore_v11_numba_call.json",
             "v11": "tensorcore_v11_numba_call.json"}
#: what every rung is compared with in the same run: PyTorch's SDPA with its flash backend
BASELINE = "sdpa_flash"
#: the fastest fp32 CUDA-core forward of chapter 10 (``kernels_gpu.fast``): (file, impl) of ``benchmarks.harness.book``
CUDA_CORE = ("final.json", "kg_flash2_fast")
#: the project's forward targets: TFLOP/s at N ≥ TARGET_TFLOPS_MIN_N; a fraction of SDPA flash of the same run at
#: every N ≥ TARGET_RATIO_MIN_N; causal faster than non-causal (wall time) by TARGET_CAUSAL at N = TARGET_CAUSAL_N
TARGET_TFLOPS = 150.0
TARGET_TFLOPS_MIN_N = 4096
TARGET_RATIO = 0.5
TARGET_RATIO_MIN_N = 1024
TARGET_CAUSAL = 1.6
TARGET_CAUSAL_N = 8192
#: FLOPs of one ``mma.sync.m16n8k16``: 16 × 8 outputs, 16 multiply-adds each
MMA_FLOPS = 2 * 16 * 8 * 16

_KEYS = ("impl", "dtype", "causal", "d", "N", "batch", "heads", "ms", "tflops", "status")


# -- runs -----------------------------------------------------------------------------------------------------------

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

    @property
    def impls(self) -> list:
        """The implementations the run measured, rungs in ladder order, then the rest."""
        found = {r["impl"] for r in self.records}
        return [v for v in RUNGS if v in found] + sorted(found - set(RUNGS))


def load(path=None) -> TensorCoreRun:
    """Read a tensor-core results file (default :data:`DEFAULT_RUN`); every record is checked for its keys."""
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


def load_runs(folder=None) -> dict:
    """Every run of ``benchmarks.tensorcore`` in ``folder`` (default :data:`FOLDER`): file name → run, oldest
    first. ``tensorcore*.json`` files that are not such runs (the tile sweep, the host-cost table) are left out."""
    folder = Path(folder) if folder is not None else FOLDER
    runs = []
    for path in sorted(folder.glob("tensorcore*.json")):
        payload = json.loads(path.read_text())
        if isinstance(payload, dict) and "records" in payload and "mma_ceiling" in payload:
            runs.append(load(path))
    if not runs:
        raise FileNotFoundError(f"no tensor-core run (tensorcore*.json with 'mma_ceiling') in {folder}")
    runs.sort(key=lambda r: (r.header.get("date", ""), r.path.name))
    return {r.path.name: r for r in runs}


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


def rung_below(rung: str) -> str | None:
    """The rung a rung changed (``"v6"`` for ``"v7"``); None for v1."""
    if rung not in RUNGS:
        raise ValueError(f"rung must be one of {RUNGS}, got {rung!r}")
    i = RUNGS.index(rung)
    return RUNGS[i - 1] if i else None


def rung_series(runs: dict, rung: str, d: int, dtype: str = "float16", causal: bool = False,
                files=None) -> tuple[list, list, str]:
    """``(Ns, TFLOP/s, file)`` of a rung from the run ``files`` names for it (default :data:`RUNG_FILE`, the one
    run of every rung; :data:`FIRST_RUN` for the run that first measured it); empty lists if that run did not
    measure this (dtype, causal, d)."""
    name = (files or RUNG_FILE).get(rung)
    if name is None:
        raise ValueError(f"rung must be one of {RUNGS}, got {rung!r}")
    if name not in runs:
        raise KeyError(f"no run {name} (the run that measured {rung}) among {sorted(runs)}")
    Ns, values = series(runs[name], rung, d, dtype, causal)
    return Ns, values, name


class RungPoint(NamedTuple):
    """A rung at one N in the run that measured it: TFLOP/s, the gain over the rung below in the same run (None
    if that run did not time it there) and the fraction of the same run's SDPA flash."""

    N: int
    tflops: float
    gain: float | None
    of_sdpa: float


def rung_points(runs: dict, rung: str, d: int, Ns=(1024, 4096, 16384), dtype: str = "float16",
                causal: bool = False, files=None) -> list[RungPoint]:
    """:class:`RungPoint` of ``rung`` at each N of ``Ns`` in the run ``files`` names for it (default
    :data:`RUNG_FILE`); a KeyError names a configuration that run lacks."""
    run = runs[(files or RUNG_FILE)[rung]]
    below = rung_below(rung)
    points = []
    for N in Ns:
        value = tflops(run, rung, d, N, dtype, causal)
        try:
            gain = value / tflops(run, below, d, N, dtype, causal) if below else None
        except KeyError:
            gain = None
        points.append(RungPoint(N, value, gain, value / tflops(run, BASELINE, d, N, dtype, causal)))
    return points


def baseline_range(runs: dict, d: int, dtype: str = "float16", causal: bool = False,
                   impl: str = BASELINE) -> tuple[list, list, list]:
    """``(Ns, lowest, highest)`` TFLOP/s of ``impl`` (SDPA flash) over every run that measured it at (dtype,
    causal, d): the spread of one unchanged kernel between runs on the same GPU."""
    by_N = {}
    for run in runs.values():
        for N, value in zip(*series(run, impl, d, dtype, causal)):
            by_N.setdefault(N, []).append(value)
    Ns = sorted(by_N)
    return Ns, [min(by_N[N]) for N in Ns], [max(by_N[N]) for N in Ns]


def cuda_core_series(d: int, causal: bool = False, folder=None) -> tuple[list, list, str]:
    """``(Ns, TFLOP/s, device)`` of the fastest fp32 CUDA-core forward (:data:`CUDA_CORE`), read by
    ``benchmarks.harness.book`` from the device folder chapter 10 teaches from (its own grid: batch × N = 16k tokens,
    hidden 2048, as here)."""
    from benchmarks.harness import book

    name, impl = CUDA_CORE
    run = book.run(name, folder)
    keys = sorted(k for k in run.ok if k[0] == impl and k[1] == "forward" and k[2] == d and k[3] == causal)
    return [k[4] for k in keys], [run.ok[k]["tflops"] for k in keys], run.header.get("device", "unknown device")


class LadderRow(NamedTuple):
    """One rung at one (d, N): TFLOP/s, the gain over the rung below (None for the first), the fraction of SDPA
    flash and of the mma.sync ceiling, all from the same run."""

    impl: str
    d: int
    N: int
    tflops: float
    gain: float | None
    of_sdpa: float
    of_ceiling: float


def ladder_table(run: TensorCoreRun, N: int = 4096, ds=(64, 128), dtype: str = "float16",
                 causal: bool = False, rungs=None) -> list[LadderRow]:
    """Every rung of ``rungs`` (default: those the run measured) at sequence length N, for each d in ``ds``."""
    rungs = [v for v in (rungs or RUNGS) if v in run.impls]
    rows = []
    for d in ds:
        sdpa = tflops(run, BASELINE, d, N, dtype, causal)
        previous = None
        for impl in rungs:
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


def pair_table(run: TensorCoreRun, impl: str = LATEST, other: str = BASELINE, N=None) -> list[PairRow]:
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


# -- the project's targets ------------------------------------------------------------------------------------------

class TargetCheck(NamedTuple):
    """One measured configuration against the TFLOP/s and SDPA-ratio targets; a verdict is None where its
    target does not apply (N below the target's smallest N)."""

    dtype: str
    causal: bool
    d: int
    N: int
    tflops: float
    of_sdpa: float
    meets_tflops: bool | None
    meets_ratio: bool | None


def targets(run: TensorCoreRun, impl: str = LATEST, tflops_min_N: int = TARGET_TFLOPS_MIN_N,
            ratio_min_N: int = TARGET_RATIO_MIN_N, target_tflops: float = TARGET_TFLOPS,
            target_ratio: float = TARGET_RATIO) -> list[TargetCheck]:
    """``impl`` at every configuration where it and SDPA flash were measured: ≥ ``target_tflops`` TFLOP/s (at
    N ≥ ``tflops_min_N``)? ≥ ``target_ratio`` × SDPA flash of the same run (at N ≥ ``ratio_min_N``)?"""
    return [TargetCheck(row.dtype, row.causal, row.d, row.N, row.tflops, row.ratio,
                        row.tflops >= target_tflops if row.N >= tflops_min_N else None,
                        row.ratio >= target_ratio if row.N >= ratio_min_N else None)
            for row in pair_table(run, impl, BASELINE)]


class CausalCheck(NamedTuple):
    """The wall-time gain of causal masking (non-causal ms / causal ms) of ``impl`` and of SDPA flash at one
    (dtype, d, N), and whether ``impl``'s reaches the target."""

    dtype: str
    d: int
    N: int
    speedup: float
    sdpa_speedup: float
    meets: bool


def causal_targets(run: TensorCoreRun, impl: str = LATEST, N: int = TARGET_CAUSAL_N,
                   target: float = TARGET_CAUSAL) -> list[CausalCheck]:
    """:func:`causal_speedup` of ``impl`` (and SDPA flash) at sequence length N for every (dtype, d) where both
    masks were measured, against ``target``."""
    keys = sorted({(r["dtype"], r["d"]) for r in run.records if r["impl"] == impl and r["N"] == N
                   and r["status"] == "ok" and r["causal"]})
    rows = []
    for dtype, d in keys:
        ours = causal_speedup(run, impl, d, N, dtype)
        rows.append(CausalCheck(dtype, d, N, ours, causal_speedup(run, BASELINE, d, N, dtype), ours >= target))
    return rows


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


# -- the rungs' headers and predictions -----------------------------------------------------------------------------

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


class Prediction(NamedTuple):
    """What a rung's header predicted before its first GPU run, for one head dimension: ``low``–``high`` in
    ``unit``, judged at every N of ``Ns`` (fp16).

    ``unit``: ``"ratio"`` (``impl``'s TFLOP/s over ``against``'s), ``"TFLOP/s"``, or ``"causal"`` (``impl``'s
    wall-time ratio non-causal / causal). ``impl`` defaults to the rung; ``file`` to the run that first
    measured it (:data:`FIRST_RUN`); ``against_file`` to ``file`` — a different one makes the comparison cross two
    runs.
    ``words`` quotes the header."""

    rung: str
    d: int
    low: float
    high: float
    unit: str
    words: str
    against: str | None = None
    causal: bool = False
    Ns: tuple = (4096, 8192, 16384)
    impl: str | None = None
    file: str | None = None
    against_file: str | None = None


def _each(rung, low, high, unit, words, against=None, ds=(64, 128), **kw):
    return tuple(Prediction(rung, d, low, high, unit, words, against, **kw) for d in ds)


#: every rung's prediction as its header states it (for "unchanged", the ±10 % that v10's header measured between
#: identical kernels in one run); judged at N ≥ 4096 unless the header names one N
PREDICTIONS: tuple[Prediction, ...] = (
    Prediction("v1", 64, 40.0, 80.0, "TFLOP/s", "40-80 TFLOP/s at N = 4096", Ns=(4096,)),
    *_each("v2", 1.5, 2.5, "ratio", "1.5-2.5× v1", "v1"),
    *_each("v3", 1.10, 1.25, "ratio", "+10-25 % over v2", "v2"),
    *_each("v4", 1.20, 1.40, "ratio", "+20-40 % over v3", "v3"),
    Prediction("v5", 64, 1.10, 1.20, "ratio", "+10-20 % at d = 64", "v4"),
    Prediction("v5", 128, 1.05, 1.10, "ratio", "+5-10 % at d = 128", "v4"),
    *_each("v6", 1.05, 1.12, "ratio", "+5-12 %", "v5"),
    Prediction("v7", 64, 1.3, 1.5, "ratio", "1.3-1.5× at d = 64", "v6"),
    Prediction("v7", 128, 1.4, 1.7, "ratio", "1.4-1.7× at d = 128", "v6"),
    Prediction("v8", 64, 130.0, 160.0, "TFLOP/s", "91 → 130-160 TFLOP/s at 4096", Ns=(4096,)),
    Prediction("v8", 128, 1.3, 1.6, "ratio", "1.3-1.6× (d = 128)", "v7"),
    *_each("v9", 1.10, 1.20, "ratio", "+10-20 %", "v8"),
    Prediction("v10", 64, 1.03, 1.06, "ratio", "+3-6 % at d = 64", "v9"),
    Prediction("v10", 128, 0.90, 1.10, "ratio", "d = 128 unchanged", "v9"),
    Prediction("v10", 256, 1.5, 2.0, "ratio", "1.5-2× v6 at d = 256", "v6", impl="v11",
               file="tensorcore_v11_d256.json"),
    *_each("v11", 1.05, 1.15, "ratio", "causal: +5-15 % over v9", "v9", causal=True,
           against_file="tensorcore_v9.json"),
    *_each("v11", 0.90, 1.10, "ratio", "non-causal: unchanged", "v10"),
    Prediction("v11", 128, 1.41, 1.6, "causal", "causal/non-causal 1.41 → 1.6", Ns=(8192,)),
)


class PredictionCheck(NamedTuple):
    """A :class:`Prediction` beside what was measured: the lowest and highest value over its Ns, and a verdict:
    ``within`` the range, ``above`` or ``below`` it entirely, or ``partly`` (the measured range straddles an end).
    ``same_run``: False when the comparison crosses two runs."""

    prediction: Prediction
    got_low: float
    got_high: float
    verdict: str
    same_run: bool


def _measure(runs: dict, p: Prediction, N: int) -> float:
    run = runs[p.file or FIRST_RUN[p.rung]]
    impl = p.impl or p.rung
    if p.unit == "causal":
        return causal_speedup(run, impl, p.d, N)
    value = tflops(run, impl, p.d, N, causal=p.causal)
    if p.unit == "TFLOP/s":
        return value
    if p.unit != "ratio":
        raise ValueError(f"unit must be 'ratio', 'TFLOP/s' or 'causal', got {p.unit!r}")
    against = runs[p.against_file or p.file or FIRST_RUN[p.rung]]
    return value / tflops(against, p.against, p.d, N, causal=p.causal)


def _verdict(low: float, high: float, got_low: float, got_high: float) -> str:
    if got_low > high:
        return "above"
    if got_high < low:
        return "below"
    return "within" if low <= got_low and got_high <= high else "partly"


#: the digits a prediction's unit is stated and judged to (TFLOP/s as whole numbers, ratios to two places)
_DIGITS = {"TFLOP/s": 0, "ratio": 2, "causal": 2}


def check_predictions(runs: dict, predictions=PREDICTIONS) -> list[PredictionCheck]:
    """Every prediction against the committed runs (``runs`` from :func:`load_runs`); the measured values are
    judged at the precision the table prints them (:data:`_DIGITS`)."""
    rows = []
    for p in predictions:
        values = [_measure(runs, p, N) for N in p.Ns]
        lo, hi = min(values), max(values)
        digits = _DIGITS[p.unit]
        same = p.against_file is None or p.against_file == (p.file or FIRST_RUN[p.rung])
        rows.append(PredictionCheck(p, lo, hi, _verdict(p.low, p.high, round(lo, digits), round(hi, digits)), same))
    return rows


def format_predictions(rows) -> str:
    """The prediction checks as a fixed-width table (at most 96 characters a line); a verdict marked ``*`` compares
    two runs."""
    def span(low, high, unit):
        suffix, digits = (" TFLOP/s" if unit == "TFLOP/s" else "×"), _DIGITS[unit]
        if round(low, digits) == round(high, digits):
            return f"{low:.{digits}f}{suffix}"
        return f"{low:.{digits}f}-{high:.{digits}f}{suffix}"

    def Ns(values):
        k = [f"{N // 1024}k" if N % 1024 == 0 else str(N) for N in values]
        return k[0] if len(k) == 1 else f"{k[0]}-{k[-1]}"
    lines = [f"{'rung':4}  {'d':>3}  {'the header said':30}  {'predicted':15}  {'measured':15}  {'N':6}  verdict"]
    for row in rows:
        p = row.prediction
        lines.append(f"{p.rung:4}  {p.d:>3}  {p.words[:30]:30}  {span(p.low, p.high, p.unit):15}  "
                     f"{span(row.got_low, row.got_high, p.unit):15}  {Ns(p.Ns):6}  {row.verdict}"
                     f"{'' if row.same_run else '*'}")
    return "\n".join(lines)


# -- Nsight Compute reports -----------------------------------------------------------------------------------------

class NcuKernel(NamedTuple):
    """One kernel of an Nsight Compute text report (``ncu --set full``, default page).

    ``metrics``: ``(section, metric name) → (value, unit)`` from the sections' tables (numeric values only);
    ``advice``: each OPT/INF/WRN paragraph as one line; ``grid`` and ``block``: the launch's dimensions."""

    rung: str
    grid: tuple
    block: tuple
    metrics: dict
    advice: list

    def metric(self, name: str, section: str | None = None) -> float:
        """The value of metric ``name`` (in ``section`` if given); KeyError if absent, ValueError if two
        sections give it different values."""
        found = {(s, n): v for (s, n), (v, _) in self.metrics.items() if n == name and section in (None, s)}
        if not found:
            raise KeyError(f"{self.rung}: no metric {name!r}" + (f" in section {section!r}" if section else ""))
        values = set(found.values())
        if len(values) > 1:
            raise ValueError(f"{self.rung}: {name!r} differs between sections {sorted(s for s, _ in found)}")
        return values.pop()

    @property
    def instructions(self) -> int:
        """Warp-level instructions executed (``Executed Instructions``)."""
        return int(self.metric("Executed Instructions"))

    @property
    def registers(self) -> int:
        return int(self.metric("Registers Per Thread"))

    def fused_nonfused(self, kind: str = "FP64") -> tuple[int, int]:
        """``(fused, non-fused)`` instruction counts of ``kind`` ("FP32", "FP64") from ncu's advice on fusing
        them; ``(0, 0)`` when the report gives none."""
        pattern = re.compile(rf"executes ([\d,]+) fused and ([\d,]+) non-fused {kind} instructions")
        for line in self.advice:
            m = pattern.search(line)
            if m:
                return int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))
        return 0, 0

    def busiest_pipe(self) -> tuple[str, float] | None:
        """``(pipe, % of peak)`` of the highest-utilised pipeline ncu names, or None."""
        for line in self.advice:
            m = re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", line)
            if m:
                return m.group(1), float(m.group(2))
        return None


_KERNEL_LINE = re.compile(r"^  (?P<module>\w+)::\S+.*\((?P<grid>\d+, \d+, \d+)\)x\((?P<block>\d+, \d+, \d+)\)")
_DASHES = re.compile(r"^\s*-{3,}[ -]*$")
_ROW = re.compile(r"^ {4}(?P<name>\S(?:.*?\S)?)\s{2,}(?:(?P<unit>\S+)\s+)?(?P<value>-?[\d,]*\.?\d+)\s*$")
_ADVICE = re.compile(r"^ {4}(OPT|INF|WRN) ")


def parse_ncu_text(text: str) -> list[NcuKernel]:
    """The kernels of an Nsight Compute text report, in report order. A kernel's rung is read from its module
    (``flash2_forward_v7::…`` → ``"v7"``; the module name itself otherwise)."""
    kernels, current = [], None
    section, table, paragraph = "", None, None         # table: None, "header" (after "Metric Name") or "rows"

    def close_paragraph():
        if current is not None and paragraph is not None:
            current["advice"].append(" ".join(paragraph.split()))

    for line in text.splitlines():
        m = _KERNEL_LINE.match(line)
        if m:
            close_paragraph()
            paragraph = None
            module = m["module"]
            rung = re.search(r"_(v\d+)$", module)
            current = {"rung": rung.group(1) if rung else module, "metrics": {}, "advice": [],
                       "grid": tuple(int(x) for x in m["grid"].split(", ")),
                       "block": tuple(int(x) for x in m["block"].split(", "))}
            kernels.append(current)
            continue
        if current is None:
            continue
        if line.startswith("    Section: "):
            close_paragraph()
            paragraph, section, table = None, line.split("Section: ", 1)[1].strip(), None
            continue
        if _ADVICE.match(line):
            close_paragraph()
            paragraph = line.strip()[3:]
            continue
        if paragraph is not None and line.startswith(" " * 10) and line.strip():
            paragraph += " " + line.strip()
            continue
        close_paragraph()
        paragraph = None
        if line.startswith("    Metric Name"):
            table = "header"
            continue
        if _DASHES.match(line):
            table = "rows" if table == "header" else None     # a table's rows lie between its last two rules
            continue
        row = _ROW.match(line)
        if row and table == "rows":
            value = float(row["value"].replace(",", ""))
            current["metrics"].setdefault((section, row["name"]), (value, row["unit"] or ""))
    close_paragraph()
    return [NcuKernel(k["rung"], k["grid"], k["block"], k["metrics"], k["advice"]) for k in kernels]


def ncu_report(name: str, folder=None) -> dict:
    """rung → :class:`NcuKernel` of the report ``name`` in ``folder`` (default :data:`FOLDER`)."""
    path = (Path(folder) if folder is not None else FOLDER) / name
    kernels = parse_ncu_text(path.read_text(errors="replace"))
    if not kernels:
        raise ValueError(f"{path}: no kernel found (not an Nsight Compute text report?)")
    return {k.rung: k for k in kernels}


#: SASS opcodes of integer arithmetic (per-thread and uniform datapath): index, address and loop bookkeeping
INTEGER_OPCODES = frozenset({"IADD3", "IMAD", "ISETP", "SEL", "LEA", "SHF", "LOP3", "UIADD3", "UIMAD", "UISETP",
                             "ULEA", "ULOP3", "USHF", "USEL"})


def sass_opcodes(name: str, folder=None) -> dict:
    """kernel name → {opcode: instructions executed} from an opcode summary of Nsight Compute's source page (the
    ``ncu_*_sass.txt`` files: a ``== kernel: …`` line, a header, then one row per opcode, the most executed first)."""
    path = (Path(folder) if folder is not None else FOLDER) / name
    kernels, current = {}, None
    for line in path.read_text().splitlines():
        if line.startswith("== "):
            current = kernels.setdefault(line[3:].split(":")[0].strip(), {})
        elif current is not None and line and not line.startswith("opcode"):
            cells = line.split()
            if len(cells) == 5 and cells[1].replace(",", "").isdigit():
                current[cells[0]] = int(cells[1].replace(",", ""))
    if not kernels:
        raise ValueError(f"{path}: no '== kernel' section (not an opcode summary?)")
    return kernels


def mma_count(N: int, d: int, batch: int, heads: int, causal: bool = False) -> float:
    """``mma.sync.m16n8k16`` instructions (warp-wide) of one forward call when N and d are multiples of the
    tiles: the paper's FLOP count over :data:`MMA_FLOPS`."""
    return forward_flops(batch, heads, N, d, causal) / MMA_FLOPS


def instructions_per_mma(kernel: NcuKernel, N: int, d: int) -> float:
    """Warp instructions executed per ``mma.sync`` in a profiled non-causal launch of sequence length N and head
    dimension d; batch and heads are the launch grid's (heads, batch) = (grid y, grid z)."""
    _, heads, batch = kernel.grid
    return kernel.instructions / mma_count(N, d, batch, heads)


# -- registers, blocks per SM and the tile sweep --------------------------------------------------------------------

def blocks_by_registers(registers: int, threads: int = 128, registers_per_sm: int = 65536,
                        max_warps: int = 64) -> int:
    """Blocks of ``threads`` threads an SM can hold as far as registers go: registers are allocated per warp in
    units of 256 (sm_80 to sm_90), and an SM has ``registers_per_sm`` of them and at most ``max_warps`` warps."""
    if not 1 <= registers <= 255:
        raise ValueError(f"registers must be in [1, 255] per thread, got {registers}")
    if threads < 1 or threads % 32:
        raise ValueError(f"threads must be a positive multiple of 32, got {threads}")
    per_warp = -(-registers * 32 // 256) * 256
    warps = min(registers_per_sm // per_warp, max_warps)
    return warps // (threads // 32)


class TileRow(NamedTuple):
    """One (d, N, B_c) of the tile-width sweep: ptxas's registers per thread, the blocks per SM they allow, the
    TFLOP/s and the fraction of the same run's SDPA flash."""

    d: int
    N: int
    B_c: int
    registers: int
    blocks: int
    tflops: float
    of_sdpa: float


def tile_sweep(name: str = "tensorcore_tiles_v9.json", folder=None) -> list[TileRow]:
    """The rows of a ``benchmarks.profilers.tensorcore_tiles`` file, sorted by (d, N, B_c)."""
    path = (Path(folder) if folder is not None else FOLDER) / name
    records = [r for r in json.loads(path.read_text())["records"] if r["status"] == "ok"]
    sdpa = {(r["d"], r["N"]): r["tflops"] for r in records if r["impl"] == BASELINE}
    rows = [TileRow(r["d"], r["N"], r["B_c"], r["registers"], blocks_by_registers(r["registers"]),
                    r["tflops"], r["tflops"] / sdpa[(r["d"], r["N"])])
            for r in records if r["impl"] != BASELINE]
    return sorted(rows)


class LaunchRow(NamedTuple):
    """Host cost of one call (``benchmarks.profilers.launch_overhead``): µs on the host, ms of one call timed alone
    between two events and per call of many queued calls, and the TFLOP/s of each."""

    impl: str
    d: int
    N: int
    host_us: float
    single_ms: float
    queued_ms: float
    tflops_single: float
    tflops_queued: float


def launch_overhead(name: str = "tensorcore_launch_overhead.json", folder=None) -> list[LaunchRow]:
    """The rows of a host-cost file, in file order: by default the planned launch; the same measurement with
    numba's ordinary launch is ``tensorcore_launch_overhead_numba_call.json``."""
    path = (Path(folder) if folder is not None else FOLDER) / name
    return [LaunchRow(*(row[f] for f in LaunchRow._fields)) for row in json.loads(path.read_text())["rows"]]


# -- logs -----------------------------------------------------------------------------------------------------------

class SanitizerReport(NamedTuple):
    """A ``compute-sanitizer`` log of ``kernels_gpu.tensorcore.sanitize``: the checked launches (lines ending in
    ``ok``), the memcheck ERROR SUMMARY count (None in a racecheck log), how many of the reported errors were
    failed host API calls (by call name), how many were accesses by a kernel (``Invalid __global__/__shared__/
    __local__ ...``), and the racecheck hazards (None in a memcheck log)."""

    cases_ok: int
    errors_reported: int | None
    api_errors: dict
    kernel_errors: int
    hazards: int | None = None


def sanitizer_report(path=None) -> SanitizerReport:
    """Read a memcheck or racecheck log (default: ``sanitizer_tensorcore_memcheck.log`` in :data:`FOLDER`; a bare
    file name is looked up there)."""
    path = FOLDER / "sanitizer_tensorcore_memcheck.log" if path is None else Path(path)
    if not path.is_absolute() and not path.exists():
        path = FOLDER / path
    text = path.read_text(errors="replace")
    cases = len(re.findall(r"^(?:bwd_)?v\d+ .*: max (?:relative )?error \S+ ok$", text, re.M))
    summary = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
    api = Counter(re.findall(r"Program hit \S+ .*? on CUDA API call to (\w+)\.", text))
    kernel = len(re.findall(r"^=+ Invalid __(?:global|shared|local)__ ", text, re.M))
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazards?", text)
    return SanitizerReport(cases, int(summary[-1]) if summary else None, dict(api), kernel,
                           int(hazards[-1]) if hazards else None)


def gpu_test_counts(path=None) -> dict:
    """``{'passed': n, 'failed': n, ..., 'seconds': s}`` from the last pytest summary line of a GPU test log
    (default: ``gpu_tests_tensorcore.log`` in :data:`FOLDER`)."""
    from benchmarks.harness.book import pytest_counts

    path = Path(path) if path is not None else FOLDER / "gpu_tests_tensorcore.log"
    return pytest_counts(path.read_text(errors="replace"))


def gpu_test_progress(path) -> dict:
    """``{'passed': n, 'failed': n, 'errors': n, 'skipped': n, 'complete': bool}`` from the progress characters of
    a pytest log (``.`` ``F`` ``E`` ``s`` at the start of its lines), for logs cut off before pytest's summary line
    (a time limit): ``complete`` says whether the summary line is there. A bare file name is looked up in
    :data:`FOLDER`."""
    from benchmarks.harness.book import pytest_counts

    path = Path(path)
    if not path.is_absolute() and not path.exists():
        path = FOLDER / path
    text = path.read_text(errors="replace")
    marks = Counter("".join(re.findall(r"^([.FEsx]+)(?:\s|$)", text, re.M)))
    try:
        pytest_counts(text)
        complete = True
    except ValueError:
        complete = False
    return {"passed": marks["."], "failed": marks["F"], "errors": marks["E"], "skipped": marks["s"],
            "complete": complete}


# -- the backward rungs, split-K against split-Q, TF32 ----------------------------------------------------------------

#: ``python -m benchmarks.tensorcore_backward``: v3 beside SDPA flash's backward (fp16 and bf16, causal and
#: not, planned launch)
BACKWARD_RUN = "tensorcore_backward.json"
#: the earlier run of the backward rungs v1-v3 beside SDPA flash's (fp16, non-causal, numba's ordinary launch)
BACKWARD_LADDER_RUN = "tensorcore_backward_ladder.json"
#: ``python -m benchmarks.profilers.tensorcore_variants``: split-Q against split-K (with shared-memory bytes), and TF32
#: against the float32 forwards (with errors against float64)
VARIANTS_RUN = "tensorcore_variants.json"
#: ``python -m benchmarks.tensorcore_backward --impls v3,v4,sdpa_flash --dtypes bfloat16``: v4 (causal: the
#: longest blocks first) beside v3 and SDPA flash, causal and not, planned launch
BACKWARD_ORDER_RUN = "tensorcore_backward_v4.json"
#: ``python -m benchmarks.tensorcore_backward --impls v3,v5,sdpa_flash``: v5 beside v3 and SDPA flash on the
#: ladder's grid, fp16 and bf16, causal and not, planned launch
BACKWARD_V5_RUN = "tensorcore_backward_v5.json"
#: ``python -m benchmarks.profilers.tensorcore_backward_tiles``: each backward kernel's own time at the GPT's training
#: shape (batch 4, 8 heads, N = 4096, causal, bfloat16), v4 then v5 on one machine, cuDNN's backward beside them
BACKWARD_KERNEL_RUNS = ("tensorcore_backward_tiles_v4.json", "tensorcore_backward_tiles_v5.json")
#: the same kernel times for v5, v6 and v7, on one machine (v5 timed again beside the two rungs that followed it)
BACKWARD_V7_KERNEL_RUNS = ("tensorcore_backward_tiles_v5_again.json", "tensorcore_backward_tiles_v6.json",
                           "tensorcore_backward_tiles_v7.json")
#: ``python -m benchmarks.tensorcore_backward --impls v5,v7,sdpa_flash --dtypes bfloat16``: v7 beside v5 and SDPA
#: flash on the ladder's grid in bfloat16, causal and not
BACKWARD_V7_RUN = "tensorcore_backward_v7.json"
#: the backward rungs, in ladder order; those the ladder run timed; the one the full-grid run timed; the fastest
#: (``kernels_gpu.tensorcore.flash2_backward``)
BACKWARD_RUNGS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7")
BACKWARD_LADDER_RUNGS = ("v1", "v2", "v3")
BACKWARD_RUN_RUNG = "v3"
BACKWARD_LATEST = "v7"
#: the project's backward targets: TFLOP/s (backward = 2.5 × forward FLOPs) and a fraction of SDPA flash's
#: backward of the same run, both at N ≥ TARGET_BWD_MIN_N
TARGET_BWD_TFLOPS = 90.0
TARGET_BWD_RATIO = 0.4
TARGET_BWD_MIN_N = 4096


def load_results(name: str, folder=None) -> dict:
    """A results file with a header and records (``benchmarks.tensorcore_backward`` or ``_variants``), read from
    ``folder`` (default :data:`FOLDER`); every record is checked for impl, d, N and status."""
    path = (Path(folder) if folder is not None else FOLDER) / name
    payload = json.loads(path.read_text())
    if not isinstance(payload, dict) or "header" not in payload or "records" not in payload:
        raise ValueError(f"{path}: not a results file (needs 'header' and 'records')")
    for i, rec in enumerate(payload["records"]):
        missing = [key for key in ("impl", "d", "N", "status") if key not in rec]
        if missing:
            raise ValueError(f"{path}: record {i} lacks {missing}")
    return payload


def _one(records: list, what: str, **match) -> dict:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} records of {what} match {match} (expected one)")
    return found[0]


class BackwardRow(NamedTuple):
    """One backward measurement: TFLOP/s, its fraction of SDPA flash's backward at the same (d, N) in the same
    run, the largest relative error of dQ, dK, dV against float64, and whether it meets both backward targets
    (None below :data:`TARGET_BWD_MIN_N` and for SDPA itself)."""

    impl: str
    d: int
    N: int
    tflops: float
    of_sdpa: float
    max_rel_error: float
    meets: bool | None


def backward_table(name: str = BACKWARD_RUN, folder=None, dtype: str = "float16",
                   causal: bool = False) -> list[BackwardRow]:
    """The backward run as rows, by d, then N, then rung (SDPA flash last)."""
    records = [r for r in load_results(name, folder)["records"]
               if r.get("dtype") == dtype and bool(r.get("causal")) == causal and r["status"] == "ok"]
    if not records:
        raise ValueError(f"{name}: no {dtype} {'causal' if causal else 'non-causal'} record")
    order = {impl: i for i, impl in enumerate(BACKWARD_RUNGS + (BASELINE,))}
    rows = []
    for rec in sorted(records, key=lambda r: (r["d"], r["N"], order.get(r["impl"], len(order)), r["impl"])):
        sdpa = _one(records, "SDPA flash", impl=BASELINE, d=rec["d"], N=rec["N"])["tflops"]
        meets = None
        if rec["impl"] != BASELINE and rec["N"] >= TARGET_BWD_MIN_N:
            meets = rec["tflops"] >= TARGET_BWD_TFLOPS and rec["tflops"] / sdpa >= TARGET_BWD_RATIO
        rows.append(BackwardRow(rec["impl"], rec["d"], rec["N"], rec["tflops"], rec["tflops"] / sdpa,
                                max(rec["rel_error"].values()), meets))
    return rows


class KernelTimeRow(NamedTuple):
    """One tile shape of one backward rung at the training shape of :data:`BACKWARD_KERNEL_RUNS`: each kernel's
    own GPU ms per call (PyTorch's profiler), the whole call's ms (CUDA events), the registers ptxas gave each
    kernel, and cuDNN's backward of the same run (ms, events)."""

    rung: str
    d: int
    warps: int
    B_r: int
    key_block_ms: float
    dq_ms: float
    call_ms: float
    registers: tuple
    cudnn_ms: float


def backward_kernel_times(names=BACKWARD_KERNEL_RUNS, folder=None) -> list[KernelTimeRow]:
    """The rows of the kernel-time runs (``benchmarks.profilers.tensorcore_backward_tiles``), in file order; a run's
    shape must be the others' (its header's batch, heads, N, dtype, causal)."""
    rows, shape = [], None
    for name in names:
        payload = json.loads(((Path(folder) if folder is not None else FOLDER) / name).read_text())
        head = payload["header"]
        this = tuple(head[k] for k in ("batch", "heads", "N", "dtype", "causal"))
        if shape is not None and this != shape:
            raise ValueError(f"{name}: shape {this}, the other runs' {shape}")
        shape = this
        cudnn = {r["d"]: r["ms"] for r in payload["records"] if r["impl"] == "sdpa_cudnn"}
        for r in payload["records"]:
            if r["impl"] == "sdpa_cudnn" or r.get("status") != "ok":
                continue
            rows.append(KernelTimeRow(r["impl"], r["d"], r["warps"], r["B_r"], r["kernels"]["key_block"],
                                      r["kernels"]["dq"], r["ms"], (r["key_block_registers"], r["dq_registers"]),
                                      cudnn[r["d"]]))
    return rows


class PartitionRow(NamedTuple):
    """Split-Q or split-K (or SDPA flash) at one (d, N): TFLOP/s, its fraction of split-Q's and of SDPA flash's,
    and the shared-memory traffic counted by ``kernels_gpu.tensorcore.traffic`` (None for SDPA): KiB per K/V tile
    and block, of which the warps' exchange of partial results, bytes per FLOP, and the TB/s it implies."""

    impl: str
    d: int
    N: int
    tflops: float
    of_split_q: float
    of_sdpa: float
    kib_per_tile: float | None
    exchange_kib: float | None
    bytes_per_flop: float | None
    shared_tb_s: float | None


def partitioning_table(name: str = VARIANTS_RUN, folder=None) -> list[PartitionRow]:
    """The partitioning group of the variants run as rows, by d, then N, then split-Q, split-K, SDPA flash."""
    records = [r for r in load_results(name, folder)["records"]
               if r.get("group") == "partitioning" and r["status"] == "ok"]
    order = {"split-q": 0, "split-k": 1, BASELINE: 2}
    rows = []
    for rec in sorted(records, key=lambda r: (r["d"], r["N"], order.get(r["impl"], 3))):
        at = dict(d=rec["d"], N=rec["N"])
        split_q = _one(records, "split-Q", impl="split-q", **at)["tflops"]
        sdpa = _one(records, "SDPA flash", impl=BASELINE, **at)["tflops"]
        tile = rec.get("shared_per_tile")
        kib = sum(tile.values()) / 1024 if tile else None
        exchange = (tile["exchange_write"] + tile["exchange_read"]) / 1024 if tile else None
        rows.append(PartitionRow(rec["impl"], rec["d"], rec["N"], rec["tflops"], rec["tflops"] / split_q,
                                 rec["tflops"] / sdpa, kib, exchange, rec.get("shared_bytes_per_flop"),
                                 rec.get("shared_tb_per_s")))
    return rows


def precision_label(impl: str) -> str:
    """``'TF32'`` for an implementation whose products round their operands to tf32, else ``'fp32'``."""
    return "TF32" if "tf32" in impl else "fp32"


class PrecisionRow(NamedTuple):
    """A float32-input forward at one (d, N): its precision label, TFLOP/s (None where the run skipped it, with
    the reason in ``note``), and its largest absolute error in O against float64 at (d, error_N) — measured once
    per d on its own inputs, so the same for every N."""

    impl: str
    precision: str
    d: int
    N: int
    tflops: float | None
    error_f64: float
    error_N: int
    note: str


def precision_table(name: str = VARIANTS_RUN, folder=None) -> list[PrecisionRow]:
    """The precision group of the variants run as rows (file order), each with its float64 error."""
    payload = load_results(name, folder)
    errors = payload.get("float64_errors") or []
    rows = []
    for rec in payload["records"]:
        if rec.get("group") != "precision":
            continue
        err = _one(errors, "float64 error", impl=rec["impl"], d=rec["d"])
        ok = rec["status"] == "ok"
        rows.append(PrecisionRow(rec["impl"], precision_label(rec["impl"]), rec["d"], rec["N"],
                                 rec["tflops"] if ok else None, err["max_abs_error"], err["N"],
                                 "" if ok else str(rec.get("error", rec["status"]))))
    return rows
