"""What chapter 10 reads from the committed results, computed in one place and tested.

Chapter 10 ("Real hardware") teaches from the files a GPU run left under ``benchmarks/results/<device>/``: the
harness's JSON results, the logs of the GPU test suite and of ``compute-sanitizer``, and Nsight Compute exports.
This module does the reading and the arithmetic, so that the chapter asks each question in one line and
``tests/test_benchmarks.py`` checks the answers on the committed files. Nothing here times anything or needs a
GPU; ``kernels_gpu`` (for a launch plan or a default tile) is imported only by the functions that use it.

The fast forward kernels form a ladder, :data:`FORWARD_LADDER`: each rung is one idea, with the file that
measured it, the same-run comparison with the rung below, and the prediction its module header wrote *before*
that measurement. The predictions are the only numbers typed here, and they are typed as the headers state them.
Where a header states one figure ("+2 %"), the range is that figure ± 1 percentage point, about twice the median
run-to-run spread of an unchanged kernel on this device (:func:`run_to_run_spread`).

Typical use (the chapter's)::

    from benchmarks.harness import book
    dev = book.device()                      # name, dates, SMs, measured ceilings, datasheet profile
    book.ladder_table(N=4096)                # every rung at d = 64 and 128, its gain and its verdict
    book.sanitizer_summary()                 # one row per compute-sanitizer run
"""

from __future__ import annotations

import csv
import functools
import json
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from benchmarks.harness.results_io import load_results
from fa2edu import hardware
from fa2edu.flops import model_flops
from fa2edu.io import closed_form

__all__ = [
    "RESULTS", "device_folder", "Run", "run", "tflops", "sweep", "Device", "device", "FileSummary", "inventory",
    "failed_records", "run_to_run_spread", "Prediction", "Rung", "FORWARD_LADDER", "rung", "tiling",
    "rung_tflops", "same_run_ratios", "PredictionCheck", "check_prediction", "LadderRow", "ladder_table",
    "baselines", "resident_blocks", "WaveRun", "wave_runs", "busy_slots", "kernel_durations",
    "causal_speedups", "RooflinePoint", "roofline", "ncu_rows", "compulsory_read_bytes", "memory_series",
    "model_memory", "pytest_counts", "TestRun", "gpu_test_summary", "SanitizerRun", "parse_sanitizer_log",
    "sanitizer_summary",
]

RESULTS = Path(__file__).resolve().parents[1] / "results"
BYTES = 4                               # every timed kernel here stores float32
REGISTERS_PER_SM = 65536                # Volta to Hopper: 64 K 32-bit registers per SM
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SHARED_RESERVED_PER_BLOCK = 1024        # bytes the driver keeps per resident block (sm_80 and later)


# -- results files ----------------------------------------------------------------------------------------------

def device_folder(root=None) -> Path:
    """The device folder under ``root`` (default ``benchmarks/results``) whose newest ``sweep*.json`` is newest."""
    root = Path(root) if root is not None else RESULTS
    newest = {}
    for path in root.glob("*/sweep*.json"):
        header, _, _ = load_results(path)
        newest[path.parent] = max(newest.get(path.parent, ""), str(header.get("date", "")))
    if not newest:
        raise FileNotFoundError(f"no {root}/<device>/sweep*.json: run benchmarks/device_run.sh on a GPU first")
    return max(newest, key=newest.get)


def _folder(folder) -> Path:
    return Path(folder) if folder is not None else device_folder()


class Run(NamedTuple):
    """One results file: its header, all its records, and ``ok``: (impl, pass, d, causal, N) → timed record."""

    path: Path
    header: dict
    records: list
    ok: dict


@functools.lru_cache(maxsize=None)
def _run(path: str, mtime: float) -> Run:
    header, records, _ = load_results(path)
    ok = {}
    for r in records:
        if r["status"] != "ok":
            continue
        key = (r["impl"], r["pass"], r["d"], r["causal"], r["N"])
        if key in ok:
            raise ValueError(f"{path}: two timed records for {key}; a file must time each configuration once")
        ok[key] = r
    return Run(Path(path), header, records, ok)


def run(name: str, folder=None) -> Run:
    """The results file ``name`` (e.g. ``"final.json"``) of the device folder, read once and cached."""
    path = _folder(folder) / name
    if not path.exists():
        raise FileNotFoundError(f"no results file {path}")
    return _run(str(path), path.stat().st_mtime)


