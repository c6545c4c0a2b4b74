"""Decoding at the memory-bandwidth limit, and packed batches against padded ones: kernels_gpu.decode_attention
beside the device-to-device copy rate and PyTorch SDPA, kernels_gpu.varlen_attention packed against padded, in one
run on one GPU.

    python -m benchmarks.decode --out benchmarks/results/<device>/decode.json [--quick]   # also writes decode.png
    python -m benchmarks.decode --plot benchmarks/results/<device>/decode.json            # the figure again, no GPU

**Decoding grid.** One decoding step, N_new = 1 new token per sequence, H_q = 32 query heads on H_kv = 8 KV heads
(GQA, G = 4), d = 128, float16 cache, every sequence ``context`` keys long, contexts 4k … 128k, batch 1, 8, 32.
Timed, each on the same inputs:

* ``kernels_gpu``: :func:`kernels_gpu.decode_attention` on a contiguous cache (B, 8, context, 128), key blocks of
  ``--page`` keys (so that its splits are those of the paged cache), the default split rule;
* ``kernels_gpu_paged``: the same data in a paged cache of ``--page``-key pages (default 256, flash-attn's paged
  granularity; vLLM uses 16) in a shuffled physical order, found through the block table;
* ``kernels_gpu_splits1``: the contiguous cache with num_splits = 1 (one program per sequence and KV head: FA2's
  grid, without Flash-Decoding);
* ``sdpa_<backend>``: ``torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` with q
  (B, 32, 1, 128) against the contiguous cache, under each of the flash, memory-efficient, cuDNN and math backends
  (a backend that refuses the shape or runs out of memory is recorded as an error), and ``sdpa_default``, the
  same call outside ``sdpa_kernel`` (PyTorch's own choice of backend, without the context manager's host time);
  ``sdpa_best`` is the fastest.

Every implementation is checked once against SDPA's output on the same inputs (float16 rule: max error ≤ 2e-2), and
paged against contiguous (bit for bit: same splits, same arithmetic). Times are CUDA-event medians, two ways:
``call`` — a pair of events around each call, as Python issues it (host time the GPU waits for is included), and
``graph`` — the calls captured once in a CUDA graph and replayed (the kernels' own time: what the bandwidth targets
are judged on; a serving stack captures its decoding step the same way): at least :data:`GRAPH_CALLS` calls per
graph, the input sets cycled (a graph of one call adds the graph's launch latency to it), in :data:`GRAPH_ROUNDS`
rounds with every implementation once per round, a record keeping the smallest of its rounds' medians. ``host_us``
is the host time of one call.
Input sets are rotated so that together they exceed twice the L2 cache (a repeat never finds its cache in L2).

Achieved bandwidth = bytes that must move / time, the bytes being the K and V cache read once, q read and O written
(``decode_bytes``); its ratio to the device-to-device copy rate measured in the same run (read + write bytes of a
``copy_`` of a 2 GiB buffer over its time), at the start and the end of the run (the larger is used). Beside it,
per shape, a copy of the same bytes (``copy_same_bytes``: each set's K copied, :func:`same_bytes_copy`): the rate a
plain copy reaches at this size, launch, ramp-up and tail included — what the 2 GiB copy spreads thin.

**Varlen.** 16 sequences of long-tailed lengths (lognormal, median 1024, σ = 1, clipped to [16, 8192], seed 0),
32 query heads on 8 KV heads, d = 128, float16, causal (a prefill): packed (``cu_seqlens``) against the same batch
padded to its longest sequence, both through :func:`kernels_gpu.varlen_attention` (the padded run attends to its
padding, which a key-padding mask would not make cheaper). Reported with the padding fraction (1 − Σn / (B·n_max))
and the fraction of attention work that padding adds (causal: Σ n² against B·n_max²).

**Prediction** (written before any measurement; the reasoning is in :mod:`kernels_gpu.inference.decode`'s header): graph
times at contexts ≥ 16k reach 80-95 % of the copy rate at batch 8 and 32, 65-85 % at batch 1 (4k: 30-60 %); call
times at batch 1 and contexts ≤ 16k are set by host time (about 60-120 µs for two launches), as SDPA's are;
num_splits = 1 is 5-10× slower at batch 1, contexts ≥ 32k; paged within 3 % of contiguous; ahead of SDPA's best
backend at batch 1, within ±10 % at batch 32 and long contexts. Varlen: packed faster than padded by more than the
padding fraction (the work saved grows with n², not n).

**Measured** (first, CUDA-core program only: H100, 2026-11-24, ``--quick``): graph times at 4k, 16k, 64k reached
77 %, 88 %, 91 % of the copy rate at batch 32 and 18 %, 34 %, 59 % at batch 1; paged 1.036-1.063× contiguous;
0.47-0.88× SDPA's best backend. **Now** (H100 80GB HBM3, 2026-11-27 06:18 UTC, the full grid, the tensor-core
program of :mod:`kernels_gpu.inference.decode_tc` with whole tiles by tensor copies (the copy engine, through tensor
maps), S = Q Kᵀ in two accumulator chains, its split rule of one program per SM, two-warp programs where the programs
outnumber the SMs, no register cap; the splits merged inside their thread-block cluster where the GPU holds the
clusters (batch 8: clusters of 2), else by the merge launch, launched early (batch 1); the lean host path of
:class:`kernels_gpu.inference.decode.DecodePlan`; graphs of at least 4 calls, 2 rounds;
``benchmarks/results/nvidia-h100/decode.json``, copy rate 3001 GB/s), graph times at 4k … 128k:

* batch 1: 40 %, 55 %, 71 %, 86 %, 94 %, 98 % of the copy rate (the 80 % target from 16k: met except at 16k,
  where a copy of the step's own bytes reaches 88 % and the kernel runs at 0.81× that copy; 0.72-0.73 in the runs
  before); batch 8: 89-104 % (97-104 % from 16k: met); batch 32: 100-105 % (103-105 % from 16k: met);
* num_splits = 1 is 7.0-7.9× slower at batch 1 from 32k (target ≥ 3×: met); paged 0.98-1.04× contiguous, bit
  for bit the same output (target within 10 %: met);
* against SDPA's best (cuDNN's kernels, whether chosen under ``sdpa_kernel`` or by PyTorch's default dispatch,
  ``sdpa_default``; flash at batch 8, 16k), graph time: 0.974-1.027× — as fast or faster at 10 of 18 shapes
  (batch 8 but at 16k, batch 32 but at 8k), 0.987-0.989× at those two, 0.974-0.994× at batch 1, where the 8
  clusters of 16 splits do not fit and the merge launch stays (target faster everywhere: missed at 8 shapes). The
  runs before the cluster merge (06:01 and ``decode_same_bytes.json``, same day) gave 0.967-1.007× and
  0.959-1.008×, as fast or faster at 6 and 5 shapes; batch 8 gained 1-4 % (``decode_cluster_ab.json``);
* call times (a Python call between two events, host time included): 0.59-1.05× SDPA's best call (PyTorch's
  default dispatch at most shapes: 19-147 µs of host time a call in C++, where this program's plan spends 32-107
  µs in Python; ``benchmarks.profilers.decode_host`` takes a call apart) — behind most at batch 1 with short contexts,
  where the host time is most of the call; against SDPA's cuDNN backend under ``sdpa_kernel`` faster at 10 of 18;
* varlen (16 sequences, 71 % padding, 85 % of the padded causal work): packed 5.2× faster than padded, same
  output (target: met).

**On an H200** (2026-11-27 06:37 UTC, the same program and harness as the H100's run above,
``benchmarks/results/nvidia-h200/decode.json``, copy rate 4243 GB/s, 1.41× the H100's): batch 1 reaches 33 %,
46 %, 63 %, 79 %, 89 %, 96 % of the copy rate at 4k … 128k (16k: 25.0 µs), batch 8 83-104 %, batch 32 96-104 %;
SDPA's best is faster at 16 of 18 shapes, ours at 0.949-0.986× its speed there and 1.008-1.012× at batch 1 and 8
with 4k keys (the run before the cluster merge and the lean host path, same day: faster at every shape,
0.92-0.99×). The copy of the same bytes says how much of batch 1's shortfall any kernel pays at these sizes: at
batch 1 it reaches 68 %, 81 %, 86 %, 92 %, 97 %, 99 % of the 2 GiB rate (16k: 67 MB in 18.4 µs), so at 16k this
program runs at 0.74× a copy of its own bytes and cuDNN at 0.77×; from batch 8 at 32k and batch 32 at 8k on, ours
outruns the same-bytes copy (1.01-1.08×). (The copy's graph time is a memcpy node, which ran at 0.61-0.64 of the
2 GiB rate from 0.5 GB up — presumably on a copy engine rather than the copy kernel a stream's copy runs; not
profiled —, so the record takes the faster of its graph and stream timings.)
The knobs of :mod:`benchmarks.profilers.decode_variants` on the H200 (``decode_h200_knobs.json``: three or four stages,
eight warps, 32 splits; at batch 1 with 16k and 32k keys, batch 8 and 32 at 16k) were all slower than the defaults,
by 0.4-8 %: the H100's choices hold on the H200. The H100 grid again with the same-bytes copy (same day,
``benchmarks/results/nvidia-h100/decode_same_bytes.json``, copy rate 3004 GB/s): batch 1 at 16k 0.72 of the copy
rate as in ``decode.json``, where a copy of the same bytes reaches 0.88 — the kernel at 0.82× that copy; from 32k
keys at batch 8 and 8k at batch 32 it outruns the copy (1.03-1.07×); against cuDNN 0.96-1.01× (faster at 5 of 18
shapes, within 1.3 % at 12 more; the run of 2026-11-26 20:30: 8 of 18): the shapes where it leads move by a
percent from run to run.

The previous runs timed graphs of one call where one input set filled twice the L2 (batch 1 from 32k keys, batch 8
and 32 at every context) and timed each implementation once, the first of a shape right after the previous shape's
SDPA math backend: their batch-1 32k figure (0.75-0.78) carried the graph's launch latency, and their batch-32 4k
figure (0.79) a slow timing after that backend. The
harness now captures at least :data:`GRAPH_CALLS` calls per graph and times in rounds, SDPA's math backend last
(``decode_sets_{1,2,4}.json`` from :mod:`benchmarks.profilers.decode_variants`; the comments at the constants).

The JSON holds the device, versions, date, settings, the copy rates, every record, per-configuration summaries and
the decoding targets with the measured numbers. ``--quick`` runs contexts 4k, 16k, 64k at batch 1 and
32 and a smaller varlen batch (under a minute); the full grid takes about 3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

H_Q, H_KV, D = 32, 8, 128
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
BATCHES = (1, 8, 32)
QUICK_CONTEXTS = (4096, 16384, 65536)
QUICK_BATCHES = (1, 32)
PAGE = 256
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
#: the decoding targets (DESIGN.md's inference section)
TARGET_COPY_FRACTION = 0.80          # bytes / graph time ≥ 80 % of the copy rate, contexts ≥ 16k
TARGET_SPLIT_SPEEDUP = 3.0           # ≥ 3× num_splits = 1 at batch 1, contexts ≥ 32k
TARGET_PAGED_RATIO = 1.10            # paged time within 10 % of contiguous
FP16_TOLERANCE = 2e-2


# -- the byte and work counts (no GPU) ----------------------------------------------------------------------------

def decode_bytes(batch: int, H_q: int, H_kv: int, N_new: int, d: int, d_v: int, seqlens, itemsize: int = 2) -> int:
    """Bytes a decoding step must move: every sequence's cached K and V read once (per KV head: n_b·(d + d_v)
    elements), the queries read and the outputs written (B·H_q·N_new·(d + d_v) elements), ``itemsize`` bytes each.
    The log-sum-exps and the split partials are left out: the kernel's own overheads, not the problem's."""
    seqlens = list(seqlens)
    if len(seqlens) != batch:
        raise ValueError(f"seqlens must have one length per sequence ({batch}), got {len(seqlens)}")
    cache = H_kv * (d + d_v) * sum(int(n) for n in seqlens)
    return itemsize * (cache + batch * H_q * N_new * (d + d_v))


def padding_stats(lengths) -> dict:
    """Token padding fraction 1 − Σn / (B·n_max) and the causal attention work padding adds: 1 − Σn² / (B·n_max²)."""
    n = [int(x) for x in lengths]
    if not n or max(n) == 0:
        return dict(padding_fraction=0.0, padded_work_fraction=0.0, tokens=sum(n), padded_tokens=0)
    B, top = len(n), max(n)
    return dict(padding_fraction=1 - sum(n) / (B * top),
                padded_work_fraction=1 - sum(x * x for x in n) / (B * top * top),
                tokens=sum(n), padded_tokens=B * top)


def long_tailed_lengths(count: int, median: int = 1024, sigma: float = 1.0, low: int = 16, high: int = 8192,
                        seed: int = 0) -> list:
    """``count`` lengths drawn lognormal (median, σ), clipped to [low, high], from ``seed``."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(math.log(median), sigma, size=count), low, high).astype(int)]


