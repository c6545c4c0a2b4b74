"""Fast FA2 forward, version 5: v4 with a tiling and a register cap per head dimension, for more resident warps.

**What limited v4 at d = 128** (its resource reports, ``fast_v4.json``): the (32, 8, 4, 4) tiling (B_r = 128,
B_c = 32, 256 threads, 4 × 16 of Õ per thread) uses 254 registers, so one block of 8 warps per SM, and nothing hides
the shared-memory load latency of its inner loops. A register cap alone cannot help that tiling: its shared memory
is 116.5 KiB per block (Q_i is 128 × 132 floats), so a second block does not fit in the SM's 228 KiB whatever the
register count. (16, 16, 4, 4) is in the same place (115 KiB). The backward (``flash2_backward_v1``) won 20 % by the
opposite move: a smaller block, capped at 168 registers, three blocks per SM.

**What changed** (against v4; same kernel, ``tiled.make_forward(..., max_registers=)``, numba's
``cuda.jit(max_registers=)``, i.e. ptxas's ``--maxrregcount``): :data:`TILINGS` and :data:`MAX_REGISTERS` per head
dimension, from the search below. Candidates at d = 128, with their shared memory per block and the resident warps
the cap allows (65 536 registers and 228 KiB per SM):

* (16, 8, 4, 4) capped at 168: v4's per-thread work (4 × 4 of S, 4 × 16 of Õ, the same FFMAs per shared load),
  half the rows per block (B_r = 64, 128 threads, 74.5 KiB): 3 blocks of 4 warps = 12 warps (uncapped: 8);
* (32, 8, 2, 4) capped at 128: B_r = 64, 256 threads, 2 × 16 of Õ, 74.5 KiB: 2 blocks = 16 warps, but only
  2 × 4 × 4 FFMAs per 6 shared loads in the S loop (v4: 4 × 4 × 4 per 8);
* (16, 16, 4, 2) capped at 128: B_r = 64, B_c = 32, 4 × 8 of Õ, 74.5 KiB: 16 warps, 4 × 2 × 4 FFMAs per 6 loads.

At d = 64, v4's (16, 8, 4, 4) has 168 registers (3 blocks of 4 warps; 44.5 KiB): capped at 128, 4 blocks.

**Prediction** (written before the device run): the cap costs spills if ptxas cannot fit the 64 Õ registers plus
the S, Q and K operands (4 × 4 + 16 + 16) plus the pipelined tile share (16) in 168; if it fits with ≤ a few
dozen bytes of spills, (16, 8, 4, 4) r168 gains 10-20 % at d = 128 (12 warps instead of 8, as the backward's 8 → 12
gained 20 %), i.e. 28.8-32.0 → 33-37 TFLOP/s, about PyTorch eager's 34.5-39.0; the two 16-warp tilings gain less
(their FFMA-per-load ratio falls by a third) and lose if they spill. At d = 64, 12 → 16 warps: +0-5 %.

**Measured** (H200, 2026-11-22, fp32, batch × N = 16k tokens, hidden 2048, non-causal, N = 4096 / 16384; every
configuration checked against the float64 oracle on the GPU first, relative error 1.2e-6 / 2.3e-6;
``benchmarks/results/nvidia-h200/fast_v5_explore_d128.json``, ``fast_v5_explore_d64.json``), TFLOP/s:

* d = 128: v4 (32, 8, 4, 4), 254 registers, 31.29 / 32.00; (16, 8, 4, 4) uncapped (254 registers, so 2 blocks of
  4 warps) 31.22 / 31.95; (16, 8, 4, 4) r168 (168 registers, **48 bytes of spills**) 30.03 / 30.32; r128 (232 bytes
  of spills) 26.69 / 26.93; (16, 16, 4, 2) r128 (no spills) 28.41 / 28.59; (32, 8, 2, 4) r128 (no spills) 24.78 /
  24.90. **The prediction failed**: 12 warps did not beat 8 (the spills inside the tile loop cost more than the
  extra warps hid), and the 16-warp tilings lost what their lower FFMA-per-shared-load ratio predicted. No
  candidate beat v4, so v5 keeps v4's (32, 8, 4, 4) uncapped at d = 128, and the gap to PyTorch eager (34.5-39.0)
  stays open: what is left is the inner loops' instruction mix, not occupancy.
* d = 64: (16, 8, 4, 4) r128 (128 registers, 8 bytes of spills, 4 blocks of 4 warps) 32.15 / 32.35 against v4's
  31.54 / 31.76 in the same call (+1.9 %): v5's d = 64 default.
* final run (``final_v5.json``, the final run before v6, ``kg_flash2_fast`` = v5 forward): d = 64 non-causal
  31.4-32.4 (N = 1024-16384), causal 27.8-31.2; d = 128 non-causal 28.8-32.0, causal 22.8-30.3 (v4's figures, as
  expected).

**fp16 storage** (``storage="float16"``; the same kernel source, compiled for float16 arguments): Q, K, V are stored
in HBM as float16 (NumPy inputs are cast on the way in; device inputs, e.g. torch fp16 tensors, are used in place
and must be float16), every load is converted to float32 on its way into shared memory or registers, all arithmetic
and accumulation is float32, O is written as float16 (rounded once, at the end) and L stays float32. Shared memory
keeps float32 tiles, so the inner loops are v5's instructions unchanged. What it changes: the global bytes halve
(reads 2·(Nd + 2Nd·T_r) instead of 4·(…) per (batch, head); writes 2Nd + 4N instead of 4Nd + 4N), and so does the
HBM a caller needs for Q, K, V, O. Compiled here for sm_90 (numba's NVVM, then ptxas of CUDA 13.0): the float16 PTX
has no float16 arithmetic at all, its 101 global loads are ``ld.global.u16`` each followed by one ``cvt.f32.f16``,
and ptxas gives both storages the same registers (d = 64 capped: 128; d = 128: 254) and no spills (the device's
ptxas reported 8 bytes of spills for float32 at d = 64). **Prediction** (written before the device run): v5 is
compute-bound by two orders of magnitude (memory floor 0.13 ms against a compute floor of 21.6 ms at d = 64,
N = 8192, benchmarks/README.md), and its tile loads are already hidden behind arithmetic (v4's pipeline), so time should
change little: within a few per cent either way (the same number of load instructions, plus one conversion per
element loaded). The accuracy cost is O's own rounding, 2^-11 relative, beside the float16 rounding of the inputs.
Measured on the device with v6, whose loads and conversions are v5's (see its header): 1.04-1.07× the float32
time for half the bytes, relative error 3.9-4.3e-4: a few per cent, as predicted, on the slow side.
"""

