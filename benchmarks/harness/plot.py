"""Figures from benchmark results, in the style of the FA2 paper's Figures 4–7, rendered to PNG without a GPU.

    python -m benchmarks.harness.plot benchmarks/results/nvidia-h100-80gb-hbm3/sweep.json [more.json …] --out DIR

Writes, for each pass in the results, ``tflops_<pass>.png``: grouped bars of TFLOP/s per implementation at each
sequence length N, one panel per (d, causal), as the paper draws them; and ``memory.png``: peak memory against N
on log–log axes, one panel per (mode, pass, d, causal), with guide lines of slope 1 (∝ N) and 2 (∝ N²) where a
panel holds a fixed (batch, heads) series — the long-sequence mode's test of linear versus quadratic memory.
Configurations that did not run (out of memory, too slow, wrong) are marked where their bar or point would be.
"""

import argparse
import os
import sys

from benchmarks.harness.results_io import load_results

MARKS = {"skipped": "skip", "wrong": "wrong", "error": "error"}


def _mark(record):
    """A short reason for a configuration that did not run."""
    if record["status"] == "skipped" and "out of memory" in (record.get("error") or ""):
        return "OOM"
    return MARKS[record["status"]]


def load_many(paths):
    """Records of several results files of one device, and the first file's header."""
    if not paths:
        raise ValueError("paths must name at least one results file")
    header, records, devices = None, [], set()
    for path in paths:
        h, recs, _ = load_results(path)
        header = header or h
        records.extend(recs)
        devices.update(r["device"] for r in recs)
    if len(devices) > 1:
        raise ValueError(f"results from different devices cannot share a figure: {sorted(devices)}")
    return header, records


def _impl_order(records):
    return list(dict.fromkeys(r["impl"] for r in records))


def _colors(impls):
    import matplotlib
    cmap = matplotlib.colormaps["tab10"]
    return {impl: cmap(k % 10) for k, impl in enumerate(impls)}


