"""Fast FA2 forward, version 3: v2 with the tile shape chosen per head dimension from measurements.

**What changed** (against v2): only the tilings (NY, NX, TR, TC), picked from the exploration run on an H200
(``benchmarks/results/nvidia-h200/fast_explore.json``, fp32, batch × N = 16k tokens, hidden 2048):

* d = 64: (16, 16, 4, 4), i.e. B_r = 64, B_c = 64, 256 threads, 4 × 4 of S and 4 × 4 of Õ per thread, 128 registers,
  67 KiB of dynamic shared memory: 17.3 TFLOP/s at N = 8192 against 16.1 for v2's (16, 8, 4, 4) (B_c = 32,
  4 × 8 of Õ, 168 registers, so 3 blocks of 4 warps per SM instead of 2 blocks of 8 warps).
* d = 128: (32, 8, 4, 4), i.e. B_r = 128, B_c = 32, 256 threads, 4 × 16 of Õ per thread (254 registers, no
  spills): 15.9 TFLOP/s at N = 8192 against 12.3 for (16, 16, 4, 4): each P̃ value read from shared memory now
  feeds 16 multiply-adds instead of 8, and each V value 4.

Tried and worse (same run): (8, 16, 8, 4) at d = 128 (7–8 TFLOP/s), (16, 16, 4, 2) at both d (B_c = 32 with
TC = 2: fewer multiply-adds per K value), (32, 8, 4, 4) at d = 64 (15.7: the extra registers cost occupancy).
What still limits it: 2 sixteen-byte shared loads per 16 FFMAs in the S loop and no software pipelining of those
loads across iterations of the d-loop (numba cannot ask for unrolling), at 8–16 resident warps per SM.
"""

from kernels_gpu.fast.tiled import Tiling, run_forward

SHUFFLE = True
TILINGS = {64: Tiling(16, 16, 4, 4), 128: Tiling(32, 8, 4, 4)}


def default_tiling(d: int) -> Tiling:
    return TILINGS[64] if d <= 64 else TILINGS[128]


def flash2_forward(Q, K, V, causal=False, scale=None, tiling=None):
    """FA2 forward (Alg. 1), fast version 3 (per-d tilings): ``Flash2Forward(O, L)``."""
    d_v = V.shape[-1]
    return run_forward(Q, K, V, tiling=tiling or default_tiling(d_v), shuffle=SHUFFLE, causal=causal, scale=scale)
