"""Where a bfloat16 training step of the GPT goes, with fa2edu's attention and with SDPA: PyTorch's profiler.

    python -m benchmarks.profilers.gpt_step_profile > benchmarks/results/<device>/gpt_bf16_d128_profile.log
    python -m benchmarks.profilers.gpt_step_profile --config d64 > benchmarks/results/<device>/gpt_bf16_d64_profile.log

A configuration of :mod:`benchmarks.gpt_speed` (``d128`` by default: 4 layers, d_model 1024, 8 heads of d = 128;
``d64``: d_model 512, d = 64; context 4096, batch 4, bfloat16 autocast, AdamW): 5 warm-up steps, 4 steps timed on
the wall clock, then 3 steps under
``torch.profiler`` (CPU and CUDA activity). For each attention it prints the wall time per step and the profiler's
tables sorted by self CUDA time and by self CPU time; "Self CUDA time total" at the foot of a table is the GPU
time of the 3 profiled steps (4 layers each: an attention row with 12 calls is one call per layer and step).

The committed H100 log was made by this script's first version, which ran the same steps at module level and
also printed a "GPU kernel time" per step that added the operators' and their kernels' times (the kernels counted
twice); that line is gone, the tables are the same.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # examples/ is not an installed package
    sys.path.insert(0, str(ROOT))

#: the GPT of benchmarks.gpt_speed's "d128" configuration (the default; ``--config`` picks another), and its batch
MODEL = dict(n_layer=4, n_head=8, d_model=1024)
CONTEXT, BATCH = 4096, 4
WARMUP, TIMED, PROFILED = 5, 4, 3


def bf16_training(attention: str, data, model: dict = MODEL, steps: int = WARMUP + TIMED + PROFILED,
                  context: int = CONTEXT, batch: int = BATCH):
    """The GPT of ``model`` with ``attention`` on the GPU (weights from seed 0), AdamW, and ``steps`` batches of
    ``batch`` × ``context`` characters: (step(x, y), batches), ``step`` one bfloat16-autocast training step."""
    import torch

    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=data.vocab_size, context=context, attention=attention, **model)
    torch.manual_seed(0)
    net = GPT(cfg).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batches = [(x.cuda(), y.cuda()) for x, y in data.batches(steps, batch, context, seed=0)]

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = net(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step, batches


def profile_steps(attention: str, data, model: dict = MODEL) -> dict:
    """Train ``attention``'s model for WARMUP + TIMED + PROFILED steps; print the profiler's tables."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step, batches = bf16_training(attention, data, model)
    for x, y in batches[:WARMUP]:
        step(x, y)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in batches[WARMUP:WARMUP + TIMED]:
        step(x, y)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / TIMED
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x, y in batches[WARMUP + TIMED:]:
            step(x, y)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(f"== {attention}: wall {wall * 1e3:.2f} ms/step", flush=True)
    for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        try:
            print(ka.table(sort_by=key, row_limit=18, max_name_column_width=60), flush=True)
        except Exception as error:  # noqa: BLE001 (a sort key this PyTorch does not know)
            print("table", key, "failed:", error)
    return dict(wall_ms=wall * 1e3)


def main(argv=None) -> int:
    import argparse

    from benchmarks.gpt_speed import CONFIGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="d128", choices=sorted(CONFIGS))
    args = parser.parse_args(argv)
    from benchmarks.harness import timing
    timing.cuda_setup()
    import torch

    from examples.gpt.data import CharData, generate_text
    data = CharData(generate_text(100_000))
    walls = {}
    for attention in ("sdpa", "fa2edu"):
        walls[attention] = profile_steps(attention, data, CONFIGS[args.config])
        torch.cuda.empty_cache()                # (the first model's memory is free once its call returns)
    print(json.dumps(walls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
