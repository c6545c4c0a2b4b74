"""The machinery behind ``fa2edu.torch.flash_attention``: which kernel runs, how it is called, and the operators.

Three parts, in the order data flows through them:

1. **The dispatch table** (:data:`DISPATCH`, :data:`BACKENDS`, :func:`choose_backend`): the one place that says
   which *backend* computes attention for a device, a dtype and an algorithm. A backend is a family of kernels:

   ==============  ===============  ==================  =================================================
   backend         device           dtypes              what runs
   ==============  ===============  ==================  =================================================
   ``numpy``       cpu              float32, float64    fa2edu's NumPy algorithms (the counted textbook
                                                        code): FA2, FA1 and standard attention
   ``fast``        cuda             float32             ``kernels_gpu.fast``: forward v6 (padded width
                                                        ≤ 64) or v8, backward v1 (register-tiled, CUDA
                                                        cores)
   ``tensorcore``  cuda             float16, bfloat16   ``kernels_gpu.tensorcore.flash2_forward`` and
                                                        ``flash2_backward`` (mma.sync); a kernels_gpu
                                                        without the backward kernel runs ``fast``'s in
                                                        float32 instead
   ``3xtf32``      cuda             float32             ``kernels_gpu.tensorcore``'s 3xTF32 kernels: each
                                                        product as three TF32 products (float32's
                                                        accuracy), up to d = 128; wider heads on ``fast``
   ``teaching``    cuda             float32             ``kernels_gpu``'s teaching kernels (one thread per
                                                        row, FA2 and standard attention): by name only
   ==============  ===============  ==================  =================================================

   With ``backend=None`` the table :data:`DISPATCH` picks one per (device, dtype): the fastest measured for 16-bit
   CUDA tensors; for CUDA float32 the 3xTF32 kernels (DESIGN.md, decided 2026-11-28: what PyTorch's own float32
   SDPA computes, 0.91-0.92× its speed at d = 128 where the CUDA-core ``fast`` kernels reached 0.83-0.84×), with
   ``fast`` by name. The
   teaching kernels run only when asked for (``backend="teaching"``, or ``algorithm="standard"`` on CUDA, which
   only they implement). In numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) a CUDA backend named explicitly
   also takes CPU tensors: that is how the tests run the GPU paths on a machine without a GPU.

2. **The kernel calls** (:func:`flash2_forward`, :func:`flash2_backward` and their FA1 and standard siblings):
   tensors in, tensors out. The fast kernels need head dimensions that are multiples of their thread layout and
   the tensor-core kernels multiples of 8, so inputs are **padded with zero columns** inside the call and the
   results sliced back. Zero columns change nothing: a zero column of Q and K adds 0 to every score q·k, a zero
   column of V gives a zero column of O (sliced off), and a zero column of dO adds 0 to D = rowsum(dO ∘ O). The
   scale τ is always passed explicitly (the caller's default 1/√d uses the *unpadded* d).

3. **The custom operators** ``fa2edu::flash_attention_fwd`` / ``fa2edu::flash_attention_bwd`` (FA2), and
   ``fa2edu::flash1_attention_fwd|bwd``, ``fa2edu::standard_attention_fwd|bwd``: each registered with
   ``torch.library.custom_op`` and a *fake* implementation (``register_fake``) that only computes output shapes and
   dtypes, which is all ``torch.compile`` needs to trace through an operator it cannot look inside. Their autograd
   formulas are registered in :mod:`fa2edu.torch`, next to the ``autograd.Function`` classes they reuse.

4. **FlexAttention** (:mod:`fa2edu.flex` on the CPU, ``kernels_gpu.flex`` on CUDA float16/bfloat16,
   :data:`FLEX_DISPATCH`): ``fa2edu::flex_attention_fwd|bwd``, which take their mods
   as an int key of the registry :data:`MODS` (a function cannot be an operator argument; the section's header
   says how the mods' lifetime is kept), and ``fa2edu::flash_attention_flex_fwd|bwd``, flash_attention with
   flash-attn's ``window_size``, ``softcap`` and ``alibi_slopes``, built into mods by :func:`flash_attn_mods`.

5. **FP8 inputs** (``fa2edu::flash_attention_fp8_fwd``, forward only): float8_e4m3fn q, k, v with per-(batch, head)
   descales, on ``kernels_gpu.hopper.flash_forward_fp8`` (CUDA sm_90) or :mod:`fa2edu.fp8`'s emulation (CPU).

This module is private: import :mod:`fa2edu.torch`, which checks that PyTorch is installed first.
"""

from __future__ import annotations

import itertools
import os
import threading
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

import fa2edu
from fa2edu import flex as _flex
from fa2edu.blocks import num_blocks
from fa2edu.validation import check_score_range

__all__ = ["Backend", "BACKENDS", "DISPATCH", "ALGORITHMS", "MAX_HEAD_DIM", "choose_backend", "simulator_enabled",
           "flash2_forward", "flash2_backward", "flash1_forward", "flash1_backward", "standard_forward",
           "standard_backward", "fast_width", "three_tf32_width", "tensorcore_width", "tensorcore_has_backward",
           "reads_strided", "tensorcore_layout", "hopper_forward_applies", "FlexMods", "flex_mods", "MODS",
           "ModRegistry", "register_mods", "from_torch_block_mask", "flash_attn_mods", "FLEX_DISPATCH",
           "FLEX_BACKENDS", "FLEX_FLOAT32_CUDA_ERROR", "choose_flex_backend", "retile_block_mask",
           "FP8_BACKWARD_ERROR", "FP8_BACKENDS", "fp8_width", "flash_attention_fp8_fwd_impl"]

#: The algorithms of the op: FA2 (Alg. 1/2), FA1 (Alg. 2/4) and standard attention (FA1 Alg. 0/3).
ALGORITHMS = ("flash2", "flash1", "standard")

#: The largest head dimension (d and d_v) on every path, as in flash-attn.
MAX_HEAD_DIM = 256


# =================================================================================================================
# 1. The dispatch table
# =================================================================================================================

class Backend(NamedTuple):
    """One family of kernels: where it runs, what it takes, and what it is."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    algorithms: tuple[str, ...]
    description: str
    #: reads strided q, k, v, O, dO where they lie and lays O, dQ, dK, dV out like q, k, v (:func:`tensorcore_layout`);
    #: the other backends take contiguous inputs and return contiguous results
    strided: bool = False


BACKENDS = {
    "numpy": Backend(("cpu",), (torch.float32, torch.float64), ALGORITHMS,
                     "fa2edu's NumPy algorithms: the line-by-line, counted textbook code"),
    "fast": Backend(("cuda",), (torch.float32,), ("flash2",),
                    "kernels_gpu.fast: register-tiled CUDA-core kernels, forward v6/v8, backward v4"),
    "tensorcore": Backend(("cuda",), (torch.float16, torch.bfloat16), ("flash2",),
                          "kernels_gpu.tensorcore: mma.sync kernels, forward and backward (float32 "
                          "accumulators); without tensorcore.flash2_backward, the fast float32 backward",
                          strided=True),
    "3xtf32": Backend(("cuda",), (torch.float32,), ("flash2",),
                      "kernels_gpu.tensorcore's 3xTF32 kernels: float32 on tensor cores, each product as three TF32 "
                      "products (float32's accuracy, the method of PyTorch's own float32 SDPA), forward and "
                      "backward up to d = 128; wider heads on kernels_gpu.fast"),
    "teaching": Backend(("cuda",), (torch.float32,), ("flash2", "standard"),
                        "kernels_gpu's teaching kernels: one thread per row, mirroring the NumPy code"),
}

#: (device type, dtype) → the backend ``algorithm="flash2"`` runs on when none is named: the fastest measured.
DISPATCH = {
    ("cpu", torch.float32): "numpy",
    ("cpu", torch.float64): "numpy",
    ("cuda", torch.float32): "3xtf32",
    ("cuda", torch.float16): "tensorcore",
    ("cuda", torch.bfloat16): "tensorcore",
}


def simulator_enabled() -> bool:
    """True when numba's CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM=1``, read by numba at import)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _dtype_hint(device_type: str, dtype: torch.dtype) -> str:
    """What to do about a dtype no backend takes on this device."""
    if device_type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return (" (fa2edu's NumPy path computes in float32 or float64; cast with .float() or .double(), or move "
                "the tensors to a GPU, where float16 and bfloat16 run on tensor cores)")
    if device_type == "cuda" and dtype == torch.float64:
        return "; for float64 move the tensors to the CPU"
    return ""


