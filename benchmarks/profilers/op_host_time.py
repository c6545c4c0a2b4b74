"""Host time of the PyTorch op, layer by layer, beside SDPA's: what a training step pays on the CPU per attention.

    python -m benchmarks.profilers.op_host_time --out benchmarks/results/<device>/op_host_time.json

On the inputs of :mod:`benchmarks.gpt_speed`'s ``d64`` bfloat16 model (batch 4, 8 heads of d = 64, causal; q, k,
v the (B, H, N, d) views of one (B, N, 3·H·d) projection, as the GPT makes them) but a short sequence, so that the
GPU never holds the host back: the host time of one call is the wall time of ``--calls`` calls queued without
waiting, divided by the calls (median of ``--repeats``). Rows, from the outside in:

    sdpa fwd / fwd+bwd          F.scaled_dot_product_attention (its flash backend), and its autograd backward
    op fwd / fwd+bwd            fa2edu.torch.flash_attention (its eager road), and its autograd backward
    op fwd+bwd via operators    the same through the registered operators (the road torch.compile takes)
    custom op fwd / bwd         torch.ops.fa2edu.flash_attention_fwd|bwd called directly (no autograd)
    op body fwd / bwd           the operators' bodies (fa2edu._torch_ops.flash_attention_fwd|bwd_impl)
    kernels fwd / bwd           kernels_gpu.tensorcore.flash2_forward|backward called directly

The differences between neighbouring rows are what each layer costs. ``--steps`` also times the GPT's training
step itself (``d64``, bfloat16 autocast, the full context): per step the host's time to queue it and the wall
time with a synchronisation after it, for SDPA and fa2edu, and prints a cProfile of fa2edu's step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness.results_io import utc_now

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # examples/ is not an installed package
    sys.path.insert(0, str(ROOT))


def host_us(call, calls: int, repeats: int, sync) -> float:
    """Median over ``repeats`` of the host's wall time per call of ``calls`` calls queued without waiting."""
    call()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(times)


def profile_text(call, calls: int, rows: int = 30) -> str:
    """cProfile of ``calls`` calls, the ``rows`` costliest functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def op_rows(torch, args) -> tuple[list[dict], str]:
    """The layer-by-layer host times (see the module docstring) and a cProfile of the op's forward + backward."""
    import torch.nn.functional as F

    import fa2edu.torch as ft
    from fa2edu import _torch_ops as ops
    from kernels_gpu import tensorcore

    B, H, N, d = args.batch, args.heads, args.N, args.d
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, N, 3 * H * d, device="cuda", dtype=dtype, generator=g)
    q, k, v = (t.view(B, N, H, d).transpose(1, 2) for t in qkv.split(H * d, dim=2))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    dO = torch.randn(B, N, H, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    scale = d ** -0.5
    O, L = torch.ops.fa2edu.flash_attention_fwd(q, k, v, True, scale, "tensorcore", None, None)

    def backward(out):
        out.backward(dO)
        for x in leaves:
            x.grad = None

    def operators():          # flash_attention with its traced road (the registered operators) forced
        road = ft._eager
        ft._eager = lambda *tensors: False
        try:
            backward(ft.flash_attention(*leaves, causal=True))
        finally:
            ft._eager = road

    calls = {
        "sdpa fwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa fwd+bwd": lambda: backward(F.scaled_dot_product_attention(*leaves, is_causal=True)),
        "op fwd": lambda: ft.flash_attention(q, k, v, causal=True),
        "op fwd+bwd": lambda: backward(ft.flash_attention(*leaves, causal=True)),
        "op fwd+bwd via operators": operators,
        "custom op fwd": lambda: torch.ops.fa2edu.flash_attention_fwd(q, k, v, True, scale, "tensorcore", None,
                                                                       None),
        "custom op bwd": lambda: torch.ops.fa2edu.flash_attention_bwd(dO, q, k, v, O, L, True, scale, "tensorcore",
                                                                       None, None),
        "op body fwd": lambda: ops.flash_attention_fwd_impl(q, k, v, True, scale, "tensorcore", None, None),
        "op body bwd": lambda: ops.flash_attention_bwd_impl(dO, q, k, v, O, L, True, scale, "tensorcore", None,
                                                            None),
        "kernels fwd": lambda: tensorcore.flash2_forward(q, k, v, causal=True, scale=scale),
        "kernels bwd": lambda: tensorcore.flash2_backward(q, k, v, O, L, dO, causal=True, scale=scale),
    }
    rows = []
    for name, call in calls.items():
        us = host_us(call, args.calls, args.repeats, torch.cuda.synchronize)
        rows.append(dict(call=name, host_us=us))
        print(f"{name:26s} {us:8.1f} us host per call", flush=True)
    # the backward runs on autograd's device thread, which cProfile does not see: here, in this thread
    with torch.autograd.set_multithreading_enabled(False):
        text = profile_text(calls["op fwd+bwd"], 200)
    torch.cuda.synchronize()
    return rows, text


def step_rows(torch, args) -> tuple[dict, str]:
    """The GPT d64 bfloat16 step, SDPA and fa2edu: host time to queue a step and wall time with a sync after it."""
    from benchmarks.gpt_speed import CONFIGS
    from benchmarks.profilers.gpt_step_profile import bf16_training
    from examples.gpt.data import CharData, generate_text

    data = CharData(generate_text(max(40_000, 20 * args.context)))
    out, text = {}, ""
    for attention in ("sdpa", "fa2edu"):
        step, batches = bf16_training(attention, data, CONFIGS["d64"], args.steps, args.context, batch=4)
        host, wall = [], []
        for i, (x, y) in enumerate(batches):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(x, y)
            queued = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            if i >= 5:
                host.append((queued - start) * 1e3)
                wall.append((done - start) * 1e3)
        out[attention] = dict(host_ms=host, wall_ms=wall, host_median_ms=statistics.median(host),
                              wall_median_ms=statistics.median(wall))
        print(f"{attention:7s} step: host {statistics.median(host):6.2f} ms to queue, wall "
              f"{statistics.median(wall):6.2f} ms with a sync (medians of {len(host)})", flush=True)
        if attention == "fa2edu":
            x, y = batches[-1]

            def synced(step=step, x=x, y=y):
                step(x, y)
                torch.cuda.synchronize()
            text = profile_text(synced, 10, 40)
    return out, text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--N", type=int, default=256, help="sequence length of the op rows (short: the host bounds)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=0, help="also time this many GPT d64 bf16 training steps (0: not)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    import torch

    from benchmarks.harness import timing
    rows, op_profile = op_rows(torch, args)
    result = dict(device=torch.cuda.get_device_name(), date=utc_now(), versions=timing.package_versions(),
                  settings=vars(args) | {"out": str(args.out)}, rows=rows)
    if args.steps:
        result["steps"], step_profile = step_rows(torch, args)
    print("\ncProfile of 200 op fwd+bwd calls (backward in this thread):\n" + op_profile)
    if args.steps:
        print("cProfile of 10 fa2edu d64 bf16 training steps (each synchronised):\n" + step_profile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
