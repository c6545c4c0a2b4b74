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

__all__ = ["HopperRequired", "require_hopper", "longest_first", "run", "tensor_maps", "run_fp8", "prepare_fp8",
           "Fp8Problem"]


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


def tensor_maps(p, cfg, width: int | None = None) -> tuple:
    """The tensor maps of Q, K, V for problem ``p`` (:class:`kernels_gpu.tensorcore.launch.Problem`): device arrays of
    16 uint64 words each, in the kind the launch takes. ``width``: a row's length in 16-bit units (default ``p.d``;
    the FP8 rung's rows of d bytes are d/2 of them — the copy engine moves bytes, whatever they mean)."""
    from kernels_gpu import tensor_map
    width = p.d if width is None else width
    inputs = [(X, _geometry(X, rows, width)) for X, rows in ((p.Q, cfg.B_r), (p.K, cfg.B_c), (p.V, cfg.B_c))]
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


# -- the FP8 rung: float8 e4m3 in, bfloat16 out --------------------------------------------------------------------

@dataclasses.dataclass
class Fp8Problem:
    """One FP8 attention problem as the kernel sees it: Q, K, V as (Z, H, N, d/4) uint32 words of e4m3 codes, O as
    (Z, H_q, N_q, d/2) words of bfloat16 pairs, L (Z, H_q, N_q) float32, the descales (Z, H) float32."""

    Q: object
    K: object
    V: object
    O: object
    L: object
    descale_q: object
    descale_k: object
    descale_v: object
    kind: str                # "torch-cuda", "torch-cpu", "numba", "numpy"
    Z: int
    H_q: int
    H_kv: int
    N_q: int
    N_k: int
    d: int
    scale: float
    causal: bool
    lead: tuple
    O_user: object = None
    L_user: object = None
    stream: int = 0


def _fp8_kind(x, name: str) -> str:
    torch = tc_launch._torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} must be float8 e4m3 (torch.float8_e4m3fn: make it with "
                            f"fa2edu.torch.quantize_fp8), got {x.dtype}")
        return "torch-cuda" if x.is_cuda else "torch-cpu"
    if getattr(x, "__cuda_ndarray__", False) or (isinstance(x, np.ndarray) and type(x) is np.ndarray):
        if np.dtype(x.dtype) != np.uint8:
            raise TypeError(f"{name} must hold float8 e4m3 codes: a torch.float8_e4m3fn tensor, or a NumPy/numba "
                            f"array of uint8 bit patterns (fa2edu.fp8.quantize_fp8(...).codes), got dtype {x.dtype}")
        return "numba" if getattr(x, "__cuda_ndarray__", False) else "numpy"
    raise TypeError(f"{name} must be a torch.float8_e4m3fn tensor, or a NumPy or numba array of uint8 e4m3 codes, "
                    f"got {type(x).__name__}")


def _check_fp8_shapes(Q, K, V) -> None:
    sq, sk, sv = (tuple(x.shape) for x in (Q, K, V))
    if not len(sq) == len(sk) == len(sv):
        raise ValueError(f"Q, K, V must have the same number of axes, got shapes {sq}, {sk}, {sv}")
    for x, name in ((sq, "Q"), (sk, "K"), (sv, "V")):
        tc_launch._shape4(x, name)
    if sk[-1] != sq[-1] or sv[-1] != sq[-1]:
        raise ValueError(f"K and V must have Q's head dimension d = {sq[-1]} (flash_forward_fp8 takes d_v = d), "
                         f"got K {sk} and V {sv}")
    if sv[:-1] != sk[:-1]:
        raise ValueError(f"V must have K's leading axes and N_k rows {sk[:-1]}, got {sv}")
    if len(sq) >= 3:
        if sq[:-3] != sk[:-3]:
            raise ValueError(f"Q and K must have the same batch axes, got {sq[:-3]} and {sk[:-3]}")
        if sq[-3] % sk[-3]:
            raise ValueError(f"the number of query heads H_q = {sq[-3]} must be a multiple of the number of "
                             f"key/value heads H_kv = {sk[-3]} (GQA/MQA)")
    d = sq[-1]
    if d % 16 or not 16 <= d <= 256:
        raise ValueError(f"Q's head dimension d = {d}: flash_forward_fp8 takes multiples of 16 from 16 to 256 "
                         f"(64, 128 and 256 among them: a row of e4m3 codes must be whole 16-byte chunks); pad Q, K "
                         f"and V with zero columns to the next multiple of 16")