def choose_backend(device_type: str, dtype: torch.dtype, algorithm: str = "flash2", backend: str | None = None,
                   *, simulator: bool | None = None) -> str:
    """The backend that computes ``algorithm`` for tensors of ``dtype`` on ``device_type``; a clear error if none.

    Args:
        device_type (str): ``"cpu"`` or ``"cuda"`` (``torch.device.type``).
        dtype (torch.dtype): the tensors' dtype.
        algorithm (str, optional): ``"flash2"``, ``"flash1"`` or ``"standard"``. Default ``"flash2"``.
        backend (str, optional): a name from :data:`BACKENDS` to insist on, or None (default) for the table's
            choice: :data:`DISPATCH` for FA2, ``"numpy"`` for the other algorithms on the CPU and ``"teaching"``
            for ``"standard"`` on CUDA (the only kernels that implement it).
        simulator (bool, optional): whether numba's CUDA simulator is on, which lets a CUDA backend named
            explicitly take CPU tensors. Default None: read the environment (:func:`simulator_enabled`).

    Returns:
        str: a key of :data:`BACKENDS`.

    Raises:
        ValueError: an unknown algorithm, backend or device, or a backend that cannot run this algorithm here.
        TypeError: a dtype that no backend takes on this device.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"q, k, v are on device {device_type!r}; flash_attention runs on 'cpu' and 'cuda'")
    if backend is None:
        if algorithm == "flash2":
            backend = DISPATCH.get((device_type, dtype))
            if backend is None:
                takes = " or ".join(str(t).removeprefix("torch.") for (dev, t) in DISPATCH if dev == device_type)
                where = "on the CPU" if device_type == "cpu" else "on CUDA"
                raise TypeError(f"q has dtype {dtype}; {where} flash_attention takes {takes}"
                                f"{_dtype_hint(device_type, dtype)}")
        elif device_type == "cpu":
            backend = "numpy"
        elif algorithm == "standard":
            backend = "teaching"
        else:
            raise ValueError(f"algorithm={algorithm!r} runs on the CPU only (kernels_gpu has no FA1 backward); on "
                             f"CUDA use 'flash2' or 'standard', or move the tensors to the CPU")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)} or None, got {backend!r}")
    spec = BACKENDS[backend]
    simulated_gpu = device_type == "cpu" and "cuda" in spec.devices and (
        simulator_enabled() if simulator is None else simulator)
    if device_type not in spec.devices and not simulated_gpu:
        hint = (" (a CUDA backend takes CPU tensors only in numba's CUDA simulator, NUMBA_ENABLE_CUDASIM=1)"
                if device_type == "cpu" else "")
        raise ValueError(f"backend={backend!r} runs on {' and '.join(spec.devices)}, but q, k, v are on "
                         f"{device_type}{hint}")
    if algorithm not in spec.algorithms:
        raise ValueError(f"backend={backend!r} does not implement algorithm={algorithm!r} (it has "
                         f"{spec.algorithms})")
    if dtype not in spec.dtypes:
        takes = " or ".join(str(t).removeprefix("torch.") for t in spec.dtypes)
        raise TypeError(f"q has dtype {dtype}; backend={backend!r} takes {takes}{_dtype_hint(device_type, dtype)}")
    return backend


# =================================================================================================================
# 2. The kernel calls
# =================================================================================================================

# -- moving tensors between PyTorch, NumPy and numba --------------------------------------------------------------

def _to_numpy(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a NumPy array sharing its memory (no copy)."""
    return x.detach().numpy()


def _from_numpy(x: np.ndarray) -> torch.Tensor:
    """A NumPy result as a CPU tensor sharing its memory (a copy only if NumPy marked it read-only)."""
    return torch.from_numpy(x if x.flags.writeable else x.copy())


def _kernels_gpu():
    """kernels_gpu, imported only when a GPU backend runs (it needs numba.cuda)."""
    try:
        import kernels_gpu
    except ImportError as error:
        raise ImportError(f"the CUDA backends run kernels_gpu's numba.cuda kernels, which failed to import: {error}"
                          ) from error
    return kernels_gpu


def _for_kernel(x: torch.Tensor):
    """What a numba kernel of ``kernels_gpu`` (fast or teaching) is handed for the tensor ``x``.

    A CUDA tensor becomes a numba device array over the same memory (zero-copy). ``sync=False``: numba's default
    for a foreign array would wait for the whole GPU to go idle before every launch; the order is kept instead by
    :func:`_numba_stream`. A CPU tensor (the simulator) becomes a NumPy array, which the kernels copy in and out.
    """
    x = x.detach().contiguous()
    if x.is_cuda:
        from numba import cuda
        return cuda.as_cuda_array(x, sync=False)
    return x.numpy()


def _from_kernel(x, like: torch.Tensor) -> torch.Tensor:
    """A kernel's result as a tensor on ``like``'s device, without a copy: a tensor as is, a numba device array
    through ``__cuda_array_interface__`` (torch keeps it alive as long as the tensor lives), a NumPy array
    through ``torch.from_numpy``."""
    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return torch.as_tensor(x, device=like.device)
    return _from_numpy(np.asarray(x))


@contextmanager
def _numba_stream(device: torch.device):
    """Order numba's launches after PyTorch's pending work and PyTorch's next work after numba's launches.

    The fast and teaching kernels launch on numba's default stream, the legacy default stream, which is PyTorch's
    default stream too: there nothing is needed. Under ``torch.cuda.stream(side)`` the two are not ordered, so
    each side waits for the other (on the GPU: no host synchronisation). CPU tensors (the simulator) need nothing.
    """
    if device.type != "cuda":
        yield
        return
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if current == default:
        yield
        return
    default.wait_stream(current)
    yield
    current.wait_stream(default)


# -- padding the head dimension -------------------------------------------------------------------------------------

