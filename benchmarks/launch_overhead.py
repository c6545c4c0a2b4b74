"""Where a short tensor-core call spends its time: host work per call against GPU time per call.

    python -m benchmarks.launch_overhead --N 1024 --d 64

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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
