"""Launching a numba kernel through the CUDA driver, its parameters packed by hand: the host side of a short call.

An ordinary numba call, ``kernel[grid, block, stream, shared](*args)``, types every argument, looks up the compiled
overload and turns every array into its parameter layout, on every call. For a kernel with a handful of arrays
that is hundreds of microseconds of host time — measured on an H100 for the tensor-core forward: 400-830 µs per
call against SDPA's 110-170
(``benchmarks/results/nvidia-h100/tensorcore_launch_overhead_numba_call.json``) — as long as
the GPU spends on a whole attention call at N = 1024, and a decoding step takes tens of microseconds.

:func:`launch` does the same work once per kernel and argument types (compile, load, raise the shared-memory
limit) and then, per call, only packs the parameters and hands them to the driver (``cuda.core.launch``, which
is how numba launches too). The layout it packs is numba's data model for ``types.Array`` of ``ndim`` axes —
every field pointer-sized::

    meminfo, parent            null (a kernel never reads them)
    nitems, itemsize           the element count and the bytes per element
    data                       the device address of element 0
    shape[0 .. ndim-1]         elements per axis
    strides[0 .. ndim-1]       bytes per step along each axis

and scalars as their C types (int32, int64, float32; bool as is).

Arguments are :class:`Buffer` s (a device address with shape and dtype: a PyTorch tensor's memory, seen in any
element type), objects with the same two methods (``params``, ``numba_type``), numba device arrays, NumPy
int32/int64/float32 scalars and bools. On numba's CUDA simulator, or with ``FA2EDU_LEAN_LAUNCH=0``, the call goes
through numba's ordinary launch instead (the GPU tests compare the two paths).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections import OrderedDict

import numpy as np
from numba import cuda

from kernels_gpu import runtime as rt

__all__ = ["Buffer", "Prepared", "PlanCache", "enabled", "launch", "compiled_resources", "resident_blocks",
           "raise_shared_limit", "current_stream", "pdl_available", "MAX_DYNAMIC_BYTES", "allow_cluster",
           "max_active_clusters"]

#: the most dynamic shared memory a block may ask for on sm_90 (227 KiB)
MAX_DYNAMIC_BYTES = 227 * 1024


def enabled() -> bool:
    """Whether :func:`launch` packs parameters itself (on a GPU, unless ``FA2EDU_LEAN_LAUNCH=0``)."""
    return not rt.simulator_in_use() and os.environ.get("FA2EDU_LEAN_LAUNCH", "1") != "0"


def current_stream(device_index: int) -> int:
    """The raw handle of PyTorch's current stream on a CUDA device (PyTorch's own fast accessor where it has one:
    a microsecond, against several for ``torch.cuda.current_stream(device).cuda_stream``)."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


class PlanCache(OrderedDict):
    """The plans of the short roads (:class:`kernels_gpu.tensorcore.launch.ForwardPlan`, the backward's, the
    decoding step's) by key, the most recently used last, at most ``maxsize`` of them: a plan holds its first
    call's packed parameters and buffers, so a program that cycles through more shapes than that pays a first
    call's host time again instead of holding memory without bound. A ``dict`` otherwise."""

    def __init__(self, maxsize: int = 64):
        super().__init__()
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize

    def get(self, key, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


class _Interface:
    """A bare ``__cuda_array_interface__`` (numba's ordinary launch path builds its array from it)."""

    def __init__(self, ptr: int, shape: tuple, dtype: np.dtype, strides):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": np.dtype(dtype).str,
                                         "data": (ptr, False), "version": 3, "strides": strides}


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


