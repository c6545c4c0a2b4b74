"""Tensor-core FlashAttention-2 from Python: numba kernels whose bodies are Python and whose matrix products are
``mma.sync`` instructions (f16 and bf16 inputs, f32 accumulators), issued through inline PTX.

A ladder of forward kernels, each rung one file whose header says what it changed, what it predicted before its
first run, and what it measured::

    v1  mma.sync on tiles in shared memory, every operand register a plain shared load, P̃ through shared memory
    v2  ldmatrix (.trans for V): one instruction loads a warp's fragments
    v3  P̃ stays in registers: S's accumulators are P̃·V's A operand (FA2's "keep it on chip", one level down)
    v4  cp.async, double-buffered K/V: the next tile's copy runs under this tile's MMAs
    v5  base-2 softmax with the scale folded into one FMA, Õ rescaled only when the row maximum moves
    v6  the mask tested only on the tiles that can hold a masked key
    v7  two 16-row MMA tiles per warp (B_r = 128): each K and V fragment serves four MMAs instead of two
    v8  the online softmax in float32 throughout (a Python float literal had made it float64)
    v9  the tile copies' index arithmetic computed once per thread, not per 16-byte copy
    v10 the tile shape chosen per head dimension (and v8, v9's changes for d > 128 too)
    v11 causal: the longest row blocks launched first

The backward pass (FA2 Algorithm 2) has its own ladder, ``BACKWARD_VERSIONS`` ("v1", "v2", …; modules
``flash2_backward_v1`` …, with :mod:`~kernels_gpu.tensorcore.backward_steps` and
:mod:`~kernels_gpu.tensorcore.backward_launch`); ``flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None)``
returns ``Flash2Backward(dQ, dK, dV)``.

Beside the ladder: ``PARTITIONING`` maps ``"split-q"`` and ``"split-k"`` to the two forwards that measure FA2
Section 3.3 (FA2's warps splitting Q against FA1's warps splitting K/V and merging through shared memory; same tiles
and loads otherwise; :mod:`~kernels_gpu.tensorcore.traffic` counts their shared-memory bytes), and ``TF32``
maps ``"tf32"`` to :func:`~kernels_gpu.tensorcore.flash2_forward_tf32.flash2_forward_tf32`, a **TF32** forward for
float32 inputs (``mma.m16n8k8`` on operands rounded to 10-bit mantissas: errors ~1e-3, not float32's ~1e-6;
opt-in, never the float32 default), and ``"3xtf32"`` to
:func:`~kernels_gpu.tensorcore.flash2_forward_3xtf32.flash2_forward_3xtf32`, the same kernel with each operand split
into two tf32 values and three MMAs per product: float32's accuracy from the tensor cores (CUTLASS's 3xTF32, what
PyTorch's memory-efficient SDPA runs for float32). ``TF32_BACKWARD`` maps ``"3xtf32"`` to
:func:`~kernels_gpu.tensorcore.flash2_backward_3xtf32.flash2_backward_3xtf32`, FA2's backward in 3xTF32.

``flash2_forward`` is the fastest measured rung; ``VERSIONS`` maps "v1" … to each (same signature)::

    from kernels_gpu import tensorcore
    O, L = tensorcore.flash2_forward(Q, K, V, causal=True)      # Q (…, N_q, d), K, V (…, N_k, d): f16 / bf16

Modules: :mod:`~kernels_gpu.ptx` (the instructions and their simulator twins),
:mod:`~kernels_gpu.fragments` (which lane holds which element: tables and NumPy functions),
:mod:`~kernels_gpu.tensorcore.steps` (the device functions every rung shares), :mod:`~kernels_gpu.tensorcore.launch`
(inputs and outputs). In numba's CUDA simulator every rung runs unchanged (the twins emulate each warp-level
instruction), which is how CI tests them.
"""

import kernels_gpu  # noqa: F401  (applies the np.row_stack shim before numba compiles anything)
from kernels_gpu.tensorcore import (  # noqa: E402
    flash2_forward_v1,
    flash2_forward_v2,
    flash2_forward_v3,
    flash2_forward_v4,
    flash2_forward_v5,
    flash2_forward_v6,
    flash2_forward_v7,
    flash2_forward_v8,
    flash2_forward_v9,
    flash2_forward_v10,
    flash2_forward_v11,
)

