"""Speed in a model: the small GPT trained on a GPU with fa2edu's attention and with SDPA, and the op alone.

    python -m benchmarks.gpt_speed                          # on a GPU: both parts (under 4 minutes on an H100)
    python -m benchmarks.gpt_speed --skip-micro --steps 60  # training only, longer curves
    python -m benchmarks.gpt_speed --dry-run --out /tmp/g   # a tiny version of everything on the CPU, seconds
    python -m benchmarks.gpt_speed --plot FILE.json         # redraw the figure of a results file

**Training** (``examples/gpt``'s model, one attention switch): for each configuration (``d64``: 4 layers,
d_model 512, 8 heads of d = 64; ``d128``: 4 layers, d_model 1024, 8 heads of d = 128; context 4096, batch 4: 16k
tokens a step; attention is a little under half of the FLOPs at d64, over a quarter at d128) and
each precision (``float32``, TF32 off; ``bfloat16``: float32 weights under ``torch.autocast``), three models from
the same seed see the same batches: ``sdpa`` (``F.scaled_dot_product_attention``, whatever backend PyTorch picks),
``reference`` (SDPA forced to its MATH backend: the float noise of this model, measured) and ``fa2edu``
(``fa2edu.torch.flash_attention``: ``kernels_gpu.fast`` in float32, ``kernels_gpu.tensorcore`` in bfloat16).
Every step's loss is kept (as a tensor, read once at the end, so no step waits for the GPU); tokens/s are timed
over the steps after ``--warmup`` (which include numba's compilation of each kernel), with Python's garbage
collector paused (after a collection) for all three alike, so that no collection lands inside one run's window
(``--keep-gc`` leaves it running). The window lasts at least ``--min-seconds`` of SDPA's steps: a short probe run
of SDPA measures its step, and every run of the configuration then takes that many steps (at least ``--steps``) —
40 bfloat16 d64 steps last 0.4 s, and a single hiccup of the host of 30 ms moved that run's ratio by 7 %. Each
timed step's host time is kept too (``step_seconds``: when it had been queued). The losses are judged by
``examples.gpt.train.agreement_bounds``: fa2edu's distance from SDPA within 4 × the running maximum of the
reference's, plus 8 float32 ulps.

**The op alone**: forward + backward of ``flash_attention`` against SDPA in the same dtype (float32: SDPA's
memory-efficient backend; bfloat16 and float16: its flash backend), on the FA2 paper's grid at N = 2048 (batch × N
= 16k tokens, heads × d = 2048), d = 64 and 128, causal and not: CUDA events, warm-up, median of repeats, TFLOP/s
by the FA2 paper's FLOP model.

Results: ``benchmarks/results/<device>/gpt_speed.json`` (device, versions, date, settings, every loss curve,
tokens/s, the op's times) and ``gpt_speed.png`` beside it (loss curves, tokens/s bars, the op's speed ratios).
Targets printed at the end: training tokens/s ≥ 0.8 × SDPA's, the op ≥ 0.9 × SDPA's (float32).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # examples/ is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import timing  # noqa: E402
from benchmarks.harness.flop_model import model_flops  # noqa: E402
from benchmarks.harness.results_io import default_results_path, utc_now  # noqa: E402

#: model sizes: 8 heads of d = 64 or 128 (d_model = heads · d), 4 layers. Large enough that the GPU's work in a
#: step outlasts the host's (numba prepares every kernel launch in Python, a fraction of a millisecond each).
CONFIGS = {"d64": dict(n_layer=4, n_head=8, d_model=512), "d128": dict(n_layer=4, n_head=8, d_model=1024)}
PRECISIONS = ("float32", "bfloat16")
RUNS = ("sdpa", "reference", "fa2edu")
#: the op alone: SDPA's backend compared against in each dtype
SDPA_BACKEND = {"float32": "EFFICIENT_ATTENTION", "bfloat16": "FLASH_ATTENTION", "float16": "FLASH_ATTENTION"}
TARGETS = {"training": 0.8, "op": 0.9}

#: the dry run: everything at toy sizes on the CPU (fa2edu's NumPy path; float32 only: the CPU path takes no bf16)
DRY = dict(configs={"d8": dict(n_layer=1, n_head=2, d_model=16)}, precisions=("float32",), context=32, batch=2,
           steps=4, warmup=1, micro_d=(8,), micro_dtypes=("float32",), micro_N=64, tokens=128, hidden=16, repeats=2)


# ---------------------------------------------------------------------------------------------- training

def train_run(attention, data, *, model, precision, steps, warmup, batch, context, lr, seed, device,
              pause_gc=True):
    """Train one model; returns its per-step losses, tokens/s over the timed steps, the host's time per timed step
    (``step_seconds``: when each step's work had been queued; the GPU may still be behind), peak memory and size.

    ``attention``: ``"sdpa"``, ``"reference"`` (SDPA under ``sdpa_kernel(SDPBackend.MATH)``) or ``"fa2edu"``.
    The weights come from ``torch.manual_seed(seed)`` and the batches from ``data.batches(steps, …, seed)``, so runs
    that differ only in ``attention`` start equal and see the same data in the same order. ``pause_gc``: collect
    garbage before the timed steps and pause Python's collector during them (as ``timeit`` does), so that a
    collection pass does not land inside one run's short timed window and not another's.
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from examples.gpt.model import GPT, GPTConfig

    config = GPTConfig(vocab_size=data.vocab_size, context=context, attention="fa2edu" if attention == "fa2edu"
                       else "sdpa", **model)
    torch.manual_seed(seed)
    net = GPT(config).to(device)
    checksum = float(sum(p.detach().double().sum() for p in net.parameters()))
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    batches = [(x.to(device), y.to(device)) for x, y in data.batches(steps, batch, context, seed=seed)]
    backend = sdpa_kernel(SDPBackend.MATH) if attention == "reference" else contextlib.nullcontext()
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, start, marks = [], None, []
    gc_was_on = gc.isenabled()
    try:
        with backend:
            for step, (x, y) in enumerate(batches):
                if step == warmup:
                    sync()
                    if pause_gc:
                        gc.collect()
                        gc.disable()
                    start = time.perf_counter()
                with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bfloat16"):
                    _, loss = net(x, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
                if start is not None:
                    marks.append(time.perf_counter())
        sync()
        seconds = time.perf_counter() - start
    finally:
        if gc_was_on:
            gc.enable()
    timed = steps - warmup
    step_seconds = [b - a for a, b in zip([start] + marks[:-1], marks)]
    return {"loss": [float(v) for v in torch.stack(losses).float().cpu()],
            "tokens_per_s": timed * batch * context / seconds, "timed_steps": timed, "seconds": seconds,
            "step_seconds": step_seconds, "gc_paused": pause_gc,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "parameters": sum(p.numel() for p in net.parameters()), "initial_checksum": checksum}


def judge(runs):
    """fa2edu's losses against SDPA's, within the bound the noise reference measures (examples.gpt.train)."""
    import torch

    from examples.gpt.train import agreement_bounds
    sdpa, reference, fa2 = (runs[name]["loss"] for name in RUNS)
    bounds = agreement_bounds(reference, sdpa, torch.float32)
    diffs = [abs(a - b) for a, b in zip(fa2, sdpa)]
    finite = all(math.isfinite(x) for x in fa2 + sdpa + reference)
    return {"abs_diff": diffs, "noise": [abs(a - b) for a, b in zip(reference, sdpa)], "bound": bounds,
            "max_ratio": max(d / b for d, b in zip(diffs, bounds)) if finite else None,
            "within_bound": finite and all(d <= b for d, b in zip(diffs, bounds)),
            "same_initial_weights": len({runs[name]["initial_checksum"] for name in RUNS}) == 1,
            "speed_ratio": runs["fa2edu"]["tokens_per_s"] / runs["sdpa"]["tokens_per_s"]}


def training(settings, device, progress):
    """Every (configuration, precision): the three runs and their comparison."""
    from examples.gpt.data import CharData, generate_text
    # enough text that windows of the context rarely repeat
    data = CharData(generate_text(max(40_000, 20 * settings["context"])))
    results = []
    for name, model in settings["configs"].items():
        for precision in settings["precisions"]:
            def run(attention, steps, model=model, precision=precision):
                return train_run(attention, data, model=model, precision=precision, steps=steps,
                                 warmup=settings["warmup"], batch=settings["batch"], context=settings["context"],
                                 lr=settings["lr"], seed=settings["seed"], device=device,
                                 pause_gc=settings.get("pause_gc", True))

            steps, probe = timed_steps(run, settings)
            if probe is not None:
                progress(f"{name} {precision:>8}: SDPA's step {probe * 1e3:.1f} ms → {steps} steps")
            runs = {}
            for attention in RUNS:
                runs[attention] = run(attention, steps)
                progress(f"{name} {precision:>8} {attention:>9}: {runs[attention]['tokens_per_s']:>10,.0f} tokens/s, "
                         f"loss {runs[attention]['loss'][0]:.3f} → {runs[attention]['loss'][-1]:.3f}")
            head = model["d_model"] // model["n_head"]
            results.append({"config": name, "precision": precision, "d": head, **model, "steps": steps,
                            "probe_step_seconds": probe, "runs": runs, **judge(runs)})
    return results


def timed_steps(run, settings) -> tuple[int, float | None]:
    """How many steps every run of a configuration takes: ``steps``, or more, so that SDPA's timed steps last
    ``min_seconds`` (its step measured by a probe run of ``warmup`` + 10 steps: their seconds, the GPU's included,
    over 10). Returns (steps, the probe's step in seconds or None when there is no minimum)."""
    if not settings.get("min_seconds"):
        return settings["steps"], None
    timed = run("sdpa", settings["warmup"] + 10)
    probe = timed["seconds"] / timed["timed_steps"]
    return max(settings["steps"], settings["warmup"] + math.ceil(settings["min_seconds"] / probe)), probe


# ---------------------------------------------------------------------------------------------- the op alone

class WallClock:
    """The CPU as a timing device for the dry run: events read the wall clock."""

    class Event:
        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    def event(self):
        return self.Event()

    def synchronize(self):
        pass


def op_call(impl, q, k, v, dO, causal, sdpa_backend, op_backend=None):
    """A function of no arguments: one forward and backward of ``impl`` (``"fa2edu"`` on ``op_backend``, a key of
    ``fa2edu.torch.BACKENDS`` or the dispatch table's choice if None; or ``"sdpa"``, restricted to ``sdpa_backend``,
    a name of ``SDPBackend``, or PyTorch's own choice if None)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa2edu.torch import flash_attention
    def only():                           # a fresh context manager per call (one cannot be entered twice)
        return sdpa_kernel(getattr(SDPBackend, sdpa_backend)) if sdpa_backend else contextlib.nullcontext()

    def call():
        for x in (q, k, v):
            x.grad = None
        if impl == "fa2edu":
            O = flash_attention(q, k, v, causal=causal, backend=op_backend)
        else:
            with only():
                O = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        O.backward(dO)
        return O
    return call


def micro(settings, device, progress):
    """Forward + backward of the op and of SDPA, same inputs, same dtype, for every (d, dtype, causal)."""
    import torch
    clock = timing.TorchDevice() if device.startswith("cuda") else WallClock()
    rows = []
    N = settings["micro_N"]
    for d in settings["micro_d"]:
        batch, heads = max(1, settings["tokens"] // N), settings["hidden"] // d
        for dtype_name in settings["micro_dtypes"]:
            dtype = getattr(torch, dtype_name)
            for causal in (False, True):
                generator = torch.Generator(device=device).manual_seed(d)
                q, k, v, dO = (torch.randn(batch, heads, N, d, generator=generator, device=device, dtype=dtype)
                               for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                flops = sum(model_flops(batch, heads, N, d, causal, p) for p in ("forward", "backward"))
                # the CPU (dry run) has no memory-efficient or flash backend: PyTorch's choice there
                sdpa_backend = SDPA_BACKEND[dtype_name] if device.startswith("cuda") else None
                row = {"d": d, "dtype": dtype_name, "causal": causal, "batch": batch, "heads": heads, "N": N,
                       "sdpa_backend": sdpa_backend or "default", "op_backend": settings.get("op_backend")}
                outputs = {}
                for impl in ("fa2edu", "sdpa"):
                    call = op_call(impl, q, k, v, dO, causal, sdpa_backend, settings.get("op_backend"))
                    outputs[impl] = call().detach()               # also the first (compiling) call
                    times = timing.time_calls([call], clock, settings["warmup_calls"], settings["repeats"])
                    summary = timing.summarize_ms(times)
                    row[impl] = {**summary, "tflops": flops / (summary["ms"] * 1e-3) / 1e12}
                row["max_abs_diff_O"] = float((outputs["fa2edu"].float() - outputs["sdpa"].float()).abs().max())
                row["speed_ratio"] = row["sdpa"]["ms"] / row["fa2edu"]["ms"]
                progress(f"op d={d:3d} {dtype_name:>8} causal={int(causal)}: fa2edu {row['fa2edu']['ms']:8.3f} ms "
                         f"({row['fa2edu']['tflops']:6.1f} TFLOP/s), SDPA {row['sdpa_backend'].lower()} "
                         f"{row['sdpa']['ms']:8.3f} ms: {row['speed_ratio']:.2f}×")
                rows.append(row)
                del q, k, v, dO, outputs
    return rows


# ---------------------------------------------------------------------------------------------- figure

def plot(result, path):
    """Loss curves (one panel per configuration and precision), tokens/s bars and the op's speed ratios."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = result.get("training", [])
    ops = result.get("micro", [])
    columns = max(2, len(train))
    fig = plt.figure(figsize=(4.2 * columns, 8))
    grid = fig.add_gridspec(2, columns)
    styles = {"sdpa": dict(lw=2.5, alpha=0.6), "reference": dict(lw=1, color="tab:green", alpha=0.8),
              "fa2edu": dict(lw=1, ls="--", color="black")}
    for i, entry in enumerate(train):
        axis = fig.add_subplot(grid[0, i])
        for run in RUNS:
            axis.plot(entry["runs"][run]["loss"], label=run, **styles[run])
        verdict = "within" if entry["within_bound"] else "OUTSIDE"
        axis.set_title(f"{entry['config']} {entry['precision']}: loss ({verdict} the bound)", fontsize=9)
        axis.set_xlabel("step")
        axis.legend(fontsize=7)
    half = columns // 2
    if train:
        axis = fig.add_subplot(grid[1, :half])
        labels = [f"{e['config']}\n{e['precision']}" for e in train]
        x = range(len(train))
        for offset, run, color in ((-0.2, "sdpa", "tab:blue"), (0.2, "fa2edu", "black")):
            axis.bar([i + offset for i in x], [e["runs"][run]["tokens_per_s"] for e in train], 0.4, label=run,
                     color=color, alpha=0.7)
        axis.set_xticks(list(x), labels, fontsize=8)
        axis.set_ylabel("training tokens / s")
        axis.set_title("training throughput", fontsize=9)
        axis.legend(fontsize=7)
    if ops:
        axis = fig.add_subplot(grid[1, half:])
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        labels = [f"d{r['d']} {short[r['dtype']]}\n{'causal' if r['causal'] else 'full'}" for r in ops]
        axis.bar(range(len(ops)), [r["speed_ratio"] for r in ops], color="tab:orange")
        axis.axhline(1.0, color="grey", lw=1)
        axis.axhline(TARGETS["op"], color="red", lw=1, ls=":", label=f"{TARGETS['op']}× target (float32)")
        axis.set_xticks(range(len(ops)), labels, fontsize=7)
        axis.set_ylabel("SDPA time / fa2edu time (fwd + bwd)")
        axis.set_title(f"the op alone, N = {ops[0]['N']}", fontsize=9)
        axis.legend(fontsize=7)
    fig.suptitle(f"fa2edu.torch.flash_attention vs SDPA on {result['device']} ({result['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- the command

def summarize(result):
    """Lines saying how each target fared (a dry run on the CPU is judged against none: they concern a GPU)."""
    lines = []

    def verdict(ratio, target):
        return "" if result.get("dry_run") else f" ({'met' if ratio >= target else 'MISSED'} ≥ {target})"
    for e in result.get("training", []):
        ratio = e["speed_ratio"]
        fa2, sdpa = (e["runs"][run]["tokens_per_s"] for run in ("fa2edu", "sdpa"))
        lines.append(f"training {e['config']:>5} {e['precision']:>8}: fa2edu {fa2:>10,.0f} tokens/s, "
                     f"SDPA {sdpa:>10,.0f}: {ratio:.2f}×{verdict(ratio, TARGETS['training'])}; losses "
                     f"{'within' if e['within_bound'] else 'OUTSIDE'} the noise bound (max ratio "
                     f"{e['max_ratio'] if e['max_ratio'] is None else round(e['max_ratio'], 2)})")
    for r in result.get("micro", []):
        goal = verdict(r["speed_ratio"], TARGETS["op"]) if r["dtype"] == "float32" else ""
        lines.append(f"op d={r['d']:3d} {r['dtype']:>8} causal={int(r['causal'])}: {r['speed_ratio']:.2f}× SDPA "
                     f"{r['sdpa_backend'].lower()}{goal}")
    return lines


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt_speed", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="a tiny version of everything on the CPU (no GPU needed)")
    p.add_argument("--plot", metavar="RESULTS", default=None, help="redraw the figure of a results file and exit")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"model configurations among {list(CONFIGS)}")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="float32 and/or bfloat16 (autocast)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run, at least")
    p.add_argument("--min-seconds", type=float, default=3.0,
                   help="take more steps where SDPA's timed steps would last less than this (0: exactly --steps)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s (they include compilation)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=4096, help="sequence length N")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--keep-gc", action="store_true", help="leave Python's garbage collector running during the timed "
                   "training steps (default: collect before them, pause it during them)")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--micro-dtypes", default="float32,bfloat16,float16", help="dtypes of the op-alone benchmark")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per op configuration")
    p.add_argument("--op-backend", default=None,
                   help="the op-alone benchmark's fa2edu backend (a key of fa2edu.torch.BACKENDS, e.g. 3xtf32; "
                        "default: the dispatch table)")
    p.add_argument("--micro-N", type=int, default=2048, help="sequence length of the op-alone benchmark (batch × N "
                                                             "= 16k tokens, heads × d = 2048)")
    p.add_argument("--numba-allocator", choices=("torch", "numba"), default="torch",
                   help="numba's device allocations from PyTorch's caching allocator (as the kernel benchmarks) or "
                        "numba's own")
    p.add_argument("--out", default=None, help="results file, or a folder for gpt_speed.json "
                                               "(default benchmarks/results/<device>/gpt_speed.json)")
    return p


