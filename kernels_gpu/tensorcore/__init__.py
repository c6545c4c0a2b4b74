"""Tensor-core FlashAttention-2 from Python: numba kernels that issue ``mma.sync`` (f16 and bf16)."""

import kernels_gpu  # noqa: F401  (applies the np.row_stack shim before numba compiles anything)
