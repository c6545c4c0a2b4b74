"""Inputs, outputs and launches of the inference kernels (:mod:`kernels_gpu.inference.decode`,
:mod:`kernels_gpu.inference.varlen`).

**Operands.** The kernels read every tensor as a flat 1-D array of its storage, addressed with element strides
that the host passes as integers, so a strided cache (say a ``(B, N, H, d)`` buffer seen as ``(B, H, N, d)``
through a transpose) is read in place. Storage is float32, float16 or bfloat16; numba has no bfloat16 type, so a
16-bit tensor is handed to a kernel as raw bits — ``uint16`` elements (varlen) or ``uint32`` words of two halves
(decode: word w of a row holds elements 2w, low half, and 2w + 1) — and the kernel converts each value to float32
(bfloat16: the bits shifted into the upper half of a float32; float16: ``cvt.f32.f16``). All arithmetic is float32.

Accepted kinds (q, k, v of one call all of one kind and one dtype):

* **PyTorch CUDA tensors** (float32, float16, bfloat16): read in place, results are CUDA tensors, the kernels run
  on PyTorch's current stream without any host synchronisation (so they can be captured in a CUDA graph);
* **numba device arrays** and other objects with ``__cuda_array_interface__`` (float32, float16): read in place,
  results are numba device arrays;
* **NumPy arrays** (float16, float32; float64 is stored as float32) and **PyTorch CPU tensors** (also bfloat16):
  copied to the device and back (how the tests run the kernels in numba's CUDA simulator).

**Launches.** A numba kernel call (``kernel[grid, block](*args)``) types every argument and converts every array
on every call: hundreds of microseconds of host time for a kernel with a dozen arguments, against the tens of
microseconds a decoding step takes on the GPU. :func:`launch` (:func:`kernels_gpu.driver_launch.launch`)
therefore compiles each kernel once per argument types and then hands the driver the kernel's parameters itself —
for a 1-D array numba's own layout, (meminfo, parent, size, itemsize, data, shape, stride) — from pointers and
lengths, through ``cuda.core.launch`` as numba does. ``FA2EDU_LEAN_LAUNCH=0`` makes it use numba's ordinary call
instead (the GPU tests compare the two); the simulator always does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
from numba import cuda, int64, uint64

from kernels_gpu import driver_launch
from kernels_gpu import runtime as rt

__all__ = ["Flat", "Tensor", "Index", "STORAGES", "tensor", "index", "check_kinds", "Outputs", "launch",
           "stream_of", "lean_launch_enabled", "host_bits", "from_bits"]

#: the storage dtypes the inference kernels read and write (arithmetic is float32 for all three)
STORAGES = ("float32", "float16", "bfloat16")

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                 "torch.float64": "float64", "torch.int32": "int32", "torch.int64": "int64"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8}


def lean_launch_enabled() -> bool:
    """The driver-level launch of :func:`launch` (on a GPU, unless ``FA2EDU_LEAN_LAUNCH=0``)."""
    return driver_launch.enabled()


# -- flat arrays: what a kernel parameter is ----------------------------------------------------------------------

@dataclass
class Flat:
    """A kernel's 1-D array parameter: ``n`` elements of ``dtype`` from device address ``ptr``. ``array`` is the
    numba (or simulated) device array when there is one; ``keep`` holds whatever owns the memory."""

    ptr: int
    n: int
    dtype: np.dtype
    array: object = None
    keep: object = None

    @property
    def shape(self) -> tuple:
        return (self.n,)

    def numba_array(self):
        if self.array is None:
            self.array = driver_launch.Buffer(self.ptr, (max(self.n, 1),), self.dtype).numba_array()
        return self.array

    def numba_type(self):
        return driver_launch.Buffer(self.ptr, (self.n,), self.dtype).numba_type()

    def params(self) -> list:
        """numba's layout of a 1-D array parameter (:meth:`kernels_gpu.driver_launch.Buffer.params`)."""
        return driver_launch.Buffer(self.ptr, (self.n,), self.dtype).params()


def _numba_flat(array, dtype=None) -> Flat:
    """A numba (or simulated) device array as a :class:`Flat` of ``dtype`` (a reinterpretation of its bytes)."""
    flat = array.reshape(int(np.prod(array.shape)) if array.size else 0)
    if dtype is not None and np.dtype(dtype) != np.dtype(flat.dtype):
        flat = flat.view(np.dtype(dtype))
    ptr = 0 if rt.simulator_in_use() else int(flat.device_ctypes_pointer.value or 0)
    return Flat(ptr, int(flat.shape[0]), np.dtype(flat.dtype), flat, array)


