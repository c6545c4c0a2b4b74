"""Where a short tensor-core call spends its time: host work per call against GPU time per call.

    python -m benchmarks.profilers.launch_overhead --N 1024 --d 64

Times ``kernels_gpu.tensorcore.flash2_forward`` and SDPA flash three ways on one shape (batch × N = 16k tokens,
hidden 2048): the host time of a call (``perf_counter`` around a call that does not wait for the GPU), one call
between two CUDA events (what the harness reports: host work the GPU waits for is included), and 20 calls queued
between two events (the GPU never waits: per-call kernel time). The gap between the last two is the host-side
cost a single call pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv=None) -> int:
    import torch

    from benchmarks.tensorcore import HIDDEN, TOKENS, forward_flops, sdpa_flash
    from kernels_gpu import tensorcore

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--out")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also profile CALLS tensor-core calls on the host (cProfile, the 25 costliest "
                             "functions by own time) at the first N and d")
    args = parser.parse_args(argv)
    if args.profile:
        profile_host(args.N[0], args.d[0], args.profile)
        breakdown(args.N[0], args.d[0])
    rows = []
    for d in args.d:
        for N in args.N:
            batch, heads = TOKENS // N, HIDDEN // d
            q, k, v = (torch.randn(batch, heads, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
            for name, fn in (("tensorcore", lambda q=q, k=k, v=v: tensorcore.flash2_forward(q, k, v)),
                             ("sdpa_flash", lambda q=q, k=k, v=v: sdpa_flash(q, k, v, False))):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                host = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    fn()
                    host.append(time.perf_counter() - t0)
                    torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                single = []
                for _ in range(10):
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    single.append(start.elapsed_time(end))
                start.record()
                for _ in range(20):
                    fn()
                end.record()
                end.synchronize()
                queued = start.elapsed_time(end) / 20
                flops = forward_flops(batch, heads, N, d, False)
                row = dict(impl=name, d=d, N=N, host_us=1e6 * statistics.median(host),
                           single_ms=statistics.median(single), queued_ms=queued,
                           tflops_single=flops / statistics.median(single) / 1e9, tflops_queued=flops / queued / 1e9)
                rows.append(row)
                print(f"{name:10s} d={d:3d} N={N:5d} host {row['host_us']:7.1f} us  one call "
                      f"{row['single_ms']:.3f} ms ({row['tflops_single']:.0f} TFLOP/s)  queued {queued:.3f} ms "
                      f"({row['tflops_queued']:.0f} TFLOP/s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)
    return 0


def profile_host(N: int, d: int, calls: int) -> None:
    """Where a tensor-core call's host time goes: cProfile over ``calls`` calls (after warm-up), sorted by own
    time, printed."""
    import cProfile
    import pstats

    import torch

    from benchmarks.tensorcore import HIDDEN, TOKENS
    from kernels_gpu import tensorcore
    batch, heads = TOKENS // N, HIDDEN // d
    q, k, v = (torch.randn(batch, heads, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        tensorcore.flash2_forward(q, k, v)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        tensorcore.flash2_forward(q, k, v)
    profiler.disable()
    torch.cuda.synchronize()
    print(f"host profile of {calls} calls, d = {d}, N = {N}:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def breakdown(N: int, d: int, calls: int = 200) -> dict:
    """Host microseconds per call of each stage of a tensor-core call (no profiler: perf_counter over ``calls``
    repetitions of each stage alone), printed and returned."""
    import numpy as np
    import torch

    from benchmarks.tensorcore import HIDDEN, TOKENS
    from kernels_gpu import driver_launch, tensorcore
    from kernels_gpu.tensorcore import flash2_forward_v11 as v11
    from kernels_gpu.tensorcore import launch

    batch, heads = TOKENS // N, HIDDEN // d
    q, k, v = (torch.randn(batch, heads, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
    tensorcore.flash2_forward(q, k, v)
    torch.cuda.synchronize()
    p = launch.prepare(q, k, v, causal=False, scale=None)
    cfg = v11.config_for(p.d, p.dtype, p.causal, False)
    kernel = v11.make_kernel(cfg)
    kargs = (p.Q, p.K, p.V, p.O, p.L, np.int32(p.N_q), np.int32(p.N_k), np.int32(1), np.float32(p.scale))
    grid = v11.longest_first(cfg, p) if hasattr(v11, "longest_first") else launch.row_block_major(cfg, p)
    nbytes = 4 * v11.shared_words(cfg)
    cufunc, _ = driver_launch._compiled(kernel, driver_launch._argument_types(kargs))
    params = [x for a in kargs for x in (a.params() if hasattr(a, "params") else [a])]
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from numba.cuda.cudadrv.driver import ExperimentalStream
    stream = ExperimentalStream.from_handle(p.stream)
    config = LaunchConfig(grid=grid, block=(cfg.threads, 1, 1), shmem_size=nbytes)
    stages = {
        "torch.empty x2": lambda: (torch.empty_like(q), torch.empty((batch, heads, N), device="cuda")),
        "current_stream": lambda: torch.cuda.current_stream(q.device).cuda_stream,
        "prepare (checks, outputs, views)": lambda: launch.prepare(q, k, v, causal=False, scale=None),
        "config_for + make_kernel": lambda: v11.make_kernel(v11.config_for(p.d, p.dtype, p.causal, False)),
        "argument types (memoised)": lambda: driver_launch._argument_types(kargs),
        "cuda.core launch only": lambda: core_launch(stream, config, cufunc.kernel, *params),
        "driver_launch.launch": lambda: driver_launch.launch(kernel, grid, cfg.threads, p.stream, kargs, nbytes),
        "finish": lambda: launch.finish(p),
        "whole call": lambda: tensorcore.flash2_forward(q, k, v),
    }
    out = {}
    for name, fn in stages.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = 1e6 * (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        print(f"  {name:34s} {out[name]:8.1f} us per call", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
