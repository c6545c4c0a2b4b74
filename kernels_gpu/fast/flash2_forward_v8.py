"""Fast FA2 forward, version 8: v6's kernel run stream-K: one block per resident slot, the call's work cut into
equal ranges of (row block, K/V tile) steps.

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
wave by splitting its blocks into 7 pieces, in two more launches, and lost 2-8 % (its header); the wave count alone
was therefore not the whole story of v7, but the table shows that the wave is really paid for.

**What changed** (``tiled.run_forward(..., stream=True)``; the kernel is v6's, compiled with ``stream=True``):

* the grid is P blocks, P = the number the GPU holds at once (the occupancy calculator's answer, asked once:
  132 at d = 128, 396 at d = 64 on an H200), or the number of steps if that is smaller;
* the call's W = items · T_c steps (a step: one K/V tile of one row block, item = (z·H_q + h)·T_r + i) are cut
  into P ranges of ⌊W/P⌋ or ⌈W/P⌉ steps (:func:`kernels_gpu.fast.split.step_bound`); block b walks its range in
  order, running Alg. 1 lines 4-15 once per item it meets — whole items straight to O and L, and, at either end,
  a piece of an item it shares with its neighbour, whose O_p and L_p go to slot 2b or 2b + 1 of a partials array.
  One launch for all of it: no wave, no second launch of pieces (v7's);
* a small second launch merges each split item's pieces by the (m, ℓ) rule
  (:func:`kernels_gpu.fast.split.stream_merge_kernel`): at most P − 1 items, 2 pieces each when W/P ≥ T_c;
* causal calls keep v6's grid (their row blocks differ in cost, so equal step counts are not equal work).

Cost: v6's FLOPs plus ~2·d_v per split row for the merge; extra global traffic at most 2P·B_r·(d_v + 1) floats
written and read (d = 128: 264 pieces × 128 × 129 × 4 bytes ≈ 17 MB each way, ~7 µs at HBM speed), and each
split item's Q_i and K_0 read once more.

**Prediction** (written before the device run): the table's own numbers: v6's time × 15.52 / 16 plus the pieces'
extra prologues (one per block: ~1/3 of a K/V tile against 496 tiles a block at N = 2048, 0.1 %), the partials
(0.1 %) and the merge launch (~10 µs, 0.1 %): d = 128 non-causal +2.5 % at every N of the benchmark (v6 38.2-39.0
→ 39.2-40.0 TFLOP/s, ahead of PyTorch eager's 38.0-39.0 by 1-3 %); d = 64 (8192 items, 20.69 waves of 396) +1 %;
causal unchanged.
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
    """FA2 forward (Alg. 1), fast version 8 (v6 run stream-K): ``Flash2Forward(O, L)``; same inputs and outputs
    as :func:`kernels_gpu.flash2_forward`, d % 4 == 0 and d_v % (4·NX) == 0. ``slots``: resident blocks to plan
    for, the grid of a non-causal call (None: asked of the GPU). Cost: 4·N_q·N_k·d FLOPs per (batch, head), plus
    the merge of the split items (see the module header); global reads Nd + 2Nd·T_r, writes Nd + N, elements, plus
    the pieces' partials. ``storage`` as v6."""
    d_v = tuple(V.shape)[-1]        # (the simulator's device-array shapes refuse negative indices)
    if tiling is None:
        tiling = default_tiling(d_v)
        max_registers = default_max_registers(d_v) if max_registers is None else max_registers
    return run_forward(Q, K, V, tiling=tiling, shuffle=SHUFFLE, causal=causal, scale=scale, pipeline=PIPELINE,
                       max_registers=max_registers, storage=storage, fragments=FRAGMENTS, slots=slots,
                       stream=STREAM)
