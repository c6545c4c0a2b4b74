"""What SDPA's math backend computes in: the baseline of the flash-attn rule at head sizes its fused kernels refuse.

The GPU tests of ``fa2edu.torch.flash_attention`` hold every output to flash-attn's rule: error against the float64
oracle ≤ 2 × the error of PyTorch's own attention in the same dtype + a small floor. For d = 1, 7, 59, … PyTorch's
SDPA falls back to its math backend, which computes float16/bfloat16 inputs in float32 and rounds once — unless
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` — so the "same-dtype" baseline would be a float32
one. This script prints, for d = 1 and 7, both dtypes, a few seeds, and both settings of that flag, each output's
error beside its bound (``!`` where the error is over it)::

    python -m benchmarks.profilers.sdpa_baseline_dtype            # on a CUDA machine, from the repository root

Recorded: ``benchmarks/results/nvidia-h100/torch_op_d1_bfloat16_baseline.log``.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--d", type=int, nargs="+", default=[1, 7])
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from fa2edu.torch import flash_attention

    def draw(d, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        shapes = ((1, 4, 150, d), (1, 2, 170, d), (1, 2, 170, d), (1, 4, 150, d))
        return [torch.randn(s, generator=g, dtype=torch.float64).to("cuda", dtype) for s in shapes]

    def with_grads(attention, q, k, v, dO):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        O = attention(q, k, v)
        O.backward(dO)
        return [x.detach() for x in (O, q.grad, k.grad, v.grad)]

    def sdpa(q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: error / (2 × SDPA's error + floor) per "
          f"output, causal, q (1, 4, 150, d), k, v (1, 2, 170, d)")
    for reduced in (False, True):
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
        print(f"SDPA math backend with fp16/bf16 reductions {'allowed' if reduced else 'off (computes in float32)'}")
        for dtype in (torch.bfloat16, torch.float16):
            for d in args.d:
                for seed in args.seeds:
                    q, k, v, dO = draw(d, dtype, seed)
                    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, dO)
                    oracle = with_grads(sdpa, *(x.double() for x in (q, k, v, dO)))
                    base = with_grads(sdpa, q, k, v, dO)
                    cells = []
                    for name, x, ref, low in zip(("O", "dQ", "dK", "dV"), ours, oracle, base):
                        err = (x.double() - ref).abs().max().item()
                        bound = 2 * (low.double() - ref).abs().max().item() + max(1e-5, 1e-3 * max(
                            1.0, ref.abs().max().item()))
                        cells.append(f"{name} {err:.2e}/{bound:.2e}{'!' if err > bound else ' '}")
                    print(f"  {str(dtype)[6:]:>8} d={d} seed={seed}: " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
