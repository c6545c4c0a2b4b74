"""Train the small GPT with PyTorch's attention, a noise reference and fa2edu's FlashAttention-2, and compare.

    python -m examples.gpt.train --steps 300 --attention both --out examples/gpt/results/cpu   # + losses.png

Three runs start from the same initial weights (one seed, checked) and see the same batches in the same order:

* ``sdpa``: ``F.scaled_dot_product_attention`` with whatever backend PyTorch picks (on the CPU its fused
  flash kernel, on an H100/H200 in float32 the memory-efficient kernel);
* ``reference``: the same call forced to SDPA's MATH backend (softmax(QKᵀ/√d)V spelled out in PyTorch ops);
* ``fa2edu``: ``fa2edu.torch.flash_attention`` (FA2 Alg. 1 forward, Alg. 2 backward).

All three compute exact attention; they differ only in the order of their roundings. ``reference`` versus
``sdpa`` is therefore *float32 noise by construction*, amplified by training exactly as any rounding difference
is, and :func:`agreement_bounds` turns it into the per-step bound that ``fa2edu`` versus ``sdpa`` must meet.
``losses.json`` holds the three curves, the measured noise and its running-max envelope, the bound, the largest
ratio |Δloss|/bound and ``within_bound``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from examples.gpt.data import CharData, generate_text
from examples.gpt.model import GPT, GPTConfig

__all__ = ["RUNS", "NOISE_FACTOR", "FLOOR_ULPS", "train", "judge", "compare", "noise_envelope", "agreement_bounds",
           "main"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
RUNS = ("sdpa", "reference", "fa2edu")     # what ``--attention both`` trains, in this order
NOISE_FACTOR = 4                           # k in  |Δ_t| ≤ k · envelope_t + floor_t
FLOOR_ULPS = 8                             # floor_t = 8 ulps of loss_sdpa(t) in the run's dtype


def noise_envelope(reference, sdpa) -> list[float]:
    """envelope_t = max over s ≤ t of |loss_reference(s) − loss_sdpa(s)|: the float noise measured so far.

    A running maximum, because the divergence of two chaotically amplified trajectories is not monotone: it can
    dip close to zero at one step and come back at the next, and the bound should not dip with it.
    """
    if len(reference) != len(sdpa):
        raise ValueError(f"reference and sdpa must have equal lengths, got {len(reference)} and {len(sdpa)}")
    envelope, worst = [], 0.0
    for r, s in zip(reference, sdpa):
        worst = max(worst, abs(r - s))
        envelope.append(worst)
    return envelope


def agreement_bounds(reference, sdpa, dtype: torch.dtype = torch.float32) -> list[float]:
    """The largest |loss_fa2edu(t) − loss_sdpa(t)| allowed at each step t: ``k · envelope_t + floor_t``, in nats.

    Why this rule. Neither a float32 attention nor training is exact: two correct attentions round differently
    by a few ulps, and training feeds every such difference back into the weights, where it grows chaotically
    (measured: on an H200 to 5e-5 nats after 300 steps and 4e-4 after 400, on the CPU to 1.3e-5 after 300),
    far beyond any per-step rounding estimate. Rather than guess that growth, we *measure* it: ``reference`` is
    exact attention computed by a third implementation (SDPA's MATH backend), so |loss_reference − loss_sdpa|
    is what "float noise" means for this model, these batches, this device and this dtype. ``envelope_t``
    (:func:`noise_envelope`) is its running maximum up to step t.

    * ``k = NOISE_FACTOR = 4``. fa2edu is another exact attention with its own rounding order, so its divergence
      from SDPA is another sample of the same amplified noise: same model and data, hence the same rate of
      growth, but a starting perturbation that may be a few times larger (FA2's online softmax rescales O once
      per key block; on the GPU its dQ is summed by atomic adds in whatever order the blocks finish) and a
      different draw of the chaos. A factor 4 leaves room for both; a real fault does not stay within a small
      multiple of the noise. Hitting exactly bit-identical curves is not required.
    * ``floor_t = FLOOR_ULPS = 8`` ulps of loss_sdpa(t) in the run's dtype (1.9e-6 nats at the initial float32
      loss of 3.3). While the envelope is still 0 (the reference can match SDPA bit for bit for the first
      steps) the bound must not be 0: the loss is a mean over B·N token losses, and two attentions that differ
      in the last bit of the logits move that mean by one or two ulps; 8 leaves a margin.

    The rule has teeth (tests/test_gpt.py, on the CPU): a leaked future token (no causal mask) is far outside it
    at step 0, and 1% of dQ taken from the neighbouring row (a tiling bug) leaves it within a few steps. What a
    loss curve cannot see is a gradient off by a constant factor: Adam divides each entry by its own running RMS,
    so it would train identically; that is gradcheck's job (tests/test_torch_op.py). The same rule serves
    float64: there the MATH backend and SDPA's fused kernel also differ (by ~1e-15), so the envelope is measured
    in float64 rounding and the floor is 8 float64 ulps — the bound comes out near 1e-14 instead of 1e-6.
    """
    envelope = noise_envelope(reference, sdpa)
    numpy_dtype = np.float64 if dtype == torch.float64 else np.float32
    return [NOISE_FACTOR * e + FLOOR_ULPS * float(np.spacing(numpy_dtype(abs(s))))
            for e, s in zip(envelope, sdpa)]


def train(attention: str, data: CharData, *, steps: int, batch: int = 16, context: int = 64, n_layer: int = 2,
          n_head: int = 2, d_model: int = 64, lr: float = 3e-3, seed: int = 0, device: str = "cpu",
          dtype: torch.dtype = torch.float32, block_sizes=None, log_every: int = 0,
          progress: bool | None = False) -> dict:
    """Train one model for ``steps`` AdamW steps; returns its per-step training losses, time and size.

    ``attention`` is one of :data:`RUNS`: ``"sdpa"``, ``"reference"`` (the SDPA model run under
    ``sdpa_kernel(SDPBackend.MATH)``, forward and backward) or ``"fa2edu"``. The weights come from
    ``torch.manual_seed(seed)`` and the batches from ``data.batches(..., seed)``, so calls that differ only in
    ``attention`` start equal and see the same data. ``log_every``: print the loss every that many steps (0: never).
    ``progress``: a progress bar on stderr, one tick per step with the current loss (True), none (False), or one
    only when stderr is a terminal (None).
    """
    if attention not in RUNS:
        raise ValueError(f"attention must be one of {RUNS}, got {attention!r}")
    if device.startswith("cuda"):
        # Keep PyTorch's float32 matmuls (the model's and SDPA's) in true float32, as fa2edu's kernels are.
        torch.backends.cuda.matmul.allow_tf32 = False
    config = GPTConfig(vocab_size=data.vocab_size, context=context, n_layer=n_layer, n_head=n_head,
                       d_model=d_model, attention="fa2edu" if attention == "fa2edu" else "sdpa",
                       block_sizes=block_sizes)
    torch.manual_seed(seed)
    model = GPT(config).to(device=device, dtype=dtype)
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    backend = sdpa_kernel(SDPBackend.MATH) if attention == "reference" else contextlib.nullcontext()
    start = time.perf_counter()
    bar = tqdm(total=steps, desc=f"{attention:>9}", unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=None if progress is None else not progress)
    with backend, bar:
        for step, (x, y) in enumerate(data.batches(steps, batch, context, seed=seed)):
            _, loss = model(x.to(device), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            bar.update()
            if log_every and (step % log_every == 0 or step == steps - 1):
                # Through the bar, so that the line does not break it (plain print when it is off).
                bar.write(f"  {attention:>9} step {step:4d}  loss {losses[-1]:.6f}", file=sys.stdout)
                sys.stdout.flush()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"loss": losses, "seconds": seconds, "parameters": sum(p.numel() for p in initial),
            "initial_checksum": float(sum(p.double().sum() for p in initial))}


def judge(runs: dict, dtype: torch.dtype) -> dict:
    """The comparison fields of ``losses.json`` from the three runs' losses (see :func:`agreement_bounds`)."""
    sdpa, reference, fa2 = (runs[name]["loss"] for name in RUNS)
    diffs = [abs(a - b) for a, b in zip(fa2, sdpa)]
    bounds = agreement_bounds(reference, sdpa, dtype)
    ratios = [d / b for d, b in zip(diffs, bounds)]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    return {
        "criterion": {"rule": "|loss_fa2edu - loss_sdpa| <= k * envelope + floor_ulps * ulp(loss_sdpa)",
                      "k": NOISE_FACTOR, "floor_ulps": FLOOR_ULPS},
        "abs_diff": diffs,                                          # |loss_fa2edu − loss_sdpa| per step
        "noise": [abs(a - b) for a, b in zip(reference, sdpa)],     # |loss_reference − loss_sdpa| per step
        "envelope": noise_envelope(reference, sdpa),
        "bound": bounds,
        "max_abs_diff": max(diffs),
        "max_noise": max(abs(a - b) for a, b in zip(reference, sdpa)),
        "max_ratio": ratios[worst],
        "max_ratio_step": worst,
        "within_bound": ratios[worst] <= 1.0,
        "bound_at_last_step": bounds[-1],
    }


