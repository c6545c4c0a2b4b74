"""FlexAttention on the GPU: every ready mod, fa2edu's kernels beside PyTorch's compiled FlexAttention and SDPA.

    python -m benchmarks.flex                       # → benchmarks/results/<device>/flex_bf16.json
    python -m benchmarks.flex --out FILE.json --d 64 --N 4096
    python -m benchmarks.flex --plot FILE.json      # the chapter's figure, FILE.png (no GPU)
    python -m benchmarks.flex --dry-run --out DIR   # the whole run on the CPU at toy sizes (the tests' smoke run)

One run, bfloat16, the FA2 paper's grid (batch × N = 16k tokens, hidden 2048 → heads = 2048 / d), d = 64 and 128,
N = 4096, 8192, 16384, for every ready mod of :mod:`fa2edu.flex` — causal, sliding_window(1024), prefix_lm(N/8),
document (8 documents of random lengths per sequence), alibi (causal), softcap(30) (causal, as Gemma 2),
relative_bias (causal, a T5-style table of 257 entries) — forward and forward + backward:

* ``fa2edu``: ``fa2edu.torch.flex_attention`` (``kernels_gpu.flex``, the mods compiled by numba), its BlockMask
  made by ``fa2edu.create_block_mask`` at ``--block-size`` (default 64: the kernels' own tile);
* ``torch_flex``: ``torch.nn.attention.flex_attention`` compiled with ``torch.compile``, its BlockMask from
  PyTorch's ``create_block_mask`` (BLOCK_SIZE 128, its default), the same mods written for tensors;
* ``sdpa``: ``F.scaled_dot_product_attention`` where it has the same mask — ``is_causal=True`` for causal, an
  explicit boolean mask (B·H·N² bytes… broadcast over batch and heads: N² bytes) for the sliding window; no other
  mod has an SDPA form without a dense bias, and those are left out.

Each implementation's forward output is first checked against PyTorch's compiled FlexAttention in float32 on the
same inputs (relative Frobenius error < 2e-2, no NaN) — the GPU tests (tests/gpu/test_flex_gpu.py) check O and the
gradients against a float64 oracle — then timed with CUDA events: warm-up, median of repeats, input sets rotated
(``benchmarks.tensorcore.time_ms``). TFLOP/s are model FLOPs of the scores the mask keeps: 4·d·(kept scores)·B·H
forward, 3.5× that forward + backward (the FA2 paper's 2.5× for the backward), the same work for every
implementation whatever it executes.

The summary holds, per (d, N, mod, pass), fa2edu's speed over PyTorch's compiled FlexAttention (issue 38's target:
≥ 1.0), and at N = 16384 full causal's time over sliding_window(1024)'s for each implementation, beside the ratio
the ledger predicts (:func:`fa2edu.io.simulate_flex_io`, closed form at fa2edu's BLOCK_SIZE: HBM elements, and the
visited blocks, which are the MMA work); the issue's target is ≥ 8×. The file records the device, versions, date
and command (benchmarks/README.md's conventions).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.harness.results_io import default_results_path, write_measurement

GRID_N = (4096, 8192, 16384)
TOKENS = 16384
HIDDEN = 2048
MODS = ("causal", "sliding_window", "prefix_lm", "document", "alibi", "softcap", "relative_bias")
PASSES = ("forward", "forward_backward")
WINDOW = 1024
#: the dry run: the whole path on the CPU at toy sizes (fa2edu's NumPy route, PyTorch's flex eagerly, SDPA)
DRY = dict(N=(128,), d=(16,), tokens=256, hidden=32, window=40, block_size=32)


# -- the mods, for fa2edu and for PyTorch -------------------------------------------------------------------------

def document_ids(N: int, seed: int = 0, documents: int = 8) -> np.ndarray:
    """Document id of each of N positions: ``documents`` documents of random lengths (each at least N/32)."""
    rng = np.random.default_rng(seed)
    least = max(1, N // 32)
    cuts = np.sort(rng.choice(np.arange(least, N - least), documents - 1, replace=False))
    return np.repeat(np.arange(documents), np.diff(np.concatenate([[0], cuts, [N]])))


def make_mods(name: str, N: int, heads: int, device, window: int = WINDOW):
    """``(fa2edu mask_mod, fa2edu score_mod, torch mask_mod, torch score_mod, sdpa kind)`` of one ready mod at
    sequence length N; ``sdpa kind`` is "causal", "window" or None (no SDPA form)."""
    import torch

    from fa2edu import flex
    causal_t = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)                           # noqa: E731
    if name == "causal":
        return flex.causal, None, causal_t, None, "causal"
    if name == "sliding_window":
        def window_t(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
        return flex.sliding_window(window), None, window_t, None, "window"
    if name == "prefix_lm":
        n = N // 8

        def prefix_t(b, h, q_idx, kv_idx):
            return (kv_idx < n) | (q_idx >= kv_idx)
        return flex.prefix_lm(n), None, prefix_t, None, None
    if name == "document":
        ids = document_ids(N)
        ids_t = torch.from_numpy(ids).to(device)

        def document_t(b, h, q_idx, kv_idx):
            return (ids_t[q_idx] == ids_t[kv_idx]) & (q_idx >= kv_idx)
        return flex.and_masks(flex.causal, flex.document(ids)), None, document_t, None, None
    if name == "alibi":
        slopes = flex.alibi_slopes(heads)
        slopes_t = torch.from_numpy(slopes).float().to(device)

        def alibi_t(score, b, h, q_idx, kv_idx):
            return score + slopes_t[h] * (kv_idx - q_idx)
        return flex.causal, flex.alibi(slopes), causal_t, alibi_t, None
    if name == "softcap":
        def softcap_t(score, b, h, q_idx, kv_idx):
            return 30.0 * torch.tanh(score / 30.0)
        return flex.causal, flex.softcap(30.0), causal_t, softcap_t, None
    if name == "relative_bias":
        table = np.linspace(-1.0, 1.0, 257)
        table_t = torch.from_numpy(table).float().to(device)

        def bias_t(score, b, h, q_idx, kv_idx):
            return score + table_t[(kv_idx - q_idx + 128).clamp(0, 256)]
        return flex.causal, flex.relative_bias(table), causal_t, bias_t, None
    raise ValueError(f"mod must be one of {MODS}, got {name!r}")


def kept_scores(mask_mod, N: int, rows_per_chunk: int = 1024) -> int:
    """Scores (i, j) of an N × N problem that ``mask_mod`` keeps (at b = h = 0), counted exactly in row chunks."""
    from fa2edu import flex
    if mask_mod is None:
        return N * N
    mod = flex.at_lengths(mask_mod, N, N)
    j = np.arange(N)[None, :]
    total = 0
    for start in range(0, N, rows_per_chunk):
        i = np.arange(start, min(start + rows_per_chunk, N))[:, None]
        total += int(np.count_nonzero(np.broadcast_to(mod(0, 0, i, j), (len(i), N))))
    return total


def model_flops(kept: int, d: int, batch: int, heads: int, pass_: str) -> float:
    """FA2's model FLOPs of the kept scores: 4·d per score forward, 3.5× that forward + backward."""
    forward = 4.0 * d * kept * batch * heads
    return forward if pass_ == "forward" else 3.5 * forward


