"""The IO model against the hardware: Nsight Compute's global-memory bytes beside fa2edu's ledger (issue 5 item 3).

Chapters 4-6 count the elements each algorithm moves between HBM and on-chip memory; chapter 9 shows, in numba's
simulator, that the teaching kernels (:mod:`kernels_gpu`) move exactly those elements. This script asks the GPU:
it profiles one call of FA1 forward, FA2 forward and FA2 backward under Nsight Compute (``ncu``) at a few
(N, d, block sizes) and sets what the hardware counted beside the model, for the same block sizes::

    python -m benchmarks.ncu_io                         # the driver: needs a GPU and ncu; < 200 s on an H200
    python -m benchmarks.ncu_io --quick --out /tmp/ncu_io.json
    python -m benchmarks.ncu_io --show benchmarks/results/nvidia-h200/ncu_io.json

Three levels of "bytes", and what each should equal (per call, all its launches summed, × batch × heads):

* **thread bytes** (``ncu_thread_*_bytes``): 4 × the global load/store/atomic instructions the threads executed
  (``smsp__sass_thread_inst_executed_op_global_*``). The kernels access float32 one element at a time, so this is
  the element count of the ledger × 4 bytes: ``model_*_bytes``. Expect a ratio of 1.00.
* **L1 sector bytes** (``ncu_load_bytes``, ``ncu_store_bytes``; ``l1tex__t_bytes_pipe_lsu_mem_global_op_*``): what
  load/store instructions request from the L1/TEX cache, in 32-byte sectors, hits included. A warp whose 32
  threads read one element each of 32 *different rows* (the one-row-per-thread pattern of the teaching kernels)
  touches 32 sectors for 128 useful bytes: 32 bytes per element, 8× the model. Coalesced accesses (consecutive
  threads, consecutive addresses: ℓ, m, L, D, the atomic dQ update, the fill of dQ) cost 4 bytes per element.
  ``model_sector_*_bytes`` applies exactly that rule to the ledger, term by term (:func:`ledger_split`).
* **DRAM bytes** (``dram__bytes_read/write.sum``): what crossed to HBM. Caches are flushed before each kernel
  (``--cache-control all``), so every input is read from DRAM at least once; the L2 cache (50-60 MB on H100/H200)
  absorbs the repeated reads of K_j, V_j (FA2 forward reads them T_r times per head), so DRAM reads fall far
  below the model: the two-level model charges every re-read to HBM. DRAM writes can even fall *below* the
  outputs: L2 is write-back, and lines still dirty when the kernel ends are written out after the measurement.

Atomics (FA2 backward's dQ_i += τ dS K_j, a ``red.global.add``) count once as a load and once as a store, as the
ledger counts each read-modify-write. Initialisation launches (FA1's O = 0, ℓ = 0, m = −inf; FA2 backward's
dQ = 0) are profiled and included, and so are their ``init_writes`` in the model (``model_init_store_bytes``).

How a configuration is measured: the driver runs ``ncu ... python -m benchmarks.ncu_io --run-one ...`` once per
configuration. The child compiles and warms the kernels up with one call, then brackets the measured call with
``cuda.profile_start()``/``profile_stop()``, and ncu runs with ``--profile-from-start off``, so exactly the
launches of that call are profiled (if that yields nothing, the driver retries selecting by kernel name,
``--kernel-name regex:... --launch-skip <warm-up launches>``). ``--clock-control none`` leaves the GPU's clocks
alone (byte counts do not depend on them, and the house rule is never to change the card's settings);
``--cache-control all`` flushes the caches before each kernel and each replay pass, so DRAM counts start cold and
do not depend on what ran before. ncu replays each kernel once per group of counters, restoring its memory, so the
atomic dQ update is measured on the same data each pass.

Everything but the profiling itself (the model, the CSV parser, the records, the table) runs without a GPU and is
tested in ``tests/test_ncu_io.py``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from fa2edu.io import block_visits, visit_form

__all__ = [
    "Config", "KERNELS", "METRICS", "default_configs", "ledger_split", "model_bytes", "parse_ncu_csv",
    "parse_value", "measured_bytes", "make_record", "format_table", "ncu_command", "find_ncu", "main",
]

ITEMSIZE = 4                       # float32
SECTOR = 32                        # bytes per L1/L2 sector
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: The kernels of one call, by the Python function names numba puts into the mangled kernel names, in launch order.
KERNELS = {
    ("kg_flash1", "forward"): ("flash1_init_kernel", "flash1_forward_kernel"),
    ("kg_flash2", "forward"): ("flash2_forward_kernel",),
    ("kg_flash2", "backward"): ("flash2_backward_preprocess_kernel", "_fill_kernel", "flash2_backward_kernel"),
}
#: The kernel's name in the ncu report may be the mangled name (which holds the enclosing factory too, e.g.
#: ``_fill_kernel``) or the bare function (``fill``): the classifier tries these aliases.
ALIASES = {"_fill_kernel": ("_fill_kernel", "fill")}

#: What the driver asks ncu for: short name -> candidate metrics, first available wins. ``None``: optional.
METRICS = {
    "ld_bytes": ("l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"),
    "st_bytes": ("l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"),
    "red_bytes": ("l1tex__t_bytes_pipe_lsu_mem_global_op_red.sum",
                  "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum"),
    "atom_bytes": ("l1tex__t_bytes_pipe_lsu_mem_global_op_atom.sum",
                   "l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum"),
    "dram_read": ("dram__bytes_read.sum", "dram__sectors_read.sum"),
    "dram_write": ("dram__bytes_write.sum", "dram__sectors_write.sum"),
    "thread_ld": ("smsp__sass_thread_inst_executed_op_global_ld_pred_on.sum",
                  "smsp__sass_thread_inst_executed_op_global_ld.sum"),
    "thread_st": ("smsp__sass_thread_inst_executed_op_global_st_pred_on.sum",
                  "smsp__sass_thread_inst_executed_op_global_st.sum"),
    "thread_red": ("smsp__sass_thread_inst_executed_op_global_red_pred_on.sum",
                   "smsp__sass_thread_inst_executed_op_global_red.sum"),
    "thread_atom": ("smsp__sass_thread_inst_executed_op_global_atom_pred_on.sum",
                    "smsp__sass_thread_inst_executed_op_global_atom.sum"),
    "local_ld_bytes": ("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum",),
    "local_st_bytes": ("l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum",),
}
#: Without these the run says nothing about the model: the driver refuses to go on.
REQUIRED = ("ld_bytes", "st_bytes", "dram_read", "dram_write")


# -- configurations -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One profiled call: a teaching kernel, its problem size and its tiles (float32, N_q = N_k = N, d_v = d)."""

    impl: str                      # "kg_flash1" or "kg_flash2" (the benchmark harness's names)
    pass_: str                     # "forward" or "backward"
    N: int
    d: int
    block_sizes: tuple[int, int]
    causal: bool = False
    batch: int = 1
    heads: int = 4

    def __post_init__(self):
        if (self.impl, self.pass_) not in KERNELS:
            raise ValueError(f"(impl, pass_) must be one of {sorted(KERNELS)}, got {(self.impl, self.pass_)!r}")
        for name in ("N", "d", "batch", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if (len(self.block_sizes) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                              for b in self.block_sizes)):
            raise ValueError(f"block_sizes must be two positive ints (B_r, B_c), got {self.block_sizes!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")

    @property
    def kernels(self) -> tuple[str, ...]:
        return KERNELS[(self.impl, self.pass_)]

    @property
    def label(self) -> str:
        B_r, B_c = self.block_sizes
        return (f"{self.impl} {self.pass_} N={self.N} d={self.d} {B_r}x{B_c}"
                f"{' causal' if self.causal else ''} (B={self.batch}, H={self.heads})")

    def argv(self) -> list[str]:
        """The ``--run-one`` arguments that rebuild this configuration in the child process."""
        return ["--impl", self.impl, "--pass", self.pass_, "--N", str(self.N), "--d", str(self.d),
                "--block-sizes", f"{self.block_sizes[0]},{self.block_sizes[1]}", "--batch", str(self.batch),
                "--heads", str(self.heads)] + (["--causal"] if self.causal else [])