def summarize(records: list, copy_GBps: float) -> tuple[list, dict]:
    """Per (batch, context): the best SDPA backend, and our kernel against it, against num_splits = 1 and paged
    against contiguous (graph times; call times beside); then the decoding targets."""
    by = {}
    for r in records:
        if r.get("status") == "ok":
            by.setdefault((r["batch"], r["context"]), {})[r["impl"]] = r
    rows = []
    for (batch, context), impls in sorted(by.items()):
        row = dict(batch=batch, context=context)
        sdpa = [r for name, r in impls.items() if name.startswith("sdpa_")]
        for mode in ("graph", "call"):
            key = f"ms_{mode}"
            ours = impls.get("kernels_gpu", {}).get(key)
            best = min((r for r in sdpa if r.get(key)), key=lambda r: r[key], default=None)
            row[f"sdpa_best_{mode}"] = best["impl"] if best else None
            row[f"sdpa_best_ms_{mode}"] = best[key] if best else None
            row[f"vs_sdpa_{mode}"] = best[key] / ours if best and ours else None
            s1 = impls.get("kernels_gpu_splits1", {}).get(key)
            row[f"speedup_vs_splits1_{mode}"] = s1 / ours if s1 and ours else None
            paged = impls.get("kernels_gpu_paged", {}).get(key)
            row[f"paged_over_contiguous_{mode}"] = paged / ours if paged and ours else None
            row[f"copy_fraction_{mode}"] = impls.get("kernels_gpu", {}).get(f"copy_fraction_{mode}")
        # a copy of the same bytes (graph times): its rate against the 2 GiB copy's, and our time against its time
        same = impls.get("copy_same_bytes", {})
        ours = impls.get("kernels_gpu", {}).get("ms_graph")
        row["same_bytes_copy_fraction_graph"] = same.get("copy_fraction_graph")
        row["vs_same_bytes_copy_graph"] = same["ms_graph"] / ours if same.get("ms_graph") and ours else None
        rows.append(row)
    targets = {}
    checks = [(r, r["copy_fraction_graph"]) for r in rows if r["context"] >= 16384 and r["copy_fraction_graph"]]
    targets["copy_fraction_ge_0.8_at_16k_plus"] = dict(
        passed=bool(checks) and all(v >= TARGET_COPY_FRACTION for _, v in checks),
        values={f"B{r['batch']}-{r['context']}": round(v, 3) for r, v in checks})
    checks = [(r, r["speedup_vs_splits1_graph"]) for r in rows
              if r["batch"] == 1 and r["context"] >= 32768 and r["speedup_vs_splits1_graph"]]
    targets["splits_speedup_ge_3_batch1_32k_plus"] = dict(
        passed=bool(checks) and all(v >= TARGET_SPLIT_SPEEDUP for _, v in checks),
        values={f"B1-{r['context']}": round(v, 2) for r, v in checks})
    for mode in ("graph", "call"):
        checks = [(r, r[f"vs_sdpa_{mode}"]) for r in rows if r[f"vs_sdpa_{mode}"]]
        targets[f"faster_than_sdpa_best_{mode}"] = dict(
            passed=bool(checks) and all(v > 1.0 for _, v in checks),
            values={f"B{r['batch']}-{r['context']}": round(v, 3) for r, v in checks})
    checks = [(r, r["paged_over_contiguous_graph"]) for r in rows if r["paged_over_contiguous_graph"]]
    targets["paged_within_10pct"] = dict(passed=bool(checks) and all(v <= TARGET_PAGED_RATIO for _, v in checks),
                                         values={f"B{r['batch']}-{r['context']}": round(v, 3) for r, v in checks})
    return rows, targets


