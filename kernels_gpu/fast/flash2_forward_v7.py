"""Fast FA2 forward, version 7: v6 with the last, half-empty wave of blocks filled by splitting its row blocks
along the keys.

**What limited v6** (its header): with one block per SM at d = 128, the benchmark's 2048 row blocks (batch × N is
fixed at 16k tokens, so every N gives 2048) are 15.52 waves of 132 SMs: the 16th wave runs 68 blocks while 64 SMs
wait, about 3 % of the run. Tuning the block cannot remove that; only the shape of the work can.

**What changed** (``tiled.run_forward(..., split=True)``; the kernel is v6's, compiled with ``split=True``):

* blocks take their (row block, batch, head) from a 1-D grid, so a launch can cover any range of items;
* :func:`kernels_gpu.fast.split.split_plan` asks the occupancy calculator how many blocks are resident at once
  (``slots``: 132 at d = 128, 396 at d = 64 on an H200) and launches the whole waves as usual; each item of the
  remainder is cut into S pieces along the keys (FA2 Section 3.2's split over the sequence, as in decoding kernels),
  each piece a block running Alg. 1 over its range of K/V tiles and writing its own O_p and L_p; S is the number of
  pieces that makes the last wave shortest (⌈n·S / slots⌉ rounds of T_c / S tiles, plus a per-block overhead), none
  if nothing is gained;
* a third, small launch merges the pieces: L = log Σ_p e^{L_p}, O = Σ_p e^{L_p − L} O_p — the (m, ℓ) rescaling of
  Alg. 1 lines 9-12 applied to whole pieces. Causal calls are not split (their row blocks differ in cost).

Cost: the FLOPs of v6 plus the merge's ~2·S·d_v per split row; extra global traffic S·B_r·(d_v + 1) floats written
and read per split item (at d = 128, N = 2048: 68 items × 7 pieces × 128 × 129 × 4 bytes ≈ 31 MB each way, about
10 µs at HBM speed against a 7 ms call).

**Prediction** (written before the device run): at d = 128 the plan for the benchmark is 1980 whole blocks (15
waves) and 68 items in S = 7 pieces: the last wave shrinks from 32 tiles to 4 rounds of ~4.6 tiles plus the
per-block overheads, ~2.4 % of the run; so +2 % at every N of the benchmark (v6: 38.2-39.0 TFLOP/s → 39-40),
ahead of PyTorch eager (38.0-39.0) at every N. d = 64 (396 slots, 8192 items, 272 left): +1 % at most. Causal:
unchanged.

**Measured** (H200, 2026-11-22, fp32, forward, non-causal, batch × N = 16k, hidden 2048, v6 and v7 in the same call,
``fast_v7_explore_d128.json`` / ``_d64.json``; every configuration checked against the float64 reference first,
relative error ≤ 2.3e-6). The occupancy calculator gave the planned slots (132 at d = 128, 396 at d = 64) and the
plans (1980 + 68 items in 7 pieces; 7920 + 272 in 7). TFLOP/s at N = 1024 / 2048 / 4096 / 16384:

* d = 128: v7 34.9 / 37.0 / 38.1 / 39.0 against v6 38.1 / 38.5 / 38.7 / 38.9;
* d = 64 (N = 1024 / 4096 / 16384): v7 33.8 / 35.0 / 35.4 against v6 34.8 / 35.3 / 35.4.

**The prediction failed**: v7 is slower by 2-8 % up to N = 4096 and level (+0.1 %) at N = 16384, where the model
promised +2.4 %. Not established (no device time was left to profile it); the candidates are (a) each piece pays
a whole block's fixed costs — Q_i and K_0 loads, epilogue, a block launch — on 2-5 K/V tiles instead of 16-256, so
the 0.35 tile per block of the model is too little; (b) the pieces' launch starts only when the whole-wave launch
has drained, and the merge only after the pieces: two more launch boundaries, each exposing the tail of the one
before; (c) at N = 1024 (3.6 ms calls) the host work of three launches and the occupancy query per call may no
longer hide behind the queue. That N = 16384 gained nothing says the half-empty last wave does not cost what the
wave count suggests, or that (a) and (b) eat it exactly. v7 stays in the book as a measured failure;
``kg_flash2_fast`` keeps v6.

**Later** (v8's profiling, ``ncu_v8b_v8_N1024.csv``): the merge launch, one block per split item whose 128 threads
walked the item's elements one at a time, took 246 µs at d = 128, N = 1024 (7 % of the call): candidate (b) above,
in the merge rather than in the launch boundaries. The merge has since been rewritten twice, for both versions
(:mod:`kernels_gpu.fast.split`); v7 with the second form (one block per row, 65 µs) measured 37.1 / 38.3 / 38.8 /
39.1 / 39.2 TFLOP/s at N = 1024 / 2048 / 4096 / 8192 / 16384 against v6's 38.1 / 38.6 / 38.8 / 38.9 / 39.0 in the
same run (``fast_v8c_explore_d128.json``): still slower at small N, so its many short pieces cost more than the
merge alone. With the third form (one warp per row, 26 µs) v7 was not re-measured.

Correctness on the GPU: ``tests/gpu/test_kernels_fast_gpu.py`` (the split path runs at its sizes) 64 passed
(``gpu_tests_fast_v7.log``); compute-sanitizer memcheck and racecheck clean on a forced split launch
(``sanitizer_v7.log``).
"""

from kernels_gpu.fast.flash2_forward_v6 import MAX_REGISTERS, TILINGS, default_max_registers, default_tiling
from kernels_gpu.fast.tiled import Tiling, run_forward
from kernels_gpu.fast.tiled import resources as _resources

SHUFFLE = True
PIPELINE = True
FRAGMENTS = True
SPLIT = True

__all__ = ["flash2_forward", "resources", "default_tiling", "default_max_registers", "TILINGS", "MAX_REGISTERS"]


def resources(tiling: Tiling, d: int, max_registers=None, storage=None) -> dict:
    """The compiler's resource report for this version's kernel (GPU only)."""
    return _resources(tiling, d, d, SHUFFLE, PIPELINE, max_registers, storage=storage, fragments=FRAGMENTS,
                      split=SPLIT)


def flash2_forward(Q, K, V, causal=False, scale=None, tiling=None, max_registers=None, storage="float32",
                   slots=None):
    """FA2 forward (Alg. 1), fast version 7 (v6 with the last wave split along the keys): ``Flash2Forward(O, L)``;
    same inputs and outputs as :func:`kernels_gpu.flash2_forward`, d % 4 == 0 and d_v % (4·NX) == 0. ``slots``:
    resident blocks to plan for (None: asked of the GPU). Cost: 4·N_q·N_k·d FLOPs per (batch, head), plus the
    merge of the split items (see the module header); global reads Nd + 2Nd·T_r, writes Nd + N, elements, plus the
    pieces' partials. ``storage`` as v6."""
    d_v = tuple(V.shape)[-1]        # (the simulator's device-array shapes refuse negative indices)
    if tiling is None:
        tiling = default_tiling(d_v)
        max_registers = default_max_registers(d_v) if max_registers is None else max_registers
    return run_forward(Q, K, V, tiling=tiling, shuffle=SHUFFLE, causal=causal, scale=scale, pipeline=PIPELINE,
                       max_registers=max_registers, storage=storage, fragments=FRAGMENTS, split=SPLIT, slots=slots)
