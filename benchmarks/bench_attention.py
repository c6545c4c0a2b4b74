"""Benchmark attention on a GPU: kernels_gpu (standard, FA1, FA2) against PyTorch, on the FA2 paper's grid.

    python -m benchmarks.bench_attention                    # the full sweep (FA2 paper, Figs. 4–7)
    python -m benchmarks.bench_attention --quick            # a short smoke sweep
    python -m benchmarks.bench_attention --long             # FA2 forward up to N = 65 536: peak memory vs N
    python -m benchmarks.bench_attention --plan             # print the configurations, run nothing (no GPU)

The grid (FA2 Section 4.1): batch × N = 16k tokens, hidden dimension 2048, so d = 64 with 32 heads or d = 128
with 16 heads; N = 512 … 16 384; causal or not; forward and backward. Every implementation of ``impls.IMPLS``
runs in the same process, on the same inputs, under the same protocol (``timing.measure``): checked against a
float64 reference first, peak memory measured, then timed with CUDA events (warm-up, median of repeats, inputs
rotated through more than twice the L2 cache). TFLOP/s use the paper's FLOP model (``flop_model``).

Results go to ``benchmarks/results/<device-slug>/<name>.json`` (``--out`` to choose the file), rewritten after
every configuration so that a run stopped midway keeps what it measured.
"""

import argparse
import math
import os
import shlex
import subprocess
import sys
import time
from typing import NamedTuple

from benchmarks.harness import timing
from benchmarks.harness.flop_model import PASSES, model_flops
from benchmarks.harness.results_io import default_results_path, make_record, utc_now, write_results

PAPER_N = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_N = (512, 1024)
LONG_N = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
LONG_IMPLS = ("kg_flash2", "kg_flash2_v3", "kg_standard")


# ---------------------------------------------------------------------------------------------- arguments

