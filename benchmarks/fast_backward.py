"""Time the fast FA2 backward (kernels_gpu.fast.BACKWARD_VERSIONS) against the teaching kernel and PyTorch, in one run.

    python -m benchmarks.fast_backward                                   # v1 + baselines, d = 64 and 128
    python -m benchmarks.fast_backward --N 4096,8192 --d 64 --impls v1,v1@8x16x4x4r168,torch_eager

Implementations: ``v1`` (or ``v1@NYxNXxTRxTC``, another tiling; ``…rNNN``: a cap of NNN registers per thread),
``3xtf32`` (the 3xTF32 backward on tensor cores, :mod:`kernels_gpu.tensorcore.flash2_backward_3xtf32`; ``3xtf32@WxB``:
W warps, B_r = B),
``kg_flash2`` (the teaching ``kernels_gpu.flash2_backward``, only up to ``--teaching-max-N``: it takes seconds per
call beyond), ``torch_eager`` (PyTorch eager fp32, autograd backward) and ``sdpa_efficient`` (SDPA memory-efficient
fp32 backward). The same protocol as ``fast_kernels`` (``timing.measure``: float64 oracle gradients on the GPU,
outputs poisoned before the checked call, CUDA events, inputs rotated past the L2 cache, TF32 off). The forward
state each backward needs (O and L, or PyTorch's autograd graph) is built untimed; the fast backward gets O, L from
the fast forward v4. FLOPs by the FA2 paper's model: backward = 2.5 × forward. Results:
``benchmarks/results/<device>/fast_<name>.json``.

Before timing, every fast variant runs on small ragged GQA shapes (``SHAPES``) against the float64 oracle
(``--check-only`` stops there); ``sanitize()`` is the entry point for ``compute-sanitizer``. The committed H200 files
came from (PYTHONPATH=. on the device): ``--impls v1,v1@16x16x4x4r128,v1@8x16x4x4r168,v1@16x8x4x4r168 --d 64
--causal 0 --N 4096,16384 --name backward_v1_explore`` (then the default was (16, 16, 4, 4), uncapped: its rows are
labelled ``v1``), ``--impls v1,v1@8x16x4x4r168,kg_flash2,torch_eager,sdpa_efficient`` (``fast_backward_v1``), and,
with today's default, ``--d 64 --N 4096,8192,16384 --impls v1,torch_eager,sdpa_efficient --name backward_v1_final``.
"""

import argparse


def _parse_tiling(text):
    """``16x16x4x4`` → (BackwardTiling, None); ``16x16x4x4r128`` → (that tiling, a cap of 128 registers);
    "" → (None, None): the defaults."""
    from kernels_gpu.fast.flash2_backward_v1 import BackwardTiling
    if not text:
        return None, None
    shape, _, regs = text.partition("r")
    return BackwardTiling(*(int(v) for v in shape.split("x"))), (int(regs) if regs else None)


def _fast_builder(version, tiling=None, max_registers=None):
    def build(pass_, x, causal, scale, options):
        from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS
        backward = BACKWARD_VERSIONS[version]
        Q, K, V, dO = x["Q"], x["K"], x["V"], x["dO"]
        O, L = VERSIONS["v4"](Q, K, V, causal=causal, scale=scale)      # untimed: the saved state

        def call():
            dQ, dK, dV = backward(Q, K, V, O, L, dO, causal=causal, scale=scale, tiling=tiling,
                                  max_registers=max_registers)
            return {"dQ": dQ, "dK": dK, "dV": dV}
        return call
    return build


def _tf32_builder(warps=None, B_r=None):
    """The 3xTF32 backward on tensor cores (:mod:`kernels_gpu.tensorcore.flash2_backward_3xtf32`), O and L from the
    fast forward v4 (untimed)."""
    def build(pass_, x, causal, scale, options):
        from kernels_gpu.fast import VERSIONS
        from kernels_gpu.tensorcore.flash2_backward_3xtf32 import flash2_backward_3xtf32
        Q, K, V, dO = x["Q"], x["K"], x["V"], x["dO"]
        O, L = VERSIONS["v4"](Q, K, V, causal=causal, scale=scale)

        def call():
            dQ, dK, dV = flash2_backward_3xtf32(Q, K, V, O, L, dO, causal=causal, scale=scale, warps=warps, B_r=B_r)
            return {"dQ": dQ, "dK": dK, "dV": dV}
        return call
    return build


