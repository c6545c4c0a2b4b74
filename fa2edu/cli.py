"""The ``fa2edu`` command: HBM traffic tables, a guided tour, the errata, the version.

::

    fa2edu io --N 4096 --d 64 --M 98304 [--causal] [--device a100]
    fa2edu io --N 4096 --dtype float16 --batch 8 --heads 16   # bytes for a whole batch
    fa2edu io --N 8192 --method execute   # runs the algorithms on the ledger (a few seconds)
    fa2edu tour          # a few seconds: traffic, Theorem 2's scaling, exactness, causal skipping
    fa2edu errata        # every checkable erratum: printed formula vs corrected, against the oracle
    fa2edu version       # or: fa2edu --version

Every number the command prints is computed when it runs (by :func:`fa2edu.simulate_io`, the algorithms and the
oracle), never typed in.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

import fa2edu
from fa2edu import hardware
from fa2edu.blocks import DEFAULT_M
from fa2edu.io import METHODS, simulate_io

__all__ = ["main", "build_parser", "tour", "execute_bytes", "available_memory"]

#: The tour's realistic size: a 4k-token sequence, head dimension 64, 96 K elements of SRAM (192 KiB of fp16).
TOUR_N, TOUR_D, TOUR_M = 4096, 64, 98_304
#: The widest line the tour prints (the book's page width).
WIDTH = 96
#: N × N_k float32 matrices that ``--method execute`` holds at its peak: standard attention's P, kept from its
#: forward pass for its backward pass, and the backward pass's dP and dS (measured: about 3.2 of them at N = 4096).
EXECUTE_SCORE_MATRICES = 3


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fa2edu", description="FlashAttention and FlashAttention-2, a runnable textbook: HBM traffic tables, "
                                   "a guided tour, the papers' errata.")
    parser.add_argument("--version", action="version", version=f"fa2edu {fa2edu.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{io,tour,errata,version}")

    io = sub.add_parser("io", help="HBM reads/writes of standard attention, FA1 and FA2, forward and backward",
                        description="HBM traffic per (batch, head) in elements, counted by executing the algorithms "
                                    "(small sizes) or by formulas proven equal to the executed ledger (large ones); "
                                    "then in bytes for --dtype × --batch × --heads.")
    io.add_argument("--N", type=_positive_int, default=TOUR_N, help=f"sequence length N (= N_q); default {TOUR_N}")
    io.add_argument("--N-k", dest="N_k", type=_positive_int, default=None, help="key/value length (default: N)")
    io.add_argument("--d", type=_positive_int, default=TOUR_D, help=f"head dimension d; default {TOUR_D}")
    io.add_argument("--M", type=_positive_int, default=None,
                    help=f"SRAM size in ELEMENTS (FA1 Theorem 2), at least 4d; default: one SM of --device in "
                         f"--dtype if a device is given, else {DEFAULT_M}")
    io.add_argument("--causal", action="store_true", help="causal mask (blocks above the diagonal are skipped)")
    io.add_argument("--block-sizes", type=_positive_int, nargs=2, metavar=("B_R", "B_C"), default=None,
                    help="explicit block sizes for every tiled pass (default: each pass's rule from M)")
    io.add_argument("--block-sparsity", type=_fraction, default=None, metavar="S",
                    help="block-sparse attention with a random block mask of density S (FA1 Algorithm 5)")
    io.add_argument("--method", choices=METHODS, default="auto",
                    help="execute the algorithms, use the closed forms, or pick (auto: execute when small)")
    io.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "float64"],
                    help="element type for the bytes table; default float16")
    io.add_argument("--batch", type=_positive_int, default=1, help="batch size for the bytes table; default 1")
    io.add_argument("--heads", type=_positive_int, default=1, help="number of heads for the bytes table; default 1")
    io.add_argument("--device", default=None, choices=sorted(hardware.DEVICES),
                    help="a GPU profile: sets the default M and adds a roofline lower bound on the HBM time")
    io.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="a progress bar on stderr while the algorithms execute (default: when stderr is a terminal)")
    # Errors found after parsing (M too small for d, block sizes that overflow the SRAM) print this usage.
    io.set_defaults(subparser=io)

    sub.add_parser("tour", help="a guided run of a few seconds through the book's main results",
                   description="A guided run of a few seconds through the book's main results, every number "
                               "computed as it runs: (1) HBM traffic of standard attention, FlashAttention and "
                               "FlashAttention-2 at N = 4,096; (2) FA1 Theorem 2's scaling in N and M; (3) FA1 "
                               "and FA2 exact against the float64 oracle, gradients included; (4) the blocks a "
                               "causal mask skips; (5) where to read on.")
    sub.add_parser("errata", help="the papers' errata: printed formula vs corrected, checked numerically",
                   description="The typos of the FlashAttention and FlashAttention-2 papers: for each erratum, the "
                               "formula as printed and as corrected, both evaluated on random blocks and compared "
                               "with the float64 oracle (the printed one is WRONG where the typo changes the "
                               "result); then the errata that cannot be checked numerically, and why.")
    sub.add_parser("version", help="print the version", description="Print fa2edu's version and exit.")
    return parser


# -- fa2edu io --------------------------------------------------------------------------------------------------------

def _format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def execute_bytes(N: int, N_k: int | None = None) -> int:
    """About the memory ``fa2edu io --method execute`` needs: its peak is standard attention's N × N_k matrices
    (:data:`EXECUTE_SCORE_MATRICES` of them, float32; the tiled algorithms need far less)."""
    N_k = N if N_k is None else N_k
    return EXECUTE_SCORE_MATRICES * N * N_k * np.dtype(np.float32).itemsize


def available_memory() -> int | None:
    """Bytes of memory this process can still get, or None if unknown: Linux's MemAvailable, lowered to what a
    container's memory limit leaves (cgroup v2), else the free pages the system reports."""
    found = []
    try:
        with open("/proc/meminfo") as meminfo:
            found += [int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return max(min(found), 0)


def _memory_message(N: int, N_k: int | None, available: int | None) -> str:
    """What ``--method execute`` needs, what there is, and what to run instead."""
    N_k = N if N_k is None else N_k
    have = "" if available is None else f"; this machine has {_format_bytes(available)} available"
    return (f"--method execute runs the algorithms on N = {N:,} by N_k = {N_k:,} scores and needs about "
            f"{_format_bytes(execute_bytes(N, N_k))} of memory ({EXECUTE_SCORE_MATRICES} float32 matrices of "
            f"{N:,} × {N_k:,}: standard attention's P, dP and dS){have}. Use --method closed_form (the formulas, "
            f"proven equal to the executed ledger; instant at any N), or a smaller --N.")


def _run_io(args, parser: argparse.ArgumentParser, out) -> int:
    """``fa2edu io``; ``parser`` is the ``io`` subcommand's parser, whose usage an error prints."""
    M = args.M
    if M is None:
        M = hardware.M_for(args.device, args.dtype) if args.device else DEFAULT_M
    if args.method == "execute":
        # Refuse before allocating when the estimate already exceeds what the machine has.
        available = available_memory()
        if available is not None and execute_bytes(args.N, args.N_k) > available:
            parser.error(_memory_message(args.N, args.N_k, available))
    try:
        report = simulate_io(args.N, args.d, M, args.causal, N_k=args.N_k,
                             block_sizes=tuple(args.block_sizes) if args.block_sizes else None,
                             block_sparsity=args.block_sparsity, method=args.method, progress=args.progress)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    except MemoryError:       # numpy's _ArrayMemoryError, when the estimate fitted but the allocation did not
        parser.error(_memory_message(args.N, args.N_k, available_memory()))
    print(report, file=out)
    print(file=out)
    programs = f"{args.batch} × {args.heads} (batch × heads)"
    print(f"In bytes, {args.dtype} elements, {programs}:", file=out)
    records = report.to_bytes(args.dtype, batch=args.batch, heads=args.heads)
    dev = hardware.device(args.device) if args.device else None
    for rec in records:
        line = (f"  {rec['algorithm']:<9} {rec['pass']:<9} reads {_format_bytes(rec['reads_bytes']):>12}   "
                f"writes {_format_bytes(rec['writes_bytes']):>12}   total {_format_bytes(rec['total_bytes']):>12}")
        if dev is not None:
            seconds = rec["total_bytes"] / dev.hbm_bandwidth
            line += f"   ≥ {seconds * 1e3:,.3f} ms of HBM time on {dev.name}"
        print(line, file=out)
    return 0


# -- fa2edu tour ------------------------------------------------------------------------------------------------------

def _say(out, text: str, indent: str = "") -> None:
    """Print ``text`` as a paragraph wrapped to :data:`WIDTH` columns (a long path is kept whole)."""
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent, break_long_words=False,
                        break_on_hyphens=False), file=out)


