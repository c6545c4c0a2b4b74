"""Inputs and outputs of the tensor-core backward kernels: the forward's (:mod:`~kernels_gpu.tensorcore.launch`)
plus O, L and dO, and the three launches of one backward pass.

Q, K, V are checked and converted by :func:`kernels_gpu.tensorcore.launch.prepare`, exactly as for the forward
(same kinds of arrays, same errors). That function also allocates an output of Q's shape in the input dtype —
here it receives dQ — and the rest is added here: O and dO (Q's shape, kind and dtype), L (Q's shape without the
last axis, float32, as the forward returns it: natural log, +∞ on rows that see no key), and the outputs dK, dV
(K's shape and the input dtype), poisoned when ``kernels_gpu.runtime.poison_outputs`` is set.

One backward pass is three launches (:func:`run_backward`)::

    preprocess   D = rowsum(dO ∘ O), L·log₂e, dQ_acc = 0          a warp per row             (Alg. 2 lines 3-4)
    main         dK_j, dV_j; dQ_acc += dS K_j (atomic adds)       a block per key block j    (lines 5-24)
    convert      dQ = τ · dQ_acc, rounded to the input dtype      a thread per two elements

A rung that computes dQ in a pass of its own (:func:`run_backward_dq_pass`, v3) runs the preprocessing without
dQ's accumulator, its key-block kernel for dK, dV, and its dQ kernel, one block per query block, which writes dQ
itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

import kernels_gpu.runtime as rt
from kernels_gpu import driver_launch
from kernels_gpu.driver_launch import Buffer
from kernels_gpu.tensorcore import launch
from kernels_gpu.tensorcore.backward_steps import CONVERT_THREADS, PRE_WARPS, convert_dq_kernel, preprocess_kernel

__all__ = ["BackwardProblem", "prepare_backward", "finish_backward", "run_backward", "run_backward_dq_pass",
           "block_major_grids"]


@dataclass
class BackwardProblem:
    """One backward problem as the kernels see it, and how to hand the gradients back."""

    fwd: launch.Problem  # Q, K, V as words; its O (Q's shape, input dtype) receives dQ
    O: object            # (Z, H_q, N_q, d/2) uint32
    dO: object           # (Z, H_q, N_q, d/2) uint32
    L: object            # (Z, H_q, N_q) float32
    dK: object           # (Z, H_kv, N_k, d/2) uint32 output
    dV: object           # (Z, H_kv, N_k, d/2) uint32 output
    kv_lead: tuple       # the caller's leading axes of K
    dK_user: object = None
    dV_user: object = None


def _detach(x):
    return x.detach() if launch._is_torch(x) else x


def _check_like_q(x, name: str, p: launch.Problem, Q) -> None:
    kind = ("torch-cuda" if x.is_cuda else "torch-cpu") if launch._is_torch(x) else (
        "numba" if getattr(x, "__cuda_ndarray__", False) else
        "numpy" if isinstance(x, np.ndarray) and type(x) is np.ndarray else type(x).__name__)
    if kind != p.kind:
        raise TypeError(f"{name} must be of the same kind as Q, K, V ({p.kind}), got {kind}")
    if tuple(x.shape) != tuple(Q.shape):
        raise ValueError(f"{name} must have Q's shape {tuple(Q.shape)}, got {tuple(x.shape)}")
    if launch._dtype_name(x) != p.dtype:
        raise TypeError(f"{name} must have Q's dtype {p.dtype}, got {launch._dtype_name(x)}")


def _check_l(L, p: launch.Problem, Q):
    kind = ("torch-cuda" if L.is_cuda else "torch-cpu") if launch._is_torch(L) else (
        "numba" if getattr(L, "__cuda_ndarray__", False) else
        "numpy" if isinstance(L, np.ndarray) and type(L) is np.ndarray else type(L).__name__)
    if kind != p.kind:
        raise TypeError(f"L must be of the same kind as Q, K, V ({p.kind}), got {kind}")
    if tuple(L.shape) != tuple(Q.shape[:-1]):
        raise ValueError(f"L must have shape {tuple(Q.shape[:-1])} (Q's without its last axis), got "
                         f"{tuple(L.shape)}")
    if launch._dtype_name(L) != "float32":
        raise TypeError(f"L must be float32 (the forward's log-sum-exp), got {launch._dtype_name(L)}")


def _words(x, p: launch.Problem, name: str):
    """O or dO as the kernels' (Z, H_q, N_q, d/2) uint32 view on the device (a CUDA tensor in place, strided or
    not, unless :func:`~kernels_gpu.tensorcore.launch.zero_copy` says it must be copied)."""
    shape = (p.Z, p.H_q, p.N_q, p.d)
    if p.kind == "torch-cuda":
        return Buffer.of_torch(launch._kernel_view(x.reshape(shape)), np.uint32)
    if p.kind == "numba":
        return x.reshape(shape).view(np.uint32)
    if p.kind == "torch-cpu":
        import torch
        host = x.contiguous().view(torch.int16).numpy().view(np.float16)
    else:
        host = np.asarray(x)
        if not np.isfinite(host).all():
            raise ValueError(f"{name} must be finite (no NaN or inf)")
    return cuda.to_device(launch._words_host(host, p.Z, p.H_q, p.N_q, p.d))


def _stats_l(L, p: launch.Problem):
    shape = (p.Z, p.H_q, p.N_q)
    if p.kind == "torch-cuda":
        return Buffer.of_torch(L.reshape(shape).contiguous(), np.float32)
    if p.kind == "numba":
        return L.reshape(shape)
    host = L.contiguous().numpy() if p.kind == "torch-cpu" else np.asarray(L)
    if np.isnan(host).any():
        raise ValueError("L must not contain NaN (+inf marks a row that sees no key)")
    return cuda.to_device(np.ascontiguousarray(host, dtype=np.float32).reshape(shape))


def _empty_words(p: launch.Problem, like):
    """An output of the shape, dtype and layout of ``like`` (the kernels' view of K or V), as (uint32 words on the
    device, the caller-kind tensor they view or None); poisoned (0xFFFF halves, NaN in both dtypes) when asked."""
    shape = (p.Z, p.H_kv, p.N_k, p.d)
    if p.kind == "torch-cuda":
        import torch
        user = launch.empty_like_layout(like.keep)
        if rt.poison_outputs:
            user.view(torch.int16).fill_(-1)
        return Buffer.of_torch(user, np.uint32), user
    wshape = shape[:-1] + (shape[-1] // 2,)
    if rt.poison_outputs:
        return cuda.to_device(np.full(wshape, 0xFFFFFFFF, dtype=np.uint32)), None
    return cuda.device_array(wshape, dtype=np.uint32), None


def _empty_f32(p: launch.Problem, shape: tuple):
    if p.kind == "torch-cuda":
        import torch
        return Buffer.of_torch(torch.empty(shape, dtype=torch.float32, device=p.O_user.device), np.float32)
    return cuda.device_array(shape, dtype=np.float32)


def prepare_backward(Q, K, V, O, L, dO, *, causal, scale) -> BackwardProblem:
    """Check Q, K, V (as the forward does), O, L, dO, and return them as a :class:`BackwardProblem` with freshly
    allocated dQ (in ``fwd.O``), dK, dV."""
    Q, K, V, O, L, dO = (_detach(x) for x in (Q, K, V, O, L, dO))
    p = launch.prepare(Q, K, V, causal=causal, scale=scale)
    for x, name in ((O, "O"), (dO, "dO")):
        _check_like_q(x, name, p, Q)
    _check_l(L, p, Q)
    dK, dK_user = _empty_words(p, p.K)                  # dK laid out like K, dV like V (and dQ, in p.O, like Q)
    dV, dV_user = _empty_words(p, p.V)
    return BackwardProblem(fwd=p, O=_words(O, p, "O"), dO=_words(dO, p, "dO"), L=_stats_l(L, p), dK=dK, dV=dV,
                           kv_lead=tuple(K.shape[:-2]), dK_user=dK_user, dV_user=dV_user)


def _finish_kv(bp: BackwardProblem, words, user):
    p, shape = bp.fwd, bp.kv_lead + (bp.fwd.N_k, bp.fwd.d)
    if p.kind == "torch-cuda":
        return user.reshape(shape)
    if p.kind == "numba":
        return words.view(np.float16).reshape(shape)
    host = words.copy_to_host().view(np.uint16).reshape(shape)
    if p.kind == "numpy":
        return host.view(np.float16)
    import torch
    return torch.from_numpy(host.view(np.int16).copy()).view(getattr(torch, p.dtype))


def finish_backward(bp: BackwardProblem):
    """``Flash2Backward(dQ, dK, dV)`` in the caller's kind and leading axes, in the input dtype."""
    from kernels_gpu.flash2 import Flash2Backward
    dQ = launch.finish(bp.fwd)[0]
    return Flash2Backward(dQ, _finish_kv(bp, bp.dK, bp.dK_user), _finish_kv(bp, bp.dV, bp.dV_user))


