"""The tensor-core ladder on the FA2 paper's grid, beside PyTorch's FlashAttention-2 (SDPA flash), in one run.

    python -m benchmarks.tensorcore --out benchmarks/results/<device>/tensorcore.json

For each (dtype, d, causal, N) of the grid (batch × N = 16k tokens, hidden 2048 → heads = 2048 / d), every
implementation is first checked against SDPA's math backend in float32 on the same inputs (relative error < 1e-2,
no NaN) and then timed with CUDA events: warm-up, median of repeats, three input sets rotated so L2 does not
flatter. TFLOP/s use the FA2 paper's model, 4·N²·d·batch·heads for the forward (half of it when causal). The run
also measures the mma.sync ceiling: a kernel of independent m16n8k16 MMAs and nothing else, issued from numba
exactly as the rungs issue them. The JSON holds the device, versions, date, every record and the ceiling.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.harness.results_io import utc_now

GRID_N = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HIDDEN = 2048


def forward_flops(batch: int, heads: int, N: int, d: int, causal: bool) -> float:
    """The FA2 paper's forward FLOP count: two N × N × d matrix products, halved when causal."""
    return 4.0 * N * N * d * batch * heads / (2.0 if causal else 1.0)


def time_ms(fn, inputs, target_ms=150.0, min_rep=3, max_rep=30, queued=False):
    """Median milliseconds of ``fn(*inputs[k])`` over repeats, cycling through the input sets (CUDA events).

    ``queued=False``: the host waits for each call before it launches the next, so a call's time runs from an idle
    GPU and includes what the host spends before the kernel starts (argument checks, tensor maps, the launch).
    ``queued=True``: the host launches every timed call before it waits once, so where the host is faster than
    the GPU the calls run back to back and each time is the GPU's alone — what a training loop sees. Where the
    host is slower, the queued time is the host's: the call is launch-bound.
    """
    import torch
    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*inputs[0])
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    reps = int(min(max_rep, max(min_rep, target_ms / max(first, 1e-3))))
    if queued:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for r, (s, e) in enumerate(events):
            s.record()
            fn(*inputs[r % len(inputs)])
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events), reps
    times = []
    for r in range(reps):
        args = inputs[r % len(inputs)]
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), reps


def sdpa_flash(q, k, v, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def reference(q, k, v, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)


def mma_ceiling(seconds: float = 0.5) -> dict:
    """TFLOP/s of a numba kernel that does nothing but independent ``mma.sync.m16n8k16`` (f16 → f32): 8 chains per
    warp, 8 warps per block, 16 blocks per SM."""
    from numba import cuda, float32, uint32

    from kernels_gpu import ptx
    ITER = 2048

    @cuda.jit
    def kernel(out, seed):
        a = uint32(seed + cuda.threadIdx.x)
        acc = cuda.local.array(32, float32)
        for k in range(32):
            acc[k] = float32(0.0)
        for _ in range(ITER):
            for c in range(8):
                r = ptx.mma_f16(a, a, a, a, a, a, acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3])
                acc[4 * c] = r[0]
                acc[4 * c + 1] = r[1]
                acc[4 * c + 2] = r[2]
                acc[4 * c + 3] = r[3]
        total = float32(0.0)
        for k in range(32):
            total += acc[k]
        if total == float32(12345.0):
            out[0] = total

    import torch
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, threads = 16 * sms, 256
    out = cuda.device_array(1, dtype=np.float32)
    kernel[blocks, threads](out, 0)
    cuda.synchronize()
    runs = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(runs) < 3:
        t0 = time.perf_counter()
        kernel[blocks, threads](out, len(runs))
        cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    flops = 2.0 * 16 * 8 * 16 * 8 * ITER * blocks * threads // 32
    best = statistics.median(runs)
    return dict(tflops=flops / best / 1e12, ms=best * 1e3, blocks=blocks, threads=threads, chains=8, iters=ITER)


def main(argv=None) -> int:
    import numba
    import torch

    import kernels_gpu.runtime as rt
    from kernels_gpu.tensorcore import VERSIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--N", default=",".join(map(str, GRID_N)))
    parser.add_argument("--d", default="64,128")
    parser.add_argument("--ladder", default=",".join(list(VERSIONS)),
                        help="rungs timed at every point (fp16, non-causal); the newest also causal and bf16")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--causal", default="0,1")
    args = parser.parse_args(argv)
    rt.poison_outputs = True              # the check call writes every element or is caught
    Ns = [int(x) for x in args.N.split(",")]
    ds = [int(x) for x in args.d.split(",")]
    ladder = args.ladder.split(",")
    newest = list(VERSIONS)[-1]
    configs = []
    for dtype in args.dtypes.split(","):
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for d in ds:
                for N in Ns:
                    impls = list(ladder) if (dtype == "float16" and not causal) else [newest]
                    configs.append((dtype, causal, d, N, impls + ["sdpa_flash"]))
    header = dict(device=torch.cuda.get_device_name(0), date=utc_now(), torch=torch.__version__,
                  numba=numba.__version__, numba_cuda=__import__("numba_cuda").__version__,
                  python=platform.python_version(), tokens=TOKENS, hidden=HIDDEN,
                  command="python -m benchmarks.tensorcore " + " ".join(sys.argv[1:] if argv is None else argv))
    ceiling = mma_ceiling()
    print(f"mma.sync ceiling: {ceiling['tflops']:.0f} TFLOP/s", flush=True)
    records = []
    bar = tqdm(total=sum(len(c[-1]) for c in configs), desc="tensor-core grid", file=sys.stdout)
    for dtype, causal, d, N, impls in configs:
        batch, heads = TOKENS // N, HIDDEN // d
        tdt = getattr(torch, dtype)
        inputs = [tuple(torch.randn(batch, heads, N, d, device="cuda", dtype=tdt) for _ in range(3))
                  for _ in range(3)]
        ref = reference(*inputs[0], causal)
        for impl in impls:
            fn = (lambda q, k, v, c=causal: sdpa_flash(q, k, v, c)) if impl == "sdpa_flash" else \
                (lambda q, k, v, f=VERSIONS[impl], c=causal: f(q, k, v, causal=c))
            rec = dict(impl=impl, dtype=dtype, causal=causal, d=d, N=N, batch=batch, heads=heads)
            try:
                out = fn(*inputs[0])
                out = out[0] if isinstance(out, tuple) else out
                torch.cuda.synchronize()
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                rec["rel_error"] = rel
                if not rel < 1e-2 or out.isnan().any():
                    rec["status"] = "wrong"
                else:
                    rt.poison_outputs = False     # timed calls allocate their outputs as any user's call does
                    ms, reps = time_ms(fn, inputs)
                    rt.poison_outputs = True
                    rec.update(status="ok", ms=ms, repeats=reps,
                               tflops=forward_flops(batch, heads, N, d, causal) / ms / 1e9)
            except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
                rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
            records.append(rec)
            bar.update(1)
            bar.write(f"{dtype:8s} causal={int(causal)} d={d:3d} N={N:5d} {impl:10s} "
                      f"{rec.get('tflops', float('nan')):7.1f} TFLOP/s  {rec['status']}")
        del inputs, ref
        torch.cuda.empty_cache()
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(header=header, mma_ceiling=ceiling, records=records), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