def _section(out, number: int, title: str) -> None:
    print(file=out)
    print(f"({number}) {title}", file=out)
    print("-" * (len(title) + 4), file=out)


def _tour_table(out, report) -> None:
    """The traffic table of ``report`` in the columns the tour needs, narrow enough for the page."""
    head = ["algorithm", "pass", "B_r × B_c", "reads", "writes", "total", "vs standard"]
    body = []
    for r in report.rows:
        versus = "baseline" if r.algorithm == "standard" else f"{report.ratio(r.algorithm, r.pass_):.2f}× less"
        blocks = "—" if r.block_sizes is None else f"{r.block_sizes[0]} × {r.block_sizes[1]}"
        body.append([r.algorithm, r.pass_, blocks, f"{r.reads:,}", f"{r.writes:,}", f"{r.total:,}", versus])
    widths = [max(len(row[k]) for row in [head] + body) for k in range(len(head))]
    for row in [head] + body:
        print("  " + "  ".join(cell.rjust(w) if k >= 3 else cell.ljust(w)
                               for k, (cell, w) in enumerate(zip(row, widths))).rstrip(), file=out)


def _both_passes(report, algorithm: str) -> int:
    return report.row(algorithm, "forward").total + report.row(algorithm, "backward").total


def _tour_traffic(out) -> None:
    _section(out, 1, f"HBM traffic at a realistic size: N = {TOUR_N:,}, d = {TOUR_D}, M = {TOUR_M:,} elements")
    _say(out, "Standard attention writes the N × N matrices S and P to HBM and reads them back; FlashAttention "
              "tiles Q, K, V into blocks that fit in the SRAM of M elements and never stores S or P (FA1 "
              "Algorithm 1). Elements moved between HBM and SRAM per (batch, head):")
    report = simulate_io(TOUR_N, TOUR_D, TOUR_M)
    _tour_table(out, report)
    std, fa1, fa2 = (_both_passes(report, a) for a in ("standard", "flash1", "flash2"))
    _say(out, f"Forward + backward: standard {std:,}, FlashAttention {fa1:,} ({std / fa1:.1f}× less), "
              f"FlashAttention-2 {fa2:,} ({std / fa2:.1f}× less).")
    fp16 = hardware.itemsize("float16")
    _say(out, f"In fp16, per head, forward + backward: standard attention moves {std * fp16 / 1e6:,.0f} MB "
              f"(most of it its S and P), FlashAttention-2 {fa2 * fp16 / 1e6:,.1f} MB. FA2 moves {fa2 / fa1:.2f}× "
              f"FA1's traffic: its forward loop keeps O_i, ℓ_i, m_i on chip, its backward pass computes D once "
              f"instead of reloading O_i for every block.")