def _launch(kernel, grid, threads, nbytes, stream, args) -> None:
    """Launch ``kernel`` with ``nbytes`` of dynamic shared memory (checked against the limit, raised above 48 KiB
    once per compiled kernel) through :func:`kernels_gpu.driver_launch.launch`."""
    if nbytes > launch.MAX_DYNAMIC_BYTES:
        raise ValueError(f"this tile shape needs {nbytes} bytes of shared memory; a block may have "
                         f"{launch.MAX_DYNAMIC_BYTES}")
    driver_launch.launch(kernel, grid, threads, stream, args, nbytes)


def _preprocess(bp: BackwardProblem, cfg, dQacc) -> tuple:
    """Alg. 2 lines 3-4: D = rowsum(dO ∘ O) and L·log₂e, padded to whole row blocks (and dQ_acc = 0 when given).
    Returns the stats array and the launch made (kernel, grid, threads, shared bytes, arguments)."""
    p = bp.fwd
    N_pad = cfg.padded_rows(p.N_q)
    stats = _empty_f32(p, (p.Z, p.H_q, 2, N_pad))
    zero_dq = dQacc is not None
    placeholder = dQacc if zero_dq else _empty_f32(p, (1, 1, 1, 1))
    spec = (preprocess_kernel(p.d, p.dtype, zero_dq), (rt.grid_size(N_pad, PRE_WARPS), p.H_q, p.Z),
            32 * PRE_WARPS, 0, (bp.O, bp.dO, bp.L, stats, placeholder, np.int32(p.N_q)))
    _launch(*spec[:4], p.stream, spec[4])
    return stats, spec