def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero columns appended on its last axis up to ``width`` (``x`` itself when already that wide; the
    padded copy is detached: the kernels take data, and autograd records the op's own formula)."""
    return x if x.shape[-1] == width else F.pad(x.detach(), (0, width - x.shape[-1]))


def _unpad(x: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` columns of ``x``, as a contiguous tensor of their own (not a view of the padded one)."""
    return x if x.shape[-1] == width else x[..., :width].contiguous()


def fast_width(d: int, d_v: int, pass_: str) -> int:
    """The head dimension, d and d_v alike, that ``kernels_gpu.fast`` computes at for (d, d_v): the smallest its
    default thread layout takes.

    The forward kernels split a row of O over NX threads of 4 columns each (NX = 8 for widths ≤ 64, else 16), so
    the width must be a multiple of 32 up to 64 and of 64 above; the backward v1 splits rows of dK, dV over 16
    threads (a multiple of 64). Widths: forward 32, 64, 128, 192, 256; backward 64, 128, 192, 256.
    """
    D = max(d, d_v)
    if pass_ == "forward":
        return _round_up(D, 32 if D <= 64 else 64)
    return _round_up(D, 64)


def tensorcore_width(d: int, d_v: int) -> int:
    """The head dimension the tensor-core kernels compute at: d = d_v, a multiple of 8 (one 16-byte chunk)."""
    return _round_up(max(d, d_v), 8)


#: kernels_gpu.fast's forward version per padded width: v6 up to 64, v8 (stream-K over the last wave) above
#: (the measured choice, ``benchmarks.harness.impls.FAST_FORWARD``), and the backward version.
FAST_FORWARD = {64: "v6", 256: "v8"}
FAST_BACKWARD = "v4"


def _fast_wide_tilings():
    """Tile shapes for widths above 128, where the default (tuned for d = 128) needs more shared memory than a
    block may have (235 KB at 192, 301 KB at 256, against 227 KB): 64 × 64 tiles of 256 threads forward
    (217 KB at 256), 32 × 64 backward (217 KB)."""
    from kernels_gpu.fast import Tiling
    return Tiling(16, 16, 4, 4), Tiling(16, 16, 2, 4)


# -- FA2 -------------------------------------------------------------------------------------------------------------

def _fast_forward(q, k, v, causal: bool, scale: float):
    """FA2 Alg. 1 on ``kernels_gpu.fast`` (float32), padded to :func:`fast_width`."""
    from kernels_gpu.fast import VERSIONS
    d_v = v.shape[-1]
    D = fast_width(q.shape[-1], d_v, "forward")
    version = FAST_FORWARD[64] if D <= 64 else FAST_FORWARD[256]
    tiling = {"tiling": _fast_wide_tilings()[0]} if D > 128 else {}
    with _numba_stream(q.device):
        O, L = VERSIONS[version](*(_for_kernel(_pad(x, D)) for x in (q, k, v)), causal=causal, scale=scale,
                                 **tiling)
    return _unpad(_from_kernel(O, q), d_v), _from_kernel(L, q)


def _fast_backward(q, k, v, O, L, dO, causal: bool, scale: float):
    """FA2 Alg. 2 on ``kernels_gpu.fast``'s backward (:data:`FAST_BACKWARD`, float32), padded to :func:`fast_width`."""
    from kernels_gpu.fast import BACKWARD_VERSIONS
    d, d_v = q.shape[-1], v.shape[-1]
    D = fast_width(d, d_v, "backward")
    tiling = {"tiling": _fast_wide_tilings()[1]} if D > 128 else {}
    padded = [_for_kernel(_pad(x, D)) for x in (q, k, v, O)] + [_for_kernel(L), _for_kernel(_pad(dO, D))]
    with _numba_stream(q.device):
        dQ, dK, dV = BACKWARD_VERSIONS[FAST_BACKWARD](*padded, causal=causal, scale=scale, **tiling)
    return _unpad(_from_kernel(dQ, q), d), _unpad(_from_kernel(dK, q), d), _unpad(_from_kernel(dV, q), d_v)


def three_tf32_width(d: int, d_v: int) -> int:
    """The head dimension, d and d_v alike, that the 3xTF32 kernels compute at: a multiple of 16; above
    :data:`THREE_TF32_MAX` the ``"3xtf32"`` backend runs ``kernels_gpu.fast`` instead."""
    return _round_up(max(d, d_v), 16)


#: the widest head dimension of kernels_gpu.tensorcore's 3xTF32 forward (planes) and backward
THREE_TF32_MAX = 128


def _three_tf32_forward(q, k, v, causal: bool, scale: float):
    """FA2 Alg. 1 in 3xTF32 (``kernels_gpu.tensorcore.TF32["3xtf32-planes"]``, float32), padded to
    :func:`three_tf32_width`; wider heads on :func:`_fast_forward`."""
    d_v = v.shape[-1]
    D = three_tf32_width(q.shape[-1], d_v)
    if D > THREE_TF32_MAX:
        return _fast_forward(q, k, v, causal, scale)
    with _numba_stream(q.device):
        O, L = _tensorcore().TF32["3xtf32-planes"](*(_for_kernel(_pad(x, D)) for x in (q, k, v)), causal=causal,
                                                   scale=scale)
    return _unpad(_from_kernel(O, q), d_v), _from_kernel(L, q)


def _three_tf32_backward(q, k, v, O, L, dO, causal: bool, scale: float):
    """FA2 Alg. 2 in 3xTF32 (``kernels_gpu.tensorcore.TF32_BACKWARD["3xtf32"]``, float32), padded to
    :func:`three_tf32_width`; wider heads on :func:`_fast_backward`."""
    d, d_v = q.shape[-1], v.shape[-1]
    D = three_tf32_width(d, d_v)
    if D > THREE_TF32_MAX:
        return _fast_backward(q, k, v, O, L, dO, causal, scale)
    padded = [_for_kernel(_pad(x, D)) for x in (q, k, v, O)] + [_for_kernel(L), _for_kernel(_pad(dO, D))]
    with _numba_stream(q.device):
        dQ, dK, dV = _tensorcore().TF32_BACKWARD["3xtf32"](*padded, causal=causal, scale=scale)
    return _unpad(_from_kernel(dQ, q), d), _unpad(_from_kernel(dK, q), d), _unpad(_from_kernel(dV, q), d_v)


def _tensorcore():
    from kernels_gpu import tensorcore
    return tensorcore


def tensorcore_has_backward() -> bool:
    """Whether ``kernels_gpu.tensorcore`` has its backward kernel (asked at each call, not at import)."""
    return hasattr(_tensorcore(), "flash2_backward")


def tensorcore_layout(like: torch.Tensor, shape=None) -> torch.Tensor:
    """An empty tensor laid out as the tensor-core path lays out its results: O like q, dQ, dK, dV like q, k, v
    (``kernels_gpu.tensorcore.launch.empty_like_layout``: the axes in memory in the order of ``like``'s strides).
    The fake implementations use it too, so a traced graph expects the strides the kernels produce."""
    from kernels_gpu.tensorcore.launch import empty_like_layout
    return empty_like_layout(like, shape)


def _in_layout(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` if it is laid out as :func:`tensorcore_layout` of ``like`` would be (as the kernels lay out their
    results when they read their inputs in place), else a copy that is (a padded head dimension, or inputs the
    kernels had to copy)."""
    from kernels_gpu.tensorcore.launch import layout_strides
    return x if x.stride() == layout_strides(like, x.shape) else tensorcore_layout(like, x.shape).copy_(x)


def hopper_forward_applies(device: torch.device, d: int, N_k: int, causal: bool) -> bool:
    """Whether the forward runs ``kernels_gpu.hopper`` (wgmma, TMA: rung h5) rather than the mma.sync ladder: on an
    sm_90 GPU from N_k = 2048. The H200 run on record (``benchmarks/results/nvidia-h200/hopper_forward_h5_*.json``,
    2026-12-02, calls queued as a training loop queues them) measured h5 faster than v11 at every d (64, 128, 256),
    N_k (1024-16384), causal or not, float16 and bfloat16 — by 1.07-2.7×. But a Hopper call costs the host about
    0.2-0.4 ms more before its kernel starts (the ``serial_ms`` of the same records), so a lone call at N_k = 1024,
    or causal at 2048, from an idle GPU measured slower than v11; below 2048 keys the mma.sync ladder keeps it."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return N_k >= 2048


def _tensor_core_forward(q, k, v, causal: bool, scale: float):
    """FA2 Alg. 1 on tensor cores (float16/bfloat16 in and out, L float32), padded to :func:`tensorcore_width`:
    ``kernels_gpu.hopper.flash_forward`` where :func:`hopper_forward_applies`, else
    ``kernels_gpu.tensorcore.flash2_forward``. The kernels take PyTorch tensors themselves — strided ones in
    place — and launch on PyTorch's current stream; O comes back laid out like q (:func:`tensorcore_layout`)."""
    d_v = v.shape[-1]
    D = tensorcore_width(q.shape[-1], d_v)
    if hopper_forward_applies(q.device, D, k.shape[-2], causal):
        from kernels_gpu import hopper
        forward = hopper.flash_forward
    else:
        forward = _tensorcore().flash2_forward
    O, L = forward(*(_pad(x, D) for x in (q, k, v)), causal=causal, scale=scale)
    return _in_layout(_unpad(_from_kernel(O, q), d_v), q), _from_kernel(L, q)


def _tensor_core_backward(q, k, v, O, L, dO, causal: bool, scale: float):
    """FA2 Alg. 2 for float16/bfloat16 tensors.

    On tensor cores with ``kernels_gpu.tensorcore.flash2_backward``, looked up now, at each call (not at import).
    A kernels_gpu without it gets the float32 fast backward on the inputs cast up, gradients cast back to the
    inputs' dtype: right, but paying for the casts and running on CUDA cores.
    """
    tensorcore = _tensorcore()
    if hasattr(tensorcore, "flash2_backward"):
        d, d_v = q.shape[-1], v.shape[-1]
        D = tensorcore_width(d, d_v)
        Q, K, V, O_, dO_ = (_pad(x, D) for x in (q, k, v, O, dO))
        dQ, dK, dV = tensorcore.flash2_backward(Q, K, V, O_, L, dO_, causal=causal, scale=scale)
        return tuple(_in_layout(_unpad(_from_kernel(g, q), width), like)
                     for g, width, like in ((dQ, d, q), (dK, d, k), (dV, d_v, v)))
    # The fallback: float32 on CUDA cores (kernels_gpu.fast), the same formulas on the upcast values.
    grads = _fast_backward(*(x.float() for x in (q, k, v, O)), L.float(), dO.float(), causal, scale)
    return tuple(g.to(q.dtype) for g in grads)


def flash2_forward(backend: str, q, k, v, causal: bool, scale: float, block_sizes, M):
    """(O, L) of FA2 Alg. 1 on ``backend``; O (…, N_q, d_v) in q's dtype, L (…, N_q) in float32 (float64 for
    float64 inputs), +inf on rows that see no key."""
    if backend == "numpy":
        fwd = fa2edu.flash2_forward(_to_numpy(q), _to_numpy(k), _to_numpy(v), M=M, block_sizes=block_sizes,
                                    causal=causal, scale=scale)
        return _from_numpy(fwd.O), _from_numpy(fwd.L)
    if backend == "fast":
        return _fast_forward(q, k, v, causal, scale)
    if backend == "tensorcore":
        return _tensor_core_forward(q, k, v, causal, scale)
    if backend == "3xtf32":
        return _three_tf32_forward(q, k, v, causal, scale)
    # the teaching kernel: one thread block per row block of Q (FA2 Section 3.2), any head dimension
    with _numba_stream(q.device):
        O, L = _kernels_gpu().flash2_forward(*(_for_kernel(x) for x in (q, k, v)), block_sizes=block_sizes,
                                             causal=causal, scale=scale)
    return _from_kernel(O, q), _from_kernel(L, q)


def flash2_backward(backend: str, q, k, v, O, L, dO, causal: bool, scale: float, block_sizes, M):
    """(dQ, dK, dV) of FA2 Alg. 2 on ``backend``, from the forward's O and L; dK, dV summed over GQA groups."""
    if backend == "numpy":
        grads = fa2edu.flash2_backward(*(_to_numpy(x) for x in (q, k, v, O, L, dO)), M=M, block_sizes=block_sizes,
                                       causal=causal, scale=scale)
        return tuple(_from_numpy(x) for x in grads)
    if backend == "fast":
        return _fast_backward(q, k, v, O, L, dO, causal, scale)
    if backend == "tensorcore":
        return _tensor_core_backward(q, k, v, O, L, dO, causal, scale)
    if backend == "3xtf32":
        return _three_tf32_backward(q, k, v, O, L, dO, causal, scale)
    with _numba_stream(q.device):
        grads = _kernels_gpu().flash2_backward(*(_for_kernel(x) for x in (q, k, v, O, L, dO)),
                                               block_sizes=block_sizes, causal=causal, scale=scale)
    return tuple(_from_kernel(x, q) for x in grads)


# -- FA1 (NumPy only) and standard attention (NumPy or the teaching kernels) ----------------------------------------

def flash1_forward(backend: str, q, k, v, causal: bool, scale: float, block_sizes, M):
    """(O, ℓ, m) of FA1 Alg. 2 (NumPy): O and the two row statistics that FA1 Alg. 4 reads back."""
    fwd = fa2edu.flash1_forward(_to_numpy(q), _to_numpy(k), _to_numpy(v), M=M, block_sizes=block_sizes,
                                causal=causal, scale=scale)
    return _from_numpy(fwd.O), _from_numpy(fwd.l), _from_numpy(fwd.m)


def flash1_backward(backend: str, q, k, v, O, l, m, dO, causal: bool, scale: float, block_sizes, M):
    """(dQ, dK, dV) of FA1 Alg. 4 (NumPy): P rebuilt block by block from ℓ and m."""
    grads = fa2edu.flash1_backward(*(_to_numpy(x) for x in (q, k, v, O, l, m, dO)), M=M, block_sizes=block_sizes,
                                   causal=causal, scale=scale)
    return tuple(_from_numpy(x) for x in grads)


def standard_forward(backend: str, q, k, v, causal: bool, scale: float, block_sizes, M):
    """(O, P) of FA1 Alg. 0: S and P materialised (NumPy, or the teaching kernels' separate launches)."""
    if backend == "numpy":
        fwd = fa2edu.standard_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v), causal=causal, scale=scale)
        return _from_numpy(fwd.O), _from_numpy(fwd.P)
    with _numba_stream(q.device):
        O, P = _kernels_gpu().standard_attention(*(_for_kernel(x) for x in (q, k, v)), causal=causal, scale=scale)
    return _from_kernel(O, q), _from_kernel(P, q)


def standard_backward(backend: str, q, k, v, P, dO, causal: bool, scale: float, block_sizes, M):
    """(dQ, dK, dV) of FA1 Alg. 3: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P)), dQ = τ dS K, dK = τ dSᵀ Q."""
    if backend == "numpy":
        grads = fa2edu.standard_attention_backward(*(_to_numpy(x) for x in (q, k, v, P, dO)), causal=causal,
                                                   scale=scale)
        return tuple(_from_numpy(x) for x in grads)
    with _numba_stream(q.device):
        grads = _kernels_gpu().standard_attention_backward(*(_for_kernel(x) for x in (q, k, v, P, dO)),
                                                           causal=causal, scale=scale)
    return tuple(_from_kernel(x, q) for x in grads)


