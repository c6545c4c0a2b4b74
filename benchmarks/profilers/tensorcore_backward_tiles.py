"""Backward tile shapes: one tensor-core backward rung timed with each (warps, B_r), kernel by kernel, beside cuDNN.

    python -m benchmarks.profilers.tensorcore_backward_tiles --rung v4 --tiles 4x32 8x32 4x64 --d 64 128 \
        --out tiles.json

A backward rung's ``config_for`` takes ``warps`` (W: 16 keys per warp, B_c = 16·W keys per block of the key-block
kernel, 16·W queries per block of the dQ kernel) and ``B_r`` (queries per row block of the key-block kernel, keys
per tile of the dQ kernel). Each (d, tile) runs on one shape — by default the GPT benchmark's training step
(:mod:`benchmarks.gpt_speed`: batch 4, 8 heads, N = 4096, causal, bfloat16) — after checking dQ, dK, dV against
SDPA's memory-efficient backend in float32 (the harness's tolerance). Timed: the whole backward (CUDA events,
median, three rotated input sets: :func:`benchmarks.tensorcore.time_ms`), and each kernel's own GPU time from
PyTorch's profiler over ``--profiled`` calls (so a tile shape that helps one kernel and hurts the other shows it).
SDPA's cuDNN backward, the one PyTorch runs in training at this shape, is timed the same way for scale. The
tile shapes, registers (numba's report of the compiled kernels) and times go to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness.results_io import utc_now
from benchmarks.tensorcore import time_ms
from benchmarks.tensorcore_backward import TOLERANCE, reference_gradients, relative_errors


def parse_tile(text: str) -> tuple[int, int]:
    """'8x32' → (warps 8, B_r 32)."""
    try:
        warps, B_r = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--tiles: expected WARPSxB_R such as 4x32, got {text!r}") from None
    return warps, B_r


def kernel_times(torch, fn, args, calls: int) -> dict:
    """GPU ms per call of each kernel ``fn(*args)`` launches, by kernel name (PyTorch's profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    times: dict = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            times[event.key] = times.get(event.key, 0.0) + event.self_device_time_total / 1e3 / calls
    return times


def short_name(name: str) -> str:
    """A kernel's role from its mangled name: key-block, dQ, preprocess — or cuDNN's own."""
    for part, label in (("make_dq_kernel", "dq"), ("make_kernel", "key_block"), ("preprocess", "preprocess")):
        if part in name:
            return label
    return name[:60]


def cudnn_backward(torch, q, k, v, dO, causal):
    """SDPA's cuDNN attention: forward untimed, a backward callable on its graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    return lambda: torch.autograd.grad(out, leaves, dO, retain_graph=True)


def main(argv=None) -> int:
    import numba
    import torch

    import kernels_gpu.runtime as rt
    from kernels_gpu.tensorcore import flash2_forward

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rung", default="v4")
    p.add_argument("--tiles", nargs="+", default=["4x32", "8x32", "4x64", "8x64"], help="WARPSxB_R each")
    p.add_argument("--d", nargs="+", type=int, default=[64, 128])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--full", action="store_true", help="non-causal (default: causal, as the GPT trains)")
    p.add_argument("--profiled", type=int, default=5, help="calls under the profiler per tile shape")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    causal = not args.full
    rt.poison_outputs = True
    module = importlib.import_module(f"kernels_gpu.tensorcore.flash2_backward_{args.rung}")
    tiles = [parse_tile(t) for t in args.tiles]
    tdt = getattr(torch, args.dtype)
    records = []
    for d in args.d:
        shape = (args.batch, args.heads, args.N, d)
        inputs = [tuple(torch.randn(shape, device="cuda", dtype=tdt) for _ in range(4)) for _ in range(3)]
        ref = reference_gradients(*inputs[0], causal)
        states = [(q, k, v) + tuple(flash2_forward(q, k, v, causal=causal)) + (dO,) for q, k, v, dO in inputs]
        bwd = cudnn_backward(torch, *inputs[0], causal)
        ms, _ = time_ms(bwd, [()] * 3)
        kt = kernel_times(torch, bwd, (), args.profiled)
        records.append(dict(impl="sdpa_cudnn", d=d, N=args.N, ms=ms, kernels={short_name(k): v for k, v in kt.items()}))
        tqdm.write(f"d={d:3d} sdpa_cudnn {ms:8.3f} ms")
        for warps, B_r in tqdm(tiles, desc=f"d={d}", file=sys.stdout):
            rec = dict(impl=args.rung, d=d, N=args.N, warps=warps, B_r=B_r)
            try:
                cfg = module.config_for(d, args.dtype, causal, False, warps=warps, B_r=B_r)
            except ValueError as error:
                rec.update(status=f"refused: {error}")
                records.append(rec)
                continue

            def call(q, k, v, O, L, dO, w=warps, b=B_r):
                return module.flash2_backward(q, k, v, O, L, dO, causal=causal, warps=w, B_r=b)

            try:
                errors = relative_errors(call(*states[0]), ref)
            except Exception as error:  # noqa: BLE001 (too much shared memory, say: a result, not a crash)
                rec.update(status=f"{type(error).__name__}: {str(error)[:160]}")
                records.append(rec)
                tqdm.write(f"d={d:3d} W={warps} B_r={B_r}: {rec['status']}")
                continue
            rec.update(rel_errors=errors, B_c=cfg.B_c, max_registers=cfg.max_registers,
                       max_registers_dq=cfg.max_registers_dq,
                       shared_bytes=4 * module.shared_words(cfg), dq_shared_bytes=4 * module.dq_shared_words(cfg))
            for name, make in (("key_block", module.make_kernel), ("dq", module.make_dq_kernel)):
                regs = list(make(cfg).get_regs_per_thread().values())
                local = list(make(cfg).get_local_mem_per_thread().values())
                rec[f"{name}_registers"], rec[f"{name}_local_bytes"] = (regs[-1] if regs else None,
                                                                        local[-1] if local else None)
            if max(errors) < TOLERANCE:
                ms, _ = time_ms(call, states)
                kt = kernel_times(torch, call, states[0], args.profiled)
                rec.update(status="ok", ms=ms, kernels={short_name(k): v for k, v in kt.items()})
            else:
                rec["status"] = "wrong"
            records.append(rec)
            k = rec.get("kernels", {})
            tqdm.write(f"d={d:3d} W={warps} B_r={B_r:3d} {rec.get('ms', float('nan')):8.3f} ms  key-block "
                       f"{k.get('key_block', float('nan')):7.3f}  dQ {k.get('dq', float('nan')):7.3f}  regs "
                       f"{rec['key_block_registers']}/{rec['dq_registers']}  {rec['status']}")
        del inputs, states, ref
    header = dict(device=torch.cuda.get_device_name(0), date=utc_now(), torch=torch.__version__,
                  numba=numba.__version__, dtype=args.dtype, causal=causal, batch=args.batch, heads=args.heads,
                  N=args.N, rung=args.rung,
                  command="python -m benchmarks.profilers.tensorcore_backward_tiles "
                  + " ".join(sys.argv[1:] if argv is None else argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(header=header, records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