def _tour_scaling(out) -> None:
    _section(out, 2, "Theorem 2's scaling: standard Θ(Nd + N²), FlashAttention Θ(N²d²/M)")
    N, d, M = TOUR_N, TOUR_D, TOUR_M

    def totals(n: int, m: int) -> tuple[int, int]:
        rep = simulate_io(n, d, m, algorithms=("standard", "flash1"), passes=("forward",))
        return rep.row("standard", "forward").total, rep.row("flash1", "forward").total

    base, double_M, double_N = totals(N, M), totals(N, 2 * M), totals(2 * N, M)
    print(f"Forward pass, d = {d}:", file=out)
    print(f"  {'':<24}{'standard':>16}{'FlashAttention':>18}", file=out)
    for label, (s, f) in ((f"N = {N:,}, M = {M:,}", base), (f"N = {N:,}, M = {2 * M:,}", double_M),
                          (f"N = {2 * N:,}, M = {M:,}", double_N)):
        print(f"  {label:<24}{s:>16,}{f:>18,}", file=out)
    _say(out, f"Double M: standard × {double_M[0] / base[0]:.2f} (it never uses the SRAM's size), "
              f"FlashAttention × {double_M[1] / base[1]:.2f} (∝ 1/M: blocks twice as large, half as many "
              f"passes).")
    _say(out, f"Double N: standard × {double_N[0] / base[0]:.2f} (∝ N²), FlashAttention × "
              f"{double_N[1] / base[1]:.2f} (∝ N², with the factor d²/M ≈ {d * d / M:.3f} in front).")


