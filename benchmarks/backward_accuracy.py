"""The float32 backwards' errors at extreme logits, beside PyTorch's: what flash-attn's rule compares (GPU only).

    python -m benchmarks.backward_accuracy > benchmarks/results/<device>/tf32_backward_extreme_logits.log

For each problem (GQA 2:1, N = 600, bottom-right causal; d = 64 with Q, K scaled by 4 — scores in the hundreds —
and by 1; d = 128 scaled by 4) it prints the largest absolute error of dQ, dK, dV against float64 gradients on the
GPU (``tests/gpu/test_tensorcore_backward_gpu.oracle``) for: PyTorch's float32 SDPA backward on its memory-efficient
backend (CUTLASS's 3xTF32) and on its math backend (the composite formula: flash-attn's reference); the 3xTF32
backward (:mod:`kernels_gpu.tensorcore.flash2_backward_3xtf32`) given O and L from the 3xTF32 planes forward, from
the fast FFMA forward v4 and from the oracle (rounded to float32); kernels_gpu.fast's FFMA backwards v3 and v4 given
the PyTorch op's fast forward (``fa2edu._torch_ops.FAST_FORWARD``: v6 at d = 64, v8 at 128) and the oracle's. The
backward recomputes P = exp(τS − L) from the L it is given, so an L computed with other roundings than its own S
shows up in every gradient.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: (label, Q shape, K/V shape, scale of Q and K)
PROBLEMS = [("scale 4, d 64", (1, 4, 600, 64), (1, 2, 600, 64), 4.0),
            ("scale 1, d 64", (1, 4, 600, 64), (1, 2, 600, 64), 1.0),
            ("scale 4, d 128", (1, 4, 600, 128), (1, 2, 600, 128), 4.0)]


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    from test_tensorcore_backward_gpu import oracle, torch_gradients
    from test_tensorcore_gpu import reference

    from fa2edu._torch_ops import FAST_FORWARD
    from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS
    from kernels_gpu.tensorcore import TF32, TF32_BACKWARD

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; largest |error| of dQ, dK, dV")
    for label, shape_q, shape_kv, scale in PROBLEMS:
        g = torch.Generator(device="cuda").manual_seed(5)
        Q = torch.randn(shape_q, device="cuda", generator=g) * scale
        K = torch.randn(shape_kv, device="cuda", generator=g) * scale
        V = torch.randn(shape_kv, device="cuda", generator=g)
        dO = torch.randn(shape_q, device="cuda", generator=g)
        exact = oracle(Q, K, V, dO, True)

        def errors(grads, exact=exact):
            return " ".join(f"{(torch.as_tensor(a, device='cuda').double() - b).abs().max().item():.2e}"
                            for a, b in zip(grads, exact))

        O_ref, L_ref = reference(Q, K, V, True)
        op_forward = FAST_FORWARD[64] if Q.shape[-1] <= 64 else FAST_FORWARD[256]
        saved = {"3xtf32 planes forward": TF32["3xtf32-planes"](Q, K, V, causal=True),
                 "fast forward v4": VERSIONS["v4"](Q, K, V, causal=True),
                 f"fast forward {op_forward} (op)": VERSIONS[op_forward](Q, K, V, causal=True),
                 "oracle (float32)": (O_ref.float(), L_ref.float())}
        saved = {k: tuple(torch.as_tensor(x, device="cuda") for x in v) for k, v in saved.items()}
        print(f"{label}: largest |dQ|, |dK|, |dV| {' '.join(f'{x.abs().max().item():.1f}' for x in exact)}")
        for backend in ("EFFICIENT_ATTENTION", "MATH"):
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                print(f"  SDPA float32 {backend.lower():22s} {errors(torch_gradients(Q, K, V, dO, True))}")
        for name in ("3xtf32 planes forward", "fast forward v4", "oracle (float32)"):
            O, L = saved[name]
            print(f"  3xTF32 backward, O, L of {name:22s} "
                  f"{errors(TF32_BACKWARD['3xtf32'](Q, K, V, O, L, dO, causal=True))}")
        for version in ("v3", "v4"):
            for name in (f"fast forward {op_forward} (op)", "oracle (float32)"):
                O, L = saved[name]
                print(f"  fast {version} backward, O, L of {name:21s} "
                      f"{errors(BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=True))}")


if __name__ == "__main__":
    main()
