"""Time the fast FA2 kernels (kernels_gpu.fast) against PyTorch eager fp32 and SDPA memory-efficient fp32, in one run.

    python -m benchmarks.fast_kernels                                   # v1, v2 + baselines, the paper's grid
    python -m benchmarks.fast_kernels --N 1024,8192 --d 64 --impls v2,torch_eager
    python -m benchmarks.fast_kernels --impls v2,v2@16x16x4x4           # a version with another tiling NYxNXxTRxTC

Same protocol as ``bench_attention`` (it reuses ``timing.measure``, ``impls.make_check``, the float64 reference on
the GPU, CUDA events, inputs rotated past the L2 cache, TF32 off): fp32, forward, batch × N = ``--tokens`` (16k),
heads × d = ``--hidden`` (2048). Each fast kernel's resource report (registers, local memory = spills, shared
memory) is printed and stored. Results: ``benchmarks/results/<device>/fast_<name>.json``; a table at the end.

``register()`` adds the fast versions to ``benchmarks.impls.IMPLS`` as ``fast_v1``, ``fast_v2``, … (forward only),
so ``bench_attention --impls fast_v2`` can time them once something imports this module first.
"""

import argparse
import sys
import time


def _fast_builder(version, tiling=None, max_registers=None):
    def build(pass_, x, causal, scale, options):
        from kernels_gpu.fast import VERSIONS
        forward = VERSIONS[version]
        Q, K, V = x["Q"], x["K"], x["V"]
        cap = {} if max_registers is None else {"max_registers": max_registers}   # v5+: a ptxas register cap

        def call():
            O, L = forward(Q, K, V, causal=causal, scale=scale, tiling=tiling, **cap)
            return {"O": O, "L": L}
        return call
    return build


def register():
    """Add every fast version to ``benchmarks.impls.IMPLS`` (not in the default set); returns the names added."""
    from benchmarks import impls
    from kernels_gpu.fast import VERSIONS
    names = []
    for version in VERSIONS:
        name = f"fast_{version}"
        impls.IMPLS[name] = impls.ImplSpec(name, "kernels_gpu", "float32", ("forward",), _fast_builder(version),
                                           f"kernels_gpu.fast FA2 forward {version} (register-tiled)", default=False)
        names.append(name)
    return names


def _parse_impl(name):
    """``v2``, ``v2@16x8x4x4`` or ``v5@16x8x4x4r168`` (a register cap, v5+) → (label, spec) with a fast builder;
    any other name → the harness's spec."""
    from benchmarks import impls
    from kernels_gpu.fast import VERSIONS, Tiling
    version, _, tiling = name.partition("@")
    if version in VERSIONS:
        tiling, _, cap = tiling.partition("r")
        cap = int(cap) if cap else None
        til = Tiling(*(int(v) for v in tiling.split("x"))) if tiling else None
        return name, impls.ImplSpec(name, "kernels_gpu", "float32", ("forward",), _fast_builder(version, til, cap),
                                    f"fast {version} tiling {til} cap {cap}", default=False), (version, til, cap)
    if name not in impls.IMPLS:
        raise SystemExit(f"unknown implementation {name!r}: fast versions {list(VERSIONS)} or {list(impls.IMPLS)}")
    return name, impls.IMPLS[name], None


def _resources(fast, d):
    """The resource report of the fast kernel (version, tiling) at head dimension d, after it has been compiled."""
    import importlib

    from kernels_gpu.fast import tiled
    version, til, cap = fast
    module = importlib.import_module(f"kernels_gpu.fast.flash2_forward_{version}")
    if til is None and hasattr(module, "default_max_registers"):
        cap = module.default_max_registers(d) if cap is None else cap
    til = til or module.default_tiling(d)
    if hasattr(module, "resources"):                  # v6+: the version says how its kernel is compiled
        report = module.resources(til, d, cap)
    else:
        report = tiled.resources(til, d, d, module.SHUFFLE, getattr(module, "PIPELINE", False), cap)
    report["tiling"] = list(til)
    report["max_registers"] = cap
    return report


def add_run_arguments(p, *, name: str, target_ms: float) -> None:
    """The command-line arguments :func:`start_run` reads, with the fast-kernel drivers' defaults."""
    p.add_argument("--tokens", type=int, default=16384, help="batch × N (FA2 paper: 16k)")
    p.add_argument("--hidden", type=int, default=2048, help="heads × d (FA2 paper: 2048)")
    p.add_argument("--target-ms", type=float, default=target_ms, help="timed work per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=name, help=f"results file fast_<name>.json (default fast_{name}.json)")
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/<device>/fast_<name>.json)")


def start_run(args, **settings):
    """What every fast-kernel driver starts with: the CUDA device (``bench_attention.cuda_setup``), the protocol,
    the results header (device, date, package versions, allocator, settings: ``args.tokens``, ``args.hidden``, the
    protocol, ``settings``, the command line) and an empty record list. Returns ``(run, out_path)``: ``run`` as
    :func:`measure_and_record` takes it, ``out_path`` ``args.out`` or ``results/<device>/fast_<args.name>.json``."""
    from benchmarks.bench_attention import cuda_setup, package_versions
    from benchmarks.results_io import default_results_path, utc_now
    from benchmarks.timing import Protocol

    device, allocator = cuda_setup()
    import torch
    device_name = torch.cuda.get_device_name()
    out_path = args.out or str(default_results_path(device_name, f"fast_{args.name}"))
    protocol = Protocol(target_ms=args.target_ms, max_repeats=30)
    header = {"device": device_name, "date": utc_now(), "versions": package_versions(), "numba_allocator": allocator,
              "settings": {"tokens": args.tokens, "hidden": args.hidden, "protocol": protocol.as_dict(), **settings,
                           "command": " ".join(sys.argv)}, "resources": {}}
    run = dict(device=device, protocol=protocol, allocator=allocator, header=header, records=[],
               device_name=device_name, seed=args.seed)
    return run, out_path