def _parse_impl(name):
    from benchmarks.harness import impls
    from kernels_gpu.fast import BACKWARD_VERSIONS
    version, _, tiling = name.partition("@")
    if version == "3xtf32":                       # 3xtf32 or 3xtf32@WxB_r: W warps of 16 keys, B_r queries per step
        warps, B_r = (int(v) for v in tiling.split("x")) if tiling else (None, None)
        return name, impls.ImplSpec(name, "kernels_gpu", "float32", ("backward",), _tf32_builder(warps, B_r),
                                    f"3xTF32 backward warps {warps} B_r {B_r}", default=False), \
            ("3xtf32", warps, B_r)
    if version in BACKWARD_VERSIONS:
        til, regs = _parse_tiling(tiling)
        return name, impls.ImplSpec(name, "kernels_gpu", "float32", ("backward",), _fast_builder(version, til, regs),
                                    f"fast backward {version} tiling {til} max_registers {regs}",
                                    default=False), (version, til, regs)
    if name not in impls.IMPLS:
        raise SystemExit(f"unknown implementation {name!r}: {list(BACKWARD_VERSIONS)} or {list(impls.IMPLS)}")
    return name, impls.IMPLS[name], None


def _resources(fast, d):
    from kernels_gpu.fast import flash2_backward_v1 as module
    version, til, regs = fast
    if version == "3xtf32":                       # the tile; its registers: kernels_gpu.tensorcore.inspect_ptx
        from kernels_gpu.tensorcore.flash2_backward_3xtf32 import config_for
        cfg = config_for(d, "float32", False, False, til, regs)
        return {"warps": cfg.warps, "B_r": cfg.B_r, "B_c": cfg.B_c}
    if til is None:
        til, regs = module.default_tiling(d), module.MAX_REGISTERS.get(64 if d <= 64 else 128)
    report = module.resources(til, d, d, regs)
    report["max_registers"] = regs
    report["tiling"] = list(til)
    return report


#: (Z, H_q, H_kv, N_q, N_k, d, causal): ragged, GQA, N_q ≠ N_k, fully masked rows (causal, N_q > N_k)
SHAPES = [(2, 4, 2, 300, 257, 64, True), (1, 2, 2, 129, 513, 64, False), (1, 3, 1, 77, 50, 64, True),
          (1, 2, 1, 200, 333, 128, True), (2, 2, 2, 1000, 1000, 64, False)]


def check_shapes(chosen, seed=0):
    """Every fast variant on small ragged shapes against the float64 oracle on the GPU, outputs poisoned (NaN).
    Returns the worst relative error per variant (1.0 for one that failed to run); raises nothing (prints FAIL; a
    variant whose tiling does not take a shape's head size skips that shape)."""
    import torch

    from benchmarks.harness import impls
    from kernels_gpu import runtime as rt
    from kernels_gpu.fast import VERSIONS
    rt.poison_outputs = True
    worst = {}
    g = torch.Generator(device="cuda").manual_seed(seed)
    for Z, H_q, H_kv, N_q, N_k, d, causal in SHAPES:
        G = H_q // H_kv
        Q = torch.randn((Z, H_q, N_q, d), generator=g, device="cuda")
        K, V = (torch.randn((Z, H_kv, N_k, d), generator=g, device="cuda") for _ in range(2))
        dO = torch.randn((Z, H_q, N_q, d), generator=g, device="cuda")
        scale = d ** -0.5
        Ke, Ve = K.repeat_interleave(G, dim=1), V.repeat_interleave(G, dim=1)
        O_ref, L_ref = impls.reference_forward(Q, Ke, Ve, causal, scale)
        # a fully masked row has L = −inf in the oracle (logsumexp of nothing) and O = NaN, which would make its P
        # and D = rowsum(dO ∘ O) NaN and the whole dK, dV reference NaN (checked against nothing): use L = +inf and
        # O = 0 there, as the kernels do (P = 0, dS = 0)
        L_ref = torch.where(torch.isneginf(L_ref), torch.full_like(L_ref, float("inf")), L_ref)
        O_ref = torch.nan_to_num(O_ref, nan=0.0)
        dQr, dKr, dVr = impls.reference_backward(Q, Ke, Ve, dO, O_ref, L_ref, causal, scale)
        dKr = dKr.reshape(Z, H_kv, G, N_k, d).sum(2)
        dVr = dVr.reshape(Z, H_kv, G, N_k, d).sum(2)
        O, L = VERSIONS["v4"](Q, K, V, causal=causal, scale=scale)
        for label, spec, fast in chosen:
            if fast is None:
                continue
            where = f"Z={Z} H_q={H_q} H_kv={H_kv} N_q={N_q} N_k={N_k} d={d} causal={int(causal)}"
            try:
                out = spec.build("backward", {"Q": Q, "K": K, "V": V, "dO": dO}, causal, scale, {})()
            except ValueError as exc:            # a tiling that does not take this head size: nothing to check
                print(f"check {label:22s} {where} skipped: {exc}", flush=True)
                continue
            except Exception as exc:  # noqa: BLE001 (a launch that fails, e.g. out of registers, is a result too)
                worst[label] = 1.0
                print(f"check {label:22s} {where} FAIL {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            errs = {name: impls.relative_error(out[name], ref) for name, ref in (("dQ", dQr), ("dK", dKr),
                                                                                ("dV", dVr))}
            bad = any(e is None or e > 1e-4 for e in errs.values())
            worst[label] = max(worst.get(label, 0.0), *(1.0 if e is None else e for e in errs.values()))
            print(f"check {label:22s} {where} {'FAIL' if bad else 'ok'} {errs}", flush=True)
    rt.poison_outputs = False
    return worst


