"""Run tensor-core rungs once each on one shape, for Nsight Compute to profile.

    ncu --clock-control none --set full -k regex:flash2_forward_tc -c 2 \\
        python -m benchmarks.profilers.profile_tensorcore v6 v7 --N 4096 --d 128

One launch per rung (batch × N = 16k tokens, hidden 2048, as in :mod:`benchmarks.tensorcore`), so ``-c`` = the
number of rungs profiles each once. A rung is a name of ``kernels_gpu.tensorcore.VERSIONS`` or of ``TF32`` (float32
inputs: ``--dtype float32``). The report (warp stall reasons, pipe utilisation, shared-memory wavefronts)
is what a rung's header cites when a measurement misses its prediction.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    import torch

    from kernels_gpu.tensorcore import TF32, VERSIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rungs", nargs="+")
    parser.add_argument("--N", type=int, default=4096)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    batch, heads = 16384 // args.N, 2048 // args.d
    tdt = getattr(torch, args.dtype)
    Q, K, V = (torch.randn(batch, heads, args.N, args.d, device="cuda", dtype=tdt) for _ in range(3))
    for rung in args.rungs:
        (VERSIONS[rung] if rung in VERSIONS else TF32[rung])(Q, K, V, causal=args.causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
