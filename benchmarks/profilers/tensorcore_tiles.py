"""Tile shapes per head dimension: one tensor-core rung timed with each K/V tile width B_c, beside SDPA flash.

    python -m benchmarks.profilers.tensorcore_tiles --rung v9 --B_c 32,64 --d 64,128 --out tiles.json

A rung's ``config_for`` takes ``B_c``; this times every (d, B_c) on the harness's grid (batch × N = 16k tokens,
hidden 2048, fp16 unless told) with the harness's method (:func:`benchmarks.tensorcore.time_ms`: CUDA events,
median, three rotated input sets) after checking each output against SDPA's math backend in float32. The tile
width trades registers (the S accumulators: 4·B_c/8 per row tile and lane) against per-tile overhead, and the
registers decide how many blocks share an SM: the report carries ptxas's count from the compiled kernel.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness.results_io import utc_now
from benchmarks.tensorcore import HIDDEN, TOKENS, forward_flops, reference, sdpa_flash, time_ms


def main(argv=None) -> int:
    import numba
    import torch

    import kernels_gpu.runtime as rt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rung", default="v9")
    parser.add_argument("--B_c", default="32,64")
    parser.add_argument("--d", default="64,128")
    parser.add_argument("--N", default="4096,16384")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rt.poison_outputs = True
    module = importlib.import_module(f"kernels_gpu.tensorcore.flash2_forward_{args.rung}")
    tdt = getattr(torch, args.dtype)
    points = [(d, N, B_c) for d in map(int, args.d.split(",")) for N in map(int, args.N.split(","))
              for B_c in [None] + [int(b) for b in args.B_c.split(",")]]
    records = []
    for d, N, B_c in tqdm(points, desc=f"{args.rung} tiles", file=sys.stdout):
        batch, heads = TOKENS // N, HIDDEN // d
        inputs = [tuple(torch.randn(batch, heads, N, d, device="cuda", dtype=tdt) for _ in range(3))
                  for _ in range(3)]
        ref = reference(*inputs[0], args.causal)
        if B_c is None:
            fn = lambda q, k, v: sdpa_flash(q, k, v, args.causal)  # noqa: E731
        else:
            fn = lambda q, k, v, b=B_c: module.flash2_forward(q, k, v, causal=args.causal, B_c=b)  # noqa: E731
        out = fn(*inputs[0])
        out = out[0] if isinstance(out, tuple) else out
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        rec = dict(impl="sdpa_flash" if B_c is None else args.rung, B_c=B_c, d=d, N=N, rel_error=rel)
        if B_c is not None:
            kernel = module.make_kernel(module.config_for(d, args.dtype, args.causal, False, B_c=B_c))
            regs = [getattr(k, "regs_per_thread", None) for k in getattr(kernel, "overloads", {}).values()]
            if not regs:
                regs = [kernel.get_regs_per_thread()] if hasattr(kernel, "get_regs_per_thread") else []
            rec["registers"] = regs[0] if regs else None
        if rel < 1e-2 and not out.isnan().any():
            ms, reps = time_ms(fn, inputs)
            rec.update(status="ok", ms=ms, tflops=forward_flops(batch, heads, N, d, args.causal) / ms / 1e9)
        else:
            rec["status"] = "wrong"
        records.append(rec)
        tqdm.write(f"d={d:3d} N={N:5d} {rec['impl']:10s} B_c={B_c} {rec.get('tflops', float('nan')):7.1f} TFLOP/s "
                   f"regs={rec.get('registers')} {rec['status']}")
        del inputs, ref
    header = dict(device=torch.cuda.get_device_name(0), date=utc_now(), torch=torch.__version__,
                  numba=numba.__version__, dtype=args.dtype, causal=args.causal,
                  command="python -m benchmarks.profilers.tensorcore_tiles "
                  + " ".join(sys.argv[1:] if argv is None else argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(header=header, records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