# =================================================================================================================
# 3. The custom operators
# =================================================================================================================
#
# Each operator takes the resolved arguments (scale a float, backend a name of BACKENDS) and returns new tensors:
# contiguous, except on the tensor cores, which read strided q, k, v, O, dO in place and lay O, dQ, dK, dV out like
# q, k, v (:func:`tensorcore_layout`). Its fake implementation returns empty tensors of the same shapes, dtypes,
# devices and strides: what torch.compile's tracing (FakeTensors, no data) and torch.library.opcheck need.
#
# Each operator's body is a plain function of its own (``*_impl``), which the operator calls. fa2edu.torch's
# autograd Functions call the same functions directly: in eager mode PyTorch's dispatcher has nothing to add, and
# going through it costs host time on every call (`benchmarks/profilers/op_host_time.py`).

def _check_finite(*named) -> None:
    """Inputs must be finite. Checked on the CPU only: on a GPU the check would read the tensors once more and
    wait for the GPU (a host synchronisation on every call); the GPU kernels, like SDPA, trust their inputs."""
    for name, x in named:
        if not x.is_cuda and x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} contains NaN or infinite values; attention inputs must be finite")


def _check_inputs(q, k, v, scale: float) -> None:
    """The forward operators' value checks, as fa2edu's NumPy API makes them: q, k, v finite, and scores τ·q·k
    within the compute dtype (float32, float64 for float64), else an ``AttentionOverflowError`` naming q and k
    (:func:`fa2edu.validation.check_score_range`: cheap first, exact only where the cheap bound fails). CPU tensors
    only, for the reason :func:`_check_finite` gives; on a GPU the kernels return what their arithmetic gives."""
    _check_finite(("q", q), ("k", k), ("v", v))
    if q.is_cuda or not q.numel() or not k.numel():
        return
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    limit = float(torch.finfo(work).max) / 2
    grow = max(1.0, abs(scale))
    if q.shape[-1] * float(q.detach().abs().max()) * float(k.detach().abs().max()) * grow <= limit:
        return                                                     # the cheap bound: nothing can overflow
    Q, K = (x.detach().double().numpy() for x in (q, k))          # (bfloat16 has no NumPy dtype)
    if q.dim() >= 3:                                               # GQA: query head h·G + g meets key head h only
        H_q, H_kv = q.shape[-3], k.shape[-3]
        Q = Q.reshape(Q.shape[:-3] + (H_kv, H_q // H_kv) + Q.shape[-2:])
        K = K[..., None, :, :]
    check_score_range(Q, K, scale, np.float64 if work == torch.float64 else np.float32, names=("q", "k"))


def _new(x: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """An empty contiguous tensor on ``x``'s device (the fakes' outputs)."""
    return x.new_empty(tuple(shape), dtype=x.dtype if dtype is None else dtype)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of L, ℓ, m: the compute dtype, float64 for float64 inputs and float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _contiguous(*xs):
    return tuple(x.contiguous() for x in xs)


def reads_strided(backend: str) -> bool:
    """Whether ``backend`` reads strided tensors in place and lays its results out like its inputs
    (:attr:`Backend.strided`); the others are handed contiguous tensors and return contiguous results."""
    return BACKENDS[backend].strided


def _results(backend: str, *xs):
    """An operator's results: as a strided backend laid them out (:func:`tensorcore_layout`), else contiguous."""
    return xs if reads_strided(backend) else _contiguous(*xs)


def flash_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M):
    """FA2 Alg. 1: (O, L) of q (…, H_q, N_q, d), k (…, H_kv, N_k, d), v (…, H_kv, N_k, d_v)."""
    _check_inputs(q, k, v, scale)
    sizes = None if block_sizes is None else tuple(block_sizes)
    return _results(backend, *flash2_forward(backend, q, k, v, causal, scale, sizes, M))


@torch.library.custom_op("fa2edu::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                        backend: str, block_sizes: Optional[list[int]], M: Optional[int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """FA2 Alg. 1: (O, L) of q (…, H_q, N_q, d), k (…, H_kv, N_k, d), v (…, H_kv, N_k, d_v)."""
    return flash_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M)


@flash_attention_fwd.register_fake
def _(q, k, v, causal, scale, backend, block_sizes, M):
    shape = (*q.shape[:-1], v.shape[-1])
    O = tensorcore_layout(q, shape) if reads_strided(backend) else _new(q, shape)
    return O, _new(q, q.shape[:-1], _stat_dtype(q.dtype))


def flash_attention_bwd_impl(dO, q, k, v, O, L, causal, scale, backend, block_sizes, M):
    """FA2 Alg. 2: (dQ, dK, dV) from the inputs, the forward's O and L, and the upstream gradient dO."""
    sizes = None if block_sizes is None else tuple(block_sizes)
    if not reads_strided(backend):
        dO = dO.contiguous()
    return _results(backend, *flash2_backward(backend, q, k, v, O, L, dO, causal, scale, sizes, M))


@torch.library.custom_op("fa2edu::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(dO: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, O: torch.Tensor,
                        L: torch.Tensor, causal: bool, scale: float, backend: str,
                        block_sizes: Optional[list[int]], M: Optional[int]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA2 Alg. 2: (dQ, dK, dV) from the inputs, the forward's O and L, and the upstream gradient dO."""
    return flash_attention_bwd_impl(dO, q, k, v, O, L, causal, scale, backend, block_sizes, M)


@flash_attention_bwd.register_fake
def _(dO, q, k, v, O, L, causal, scale, backend, block_sizes, M):
    if reads_strided(backend):
        return tensorcore_layout(q), tensorcore_layout(k), tensorcore_layout(v)
    return _new(q, q.shape), _new(k, k.shape), _new(v, v.shape)


def flash1_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M):
    """FA1 Alg. 2: (O, ℓ, m)."""
    _check_inputs(q, k, v, scale)
    sizes = None if block_sizes is None else tuple(block_sizes)
    return _contiguous(*flash1_forward(backend, q, k, v, causal, scale, sizes, M))


@torch.library.custom_op("fa2edu::flash1_attention_fwd", mutates_args=())
def flash1_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                         backend: str, block_sizes: Optional[list[int]], M: Optional[int]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA1 Alg. 2: (O, ℓ, m)."""
    return flash1_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M)


@flash1_attention_fwd.register_fake
def _(q, k, v, causal, scale, backend, block_sizes, M):
    stat = _stat_dtype(q.dtype)
    return _new(q, (*q.shape[:-1], v.shape[-1])), _new(q, q.shape[:-1], stat), _new(q, q.shape[:-1], stat)


def flash1_attention_bwd_impl(dO, q, k, v, O, l, m, causal, scale, backend, block_sizes, M):  # noqa: E741
    """FA1 Alg. 4: (dQ, dK, dV) from the inputs, O, ℓ, m and dO."""
    sizes = None if block_sizes is None else tuple(block_sizes)
    return _contiguous(*flash1_backward(backend, q, k, v, O, l, m, dO.contiguous(), causal, scale, sizes, M))


@torch.library.custom_op("fa2edu::flash1_attention_bwd", mutates_args=())
def flash1_attention_bwd(dO: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, O: torch.Tensor,
                         l: torch.Tensor, m: torch.Tensor, causal: bool, scale: float, backend: str,  # noqa: E741
                         block_sizes: Optional[list[int]], M: Optional[int]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA1 Alg. 4: (dQ, dK, dV) from the inputs, O, ℓ, m and dO."""
    return flash1_attention_bwd_impl(dO, q, k, v, O, l, m, causal, scale, backend, block_sizes, M)


@flash1_attention_bwd.register_fake
def _(dO, q, k, v, O, l, m, causal, scale, backend, block_sizes, M):  # noqa: E741
    return _new(q, q.shape), _new(k, k.shape), _new(v, v.shape)


def standard_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M):
    """FA1 Alg. 0: (O, P), P of shape (…, H_q, N_q, N_k)."""
    _check_inputs(q, k, v, scale)
    return _contiguous(*standard_forward(backend, q, k, v, causal, scale, None, None))


@torch.library.custom_op("fa2edu::standard_attention_fwd", mutates_args=())
def standard_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                           backend: str, block_sizes: Optional[list[int]], M: Optional[int]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """FA1 Alg. 0: (O, P), P of shape (…, H_q, N_q, N_k)."""
    return standard_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M)


@standard_attention_fwd.register_fake
def _(q, k, v, causal, scale, backend, block_sizes, M):
    return _new(q, (*q.shape[:-1], v.shape[-1])), _new(q, (*q.shape[:-1], k.shape[-2]))


def standard_attention_bwd_impl(dO, q, k, v, P, causal, scale, backend, block_sizes, M):
    """FA1 Alg. 3: (dQ, dK, dV) from the inputs, P and dO."""
    return _contiguous(*standard_backward(backend, q, k, v, P, dO.contiguous(), causal, scale, None, None))


@torch.library.custom_op("fa2edu::standard_attention_bwd", mutates_args=())
def standard_attention_bwd(dO: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, P: torch.Tensor,
                           causal: bool, scale: float, backend: str, block_sizes: Optional[list[int]],
                           M: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA1 Alg. 3: (dQ, dK, dV) from the inputs, P and dO."""
    return standard_attention_bwd_impl(dO, q, k, v, P, causal, scale, backend, block_sizes, M)


@standard_attention_bwd.register_fake
def _(dO, q, k, v, P, causal, scale, backend, block_sizes, M):
    return _new(q, q.shape), _new(k, k.shape), _new(v, v.shape)


# =================================================================================================================
# 4. FlexAttention: mods as code (fa2edu.flex on the CPU, kernels_gpu.flex on CUDA)
# =================================================================================================================
#
# fa2edu.torch.flex_attention computes with fa2edu.flex (NumPy, FA2's loops over a BlockMask) on CPU tensors and
# with kernels_gpu.flex (the same mods compiled by numba into the tensor-core kernels) on CUDA float16/bfloat16
# tensors: FLEX_DISPATCH below, the operators' ``backend`` argument. Its mods are Python functions, and an
# operator's arguments are tensors, numbers,
# strings and lists of them: a function cannot be one. So the mods travel in two ways, one per road of fa2edu.torch:
#
# * **eager**: the autograd Function is handed the :class:`FlexMods` object itself and keeps it on its context for
#   the backward pass; nothing global is touched, and the mods die with the autograd graph;
# * **traced** (torch.compile and the other tracers): the operators take an ``int``, the key of the mods in
#   :data:`MODS`, a registry that :func:`register_mods` fills while the caller's code is traced. torch.compile
#   calls it once per compilation (``torch.compiler.assume_constant_result``) and bakes the key into the graph;
#   the key's ``id()`` arguments make the compiled code guard on the identity of each mod, so other mods (another
#   ``softcap(c)`` closure, with the same code) compile again instead of reusing the key.
#
# The registry holds the caller's own objects weakly: an entry goes away when its mods are garbage-collected (and
# torch.compile drops the compiled code that guarded on them), so it does not grow with the number of calls or
# leak mods. Objects that torch.compile rebuilt while tracing (a functools.partial, a function defined inside the
# compiled code) are nobody else's and are held strongly: one entry per compilation, as long-lived as the compiled
# code that uses it. Keys count up and are never reused, so a stale key is a clear error, never someone else's
# mods. The flash-attn keywords of flash_attention (window_size, softcap, alibi_slopes) need none of this: they are
# numbers and a tensor, so their operators take them as they are and build the mods inside.

#: Where FlexAttention runs, per (device type, dtype), when no backend is named: CPU float32/float64 on fa2edu.flex
#: (NumPy, the counted textbook code); CUDA float16/bfloat16 on kernels_gpu.flex (the mods compiled by numba into the
#: mma.sync forward and backward). CUDA float32 has no FlexAttention kernel of float32's accuracy (the tensor-core
#: kernels take 16-bit inputs, and running them on float32 tensors would round q, k, v to 16 bits: bfloat16's error
#: where the caller asked for float32's); it gets a clear error naming the two honest choices, never a silent cast or
#: a silent copy to the CPU.
FLEX_DISPATCH = {
    ("cpu", torch.float32): "numpy",
    ("cpu", torch.float64): "numpy",
    ("cuda", torch.float16): "tensorcore",
    ("cuda", torch.bfloat16): "tensorcore",
}

#: the backends FlexAttention runs on: name → (devices, dtypes); "tensorcore" also takes CPU tensors in numba's
#: CUDA simulator when named (how the tests run the GPU route)
FLEX_BACKENDS = {
    "numpy": (("cpu",), (torch.float32, torch.float64)),
    "tensorcore": (("cuda",), (torch.float16, torch.bfloat16)),
}

#: what FlexAttention on CUDA float32 tensors says ({what}: the function's name)
FLEX_FLOAT32_CUDA_ERROR = (
    "{what} on CUDA takes float16 or bfloat16 (kernels_gpu.flex: the mods compiled into tensor-core kernels, "
    "float32 accumulators); q has dtype torch.float32, and no FlexAttention kernel of float32's accuracy exists in "
    "kernels_gpu. Cast q, k, v to torch.bfloat16 (or float16) yourself to run on the GPU with 16-bit inputs, or "
    "move them to the CPU (.cpu()) for the float32 NumPy path; the op neither rounds float32 to 16 bits nor copies "
    "to the CPU behind your back")


def choose_flex_backend(device_type: str, dtype: torch.dtype, backend: str | None = None, *,
                        what: str = "fa2edu.torch.flex_attention", simulator: bool | None = None) -> str:
    """The backend that runs FlexAttention (``flex_attention``, and ``flash_attention``'s flash-attn keywords) for
    tensors of ``dtype`` on ``device_type``: :data:`FLEX_DISPATCH` when ``backend`` is None, else the named one
    (:data:`FLEX_BACKENDS`), checked; ``"tensorcore"`` takes CPU tensors in numba's CUDA simulator.

    Raises:
        ValueError: an unknown device or backend, or a backend that does not run on this device.
        TypeError: a dtype that no FlexAttention backend takes there (CUDA float32: :data:`FLEX_FLOAT32_CUDA_ERROR`).
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"q, k, v are on device {device_type!r}; {what} runs on 'cpu' and 'cuda'")
    if backend is None:
        backend = FLEX_DISPATCH.get((device_type, dtype))
        if backend is None:
            if device_type == "cuda" and dtype == torch.float32:
                raise TypeError(FLEX_FLOAT32_CUDA_ERROR.format(what=what))
            if device_type == "cpu":
                raise TypeError(f"q has dtype {dtype}; on the CPU {what} takes float32 or float64"
                                f"{_dtype_hint('cpu', dtype)}")
            raise TypeError(f"q has dtype {dtype}; on CUDA {what} takes float16 or bfloat16"
                            f"{_dtype_hint(device_type, dtype)}")
        return backend
    if backend not in FLEX_BACKENDS:
        raise ValueError(f"backend must be one of {tuple(FLEX_BACKENDS)} or None for {what}, got {backend!r}")
    devices, dtypes = FLEX_BACKENDS[backend]
    simulated_gpu = device_type == "cpu" and "cuda" in devices and (
        simulator_enabled() if simulator is None else simulator)
    if device_type not in devices and not simulated_gpu:
        hint = (" (a CUDA backend takes CPU tensors only in numba's CUDA simulator, NUMBA_ENABLE_CUDASIM=1)"
                if device_type == "cpu" else "")
        raise ValueError(f"backend={backend!r} runs on {' and '.join(devices)}, but q, k, v are on {device_type}"
                         f"{hint}")
    if dtype not in dtypes:
        takes = " or ".join(str(t).removeprefix("torch.") for t in dtypes)
        if device_type == "cuda" and dtype == torch.float32:
            raise TypeError(FLEX_FLOAT32_CUDA_ERROR.format(what=what))
        raise TypeError(f"q has dtype {dtype}; {what} with backend={backend!r} takes {takes}")
    return backend


@dataclass(frozen=True, eq=False)
class FlexMods:
    """What a flex_attention call needs besides its tensors: the score_mod, its derivative and the block mask.

    Attributes:
        score_mod (callable or None): ``score_mod(score, b, h, q_idx, kv_idx) -> score``, or None.
        score_mod_grad (callable or None): its derivative with respect to score, or None (then the backward pass
            uses ``score_mod.score_mod_grad``, and raises when there is none).
        block_mask (fa2edu.flex.BlockMask or None): the mask, or None (every score kept).
    """

    score_mod: Callable | None
    score_mod_grad: Callable | None
    block_mask: Any


#: fa2edu BlockMasks made from PyTorch's, by the PyTorch BlockMask (weakly: one conversion while it lives)
_CONVERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CONVERTED_LOCK = threading.Lock()


def _torch_block_mask_type():
    """torch.nn.attention.flex_attention.BlockMask, or None where this PyTorch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:                                   # pragma: no cover - PyTorch < 2.5
        return None
    return BlockMask


def _mask_mod_on_tensors(mask_mod):
    """A mask_mod written for PyTorch (called on index tensors, as torch's create_block_mask calls it), callable
    with the NumPy arrays and Python ints that fa2edu.flex evaluates mods on."""
    def on_tensors(b, h, q_idx, kv_idx):
        return np.asarray(mask_mod(*(torch.as_tensor(x) for x in (b, h, q_idx, kv_idx))))
    on_tensors.__name__ = getattr(mask_mod, "__name__", type(mask_mod).__name__)
    on_tensors.torch_mask_mod = mask_mod         # what the GPU route compiles (numba, on scalars)
    return on_tensors


def from_torch_block_mask(block_mask):
    """A PyTorch ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask``) as a fa2edu.flex BlockMask.

    The classes are PyTorch's own: a block listed in ``kv_indices`` is partial, one in ``full_kv_indices`` full,
    the rest skipped; partial blocks evaluate PyTorch's mask_mod, on tensors, as PyTorch does (so a BlockMask made
    with ``BlockMask.from_kv_blocks`` keeps its meaning too). PyTorch's mask_mods are written as they apply, without
    fa2edu's bottom-right specialisation (:func:`fa2edu.flex.at_lengths`): the same scores are kept as in
    torch.nn.attention.flex_attention. Converted once per PyTorch BlockMask (cached while it lives).

    Args:
        block_mask (torch.nn.attention.flex_attention.BlockMask): the mask, its index tensors on any device.

    Returns:
        fa2edu.flex.BlockMask: the same blocks and mask_mod, shape (B, H, Q_LEN, KV_LEN) as PyTorch's.
    """
    with _CONVERTED_LOCK:
        converted = _CONVERTED.get(block_mask)
    if converted is not None:
        return converted
    Q_LEN, KV_LEN = (int(n) for n in block_mask.seq_lengths)
    B_r, B_c = (int(n) for n in block_mask.BLOCK_SIZE)
    B, H, T_r = block_mask.kv_num_blocks.shape
    T_c = num_blocks(KV_LEN, B_c)
    if T_r != num_blocks(Q_LEN, B_r) or block_mask.kv_indices.shape[-1] < T_c:
        raise ValueError(f"block_mask: this PyTorch BlockMask has {T_r} query blocks and "
                         f"{block_mask.kv_indices.shape[-1]} key blocks for Q_LEN = {Q_LEN}, KV_LEN = {KV_LEN}, "
                         f"BLOCK_SIZE = ({B_r}, {B_c}); expected "
                         f"{num_blocks(Q_LEN, B_r)} and {T_c}: make it with fa2edu.create_block_mask instead")
    classes = np.full((B, H, T_r, T_c), _flex.SKIPPED, dtype=np.int8)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, _flex.PARTIAL),
             (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, _flex.FULL)]
    for count, indices, kind in lists:
        if count is None:
            continue
        count, indices = count.detach().cpu().numpy(), indices.detach().cpu().numpy()
        # entries n < count[b, h, i] of row (b, h, i) name the key blocks of that kind
        b, h, i, n = np.nonzero(np.arange(indices.shape[-1]) < count[..., None])
        classes[b, h, i, indices[b, h, i, n]] = kind
    converted = _flex.BlockMask(_mask_mod_on_tensors(block_mask.mask_mod), B, H, Q_LEN, KV_LEN, (B_r, B_c), classes)
    with _CONVERTED_LOCK:
        return _CONVERTED.setdefault(block_mask, converted)


def flex_mods(score_mod, block_mask, score_mod_grad) -> FlexMods:
    """The mods of one flex_attention call, checked: callables or None, and a BlockMask of fa2edu's (or PyTorch's,
    converted by :func:`from_torch_block_mask`) or None. Shapes are checked against q and k where they meet."""
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx) -> score, or None; got "
                        f"{type(score_mod).__name__}")
    if score_mod_grad is not None:
        if not callable(score_mod_grad):
            raise TypeError(f"score_mod_grad must be a callable score_mod_grad(score, b, h, q_idx, kv_idx) -> "
                            f"d score_mod / d score, or None; got {type(score_mod_grad).__name__}")
        if score_mod is None:
            raise ValueError("score_mod_grad was given without a score_mod")
    torch_block_mask = _torch_block_mask_type()
    if torch_block_mask is not None and isinstance(block_mask, torch_block_mask):
        block_mask = from_torch_block_mask(block_mask)
    elif block_mask is not None and not isinstance(block_mask, _flex.BlockMask):
        raise TypeError(f"block_mask must be a fa2edu.flex.BlockMask (fa2edu.create_block_mask), a PyTorch "
                        f"BlockMask (torch.nn.attention.flex_attention.create_block_mask) or None; got "
                        f"{type(block_mask).__name__}")
    return FlexMods(score_mod, score_mod_grad, block_mask)


class ModRegistry:
    """Integer keys for :class:`FlexMods`, so that the traced road's operators can take them (see above).

    Thread-safe: one lock guards the tables. Weakly held objects report their death through weakref callbacks,
    which may run whenever the garbage collector does — inside this registry's own locked code too — so they only
    append the dead key to a list that the next call clears under the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple] = {}         # key → (references, identity)
        self._keys: dict[tuple, int] = {}            # identity (the id()s of the objects held) → key
        self._counter = itertools.count(1)
        self._dead: list[int] = []

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return len(self._entries)

    def _purge(self) -> None:
        while self._dead:
            key = self._dead.pop()
            entry = self._entries.pop(key, None)
            if entry is not None and self._keys.get(entry[1]) == key:
                del self._keys[entry[1]]

    def _reference(self, obj, owned: bool, key: int):
        """A callable giving ``obj`` back: a weak reference when the caller owns it (the entry dies with it), else
        the object itself, held strongly."""
        if obj is None:
            return lambda: None
        if owned:
            def died(_, key=key, dead=self._dead):
                dead.append(key)
            try:
                return (weakref.WeakMethod if isinstance(obj, types.MethodType) else weakref.ref)(obj, died)
            except TypeError:                      # no weak references to it (a class with __slots__): hold it
                pass
        return lambda: obj

    def register(self, mods: FlexMods, owned=(True, True, True)) -> int:
        """The key of ``mods`` (the same key for the same objects while they live). ``owned[i]``: whether the
        caller holds the i-th object (score_mod, score_mod_grad, block_mask), so it may be held weakly."""
        objects = (mods.score_mod, mods.score_mod_grad, mods.block_mask)
        identity = tuple(None if obj is None else id(obj) for obj in objects)
        with self._lock:
            self._purge()
            key = self._keys.get(identity)
            if key is not None and all(ref() is obj for ref, obj in zip(self._entries[key][0], objects)):
                return key
            key = next(self._counter)
            references = tuple(self._reference(obj, own, key) for obj, own in zip(objects, owned))
            self._entries[key] = (references, identity)
            self._keys[identity] = key
            return key

    def lookup(self, key: int) -> FlexMods:
        """The mods registered under ``key``; a RuntimeError when they are gone."""
        with self._lock:
            self._purge()
            entry = self._entries.get(key)
        objects = None if entry is None else tuple(ref() for ref in entry[0])
        if entry is None or any(obj is None and ident is not None for obj, ident in zip(objects, entry[1])):
            raise RuntimeError(
                f"fa2edu.torch.flex_attention: the mods registered under key {key} are gone (garbage-collected, or "
                "never registered): a traced or compiled flex_attention needs its score_mod, score_mod_grad and "
                "block_mask alive while its graph runs, its backward pass included; keep a reference to them "
                "(a module attribute, say) for as long as the graph is used")
        return FlexMods(*objects)


