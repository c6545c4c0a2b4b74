"""numba device allocations through PyTorch's caching allocator, so peak memory is counted one way for all.

kernels_gpu returns numba device arrays and allocates its outputs and intermediates (standard attention's S and
P) through numba. PyTorch's ``max_memory_allocated`` does not see numba's own allocations, so the harness
installs this External Memory Management plugin (numba's documented EMM interface) before numba creates its
context: every ``cuda.device_array`` then comes from ``torch.cuda.caching_allocator_alloc`` and is counted in
PyTorch's statistics beside the PyTorch baselines' tensors.

Poisoning: inside ``poisoned()`` every fresh numba allocation is filled with 0xFF bytes (a NaN in float32 and
float16), so an output element a kernel forgot to write shows up as NaN in the correctness check.
"""

import contextlib
import ctypes

from numba import cuda

_state = {"poison": False}


class TorchNumbaMemoryManager(cuda.GetIpcHandleMixin, cuda.HostOnlyCUDAMemoryManager):
    """numba EMM plugin: device memory from PyTorch's caching allocator (host memory stays numba's)."""

    def initialize(self):
        # mirror numba's own manager: size the pending-deallocation queue of host allocations
        self.deallocations.memory_capacity = self.get_memory_info().total

    def memalloc(self, size):
        import torch
        address = torch.cuda.caching_allocator_alloc(size) if size > 0 else 0

        def free(address=address):
            if address:
                try:
                    torch.cuda.caching_allocator_delete(address)
                except Exception:  # interpreter shutting down: PyTorch may already be gone
                    pass

        memory = cuda.MemoryPointer(self.context, ctypes.c_void_p(address), size, finalizer=free)
        if _state["poison"] and size > 0:
            memory.memset(0xFF)
        return memory

    def get_memory_info(self):
        import torch
        free, total = torch.cuda.mem_get_info()
        return cuda.MemoryInfo(free=free, total=total)

    @property
    def interface_version(self):
        return 1


def install():
    """Route numba's device allocations through PyTorch. Must run before numba creates its CUDA context
    (before the first kernel launch or device array). Returns True when numba's context uses the plugin."""
    cuda.set_memory_manager(TorchNumbaMemoryManager)
    return is_installed()


def is_installed():
    """True when numba's current context allocates through PyTorch (creates the context if needed)."""
    return isinstance(cuda.current_context().memory_manager, TorchNumbaMemoryManager)


@contextlib.contextmanager
def poisoned():
    """Fill every numba allocation made inside the block with NaN bytes."""
    previous = _state["poison"]
    _state["poison"] = True
    try:
        yield
    finally:
        _state["poison"] = previous