def run_backward(make_kernel, config_for, shared_words, Q, K, V, O, L, dO, *, causal, scale, extra_args=(),
                 **options):
    """Check the inputs, pick the rung's configuration, run the three launches (preprocess; the rung's kernel,
    one block per (key block, column chunk, key/value head, batch); dQ's conversion) and return
    ``Flash2Backward(dQ, dK, dV)`` in the caller's kind. ``options`` go to ``config_for``; ``extra_args`` are
    appended to the main kernel's arguments (the flex backward's block classes and bound arrays). The launches go to the
    forward's stream (PyTorch's current stream for CUDA tensors), with no host synchronisation."""
    bp = prepare_backward(Q, K, V, O, L, dO, causal=causal, scale=scale)
    p = bp.fwd
    if not getattr(p.O, "contiguous", True):     # dQ laid out like a strided Q: the conversion writes flat runs
        p.O_user = p.O_user.contiguous()
        p.O = Buffer.of_torch(p.O_user, np.uint32)
    cfg = config_for(p.d, p.dtype, p.causal, rt.simulator_in_use(), **options)
    kernel = make_kernel(cfg)
    # Alg. 2 lines 3-4: dQ_acc = 0; D = rowsum(dO ∘ O); L·log₂e.
    dQacc = _empty_f32(p, (p.Z, p.H_q, p.N_q, p.d))
    stats, _ = _preprocess(bp, cfg, dQacc)
    # Alg. 2 lines 5-24: one block per key block j (and column chunk).
    args = (p.Q, p.K, p.V, bp.dO, stats, dQacc, bp.dK, bp.dV, np.int32(p.N_q), np.int32(p.N_k),
            np.int32(p.H_q // p.H_kv), np.float32(p.scale), np.float32(p.scale * math.log2(math.e))) + tuple(extra_args)
    _launch(kernel, (rt.grid_size(p.N_k, cfg.B_c) * cfg.chunks, p.H_kv, p.Z), cfg.threads, 4 * shared_words(cfg),
            p.stream, args)
    # Alg. 2 line 15's result, rounded once: dQ = τ · dQ_acc in the input dtype.
    n_words = p.Z * p.H_q * p.N_q * p.d // 2
    _launch(convert_dq_kernel(p.dtype), rt.grid_size(n_words, CONVERT_THREADS), CONVERT_THREADS, 0, p.stream,
            (dQacc.reshape(-1), p.O.reshape(-1), np.float32(p.scale)))
    return finish_backward(bp)


def block_major_grids(cfg, p) -> tuple:
    """The launch grids of v3's two kernels: (key blocks · chunks, H_kv, Z) and (query blocks · chunks, H_q, Z) —
    blockIdx.x is the block's key (query) block and column chunk."""
    return ((rt.grid_size(p.N_k, cfg.B_c) * cfg.chunks, p.H_kv, p.Z),
            (rt.grid_size(p.N_q, cfg.B_c) * cfg.chunks, p.H_q, p.Z))


def run_backward_dq_pass(make_kernel, make_dq_kernel, config_for, shared_words, dq_shared_words, Q, K, V, O, L,
                         dO, *, causal, scale, grids_for=block_major_grids, **options):
    """:func:`run_backward` for rungs that compute dQ in a pass of its own: preprocess (no dQ accumulator); the
    rung's key-block kernel (dK, dV only), one block per (key block, column chunk, key/value head, batch); the
    rung's dQ kernel, one block per (query block of 16·W rows, column chunk, query head, batch), which writes dQ in
    the input dtype itself — no atomics, no conversion launch. ``grids_for(cfg, problem)`` arranges the two
    grids (the order in which the GPU hands out the blocks)."""
    key = launch._plan_key((Q, K, V, O, L, dO), (make_kernel, make_dq_kernel, grids_for), causal, scale, options)
    if key is not None:
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(Q, K, V, O, L, dO)
    bp = prepare_backward(Q, K, V, O, L, dO, causal=causal, scale=scale)
    p = bp.fwd
    cfg = config_for(p.d, p.dtype, p.causal, rt.simulator_in_use(), **options)
    stats, pre = _preprocess(bp, cfg, None)
    common = (np.int32(p.N_q), np.int32(p.N_k), np.int32(p.H_q // p.H_kv), np.float32(p.scale),
              np.float32(p.scale * math.log2(math.e)))
    kv_grid, dq_grid = grids_for(cfg, p)
    # Alg. 2 lines 5-24 without line 20: dK_j, dV_j, one block per key block j (and column chunk).
    kv = (make_kernel(cfg), kv_grid, cfg.threads, 4 * shared_words(cfg),
          (p.Q, p.K, p.V, bp.dO, stats, bp.dK, bp.dV) + common)
    _launch(*kv[:4], p.stream, kv[4])
    # Alg. 2 line 20 as a pass over query blocks: dQ_i = τ Σ_j dS_ij K_j, written once.
    dq = (make_dq_kernel(cfg), dq_grid, cfg.threads, 4 * dq_shared_words(cfg),
          (p.Q, p.K, p.V, bp.dO, stats, p.O) + common)
    _launch(*dq[:4], p.stream, dq[4])
    if key is not None:
        prepared = [driver_launch.Prepared(k, grid, threads, args, nbytes) for k, grid, threads, nbytes, args
                    in (pre, kv, dq)]
        _PLANS[key] = BackwardPlan(bp, tuple(stats.shape), pre[4][4], *prepared, Q, K, V, O, dO)
    return finish_backward(bp)


# -- the short road for PyTorch CUDA tensors -------------------------------------------------------------------------

#: plans per (rung, options, shapes, strides, dtypes, device) of :func:`run_backward_dq_pass`, the 64 most recently
#: used
_PLANS = driver_launch.PlanCache()


class BackwardPlan:
    """A backward (:func:`run_backward_dq_pass`) on PyTorch CUDA tensors of fixed shapes, dtype and options,
    made from a first call's checked :class:`BackwardProblem`, its tensors and its three prepared launches. A call
    views or copies Q, K, V, O, dO as the first call did (:class:`~kernels_gpu.tensorcore.launch.View`), allocates
    the stats and dQ, dK, dV laid out like Q, K, V (poisoned when asked) and launches preprocess → key-block
    kernel → dQ kernel on PyTorch's current stream."""

    def __init__(self, bp: BackwardProblem, stats_shape: tuple, placeholder, pre, kv, dq, Q, K, V, O, dO):
        p = bp.fwd
        self.pre, self.kv, self.dq = pre, kv, dq
        self.placeholder = placeholder              # a (1, 1, 1, 1) float32 Buffer the preprocess never writes
        self.stats_shape = stats_shape
        q4, kv4 = (p.Z, p.H_q, p.N_q, p.d), (p.Z, p.H_kv, p.N_k, p.d)
        self.q_shape, self.kv_shape = p.lead + (p.N_q, p.d), bp.kv_lead + (p.N_k, p.d)
        self.reshape_q, self.reshape_kv = self.q_shape != q4, self.kv_shape != kv4
        self.views = tuple(launch.View(x, shape) for x, shape in ((Q, q4), (K, kv4), (V, kv4), (O, q4), (dO, q4)))
        self.layouts = tuple(launch.Layout(view(x)) for view, x in zip(self.views, (Q, K, V)))
        self.device = p.O_user.device
        self.device_index = self.device.index

    def __call__(self, Q, K, V, O, L, dO):
        from kernels_gpu.flash2 import Flash2Backward
        torch = launch._torch()
        vq, vk, vv, vo, vdo = self.views
        q, k, v, o, do = vq(Q), vk(K), vv(V), vo(O), vdo(dO)
        lse = L.contiguous()
        stats = torch.empty(self.stats_shape, dtype=torch.float32, device=self.device)
        dQ, dK, dV = (layout.empty() for layout in self.layouts)
        if rt.poison_outputs:
            for x in (dQ, dK, dV):
                x.view(torch.int16).fill_(-1)
        s = driver_launch.current_stream(self.device_index)
        Qp, Kp, Vp, dOp, Sp = q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), stats.data_ptr()
        self.pre(s, o.data_ptr(), dOp, lse.data_ptr(), Sp, self.placeholder.ptr)
        self.kv(s, Qp, Kp, Vp, dOp, Sp, dK.data_ptr(), dV.data_ptr())
        self.dq(s, Qp, Kp, Vp, dOp, Sp, dQ.data_ptr())
        if self.reshape_q:
            dQ = dQ.reshape(self.q_shape)
        if self.reshape_kv:
            dK, dV = dK.reshape(self.kv_shape), dV.reshape(self.kv_shape)
        return Flash2Backward(dQ, dK, dV)