from kernels_gpu.fast.tiled import Tiling, run_forward

SHUFFLE = True
PIPELINE = True
#: tiling per head dimension (d ≤ 64 → the first, otherwise the second): set from ``fast_v5_explore.json``
TILINGS = {64: Tiling(16, 8, 4, 4), 128: Tiling(32, 8, 4, 4)}
#: ptxas's cap on registers per thread for the default tiling of each head dimension (None: no cap)
MAX_REGISTERS = {64: 128, 128: None}


def default_tiling(d: int) -> Tiling:
    return TILINGS[64] if d <= 64 else TILINGS[128]


def default_max_registers(d: int):
    return MAX_REGISTERS[64] if d <= 64 else MAX_REGISTERS[128]


def flash2_forward(Q, K, V, causal=False, scale=None, tiling=None, max_registers=None, storage="float32"):
    """FA2 forward (Alg. 1), fast version 5 (v4 with per-d tiling and register cap): ``Flash2Forward(O, L)``; same
    inputs and outputs as :func:`kernels_gpu.flash2_forward`, d % 4 == 0 and d_v % (4·NX) == 0. With ``tiling``
    given and ``max_registers`` None, no cap. Cost: 4·N_q·N_k·d FLOPs per (batch, head); global reads Nd + 2Nd·T_r,
    writes Nd + N (as v1-v4), elements. ``storage``: ``"float32"`` (4 bytes per element) or ``"float16"`` (Q, K, V
    read and O written as float16, 2 bytes; L float32; arithmetic float32): see "fp16 storage" above."""
    d_v = tuple(V.shape)[-1]        # (the simulator's device-array shapes refuse negative indices)
    if tiling is None:
        tiling = default_tiling(d_v)
        max_registers = default_max_registers(d_v) if max_registers is None else max_registers
    return run_forward(Q, K, V, tiling=tiling, shuffle=SHUFFLE, causal=causal, scale=scale, pipeline=PIPELINE,
                       max_registers=max_registers, storage=storage)
