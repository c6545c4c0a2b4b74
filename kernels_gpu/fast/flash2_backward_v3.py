"""Fast FA2 backward, version 3: dQ's atomic additions four floats at a time (v2 + one change).

**Why.** Column blocks j run concurrently and all add into the same rows of dQ (FA2 Alg. 2 line 15), so v1 and v2
add their τ dS K_j into HBM with ``cuda.atomic.add``: one ``RED.ADD.F32`` per float. Per (batch, head) that is
T_c·N_q·d reductions (T_c = ⌈N_k / B_c⌉): at batch 8, 16 heads, N = 2048, d = 128 and B_c = 64, 1.07·10⁹ of them
per backward call, each one L2 operation, against 25 ms of arithmetic. Each thread's share of a row of dQ is
already in chunks of four consecutive floats (columns 4·tx + 4·NX·q + e, e = 0 … 3: the layout the forward's
16-byte loads use), and Hopper (PTX ISA 8.1, sm_90) has a vector form of the reduction: ``red.global.add.v4.f32``
adds four consecutive floats by one instruction (:func:`kernels_gpu.ptx.red_add_v4_f32`).

**What changes.** The four reductions of a chunk become one vector reduction: a quarter of the instructions and
of the requests the L2 serves for dQ. Each of the four additions is still atomic on its own (as the scalar ones
were), so the sums are the same sums in an order that, as before, depends on which column block comes first:
float32 rounding apart, dQ is v2's. Everything else — tiles, D's pass (v2's warp per row), the launches — is
v2's (:func:`~kernels_gpu.fast.flash2_backward_v1.run_backward` with ``vector_red=True``). The address of each
chunk is a multiple of 16 bytes because d is a multiple of 4·NX (the tilings' rule, :func:`check_tiling`).

Cost per (batch, head): v2's FLOPs and bytes; T_c·N_q·d / 4 reduction instructions instead of T_c·N_q·d.

**Prediction (written before the GPU run).** If the L2's reduction throughput is what the scalar atomics wait on,
the main kernel gets faster by up to the share of its time they take — at most about a third (25.1 ms → 17-22 ms at
d = 128, batch 8, 16 heads, N = 2048, float32); if the FFMA work hides them, within ±2 %. Nsight Compute on v2's
main kernel beside the timing (L2 throughput, the lg-throttle stall) decides which.

**Measured** (H100 80GB HBM3, 2026-11-26, ``python -m benchmarks.fast_backward --d 128,64 --N 2048,4096 --causal
0,1 --impls v2,v3,sdpa_efficient``, ``fast_backward_v3_ab.json``; every variant checked against the float64 oracle
first; TFLOP/s by the FA2 model, batch × N = 16k tokens, 2048 = heads × d). d = 128: v2 27.10 / 27.75 → v3 29.48 /
30.21 non-causal (N = 2048 / 4096), 25.34 / 27.01 → 27.42 / 29.31 causal: 8-9 % faster (the main kernel 25.4 →
23.3 ms at N = 2048); d = 64: 30.56 / 30.97 → 31.53 / 31.96, causal 28.37 / 29.56 → 29.32 / 30.70 (3-4 %). SDPA's
memory-efficient float32 backward in the same run: 35.68 / 36.41 and 32.53 / 35.03 at d = 128, 34.35 / 35.31 and
31.85 / 33.29 at d = 64. Neither branch of the prediction: 8 %, between "within ±2 %" and "up to a third". Nsight
Compute on v2's main kernel (``ncu_fast_bwd_v2_d128.txt``, 25.11 ms) had the L2 at 21.6 % of its throughput, so
the scalar reductions did not saturate it; they cost issue slots and load/store queue entries in a kernel that
issues in only 58 % of its cycles (FMA pipe 44 %, two warps per scheduler, 0.93 eligible). GPU tests
(``gpu_tests_fast_backward_v3.log``: v3 against the float64 oracle at d = 64 and 128, causal and not, N_q ≠ N_k,
and float16 storage): 8 passed; compute-sanitizer memcheck of ``benchmarks.fast_backward.sanitize`` (every
version, ``sanitizer_fast_backward_v3_memcheck.log``): 0 errors. In the PyTorch op (``python -m
benchmarks.gpt_speed``, ``gpt_speed.json``; the run with v2: ``gpt_speed_fast_bwd_v2.json``): float32 forward +
backward at d = 128 0.83× / 0.85× SDPA's memory-efficient kernel (non-causal / causal; 0.79 / 0.81 with v2),
0.94 / 0.97 at d = 64 — the 0.9 target still missed at d = 128.

**Tried after v3, not kept: the products software-pipelined.** v3's stall samples per SASS loop
(``ncu_fast_bwd_v3_d128_stalls.txt``; ``python -m benchmarks.profilers.profile_fast --loops`` on the source page:
``ncu_fast_bwd_v3_d128_loops.txt``): 96 % of them in the four inner loops (S, dP, the dK/dV update, dQ), each in
proportion to its FFMAs, and in each the short scoreboard (an FFMA waiting for its ``LDS.128``) is 15-27 % of the
loop's samples. So every loop was unrolled by two steps with the next step's operands loaded into a second set of
registers before the current step's FFMAs (255 registers at d = 128, 12 bytes spilled outside the loops;
prediction: 1.1-1.2× faster). Measured (``fast_backward_v4_ab.json``): *slower* — d = 128 29.46 → 27.74 TFLOP/s
(N = 2048, non-causal; −6 % at every point), d = 64 31.6 → 27.0 (684 bytes spilled under the cap of 168; 27.8
uncapped). Nsight Compute (``ncu_fast_bwd_v4_d128.txt``): the main kernel 24.56 ms, short-scoreboard samples
only 13 % fewer (535 k → 468 k) while fixed-latency waits rose 296 k → 408 k and dispatch stalls 252 k → 315 k —
the loads were not waiting on latency alone but on the shared-memory pipe (about 1.7 k wavefronts per warp and
tile against 10 k FFMAs; L1 62 % busy in v2), which issuing them earlier does not widen. Reverted; what would
widen it is fewer shared-memory loads per FFMA (larger register tiles, which 255 registers do not leave room for)
or tensor cores.

**Tried after v3, not kept: warps of 4 × 8 threads.** Fewer wavefronts for the same loads instead: with
t = ty·NX + tx a warp is 2 rows × 16 columns of the thread grid, so a load picked by tx (rows of K_j, V_j; columns
4·tx + … of dO_i, Q_i, K_j) touches 16 distinct 16-byte chunks, two wavefronts; as a 4 × 8 patch (lane ℓ at row
ℓ // 8, column ℓ % 8 of its warp's patch) one, and a ty-picked load 4 chunks instead of 2, still one — about 35 %
fewer wavefronts per tile, the same loads, FFMAs, registers (255 / 168, no spill) and sums (dK, dV bit for bit
v3's in the simulator). Prediction: 1.15-1.3× faster if the shared-memory pipe binds. Measured
(``fast_backward_v4_warp_tiles_ab.json``, v3 beside it): d = 128 29.47 / 30.42 → 28.99 / 29.88 TFLOP/s
non-causal, 27.42 / 29.32 → 26.97 / 28.80 causal (1.6-1.8 % slower), d = 64 0.6-1.5 % faster. Neither the
loads' latency nor the pipe's wavefronts is what holds this kernel at 44 % of the FMA pipe; with two warps per
scheduler, what is left is issue itself: each scheduler has 0.93 eligible warps per cycle, and the next lever is
more of them, which 255 registers and 167 KiB of shared memory per 256-thread block rule out. Reverted.
"""

from __future__ import annotations

from kernels_gpu.fast import flash2_backward_v1 as v1
from kernels_gpu.fast.flash2_backward_v2 import warp_preprocess
from kernels_gpu.flash2 import Flash2Backward

__all__ = ["flash2_backward"]


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, tiling=None, max_registers=None,
                    storage="float32") -> Flash2Backward:
    """FA2 backward (Alg. 2), fast version 3: v2 (:func:`kernels_gpu.fast.flash2_backward_v2.flash2_backward`, same
    arguments, tilings and result) with dQ's additions into HBM by ``red.global.add.v4.f32``, four floats each.
    Cost per (batch, head), N_q = N_k = N, not causal: 10·N²·d FLOPs; T_c·N·d / 4 vector reductions into dQ."""
    return v1.run_backward(Q, K, V, O, L, dO, causal, scale, tiling, max_registers, storage, warp_preprocess,
                           vector_red=True)
