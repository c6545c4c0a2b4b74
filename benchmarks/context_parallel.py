"""Ring attention on several GPUs: strong and weak scaling over NCCL, forward and training, beside one-GPU attention,
PyTorch's own context parallelism and the simulator.

``fa2edu.distributed.ring_attention`` runs on a ring of W ranks, one GPU each. This script measures it and writes
a results file (JSON, ``benchmarks.harness.results_io``'s schema) with the device, the versions and the date:

1. **check first**: for every ring size W, layout and dtype, the ring's output **and its gradients** dq, dk, dv
   (``ring_attention(...).backward(dO)``) on a small sequence, unsharded, against float64 attention with
   autograd on one device, with the error of one-device attention in the same dtype (PyTorch SDPA, forward and
   backward) as the yardstick: the ring passes when each error is at most twice SDPA's plus a small floor. A
   configuration that fails is recorded as ``wrong`` and not timed. On CUDA, PyTorch's context parallelism is
   checked the same way (its shards unsharded with fa2edu's layouts: that the layouts match is part of the check);
2. **the link and the rates**: the bandwidth of one ring exchange per direction (a large buffer sent to the next
   rank while one arrives from the previous), and the FLOP rates of a single GPU on one full ring step, forward
   and backward (the W = 1 ring, non-causal, N_local tokens, up to ``--rate-max-N-local``; longer shards reuse the
   rate of the longest measured: the rate has saturated by then, and a full step of 131072 tokens in float32
   would take a minute to time);
3. **strong scaling** (fixed total N) and **weak scaling** (fixed N per GPU) over W = 1, 2, 4, 8 (those the
   machine has), contiguous and zigzag, causal, bf16 and fp32, passes ``forward`` and ``forward+backward``
   (autograd: ``ring_attention(...).backward(dO)``), by default: every rank's time (CUDA events, median of the
   repeats, a barrier before each), and beside it what ``fa2edu.simulate_context_parallel`` predicts (``pass_``
   the same) with the measured link and rates: every rank's time, the idle fractions, whether each step's compute
   hides its transfers (``predicted_comm_hidden``; ``predicted_comm_ms``: what communication adds to the ring's
   time, in the backward at least the last dK, dV transfer); the same rings in **PyTorch's context parallelism**
   (``torch.distributed.tensor.experimental.context_parallel`` on a ``DeviceMesh`` of the ring's ranks, ring
   attention over SDPA: K/V rotated by ``set_rotate_method("alltoall")``, the ring, not the default all-gather;
   its head-tail load balancer for zigzag, exactly fa2edu's zigzag chunks, and none for contiguous), CUDA only;
   one-GPU attention (PyTorch SDPA) at every N the rings use, forward and forward+backward.

Records: ``kind`` "ring" (fa2edu, ``impl`` ring_<layout>), "torch_cp" (``impl`` torch_cp_<layout>) or "single"
(``impl`` sdpa); ``pass`` "forward" or "forward+backward" (the time of both, FA2's "fwd + bwd"; TFLOP/s from
``fa2edu.flops.model_flops`` of that pass). ``summary.comparisons`` puts fa2edu's ring beside PyTorch's for each
configuration, ``summary.scaling`` the strong-scaling efficiencies time(W = 1) / (W · time(W)).

Launch it with torchrun (one process per GPU)::

    torchrun --nproc_per_node=4 -m benchmarks.context_parallel --out benchmarks/results/DEVICE/context_parallel.json

or let it start its own processes, one per visible GPU::

    python -m benchmarks.context_parallel --out context_parallel.json

Every process keeps ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) and every collective runs under a timeout; a
configuration that raises (out of memory, a kernel that refuses a shape, PyTorch's context parallelism failing)
is recorded as an ``error``, and the run goes on. On a machine with one GPU it runs the single-device path and
the W = 1 ring, and the results file lists what it could not run (``summary.not_run``). ``--dry-run`` runs the
whole logic on the CPU: a world of 2 processes on gloo, tiny sizes (``python -m benchmarks.context_parallel
--dry-run --out /tmp/cp.json``); PyTorch's context parallelism is listed as not run (it dispatches SDPA's CUDA
kernels only); its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
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
  torchrun --nproc_per_node=4 -m benchmarks.context_parallel --out cp.json
  torchrun --nproc_per_node=2 -m benchmarks.context_parallel --world-sizes 1,2 --dtypes bfloat16 --out cp.json
  python -m benchmarks.context_parallel --passes forward --impls fa2edu --out cp.json   # one process per GPU
  python -m benchmarks.context_parallel --dry-run --out /tmp/cp.json   # CPU, gloo, 2 processes, tiny sizes
"""

