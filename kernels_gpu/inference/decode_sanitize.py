"""One small launch of each inference kernel, checked against the float64 oracle, for NVIDIA's compute-sanitizer.

Run on the GPU machine from the repository root::

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
        python -m kernels_gpu.inference.decode_sanitize
    compute-sanitizer --tool racecheck --error-exitcode 1 python -m kernels_gpu.inference.decode_sanitize
    compute-sanitizer --tool synccheck --error-exitcode 1 python -m kernels_gpu.inference.decode_sanitize
    compute-sanitizer --tool initcheck --error-exitcode 1 python -m kernels_gpu.inference.decode_sanitize

(``--report-api-errors no``: on the device image of 2026-11-26, memcheck otherwise counts 34 host-side errors,
every one a call to ``cuGetProcAddress_v2`` from numba's driver initialisation — none from a kernel.)

Launches: decoding from a paged float16 cache (shuffled pages, ragged lengths with an idle slot and a full one, GQA
4, 3 splits merged inside their thread-block cluster — and once more by the merge launch —, on the tensor-core
program), from a contiguous bfloat16 cache with
2 new tokens (causal: a token that sees no key) and one split, float32 with the default split rule (the CUDA-core
program, 16-byte loads), the CUDA-core program on float16 (3 splits and the merge launch), and a contiguous float16
cache with 3 new tokens and the default split rule — the tensor-core ones with whole tiles by tensor copies (the
default), then two of them again with bulk copies and with ``cp.async``; varlen over a packed float16 batch (an
empty sequence, n_q ≠ n_k, causal) and a float32 one. Ragged everywhere: lengths divide no tile. Outputs are
poisoned (NaN) before each launch, so initcheck and the oracle both see a forgotten write. Prints one line per
launch; exits non-zero on a wrong result.
"""

from __future__ import annotations

import sys

import numpy as np


def _reference(q, k, v, causal):
    """float64 attention of one sequence (q (H_q, N_q, d), k, v (H_kv, N_k, d)), GQA, bottom-right causal."""
    import torch
    G = q.shape[0] // k.shape[0]
    q, k, v = q.double(), k.double().repeat_interleave(G, 0), v.double().repeat_interleave(G, 0)
    S = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).tril(S.shape[-1] - S.shape[-2])
        S = S.masked_fill(~keep, -torch.inf)
    return torch.softmax(S, -1).nan_to_num(0.0) @ v


