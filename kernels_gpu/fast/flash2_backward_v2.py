"""Fast FA2 backward, version 2: D = rowsum(dO ∘ O) by a warp per row (v1 + one change).

**Why.** Before its main kernel the backward computes D_i = rowsum(dO_i ∘ O_i) (FA2 Alg. 2 line 4), one float per
query row. v1 takes the teaching kernel's pass for it (:func:`kernels_gpu.flash2.preprocess_kernel`): one thread
per row, each walking its row's d_v elements of O and dO. Neighbouring threads then read addresses d_v floats
apart, so every load instruction of a warp touches 32 different 128-byte lines and uses 4 bytes of each. PyTorch's
profiler on the op (``benchmarks/results/nvidia-h100/op_kernels_float32.json``, ``python -m
benchmarks.profilers.op_kernels``; batch 8, 16 heads, N = 2048, d = 128, float32) times that pass at 0.59-0.61 ms per
call: 268 MB of O and dO at 0.45 TB/s, 1.8 % of the op's forward + backward, on a GPU that copies at 3.0 TB/s (device to
device, measured in
``decode.json``).

**What changes.** :func:`preprocess_rows_kernel`: a warp per row. Lane ℓ reads columns ℓ, ℓ + 32, … of the row
(a warp's load is one contiguous 128-byte line of O and one of dO), multiplies and adds in float32 (loads are
converted, so float16 storage still multiplies in float32), and the 32 partial sums meet by five butterfly shuffles
(``shfl_xor``); lane 0 writes D_i. The main kernel, its tiles and every other launch are v1's
(:func:`~kernels_gpu.fast.flash2_backward_v1.run_backward`). D is summed in another order, so the gradients differ
from v1's by float32 rounding, not more.

Cost per (batch, head): reads 2·N·d_v floats, writes N (as v1's pass); now at the bandwidth of coalesced loads.

**Prediction (written before the GPU run).** The pass reads 268 MB at d = 128 (batch 8, 16 heads, N = 2048): at
2-3 TB/s, 0.09-0.13 ms instead of 0.59, so about 0.5 ms less per op call at d = 128 and d = 64 alike (the bytes
are the same: heads × d is fixed), −1.5 % of the op's time, nothing else changed.

**Measured** (H100 80GB HBM3, 2026-11-26, ``python -m benchmarks.profilers.op_kernels --dtype float32``, the op through
v1 in ``op_kernels_float32.json`` and through v2 in ``op_kernels_float32_bwd_v2.json``, two machines of one kind).
The D pass: 0.115 ms at d = 128 (v1's 0.593-0.610), inside the prediction; 0.160-0.167 ms at d = 64 (v1's 0.66), above
it — a row of 64 floats gives each warp two 128-byte loads per tensor, so the fixed cost per row (the five shuffles, the
store) is likely to weigh twice as much (not profiled). The op's GPU time per call at d = 128: 32.76 → 32.25 ms
non-causal, 18.06 → 17.57 ms causal (−1.5 %, −2.7 %); in ``python -m benchmarks.gpt_speed`` (``gpt_speed.json``) the
float32 op is 0.78-0.80× SDPA's memory-efficient kernel at d = 128 (0.77-0.78 with v1, ``gpt_speed_fast_bwd_v1.json``)
and 0.92-0.95× at d = 64. GPU tests (``gpu_tests_fast_backward_v2.log``: v1 and v2 against the float64 oracle, float16
storage): 12 passed; compute-sanitizer memcheck of ``benchmarks.fast_backward.sanitize`` (both versions,
``sanitizer_fast_backward_v2_memcheck.log``): 0 errors. What binds the float32 backward at d = 128 is its main kernel
(25.1 ms against SDPA's 18.7: SDPA's memory-efficient kernel multiplies float32 on tensor cores, as three TF32
products), and no other tile shape of v1 does better (``fast_backward_v1_d128_explore.json``).
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from kernels_gpu import runtime as rt
from kernels_gpu.fast import flash2_backward_v1 as v1
from kernels_gpu.flash2 import Flash2Backward

__all__ = ["flash2_backward", "preprocess_rows_kernel", "warp_preprocess", "WARPS"]

#: rows (warps) per block of the D pass
WARPS = 8


@functools.lru_cache(maxsize=None)
def preprocess_rows_kernel(d_v: int, warps: int = WARPS, simulator: bool = False):
    """FA2 Alg. 2 line 4, D = rowsum(dO ∘ O): a warp per row, ``warps`` rows per block; loads converted to float32.
    Grid (⌈N_q / warps⌉, Z, H_q), ``32·warps`` threads. ``simulator``: numba's simulator has no warp shuffles, so
    there the butterfly exchanges through shared memory between barriers (same sums, same order)."""

    @cuda.jit
    def flash2_backward_preprocess_rows(O, dO, D):
        z = cuda.blockIdx.y
        h = cuda.blockIdx.z
        t = cuda.threadIdx.x
        lane = t % 32
        row = cuda.blockIdx.x * warps + t // 32
        # Alg. 2 line 4: lane ℓ's share of rowsum(dO_i ∘ O_i), columns ℓ, ℓ + 32, … (one 128-byte line of each
        # per step of the warp); a warp past the last row adds nothing but still takes part in the exchange.
        acc = float32(0.0)
        if row < O.shape[2]:
            for k in range(lane, d_v, 32):
                acc += float32(dO[z, h, row, k]) * float32(O[z, h, row, k])
        # The 32 partial sums, added by a butterfly: after it every lane holds the row's total.
        width = 16
        if simulator:
            scratch = cuda.shared.array(32 * warps, float32)
            while width > 0:
                scratch[t] = acc
                cuda.syncthreads()
                acc += scratch[t ^ width]
                cuda.syncthreads()
                width //= 2
        else:
            while width > 0:
                acc += cuda.shfl_xor_sync(0xFFFFFFFF, acc, width)
                width //= 2
        if row < O.shape[2] and lane == 0:
            D[z, h, row] = acc

    return flash2_backward_preprocess_rows


def warp_preprocess(O4, dO4, D, d_v: int) -> None:
    """Alg. 2 line 4 into D (Z, H_q, N_q) by :func:`preprocess_rows_kernel` (the launch v2 hands to v1's body)."""
    Z, H_q, N_q = D.shape
    kernel = preprocess_rows_kernel(d_v, WARPS, rt.simulator_in_use())
    kernel[(rt.grid_size(N_q, WARPS), Z, H_q), 32 * WARPS](O4, dO4, D)


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, tiling=None, max_registers=None,
                    storage="float32") -> Flash2Backward:
    """FA2 backward (Alg. 2), fast version 2: v1 (:func:`kernels_gpu.fast.flash2_backward_v1.flash2_backward`, same
    arguments, tilings and result) with D = rowsum(dO ∘ O) computed by a warp per row."""
    return v1.run_backward(Q, K, V, O, L, dO, causal, scale, tiling, max_registers, storage, warp_preprocess)
