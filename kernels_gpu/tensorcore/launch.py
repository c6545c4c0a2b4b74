"""Inputs and outputs of the tensor-core kernels: 16-bit tensors in, seen by the kernels as 32-bit words.

A tensor-core operand register holds two 16-bit values, and the kernels move data in 32-bit words (or 16-byte
groups of them), never in single halves. So every 16-bit tensor (…, N, d) reaches a kernel as a ``uint32`` view
(…, N, d/2) of the same memory — word w of a row holds columns 2w (low half) and 2w + 1 (high half) — and the
kernel is compiled for the element type, ``"float16"`` or ``"bfloat16"`` (numba has no bfloat16 arrays; the
view makes that irrelevant).

Accepted inputs (all three of Q, K, V of one kind, one dtype):

* PyTorch tensors of dtype float16 or bfloat16. CUDA tensors are used in place (zero-copy: the kernels get their
  addresses as :class:`~kernels_gpu.driver_launch.Buffer` s of uint32 words), strided ones too — a (B, H, N, d)
  view of a (B, N, H, d) projection is read where it lies — as long as their last axis is contiguous and their
  rows 16-byte aligned (:func:`zero_copy`; others are copied first). O comes back as a CUDA tensor of the input
  dtype laid out like Q (:func:`empty_like_layout`: contiguous for a contiguous Q, (B, N, H, d) in memory for the
  view above, as SDPA's flash and cuDNN kernels lay out theirs), L as a contiguous float32 tensor. The launch goes to
  PyTorch's current stream with no host synchronisation, through :func:`kernels_gpu.driver_launch.launch` — the
  parameters packed by hand, not numba's per-call typing (tens of microseconds of host time, not hundreds).
  CPU tensors are copied (how the tests run the kernels in numba's CUDA simulator) and the results come back as
  CPU tensors.
* numba device arrays of float16 (results: numba device arrays);
* NumPy arrays of float16 (copied in and out).

Shapes: Q (…, N_q, d), K and V (…, N_k, d) with the same d (``d_v = d``); heads on the axis before N; GQA/MQA
when Q has more heads than K and V (query head h reads key/value head h // (H_q / H_kv)). d must be a multiple
of 8, at most 256 (a 16-byte row chunk is 8 halves).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

import kernels_gpu.runtime as rt
from fa2edu.validation import check_scale
from kernels_gpu import driver_launch
from kernels_gpu.driver_launch import MAX_DYNAMIC_BYTES, Buffer

__all__ = ["Problem", "prepare", "finish", "run", "ForwardPlan", "Layout", "View", "DTYPES", "MAX_HEAD_DIM",
           "MAX_DYNAMIC_BYTES", "zero_copy", "layout_order", "layout_strides", "empty_like_layout"]

DTYPES = ("float16", "bfloat16")
MAX_HEAD_DIM = 256


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional dependency
        return None
    return torch


def _is_torch(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _dtype_name(x) -> str:
    if _is_torch(x):
        return str(x.dtype).replace("torch.", "")
    return np.dtype(getattr(x, "dtype", np.float64)).name


@dataclass
class Problem:
    """One attention problem as the kernels see it (4-D uint32 views) and how to hand results back."""

    Q: object            # (Z, H_q, N_q, d/2) uint32 on the device (a Buffer for CUDA tensors, else a numba array)
    K: object            # (Z, H_kv, N_k, d/2)
    V: object            # (Z, H_kv, N_k, d/2)
    O: object            # (Z, H_q, N_q, d/2) uint32 output
    L: object            # (Z, H_q, N_q) float32 output
    dtype: str           # "float16" or "bfloat16"
    kind: str            # "torch-cuda", "torch-cpu", "numba", "numpy"
    Z: int
    H_q: int
    H_kv: int
    N_q: int
    N_k: int
    d: int
    scale: float
    causal: bool
    lead: tuple          # the caller's leading axes of Q
    O_user: object = None   # the caller-kind array that O is a view of (torch-cuda), if any
    L_user: object = None
    stream: int = 0         # the raw handle of the stream to launch on: PyTorch's current one for CUDA tensors, else 0


def zero_copy(x) -> bool:
    """Whether a CUDA tensor can reach the kernels as it lies: last axis contiguous, and every row and the first
    element 16-byte aligned (``cp.async`` copies 16 bytes from 16-byte aligned addresses)."""
    size = x.element_size()
    return (x.dim() > 0 and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all((n * size) % 16 == 0 for n in x.stride()[:-1]))


def _kernel_view(x):
    """``x`` itself when the kernels can read it in place (:func:`zero_copy`), else a contiguous copy."""
    return x if zero_copy(x) else x.contiguous()


def layout_order(x) -> list:
    """x's axes from the largest stride to the smallest, the last axis kept last (the kernels' rows are
    contiguous); axes of equal stride (size 1) keep their order."""
    strides = x.stride()
    try:
        return list(_order(strides))
    except TypeError:       # symbolic strides (FakeTensors under dynamic shapes, as torch.compile traces) do not hash
        return list(_order.__wrapped__(strides))


@functools.lru_cache(maxsize=1024)
def _order(strides: tuple) -> tuple:
    lead = sorted(range(len(strides) - 1), key=lambda i: (-strides[i], i))
    return tuple(lead) + (len(strides) - 1,)


def layout_strides(x, shape=None) -> tuple:
    """The strides (elements) of :func:`empty_like_layout` (x, shape), without allocating it."""
    order, shape = tuple(layout_order(x)), tuple(x.shape) if shape is None else tuple(shape)
    try:
        return _strides_in_order(order, shape)
    except TypeError:       # symbolic sizes
        return _strides_in_order.__wrapped__(order, shape)


@functools.lru_cache(maxsize=1024)
def _strides_in_order(order: tuple, shape: tuple) -> tuple:
    strides, step = [0] * len(shape), 1
    for i in reversed(order):
        strides[i] = step
        step *= max(int(shape[i]), 1)
    return tuple(strides)


def empty_like_layout(x, shape=None, dtype=None):
    """An empty dense tensor on x's device, of ``shape`` and ``dtype`` (x's by default), whose axes lie in memory in
    the order of x's (:func:`layout_order`): contiguous when x is, (B, N, H, d) in memory when x is a (B, H, N, d)
    view of a (B, N, H, d) projection — the layout SDPA's flash and cuDNN kernels give their outputs, so that the
    caller's ``transpose(1, 2).reshape(B, N, H·d)`` of O costs no copy."""
    return Layout(x, shape, dtype).empty()