def _ints(text):
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _bools(text):
    table = {"0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}
    if text.strip().lower() == "both":
        return (False, True)
    try:
        values = tuple(dict.fromkeys(table[v.strip().lower()] for v in text.split(",") if v.strip()))
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected 'both' or a list of 0/1/true/false, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _passes(text):
    alias = {"forward": "forward", "fwd": "forward", "backward": "backward", "bwd": "backward"}
    try:
        values = tuple(dict.fromkeys(alias[v.strip().lower()] for v in text.split(",") if v.strip()))
    except KeyError:
        raise argparse.ArgumentTypeError(f"passes must be forward/backward (or fwd/bwd), got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one pass")
    return values


def _impl_names(text):
    from benchmarks.harness.impls import IMPLS
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    unknown = [v for v in values if v not in IMPLS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {unknown}; known: {', '.join(IMPLS)}")
    return values


def _block_sizes(text):
    values = _ints(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"block sizes are two integers B_r,B_c, got {text!r}")
    return values


def build_parser():
    from benchmarks.harness.impls import DEFAULT_IMPLS, IMPLS
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_attention",
        description="Time attention implementations on a CUDA GPU on the FA2 paper's grid; write JSON results.",
        epilog="implementations: " + "; ".join(f"{n} ({s.dtype}, {'/'.join(s.passes)})" for n, s in IMPLS.items()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"smoke sweep: N in {QUICK_N}, d = 64, short timing")
    mode.add_argument("--long", action="store_true",
                      help="long-sequence mode: B = 1, fixed heads, N up to 65 536; peak memory vs N")
    parser.add_argument("--plan", action="store_true", help="print the configurations and exit (needs no GPU)")
    parser.add_argument("--show", nargs="+", metavar="RESULTS", default=None,
                        help="print the tables and summary of results file(s), and where to commit them; no GPU")
    parser.add_argument("--impls", type=_impl_names, default=None,
                        help=f"comma-separated implementations (default: {','.join(DEFAULT_IMPLS)}; "
                             f"--long: {','.join(LONG_IMPLS)})")
    parser.add_argument("--N", type=_ints, default=None,
                        help=f"sequence lengths (default {','.join(map(str, PAPER_N))}; "
                             f"--long: {','.join(map(str, LONG_N))})")
    parser.add_argument("--d", type=_ints, default=None, help="head dimensions (default 64,128; --long: 64)")
    parser.add_argument("--causal", type=_bools, default=None, help="'both', or 0/1 (default both; --long: 0)")
    parser.add_argument("--passes", type=_passes, default=None,
                        help="forward,backward or a subset (default both; --long: forward)")
    parser.add_argument("--tokens", type=int, default=16384, help="batch × N for the sweep (FA2 paper: 16k)")
    parser.add_argument("--hidden", type=int, default=2048, help="heads × d for the sweep (FA2 paper: 2048)")
    parser.add_argument("--long-batch", type=int, default=1, help="batch in --long mode")
    parser.add_argument("--long-heads", type=int, default=16, help="heads in --long mode")
    parser.add_argument("--block-sizes", type=_block_sizes, default=None,
                        help="B_r,B_c for the kernels_gpu flash kernels (default: their own)")
    parser.add_argument("--name", default=None, help="results file name (default: sweep, quick or long)")
    parser.add_argument("--out", default=None,
                        help="results file path (default benchmarks/results/<device>/<name>.json)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting configurations after this many seconds; the rest are recorded as skipped "
                             "(default: none; --quick: 120)")
    parser.add_argument("--max-call-ms", type=float, default=None,
                        help="a configuration whose one call takes longer is not timed (default 1500; --long: 120000)")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="timed work per configuration (default 200; --quick: 100; --long: 2000)")
    parser.add_argument("--min-repeats", type=int, default=None, help="timed calls at least (default 3; --long: 1)")
    parser.add_argument("--max-repeats", type=int, default=None, help="timed calls at most (default 50; --long: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 1; --long: 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random inputs")
    parser.add_argument("--no-torch-allocator", action="store_true",
                        help="leave numba on its own allocator (kernels_gpu peak memory is then not recorded)")
    parser.add_argument("--no-ceilings", action="store_true",
                        help="skip measuring the copy bandwidth and fp32 matmul rate recorded in the header")
    return parser


def parse_args(argv=None):
    """Parse the command line and fill the mode-dependent defaults (quick / long / full sweep)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from benchmarks.harness.impls import DEFAULT_IMPLS, IMPLS
    if args.long:
        defaults = dict(impls=LONG_IMPLS, N=LONG_N, d=(64,), causal=(False,), passes=("forward",), name="long",
                        budget_s=None, max_call_ms=120_000.0, target_ms=2000.0, min_repeats=1, max_repeats=3, warmup=0)
    elif args.quick:
        defaults = dict(impls=DEFAULT_IMPLS, N=QUICK_N, d=(64,), causal=(False, True), passes=PASSES, name="quick",
                        budget_s=120.0, max_call_ms=1500.0, target_ms=100.0, min_repeats=3, max_repeats=20, warmup=1)
    else:
        defaults = dict(impls=DEFAULT_IMPLS, N=PAPER_N, d=(64, 128), causal=(False, True), passes=PASSES,
                        name="sweep", budget_s=None, max_call_ms=1500.0, target_ms=200.0, min_repeats=3,
                        max_repeats=50, warmup=1)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("tokens", "hidden", "long_batch", "long_heads", "min_repeats", "max_repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.max_repeats < args.min_repeats:
        parser.error("--max-repeats must be >= --min-repeats")
    if not args.long:
        for N in args.N:
            if args.tokens % N:
                parser.error(f"--tokens {args.tokens} is not a multiple of N = {N} (batch = tokens / N)")
        for d in args.d:
            if args.hidden % d:
                parser.error(f"--hidden {args.hidden} is not a multiple of d = {d} (heads = hidden / d)")
    useful = [i for i in args.impls if set(IMPLS[i].passes) & set(args.passes)]
    if not useful:
        parser.error(f"none of {list(args.impls)} has a {'/'.join(args.passes)} pass")
    return args


# ---------------------------------------------------------------------------------------------- the plan

class Config(NamedTuple):
    """One measurement: an implementation's pass on one problem."""

    impl: str
    pass_: str
    batch: int
    heads: int
    N: int
    d: int
    causal: bool

    @property
    def problem(self):
        """What the reference depends on: (batch, heads, N, d, causal)."""
        return (self.batch, self.heads, self.N, self.d, self.causal)

    @property
    def series(self):
        """A line in the figures: one implementation, pass, d and causal flag, across N."""
        return (self.impl, self.pass_, self.d, self.causal)

    def flops(self):
        return model_flops(self.batch, self.heads, self.N, self.d, self.causal, self.pass_)

    def label(self):
        direction = "fwd" if self.pass_ == "forward" else "bwd"
        return f"{self.impl} {direction} N={self.N} d={self.d}{' causal' if self.causal else ''}"


def plan(args):
    """The configurations in run order: per (d, causal, N) every pass and implementation, N ascending, so each
    problem's reference is computed once and a series can be cut short once it is too slow or out of memory."""
    from benchmarks.harness.impls import IMPLS
    configs = []
    for d in args.d:
        for causal in args.causal:
            for N in sorted(args.N):
                if args.long:
                    batch, heads = args.long_batch, args.long_heads
                else:
                    batch, heads = args.tokens // N, args.hidden // d
                for pass_ in args.passes:
                    for impl in args.impls:
                        if pass_ in IMPLS[impl].passes:
                            configs.append(Config(impl, pass_, batch, heads, N, d, causal))
    return configs


def predicted_skip(history, config, max_call_ms, margin=2.0):
    """Why ``config`` need not run, judged from the same series at smaller N (or None to run it).

    history: {series: (N, status, one_call_ms, flops)} of the last measured point of each series. A series that
    ran out of memory at a smaller N will again (memory grows with N on both grids); one that was too slow will
    be slower; one whose last time, scaled by the FLOP ratio, exceeds ``margin`` × the cap is not started.
    """
    last = history.get(config.series)
    if last is None:
        return None
    N, status, one_call_ms, flops = last
    if status == "oom":
        return f"out of memory already at N = {N}"
    if status == "too_slow":
        return f"already slower than the cap at N = {N}"
    if status == "ok" and one_call_ms:
        predicted = one_call_ms * config.flops() / flops
        if predicted > margin * max_call_ms:
            return f"predicted {predicted:.0f} ms per call from N = {N} (cap {max_call_ms:.0f} ms)"
    return None


def update_history(history, config, outcome):
    """Remember the last point of ``config``'s series for ``predicted_skip``."""
    status = outcome["status"]
    error = outcome.get("error") or ""
    if status == "ok":
        history[config.series] = (config.N, "ok", outcome["ms"], config.flops())
    elif status == "skipped" and error.startswith("out of memory"):
        history[config.series] = (config.N, "oom", None, config.flops())
    elif status == "skipped" and "cap" in error:
        history[config.series] = (config.N, "too_slow", outcome.get("ms_one_call"), config.flops())


# ---------------------------------------------------------------------------------------------- the device

# cuda_setup and package_versions live in ``timing`` (every driver starts with them); named here as before.
cuda_setup, package_versions = timing.cuda_setup, timing.package_versions


def _git_commit():
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        text = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return text.stdout.strip() or None
    except Exception:
        return None


def _nvidia_smi(query):
    try:
        text = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        return text.stdout.strip().splitlines()[0] if text.stdout.strip() else None
    except Exception:
        return None


def device_header(allocator):
    """What was measured on: device properties, versions, settings that change the numbers."""
    import torch
    props = torch.cuda.get_device_properties(0)
    versions = package_versions()
    versions.update(python=sys.version.split()[0], torch_cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), driver=_nvidia_smi("driver_version"))
    return {
        "device": props.name,
        "device_properties": {"multiprocessors": props.multi_processor_count,
                              "total_memory_bytes": props.total_memory,
                              "l2_cache_bytes": getattr(props, "L2_cache_size", None),
                              "compute_capability": f"{props.major}.{props.minor}",
                              "clocks": _nvidia_smi("clocks.sm,clocks.max.sm,clocks.mem")},
        "versions": versions,
        "numba_allocator": allocator,
        "numba_cuda_array_interface_sync": os.environ.get("NUMBA_CUDA_ARRAY_INTERFACE_SYNC"),
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
    }