def default_configs(quick: bool = False) -> list[Config]:
    """The driver's grid: per kernel, N = 1024 and 4096 at d = 64 with two tile shapes each (the second changes the
    number of outer/inner blocks the model depends on), plus one causal case at N = 4096; ``quick`` keeps N = 1024
    and the causal case. FA2 backward's tiles are limited by 48 KiB of shared memory (Q_i, dO_i, K_j, dS_ij)."""
    tiles = {
        ("kg_flash1", "forward"): [(64, 64), (128, 32)],      # T_c = N/B_c drives FA1's traffic
        ("kg_flash2", "forward"): [(64, 64), (128, 32)],      # T_r = N/B_r drives FA2's forward traffic
        ("kg_flash2", "backward"): [(32, 64), (32, 32)],      # T_c drives FA2's backward traffic
    }
    lengths = [1024] if quick else [1024, 4096]
    causal_N = lengths[-1]
    configs = []
    # Most telling first, so that a run cut short by its time budget still covers every kernel.
    for N in lengths:
        configs += [Config(impl, pass_, N, 64, shapes[0]) for (impl, pass_), shapes in tiles.items()]
    configs += [Config(impl, pass_, causal_N, 64, shapes[0], causal=True) for (impl, pass_), shapes in tiles.items()]
    for N in lengths:
        configs += [Config(impl, pass_, N, 64, shapes[1]) for (impl, pass_), shapes in tiles.items()]
    return configs


# -- the model ------------------------------------------------------------------------------------------------------