def sanitize(versions=None):
    """One small ragged GQA problem (causal and not, N_q > N_k and N_q < N_k) through every fast backward version
    (or those named in ``versions``), with every default and one other tiling, NumPy in and out, checked against
    fa2edu's float64 oracle: run under ``compute-sanitizer --tool racecheck`` (or memcheck) on the GPU machine,
    ``python -c "from benchmarks.fast_backward import sanitize; sanitize()"``. Raises AssertionError on a wrong
    result."""
    import numpy as np

    import fa2edu
    from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS
    from kernels_gpu.fast.flash2_backward_v1 import BackwardTiling
    rng = np.random.default_rng(0)
    for version in versions or list(BACKWARD_VERSIONS):
        backward = BACKWARD_VERSIONS[version]
        for N_q, N_k, causal in ((100, 77, True), (77, 100, False)):
            for d, tiling, regs in ((64, None, None), (64, BackwardTiling(16, 16, 4, 4), None), (128, None, None)):
                Q = rng.standard_normal((1, 4, N_q, d)).astype(np.float32)
                K, V = (rng.standard_normal((1, 2, N_k, d)).astype(np.float32) for _ in range(2))
                dO = rng.standard_normal((1, 4, N_q, d)).astype(np.float32)
                O, L = VERSIONS["v4"](Q, K, V, causal=causal)
                got = backward(Q, K, V, O, L, dO, causal=causal, tiling=tiling, max_registers=regs)
                ref = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal)
                for name, a, b in zip(("dQ", "dK", "dV"), got, ref[:3]):
                    err = float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
                    assert np.isfinite(a).all() and err < 1e-4, (name, err)
                print(f"ok: fast backward {version} N_q={N_q} N_k={N_k} d={d} causal={causal} tiling={tiling}",
                      flush=True)


def main(argv=None):
    from benchmarks.fast_kernels import _table, add_run_arguments, measure_and_record, start_run
    from benchmarks.harness import impls
    from benchmarks.harness.flop_model import model_flops
    from benchmarks.harness.results_io import write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--N", default="1024,4096,8192,16384")
    p.add_argument("--d", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--impls", default="v1,kg_flash2,torch_eager,sdpa_efficient")
    p.add_argument("--teaching-max-N", type=int, default=4096)
    add_run_arguments(p, name="backward_v1", target_ms=150.0)
    p.add_argument("--check-only", action="store_true", help="only the ragged-shape oracle check")
    args = p.parse_args(argv)

    run, out_path = start_run(args, **{"pass": "backward"})
    header, records = run["header"], run["records"]
    chosen = [_parse_impl(n.strip()) for n in args.impls.split(",") if n.strip()]
    header["shape_check"] = check_shapes(chosen, args.seed)
    if args.check_only:
        return
    for d in (int(v) for v in args.d.split(",")):
        heads = args.hidden // d
        for causal in (bool(int(v)) for v in args.causal.split(",")):
            for N in (int(v) for v in args.N.split(",")):
                batch = max(1, args.tokens // N)
                scale = d ** -0.5
                flops = model_flops(batch, heads, N, d, causal=causal, pass_="backward")
                x0 = impls.make_inputs(batch, heads, N, d, impls.config_seed(args.seed, N, d, causal, 0))
                O_ref, L_ref = impls.reference_forward(x0["Q"], x0["K"], x0["V"], causal, scale)
                dQ_ref, dK_ref, dV_ref = impls.reference_backward(x0["Q"], x0["K"], x0["V"], x0["dO"], O_ref, L_ref,
                                                                  causal, scale)
                check = impls.make_check({"dQ": dQ_ref, "dK": dK_ref, "dV": dV_ref}, "float32", "backward")
                del x0, O_ref, L_ref
                for label, spec, fast in chosen:
                    if label == "kg_flash2" and N > args.teaching_max_N:
                        continue
                    measure_and_record(run, label, spec, fast, "backward", check, flops,
                                       (batch, heads, N, d, causal, scale), _resources)
                write_results(out_path, header, records)
    _table(records)
    print(f"results: {out_path}")


if __name__ == "__main__":
    main()