def measure_ceilings(device, repeats=10):
    """The two ceilings of GPU.md's method, measured here: device-to-device copy bandwidth (bytes read + written)
    and the fp32 matrix product rate with TF32 off (8192³)."""
    import torch

    from benchmarks.harness.timing import summarize_ms, time_calls
    src = torch.randn(2**28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    copy_bytes = 2 * src.numel() * src.element_size()  # each byte read once and written once
    copy_ms = summarize_ms(time_calls([lambda: dst.copy_(src)], device, 3, repeats))["ms"]
    n = 8192
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    mm_ms = summarize_ms(time_calls([lambda: torch.matmul(a, b)], device, 3, repeats))["ms"]
    src = dst = a = b = None  # free the buffers before the sweep
    device.empty_cache()
    return {"copy_TBps": copy_bytes / (copy_ms * 1e-3) / 1e12, "fp32_matmul_TFLOPs": 2 * n**3 / (mm_ms * 1e-3) / 1e12,
            "copy_ms": copy_ms, "matmul_ms": mm_ms, "repeats": repeats}


# ---------------------------------------------------------------------------------------------- the run

def run(args, configs, device, header, out_path, progress=True):
    """Measure every configuration in order; write the results file after each. Returns the records."""
    from tqdm import tqdm

    from benchmarks.harness import impls
    from benchmarks.harness.timing import Protocol

    l2 = header.get("device_properties", {}).get("l2_cache_bytes") or 60 * 2**20
    protocol = Protocol(warmup=args.warmup, min_repeats=args.min_repeats, max_repeats=args.max_repeats,
                        target_ms=args.target_ms, max_call_ms=args.max_call_ms, pool_target_bytes=2 * l2)
    header["settings"] = {"protocol": protocol.as_dict(), "tolerance": {f"{k[0]}/{k[1]}": v
                                                                        for k, v in impls.TOLERANCE.items()},
                          "mode": "long" if args.long else ("quick" if args.quick else "sweep"),
                          "tokens": None if args.long else args.tokens, "hidden": None if args.long else args.hidden,
                          "block_sizes": args.block_sizes, "seed": args.seed, "budget_s": args.budget_s}
    options = {"block_sizes": tuple(args.block_sizes) if args.block_sizes else None}
    mode = header["settings"]["mode"]
    records, history, reference = [], {}, {"problem": None}
    started = time.perf_counter()
    bar = tqdm(configs, desc=mode, unit="cfg", dynamic_ncols=True, mininterval=2.0, disable=not progress)
    for config in bar:
        bar.set_postfix_str(config.label(), refresh=False)
        spec = impls.IMPLS[config.impl]
        common = dict(impl=config.impl, pass_=config.pass_, dtype=spec.dtype, batch=config.batch,
                      heads=config.heads, N=config.N, d=config.d, causal=config.causal, device=header["device"],
                      mode=mode, family=spec.family)
        elapsed = time.perf_counter() - started
        reason = predicted_skip(history, config, args.max_call_ms)
        if args.budget_s is not None and elapsed > args.budget_s:
            reason = f"sweep time budget of {args.budget_s:.0f} s spent"
        if reason:
            records.append(make_record(status="skipped", error=reason, **common))
        else:
            outcome = _measure_one(config, spec, args, device, protocol, options, reference,
                                   count_memory=(spec.family == "torch" or header["numba_allocator"] == "torch"))
            update_history(history, config, outcome)
            fields = {k: v for k, v in outcome.items() if k not in ("status", "error", "ms", "tflops",
                                                                     "peak_mem_bytes")}
            records.append(make_record(status=outcome["status"], error=outcome["error"], ms=outcome["ms"],
                                       tflops=outcome["tflops"], peak_mem_bytes=outcome["peak_mem_bytes"],
                                       **fields, **common))
        write_results(out_path, header, records, summary=summarize(records, mode))
    bar.close()
    reference.clear()
    device.empty_cache()
    return records


def _measure_one(config, spec, args, device, protocol, options, reference, count_memory):
    """``timing.measure`` for one configuration, its reference computed (or reused) first."""
    from benchmarks.harness import impls
    from benchmarks.harness.timing import Outcome, measure
    try:
        ref = _reference_for(reference, config, args.seed, device)
    except Exception as exc:  # the float64 reference itself did not fit: nothing to check against
        reference.clear()
        device.empty_cache()
        status = "skipped" if device.is_out_of_memory(exc) else "error"
        return Outcome(status=status, ms=None, tflops=None, peak_mem_bytes=None,
                       error=f"float64 reference failed: {type(exc).__name__}: {exc}"[:400])
    seed, scale = args.seed, 1.0 / math.sqrt(config.d)  # docs/conventions.md: τ = 1/√d

    def make_call(k):
        x = impls.make_inputs(config.batch, config.heads, config.N, config.d,
                              impls.config_seed(seed, config.N, config.d, config.causal, k))
        return spec.build(config.pass_, x, config.causal, scale, options)

    check = impls.make_check(ref[config.pass_], spec.dtype, config.pass_)
    return measure(make_call, check, device, protocol, config.flops(), count_memory=count_memory)


def _reference_for(cache, config, seed, device):
    """The float64 reference of ``config``'s problem for input set 0, computed once per problem (the previous
    problem's is dropped first, to keep GPU memory free)."""
    from benchmarks.harness import impls
    if cache.get("problem") == config.problem and config.pass_ in cache:
        return cache
    if cache.get("problem") != config.problem:
        cache.clear()
        device.empty_cache()
        cache["problem"] = config.problem
    x = impls.make_inputs(config.batch, config.heads, config.N, config.d,
                          impls.config_seed(seed, config.N, config.d, config.causal, 0))
    scale = 1.0 / math.sqrt(config.d)  # docs/conventions.md: τ = 1/√d (FA2's footnote printing 1/d is an erratum)
    if "forward_O" not in cache:
        O, L = impls.reference_forward(x["Q"], x["K"], x["V"], config.causal, scale)
        cache["forward_O"], cache["forward_L"] = O, L
        cache["forward"] = {"O": O, "L": L}
    if config.pass_ == "backward":
        dQ, dK, dV = impls.reference_backward(x["Q"], x["K"], x["V"], x["dO"], cache["forward_O"],
                                              cache["forward_L"], config.causal, scale)
        cache["backward"] = {"dQ": dQ, "dK": dK, "dV": dV}
    del x
    device.empty_cache()
    return cache


def memory_slope(points):
    """Least-squares slope of log(peak memory) against log(N): 1 for linear memory, 2 for quadratic."""
    points = [(N, m) for N, m in points if m]
    if len(points) < 2:
        return None
    xs = [math.log(N) for N, _ in points]
    ys = [math.log(m) for _, m in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return None if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def summarize(records, mode):
    """Per series: points measured and skipped; in long mode the memory slope and the largest N that ran."""
    series = {}
    for r in records:
        key = f"{r['impl']}/{r['pass']}/d{r['d']}/{'causal' if r['causal'] else 'full'}"
        s = series.setdefault(key, {"ok": 0, "skipped": 0, "wrong": 0, "error": 0, "max_N_ok": None, "points": []})
        s[r["status"]] += 1
        if r["status"] == "ok":
            s["max_N_ok"] = max(s["max_N_ok"] or 0, r["N"])
            if r.get("peak_mem_bytes"):
                s["points"].append((r["N"], r["peak_mem_bytes"]))
    for s in series.values():
        # the slope over the two largest N that ran: there the N² term, if any, dominates the inputs' N term
        s["memory_slope_top"] = memory_slope(sorted(s["points"])[-2:])
        s["memory_slope_fit"] = memory_slope(s["points"])
        if mode != "long":
            del s["points"]
    return {"mode": mode, "series": series}


def format_table(records):
    """A plain-text table: TFLOP/s per implementation (rows) and N (columns), one block per (pass, d, causal);
    '-' skipped, 'X' wrong, 'E' error."""
    lines = []
    def block(r):
        return (r.get("mode", "sweep"), r["pass"], r["d"], r["causal"])
    for mode, pass_, d, causal in sorted({block(r) for r in records},
                                         key=lambda b: (b[0] == "long", b[1] != "forward", b[2], b[3])):
        rows = [r for r in records if block(r) == (mode, pass_, d, causal)]
        Ns = sorted({r["N"] for r in rows})
        shape = f"B = {rows[0]['batch']}, H = {rows[0]['heads']}, " if mode == "long" else ""
        lines.append(f"\n{mode}: {pass_}, {shape}d = {d}, {'causal' if causal else 'not causal'}: "
                     "TFLOP/s (peak GiB)")
        lines.append(f"{'impl':<16}" + "".join(f"{N:>16}" for N in Ns))
        for impl in dict.fromkeys(r["impl"] for r in rows):
            cells = []
            for N in Ns:
                hit = [r for r in rows if r["impl"] == impl and r["N"] == N]
                if not hit:
                    cells.append("")
                    continue
                r = hit[0]
                if r["status"] == "ok":
                    mem = "" if r["peak_mem_bytes"] is None else f" ({r['peak_mem_bytes'] / 2**30:.2f})"
                    cells.append(f"{r['tflops']:.2f}{mem}")
                else:
                    cells.append({"skipped": "-", "wrong": "X", "error": "E"}[r["status"]])
            lines.append(f"{impl:<16}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def show(paths):
    """Print the table and summary of results files, and the path each belongs at in the repository."""
    from benchmarks.harness.results_io import load_results
    for path in paths:
        header, records, summary = load_results(path)
        name = os.path.splitext(os.path.basename(path))[0]
        print(f"{path}: {header.get('device')} {header.get('date')} ({len(records)} records)")
        print(f"  commit as {os.path.relpath(default_results_path(header.get('device') or 'unknown', name))}")
        print(format_table(records))
        for key, s in (summary or {}).get("series", {}).items():
            if s.get("memory_slope_top") is not None and (summary or {}).get("mode") == "long":
                print(f"{key}: largest N {s['max_N_ok']}, memory slope top {_fmt(s['memory_slope_top'])}, "
                      f"fit {_fmt(s['memory_slope_fit'])}")
        print()
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.show:
        return show(args.show)
    configs = plan(args)
    if args.plan:
        for config in configs:
            print(config.label(), f"batch={config.batch} heads={config.heads} flops={config.flops():.3e}")
        print(f"{len(configs)} configurations")
        return 0
    device, allocator = cuda_setup(use_torch_allocator=not args.no_torch_allocator)
    header = device_header(allocator)
    header.update(date=utc_now(), command=shlex.join([sys.executable, "-m", "benchmarks.bench_attention"]
                                                     + list(sys.argv[1:] if argv is None else argv)),
                  git_commit=_git_commit())
    if not args.no_ceilings:
        header["ceilings"] = measure_ceilings(device)
    out_path = args.out or default_results_path(header["device"], args.name)
    print(f"{header['device']}: {len(configs)} configurations -> {out_path}", flush=True)
    records = run(args, configs, device, header, out_path)
    print(format_table(records))
    summary = summarize(records, header["settings"]["mode"])
    if args.long:
        for key, s in summary["series"].items():
            print(f"{key}: largest N that ran {s['max_N_ok']}, memory slope (log-log) "
                  f"top two N {_fmt(s['memory_slope_top'])}, all N {_fmt(s['memory_slope_fit'])}")
    counts = {status: sum(r["status"] == status for r in records) for status in ("ok", "skipped", "wrong", "error")}
    print(f"\n{counts} -> {out_path}")
    return 1 if counts["wrong"] or counts["error"] else 0


def _fmt(value):
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
