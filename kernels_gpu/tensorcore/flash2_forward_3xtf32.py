"""Tensor-core FA2 forward in **3xTF32** for float32 inputs: float32's accuracy from tf32 tensor cores, three MMAs per
product (the TF32 rung, :mod:`~kernels_gpu.tensorcore.flash2_forward_tf32`, + one change).

**Why.** PyTorch's SDPA "memory-efficient" backend, the float32 baseline of ``fa2edu.torch.flash_attention``, is not a
CUDA-core kernel on sm_80 and later: its CUTLASS GEMMs for float32 (``DefaultGemmType<ArchTag, float>`` in
PyTorch's ``mem_eff_attention/gemm_kernel_utils.h``) are ``OpClassTensorOp`` with instruction shape 16 × 8 × 8 and
``OpMultiplyAddFastF32`` — CUTLASS's 3xTF32, the trick of this file. That is how it runs at 42-46 TFLOP/s forward at
d = 128 (GPU.md), where cuBLAS's float32 GEMM on the FMA units makes 50.8 and kernels_gpu.fast's float32 forward
36-40. This rung does the same on the MMAs fa2edu already issues, to measure what it buys here.

**The split.** Every float32 operand x becomes two tf32 values (:func:`kernels_gpu.ptx.split_tf32`):
big = x rounded to tf32 (``cvt.rna``: 10 mantissa bits, ``|x − big| ≤ u·|x|`` with u = 2⁻¹¹) and small = (x − big)
rounded to tf32 (x − big is exact in float32; ``|x − big − small| ≤ u²·|x| = 2⁻²²·|x|``). A product of two operands is
then

    a·b ≈ a_small·b_big + a_big·b_small + a_big·b_big

three ``mma.m16n8k8`` with float32 accumulation, the small terms first (added while the accumulator is small).
What is left out: a_small·b_small (``≤ u²·|a·b|·(1 + u)²``) and the residuals of the splits (``≤ u²·|a·b|``
each side), so every product is off by at most ε = 3u²(1 + u)² ≈ 7.2e-7 of its size — about 12 of float32's unit
roundoffs, where TF32 is off by 2u ≈ 1e-3 (8200 of them). Accumulated over d products, float32's own summation error
(up to d roundoffs of the running sum) is of the same size: this is float32 accuracy, not TF32's
(:func:`error_bound` states it; appendix 12, the lab notebook of chapter 12, shows the arithmetic in NumPy).

**What changes against the TF32 rung:** only the operands and the product (``TF32Config.products = 3``: the same
tiles, copies, online softmax and key order); each operand register that was ``cvt(ld.shared)`` is now
``split(ld.shared)`` — two tf32 registers, four instructions (cvt, and, sub, cvt) instead of one — and each MMA is
three. Both products of Alg. 1 are split, S = Q_i K_jᵀ (line 8) and Õ += P̃_ij V_j (line 10), with P̃ split from its
float32 accumulators. Cost: the TF32 rung's HBM traffic and shared memory; 3× its MMAs; per warp and K/V tile at
d = 128 (B_c = 32), ~2050 instructions in the two product loops where TF32 issues ~790.

**Prediction** (written before the first GPU run). The TF32 rung ran at 43.9 / 47.4 TFLOP/s at d = 128 (N = 4096 /
16384) and 38.7 / 46.6 at d = 64 with one MMA per product. With 2.6× its instructions in the product loops and 3×
its MMAs, if the time follows the instructions: ~17-18 TFLOP/s at d = 128; if part of the TF32 rung's time was
latency that the extra independent instructions fill: up to ~29. So **17-29 TFLOP/s at d = 128 and 64** —
*slower* than kernels_gpu.fast's float32 forward (36-40) and SDPA memory-efficient (42-46): the split done per
warp and per use is the cost to remove next (split each K/V tile once per block into big and small planes in
shared memory, fed to the MMAs by ``ldmatrix``, as CUTLASS splits once per fragment). Error against float64: within
2× of SDPA memory-efficient float32's at the same shape (flash-attn's rule), ~1e-6 at N = 2048.

**What SDPA runs, measured first** (H200, 2026-11-26; ``ncu … python -m benchmarks.profilers.sdpa_fp32_pipes``,
``benchmarks/results/nvidia-h200/ncu_sdpa_fp32_pipes.txt``; batch 8, 16 heads, N = 2048, d = 128, PyTorch's TF32
switch off): the float32 forward kernel ``fmha_cutlassF_f32_aligned_64x128_rf_sm80`` issues 402,653,184
tensor-core MMAs and the backward 1,006,632,960 — exactly 3 × (the FA2 model's FLOPs) / 2048 for each: every float32
product of PyTorch's memory-efficient attention is three tf32 MMAs. The float32 target of
``fa2edu.torch.flash_attention`` (≥ 0.9× this backend) compares kernels_gpu.fast's FMA-unit kernels with a
tensor-core kernel.

**Measured** (H200, 2026-11-26, ``python -m benchmarks.profilers.tensorcore_variants --parts precision``; batch × N =
16k tokens, non-causal, TFLOP/s by the FA2 model; error: largest ``|O − O_float64|`` at N = 2048, batch 1):

* **first form, one accumulator chain** (``tensorcore_3xtf32_unstaged.json``, the TF32 rung, kernels_gpu.fast and
  SDPA in the same run): d = 128 21.1 / 21.8 / 22.4 TFLOP/s at N = 2048 / 4096 / 16384, d = 64 25.3 / 26.6 / 27.4
  — inside the predicted 17-29; TF32 41.2-46.5 and 43.2-48.5, kernels_gpu.fast 31.5-38.8 and 31.2-34.7, SDPA
  memory-efficient 44.7-46.1 and 34.6-35.1. But the error missed: 1.1e-5 at d = 128 and 7.3e-6 at d = 64, against
  SDPA's 5.5e-7 and 5.3e-7 and kernels_gpu.fast's 1.0e-6 and 6.4e-7 — within :func:`error_bound` (a worst case)
  but 20× SDPA's, and flash-attn's rule failed on 3 of the GPU tests' 5 shapes (5.4e-6 against 2 × 9.6e-7 + 2⁻²⁰:
  ``tensorcore_3xtf32_unstaged_tests.log``). The cause is the accumulation, not the split: the tensor core adds
  an MMA's products into its float32 accumulator with truncation, so the 3·d/8 MMAs of an S element and the 3·N_k/8
  of an Õ element drift one way; CUTLASS's 3xTF32 GEMMs stage their sums for that reason;
* **staged** (``TF32Config.products = 3`` now accumulates each group of four k-steps of S and each tile's P̃V in
  zeroed registers, added by float32 additions: ``tensorcore_3xtf32.json``): error 5.5e-7 at d = 128 and 3.7e-7 at
  d = 64 (SDPA in the same run 5.5e-7 and 5.3e-7) — float32's accuracy; speed 25.3 / 27.7 TFLOP/s at d = 128
  (N = 2048 / 16384), faster than the first form (the staged chains are 12 MMAs long instead of 48 and 384: more
  of them in flight), and 25.7 / 27.9 at d = 64; SDPA memory-efficient 45.4 / 44.5 and 35.4 / 35.6. GPU tests
  (``gpu_tests_tensorcore_3xtf32.log``: the split instruction bit for bit against its twin, five shapes within
  :func:`error_bound` and flash-attn's rule against SDPA float32, extreme logits, 100 identical reruns): 8 passed.
  ptxas (``python -m kernels_gpu.tensorcore.inspect_ptx tf32 3xtf32 --dtype float32``, ``inspect_ptx_3xtf32.txt``):
  235 registers at d = 128, 155 at d = 64 (the first form: 150, 99), no spills, 204 MMAs in the unrolled loops.

So float32's accuracy on tensor cores costs this rung 1.6-1.8× SDPA's time at d = 128: the per-use split (four
instructions for every operand register, by every warp that loads it — in fact about ten on sm_90, where ptxas
expands each ``cvt.rna.tf32.f32`` into five) is what SDPA's kernel does not pay. Since ``split_tf32`` rounds on the
bits (two instructions per rounding; :mod:`~kernels_gpu.tensorcore.flash2_forward_3xtf32_planes`, step 2) this rung
runs at 24.8 / 26.9 / 28.6 TFLOP/s at d = 128 and 27.0 / 28.9 / 32.5 at d = 64 (N = 2048 / 4096 / 16384,
``tensorcore_3xtf32_planes.json``); the planes form, which splits each value once, is the faster 3xTF32 forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kernels_gpu.tensorcore import flash2_forward_tf32 as tf32
from kernels_gpu.tensorcore.flash2_forward_tf32 import UNIT_ROUNDOFF_FP32, UNIT_ROUNDOFF_TF32

__all__ = ["flash2_forward_3xtf32", "Flash2Forward3xTF32", "error_bound", "PRODUCT_ERROR", "config_for",
           "make_kernel", "shared_words", "PTX_SIGNATURE"]

#: the largest relative error of one 3xTF32 product against the exact product of its float32 operands:
#: 3u²(1 + u)², u = 2⁻¹¹ (the two splits' residuals and the dropped small·small term)
PRODUCT_ERROR = 3 * UNIT_ROUNDOFF_TF32 ** 2 * (1 + UNIT_ROUNDOFF_TF32) ** 2


#: the TF32 rung's kernel factory, shared-memory size and argument types (for ``inspect_ptx 3xtf32``)
make_kernel, shared_words, PTX_SIGNATURE = tf32.make_kernel, tf32.shared_words, tf32.PTX_SIGNATURE


def config_for(d: int, dtype: str, causal: bool, simulated: bool) -> tf32.TF32Config:
    """The TF32 rung's tiles (4 warps, B_c = 32 up to d = 128, 16 beyond) with three products per product."""
    return tf32.config_for(d, dtype, causal, simulated, products=3)