def measure_and_record(run, label, spec, fast, pass_, check, flops, config, resources):
    """Time one implementation at one configuration and append its record to ``run["records"]``, printing a line.

    ``run`` holds the run's ``device``, ``protocol``, ``allocator``, ``header``, ``records``, ``device_name`` and
    ``seed``; ``config`` is ``(batch, heads, N, d, causal, scale)``; ``fast`` (a fast kernel's identity, or None)
    with ``resources(fast, d)`` adds that kernel's resource report to the header once per (label, d).
    """
    from benchmarks import impls
    from benchmarks.results_io import make_record
    from benchmarks.timing import measure

    batch, heads, N, d, causal, scale = config
    header, records = run["header"], run["records"]

    def make_call(k):
        x = impls.make_inputs(batch, heads, N, d, impls.config_seed(run["seed"], N, d, causal, k))
        return spec.build(pass_, x, causal, scale, {})
    t0 = time.perf_counter()
    outcome = measure(make_call, check, run["device"], run["protocol"], flops,
                      count_memory=(spec.family == "torch" or run["allocator"] == "torch"))
    if fast is not None and outcome["status"] == "ok":
        key = f"{label}/d{d}"
        if key not in header["resources"]:
            try:
                header["resources"][key] = resources(fast, d)
            except Exception as exc:  # noqa: BLE001
                header["resources"][key] = {"error": repr(exc)}
            print(f"resources {key}: {header['resources'][key]}", flush=True)
    extra = {k: v for k, v in outcome.items() if k not in ("status", "error", "ms", "tflops", "peak_mem_bytes")}
    records.append(make_record(impl=label if fast is None else f"fast_{label}", pass_=pass_, dtype=spec.dtype,
                               batch=batch, heads=heads, N=N, d=d, causal=causal, device=run["device_name"],
                               ms=outcome["ms"], tflops=outcome["tflops"], peak_mem_bytes=outcome["peak_mem_bytes"],
                               status=outcome["status"], error=outcome["error"], **extra))
    r = records[-1]
    tf = "-" if r.get("tflops") is None else f"{r['tflops']:.2f}"
    ms = "-" if r.get("ms") is None else f"{r['ms']:.3f}"
    print(f"d={d:3d} causal={int(causal)} N={N:5d} {label:22s} {r['status']:7s} {ms:>9s} ms "
          f"{tf:>7s} TFLOP/s err={outcome.get('rel_error')} ({time.perf_counter() - t0:.1f} s)"
          + ("" if outcome["status"] == "ok" else f" {outcome['error']}"), flush=True)


def main(argv=None):
    from benchmarks import impls
    from benchmarks.flop_model import model_flops
    from benchmarks.results_io import write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", default="1024,2048,4096,8192,16384")
    p.add_argument("--d", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--impls", default="v1,v2,torch_eager,sdpa_efficient")
    add_run_arguments(p, name="forward", target_ms=150.0)
    args = p.parse_args(argv)

    run, out_path = start_run(args)
    header, records = run["header"], run["records"]
    chosen = [_parse_impl(n.strip()) for n in args.impls.split(",") if n.strip()]
    for d in (int(v) for v in args.d.split(",")):
        heads = args.hidden // d
        for causal in (bool(int(v)) for v in args.causal.split(",")):
            for N in (int(v) for v in args.N.split(",")):
                batch = max(1, args.tokens // N)
                scale = d ** -0.5
                flops = model_flops(batch, heads, N, d, causal=causal, pass_="forward")
                seed0 = impls.config_seed(args.seed, N, d, causal, 0)
                x0 = impls.make_inputs(batch, heads, N, d, seed0)
                O_ref, L_ref = impls.reference_forward(x0["Q"], x0["K"], x0["V"], causal, scale)
                check = impls.make_check({"O": O_ref, "L": L_ref}, "float32", "forward")
                del x0
                for label, spec, fast in chosen:
                    measure_and_record(run, label, spec, fast, "forward", check, flops,
                                       (batch, heads, N, d, causal, scale), _resources)
                write_results(out_path, header, records)
    _table(records)
    print(f"results: {out_path}")


def _table(records):
    """TFLOP/s per (d, causal, N) row, one column per implementation."""
    labels = list(dict.fromkeys(r["impl"] for r in records))
    keys = list(dict.fromkeys((r["d"], r["causal"], r["N"]) for r in records))
    print("d    causal N      " + " ".join(f"{label[:14]:>14s}" for label in labels))
    for key in keys:
        cells = []
        for label in labels:
            hit = [r for r in records if (r["d"], r["causal"], r["N"]) == key and r["impl"] == label]
            tf = hit[0].get("tflops") if hit else None
            cells.append(f"{tf:14.2f}" if tf is not None else f"{'-':>14s}")
        print(f"{key[0]:<4d} {int(key[1]):<6d} {key[2]:<6d} " + " ".join(cells))


if __name__ == "__main__":
    main()
