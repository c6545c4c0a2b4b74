"""What the merge launch of a split decoding step costs in a CUDA graph: the whole step against its split programs
alone, beside cuDNN's step, on the :mod:`benchmarks.decode` grid's shapes that split.

    python -m benchmarks.profilers.decode_merge_cost --out benchmarks/results/<device>/decode_merge_cost.json

Per shape, in 3 rounds (each implementation once per round, graph replays of :func:`benchmarks.decode.time_graph`,
the medians kept): ``full`` — :func:`kernels_gpu.decode_attention` with the merge launch (``decode.CLUSTER_MERGE``
off: the splits merged by :func:`kernels_gpu.inference.decode.merge_kernel`); ``split_only`` — the same kept plan with
its merge launch replaced by nothing (its output is then not the answer: a timing device only); ``cudnn`` — SDPA's
cuDNN backend. ``full − split_only`` is what the merge adds to a step, its launch latency included; this is the
measurement behind the cluster merge of :mod:`kernels_gpu.inference.decode_tc`.
"""

from __future__ import annotations

import argparse
import statistics
import sys

SHAPES = ((1, 4096), (1, 8192), (1, 16384), (1, 32768), (8, 4096), (8, 16384))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    from benchmarks.harness.results_io import write_measurement
    from benchmarks.harness.timing import cuda_setup, package_versions
    cuda_setup(use_torch_allocator=False)
    import torch

    import kernels_gpu
    from benchmarks import decode as bench
    from kernels_gpu.inference import decode
    decode.CLUSTER_MERGE = False
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cudnn = bench._sdpa(torch, "cudnn")
    rows = []
    for batch, context in SHAPES:
        one = 2 * batch * bench.H_KV * context * bench.D * 2
        sets = bench.make_sets(torch, batch, context, bench.PAGE, max(2, -(-2 * l2 // one)), seed=0)

        def full(s):
            return kernels_gpu.decode_attention(s["q"], s["k"], s["v"], s["seqlens"], block_size=bench.PAGE).O
        full(sets[0])
        s0 = sets[0]
        plan = decode._PLANS.get(decode._plan_key(s0["q"], s0["k"], s0["v"], s0["seqlens"], None, True, None, None,
                                                  bench.PAGE, None, None))
        times = {"full": [], "cudnn": [], "split_only": []}
        for _ in range(a.rounds):
            for name, fn in (("full", full), ("cudnn", cudnn)):
                times[name].append(1e3 * statistics.median(bench.time_graph(torch, fn, sets, 30)))
            if plan.partials:
                merge = plan.launches[1]
                plan.launches[1] = lambda *args: None
                times["split_only"].append(1e3 * statistics.median(bench.time_graph(torch, full, sets, 30)))
                plan.launches[1] = merge
        row = dict(batch=batch, context=context, splits=plan.partials // (batch * bench.H_Q) if plan.partials else 1,
                   **{name: round(statistics.median(t), 2) for name, t in times.items() if t})
        print(row, flush=True)
        rows.append(row)
        decode._PLANS.clear()
    write_measurement(a.out, "fa2edu.decode_merge_cost/1", rows, device=torch.cuda.get_device_name(0),
                      versions=package_versions(), unit="microseconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
