"""The tensor-core backward ladder on the FA2 paper's grid, beside PyTorch's FlashAttention-2 backward (SDPA flash).

    python -m benchmarks.tensorcore_backward --out benchmarks/results/<device>/tensorcore_backward.json

For each (dtype, d, causal, N) of the grid (batch × N = 16k tokens, hidden 2048 → heads = 2048 / d, H_q = H_kv),
every implementation's backward is timed on the same inputs Q, K, V, dO:

* ``v1``, ``v2``, … (``kernels_gpu.tensorcore.BACKWARD_VERSIONS``): ``flash2_backward(Q, K, V, O, L, dO)``, with
  O, L from ``kernels_gpu.tensorcore.flash2_forward`` computed once, untimed. The timed call is the whole
  backward: the preprocessing launch (D, L·log₂e, dQ zeroed), the main kernel and dQ's conversion, and the host
  work of the call.
* ``hopper_b1``, … (``kernels_gpu.hopper.BACKWARD_VERSIONS``, sm_90 only): the same call on the Hopper rungs.
* ``sdpa_flash``: PyTorch's ``scaled_dot_product_attention`` with the flash backend; its forward runs once per
  input set, untimed, and the timed call is ``torch.autograd.grad(out, (q, k, v), dO, retain_graph=True)``.
  ``sdpa_default``: the same with no backend chosen (cuDNN's on an H100/H200).

    python -m benchmarks.tensorcore_backward --impls hopper_b1,v7,sdpa_default,sdpa_flash --out …   # on Hopper

Before timing, each implementation's dQ, dK, dV are checked against SDPA's memory-efficient backend in float32 on
the same inputs (relative error in the Frobenius norm below 2e-2 for each gradient, no NaN; a wrong result is
recorded, not timed). Times: CUDA events after a warm-up, median of repeats, three input sets rotated so that L2
does not flatter (``benchmarks.tensorcore.time_ms``). TFLOP/s by the FA2 paper's model
(``benchmarks.harness.flop_model``): backward = 2.5 × forward = 10·N²·d·batch·heads, halved when causal. The JSON holds
the device, versions, date, the command, and every record (with the compiled kernels' registers and local memory where
numba reports them).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

GRID_N = (1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HIDDEN = 2048
#: relative error (Frobenius norm) of each gradient against the float32 reference below which a result is timed
TOLERANCE = 2e-2


def sdpa_flash_state(q, k, v, causal, backend="flash"):
    """SDPA's forward (untimed) with the flash backend (``backend="default"``: none chosen), on leaf copies of q, k,
    v that require gradients: (out, (q, k, v))."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    chosen = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if backend == "flash" else contextlib.nullcontext()
    with chosen:
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    return out, leaves


def reference_gradients(q, k, v, dO, causal):
    """dQ, dK, dV from SDPA's memory-efficient backend in float32 (O(N) memory, so every N of the grid fits)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = tuple(x.detach().float().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    return torch.autograd.grad(out, leaves, dO.float())


def relative_errors(grads, ref) -> list:
    """‖g − g_ref‖ / ‖g_ref‖ for dQ, dK, dV (NaN when g has a NaN)."""
    return [((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, ref)]


def _resources(version, d, dtype, causal) -> dict:
    """Registers and local memory per thread of a rung's compiled main kernel (what numba reports), if compiled."""
    import importlib
    try:
        name = (f"kernels_gpu.hopper.flash_backward_{version[len('hopper_'):]}" if version.startswith("hopper_")
                else f"kernels_gpu.tensorcore.flash2_backward_{version}")
        module = importlib.import_module(name)
        cfg = module.config_for(d, dtype, causal, False)
        kernel = module.make_kernel(cfg)
        regs = list(kernel.get_regs_per_thread().values())
        local = list(kernel.get_local_mem_per_thread().values())
        return dict(registers=regs[-1] if regs else None, local_bytes=local[-1] if local else None,
                    B_r=cfg.B_r, B_c=cfg.B_c, chunks=cfg.chunks, max_registers=cfg.max_registers,
                    shared_bytes=4 * module.shared_words(cfg))
    except Exception as error:  # noqa: BLE001 (a report, not a requirement)
        return dict(resources_error=f"{type(error).__name__}: {str(error)[:200]}")