def predicted_ratio(N: int, d: int, block_size, window: int = WINDOW) -> dict:
    """What the ledger predicts for full causal over sliding_window(window) at N (fa2edu's BLOCK_SIZE): the ratio
    of HBM elements (:func:`fa2edu.io.simulate_flex_io`, closed form, per pass) and of visited blocks (the MMA
    work)."""
    import fa2edu
    from fa2edu import flex
    from fa2edu.io import simulate_flex_io
    out = {}
    masks = {name: fa2edu.create_block_mask(mod, None, None, N, N, BLOCK_SIZE=block_size)
             for name, mod in (("causal", flex.causal), ("window", flex.sliding_window(window)))}
    reports = {name: simulate_flex_io(bm, N, d, method="closed_form").to_records()
               for name, bm in masks.items()}
    for pass_ in ("forward", "backward"):
        total = {name: next(r["total"] for r in recs if r["pass"] == pass_) for name, recs in reports.items()}
        out[f"hbm_{pass_}"] = total["causal"] / total["window"]
    visited = {name: int((bm.classes != flex.SKIPPED).sum()) for name, bm in masks.items()}
    out["visited_blocks"] = visited["causal"] / visited["window"]
    out["visited"] = visited
    return out


# -- timing -------------------------------------------------------------------------------------------------------

def time_cpu(fn, inputs, repeats: int = 3) -> tuple[float, int]:
    """Median milliseconds on the CPU (the dry run): wall clock around each call."""
    fn(*inputs[0])
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        fn(*inputs[r % len(inputs)])
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2], repeats


