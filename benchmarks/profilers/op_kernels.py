"""The PyTorch op's forward + backward taken apart kernel by kernel, beside SDPA's, with PyTorch's profiler.

    python -m benchmarks.profilers.op_kernels --dtype float32 --out benchmarks/results/<device>/op_kernels_float32.json

For each head dimension and mask, on the inputs of :mod:`benchmarks.gpt_speed`'s op-alone rows (batch × N = 16k
tokens, heads × d = 2048, N = 2048): ``fa2edu.torch.flash_attention`` and SDPA (restricted to the backend those rows
compare against: memory-efficient for float32, flash for float16/bfloat16) each run ``--warmup`` forward + backward
calls, then ``--calls`` more under the profiler. Recorded per implementation: every CUDA kernel's own GPU time per
call and launches per call, and their sum. Where the op-alone ratio of ``gpt_speed.json`` says *how much* slower
the op is, this says *which kernels* make the difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness.results_io import utc_now

#: SDPA's backend per dtype, as in benchmarks.gpt_speed's op-alone rows
BACKEND = {"float32": "EFFICIENT_ATTENTION", "float16": "FLASH_ATTENTION", "bfloat16": "FLASH_ATTENTION"}


def kernel_table(torch, call, calls: int) -> list[dict]:
    """``call()`` run ``calls`` times under the profiler: one row per CUDA kernel (name, ms and launches per
    call), slowest first."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    rows = [dict(kernel=e.key, ms=e.self_device_time_total / 1e3 / calls, launches=e.count / calls)
            for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["ms"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=sorted(BACKEND))
    p.add_argument("--d", default="128,64", help="head dimensions (heads = --hidden / d)")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--N", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384, help="batch × N")
    p.add_argument("--hidden", type=int, default=2048, help="heads × d")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    import torch

    from benchmarks.gpt_speed import op_call
    records = []
    for d in (int(x) for x in args.d.split(",")):
        batch, heads = max(1, args.tokens // args.N), args.hidden // d
        for causal in (bool(int(x)) for x in args.causal.split(",")):
            g = torch.Generator(device="cuda").manual_seed(d)
            q, k, v, dO = (torch.randn(batch, heads, args.N, d, generator=g, device="cuda",
                                       dtype=getattr(torch, args.dtype)) for _ in range(4))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            for impl in ("fa2edu", "sdpa"):
                call = op_call(impl, q, k, v, dO, causal, BACKEND[args.dtype])
                for _ in range(args.warmup):
                    call()
                rows = kernel_table(torch, call, args.calls)
                total = sum(r["ms"] for r in rows)
                records.append(dict(impl=impl, d=d, causal=causal, batch=batch, heads=heads, N=args.N,
                                    total_ms=total, kernels=rows))
                print(f"== d={d} causal={int(causal)} {impl}: {total:.3f} ms of GPU time per call", flush=True)
                for r in rows:
                    print(f"   {r['ms']:8.3f} ms  x{r['launches']:<4g} {r['kernel'][:100]}", flush=True)
            del q, k, v, dO
    header = dict(device=torch.cuda.get_device_name(0), date=utc_now(), torch=torch.__version__,
                  dtype=args.dtype, sdpa_backend=BACKEND[args.dtype], calls=args.calls,
                  command="python -m benchmarks.profilers.op_kernels "
                  + " ".join(sys.argv[1:] if argv is None else argv))
    args.out.write_text(json.dumps(dict(header=header, records=records), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