class Flash2Forward3xTF32(NamedTuple):
    """``(O, L)`` of the 3xTF32 forward — O float32 (…, N_q, d), L float32 (…, N_q) in natural-log units (+inf on
    rows that see no key) — computed from three tf32 products per float32 product: ``precision`` says so."""

    O: object
    L: object
    precision = "3xtf32"


def flash2_forward_3xtf32(Q, K, V, causal=False, scale=None) -> Flash2Forward3xTF32:
    """FA2 forward on tensor cores **in 3xTF32**: float32 Q (…, N_q, d), K, V (…, N_k, d) — NumPy arrays (float64 is
    cast to float32), numba device arrays or anything with ``__cuda_array_interface__`` such as PyTorch CUDA
    tensors (zero-copy, C-contiguous) — each matrix-product operand split into two tf32 values and each product
    made of three MMAs with float32 accumulation (float32's accuracy: :func:`error_bound`). Returns
    ``Flash2Forward3xTF32(O, L)`` (``.precision == "3xtf32"``): O float32 (…, N_q, d), L float32 (…, N_q), +inf on
    rows that see no key (O = 0 there); NumPy in → NumPy out, device in → numba device arrays out. d a multiple of 8
    up to 256, d_v = d; GQA/MQA by head mapping; ``causal``: bottom-right aligned; ``scale``: τ, default 1/√d.
    Cost: 4·N_q·N_k·d FLOPs per (batch, head) (half of it skipped when causal), issued as 3× as many tensor-core
    FLOPs; HBM reads N_q·d + 2·N_k·d·T_r floats, writes N_q·d + N_q."""
    return Flash2Forward3xTF32(*tf32.run(Q, K, V, causal, scale, products=3))