def _tour_exactness(out) -> None:
    _section(out, 3, "Exact, not approximate: FA1 and FA2 against the float64 oracle")
    rng = np.random.default_rng(0)
    batch, heads, N, d, M = 1, 2, 150, 16, 512
    Q, K, V, dO = (rng.standard_normal((batch, heads, N, d)) for _ in range(4))
    _say(out, f"A random causal problem: Q, K, V of shape {Q.shape}, M = {M} (blocks do not divide N), "
              f"float64.")
    O, L = fa2edu.attention_reference(Q, K, V, causal=True)
    grads = fa2edu.attention_reference_backward(Q, K, V, dO, causal=True)
    f1 = fa2edu.flash1_forward(Q, K, V, M=M, causal=True)
    g1 = fa2edu.flash1_backward(Q, K, V, f1.O, f1.l, f1.m, dO, M=M, causal=True)
    f2 = fa2edu.flash2_forward(Q, K, V, M=M, causal=True)
    g2 = fa2edu.flash2_backward(Q, K, V, f2.O, f2.L, dO, M=M, causal=True)

    def err(a, b) -> float:
        return float(np.max(np.abs(a - b)))

    L1 = f1.m + np.log(f1.l)                       # FA1 saves (ℓ, m); L = m + log ℓ is FA2's single statistic
    print(f"  {'':<18}{'O':>10}{'L':>10}{'dQ':>10}{'dK':>10}{'dV':>10}   (max |error|)", file=out)
    for name, fwd_O, fwd_L, g in (("FlashAttention", f1.O, L1, g1), ("FlashAttention-2", f2.O, f2.L, g2)):
        errors = [err(fwd_O, O), err(fwd_L, L), err(g.dQ, grads.dQ), err(g.dK, grads.dK), err(g.dV, grads.dV)]
        print(f"  {name:<18}" + "".join(f"{e:>10.1e}" for e in errors), file=out)
    _say(out, "Errors at float64 rounding level: tiling and the online softmax change the order of the sums, "
              "not the result.")


