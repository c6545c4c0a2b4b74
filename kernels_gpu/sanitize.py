"""Launch every kernel once on a small ragged problem, for NVIDIA's compute-sanitizer (and as a GPU smoke test).

Run on the GPU machine from the repository root::

    compute-sanitizer --tool memcheck  --error-exitcode 1 python -m kernels_gpu.sanitize
    compute-sanitizer --tool racecheck --error-exitcode 1 python -m kernels_gpu.sanitize
    compute-sanitizer --tool synccheck --error-exitcode 1 python -m kernels_gpu.sanitize
    compute-sanitizer --tool initcheck --error-exitcode 1 python -m kernels_gpu.sanitize

memcheck finds out-of-bounds and misaligned global accesses (the ragged edges: N_q, N_k and d divide no block size
here), racecheck finds shared-memory hazards (a missing ``cuda.syncthreads``), synccheck barriers inside divergent
code, initcheck reads of global memory nothing wrote. The problem is GQA (4 query heads on 2 K/V heads), with
N_q < N_k and N_q > N_k (fully masked rows when causal), causal on and off, small and default tiles. Every result is
also checked against the float64 oracle, so a clean sanitizer run is a correct run too. ``--quick`` runs one
configuration only (the sanitizer slows kernels down by orders of magnitude); ``--fast`` adds the numbered fast FA2
forward and backward versions of :mod:`kernels_gpu.fast` at d = 64.
"""

from __future__ import annotations

import sys

import numpy as np

import kernels_gpu
from fa2edu import attention_reference, attention_reference_backward


def _check(name: str, actual, expected, tol: float = 2e-4) -> None:
    actual = np.asarray(actual)
    finite = np.isfinite(expected)
    assert not np.isnan(actual).any(), f"{name}: NaN"
    assert (np.isinf(actual) == np.isinf(expected)).all(), f"{name}: infinities differ from the oracle"
    err = float(np.max(np.abs(actual[finite] - expected[finite]), initial=0.0))
    scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    assert err <= tol * scale, f"{name}: max error {err:.2e}"