def _descale(x, name: str, lead: tuple, kind: str, device=None):
    """A descale as a (Z, H) float32 array in the launch's kind: ``None`` → ones; otherwise a float32 array or tensor
    of exactly the shape ``lead`` (its tensor's leading axes), positive and finite where it can be read without
    a device synchronisation."""
    torch = tc_launch._torch()
    Z = int(np.prod(lead[:-1])) if len(lead) > 1 else 1
    H = lead[-1] if lead else 1
    if x is None:
        if kind == "torch-cuda":
            return torch.ones((Z, H), dtype=torch.float32, device=device)
        return cuda.to_device(np.ones((Z, H), np.float32))
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (one descale per (batch, head)), got {x.dtype}")
        if tuple(x.shape) != tuple(lead):
            raise ValueError(f"{name} must have shape {tuple(lead)} (one descale per (batch, head) of its tensor; "
                             f"block descales run on fa2edu.fp8's NumPy path), got {tuple(x.shape)}")
        if kind == "torch-cuda":
            if x.device != device:
                raise ValueError(f"{name} must be on the inputs' device {device}, got {x.device}")
            return x.contiguous().reshape(Z, H)
        host = x.detach().cpu().numpy()
    elif isinstance(x, np.ndarray) or getattr(x, "__cuda_ndarray__", False):
        host = x.copy_to_host() if getattr(x, "__cuda_ndarray__", False) else x
        if np.dtype(host.dtype) != np.float32:
            raise TypeError(f"{name} must be float32 (one descale per (batch, head)), got {host.dtype}")
        if tuple(host.shape) != tuple(lead):
            raise ValueError(f"{name} must have shape {tuple(lead)} (one descale per (batch, head) of its tensor; "
                             f"block descales run on fa2edu.fp8's NumPy path), got {tuple(host.shape)}")
    else:
        raise TypeError(f"{name} must be None, a float32 torch tensor or a float32 NumPy array, got "
                        f"{type(x).__name__}")
    if kind == "torch-cuda":
        raise ValueError(f"{name} must be a CUDA tensor on the inputs' device {device}, got a host array")
    if not (np.isfinite(host).all() and (host > 0).all()):
        raise ValueError(f"{name} must be positive and finite (a descale is amax / 448 of its tensor)")
    return cuda.to_device(np.ascontiguousarray(host, dtype=np.float32).reshape(Z, H))