def error_bound(Q, K, V, scale=None):
    """Worst-case bounds on the 3xTF32 kernel's error against exact attention, for host arrays: ``(bound_O,
    bound_L)`` shaped like O (…, N_q, d) and L (…, N_q). With ε = :data:`PRODUCT_ERROR` (one product's relative
    error) and ``E_i = τ·max_j (ε + (3d + 2)·2⁻²⁴)·Σ_k |q_ik|·|k_jk|`` (the largest error of a scaled score: d
    products, each off by ε, accumulated by 3·d/8 MMAs in float32 — one float32 rounding of the running sum per
    product, counted generously):

    * ``|O_ic − O_ic,exact| ≤ max_j |v_jc|·(e^(2E_i)(1 + ε) − 1) + 16·2⁻²⁴·max_j |v_jc|`` — the softmax weights move
      by factors within e^(±2E_i), the products P̃V are off by ε each, the rest is float32 arithmetic;
    * ``|L_i − L_i,exact| ≤ E_i`` (plus float32's own rounding of L, the caller's to add).

    The maxima over j run over every key, masked or not, so the bounds hold for causal calls too."""
    q, k, v = tf32._heads(Q, K, V)
    d = q.shape[-1]
    tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
    reach = np.max(np.abs(q) @ np.abs(k).swapaxes(-1, -2), axis=-1)                          # (Z, H, N_q)
    score_bound = tau * (PRODUCT_ERROR + (3 * d + 2) * UNIT_ROUNDOFF_FP32) * reach            # E_i
    vmax = np.abs(v).max(axis=-2)[..., None, :]                                                # (Z, H, 1, d)
    bound_O = vmax * (np.exp(2 * score_bound)[..., None] * (1 + PRODUCT_ERROR) - 1) + 16 * UNIT_ROUNDOFF_FP32 * vmax
    lead = np.shape(Q)[:-1]
    return bound_O.reshape(lead + (d,)), score_bound.reshape(lead)
