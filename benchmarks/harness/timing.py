"""How one configuration is measured: check once, measure peak memory once, warm up, time, take the median.

The protocol (``measure``), for one implementation at one (batch, heads, N, d, causal, pass):

1. build one input set and whatever the timed pass needs (for a backward pass: the forward's saved state);
2. **correct first**: run it once with fresh allocations poisoned (NaN), compare with the float64 reference;
   a wrong result is recorded as ``wrong`` and never timed. The same call, between ``reset_peak_memory_stats``
   and ``max_memory_allocated``, gives the **peak memory**: inputs, saved state, outputs and temporaries;
3. run it once more, timed with events: a call slower than the cap is recorded as ``skipped``;
4. **rotate inputs**: build more input sets until together they exceed ``pool_target_bytes`` (twice the L2 cache),
   so a repeat never finds its inputs left in L2 by the previous one;
5. **warm up** (every input set at least once), then time ``repeats`` calls with a pair of CUDA events each,
   cycling through the input sets, synchronising once at the end; report the median (and the quartiles).
   With ``min_repeats = 1`` (the long-sequence mode) a call longer than ``target_ms`` is not repeated: the
   call of step 3, already warm, is the one sample.

Everything device-specific goes through a *device* object (``TorchDevice`` on a GPU; tests pass a fake with a
fake clock), so the protocol itself runs and is tested without a GPU.

Below the protocol: the CUDA set-up every driver starts with (``cuda_setup``: TF32 off, PyTorch's context first,
numba's allocations through PyTorch's allocator; ``package_versions``), and the run record the fast-kernel drivers
share (``add_run_arguments``, ``start_run``, ``measure_and_record``, ``results_table``).

Layering: ``impls`` (what is timed) ← this module ← the drivers (``bench_attention``, ``fast_kernels``, …); this
module never imports a driver.
"""

import gc
import math
import os
import statistics
import sys
import time


class Protocol:
    """The knobs of ``measure``; the defaults suit the FA2 grid on an H100/H200.

    warmup       untimed calls before timing (at least one per input set)
    min_repeats  timed calls at least (unless one call exceeds ``max_call_ms``)
    max_repeats  timed calls at most
    target_ms    timed work to aim for per configuration; repeats = target_ms / (time of one call), clamped
    max_call_ms  a configuration whose single call takes longer is not timed further (status ``skipped``)
    pool_target_bytes  rotate among input sets until their total exceeds this (2 × L2 by default)
    max_pool     input sets at most
    """

    def __init__(self, warmup=1, min_repeats=3, max_repeats=50, target_ms=200.0, max_call_ms=1500.0,
                 pool_target_bytes=120 * 2**20, max_pool=8):
        if not (isinstance(warmup, int) and warmup >= 0):
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        if not (isinstance(min_repeats, int) and min_repeats >= 1):
            raise ValueError(f"min_repeats must be an int >= 1, got {min_repeats!r}")
        if not (isinstance(max_repeats, int) and max_repeats >= min_repeats):
            raise ValueError(f"max_repeats must be an int >= min_repeats, got {max_repeats!r}")
        if not target_ms > 0 or not max_call_ms > 0:
            raise ValueError("target_ms and max_call_ms must be positive")
        if not (isinstance(max_pool, int) and max_pool >= 1):
            raise ValueError(f"max_pool must be an int >= 1, got {max_pool!r}")
        self.warmup, self.min_repeats, self.max_repeats = warmup, min_repeats, max_repeats
        self.target_ms, self.max_call_ms = float(target_ms), float(max_call_ms)
        self.pool_target_bytes, self.max_pool = int(pool_target_bytes), max_pool

    def as_dict(self):
        return dict(vars(self))


def plan_repeats(call_ms, target_ms, min_repeats, max_repeats):
    """Timed calls for a call of ``call_ms``: enough to fill ``target_ms``, within [min_repeats, max_repeats]."""
    if call_ms <= 0:
        return max_repeats
    return int(min(max_repeats, max(min_repeats, math.ceil(target_ms / call_ms))))


def pool_copies(bytes_per_set, target_bytes, max_pool, free_bytes=None, headroom_bytes=0):
    """How many input sets to rotate among: enough that together they exceed ``target_bytes`` (so the L2
    cache cannot hold them), at most ``max_pool``, and no more than fit in ``free_bytes`` beside
    ``headroom_bytes`` (what one call allocates). Always at least one."""
    if bytes_per_set <= 0:
        return 1
    n = min(max_pool, max(1, math.ceil((target_bytes + 1) / bytes_per_set)))
    if free_bytes is not None:
        fits = 1 + max(0, free_bytes - headroom_bytes) // bytes_per_set
        n = min(n, fits)
    return int(max(1, n))


