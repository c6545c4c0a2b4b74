"""Fast FA2 backward, version 4: S rounded as the forward rounds it (v3 + one change, for accuracy, not speed).

**Why.** The backward does not store P: it recomputes P = exp2(S₂ − L·log₂e) from the forward's L (FA2 Alg. 2
line 11), with S₂ = τ·log₂e·Q Kᵀ. That is exact only if the backward's S₂ is the S₂ the forward normalised. The
fast forward (:mod:`kernels_gpu.fast.tiled`) multiplies Q_i by τ·log₂e when it loads it and sums
S₂ = Σ_k (τ·log₂e·Q)_k K_k serially over k; v1-v3 multiply K_j instead and sum Σ_k Q_k (τ·log₂e·K)_k: the same
sum of differently rounded terms. With scores in the hundreds (inputs scaled by 4, S₂ ~ 20-30 after scaling) the
two differ by a few ulps of S₂ (2-4·10⁻⁶), so P's rows no longer sum to one by about that much, and every gradient
inherits it: in ``benchmarks.backward_accuracy``'s extreme-logit problem v3's largest dK error was 3.7× SDPA's
memory-efficient backward and its dV error 2.1× — outside flash-attn's rule (at most 2× PyTorch's own error in the
same dtype) — while at ordinary scales it was within it. A float32 emulation of both kernels' arithmetic in NumPy
(serial FMAs in the kernels' order, before any GPU run) put the whole gap on this mismatch: with K scaled,
errors of dQ, dK, dV 6.7·10⁻⁵, 7.8·10⁻⁵, 3.9·10⁻⁵ (scale 4, d = 64, N = 600, causal); with Q scaled as the
forward does 6.2·10⁻⁵, 5.1·10⁻⁵, 2.1·10⁻⁵, and PyTorch's float32 composite on the CPU 6.6·10⁻⁵, 6.1·10⁻⁵,
1.8·10⁻⁵; handing the backward an exactly rounded L instead of the forward's doubled the errors (the consistency
matters more than L's own accuracy).

**What changes.** K_j goes to shared memory unscaled; each Q_i is multiplied by τ·log₂e in registers (the same
float32 product as the forward's) just before it is stored to shared memory, once per step. The S₂ loop is
unchanged — the same serial chain of FMAs over k as the forward's — so S₂ is the forward's bit for bit, and
P = exp2(S₂ − L·log₂e) rounds only in L's conversion and the exponential. The factors move: dQ's product
dS K_j (K unscaled) is multiplied by τ, and dK_j = Σ dSᵀ (τ·log₂e·Q_i) by ln 2 (τ / (τ·log₂e)). Everything else is
v3's (:func:`~kernels_gpu.fast.flash2_backward_v1.run_backward` with ``vector_red=True, scale_q=True``).

Cost per (batch, head): v3's FLOPs, bytes and reductions, plus B_r·d multiplications per step and block (Q_i's
scaling; B_c·d fewer at the start, K_j's): under 0.5 % of a step's 5·B_r·B_c·d FFMAs at B_c = 64.

**Prediction (written before the GPU run).** Speed: v3's within ±1 % (the same loops, registers within a few).
Accuracy: on the extreme-logit problem, with O and L from the op's fast forward, dK and dV errors within 2× of
SDPA's memory-efficient backward (v3: 3.7× and 2.1×); at ordinary scales unchanged.

**Measured** (H200, 2026-11-27; every variant checked against the float64 oracle first). Speed (``python -m
benchmarks.fast_backward --d 128,64 --N 2048,4096 --causal 0,1 --impls v3,v4,sdpa_efficient``,
``fast_backward_v4_ab.json``), TFLOP/s v3 → v4: d = 128 29.63 → 29.74 and 30.34 → 30.37 (N = 2048 / 4096), causal 27.48
→ 27.74 and 29.35 → 29.50; d = 64 31.55 → 31.54, 31.97 → 31.93, causal 29.06 → 29.11, 30.34 → 30.27: within ±1 %
(prediction held). SDPA's memory-efficient backward in the same run: 33.5-37.0. Accuracy (``python -m
benchmarks.backward_accuracy``, ``fast_backward_v4_extreme_logits.log``; largest errors of dQ, dK, dV with O and L from
the op's fast forward, GQA 2:1, N = 600, causal): scale 4, d = 64: v3 1.45e-4, 2.04e-4, 7.15e-5 → v4 1.38e-4, 1.42e-4,
3.11e-5, against SDPA memory-efficient 6.36e-5, 5.52e-5, 3.37e-5 and SDPA's math backend (flash-attn's own reference:
the composite formula) 1.42e-4, 9.32e-5, 2.25e-5; scale 4, d = 128: v3 1.66e-4, 9.28e-5, 6.27e-5 → v4 1.66e-4, 9.23e-5,
3.61e-5 (memory-efficient 1.16e-4, 6.41e-5, 3.03e-5). dV's error halved, as the emulation said; against the math backend
every gradient is now within 2× (v3: dK 2.2×, dV 3.2× at d = 64), against the memory-efficient kernel all but dK and dQ
at d = 64 (2.6× and 2.2×: the prediction held for dV, not for dK). What is left there is not P: in the emulation neither
P's consistency nor dK's sum over rows (staged per row block: no change) moves dK; it is dS = P ∘ (dP − D), whose
dominant entries cancel, computed from serial float32 dot products (the likeliest difference from the memory-efficient
kernel, whose tensor cores sum eight products per step; not measured here). GPU tests
(``gpu_tests_fast_backward_v4.log``: v3 and v4 against the oracle at N in the thousands; the op's float32 path against
SDPA, with extreme logits at d = 64 and 128 by flash-attn's rule with float32's 2⁻²⁰ floor): 15 passed; then everything
float32 of the op's GPU tests (odd head sizes 1 … 256 through the wide tilings, opcheck, ``torch.compile``, streams,
``return_lse``, the 16-bit backwards' float32 fallback), every fast backward version against the oracle, float16 storage
bit for bit and the context-parallel benchmark's single-GPU run (``gpu_tests_fast_backward_v4_op.log``): 45 passed.
compute-sanitizer memcheck and racecheck of ``benchmarks.fast_backward.sanitize(["v4"])``
(``sanitizer_fast_backward_v4_*.log``): 0 errors, 0 hazards. The op (``python -m benchmarks.gpt_speed --skip-training
--micro-dtypes float32``, ``gpt_speed_op_float32_fast_v4.json``) runs v4: float32 forward + backward 0.92× / 0.93× SDPA
at d = 64, 0.83× / 0.84× at d = 128, as with v3.

**Tried on v4, not kept: 512 threads at d = 128.** v3's profile asked for more warps per scheduler; 16 warps fit an
SM in one block of 512 threads at 128 registers each, tiling (32, 16, 2, 4) (B_r = B_c = 64, as the default; each
thread 2 × 4 scores and 2 rows of dK_j, dV_j instead of 4 × 4 and 4). Prediction (before the run): slower by
10-25 %, because a thread's smaller tile needs more shared-memory loads per FFMA — in the S and dP loops 10
wavefronts per 32 FFMAs per warp against 12 per 64, in the dK/dV loop about twice as many — and v3's L1 was already
62 % busy: the shared-memory pipe would bind before the extra warps help. Measured (H200, d = 128, N = 2048, not
causal, ``fast_backward_v4_512_threads.json``): 23.24 TFLOP/s against the default's 29.71 (−22 %); without the cap
ptxas takes more than 128 registers and the launch fails (out of resources). Kept as it was.
"""

from __future__ import annotations

from kernels_gpu.fast import flash2_backward_v1 as v1
from kernels_gpu.fast.flash2_backward_v2 import warp_preprocess
from kernels_gpu.flash2 import Flash2Backward

__all__ = ["flash2_backward"]


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, tiling=None, max_registers=None,
                    storage="float32") -> Flash2Backward:
    """FA2 backward (Alg. 2), fast version 4: v3 (:func:`kernels_gpu.fast.flash2_backward_v3.flash2_backward`, same
    arguments, tilings and result) with τ·log₂e on Q_i instead of K_j, so that the recomputed S₂ is the fast
    forward's bit for bit and P = exp(S − L) is consistent with its L. Cost per (batch, head), N_q = N_k = N, not
    causal: 10·N²·d FLOPs; T_c·N·d / 4 vector reductions into dQ."""
    return v1.run_backward(Q, K, V, O, L, dO, causal, scale, tiling, max_registers, storage, warp_preprocess,
                           vector_red=True, scale_q=True)