def _tour_causal(out) -> None:
    _section(out, 4, "Causal masking skips blocks (FA2 Section 3.1)")
    dense = simulate_io(TOUR_N, TOUR_D, TOUR_M, algorithms=("flash2",))
    causal = simulate_io(TOUR_N, TOUR_D, TOUR_M, causal=True, algorithms=("flash2",))
    _say(out, "Blocks entirely above the diagonal are never loaded; those that straddle it are masked "
              "elementwise.")
    for pass_ in ("forward", "backward"):
        a, b = dense.row("flash2", pass_), causal.row("flash2", pass_)
        _say(out, f"FA2 {pass_:<8}: {b.blocks_visited:,} of {b.blocks_total:,} blocks visited "
                  f"({b.blocks_visited / b.blocks_total:.0%}), traffic {a.total:,} → {b.total:,} "
                  f"({1 - b.total / a.total:.0%} saved)", indent="  ")
    row = causal.row("flash2", "forward")
    _say(out, f"Visiting {row.blocks_visited / row.blocks_total:.0%} of the blocks bounds the forward pass's "
              f"causal speedup by {row.blocks_total / row.blocks_visited:.2f}× (FA2 Section 3.1 measures "
              f"1.7-1.8×).")


def _tour_read_on(out) -> None:
    _section(out, 5, "Where to read on")
    root = Path(fa2edu.__file__).resolve().parent.parent
    chapters = sorted((root / "chapters").glob("[0-9][0-9]_*.md"))
    if chapters:
        _say(out, f"The book's chapters ({root / 'chapters'}), one notebook each (jupytext Markdown):")
        for path in chapters:
            print(f"  {path.name}", file=out)
        _say(out, "Open them as notebooks in JupyterLab (pip install -e \".[notebooks]\" first):")
        print(f"  bash {root / 'scripts' / 'lab.sh'}", file=out)
    else:
        _say(out, "The chapters live in the source checkout's chapters/ folder (not installed with the package).")
    docs = root / "docs"
    built = docs / "_build" / "html" / "index.html"
    if built.exists():
        _say(out, f"The book as a website, with the API reference: {built}")
    else:
        _say(out, "The book as a website, with the API reference: `bash scripts/build_docs.sh` in the source "
                  "checkout, then open docs/_build/html/index.html.")
    print("Try: fa2edu io --help", file=out)
    print("     fa2edu io --N 16384 --d 128 --causal --device H100-SXM --batch 8 --heads 16", file=out)
    print("     fa2edu errata      (the papers' typos, each checked against the oracle)", file=out)


def tour(out=None) -> None:
    """The guided tour: five numbered sections, every number computed as it runs (a few seconds)."""
    out = sys.stdout if out is None else out
    start = time.perf_counter()
    print(f"fa2edu {fa2edu.__version__}: a tour of FlashAttention (FA1) and FlashAttention-2 (FA2)", file=out)
    _tour_traffic(out)
    _tour_scaling(out)
    _tour_exactness(out)
    _tour_causal(out)
    _tour_read_on(out)
    print(f"\n(tour computed in {time.perf_counter() - start:.1f} s)", file=out)


# -- fa2edu errata ----------------------------------------------------------------------------------------------------

def _run_errata(out) -> int:
    from fa2edu.errata import UNCHECKED, check_all

    print("The papers' errata (typos in the FA1 and FA2 texts), each evaluated on random blocks:", file=out)
    for erratum in check_all():
        print(erratum, file=out)
    for number, (where, what, why) in sorted(UNCHECKED.items()):
        print(f"Not computed: {number} ({where}): {what} [{why}]", file=out)
    return 0


def main(argv=None) -> int:
    """Entry point of the ``fa2edu`` command (``pyproject.toml``: ``fa2edu = fa2edu.cli:main``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args, parser, sys.stdout)
    except BrokenPipeError:
        # The reader went away (`fa2edu errata | head`): stop quietly, as Unix tools do, and point stdout at
        # /dev/null so that Python's final flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(args, parser, out) -> int:
    if args.command == "io":
        return _run_io(args, args.subparser, out)
    if args.command == "tour":
        tour(out)
        return 0
    if args.command == "errata":
        return _run_errata(out)
    if args.command == "version":
        print(f"fa2edu {fa2edu.__version__}", file=out)
        return 0
    parser.print_help(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
