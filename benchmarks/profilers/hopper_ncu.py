"""One launch of each Hopper rung at bf16, d = 128, N = 4096 (non-causal, batch 4 × 16 heads), for Nsight Compute.

    ncu --clock-control none --kernel-name regex:flash_forward_h --section SpeedOfLight --section LaunchStats \\
        --section WarpStateStats python -m benchmarks.profilers.hopper_ncu --rungs h2,h3,h4

Each rung is compiled by its first call, and that call is the one profiled: one kernel launch per rung, nothing
else on the GPU matching the kernel-name filter.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    import torch

    from kernels_gpu import hopper

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rungs", default="h2,h5,h6")
    parser.add_argument("--N", type=int, default=4096)
    parser.add_argument("--d", type=int, default=128)
    args = parser.parse_args(argv)
    batch, heads = 16384 // args.N, 2048 // args.d
    q, k, v = (torch.randn(batch, heads, args.N, args.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for rung in args.rungs.split(","):
        hopper.VERSIONS[rung](q, k, v)
        torch.cuda.synchronize()
        print(f"ran {rung}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
