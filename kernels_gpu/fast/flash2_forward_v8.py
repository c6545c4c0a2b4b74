"""Fast FA2 forward, version 8: v6's kernel on a grid of exactly the blocks the GPU holds, taking work from a
counter: whole row blocks for whole waves, then the leftover row blocks' K/V tiles shared out evenly (stream-K).

**What limited v6, measured** (H200, 2026-11-22, ``fast_waves_h{123,128,132}.json``: v6 at d = 128, N = 2048,
batch 1, the heads varied so that the block count crosses a wave boundary; 132 slots, one block of 8 warps per SM):

========  ======  =====  =========  ===========
heads     blocks  waves  v6 (ms)    TFLOP/s
========  ======  =====  =========  ===========
123       1968    14.91  6.683      39.53
128       2048    15.52  7.122      38.60
132       2112    16.00  7.140      39.70
========  ======  =====  =========  ===========

The 64 blocks that fill the 16th wave cost 0.018 ms (0.25 %), while the 80 blocks of it that 123 heads leave out
save 0.44 ms (6 %): the time is counted in whole waves, so the benchmark's 15.52 waves (2048 blocks at every N, since
batch × N is fixed) pay for 16, and 3 % of v6's run is SMs waiting for the last 68 blocks. v7 tried to fill that
wave by splitting its blocks into 7 pieces, in two more launches, and lost 2-8 % (its header); the table shows that
the wave is really paid for, so the idea stands and v7's way of doing it did not.

**What changed** (``tiled.run_forward(..., stream=True)``; the kernel is v6's, compiled with ``stream=True``: its
inner loops are v6's instruction for instruction, 254 registers at d = 128, and at d = 64 one 4-byte spill in the
per-item prologue under the 168-register cap):

* the grid is P blocks, P = the number the GPU holds at once (the occupancy calculator's answer, asked once per
  kernel: 132 at d = 128, 396 at d = 64 on an H200);
* the blocks take work units from a global counter (one atomic per unit, by one thread, handed to the block through
  shared memory), in order (:func:`kernels_gpu.fast.split.stream_plan`): first the whole items (row blocks, item
  = (z·H_q + h)·T_r + i, in v6's block order) that fill whole waves, 1980 of the benchmark's 2048 at d = 128; then
  the steps of the remaining items (a step: one K/V tile of one item), cut into R ≤ P ranges of ⌊W/R⌋ or ⌈W/R⌉
  steps (:func:`kernels_gpu.fast.split.step_bound`): 68 items × 32 tiles in 132 ranges of 16-17 tiles at
  N = 2048. A range runs Alg. 1 lines 4-15 once per item it touches; a piece of an item (a range begins or ends
  inside it) writes its own O_p and L_p to slot 2r or 2r + 1 of a partials array. Whoever is free takes the next
  unit, so an SM that runs slower takes fewer;
* a second, small launch merges the split items' pieces by the (m, ℓ) rule
  (:func:`kernels_gpu.fast.split.stream_merge_kernel`: one warp per row, 4 pieces' loads in flight together),
  and a one-thread launch zeroes the counter before;
* causal calls keep v6's grid (their row blocks differ in cost, so equal step counts are not equal work).

Cost: v6's FLOPs plus ~2·d_v per split row for the merge; extra global traffic at most 2R·B_r·(d_v + 1) floats
written and read (d = 128: ≤ 264 pieces × 128 × 129 × 4 bytes ≈ 17 MB each way, ~7 µs at HBM speed, and as much
extra device memory during the call), and each split item's Q_i and K_0 read once per piece.

**The first form, measured: a failure** (``fast_v8a_explore_d128.json``, ``_d64.json``; commit "Forward v8, first
form"). Pure stream-K: block b took the steps [b·W/P, (b+1)·W/P) of the whole call, W = items · T_c, so ~15.5
consecutive items each. Predicted (from the table: v6's time × 15.52 / 16, plus ~0.3 % for pieces and merge):
+2.5 % at d = 128, +1 % at d = 64. Measured against v6 in the same run (TFLOP/s at N = 1024 / 2048 / 4096 / 8192 /
16384): d = 128 36.7 / 38.2 / 38.8 / 39.2 / 39.4 against 38.1 / 38.6 / 38.8 / 38.9 / 39.0 (−3.7 % … +1.2 %);
d = 64 33.8 / 34.3 / 34.6 / 34.7 / 34.8 against 34.9 / 35.1 / 35.3 / 35.3 / 35.4 (−2 … −3 %). Losses that
shrink as N grows are a cost per item; the likely ones: 132 blocks that each stay on their own head for ~15 items
read 132 different heads' K and V at once (v6's concurrent blocks are neighbouring row blocks of a few heads,
which share every K/V tile through the L2 cache), and a static split cannot let a faster SM take more (v6's
dynamic block scheduling does). The second form above keeps v6's order and dynamic assignment for the whole waves
and shares out only the leftover items.

**Prediction for the second form** (written before its device run): v6's time × 15.52 / 16 plus the pieces'
extra prologues (≤ 2 per range of 16-17 tiles, ~0.35 tile each against a call of ~32 tiles per SM-wave: ~0.2 %),
the atomics (one per unit, ~1 µs against a unit of ~450 µs) and the merge (~10 µs): d = 128 non-causal +2.5 % at
every N (v6 38.1-39.0 → 39.1-40.0 TFLOP/s, ahead of PyTorch eager's 38.0-39.0); d = 64 (8192 items, 20.69 waves
of 396) +1 %; causal unchanged.

**Measured** (H200, 2026-11-22, fp32, forward, non-causal, batch × N = 16k, hidden 2048, ``benchmarks.fast_kernels``
with v6 and PyTorch eager in the same run; every configuration checked against the float64 reference first,
relative error ≤ 2.3e-6; TFLOP/s at N = 1024 / 2048 / 4096 / 8192 / 16384):

* as described (``fast_v8b_explore_d128.json``, ``_d64.json``): d = 128 37.2 / 38.8 / 39.6 / 40.0 / 40.2 against
  v6's 38.2 / 38.6 / 38.8 / 38.9 / 39.0: the prediction held at N = 16384 (+3.2 %) and failed at small N
  (−2.6 % at 1024). With 4× the tokens at N = 1024 (``fast_v8b_tokens64k.json``) the loss stayed −2.7 %: a cost
  that grows with the work, not one per call. Nsight Compute at N = 1024 (``ncu_v8b_v6_N1024.csv``,
  ``ncu_v8b_v8_N1024.csv``) found it: the main kernel took 3.52 ms against v6's 3.61 (−2.5 %, as modelled), and
  **the merge launch 246 µs** — one block per item, whose 128 threads walked the item's 16384 elements one at a
  time, each element a chain of dependent loads. The same merge is v7's: the likeliest cause of v7's failure too;
* the merge as one block per row and a thread per column (``fast_v8c_explore_d128.json``, ``_d64.json``;
  ``ncu_v8c_durations.txt``: 65 µs): d = 128 38.4 / 39.4 / 40.0 / 40.1 / 40.2; v7 with the same merge, same run,
  37.1 / 38.3 / 38.8 / 39.1 / 39.2 against v6's 38.1 / 38.6 / 38.8 / 38.9 / 39.0 — still slower at small N, so
  v7's pieces and launches cost more than its merge alone;
* tried and reverted: the merge inside the main launch (the last piece of an item to finish, counted with a
  per-item atomic after a memory fence, merged them all: stream-K's "fix-up"; ``fast_v8d_explore_d128.json``,
  ``ncu_v8d_durations.txt``): 36.2 / 36.8 / 37.1 / 37.2 / 37.2, 4-7 % slower at every N, N = 16384 included,
  where merges cost nothing: the kernel itself became slower (3.81 ms against 3.52 at N = 1024). Its SASS had
  the same inner loops, 48 bytes of spills outside the K/V-tile loop and a longer item loop (8226 instructions
  against 6828); why that costs 8 % was not established;
* the merge as one warp per row with 4 pieces' loads issued together (``fast_v8e_explore_d128.json``, ``_d64.json``;
  ``ncu_v8e_durations.txt``: 25.7 µs): **d = 128 38.7 / 39.6 / 40.0 / 40.2 / 40.3**, +1.4 % … +3.4 % over v6
  (PyTorch eager in the same run 38.0 / 39.0 / 36.7 / 34.4 / 38.7); d = 64 34.4 / 34.9 / 34.8 / 35.2 / 35.2
  against v6's 34.9 / 35.1 / 35.3 / 35.4 / 35.4: **v8 does not pay at d = 64** (−0.4 … −1.4 %; the leftover wave
  is 1.5 % there, 3 blocks per SM; what costs more than it saves was not established), so the harness times v6
  at d ≤ 64 and v8 above (``benchmarks.harness.impls.FAST_FORWARD``);
* final run (``final.json``, ``kg_flash2_fast`` = v8 at d = 128, all baselines in the same run): d = 128
  non-causal 38.8 / 39.6 / 40.0 / 40.2 / 40.3 against PyTorch eager 38.0 / 39.0 / 36.6 / 34.5 / 38.8, ahead at
  every N (by 1.9 %, 1.5 %, 9 %, 17 %, 4 %). Causal calls run v6's grid: 31.9-37.0, as before.

Correctness on the GPU: ``tests/gpu/test_kernels_fast_gpu.py`` (every version, v8 also on grids of 7, 50 and 1000
blocks) 78 passed (``gpu_tests_fast_v8.log``); compute-sanitizer memcheck (``sanitizer_v8.log``) and racecheck
(``sanitizer_v8_racecheck.log``) clean over ``kernels_gpu.sanitize --quick --fast``, which runs v8 planned for 3
and 7 resident blocks.
"""