#: the registry of the traced road
MODS = ModRegistry()


@torch.compiler.assume_constant_result
def register_mods(score_mod, score_mod_grad, block_mask, identities) -> int:
    """Check the mods (:func:`flex_mods`) and register them in :data:`MODS`; the key. ``identities`` are the
    ``id()`` of each argument in the caller's code: an argument with another id is an object torch.compile rebuilt
    while tracing, which only the registry keeps alive. Under torch.compile this runs once per compilation, its
    answer a constant of the compiled graph."""
    owned = tuple(obj is None or ident == id(obj) for obj, ident in zip((score_mod, score_mod_grad, block_mask),
                                                                         identities))
    return MODS.register(flex_mods(score_mod, block_mask, score_mod_grad), owned)


def _check_block_mask_fits(block_mask, q_shape, k_shape) -> None:
    """The BlockMask must have been made for q's and k's lengths, its (B, H) equal to q's or 1 (fa2edu.flex's rule,
    checked here on shapes alone, so that torch.compile's fake run reports it)."""
    if block_mask is None:
        return
    B, H_q, N_q = q_shape[0], q_shape[1], q_shape[2]
    N_k = k_shape[2]
    if block_mask.Q_LEN != N_q or block_mask.KV_LEN != N_k:
        raise ValueError(f"block_mask was made for Q_LEN = {block_mask.Q_LEN}, KV_LEN = {block_mask.KV_LEN}, but q "
                         f"has N_q = {N_q} queries and k has N_k = {N_k} keys: make it with "
                         f"create_block_mask(mask_mod, B, H, {N_q}, {N_k})")
    if block_mask.B not in (1, B) or block_mask.H not in (1, H_q):
        raise ValueError(f"block_mask covers (B, H) = ({block_mask.B}, {block_mask.H}); q has (B, H) = ({B}, {H_q}):"
                         f" each must match or be 1 (None in create_block_mask: broadcast)")