# -- the caller's tensors ------------------------------------------------------------------------------------------

def _kind(x) -> str:
    module = type(x).__module__
    if module.startswith("torch") and hasattr(x, "is_cuda"):
        return "torch-cuda" if x.is_cuda else "torch-cpu"
    if isinstance(x, np.ndarray):
        return "numpy"
    if getattr(x, "__cuda_ndarray__", False) or hasattr(x, "__cuda_array_interface__"):
        return "device"
    return "other"


@dataclass
class Tensor:
    """One floating tensor of the caller, checked for its kind and dtype (its shape is checked by the caller).

    ``storage``: 'float32', 'float16' or 'bfloat16' (float64 host inputs are stored as float32); ``host``: the
    contiguous NumPy array to copy to the device (16-bit values as ``uint16`` bits), for host kinds; ``ptr``,
    ``strides`` (in elements): the device tensor read in place, for device kinds."""

    name: str
    kind: str                 # "torch-cuda", "device", "numpy", "torch-cpu"
    shape: tuple
    storage: str
    source: object            # the caller's object
    host: np.ndarray | None = None
    ptr: int = 0
    strides: tuple = ()
    device_array: object = None   # numba kinds: the numba array itself

    @property
    def on_device(self) -> bool:
        return self.kind in ("torch-cuda", "device")


def host_bits(x: np.ndarray, storage: str) -> np.ndarray:
    """Host values → the contiguous array a kernel reads: float32, or 16-bit bits as uint16."""
    if storage == "float32":
        with np.errstate(over="ignore"):
            return np.ascontiguousarray(x, dtype=np.float32)
    if storage == "float16":
        return np.ascontiguousarray(x, dtype=np.float16).view(np.uint16)
    return np.ascontiguousarray(x).view(np.uint16)          # bfloat16: already bits


def host_values(t: Tensor) -> np.ndarray:
    """A host operand's values for the checks before its copy: bfloat16 bits decoded to float32, else as given."""
    if t.storage == "bfloat16":
        return (t.host.astype(np.uint32) << 16).view(np.float32)
    return t.host


def from_bits(bits: np.ndarray, storage: str) -> np.ndarray:
    """The inverse of :func:`host_bits` for float32 and float16 (bfloat16 stays bits: only torch can hold it)."""
    if storage == "float16":
        return bits.view(np.float16)
    return bits