def _check(name: str, O, O_ref, tol: float) -> bool:
    err = (O.double() - O_ref).abs().max().item() if O.numel() else 0.0
    ok = err <= tol and not O.isnan().any()
    print(f"{name}: max error {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def decode_case(dtype, *, paged: bool, N_new: int, num_splits, seed: int, kernel=None) -> bool:
    import torch

    import kernels_gpu
    g = torch.Generator().manual_seed(seed)
    B, H_kv, G, d, page, max_pages = 3, 2, 4, 128, 16, 5
    lengths = [0, page * max_pages, 37]
    q = torch.randn(B, H_kv * G, N_new, d, generator=g).to(dtype).cuda()
    keys = [torch.randn(H_kv, n, d, generator=g).to(dtype).cuda() for n in lengths]
    values = [torch.randn(H_kv, n, d, generator=g).to(dtype).cuda() for n in lengths]
    if paged:
        num_pages = B * max_pages + 2
        kc = torch.zeros(num_pages, H_kv, page, d, dtype=dtype, device="cuda")
        vc = torch.zeros_like(kc)
        table = torch.randperm(num_pages, generator=g)[:B * max_pages].reshape(B, max_pages).to(torch.int32)
        for b, n in enumerate(lengths):
            for p in range(-(-n // page)):
                rows = slice(p * page, min((p + 1) * page, n))
                kc[table[b, p], :, :rows.stop - rows.start] = keys[b][:, rows]
                vc[table[b, p], :, :rows.stop - rows.start] = values[b][:, rows]
        table = table.cuda()
    else:
        kc = torch.zeros(B, H_kv, page * max_pages, d, dtype=dtype, device="cuda")
        vc = torch.zeros_like(kc)
        for b, n in enumerate(lengths):
            kc[b, :, :n], vc[b, :, :n] = keys[b], values[b]
        table = None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    O, L = kernels_gpu.decode_attention(q, kc, vc, seqlens, table, num_splits=num_splits, kernel=kernel)
    torch.cuda.synchronize()
    ok = True
    for b, n in enumerate(lengths):
        ref = torch.zeros_like(O[b], dtype=torch.float64) if n == 0 else _reference(q[b], keys[b], values[b], True)
        ok &= _check(f"decode {str(dtype)[6:]} {kernel or 'default'} {'paged' if paged else 'contiguous'} "
                     f"N_new={N_new} num_splits={num_splits} sequence {b} (n = {n})", O[b], ref,
                     1e-5 if dtype == torch.float32 else 2e-2)
    return ok


def varlen_case(dtype, *, causal: bool, seed: int) -> bool:
    import torch

    import kernels_gpu
    g = torch.Generator().manual_seed(seed)
    n_q, n_k = [70, 0, 129, 5], [90, 3, 129, 1]
    cu_q, cu_k = np.cumsum([0] + n_q), np.cumsum([0] + n_k)
    H_kv, G, d = 2, 2, 64
    q = torch.randn(H_kv * G, int(cu_q[-1]), d, generator=g).to(dtype).cuda()
    k = torch.randn(H_kv, int(cu_k[-1]), d, generator=g).to(dtype).cuda()
    v = torch.randn(H_kv, int(cu_k[-1]), d, generator=g).to(dtype).cuda()
    O, L = kernels_gpu.varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    torch.cuda.synchronize()
    ok = True
    for b in range(len(n_q)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop == rows.start:
            continue
        ref = _reference(q[:, rows], k[:, keys], v[:, keys], causal)
        ok &= _check(f"varlen {str(dtype)[6:]} causal={causal} sequence {b} (n_q = {n_q[b]}, n_k = {n_k[b]})",
                     O[:, rows], ref, 1e-5 if dtype == torch.float32 else 2e-2)
    return ok


def main(argv=None) -> int:
    import torch

    import kernels_gpu.runtime as rt
    rt.poison_outputs = True
    ok = decode_case(torch.float16, paged=True, N_new=1, num_splits=3, seed=0)
    ok &= decode_case(torch.bfloat16, paged=False, N_new=2, num_splits=1, seed=1)
    ok &= decode_case(torch.float32, paged=True, N_new=1, num_splits=None, seed=2)
    ok &= decode_case(torch.float16, paged=True, N_new=1, num_splits=3, seed=5, kernel="cuda_core")
    ok &= decode_case(torch.float16, paged=False, N_new=3, num_splits=None, seed=6)
    # the tensor-core program's other ways of copying whole tiles (decode_tc.COPY; the default: tensor copies)
    from kernels_gpu.inference import decode, decode_tc
    default = decode_tc.COPY
    try:
        for i, copy in enumerate(("bulk", "cp.async")):
            decode_tc.COPY = copy
            decode._PLANS.clear()
            ok &= decode_case(torch.float16, paged=True, N_new=1, num_splits=3, seed=7 + 2 * i)
            ok &= decode_case(torch.bfloat16, paged=False, N_new=2, num_splits=None, seed=8 + 2 * i)
    finally:
        decode_tc.COPY = default
        decode._PLANS.clear()
    # the splits merged by the merge launch instead of inside their thread-block cluster (the default where it fits)
    try:
        decode.CLUSTER_MERGE = False
        ok &= decode_case(torch.float16, paged=True, N_new=1, num_splits=3, seed=11)
    finally:
        decode.CLUSTER_MERGE = True
        decode._PLANS.clear()
    ok &= varlen_case(torch.float16, causal=True, seed=3)
    ok &= varlen_case(torch.float32, causal=False, seed=4)
    print("all ok" if ok else "SOME RESULTS WRONG", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
