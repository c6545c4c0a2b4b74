"""kernels_gpu: fa2edu's algorithms as numba.cuda kernels, for a real GPU and for numba's CUDA simulator.

The same algorithms as :mod:`fa2edu`, with the same names, keywords and NamedTuple results, now as GPU kernels::

    import kernels_gpu
    # FA1 Alg. 0: S and P in global memory
    O, P = kernels_gpu.standard_attention(Q, K, V, causal=True)
    # FA1 Alg. 1: the K/V-outer loop
    O, l, m = kernels_gpu.flash1_forward(Q, K, V, block_sizes=(64, 32))
    # FA2 Alg. 1: the Q-outer loop, L written once
    O, L = kernels_gpu.flash2_forward(Q, K, V, causal=True)
    # FA2 Alg. 2: atomics on dQ
    dQ, dK, dV = kernels_gpu.flash2_backward(Q, K, V, O, L, dO, causal=True)

Arrays are (..., N, d) float32 with heads on the axis before N (GQA when Q has more heads than K and V). NumPy
arrays are copied to the device and the results come back as NumPy arrays; numba device arrays and anything with
``__cuda_array_interface__`` (PyTorch, CuPy) are used in place, zero-copy, and the results are numba device arrays.

No GPU? Everything runs in numba's CUDA simulator. ``import kernels_gpu`` chooses it by itself on a machine with no
CUDA driver (:func:`fa2edu.simulator.choose`, saying so in one line); elsewhere set ``NUMBA_ENABLE_CUDASIM=1`` in
the environment *before* numba is imported (the test suite does this). ``import kernels_gpu`` itself needs neither
a GPU nor the CUDA toolkit: kernels are compiled on first use, one compiled kernel per tile shape.

Modules: :mod:`kernels_gpu.runtime` (device checks, layouts, interop), :mod:`kernels_gpu.standard`,
:mod:`kernels_gpu.flash1`, :mod:`kernels_gpu.flash2` (the kernels), :mod:`kernels_gpu.counting` (global-memory
traffic counted in the simulator), :mod:`kernels_gpu.sanitize` (one launch of each kernel, for compute-sanitizer),
:mod:`kernels_gpu.inference.decode` and :mod:`kernels_gpu.inference.varlen` (inference: split-KV decoding from a paged
KV cache, packed batches; the decoding program's tiles come by Hopper's copy engine, through the tensor maps of
:mod:`kernels_gpu.tensor_map`), :mod:`kernels_gpu.flex` (FlexAttention's forward on tensor cores: a BlockMask's skipped
blocks never loaded, the user's ``mask_mod`` and ``score_mod`` compiled by numba into the kernel as device functions).
"""

import numpy as _np

from fa2edu import simulator as _simulator

# No CUDA driver here: numba's CUDA simulator, chosen before numba.cuda is imported (it reads the variable once).
_simulator.choose()

# numba-cuda 0.30.4 still calls np.row_stack, which NumPy 2.5 removed: restore it before numba compiles anything.
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack

from kernels_gpu.flash1 import Flash1Forward, flash1_forward  # noqa: E402
from kernels_gpu.flash2 import Flash2Backward, Flash2Forward, flash2_backward, flash2_forward  # noqa: E402
from kernels_gpu.inference.decode import DecodeResult, decode_attention  # noqa: E402
from kernels_gpu.inference.varlen import varlen_attention  # noqa: E402
from kernels_gpu.runtime import NoGPUError, default_block_sizes, simulator_in_use  # noqa: E402
from kernels_gpu.standard import (  # noqa: E402
    StandardBackward,
    StandardForward,
    standard_attention,
    standard_attention_backward,
)

__all__ = [
    "standard_attention", "standard_attention_backward", "flash1_forward", "flash2_forward", "flash2_backward",
    "StandardForward", "StandardBackward", "Flash1Forward", "Flash2Forward", "Flash2Backward",
    "NoGPUError", "default_block_sizes", "simulator_in_use", "decode_attention", "varlen_attention", "DecodeResult",
]