class Buffer:
    """A kernel's array parameter: ``shape`` elements of ``dtype`` at device address ``ptr``, C-contiguous unless
    ``strides`` (bytes) says otherwise. ``keep`` holds whatever owns the memory (a tensor) for as long as the
    buffer lives."""

    __slots__ = ("ptr", "shape", "dtype", "strides", "keep", "_array")

    def __init__(self, ptr: int, shape: tuple, dtype, strides: tuple | None = None, keep=None):
        self.ptr = int(ptr)
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        c = _c_strides(self.shape, self.dtype.itemsize)
        self.strides = c if strides is None else tuple(int(s) for s in strides)
        self.keep = keep
        self._array = None

    @classmethod
    def of_torch(cls, t, dtype) -> Buffer:
        """A CUDA tensor's memory seen as elements of ``dtype`` (a NumPy dtype: bfloat16 has none, so 16-bit
        tensors are seen as uint16 or as uint32 words of two); the last axis scales by the ratio of the item sizes,
        as ``Tensor.view(dtype)`` does. A strided tensor keeps its strides (a (B, H, N, d) view of (B, N, H, d)
        memory, say) if its last axis is contiguous and its other strides are whole elements of ``dtype``."""
        dtype, size = np.dtype(dtype), t.element_size()
        shape = tuple(t.shape) or (1,)
        strides = None
        if not t.is_contiguous():
            if t.stride(-1) != 1:                  # (a 0-d tensor is contiguous: never here)
                raise ValueError(f"Buffer.of_torch needs the last axis contiguous (stride 1), got strides "
                                 f"{tuple(t.stride())}")
            strides = tuple(n * size for n in t.stride()[:-1]) + (dtype.itemsize,)
            if any(n % dtype.itemsize for n in strides):
                raise ValueError(f"strides {tuple(t.stride())} of {size}-byte elements are not whole "
                                 f"{dtype.name} elements")
        if dtype.itemsize != size:
            if (shape[-1] * size) % dtype.itemsize:
                raise ValueError(f"a last axis of {shape[-1]} elements of {size} bytes is not a whole number of "
                                 f"{dtype.name} elements")
            shape = shape[:-1] + (shape[-1] * size // dtype.itemsize,)
        return cls(t.data_ptr(), shape, dtype, strides, keep=t)

    @classmethod
    def of_numba(cls, a) -> Buffer:
        """A numba device array's memory (read in place)."""
        return cls(a.device_ctypes_pointer.value or 0, a.shape, a.dtype, a.strides, keep=a)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        return self.strides == _c_strides(self.shape, self.dtype.itemsize)

    def reshape(self, *shape) -> Buffer:
        """The same contiguous memory with another shape (one axis may be -1)."""
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        if not self.contiguous:
            raise ValueError("only a contiguous Buffer can be reshaped")
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {shape}")
        return Buffer(self.ptr, shape, self.dtype, keep=self.keep)

    def numba_type(self):
        from numba.cuda import types
        from numba.cuda.np import numpy_support
        return types.Array(numpy_support.from_dtype(self.dtype), len(self.shape),
                           "C" if self.contiguous else "A")

    def params(self) -> list:
        """The parameter words of numba's array layout (see the module's docstring)."""
        return [0, 0, self.size, self.dtype.itemsize, self.ptr, *self.shape, *self.strides]

    def numba_array(self):
        """The same memory as a numba device array (for numba's ordinary launch)."""
        if self._array is None:
            strides = None if self.contiguous else self.strides
            self._array = cuda.as_cuda_array(_Interface(self.ptr, self.shape, self.dtype, strides), sync=False)
        return self._array


_SCALAR_CTYPES = {np.dtype(np.int64): ctypes.c_int64, np.dtype(np.int32): ctypes.c_int32,
                  np.dtype(np.float32): ctypes.c_float}

#: compiled kernels: (dispatcher, argument types) → (loaded function, numba's compiled kernel)
_COMPILED: dict = {}
#: loaded functions whose dynamic shared-memory limit was raised: id → bytes
_SHARED_LIMIT: dict = {}
#: resident blocks per (kernel, argument types, threads, dynamic shared bytes)
_RESIDENT: dict = {}
#: numba's types per argument signature (types are memoised: typing every call costs host time)
_TYPES: dict = {}
#: cuda.core stream objects per raw stream handle
_STREAMS: dict = {}


def _is_numba_array(a) -> bool:
    return bool(getattr(a, "__cuda_ndarray__", False))


def _signature_key(a):
    if hasattr(a, "params"):
        return (type(a), a.dtype.char, len(a.shape), getattr(a, "contiguous", True))
    if _is_numba_array(a):
        return ("numba", a._numba_type_)
    return type(a)


def _argument_types(args) -> tuple:
    key = tuple(_signature_key(a) for a in args)
    hit = _TYPES.get(key)
    if hit is None:
        hit = _TYPES[key] = tuple(_numba_type(a) for a in args)
    return hit


def _numba_type(a):
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    if hasattr(a, "numba_type"):
        return a.numba_type()
    if _is_numba_array(a):
        return a._numba_type_
    if isinstance(a, (bool, np.bool_)):
        return types.boolean
    if type(a) in (int, float):
        raise TypeError(f"a kernel scalar must be a NumPy int32, int64 or float32 (its C type), got a Python "
                        f"{type(a).__name__}")
    return numpy_support.from_dtype(np.dtype(type(a)))


def _compiled(kernel, argtypes):
    key = (kernel, argtypes)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel.compile(argtypes)
        hit = _COMPILED[key] = (compiled._codelibrary.get_cufunc(), compiled)
    return hit


def compiled_resources(kernel, args) -> dict:
    """Registers, local memory (spill) bytes and static shared memory of ``kernel`` compiled for ``args`` (GPU)."""
    _, compiled = _compiled(kernel, _argument_types(args))
    return dict(registers=compiled.regs_per_thread, local_bytes=compiled.local_mem_per_thread,
                static_shared_bytes=compiled.shared_mem_per_block)


def resident_blocks(kernel, args, threads: int, shared_bytes: int = 0) -> int:
    """Blocks of ``kernel`` (compiled for ``args``) the GPU holds at once: SMs × blocks per SM (the occupancy
    calculator's answer), asked once per kernel and launch shape."""
    argtypes = _argument_types(args)
    key = (kernel, argtypes, threads, shared_bytes)
    if key not in _RESIDENT:
        # Above 48 KiB the occupancy calculator counts a block only once the function may have that much: asked
        # first, it answers 0 blocks.
        raise_shared_limit(kernel, args, shared_bytes)
        _, compiled = _compiled(kernel, argtypes)
        _RESIDENT[key] = max(1, compiled.max_cooperative_grid_blocks(threads, shared_bytes))
    return _RESIDENT[key]


def raise_shared_limit(kernel, args, nbytes: int) -> None:
    """Allow ``nbytes`` of dynamic shared memory (``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``) to
    ``kernel`` compiled for ``args``; a driver call once per compiled kernel, nothing afterwards. Above
    :data:`MAX_DYNAMIC_BYTES` a clear error."""
    if nbytes > MAX_DYNAMIC_BYTES:
        raise ValueError(f"this launch needs {nbytes} bytes of shared memory; a block may have {MAX_DYNAMIC_BYTES}")
    if nbytes <= 48 * 1024 or rt.simulator_in_use():
        return
    cufunc, _ = _compiled(kernel, _argument_types(args))
    if _SHARED_LIMIT.get(id(cufunc), 0) >= nbytes:
        return
    from numba.cuda.cudadrv.driver import binding, driver
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    _SHARED_LIMIT[id(cufunc)] = nbytes


def _dim3(x) -> tuple:
    x = tuple(int(n) for n in x) if isinstance(x, (tuple, list)) else (int(x),)
    return x + (1,) * (3 - len(x))


def _ordinary(a):
    return a.numba_array() if hasattr(a, "numba_array") else a


def _config(grid, block, shared_bytes: int, early: bool, cluster: int = 0):
    """The launch configuration; ``early``: programmatic dependent launch, where this ``cuda.core`` has it;
    ``cluster``: blocks along x per thread-block cluster (0: none)."""
    from cuda.core import LaunchConfig
    extra = {}
    if early and pdl_available():
        extra["programmatic_stream_serialization"] = True
    if cluster:
        extra["cluster"] = (int(cluster), 1, 1)
    return LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes, **extra)


