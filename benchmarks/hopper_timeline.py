"""Which warpgroup of a Hopper block does what, when: the rungs' own clock stamps, one run on the GPU.

    python -m benchmarks.hopper_timeline --out benchmarks/results/<device>/hopper_timeline.json

Each traced rung (h2 and later: :func:`kernels_gpu.hopper.launch.run`'s ``trace``) runs once at bf16, d = 128,
N = 4096, non-causal (batch 4 × 16 heads: the benchmark grid's shape), and thread 0 of every warpgroup of the
first ``--blocks`` blocks writes a clock into T[block, warpgroup, tile, step] at the steps of
:data:`kernels_gpu.hopper.steps.TRACE_EVENTS`. Two clocks: ``%clock64`` (the SM's cycles: one block stays on one SM,
so its stamps compare) and ``%globaltimer`` (nanoseconds, shared by the SMs, but updated coarsely — the file
records its smallest nonzero step). The stamped run is also timed against an unstamped one, so that the figure's
cost is known. Output: the stamps as integer lists, per rung and clock, with the device's SM clock rate.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np

from benchmarks.harness.results_io import write_measurement


def main(argv=None) -> int:
    import numba
    import torch
    from numba import cuda

    from benchmarks.tensorcore import time_ms
    from kernels_gpu import hopper
    from kernels_gpu.hopper.steps import TRACE_EVENTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rungs", default="h2,h3,h4,h5")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--N", type=int, default=4096)
    parser.add_argument("--d", type=int, default=128)
    args = parser.parse_args(argv)
    batch, heads = 16384 // args.N, 2048 // args.d
    q, k, v = (torch.randn(batch, heads, args.N, args.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    device = cuda.get_current_device()
    versions = dict(torch=torch.__version__, numba=numba.__version__,
                    numba_cuda=__import__("numba_cuda").__version__, python=platform.python_version())
    shape = dict(dtype="bfloat16", d=args.d, N=args.N, batch=batch, heads=heads, causal=False,
                 sm_clock_khz=int(device.CLOCK_RATE), events=list(TRACE_EVENTS))
    records = []
    for rung in args.rungs.split(","):
        f = hopper.VERSIONS[rung]
        B_c = 128 if args.d <= 128 else 64
        tiles = -(-args.N // B_c)
        plain_ms, _ = time_ms(f, [(q, k, v)])
        for clock in ("clock64", "globaltimer"):
            T = cuda.to_device(np.zeros((args.blocks, 4, tiles, 5), np.uint64))
            f(q, k, v, trace=(clock, T))                 # compiles the stamped kernel
            torch.cuda.synchronize()
            traced_ms, _ = time_ms(lambda a, b, c, f=f, t=(clock, T): f(a, b, c, trace=t), [(q, k, v)])
            f(q, k, v, trace=(clock, T))
            torch.cuda.synchronize()
            stamps = T.copy_to_host().astype(np.int64)
            nonzero = stamps[stamps > 0]
            steps = np.diff(np.unique(nonzero))
            records.append(dict(impl=f"hopper_{rung}", clock=clock, ms=plain_ms, traced_ms=traced_ms,
                                smallest_step=int(steps.min()) if steps.size else None,
                                stamps=stamps.tolist()))
            print(f"{rung} {clock:11s}: {plain_ms:.3f} ms plain, {traced_ms:.3f} ms stamped, smallest clock step "
                  f"{records[-1]['smallest_step']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_measurement(str(args.out), "hopper_timeline", records, device=torch.cuda.get_device_name(0),
                      versions=versions, **shape)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