def ledger_split(config: Config) -> dict[str, dict[str, int]]:
    """The ledger of one call per (batch, head), in elements, split by how the kernel's threads touch memory.

    Returns ``{"load": {"row": …, "coalesced": …}, "store": {…}, "init_store": {…}}``. "row": each thread walks
    its own row of a d-wide matrix, so a warp's access touches one sector per thread; "coalesced": consecutive
    threads touch consecutive elements. ``load + store`` equal :func:`fa2edu.io.visit_form` (FA1/FA2 line by line,
    as its docstring lists them, with RV/CV the Q-side/K-side rows streamed over visited blocks); ``init_store`` is
    the ledger's ``init_writes``. The atomic dQ update sits in both "load" and "store" (coalesced).
    """
    N, d = config.N, config.d
    visits = block_visits(N, N, *config.block_sizes, causal=config.causal)
    RV, CV = visits.row_elements, visits.col_elements
    if (config.impl, config.pass_) == ("kg_flash1", "forward"):
        # FA1 Alg 1 line 6: K_j, V_j (rows) | line 8: Q_i, O_i (rows), ℓ_i, m_i (coalesced) | lines 12-13: back out.
        # Line 2, its own launch: O = 0 (rows), ℓ = 0, m = −inf (coalesced).
        load = {"row": 2 * N * d + 2 * d * RV, "coalesced": 2 * RV}
        store = {"row": d * RV, "coalesced": 2 * RV}
        init = {"row": N * d, "coalesced": 2 * N}
    elif (config.impl, config.pass_) == ("kg_flash2", "forward"):
        # FA2 Alg 1 line 4: Q_i (rows) | line 7: K_j, V_j (rows) per visit | line 14: O_i (rows) | line 15: L_i.
        load = {"row": N * d + 2 * d * CV, "coalesced": 0}
        store = {"row": N * d, "coalesced": N}
        init = {"row": 0, "coalesced": 0}
    else:
        # FA2 Alg 2 line 4: dO, O (rows) in, D out | line 6: K_j, V_j (rows) | line 9: Q_i, dO_i (rows), L_i, D_i
        # | line 15: dQ_i += τ dS K_j (atomic, coalesced, in and out) | line 17: dK_j, dV_j (rows).
        # Line 3: dQ = 0, a fill over the flat array (coalesced).
        load = {"row": 2 * N * d + 2 * N * d + 2 * d * RV, "coalesced": 2 * RV + d * RV}
        store = {"row": 2 * N * d, "coalesced": N + d * RV}
        init = {"row": 0, "coalesced": N * d}
    return {"load": load, "store": store, "init_store": init}


def model_bytes(config: Config) -> dict[str, int]:
    """The model's bytes for one call (× batch × heads): ledger elements × 4, and × the sector rule.

    Keys: ``model_load_bytes``, ``model_store_bytes`` (init writes included, as the profiled call includes its
    init launch), ``model_init_store_bytes`` (that part), ``model_sector_load_bytes``, ``model_sector_store_bytes``
    (32 bytes per "row" element, 4 per coalesced one: what ncu's L1 counters should show).
    """
    split = ledger_split(config)
    programs = config.batch * config.heads

    def elements(kinds):
        return sum(split[k]["row"] + split[k]["coalesced"] for k in kinds)

    def sectors(kinds):
        return sum(SECTOR * split[k]["row"] + ITEMSIZE * split[k]["coalesced"] for k in kinds)

    return {
        "model_load_bytes": elements(["load"]) * ITEMSIZE * programs,
        "model_store_bytes": elements(["store", "init_store"]) * ITEMSIZE * programs,
        "model_init_store_bytes": elements(["init_store"]) * ITEMSIZE * programs,
        "model_sector_load_bytes": sectors(["load"]) * programs,
        "model_sector_store_bytes": sectors(["store", "init_store"]) * programs,
    }


def ledger_elements(config: Config) -> tuple[int, int, int]:
    """``(reads, writes, init_writes)`` per (batch, head) straight from :func:`fa2edu.io.visit_form` (the check on
    :func:`ledger_split`)."""
    algorithm = "flash1" if config.impl == "kg_flash1" else "flash2"
    visits = block_visits(config.N, config.N, *config.block_sizes, causal=config.causal)
    reads, writes = visit_form(algorithm, config.pass_, config.d, visits)
    if config.impl == "kg_flash1":
        init = config.N * (config.d + 2)             # FA1 Alg 1 line 2: O = 0, ℓ = 0, m = −inf
    elif config.pass_ == "backward":
        init = config.N * config.d                   # FA2 Alg 2 line 3: dQ = 0
    else:
        init = 0
    return reads, writes, init


# -- ncu's CSV ------------------------------------------------------------------------------------------------------

_SCALE = {"": 1, "byte": 1, "b": 1, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6, "gbyte": 1e9, "gb": 1e9,
          "tbyte": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "sector": 1, "inst": 1, "%": 1}