def tensor(x, name: str) -> Tensor:
    """Classify a floating operand: kind, storage dtype, and how a kernel will reach it."""
    kind = _kind(x)
    if kind == "torch-cuda" or kind == "torch-cpu":
        dtype = _TORCH_DTYPES.get(str(x.dtype))
        if dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
        if kind == "torch-cuda":
            if dtype == "float64":
                raise TypeError(f"{name} is a float64 CUDA tensor; the kernels store float32, float16 or bfloat16 "
                                f"(convert it on the device first)")
            if rt.simulator_in_use():
                raise TypeError(f"{name} is a CUDA tensor, but numba's CUDA simulator is in use: pass CPU tensors")
            return Tensor(name, kind, tuple(x.shape), dtype, x, ptr=int(x.data_ptr()), strides=tuple(x.stride()))
        import torch
        t = x.detach()
        if dtype == "bfloat16":
            host = t.contiguous().view(torch.int16).numpy().view(np.uint16)
            return Tensor(name, kind, tuple(x.shape), "bfloat16", x, host=host)
        host = t.contiguous().numpy()
        return Tensor(name, kind, tuple(x.shape), "float32" if dtype == "float64" else dtype, x, host=host)
    if kind == "numpy":
        if x.dtype not in (np.float16, np.float32, np.float64):
            raise TypeError(f"{name} must have a floating dtype (float16, float32 or float64), got {x.dtype}")
        return Tensor(name, kind, x.shape, "float16" if x.dtype == np.float16 else "float32", x, host=x)
    if kind == "device":
        dtype = np.dtype(x.dtype)
        if dtype not in (np.float16, np.float32):
            raise TypeError(f"{name} must be float32 or float16 on the device (bfloat16 as a PyTorch tensor), got "
                            f"{dtype}")
        if rt.simulator_in_use():
            array = x
            return Tensor(name, kind, tuple(x.shape), dtype.name, x, device_array=array,
                          strides=tuple(s // dtype.itemsize for s in x.strides))
        array = x if getattr(x, "__cuda_ndarray__", False) else cuda.as_cuda_array(x, sync=False)
        return Tensor(name, kind, tuple(array.shape), dtype.name, x, ptr=int(array.device_ctypes_pointer.value or 0),
                      strides=tuple(s // dtype.itemsize for s in array.strides), device_array=array)
    raise TypeError(f"{name} must be a PyTorch tensor, a numba device array or a NumPy array, got "
                    f"{type(x).__name__}")


def check_kinds(*tensors: Tensor) -> str:
    """All operands of one kind and one storage dtype; returns the kind."""
    kinds = {t.kind for t in tensors}
    if len(kinds) != 1:
        raise TypeError(f"{', '.join(t.name for t in tensors)} must be of one kind (all CUDA tensors, all CPU "
                        f"tensors, all numba device arrays or all NumPy arrays), got "
                        f"{', '.join(f'{t.name}: {t.kind}' for t in tensors)}")
    dtypes = {t.source.dtype if t.kind != "device" else np.dtype(t.source.dtype) for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"{', '.join(t.name for t in tensors)} must share one dtype, got "
                        f"{', '.join(str(t.source.dtype) for t in tensors)}")
    return kinds.pop()


def device_flat(t: Tensor, view: np.dtype, words: bool = False) -> Flat:
    """A device tensor read in place as a flat array of ``view`` elements (its strides stay the caller's)."""
    itemsize = _ITEMSIZE[t.storage]
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)) if 0 not in t.shape else 0
    nbytes = span * itemsize
    view = np.dtype(view)
    if rt.simulator_in_use():
        flat = t.device_array.reshape(int(np.prod(t.shape)))  # simulator: C-contiguous device arrays only
        return Flat(0, flat.shape[0], view, flat.view(view) if view != flat.dtype else flat, t.source)
    return Flat(t.ptr, -(-nbytes // view.itemsize), view, None, t.source)


# -- where a cached key lives (device code, both decoding programs) ------------------------------------------------

@functools.lru_cache(maxsize=None)
def cache_rows(page: int, simulator: bool):
    """A device function ``rows(table, b, h, j, max_pages, num_pages, k_so, k_sh, k_sn, v_so, v_sh, v_sn) ->
    (k_row, v_row)``: the flat element offsets of key j of sequence b, KV head h, in K and in V (strides in the
    kernel's elements). ``page`` = 0: a contiguous cache, row j of [b, h]. ``page`` > 0 (a compile-time constant,
    so the division is a multiply and a shift): PagedAttention — logical page j // page of sequence b is physical
    page ``table[b, j // page]``, clamped into the cache (device tables are not checked by the host: a bad entry
    gives a wrong answer, never a read outside the cache)."""
    jit = cuda.jit(device=True) if simulator else cuda.jit(device=True, forceinline=True)
    PAGE = page

    @jit
    def rows(table, b, h, j, max_pages, num_pages, k_so, k_sh, k_sn, v_so, v_sh, v_sn):
        if PAGE > 0:
            p = j // PAGE
            phys = min(max(int64(table[uint64(b * max_pages + p)]), int64(0)), num_pages - 1)
            return (phys * k_so + h * k_sh + (j - p * PAGE) * k_sn,
                    phys * v_so + h * v_sh + (j - p * PAGE) * v_sn)
        return b * k_so + h * k_sh + j * k_sn, b * v_so + h * v_sh + j * v_sn
    return rows


# -- index arrays (cache_seqlens, block_table, cu_seqlens) ---------------------------------------------------------

@dataclass
class Index:
    """An integer operand: ``host`` (int64 NumPy) when the caller passed host data, else ``flat`` on the device."""

    name: str
    shape: tuple
    host: np.ndarray | None = None
    flat: Flat | None = None
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.int32))


def index(x, name: str, ndim: int) -> Index:
    """An index operand: host (NumPy, list, CPU tensor: checked later by fa2edu's rules) or device (int32/int64,
    C-contiguous, used in place)."""
    kind = _kind(x)
    if kind == "torch-cuda" or (kind == "device" and not rt.simulator_in_use()):
        if kind == "torch-cuda":
            dtype = _TORCH_DTYPES.get(str(x.dtype))
            contiguous = x.is_contiguous()
            shape, ptr = tuple(x.shape), int(x.data_ptr())
        else:
            array = x if getattr(x, "__cuda_ndarray__", False) else cuda.as_cuda_array(x, sync=False)
            dtype, contiguous = np.dtype(array.dtype).name, array.is_c_contiguous()
            shape, ptr = tuple(array.shape), int(array.device_ctypes_pointer.value or 0)
        if dtype not in ("int32", "int64"):
            raise TypeError(f"{name} must hold int32 or int64 on the device, got {x.dtype}")
        if len(shape) != ndim:
            raise ValueError(f"{name} must have {ndim} {'axes' if ndim > 1 else 'axis'}, got shape {shape}")
        if not contiguous:
            raise ValueError(f"{name} must be C-contiguous on the device")
        n = int(np.prod(shape))
        return Index(name, shape, flat=Flat(ptr, n, np.dtype(dtype), None, x), dtype=np.dtype(dtype))
    if kind == "device":                                   # simulator: a simulated device array
        return Index(name, tuple(x.shape), host=np.asarray(x.copy_to_host()))
    if kind == "torch-cpu":
        x = x.numpy()
    return Index(name, tuple(np.shape(x)), host=np.asarray(x))


def upload_index(values: np.ndarray, name: str) -> Flat:
    """Checked host integers → an int32 device array (values must fit)."""
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    if values.size and (values.max() >= 2**31 or values.min() < -2**31):
        raise ValueError(f"{name} has values beyond int32")
    return _numba_flat(cuda.to_device(values.astype(np.int32) if values.size else np.zeros(1, np.int32)))


# -- outputs ---------------------------------------------------------------------------------------------------

class Outputs:
    """Allocates a call's outputs (and scratch) in the caller's kind and hands them back at the end.

    torch-cuda: CUDA tensors (PyTorch's allocator, so a CUDA graph can capture them); device: numba device arrays;
    host kinds: numba device arrays copied back to NumPy arrays or CPU tensors. Fresh outputs are NaN-filled when
    ``kernels_gpu.runtime.poison_outputs`` is set (tests): an element a kernel forgets shows up."""

    def __init__(self, kind: str, device=None):
        self.kind = kind
        self.device = device        # the torch device of torch-cuda inputs

    def empty(self, shape: tuple, storage: str, view: np.dtype | None = None):
        """(user array, Flat for the kernel). ``view``: the element type the kernel sees (16-bit: uint16 or uint32
        bits; default: the storage's own)."""
        shape = tuple(int(s) for s in shape)
        n = int(np.prod(shape))
        if view is None:
            view = np.dtype(np.float32) if storage == "float32" else np.dtype(np.uint16)
        view = np.dtype(view)
        if self.kind == "torch-cuda":
            import torch
            tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[storage]
            out = torch.empty(shape, dtype=tdtype, device=self.device)
            if rt.poison_outputs:
                if storage == "float32":
                    out.fill_(math.nan)
                else:
                    out.view(torch.int16).fill_(-1)                  # 0xFFFF: NaN in float16 and bfloat16
            nbytes = n * _ITEMSIZE[storage]
            return out, Flat(int(out.data_ptr()), nbytes // view.itemsize, view, None, out)
        np_storage = np.float32 if storage == "float32" else np.uint16
        if rt.poison_outputs:
            fill = np.full(shape, np.nan, np.float32) if storage == "float32" else np.full(shape, 0xFFFF, np.uint16)
            array = cuda.to_device(fill)
        else:
            array = cuda.device_array(shape, dtype=np_storage)
        return array, _numba_flat(array, view)

    def finish(self, array, storage: str):
        """A result in the caller's kind (numba arrays of 16-bit bits become float16 arrays or bfloat16 tensors)."""
        if self.kind == "torch-cuda":
            return array
        if self.kind == "device":
            return array if storage == "float32" else array.view(np.float16)
        host = array.copy_to_host()
        if self.kind == "numpy":
            return from_bits(host, storage)
        import torch
        if storage == "float32":
            return torch.from_numpy(host)
        t = torch.from_numpy(host.view(np.int16).copy())
        return t.view(torch.float16 if storage == "float16" else torch.bfloat16)

    def scratch(self, n: int):
        """A float32 work array of ``n`` elements (partial results), never handed back: not poisoned (every
        element a later kernel reads is written first)."""
        n = max(1, int(n))
        if self.kind == "torch-cuda":
            import torch
            out = torch.empty(n, dtype=torch.float32, device=self.device)
            return Flat(int(out.data_ptr()), n, np.dtype(np.float32), None, out)
        return _numba_flat(cuda.device_array(n, dtype=np.float32))


# -- streams and launches ----------------------------------------------------------------------------------------

def stream_of(kind: str, device=None):
    """The stream to launch on: PyTorch's current stream for CUDA tensors (ordered after the work that made the
    inputs, no host synchronisation), else numba's default stream (0)."""
    if kind != "torch-cuda":
        return 0
    import torch
    return int(torch.cuda.current_stream(device).cuda_stream)


#: the launch itself: :mod:`kernels_gpu.driver_launch` (parameters packed by hand, compiled once per types)
launch = driver_launch.launch
compiled_resources = driver_launch.compiled_resources
resident_blocks = driver_launch.resident_blocks
