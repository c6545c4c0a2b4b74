"""Check issue 5's speed targets against one results file of the benchmark harness.

    python -m benchmarks.harness.check_targets benchmarks/results/nvidia-h200/final.json    # the final run
    python -m benchmarks.harness.check_targets RESULTS --impl kg_flash2_fast --eager torch_eager --standard kg_standard

The file must come from one run holding the fast FA2 kernels and the baselines side by side (``bench_attention
--impls kg_standard,kg_flash2_fast,torch_eager,... --passes forward,backward``): every comparison below is between
records of the same file, so of the same device, inputs and protocol. The targets (fp32, batch × N = 16k tokens):

1. FA2 forward ≥ 25 TFLOP/s at d = 64, not causal, every N ≥ 4096;
2. FA2 forward ≥ PyTorch eager fp32 forward at every N ≥ 1024, d = 64 and 128 (causal and not);
3. FA2 backward ≥ 12 TFLOP/s at d = 64, every N ≥ 4096 (causal and not);
4. causal FA2 forward ≥ 1.6× faster in wall time than non-causal at N = 8192 (each d);
5. FA2 forward ≥ 3× faster (wall time) than kernels_gpu's standard attention at N = 8192 (each d, causal and not).

Prints one line per target, ``met`` or ``MISSED``, with the numbers it compared; a comparison whose records are
missing (not measured, skipped, wrong) counts as missed. Exit status 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from benchmarks.harness.results_io import load_results

__all__ = ["Target", "evaluate", "main"]


class Target(NamedTuple):
    """One target: its statement, whether it is met, and one line per comparison made."""
    name: str
    met: bool
    lines: tuple


def _index(records):
    """(impl, pass, d, causal, N) → the record, for records that ran and passed the oracle check."""
    out = {}
    for r in records:
        if r.get("status") == "ok" and r.get("ms") is not None and r.get("tflops") is not None:
            out[(r["impl"], r["pass"], r["d"], bool(r["causal"]), r["N"])] = r
    return out


def _grid(records, d=None, causal=None, N_min=None, N=None):
    """The (d, causal, N) points of the file, filtered."""
    points = sorted({(r["d"], bool(r["causal"]), r["N"]) for r in records})
    return [p for p in points if (d is None or p[0] in d) and (causal is None or p[1] == causal)
            and (N_min is None or p[2] >= N_min) and (N is None or p[2] == N)]


def _check(name, points, compare):
    """Apply ``compare(point) -> (ok, text)`` to every point; met iff there is at least one point and all are ok."""
    lines, ok_all = [], bool(points)
    for p in points:
        ok, text = compare(p)
        ok_all &= ok
        lines.append(f"d={p[0]:<3d} causal={int(p[1])} N={p[2]:<5d} {text}{'' if ok else '   <- missed'}")
    if not points:
        lines.append("no records for this target in the file")
    return Target(name, ok_all, tuple(lines))


def evaluate(records, impl="kg_flash2_fast", eager="torch_eager", standard="kg_standard") -> list[Target]:
    """The five targets of issue 5, checked on ``records`` (a results file's list) for ``impl``."""
    idx = _index(records)

    def tflops_at_least(pass_, floor):
        def compare(p):
            r = idx.get((impl, pass_, *p))
            if r is None:
                return False, f"{impl} {pass_}: no ok record"
            return r["tflops"] >= floor, f"{impl} {pass_} {r['tflops']:.2f} TFLOP/s (target ≥ {floor})"
        return compare

    def at_least_eager(p):
        a, b = idx.get((impl, "forward", *p)), idx.get((eager, "forward", *p))
        if a is None or b is None:
            return False, f"missing record ({impl if a is None else eager})"
        return a["tflops"] >= b["tflops"], f"{impl} {a['tflops']:.2f} vs {eager} {b['tflops']:.2f} TFLOP/s"

    def causal_speedup(p):
        d, _, N = p
        nc, c = idx.get((impl, "forward", d, False, N)), idx.get((impl, "forward", d, True, N))
        if nc is None or c is None:
            return False, "missing causal or non-causal record"
        ratio = nc["ms"] / c["ms"]
        return ratio >= 1.6, f"non-causal {nc['ms']:.2f} ms / causal {c['ms']:.2f} ms = {ratio:.2f}× (target ≥ 1.6)"

    def over_standard(p):
        a, s = idx.get((impl, "forward", *p)), idx.get((standard, "forward", *p))
        if a is None or s is None:
            return False, f"missing record ({impl if a is None else standard})"
        ratio = s["ms"] / a["ms"]
        return ratio >= 3.0, f"{standard} {s['ms']:.2f} ms / {impl} {a['ms']:.2f} ms = {ratio:.2f}× (target ≥ 3)"

    return [
        _check("1. forward >= 25 TFLOP/s, d = 64, not causal, N >= 4096",
               _grid(records, d=(64,), causal=False, N_min=4096), tflops_at_least("forward", 25.0)),
        _check(f"2. forward >= {eager} at every N >= 1024, d = 64 and 128",
               _grid(records, d=(64, 128), N_min=1024), at_least_eager),
        _check("3. backward >= 12 TFLOP/s, d = 64, N >= 4096",
               _grid(records, d=(64,), N_min=4096), tflops_at_least("backward", 12.0)),
        _check("4. causal forward >= 1.6x faster (wall time) than non-causal, N = 8192",
               _grid(records, causal=False, N=8192), causal_speedup),
        _check(f"5. forward >= 3x faster (wall time) than {standard}, N = 8192",
               _grid(records, N=8192), over_standard),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a results file of benchmarks.bench_attention")
    p.add_argument("--impl", default="kg_flash2_fast", help="the FA2 implementation checked (default kg_flash2_fast)")
    p.add_argument("--eager", default="torch_eager", help="the eager baseline of target 2")
    p.add_argument("--standard", default="kg_standard", help="the standard-attention baseline of target 5")
    args = p.parse_args(argv)
    header, records, _ = load_results(args.results)
    print(f"{args.results}: {header.get('device', '?')}, {len(records)} records, implementation {args.impl}")
    targets = evaluate(records, args.impl, args.eager, args.standard)
    for t in targets:
        print(f"{'met   ' if t.met else 'MISSED'} {t.name}")
        for line in t.lines:
            print(f"         {line}")
    missed = [t.name.split(".")[0] for t in targets if not t.met]
    print("all targets met" if not missed else f"missed: target(s) {', '.join(missed)}")
    return 0 if not missed else 1


if __name__ == "__main__":
    raise SystemExit(main())