def parse_value(value: str, unit: str = "") -> float | None:
    """A metric value as ncu prints it, in base units: ``"1,048,576"`` → 1048576.0; ``("1.5", "Mbyte")`` →
    1.5e6; a decimal comma (``"9,5"``, some locales) → 9.5; ``"n/a"`` or empty → None."""
    text = str(value).strip().replace("\u202f", "").replace(" ", "")
    if not text or text.lower() in ("n/a", "nan", "-"):
        return None
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")               # thousands separators
    elif text.count(",") == 1 and "." not in text:
        text = text.replace(",", ".")              # a decimal comma
    try:
        number = float(text)
    except ValueError:
        return None
    scale = _SCALE.get(unit.strip().lower())
    if scale is None:
        raise ValueError(f"unknown metric unit {unit!r} (value {value!r}); run ncu with --print-units base")
    return number * scale


@dataclass
class KernelResult:
    """One profiled kernel launch of an ncu report: its ID, name, and metrics in base units."""

    id: int
    name: str
    metrics: dict[str, float | None] = field(default_factory=dict)
    grid: str | None = None
    block: str | None = None


def parse_ncu_csv(text: str) -> list[KernelResult]:
    """Parse ``ncu --csv`` output (the details page: one row per (kernel, metric)) into kernel results, in ID order.

    The header row begins with ``"ID"`` and names the columns ("ID", "Process ID", …, "Kernel Name", …,
    "Metric Name", "Metric Unit", "Metric Value"); lines before it (``==PROF==`` messages, the application's own
    output) and lines after it that are not CSV rows are skipped. Values may carry thousands separators; scaled
    byte units (``Kbyte``, ``MB``, …) are converted to bytes; counts (sectors, instructions) stay counts.
    """
    lines = text.splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    body = [lines[start]] + [line for line in lines[start + 1:] if line.startswith('"')]
    reader = csv.DictReader(io.StringIO("\n".join(body)))
    needed = {"ID", "Kernel Name", "Metric Name", "Metric Value"}
    if not needed <= set(reader.fieldnames or ()):
        raise ValueError(f"ncu CSV header lacks {sorted(needed - set(reader.fieldnames or ()))}: "
                         f"{lines[start][:200]}")
    kernels: dict[int, KernelResult] = {}
    for row in reader:
        try:
            kid = int(str(row["ID"]).replace(",", ""))
        except (TypeError, ValueError):
            continue
        result = kernels.setdefault(kid, KernelResult(kid, row["Kernel Name"], grid=row.get("Grid Size"),
                                                      block=row.get("Block Size")))
        name = row["Metric Name"]
        if name is None:
            continue
        result.metrics[name] = parse_value(row["Metric Value"], row.get("Metric Unit") or "")
    return [kernels[k] for k in sorted(kernels)]


def classify(name: str, config: Config) -> str | None:
    """Which of the call's kernels (:data:`KERNELS`) an ncu kernel name is, or None. Full names first (no name is
    a part of another: ``flash2_backward_kernel`` is not in ``flash2_backward_preprocess_kernel``), then the
    :data:`ALIASES` as whole words (``fill`` in ``…4fill$24…`` or ``fill``)."""
    for kernel in config.kernels:
        if kernel in name:
            return kernel
    for kernel in config.kernels:
        for alias in ALIASES.get(kernel, ()):
            if re.search(rf"(?<![A-Za-z_]){re.escape(alias)}(?![A-Za-z_])", name):
                return kernel
    return None


def measured_bytes(kernels: list[KernelResult], chosen: dict[str, str]) -> dict[str, float | None]:
    """Sum the call's kernels: L1 sector bytes, 4 × thread instructions, DRAM and local-memory bytes.

    ``chosen`` maps :data:`METRICS` short names to the metric actually requested (a ``*_sectors_*`` fallback is
    converted to bytes, × 32). Loads include atomics and reductions, and so do stores (a read-modify-write is one
    of each, as in the ledger). A short name that ncu did not report gives None.
    """
    def total(short):
        metric = chosen.get(short)
        if metric is None:
            return None
        values = [k.metrics.get(metric) for k in kernels]
        if not values or any(v is None for v in values):
            return None
        scale = SECTOR if "__sectors" in metric or "_sectors_" in metric else 1      # a sector-count fallback
        return float(sum(values)) * scale

    def plus(*parts):
        if parts[0] is None:
            return None
        return parts[0] + sum(p for p in parts[1:] if p is not None)

    ld, st, red, atom = (total(s) for s in ("ld_bytes", "st_bytes", "red_bytes", "atom_bytes"))
    t_ld, t_st, t_red, t_atom = (total(s) for s in ("thread_ld", "thread_st", "thread_red", "thread_atom"))
    thread_ld = plus(t_ld, t_red, t_atom)
    thread_st = plus(t_st, t_red, t_atom)
    return {
        "ncu_load_bytes": plus(ld, red, atom),
        "ncu_store_bytes": plus(st, red, atom),
        "ncu_atomic_bytes": None if red is None and atom is None else (red or 0.0) + (atom or 0.0),
        "ncu_thread_load_bytes": None if thread_ld is None else ITEMSIZE * thread_ld,
        "ncu_thread_store_bytes": None if thread_st is None else ITEMSIZE * thread_st,
        "dram_read_bytes": total("dram_read"),
        "dram_write_bytes": total("dram_write"),
        "local_load_bytes": total("local_ld_bytes"),
        "local_store_bytes": total("local_st_bytes"),
    }


