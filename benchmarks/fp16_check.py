"""fp16 storage against fp32 storage for the fast FA2 kernels (``impls.FP16_FORWARD``, ``FP16_BACKWARD``), one GPU run.

    python -m benchmarks.fp16_check --out $OUT/fast_fp16.json          # the grid below, about 5 minutes
    python -m benchmarks.fp16_check --d 64 --N 4096 --causal 0 --passes forward

What it measures. ``storage="float16"`` keeps Q, K, V (and O, dO) in HBM as float16 and computes in float32
(:mod:`kernels_gpu.fast.tiled`); the kernels are compute-bound, so the prediction in their headers is "little time
changes". For d in (64, 128), N in (1024, 4096), causal and not, batch × N = ``--tokens`` (16k) and
heads = ``--hidden`` // d (2048 // d), this times the fast forward and backward (``impls.FP16_FORWARD``,
``FP16_BACKWARD``) with each storage, through the harness's builder (``impls._kg_flash2_fast``: the float16 rows
are ``kg_flash2_fast_fp16``) and protocol (``fast_kernels.measure_and_record``: ``timing.measure``, outputs
poisoned on the checked call, CUDA events, median, inputs rotated past the L2 cache, TF32 off). Every row is first
checked against the harness's float64 reference (``impls.reference_forward`` / ``reference_backward``, on the
float32 inputs) with the harness's tolerance for its dtype (``impls.TOLERANCE``: fp16 1e-2 forward, 3e-2 backward).
Before timing, :func:`check_shapes` runs the float16 path on small ragged GQA shapes (N_q ≠ N_k, fully masked
rows) against fa2edu's oracle (``--check-only`` stops there; also a ``compute-sanitizer`` entry point).

Output: records like the other ``fast_*.json`` files (``impl`` = e.g. ``fast_v6_fp32``, ``fast_v6_fp16``,
``fast_v1_fp32``, ``fast_v1_fp16``; ``dtype`` the storage), each with ``model_bytes``: the global-memory bytes
the kernel moves by its own count (non-causal rows only; ``null`` on causal ones), the resource report of each
kernel in the header, and a summary pairing fp16 with fp32 (time ratio, both errors), printed last.
"""

import argparse
import math
import time

STORAGES = ("float32", "float16")
SHORT = {"float32": "fp32", "float16": "fp16"}
PASSES = ("forward", "backward")


def _ints(text):
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _bools(text):
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v not in ("0", "1") for v in values):
        raise argparse.ArgumentTypeError(f"causal must be 0, 1 or 0,1, got {text!r}")
    return tuple(v == "1" for v in values)


def _passes(text):
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v not in PASSES for v in values):
        raise argparse.ArgumentTypeError(f"passes must be forward, backward or both, got {text!r}")
    return values


def parse_args(argv=None):
    from benchmarks.fast_kernels import add_run_arguments
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp16_check", description=__doc__.splitlines()[0])
    p.add_argument("--d", type=_ints, default=(64, 128), help="head dimensions (default 64,128)")
    p.add_argument("--N", type=_ints, default=(1024, 4096), help="sequence lengths (default 1024,4096)")
    p.add_argument("--causal", type=_bools, default=(False, True), help="0, 1 or 0,1 (default both)")
    p.add_argument("--passes", type=_passes, default=PASSES, help="forward, backward or both (default both)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no configuration after this many seconds (default 480: one 10-minute device call)")
    add_run_arguments(p, name="fp16", target_ms=100.0)
    p.add_argument("--check-only", action="store_true", help="only the ragged-shape check against fa2edu's oracle")
    args = p.parse_args(argv)
    bad = [d for d in args.d if args.hidden % d or d % 4]
    if bad:
        p.error(f"--d {bad}: each d must divide --hidden {args.hidden} and be a multiple of 4")
    if args.tokens < 1 or args.target_ms <= 0 or args.budget_s <= 0:
        p.error("--tokens, --target-ms and --budget-s must be positive")
    return args


