"""The Hopper forward ladder on the FA2 paper's grid, beside what a Hopper user gets by default, in one run.

    python -m benchmarks.hopper --out benchmarks/results/<device>/hopper_forward.json   # → _bf16.json, _fp16.json

For each (dtype, d, causal, N) of the grid (batch × N = 16k tokens, hidden 2048 → heads = 2048 / d) every
implementation — the rungs ``hopper_h1`` …, ``sdpa_default`` (``F.scaled_dot_product_attention`` with no backend
chosen: cuDNN on an H100/H200), ``sdpa_flash`` (PyTorch's FlashAttention-2) and ``tensorcore_v11`` (the fastest
mma.sync rung) — is checked against SDPA's math backend in float32 on the same inputs (relative error < 1e-2, no
NaN), then timed with CUDA events (warm-up, median of repeats, three input sets rotated) twice: ``ms`` with the
timed calls queued back to back (the GPU's time, as a training loop sees it: the host launches ahead), and
``serial_ms`` with the host waiting for each call (from an idle GPU: the host's checks and launch included — where
it exceeds ``ms`` by much, small problems are launch-bound). TFLOP/s come from ``ms`` and use the FA2
paper's model (4·N²·d·batch·heads, halved when causal). The run also measures the wgmma ceiling: a kernel of
``wgmma m64n256k16`` from shared memory and nothing else, issued as the rungs issue theirs. Records carry ``impl``,
``pass``, ``dtype``, ``d``, ``N``, ``causal``, ``tflops``.

**FP8** (issue 40; ``--fp8``, its own file ``<out>_fp8.json``)::

    python -m benchmarks.hopper --fp8 --out benchmarks/results/<device>/hopper_forward.json   # → _fp8.json

times ``hopper_fp8`` (:func:`kernels_gpu.hopper.flash_forward_fp8` on e4m3 inputs quantised by
``fa2edu.torch.quantize_fp8``, incoherent) beside ``hopper_bf16`` (fa2edu's fastest bf16 Hopper forward) and
``sdpa_default`` in bf16 at d = 128 and 256, N = 4096 … 16384 (the same grid rule and FLOP model; FP8 checked
against the float32 reference of the bf16 inputs it was quantised from, relative error < 0.1). Then the error
study: on inputs with outlier channels (:func:`fa2edu.fp8.outlier_inputs`), the kernel's error against the
float64 oracle for plain (per-head) and incoherent FP8, beside fa2edu.fp8's NumPy prediction on the same codes
(:func:`fa2edu.fp8.fp8_error_study`, which also gives block scaling — the kernel takes per-(batch, head) descales
only, so block scaling is NumPy's number alone). The summary holds the study and the issue's three targets.
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


#: the FP8 grid's defaults (issue 40's targets: d = 128 and 256, N ≥ 4096)
FP8_N, FP8_D = (4096, 8192, 16384), (128, 256)
#: the methods of the error study the kernel can run (per-(batch, head) descales): name → incoherent
FP8_KERNEL_METHODS = {"per_head": False, "incoherent": True}


def fp8_error_study(attend, N: int = 1024, d: int = 128, outlier_channels: int = 4, outlier_scale: float = 100.0,
                    seeds=(0, 1, 2), block: int = 128, causal: bool = False) -> dict:
    """The error of FP8 attention on outlier inputs, measured by ``attend`` and predicted by fa2edu.fp8, per method.

    ``attend(Q8, K8, V8, causal) -> O`` (NumPy, float) runs one FP8 attention on :class:`fa2edu.fp8.Fp8Tensor` s
    (per-(batch, head) scales): on the GPU the kernel, in the CPU tests fa2edu.fp8's own emulation. For each seed the
    inputs are :func:`fa2edu.fp8.outlier_inputs` and the codes those of :func:`fa2edu.fp8.quantize_fp8` (seeded
    rotation for ``incoherent``), so the measured and the predicted errors are of the same codes; the prediction is
    :func:`fa2edu.fp8.fp8_error_study` (which also measures ``block`` and ``block_incoherent``, NumPy only).
    Returns {"settings", "methods": {name: {rmse_measured, max_measured, rmse_predicted, max_predicted,
    measured_over_predicted}}, "incoherent_over_per_head": {"measured", "predicted"}}; cost: one oracle, two
    kernel runs and four NumPy FP8 attentions per seed (N²d each)."""
    import numpy as np

    from fa2edu import attention_reference, fp8
    predicted = fp8.fp8_error_study(N=N, d=d, outlier_channels=outlier_channels, outlier_scale=outlier_scale,
                                    seeds=seeds, block=block, causal=causal)
    measured = {name: ([], []) for name in FP8_KERNEL_METHODS}
    for seed in seeds:
        q, k, v = fp8.outlier_inputs(N, d, outlier_channels, outlier_scale, seed)
        O_ref = attention_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                    causal=causal).O
        for name, incoherent in FP8_KERNEL_METHODS.items():
            Q8, K8 = (fp8.quantize_fp8(x[None, None], incoherent=incoherent, seed=seed) for x in (q, k))
            V8 = fp8.quantize_fp8(v[None, None])
            err = np.asarray(attend(Q8, K8, V8, causal), dtype=np.float64).reshape(N, d) - O_ref
            measured[name][0].append(float(np.sqrt(np.mean(err ** 2))))
            measured[name][1].append(float(np.max(np.abs(err))))
    methods = {}
    for name in predicted.rmse:
        entry = dict(rmse_predicted=predicted.mean_rmse(name), max_predicted=float(np.max(predicted.max_error[name])))
        if name in measured:
            entry.update(rmse_measured=float(np.mean(measured[name][0])), max_measured=float(np.max(measured[name][1])))
            entry["measured_over_predicted"] = entry["rmse_measured"] / entry["rmse_predicted"]
        else:
            entry["note"] = "NumPy only: the kernel takes one descale per (batch, head)"
        methods[name] = entry
    ratio = {"predicted": methods["incoherent"]["rmse_predicted"] / methods["per_head"]["rmse_predicted"],
             "measured": methods["incoherent"]["rmse_measured"] / methods["per_head"]["rmse_measured"]}
    return dict(settings=predicted.settings | {"seeds": list(seeds)}, methods=methods, incoherent_over_per_head=ratio)


def fp8_targets(records: list, study: dict) -> dict:
    """Issue 40's targets from one run: FP8 ≥ 1.5× fa2edu's bf16 forward at every (d, N ≥ 4096, causal) timed;
    incoherent FP8's error ≤ 0.5× plain FP8's (measured); the NumPy prediction within 20 % of the measured error
    (plain and incoherent)."""
    ok = {(r["d"], r["N"], r["causal"]): r for r in records if r["impl"] == "hopper_fp8" and r["status"] == "ok"}
    speedups = []
    for r in records:
        key = (r["d"], r["N"], r["causal"])
        if r["impl"] == "hopper_bf16" and r["status"] == "ok" and key in ok and r["N"] >= 4096:
            speedups.append(dict(d=key[0], N=key[1], causal=key[2], speedup=ok[key]["tflops"] / r["tflops"]))
    ratio = study["incoherent_over_per_head"]["measured"]
    within = {m: abs(study["methods"][m]["measured_over_predicted"] - 1.0) for m in FP8_KERNEL_METHODS}
    return dict(speedup=dict(target=1.5, points=speedups, met=bool(speedups) and min(s["speedup"] for s in speedups)
                             >= 1.5),
                incoherent_error=dict(target=0.5, ratio=ratio, met=ratio <= 0.5),
                prediction=dict(target=0.2, deviation=within, met=max(within.values()) <= 0.2))


def _fp8_on_gpu(Q8, K8, V8, causal):
    """``attend`` for :func:`fp8_error_study` on the GPU: fa2edu.fp8 codes → float8 CUDA tensors → the kernel."""
    import torch

    from kernels_gpu import hopper

    def tensor(t):
        return torch.from_numpy(t.codes).cuda().view(torch.float8_e4m3fn)

    def descale(t):
        return torch.from_numpy(t.descale.astype("float32")).cuda()
    O, _ = hopper.flash_forward_fp8(tensor(Q8), tensor(K8), tensor(V8), causal=causal, descale_q=descale(Q8),
                                    descale_k=descale(K8), descale_v=descale(V8))
    return O.float().cpu().numpy()


def run_fp8(args, header) -> int:
    """The ``--fp8`` run: the FP8 speed grid beside bf16, then the error study; one results file."""
    import torch

    import kernels_gpu.runtime as rt
    from fa2edu.torch import quantize_fp8
    from kernels_gpu import hopper
    N_grid = [int(x) for x in (args.N.split(",") if args.N != ",".join(map(str, GRID_N)) else FP8_N)]
    d_grid = [int(x) for x in (args.d.split(",") if args.d != "64,128,256" else FP8_D)]
    impls = {"hopper_fp8": None, "hopper_bf16": (lambda q, k, v, c: hopper.flash_forward(q, k, v, causal=c)),
             "sdpa_default": sdpa_default}
    records = []
    for causal in (bool(int(c)) for c in args.causal.split(",")):
        for d in d_grid:
            for N in N_grid:
                batch, heads = TOKENS // N, HIDDEN // d
                inputs = [tuple(torch.randn(batch, heads, N, d, device="cuda", dtype=torch.bfloat16)
                                for _ in range(3)) for _ in range(3)]
                ref = reference(*inputs[0], causal)
                quantised = []
                for q, k, v in inputs:
                    (q8, dq), (k8, dk), (v8, dv) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v, incoherent=False)
                    quantised.append((q8, k8, v8, dq, dk, dv))
                for impl in impls:
                    common = dict(impl=impl, pass_="forward", dtype="float8_e4m3fn" if impl == "hopper_fp8" else
                                  "bfloat16", batch=batch, heads=heads, N=N, d=d, causal=causal,
                                  device=header["device"])
                    if impl == "hopper_fp8":
                        sets, bound = quantised, 0.1       # FP8's own error: a few percent of |O|
                        call = (lambda q8, k8, v8, dq, dk, dv, c=causal: hopper.flash_forward_fp8(
                            q8, k8, v8, causal=c, descale_q=dq, descale_k=dk, descale_v=dv))
                    else:
                        sets, bound = inputs, 1e-2
                        call = (lambda q, k, v, f=impls[impl], c=causal: f(q, k, v, c))
                    try:
                        out = call(*sets[0])
                        out = out[0] if isinstance(out, tuple) else out
                        torch.cuda.synchronize()
                        rel = ((out.float() - ref).norm() / ref.norm()).item()
                        if not rel < bound or out.isnan().any():
                            rec = make_record(**common, status="wrong", error=f"relative error {rel:.3g}",
                                              rel_error=rel)
                        else:
                            rt.poison_outputs = False
                            ms, reps = time_ms(call, sets, queued=True)
                            serial_ms, _ = time_ms(call, sets)
                            rt.poison_outputs = True
                            rec = make_record(**common, ms=ms, repeats=reps, rel_error=rel, serial_ms=serial_ms,
                                              tflops=forward_flops(batch, heads, N, d, causal) / ms / 1e9)
                    except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
                        rec = make_record(**common, status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
                    records.append(rec)
                    print(f"fp8 grid causal={int(causal)} d={d:3d} N={N:5d} {impl:12s} "
                          f"{rec['tflops'] or float('nan'):7.1f} TFLOP/s  {rec['status']}", flush=True)
                del inputs, quantised, ref
                torch.cuda.empty_cache()
    study = fp8_error_study(_fp8_on_gpu, N=args.fp8_study_N, d=args.fp8_study_d)
    for name, m in study["methods"].items():
        print(f"fp8 error {name:18s} predicted RMSE {m['rmse_predicted']:.3e}  measured "
              f"{m.get('rmse_measured', float('nan')):.3e}", flush=True)
    summary = dict(error_study=study, targets=fp8_targets(records, study))
    print(f"targets: {summary['targets']}", flush=True)
    path = args.out.with_name(f"{args.out.stem}_fp8{args.out.suffix}")
    write_results(path, header, records, summary)
    print(f"wrote {path}")
    return 0


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
    parser.add_argument("--fp8", action="store_true",
                        help="the FP8 run instead (issue 40): hopper_fp8 beside hopper_bf16 and sdpa_default at "
                             "d = 128, 256 and N = 4096 … 16384 (unless --d, --N say otherwise), then the error "
                             "study on outlier inputs; writes <out>_fp8.json")
    parser.add_argument("--fp8-study-N", type=int, default=1024, help="sequence length of the FP8 error study")
    parser.add_argument("--fp8-study-d", type=int, default=128, help="head dimension of the FP8 error study")
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
    if args.fp8:
        return run_fp8(args, header)
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
                    ms, reps = time_ms(call, inputs, queued=True)
                    serial_ms, _ = time_ms(call, inputs)
                    rt.poison_outputs = True
                    rec = make_record(**common, ms=ms, tflops=forward_flops(batch, heads, N, d, causal) / ms / 1e9,
                                      repeats=reps, rel_error=rel, serial_ms=serial_ms)
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