DTYPES = ("float16", "bfloat16", "float32")
LAYOUTS = ("contiguous", "zigzag")
#: What --passes names, and the pass each one times: "backward" is timed with its forward (autograd's
#: ring_attention(...).backward(dO)), as FA2 times "fwd + bwd".
PASSES = {"forward": "forward", "backward": "forward+backward"}
#: fa2edu's ring, and PyTorch's own context parallelism (ring attention over SDPA, CUDA only).
IMPLS = ("fa2edu", "torch_cp")
ROTATE_METHODS = ("alltoall", "allgather")
#: The check's absolute floor beside twice SDPA's error, by dtype, relative to max(1, max |reference|) (O's
#: entries are O(1); the gradients' grow with N).
FLOOR = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-12}
TORCH_CP_CPU = ("PyTorch's context parallelism dispatches SDPA's CUDA kernels only (flash, memory-efficient, cuDNN "
                "ops); the CPU's SDPA op has no context-parallel handler: CUDA only")
DRY_RUN = dict(world_sizes=[1, 2], strong_N=16, weak_N=8, d=8, heads=2, batch=1, dtypes=["float32", "bfloat16"],
               repeats=2, warmup=1, check_local=8, link_mib=1, timeout_s=60, budget_s=60, rate_max_N_local=16)


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
    parser.add_argument("--strong-N", type=int, default=131072,
                        help="total tokens of strong scaling (default 131072)")
    parser.add_argument("--weak-N", type=int, default=32768, help="tokens per GPU of weak scaling (default 32768)")
    parser.add_argument("--d", type=int, default=128, help="head dimension (default 128)")
    parser.add_argument("--heads", type=int, default=16, help="heads (default 16)")
    parser.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    parser.add_argument("--dtypes", type=_choices(DTYPES + ("float64",)), default=["bfloat16", "float32"],
                        help="dtypes, run in this order (default bfloat16,float32)")
    parser.add_argument("--layouts", type=_choices(LAYOUTS), default=["zigzag", "contiguous"],
                        help="layouts (default zigzag,contiguous)")
    parser.add_argument("--passes", type=_choices(tuple(PASSES)), default=list(PASSES),
                        help="forward: the forward alone; backward: forward + backward through autograd "
                             "(default forward,backward)")
    parser.add_argument("--impls", type=_choices(IMPLS), default=list(IMPLS),
                        help="fa2edu's ring and PyTorch's context parallelism (default fa2edu,torch_cp)")
    parser.add_argument("--torch-cp-rotate", choices=ROTATE_METHODS, default="alltoall",
                        help="how PyTorch's context parallelism moves K/V: alltoall (a ring, as fa2edu's) or "
                             "allgather (its default: every block at once) (default alltoall)")
    parser.add_argument("--non-causal", action="store_true", help="time the non-causal ring instead of causal")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per configuration (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--check-local", type=int, default=512,
                        help="tokens per rank of the correctness check (default 512)")
    parser.add_argument("--rate-max-N-local", type=int, default=32768,
                        help="longest shard whose step rate is measured; longer ones reuse it (default 32768)")
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
    parser.add_argument("--merge", nargs="+", metavar="FILE", default=None,
                        help="run nothing: merge results files of this script (parts of one run, e.g. one per "
                             "dtype, each within a command's time limit) into --out")
    return parser


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    for name in ("strong_N", "weak_N", "d", "heads", "batch", "repeats", "check_local", "link_mib", "timeout_s",
                 "rate_max_N_local"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be at least 0, got {args.warmup}")
    args.causal = not args.non_causal
    if not args.causal and "torch_cp" in args.impls:
        print("note: PyTorch's context parallelism load-balances causal rings only; non-causal runs use it "
              "without a load balancer")
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

    def gather(self, tensors, group, W: int) -> list[list] | None:
        """Each of ``tensors`` from every rank of the ring (on rank 0; None elsewhere), without rounding."""
        torch, dist = self.torch, self.dist
        out = []
        for t in tensors:
            carrier = torch.float64 if t.dtype == torch.float64 else torch.float32
            pieces = [torch.empty_like(t, dtype=carrier) for _ in range(W)]
            dist.all_gather(pieces, t.detach().to(carrier).contiguous(), group=group)
            out.append(pieces)
        return out if self.rank == 0 else None

    @contextlib.contextmanager
    def torch_cp(self, W: int, layout: str, buffers):
        """PyTorch's context parallelism over the ring's ranks: ``buffers`` (full (B, H, N, d) tensors, the same
        on every rank) sharded **in place** along the sequence axis while the context is open — by its head-tail
        load balancer for zigzag (rank r keeps chunks r and 2W − 1 − r of 2W: fa2edu's zigzag), without one for
        contiguous — and SDPA replaced by its ring attention, K/V moved by ``--torch-cp-rotate``."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
        mesh = DeviceMesh.from_group(self.rings[W], "cuda")
        saved = (_cp_options.enable_load_balance, _cp_options.rotate_method)
        set_rotate_method(self.args.torch_cp_rotate)
        # context_parallel picks its head-tail load balancer when enable_load_balance is on (and N splits in 2W).
        _cp_options.enable_load_balance = layout == "zigzag"
        try:
            with context_parallel(mesh, buffers=list(buffers), buffer_seq_dims=[2] * len(buffers),
                                  no_restore_buffers=set(buffers)):
                yield
        finally:
            _cp_options.enable_load_balance, _cp_options.rotate_method = saved

    def attention_call(self, impl: str, W: int, layout: str, q, k, v, dO, backward: bool):
        """One call of ``impl`` on this rank's shards (inside ``torch_cp`` for PyTorch's): the forward, or the
        forward and autograd's backward with ``dO``. Returns the output and, with ``backward``, the leaves."""
        torch = self.torch
        if backward:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        if impl == "fa2edu":
            from fa2edu import distributed as cp
            o = cp.ring_attention(q, k, v, causal=self.args.causal, group=self.rings[W], layout=layout, check=False)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.args.causal)
        if backward:
            o.backward(dO)
        return o, (q, k, v)

    # -- 1. the check --------------------------------------------------------------------------------------------
    def check(self, impl: str, W: int, layout: str, dtype_name: str) -> dict | None:
        """Ring output and gradients vs float64 attention with autograd on one device, beside SDPA's errors in the
        same dtype (rank 0's verdict; None on ranks outside the ring)."""
        from fa2edu import distributed as cp
        torch = self.torch
        args = self.args
        N = args.check_local * W
        if not _splittable(N, W, layout):
            N = 2 * W * max(1, args.check_local // 2)
        if self.rank >= W:
            return None
        group = self.rings[W]
        dtype = self.dtype(dtype_name)
        shape = (args.batch, args.heads, N, args.d)
        full = [self.random(shape, torch.float64, seed) for seed in (11, 12, 13, 14)]
        if impl == "fa2edu":
            q, k, v, dO = (cp.shard(x, self.rank, W, layout).to(dtype) for x in full)
            o, leaves = self.attention_call(impl, W, layout, q, k, v, dO, backward=True)
        else:
            q, k, v, dO = (x.to(dtype) for x in full)
            with self.torch_cp(W, layout, [q, k, v, dO]):
                o, leaves = self.attention_call(impl, W, layout, q, k, v, dO, backward=True)
        got = self.gather([o] + [t.grad for t in leaves], group, W)
        if self.rank != 0:
            return None
        got = [cp.unshard(pieces, layout).double() for pieces in got]
        reference = _attention_with_grads(*full, args.causal, dtype=None)
        sdpa = _attention_with_grads(*(x.to(dtype) for x in full), args.causal, dtype=dtype)
        names = ("o", "dq", "dk", "dv")
        errors = {n: float((g - r).abs().max()) for n, g, r in zip(names, got, reference)}
        sdpa_errors = {n: float((s - r).abs().max()) for n, s, r in zip(names, sdpa, reference)}
        tolerance = {n: 2 * sdpa_errors[n] + FLOOR[dtype_name] * max(1.0, float(r.abs().max()))
                     for n, r in zip(names, reference)}
        ok = all(errors[n] <= tolerance[n] for n in names)
        return {"impl": impl, "world_size": W, "layout": layout, "dtype": dtype_name, "N": N, "causal": args.causal,
                "max_error": errors["o"], "sdpa_max_error": sdpa_errors["o"], "tolerance": tolerance["o"],
                "errors": errors, "sdpa_errors": sdpa_errors, "tolerances": tolerance,
                "status": "ok" if ok else "wrong"}

    # -- 2. the link and the rates -------------------------------------------------------------------------------
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

    def step_rate(self, dtype_name: str, N_local: int, backward: bool) -> dict | None:
        """FLOP/s of one full ring step on one GPU: the W = 1 ring, non-causal, N_local tokens (rank 0), forward,
        and (``backward``) the backward from the forward + backward time less the forward's."""
        from fa2edu import distributed as cp
        args = self.args
        if self.rank != 0:
            return None
        dtype = self.dtype(dtype_name)
        shape = (args.batch, args.heads, N_local, args.d)
        q, k, v, dO = (self.random(shape, dtype, seed) for seed in (21, 22, 23, 24))
        flops = 4.0 * N_local * N_local * args.d * args.batch * args.heads

        def call(with_backward):
            def run():
                leaves = [t.detach().requires_grad_() for t in (q, k, v)] if with_backward else (q, k, v)
                o = cp.ring_attention(*leaves, causal=False, group=self.alone[0], layout="contiguous", check=False)
                if with_backward:
                    o.backward(dO)
            return run

        forward_ms = statistics.median(self.timed(call(False), args.repeats, args.warmup))
        out = {"forward": flops / (forward_ms * 1e-3), "forward_ms": forward_ms}
        if backward:
            both_ms = statistics.median(self.timed(call(True), args.repeats, args.warmup))
            out.update(backward=2.5 * flops / (max(both_ms - forward_ms, 1e-6) * 1e-3), forward_backward_ms=both_ms)
        return out

    # -- 3. the rings and one-GPU attention ----------------------------------------------------------------------
    def ring(self, impl: str, W: int, N: int, layout: str, dtype_name: str, backward: bool) -> dict | None:
        """Every rank's median ms for ``impl`` over W ranks (gathered on rank 0), and the peak memory."""
        torch, dist = self.torch, self.dist
        args = self.args
        if self.rank >= W:
            return None
        group = self.rings[W]
        dtype = self.dtype(dtype_name)
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if impl == "fa2edu":
            shape = (args.batch, args.heads, N // W, args.d)
            q, k, v, dO = (self.random(shape, dtype, 1000 * seed + self.rank) for seed in (1, 2, 3, 4))

            def call():
                self.attention_call(impl, W, layout, q, k, v, dO, backward)

            mine = statistics.median(self.timed(call, args.repeats, args.warmup, group=group))
        else:
            shape = (args.batch, args.heads, N, args.d)                 # the full buffers, sharded in place
            q, k, v, dO = (self.random(shape, dtype, seed) for seed in (1, 2, 3, 4))
            with self.torch_cp(W, layout, [q, k, v, dO]):
                def call():
                    self.attention_call(impl, W, layout, q, k, v, dO, backward)

                mine = statistics.median(self.timed(call, args.repeats, args.warmup, group=group))
        peak = torch.cuda.max_memory_allocated() if self.cuda else None
        everyone = [None] * W
        dist.all_gather_object(everyone, (mine, peak), group=group)
        return {"rank_ms": [t for t, _ in everyone], "peak_mem_bytes": max(p or 0 for _, p in everyone) or None}

    def single(self, N: int, dtype_name: str, backward: bool) -> dict | None:
        """One-GPU attention at N tokens: PyTorch SDPA (rank 0), the forward or forward + backward."""
        torch = self.torch
        args = self.args
        if self.rank != 0:
            return None
        dtype = self.dtype(dtype_name)
        shape = (args.batch, args.heads, N, args.d)
        q, k, v, dO = (self.random(shape, dtype, seed) for seed in (31, 32, 33, 34))
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

        def call():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)] if backward else (q, k, v)
            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=args.causal)
            if backward:
                o.backward(dO)

        ms = statistics.median(self.timed(call, args.repeats, args.warmup))
        return {"ms": ms, "peak_mem_bytes": torch.cuda.max_memory_allocated() if self.cuda else None}


