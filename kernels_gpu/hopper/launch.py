"""Inputs and outputs of the Hopper kernels: the tensor-core ladder's (:mod:`kernels_gpu.tensorcore.launch`), plus the
GPU check and the tensor maps of the rungs that copy by TMA.

Accepted inputs, shapes and results are those of the mma.sync ladder: PyTorch float16/bfloat16 tensors (CUDA
tensors in place, on PyTorch's current stream), numba device arrays or NumPy arrays of float16; Q (…, N_q, d), K, V
(…, N_k, d), d a multiple of 8 up to 256, GQA by head mapping. On a GPU that is not sm_90 (Hopper) every rung
raises :class:`HopperRequired`, naming :mod:`kernels_gpu.tensorcore`, which runs the same attention with
``mma.sync`` on any GPU from sm_80.

**Tensor maps.** A rung that copies by TMA takes one ``CUtensorMap`` per input (:mod:`kernels_gpu.tensor_map`): the
tensor's (d, N, heads, batch) geometry in elements, its byte strides, and a box of 64 columns × the tile's rows
(B_r for Q, B_c for K and V), landing with the 128-byte swizzle that wgmma's descriptors read. The copy engine fills
the box's elements past N and past d with zeros: ragged tiles and head dimensions that are not multiples of 64 need
no special case. In numba's simulator the maps are stand-ins (:func:`kernels_gpu.tensor_map.simulated_map`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numba import cuda

import kernels_gpu.runtime as rt
from kernels_gpu import driver_launch
from kernels_gpu.driver_launch import MAX_DYNAMIC_BYTES, Buffer
from kernels_gpu.hopper.steps import shared_bytes
from kernels_gpu.tensorcore import launch as tc_launch

__all__ = ["HopperRequired", "require_hopper", "longest_first", "run", "tensor_maps"]


class HopperRequired(RuntimeError):
    """A Hopper kernel was asked to run on a GPU that is not sm_90."""


def require_hopper() -> None:
    """Raise :class:`HopperRequired` unless the current GPU is sm_90 (in numba's simulator, nothing to check)."""
    if rt.simulator_in_use():
        return
    cc = tuple(cuda.get_current_device().compute_capability)
    if cc[:2] != (9, 0):
        raise HopperRequired(f"kernels_gpu.hopper needs an sm_90 GPU (H100, H200): wgmma, TMA and setmaxnreg exist "
                             f"only there, and this GPU is sm_{cc[0]}{cc[1]}. kernels_gpu.tensorcore runs the same "
                             f"attention with mma.sync on any GPU from sm_80")


def longest_first(cfg, p) -> tuple:
    """The launch grid: causal → (heads, batch, row blocks), the kernel reading row block T_r − 1 − blockIdx.z
    (the longest row blocks first, as mma.sync's v11); otherwise (row blocks, heads, batch)."""
    T_r = -(-p.N_q // cfg.B_r)
    return (p.H_q, p.Z, T_r) if cfg.causal else (T_r, p.H_q, p.Z)


def _geometry(X, rows_box: int, d: int):
    """(sizes, byte strides, box) of a tensor map over X's (Z, H, N, d/2) words: 16-bit elements, innermost first."""
    Z, H, N, _ = X.shape
    st = X.strides
    return (d, N, H, Z), (st[2], st[1], st[0]), (64, rows_box, 1, 1)


def tensor_maps(p, cfg) -> tuple:
    """The tensor maps of Q, K, V for problem ``p`` (:class:`kernels_gpu.tensorcore.launch.Problem`): device arrays of
    16 uint64 words each, in the kind the launch takes."""
    from kernels_gpu import tensor_map
    inputs = [(X, _geometry(X, rows, p.d)) for X, rows in ((p.Q, cfg.B_r), (p.K, cfg.B_c), (p.V, cfg.B_c))]
    if rt.simulator_in_use():
        return tuple(cuda.to_device(tensor_map.simulated_map(X, *geometry)) for X, geometry in inputs)
    ptrs = [X.ptr if isinstance(X, Buffer) else X.device_ctypes_pointer.value for X, _ in inputs]
    encode = lambda: [tensor_map.encode_4d(ptr, 2, *geometry) for ptr, (_, geometry) in zip(ptrs, inputs)]  # noqa: E731
    if p.kind == "torch-cuda":
        # encoded once per (addresses, geometry) and uploaded stream-ordered from pinned memory: a repeated call
        # on the same tensors pays neither the encoding nor a synchronous copy
        key = (tuple(ptrs), tuple(g for _, g in inputs))
        rows = _device_maps().get(key, encode, p.O_user.device)
        return tuple(Buffer.of_torch(r, np.uint64) for r in rows)
    return tuple(cuda.to_device(words) for words in encode())


_MAPS = None
_NO_TRACE = {}


def _no_trace():
    """The trace array of an untraced launch: one uint64 on the current device, never written."""
    key = "simulator" if rt.simulator_in_use() else cuda.get_current_device().id
    if key not in _NO_TRACE:
        _NO_TRACE[key] = cuda.device_array((1, 4, 1, 5), np.uint64)
    return _NO_TRACE[key]


def _device_maps():
    """The tensor maps of the tensors that calls have used (:class:`kernels_gpu.tensor_map.DeviceMaps`)."""
    global _MAPS
    if _MAPS is None:
        from kernels_gpu.tensor_map import DeviceMaps
        _MAPS = DeviceMaps()
    return _MAPS


def run(make_kernel, config_for, Q, K, V, *, causal, scale, maps: bool = False, trace=None, **options):
    """Check the inputs and the GPU, pick the rung's configuration, launch one block per (row block, head, batch)
    (:func:`longest_first`), return ``Flash2Forward(O, L)`` in the caller's kind. ``maps``: the kernel takes the
    tensor maps of Q, K, V as three more parameters, and then a trace array: ``trace`` = (clock, T) with clock
    ``"globaltimer"`` or ``"clock64"`` and T a device array of uint64, (blocks, 4, tiles, 5), that the kernel
    stamps (:data:`kernels_gpu.hopper.steps.TRACE_EVENTS`); without it, a one-element array that is never
    written. Rungs without maps take the mma.sync ladder's short road for repeated calls on PyTorch CUDA tensors
    (:class:`kernels_gpu.tensorcore.launch.ForwardPlan`)."""
    from kernels_gpu.flash2 import Flash2Forward

    if trace is not None and not maps:
        raise ValueError("trace: only the rungs that copy by TMA (h2 and later) take a trace array")
    if not maps:
        def checked(d, dtype, causal_, simulated, **opts):
            require_hopper()
            return config_for(d, dtype, causal_, simulated, **opts)
        return tc_launch.run(make_kernel, checked, lambda cfg: -(-shared_bytes(cfg) // 4), Q, K, V,
                             causal=causal, scale=scale, grid_for=longest_first, **options)
    p = tc_launch.prepare(Q, K, V, causal=causal, scale=scale)
    require_hopper()
    cfg = config_for(p.d, p.dtype, p.causal, rt.simulator_in_use(), **options)
    if trace is not None:
        clock, T = trace
        if tuple(T.shape[1:2]) + tuple(T.shape[3:]) != (4, 5) or T.ndim != 4 or T.dtype != np.uint64:
            raise ValueError(f"trace: T must be a uint64 device array of shape (blocks, 4, tiles, 5), got "
                             f"{T.dtype} {tuple(T.shape)}")
        cfg = dataclasses.replace(cfg, trace=clock)
    else:
        T = _no_trace()
    kernel = make_kernel(cfg)
    nbytes = shared_bytes(cfg)
    if nbytes > MAX_DYNAMIC_BYTES:
        raise ValueError(f"this tile shape needs {nbytes} bytes of shared memory at d = {p.d}; a block may have "
                         f"{MAX_DYNAMIC_BYTES}")
    args = (p.Q, p.K, p.V, p.O, p.L, np.int32(p.N_q), np.int32(p.N_k), np.int32(p.H_q // p.H_kv),
            np.float32(p.scale)) + tensor_maps(p, cfg) + (T,)
    driver_launch.launch(kernel, longest_first(cfg, p), cfg.threads, p.stream, args, nbytes)
    return Flash2Forward(*tc_launch.finish(p))