def flex_forward(q, k, v, mods: FlexMods, scale: float, enable_gqa: bool, backend: str = "numpy"):
    """(O, L) of FlexAttention (FA2 Alg. 1 over the BlockMask) on tensors (B, H, N, d): O in q's dtype, L
    (B, H_q, N_q) in the compute dtype (float32 for 16-bit inputs), +inf on rows that keep no score. ``backend``
    "numpy": fa2edu.flex.flex_attention on CPU tensors; "tensorcore": kernels_gpu.flex.flex_forward
    (:func:`_flex_tensor_core_forward`)."""
    if backend == "tensorcore":
        return _flex_tensor_core_forward(q, k, v, mods, scale, enable_gqa)
    O, L = _flex.flex_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v), score_mod=mods.score_mod,
                                block_mask=mods.block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True)
    return _contiguous(_from_numpy(O), _from_numpy(L))


def flex_backward(dO, q, k, v, O, L, mods: FlexMods, scale: float, enable_gqa: bool, backend: str = "numpy"):
    """(dQ, dK, dV) of FlexAttention's backward (FA2 Alg. 2, through score_mod's derivative) on ``backend``
    (:func:`flex_forward`'s)."""
    if backend == "tensorcore":
        return _flex_tensor_core_backward(dO, q, k, v, O, L, mods, scale, enable_gqa)
    grads = _flex.flex_attention_backward(*(_to_numpy(x) for x in (q, k, v, O, L, dO)), score_mod=mods.score_mod,
                                          block_mask=mods.block_mask, scale=scale, enable_gqa=enable_gqa,
                                          score_mod_grad=mods.score_mod_grad)
    return _contiguous(*(_from_numpy(x) for x in grads))


# -- FlexAttention on tensor cores (kernels_gpu.flex) -------------------------------------------------------------

def retile_block_mask(block_mask, BLOCK_SIZE) -> "_flex.BlockMask":
    """``block_mask``'s classes for other blocks (B_r, B_c), read from its own classes alone (no mask_mod call).

    A new block is **full** when every old block it overlaps is full, **skipped** when every one is skipped, and
    **partial** otherwise. That is exact for full and skipped (the new block lies inside the union of the old
    blocks it overlaps) and safe for partial, where the kernel evaluates mask_mod per element: a new block inside
    the kept part of an old partial block is classed partial though it is full, which costs mask calls, never a
    wrong score. Cost: O(B·H·(T_r·T_c + T_r'·T_c')) with 2-D prefix sums over the old classes.

    Args:
        block_mask (fa2edu.flex.BlockMask): the mask.
        BLOCK_SIZE (tuple of int): the new (B_r, B_c).

    Returns:
        fa2edu.flex.BlockMask: the same mask_mod, shape and lengths, blocks (B_r, B_c).
    """
    B_r, B_c = BLOCK_SIZE
    if tuple(block_mask.BLOCK_SIZE) == (B_r, B_c):
        return block_mask
    old_r, old_c = block_mask.BLOCK_SIZE
    Q_LEN, KV_LEN = block_mask.Q_LEN, block_mask.KV_LEN
    T_r, T_c = num_blocks(Q_LEN, B_r), num_blocks(KV_LEN, B_c)

    def ranges(T: int, new: int, old: int, N: int):
        first = np.arange(T) * new
        last = np.minimum(first + new, N) - 1
        return first // old, last // old + 1           # old blocks [start, stop) that the new block overlaps

    r0, r1 = ranges(T_r, B_r, old_r, Q_LEN)
    c0, c1 = ranges(T_c, B_c, old_c, KV_LEN)

    def count(hit):                                     # old blocks with ``hit`` inside each new block's range
        P = np.zeros(hit.shape[:2] + (hit.shape[2] + 1, hit.shape[3] + 1), dtype=np.int64)
        P[:, :, 1:, 1:] = hit.cumsum(axis=2).cumsum(axis=3)
        R0, R1, C0, C1 = r0[:, None], r1[:, None], c0[None, :], c1[None, :]
        return P[:, :, R1, C1] - P[:, :, R0, C1] - P[:, :, R1, C0] + P[:, :, R0, C0]

    total = (r1 - r0)[:, None] * (c1 - c0)[None, :]
    classes = np.full(block_mask.classes.shape[:2] + (T_r, T_c), _flex.PARTIAL, dtype=np.int8)
    classes[count(block_mask.classes == _flex.FULL) == total] = _flex.FULL
    classes[count(block_mask.classes == _flex.SKIPPED) == total] = _flex.SKIPPED
    return _flex.BlockMask(block_mask.mask_mod, block_mask.B, block_mask.H, Q_LEN, KV_LEN, (B_r, B_c), classes)