def time_calls(calls, device, warmup, repeats):
    """Time ``repeats`` calls, cycling through ``calls`` (one per input set), after ``warmup`` untimed ones.

    Each timed call sits between two device events; the host synchronises once, after the last, so the host
    never waits between launches. Returns the list of per-call times in milliseconds.
    """
    if not calls:
        raise ValueError("calls must hold at least one callable")
    n = len(calls)
    for k in range(max(warmup, n)):
        calls[k % n]()
    starts = [device.event() for _ in range(repeats)]
    ends = [device.event() for _ in range(repeats)]
    for r in range(repeats):
        starts[r].record()
        calls[r % n]()
        ends[r].record()
    device.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def summarize_ms(times):
    """Median and quartiles of a list of times (ms)."""
    if not times:
        raise ValueError("times must not be empty")
    med = statistics.median(times)
    if len(times) >= 2:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    else:
        q1 = q3 = med
    return {"ms": med, "ms_q1": q1, "ms_q3": q3, "ms_min": min(times)}


class Outcome(dict):
    """The result of ``measure``: status, ms, peak_mem_bytes, error and the extra record fields."""


def measure(make_call, check, device, protocol, flops, count_memory=True):
    """Run the protocol above for one configuration.

    make_call(k)  builds input set k (and the forward state a backward pass needs) and returns a function of no
                  arguments that runs the timed pass once and returns its outputs; not timed.
    check(out)    compares one call's outputs with the reference; returns ``(ok, details)``, details a dict of
                  relative errors put in the record.
    device        ``TorchDevice`` (or a fake): events, synchronize, memory statistics, out-of-memory test.
    flops         the model FLOPs of one call (``flop_model.model_flops``), for TFLOP/s.
    count_memory  False when the device's statistics miss this implementation's allocations (numba's own
                  allocator): ``peak_mem_bytes`` is then left out rather than under-reported.

    Returns an ``Outcome`` with ``status`` in {ok, skipped, wrong, error}; never raises for a failing
    implementation: out of memory is ``skipped``, any other exception is ``error``.
    """
    from benchmarks.harness.flop_model import tflops as to_tflops

    out = Outcome(status="ok", ms=None, tflops=None, peak_mem_bytes=None, error=None)
    calls = []
    try:
        device.synchronize()
        m0 = device.memory_allocated()
        calls.append(make_call(0))

        # 2. correct first: fresh allocations poisoned, so an unwritten output element shows up as NaN;
        # 3. the same call gives the peak memory (poisoning writes into allocations, it adds none)
        device.synchronize()
        base = device.memory_allocated()
        device.reset_peak_memory_stats()
        t_first = time.perf_counter()
        with device.poisoned():
            result = calls[0]()
            device.synchronize()
        out["first_call_s"] = time.perf_counter() - t_first  # includes JIT compilation on a kernel's first use
        peak = device.max_memory_allocated()
        if count_memory:
            out["peak_mem_bytes"] = peak - m0
        out["resident_bytes"] = base - m0
        ok, details = check(result)
        del result
        out.update(details)
        if not ok:
            out.update(status="wrong", error=f"does not match the float64 reference: {details}")
            return out

        # 3. the time of one warm call decides the repeats, or that the configuration is too slow to repeat
        start, end = device.event(), device.event()
        start.record()
        result = calls[0]()
        end.record()
        device.synchronize()
        del result
        one_call_ms = start.elapsed_time(end)
        if one_call_ms > protocol.max_call_ms:
            out.update(status="skipped", ms_one_call=one_call_ms,
                       error=f"one call took {one_call_ms:.0f} ms > cap {protocol.max_call_ms:.0f} ms")
            return out
        if protocol.min_repeats == 1 and one_call_ms >= protocol.target_ms:
            # a call this long is its own sample: warmed up by the check, inputs far larger than L2
            out.update(summarize_ms([one_call_ms]), repeats=1, pool=1, tflops=to_tflops(flops, one_call_ms))
            return out

        # 4. rotate inputs: more sets until together they exceed the L2 cache several times over
        want = pool_copies(base - m0, protocol.pool_target_bytes, protocol.max_pool,
                           free_bytes=device.free_bytes(), headroom_bytes=2 * max(0, peak - base))
        for k in range(1, want):
            try:
                calls.append(make_call(k))
            except Exception as exc:  # out of memory while building the pool: use the sets we have
                if not device.is_out_of_memory(exc):
                    raise
                device.empty_cache()
                break
        out["pool"] = len(calls)

        # 5. warm up, time, take the median
        repeats = plan_repeats(one_call_ms, protocol.target_ms, protocol.min_repeats, protocol.max_repeats)
        times = time_calls(calls, device, protocol.warmup, repeats)
        out.update(summarize_ms(times))
        out["repeats"] = repeats
        out["tflops"] = to_tflops(flops, out["ms"])
        return out
    except Exception as exc:
        if device.is_out_of_memory(exc):
            out.update(status="skipped", error=f"out of memory: {_short(exc)}")
        else:
            out.update(status="error", error=f"{type(exc).__name__}: {_short(exc)}")
        return out
    finally:
        calls.clear()
        device.empty_cache()


