"""One call of a fast FA2 forward (or backward) version, bracketed for Nsight Compute: where does its time go?

    ncu --profile-from-start off --clock-control none --set full -o v6 \\
        python -m benchmarks.profilers.profile_fast --version v6 --d 128 --N 4096
    ncu --profile-from-start off --clock-control none --set full -k regex:flash2_backward_fast -o bwd \\
        python -m benchmarks.profilers.profile_fast --backward v2 --d 128 --N 2048
    ncu --import v6.ncu-rep --page details --csv        # speed of light, warp stalls, pipes, occupancy
    ncu --import v6.ncu-rep --page source --csv --print-source sass   # stall samples per SASS instruction

The inputs are the benchmark's (fp32, batch × N = ``--tokens``, heads × d = ``--hidden``); the kernel is compiled
and run once before the profiled call, so only that call's launch is captured. ``--tiling NYxNXxTRxTC`` and
``--max-registers`` pick another configuration of the version (as ``benchmarks.fast_kernels`` spells them).
``--backward VERSION``: one call of that fast backward (its launches: D's pass, dQ's zeroing, the main kernel),
on O and L from the forward ``--version``; ``--backward 3xtf32``: the 3xTF32 backward on tensor cores
(``kernels_gpu.tensorcore.TF32_BACKWARD``; its kernel ``flash2_backward_3xtf32_kernel``). ``--loops SOURCE.csv``
(no GPU needed): the stall samples of an ncu source page (``--page source --csv --print-source sass``) summed per
loop of the SASS (a backward branch's target to the branch), with each loop's instruction mix and stall reasons —
where the kernel's time goes, by loop.
"""

import argparse
import collections
import csv
import re


def loop_table(path: str, min_share: float = 0.01) -> str:
    """The per-loop summary of an ncu SASS source page in CSV (see the module's docstring): one line per loop
    holding at least ``min_share`` of the samples — offsets from the kernel's first instruction, instructions,
    share of all samples, the three commonest opcodes, the stall reasons over 3 % of the loop's samples."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header, data = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    at, src, samples = header.index("Address"), header.index("Source"), header.index(
        "Warp Stall Sampling (All Samples)")
    reasons = {h[6:]: i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h}
    addr = [int(r[at], 16) for r in data]
    total = sum(int(r[samples]) for r in data) or 1

    def opcode(text):
        words = text.split()
        return words[1] if words[0].startswith("@") else words[0]
    lines = [f"{path}: {total} stall samples"]
    for k, r in enumerate(data):
        targets = re.findall(r"0x([0-9a-f]+)", r[src]) if "BRA" in r[src] else []
        if not targets or int(targets[-1], 16) >= addr[k]:
            continue
        body = [x for x, a in zip(data, addr) if int(targets[-1], 16) <= a <= addr[k]]
        n = sum(int(x[samples]) for x in body)
        if n / total < min_share:
            continue
        ops = collections.Counter(opcode(x[src]) for x in body).most_common(3)
        why = {name: sum(int(x[i]) for x in body) / n for name, i in reasons.items()}
        why = ", ".join(f"{name} {v:.2f}" for name, v in sorted(why.items(), key=lambda t: -t[1]) if v >= 0.03)
        lines.append(f"loop {int(targets[-1], 16) - addr[0]:#07x}-{addr[k] - addr[0]:#07x}: {len(body):5d} "
                     f"instructions, {n / total:.3f} of the samples; {dict(ops)}; {why}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default="v6")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--tiling", default=None, help="NYxNXxTRxTC")
    p.add_argument("--max-registers", type=int, default=None)
    p.add_argument("--backward", default=None, help="profile this fast backward version instead of the forward")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--loops", default=None, help="summarise an ncu SASS source CSV by loop, then exit")
    args = p.parse_args(argv)
    if args.loops:
        print(loop_table(args.loops))
        return

    from numba import cuda

    from benchmarks.harness import impls
    from kernels_gpu.fast import VERSIONS, Tiling
    forward = VERSIONS[args.version]
    options = {}
    if args.tiling:
        options["tiling"] = Tiling(*(int(v) for v in args.tiling.split("x")))
    if args.max_registers is not None:
        options["max_registers"] = args.max_registers
    x = impls.make_inputs(max(1, args.tokens // args.N), args.hidden // args.d, args.N, args.d, seed=0)
    if args.backward:
        from kernels_gpu.fast import BACKWARD_VERSIONS
        from kernels_gpu.tensorcore import TF32_BACKWARD
        backward = TF32_BACKWARD["3xtf32"] if args.backward == "3xtf32" else BACKWARD_VERSIONS[args.backward]
        O, L = forward(x["Q"], x["K"], x["V"], causal=args.causal)

        def call():
            return backward(x["Q"], x["K"], x["V"], O, L, x["dO"], causal=args.causal, **options)
    else:
        def call():
            return forward(x["Q"], x["K"], x["V"], causal=args.causal, **options)
    call()                                                              # compile and warm up: not profiled
    cuda.synchronize()
    cuda.profile_start()
    call()
    cuda.synchronize()
    cuda.profile_stop()


if __name__ == "__main__":
    main()