#: the kernels allowed clusters of more than 8 blocks, by id of the compiled function
_CLUSTER_ALLOWED: dict = {}


def allow_cluster(kernel, args, cluster: int) -> None:
    """Let ``kernel`` (compiled for ``args``) be launched in clusters of ``cluster`` blocks: above 8 (the portable
    size) the driver asks for ``CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED``; Hopper takes up to 16.
    Once per compiled kernel."""
    if not 1 <= cluster <= 16:
        raise ValueError(f"a cluster holds 1 to 16 blocks, got {cluster}")
    if cluster <= 8 or rt.simulator_in_use():
        return
    cufunc, _ = _compiled(kernel, _argument_types(args))
    if _CLUSTER_ALLOWED.get(id(cufunc)):
        return
    from numba.cuda.cudadrv.driver import binding, driver
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    driver.cuKernelSetAttribute(attr, 1, cufunc.handle, cufunc.device.id)
    _CLUSTER_ALLOWED[id(cufunc)] = True


def max_active_clusters(kernel, args, grid, block, shared_bytes: int, cluster: int) -> int:
    """How many clusters of ``cluster`` blocks of ``kernel`` (compiled for ``args``, ``block`` threads,
    ``shared_bytes`` of dynamic shared memory) the GPU holds at once — the driver's
    ``cuOccupancyMaxActiveClusters``; 0 where it cannot place one (or has no clusters: before sm_90)."""
    if not enabled() or cuda.get_current_device().compute_capability < (9, 0):
        return 0
    from cuda.bindings import driver as drv
    raise_shared_limit(kernel, args, shared_bytes)
    allow_cluster(kernel, args, cluster)
    cufunc, _ = _compiled(kernel, _argument_types(args))
    err, func = drv.cuKernelGetFunction(cufunc.kernel.handle)
    if err != drv.CUresult.CUDA_SUCCESS:
        return 0
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = _dim3(grid)
    config.blockDimX, config.blockDimY, config.blockDimZ = _dim3(block)
    config.sharedMemBytes = int(shared_bytes)
    config.attrs = [_cluster_attribute(drv, cluster)]
    config.numAttrs = 1
    err, count = drv.cuOccupancyMaxActiveClusters(func, config)
    return int(count) if err == drv.CUresult.CUDA_SUCCESS else 0