def _short(exc, limit=300):
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "…"


class TorchDevice:
    """The device seen through PyTorch: CUDA events, memory statistics of PyTorch's caching allocator
    (which sees numba's allocations too once ``torch_allocator.install`` has run)."""

    def __init__(self):
        import torch
        self.torch = torch

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def synchronize(self):
        self.torch.cuda.synchronize()

    def memory_allocated(self):
        return self.torch.cuda.memory_allocated()

    def reset_peak_memory_stats(self):
        self.torch.cuda.reset_peak_memory_stats()

    def max_memory_allocated(self):
        return self.torch.cuda.max_memory_allocated()

    def free_bytes(self):
        free, _total = self.torch.cuda.mem_get_info()
        # memory PyTorch has cached but not handed out is free for our purpose too
        return free + self.torch.cuda.memory_reserved() - self.torch.cuda.memory_allocated()

    def empty_cache(self):
        gc.collect()
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()

    def is_out_of_memory(self, exc):
        if isinstance(exc, self.torch.cuda.OutOfMemoryError):
            return True
        text = str(exc)
        return "out of memory" in text.lower() or "CUDA_ERROR_OUT_OF_MEMORY" in text

    def poisoned(self):
        from benchmarks.harness import torch_allocator
        return torch_allocator.poisoned()



# ---------------------------------------------------------------------------------------------- the CUDA set-up

def cuda_setup(use_torch_allocator=True):
    """Prepare PyTorch and numba on the GPU; returns (device, allocator name). TF32 off: fp32 means fp32."""
    import numpy as np
    if not hasattr(np, "row_stack"):  # numba-cuda 0.30.4 still references np.row_stack, gone in NumPy 2.5
        np.row_stack = np.vstack
    # numba would synchronise PyTorch's stream each time a kernel takes a tensor; both run on the legacy default
    # stream, which orders their work already, and a host sync per call would add launch gaps to the timings
    os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "use --plan (bench_attention) or --dry-run (gpt_speed) to see what it would run")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.cuda.init()
    torch.empty(1, device="cuda")  # create PyTorch's context before numba looks for one
    allocator = "numba"
    if use_torch_allocator:
        from benchmarks.harness import torch_allocator
        try:
            installed = torch_allocator.install()
        except Exception as exc:  # measure anyway, without kernels_gpu's peak memory
            installed, why = False, repr(exc)
        else:
            why = "numba's context existed before the plugin was installed"
        if installed:
            allocator = "torch"
        else:
            print(f"warning: numba allocations not routed through PyTorch ({why}); "
                  "kernels_gpu peak memory will not be recorded", file=sys.stderr)
    return TorchDevice(), allocator


def package_versions(names=("torch", "numba", "numba-cuda", "numpy", "llvmlite", "cuda-bindings", "fa2edu")):
    """Installed versions of ``names`` (None for a missing package)."""
    from importlib import metadata
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# ---------------------------------------------------------------------------------------------- a run's record

def add_run_arguments(p, *, name: str, target_ms: float) -> None:
    """The command-line arguments :func:`start_run` reads, with the fast-kernel drivers' defaults."""
    p.add_argument("--tokens", type=int, default=16384, help="batch × N (FA2 paper: 16k)")
    p.add_argument("--hidden", type=int, default=2048, help="heads × d (FA2 paper: 2048)")
    p.add_argument("--target-ms", type=float, default=target_ms, help="timed work per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=name, help=f"results file fast_<name>.json (default fast_{name}.json)")
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/<device>/fast_<name>.json)")