def _ratio(a, b):
    return None if a is None or not b else float(f"{a / b:.5g}")


def make_record(config: Config, measured: dict | None = None, *, status: str = "ok", error: str | None = None,
                kernels: list[KernelResult] | None = None, device: str | None = None, **extra) -> dict:
    """One table row: the configuration, the model's bytes, ncu's bytes and their ratios (None where unmeasured).

    Keys: ``impl, pass, batch, heads, N, d, causal, block_sizes, dtype``, the :func:`model_bytes` keys, the
    :func:`measured_bytes` keys, ratios ``load_ratio``/``store_ratio`` (L1 sectors over the ledger),
    ``sector_load_ratio``/``sector_store_ratio`` (over the sector rule), ``thread_load_ratio``/
    ``thread_store_ratio`` (thread bytes over the ledger), ``dram_read_ratio``/``dram_write_ratio`` (DRAM over the
    ledger), and ``status`` ("ok", "error", "skipped"), ``error``, ``kernels`` (per launch), ``device``.
    """
    if status not in ("ok", "error", "skipped"):
        raise ValueError(f"status must be 'ok', 'error' or 'skipped', got {status!r}")
    if status != "ok" and not error:
        raise ValueError(f"a {status!r} record needs an error message saying why")
    model = model_bytes(config)
    measured = dict.fromkeys(("ncu_load_bytes", "ncu_store_bytes", "ncu_atomic_bytes", "ncu_thread_load_bytes",
                              "ncu_thread_store_bytes", "dram_read_bytes", "dram_write_bytes",
                              "local_load_bytes", "local_store_bytes")) | dict(measured or {})
    record = {"impl": config.impl, "pass": config.pass_, "batch": config.batch, "heads": config.heads,
              "N": config.N, "d": config.d, "causal": config.causal, "block_sizes": list(config.block_sizes),
              "dtype": "float32"}
    record.update(model)
    record.update({k: (None if v is None else int(round(v))) for k, v in measured.items()})
    record.update(
        load_ratio=_ratio(measured["ncu_load_bytes"], model["model_load_bytes"]),
        store_ratio=_ratio(measured["ncu_store_bytes"], model["model_store_bytes"]),
        sector_load_ratio=_ratio(measured["ncu_load_bytes"], model["model_sector_load_bytes"]),
        sector_store_ratio=_ratio(measured["ncu_store_bytes"], model["model_sector_store_bytes"]),
        thread_load_ratio=_ratio(measured["ncu_thread_load_bytes"], model["model_load_bytes"]),
        thread_store_ratio=_ratio(measured["ncu_thread_store_bytes"], model["model_store_bytes"]),
        dram_read_ratio=_ratio(measured["dram_read_bytes"], model["model_load_bytes"]),
        dram_write_ratio=_ratio(measured["dram_write_bytes"], model["model_store_bytes"]),
        status=status, error=error, device=device,
        kernels=[{"id": k.id, "name": k.name, "grid": k.grid, "block": k.block, "metrics": k.metrics}
                 for k in (kernels or [])])
    overlap = set(extra) & set(record)
    if overlap:
        raise ValueError(f"extra keys clash with the record: {sorted(overlap)}")
    record.update(extra)
    return record


def format_table(records: list[dict]) -> str:
    """The records as a text table: sizes in MiB, ratios measured/model."""
    def mib(v):
        return "—" if v is None else f"{v / 2**20:,.1f}"

    def x(v):
        return "—" if v is None else f"{v:.3f}"

    head = (f"{'impl':<10}{'pass':<9}{'N':>6}{'tiles':>8}{'causal':>7} | {'model ld':>9}{'model st':>9} | "
            f"{'thr/mdl ld':>10}{'st':>7} | {'L1/mdl ld':>9}{'st':>7} | {'L1/sect ld':>10}{'st':>7} | "
            f"{'DRAM/mdl rd':>11}{'wr':>7}  status")
    lines = [head, "-" * len(head)]
    for r in records:
        tiles = "x".join(str(b) for b in r["block_sizes"])
        lines.append(
            f"{r['impl']:<10}{r['pass']:<9}{r['N']:>6}{tiles:>8}{str(r['causal'])[0]:>7} | "
            f"{mib(r['model_load_bytes']):>9}{mib(r['model_store_bytes']):>9} | "
            f"{x(r['thread_load_ratio']):>10}{x(r['thread_store_ratio']):>7} | "
            f"{x(r['load_ratio']):>9}{x(r['store_ratio']):>7} | "
            f"{x(r['sector_load_ratio']):>10}{x(r['sector_store_ratio']):>7} | "
            f"{x(r['dram_read_ratio']):>11}{x(r['dram_write_ratio']):>7}  {r['status']}"
            + (f": {str(r['error'])[:60]}" if r.get("error") else ""))
    lines.append("model = fa2edu's ledger x 4 B (MiB per call); thr = 4 B x thread instructions; L1 = l1tex sector "
                 "bytes; sect = ledger with 32 B per row-per-thread element")
    return "\n".join(lines)


