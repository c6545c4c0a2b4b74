"""Ring attention on several GPUs: strong and weak scaling over NCCL, beside one-GPU attention and the simulator.

``fa2edu.distributed.ring_attention`` runs on a ring of W ranks, one GPU each. This script measures it and writes
a results file (JSON, ``benchmarks.harness.results_io``'s schema) with the device, the versions and the date:

1. **check first**: for every ring size W, layout and dtype, the ring's output on a small sequence, unsharded,
   against float64 attention on one GPU, with the error of one-GPU attention in the same dtype (PyTorch SDPA) as
   the yardstick: the ring passes when its error is at most twice SDPA's plus a small floor. A configuration that
   fails is recorded as ``wrong`` and not timed;
2. **the link and the rate**: the bandwidth of one ring exchange per direction (a large buffer sent to the next
   rank while one arrives from the previous), and the FLOP rate of a single GPU on one full ring step (the W = 1
   ring, non-causal, N_local tokens) for every dtype and N_local the runs use;
3. **strong scaling** (fixed total N) and **weak scaling** (fixed N per GPU) over W = 1, 2, 4, 8 (those the
   machine has), contiguous and zigzag, causal, bf16 and fp32 by default: every rank's time (CUDA events, median
   of the repeats, a barrier before each), and beside it what ``fa2edu.simulate_context_parallel`` predicts with
   the measured link and rate: every rank's time, the idle fractions, whether each step's compute hides its
   transfer (``predicted_comm_hidden``: every step's compute covers its transfer; ``predicted_comm_ms``: what
   communication adds to the ring's time); one-GPU attention (PyTorch SDPA) at the same N for comparison.

Launch it with torchrun (one process per GPU)::

    torchrun --nproc_per_node=8 -m benchmarks.context_parallel --out benchmarks/results/DEVICE/context_parallel.json

or let it start its own processes, one per visible GPU::

    python -m benchmarks.context_parallel --out context_parallel.json

Every process keeps ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) and every collective runs under a timeout. On a
machine with one GPU it runs the single-device path and the W = 1 ring, and the results file lists what it could
not run (``summary.not_run``). ``--dry-run`` runs the whole logic on the CPU: a world of 2 processes on gloo, tiny
sizes (``python -m benchmarks.context_parallel --dry-run --out /tmp/cp.json``); its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import queue as queue_module
import statistics
import sys
import tempfile
import time
import traceback

from benchmarks.harness import results_io

EXAMPLES = """examples:
  torchrun --nproc_per_node=8 -m benchmarks.context_parallel --out cp.json
  torchrun --nproc_per_node=2 -m benchmarks.context_parallel --world-sizes 1,2 --dtypes bfloat16 --out cp.json
  python -m benchmarks.context_parallel --out cp.json            # one process per visible GPU
  python -m benchmarks.context_parallel --dry-run --out /tmp/cp.json   # CPU, gloo, 2 processes, tiny sizes