def _cluster_attribute(drv, cluster: int):
    attribute = drv.CUlaunchAttribute()
    attribute.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = int(cluster), 1, 1
    return attribute


@functools.lru_cache(maxsize=None)
def pdl_available() -> bool:
    """Whether launches can be made *programmatically dependent* (PDL, sm_90 on): the launch attribute
    ``programmatic_stream_serialization`` of ``cuda.core``'s ``LaunchConfig``, on a device of compute capability 9
    or more, and ``FA2EDU_PDL`` not ``0``. Such a launch may start while the previous kernel on its stream still
    runs — once every block of that kernel has executed ``griddepcontrol.launch_dependents`` or exited — and its
    kernel must execute ``griddepcontrol.wait`` before it reads what the previous kernel wrote
    (:func:`kernels_gpu.ptx.griddep_wait`). What it saves is the gap between two kernels: the second one's
    launch, block scheduling and prologue overlap the first one's last blocks."""
    if not enabled() or os.environ.get("FA2EDU_PDL", "1") == "0":
        return False
    try:
        from cuda.core import LaunchConfig
        LaunchConfig(grid=1, block=32, programmatic_stream_serialization=True)
    except TypeError:
        return False
    return cuda.get_current_device().compute_capability >= (9, 0)


def launch(kernel, grid, block, stream: int, args: tuple, shared_bytes: int = 0, early: bool = False,
           cluster: int = 0) -> None:
    """Launch ``kernel`` (a ``cuda.jit`` dispatcher) on ``grid`` × ``block`` threads with ``shared_bytes`` of
    dynamic shared memory on the stream whose raw handle is ``stream`` (0: numba's default stream).

    ``args``: :class:`Buffer` s and like objects, numba device arrays, NumPy int32/int64/float32 scalars, bools —
    the kernel's parameters in order. The shared-memory limit is raised (once) above 48 KiB. ``early``: a
    programmatic dependent launch where :func:`pdl_available` (the kernel must begin its reads of the previous
    kernel's results with ``griddepcontrol.wait``); an ordinary launch otherwise. ``cluster``: 0, or the blocks
    along x of one thread-block cluster (:func:`allow_cluster`; the driver-level launch only)."""
    grid, block = _dim3(grid), _dim3(block)
    shared_bytes = int(shared_bytes)
    raise_shared_limit(kernel, args, shared_bytes)
    if cluster:
        allow_cluster(kernel, args, cluster)
    if not enabled():
        if cluster:
            raise RuntimeError("a cluster launch needs the driver-level launch (a GPU, FA2EDU_LEAN_LAUNCH not 0)")
        values = [_ordinary(a) for a in args]
        on = 0 if rt.simulator_in_use() or not stream else cuda.external_stream(stream)
        kernel[grid, block, on, shared_bytes](*values)
        return
    from cuda.core import launch as core_launch
    _bind_context()
    argtypes = _argument_types(args)
    cufunc, _ = _compiled(kernel, argtypes)
    params = []
    for a in args:
        if hasattr(a, "params"):
            params += a.params()
        elif _is_numba_array(a):
            params += Buffer.of_numba(a).params()
        elif isinstance(a, (bool, np.bool_)):
            params.append(bool(a))
        else:
            params.append(_SCALAR_CTYPES[np.dtype(type(a))](a))
    core_launch(_core_stream(stream), _config(grid, block, shared_bytes, early, cluster), cufunc.kernel, *params)


