"""One call of a tensor-core backward rung, bracketed for Nsight Compute: where do its kernels' cycles go?

    ncu --profile-from-start off --set full --import-source yes -o bwd \\
        python -m benchmarks.profilers.profile_tensorcore_backward --rung v5 --d 128
    ncu --import bwd.ncu-rep --page details                 # speed of light, pipes, warp stalls, occupancy
    ncu --import bwd.ncu-rep --page source --csv --print-source sass   # stall samples per SASS instruction

The shape defaults to the GPT benchmark's training step (:mod:`benchmarks.gpt_speed`: batch 4, 8 heads,
N = 4096, causal, bfloat16). The rung's kernels are compiled and run once before the profiled call, so only that
call's launches (preprocess, key-block kernel, dQ kernel) are captured. ``--warps`` and ``--B-r`` pick another tile
shape of the rung (as :mod:`benchmarks.profilers.tensorcore_backward_tiles` spells them).
"""

from __future__ import annotations

import argparse
import importlib


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rung", default="v5", help="a key of kernels_gpu.tensorcore.BACKWARD_VERSIONS")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--full", action="store_true", help="non-causal (default: causal, as the GPT trains)")
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--B-r", dest="B_r", type=int, default=None)
    args = p.parse_args(argv)

    import torch
    from numba import cuda

    from kernels_gpu.tensorcore import flash2_forward
    module = importlib.import_module(f"kernels_gpu.tensorcore.flash2_backward_{args.rung}")
    tile = {k: v for k, v in (("warps", args.warps), ("B_r", args.B_r)) if v is not None}
    causal = not args.full
    shape = (args.batch, args.heads, args.N, args.d)
    torch.manual_seed(0)
    q, k, v, dO = (torch.randn(shape, device="cuda", dtype=getattr(torch, args.dtype)) for _ in range(4))
    O, L = flash2_forward(q, k, v, causal=causal)
    module.flash2_backward(q, k, v, O, L, dO, causal=causal, **tile)     # compile and warm up: not profiled
    torch.cuda.synchronize()
    cuda.profile_start()
    module.flash2_backward(q, k, v, O, L, dO, causal=causal, **tile)
    torch.cuda.synchronize()
    cuda.profile_stop()


if __name__ == "__main__":
    main()