def start_run(args, **settings):
    """What every fast-kernel driver starts with: the CUDA device (:func:`cuda_setup`), the protocol, the results
    header (device, date, package versions, allocator, settings: ``args.tokens``, ``args.hidden``, the protocol,
    ``settings``, the command line) and an empty record list. Returns ``(run, out_path)``: ``run`` as
    :func:`measure_and_record` takes it, ``out_path`` ``args.out`` or ``results/<device>/fast_<args.name>.json``."""
    from benchmarks.harness.results_io import default_results_path, utc_now

    device, allocator = cuda_setup()
    import torch
    device_name = torch.cuda.get_device_name()
    out_path = args.out or str(default_results_path(device_name, f"fast_{args.name}"))
    protocol = Protocol(target_ms=args.target_ms, max_repeats=30)
    header = {"device": device_name, "date": utc_now(), "versions": package_versions(), "numba_allocator": allocator,
              "settings": {"tokens": args.tokens, "hidden": args.hidden, "protocol": protocol.as_dict(), **settings,
                           "command": " ".join(sys.argv)}, "resources": {}}
    run = dict(device=device, protocol=protocol, allocator=allocator, header=header, records=[],
               device_name=device_name, seed=args.seed)
    return run, out_path


def measure_and_record(run, label, spec, fast, pass_, check, flops, config, resources):
    """Time one implementation at one configuration and append its record to ``run["records"]``, printing a line.

    ``run`` holds the run's ``device``, ``protocol``, ``allocator``, ``header``, ``records``, ``device_name`` and
    ``seed``; ``config`` is ``(batch, heads, N, d, causal, scale)``; ``fast`` (a fast kernel's identity, or None)
    with ``resources(fast, d)`` adds that kernel's resource report to the header once per (label, d).
    """
    from benchmarks.harness import impls
    from benchmarks.harness.results_io import make_record

    batch, heads, N, d, causal, scale = config
    header, records = run["header"], run["records"]

    def make_call(k):
        x = impls.make_inputs(batch, heads, N, d, impls.config_seed(run["seed"], N, d, causal, k))
        return spec.build(pass_, x, causal, scale, {})
    t0 = time.perf_counter()
    outcome = measure(make_call, check, run["device"], run["protocol"], flops,
                      count_memory=(spec.family == "torch" or run["allocator"] == "torch"))
    if fast is not None and outcome["status"] == "ok":
        key = f"{label}/d{d}"
        if key not in header["resources"]:
            try:
                header["resources"][key] = resources(fast, d)
            except Exception as exc:  # noqa: BLE001
                header["resources"][key] = {"error": repr(exc)}
            print(f"resources {key}: {header['resources'][key]}", flush=True)
    extra = {k: v for k, v in outcome.items() if k not in ("status", "error", "ms", "tflops", "peak_mem_bytes")}
    records.append(make_record(impl=label if fast is None else f"fast_{label}", pass_=pass_, dtype=spec.dtype,
                               batch=batch, heads=heads, N=N, d=d, causal=causal, device=run["device_name"],
                               ms=outcome["ms"], tflops=outcome["tflops"], peak_mem_bytes=outcome["peak_mem_bytes"],
                               status=outcome["status"], error=outcome["error"], **extra))
    r = records[-1]
    tf = "-" if r.get("tflops") is None else f"{r['tflops']:.2f}"
    ms = "-" if r.get("ms") is None else f"{r['ms']:.3f}"
    print(f"d={d:3d} causal={int(causal)} N={N:5d} {label:22s} {r['status']:7s} {ms:>9s} ms "
          f"{tf:>7s} TFLOP/s err={outcome.get('rel_error')} ({time.perf_counter() - t0:.1f} s)"
          + ("" if outcome["status"] == "ok" else f" {outcome['error']}"), flush=True)


def results_table(records):
    """Print TFLOP/s per (d, causal, N) row, one column per implementation."""
    labels = list(dict.fromkeys(r["impl"] for r in records))
    keys = list(dict.fromkeys((r["d"], r["causal"], r["N"]) for r in records))
    print("d    causal N      " + " ".join(f"{label[:14]:>14s}" for label in labels))
    for key in keys:
        cells = []
        for label in labels:
            hit = [r for r in records if (r["d"], r["causal"], r["N"]) == key and r["impl"] == label]
            tf = hit[0].get("tflops") if hit else None
            cells.append(f"{tf:14.2f}" if tf is not None else f"{'-':>14s}")
        print(f"{key[0]:<4d} {int(key[1]):<6d} {key[2]:<6d} " + " ".join(cells))