# -- running ncu ----------------------------------------------------------------------------------------------------

def find_ncu(explicit: str | None = None) -> str | None:
    """The ncu executable: ``explicit``, $NCU, PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute/*/."""
    candidates = [explicit, os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"]
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/ncu"), reverse=True)
    candidates += sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def available_metrics(ncu: str) -> set[str] | None:
    """Base metric names ``ncu --query-metrics`` lists for the attached GPU, or None if the query failed."""
    try:
        done = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = set(re.findall(r"^\s*([a-z0-9]+__[A-Za-z0-9_]+)", done.stdout, flags=re.M))
    return names or None


def choose_metrics(available: set[str] | None) -> dict[str, str]:
    """Short name -> the first candidate of :data:`METRICS` whose base name ncu lists (all firsts if unknown).
    SASS-instrumented metrics (``smsp__sass_*``) are kept when unlisted: some ncu versions leave them out of the
    query; a failing run is retried without them."""
    chosen = {}
    for short, candidates in METRICS.items():
        for metric in candidates:
            base = metric.split(".")[0]
            if available is None or base in available:
                chosen[short] = metric
                break
        else:
            if candidates[0].startswith("smsp__sass"):
                chosen[short] = candidates[0]
    missing = [s for s in REQUIRED if s not in chosen]
    if missing:
        raise RuntimeError(f"ncu lists none of the candidate metrics for {missing}: {[METRICS[s] for s in missing]}")
    return chosen


def ncu_version(ncu: str) -> str | None:
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"Version\s+(\S+)", out)
    return found.group(1) if found else (out.strip().splitlines() or [None])[-1]


def ncu_options(ncu: str) -> set[str]:
    """The long options this ncu accepts (from ``ncu --help``), to add optional ones only where they exist."""
    try:
        text = subprocess.run([ncu, "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", text))


def ncu_command(ncu: str, config: Config, metrics: list[str], *, python: str = sys.executable,
                info_path: str, selection: str = "range", options: set[str] | None = None) -> list[str]:
    """The ncu command line that profiles one call of ``config`` (see the module docstring for each choice).

    ``selection="range"``: ``--profile-from-start off``, the child brackets the measured call with
    ``cuda.profile_start/stop``. ``selection="name"``: ``--kernel-name regex:…`` over the mangled names,
    ``--launch-skip`` the warm-up call's launches, ``--launch-count`` the measured call's.
    """
    if selection not in ("range", "name"):
        raise ValueError(f"selection must be 'range' or 'name', got {selection!r}")
    options = options or set()
    cmd = [ncu, "--csv", "--metrics", ",".join(metrics), "--clock-control", "none", "--cache-control", "all",
           "--replay-mode", "kernel", "--target-processes", "all"]
    if not options or "--print-units" in options:
        cmd += ["--print-units", "base"]
    if "--print-metric-name" in options:
        cmd += ["--print-metric-name", "name"]
    launches = len(config.kernels)
    if selection == "range":
        cmd += ["--profile-from-start", "off"]
    else:
        names = "|".join(a for k in config.kernels for a in ALIASES.get(k, (k,))[:1])
        cmd += ["--kernel-name-base", "mangled", "--kernel-name", f"regex:.*({names}).*",
                "--launch-skip", str(launches), "--launch-count", str(launches)]
    return cmd + [python, "-m", "benchmarks.ncu_io", "--run-one", *config.argv(), "--info", info_path]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.pop("KERNELS_GPU_POISON", None)          # poison fills would be extra launches
    env["LC_ALL"] = "C"                           # "1,234.5", not "1.234,5"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def profile(config: Config, ncu: str, chosen: dict[str, str], *, options: set[str], timeout: float = 120):
    """Profile one configuration: ``(kernels, info, selection, log)``; raises RuntimeError with ncu's words."""
    log = []
    with tempfile.TemporaryDirectory(prefix="ncu_io-") as tmp:
        info_path = os.path.join(tmp, "info.json")
        for selection in ("range", "name"):
            cmd = ncu_command(ncu, config, list(dict.fromkeys(chosen.values())), info_path=info_path,
                              selection=selection, options=options)
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env())
            log.append(f"$ {' '.join(cmd)}\n[rc {done.returncode}]\n{done.stderr[-3000:]}")
            kernels = parse_ncu_csv(done.stdout)
            if done.returncode != 0 and not kernels:
                errors = [line for line in (done.stdout + done.stderr).splitlines()
                          if "ERR" in line or "rror" in line or "Failed" in line]
                raise RuntimeError(f"ncu exited {done.returncode}: {' | '.join(errors[-4:]) or done.stderr[-400:]}")
            mine = [k for k in kernels if classify(k.name, config)]
            if mine:
                info = json.load(open(info_path)) if os.path.exists(info_path) else {}
                return mine, info, selection, "\n".join(log)
        raise RuntimeError(f"ncu profiled none of {config.kernels}; stdout tail: {done.stdout[-400:]!r}")


