"""The simulator's predictions for the multi-GPU ring, written down before any multi-GPU run.

    python -m benchmarks.context_parallel_predictions --out benchmarks/results/predictions/ring_predictions.json

For the configurations ``benchmarks.context_parallel`` measures (W = 1, 2, 4, 8 GPUs; strong scaling at a fixed
total length and weak scaling at a fixed length per GPU; contiguous and zigzag; causal; d = 128, H200-class
NVLink), :func:`fa2edu.simulate_context_parallel` gives each rank's predicted time, the idle fraction against the
busiest rank, and whether every step's compute hides its transfer. A run on a machine with several GPUs is then
compared with this file, not with numbers produced after the fact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness.results_io import utc_now
from fa2edu import simulate_context_parallel


def predictions(d: int = 128, heads: int = 16, strong_N: int = 65536, weak_N_local: int = 16384) -> list[dict]:
    """One record per (scaling, layout, W): predicted per-rank time, idle fractions, communication hidden."""
    records = []
    for scaling in ("strong", "weak"):
        for layout in ("contiguous", "zigzag"):
            for W in (1, 2, 4, 8):
                N = strong_N if scaling == "strong" else weak_N_local * W
                report = simulate_context_parallel(N, d, W, causal=True, layout=layout, heads=heads)
                records.append(dict(scaling=scaling, layout=layout, world_size=W, N=N, d=d, heads=heads,
                                    predicted_ms=report.time_s * 1e3,
                                    predicted_compute_ms=report.compute_time_s * 1e3,
                                    predicted_rank_ms=[t.finish_s * 1e3 for t in report.ranks],
                                    idle_fractions=list(report.idle_fractions),
                                    comm_hidden=bool(report.hides_communication),
                                    bandwidth_to_hide=report.bandwidth_to_hide))
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = predictions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(date=utc_now(), model="fa2edu.simulate_context_parallel (causal, "
                                        "link NVLink4-H100, flop rate H100-SXM)", records=records), indent=1))
    for r in records:
        print(f"{r['scaling']:6s} {r['layout']:10s} W={r['world_size']} N={r['N']:6d} "
              f"{r['predicted_ms']:8.2f} ms  max idle {max(r['idle_fractions']):.2f}  hidden={r['comm_hidden']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