# -- measurements (GPU) -------------------------------------------------------------------------------------------

def _median_ms(samples):
    return statistics.median(samples) if samples else None


def copy_rate_GBps(torch, nbytes: int = 2 * 2**30, repeats: int = 20) -> float:
    """Device-to-device copy: (read + write bytes) / time of ``dst.copy_(src)``, median of ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def time_calls(torch, fn, sets, target_ms: float, min_rep: int = 5, max_rep: int = 50) -> list:
    """ms of each call between a pair of CUDA events, cycling through the input sets (after a warm-up of each)."""
    for s in sets:
        fn(s)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(sets[0])
    end.record()
    end.synchronize()
    reps = int(min(max_rep, max(min_rep, target_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for r in range(reps):
        start.record()
        fn(sets[r % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


#: calls captured in one graph at least (the input sets cycled): a graph of a single call adds the graph's own
#: launch latency to that call — against 4 calls, +6 µs at batch 1, 16k keys and +26 µs at batch 32, 4k on an H100
#: (cuDNN's: +8 and +10; ``decode_sets_{1,2,4}.json``); with 4 calls a call's time is that of calls issued back to
#: back, as the kernels of a captured decoding step are
GRAPH_CALLS = 4


#: rounds of graph timings per shape (see run_decode_grid)
GRAPH_ROUNDS = 2


def time_graph(torch, fn, sets, target_ms: float, min_rep: int = 5, max_rep: int = 50,
               min_calls: int = GRAPH_CALLS) -> list:
    """ms per call of the calls captured in one CUDA graph — one call per input set, the sets cycled until there
    are at least ``min_calls`` —, replayed."""
    sets = [sets[i % len(sets)] for i in range(max(len(sets), min_calls))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sets:
            fn(s)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):          # the warmed-up stream: nothing new to set up inside
        for s in sets:
            fn(s)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    per_replay = start.elapsed_time(end)
    reps = int(min(max_rep, max(min_rep, target_ms / max(per_replay, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(sets))
    del graph
    return times


def host_time_us(torch, fn, sets, calls: int = 20) -> float:
    """Median host time of one call (perf_counter, no synchronisation inside the timed region)."""
    times = []
    for i in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(sets[i % len(sets)])
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def make_sets(torch, batch: int, context: int, page: int, n_sets: int, seed: int) -> list:
    """``n_sets`` input sets: q, a contiguous cache, the same keys in a shuffled paged cache, the block table and
    the lengths (int32 on the device, so that nothing is copied per call)."""
    sets = []
    pages = context // page
    for i in range(n_sets):
        g = torch.Generator(device="cuda").manual_seed(seed + i)
        q = torch.randn(batch, H_Q, 1, D, device="cuda", generator=g, dtype=torch.float16)
        k = torch.randn(batch, H_KV, context, D, device="cuda", generator=g, dtype=torch.float16)
        v = torch.randn(batch, H_KV, context, D, device="cuda", generator=g, dtype=torch.float16)
        perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed + i))
        table = perm.reshape(batch, pages).to(torch.int32).cuda()
        kp = torch.empty(batch * pages, H_KV, page, D, device="cuda", dtype=torch.float16)
        vp = torch.empty_like(kp)
        for b in range(batch):
            # sequence b's logical page p (keys p·page …) to physical page table[b, p]
            kp[table[b].long()] = k[b].reshape(H_KV, pages, page, D).transpose(0, 1)
            vp[table[b].long()] = v[b].reshape(H_KV, pages, page, D).transpose(0, 1)
        seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        sets.append(dict(q=q, k=k, v=v, kp=kp, vp=vp, table=table, seqlens=seqlens))
    return sets


def _sdpa(torch, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]

    def call(s):
        with sdpa_kernel(which):
            return torch.nn.functional.scaled_dot_product_attention(s["q"], s["k"], s["v"], enable_gqa=True)
    return call


def decode_impls(torch, page: int) -> dict:
    import kernels_gpu

    def ours(s, **kw):
        return kernels_gpu.decode_attention(s["q"], s["k"], s["v"], s["seqlens"], block_size=page, **kw).O
    impls = {
        "kernels_gpu": lambda s: ours(s),
        "kernels_gpu_paged": lambda s: kernels_gpu.decode_attention(s["q"], s["kp"], s["vp"], s["seqlens"],
                                                                    s["table"]).O,
        "kernels_gpu_splits1": lambda s: ours(s, num_splits=1),
        # the first split program (FMA units, kernels_gpu.inference.decode.split_kernel), beside the tensor-core default
        "kernels_gpu_cuda_core": lambda s: ours(s, kernel="cuda_core"),
    }
    for backend in SDPA_BACKENDS:
        impls[f"sdpa_{backend}"] = _sdpa(torch, backend)
    # SDPA as most code calls it, PyTorch choosing the backend: the same kernels as one of the above, without the
    # host time of entering and leaving sdpa_kernel (benchmarks.profilers.decode_host measures it)
    impls["sdpa_default"] = lambda s: torch.nn.functional.scaled_dot_product_attention(s["q"], s["k"], s["v"],
                                                                                       enable_gqa=True)
    return impls


def run_decode_grid(torch, batches, contexts, page, copy_GBps, target_ms, progress) -> list:
    from kernels_gpu.inference import decode
    records = []
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    configs = [(b, c) for b in batches for c in contexts]
    for batch, context in progress(configs, desc="decode grid"):
        cache_bytes = batch * H_KV * context * D * 2 * 2
        free, _ = torch.cuda.mem_get_info()
        base = dict(batch=batch, context=context, H_q=H_Q, H_kv=H_KV, d=D, N_new=1, dtype="float16", page=page)
        if 2.3 * cache_bytes > 0.9 * free:
            records.append(dict(base, impl="all", status="skipped", error=f"needs ~{2.3 * cache_bytes / 1e9:.1f} GB,"
                                f" {free / 1e9:.1f} GB free"))
            continue
        n_sets = max(1, min(8, math.ceil(2 * l2 / cache_bytes)))
        sets = make_sets(torch, batch, context, page, n_sets, seed=batch * 1000 + context // 1024)
        nbytes = decode_bytes(batch, H_Q, H_KV, 1, D, D, [context] * batch)
        reference = None
        outputs = {}
        impls = decode_impls(torch, page)
        # sets and outputs are passed, not bound as defaults, so that the del at the end of the iteration frees them
        def time_calls_of(name, sets, outputs, impls=impls, base=base, nbytes=nbytes, n_sets=n_sets,
                          cache_bytes=cache_bytes):
            """Check one implementation's output and time its calls; append its record."""
            fn = impls[name]
            rec = dict(base, impl=name, bytes=nbytes, sets=n_sets)
            if name == "sdpa_math" and 6 * cache_bytes > 0.9 * torch.cuda.mem_get_info()[0]:
                records.append(dict(rec, status="skipped", error="math backend: K/V expanded for GQA would not fit"))
                return
            try:
                out = fn(sets[0])
                torch.cuda.synchronize()
                outputs[name] = out
                if name.startswith("kernels_gpu"):
                    s = sets[0]
                    paged = name == "kernels_gpu_paged"
                    k_, v_, t_ = (s["kp"], s["vp"], s["table"]) if paged else (s["k"], s["v"], None)
                    rec["num_splits"] = decode.planned_splits(
                        s["q"], k_, v_, s["seqlens"], t_, num_splits=1 if name.endswith("splits1") else None,
                        block_size=None if t_ is not None else page,
                        kernel="cuda_core" if name.endswith("cuda_core") else None)
                calls = time_calls(torch, fn, sets, target_ms)
                rec.update(status="ok", ms_call=_median_ms(calls), repeats_call=len(calls),
                           host_us=host_time_us(torch, fn, sets))
            except Exception as exc:  # noqa: BLE001 (a backend that refuses the shape is a result too)
                rec.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                torch.cuda.synchronize()
                records.append(rec)
                return
            records.append(rec)

        # SDPA's math backend (30-40× slower, compute-bound) last, and by calls only: timed right after it, a
        # launch came out 16-19 % slower in both graph rounds than the same launch timed later (2026-11-26 H100
        # runs: batch 32 at 4k, 16k, 32k; batch 8 at 64k, 128k) — presumably the card recovering from its load.
        first = len(records)
        for name in impls:
            if name != "sdpa_math":
                time_calls_of(name, sets, outputs)
        # Graph times in GRAPH_ROUNDS rounds, every implementation once per round in turn; a record keeps the
        # smallest of its rounds' medians.
        timed = [(r, impls[r["impl"]]) for r in records[first:] if r.get("status") == "ok"]
        for _ in range(GRAPH_ROUNDS):
            for rec, fn in timed:
                if rec.get("graph_error"):
                    continue
                try:
                    graph = time_graph(torch, fn, sets, target_ms)
                    rec.setdefault("ms_graph_rounds", []).append(_median_ms(graph))
                    rec["repeats_graph"] = len(graph)
                except Exception as exc:  # noqa: BLE001 (no graph: the call times stand alone)
                    rec.update(graph_error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    torch.cuda.synchronize()
        if "sdpa_math" in impls:
            time_calls_of("sdpa_math", sets, outputs)
        for rec in records[first:]:
            if rec.get("status") != "ok":
                continue
            rec["ms_graph"] = min(rec["ms_graph_rounds"]) if rec.get("ms_graph_rounds") else None
            for mode in ("call", "graph"):
                ms = rec.get(f"ms_{mode}")
                rec[f"GBps_{mode}"] = nbytes / (ms * 1e-3) / 1e9 if ms else None
                rec[f"copy_fraction_{mode}"] = rec[f"GBps_{mode}"] / copy_GBps if ms else None
        # correct first: every output against the best available SDPA output, paged against contiguous
        for name in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"):
            if name in outputs:
                reference = outputs[name].float()
                break
        for rec in records[-len(decode_impls(torch, page)):]:
            if rec.get("status") == "ok" and reference is not None:
                err = (outputs[rec["impl"]].float() - reference).abs().max().item()
                rec["max_error_vs_sdpa"] = err
                if err > FP16_TOLERANCE or math.isnan(err):
                    rec["status"], rec["error"] = "wrong", f"max error {err:.3e} against SDPA"
        if "kernels_gpu" in outputs and "kernels_gpu_paged" in outputs:
            same = bool(torch.equal(outputs["kernels_gpu"], outputs["kernels_gpu_paged"]))
            for rec in records[-len(decode_impls(torch, page)):]:
                if rec["impl"] == "kernels_gpu_paged":
                    rec["bitwise_equal_to_contiguous"] = same
        records.append(same_bytes_copy(torch, sets, base, target_ms, copy_GBps))
        del sets, outputs, reference
        torch.cuda.empty_cache()
    return records


def same_bytes_copy(torch, sets, base: dict, target_ms: float, copy_GBps: float) -> dict:
    """The record of a device-to-device copy of each set's K into a scratch tensor (K's bytes read and written: the
    cache's K and V bytes), timed both ways the decoding steps are — calls between CUDA events (as
    :func:`copy_rate_GBps` times its 2 GiB copy) and CUDA graphs (the sets in turn, ``GRAPH_ROUNDS`` rounds, the
    smallest median) — and reported at the faster of the two (``ms_graph``; a graph's copies are memcpy nodes, which
    ran slower than a stream's copy from 0.5 GB up on an H200). What merely moving a
    step's bytes costs at this size: launch, ramp-up and tail included, which the 2 GiB copy spreads over 1000× more
    bytes."""
    scratch = torch.empty_like(sets[0]["k"])
    nbytes = 2 * scratch.numel() * scratch.element_size()

    def copy(s):
        return scratch.copy_(s["k"])
    calls = _median_ms(time_calls(torch, copy, sets, target_ms))
    rounds = [_median_ms(time_graph(torch, copy, sets, target_ms)) for _ in range(GRAPH_ROUNDS)]
    ms = min([calls] + rounds)
    GBps = nbytes / (ms * 1e-3) / 1e9
    return dict(base, impl="copy_same_bytes", status="ok", bytes=nbytes, ms_copy_call=calls,
                ms_copy_graph_rounds=rounds, ms_graph=ms, ms_call=None, GBps_graph=GBps,
                copy_fraction_graph=GBps / copy_GBps)


def run_varlen(torch, count: int, target_ms: float) -> list:
    import numpy as np

    import kernels_gpu
    lengths = long_tailed_lengths(count)
    top = max(lengths)
    records = []
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    g = torch.Generator(device="cuda").manual_seed(17)
    packed = [torch.randn(H, int(offsets[-1]), D, device="cuda", generator=g, dtype=torch.float16)
              for H in (H_Q, H_KV, H_KV)]
    # the padded batch holds the same tokens, each sequence followed by zeros up to the longest
    padded = [torch.zeros(x.shape[0], count * top, D, device="cuda", dtype=torch.float16) for x in packed]
    for b in range(count):
        for x, y in zip(packed, padded):
            y[:, b * top:b * top + lengths[b]] = x[:, offsets[b]:offsets[b + 1]]
    layouts = {"packed": (packed, offsets), "padded": (padded, np.arange(count + 1, dtype=np.int64) * top)}
    outputs = {}
    for layout, ((q, k, v), cu) in layouts.items():
        sets = [dict(q=q, k=k, v=v, cu=cu)]
        ns = np.diff(cu)

        def fn(s):
            return kernels_gpu.varlen_attention(s["q"], s["k"], s["v"], s["cu"], s["cu"], causal=True).O
        rec = dict(layout=layout, sequences=count, tokens=int(cu[-1]), H_q=H_Q, H_kv=H_KV, d=D, dtype="float16",
                   causal=True)
        try:
            outputs[layout] = fn(sets[0])
            times = time_calls(torch, fn, sets, target_ms, min_rep=3, max_rep=20)
            work = sum(int(n) * int(n) for n in ns) * H_Q * D * 2          # 4·n²·d per head, halved by causality
            rec.update(status="ok", ms=_median_ms(times), repeats=len(times),
                       tflops=work / (_median_ms(times) * 1e-3) / 1e12)
        except Exception as exc:  # noqa: BLE001
            rec.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        records.append(rec)
    stats = padding_stats(lengths)
    ok = {r["layout"]: r for r in records if r.get("status") == "ok"}
    summary = dict(lengths=lengths, **stats)
    if len(ok) == 2:
        packed, padded = ok["packed"]["ms"], ok["padded"]["ms"]
        summary.update(speedup=padded / packed, target_ms=padded * (1 - stats["padding_fraction"]),
                       passed=packed <= padded * (1 - stats["padding_fraction"]))
        # a padded sequence's first n rows see only its n real keys (causal): the packed run's answer
        err = max((outputs["packed"][:, offsets[b]:offsets[b + 1]].float()
                   - outputs["padded"][:, b * top:b * top + lengths[b]].float()).abs().max().item()
                  for b in range(count))
        summary["max_difference_packed_vs_padded"] = err
    return [dict(r) for r in records] + [dict(summary=summary)]


# -- the figure -------------------------------------------------------------------------------------------------

def plot(results: dict, path: str) -> str:
    """Achieved GB/s against context, a panel per batch: our kernel (contiguous, paged, num_splits = 1) and SDPA's
    best backend (graph times; our call times dotted), against the copy rate and 80 % of it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [r for r in results["decode"] if r.get("status") == "ok"]
    batches = sorted({r["batch"] for r in recs})
    copy = results["copy_GBps"]["used"]
    fig, axes = plt.subplots(1, max(1, len(batches)), figsize=(4.2 * max(1, len(batches)), 3.6), squeeze=False)
    styles = {"kernels_gpu": ("tab:blue", "-", "kernels_gpu"), "kernels_gpu_paged": ("tab:green", "--", "paged"),
              "kernels_gpu_splits1": ("tab:gray", ":", "num_splits=1"),
              "kernels_gpu_cuda_core": ("tab:purple", "-.", "CUDA-core program")}
    for ax, batch in zip(axes[0], batches):
        here = [r for r in recs if r["batch"] == batch]
        contexts = sorted({r["context"] for r in here})
        for impl, (color, ls, label) in styles.items():
            pts = sorted((r["context"], r["GBps_graph"]) for r in here if r["impl"] == impl and r["GBps_graph"])
            if pts:
                ax.plot(*zip(*pts), color=color, ls=ls, marker="o", ms=3, label=label)
        pts = sorted((r["context"], r["GBps_call"]) for r in here if r["impl"] == "kernels_gpu")
        if pts:
            ax.plot(*zip(*pts), color="tab:blue", ls="", marker="x", ms=4, label="kernels_gpu, Python call")
        best = {}
        for r in here:
            if r["impl"].startswith("sdpa_") and r["GBps_graph"]:
                best[r["context"]] = max(best.get(r["context"], 0.0), r["GBps_graph"])
        if best:
            ax.plot(*zip(*sorted(best.items())), color="tab:red", marker="s", ms=3, label="SDPA, best backend")
        pts = sorted((r["context"], r["GBps_graph"]) for r in here if r["impl"] == "copy_same_bytes")
        if pts:
            ax.plot(*zip(*pts), color="black", ls=":", marker="^", ms=3, label="copy of the same bytes")
        ax.axhline(copy, color="black", lw=1, label=f"copy rate {copy:.0f} GB/s")
        ax.axhline(TARGET_COPY_FRACTION * copy, color="black", lw=0.8, ls="--", label="80 % of copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}k" for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (keys per sequence)")
        ax.set_title(f"batch {batch}")
        ax.set_ylim(0, 1.15 * max([copy] + [r["GBps_graph"] or 0 for r in here]))
    axes[0][0].set_ylabel("GB/s: (K, V, q, O bytes) / time")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False, fontsize=8)
    fig.suptitle(f"Decoding, N_new = 1, H_q = 32, H_kv = 8, d = 128, fp16 — {results['device']}, "
                 f"{results['date'][:10]}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


# -- the run ---------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results JSON (default: benchmarks/results/<device>/decode.json)")
    parser.add_argument("--png", help="figure (default: the JSON's path with .png)")
    parser.add_argument("--quick", action="store_true", help="contexts 4k, 16k, 64k; batch 1 and 32; fewer varlen")
    parser.add_argument("--page", type=int, default=PAGE, help="page size of the paged cache (keys)")
    parser.add_argument("--target-ms", type=float, default=60.0, help="timed work per measurement")
    parser.add_argument("--plot", metavar="JSON", help="only draw the figure of an existing results file")
    args = parser.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            results = json.load(f)
        print(plot(results, args.png or os.path.splitext(args.plot)[0] + ".png"))
        return 0
    if any(c % args.page for c in CONTEXTS):
        parser.error("--page must divide every context (4096 … 131072)")

    from tqdm import tqdm

    from benchmarks.harness.results_io import default_results_path, utc_now
    from benchmarks.harness.timing import cuda_setup, package_versions
    cuda_setup(use_torch_allocator=False)
    import torch

    from kernels_gpu import driver_launch
    device = torch.cuda.get_device_name(0)
    out = args.out or default_results_path(device, "decode")
    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
    started = time.time()
    copy_start = copy_rate_GBps(torch)
    print(f"{device}: device-to-device copy {copy_start:.0f} GB/s", flush=True)
    records = run_decode_grid(torch, batches, contexts, args.page, copy_start, args.target_ms, tqdm)
    varlen = run_varlen(torch, 8 if args.quick else 16, args.target_ms)
    copy_end = copy_rate_GBps(torch)
    copy_used = max(copy_start, copy_end)
    for r in records:                       # fractions against the larger of the two copy measurements
        for mode in ("call", "graph"):
            if r.get(f"GBps_{mode}"):
                r[f"copy_fraction_{mode}"] = r[f"GBps_{mode}"] / copy_used
    rows, targets = summarize(records, copy_used)
    varlen_summary = varlen[-1]["summary"]
    targets["varlen_packed_faster_by_padding_share"] = dict(passed=bool(varlen_summary.get("passed")),
                                                           values={k: varlen_summary.get(k) for k in (
                                                               "speedup", "padding_fraction",
                                                               "padded_work_fraction")})
    results = dict(schema="decode-1", device=device, versions=package_versions(), date=utc_now(),
                   command=" ".join(sys.argv), settings=dict(vars(args), H_q=H_Q, H_kv=H_KV, d=D, batches=batches,
                                                             contexts=contexts,
                                                             merge_launched_early=driver_launch.pdl_available()),
                   copy_GBps=dict(start=copy_start, end=copy_end, used=copy_used), decode=records,
                   decode_summary=rows, varlen=varlen, targets=targets, seconds=time.time() - started)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    png = plot(results, args.png or os.path.splitext(out)[0] + ".png")
    print(f"copy {copy_start:.0f} / {copy_end:.0f} GB/s")
    for row in rows:
        print(f"B={row['batch']:2d} ctx={row['context'] // 1024:4d}k  "
              f"copy fraction {row['copy_fraction_graph'] or 0:.2f} "
              f"(call {row['copy_fraction_call'] or 0:.2f})  vs splits=1 {row['speedup_vs_splits1_graph'] or 0:.2f}x  "
              f"paged/contig {row['paged_over_contiguous_graph'] or 0:.3f}  vs {row['sdpa_best_graph']} "
              f"{row['vs_sdpa_graph'] or 0:.2f}x (call {row['vs_sdpa_call'] or 0:.2f}x)  copy of the same bytes "
              f"{row['same_bytes_copy_fraction_graph'] or 0:.2f}, ours at {row['vs_same_bytes_copy_graph'] or 0:.2f}x "
              f"its speed")
    print(f"varlen: {json.dumps({k: v for k, v in varlen_summary.items() if k != 'lengths'})}")
    for name, t in targets.items():
        print(f"target {name}: {'PASS' if t['passed'] else 'FAIL'} {t['values']}")
    print(f"wrote {out} and {png} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