def with_backward(forward, dO):
    """forward + backward of ``forward(q, k, v) -> O`` with the upstream gradient dO (autograd.grad: no .grad
    accumulates between repeats)."""
    import torch

    def run(q, k, v):
        O = forward(q, k, v)
        O = O[0] if isinstance(O, tuple) else O
        return torch.autograd.grad(O, (q, k, v), dO)
    return run


def implementations(name, N, heads, batch, device, block_size, window, compiled_flex):
    """{impl: forward(q, k, v) -> O} for one mod at one N."""
    import torch
    import torch.nn.functional as F

    import fa2edu
    from fa2edu.torch import flex_attention

    mask_mod, score_mod, mask_t, score_t, sdpa_kind = make_mods(name, N, heads, device, window)
    bm = None if mask_mod is None else fa2edu.create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=block_size)
    impls = {"fa2edu": lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)}
    if compiled_flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask
        tbm = None if mask_t is None else create_block_mask(mask_t, None, None, N, N, device=str(device))
        impls["torch_flex"] = lambda q, k, v: compiled_flex(q, k, v, score_mod=score_t, block_mask=tbm)
    if sdpa_kind == "causal":
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif sdpa_kind == "window":
        i = torch.arange(N, device=device)
        keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)          # (N, N) bool, broadcast
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return impls, bm


