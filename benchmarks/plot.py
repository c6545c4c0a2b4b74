"""Figures from benchmark results, in the style of the FA2 paper's Figures 4–7, rendered to PNG without a GPU.

    python -m benchmarks.plot benchmarks/results/nvidia-h100-80gb-hbm3/sweep.json [more.json …] --out DIR

Writes, for each pass in the results, ``tflops_<pass>.png``: grouped bars of TFLOP/s per implementation at each
sequence length N, one panel per (d, causal), as the paper draws them; and ``memory.png``: peak memory against N
on log–log axes, one panel per (mode, pass, d, causal), with guide lines of slope 1 (∝ N) and 2 (∝ N²) where a
panel holds a fixed (batch, heads) series — the long-sequence mode's test of linear versus quadratic memory.
Configurations that did not run (out of memory, too slow, wrong) are marked where their bar or point would be.
"""

import argparse
import os
import sys

from benchmarks.results_io import load_results

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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot",
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