def parse_args(argv=None):
    from kernels_gpu.tensorcore import BACKWARD_VERSIONS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the results file (JSON)")
    parser.add_argument("--N", default=",".join(map(str, GRID_N)), help="sequence lengths (batch = 16384 / N)")
    parser.add_argument("--d", default="64,128", help="head dimensions (heads = 2048 / d)")
    parser.add_argument("--impls", default=",".join(sorted(BACKWARD_VERSIONS)) + ",sdpa_flash",
                        help="backward rungs (v1, v2, …, hopper_b1, …), sdpa_flash, sdpa_default")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--causal", default="0,1", help="0 (non-causal), 1 (causal) or both")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numba
    import torch
    from tqdm import tqdm

    import kernels_gpu.runtime as rt
    from benchmarks.harness.flop_model import model_flops, tflops
    from benchmarks.harness.results_io import utc_now
    from benchmarks.tensorcore import time_ms
    from kernels_gpu import hopper
    from kernels_gpu.tensorcore import BACKWARD_VERSIONS, flash2_forward

    rungs = dict(BACKWARD_VERSIONS, **{f"hopper_{k}": f for k, f in hopper.BACKWARD_VERSIONS.items()})
    impls = args.impls.split(",")
    unknown = [x for x in impls if x not in ("sdpa_flash", "sdpa_default") and x not in rungs]
    if unknown:
        raise SystemExit(f"unknown implementations {unknown}: {sorted(rungs)}, sdpa_flash or sdpa_default")
    configs = [(dtype, bool(int(c)), int(d), int(N)) for dtype in args.dtypes.split(",")
               for c in args.causal.split(",") for d in args.d.split(",") for N in args.N.split(",")]
    header = dict(device=torch.cuda.get_device_name(0), date=utc_now(), torch=torch.__version__,
                  numba=numba.__version__, numba_cuda=__import__("numba_cuda").__version__,
                  python=platform.python_version(), tokens=TOKENS, hidden=HIDDEN, tolerance=TOLERANCE,
                  flop_model="backward = 2.5 x forward (FA2 Section 4.1), halved when causal",
                  command="python -m benchmarks.tensorcore_backward " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv))
    records = []
    bar = tqdm(total=len(configs) * len(impls), desc="tensor-core backward grid", file=sys.stdout)
    for dtype, causal, d, N in configs:
        batch, heads = TOKENS // N, HIDDEN // d
        tdt = getattr(torch, dtype)
        inputs = [tuple(torch.randn(batch, heads, N, d, device="cuda", dtype=tdt) for _ in range(4))
                  for _ in range(3)]                                   # (Q, K, V, dO) × 3 sets
        ref = reference_gradients(*inputs[0], causal)
        flops = model_flops(batch, heads, N, d, causal, pass_="backward")
        for impl in impls:
            rec = dict(impl=impl, pass_="backward", dtype=dtype, causal=causal, d=d, N=N, batch=batch, heads=heads)
            try:
                if impl.startswith("sdpa_"):
                    states = [sdpa_flash_state(q, k, v, causal, impl[len("sdpa_"):]) + (dO,)
                              for q, k, v, dO in inputs]

                    def call(out, leaves, dO):
                        return torch.autograd.grad(out, leaves, dO, retain_graph=True)
                else:
                    backward = rungs[impl]
                    states = [(q, k, v) + tuple(flash2_forward(q, k, v, causal=causal)) + (dO,)
                              for q, k, v, dO in inputs]

                    def call(q, k, v, O, L, dO, backward=backward, causal=causal):
                        return backward(q, k, v, O, L, dO, causal=causal)
                rt.poison_outputs = True          # the checked call writes every gradient element or is caught
                grads = call(*states[0])
                torch.cuda.synchronize()
                rt.poison_outputs = False         # (the timed calls do not pay for the poisoning fill)
                errs = relative_errors(grads, ref)
                rec["rel_error"] = dict(zip(("dQ", "dK", "dV"), errs))
                if not all(e < TOLERANCE for e in errs):          # (a NaN fails the test too)
                    rec["status"] = "wrong"
                else:
                    ms, reps = time_ms(call, states, queued=True)      # the GPU's time (calls back to back)
                    serial_ms, _ = time_ms(call, states)                # from an idle GPU: the host's cost in it
                    rec.update(status="ok", ms=ms, serial_ms=serial_ms, repeats=reps, tflops=tflops(flops, ms))
                if not impl.startswith("sdpa_"):
                    rec.update(_resources(impl, d, dtype, causal))
                del states, grads
            except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
                rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
            records.append(rec)
            bar.update(1)
            bar.write(f"{dtype:8s} causal={int(causal)} d={d:3d} N={N:5d} {impl:10s} "
                      f"{rec.get('tflops') or float('nan'):7.1f} TFLOP/s  {rec['status']}")
        del inputs, ref
        torch.cuda.empty_cache()
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(header=header, records=records), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