#: block masks as the kernels take them, per fa2edu BlockMask (weakly): {(pass, width, dtype): BlockMask}
_KERNEL_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KERNEL_MASKS_LOCK = threading.Lock()


def _kernel_block_mask(block_mask, pass_: str, width: int, dtype: str):
    """The BlockMask a kernels_gpu.flex pass runs for ``block_mask``: its own blocks when the kernel runs that tile
    at this width (``kernels_gpu.flex.config_for`` / ``backward_config_for``), else the same mask retiled
    (:func:`retile_block_mask`) to the kernel's default tile; a PyTorch BlockMask's mask_mod as PyTorch wrote it
    (numba compiles it for scalars), not the tensor wrapper the NumPy path calls. Cached per BlockMask."""
    if block_mask is None:
        return None
    import kernels_gpu.flex as kflex
    import kernels_gpu.runtime as rt
    key = (pass_, width, dtype)
    with _KERNEL_MASKS_LOCK:
        found = _KERNEL_MASKS.get(block_mask, {}).get(key)
    if found is not None:
        return found
    simulated = rt.simulator_in_use()
    fits = kflex.config_for if pass_ == "forward" else kflex.backward_config_for
    sizes = tuple(block_mask.BLOCK_SIZE)
    try:
        fits(width, dtype, sizes, simulated)
        mask = block_mask
    except ValueError:              # a tile the kernel cannot run (odd sizes, too much shared memory at this width)
        default = kflex.DEFAULT_BLOCK_SIZE if pass_ == "forward" else (64 if width <= 64 else 32, 64)
        mask = retile_block_mask(block_mask, default)
    torch_mod = getattr(mask.mask_mod, "torch_mask_mod", None)
    if torch_mod is not None:
        mask = _flex.BlockMask(torch_mod, mask.B, mask.H, mask.Q_LEN, mask.KV_LEN, mask.BLOCK_SIZE, mask.classes)
    with _KERNEL_MASKS_LOCK:
        _KERNEL_MASKS.setdefault(block_mask, {})[key] = mask
    return mask