def run(N_q: int, N_k: int, causal: bool, block_sizes, seed: int = 0) -> None:
    """Every public kernel once on (B, H_q, H_kv, d, d_v) = (2, 4, 2, 24, 20), compared with the oracle."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((2, 4, N_q, 24)).astype(np.float32)
    K = rng.standard_normal((2, 2, N_k, 24)).astype(np.float32)
    V = rng.standard_normal((2, 2, N_k, 20)).astype(np.float32)
    dO = rng.standard_normal((2, 4, N_q, 20)).astype(np.float32)
    O_ref, L_ref = attention_reference(Q, K, V, causal=causal)
    grads_ref = attention_reference_backward(Q, K, V, dO, causal=causal)
    fwd_bs, bwd_bs = block_sizes

    std = kernels_gpu.standard_attention(Q, K, V, causal=causal)
    _check("standard O", std.O, O_ref)
    for name, g, e in zip(("dQ", "dK", "dV"), kernels_gpu.standard_attention_backward(Q, K, V, std.P, dO,
                                                                                      causal=causal), grads_ref):
        _check(f"standard {name}", g, e)
    fa1 = kernels_gpu.flash1_forward(Q, K, V, block_sizes=fwd_bs, causal=causal)
    _check("flash1 O", fa1.O, O_ref)
    fa2 = kernels_gpu.flash2_forward(Q, K, V, block_sizes=fwd_bs, causal=causal)
    _check("flash2 O", fa2.O, O_ref)
    _check("flash2 L", fa2.L, L_ref)
    for deterministic in (False, True):
        grads = kernels_gpu.flash2_backward(Q, K, V, fa2.O, fa2.L, dO, block_sizes=bwd_bs, causal=causal,
                                            deterministic=deterministic)
        for name, g, e in zip(("dQ", "dK", "dV"), grads, grads_ref):
            _check(f"flash2 backward {name} (deterministic={deterministic})", g, e)


def run_fast(N_q: int, N_k: int, causal: bool, seed: int = 1) -> None:
    """Every numbered fast FA2 forward and backward (kernels_gpu.fast) once at d = 64 with ragged N, GQA, against
    the oracle (the backward fed with the last forward's O and L)."""
    from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS

    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((1, 4, N_q, 64)).astype(np.float32)
    K = rng.standard_normal((1, 2, N_k, 64)).astype(np.float32)
    V = rng.standard_normal((1, 2, N_k, 64)).astype(np.float32)
    O_ref, L_ref = attention_reference(Q, K, V, causal=causal)
    for version, forward in VERSIONS.items():
        O, L = forward(Q, K, V, causal=causal)
        _check(f"fast {version} O", O, O_ref)
        _check(f"fast {version} L", L, L_ref)
    dO = rng.standard_normal(O_ref.shape).astype(np.float32)
    grads_ref = attention_reference_backward(Q, K, V, dO, causal=causal)
    for version, backward in BACKWARD_VERSIONS.items():
        grads = backward(Q, K, V, np.asarray(O), np.asarray(L), dO, causal=causal)
        for name, g, e in zip(("dQ", "dK", "dV"), grads, grads_ref):
            _check(f"fast backward {version} {name}", g, e)
        # float16 storage (fp32 arithmetic): the same kernels compiled for float16 arguments
        grads16 = backward(Q, K, V, np.asarray(O), np.asarray(L), dO, causal=causal, storage="float16")
        for name, g, e in zip(("dQ", "dK", "dV"), grads16, grads_ref):
            _check(f"fast backward {version} {name} (float16 storage)", np.asarray(g, np.float32), e, tol=3e-2)
    newest = list(VERSIONS)[-1]
    O16, L16 = VERSIONS[newest](Q, K, V, causal=causal, storage="float16")
    _check(f"fast {newest} O (float16 storage)", np.asarray(O16, np.float32), O_ref, tol=1e-2)
    # d = 128: the newest version's own tiling there (more threads per row, dynamic shared memory)
    Q2, K2, V2 = (rng.standard_normal(x.shape[:-1] + (128,)).astype(np.float32) for x in (Q, K, V))
    O2_ref, L2_ref = attention_reference(Q2, K2, V2, causal=causal)
    O2, L2 = VERSIONS[newest](Q2, K2, V2, causal=causal)
    _check(f"fast {newest} O (d = 128)", O2, O2_ref)
    _check(f"fast {newest} L (d = 128)", L2, L2_ref)
    # v7's split launch (pieces over ranges of K/V tiles, then the merge), forced by planning for 3 resident blocks
    Kl, Vl = (rng.standard_normal((1, 2, 4 * N_k, 64)).astype(np.float32) for _ in range(2))
    Ol_ref, Ll_ref = attention_reference(Q, Kl, Vl)
    Ol, Ll = VERSIONS["v7"](Q, Kl, Vl, slots=3)
    _check("fast v7 O (split launch)", Ol, Ol_ref)
    _check("fast v7 L (split launch)", Ll, Ll_ref)
    # v8 planned for 3 resident blocks (6 whole items, 2 in 3 ranges) and for 7 (7 whole, 1 in 7 ranges)
    for slots in (3, 7):
        Ol, Ll = VERSIONS["v8"](Q, Kl, Vl, slots=slots)
        _check(f"fast v8 O (stream-K on {slots} blocks)", Ol, Ol_ref)
        _check(f"fast v8 L (stream-K on {slots} blocks)", Ll, Ll_ref)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configs = [(37, 53, True, ((16, 8), (8, 16))), (53, 37, True, (None, None)), (53, 37, False, ((16, 8), (8, 16))),
               (37, 53, False, (None, None))]
    if "--quick" in argv:
        configs = configs[:1]
    for N_q, N_k, causal, block_sizes in configs:
        run(N_q, N_k, causal, block_sizes)
        print(f"ok: N_q={N_q} N_k={N_k} causal={causal} block_sizes={block_sizes}")
    if "--fast" in argv:
        for N_q, N_k, causal in [(100, 77, True), (77, 100, False)]:
            run_fast(N_q, N_k, causal)
            print(f"ok: fast versions, N_q={N_q} N_k={N_k} causal={causal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
