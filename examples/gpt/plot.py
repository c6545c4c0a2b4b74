"""Plot the two loss curves of a ``losses.json`` and their step-wise difference against the agreement bound.

    python -m examples.gpt.plot examples/gpt/results/cpu/losses.json        # writes losses.png beside it
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

LABELS = {"sdpa": "PyTorch SDPA", "fa2edu": "fa2edu.torch.flash_attention (FA2)"}


def _bounds(result: dict) -> list[float]:
    from examples.gpt.train import DTYPES, agreement_bound

    dtype = DTYPES[result["config"]["dtype"]]
    return [agreement_bound(dtype, step) for step in range(result["config"]["steps"])]


def plot(result: dict, path: Path) -> Path:
    """Top: training loss of each run. Bottom (when there are two runs): |Δloss| per step and the bound."""
    runs = result["runs"]
    two = "abs_diff" in result
    figure, axes = plt.subplots(2 if two else 1, 1, figsize=(7, 6.5 if two else 4), sharex=True, squeeze=False)
    top = axes[0, 0]
    styles = iter([dict(lw=2.5, alpha=0.6), dict(lw=1.0, ls="--", color="black")])
    for name, run in runs.items():
        top.plot(run["loss"], label=f"{LABELS.get(name, name)} ({run['seconds']:.0f} s)", **next(styles))
    config = result["config"]
    top.set_ylabel("training loss (nats / character)")
    top.set_title(f"char-level GPT, {runs[next(iter(runs))]['parameters']:,} parameters, {config['dtype']}, "
                  f"{config.get('device', 'cpu')}")
    top.legend()
    if two:
        bottom = axes[1, 0]
        steps = range(len(result["abs_diff"]))
        diffs = result["abs_diff"]
        nonzero = [(step, x) for step, x in zip(steps, diffs) if x > 0]
        # Steps where the two losses are bit-identical cannot go on a log axis: mark them along the bottom edge.
        floor = min([x for _, x in nonzero] or [1e-12]) / 3
        equal = [step for step, x in zip(steps, diffs) if x == 0]
        bottom.semilogy([s for s, _ in nonzero], [x for _, x in nonzero], ".", ms=3, label="|Δloss| per step")
        bottom.semilogy(equal, [floor] * len(equal), "|", color="grey", ms=4,
                        label=f"bit-identical losses ({len(equal)} steps)")
        bottom.semilogy(steps, _bounds(result), "r-", lw=1, label="agreement bound")
        bottom.set_ylabel("|loss_sdpa − loss_fa2edu|")
        bottom.set_xlabel("step")
        bottom.set_ylim(top=30 * max(_bounds(result)))       # room above the bound for the legend
        bottom.legend(loc="upper left", fontsize=8, ncol=3)
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
