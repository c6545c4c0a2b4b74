"""Plot the loss curves of a ``losses.json``, and fa2edu's step-wise difference from SDPA against the measured noise.

    python -m examples.gpt.plot examples/gpt/results/cpu/losses.json        # writes losses.png beside it

(``python -m examples.gpt.train --out DIR`` already draws DIR/losses.png; this redraws it from a saved file.)

Top: the training loss of every run. Bottom (when the file compares runs): |loss_fa2edu − loss_sdpa| per step,
the float noise |loss_reference − loss_sdpa| per step, and the bound ``k · envelope + floor`` built from that
noise (``examples.gpt.train.agreement_bounds``). A file written before the noise reference existed (two runs, no
``bound`` field) is drawn without a bound, and the title says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot", "main"]

LABELS = {"sdpa": "PyTorch SDPA", "reference": "SDPA, MATH backend (noise reference)",
          "fa2edu": "fa2edu.torch.flash_attention (FA2)"}
STYLES = {"sdpa": dict(lw=2.5, alpha=0.6), "reference": dict(lw=1.0, color="tab:green", alpha=0.8),
          "fa2edu": dict(lw=1.0, ls="--", color="black")}


def _log_points(axis, values, floor, **style):
    """Draw the positive values on the log axis and the zeros (bit-identical losses) along ``floor``."""
    steps = range(len(values))
    axis.semilogy([s for s in steps if values[s] > 0], [x for x in values if x > 0], ".", ms=3, **style)
    zeros = [s for s in steps if values[s] == 0]
    axis.semilogy(zeros, [floor] * len(zeros), "|", ms=4, color=style.get("color"), alpha=0.5)
    return len(zeros)


def plot(result: dict, path: Path) -> Path:
    """Top: training loss of each run. Bottom (when runs are compared): the differences, the noise and the bound."""
    runs = result["runs"]
    compared = "abs_diff" in result
    figure, axes = plt.subplots(2 if compared else 1, 1, figsize=(7, 6.5 if compared else 4), sharex=True,
                                squeeze=False)
    top = axes[0, 0]
    for name, run in runs.items():
        top.plot(run["loss"], label=f"{LABELS.get(name, name)} ({run['seconds']:.0f} s)", **STYLES.get(name, {}))
    config = result["config"]
    top.set_ylabel("training loss (nats / character)")
    top.set_title(f"char-level GPT, {runs[next(iter(runs))]['parameters']:,} parameters, {config['dtype']}, "
                  f"{config.get('device', 'cpu')}")
    top.legend(fontsize=8)
    if compared:
        bottom = axes[1, 0]
        diffs, noise = result["abs_diff"], result.get("noise", [])
        positive = [x for x in diffs + noise if x > 0]
        floor = min(positive or [1e-12]) / 3          # where bit-identical steps are marked (a log axis has no 0)
        equal = _log_points(bottom, diffs, floor, color="tab:blue", label="|loss_fa2edu − loss_sdpa|")
        if noise:
            _log_points(bottom, noise, floor / 2, color="tab:green",
                        label="|loss_reference − loss_sdpa| (float noise)")
        if "bound" in result:
            criterion = result["criterion"]
            bottom.semilogy(result["bound"], "r-", lw=1,
                            label=f"bound = {criterion['k']}·running max of the noise + "
                                  f"{criterion['floor_ulps']} ulps")
            verdict = "within" if result["within_bound"] else "OUTSIDE"
            bottom.set_title(f"largest |Δ| / bound = {result['max_ratio']:.2f}: {verdict} the bound", fontsize=9)
            bottom.set_ylim(top=30 * max(result["bound"]))  # room above the bound for the legend
        else:
            bottom.set_title("old-format file: no noise reference was run, so no bound is drawn", fontsize=9)
            bottom.set_ylim(top=30 * max(positive or [1e-12]))
        bottom.set_ylabel("|Δloss| (nats); ticks at the bottom: bit-identical")
        bottom.set_xlabel(f"step ({equal} steps with fa2edu bit-identical to SDPA)")
        bottom.legend(loc="upper left", fontsize=7, ncol=2)
    else:
        top.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.gpt.plot", description=__doc__.splitlines()[0])
    parser.add_argument("losses", type=Path, help="a losses.json written by examples.gpt.train")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: losses.png beside the JSON)")
    args = parser.parse_args(argv)
    result = json.loads(args.losses.read_text())
    path = plot(result, args.out or args.losses.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
