"""The Hopper forward ladder on the FA2 paper's grid, beside what a Hopper user gets by default, in one run.

    python -m benchmarks.hopper --out benchmarks/results/<device>/hopper_forward.json   # → _bf16.json, _fp16.json

For each (dtype, d, causal, N) of the grid (batch × N = 16k tokens, hidden 2048 → heads = 2048 / d) every
implementation — the rungs ``hopper_h1`` …, ``sdpa_default`` (``F.scaled_dot_product_attention`` with no backend
chosen: cuDNN on an H100/H200), ``sdpa_flash`` (PyTorch's FlashAttention-2) and ``tensorcore_v11`` (the fastest
mma.sync rung) — is checked against SDPA's math backend in float32 on the same inputs (relative error < 1e-2, no
NaN), then timed with CUDA events (warm-up, median of repeats, three input sets rotated). TFLOP/s use the FA2
paper's model (4·N²·d·batch·heads, halved when causal). The run also measures the wgmma ceiling: a kernel of
``wgmma m64n256k16`` from shared memory and nothing else, issued as the rungs issue theirs. Records carry ``impl``,
``pass``, ``dtype``, ``d``, ``N``, ``causal``, ``tflops``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness.results_io import make_record, utc_now, write_results
from benchmarks.tensorcore import HIDDEN, TOKENS, forward_flops, reference, sdpa_flash, time_ms

GRID_N = (1024, 2048, 4096, 8192, 16384)


def wgmma_ceiling(seconds: float = 0.5) -> dict:
    """TFLOP/s of a numba kernel doing only ``wgmma.mma_async m64n256k16`` (bf16 → f32, both operands in shared
    memory), one warpgroup per block, two blocks per SM, 8 products per commit group."""
    import numpy as np
    from numba import cuda, float32, uint32

    from kernels_gpu import ptx
    ITER, N = 512, 256
    ACC = N // 2
    mma = ptx.make_wgmma("bfloat16", N, "smem", False)
    wait = ptx.make_wgmma_wait(0, N // 2)

    @cuda.jit
    def kernel(out, seed):
        sm = cuda.shared.array(8192, uint32)
        t = cuda.threadIdx.x
        for e in range(t, 8192, 128):
            sm[e] = uint32(seed + e) & uint32(0x3F803F80)
        cuda.syncthreads()
        acc = cuda.local.array(ACC, float32)
        for k in range(ACC):
            acc[k] = float32(0.0)
        a = ptx.shared_byte_address(sm, 0)
        desc = ptx.descriptor(a, 16, 1024, 1)
        for _ in range(ITER):
            for _ in range(8):
                mma(sm, acc, desc, desc, uint32(1))
            ptx.wgmma_commit()
            wait(acc)
        total = float32(0.0)
        for k in range(ACC):
            total += acc[k]
        if total == float32(12345.0):
            out[0] = total

    import torch
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = 2 * sms
    out = cuda.device_array(1, dtype=np.float32)
    kernel[blocks, 128](out, 0)
    cuda.synchronize()
    runs, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(runs) < 3:
        t0 = time.perf_counter()
        kernel[blocks, 128](out, len(runs))
        cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    best = statistics.median(runs)
    flops = 2.0 * 64 * N * 16 * 8 * ITER * blocks
    return dict(tflops=flops / best / 1e12, ms=best * 1e3, blocks=blocks, shape="m64n256k16", group=8, iters=ITER)


def sdpa_default(q, k, v, causal):
    import torch
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main(argv=None) -> int:
    import numba
    import torch

    import kernels_gpu.runtime as rt
    from kernels_gpu import hopper, tensorcore

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--N", default=",".join(map(str, GRID_N)))
    parser.add_argument("--d", default="64,128,256")
    parser.add_argument("--rungs", default=",".join(hopper.VERSIONS))
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--all-rungs-everywhere", action="store_true",
                        help="time every rung at every point (default: every rung in bf16 non-causal, the "
                             "fastest rung everywhere)")
    args = parser.parse_args(argv)
    rt.poison_outputs = True
    rungs = args.rungs.split(",")
    impls_of = {f"hopper_{r}": (lambda f: lambda q, k, v, c: f(q, k, v, causal=c))(hopper.VERSIONS[r])
                for r in rungs}
    impls_of.update(sdpa_default=sdpa_default, sdpa_flash=sdpa_flash,
                    tensorcore_v11=lambda q, k, v, c: tensorcore.flash2_forward(q, k, v, causal=c))
    configs = []
    for dtype in args.dtypes.split(","):
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for d in (int(x) for x in args.d.split(",")):
                for N in (int(x) for x in args.N.split(",")):
                    every = args.all_rungs_everywhere or (dtype == "bfloat16" and not causal)
                    mine = [f"hopper_{r}" for r in (rungs if every else rungs[-1:])]
                    configs.append((dtype, causal, d, N, mine + ["sdpa_default", "sdpa_flash", "tensorcore_v11"]))
    header = dict(device=torch.cuda.get_device_name(0), date=utc_now(), torch=torch.__version__,
                  cudnn=torch.backends.cudnn.version(), numba=numba.__version__,
                  numba_cuda=__import__("numba_cuda").__version__, python=platform.python_version(),
                  tokens=TOKENS, hidden=HIDDEN,
                  command="python -m benchmarks.hopper " + " ".join(sys.argv[1:] if argv is None else argv))
    ceiling = wgmma_ceiling()
    print(f"wgmma ceiling: {ceiling['tflops']:.0f} TFLOP/s", flush=True)
    records = []
    bar = tqdm(total=sum(len(c[-1]) for c in configs), desc="hopper grid", file=sys.stdout)
    for dtype, causal, d, N, impls in configs:
        batch, heads = TOKENS // N, HIDDEN // d
        tdt = getattr(torch, dtype)
        inputs = [tuple(torch.randn(batch, heads, N, d, device="cuda", dtype=tdt) for _ in range(3))
                  for _ in range(3)]
        ref = reference(*inputs[0], causal)
        for impl in impls:
            fn = impls_of[impl]
            call = (lambda q, k, v, f=fn, c=causal: f(q, k, v, c))
            common = dict(impl=impl, pass_="forward", dtype=dtype, batch=batch, heads=heads, N=N, d=d,
                          causal=causal, device=header["device"])
            try:
                out = call(*inputs[0])
                out = out[0] if isinstance(out, tuple) else out
                torch.cuda.synchronize()
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                if not rel < 1e-2 or out.isnan().any():
                    rec = make_record(**common, status="wrong", error=f"relative error {rel:.3g}", rel_error=rel)
                else:
                    rt.poison_outputs = False
                    ms, reps = time_ms(call, inputs)
                    rt.poison_outputs = True
                    rec = make_record(**common, ms=ms, tflops=forward_flops(batch, heads, N, d, causal) / ms / 1e9,
                                      repeats=reps, rel_error=rel)
            except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
                rec = make_record(**common, status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
            records.append(rec)
            bar.update(1)
            bar.write(f"{dtype:8s} causal={int(causal)} d={d:3d} N={N:5d} {impl:14s} "
                      f"{rec['tflops'] or float('nan'):7.1f} TFLOP/s  {rec['status']}")
        del inputs, ref
        torch.cuda.empty_cache()
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes.split(","):        # one file per dtype (the book keys a file's records without it)
        tag = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
        path = args.out.with_name(f"{args.out.stem}_{tag}{args.out.suffix}")
        write_results(path, dict(header, wgmma_ceiling=ceiling), [r for r in records if r["dtype"] == dtype])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