class Layout:
    """How to make a tensor of ``shape`` (``like``'s by default) and ``dtype`` laid out like ``like``
    (:func:`empty_like_layout`), worked out once — the shape to allocate and the permutation back (None when the
    axes are in order) — so that a plan makes one on every call with ``empty()``."""

    __slots__ = ("alloc", "perm", "dtype", "device")

    def __init__(self, like, shape=None, dtype=None):
        shape = tuple(like.shape) if shape is None else tuple(shape)
        order = layout_order(like)
        self.alloc = [shape[i] for i in order]
        perm = [order.index(i) for i in range(len(order))]
        self.perm = None if perm == sorted(perm) else perm
        self.dtype, self.device = like.dtype if dtype is None else dtype, like.device

    def empty(self):
        t = _torch().empty(self.alloc, dtype=self.dtype, device=self.device)
        return t if self.perm is None else t.permute(self.perm)


class View:
    """How a plan turns a call's tensor into the kernels' 4-axis view, worked out once from a first call's tensor
    of the same shape, strides, dtype and 16-byte alignment (what a plan's key fixes): reshape it unless it has
    the kernels' shape already, and copy it unless the kernels can read it in place (:func:`zero_copy`)."""

    __slots__ = ("shape", "reshape", "copy")

    def __init__(self, x, shape: tuple):
        self.shape, self.reshape = tuple(shape), tuple(x.shape) != tuple(shape)
        self.copy = not zero_copy(x.reshape(shape))

    def __call__(self, x):
        if self.reshape:
            x = x.reshape(self.shape)
        return x.contiguous() if self.copy else x


def _shape4(shape: tuple, name: str) -> tuple:
    if len(shape) < 2:
        raise ValueError(f"{name} must have shape (..., N, d) with at least 2 axes, got shape {shape}")
    if 0 in shape:
        raise ValueError(f"{name} must not be empty, got shape {shape}")
    H = shape[-3] if len(shape) >= 3 else 1
    Z = int(np.prod(shape[:-3])) if len(shape) > 3 else 1
    return Z, H, shape[-2], shape[-1]