def reference(name, q, k, v, N, heads, device, window, compiled_flex):
    """O by PyTorch's FlexAttention in float32 on the same inputs (compiled on the GPU, eager on the CPU)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _, _, mask_t, score_t, _ = make_mods(name, N, heads, device, window)
    tbm = None if mask_t is None else create_block_mask(mask_t, None, None, N, N, device=str(device))
    fn = compiled_flex or flex_attention
    with torch.no_grad():
        return fn(q.detach().float(), k.detach().float(), v.detach().float(), score_mod=score_t, block_mask=tbm)


# -- the run ------------------------------------------------------------------------------------------------------

def run(args, checkpoint=None) -> dict:
    """The grid of ``args``; ``checkpoint(rows)``, when given, is called after every (d, N, mod) with the rows so far
    (the results file is rewritten each time: a run cut short by a time limit keeps what it measured)."""
    import numba
    import torch

    dry = args.dry_run
    if dry:                                  # PyTorch's FlexAttention runs eagerly on the CPU, and says so each time
        import warnings
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16      # the dry run: fa2edu's NumPy route takes float32
    tokens, hidden = (DRY["tokens"], DRY["hidden"]) if dry else (TOKENS, HIDDEN)
    window = DRY["window"] if dry else args.window
    block_size = DRY["block_size"] if dry else args.block_size
    Ns = DRY["N"] if dry else tuple(int(x) for x in args.N.split(","))
    ds = DRY["d"] if dry else tuple(int(x) for x in args.d.split(","))
    mods = args.mods.split(",")
    if not dry:
        import kernels_gpu.runtime as rt
        from benchmarks.tensorcore import time_ms
        rt.poison_outputs = True
        torch.backends.cuda.matmul.allow_tf32 = False
    compiled_flex = None
    try:
        from torch.nn.attention.flex_attention import flex_attention as torch_flex
        compiled_flex = torch_flex if dry else torch.compile(torch_flex)
        if not dry:
            import warnings

            import torch._dynamo
            # One compiled function serves every (mod, d, N, pass), a graph each: more than dynamo's default of 8
            # recompilations, past which it runs FlexAttention eagerly (scores materialised) and says so in a
            # warning. The limit is raised, and that warning made an error, so no eager time is recorded as PyTorch's.
            for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 4096)
            warnings.filterwarnings("error", message="flex_attention called without torch.compile")
    except ImportError:                                   # pragma: no cover (torch < 2.5)
        pass
    device_name = "cpu (dry run)" if dry else torch.cuda.get_device_name(0)
    rows = []
    bar = tqdm(total=len(ds) * len(Ns) * len(mods), desc="flex grid", file=sys.stdout)
    for d in ds:
        heads = hidden // d
        for N in Ns:
            batch = max(1, tokens // N)
            for name in mods:
                generator = torch.Generator(device=device).manual_seed(N + d)
                sets = [tuple(torch.randn(batch, heads, N, d, device=device, dtype=dtype, generator=generator)
                              .requires_grad_() for _ in range(3)) for _ in range(1 if dry else 2)]
                plain = [tuple(x.detach() for x in s) for s in sets]      # the forward pass's inputs: no autograd
                dO = torch.randn(batch, heads, N, d, device=device, dtype=dtype, generator=generator)
                impls, bm = implementations(name, N, heads, batch, device, block_size, window, compiled_flex)
                kept = kept_scores(make_mods(name, N, heads, device, window)[0], N)
                try:
                    ref = reference(name, *sets[0], N, heads, device, window, None if dry else compiled_flex)
                except Exception as error:  # noqa: BLE001 (recorded: no reference, nothing timed as checked)
                    ref, ref_error = None, f"{type(error).__name__}: {str(error)[:200]}"
                for impl, forward in impls.items():
                    for pass_ in PASSES:
                        row = dict(impl=impl, mod=name, pass_=pass_, dtype=str(dtype).removeprefix("torch."), d=d,
                                   N=N, batch=batch, heads=heads, kept_fraction=kept / (N * N),
                                   block_size=list(bm.BLOCK_SIZE) if (impl == "fa2edu" and bm is not None) else None)
                        fn = forward if pass_ == "forward" else with_backward(forward, dO)
                        try:
                            if pass_ == "forward":
                                with torch.no_grad():
                                    out = forward(*plain[0])
                                if ref is None:
                                    raise RuntimeError(f"no reference to check against: {ref_error}")
                                rel = float((out.float() - ref).norm() / ref.norm())
                                row["rel_error"] = rel
                                if not rel < 2e-2 or bool(out.isnan().any()):
                                    row.update(status="wrong")
                                    rows.append(row)
                                    continue
                            if not dry:
                                rt.poison_outputs = False
                            inputs = plain if pass_ == "forward" else sets
                            ms, reps = time_cpu(fn, inputs) if dry else time_ms(fn, inputs, queued=True)
                            if not dry:
                                rt.poison_outputs = True
                            flops = model_flops(kept, d, batch, heads, pass_)
                            row.update(status="ok", ms=ms, repeats=reps, tflops=flops / ms / 1e9)
                        except Exception as error:  # noqa: BLE001 (recorded, the run goes on)
                            row.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
                        rows.append(row)
                        bar.write(f"d={d:3d} N={N:5d} {name:15s} {impl:10s} {pass_:16s} "
                                  f"{row.get('tflops', float('nan')):7.1f} TFLOP/s  {row['status']}")
                bar.update(1)
                del sets, plain, dO
                if checkpoint is not None:
                    checkpoint(rows)
                if not dry:
                    torch.cuda.empty_cache()
    bar.close()
    summary = summarize(rows, Ns, ds, block_size, window)
    versions = dict(torch=torch.__version__, numba=numba.__version__, numpy=np.__version__,
                    python=platform.python_version())
    try:
        versions["numba_cuda"] = __import__("numba_cuda").__version__
    except ImportError:                                   # pragma: no cover
        versions["numba_cuda"] = None
    if not dry:
        versions["cuda"] = torch.version.cuda
    return dict(device=device_name, versions=versions, tokens=tokens, hidden=hidden, window=window,
                fa2edu_block_size=block_size, dry_run=dry, rows=rows, summary=summary)


def summarize(rows, Ns, ds, block_size, window) -> dict:
    """fa2edu over PyTorch's compiled FlexAttention per point (target ≥ 1.0), and causal over sliding window at the
    largest N per implementation beside the ledger's prediction (target ≥ 8)."""
    ok = {(r["impl"], r["mod"], r["pass_"], r["d"], r["N"]): r for r in rows if r.get("status") == "ok"}
    versus = []
    for (impl, mod, pass_, d, N), r in sorted(ok.items()):
        theirs = ok.get(("torch_flex", mod, pass_, d, N))
        if impl == "fa2edu" and theirs is not None:
            versus.append(dict(mod=mod, pass_=pass_, d=d, N=N, speedup=theirs["ms"] / r["ms"],
                               met=theirs["ms"] / r["ms"] >= 1.0))
    N = max(Ns)
    window_ratio = []
    for d in ds:
        predicted = predicted_ratio(N, d, block_size, window)
        for impl in ("fa2edu", "torch_flex", "sdpa"):
            for pass_ in PASSES:
                full, slide = ok.get((impl, "causal", pass_, d, N)), ok.get((impl, "sliding_window", pass_, d, N))
                if full and slide:
                    measured = full["ms"] / slide["ms"]
                    window_ratio.append(dict(impl=impl, pass_=pass_, d=d, N=N, measured=measured,
                                             predicted_hbm=predicted["hbm_forward" if pass_ == "forward" else
                                                                     "hbm_backward"],
                                             predicted_blocks=predicted["visited_blocks"], met=measured >= 8.0))
    return dict(versus_torch_flex=versus, causal_over_window=window_ratio,
                all_met=bool(versus) and all(v["met"] for v in versus) and all(
                    w["met"] for w in window_ratio if w["impl"] == "fa2edu"))