_THREAD = threading.local()


def _bind_context() -> None:
    """Make a CUDA context current on the calling thread, once per thread. A launch goes to the driver directly,
    which needs one; a thread that has not used CUDA yet (a ``threading.Thread`` of the user's, before any PyTorch
    CUDA call in it) has none, and its launch would fail with ``CUDA_ERROR_INVALID_CONTEXT``. numba's
    ``current_context`` binds the device's primary context, the one PyTorch and numba share (a thread that already
    has it current, such as autograd's device thread, keeps it)."""
    if not getattr(_THREAD, "bound", False):
        cuda.current_context()
        _THREAD.bound = True


def _core_stream(handle: int):
    stream = _STREAMS.get(handle)
    if stream is None:
        from numba.cuda.cudadrv.driver import ExperimentalStream
        stream = _STREAMS[handle] = ExperimentalStream.from_handle(handle)
    return stream


class Prepared:
    """One launch with everything fixed but the arrays' addresses and the stream: the kernel compiled and loaded,
    its shared-memory limit raised, the launch configuration built, the parameters packed — all once, from the
    arguments of a first call (``args``, as for :func:`launch`). A call, ``prepared(stream, *addresses)``, writes
    one device address per array argument (in their order) into the packed parameters and launches. The arrays
    must have the shapes, dtypes and strides of the first call's — the caller's cache key guarantees it.
    ``early``, ``cluster``: as for :func:`launch`.

    The parameters live in C memory made once — one ctypes object per parameter word, and the array of their
    addresses that the driver's ``cuLaunchKernelEx`` takes (it copies the values when it queues the launch) —, the
    driver's launch configuration is made once per stream, and a call writes the addresses and hands the driver
    the array (``cuda.bindings``). Host time of one launch of the decoding split program (94 parameter words,
    ``benchmarks.profilers.decode_host``, H100, ``decode_host_breakdown.json``): 10.1 µs, of which the driver call alone
    8.3;
    ``cuda.core.launch`` with the same words handed over one by one, 12.9. Calling ``cuLaunchKernelEx`` through
    ctypes with copies of cuda.h's structs instead was no faster (6.7 µs against 5.8 for the bare bindings call and
    8.3 for ``cuda.core``, on another host: ``decode_host_breakdown_ctypes.json``). A lock keeps two threads from
    writing each other's addresses between the writes and the launch."""

    __slots__ = ("kernel", "func", "dims", "early", "words", "pointers", "address", "slot_words", "configs",
                 "lock", "driver", "success", "cluster")

    def __init__(self, kernel, grid, block, args: tuple, shared_bytes: int = 0, early: bool = False,
                 cluster: int = 0):
        if not enabled():
            raise RuntimeError("a Prepared launch needs the driver-level launch (a GPU, FA2EDU_LEAN_LAUNCH not 0)")
        from cuda.bindings import driver
        raise_shared_limit(kernel, args, shared_bytes)
        if cluster:
            allow_cluster(kernel, args, cluster)
        self.cluster = int(cluster)
        cufunc, _ = _compiled(kernel, _argument_types(args))
        words, slots = [], []
        for a in args:
            if _is_numba_array(a):
                a = Buffer.of_numba(a)
            if hasattr(a, "params"):
                slots.append(len(words) + 4)            # the data pointer: after meminfo, parent, nitems, itemsize
                words += [ctypes.c_int64(w) for w in a.params()]      # (every field pointer-sized)
            elif isinstance(a, (bool, np.bool_)):
                words.append(ctypes.c_bool(bool(a)))
            else:
                words.append(_SCALAR_CTYPES[np.dtype(type(a))](a))
        self.kernel = cufunc.kernel                     # cuda.core's Kernel (benchmarks.profilers.decode_host compares)
        self.func = cufunc.kernel.handle                # the loaded kernel, as the driver names it
        self.dims = (_dim3(grid), _dim3(block), int(shared_bytes))
        self.early = bool(early) and pdl_available()
        self.words = words
        self.pointers = (ctypes.c_void_p * len(words))(*[ctypes.addressof(w) for w in words])
        self.address = ctypes.addressof(self.pointers)
        self.slot_words = tuple(words[i] for i in slots)
        self.configs = {}
        self.lock = threading.Lock()
        self.driver, self.success = driver, driver.CUresult.CUDA_SUCCESS

    def _config(self, stream: int):
        """The driver's launch configuration on ``stream`` (a raw handle), made once per stream."""
        drv = self.driver
        config = drv.CUlaunchConfig()
        (config.gridDimX, config.gridDimY, config.gridDimZ), (config.blockDimX, config.blockDimY,
                                                              config.blockDimZ), config.sharedMemBytes = self.dims
        config.hStream = drv.CUstream(stream)
        attributes = []
        if self.early:
            attribute = drv.CUlaunchAttribute()
            attribute.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        if self.cluster:
            attributes.append(_cluster_attribute(drv, self.cluster))
        config.attrs = attributes
        config.numAttrs = len(attributes)
        self.configs[stream] = config
        return config

    def __call__(self, stream: int, *addresses: int) -> None:
        _bind_context()
        config = self.configs.get(stream) or self._config(stream)
        with self.lock:
            for word, address in zip(self.slot_words, addresses):
                word.value = address
            err, = self.driver.cuLaunchKernelEx(config, self.func, self.address, 0)
        if err != self.success:
            _, name = self.driver.cuGetErrorName(err)
            raise RuntimeError(f"cuLaunchKernelEx failed: {name.decode() if name else err!r}")