from kernels_gpu.fast.flash2_forward_v6 import MAX_REGISTERS, TILINGS, default_max_registers, default_tiling
from kernels_gpu.fast.tiled import Tiling, run_forward
from kernels_gpu.fast.tiled import resources as _resources

SHUFFLE = True
PIPELINE = True
FRAGMENTS = True
STREAM = True

__all__ = ["flash2_forward", "resources", "default_tiling", "default_max_registers", "TILINGS", "MAX_REGISTERS"]


def resources(tiling: Tiling, d: int, max_registers=None, storage=None) -> dict:
    """The compiler's resource report for this version's (non-causal) kernel (GPU only)."""
    return _resources(tiling, d, d, SHUFFLE, PIPELINE, max_registers, storage=storage, fragments=FRAGMENTS,
                      stream=STREAM)


def flash2_forward(Q, K, V, causal=False, scale=None, tiling=None, max_registers=None, storage="float32",
                   slots=None):
    """FA2 forward (Alg. 1), fast version 8 (v6's kernel taking whole items, then stream-K ranges of the leftover
    items, from a counter): ``Flash2Forward(O, L)``; same inputs and outputs as :func:`kernels_gpu.flash2_forward`,
    d % 4 == 0 and d_v % (4·NX) == 0. ``slots``: resident blocks to plan for, the grid of a non-causal call
    (None: asked of the GPU). Cost: 4·N_q·N_k·d FLOPs per (batch, head), plus
    the merge of the split items (see the module header); global reads Nd + 2Nd·T_r, writes Nd + N, elements, plus
    the pieces' partials. ``storage`` as v6."""
    d_v = tuple(V.shape)[-1]        # (the simulator's device-array shapes refuse negative indices)
    if tiling is None:
        tiling = default_tiling(d_v)
        max_registers = default_max_registers(d_v) if max_registers is None else max_registers
    return run_forward(Q, K, V, tiling=tiling, shuffle=SHUFFLE, causal=causal, scale=scale, pipeline=PIPELINE,
                       max_registers=max_registers, storage=storage, fragments=FRAGMENTS, slots=slots,
                       stream=STREAM)