def plan(args):
    """The configurations in run order: dicts with d, causal, N, batch (tokens // N, at least 1), heads."""
    return [dict(d=d, causal=causal, N=N, batch=max(1, args.tokens // N), heads=args.hidden // d)
            for d in args.d for causal in args.causal for N in args.N]


def model_bytes(pass_, storage, N, d, B_r, B_c):
    """Global-memory bytes one (batch, head) moves, by the kernels' own counts (non-causal, N_q = N_k = N, d_v = d;
    4-byte float32, 2-byte float16; L, D and the dQ accumulator are float32 in both storages).

    forward (FA2 Alg. 1, grid over row blocks): reads Q once and K, V once per row block, Nd + 2Nd·T_r elements;
    writes O (Nd) and L (N).
    backward (Alg. 2, grid over column blocks): D's pass reads O, dO (2Nd) and writes D (N); dQ's zeroing writes Nd
    float32; the main kernel reads K, V (2Nd) and per column block Q, dO (2Nd) and L, D (2N), adds into dQ
    atomically (T_c·Nd float32 read-modify-writes) and writes dK, dV (2Nd); float16 storage adds the cast of dQ
    (reads Nd float32, writes Nd float16).
    """
    s = 2 if storage == "float16" else 4
    T_r, T_c = math.ceil(N / B_r), math.ceil(N / B_c)
    Nd = N * d
    if pass_ == "forward":
        return s * (Nd + 2 * Nd * T_r) + s * Nd + 4 * N
    total = s * 2 * Nd + 4 * N                              # D = rowsum(dO ∘ O)
    total += 4 * Nd                                         # dQ = 0
    total += s * 2 * Nd + T_c * (s * 2 * Nd + 4 * 2 * N)    # K, V once; Q, dO, L, D per column block
    total += T_c * Nd * (4 + 4)                             # dQ atomics
    total += s * 2 * Nd                                     # dK, dV
    if storage == "float16":
        total += Nd * (4 + 2)                               # dQ float32 → float16
    return total


def _block_sizes(pass_, d):
    """(B_r, B_c) of the default tiling of the fp16 forward / backward versions at head dimension d."""
    if pass_ == "forward":
        module = _forward_module()
    else:
        from kernels_gpu.fast import flash2_backward_v1 as module
    tiling = module.default_tiling(d)
    return tiling.B_r, tiling.B_c


def _forward_module():
    """The module of the forward version timed with fp16 storage (``impls.FP16_FORWARD``)."""
    import importlib

    from benchmarks.harness import impls
    return importlib.import_module(f"kernels_gpu.fast.flash2_forward_{impls.FP16_FORWARD}")


def specs(passes):
    """(label, ImplSpec, fast) per (pass, storage): the harness's fast builder with v5 / v1 and that storage."""
    import functools

    from benchmarks.harness import impls
    out = []
    for pass_ in passes:
        version = impls.FP16_FORWARD if pass_ == "forward" else impls.FP16_BACKWARD
        for storage in STORAGES:
            build = functools.partial(impls._kg_flash2_fast, storage=storage,
                                      versions=(impls.FP16_FORWARD, impls.FP16_BACKWARD))
            label = f"{version}_{SHORT[storage]}"
            spec = impls.ImplSpec(label, "kernels_gpu", storage, (pass_,), build,
                                  f"kernels_gpu.fast {pass_} {version}, {storage} storage", default=False)
            out.append((label, spec, (pass_, storage)))
    return out


def _resources(fast, d):
    """The compiler's report (registers, spills, shared memory) of the kernel for this pass and storage."""
    pass_, storage = fast
    if pass_ == "forward":
        from kernels_gpu.fast import tiled
        module = _forward_module()
        tiling, cap = module.default_tiling(d), module.default_max_registers(d)
        if hasattr(module, "resources"):              # v6+: the version says how its kernel is compiled
            report = module.resources(tiling, d, cap, storage=storage)
        else:
            report = tiled.resources(tiling, d, d, module.SHUFFLE, module.PIPELINE, cap, storage=storage)
    else:
        from kernels_gpu.fast import flash2_backward_v1 as v1
        tiling, cap = v1.default_tiling(d), v1.MAX_REGISTERS.get(64 if d <= 64 else 128)
        report = v1.resources(tiling, d, d, cap, storage=storage)
    report.update(tiling=list(tiling), max_registers=cap, storage=storage)
    return report


def summarize(records):
    """Pair each fp16 record with the fp32 one of the same (pass, d, causal, N): both times, their ratio
    (fp16 / fp32: below 1 means fp16 storage is faster), both relative errors and both model byte counts."""
    rows = []
    by_key = {}
    for r in records:
        by_key.setdefault((r["pass"], r["d"], r["causal"], r["N"]), {})[r["dtype"]] = r
    for (pass_, d, causal, N), pair in by_key.items():
        a, b = pair.get("float32"), pair.get("float16")
        if a is None or b is None:
            continue
        ok = a.get("status") == "ok" and b.get("status") == "ok"
        rows.append(dict(pass_=pass_, d=d, causal=causal, N=N, ms_fp32=a.get("ms"), ms_fp16=b.get("ms"),
                         ratio=(b["ms"] / a["ms"]) if ok else None, tflops_fp32=a.get("tflops"),
                         tflops_fp16=b.get("tflops"), rel_error_fp32=a.get("rel_error"),
                         rel_error_fp16=b.get("rel_error"), bytes_fp32=a.get("model_bytes"),
                         bytes_fp16=b.get("model_bytes")))
    return rows


def format_summary(rows):
    """The summary as a text table."""
    lines = ["pass     d    causal N      fp32 ms   fp16 ms   fp16/fp32  err fp32   err fp16   bytes fp16/fp32"]
    for r in rows:
        def num(v, fmt):
            return "-" if v is None else format(v, fmt)
        bytes_ratio = (r["bytes_fp16"] / r["bytes_fp32"]) if r["bytes_fp32"] and r["bytes_fp16"] else None
        lines.append(f"{r['pass_']:8s} {r['d']:<4d} {int(r['causal']):<6d} {r['N']:<6d} "
                     f"{num(r['ms_fp32'], '9.3f'):>9s} {num(r['ms_fp16'], '9.3f'):>9s} {num(r['ratio'], '10.3f'):>10s} "
                     f"{num(r['rel_error_fp32'], '10.2e'):>10s} {num(r['rel_error_fp16'], '10.2e'):>10s} "
                     f"{num(bytes_ratio, '8.3f'):>8s}")
    return "\n".join(lines)


#: (Z, H_q, H_kv, N_q, N_k, d, causal): ragged, GQA, N_q ≠ N_k, fully masked rows (causal with N_q > N_k)
SHAPES = [(1, 4, 2, 100, 77, 64, True), (1, 4, 2, 77, 100, 128, False), (2, 2, 1, 129, 200, 64, True),
          (1, 2, 2, 200, 129, 128, True)]


def check_shapes(seed=0, tolerance=4e-3, shapes=None):
    """The fp16 forward and backward versions, float16 storage, on small ragged GQA shapes (NumPy in and out), against
    fa2edu's float64 oracle on the float16-rounded inputs: max |error| / max(1, max |reference|) per output, which
    float16 output rounding puts near 2^-11 ≈ 5e-4 (``tolerance`` leaves room for the float16 O in D's pass).
    Also whether O and L are bit for bit the float32 kernel's on the same values (O rounded once): the arithmetic
    is the same instructions, so they should be. Returns a list of dicts; prints one line per shape."""
    import numpy as np

    import fa2edu
    from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS

    rng = np.random.default_rng(seed)
    from benchmarks.harness import impls
    forward, backward = VERSIONS[impls.FP16_FORWARD], BACKWARD_VERSIONS[impls.FP16_BACKWARD]
    out = []
    for Z, H_q, H_kv, N_q, N_k, d, causal in (SHAPES if shapes is None else shapes):
        Q = rng.standard_normal((Z, H_q, N_q, d)).astype(np.float16)
        K, V = (rng.standard_normal((Z, H_kv, N_k, d)).astype(np.float16) for _ in range(2))
        dO = rng.standard_normal((Z, H_q, N_q, d)).astype(np.float16)
        O, L = forward(Q, K, V, causal=causal, storage="float16")
        O32, L32 = forward(*(x.astype(np.float32) for x in (Q, K, V)), causal=causal)
        grads = backward(Q, K, V, O, L, dO, causal=causal, storage="float16")
        exact = [x.astype(np.float64) for x in (Q, K, V, dO)]
        O_ref, L_ref = fa2edu.attention_reference(*exact[:3], causal=causal)
        refs = fa2edu.attention_reference_backward(*exact, causal=causal)[:3]
        errors = {}
        for name, got, ref in zip(("O", "L", "dQ", "dK", "dV"), (O, L, *grads), (O_ref, L_ref, *refs)):
            got = np.asarray(got, dtype=np.float64)
            finite = np.isfinite(ref)
            same_inf = bool(np.array_equal(np.isposinf(got), np.isposinf(ref)) and not np.isnan(got).any())
            err = float(np.abs(got[finite] - ref[finite]).max(initial=0.0))
            errors[name] = err / max(1.0, float(np.abs(ref[finite]).max(initial=0.0))) if same_inf else math.inf
        row = dict(shape=[Z, H_q, H_kv, N_q, N_k, d, bool(causal)], errors=errors,
                   dtypes=[str(np.asarray(x).dtype) for x in (O, L, *grads)],
                   forward_bitwise=bool(np.array_equal(O, O32.astype(np.float16)) and np.array_equal(L, L32)))
        row["ok"] = (max(errors.values()) <= tolerance
                     and row["dtypes"] == ["float16", "float32", "float16", "float16", "float16"])
        out.append(row)
        print(f"check Z={Z} H_q={H_q} H_kv={H_kv} N_q={N_q} N_k={N_k} d={d} causal={int(causal)} "
              f"{'ok' if row['ok'] else 'FAIL'} bitwise_forward={row['forward_bitwise']} "
              + " ".join(f"{k}={v:.2e}" for k, v in errors.items()), flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    from benchmarks.fast_kernels import measure_and_record, start_run
    from benchmarks.harness import impls
    from benchmarks.harness.flop_model import model_flops
    from benchmarks.harness.results_io import make_record, write_results

    run, out_path = start_run(args, versions={"forward": impls.FP16_FORWARD, "backward": impls.FP16_BACKWARD},
                              tolerance={f"{k[0]}/{k[1]}": v for k, v in impls.TOLERANCE.items()})
    header, records, device_name = run["header"], run["records"], run["device_name"]
    header["shape_check"] = check_shapes(args.seed)
    if args.check_only:
        write_results(out_path, header, [])
        print(f"results: {out_path}")
        return
    chosen = specs(args.passes)
    t_start = time.perf_counter()
    for c in plan(args):
        d, causal, N, batch, heads = c["d"], c["causal"], c["N"], c["batch"], c["heads"]
        scale = d ** -0.5
        config = (batch, heads, N, d, causal, scale)
        if time.perf_counter() - t_start > args.budget_s:
            for label, _spec, (pass_, storage) in chosen:
                records.append(make_record(impl=f"fast_{label}", pass_=pass_, dtype=storage, batch=batch,
                                           heads=heads, N=N, d=d, causal=causal, device=device_name,
                                           status="skipped", error=f"--budget-s {args.budget_s:g} s spent"))
            continue
        # the float64 reference of the harness, on input set 0's float32 values (the float16 rows get them cast)
        x0 = impls.make_inputs(batch, heads, N, d, impls.config_seed(args.seed, N, d, causal, 0))
        O_ref, L_ref = impls.reference_forward(x0["Q"], x0["K"], x0["V"], causal, scale)
        reference = {"forward": {"O": O_ref, "L": L_ref}}
        if "backward" in args.passes:
            dQ, dK, dV = impls.reference_backward(x0["Q"], x0["K"], x0["V"], x0["dO"], O_ref, L_ref, causal, scale)
            reference["backward"] = {"dQ": dQ, "dK": dK, "dV": dV}
        del x0
        for label, spec, fast in chosen:
            pass_, storage = fast
            check = impls.make_check(reference[pass_], storage, pass_)
            flops = model_flops(batch, heads, N, d, causal=causal, pass_=pass_)
            measure_and_record(run, label, spec, fast, pass_, check, flops, config, _resources)
            # the byte count is the non-causal one: a causal run skips tiles, so it gets none
            records[-1]["model_bytes"] = (None if causal else
                                          batch * heads * model_bytes(pass_, storage, N, d, *_block_sizes(pass_, d)))
        del reference, O_ref, L_ref
        run["device"].empty_cache()
        write_results(out_path, header, records, {"fp16_vs_fp32": summarize(records)})
    rows = summarize(records)
    write_results(out_path, header, records, {"fp16_vs_fp32": rows})
    print(format_summary(rows))
    print(f"results: {out_path}")


if __name__ == "__main__":
    main()
