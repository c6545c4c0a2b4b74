"""Fast FA2 kernels: numbered versions beside the teaching kernels, each module's header says what changed and
what it measured. ``VERSIONS`` maps a name to its ``flash2_forward(Q, K, V, causal=, scale=, tiling=)``,
``BACKWARD_VERSIONS`` a name to its ``flash2_backward``."""

import kernels_gpu  # noqa: F401  (applies the np.row_stack shim before numba compiles anything)
from kernels_gpu.fast import (
    flash2_backward_v1,
    flash2_backward_v2,
    flash2_backward_v3,
    flash2_backward_v4,
    flash2_forward_v1,
    flash2_forward_v2,
    flash2_forward_v3,
    flash2_forward_v4,
    flash2_forward_v5,
    flash2_forward_v6,
    flash2_forward_v7,
    flash2_forward_v8,
)
from kernels_gpu.fast.tiled import Tiling

VERSIONS = {"v1": flash2_forward_v1.flash2_forward, "v2": flash2_forward_v2.flash2_forward,
            "v3": flash2_forward_v3.flash2_forward, "v4": flash2_forward_v4.flash2_forward,
            "v5": flash2_forward_v5.flash2_forward, "v6": flash2_forward_v6.flash2_forward,
            "v7": flash2_forward_v7.flash2_forward, "v8": flash2_forward_v8.flash2_forward}

#: the fast FA2 backward versions: name → ``flash2_backward(Q, K, V, O, L, dO, causal=, scale=, tiling=)``
BACKWARD_VERSIONS = {"v1": flash2_backward_v1.flash2_backward, "v2": flash2_backward_v2.flash2_backward,
                     "v3": flash2_backward_v3.flash2_backward, "v4": flash2_backward_v4.flash2_backward}

__all__ = ["VERSIONS", "BACKWARD_VERSIONS", "Tiling", "flash2_backward_v1", "flash2_backward_v2",
           "flash2_backward_v3", "flash2_backward_v4", "flash2_forward_v1", "flash2_forward_v2",
           "flash2_forward_v3", "flash2_forward_v4", "flash2_forward_v5", "flash2_forward_v6", "flash2_forward_v7",
           "flash2_forward_v8"]
