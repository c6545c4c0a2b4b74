"""Each Hopper rung once on small ragged problems, for compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool racecheck python -m benchmarks.profilers.hopper_sanitize [--rungs h3,h4,b1]

A forward rung (h1 …) is compared with SDPA's math backend's output; a backward rung (b1 …) runs on h2's O and L
and its dQ, dK, dV are compared with the math backend's gradients.

Exits non-zero if a result is not close to SDPA's math backend in float32."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    import argparse

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels_gpu import hopper
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rungs", default=",".join([*hopper.VERSIONS, *hopper.BACKWARD_VERSIONS]))
    rungs = parser.parse_args(argv).rungs.split(",")
    bad = 0
    for name in rungs:
        for (Nq, Nk, d, causal) in ((150, 200, 128, True), (130, 70, 64, False)):
            q = torch.randn(1, 2, Nq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, 1, Nk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            leaves = [x.float().requires_grad_() for x in (q, k, v)]
            with sdpa_kernel(SDPBackend.MATH):
                mask = torch.ones(Nq, Nk, dtype=torch.bool, device="cuda").tril(Nk - Nq) if causal else None
                ref = torch.nn.functional.scaled_dot_product_attention(
                    leaves[0], leaves[1].expand(1, 2, Nk, d), leaves[2].expand(1, 2, Nk, d), attn_mask=mask)
            if name in hopper.VERSIONS:
                got, want = [hopper.VERSIONS[name](q, k, v, causal=causal)[0]], [ref.detach()]
            else:
                dO = torch.randn_like(q)
                rows = ref.isfinite().all(-1, keepdim=True)          # rows that see no key: NaN in SDPA's math
                want = torch.autograd.grad(ref.nan_to_num(0), leaves, dO.float() * rows)
                O, L = hopper.VERSIONS["h2"](q, k, v, causal=causal)
                got = hopper.BACKWARD_VERSIONS[name](q, k, v, O, L, dO, causal=causal)
            for g, w in zip(got, want):
                w = w.nan_to_num(0)
                rel = ((g.float() - w).norm() / w.norm()).item()
                print(f"{name} N_q={Nq} N_k={Nk} d={d} causal={causal}: relative error {rel:.2e}", flush=True)
                bad += not rel < 1e-2
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