def _settings(args):
    if args.dry_run:
        settings = dict(DRY, lr=args.lr, seed=args.seed)
    else:
        unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
        if unknown:
            raise SystemExit(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
        settings = dict(configs={c: CONFIGS[c] for c in args.configs.split(",")},
                        precisions=tuple(args.precisions.split(",")), context=args.context, batch=args.batch,
                        steps=args.steps, warmup=args.warmup, micro_d=(64, 128),
                        micro_dtypes=tuple(args.micro_dtypes.split(",")), micro_N=args.micro_N, tokens=16384,
                        hidden=2048,
                        repeats=args.repeats, lr=args.lr, seed=args.seed, pause_gc=not args.keep_gc,
                        min_seconds=args.min_seconds)
    if settings["warmup"] >= settings["steps"]:
        raise SystemExit(f"--warmup ({settings['warmup']}) must be smaller than --steps ({settings['steps']})")
    settings["warmup_calls"] = 1 if args.dry_run else 3
    settings["op_backend"] = args.op_backend
    return settings


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.plot:
        path = Path(args.plot)
        print(f"wrote {plot(json.loads(path.read_text()), path.with_suffix('.png'))}")
        return 0
    settings = _settings(args)
    import torch
    if args.dry_run:
        device, device_name, allocator = "cpu", "cpu (dry run)", None
        torch.set_num_threads(1)
    else:
        _, allocator = timing.cuda_setup(use_torch_allocator=args.numba_allocator == "torch")
        device, device_name = "cuda", torch.cuda.get_device_name()
    if args.out is None:
        if args.dry_run:
            raise SystemExit("--dry-run writes nowhere by default: pass --out")
        out = Path(default_results_path(device_name, "gpt_speed"))
    else:
        out = Path(args.out)
        out = out / "gpt_speed.json" if out.suffix != ".json" else out
    started = time.perf_counter()

    def progress(line):
        print(f"[{time.perf_counter() - started:6.1f} s] {line}", flush=True)

    result = {"device": device_name, "date": utc_now(), "versions": timing.package_versions(),
              "torch_cuda": torch.version.cuda, "numba_allocator": allocator, "dry_run": args.dry_run,
              "settings": {k: v for k, v in settings.items()}, "command": " ".join(sys.argv),
              "training": [], "micro": []}
    if not args.skip_training:
        result["training"] = training(settings, device, progress)
    if not args.skip_micro:
        result["micro"] = micro(settings, device, progress)
    result["seconds"] = time.perf_counter() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}\nwrote {plot(result, out.with_suffix('.png'))}")
    for line in summarize(result):
        print(line)
    print(f"total {result['seconds']:.0f} s")
    ok = all(e["same_initial_weights"] and e["max_ratio"] is not None for e in result["training"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
