"""Variants of the tensor-core decoding program against each other and cuDNN, in one process, on the same inputs.

    python -m benchmarks.profilers.decode_variants --variants copy=bulk copy=cp.async --out /tmp/variants.json
    ncu --nvtx --nvtx-include "variant/" --section ... python -m benchmarks.profilers.decode_variants --ncu ...

A variant is a set of the module-level choices of :mod:`kernels_gpu.inference.decode`,
:mod:`kernels_gpu.inference.decode_tc` and :mod:`kernels_gpu.tensor_map`: ``copy`` (``decode_tc.COPY``: "bulk",
"cp.async" or "tensor"), ``stages`` (``decode_tc.STAGES``), ``chains`` (``decode_tc.CHAINS``), ``tile``
(``decode_tc.TILE``, keys per warp tile),
``cluster`` (``decode.CLUSTER_MERGE``: 1 merges the splits inside their thread-block cluster, 0 by the merge
launch), ``cluster_shared`` (``decode.CLUSTER_SHARED_BYTES``: the least shared memory a clustered program asks for),
``warps`` (``decode.TC_WARPS``), ``l2`` (``tensor_map.L2_PROMOTION``: "none", "64B", "128B", "256B") and ``splits``
(``num_splits`` of the call; default: the split rule). Each shape (batch × context, the :mod:`benchmarks.decode`
grid's H_q = 32, H_kv = 8, d = 128, float16, contiguous cache) is timed by CUDA-graph replay
(:func:`benchmarks.decode.time_graph`) in ``--rounds`` rounds, every variant and SDPA's cuDNN backend once per round
in turn, so that a drift of the clock or the memory touches all of them alike; the median over rounds is reported,
with each variant's output checked against cuDNN's. ``--cluster-occupancy``: only how many clusters of S split
programs the GPU holds at once. ``--ncu``: one call of each variant and of cuDNN per shape, each inside an NVTX
range ``<name> B<batch>-<context>`` inside a range ``variant``, for Nsight Compute (``--nvtx --nvtx-include
"variant/"``).

This is the harness behind the A/B files of the decoding program's header (``decode_tc_bulk_ab.json``) and
behind ``decode_sets_{1,2,4}.json`` (``--sets N --graph-calls 1``: N input sets, one call each per graph), which
set :data:`benchmarks.decode.GRAPH_CALLS`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks import decode as bench
from benchmarks.harness.results_io import utc_now
from benchmarks.harness.timing import cuda_setup, package_versions

KNOBS = ("copy", "stages", "warps", "splits", "l2", "chains", "tile", "cluster", "cluster_shared")


def parse_variant(text: str) -> dict:
    """``"copy=bulk,stages=2"`` → {"copy": "bulk", "stages": 2}; unknown knobs are an error."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in KNOBS or not value:
            raise SystemExit(f"--variants: expected knob=value with knob in {KNOBS}, got {item!r}")
        out[key] = value if key in ("copy", "l2") else int(value)
    return out


def parse_shape(text: str) -> tuple[int, int]:
    batch, _, context = text.partition("x")
    try:
        return int(batch), int(context)
    except ValueError:
        raise SystemExit(f"--shapes: expected <batch>x<context>, got {text!r}") from None


_CURRENT: list = [None]


def apply(variant: dict) -> None:
    """Set the module-level choices of ``variant`` (the others back to their defaults) and drop cached plans —
    only when the variant changes: a call being captured into a graph must find its plan (and its buffers)."""
    from kernels_gpu import tensor_map
    from kernels_gpu.inference import decode, decode_tc
    if _CURRENT[0] == variant:
        return
    _CURRENT[0] = dict(variant)
    decode_tc.COPY = variant.get("copy", DEFAULTS["copy"])
    decode_tc.STAGES = variant.get("stages", DEFAULTS["stages"])
    decode_tc.CHAINS = variant.get("chains", DEFAULTS["chains"])
    decode_tc.TILE = variant.get("tile", DEFAULTS["tile"])
    decode.CLUSTER_MERGE = bool(variant.get("cluster", DEFAULTS["cluster"]))
    decode.CLUSTER_SHARED_BYTES = variant.get("cluster_shared", DEFAULTS["cluster_shared"])
    decode.TC_WARPS = variant.get("warps", DEFAULTS["warps"])
    tensor_map.L2_PROMOTION = variant.get("l2", DEFAULTS["l2"])
    decode._PLANS.clear()


def caller(variant: dict, page: int):
    import kernels_gpu
    kw = {} if "splits" not in variant else dict(num_splits=variant["splits"])

    def call(s):
        apply(variant)
        return kernels_gpu.decode_attention(s["q"], s["k"], s["v"], s["seqlens"], block_size=page, **kw).O
    return call


def name_of(variant: dict) -> str:
    return ",".join(f"{k}={variant[k]}" for k in KNOBS if k in variant) or "default"