def _grid(n_panels, max_cols):
    cols = min(max_cols, n_panels)
    rows = -(-n_panels // cols)
    return rows, cols


def plot_tflops(records, pass_, path, title_prefix=""):
    """Grouped bars: TFLOP/s per implementation at each N, one panel per (d, causal); records of one pass."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if r["pass"] == pass_ and r.get("mode", "sweep") != "long"]
    if not records:
        return None
    impls = _impl_order(records)
    colors = _colors(impls)
    panels = sorted({(r["causal"], r["d"]) for r in records})
    rows, cols = _grid(len(panels), 2)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.2 * rows), squeeze=False)
    width = 0.8 / len(impls)
    for ax, (causal, d) in zip(axes.flat, panels):
        panel = [r for r in records if (r["causal"], r["d"]) == (causal, d)]
        Ns = sorted({r["N"] for r in panel})
        ok = [r["tflops"] for r in panel if r["status"] == "ok" and r["tflops"] > 0]
        # A log axis: fp16 tensor-core SDPA runs ~10-100x the fp32 CUDA-core rows, which a linear axis flattens.
        top, bottom = max(ok + [1.0]), min(ok + [1.0]) / 2
        for k, impl in enumerate(impls):
            for x, N in enumerate(Ns):
                hit = [r for r in panel if r["impl"] == impl and r["N"] == N]
                if not hit:
                    continue
                r, pos = hit[0], x - 0.4 + (k + 0.5) * width
                if r["status"] == "ok":
                    ax.bar(pos, r["tflops"], width, color=colors[impl])
                    ax.text(pos, r["tflops"], f"{r['tflops']:.3g}", ha="center", va="bottom", fontsize=6,
                            rotation=90)
                else:
                    ax.text(pos, bottom * 1.1, _mark(r), ha="center", va="bottom", fontsize=6, rotation=90,
                            color=colors[impl])
        ax.set_xticks(range(len(Ns)), [f"{N // 1024}k" if N >= 1024 else str(N) for N in Ns])
        ax.set_yscale("log")
        ax.set_ylim(bottom, top * 3)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s (FA2 paper's FLOP model, log scale)")
        ax.set_title(f"{pass_}, head dim {d}, {'causal' if causal else 'not causal'}")
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i]) for i in impls]
    fig.suptitle(f"{title_prefix}attention {pass_} speed (bars not drawn: OOM, skip = too slow, wrong, error)",
                 fontsize=10)
    fig.legend(handles, impls, loc="upper center", bbox_to_anchor=(0.5, 0.97), ncol=min(len(impls), 8),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(records, path, title_prefix=""):
    """Peak memory against N (log–log), one panel per (mode, pass, d, causal)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keyed = [r for r in records if r["status"] == "ok" and r.get("peak_mem_bytes")]
    if not keyed:
        return None
    impls = _impl_order(records)
    colors = _colors(impls)
    panels = sorted({(r.get("mode", "sweep"), r["pass"], r["d"], r["causal"]) for r in keyed},
                    key=lambda p: (p[0] != "long", p[1] != "forward", p[2], p[3]))
    rows, cols = _grid(len(panels), 3)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    for ax, (mode, pass_, d, causal) in zip(axes.flat, panels):
        panel = [r for r in records if (r.get("mode", "sweep"), r["pass"], r["d"], r["causal"])
                 == (mode, pass_, d, causal)]
        fixed_shape = len({(r["batch"], r["heads"]) for r in panel}) == 1
        for impl in impls:
            pts = sorted((r["N"], r["peak_mem_bytes"] / 2**30) for r in panel
                         if r["impl"] == impl and r["status"] == "ok" and r.get("peak_mem_bytes"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[impl], label=impl)
            for r in panel:
                if r["impl"] == impl and r["status"] != "ok":
                    ax.axvline(r["N"], color=colors[impl], alpha=0.25, lw=4)
                    ax.annotate(f"{impl}: {_mark(r)}", (r["N"], 1), xycoords=("data", "axes fraction"),
                                rotation=90, va="top", ha="right", fontsize=6, color=colors[impl])
        if fixed_shape:
            # guides through the smallest point of the panel: ∝ N and ∝ N²
            lo = min((r for r in panel if r["status"] == "ok" and r.get("peak_mem_bytes")), key=lambda r: r["N"])
            Ns = sorted({r["N"] for r in panel})
            m0 = lo["peak_mem_bytes"] / 2**30
            ax.plot(Ns, [m0 * N / lo["N"] for N in Ns], ":", color="grey", lw=1, label="∝ N")
            ax.plot(Ns, [m0 * (N / lo["N"]) ** 2 for N in Ns], "--", color="grey", lw=1, label="∝ N²")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("peak memory (GiB)")
        shape = f"B={panel[0]['batch']}, H={panel[0]['heads']}" if fixed_shape else "batch × N fixed"
        ax.set_title(f"{mode}: {pass_}, d = {d}, {'causal' if causal else 'not causal'} ({shape})", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{title_prefix}peak memory of one call (inputs, saved state, outputs, temporaries)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render(paths, out_dir):
    """Every figure for the results files ``paths`` into ``out_dir``; returns the files written."""
    header, records = load_many(paths)
    os.makedirs(out_dir, exist_ok=True)
    prefix = f"{header.get('device', '')}: " if header.get("device") else ""
    written = []
    for pass_ in ("forward", "backward"):
        path = plot_tflops(records, pass_, os.path.join(out_dir, f"tflops_{pass_}.png"), prefix)
        if path:
            written.append(path)
    path = plot_memory(records, os.path.join(out_dir, "memory.png"), prefix)
    if path:
        written.append(path)
    return written


# -- the book's figures (chapter 10) ------------------------------------------------------------------------------
#
# Each draws one pyplot figure and returns it (a notebook shows it with ``plt.show()``): at most two panels side
# by side, 7 inches wide, so that shown in a ~700-pixel column at 100 dpi every font is at least 9 pt. The data
# come from benchmarks.harness.book; these functions only draw.

BOOK_WIDTH = 7.0                    # inches
BOOK_RC = {"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9,
           "ytick.labelsize": 9, "legend.fontsize": 9, "figure.titlesize": 10, "axes.grid": True,
           "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False}
#: One colour per implementation, the same in every figure of the chapter.
IMPL_STYLE = {
    "kg_flash2": ("tab:orange", "^", "teaching FA2 (fp32)"),
    "kg_flash2_fast": ("tab:red", "o", "fast FA2 (fp32)"),
    "kg_standard": ("tab:gray", "s", "standard attention (fp32)"),
    "torch_eager": ("tab:blue", "D", "PyTorch eager (fp32)"),
    "sdpa_efficient": ("tab:purple", "P", "SDPA mem-efficient (fp32)"),
    "sdpa_flash": ("black", "*", "SDPA flash (fp16, tensor cores)"),
}
VERDICT_COLOR = {"inside": "tab:green", "below": "tab:red", "above": "tab:blue"}


def _book_figure(ncols=2, height=3.3, **kwargs):
    """A pyplot figure of ``ncols`` panels in one row, the book's width, made with the book's rc settings."""
    import matplotlib.pyplot as plt
    with plt.rc_context(BOOK_RC):
        fig, axes = plt.subplots(1, ncols, figsize=(BOOK_WIDTH, height), squeeze=False, **kwargs)
    return fig, list(axes[0])


def _styled(fig):
    """Apply the book's font sizes to every text of ``fig`` (rc_context only reaches artists made inside it)."""
    for ax in fig.axes:
        for label in ax.get_xticklabels() + ax.get_yticklabels():
            label.set_fontsize(max(label.get_fontsize(), BOOK_RC["xtick.labelsize"]))
    return fig


def _lengths_axis(ax, lengths):
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("sequence length N")


def _finish(fig, title, dev, legend_inches=0.0, legend=None, ncol=2):
    """Title (with the device and the dates of its results), a legend under the panels taking
    ``legend_inches`` of the height, tight layout, the book's tick sizes."""
    fig.suptitle(f"{title}\n{dev.name}, {dev.dates}", fontsize=BOOK_RC["figure.titlesize"])
    if legend is not None:
        handles, labels = legend
        fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, handletextpad=0.4,
                   columnspacing=1.2)
    fig.tight_layout(rect=(0, legend_inches / fig.get_figheight(), 1, 1))
    return _styled(fig)


def ladder_figure(rows, base, dev):
    """Bars: each forward rung's TFLOP/s at one N, a panel per d; lines: the baselines and the fp32 ceiling.

    ``rows``: :func:`benchmarks.harness.book.ladder_table`; ``base``: d → {impl: TFLOP/s} (:func:`book.baselines`);
    ``dev``: :func:`book.device`."""
    import matplotlib
    ds = sorted({r.d for r in rows})
    fig, axes = _book_figure(len(ds), 3.9, sharey=True)
    cmap = matplotlib.colormaps["viridis"]
    for ax, d in zip(axes, ds):
        mine = [r for r in rows if r.d == d]
        x = range(len(mine))
        colors = ["tab:orange"] + [cmap(0.15 + 0.7 * k / max(1, len(mine) - 2)) for k in range(len(mine) - 1)]
        bars = ax.bar(x, [r.tflops for r in mine], color=colors, width=0.7, zorder=2)
        for bar, r in zip(bars, mine):
            ax.text(bar.get_x() + bar.get_width() / 2, r.tflops + 0.8, f"{r.tflops:.0f}", ha="center",
                    va="bottom", fontsize=9)
        ax.set_xticks(list(x), ["teach." if r.rung == "teaching" else r.rung for r in mine])
        for impl, style in (("torch_eager", "--"), ("sdpa_efficient", "-."), ("kg_standard", ":")):
            if impl in base[d]:
                color, _, label = IMPL_STYLE[impl]
                ax.axhline(base[d][impl], color=color, ls=style, lw=1.5, label=label, zorder=3)
        ax.axhline(dev.matmul_tflops, color="black", lw=1.2, label="fp32 matmul ceiling (measured)", zorder=3)
        ax.set_title(f"d = {d}")
        ax.set_xlabel("rung of the ladder")
        ax.grid(axis="x", visible=False)
    axes[0].set_ylabel("TFLOP/s (FA2 FLOP model)")
    axes[0].set_ylim(0, dev.matmul_tflops * 1.12)
    return _finish(fig, f"Forward, fp32, not causal, N = {rows[0].N}, batch × N = 16k tokens", dev, 0.5,
                   axes[0].get_legend_handles_labels())


def prediction_figure(checks, dev, split=1.15):
    """Each prediction's range (a bar) and the same-run measurements (a dot per N), as % change over the rung
    below: left the large bets (predicted upper end ≥ ``split``), right the small ones. ``checks``: a list of
    :class:`benchmarks.harness.book.PredictionCheck` with a prediction."""
    checks = [c for c in checks if c.prediction is not None]
    groups = [[c for c in checks if c.ratio_range[1] >= split], [c for c in checks if c.ratio_range[1] < split]]
    height = 0.9 + 0.32 * max(len(g) for g in groups)
    fig, axes = _book_figure(2, height)
    for ax, group, title in zip(axes, groups, ("large predicted gains", "small predicted gains")):
        for row, c in enumerate(reversed(group)):
            lo, hi = c.ratio_range
            ax.barh(row, (hi - lo) * 100, left=(lo - 1) * 100, height=0.55, color="0.85", zorder=1)
            for N, ratio in c.ratios.items():
                value = c.measured[N]
                where = "below" if value < c.prediction.low else "above" if value > c.prediction.high \
                    else "inside"
                ax.plot((ratio - 1) * 100, row, "o", ms=5, color=VERDICT_COLOR[where], zorder=3)
        ax.set_yticks(range(len(group)), [f"{c.rung}, d = {c.d}" for c in reversed(group)])
        ax.axvline(0, color="black", lw=0.8)
        ax.set_xlabel("change over the rung below (%)")
        ax.set_title(title)
        ax.grid(axis="y", visible=False)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles = [Patch(color="0.85", label="predicted range")] + [
        Line2D([], [], marker="o", ls="", color=color, label=f"measured, {name}")
        for name, color in VERDICT_COLOR.items()]
    return _finish(fig, "Predicted before the run, measured in one run with the rung below (a dot per N)",
                   dev, 0.3, (handles, [h.get_label() for h in handles]), ncol=4)


def wave_figure(runs, v6_steps, v8_steps, tiles, dev):
    """Left: the time of one call against its block count (``runs``: :func:`book.wave_runs`) with the
    whole-wave model; right: the busy block slots over the last waves of the benchmark's call for v6's and v8's
    plans (:func:`book.busy_slots`, time in K/V tiles of one block, ``tiles`` per row block)."""
    fig, axes = _book_figure(2, 3.6)
    ax = axes[0]
    slots = runs[0].slots
    full = next(r for r in runs if r.blocks % slots == 0)          # a call of whole waves sets the wave's cost
    per_wave = full.ms / full.paid_waves
    lo, hi = min(r.blocks for r in runs) - 70, max(r.blocks for r in runs) + 50
    blocks = list(range(lo, hi + 1))
    ax.step(blocks, [per_wave * -(-b // slots) for b in blocks], where="post", color="0.5",
            label="whole waves × one wave's cost")
    for k, r in enumerate(runs):
        # Labels alternate below and above the points, so that neighbours do not collide.
        ax.annotate(f"{r.heads} heads\n{r.waves:.2f} waves", (r.blocks, r.ms), textcoords="offset points",
                    xytext=(0, -9 if k % 2 == 0 else 9), ha="center", va="top" if k % 2 == 0 else "bottom",
                    fontsize=9)
        ax.plot(r.blocks, r.ms, "o", color="tab:red", ms=6, zorder=3)
    ax.plot([], [], "o", color="tab:red", label="measured (v6)")
    ax.set_ylim(per_wave * (full.paid_waves - 2.4), per_wave * (full.paid_waves + 3.0))
    ax.set_xlabel(f"row blocks in the call ({slots} resident at once)")
    ax.set_ylabel("time per call (ms)")
    ax.set_title("time comes in whole waves")
    ax.legend(loc="upper left")
    ax = axes[1]
    for steps, color, label in ((v6_steps, "tab:orange", "v6"), (v8_steps, "tab:blue", "v8 (stream-K)")):
        xs, ys = [], []
        for start, end, busy in steps:
            xs += [start / tiles, end / tiles]
            ys += [busy, busy]
        xs.append(xs[-1])
        ys.append(0)
        ax.plot(xs, ys, color=color, lw=2, label=f"{label}: ends at {xs[-1]:.2f}")
        ax.fill_between(xs, ys, color=color, alpha=0.12)
    end = max(s[1] for s in v6_steps) / tiles
    ax.set_xlim(end - 3.2, end + 0.3)
    ax.set_ylim(0, slots * 1.7)
    ax.set_xlabel("time (waves of one row block)")
    ax.set_ylabel("busy block slots")
    ax.set_title("the last waves, as planned")
    ax.legend(loc="upper left", fontsize=9)
    return _finish(fig, "Waves: v6 at d = 128, N = 2048 (one block per SM)", dev)


def causal_figure(speedups, dev):
    """Wall time without the mask over wall time with it, against N; ``speedups``: d → {impl: {N: ratio}}
    (:func:`book.causal_speedups`)."""
    ds = sorted(speedups)
    fig, axes = _book_figure(len(ds), 4.0, sharey=True)
    for ax, d in zip(axes, ds):
        lengths = sorted({N for series in speedups[d].values() for N in series})
        for impl, series in speedups[d].items():
            color, marker, label = IMPL_STYLE[impl]
            ax.plot(list(series), list(series.values()), marker=marker, color=color, label=label, ms=5)
        ax.axhline(2, color="black", lw=1, ls="--")
        ax.axhline(1, color="black", lw=0.8)
        ax.text(lengths[0], 2.03, "half the FLOPs: 2×", fontsize=9, va="bottom")
        _lengths_axis(ax, lengths)
        ax.set_title(f"d = {d}")
    axes[0].set_ylabel("time not causal / time causal")
    axes[0].set_ylim(0.5, 2.3)
    return _finish(fig, "What the causal mask saves, forward, batch × N = 16k tokens", dev, 0.85,
                   axes[0].get_legend_handles_labels())


def backward_figure(series, dev):
    """Backward TFLOP/s against N, a panel per d; ``series``: d → {impl: {N: TFLOP/s}}."""
    ds = sorted(series)
    fig, axes = _book_figure(len(ds), 4.0, sharey=True)
    for ax, d in zip(axes, ds):
        lengths = sorted({N for s in series[d].values() for N in s})
        for impl, s in series[d].items():
            color, marker, label = IMPL_STYLE[impl]
            ax.plot(list(s), list(s.values()), marker=marker, color=color, label=label, ms=5)
        ax.axhline(dev.matmul_tflops, color="black", lw=1.2, label="fp32 matmul ceiling (measured)")
        _lengths_axis(ax, lengths)
        ax.set_title(f"d = {d}")
    axes[0].set_ylabel("TFLOP/s (FA2 FLOP model)")
    axes[0].set_ylim(0, dev.matmul_tflops * 1.1)
    return _finish(fig, "Backward pass, fp32, not causal, batch × N = 16k tokens", dev, 0.85,
                   axes[0].get_legend_handles_labels())


def roofline_figure(points, dev):
    """The roofline of the measured ceilings (and, faint, the datasheet's fp16 tensor-core roof), with every
    forward rung, standard attention and eager PyTorch; ``points``: d → [:class:`book.RooflinePoint`]."""
    import numpy as np
    ds = sorted(points)
    fig, axes = _book_figure(len(ds), 4.8, sharey=True)
    intensity = np.logspace(0, 3.5, 200)
    for ax, d in zip(axes, ds):
        ax.plot(intensity, np.minimum(dev.matmul_tflops, intensity * dev.copy_tbps), color="black", lw=1.5,
                label="fp32 roof (measured)")
        if dev.profile is not None:
            tc = dev.profile.fp16_tensor / 1e12
            ax.plot(intensity, np.minimum(tc, intensity * dev.profile.hbm_bandwidth / 1e12), color="0.6",
                    lw=1, ls="--", label="fp16 tensor-core roof (datasheet)")
        rungs = [p for p in points[d] if not p.label.startswith(("kg_", "torch_"))]
        ax.plot([p.intensity for p in rungs[1:]], [p.tflops for p in rungs[1:]], "o", color="tab:red", ms=4,
                label="fast rungs v1 … v8")
        ax.plot(rungs[0].intensity, rungs[0].tflops, "^", color="tab:orange", ms=7, label="teaching FA2")
        top = max(rungs, key=lambda p: p.tflops)
        ax.annotate(top.label, (top.intensity, top.tflops), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=9)
        ax.plot(top.once_intensity, top.tflops, "o", mfc="none", color="tab:red", ms=7,
                label="same, DRAM bytes if L2 holds re-reads")
        ax.annotate("", (top.once_intensity, top.tflops), (top.intensity * 1.25, top.tflops),
                    arrowprops=dict(arrowstyle="->", color="tab:red", lw=0.8))
        for p in points[d]:
            if p.label in IMPL_STYLE:
                color, marker, label = IMPL_STYLE[p.label]
                ax.plot(p.intensity, p.tflops, marker, color=color, ms=6, label=label.replace(" (fp32)", ""))
        ax.axvline(dev.ridge, color="black", lw=0.6, ls=":")
        ax.text(dev.ridge / 1.1, 1.3, f"ridge\n{dev.ridge:.0f}", fontsize=9, ha="right")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(1, intensity[-1])
        ax.set_ylim(1, 1500)
        ax.set_xlabel("arithmetic intensity (FLOP per byte)")
        ax.set_title(f"d = {d}, N = {points[d][0].N}")
    axes[0].set_ylabel("TFLOP/s")
    return _finish(fig, "Roofline of the forward kernels (bytes: the two-level model, each kernel's tiles)",
                   dev, 1.0, axes[0].get_legend_handles_labels())


def memory_figure(series, model, dev, title):
    """Peak memory of one call against N (log–log), measured points over the model's wide pale line;
    ``series``: impl → [(N, bytes)]; ``model(impl, N)`` → bytes."""
    fig, (ax,) = _book_figure(1, 4.0)
    for impl, pts in sorted(series.items()):
        Ns = [n for n, _ in pts]
        color, marker, label = IMPL_STYLE.get(impl, ("tab:red", "o", impl))
        if impl == "kg_flash2_v3":
            color, marker, label = "tab:red", "o", "fast FA2 v3 (fp32)"
        # Hollow, larger markers for the teaching kernel: its points lie under v3's (the same tensors).
        hollow = dict(mfc="none", ms=9) if impl == "kg_flash2" else dict(ms=5)
        ax.plot(Ns, [b / 2**30 for _, b in pts], marker=marker, color=color, label=label, **hollow)
        ax.plot(Ns, [model(impl, n) / 2**30 for n in Ns], color=color, lw=6, alpha=0.2)
    ax.plot([], [], color="0.5", lw=6, alpha=0.3, label="the model")
    ax.axhline(dev.memory_bytes / 2**30, color="black", lw=1, ls=":")
    ax.text(1024, dev.memory_bytes / 2**30 / 1.6, f"the device's memory, {dev.memory_bytes / 2**30:.0f} GiB",
            fontsize=9, va="top")
    lengths = sorted({n for pts in series.values() for n, _ in pts})
    _lengths_axis(ax, lengths)
    ax.set_yscale("log")
    ax.set_ylabel("peak memory of one call (GiB)")
    return _finish(fig, title, dev, 0.6, ax.get_legend_handles_labels())


def ncu_figure(rows, dev):
    """Measured bytes against modelled bytes per profiled call (log–log, one dot per call and model): left the
    load bytes at L1 (ledger × 4 B and the sector model), right the DRAM reads (ledger and each tensor once)."""
    from benchmarks.harness.book import compulsory_read_bytes
    MiB = 2**20
    fig, axes = _book_figure(2, 3.9)
    panels = (("ncu_load_bytes", "loads requested at L1 (MiB)",
               (("model_load_bytes", "ledger × 4 B", "tab:blue"),
                ("model_sector_load_bytes", "sector model", "tab:cyan"))),
              ("dram_read_bytes", "reads from DRAM (MiB)",
               (("model_load_bytes", "ledger × 4 B", "tab:blue"), (None, "each tensor once", "tab:gray"))))
    for ax, (measured, ylabel, models) in zip(axes, panels):
        values = []
        for key, label, color in models:
            xs = [(r[key] if key else compulsory_read_bytes(r)) / MiB for r in rows]
            ys = [r[measured] / MiB for r in rows]
            ax.plot(xs, ys, "o", color=color, label=label, ms=5, alpha=0.85)
            values += xs + ys
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="measured = model")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("model (MiB)")
        ax.set_ylabel(ylabel)
    axes[0].set_title("L1: every sector counts")
    axes[1].set_title("DRAM: L2 absorbs the re-reads")
    legend = {}
    for ax in axes:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    return _finish(fig, f"Nsight Compute against the IO model, {len(rows)} calls of the teaching kernels", dev,
                   0.35, (list(legend.values()), list(legend)), ncol=4)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.plot",
                                     description="Render FA2-paper-style figures from benchmark results JSON.")
    parser.add_argument("results", nargs="+", help="results file(s) of one device")
    parser.add_argument("--out", required=True, help="folder for the PNG files")
    args = parser.parse_args(argv)
    written = render(args.results, args.out)
    for path in written:
        print(path)
    if not written:
        print("nothing to plot: no successful records", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
