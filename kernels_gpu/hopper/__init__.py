"""FlashAttention-3 in Python: FA2's forward on Hopper's machinery — warpgroup MMA (``wgmma``) reading shared memory,
the Tensor Memory Accelerator (TMA) with ``mbarrier`` completion, warp specialisation — as numba kernels whose
instructions are inline PTX (:mod:`kernels_gpu.ptx`, layouts in :mod:`kernels_gpu.wgmma_layout`).

A ladder of forward rungs, each one file whose header gives its prediction (written before its first GPU run),
its measurement and the reason for any miss::

    h1  one warpgroup per block; S = QKᵀ and O += PV on wgmma (Q, K, V from shared memory, P from registers);
        tiles copied by cp.async into 128-byte swizzled panels, two stages
    h2  two consumer warpgroups (B_r = 128) sharing each K/V tile; tiles copied by TMA into a ring of stages,
        each with an mbarrier the copy engine completes
    h3  warp specialisation: a producer warpgroup that only issues TMA copies (one elected thread), two consumer
        warpgroups that only compute, registers moved to them with setmaxnreg, stages released through "empty"
        mbarriers
    h4  ping-pong: the two consumers take turns on the tensor cores (two named barriers), one's softmax under the
        other's S = QKᵀ
    h5  h4 with the softmax compiled twice, with and without the column mask, so that the tiles no mask touches
        test nothing (h3 and h4 computed the 64 column masks of every tile: their SASS,
        ``benchmarks.profilers.hopper_sass``)
    h6  intra-warpgroup overlap: each consumer issues S_ij and the PV product of tile j − 1 before the softmax of
        tile j, which runs under that product (its rescale of Õ deferred until the product is done)

and, on float8 (FA3 Section 3.3)::

    fp8 h2's kernel with both products on the FP8 tensor cores (``wgmma m64nNk32 .e4m3``): e4m3 Q, K, V, each V
        tile transposed in shared memory (the 8-bit wgmma reads K-major operands only), P̃ = 2⁸·exp(S − m)
        rounded to e4m3 in registers, the descales folded into the softmax scale and the output; O bfloat16
        (``flash_forward_fp8``; not yet measured on a GPU)

and a backward ladder (FA2 Algorithm 2)::

    b1  two consumer warpgroups per key block of 128; Sᵀ, dPᵀ, dV, dK and dQ's share on wgmma (dS transposed
        through shared memory); dQ by float32 atomic adds, or (``deterministic=True``) in a pass of its own over
        query blocks; cp.async copies waited for at once; d ≤ 128
    b2  b1 with dQ's share a 64-column panel at a time and added by red.global.add.v4, and the loop's addresses
        recomputed per row block: b1's SASS spills (824 bytes of loads a thread at d = 128), b2's 20
    b3  b2 with Q_i, dO_i, L_i, D_i copied by TMA into a ring of two stages (full and empty mbarriers), the next
        row block's copies issued by one thread before this row block's products, so that they run under them

``flash_forward`` is the fastest measured rung; ``VERSIONS`` maps "h1" … to each (same signature);
``BACKWARD_VERSIONS`` maps "b1" … to the backward rungs and ``flash_backward`` is the newest (not yet measured)::

    from kernels_gpu import hopper
    O, L = hopper.flash_forward(Q, K, V, causal=True)     # Q (…, N_q, d), K, V (…, N_k, d): f16 / bf16
    dQ, dK, dV = hopper.flash_backward(Q, K, V, O, L, dO, causal=True)
    O, L = hopper.flash_forward_fp8(Q8, K8, V8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)

Inputs, outputs, head dimensions (multiples of 8 up to 256), GQA, bottom-right causal masking and fully masked rows
are those of :mod:`kernels_gpu.tensorcore`. On a GPU that is not sm_90 every rung raises
:class:`~kernels_gpu.hopper.launch.HopperRequired`. In numba's CUDA simulator every rung runs unchanged (the
twins of :mod:`kernels_gpu.ptx` emulate wgmma, the TMA and the barriers), which is how CI tests them.
"""

import kernels_gpu  # noqa: F401  (applies the np.row_stack shim before numba compiles anything)
from kernels_gpu.hopper import (  # noqa: E402
    flash_backward_b1,
    flash_backward_b2,
    flash_backward_b3,
    flash_forward_fp8,
    flash_forward_h1,
    flash_forward_h2,
    flash_forward_h3,
    flash_forward_h4,
    flash_forward_h5,
    flash_forward_h6,
)
from kernels_gpu.hopper.launch import HopperRequired  # noqa: E402

__all__ = ["VERSIONS", "flash_forward", "BACKWARD_VERSIONS", "flash_backward", "HopperRequired", "flash_forward_fp8"]

#: the forward rungs: name → ``flash_forward(Q, K, V, causal=False, scale=None) -> Flash2Forward(O, L)``
VERSIONS = {"h1": flash_forward_h1.flash_forward, "h2": flash_forward_h2.flash_forward,
            "h3": flash_forward_h3.flash_forward, "h4": flash_forward_h4.flash_forward,
            "h5": flash_forward_h5.flash_forward, "h6": flash_forward_h6.flash_forward}

#: the fastest measured rung: h5 (``benchmarks/results/nvidia-h200/hopper_forward_{bf16,fp16}.json``, 2026-12-02:
#: at bf16 non-causal, N = 4096-16384, h5 beats h2 by 5-9 % at d = 64 and 128 and by 6-14 % at d = 256; h6 ties h5
#: at d = 128 and loses 30 % at d = 256)
flash_forward = flash_forward_h5.flash_forward

#: the backward rungs: name → ``flash_backward(Q, K, V, O, L, dO, causal=False, scale=None) -> Flash2Backward``
BACKWARD_VERSIONS = {"b1": flash_backward_b1.flash_backward, "b2": flash_backward_b2.flash_backward,
                     "b3": flash_backward_b3.flash_backward}

#: the backward rung the ladder has reached (b3; no backward rung has run on a GPU yet, so the op keeps the mma.sync
#: backward)
flash_backward = flash_backward_b3.flash_backward

#: the FP8 forward (FA3 §3.3): ``flash_forward_fp8(Q, K, V, causal=False, scale=None, descale_q=None,
#: descale_k=None, descale_v=None, incoherent=True) -> Flash2Forward(O, L)`` on float8 e4m3 inputs, O in bfloat16
flash_forward_fp8 = flash_forward_fp8.flash_forward_fp8
