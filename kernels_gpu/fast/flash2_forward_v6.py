"""Fast FA2 forward, version 6: v5 with the shared-memory operands of both inner loops double-buffered in registers.

**What limited v5 at d = 128** (its SASS, compiled here with numba's NVVM, ``ptxas -arch=sm_90`` and ``nvdisasm``):
the loop of Alg. 1 line 8 (S = Q_i K_jᵀ, 4 values of d per step) is not unrolled: each of its d/4 = 32 steps issues
its 8 ``LDS.128`` (4 rows of Q_i, 4 of K_j) and then, at once, the 64 FFMAs that need them, so every step waits the
full shared-memory latency (~30 cycles) before its first FFMA. The loop of line 10 (Õ += P̃ V_j, 4 columns of P̃
per step) does the same, and inside a step ptxas reuses the same 16 registers for each of the 4 rows of V_j, so
each row's 4 loads also wait in front of their 64 FFMAs. With 254 registers a block of 8 warps fills the SM: two
warps per scheduler cannot cover those waits.

**What changed** (``tiled.make_forward(..., fragments=True)``; same algorithm, same global traffic, shared layout
plus d_v floats of slack):

* **double-buffered operands.** Line 8's steps come in pairs: step k+1's 4 columns of Q_i and K_j are loaded into a
  second register buffer before step k's FFMAs, step k+2's into the first before step k+1's. Line 10 loads row c+1
  of V_j into the other buffer before row c's FFMAs, and the next 4 columns of P̃ when a group of 4 starts; that
  step is four calls of an inlined device function with a constant row index, so that every register index is a
  compile-time constant (as a loop, LLVM did not unroll it and the buffers went to local memory: 256 bytes of
  stack). The last prefetch of each loop reads one step past the end, into the rows' padding (Q_i, K_j: columns
  d … d+3; P̃: columns B_c … B_c+3) or one row past V_j: inside the shared array, never used (clamping the index
  with ``min`` instead made LLVM keep one address per element and lose the 16-byte loads: 48 scalar ``LDS``);
* **the loads before the loop get ``+ 0.0``.** Without it LLVM's instruction combiner merges the prologue's load
  and the loop's last prefetch, which feed the same register at the loop head, into one load *at the top of the
  loop*: the first version of v6 compiled to exactly v5's schedule (PTX: all 16 loads of a step pair at the top of
  the body, each step's FFMAs waiting on them). Adding +0.0 changes no value (it only turns −0.0 into +0.0, which
  changes no sum) and is not folded away without fast-math flags, so the two loads stay distinct and the prefetch
  survives;
* **Q_i moves like the K/V tiles** (Alg. 1 line 4): K_0's loads are issued first, then Q_i's in passes of at most
  32 values per thread (all of Q_i at once spilled at d = 128), each pass's loads issued before its stores. v1-v5
  load Q_i one element per iteration behind a bounds branch, each store waiting for its load (up to 64 global
  latencies in a row per block at d = 128): a once-per-block cost, most visible at small N (few K/V tiles per
  block);
* **S = Q_i K_jᵀ as outer products** (``s_step``): for each of the 4 values of a step, all TR × TC products, so
  consecutive FFMAs share an operand (v5: each element's 4 products in a chain); every element still sums its
  products in the same order;
* **2^x as one ``MUFU.EX2``** (``ex2.approx.ftz``, an NVVM intrinsic; libdevice's exp2f adds a range test and two
  multiplies per call to keep subnormal results, which P̃ does not need) and **no Õ rescale when α = 1** (the row
  maximum did not move, as it mostly does not once a row has seen many keys);
* tilings per head dimension: d = 64 (16, 8, 4, 4) capped at 168 registers (3 blocks of 4 warps per SM); d = 128
  (16, 16, 8, 4): B_r = 128, B_c = 64, 256 threads, 8 × 4 of S and 8 × 8 of Õ per thread, 169 KiB of shared
  memory, one block of 8 warps per SM.

ptxas (sm_90, this machine's NVVM and CUDA 13.0 ptxas, also the device's report in the results files), 0 bytes of
spills: d = 64 (16, 8, 4, 4) 168 registers (capped; 192 uncapped); d = 128 (16, 16, 8, 4) 255, (32, 8, 4, 8) 254.

**Prediction** (written before the first device run, for the first item alone): the instruction count is unchanged,
only the exposed shared-load latency goes. At d = 128 (8 warps, nothing else to hide it) FFMA issue should rise from
~47 % of the SM's peak (31.3-32.0 TFLOP/s at N ≥ 4096) toward 60-65 %: 38-42 TFLOP/s, past PyTorch eager
(34.5-39.0). At d = 64, where v5 already runs more warps, +5-10 %.

**Measured** (H200, 2026-11-22, fp32, forward, batch × N = 16k tokens, hidden 2048, ``benchmarks.fast_kernels``
with the harness's protocol; every configuration checked against the float64 reference first, relative error
≤ 2.4e-6; TFLOP/s at N = 1024 / 2048 / 4096 / 16384 where all four ran, else N = 1024 / 4096 / 16384):

* the first item alone (``fast_v6_explore_d128.json``, ``_d64.json``): d = 128 (32, 8, 4, 4) 29.3 / 32.0 / 32.7
  against v5's 28.8 / 31.3 / 32.0: **the prediction failed** (+2 %, not +20-30 %). Nsight Compute
  (``ncu_v6_first_d128_details.csv``, N = 4096): issue slots 61 % busy, and the SASS showed why — every step pair
  began with the loads its first FFMAs needed (LLVM's merge, above);
* with +0.0 (``fast_v6b_explore_*.json``): d = 128 (32, 8, 4, 4) 32.0 / 35.2 / 36.1, (32, 8, 4, 8) 33.2 / 36.7 / 37.7;
  d = 64 (16, 8, 4, 4) r168 33.7 / 34.8 / 35.1 (v5 31.4 / 32.2 / 32.4);
* with the Q_i move (``fast_v6c_kv1_d128.json``, ``_kv0``): (32, 8, 4, 8) 36.9 / 37.4 / 37.7 / 37.9 — N = 1024 gained
  the most (+11 %), as predicted for a once-per-block cost. The same files compare fetching V_{j+1} together with
  K_{j+1} during P̃_j V_j (kv1) against v4's schedule (kv0): within ±1 % either way, so v6 keeps v4's;
* tiling (``fast_v6_tiling_d128.json``): (16, 16, 8, 4) 37.4 / 37.9 / 38.1 / 38.3, (32, 8, 4, 8) 36.9 / 37.4 / 37.7 /
  37.9, (32, 8, 4, 4) 35.4-36.4; causal likewise ordered;
* outer products (``fast_v6_outer_*.json``): (32, 8, 4, 8) +1.8 % (37.6 / 38.2 / 38.4 / 38.6), (16, 16, 8, 4)
  unchanged, d = 64 −1 % (34.6 / 35.0 / 35.1); Nsight Compute on (16, 16, 8, 4) (``ncu_v6_d128_details.csv``):
  issue slots 69.5 % busy, 2 warps per scheduler of which 1.37 eligible on average, 15.52 waves;
* ``ex2`` and the skipped rescale (``fast_v6_ex2_*.json``): (16, 16, 8, 4) 37.9 / 38.4 / 38.6 / 38.9 (+1.4 %);
  d = 64 34.8 / 35.2 / 35.3;
* final run (``final_v6.json``, the final run before v8, ``kg_flash2_fast`` = v6 forward, all baselines): d = 128
  non-causal 38.2 / 38.6 / 38.8 / 38.9 / 39.0 (N = 1024 … 16384) against PyTorch eager 38.0 / 39.0 / 36.7 / 34.4 /
  38.7 — ahead at four N, **behind by 1 % at N = 2048**, and within 0.4 % / 0.6 % at N = 1024 / 16384; causal
  32.0-37.0 (eager 13.7-15.5); d = 64 34.9-35.4 non-causal (eager 24.4-30.0), causal 31.6-34.4.

What limits v6 (Nsight Compute on the final version, d = 128, N = 2048: ``ncu_v6_final_d128_details.csv`` and the
summary of its source counters, ``ncu_v6_final_d128_stalls.txt``): one block of 8 warps per SM (255 registers,
169 KiB of shared memory), so two warps per scheduler, 1.35 of them eligible on average, and 30 % of issue slots
idle. Of the warps' sampled states 36 % issue and 32 % wait while the other warp issues; the losses are dispatch
stalls (16 %, three quarters on FFMAs, most likely register-bank conflicts between their operands), waits on shared
loads (7 %) and fixed latencies (5 %); barriers, the softmax's MUFU and global loads are about 1 % each, and shared
memory serves its wavefronts with no bank conflicts (1.016 of the ideal count). 83 % of the executed instructions
are FFMAs (the 16-byte shared loads 7 %). Besides, the benchmark's 2048 blocks are 15.52 waves of 132 SMs at every
N (batch × N is fixed), so the last wave leaves half the SMs idle (~3 %), and each block pays its Q_i/K_0 loads
and its epilogue once (about a third of a K/V tile: ~1 % at N = 2048, 32 tiles per block). Not tried here:
persistent blocks that start the next row block's loads during the last tile of the current one, with the last
wave's row blocks split along the keys (FA2's split-K, merged by the (m, ℓ) rule) to fill it; an asynchronous
global-to-shared copy, which would free the 32 staging registers (numba exposes no ``cp.async``).

**fp16 storage** (``storage="float16"``, as v5): measured with this version and backward v1 in one run
(``fast_fp16.json``, ``python -m benchmarks.fp16_check``; d = 64 and 128, N = 1024 and 4096, causal and not): the
global bytes are 0.500 of float32's for the forward (0.75 for the backward, whose dQ atomics stay float32), and the
time *rises* by 4-7 % (forward) and 1-4 % (backward): the kernels are compute-bound, each element still costs one
load instruction, now plus a conversion. Relative error against the float64 reference 3.9-4.3e-4 (forward) and
5.0-5.3e-4 (backward), float16's rounding of the outputs (2^-11 ≈ 4.9e-4), against ~1e-6 with float32 storage.
"""