def _attention_with_grads(q, k, v, dO, causal: bool, dtype):
    """O, dQ, dK, dV of one-device attention, as float64: softmax(QKᵀ/√d + mask)·V written out in float64
    (``dtype`` None: the reference), or PyTorch SDPA in ``dtype`` (the yardstick), each with autograd."""
    import torch
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if dtype is None:
        S = (leaves[0] @ leaves[1].transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if causal:
            N = S.shape[-1]
            S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=S.device).tril(), -math.inf)
        o = torch.softmax(S, dim=-1) @ leaves[2]
    else:
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    o.backward(dO.to(o.dtype))
    return [t.detach().double() for t in (o, *(leaf.grad for leaf in leaves))]


# -- the run ------------------------------------------------------------------------------------------------------

def _header(me: Rank, args, world: int) -> dict:
    from benchmarks.harness.timing import package_versions
    torch = me.torch
    versions = package_versions()
    versions.update(python=sys.version.split()[0], torch_cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if me.cuda else None)
    device = torch.cuda.get_device_name(me.device) if me.cuda else "cpu (dry run)"
    sdpa = None
    if me.cuda:
        backends = torch.backends.cuda
        sdpa = {name: bool(getattr(backends, f"{name}_sdp_enabled")()) for name in
                ("flash", "mem_efficient", "cudnn", "math") if hasattr(backends, f"{name}_sdp_enabled")}
    return {"device": device, "versions": versions, "date": results_io.utc_now(), "command": " ".join(sys.argv),
            "backend": "gloo" if args.dry_run else "nccl", "world_size": world, "gpus": world if me.cuda else 0,
            "dry_run": bool(args.dry_run), "env": {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")},
            "sdpa_backends_enabled": sdpa, "torch_cp_rotate": args.torch_cp_rotate,
            "settings": {k: v for k, v in vars(args).items() if k != "out"}}


def _rate_for(rates: dict, dtype_name: str, N_local: int, cap: int) -> tuple[dict, int]:
    """The measured rates for a shard of N_local tokens: its own, or those of the longest shard measured."""
    measured = min(N_local, cap)
    return rates[dtype_name, measured], measured


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
    impls = list(args.impls)
    if "torch_cp" in impls and not me.cuda:
        impls.remove("torch_cp")
        not_run.append({"kind": "torch_cp", "reason": TORCH_CP_CPU})
    passes = [PASSES[p] for p in args.passes]
    backward = "forward+backward" in passes

    def out_of_time() -> bool:
        return me.decide(time.monotonic() - started > args.budget_s if rank == 0 else None)

    # 1. Check every ring (output and gradients) against one-device attention before timing anything.
    passed = {}
    for impl in impls:
        for W in rings:
            for layout in args.layouts:
                for dtype_name in args.dtypes:
                    verdict = me.decide(_guarded(me.check, impl, W, layout, dtype_name))
                    if "error" in verdict:
                        verdict = {"impl": impl, "world_size": W, "layout": layout, "dtype": dtype_name,
                                   "status": "error", "error": verdict["error"]}
                    checks.append(verdict)
                    passed[impl, W, layout, dtype_name] = verdict["status"] == "ok"
    # 2. The link, and the single-GPU rates of one full step at every N_local the rings use (up to the cap).
    link = me.link_bandwidth()
    sizes = _sizes(args, world)
    rates = {}
    for dtype_name in args.dtypes:
        for N_local in sorted({min(N // W, args.rate_max_N_local) for _, W, N in sizes}):
            rates[dtype_name, N_local] = me.decide(_guarded(me.step_rate, dtype_name, N_local, backward))
    # 3. The rings, and one-GPU attention at the same N; bf16 first (the targets), then fp32.
    single_done = set()
    for dtype_name in args.dtypes:
        dtype_bytes = me.torch.empty(0, dtype=me.dtype(dtype_name)).element_size()
        for scaling, W, N in sizes:
            for pass_ in passes:
                if (N, dtype_name, pass_) in single_done:
                    continue
                single_done.add((N, dtype_name, pass_))
                if out_of_time():
                    not_run.append({"kind": "single", "N": N, "dtype": dtype_name, "pass": pass_,
                                    "reason": "time budget spent"})
                    continue
                result = me.decide(_guarded(me.single, N, dtype_name, pass_ != "forward"))
                if rank == 0:
                    records.append(_single_record(result, args, N, dtype_name, pass_, device, model_flops))
            for layout in args.layouts:
                for impl in impls:
                    for pass_ in passes:
                        kind = "ring" if impl == "fa2edu" else "torch_cp"
                        base = dict(kind=kind, scaling=scaling, world_size=W, layout=layout, N_local=N // W,
                                    dtype_bytes=dtype_bytes)
                        common = dict(impl=f"{'ring' if impl == 'fa2edu' else 'torch_cp'}_{layout}", pass_=pass_,
                                      dtype=dtype_name, batch=args.batch, heads=args.heads, N=N, d=args.d,
                                      causal=args.causal, device=device)
                        if impl == "torch_cp":
                            base["rotate_method"] = args.torch_cp_rotate
                        if not _splittable(N, W, layout):
                            not_run.append(dict(base, pass_=pass_, reason=f"N = {N} does not split into the layout"))
                            continue
                        if not passed[impl, W, layout, dtype_name]:
                            if rank == 0:
                                records.append(results_io.make_record(
                                    **common, status="wrong", **base,
                                    error="the check against one-device attention failed: not timed"))
                            continue
                        if out_of_time():
                            not_run.append(dict(base, pass_=pass_, reason="time budget spent"))
                            continue
                        result = me.decide(_guarded(me.ring, impl, W, N, layout, dtype_name,
                                                    pass_ != "forward"))
                        if rank != 0:
                            continue
                        if "error" in result:
                            records.append(results_io.make_record(**common, status="error", error=result["error"],
                                                                  **base))
                            continue
                        ms = max(result["rank_ms"])
                        extra = dict(rank_ms=result["rank_ms"], repeats=args.repeats)
                        if impl == "fa2edu":
                            extra.update(_prediction(simulate_context_parallel, rates, args, N, W, layout,
                                                     dtype_name, dtype_bytes, pass_, link))
                        records.append(results_io.make_record(
                            **common, ms=ms, tflops=model_flops(args.batch, args.heads, N, args.d, args.causal,
                                                                pass_) / ms / 1e9,
                            peak_mem_bytes=result["peak_mem_bytes"], **base, **extra))
    me.dist.barrier()
    me.dist.destroy_process_group()
    if rank != 0:
        return None
    summary = {"checks": checks, "not_run": not_run, "link_bytes_per_s": link,
               "step_flop_rate": [{"dtype": k[0], "N_local": k[1], "flop_rate": (v or {}).get("forward"),
                                   "backward_flop_rate": (v or {}).get("backward"),
                                   "error": (v or {}).get("error")} for k, v in rates.items()],
               "comparisons": _comparisons(records), "scaling": _scaling(records),
               "seconds": time.monotonic() - started}
    return {"header": header, "records": records, "summary": summary}


def _prediction(simulate, rates, args, N, W, layout, dtype_name, dtype_bytes, pass_, link) -> dict:
    """The simulator's prediction for one of fa2edu's rings, with the measured link and step rates."""
    rate, measured_at = _rate_for(rates, dtype_name, N // W, args.rate_max_N_local)
    if not rate or "error" in rate or (pass_ != "forward" and not rate.get("backward")):
        return {"prediction_error": f"no measured step rate: {(rate or {}).get('error')}"}
    report = simulate(N, args.d, W, causal=args.causal, layout=layout, batch=args.batch, heads=args.heads,
                      dtype_bytes=dtype_bytes, link=link if link else 1e30, flop_rate=rate["forward"],
                      backward_flop_rate=rate.get("backward"), pass_=pass_)
    return dict(predicted_rank_ms=[t.finish_s * 1e3 for t in report.ranks], predicted_ms=report.time_s * 1e3,
                predicted_compute_ms=report.compute_time_s * 1e3,
                predicted_comm_ms=(report.time_s - report.compute_time_s) * 1e3,
                predicted_idle_fraction=report.idle_fractions, predicted_comm_hidden=report.hides_communication,
                predicted_bandwidth_to_hide=report.bandwidth_to_hide, link_bytes_per_s=link if link else None,
                flop_rate=rate["forward"], backward_flop_rate=rate.get("backward"), rate_N_local=measured_at)


def _comparisons(records) -> list[dict]:
    """fa2edu's ring beside PyTorch's context parallelism, per (scaling, W, layout, dtype, pass): the speed-up
    torch_cp ms / fa2edu ms (≥ 1: fa2edu's ring is faster)."""
    ok = {(r["kind"], r["scaling"], r["world_size"], r["layout"], r["dtype"], r["pass"]): r["ms"]
          for r in records if r.get("kind") in ("ring", "torch_cp") and r["status"] == "ok"}
    out = []
    for (kind, *key), ms in ok.items():
        theirs = ok.get(("torch_cp", *key))
        if kind == "ring" and theirs:
            out.append(dict(zip(("scaling", "world_size", "layout", "dtype", "pass"), key), fa2edu_ms=ms,
                            torch_cp_ms=theirs, speedup=theirs / ms))
    return out


def _scaling(records) -> list[dict]:
    """Strong-scaling efficiency time(W = 1) / (W · time(W)) per (kind, layout, dtype, pass), measured and (for
    fa2edu's ring) predicted."""
    strong = {(r["kind"], r["layout"], r["dtype"], r["pass"], r["world_size"]): r for r in records
              if r.get("scaling") == "strong" and r["status"] == "ok"}
    out = []
    for (kind, layout, dtype, pass_, W), r in strong.items():
        one = strong.get((kind, layout, dtype, pass_, 1))
        if one is None or W == 1:
            continue
        row = dict(kind=kind, layout=layout, dtype=dtype, **{"pass": pass_}, world_size=W,
                   efficiency=one["ms"] / (W * r["ms"]))
        if "predicted_ms" in r and "predicted_ms" in one:
            row["predicted_efficiency"] = one["predicted_ms"] / (W * r["predicted_ms"])
        out.append(row)
    return out


def _guarded(fn, *a):
    """``fn(*a)``, or {"error": ...} when it raises (an out-of-memory, a kernel that refuses a shape)."""
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"}


def _single_record(result, args, N, dtype_name, pass_, device, model_flops):
    common = dict(impl="sdpa", pass_=pass_, dtype=dtype_name, batch=args.batch, heads=args.heads, N=N, d=args.d,
                  causal=args.causal, device=device, kind="single", world_size=1)
    if "error" in result:
        return results_io.make_record(**common, status="error", error=result["error"])
    ms = result["ms"]
    return results_io.make_record(**common, ms=ms,
                                  tflops=model_flops(args.batch, args.heads, N, args.d, args.causal, pass_) / ms / 1e9,
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
        if c["status"] == "error":
            print(f"check {c['impl']} W={c['world_size']} {c['layout']:>10} {c['dtype']:>8}: error: {c['error']}")
            continue
        errors = " ".join(f"{n} {e:.1e}/{c['sdpa_errors'][n]:.1e}" for n, e in c["errors"].items())
        print(f"check {c['impl']:>8} W={c['world_size']} {c['layout']:>10} {c['dtype']:>8}: {c['status']} "
              f"(error/SDPA's: {errors})")
    for r in records:
        if r.get("kind") in ("ring", "torch_cp") and r["status"] == "ok":
            ranks = " ".join(f"{t:.3g}" for t in r["rank_ms"])
            predicted = " ".join(f"{t:.3g}" for t in r.get("predicted_rank_ms", []))
            print(f"{r['impl']:>19} {r['scaling']:>6} W={r['world_size']} N={r['N']:>7} {r['dtype']:>8} "
                  f"{r['pass']:>16}: ms [{ranks}]" + (f" predicted [{predicted}]" if predicted else ""))
        elif r.get("kind") == "single" and r["status"] == "ok":
            print(f"single N={r['N']:>7} {r['dtype']:>8} {r['pass']:>16}: SDPA {r['ms']:.3g} ms")
        else:
            print(f"{r.get('kind')} W={r.get('world_size')} N={r['N']} {r['dtype']} {r['pass']}: {r['status']}: "
                  f"{r['error']}")
    for c in summary["comparisons"]:
        print(f"fa2edu vs torch_cp {c['scaling']} W={c['world_size']} {c['layout']} {c['dtype']} {c['pass']}: "
              f"{c['speedup']:.2f}x")
    for item in summary["not_run"]:
        print(f"not run: {item}")


def merge(paths, out) -> dict:
    """One results file from parts of a run: the first part's header (with every part's command and date), every
    record, the checks, the not-run items and the rates of all parts, comparisons and efficiencies recomputed."""
    import json
    parts = [json.loads(open(path).read()) for path in paths]
    header = dict(parts[0]["header"], parts=[{"command": p["header"]["command"], "date": p["header"]["date"],
                                              "settings": p["header"]["settings"]} for p in parts])
    records = [r for p in parts for r in p["records"]]
    summary = {"checks": [c for p in parts for c in p["summary"]["checks"]],
               "not_run": [n for p in parts for n in p["summary"]["not_run"]],
               "link_bytes_per_s": min(p["summary"]["link_bytes_per_s"] or math.inf for p in parts),
               "step_flop_rate": [r for p in parts for r in p["summary"]["step_flop_rate"]],
               "comparisons": _comparisons(records), "scaling": _scaling(records),
               "seconds": sum(p["summary"]["seconds"] for p in parts)}
    if math.isinf(summary["link_bytes_per_s"]):
        summary["link_bytes_per_s"] = None
    payload = {"header": header, "records": records, "summary": summary}
    results_io.write_results(out, header, records, summary)
    return payload


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        payload = merge(args.merge, args.out)
        _print(payload)
        print(f"wrote {args.out}")
        return 0
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