# -- the figure ---------------------------------------------------------------------------------------------------

def figure(result: dict, N: int | None = None):
    """The chapter's figure: TFLOP/s of each mod at one N (the largest by default), forward + backward, one panel per
    d, a bar per implementation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r.get("status") == "ok" and r["pass_"] == "forward_backward"]
    ds = sorted({r["d"] for r in result["rows"]})
    N = N or max(r["N"] for r in result["rows"])
    impls = [i for i in ("fa2edu", "torch_flex", "sdpa") if any(r["impl"] == i for r in result["rows"])]
    fig, axes = plt.subplots(1, len(ds), figsize=(7.0, 3.2), squeeze=False)
    for ax, d in zip(axes[0], ds):
        for n, impl in enumerate(impls):
            speed = {r["mod"]: r["tflops"] for r in rows if r["impl"] == impl and r["d"] == d and r["N"] == N}
            xs = [m for m, mod in enumerate(MODS) if mod in speed]
            ax.bar([x + 0.27 * (n - 1) for x in xs], [speed[MODS[x]] for x in xs], width=0.27, label=impl)
        ax.set_xticks(range(len(MODS)), [m.replace("_", "\n") for m in MODS], fontsize=9)
        ax.set_title(f"d = {d}, N = {N}, forward + backward", fontsize=10)
        ax.set_ylabel("TFLOP/s (model)", fontsize=9)
        ax.tick_params(labelsize=9)
    axes[0][0].legend(fontsize=9)
    fig.suptitle(f"FlexAttention, bfloat16: {result['device']} ({result['date'][:10]})", fontsize=10)
    fig.tight_layout()
    return fig


def plot(path) -> Path:
    """Draw :func:`figure` from a results file next to it (FILE.png)."""
    import json

    import matplotlib.pyplot as plt
    path = Path(path)
    fig = figure(json.loads(path.read_text()))
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default benchmarks/results/<device>/flex_bf16.json; a folder with "
                             "--dry-run)")
    parser.add_argument("--N", default=",".join(map(str, GRID_N)))
    parser.add_argument("--d", default="64,128")
    parser.add_argument("--mods", default=",".join(MODS))
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--block-size", type=int, default=64, help="fa2edu's BlockMask BLOCK_SIZE (default 64)")
    parser.add_argument("--dry-run", action="store_true", help="the whole run on the CPU at toy sizes")
    parser.add_argument("--plot", type=Path, default=None, help="draw the figure of a results file and exit")
    args = parser.parse_args(argv)
    for mod in args.mods.split(","):
        if mod not in MODS:
            parser.error(f"--mods: {mod!r} is not one of {', '.join(MODS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot is not None:
        print(f"wrote {plot(args.plot)}")
        return 0
    if args.dry_run:
        out, device = (args.out or Path(".")) / "flex_bf16.json", "cpu (dry run)"
    else:
        import torch
        device = torch.cuda.get_device_name(0)
        out = args.out or Path(default_results_path(device, "flex_bf16"))
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.flex " + " ".join(sys.argv[1:] if argv is None else argv)

    def checkpoint(rows):                  # the rows so far, marked partial until the summary is in
        write_measurement(str(out), "fa2edu.flex_benchmark/1", rows, device=device, versions={}, partial=True,
                          run_command=command)
    result = run(args, checkpoint)
    write_measurement(str(out), "fa2edu.flex_benchmark/1", result.pop("rows"), device=result.pop("device"),
                      versions=result.pop("versions"), run_command=command, partial=False, **result)
    print(f"wrote {out}")
    fig_path = plot(out)
    print(f"wrote {fig_path}")
    for v in (result["summary"]["causal_over_window"]):
        print(f"causal / sliding_window({result['window']}) d={v['d']} N={v['N']} {v['impl']:10s} {v['pass_']:16s} "
              f"measured {v['measured']:.2f}×, ledger predicts {v['predicted_hbm']:.2f}× (HBM), "
              f"{v['predicted_blocks']:.2f}× (blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
