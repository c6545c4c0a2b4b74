"""Fast FA2 forward, version 4: v3 with the K_j/V_j tile loads pipelined behind the arithmetic.

**What limited v3** (read off its PTX, compiled here with numba's NVVM and ``ptxas -arch=sm_90 -v``, which gives the
same 128 / 254 registers as the device's report in ``fast_forward.json``): Alg. 1 line 7, the move of K_j and V_j
into shared memory, is a loop of ``x = 0; if col0 + c < N_k: x = K[…]; sm[…] = x``. Each load sits behind the bounds
branch and its store waits for it, so a thread's 2·B_c·d / T = 32 loads per tile (both tilings) pay the global
latency one after another while the block's S and P̃V arithmetic waits at the barrier. Counted from v3's own figure
(d = 64, N = 8192: 63.6 ms; 32 heads × 2 batches × 128 row blocks over 132 SMs × 2 resident blocks, 128 tiles each)
one tile took about 16 µs, of which the 2·B_r·B_c·d multiply-adds of both resident blocks are about 4 µs at one
FFMA per clock per SM sub-partition: the rest is mostly those serial load latencies (32 × ~0.35 µs ≈ 11 µs).

**What changed** (against v3; same tilings, same shared layout; ``tiled.make_forward(..., pipeline=True)``):

* the tile move is split in two (``tiled._tile_io``): ``fetch`` issues all of a thread's loads of a tile into
  registers, none behind a branch (the ragged last tile clamps the row and zeroes it by a select), from a flat view
  of K or V so that the row stride is the compile-time d: the n addresses are one register plus constant offsets
  (``ld.global.f32 [%rd+1024]``, …); ``store`` writes them to shared memory later;
* software pipelining across the two phases of Alg. 1 lines 8-10: the loads of V_j are issued before S_j = Q_i K_jᵀ
  and stored after the softmax; the loads of K_{j+1} are issued before P̃_j V_j and stored after it. Each batch of
  loads is in flight while the other phase computes, and a thread holds only one tile's share at a time
  (16 registers in both tilings), in a phase where the other share's registers are dead;
* two barriers per tile instead of three (the store of V_j joins the barrier that publishes P̃).

ptxas (sm_90): d = 64 (16, 16, 4, 4): 128 registers, as v3; d = 128 (32, 8, 4, 4): 254, as v3; 0 bytes of stack
or spills in both. (A first try indexed the 4-D arrays K[z, h, row, k] in ``fetch``: ptxas then kept a 64-bit
address per load and rose to 255 registers at d = 64, and spilled at d = 128: hence the flat views.)

**Prediction** (written before the device run): the arithmetic and the shared-memory traffic are unchanged, only
the exposed load latency goes. If the ~11 µs per tile are load latency, a tile falls toward the 4-6 µs of
arithmetic and softmax: d = 64 from 17.5 to 28-35 TFLOP/s (N ≥ 4096, non-causal), d = 128 (one block, 8 warps per
SM, so nothing hid its loads at all) from 15.6 to 25-30. Causal the same factor. Limits then: FFMA issue, two
16-byte shared loads per 16 FFMAs, 8-16 warps per SM.

**Measured** (H200, 2026-11-22, same protocol as v3; ``benchmarks/results/nvidia-h200/``):

* first run, v3's tilings (``fast_v4_first.json``): d = 64 29.1-30.1 TFLOP/s non-causal against v3's 15.1-17.5 in
  the same run (1.7-1.9×); d = 128 28.8-32.0 against 13.0-16.0 (2.0-2.3×); causal 25.7-29.4 / 22.9-30.3. The
  prediction held (d = 128 slightly above its range): the serial load latency was the main cost;
* a small search in the same call (``fast_v4_explore_d64.json``, ``_d128.json``, N = 4096 and 16384): at d = 64,
  (16, 8, 4, 4) (168 registers, 128 threads) 31.6-31.8 against 29.9-30.1 for (16, 16, 4, 4) — once the loads are
  hidden, three smaller blocks per SM beat two larger; (8, 16, 8, 4) 29.6-29.9, (32, 8, 4, 4) 28.6-29.2. At
  d = 128, (16, 16, 4, 4) 30.2-30.9 against 31.3-32.0 for (32, 8, 4, 4): kept;
* final run with d = 64 → (16, 8, 4, 4) (``fast_v4.json``): d = 64 non-causal 30.7 (N = 1024) to 31.8 (N = 16384),
  above PyTorch eager fp32 at every N of the same run (29.3, 30.1, 27.3, 24.5, 29.0) and at 90 % of SDPA
  memory-efficient (35.0-35.4); causal 27.0-30.8 (eager 9.0-11.0). d = 128 non-causal 28.8-32.0: still **below**
  eager (34.5-39.0) and SDPA (44.7-45.9); causal 22.8-30.3 (eager 13.8-15.6). The (16, 16, 4, 4) column of that
  run repeats the first run's d = 64 figures to 0.1 TFLOP/s (the noise).

What limits v4 now: FFMA issue with two 16-byte shared loads per 16 FFMAs, the softmax's MUFU/shuffle work, and,
at d = 128, 8 resident warps per SM (254 registers) with nothing to hide the shared-load latency.
"""

from kernels_gpu.fast.tiled import Tiling, run_forward

SHUFFLE = True
PIPELINE = True
TILINGS = {64: Tiling(16, 8, 4, 4), 128: Tiling(32, 8, 4, 4)}


def default_tiling(d: int) -> Tiling:
    return TILINGS[64] if d <= 64 else TILINGS[128]


def flash2_forward(Q, K, V, causal=False, scale=None, tiling=None, storage="float32"):
    """FA2 forward (Alg. 1), fast version 4 (pipelined K/V tile loads): ``Flash2Forward(O, L)``; same inputs and
    outputs as :func:`kernels_gpu.flash2_forward`, d % 4 == 0 and d_v % (4·NX) == 0. Cost: 4·N_q·N_k·d FLOPs per
    (batch, head); global reads Nd + 2Nd·T_r, writes Nd + N (as v1-v3). ``storage="float16"``: Q, K, V and O in
    HBM as float16, arithmetic and L float32 (see :mod:`kernels_gpu.fast.tiled`)."""
    d_v = tuple(V.shape)[-1]        # (the simulator's device-array shapes refuse negative indices)
    return run_forward(Q, K, V, tiling=tiling or default_tiling(d_v), shuffle=SHUFFLE, causal=causal, scale=scale,
                       pipeline=PIPELINE, storage=storage)