from kernels_gpu.fast.tiled import Tiling, run_forward
from kernels_gpu.fast.tiled import resources as _resources

SHUFFLE = True
PIPELINE = True
FRAGMENTS = True
#: tiling per head dimension (d ≤ 64 → the first, otherwise the second)
TILINGS = {64: Tiling(16, 8, 4, 4), 128: Tiling(16, 16, 8, 4)}
#: ptxas's cap on registers per thread for the default tiling of each head dimension (None: no cap)
MAX_REGISTERS = {64: 168, 128: None}


def default_tiling(d: int) -> Tiling:
    return TILINGS[64] if d <= 64 else TILINGS[128]


def default_max_registers(d: int):
    return MAX_REGISTERS[64] if d <= 64 else MAX_REGISTERS[128]


def resources(tiling: Tiling, d: int, max_registers=None, storage=None) -> dict:
    """The compiler's resource report for this version's kernel (GPU only)."""
    return _resources(tiling, d, d, SHUFFLE, PIPELINE, max_registers, storage=storage, fragments=FRAGMENTS)


def flash2_forward(Q, K, V, causal=False, scale=None, tiling=None, max_registers=None, storage="float32"):
    """FA2 forward (Alg. 1), fast version 6 (v5 with double-buffered register operands): ``Flash2Forward(O, L)``;
    same inputs and outputs as :func:`kernels_gpu.flash2_forward`, d % 4 == 0 and d_v % (4·NX) == 0. With
    ``tiling`` given and ``max_registers`` None, no cap. Cost: 4·N_q·N_k·d FLOPs per (batch, head); global reads
    Nd + 2Nd·T_r, writes Nd + N (as v1-v5), elements. ``storage``: ``"float32"`` or ``"float16"`` (as v5: Q, K, V
    read and O written as float16, L float32, arithmetic float32)."""
    d_v = tuple(V.shape)[-1]        # (the simulator's device-array shapes refuse negative indices)
    if tiling is None:
        tiling = default_tiling(d_v)
        max_registers = default_max_registers(d_v) if max_registers is None else max_registers
    return run_forward(Q, K, V, tiling=tiling, shuffle=SHUFFLE, causal=causal, scale=scale, pipeline=PIPELINE,
                       max_registers=max_registers, storage=storage, fragments=FRAGMENTS)