#: the forward rungs: name → ``flash2_forward(Q, K, V, causal=False, scale=None) -> Flash2Forward(O, L)``
VERSIONS = {"v1": flash2_forward_v1.flash2_forward, "v2": flash2_forward_v2.flash2_forward,
            "v3": flash2_forward_v3.flash2_forward, "v4": flash2_forward_v4.flash2_forward,
            "v5": flash2_forward_v5.flash2_forward, "v6": flash2_forward_v6.flash2_forward,
            "v7": flash2_forward_v7.flash2_forward, "v8": flash2_forward_v8.flash2_forward,
            "v9": flash2_forward_v9.flash2_forward, "v10": flash2_forward_v10.flash2_forward,
            "v11": flash2_forward_v11.flash2_forward}

#: the fastest measured forward rung (v11: ``benchmarks/results/nvidia-h100/tensorcore_v11.json``)
flash2_forward = flash2_forward_v11.flash2_forward

from kernels_gpu.tensorcore import (  # noqa: E402
    flash2_backward_v1,
    flash2_backward_v2,
    flash2_backward_v3,
    flash2_backward_v4,
    flash2_backward_v5,
    flash2_backward_v6,
    flash2_backward_v7,
)

#: the backward rungs: name → ``flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None) ->
#: Flash2Backward(dQ, dK, dV)`` (v1: FA2 Alg. 2 on mma.sync, dQ by atomic adds; v2: Q_i, dO_i double-buffered;
#: v3: dQ by a second kernel over query blocks, no atomics; v4: causal, the longest blocks first; v5: copies
#: that step their addresses; v6: the key-block kernel's step bookkeeping without divisions or signed indices;
#: v7: Sᵀ and dPᵀ in one loop)
BACKWARD_VERSIONS = {"v1": flash2_backward_v1.flash2_backward, "v2": flash2_backward_v2.flash2_backward,
                     "v3": flash2_backward_v3.flash2_backward, "v4": flash2_backward_v4.flash2_backward,
                     "v5": flash2_backward_v5.flash2_backward, "v6": flash2_backward_v6.flash2_backward,
                     "v7": flash2_backward_v7.flash2_backward}

#: the fastest measured backward rung (v7: v3's sums — 141-155 TFLOP/s at N ≥ 4096 against v2's 101-123 in
#: ``benchmarks/results/nvidia-h100/tensorcore_backward.json`` —, the longest blocks first when causal, +1-11 %
#: in ``tensorcore_backward_v4.json``, copies stepped by constants, 13-23 % less time per kernel in
#: ``tensorcore_backward_tiles_v5.json``, and the key-block kernel's loop without divisions or signed indices and
#: with Sᵀ, dPᵀ in one loop: that kernel 21-28 % faster than v5's in ``tensorcore_backward_tiles_v7.json``)
flash2_backward = flash2_backward_v7.flash2_backward

from kernels_gpu.tensorcore import (  # noqa: E402
    flash2_backward_3xtf32,
    flash2_forward_3xtf32,
    flash2_forward_3xtf32_planes,
    flash2_forward_splitk,
    flash2_forward_splitq,
    flash2_forward_tf32,
)

#: FA2 Section 3.3: the two work partitionings between warps, same signature as ``VERSIONS``' (d ≤ 128)
PARTITIONING = {"split-k": flash2_forward_splitk.flash2_forward, "split-q": flash2_forward_splitq.flash2_forward}

#: tensor-core forwards for float32 inputs (labelled, opt-in): name → ``f(Q, K, V, causal=False, scale=None) ->
#: (O, L)`` whose ``.precision`` names the arithmetic: "tf32" (operands rounded to tf32) or "3xtf32" (each operand
#: split into two tf32 values, three products: float32's accuracy; "3xtf32-planes" splits K and V once per tile)
TF32 = {"tf32": flash2_forward_tf32.flash2_forward_tf32, "3xtf32": flash2_forward_3xtf32.flash2_forward_3xtf32,
        "3xtf32-planes": flash2_forward_3xtf32_planes.flash2_forward_3xtf32_planes}

#: the tensor-core backward for float32 inputs (opt-in): name → ``f(Q, K, V, O, L, dO, causal=False, scale=None) ->
#: Flash2Backward(dQ, dK, dV)``; "3xtf32": FA2 Alg. 2 with every product in 3xTF32 (float32's accuracy)
TF32_BACKWARD = {"3xtf32": flash2_backward_3xtf32.flash2_backward_3xtf32}

__all__ = ["VERSIONS", "flash2_forward", "BACKWARD_VERSIONS", "flash2_backward", "PARTITIONING",
           "TF32", "TF32_BACKWARD"]
