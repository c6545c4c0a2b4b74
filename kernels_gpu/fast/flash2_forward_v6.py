"""Fast FA2 forward, version 6: v5 with the shared-memory operands of both inner loops double-buffered in registers.

**What limited v5 at d = 128** (its SASS, compiled here with numba's NVVM, ``ptxas -arch=sm_90`` and ``nvdisasm``):
the loop of Alg. 1 line 8 (S = Q_i K_jᵀ, 4 values of d per step) is not unrolled: each of its d/4 = 32 steps issues
its 8 ``LDS.128`` (4 rows of Q_i, 4 of K_j) and then, at once, the 64 FFMAs that need them, so every step waits the
full shared-memory latency (~30 cycles) before its first FFMA. The loop of line 10 (Õ += P̃ V_j, 4 columns of P̃
per step) does the same, and inside a step ptxas reuses the same 16 registers for each of the 4 rows of V_j, so
each row's 4 loads also wait in front of their 64 FFMAs. With 254 registers a block of 8 warps fills the SM: two
warps per scheduler cannot cover those waits.

**What changed** (``tiled.make_forward(..., fragments=True)``; same tiles, same shared layout plus one row of
slack): the operands are double-buffered in registers, so the loads of the next step are in flight while the FFMAs
of the current step run —

* line 8: steps come in pairs; step k+1's Q_i and K_j columns are loaded into the second buffer before step k's
  FFMAs, step k+2's into the first before step k+1's;
* line 10: row c+1 of V_j is loaded into the other buffer before row c's FFMAs, and the next 4 columns of P̃ when
  a group of 4 starts. The step is written as four calls of an inlined device function with a constant row index,
  so that every register index is a compile-time constant (as a loop, LLVM did not unroll it and the buffers went
  to local memory: 256 bytes of stack);
* the last prefetch of each loop reads one step past the end, into the rows' padding (Q_i, K_j: columns d … d+3;
  P̃: columns B_c … B_c+3) or one row past V_j: always inside the shared array, never used. Clamping the index
  instead (``min``) made LLVM keep one address per element and lose the 16-byte loads (48 scalar ``LDS``).

ptxas (sm_90), 0 bytes of spills unless noted: d = 128 (32, 8, 4, 4) 254 registers (v5: 254), (16, 16, 4, 2)
capped at 128: 128, (16, 8, 4, 4) capped at 168: 168 with 32 bytes of spills; d = 64 (16, 8, 4, 4) 208 (v5
uncapped: 168), capped at 168: 168, capped at 128: 128 with 4 bytes of spills.

**Prediction** (written before the device run): the instruction count is unchanged, only the exposed shared-load
latency goes. At d = 128 (8 warps, nothing else to hide it) FFMA issue should rise from ~47 % of the SM's peak
(31.3-32.0 TFLOP/s at N ≥ 4096) toward 60-65 %: 38-42 TFLOP/s, past PyTorch eager (34.5-39.0). At d = 64, where
v5 already runs 16 warps, less: +5-10 %.
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