def _check_shapes(Q, K, V) -> None:
    sq, sk, sv = (tuple(x.shape) for x in (Q, K, V))
    if not len(sq) == len(sk) == len(sv):
        raise ValueError(f"Q, K, V must have the same number of axes, got shapes {sq}, {sk}, {sv}")
    for x, name in ((sq, "Q"), (sk, "K"), (sv, "V")):
        _shape4(x, name)
    if sk[-1] != sq[-1]:
        raise ValueError(f"K's head dimension must equal Q's: Q has d = {sq[-1]}, K has {sk[-1]}")
    if sv[-1] != sq[-1]:
        raise ValueError(f"V's head dimension must equal Q's (the tensor-core kernels take d_v = d): Q has "
                         f"d = {sq[-1]}, V has {sv[-1]}")
    if sv[-2] != sk[-2]:
        raise ValueError(f"V must have as many rows as K: K has N_k = {sk[-2]}, V has {sv[-2]}")
    if sk[:-2] != sv[:-2]:
        raise ValueError(f"K and V must have the same leading axes, got {sk[:-2]} and {sv[:-2]}")
    if len(sq) >= 3:
        if sq[:-3] != sk[:-3]:
            raise ValueError(f"Q and K must have the same batch axes, got {sq[:-3]} and {sk[:-3]}")
        if sq[-3] % sk[-3]:
            raise ValueError(f"the number of query heads H_q = {sq[-3]} must be a multiple of the number of "
                             f"key/value heads H_kv = {sk[-3]} (GQA/MQA)")
    d = sq[-1]
    if d % 8 or d > MAX_HEAD_DIM:
        raise ValueError(f"the tensor-core kernels take head dimensions that are multiples of 8 up to "
                         f"{MAX_HEAD_DIM}, got d = {d}")


def _words_host(x: np.ndarray, Z: int, H: int, N: int, d: int) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(Z, H, N, d).view(np.uint32)


