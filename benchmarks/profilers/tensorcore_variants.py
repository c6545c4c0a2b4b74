"""FA2 Section 3.3 (split-K against split-Q) and the TF32 forward, measured on the FA2 paper's grid, in one run.

    python -m benchmarks.profilers.tensorcore_variants --out benchmarks/results/<device>/tensorcore_variants.json

**Partitioning.** For each d and N of the grid (float16, batch × N = 16k tokens, hidden 2048 → heads = 2048 / d,
non-causal unless ``--causal 0,1``), the split-K and split-Q forwards (``kernels_gpu.tensorcore.PARTITIONING``: same
tiles and copies, only the warps' partitioning differs) and SDPA flash for scale; beside each time, the shared
memory the kernel moves (:func:`kernels_gpu.tensorcore.traffic.shared_memory_traffic`: copies in, operand loads,
split-K's exchange), its rate, its bytes per FLOP and the block's shared-memory footprint.

**TF32.** For each d and N: the TF32 and 3xTF32 forwards (``kernels_gpu.tensorcore.TF32``), kernels_gpu.fast's float32
forward (v6 for d ≤ 64, v8 beyond: what ``fa2edu.distributed`` runs on CUDA float32), PyTorch SDPA's
memory-efficient backend in float32, its math backend in float32 with TF32 matmuls off (the default) and on
(``torch.backends.cuda.matmul.allow_tf32``: what the Triton tutorial's users get without knowing). The math backend
materialises S: it runs up to ``--math-max-N``. On one shape (``--error-N``) every one's error against a float64
reference on the same inputs, recorded beside the times: TF32's 10-bit mantissa costs ~1e-3, float32 ~1e-6.

Every implementation is first checked (no NaN; relative error against SDPA memory-efficient float32 below 1e-2)
and then timed with :func:`benchmarks.tensorcore.time_ms` (CUDA events, warm-up, median, three input sets rotated).
TFLOP/s use the FA2 paper's model, 4·N²·d·batch·heads (half of it when causal). The JSON holds the device,
versions, date, command, the ptxas report of each new kernel (registers, spills) where ptxas is found, and every
record.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path

from benchmarks.harness.results_io import utc_now
from benchmarks.tensorcore import GRID_N, HIDDEN, TOKENS, forward_flops, sdpa_flash, time_ms

PARTITION_IMPLS = ("split-q", "split-k", "sdpa_flash")
PRECISION_IMPLS = ("tf32", "3xtf32", "3xtf32-planes", "fast_fp32", "sdpa_mem_efficient_fp32", "sdpa_math_fp32",
                   "sdpa_math_tf32")


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """PyTorch's float32 matrix products with TF32 on or off inside the block (restored after)."""
    import torch
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def sdpa(q, k, v, causal, backend):
    """PyTorch SDPA with one backend (``"efficient"`` or ``"math"``)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    with sdpa_kernel(which):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def precision_impl(name: str, d: int, causal: bool):
    """``f(q, k, v) -> O`` (a CUDA tensor) for one implementation of the float32 comparison."""
    import torch

    from kernels_gpu.fast import VERSIONS as FAST
    from kernels_gpu.tensorcore import TF32

    if name in TF32:
        forward = TF32[name]
        return lambda q, k, v: torch.as_tensor(forward(q, k, v, causal=causal).O, device=q.device)
    if name == "fast_fp32":
        fast = FAST["v6" if d <= 64 else "v8"]
        return lambda q, k, v: torch.as_tensor(fast(q, k, v, causal=causal).O, device=q.device)
    if name == "sdpa_mem_efficient_fp32":
        return lambda q, k, v: sdpa(q, k, v, causal, "efficient")
    if name == "sdpa_math_fp32":
        def math_fp32(q, k, v):
            with tf32_matmuls(False):
                return sdpa(q, k, v, causal, "math")
        return math_fp32
    if name == "sdpa_math_tf32":
        def math_tf32(q, k, v):
            with tf32_matmuls(True):
                return sdpa(q, k, v, causal, "math")
        return math_tf32
    raise ValueError(f"unknown implementation {name!r}")


def partition_impl(name: str, causal: bool):
    """``f(q, k, v) -> O`` for split-K, split-Q (kernels_gpu.tensorcore.PARTITIONING) or SDPA flash."""
    from kernels_gpu.tensorcore import PARTITIONING
    if name == "sdpa_flash":
        return lambda q, k, v: sdpa_flash(q, k, v, causal)
    forward = PARTITIONING[name]
    return lambda q, k, v: forward(q, k, v, causal=causal)[0]


def float64_errors(impls, d: int, N: int, causal: bool, seed: int = 0) -> list:
    """Each float32 implementation's error against float64 attention on one shape (batch 1, heads = hidden / d):
    ``max |O − O_ref|`` and ``‖O − O_ref‖ / ‖O_ref‖``."""
    import torch
    heads = HIDDEN // d
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, heads, N, d, device="cuda", generator=g) for _ in range(3))
    S = (q.double() @ k.double().transpose(-1, -2)) / d ** 0.5
    if causal:
        S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool, device="cuda").tril(), -torch.inf)
    ref = torch.softmax(S, dim=-1) @ v.double()
    del S
    out = []
    for name in impls:
        rec = dict(impl=name, d=d, N=N, batch=1, heads=heads, causal=causal, dtype="float32")
        try:
            O = precision_impl(name, d, causal)(q, k, v).double()
            torch.cuda.synchronize()
            rec.update(status="ok", max_abs_error=(O - ref).abs().max().item(),
                       rel_error=((O - ref).norm() / ref.norm()).item(), max_abs_O=ref.abs().max().item())
        except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
        out.append(rec)
        print(f"float64 error d={d} N={N} {name:24s} {rec.get('max_abs_error', float('nan')):.3e} {rec['status']}",
              flush=True)
    torch.cuda.empty_cache()
    return out


def ptxas_reports(ds) -> list:
    """Registers and spills of the new kernels (``kernels_gpu.tensorcore.inspect_ptx``); empty without ptxas."""
    from kernels_gpu.tensorcore import inspect_ptx
    out = []
    for version, dtype in (("splitq", "float16"), ("splitk", "float16"), ("tf32", "float32"), ("3xtf32", "float32"),
                           ("3xtf32_planes", "float32")):
        for d in ds:
            try:
                out.append(inspect_ptx.report(version, d, dtype))
            except Exception as error:  # noqa: BLE001 (no ptxas on this machine: the run goes on)
                out.append(dict(version=version, d=d, error=f"{type(error).__name__}: {str(error)[:200]}"))
    return out


def run_grid(group: str, impls, dtype: str, ds, Ns, causals, math_max_N: int, records: list) -> None:
    """Time every implementation of ``group`` ("partitioning" or "precision") at every (causal, d, N)."""
    import torch

    from kernels_gpu.tensorcore.traffic import shared_memory_traffic
    tdt = getattr(torch, dtype)
    for causal in causals:
        for d in ds:
            for N in Ns:
                batch, heads = TOKENS // N, HIDDEN // d
                inputs = [tuple(torch.randn(batch, heads, N, d, device="cuda", dtype=tdt) for _ in range(3))
                          for _ in range(3)]
                check = sdpa(*(x.float() for x in inputs[0]), causal, "efficient")
                for name in impls:
                    rec = dict(group=group, impl=name, dtype=dtype, causal=causal, d=d, N=N, batch=batch,
                               heads=heads)
                    if name.startswith("sdpa_math") and N > math_max_N:
                        rec.update(status="skipped", error=f"the math backend materialises S: N > {math_max_N}")
                        records.append(rec)
                        continue
                    fn = partition_impl(name, causal) if group == "partitioning" else precision_impl(name, d, causal)
                    try:
                        out = fn(*inputs[0])
                        torch.cuda.synchronize()
                        rel = ((out.float() - check).norm() / check.norm()).item()
                        rec["rel_error_vs_sdpa_fp32"] = rel
                        if not rel < 1e-2 or out.isnan().any():
                            rec["status"] = "wrong"
                        else:
                            ms, reps = time_ms(fn, inputs)
                            flops = forward_flops(batch, heads, N, d, causal)
                            rec.update(status="ok", ms=ms, repeats=reps, tflops=flops / ms / 1e9)
                            if name in ("split-q", "split-k"):
                                t = shared_memory_traffic(name, N, N, d, causal=causal, batch=batch, heads=heads)
                                rec.update(shared_bytes=t["total_bytes"], shared_detail=t["total"],
                                           shared_per_tile=t["per_tile"],
                                           shared_bytes_per_block=t["shared_bytes_per_block"],
                                           shared_tb_per_s=t["total_bytes"] / ms / 1e9,
                                           shared_bytes_per_flop=t["total_bytes"] / flops)
                    except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
                        rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
                    records.append(rec)
                    extra = f"  shared {rec['shared_tb_per_s']:6.1f} TB/s" if "shared_tb_per_s" in rec else ""
                    print(f"{group:12s} {dtype:8s} causal={int(causal)} d={d:3d} N={N:5d} {name:24s} "
                          f"{rec.get('tflops', float('nan')):7.1f} TFLOP/s  {rec['status']}{extra}", flush=True)
                del inputs, check
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON results file to write")
    parser.add_argument("--N", default=",".join(map(str, GRID_N)), help="sequence lengths (batch × N = 16k tokens)")
    parser.add_argument("--d", default="64,128", help="head dimensions")
    parser.add_argument("--causal", default="0", help="0, 1 or 0,1")
    parser.add_argument("--parts", default="partitioning,precision", help="which groups to run")
    parser.add_argument("--math-max-N", type=int, default=4096, help="longest N for SDPA's math backend")
    parser.add_argument("--error-N", type=int, default=2048, help="the shape of the float64 error comparison")
    parser.add_argument("--precision-impls", default=",".join(PRECISION_IMPLS),
                        help="which implementations the precision group runs")
    args = parser.parse_args(argv)

    import numba
    import torch

    import kernels_gpu.runtime as rt
    Ns = [int(x) for x in args.N.split(",")]
    ds = [int(x) for x in args.d.split(",")]
    causals = [bool(int(c)) for c in args.causal.split(",")]
    parts = args.parts.split(",")
    header = dict(device=torch.cuda.get_device_name(0), date=utc_now(), torch=torch.__version__,
                  numba=numba.__version__, numba_cuda=__import__("numba_cuda").__version__,
                  python=platform.python_version(), tokens=TOKENS, hidden=HIDDEN,
                  torch_allow_tf32_default=torch.backends.cuda.matmul.allow_tf32,
                  command="python -m benchmarks.profilers.tensorcore_variants " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv))
    result = dict(header=header, ptxas=ptxas_reports(ds), records=[], float64_errors=[])
    rt.poison_outputs = True                 # the check call writes every element or is caught
    if "partitioning" in parts:
        run_grid("partitioning", PARTITION_IMPLS, "float16", ds, Ns, causals, args.math_max_N, result["records"])
    if "precision" in parts:
        impls = args.precision_impls.split(",")
        for d in ds:
            result["float64_errors"] += float64_errors(impls, d, args.error_N, False)
        run_grid("precision", impls, "float32", ds, Ns, causals, args.math_max_N, result["records"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