def _kernel_dtype(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def _flex_tensor_core_forward(q, k, v, mods: FlexMods, scale: float, enable_gqa: bool):
    """FlexAttention forward on ``kernels_gpu.flex.flex_forward`` (float16/bfloat16, float32 accumulators): q, k, v
    padded with zero columns to :func:`tensorcore_width` (the kernels take d = d_v, a multiple of 8; a zero column
    adds 0 to every score), the block mask's tile kept or retiled (:func:`_kernel_block_mask`); O sliced back to
    d_v, contiguous, L float32 (+inf on rows that keep no score). CUDA tensors zero-copy on PyTorch's current
    stream; CPU tensors in numba's simulator."""
    import kernels_gpu.flex as kflex
    d_v = v.shape[-1]
    D = tensorcore_width(q.shape[-1], d_v)
    block_mask = _kernel_block_mask(mods.block_mask, "forward", D, _kernel_dtype(q))
    Q, K, V = (_pad(x.contiguous(), D) for x in (q, k, v))
    O, L = kflex.flex_forward(Q, K, V, score_mod=mods.score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa)
    return _unpad(_from_kernel(O, q), d_v).contiguous(), _from_kernel(L, q).contiguous()


def _flex_tensor_core_backward(dO, q, k, v, O, L, mods: FlexMods, scale: float, enable_gqa: bool):
    """FlexAttention backward on ``kernels_gpu.flex.flex_backward`` (built as the mma.sync backward v7 over the
    block classes: a key-block kernel for dK, dV and a query-block kernel for dQ, through score_mod's derivative),
    padded as the forward; dQ, dK, dV contiguous in
    the inputs' dtype, dK, dV summed over each GQA group."""
    import kernels_gpu.flex as kflex
    d, d_v = q.shape[-1], v.shape[-1]
    D = tensorcore_width(d, d_v)
    block_mask = _kernel_block_mask(mods.block_mask, "backward", D, _kernel_dtype(q))
    Q, K, V, O_, dO_ = (_pad(x.contiguous(), D) for x in (q, k, v, O, dO))
    grads = kflex.flex_backward(Q, K, V, O_, L.contiguous(), dO_, score_mod=mods.score_mod, block_mask=block_mask,
                                scale=scale, enable_gqa=enable_gqa, score_mod_grad=mods.score_mod_grad)
    return tuple(_unpad(_from_kernel(g, q), width).contiguous() for g, width in zip(grads, (d, d, d_v)))


def _keep_until_freed(x: torch.Tensor, obj) -> None:
    """Keep ``obj`` alive as long as the tensor ``x`` lives (a finalizer holds it, and lets go when x is freed)."""
    weakref.finalize(x, _let_go, obj)


def _let_go(obj) -> None:
    """A finalizer's callback: holding ``obj`` until now was its whole job."""


def flex_attention_fwd_impl(q, k, v, mods, scale, enable_gqa, backend):
    """FlexAttention forward: (O, L) of q (B, H_q, N_q, d), k (B, H_kv, N_k, d), v (B, H_kv, N_k, d_v) with the mods
    registered under the key ``mods``, on ``backend`` (:func:`choose_flex_backend`). The mods are kept alive with L,
    which the backward pass saves: a compiled graph's backward finds them even when the caller let go of them
    after the forward pass."""
    found = MODS.lookup(mods)
    O, L = flex_forward(q, k, v, found, scale, enable_gqa, backend)
    _keep_until_freed(L, found)
    return O, L


@torch.library.custom_op("fa2edu::flex_attention_fwd", mutates_args=())
def flex_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: int, scale: float,
                       enable_gqa: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention forward: (O, L) of q (B, H_q, N_q, d), k (B, H_kv, N_k, d), v (B, H_kv, N_k, d_v) with the mods
    registered under the key ``mods``, on ``backend`` ("numpy" or "tensorcore")."""
    return flex_attention_fwd_impl(q, k, v, mods, scale, enable_gqa, backend)


@flex_attention_fwd.register_fake
def _(q, k, v, mods, scale, enable_gqa, backend):
    _check_block_mask_fits(MODS.lookup(mods).block_mask, q.shape, k.shape)
    return _new(q, (*q.shape[:-1], v.shape[-1])), _new(q, q.shape[:-1], _stat_dtype(q.dtype))


def flex_attention_bwd_impl(dO, q, k, v, O, L, mods, scale, enable_gqa, backend):
    """FlexAttention backward: (dQ, dK, dV) from the inputs, O, L and dO, through the registered mods."""
    return flex_backward(dO.contiguous(), q, k, v, O, L, MODS.lookup(mods), scale, enable_gqa, backend)


@torch.library.custom_op("fa2edu::flex_attention_bwd", mutates_args=())
def flex_attention_bwd(dO: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, O: torch.Tensor,
                       L: torch.Tensor, mods: int, scale: float, enable_gqa: bool, backend: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlexAttention backward: (dQ, dK, dV) from the inputs, O, L and dO, through the registered mods."""
    return flex_attention_bwd_impl(dO, q, k, v, O, L, mods, scale, enable_gqa, backend)


@flex_attention_bwd.register_fake
def _(dO, q, k, v, O, L, mods, scale, enable_gqa, backend):
    return _new(q, q.shape), _new(k, k.shape), _new(v, v.shape)


# -- flash-attn's keywords: window_size, softcap, alibi_slopes ------------------------------------------------------

@lru_cache(maxsize=64)
def _window_block_mask(left: int, right: int, N_q: int, N_k: int, B_r: int, B_c: int):
    """The BlockMask of flash-attn's window (left, right) for these lengths and blocks, every block full for
    (−1, −1) (cached: a window costs O(N_q·N_k) mask evaluations to classify)."""
    mask_mod = None if (left, right) == (-1, -1) else _flex.local_window(left, right)
    return _flex.create_block_mask(mask_mod, None, None, N_q, N_k, BLOCK_SIZE=(B_r, B_c))


def flash_attn_mods(N_q: int, N_k: int, causal: bool, window_left: int, window_right: int, softcap: float,
                    alibi_slopes, block_sizes) -> FlexMods:
    """flash_attention's flash-attn keywords as FlexAttention's mods, in flash-attn's order (its ``attention_ref``):
    the scaled score is soft-capped, then masked by the window (and causal), then biased by ALiBi.

    * mask: :func:`fa2edu.flex.local_window` (left, right); as in flash-attn's kernels (``flash_api.cpp``), a side
      of N_k or more is unbounded (−1), then ``causal`` makes it (left, 0); (−1, −1) without causal masks nothing.
      (The normalisation matters only for right ≥ N_k with N_q > N_k + 1, where the docstring's formula
      i + N_k − N_q + right would still cut off keys of the first queries; the kernels do not);
    * score_mod: :func:`fa2edu.flex.softcap` (c) when c > 0, :func:`fa2edu.flex.symmetric_alibi` (slopes) when
      slopes are given, both chained (:func:`fa2edu.flex.chain_score_mods`) when both are.

    ``alibi_slopes`` is a NumPy array (H_q,) or (B, H_q), or None; ``block_sizes`` the pair (B_r, B_c).
    """
    left, right = (-1 if side >= N_k else side for side in (window_left, window_right))
    if causal:
        right = 0
    block_mask = _window_block_mask(left, right, N_q, N_k, *block_sizes)
    parts = []
    if softcap > 0:
        parts.append(_flex.softcap(softcap))
    if alibi_slopes is not None:
        parts.append(_flex.symmetric_alibi(alibi_slopes))
    score_mod = None if not parts else parts[0] if len(parts) == 1 else _flex.chain_score_mods(*parts)
    return FlexMods(score_mod, None, block_mask)


def _as_bhnd(x: torch.Tensor) -> torch.Tensor:
    """(…, H, N, d) as (B, H, N, d): the leading axes flattened into one batch axis (a 2-D x gets B = H = 1)."""
    return x[None, None] if x.dim() == 2 else x.reshape(-1, *x.shape[-3:])


def _flash_attn_run(q, k, v, alibi_slopes, causal, window_left, window_right, softcap, block_sizes):
    """The mods and the 4-D q, k, v of one flash_attention call with flash-attn's keywords."""
    slopes = None
    if alibi_slopes is not None:
        _check_finite(("alibi_slopes", alibi_slopes))
        # (H,) or (B, H) floats, read on the host (a CUDA tensor's copy waits for the GPU: a few bytes, once per
        # call); the kernels receive them as a bound array
        slopes = alibi_slopes.detach().cpu().double().numpy()
        if slopes.ndim > 1:
            slopes = slopes.reshape(-1, slopes.shape[-1])                    # (…, H_q) → (B, H_q), as q
    mods = flash_attn_mods(q.shape[-2], k.shape[-2], causal, window_left, window_right, softcap, slopes, block_sizes)
    return mods, _as_bhnd(q), _as_bhnd(k), _as_bhnd(v)


def flash_attention_flex_fwd_impl(q, k, v, alibi_slopes, causal, window_left, window_right, softcap, scale,
                                  block_sizes, backend):
    """flash_attention with flash-attn's keywords: (O, L) of q (…, H_q, N_q, d), k, v (…, H_kv, N_k, d | d_v), on
    ``backend`` ("numpy" or "tensorcore", :func:`flex_forward`)."""
    _check_inputs(q, k, v, scale)
    mods, q4, k4, v4 = _flash_attn_run(q, k, v, alibi_slopes, causal, window_left, window_right, softcap,
                                       block_sizes)
    O, L = flex_forward(q4, k4, v4, mods, scale, q4.shape[1] != k4.shape[1], backend)
    return O.reshape(*q.shape[:-1], v.shape[-1]), L.reshape(q.shape[:-1])


@torch.library.custom_op("fa2edu::flash_attention_flex_fwd", mutates_args=())
def flash_attention_flex_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
                             causal: bool, window_left: int, window_right: int, softcap: float, scale: float,
                             block_sizes: list[int], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attention with flash-attn's keywords: (O, L) of q (…, H_q, N_q, d), k, v (…, H_kv, N_k, d | d_v)."""
    return flash_attention_flex_fwd_impl(q, k, v, alibi_slopes, causal, window_left, window_right, softcap, scale,
                                         block_sizes, backend)


@flash_attention_flex_fwd.register_fake
def _(q, k, v, alibi_slopes, causal, window_left, window_right, softcap, scale, block_sizes, backend):
    return _new(q, (*q.shape[:-1], v.shape[-1])), _new(q, q.shape[:-1], _stat_dtype(q.dtype))


def flash_attention_flex_bwd_impl(dO, q, k, v, O, L, alibi_slopes, causal, window_left, window_right, softcap, scale,
                                  block_sizes, backend):
    """flash_attention with flash-attn's keywords, backward: (dQ, dK, dV) shaped like q, k, v."""
    mods, q4, k4, v4 = _flash_attn_run(q, k, v, alibi_slopes, causal, window_left, window_right, softcap,
                                       block_sizes)
    dQ, dK, dV = flex_backward(_as_bhnd(dO.contiguous()), q4, k4, v4, _as_bhnd(O), L.reshape(q4.shape[:-1]), mods,
                               scale, q4.shape[1] != k4.shape[1], backend)
    return dQ.reshape(q.shape), dK.reshape(k.shape), dV.reshape(v.shape)


@torch.library.custom_op("fa2edu::flash_attention_flex_bwd", mutates_args=())
def flash_attention_flex_bwd(dO: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, O: torch.Tensor,
                             L: torch.Tensor, alibi_slopes: Optional[torch.Tensor], causal: bool, window_left: int,
                             window_right: int, softcap: float, scale: float, block_sizes: list[int], backend: str
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attention with flash-attn's keywords, backward: (dQ, dK, dV) shaped like q, k, v."""
    return flash_attention_flex_bwd_impl(dO, q, k, v, O, L, alibi_slopes, causal, window_left, window_right, softcap,
                                         scale, block_sizes, backend)


@flash_attention_flex_bwd.register_fake
def _(dO, q, k, v, O, L, alibi_slopes, causal, window_left, window_right, softcap, scale, block_sizes, backend):
    return _new(q, q.shape), _new(k, k.shape), _new(v, v.shape)


# =================================================================================================================
# 5. FP8 inputs (FA3 Section 3.3): forward only
# =================================================================================================================
#
# fa2edu.torch.flash_attention on torch.float8_e4m3fn q, k, v (with their per-(batch, head) descales, from
# fa2edu.torch.quantize_fp8) runs ``fa2edu::flash_attention_fp8_fwd``: on CUDA sm_90 kernels_gpu.hopper's FP8 rung,
# on the CPU fa2edu.fp8's NumPy emulation of it (FA2 Alg. 1 on the codes, P̃ rounded to e4m3); O bfloat16, L
# float32. There is no FP8 backward (FA3 has none either): fa2edu.torch registers an autograd formula that says so.

#: what the backward of a float8 flash_attention raises
FP8_BACKWARD_ERROR = (
    "fa2edu.torch.flash_attention on float8_e4m3fn inputs is forward only: FA3's FP8 attention (and fa2edu's) has "
    "no backward pass, because gradients need more precision than e4m3 carries. Train in bfloat16 (quantise for "
    "inference), or detach the float8 inputs")

#: the backends of the FP8 op: the NumPy emulation on the CPU, the Hopper rung on CUDA
FP8_BACKENDS = ("numpy", "hopper")


def fp8_width(d: int, d_v: int) -> int:
    """The head dimension the FP8 kernel runs at: max(d, d_v) rounded up to 16 (its rows are whole 16-byte chunks;
    zero columns of q, k add 0 to every score, zero columns of v give zero columns of O, sliced off)."""
    return _round_up(max(d, d_v), 16)


def _fp8_numpy(q, k, v, descale_q, descale_k, descale_v, causal: bool, scale: float):
    """The CPU road: fa2edu.fp8.flash2_forward_fp8 on the codes (zero-copy views of the CPU tensors)."""
    from fa2edu import fp8
    t = [fp8.Fp8Tensor(x.detach().contiguous().view(torch.uint8).numpy(), d.detach().contiguous().numpy(),
                       "e4m3", None, None) for x, d in ((q, descale_q), (k, descale_k), (v, descale_v))]
    O, L = fp8.flash2_forward_fp8(*t, causal=causal, scale=scale)
    return torch.from_numpy(np.ascontiguousarray(O)).to(torch.bfloat16), torch.from_numpy(np.ascontiguousarray(L))


def _fp8_hopper(q, k, v, descale_q, descale_k, descale_v, causal: bool, scale: float):
    """The CUDA road (also CPU tensors in numba's simulator): kernels_gpu.hopper.flash_forward_fp8 at
    :func:`fp8_width`, padded with zero codes and sliced back."""
    from kernels_gpu import hopper
    d_v = v.shape[-1]
    width = fp8_width(q.shape[-1], d_v)

    def padded(x):
        x = x.contiguous()
        if x.shape[-1] == width:
            return x
        return F.pad(x.view(torch.uint8), (0, width - x.shape[-1])).view(torch.float8_e4m3fn)
    O, L = hopper.flash_forward_fp8(padded(q), padded(k), padded(v), causal=causal, scale=scale,
                                    descale_q=descale_q.contiguous(), descale_k=descale_k.contiguous(),
                                    descale_v=descale_v.contiguous())
    return (O if width == d_v else O[..., :d_v].contiguous()), L


def flash_attention_fp8_fwd_impl(q, k, v, descale_q, descale_k, descale_v, causal, scale, backend):
    """FP8 attention forward: (O bfloat16 (…, N_q, d_v), L float32 (…, N_q))."""
    run = _fp8_numpy if backend == "numpy" else _fp8_hopper
    return run(q, k, v, descale_q, descale_k, descale_v, causal, scale)


@torch.library.custom_op("fa2edu::flash_attention_fp8_fwd", mutates_args=())
def flash_attention_fp8_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
                            descale_k: torch.Tensor, descale_v: torch.Tensor, causal: bool, scale: float,
                            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward (FA3 §3.3): float8_e4m3fn q, k, v and float32 descales → (O bfloat16, L float32)."""
    return flash_attention_fp8_fwd_impl(q, k, v, descale_q, descale_k, descale_v, causal, scale, backend)


@flash_attention_fp8_fwd.register_fake
def _(q, k, v, descale_q, descale_k, descale_v, causal, scale, backend):
    return (q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.bfloat16),
            q.new_empty(q.shape[:-1], dtype=torch.float32))