def compare(steps: int, *, attentions=RUNS, text_chars: int = 40_000, dtype: torch.dtype = torch.float32,
            **options) -> dict:
    """Run :func:`train` for each attention on the same text, seed and batches; the JSON-ready result.

    With all three of :data:`RUNS` the result also holds :func:`judge`'s fields (the bound and the verdict).
    """
    data = CharData(generate_text(text_chars))
    runs = {name: train(name, data, steps=steps, dtype=dtype, **options) for name in attentions}
    result = {
        "config": {"steps": steps, "text_chars": text_chars, "vocab_size": data.vocab_size,
                   "dtype": str(dtype).removeprefix("torch."), **{k: v for k, v in options.items()
                                                                 if k not in ("log_every", "progress")}},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "threads": torch.get_num_threads(),
                        "device_name": (torch.cuda.get_device_name() if str(options.get("device", "cpu"))
                                        .startswith("cuda") else platform.processor() or "cpu")},
        "runs": runs,
    }
    if len(runs) > 1:
        result["same_initial_weights"] = len({run["initial_checksum"] for run in runs.values()}) == 1
    if set(runs) == set(RUNS):
        result.update(judge(runs, dtype))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.gpt.train", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--attention", choices=RUNS + ("both",), default="both",
                        help="one run, or 'both' (default): sdpa, the noise reference and fa2edu, compared")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for losses.json and its plot losses.png (default: print only)")
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
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every that many steps")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar per run with the loss on stderr (default: when stderr is a terminal)")
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch CPU threads (default 1: the model is tiny, more threads mostly spin-wait)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    block_sizes = tuple(args.block_sizes) if args.block_sizes else ((16, 16) if args.device == "cpu" else None)
    attentions = RUNS if args.attention == "both" else (args.attention,)
    result = compare(args.steps, attentions=attentions, dtype=DTYPES[args.dtype], batch=args.batch,
                     context=args.context, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                     lr=args.lr, seed=args.seed, device=args.device, block_sizes=block_sizes,
                     log_every=args.log_every, progress=args.progress)
    for name, run in result["runs"].items():
        print(f"{name:>9}: loss {run['loss'][0]:.4f} → {run['loss'][-1]:.4f} in {run['seconds']:.1f} s "
              f"({run['parameters']} parameters)")
    if "within_bound" in result:
        print(f"max |loss_reference − loss_sdpa| (float noise) over {args.steps} steps: {result['max_noise']:.3e}\n"
              f"max |loss_fa2edu − loss_sdpa| over {args.steps} steps: {result['max_abs_diff']:.3e}; "
              f"largest |Δloss| / bound = {result['max_ratio']:.2f} at step {result['max_ratio_step']} "
              f"(bound = {NOISE_FACTOR}·envelope + {FLOOR_ULPS} ulps; {result['bound_at_last_step']:.1e} at the "
              f"last step): {'within' if result['within_bound'] else 'OUTSIDE'} the bound")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "losses.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
        # Imported here: examples.gpt.plot selects matplotlib's file backend, which a notebook importing this
        # module must not get.
        from examples.gpt import plot

        print(f"wrote {plot.plot(result, path.with_suffix('.png'))}")
    ok = result.get("within_bound", True) and result.get("same_initial_weights", True)
    return 0 if ok and all(math.isfinite(x) for r in result["runs"].values() for x in r["loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())
