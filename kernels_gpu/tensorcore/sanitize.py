"""One small launch of each tensor-core rung, checked, for compute-sanitizer.

f16 and bf16, d = 64 and 128, causal and not, ragged N:
``compute-sanitizer --tool memcheck python -m kernels_gpu.tensorcore.sanitize`` (and ``--tool racecheck``); name
rungs to run only those (``python -m kernels_gpu.tensorcore.sanitize v6``; backward rungs as ``bwd_v1`` …: GQA,
ragged, causal with rows that see no key, d = 64, 128 and 256; FA2 Section 3.3's ``split-k``, ``split-q`` and the
float32 tensor-core forwards ``tf32``, ``3xtf32``, ``3xtf32-planes`` and the 3xTF32 backward ``3xtf32-bwd`` by
those names; ``strided``: the PyTorch op
on GPT-shaped strided views, read in place).
Prints one line per launch; exits non-zero on a wrong result."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels_gpu.tensorcore import BACKWARD_VERSIONS, PARTITIONING, VERSIONS
    wanted = list(sys.argv[1:] if argv is None else argv) or (list(VERSIONS) +
                                                              [f"bwd_{v}" for v in BACKWARD_VERSIONS])
    failures = 0
    for version, forward in sorted({**VERSIONS, **PARTITIONING}.items()):
        if version not in wanted:
            continue
        for dtype in (torch.float16, torch.bfloat16):
            for d, causal in ((64, False), (128, True)):
                Q = torch.randn(1, 2, 150, d, device="cuda").to(dtype)
                K = torch.randn(1, 1, 130, d, device="cuda").to(dtype)
                V = torch.randn(1, 1, 130, d, device="cuda").to(dtype)
                O, L = forward(Q, K, V, causal=causal)
                torch.cuda.synchronize()
                mask = torch.ones(150, 130, dtype=torch.bool, device="cuda").tril(-20) if causal else None
                with sdpa_kernel(SDPBackend.MATH):   # a reference kernel the sanitizer need not check
                    ref = torch.nn.functional.scaled_dot_product_attention(
                        Q.float(), K.float().expand(1, 2, 130, d), V.float().expand(1, 2, 130, d),
                        attn_mask=mask).nan_to_num(0.0)
                err = (O.float() - ref).abs().max().item()
                ok = err < 2e-2 and not O.isnan().any()
                failures += not ok
                print(f"{version} {dtype} d={d} causal={causal}: max error {err:.2e} {'ok' if ok else 'WRONG'}",
                      flush=True)
    failures += _backward(wanted)
    failures += _tf32(wanted)
    failures += _tf32_backward(wanted)
    failures += _strided(wanted)
    return 1 if failures else 0


def _strided(wanted) -> int:
    """If ``strided`` is in ``wanted``: the fastest forward and backward through ``fa2edu.torch.flash_attention``
    on GPT-shaped strided inputs — q, k, v (B, H, N, d) views of one (B, N, 3·H·d) projection, dO a view of a
    (B, N, H·d) gradient — read in place, O and the gradients written in (B, N, H, d) memory: O checked against
    SDPA's math backend, the gradients against the same op on contiguous copies (bit for bit)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa2edu.torch import flash_attention
    if "strided" not in wanted:
        return 0
    failures = 0
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            B, N, H = 2, 150, 4
            qkv = torch.randn(B, N, 3 * H * d, device="cuda").to(dtype)
            q, k, v = (t.view(B, N, H, d).transpose(1, 2) for t in qkv.split(H * d, dim=2))
            dO = torch.randn(B, N, H * d, device="cuda").to(dtype).view(B, N, H, d).transpose(1, 2)
            runs = []
            for args in ((q, k, v), tuple(x.contiguous() for x in (q, k, v))):
                leaves = [x.detach().requires_grad_() for x in args]
                O = flash_attention(*leaves, causal=True)
                O.backward(dO if args[0] is q else dO.contiguous())
                runs.append([O.detach()] + [x.grad for x in leaves])
            torch.cuda.synchronize()
            with sdpa_kernel(SDPBackend.MATH):
                ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                       is_causal=True)
            err = (runs[0][0].float() - ref).abs().max().item()
            same = all(torch.equal(a, b) for a, b in zip(*runs))
            ok = err < 2e-2 and same
            failures += not ok
            print(f"strided {dtype} d={d} causal=True: O max error {err:.2e}, gradients "
                  f"{'equal' if same else 'DIFFERENT'} to contiguous inputs' {'ok' if ok else 'WRONG'}", flush=True)
    return failures


