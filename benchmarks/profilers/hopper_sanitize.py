"""Each Hopper rung once on small ragged problems, for compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool racecheck python -m benchmarks.profilers.hopper_sanitize [--rungs h3,h4]

Exits non-zero if a result is not close to SDPA's math backend in float32."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    import argparse

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels_gpu import hopper
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rungs", default=",".join(hopper.VERSIONS))
    rungs = parser.parse_args(argv).rungs.split(",")
    bad = 0
    for name, f in ((r, hopper.VERSIONS[r]) for r in rungs):
        for (Nq, Nk, d, causal) in ((150, 200, 128, True), (130, 70, 64, False)):
            q = torch.randn(1, 2, Nq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, 1, Nk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            O, _ = f(q, k, v, causal=causal)
            with sdpa_kernel(SDPBackend.MATH):
                mask = torch.ones(Nq, Nk, dtype=torch.bool, device="cuda").tril(Nk - Nq) if causal else None
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float().expand(1, 2, Nk, d), v.float().expand(1, 2, Nk, d), attn_mask=mask)
            rel = ((O.float() - ref.nan_to_num(0)).norm() / ref.nan_to_num(0).norm()).item()
            print(f"{name} N_q={Nq} N_k={Nk} d={d} causal={causal}: relative error {rel:.2e}", flush=True)
            bad += not rel < 1e-2
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