def main(argv=None) -> int:
    global DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1x16384", "1x65536", "8x32768", "32x4096", "32x16384"])
    p.add_argument("--variants", nargs="+", default=["copy=bulk", "copy=cp.async"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--page", type=int, default=256)
    p.add_argument("--target-ms", type=float, default=30.0)
    p.add_argument("--graph-calls", type=int, default=bench.GRAPH_CALLS,
                   help="calls captured per graph at least (the sets cycled)")
    p.add_argument("--sets", type=int, default=0, help="input sets per shape, each a call of the graph (default: "
                   "enough to exceed twice the L2 cache, at least 2)")
    p.add_argument("--ncu", action="store_true", help="one call per variant in NVTX ranges, nothing timed")
    p.add_argument("--cluster-occupancy", action="store_true",
                   help="only print how many clusters of S split programs the GPU holds at once (batch 1, 16k keys)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cuda_setup(use_torch_allocator=False)
    import torch

    from kernels_gpu import tensor_map
    from kernels_gpu.inference import decode, decode_tc
    if a.cluster_occupancy:
        return cluster_occupancy(torch, a.page)
    DEFAULTS = dict(copy=decode_tc.COPY, stages=decode_tc.STAGES, warps=decode.TC_WARPS, tile=decode_tc.TILE,
                    cluster=int(decode.CLUSTER_MERGE), cluster_shared=decode.CLUSTER_SHARED_BYTES,
                    l2=tensor_map.L2_PROMOTION, chains=decode_tc.CHAINS)
    variants = [parse_variant(v) for v in a.variants]
    shapes = [parse_shape(s) for s in a.shapes]
    cudnn = bench._sdpa(torch, "cudnn")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copy_GBps = None if a.ncu else bench.copy_rate_GBps(torch)
    rows, t0 = [], time.time()
    for batch, context in shapes:
        one = 2 * batch * bench.H_KV * context * bench.D * 2
        n_sets = 1 if a.ncu else a.sets or max(2, -(-2 * l2 // one))
        sets = bench.make_sets(torch, batch, context, a.page, n_sets, seed=0)
        impls = {name_of(v): caller(v, a.page) for v in variants}
        impls["sdpa_cudnn"] = cudnn
        ref = cudnn(sets[0]).float()
        if a.ncu:
            for name, fn in impls.items():
                fn(sets[0])
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("variant")          # ncu --nvtx-include "variant/"
                torch.cuda.nvtx.range_push(f"{name} B{batch}-{context}")
                fn(sets[0])
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                torch.cuda.nvtx.range_pop()
            continue
        times = {name: [] for name in impls}
        errors = {name: float((fn(sets[0]).float() - ref).abs().max()) for name, fn in impls.items()}
        for _ in range(a.rounds):
            for name, fn in impls.items():
                times[name].append(statistics.median(bench.time_graph(torch, fn, sets, a.target_ms,
                                                                         min_calls=a.graph_calls)))
        nbytes = bench.decode_bytes(batch, bench.H_Q, bench.H_KV, 1, bench.D, bench.D, [context] * batch)
        for name in impls:
            us = 1e3 * statistics.median(times[name])
            row = dict(batch=batch, context=context, impl=name, us=us, us_rounds=[1e3 * t for t in times[name]],
                       copy_fraction=nbytes / (us * 1e-6) / 1e9 / copy_GBps, max_error_vs_cudnn=errors[name])
            rows.append(row)
            print(f"B{batch:<3d} {context:>7d}  {name:<24s} {us:9.1f} us  {row['copy_fraction']:.3f} of copy  "
                  f"err {errors[name]:.1e}", flush=True)
        del sets
        torch.cuda.empty_cache()
    if a.out:
        rec = dict(schema="decode-variants-1", device=torch.cuda.get_device_name(0), versions=package_versions(),
                   date=utc_now(), command=" ".join(sys.argv),
                   copy_GBps=copy_GBps, rounds=a.rounds, rows=rows, seconds=time.time() - t0)
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


def cluster_occupancy(torch, page: int) -> int:
    """For clusters of S = 2 … 16 split programs (the decoding grid's batch 1, 16k keys): how many the GPU holds at
    once (``cuOccupancyMaxActiveClusters``), with each program's own shared memory and with the floor that keeps
    one program per SM (``decode.CLUSTER_SHARED_BYTES``). The split rule's batch 1 needs 8 clusters of 16."""
    import numpy as np

    from kernels_gpu import driver_launch
    from kernels_gpu.inference import decode
    s = bench.make_sets(torch, 1, 16384, page, 1, seed=0)[0]
    c = decode._prepare(s["q"], s["k"], s["v"], s["seqlens"], None, True, None, None, page, None, None)
    _, Ow = c.out.empty((c.B, c.H_q, c.N_new, c.d_v), c.storage, np.uint32)
    _, Lf = c.out.empty((c.B, c.H_q, c.N_new), "float32")
    floor = decode.CLUSTER_SHARED_BYTES
    print(f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    try:
        for S in (2, 4, 8, 10, 12, 14, 15, 16):
            args = decode._split_args(c, S, Ow, Lf, Lf, Lf)
            for least in (0, floor):
                decode.CLUSTER_SHARED_BYTES = least
                kernel, threads, shared = decode._split_program(c, False, S)
                n = driver_launch.max_active_clusters(kernel, args, (S, c.H_kv, c.B), threads, shared, S)
                print(f"S = {S:2d}, {shared:6d} bytes of shared memory a program: {n} clusters at once", flush=True)
    finally:
        decode.CLUSTER_SHARED_BYTES = floor
    return 0


DEFAULTS: dict = {}

if __name__ == "__main__":
    sys.exit(main())