# -- the child: one call --------------------------------------------------------------------------------------------

def run_one(config: Config, info_path: str | None) -> None:
    """Build the inputs on the GPU, warm the kernels up with one call, then run the measured call between
    ``cuda.profile_start()`` and ``cuda.profile_stop()``. Nothing goes to stdout (ncu's CSV does)."""
    import numpy as np
    if not hasattr(np, "row_stack"):                  # numba-cuda 0.30.4 under NumPy 2.5 (as kernels_gpu does)
        np.row_stack = np.vstack
    from numba import cuda

    import kernels_gpu
    from kernels_gpu import runtime as rt

    rt.poison_outputs = False
    B, H, N, d = config.batch, config.heads, config.N, config.d
    rng = np.random.default_rng(0)
    Q, K, V, dO = (cuda.to_device(rng.standard_normal((B, H, N, d)).astype(np.float32)) for _ in range(4))
    kw = dict(block_sizes=config.block_sizes, causal=config.causal)
    if config.impl == "kg_flash1":
        def call():
            return kernels_gpu.flash1_forward(Q, K, V, **kw)
    elif config.pass_ == "forward":
        def call():
            return kernels_gpu.flash2_forward(Q, K, V, **kw)
    else:
        fwd = kernels_gpu.flash2_forward(Q, K, V, causal=config.causal)
        cuda.synchronize()

        def call():
            return kernels_gpu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, **kw)

    started = time.perf_counter()
    call()                                            # compiles, and is the warm-up launch
    cuda.synchronize()
    compile_s = time.perf_counter() - started
    # (numba's simulator has no profiler API: there the bracket is a no-op, so the child can be checked without a GPU)
    start, stop = (getattr(cuda, name, lambda: None) for name in ("profile_start", "profile_stop"))
    start()
    out = call()
    cuda.synchronize()
    stop()

    # A sanity check of the measured call: every output finite, and (forward) a few rows against float64.
    finite = all(bool(np.isfinite(x.copy_to_host()).all()) for x in out)
    rel_error = None
    if config.pass_ == "forward":
        q, k, v = (x.copy_to_host()[0, 0].astype(np.float64) for x in (Q, K, V))
        rows = np.arange(0, N, max(1, N // 16))
        s = q[rows] @ k.T / np.sqrt(d)
        if config.causal:
            s[np.arange(N)[None, :] > rows[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        ref = (p / p.sum(axis=1, keepdims=True)) @ v
        got = out[0].copy_to_host()[0, 0][rows]
        rel_error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    device = cuda.get_current_device()
    name = getattr(device, "name", "numba CUDA simulator")
    name = name.decode() if isinstance(name, bytes) else str(name)
    info = {"device": name, "compute_capability": list(getattr(device, "compute_capability", ()) or ()),
            "compile_s": round(compile_s, 2),
            "finite": finite, "rel_error": rel_error, "launches": list(config.kernels)}
    print(f"[run-one] {config.label}: {info}", file=sys.stderr)
    if info_path:
        with open(info_path, "w") as f:
            json.dump(info, f)
    if not finite or (rel_error is not None and rel_error > 1e-3):
        raise SystemExit(f"run-one: wrong result for {config.label}: finite={finite}, rel_error={rel_error}")


# -- the driver -----------------------------------------------------------------------------------------------------

def _versions() -> dict:
    from importlib import metadata
    versions = {"python": sys.version.split()[0]}
    for name in ("numba", "numba-cuda", "numpy", "fa2edu"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def write_json(path: str, header: dict, records: list[dict]) -> str:
    """Write ``{"schema": 1, "header": …, "records": […]}`` atomically (the format chapter 10.4 reads)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ncu_io-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump({"schema": 1, "header": header, "records": records}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def drive(args) -> int:
    from datetime import datetime, timezone

    from benchmarks.harness.results_io import device_slug

    started = time.perf_counter()
    ncu = find_ncu(args.ncu)
    if ncu is None:
        print("ncu not found (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute/*/): pass --ncu PATH",
              file=sys.stderr)
        return 2
    version, options = ncu_version(ncu), ncu_options(ncu)
    available = available_metrics(ncu)
    chosen = choose_metrics(available)
    print(f"ncu {version} at {ncu}; {len(available) if available else 'unknown'} metrics listed; using "
          f"{sorted(set(chosen.values()))}", flush=True)
    configs = default_configs(quick=args.quick)
    records, device, infos = [], None, []
    for config in configs:
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            records.append(make_record(config, status="skipped", error=f"time budget {args.budget_s} s spent"))
            continue
        t0 = time.perf_counter()
        try:
            try:
                kernels, info, selection, _ = profile(config, ncu, chosen, options=options)
            except RuntimeError as error:
                without_sass = {s: m for s, m in chosen.items() if not m.startswith("smsp__sass")}
                if without_sass == chosen or "metric" not in str(error).lower():
                    raise
                print(f"  retrying without SASS metrics: {error}", flush=True)
                chosen = without_sass
                kernels, info, selection, _ = profile(config, ncu, chosen, options=options)
            device = info.get("device") or device
            infos.append(info)
            found = {classify(k.name, config) for k in kernels}
            error = None if found == set(config.kernels) else f"profiled {sorted(found)}, expected {config.kernels}"
            records.append(make_record(config, measured_bytes(kernels, chosen), kernels=kernels, device=device,
                                       status="ok" if error is None else "error", error=error,
                                       selection=selection, rel_error=info.get("rel_error")))
        except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as error:
            records.append(make_record(config, status="error", error=str(error)[:500]))
            if "ERR_NVGPUCTRPERM" in str(error):
                print("no permission to read the GPU's performance counters: stopping", file=sys.stderr)
                break
        r = records[-1]
        print(f"  {config.label}: {time.perf_counter() - t0:.1f} s, {r['status']}"
              f"{'' if r['error'] is None else ': ' + str(r['error'])[:200]}", flush=True)
    done_labels = {(r["impl"], r["pass"], r["N"], tuple(r["block_sizes"]), r["causal"]) for r in records}
    for config in configs:                           # configurations never reached (a stop) are recorded as skipped
        if (config.impl, config.pass_, config.N, config.block_sizes, config.causal) not in done_labels:
            records.append(make_record(config, status="skipped", error="not run (stopped early)"))

    header = {"device": device, "date": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
              "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.ncu_io", *sys.argv[1:]]),
              "versions": dict(_versions(), ncu=version), "git_commit": _git_commit(), "ncu_path": ncu,
              "metrics": chosen, "ncu_flags": "--clock-control none --cache-control all --replay-mode kernel",
              "compute_capability": infos[0].get("compute_capability") if infos else None,
              "notes": "bytes per call (batch x heads programs), float32; see benchmarks/ncu_io.py's docstring",
              "seconds": round(time.perf_counter() - started, 1)}
    path = args.out or os.path.join(RESULTS, device_slug(device or "unknown-device"), "ncu_io.json")
    write_json(path, header, records)
    print(format_table(records))
    print(f"wrote {path} ({header['seconds']} s)")
    return 0 if all(r["status"] == "ok" for r in records) else 1


def show(path: str) -> None:
    with open(path) as f:
        payload = json.load(f)
    rows = payload.get("records", payload) if isinstance(payload, dict) else payload
    if isinstance(payload, dict):
        print({k: payload["header"].get(k) for k in ("device", "date", "versions")})
    print(format_table(rows))


def _block_sizes(text: str) -> tuple[int, int]:
    parts = text.replace("x", ",").split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"block sizes must be 'B_r,B_c', got {text!r}")
    return int(parts[0]), int(parts[1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ncu_io", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="results file (default benchmarks/results/<device>/ncu_io.json)")
    parser.add_argument("--ncu", help="the ncu executable (default: searched)")
    parser.add_argument("--quick", action="store_true", help="N = 1024 only (and one causal case per kernel)")
    parser.add_argument("--budget-s", type=float, default=160.0,
                        help="stop starting configurations after this many seconds (default 160)")
    parser.add_argument("--show", metavar="PATH", help="print the table of a results file and exit")
    child = parser.add_argument_group("internal: one profiled call (run under ncu by the driver)")
    child.add_argument("--run-one", action="store_true")
    child.add_argument("--impl", choices=sorted({i for i, _ in KERNELS}))
    child.add_argument("--pass", dest="pass_", choices=["forward", "backward"], default="forward")
    child.add_argument("--N", type=int, default=1024)
    child.add_argument("--d", type=int, default=64)
    child.add_argument("--block-sizes", type=_block_sizes, default=(64, 64))
    child.add_argument("--batch", type=int, default=1)
    child.add_argument("--heads", type=int, default=4)
    child.add_argument("--causal", action="store_true")
    child.add_argument("--info", help="where the child writes device name and its check (JSON)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.show:
        show(args.show)
        return 0
    if args.run_one:
        if args.impl is None:
            raise SystemExit("--run-one needs --impl")
        run_one(Config(args.impl, args.pass_, args.N, args.d, tuple(args.block_sizes), args.causal, args.batch,
                       args.heads), args.info)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
