"""One call of a fast FA2 forward version, bracketed for Nsight Compute: where does its time go?

    ncu --profile-from-start off --clock-control none --set full -o v6 \\
        python -m benchmarks.profile_fast --version v6 --d 128 --N 4096
    ncu --import v6.ncu-rep --page details --csv        # speed of light, warp stalls, pipes, occupancy
    ncu --import v6.ncu-rep --page source --csv --print-source sass   # stall samples per SASS instruction

The inputs are the benchmark's (fp32, batch × N = ``--tokens``, heads × d = ``--hidden``); the kernel is compiled
and run once before the profiled call, so only that call's launch is captured. ``--tiling NYxNXxTRxTC`` and
``--max-registers`` pick another configuration of the version (as ``benchmarks.fast_kernels`` spells them).
"""

import argparse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default="v6")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--tiling", default=None, help="NYxNXxTRxTC")
    p.add_argument("--max-registers", type=int, default=None)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    args = p.parse_args(argv)

    from numba import cuda

    from benchmarks import impls
    from kernels_gpu.fast import VERSIONS, Tiling
    forward = VERSIONS[args.version]
    options = {}
    if args.tiling:
        options["tiling"] = Tiling(*(int(v) for v in args.tiling.split("x")))
    if args.max_registers is not None:
        options["max_registers"] = args.max_registers
    x = impls.make_inputs(max(1, args.tokens // args.N), args.hidden // args.d, args.N, args.d, seed=0)
    forward(x["Q"], x["K"], x["V"], causal=args.causal, **options)      # compile and warm up: not profiled
    cuda.synchronize()
    cuda.profile_start()
    forward(x["Q"], x["K"], x["V"], causal=args.causal, **options)
    cuda.synchronize()
    cuda.profile_stop()


if __name__ == "__main__":
    main()