def _tf32(wanted) -> int:
    """The float32 tensor-core forwards named in ``wanted`` (``tf32``, ``3xtf32``, ``3xtf32-planes``): float32 inputs,
    d = 64 (non-causal), 128 and 256 (causal, rows that see no key; the planes form stops at 128), checked against
    SDPA's math backend in float32 — TF32's errors are ~1e-3 (bound 1e-2), 3xTF32's float32's (bound 1e-5)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels_gpu.tensorcore import TF32
    failures = 0
    for name in (n for n in TF32 if n in wanted):
        bound = 1e-2 if name == "tf32" else 1e-5
        for d, causal in ((64, False), (128, True), (256, True)):
            if name == "3xtf32-planes" and d > 128:
                continue
            Q = torch.randn(1, 2, 150, d, device="cuda")
            K, V = (torch.randn(1, 1, 130, d, device="cuda") for _ in range(2))
            res = TF32[name](Q, K, V, causal=causal)
            torch.cuda.synchronize()
            O = torch.as_tensor(res.O, device="cuda")
            mask = torch.ones(150, 130, dtype=torch.bool, device="cuda").tril(-20) if causal else None
            with sdpa_kernel(SDPBackend.MATH):
                ref = torch.nn.functional.scaled_dot_product_attention(
                    Q, K.expand(1, 2, 130, d), V.expand(1, 2, 130, d), attn_mask=mask).nan_to_num(0.0)
            err = (O - ref).abs().max().item()
            ok = err < bound and not O.isnan().any() and res.precision == name.removesuffix("-planes")
            failures += not ok
            print(f"{name} float32 d={d} causal={causal}: max error {err:.2e} {'ok' if ok else 'WRONG'}",
                  flush=True)
    return failures


def _tf32_backward(wanted) -> int:
    """If ``3xtf32-bwd`` is in ``wanted``: the 3xTF32 backward on float32 inputs (GQA 2:1, N_q = 150, N_k = 130; d = 64
    with its default tile and with four warps, d = 128 causal with rows that see no key), dQ, dK, dV checked against
    fa2edu's float64 oracle (max error over max gradient below 1e-5: float32's accuracy)."""
    import numpy as np
    import torch

    import fa2edu
    from kernels_gpu.tensorcore import TF32, TF32_BACKWARD
    if "3xtf32-bwd" not in wanted:
        return 0
    failures = 0
    for d, causal, warps in ((64, False, None), (64, True, 4), (128, True, None)):
        Q, dO = (torch.randn(1, 2, 150, d, device="cuda") for _ in range(2))
        K, V = (torch.randn(1, 1, 130, d, device="cuda") for _ in range(2))
        O, L = (torch.as_tensor(x, device="cuda") for x in TF32["3xtf32-planes"](Q, K, V, causal=causal))
        grads = TF32_BACKWARD["3xtf32"](Q, K, V, O, L, dO, causal=causal, warps=warps)
        torch.cuda.synchronize()
        ref = fa2edu.attention_reference_backward(*(x.cpu().numpy() for x in (Q, K, V, dO)), causal=causal)
        errs = [float(np.abs(torch.as_tensor(g, device="cuda").cpu().numpy() - r).max() / np.abs(r).max())
                for g, r in zip(grads, ref[:3])]
        ok = max(errs) < 1e-5
        failures += not ok
        print(f"3xtf32-bwd float32 d={d} causal={causal} warps={warps}: max relative errors dQ, dK, dV "
              f"{', '.join(f'{e:.1e}' for e in errs)} {'ok' if ok else 'WRONG'}", flush=True)
    return failures


def _backward(wanted) -> int:
    """The backward rungs named ``bwd_v1`` … in ``wanted``: one launch per dtype and (d, causal), dQ, dK, dV checked
    against fa2edu's float64 oracle (max error over max gradient below 2e-2). Returns the number of failures."""
    import numpy as np
    import torch

    import fa2edu
    from kernels_gpu.tensorcore import BACKWARD_VERSIONS, flash2_forward
    failures = 0
    for version, backward in sorted(BACKWARD_VERSIONS.items()):
        if f"bwd_{version}" not in wanted:
            continue
        for dtype in (torch.float16, torch.bfloat16):
            for d, causal in ((64, False), (128, True), (256, True)):
                Q, dO = (torch.randn(1, 2, 150, d, device="cuda").to(dtype) for _ in range(2))
                K, V = (torch.randn(1, 1, 130, d, device="cuda").to(dtype) for _ in range(2))
                O, L = flash2_forward(Q, K, V, causal=causal)
                grads = backward(Q, K, V, O, L, dO, causal=causal)
                torch.cuda.synchronize()
                ref = fa2edu.attention_reference_backward(*(x.double().cpu().numpy() for x in (Q, K, V, dO)),
                                                          causal=causal)
                err = max(float(np.abs(g.double().cpu().numpy() - r).max() / np.abs(r).max())
                          for g, r in zip(grads, ref))
                ok = err < 2e-2 and not any(g.isnan().any() for g in grads)
                failures += not ok
                print(f"bwd_{version} {dtype} d={d} causal={causal}: max relative error {err:.2e} "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