def prepare_fp8(Q, K, V, *, causal, scale, descale_q, descale_k, descale_v, incoherent) -> Fp8Problem:
    """Check the FP8 inputs and return them as an :class:`Fp8Problem` with fresh outputs (poisoned when
    ``kernels_gpu.runtime.poison_outputs`` is set)."""
    from fa2edu.validation import check_scale
    rt.require_device()
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(incoherent, (bool, np.bool_)):
        raise TypeError(f"incoherent must be a bool (whether quantize_fp8 rotated Q and K), got "
                        f"{type(incoherent).__name__}")
    kinds = [_fp8_kind(x, n) for x, n in ((Q, "Q"), (K, "K"), (V, "V"))]
    if len(set(kinds)) != 1:
        raise TypeError(f"Q, K, V must be of one kind (all torch.float8_e4m3fn CUDA tensors, all CPU tensors, all "
                        f"numba device arrays or all NumPy arrays of codes), got {kinds}")
    kind = kinds[0]
    _check_fp8_shapes(Q, K, V)
    Z, H_q, N_q, d = tc_launch._shape4(tuple(Q.shape), "Q")
    _, H_kv, N_k, _ = tc_launch._shape4(tuple(K.shape), "K")
    tau = float(check_scale(scale, d))
    lead = tuple(Q.shape[:-2])
    kv_lead = tuple(K.shape[:-2])
    shapes = ((Z, H_q, N_q, d), (Z, H_kv, N_k, d), (Z, H_kv, N_k, d))
    common = dict(kind=kind, Z=Z, H_q=H_q, H_kv=H_kv, N_q=N_q, N_k=N_k, d=d, scale=tau, causal=bool(causal),
                  lead=lead)
    if kind == "torch-cuda":
        torch = tc_launch._torch()
        if rt.simulator_in_use():
            raise TypeError("CUDA tensors cannot run in numba's CUDA simulator: pass CPU tensors there")
        for x, name in ((K, "K"), (V, "V")):
            if x.device != Q.device:
                raise ValueError(f"Q, K, V must be on one device, got Q on {Q.device} and {name} on {x.device}")
        dev = Q.device
        ds = [_descale(x, n, ld, kind, dev) for x, n, ld in ((descale_q, "descale_q", lead),
                                                             (descale_k, "descale_k", kv_lead),
                                                             (descale_v, "descale_v", kv_lead))]
        q, k, v = (x.reshape(sh).contiguous() for x, sh in zip((Q, K, V), shapes))
        O_user = torch.empty((Z, H_q, N_q, d), dtype=torch.bfloat16, device=dev)
        L_user = torch.empty((Z, H_q, N_q), dtype=torch.float32, device=dev)
        if rt.poison_outputs:
            O_user.view(torch.int16).fill_(-1)
            L_user.fill_(float("nan"))
        stream = driver_launch.current_stream(dev.index)
        words = [Buffer.of_torch(x.view(torch.uint8), np.uint32) for x in (q, k, v)]
        return Fp8Problem(*words, Buffer.of_torch(O_user, np.uint32), Buffer.of_torch(L_user, np.float32),
                          *(Buffer.of_torch(x, np.float32) for x in ds), O_user=O_user, L_user=L_user,
                          stream=stream, **common)
    ds = [_descale(x, n, ld, kind) for x, n, ld in ((descale_q, "descale_q", lead), (descale_k, "descale_k", kv_lead),
                                                    (descale_v, "descale_v", kv_lead))]
    if kind == "torch-cpu":
        torch = tc_launch._torch()
        host = [x.detach().contiguous().view(torch.uint8).numpy() for x in (Q, K, V)]
    elif kind == "numpy":
        host = [np.asarray(x) for x in (Q, K, V)]
    else:
        host = None
    if host is not None:
        words = [cuda.to_device(np.ascontiguousarray(x).reshape(sh).view(np.uint32)) for x, sh in zip(host, shapes)]
    else:
        words = [x.reshape(*sh).view(np.uint32) for x, sh in zip((Q, K, V), shapes)]
    if rt.poison_outputs:
        O = cuda.to_device(np.full((Z, H_q, N_q, d // 2), 0xFFFFFFFF, dtype=np.uint32))
        L = cuda.to_device(np.full((Z, H_q, N_q), np.nan, dtype=np.float32))
    else:
        O = cuda.device_array((Z, H_q, N_q, d // 2), dtype=np.uint32)
        L = cuda.device_array((Z, H_q, N_q), dtype=np.float32)
    return Fp8Problem(*words, O, L, *ds, **common)


def finish_fp8(p: Fp8Problem):
    """``(O, L)`` in the caller's kind and leading axes: O bfloat16 (torch), float32 holding bfloat16 values
    (NumPy), uint16 bfloat16 patterns (numba); L float32."""
    lead = p.lead
    if p.kind == "torch-cuda":
        return p.O_user.reshape(lead + (p.N_q, p.d)), p.L_user.reshape(lead + (p.N_q,))
    if p.kind == "numba":
        return p.O.view(np.uint16).reshape(lead + (p.N_q, p.d)), p.L.reshape(lead + (p.N_q,))
    bits = p.O.copy_to_host().view(np.uint16).reshape(lead + (p.N_q, p.d))
    L = p.L.copy_to_host().reshape(lead + (p.N_q,))
    if p.kind == "numpy":
        from kernels_gpu.ptx import bf16_bits_to_f32
        return bf16_bits_to_f32(bits), L
    torch = tc_launch._torch()
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16), torch.from_numpy(L.copy())


def run_fp8(make_kernel, config_for, Q, K, V, *, causal, scale, descale_q, descale_k, descale_v, incoherent,
            **options):
    """:func:`run` for the FP8 rung: check the e4m3 inputs and their descales, pick the configuration, build the
    tensor maps (rows of d bytes as d/2 16-bit units), launch one block per (row block, head, batch), return
    ``Flash2Forward(O, L)``."""
    from kernels_gpu.flash2 import Flash2Forward
    from kernels_gpu.hopper.fp8_steps import shared_bytes as fp8_shared_bytes

    p = prepare_fp8(Q, K, V, causal=causal, scale=scale, descale_q=descale_q, descale_k=descale_k,
                    descale_v=descale_v, incoherent=incoherent)
    require_hopper()
    cfg = config_for(p.d, p.causal, rt.simulator_in_use(), **options)
    kernel = make_kernel(cfg)
    nbytes = fp8_shared_bytes(cfg)
    if nbytes > MAX_DYNAMIC_BYTES:
        raise ValueError(f"this tile shape needs {nbytes} bytes of shared memory at d = {p.d}; a block may have "
                         f"{MAX_DYNAMIC_BYTES}")
    args = (p.Q, p.K, p.V, p.O, p.L, np.int32(p.N_q), np.int32(p.N_k), np.int32(p.H_q // p.H_kv),
            np.float32(p.scale), p.descale_q, p.descale_k, p.descale_v) + tensor_maps(p, cfg, width=p.d // 2)
    driver_launch.launch(kernel, longest_first(cfg, p), cfg.threads, p.stream, args, nbytes)
    return Flash2Forward(*finish_fp8(p))
