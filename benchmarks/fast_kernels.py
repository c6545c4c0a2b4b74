"""Time the fast FA2 kernels (kernels_gpu.fast) against PyTorch eager fp32 and SDPA memory-efficient fp32, in one run.

    python -m benchmarks.fast_kernels                                   # v1, v2 + baselines, the paper's grid
    python -m benchmarks.fast_kernels --N 1024,8192 --d 64 --impls v2,torch_eager
    python -m benchmarks.fast_kernels --impls v2,v2@16x16x4x4           # a version with another tiling NYxNXxTRxTC

Same protocol as ``bench_attention`` (it reuses ``timing.measure``, ``impls.make_check``, the float64 reference on
the GPU, CUDA events, inputs rotated past the L2 cache, TF32 off): fp32, forward, batch × N = ``--tokens`` (16k),
heads × d = ``--hidden`` (2048). Each fast kernel's resource report (registers, local memory = spills, shared
memory) is printed and stored. Results: ``benchmarks/results/<device>/fast_<name>.json``; a table at the end.

``register()`` (``impls.register_fast_versions``) adds the fast versions to ``benchmarks.harness.impls.IMPLS`` as
``fast_v1``, ``fast_v2``, … (forward only), so ``bench_attention --impls fast_v2`` can time them once it has run.

A driver: it imports ``impls`` (what is timed) and ``timing`` (how), never the other way round.
"""

import argparse

from benchmarks.harness import impls, timing

# The builder lives with the other implementations (``impls``), the run record with the protocol (``timing``);
# the names below are kept for the drivers that import them from here (fast_backward, fp16_check).
_fast_builder = impls.fast_builder
register = impls.register_fast_versions
add_run_arguments, start_run, measure_and_record = timing.add_run_arguments, timing.start_run, timing.measure_and_record
_table = timing.results_table


def _parse_impl(name):
    """``v2``, ``v2@16x8x4x4`` or ``v5@16x8x4x4r168`` (a register cap, v5+) → (label, spec) with a fast builder;
    any other name → the harness's spec."""
    from kernels_gpu.fast import VERSIONS, Tiling
    version, _, tiling = name.partition("@")
    if version in VERSIONS:
        tiling, _, cap = tiling.partition("r")
        cap = int(cap) if cap else None
        til = Tiling(*(int(v) for v in tiling.split("x"))) if tiling else None
        return name, impls.ImplSpec(name, "kernels_gpu", "float32", ("forward",), impls.fast_builder(version, til, cap),
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


def main(argv=None):
    from benchmarks.harness.flop_model import model_flops
    from benchmarks.harness.results_io import write_results

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


if __name__ == "__main__":
    main()