def tflops(name: str, impl: str, d: int, N: int, causal: bool = False, pass_: str = "forward",
           folder=None) -> float:
    """TFLOP/s (FA2 paper's FLOP model) of one timed configuration of one file; KeyError naming it if absent."""
    key = (impl, pass_, d, causal, N)
    record = run(name, folder).ok.get(key)
    if record is None:
        raise KeyError(f"{name} has no timed record {key}")
    return record["tflops"]


def sweep(folder=None) -> dict:
    """The sweep files of a device combined: (impl, pass, d, causal, N) → record, on the paper's grid
    (batch × N = the files' token count); where two files time one configuration, the newer file wins."""
    folder = _folder(folder)
    runs = sorted((run(p.name, folder) for p in folder.glob("sweep*.json")),
                  key=lambda r: str(r.header.get("date", "")))
    combined = {}
    for r in runs:
        tokens = r.header["settings"]["tokens"]
        for key, record in r.ok.items():
            if record["batch"] * record["N"] == tokens:
                combined[key] = record
    return combined


class Device(NamedTuple):
    """The device of a results folder: what the driver reported, what the harness measured, the datasheet."""

    name: str
    folder: Path
    first_date: str                 # the oldest and newest result file, YYYY-MM-DD
    last_date: str
    sms: int
    l2_bytes: int
    memory_bytes: int
    matmul_tflops: float            # an 8192³ fp32 cuBLAS matmul, TF32 off: the fp32 compute ceiling
    copy_tbps: float                # a device-to-device copy: the memory ceiling
    versions: dict
    profile: hardware.DeviceProfile | None

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the two measured ceilings meet (the roofline's ridge point)."""
        return self.matmul_tflops / self.copy_tbps

    @property
    def dates(self) -> str:
        return self.first_date if self.first_date == self.last_date else f"{self.first_date} to {self.last_date}"


def _profile_for(name: str):
    for key, alias in (("H200", "H200"), ("H100", "H100-SXM"), ("A100", "A100-80GB"), ("T4", "T4")):
        if key in name:
            return hardware.device(alias)
    return None


#: results files of other harnesses that a device folder may hold beside the kernel timings: Nsight Compute's byte
#: counts (profiles, not timings) and the multi-GPU ring's (one configuration timed per dtype and ring size, which
#: the (impl, pass, d, causal, N) key of :class:`Run` does not tell apart), the tensor-core harnesses' (their own
#: record layout, read by :mod:`benchmarks.harness.tensorcore_book`), the GPT and op timings of
#: :mod:`benchmarks.gpt_speed` and the decoding step's (:mod:`benchmarks.decode`,
#: :mod:`benchmarks.profilers.decode_variants`: schemas of their own), the Hopper timeline's stamps and
#: :mod:`benchmarks.flex`'s rows (schemas of their own)
OTHER_HARNESSES = ("ncu_io.json", "context_parallel*.json", "tensorcore*.json", "gpt_speed*.json", "decode*.json",
                   "hopper_timeline*.json", "flex*.json")


def _timing_files(folder: Path, pattern: str = "*.json") -> list[Path]:
    """The kernel-timing results files of ``folder`` matching ``pattern``, sorted: :data:`OTHER_HARNESSES` aside."""
    return [p for p in sorted(folder.glob(pattern)) if not any(p.match(other) for other in OTHER_HARNESSES)]


def device(folder=None) -> Device:
    """The device summary of a results folder; ceilings and properties from its newest file that has them."""
    folder = _folder(folder)
    runs = [run(p.name, folder) for p in _timing_files(folder)]
    dates = sorted(str(r.header["date"])[:10] for r in runs if r.header.get("date"))
    full = max((r for r in runs if "ceilings" in r.header), key=lambda r: str(r.header["date"]))
    props, ceilings = full.header["device_properties"], full.header["ceilings"]
    return Device(full.header["device"], folder, dates[0], dates[-1], props["multiprocessors"],
                  props["l2_cache_bytes"], props["total_memory_bytes"], ceilings["fp32_matmul_TFLOPs"],
                  ceilings["copy_TBps"], full.header["versions"], _profile_for(full.header["device"]))


class FileSummary(NamedTuple):
    """One results file in a line: its records, how many were timed, and why the others were not."""

    name: str
    date: str
    records: int
    timed: int
    not_timed: Counter              # (status, reason with the numbers blanked) → count


def inventory(folder=None, pattern: str = "*.json") -> list[FileSummary]:
    """Every kernel-timing results file of the folder (:data:`OTHER_HARNESSES` aside), oldest first."""
    folder = _folder(folder)
    out = []
    for path in _timing_files(folder, pattern):
        r = run(path.name, folder)
        why = Counter((x["status"], re.sub(r"[\d.]+", "#", str(x["error"])).split(":")[0])
                      for x in r.records if x["status"] != "ok")
        out.append(FileSummary(path.name, str(r.header.get("date", ""))[:16], len(r.records), len(r.ok), why))
    return sorted(out, key=lambda f: f.date)


def failed_records(folder=None) -> list[tuple[str, dict]]:
    """(file, record) for every record that failed its float64 check (``wrong``) or raised (``error``)."""
    folder = _folder(folder)
    return [(f.name, x) for f in inventory(folder) for x in run(f.name, folder).records
            if x["status"] in ("wrong", "error")]


def run_to_run_spread(impl: str = "torch_eager", folder=None, min_files: int = 3) -> dict:
    """How much one unchanged implementation's rate moves between files: (d, causal, N) → (files, max/min − 1),
    over the configurations that at least ``min_files`` files time (forward, paper's grid). PyTorch's kernels
    did not change between the runs, so this is the device's run-to-run noise."""
    folder = _folder(folder)
    seen = {}
    for f in inventory(folder):
        r = run(f.name, folder)
        tokens = r.header.get("settings", {}).get("tokens")
        for (name, pass_, d, causal, N), x in r.ok.items():
            if name == impl and pass_ == "forward" and x["batch"] * N == tokens:
                seen.setdefault((d, causal, N), []).append(x["tflops"])
    return {key: (len(v), max(v) / min(v) - 1) for key, v in sorted(seen.items()) if len(v) >= min_files}


# -- the forward ladder -------------------------------------------------------------------------------------------

class Prediction(NamedTuple):
    """What a rung's header predicted before its device run: ``low``–``high`` in ``unit``, at N ≥ ``N_min``.

    ``unit`` is ``"ratio"`` (the rung's rate over the rung below, timed in the same run) or ``"TFLOP/s"``.
    ``words`` quotes the header.
    """

    low: float
    high: float
    unit: str
    words: str
    N_min: int = 0


class Rung(NamedTuple):
    """One fast FA2 forward kernel of ``kernels_gpu.fast``, as the chapter teaches it.

    ``measured[d]``: (file, impl) giving the rung's rate on the paper's grid; ``test[d]``: (file, impl, impl of the
    rung below) timed in one run, the comparison its prediction is judged on; ``tiling[d]``: (file, resource key)
    whose ``(NY, NX, TR, TC)`` gives the tiles B_r = NY·TR, B_c = NX·TC.
    """

    name: str
    module: str
    change: str
    limit: str
    measured: dict
    test: dict
    predicted: dict
    tiling: dict


def _each_d(value_64, value_128=None):
    return {64: value_64, 128: value_128 if value_128 is not None else value_64}


FORWARD_LADDER: tuple[Rung, ...] = (
    Rung("teaching", "kernels_gpu.flash2",
         "one thread per query row, as FA2 Alg. 1 reads",
         "—",
         {d: (f"sweep_d{d}.json", "kg_flash2") for d in (64, 128)}, {}, {}, {}),
    Rung("v1", "kernels_gpu.fast.flash2_forward_v1",
         "S and Õ tiled over registers, 16-byte shared loads",
         "rows in local memory, no reuse of a loaded K_j value across rows",
         _each_d(("fast_forward.json", "fast_v1")), {}, {},
         {d: ("fast_forward.json", f"v1/d{d}") for d in (64, 128)}),
    Rung("v2", "kernels_gpu.fast.flash2_forward_v2",
         "row maxima and sums by warp shuffles",
         "a shared-memory round trip and a barrier per K/V tile",
         _each_d(("fast_forward.json", "fast_v2")),
         _each_d(("fast_forward.json", "fast_v2", "fast_v1")),
         _each_d(Prediction(1.00, 1.05, "ratio", "a few percent at most")),
         {d: ("fast_forward.json", f"v2/d{d}") for d in (64, 128)}),
    Rung("v3", "kernels_gpu.fast.flash2_forward_v3",
         "the tile shape chosen per head dimension",
         "one tile shape for both d",
         _each_d(("fast_forward.json", "fast_v3")),
         _each_d(("fast_forward.json", "fast_v3", "fast_v2")), {},
         {d: ("fast_forward.json", f"v3/d{d}") for d in (64, 128)}),
    Rung("v4", "kernels_gpu.fast.flash2_forward_v4",
         "a tile's global loads issued together, pipelined behind arithmetic",
         "each global load waited out in turn, behind a branch",
         _each_d(("fast_v4.json", "fast_v4")),
         _each_d(("fast_v4_first.json", "fast_v4", "fast_v3")),
         {64: Prediction(28.0, 35.0, "TFLOP/s", "d = 64 from 17.5 to 28-35", 4096),
          128: Prediction(25.0, 30.0, "TFLOP/s", "d = 128 from 15.6 to 25-30", 4096)},
         {d: ("fast_v4.json", f"v4/d{d}") for d in (64, 128)}),
    Rung("v5", "kernels_gpu.fast.flash2_forward_v5",
         "a register cap for more resident warps",
         "8 resident warps per SM at d = 128",
         _each_d(("final_v5.json", "kg_flash2_fast")),
         {64: ("fast_v5_explore_d64.json", "fast_v5@16x8x4x4r128", "fast_v4"),
          128: ("fast_v5_explore_d128.json", "fast_v5@16x8x4x4r168", "fast_v4")},
         {64: Prediction(1.00, 1.05, "ratio", "+0-5 %"),
          128: Prediction(1.10, 1.20, "ratio", "(16, 8, 4, 4) r168 gains 10-20 %")},
         {64: ("fast_v5_explore_d64.json", "v5@16x8x4x4r128/d64"), 128: ("fast_v4.json", "v4/d128")}),
    Rung("v6", "kernels_gpu.fast.flash2_forward_v6",
         "shared-memory operands double-buffered in registers",
         "every inner step waits the shared-load latency",
         _each_d(("final_v6.json", "kg_flash2_fast")),
         {d: (f"fast_v6_explore_d{d}.json", "fast_v6", "fast_v5") for d in (64, 128)},
         {64: Prediction(1.05, 1.10, "ratio", "+5-10 %"),
          128: Prediction(38.0, 42.0, "TFLOP/s", "38-42 TFLOP/s", 4096)},
         {d: (f"fast_v6_ex2_d{d}.json", f"v6/d{d}") for d in (64, 128)}),
    Rung("v7", "kernels_gpu.fast.flash2_forward_v7",
         "the last wave's row blocks split along the keys",
         "a half-empty last wave of blocks",
         {d: (f"fast_v7_explore_d{d}.json", "fast_v7") for d in (64, 128)},
         {d: (f"fast_v7_explore_d{d}.json", "fast_v7", "fast_v6") for d in (64, 128)},
         {64: Prediction(1.00, 1.01, "ratio", "+1 % at most"),
          128: Prediction(1.01, 1.03, "ratio", "+2 % at every N")},
         {d: (f"fast_v7_explore_d{d}.json", f"v7/d{d}") for d in (64, 128)}),
    Rung("v8", "kernels_gpu.fast.flash2_forward_v8",
         "a resident grid taking work from a counter; stream-K tail",
         "a half-empty last wave of blocks",
         {64: ("fast_v8e_explore_d64.json", "fast_v8"), 128: ("final.json", "kg_flash2_fast")},
         {d: (f"fast_v8e_explore_d{d}.json", "fast_v8", "fast_v6") for d in (64, 128)},
         {64: Prediction(1.00, 1.02, "ratio", "+1 %"),
          128: Prediction(1.015, 1.035, "ratio", "+2.5 % at every N")},
         {d: (f"fast_v8e_explore_d{d}.json", f"v8/d{d}") for d in (64, 128)}),
)


def rung(name: str) -> Rung:
    """The rung called ``name`` (``"teaching"``, ``"v1"`` … ``"v8"``)."""
    for r in FORWARD_LADDER:
        if r.name == name:
            return r
    raise ValueError(f"rung must be one of {[r.name for r in FORWARD_LADDER]}, got {name!r}")


def tiling(rung_: Rung | str, d: int, folder=None) -> tuple[int, int]:
    """``(B_r, B_c)`` of a rung at head dimension ``d``: from the resources its results file recorded, or, for
    the teaching kernel, ``kernels_gpu.runtime.default_block_sizes`` (one thread per row of a 64-row block)."""
    rung_ = rung(rung_) if isinstance(rung_, str) else rung_
    if not rung_.tiling:
        from kernels_gpu.runtime import default_block_sizes
        return default_block_sizes("flash2_forward", d)
    name, key = rung_.tiling[d]
    NY, NX, TR, TC = run(name, folder).header["resources"][key]["tiling"]
    return NY * TR, NX * TC


def rung_tflops(rung_: Rung | str, d: int, N: int, folder=None) -> float:
    """The rung's rate (forward, not causal, paper's grid) from the file that measured it."""
    rung_ = rung(rung_) if isinstance(rung_, str) else rung_
    name, impl = rung_.measured[d]
    return tflops(name, impl, d, N, folder=folder)


def same_run_ratios(name: str, new: str, old: str, d: int, causal: bool = False, folder=None,
                    pass_: str = "forward") -> dict:
    """N → rate of ``new`` / rate of ``old``, at every N where one file times both."""
    ok = run(name, folder).ok
    return {N: ok[(new, p, dd, c, N)]["tflops"] / ok[(old, p, dd, c, N)]["tflops"]
            for (impl, p, dd, c, N) in sorted(ok, key=lambda k: k[4])
            if impl == new and p == pass_ and dd == d and c == causal and (old, p, dd, c, N) in ok}


class PredictionCheck(NamedTuple):
    """A rung's prediction against its same-run measurement at head dimension ``d``.

    ``measured``: N → the value in the prediction's unit; ``ratios``: N → rate over the rung below (same run);
    ``verdict``: ``"held"`` (every N inside the range), ``"beaten"`` (none below, some above), ``"failed"`` (every
    N below), ``"mixed"`` (some below, some not), ``"none"`` (the header predicted nothing).
    """

    rung: str
    d: int
    file: str
    prediction: Prediction | None
    measured: dict
    ratios: dict
    verdict: str
    below_rate: float               # the rung below's mean rate over the judged N, same run (TFLOP/s)

    @property
    def held_at(self) -> int:
        p = self.prediction
        return sum(p.low <= v <= p.high for v in self.measured.values()) if p else 0

    @property
    def ratio_range(self) -> tuple[float, float] | None:
        """The predicted range as a ratio over the rung below (a TFLOP/s range divided by its mean rate)."""
        p = self.prediction
        if p is None:
            return None
        return (p.low, p.high) if p.unit == "ratio" else (p.low / self.below_rate, p.high / self.below_rate)


def _verdict(prediction, values) -> str:
    if prediction is None:
        return "none"
    below = [v < prediction.low for v in values]
    above = [v > prediction.high for v in values]
    if all(below):
        return "failed"
    if any(below):
        return "mixed"
    return "beaten" if any(above) else "held"


def check_prediction(rung_: Rung | str, d: int, folder=None) -> PredictionCheck:
    """Judge a rung's prediction at ``d`` on its same-run file (non-causal, N ≥ the prediction's N_min)."""
    rung_ = rung(rung_) if isinstance(rung_, str) else rung_
    if d not in rung_.test:
        raise ValueError(f"rung {rung_.name} has no same-run comparison with the rung below")
    name, new, old = rung_.test[d]
    prediction = rung_.predicted.get(d)
    N_min = prediction.N_min if prediction else 0
    ratios = {N: x for N, x in same_run_ratios(name, new, old, d, folder=folder).items() if N >= N_min}
    if not ratios:
        raise ValueError(f"{name} times {new} and {old} at no common N ≥ {N_min} for d = {d}")
    if prediction and prediction.unit == "TFLOP/s":
        measured = {N: tflops(name, new, d, N, folder=folder) for N in ratios}
    else:
        measured = dict(ratios)
    below = sum(tflops(name, old, d, N, folder=folder) for N in ratios) / len(ratios)
    return PredictionCheck(rung_.name, d, name, prediction, measured, ratios,
                           _verdict(prediction, measured.values()), below)


class LadderRow(NamedTuple):
    """One rung at one (d, N): its rate, its gain over the rung below in the same run (None where no file
    times both, as for v1 against the teaching kernel), and the verdict on its prediction."""

    rung: str
    d: int
    N: int
    tflops: float
    gain: float | None
    verdict: str
    change: str


def ladder_table(N: int = 4096, ds=(64, 128), folder=None) -> list[LadderRow]:
    """Every rung of :data:`FORWARD_LADDER` at each d in ``ds`` and sequence length ``N`` (forward, not causal)."""
    rows = []
    for d in ds:
        for r in FORWARD_LADDER:
            gain, verdict = None, "none"
            if d in r.test:
                name, new, old = r.test[d]
                gain = same_run_ratios(name, new, old, d, folder=folder).get(N)
                verdict = check_prediction(r, d, folder).verdict
            rows.append(LadderRow(r.name, d, N, rung_tflops(r, d, N, folder), gain, verdict, r.change))
    return rows


def baselines(d: int, N: int, name: str = "final.json", causal: bool = False, pass_: str = "forward",
              impls=("kg_standard", "torch_eager", "sdpa_efficient", "sdpa_flash"), folder=None) -> dict:
    """impl → TFLOP/s of the baselines in one file at (d, N), the impls it timed there."""
    ok = run(name, folder).ok
    return {i: ok[(i, pass_, d, causal, N)]["tflops"] for i in impls if (i, pass_, d, causal, N) in ok}


# -- waves ----------------------------------------------------------------------------------------------------------

def resident_blocks(resources: dict, sram_per_sm: int) -> int:
    """How many blocks of a kernel an SM holds at once, from its recorded resources (registers per thread, the
    tiling's NY·NX threads, shared memory), as the occupancy calculator counts them: registers are allocated per
    warp in units of 256, shared memory per block plus 1 KiB the driver reserves."""
    NY, NX, _, _ = resources["tiling"]
    threads = NY * NX
    warps = -(-threads // 32)
    per_warp = -(-resources["registers"] * 32 // 256) * 256
    by_registers = (REGISTERS_PER_SM // per_warp) // warps
    # shared_floats is the block's float32 arrays (static or dynamic); static_shared_bytes adds a few counters
    shared = max(resources["shared_floats"] * BYTES, resources.get("static_shared_bytes", 0))
    by_shared = sram_per_sm // (shared + SHARED_RESERVED_PER_BLOCK)
    return min(by_registers, by_shared, MAX_THREADS_PER_SM // threads, MAX_BLOCKS_PER_SM)


class WaveRun(NamedTuple):
    """One call of the wave measurement: v6 at d = 128, N = 2048, batch 1, ``heads`` heads."""

    heads: int
    blocks: int                     # row blocks: heads · ceil(N / B_r)
    slots: int                      # blocks resident at once on the whole GPU
    ms: float
    tflops: float

    @property
    def waves(self) -> float:
        return self.blocks / self.slots

    @property
    def paid_waves(self) -> int:
        return -(-self.blocks // self.slots)


def wave_runs(folder=None, impl: str = "fast_v6") -> list[WaveRun]:
    """The ``fast_waves_h*.json`` calls, fewest heads first."""
    folder = _folder(folder)
    dev = device(folder)
    out = []
    for path in folder.glob("fast_waves_h*.json"):
        r = run(path.name, folder)
        x = next(x for x in r.ok.values() if x["impl"] == impl)
        res = r.header["resources"][f"{impl.removeprefix('fast_')}/d{x['d']}"]
        B_r = res["tiling"][0] * res["tiling"][2]
        blocks = -(-x["N"] // B_r) * x["batch"] * x["heads"]
        slots = resident_blocks(res, dev.profile.sram_per_sm) * dev.sms
        out.append(WaveRun(x["heads"], blocks, slots, x["ms"], x["tflops"]))
    return sorted(out)


def busy_slots(items: int, tiles: int, slots: int, plan: str):
    """The GPU's busy block slots over time for ``items`` row blocks of ``tiles`` K/V tiles each: a step function
    ``[(start, end, busy), ...]``, time in K/V tiles of one block. ``plan="waves"``: v6's launch, one block per item;
    ``plan="stream"``: v8's (:func:`kernels_gpu.fast.split.stream_plan`), whole items for the whole waves, then
    the leftover items' tiles cut into equal ranges. Per-block fixed costs are left out."""
    if plan == "waves":
        full, rest = divmod(items, slots)
        steps = [(0, full * tiles, slots)]
        return steps + ([(full * tiles, (full + 1) * tiles, rest)] if rest else [])
    if plan != "stream":
        raise ValueError(f"plan must be 'waves' or 'stream', got {plan!r}")
    from kernels_gpu.fast.split import stream_plan
    n_whole, ranges = stream_plan(items, tiles, slots)
    end = n_whole // slots * tiles
    steps = [(0, end, slots)]
    if ranges:
        steps.append((end, end + (items - n_whole) * tiles / ranges, ranges))
    return steps


def kernel_durations(name: str, folder=None) -> dict:
    """Kernel → duration in µs from an Nsight Compute export: a ``--page details --csv`` file (``.csv``) or the
    text listing of ``gpu__time_duration.sum`` (``.txt``). Kernel names are shortened to the Python function's."""
    path = _folder(folder) / name
    scale = {"ms": 1e3, "us": 1.0, "ns": 1e-3, "msecond": 1e3, "usecond": 1.0, "nsecond": 1e-3}
    out = {}
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["Metric Name"] in ("Duration", "gpu__time_duration.sum"):
                    kernel = row["Kernel Name"].split("[")[0].split("(")[0].split("::")[-1]
                    out[kernel] = float(row["Metric Value"].replace(",", "")) * scale[row["Metric Unit"]]
        return out
    kernel = None
    for line in path.read_text().splitlines():
        timing = re.match(r"\s*gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)", line)
        if timing:
            # An excerpt without the kernel-name lines names its launches by their order.
            out[kernel or f"launch {len(out)}"] = float(timing.group(2).replace(",", "")) * scale[timing.group(1)]
            kernel = None
        elif line.startswith("  ") and not line.startswith("    "):
            kernel = line.strip().split("[")[0].split("(")[0].split("::")[-1]
    return out


# -- causal, roofline -----------------------------------------------------------------------------------------------

def causal_speedups(name: str = "final.json", d: int = 64, pass_: str = "forward", impls=None,
                    folder=None) -> dict:
    """impl → {N: wall time without the mask / wall time with it} (FA2's FLOP model halves the work)."""
    ok = run(name, folder).ok
    impls = impls or list(dict.fromkeys(k[0] for k in ok))
    out = {}
    for impl in impls:
        series = {N: ok[(impl, pass_, d, False, N)]["ms"] / ok[(impl, pass_, d, True, N)]["ms"]
                  for (i, p, dd, c, N) in sorted(ok, key=lambda k: k[4])
                  if (i, p, dd, c) == (impl, pass_, d, False) and (impl, pass_, d, True, N) in ok}
        if series:
            out[impl] = series
    return out


class RooflinePoint(NamedTuple):
    """One kernel on the roofline: model FLOPs per call, bytes by the two-level model of FA1/FA2 (every
    re-read of K_j, V_j charged to HBM) and by 'each tensor once' (what DRAM sees when L2 holds the re-reads)."""

    label: str
    d: int
    N: int
    tflops: float
    flops: float
    model_bytes: float
    once_bytes: float
    roof_tflops: float              # the measured roof at the model's intensity

    @property
    def intensity(self) -> float:
        return self.flops / self.model_bytes

    @property
    def once_intensity(self) -> float:
        return self.flops / self.once_bytes

    @property
    def of_roof(self) -> float:
        return self.tflops / self.roof_tflops


def roofline(d: int, N: int = 8192, folder=None) -> list[RooflinePoint]:
    """Each forward rung, standard attention and eager PyTorch at (d, N) on the paper's grid (not causal)."""
    dev = device(folder)
    final = run("final.json", folder)
    tokens, hidden = final.header["settings"]["tokens"], final.header["settings"]["hidden"]
    batch, heads = tokens // N, hidden // d
    flops = model_flops(batch, heads, N, d)
    per_head = BYTES * batch * heads
    once = per_head * (4 * N * d + N)                                # Q, K, V in; O, L out

    def roof(intensity):
        return min(dev.matmul_tflops, intensity * dev.copy_tbps)

    points = []
    for r in FORWARD_LADDER:
        B_r, B_c = tiling(r, d, folder)
        moved = per_head * sum(closed_form("flash2", "forward", N, d, B_r, B_c))
        points.append(RooflinePoint(r.name, d, N, rung_tflops(r, d, N, folder), flops, moved, once,
                                    roof(flops / moved)))
    standard = per_head * sum(closed_form("standard", "forward", N, d))  # S and P through HBM
    for impl in ("kg_standard", "torch_eager"):
        points.append(RooflinePoint(impl, d, N, tflops("final.json", impl, d, N, folder=folder), flops,
                                    standard, standard, roof(flops / standard)))
    return points


# -- the IO profile (Nsight Compute) and the long run -------------------------------------------------------------

def compulsory_read_bytes(r: dict) -> int:
    """DRAM reads of a profiled call if every tensor its launches read crossed from HBM exactly once (ncu flushes
    the caches before each launch): FA2 forward Q, K, V; FA1 forward also O, ℓ, m (written by its init launch);
    FA2 backward dO, O in the preprocessing launch, then Q, K, V, dO, L, D and dQ (zeroed by a fill launch)."""
    N, d = r["N"], r["d"]
    elements = {("kg_flash2", "forward"): 3 * N * d,
                ("kg_flash1", "forward"): 4 * N * d + 2 * N,
                ("kg_flash2", "backward"): 2 * N * d + (5 * N * d + 2 * N)}[(r["impl"], r["pass"])]
    return BYTES * elements * r["batch"] * r["heads"]


def ncu_rows(folder=None) -> list[dict]:
    """The profiled calls of ``ncu_io.json`` with the ratios the chapter discusses added: ``L1_ld``/``L1_st``
    (L1 sector bytes over the ledger × 4 B), ``sec_ld``/``sec_st`` (over the sector model), ``dram_ld`` (DRAM
    reads over the ledger) and ``once`` (DRAM reads over :func:`compulsory_read_bytes`)."""
    payload = json.loads((_folder(folder) / "ncu_io.json").read_text())
    rows = []
    for r in payload["records"]:
        if r["status"] != "ok":
            continue
        rows.append(dict(r, L1_ld=r["ncu_load_bytes"] / r["model_load_bytes"],
                         L1_st=r["ncu_store_bytes"] / r["model_store_bytes"],
                         sec_ld=r["ncu_load_bytes"] / r["model_sector_load_bytes"],
                         sec_st=r["ncu_store_bytes"] / r["model_sector_store_bytes"],
                         dram_ld=r["dram_read_bytes"] / r["model_load_bytes"],
                         once=r["dram_read_bytes"] / compulsory_read_bytes(r)))
    return rows


def model_memory(impl: str, N: int, batch: int, heads: int, d: int) -> int:
    """Bytes one float32 forward call holds at its peak: Q, K, V, O (4Nd per head) and S, P (2N²) for standard
    attention, L (N) for the fused kernels."""
    extra = 2 * N * N if impl == "kg_standard" else N
    return BYTES * batch * heads * (4 * N * d + extra)


def memory_series(folder=None, name: str = "long.json") -> dict:
    """impl → [(N, peak bytes), ...] of the long-sequence run, in N order."""
    out = {}
    for r in run(name, folder).records:
        if r["status"] == "ok":
            out.setdefault(r["impl"], []).append((r["N"], r["peak_mem_bytes"]))
    return {impl: sorted(points) for impl, points in out.items()}


# -- logs of the GPU test suite and of compute-sanitizer ----------------------------------------------------------

def pytest_counts(text: str) -> dict:
    """``{'passed': n, 'failed': n, ...}`` and ``seconds`` from the last pytest summary line of a log."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s", line)]
    if not lines:
        raise ValueError("no pytest summary line ('N passed ... in Ts') in the log")
    line = lines[-1]
    counts = {word.rstrip("s") if word.startswith("error") else word: int(n)
              for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", line)}
    counts["seconds"] = float(re.search(r" in ([\d.]+)s", line).group(1))
    return counts


class TestRun(NamedTuple):
    """One GPU test-suite log: its pytest counts and wall time."""

    log: str
    passed: int
    failed: int
    errors: int
    deselected: int
    seconds: float

    @property
    def clean(self) -> bool:
        return self.passed > 0 and not self.failed and not self.errors


def gpu_test_summary(folder=None) -> list[TestRun]:
    """Every ``gpu_tests*.log`` of the folder, in name order."""
    out = []
    for path in sorted(_folder(folder).glob("gpu_tests*.log")):
        c = pytest_counts(path.read_text(errors="replace"))
        out.append(TestRun(path.name, c.get("passed", 0), c.get("failed", 0), c.get("error", 0),
                           c.get("deselected", 0), c["seconds"]))
    return out


class SanitizerRun(NamedTuple):
    """One compute-sanitizer run in a log: the tool, the problems its summary reported (None: no summary, the
    run did not finish), its exit status (124: stopped by its time limit) and the checked cases (``ok:`` lines:
    a kernel's results matched the oracle while the tool watched)."""

    log: str
    tool: str
    problems: int | None
    exit_status: int
    cases: int

    @property
    def clean(self) -> bool:
        return self.problems == 0 and self.exit_status == 0


_EXIT = re.compile(r"(?:compute-sanitizer )?(memcheck|racecheck) exit(?: status)?:? (\d+)")
_MEMCHECK = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACECHECK = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def parse_sanitizer_log(text: str, log: str = "") -> list[SanitizerRun]:
    """The runs of one log. Each run's output ends with the driver's exit line (``memcheck exit 0`` or
    ``compute-sanitizer racecheck exit status: 0 (...)``); the run's summary and ``ok:`` lines come before it."""
    runs, chunk = [], []
    for line in text.splitlines():
        chunk.append(line)
        end = _EXIT.search(line)
        if not end:
            continue
        body = "\n".join(chunk)
        tool = end.group(1)
        problems = None
        if tool == "memcheck" and _MEMCHECK.search(body):
            problems = int(_MEMCHECK.search(body).group(1))
        elif tool == "racecheck" and _RACECHECK.search(body):
            hazards, errors, warnings = map(int, _RACECHECK.search(body).groups())
            problems = max(hazards, errors + warnings)
        cases = len(re.findall(r"^ok: ", body, re.M))
        runs.append(SanitizerRun(log, tool, problems, int(end.group(2)), cases))
        chunk = []
    return runs


def sanitizer_summary(folder=None) -> list[SanitizerRun]:
    """Every run in every ``sanitizer*.log`` of the folder, in name order."""
    out = []
    for path in sorted(_folder(folder).glob("sanitizer*.log")):
        out.extend(parse_sanitizer_log(path.read_text(errors="replace"), path.name))
    return out