def prepare(Q, K, V, *, causal, scale) -> Problem:
    """Check Q, K, V and return them as a :class:`Problem` with freshly allocated outputs (poisoned with NaN
    patterns when ``kernels_gpu.runtime.poison_outputs`` is set)."""
    rt.require_device()
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    kinds = []
    for x, name in ((Q, "Q"), (K, "K"), (V, "V")):
        if _is_torch(x):
            kinds.append("torch-cuda" if x.is_cuda else "torch-cpu")
        elif getattr(x, "__cuda_ndarray__", False):
            kinds.append("numba")
        elif isinstance(x, np.ndarray) and type(x) is np.ndarray:
            kinds.append("numpy")
        else:
            raise TypeError(f"{name} must be a PyTorch tensor, a numba device array or a NumPy array of float16 "
                            f"(or a bfloat16 tensor), got {type(x).__name__}")
    if len(set(kinds)) != 1:
        raise TypeError(f"Q, K, V must be of one kind (all PyTorch CUDA tensors, all CPU tensors, all numba device "
                        f"arrays or all NumPy arrays), got {kinds}")
    kind = kinds[0]
    dtypes = [_dtype_name(x) for x in (Q, K, V)]
    for dt, name in zip(dtypes, "QKV"):
        if dt not in DTYPES or (dt == "bfloat16" and not kind.startswith("torch")):
            raise TypeError(f"{name} must be float16 or bfloat16 (bfloat16 as a PyTorch tensor), got {dt}")
    if len(set(dtypes)) != 1:
        raise TypeError(f"Q, K, V must have one dtype, got {dtypes}")
    _check_shapes(Q, K, V)
    Z, H_q, N_q, d = _shape4(tuple(Q.shape), "Q")
    _, H_kv, N_k, _ = _shape4(tuple(K.shape), "K")
    tau = float(check_scale(scale, d))
    lead = tuple(Q.shape[:-2])
    common = dict(dtype=dtypes[0], kind=kind, Z=Z, H_q=H_q, H_kv=H_kv, N_q=N_q, N_k=N_k, d=d, scale=tau,
                  causal=bool(causal), lead=lead)
    if kind == "torch-cuda":
        torch = _torch()
        if rt.simulator_in_use():
            raise TypeError("CUDA tensors cannot run in numba's CUDA simulator: pass CPU tensors there")
        q, k, v = (_kernel_view(x.reshape(s)) for x, s in ((Q, (Z, H_q, N_q, d)), (K, (Z, H_kv, N_k, d)),
                                                             (V, (Z, H_kv, N_k, d))))
        O_user = empty_like_layout(q)
        L_user = torch.empty((Z, H_q, N_q), dtype=torch.float32, device=q.device)
        if rt.poison_outputs:
            O_user.view(torch.int16).fill_(-1)           # 0xFFFF: a NaN in both float16 and bfloat16
            L_user.fill_(math.nan)
        # Zero-copy views, launched on PyTorch's current stream: the kernel is ordered after the work that produced
        # Q, K, V and before whatever PyTorch does next, with no host synchronisation.
        stream = driver_launch.current_stream(q.device.index)
        words = [Buffer.of_torch(x, np.uint32) for x in (q, k, v, O_user)]
        return Problem(*words[:3], words[3], Buffer.of_torch(L_user, np.float32), O_user=O_user,
                       L_user=L_user, stream=stream, **common)
    if kind == "torch-cpu":
        torch = _torch()
        host = [x.detach().contiguous().view(torch.int16).numpy().view(np.float16) for x in (Q, K, V)]
    elif kind == "numba":
        host = None
    else:
        host = [np.asarray(x) for x in (Q, K, V)]
        for x, name in zip(host, "QKV"):
            if not np.isfinite(x).all():
                raise ValueError(f"{name} must be finite (no NaN or inf)")
    if host is not None:
        words = [cuda.to_device(_words_host(x, Z, H, N, d)) for x, H, N in zip(host, (H_q, H_kv, H_kv),
                                                                                 (N_q, N_k, N_k))]
    else:
        words = [x.reshape(Z, H, N, d).view(np.uint32) for x, H, N in ((Q, H_q, N_q), (K, H_kv, N_k),
                                                                         (V, H_kv, N_k))]
    if rt.poison_outputs:                                  # 0xFFFF halves and NaN: never a plausible result
        O = cuda.to_device(np.full((Z, H_q, N_q, d // 2), 0xFFFFFFFF, dtype=np.uint32))
        L = cuda.to_device(np.full((Z, H_q, N_q), np.nan, dtype=np.float32))
    else:
        O = cuda.device_array((Z, H_q, N_q, d // 2), dtype=np.uint32)
        L = cuda.device_array((Z, H_q, N_q), dtype=np.float32)
    return Problem(*words, O, L, **common)


def finish(p: Problem):
    """``(O, L)`` in the caller's kind and leading axes: O in the input dtype, L float32."""
    lead = p.lead
    if p.kind == "torch-cuda":
        return p.O_user.reshape(lead + (p.N_q, p.d)), p.L_user.reshape(lead + (p.N_q,))
    if p.kind == "numba":
        return p.O.view(np.float16).reshape(lead + (p.N_q, p.d)), p.L.reshape(lead + (p.N_q,))
    O = p.O.copy_to_host().view(np.uint16).reshape(lead + (p.N_q, p.d))
    L = p.L.copy_to_host().reshape(lead + (p.N_q,))
    if p.kind == "numpy":
        return O.view(np.float16), L
    torch = _torch()
    O_t = torch.from_numpy(O.view(np.int16).copy()).view(getattr(torch, p.dtype))
    return O_t, torch.from_numpy(L.copy())


def row_block_major(cfg, p) -> tuple:
    """The launch grid of every rung up to v10: (row blocks, heads, batch) — blockIdx.x is the row block i."""
    return (rt.grid_size(p.N_q, cfg.B_r), p.H_q, p.Z)


def run(make_kernel, config_for, shared_words, Q, K, V, *, causal, scale, grid_for=row_block_major, **options):
    """Check the inputs, pick the rung's configuration, launch one block per (row block, head, batch) — arranged
    by ``grid_for(cfg, problem)`` —, and return ``Flash2Forward(O, L)`` in the caller's kind. ``options`` go to
    ``config_for`` (e.g. a tile shape).

    PyTorch CUDA tensors take a shorter road from the second call with the same shapes, dtypes, device and
    options on: the checks passed, the configuration, the kernel and its packed parameters are kept in a
    :class:`ForwardPlan`, and a call only allocates O and L and launches."""
    from kernels_gpu.flash2 import Flash2Forward

    key = _plan_key((Q, K, V), (make_kernel, grid_for), causal, scale, options)
    if key is not None:
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(Q, K, V)
    p = prepare(Q, K, V, causal=causal, scale=scale)
    cfg = config_for(p.d, p.dtype, p.causal, rt.simulator_in_use(), **options)
    kernel = make_kernel(cfg)
    nbytes = 4 * shared_words(cfg)
    if nbytes > MAX_DYNAMIC_BYTES:
        raise ValueError(f"this tile shape needs {nbytes} bytes of shared memory at d = {p.d}; a block may have "
                         f"{MAX_DYNAMIC_BYTES}")
    args = (p.Q, p.K, p.V, p.O, p.L, np.int32(p.N_q), np.int32(p.N_k), np.int32(p.H_q // p.H_kv),
            np.float32(p.scale))
    grid = grid_for(cfg, p)
    driver_launch.launch(kernel, grid, cfg.threads, p.stream, args, nbytes)
    if key is not None:
        _PLANS[key] = ForwardPlan(p, driver_launch.Prepared(kernel, grid, cfg.threads, args, nbytes), Q, K, V)
    return Flash2Forward(*finish(p))


# -- the short road for PyTorch CUDA tensors -------------------------------------------------------------------------

#: plans per (rung, options, shapes, strides, dtypes, device), the 64 most recently used: what a repeated call
#: needs beyond allocating its outputs
_PLANS = driver_launch.PlanCache()


def _plan_key(tensors, rung: tuple, causal, scale, options: dict):
    """The cache key of a call on PyTorch CUDA tensors with the driver-level launch (None otherwise: no plan).
    Everything the checks and the configuration depend on is in it — shapes, strides, dtypes, device, the type and
    value of every option, and whether each tensor's first element is 16-byte aligned (with its strides and dtype,
    what decides whether it is read in place, :func:`zero_copy`) — so a call that finds a plan would have passed the
    checks of the call that made it, and lays its tensors out as that call did."""
    torch = _torch()
    if torch is None or not driver_launch.enabled():
        return None
    parts = []
    for x in tensors:
        if type(x) is not torch.Tensor or not x.is_cuda:
            return None
        parts.append((x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() % 16 == 0))
    return (rung, type(causal), causal, type(scale), scale, tuple(sorted(options.items())) if options else (),
            tuple(parts))


class ForwardPlan:
    """A forward on PyTorch CUDA tensors of fixed shapes, dtype and options, made from a first call's checked
    :class:`Problem`, its tensors and its :class:`~kernels_gpu.driver_launch.Prepared` launch. A call views or
    copies Q, K, V as the first call did (:class:`View`), allocates O (Q's shape, dtype and layout) and L (float32,
    Q's shape without the last axis), poisons them when asked, and launches on PyTorch's current stream."""

    def __init__(self, p: Problem, launch_, Q, K, V):
        self.launch = launch_
        q4, kv4 = (p.Z, p.H_q, p.N_q, p.d), (p.Z, p.H_kv, p.N_k, p.d)
        self.views = (View(Q, q4), View(K, kv4), View(V, kv4))
        self.o_shape, self.l_shape = p.lead + (p.N_q, p.d), p.lead + (p.N_q,)
        self.o_layout = Layout(self.views[0](Q))
        self.reshape_o = self.o_shape != q4
        self.device = p.O_user.device
        self.device_index = self.device.index

    def __call__(self, Q, K, V):
        from kernels_gpu.flash2 import Flash2Forward
        torch = _torch()
        # as prepare() did for the first call: the kernels' 4-axis views, read in place or copied, O like q
        vq, vk, vv = self.views
        q, k, v = vq(Q), vk(K), vv(V)
        O = self.o_layout.empty()
        L = torch.empty(self.l_shape, dtype=torch.float32, device=self.device)
        if rt.poison_outputs:
            O.view(torch.int16).fill_(-1)
            L.fill_(math.nan)
        self.launch(driver_launch.current_stream(self.device_index), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                    O.data_ptr(), L.data_ptr())
        return Flash2Forward(O.reshape(self.o_shape) if self.reshape_o else O, L)