"""

DTYPES = ("float16", "bfloat16", "float32")
LAYOUTS = ("contiguous", "zigzag")
#: The check's absolute floor beside twice SDPA's error, by dtype (max-norm of O, whose entries are O(1)).
FLOOR = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-12}
DRY_RUN = dict(world_sizes=[1, 2], strong_N=16, weak_N=8, d=8, heads=2, batch=1, dtypes=["float32", "bfloat16"],
               repeats=2, warmup=1, check_local=8, link_mib=1, timeout_s=60, budget_s=60)


# -- arguments ----------------------------------------------------------------------------------------------------

def _ints(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _choices(allowed):
    def parse(text):
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(allowed)}, "
                                             f"got {text!r}")
        return values
    return parse


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.context_parallel", description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the results file to write (JSON)")
    parser.add_argument("--world-sizes", type=_ints, default=[1, 2, 4, 8],
                        help="ring sizes W to run, those up to the processes started (default 1,2,4,8)")
    parser.add_argument("--strong-N", type=int, default=32768, help="total tokens of strong scaling (default 32768)")
    parser.add_argument("--weak-N", type=int, default=8192, help="tokens per GPU of weak scaling (default 8192)")
    parser.add_argument("--d", type=int, default=128, help="head dimension (default 128)")
    parser.add_argument("--heads", type=int, default=16, help="heads (default 16)")
    parser.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    parser.add_argument("--dtypes", type=_choices(DTYPES + ("float64",)), default=["bfloat16", "float32"],
                        help="dtypes (default bfloat16,float32)")
    parser.add_argument("--layouts", type=_choices(LAYOUTS), default=list(LAYOUTS),
                        help="layouts (default contiguous,zigzag)")
    parser.add_argument("--non-causal", action="store_true", help="time the non-causal ring instead of causal")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per configuration (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--check-local", type=int, default=512,
                        help="tokens per rank of the correctness check (default 512)")
    parser.add_argument("--link-mib", type=int, default=256,
                        help="MiB per direction of the link measurement (default 256)")
    parser.add_argument("--timeout-s", type=int, default=300,
                        help="timeout of every collective, seconds (default 300)")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="stop starting new configurations after this many seconds (default 480)")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="processes to start without torchrun (default: one per visible GPU; 2 with --dry-run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU only: gloo, 2 processes, tiny sizes; proves the logic, times nothing useful")
    return parser


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    for name in ("strong_N", "weak_N", "d", "heads", "batch", "repeats", "check_local", "link_mib", "timeout_s"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be at least 0, got {args.warmup}")
    args.causal = not args.non_causal
    return args


def _sizes(args, world: int) -> list[tuple[str, int, int]]:
    """(scaling, W, N) of every ring to time: strong at fixed total N, weak at fixed N per rank."""
    out = []
    for W in sorted(w for w in args.world_sizes if w <= world):
        out.append(("strong", W, args.strong_N))
        out.append(("weak", W, args.weak_N * W))
    return out


def _splittable(N: int, W: int, layout: str) -> bool:
    return N % (W if layout == "contiguous" else 2 * W) == 0


# -- one process of the world -------------------------------------------------------------------------------------

class Rank:
    """This process: its rank, the world, the device, and the groups of the rings (prefixes of the world)."""

    def __init__(self, rank: int, world: int, init_method: str, args):
        os.environ["NCCL_NVLS_ENABLE"] = "0"          # NVLink multicast off, in every process (set before NCCL)
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = rank, world
        self.cuda = not args.dry_run
        if self.cuda:
            import numpy as np
            if not hasattr(np, "row_stack"):          # numba-cuda 0.30.4 still references np.row_stack
                np.row_stack = np.vstack
            os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")
            local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            torch.backends.cuda.matmul.allow_tf32 = False     # fp32 means fp32
            torch.backends.cudnn.allow_tf32 = False
            torch.empty(1, device="cuda")                     # PyTorch's context before numba looks for one
            self.device = torch.device("cuda", local)
        else:
            torch.set_num_threads(1)
            self.device = torch.device("cpu")
        timeout = datetime.timedelta(seconds=args.timeout_s)
        dist.init_process_group("gloo" if args.dry_run else "nccl", init_method=init_method, rank=rank,
                                world_size=world, timeout=timeout)
        # Every rank takes part in creating every group (new_group is collective), in the same order.
        self.rings = {W: dist.new_group(list(range(W)), timeout=timeout)
                      for W in sorted(set(args.world_sizes)) if W <= world}
        self.alone = [dist.new_group([r], timeout=timeout) for r in range(world)]

    # -- helpers -------------------------------------------------------------------------------------------------
    def dtype(self, name: str):
        return getattr(self.torch, name)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, fn, repeats: int, warmup: int, group=None) -> list[float]:
        """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, a group barrier before each
        (CUDA events on the GPU, the wall clock on the CPU)."""
        torch, dist = self.torch, self.dist
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            if group is not None:
                dist.barrier(group=group)
            self.sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(float(start.elapsed_time(end)))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def random(self, shape, dtype, seed: int):
        generator = self.torch.Generator().manual_seed(seed)
        return self.torch.randn(shape, generator=generator, dtype=self.torch.float64).to(self.device, dtype)

    def decide(self, value):
        """Rank 0's ``value`` on every rank (so that every rank skips or runs the same configurations)."""
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- 1. the check --------------------------------------------------------------------------------------------
    def check(self, W: int, layout: str, dtype_name: str) -> dict | None:
        """Ring output vs float64 attention on one device, beside SDPA's error in the same dtype (rank 0's
        verdict; None on ranks outside the ring)."""
        from fa2edu import distributed as cp
        torch, dist = self.torch, self.dist
        args = self.args
        N = args.check_local * W
        if not _splittable(N, W, layout):
            N = 2 * W * max(1, args.check_local // 2)
        if self.rank >= W:
            return None
        group = self.rings[W]
        dtype = self.dtype(dtype_name)
        shape = (args.batch, args.heads, N, args.d)
        q, k, v = (self.random(shape, torch.float64, seed) for seed in (11, 12, 13))
        local = [cp.shard(x, self.rank, W, layout).to(dtype) for x in (q, k, v)]
        o = cp.ring_attention(*local, causal=args.causal, group=group, layout=layout)
        carrier = torch.float64 if dtype == torch.float64 else torch.float32      # gathered without rounding
        pieces = [torch.empty_like(o, dtype=carrier) for _ in range(W)]
        dist.all_gather(pieces, o.to(carrier).contiguous(), group=group)
        if self.rank != 0:
            return None
        got = cp.unshard(pieces, layout).double()
        reference = _attention_float64(q, k, v, args.causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                                                is_causal=args.causal).double()
        err, sdpa_err = float((got - reference).abs().max()), float((sdpa - reference).abs().max())
        tolerance = 2 * sdpa_err + FLOOR[dtype_name]
        return {"world_size": W, "layout": layout, "dtype": dtype_name, "N": N, "causal": args.causal,
                "max_error": err, "sdpa_max_error": sdpa_err, "tolerance": tolerance,
                "status": "ok" if err <= tolerance else "wrong"}

    # -- 2. the link and the rate --------------------------------------------------------------------------------
    def link_bandwidth(self) -> float | None:
        """Bytes/s per direction of one ring exchange on the whole world (None for a world of 1)."""
        torch, dist = self.torch, self.dist
        W = self.world
        if W == 1:
            return None
        n = self.args.link_mib * 2**20 // 4
        send, receive = torch.ones(n, device=self.device), torch.empty(n, device=self.device)

        def exchange():
            ops = [dist.P2POp(dist.isend, send, (self.rank + 1) % W),
                   dist.P2POp(dist.irecv, receive, (self.rank - 1) % W)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        ms = statistics.median(self.timed(exchange, max(3, self.args.repeats), 1, group=dist.group.WORLD))
        mine = torch.tensor([n * 4 / (ms * 1e-3)], dtype=torch.float64, device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)             # the slowest link sets the pace of the ring
        return float(mine.item())

    def step_rate(self, dtype_name: str, N_local: int) -> float | None:
        """FLOP/s of one full ring step on one GPU: the W = 1 ring, non-causal, N_local tokens (rank 0)."""
        from fa2edu import distributed as cp
        args = self.args
        if self.rank != 0:
            return None
        dtype = self.dtype(dtype_name)
        shape = (args.batch, args.heads, N_local, args.d)
        q, k, v = (self.random(shape, dtype, seed) for seed in (21, 22, 23))

        def call():
            cp.ring_attention(q, k, v, causal=False, group=self.alone[0], layout="contiguous", check=False)

        ms = statistics.median(self.timed(call, args.repeats, args.warmup))
        return 4.0 * N_local * N_local * args.d * args.batch * args.heads / (ms * 1e-3)

    # -- 3. the rings and one-GPU attention ----------------------------------------------------------------------
    def ring(self, W: int, N: int, layout: str, dtype_name: str) -> dict | None:
        """Every rank's median ms for ring_attention over W ranks (gathered on rank 0), and its peak memory."""
        from fa2edu import distributed as cp
        torch, dist = self.torch, self.dist
        args = self.args
        if self.rank >= W:
            return None
        group = self.rings[W]
        dtype = self.dtype(dtype_name)
        shape = (args.batch, args.heads, N // W, args.d)
        q, k, v = (self.random(shape, dtype, 1000 * seed + self.rank) for seed in (1, 2, 3))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

        def call():
            cp.ring_attention(q, k, v, causal=args.causal, group=group, layout=layout, check=False)

        mine = statistics.median(self.timed(call, args.repeats, args.warmup, group=group))
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        everyone = [None] * W
        dist.all_gather_object(everyone, (mine, peak), group=group)
        return {"rank_ms": [t for t, _ in everyone], "peak_mem_bytes": max(p or 0 for _, p in everyone) or None}

    def single(self, N: int, dtype_name: str) -> dict | None:
        """One-GPU attention at N tokens: PyTorch SDPA (rank 0)."""
        torch = self.torch
        args = self.args
        if self.rank != 0:
            return None
        dtype = self.dtype(dtype_name)
        shape = (args.batch, args.heads, N, args.d)
        q, k, v = (self.random(shape, dtype, seed) for seed in (31, 32, 33))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

        def call():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

        ms = statistics.median(self.timed(call, args.repeats, args.warmup))
        return {"ms": ms, "peak_mem_bytes": torch.cuda.max_memory_allocated() if self.cuda else None}


def _attention_float64(q, k, v, causal: bool):
    """softmax(QKᵀ/√d + mask)·V in float64: the reference of the check."""
    import torch
    S = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        N = S.shape[-1]
        S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=S.device).tril(), -math.inf)
    return torch.softmax(S, dim=-1) @ v


# -- the run ------------------------------------------------------------------------------------------------------

def _header(me: Rank, args, world: int) -> dict:
    from benchmarks.harness.timing import package_versions
    torch = me.torch
    versions = package_versions()
    versions.update(python=sys.version.split()[0], torch_cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if me.cuda else None)
    device = torch.cuda.get_device_name(me.device) if me.cuda else "cpu (dry run)"
    return {"device": device, "versions": versions, "date": results_io.utc_now(), "command": " ".join(sys.argv),
            "backend": "gloo" if args.dry_run else "nccl", "world_size": world, "gpus": world if me.cuda else 0,
            "dry_run": bool(args.dry_run), "env": {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")},
            "settings": {k: v for k, v in vars(args).items() if k != "out"}}


def run_rank(rank: int, world: int, init_method: str, args) -> dict | None:
    """Everything one process does; rank 0 returns the results (header, records, summary), the others None."""
    from fa2edu import simulate_context_parallel
    from fa2edu.flops import model_flops

    started = time.monotonic()
    me = Rank(rank, world, init_method, args)
    header = _header(me, args, world) if rank == 0 else None
    device = header["device"] if header else None
    records, checks = [], []
    not_run = [{"world_size": W, "reason": f"only {world} process(es) / GPU(s) in this run"}
               for W in sorted(set(args.world_sizes)) if W > world]
    rings = [W for W in sorted(set(args.world_sizes)) if W <= world]

    def out_of_time() -> bool:
        return me.decide(time.monotonic() - started > args.budget_s if rank == 0 else None)

    # 1. Check every ring against one-device attention before timing anything.
    passed = {}
    for W in rings:
        for layout in args.layouts:
            for dtype_name in args.dtypes:
                verdict = me.check(W, layout, dtype_name)
                verdict = me.decide(verdict)
                checks.append(verdict)
                passed[W, layout, dtype_name] = verdict["status"] == "ok"
    # 2. The link, and the single-GPU rate of one full step at every N_local the rings use.
    link = me.link_bandwidth()
    sizes = _sizes(args, world)
    rates = {}
    for dtype_name in args.dtypes:
        for N_local in sorted({N // W for _, W, N in sizes}):
            rates[dtype_name, N_local] = me.decide(me.step_rate(dtype_name, N_local))
    # 3. The rings, and one-GPU attention at the same N.
    single_done = set()
    for scaling, W, N in sizes:
        for dtype_name in args.dtypes:
            if (N, dtype_name) not in single_done:
                single_done.add((N, dtype_name))
                if out_of_time():
                    not_run.append({"kind": "single", "N": N, "dtype": dtype_name, "reason": "time budget spent"})
                else:
                    result = me.decide(_guarded(me.single, N, dtype_name))
                    if rank == 0:
                        records.append(_single_record(result, args, N, dtype_name, device, model_flops))
            for layout in args.layouts:
                base = dict(kind="ring", scaling=scaling, world_size=W, layout=layout, N_local=N // W,
                            dtype_bytes=me.torch.empty(0, dtype=me.dtype(dtype_name)).element_size())
                common = dict(impl=f"ring_{layout}", pass_="forward", dtype=dtype_name, batch=args.batch,
                              heads=args.heads, N=N, d=args.d, causal=args.causal, device=device)
                if not _splittable(N, W, layout):
                    not_run.append(dict(base, scaling=scaling, reason=f"N = {N} does not split into the layout"))
                    continue
                if not passed[W, layout, dtype_name]:
                    if rank == 0:
                        records.append(results_io.make_record(**common, status="wrong", **base,
                                                              error="the check against one-device attention "
                                                                    "failed: not timed"))
                    continue
                if out_of_time():
                    not_run.append(dict(base, reason="time budget spent"))
                    continue
                result = me.decide(_guarded(me.ring, W, N, layout, dtype_name))
                if rank != 0:
                    continue
                if "error" in result:
                    records.append(results_io.make_record(**common, status="error", error=result["error"], **base))
                    continue
                rate = rates[dtype_name, N // W]
                report = simulate_context_parallel(N, args.d, W, causal=args.causal, layout=layout,
                                                   batch=args.batch, heads=args.heads,
                                                   dtype_bytes=base["dtype_bytes"],
                                                   link=link if link else 1e30, flop_rate=rate)
                ms = max(result["rank_ms"])
                records.append(results_io.make_record(
                    **common, ms=ms, tflops=model_flops(args.batch, args.heads, N, args.d, args.causal) / ms / 1e9,
                    peak_mem_bytes=result["peak_mem_bytes"], **base, rank_ms=result["rank_ms"],
                    predicted_rank_ms=[t.finish_s * 1e3 for t in report.ranks],
                    predicted_ms=report.time_s * 1e3, predicted_compute_ms=report.compute_time_s * 1e3,
                    predicted_comm_ms=(report.time_s - report.compute_time_s) * 1e3,
                    predicted_idle_fraction=report.idle_fractions,
                    predicted_comm_hidden=report.hides_communication,
                    predicted_bandwidth_to_hide=report.bandwidth_to_hide,
                    link_bytes_per_s=link if link else None, flop_rate=rate, repeats=args.repeats))
    me.dist.barrier()
    me.dist.destroy_process_group()
    if rank != 0:
        return None
    summary = {"checks": checks, "not_run": not_run, "link_bytes_per_s": link,
               "step_flop_rate": [{"dtype": k[0], "N_local": k[1], "flop_rate": v} for k, v in rates.items()],
               "seconds": time.monotonic() - started}
    return {"header": header, "records": records, "summary": summary}


def _guarded(fn, *a):
    """``fn(*a)``, or {"error": ...} when it raises (an out-of-memory, a kernel that refuses a shape)."""
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"}


def _single_record(result, args, N, dtype_name, device, model_flops):
    common = dict(impl="sdpa", pass_="forward", dtype=dtype_name, batch=args.batch, heads=args.heads, N=N, d=args.d,
                  causal=args.causal, device=device, kind="single", world_size=1)
    if "error" in result:
        return results_io.make_record(**common, status="error", error=result["error"])
    ms = result["ms"]
    return results_io.make_record(**common, ms=ms,
                                  tflops=model_flops(args.batch, args.heads, N, args.d, args.causal) / ms / 1e9,
                                  peak_mem_bytes=result["peak_mem_bytes"], repeats=args.repeats)


def _worker(rank, world, init_method, args, results):
    try:
        results.put((rank, run_rank(rank, world, init_method, args), None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails with the traceback
        results.put((rank, None, traceback.format_exc()))


def _spawn(world: int, args) -> dict:
    """Start ``world`` processes (spawn), rendezvous through a file, collect rank 0's results; kill stragglers."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    deadline = time.monotonic() + args.budget_s + 2 * args.timeout_s + 120
    with tempfile.TemporaryDirectory() as folder:
        init_method = f"file://{os.path.join(folder, 'rendezvous')}"
        processes = [ctx.Process(target=_worker, args=(r, world, init_method, args, results), daemon=True)
                     for r in range(world)]
        for p in processes:
            p.start()
        payload, failures, reported = None, [], 0
        try:
            while reported < world:
                try:
                    rank, out, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue_module.Empty:
                    raise SystemExit(f"the {world} processes did not finish in time; ranks that died: "
                                     f"{[r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]}") from None
                reported += 1
                if error:
                    failures.append(f"rank {rank}:\n{error}")
                elif rank == 0:
                    payload = out
            for p in processes:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
    if failures:
        raise SystemExit("\n".join(failures))
    return payload


def _print(payload) -> None:
    header, records, summary = payload["header"], payload["records"], payload["summary"]
    print(f"{header['device']}, {header['world_size']} process(es), {header['backend']}; "
          f"link {summary['link_bytes_per_s'] or 0:.3g} B/s per direction")
    for c in summary["checks"]:
        print(f"check W={c['world_size']} {c['layout']:>10} {c['dtype']:>8}: {c['status']} "
              f"(max error {c['max_error']:.2e}, SDPA {c['sdpa_max_error']:.2e})")
    for r in records:
        if r.get("kind") == "ring" and r["status"] == "ok":
            ranks = " ".join(f"{t:.3g}" for t in r["rank_ms"])
            predicted = " ".join(f"{t:.3g}" for t in r["predicted_rank_ms"])
            print(f"{r['scaling']:>6} W={r['world_size']} N={r['N']:>7} {r['layout']:>10} {r['dtype']:>8}: "
                  f"ms [{ranks}] predicted [{predicted}] hidden={r['predicted_comm_hidden']}")
        elif r.get("kind") == "single" and r["status"] == "ok":
            print(f"single N={r['N']:>7} {r['dtype']:>8}: SDPA {r['ms']:.3g} ms")
        else:
            print(f"{r.get('kind')} W={r.get('world_size')} N={r['N']} {r['dtype']}: {r['status']}: {r['error']}")
    for item in summary["not_run"]:
        print(f"not run: {item}")


def main(argv=None):
    args = parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"              # inherited by every process started from here
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:          # started by torchrun: one rank of the world
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        payload = run_rank(rank, world, "env://", args)
        if rank != 0:
            return 0
    else:
        if args.dry_run:
            world = args.nprocs or 2
        else:
            import torch
            visible = torch.cuda.device_count()
            if visible == 0:
                raise SystemExit("no CUDA GPU is visible: run with --dry-run to check the logic on the CPU")
            world = min(args.nprocs or visible, visible)
        payload = _spawn(world, args)
    results_io.write_results(args.out, payload["header"], payload["records"], payload["summary"])
    _print(payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
