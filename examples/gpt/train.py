"""Train the small GPT twice, once with PyTorch's attention and once with fa2edu's FlashAttention-2, and compare.

    python -m examples.gpt.train --steps 300 --attention both --out examples/gpt/results/cpu
    python -m examples.gpt.plot examples/gpt/results/cpu/losses.json

Both runs start from the same initial weights (one seed, checked) and see the same batches in the same order, so
their loss curves differ only by the rounding of the two attention implementations. ``losses.json`` holds both
curves, the largest step-wise difference and the bound it is checked against (:func:`agreement_bound`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from examples.gpt.data import CharData, generate_text
from examples.gpt.model import ATTENTIONS, GPT, GPTConfig

__all__ = ["train", "compare", "agreement_bound", "main"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def agreement_bound(dtype: torch.dtype, step: int) -> float:
    """The largest |loss_sdpa − loss_fa2edu| allowed at ``step`` (0-based), in nats.

    Why this bound. The two implementations compute the same attention up to rounding: in float32 their outputs
    differ by a few ulps (~1e-7 relative), so at step 0, with equal weights, the two losses agree to about one ulp
    of the loss (2.4e-7 at a loss of 3.3). Training feeds the difference back into the weights, and it grows
    slowly as the runs go on; ``losses.json`` records the measured drift. The bound allows 40 ulps at step 0 plus
    1e-6 nats per step (capped at 1e-2): ``1e-5 + 1e-6·step`` in float32, 3.1e-4 at step 300. Faults land outside
    it: a leaked future token (no causal mask) at once, and 1% of dQ taken from the neighbouring row (a tiling
    bug) within about ten steps (tests/test_gpt.py checks both). What a loss curve cannot see is a gradient off by
    a constant factor: Adam divides each entry by its own running RMS, so it would train identically; that is
    gradcheck's job (tests/test_torch_op.py). In float64 the rounding is ~1e-16 and the bound is
    ``1e-10 + 1e-12·step``.
    """
    if dtype == torch.float64:
        return 1e-10 + 1e-12 * step
    return min(1e-5 + 1e-6 * step, 1e-2)


def train(attention: str, data: CharData, *, steps: int, batch: int = 16, context: int = 64, n_layer: int = 2,
          n_head: int = 2, d_model: int = 64, lr: float = 3e-3, seed: int = 0, device: str = "cpu",
          dtype: torch.dtype = torch.float32, block_sizes=None, log_every: int = 0) -> dict:
    """Train one model for ``steps`` AdamW steps; returns its per-step training losses, time and size.

    The weights come from ``torch.manual_seed(seed)`` and the batches from ``data.batches(..., seed)``, so two
    calls that differ only in ``attention`` start equal and see the same data.
    """
    if device.startswith("cuda"):
        # Keep PyTorch's float32 matmuls (the model's and SDPA's) in true float32, as fa2edu's kernels are.
        torch.backends.cuda.matmul.allow_tf32 = False
    config = GPTConfig(vocab_size=data.vocab_size, context=context, n_layer=n_layer, n_head=n_head,
                       d_model=d_model, attention=attention, block_sizes=block_sizes)
    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=dtype)
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    start = time.perf_counter()
    for step, (x, y) in enumerate(data.batches(steps, batch, context, seed=seed)):
        _, loss = model(x.to(device), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  {attention:>6} step {step:4d}  loss {losses[-1]:.6f}", flush=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"loss": losses, "seconds": seconds, "parameters": sum(p.numel() for p in initial),
            "initial_checksum": float(sum(p.double().sum() for p in initial))}


def compare(steps: int, *, attentions=ATTENTIONS, text_chars: int = 40_000, dtype: torch.dtype = torch.float32,
            **options) -> dict:
    """Run :func:`train` for each attention on the same text, seed and batches; the JSON-ready result."""
    data = CharData(generate_text(text_chars))
    runs = {name: train(name, data, steps=steps, dtype=dtype, **options) for name in attentions}
    result = {
        "config": {"steps": steps, "text_chars": text_chars, "vocab_size": data.vocab_size,
                   "dtype": str(dtype).removeprefix("torch."), **{k: v for k, v in options.items()
                                                                 if k != "log_every"}},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "threads": torch.get_num_threads(),
                        "device_name": (torch.cuda.get_device_name() if str(options.get("device", "cpu"))
                                        .startswith("cuda") else platform.processor() or "cpu")},
        "runs": runs,
    }
    if len(runs) == 2:
        a, b = (runs[name]["loss"] for name in attentions)
        diffs = [abs(x - y) for x, y in zip(a, b)]
        bounds = [agreement_bound(dtype, step) for step in range(steps)]
        result["max_abs_diff"] = max(diffs)
        result["abs_diff"] = diffs
        result["within_bound"] = all(d <= bound for d, bound in zip(diffs, bounds))
        result["bound_at_last_step"] = bounds[-1]
        result["same_initial_weights"] = runs[attentions[0]]["initial_checksum"] == \
            runs[attentions[1]]["initial_checksum"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.gpt.train", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--attention", choices=ATTENTIONS + ("both",), default="both")
    parser.add_argument("--out", type=Path, default=None, help="folder for losses.json (default: print only)")
    parser.add_argument("--device", default="cpu", help="'cpu' (fa2edu's NumPy FA2) or 'cuda' (kernels_gpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-sizes", type=int, nargs=2, default=None, metavar=("B_r", "B_c"),
                        help="fa2edu's tile sizes (default on the CPU: 16 16, so each row crosses several tiles)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch CPU threads (default 1: the model is tiny, more threads mostly spin-wait)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    block_sizes = tuple(args.block_sizes) if args.block_sizes else ((16, 16) if args.device == "cpu" else None)
    attentions = ATTENTIONS if args.attention == "both" else (args.attention,)
    result = compare(args.steps, attentions=attentions, dtype=DTYPES[args.dtype], batch=args.batch,
                     context=args.context, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                     lr=args.lr, seed=args.seed, device=args.device, block_sizes=block_sizes,
                     log_every=args.log_every)
    for name, run in result["runs"].items():
        print(f"{name:>6}: loss {run['loss'][0]:.4f} → {run['loss'][-1]:.4f} in {run['seconds']:.1f} s "
              f"({run['parameters']} parameters)")
    if "max_abs_diff" in result:
        print(f"max |Δloss| over {args.steps} steps: {result['max_abs_diff']:.3e} "
              f"(bound {result['bound_at_last_step']:.1e} at the last step): "
              f"{'within' if result['within_bound'] else 'OUTSIDE'} the bound")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "losses.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    ok = result.get("within_bound", True) and result.get("same_initial_weights", True)
    return 0 if ok and all(math.isfinite(x) for r in result["runs"].values() for x in r["loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())
