"""What every kernel launch needs besides the kernel: a device, checked inputs in one layout, outputs back out.

* **The device.** :func:`require_device` raises :class:`NoGPUError`, with the simulator recipe, when there is
  neither a GPU nor numba's CUDA simulator. :func:`simulator_in_use` says which one runs the kernels.
* **The layout.** Kernels index 4-D arrays ``(Z, H, N, d)``: Z the flattened batch axes, H the heads. Query head h
  reads key/value head ``h // G`` with ``G = H_q // H_kv`` (FA2 Section 3.1's head-index mapping: K and V are never
  copied). :func:`prepare_inputs` checks Q, K, V and returns them in that layout with a :class:`Layout` that remembers
  the caller's shapes, so :func:`finish` can hand results back in them.
* **Interop.** NumPy in → checked by :func:`fa2edu.validation.prepare` (the same errors as fa2edu), copied to the
  device as float32 (or float16: see Storage), results copied back as NumPy arrays of that dtype. Numba device
  arrays and anything with ``__cuda_array_interface__`` (PyTorch, CuPy) in → used in place (``cuda.as_cuda_array``,
  zero-copy; 4-D inputs may have any strides, others must be contiguous so that a view can add the missing axes),
  results are numba device arrays. Device inputs get shape and dtype checks only: a finiteness check would cost a
  pass over HBM.
* **Storage.** Every kernel stores in float32 unless it takes ``storage="float16"`` (the fast kernels,
  :mod:`kernels_gpu.fast`): then the inputs are kept in HBM as float16 (NumPy inputs cast on their way in, device
  inputs must already be float16), the kernels convert each value to float32 as they load it, and write their
  results as float16. The ``storage`` argument of :func:`prepare_inputs`, :func:`prepare_like` and
  :func:`device_empty` defaults to float32, so every other kernel is unchanged.
* **Counting.** :func:`tally` hands each global array to :mod:`kernels_gpu.counting` when a count is running (the
  simulator only); otherwise it returns the array unchanged.
* **Resources.** Tile shapes are compile-time constants; numba gives a block at most 48 KiB of static shared
  memory (12 288 float32) and 1024 threads: :func:`check_resources` says so before a launch fails obscurely.
* **Progress.** The simulator runs a launch block by block, slowly: a launch longer than two seconds shows a tqdm
  bar of its thread blocks, with the time left (:func:`simulator_progress` turns it on, off, or automatic).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32
from tqdm import tqdm

from fa2edu.blocks import resolve_block_sizes
from fa2edu.validation import check_like, check_scale, prepare

__all__ = [
    "NoGPUError", "Layout", "simulator_in_use", "require_device", "is_device_array", "prepare_inputs",
    "prepare_like", "device_empty", "device_zeros", "finish", "tally", "grid_size", "check_resources",
    "default_block_sizes",
    "checked_block_sizes", "SHARED_FLOATS", "MAX_THREADS", "STORAGE", "storage_dtype", "simulator_progress",
    "PROGRESS_DELAY_S",
]

#: numba's static shared memory per block, 48 KiB, in float32 elements.
SHARED_FLOATS = 48 * 1024 // 4
#: CUDA's limit on threads per block.
MAX_THREADS = 1024
#: the storage types a kernel may keep its tensors in HBM as (arithmetic is float32 in both).
STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}

SIMULATOR_RECIPE = ("no CUDA GPU is available. To run kernels_gpu without a GPU, use numba's CUDA simulator: set "
                    "the environment variable NUMBA_ENABLE_CUDASIM=1 before numba is imported, e.g. "
                    "`NUMBA_ENABLE_CUDASIM=1 python script.py` (slow: keep N small)")


class NoGPUError(RuntimeError):
    """A kernel was called on a machine with no usable CUDA GPU, outside the simulator."""


_NUMBA_CONFIG = []


def simulator_in_use() -> bool:
    """True when numba.cuda is the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` was set before numba was imported)."""
    if not _NUMBA_CONFIG:                    # (numba's config module, found once: this runs on every call)
        from numba.cuda.core import config
        _NUMBA_CONFIG.append(config)
    return bool(_NUMBA_CONFIG[0].ENABLE_CUDASIM)


def require_device() -> None:
    """Raise :class:`NoGPUError` (saying how to use the simulator) unless a GPU or the simulator can run kernels."""
    if simulator_in_use():
        return
    try:
        available = cuda.is_available()
    except Exception:  # noqa: BLE001 (a broken driver install is "no GPU" too)
        available = False
    if not available:
        raise NoGPUError(SIMULATOR_RECIPE)


def storage_dtype(storage) -> np.dtype:
    """The NumPy dtype of a ``storage`` name, ``"float32"`` or ``"float16"``; anything else is a ValueError."""
    if not isinstance(storage, str) or storage not in STORAGE:
        raise ValueError(f"storage must be 'float32' or 'float16', got {storage!r}")
    return STORAGE[storage]


def is_device_array(x) -> bool:
    """A numba device array (real or simulated) or any object exporting ``__cuda_array_interface__``."""
    return bool(getattr(x, "__cuda_ndarray__", False)) or hasattr(x, "__cuda_array_interface__")


# -- tile shapes --------------------------------------------------------------------------------------------------

def default_block_sizes(algorithm: str, d: int, d_v: int | None = None) -> tuple[int, int]:
    """``(B_r, B_c)`` for a GPU run when the caller gives none: the largest power-of-two tiles that fit.

    fa2edu's M-based rule (FA1 Alg. 1 line 1) sizes tiles for an SRAM of M elements; on the GPU the binding limits
    are numba's 48 KiB of static shared memory per block and the thread count, so:

    * ``"flash1_forward"``, ``"flash2_forward"``: B_r = 64 threads (one per query row), B_c the largest power of
      two ≤ 64 with K_j and V_j (B_c·(d + d_v) floats) in shared memory;
    * ``"flash2_backward"``: B_c = 64 threads (one per key row) for d ≤ 64, else 32; B_r the largest power of two
      ≤ 32 with Q_i, dO_i, K_j, dS and L_i, D_i in shared memory.

    Parameters
    ----------
    algorithm : {"flash1_forward", "flash2_forward", "flash2_backward"}
        The kernel to size tiles for.
    d : int
        Head dimension of Q and K.
    d_v : int, optional
        Head dimension of V. Default None: d_v = d.

    Returns
    -------
    tuple of int
        ``(B_r, B_c)``.
    """
    d_v = d if d_v is None else d_v
    if algorithm in ("flash1_forward", "flash2_forward"):
        B_c = 64
        while B_c > 1 and B_c * (d + d_v) > SHARED_FLOATS:
            B_c //= 2
        return 64, B_c
    if algorithm == "flash2_backward":
        B_c = 64 if d <= 64 else 32
        B_r = 32
        while B_r > 1 and flash2_backward_shared(B_r, B_c, d, d_v) > SHARED_FLOATS:
            B_r //= 2
        return B_r, B_c
    raise ValueError(f"algorithm must be 'flash1_forward', 'flash2_forward' or 'flash2_backward', got {algorithm!r}")


def flash2_backward_shared(B_r: int, B_c: int, d: int, d_v: int) -> int:
    """Shared-memory floats of the FA2 backward kernel: Q_i, dO_i, K_j, dS_ij, L_i, D_i."""
    return B_r * d + B_r * d_v + B_c * d + B_r * B_c + 2 * B_r


def checked_block_sizes(block_sizes, algorithm: str, d: int, d_v: int) -> tuple[int, int]:
    """The caller's ``(B_r, B_c)`` (checked as fa2edu checks them), or :func:`default_block_sizes`."""
    if block_sizes is None:
        return default_block_sizes(algorithm, d, d_v)
    return resolve_block_sizes(None, block_sizes, d, rule=None)


def check_resources(*, threads: int, shared_floats: int, what: str) -> None:
    """Refuse tile shapes a CUDA block cannot have (> 1024 threads, > 48 KiB static shared memory)."""
    if threads > MAX_THREADS:
        raise ValueError(f"block_sizes give {what} {threads} threads per block; CUDA allows at most {MAX_THREADS}")
    if shared_floats > SHARED_FLOATS:
        raise ValueError(f"block_sizes give {what} {shared_floats} float32 of shared memory "
                         f"({4 * shared_floats} bytes); numba allows {4 * SHARED_FLOATS} bytes of static shared "
                         f"memory per block: choose smaller block_sizes")


# -- inputs --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Sizes of one attention problem and the caller's shapes (for handing results back)."""

    Z: int               # product of the batch axes
    H_q: int             # query heads
    H_kv: int            # key/value heads; G = H_q // H_kv query heads share one
    N_q: int
    N_k: int
    d: int
    d_v: int
    lead_q: tuple        # the caller's leading axes of Q (and O, L, dQ, dO)
    lead_kv: tuple       # ... of K and V (and dK, dV)
    on_host: bool        # NumPy in, NumPy out

    @property
    def G(self) -> int:
        return self.H_q // self.H_kv


def _to_4d(x, name: str):
    """A device array (…, N, d) as (Z, H, N, d): 4-D arrays as they are (any strides), others as a view."""
    if x.ndim == 4:
        return x
    shape = tuple(x.shape)
    H = shape[-3] if x.ndim >= 3 else 1
    Z = int(np.prod(shape[:-3])) if x.ndim > 3 else 1
    try:
        return x.reshape(Z, H, shape[-2], shape[-1])
    except Exception as error:  # noqa: BLE001 (numba refuses views of non-contiguous arrays)
        raise ValueError(f"{name} must be C-contiguous when it does not have 4 axes (shape {tuple(shape)}); "
                         f"make it contiguous first ({error})") from error


def _device_view(x, name: str, dtype=np.float32):
    """Zero-copy numba view of a device array; its dtype must be the storage type ``dtype`` (no copy converts it)."""
    if not simulator_in_use() and not getattr(x, "__cuda_ndarray__", False):
        x = cuda.as_cuda_array(x)
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) != dtype:
        raise TypeError(f"{name} must be {dtype.name} on the device (storage={dtype.name!r}; the kernels compute in "
                        f"float32), got {np.dtype(x.dtype).name}")
    return x


def _as_device(x, name: str, dtype=np.float32):
    """:func:`_device_view` of an input matrix (…, N, d)."""
    x = _device_view(x, name, dtype)
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., N, d) with at least 2 axes, got shape {tuple(x.shape)}")
    if 0 in tuple(x.shape):
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


@dataclass(frozen=True)
class _Shape:
    """Just a shape, with NumPy's negative indexing (the simulator's device-array shapes refuse it)."""

    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _check_device_problem(Q, K, V) -> None:
    """The shape rules of :func:`fa2edu.validation.prepare`, for device arrays."""
    Q, K, V = (_Shape(tuple(x.shape)) for x in (Q, K, V))
    if not (Q.ndim == K.ndim == V.ndim):
        raise ValueError(f"Q, K, V must have the same number of axes, got shapes {Q.shape}, {K.shape}, {V.shape}")
    if K.shape[-1] != Q.shape[-1]:
        raise ValueError(f"K's head dimension must equal Q's: Q has d = {Q.shape[-1]}, K has {K.shape[-1]}")
    if V.shape[-2] != K.shape[-2]:
        raise ValueError(f"V must have as many rows as K: K has N_k = {K.shape[-2]}, V has {V.shape[-2]}")
    if tuple(K.shape[:-2]) != tuple(V.shape[:-2]):
        raise ValueError(f"K and V must have the same leading axes, got {K.shape[:-2]} and {V.shape[:-2]}")
    if Q.ndim >= 3:
        if tuple(Q.shape[:-3]) != tuple(K.shape[:-3]):
            raise ValueError(f"Q and K must have the same batch axes, got {Q.shape[:-3]} and {K.shape[:-3]}")
        if Q.shape[-3] % K.shape[-3] != 0:
            raise ValueError(f"the number of query heads H_q = {Q.shape[-3]} must be a multiple of the number of "
                             f"key/value heads H_kv = {K.shape[-3]} (GQA/MQA)")


def prepare_inputs(Q, K, V, *, causal, scale, storage: str = "float32"):
    """Check Q, K, V; return ``(layout, Q4, K4, V4, tau)`` with device arrays in the (Z, H, N, d) layout.

    NumPy inputs go through :func:`fa2edu.validation.prepare` (types, shapes, finiteness, GQA divisibility, causal,
    scale), device inputs through the same shape rules. Mixing the two kinds is refused. ``storage``: the dtype the
    device arrays have, ``"float32"`` or ``"float16"`` (NumPy inputs are cast to it; device inputs must have it).
    """
    dtype = storage_dtype(storage)
    require_device()
    on_device = [is_device_array(x) for x in (Q, K, V)]
    if any(on_device) and not all(on_device):
        raise TypeError("Q, K, V must all be NumPy arrays or all be device arrays, not a mix")
    if not all(on_device):
        # The kernels compute in float32 whatever the inputs' dtype: scores must fit float32 (else inf, then NaN).
        problem = prepare(Q, K, V, causal=causal, scale=scale, allow_mask=False, score_dtype=np.float32)
        Z, H_kv, G = problem.lead
        layout = Layout(Z, H_kv * G, H_kv, problem.N_q, problem.N_k, problem.d, problem.d_v,
                        tuple(problem.q_shape[:-2]), tuple(problem.kv_shape[:-2]), on_host=True)
        Q4 = _host_to_device(problem.Q.reshape(Z, H_kv * G, layout.N_q, layout.d), "Q", dtype)
        K4 = _host_to_device(problem.K.reshape(Z, H_kv, layout.N_k, layout.d), "K", dtype)
        V4 = _host_to_device(problem.V.reshape(Z, H_kv, layout.N_k, layout.d_v), "V", dtype)
        return layout, Q4, K4, V4, np.float32(problem.scale)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    Q, K, V = (_as_device(x, name, dtype) for x, name in ((Q, "Q"), (K, "K"), (V, "V")))
    _check_device_problem(Q, K, V)
    Q4, K4, V4 = _to_4d(Q, "Q"), _to_4d(K, "K"), _to_4d(V, "V")
    Z, H_q, N_q, d = Q4.shape
    layout = Layout(Z, H_q, K4.shape[1], N_q, K4.shape[2], d, V4.shape[3],
                    tuple(Q.shape[:-2]), tuple(K.shape[:-2]), on_host=False)
    return layout, Q4, K4, V4, np.float32(check_scale(scale, d))


def prepare_like(x, name: str, layout: Layout, tail: tuple, *, per_query: bool = True, finite: bool = True,
                 storage: str = "float32"):
    """A saved statistic or gradient (O, L, dO, P, ...) of shape ``lead + tail``, as a device array with leading
    axes (Z, H). ``per_query`` picks Q's leading axes (else K's). L may hold +inf: pass ``finite=False``.
    ``storage``: the device dtype, as in :func:`prepare_inputs` (L stays float32 under float16 storage)."""
    dtype = storage_dtype(storage)
    lead = layout.lead_q if per_query else layout.lead_kv
    H = layout.H_q if per_query else layout.H_kv
    shape = tuple(lead) + tuple(tail)
    if layout.on_host:
        if is_device_array(x):
            raise TypeError(f"{name} is a device array but Q, K, V are NumPy arrays: pass all inputs of one kind")
        x = check_like(x, name, shape, finite=finite)
        return _host_to_device(np.asarray(x).reshape((layout.Z, H) + tuple(tail)), name, dtype)
    if not is_device_array(x):
        raise TypeError(f"{name} must be a device array like Q, K, V, got {type(x).__name__}")
    x = _device_view(x, name, dtype)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.ndim == 2 + len(tail):
        return x
    try:
        return x.reshape((layout.Z, H) + tuple(tail))
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{name} must be C-contiguous (shape {shape}): {error}") from error


def _host_to_device(array: np.ndarray, name: str = "input", dtype=np.float32):
    """A contiguous copy of ``array`` in ``dtype`` on the device. Casting a finite NumPy input to float16 (|x| >
    65504) or a float64 one to float32 (|x| > 3.4e38) may overflow: refused, naming the argument, rather than stored
    as inf."""
    with np.errstate(over="ignore"):                  # an overflow is reported below, naming the argument
        stored = np.ascontiguousarray(array, dtype=dtype)
    if stored.dtype != array.dtype and np.any(np.isfinite(array) & ~np.isfinite(stored)):
        raise ValueError(f"{name} has values beyond the range of {stored.dtype.name} "
                         f"(|x| <= {float(np.finfo(stored.dtype).max):g}): it cannot be stored as {stored.dtype.name}")
    return cuda.to_device(stored)


# -- outputs -------------------------------------------------------------------------------------------------------

#: Fill every freshly allocated output with NaN before the kernels run (tests set it; also ``KERNELS_GPU_POISON=1``):
#: an element a kernel forgets to write then shows up as NaN instead of passing with stale or zero memory.
poison_outputs = os.environ.get("KERNELS_GPU_POISON") == "1"


def device_empty(shape: tuple, *, storage: str = "float32"):
    """A device array (float32, or the ``storage`` dtype) for a kernel to fill (every element gets written); NaN if
    :data:`poison_outputs`."""
    array = cuda.device_array(shape, dtype=storage_dtype(storage))
    if poison_outputs:
        _fill(array, np.nan)
    return array


@functools.lru_cache(maxsize=None)
def _fill_kernel():
    @cuda.jit
    def fill(x, value):
        # One thread per element of a flat array; the grid may not cover it exactly, so guard the tail.
        k = cuda.grid(1)
        if k < x.shape[0]:
            x[k] = value
    return fill


def device_zeros(shape: tuple, *, name: str = "zeros"):
    """A float32 device array of zeros, filled on the device (no host copy); an initialisation write named ``name``."""
    array = device_empty(shape)
    _fill(array, 0.0, name=name)
    return array


def _fill(array, value: float, *, name: str | None = None) -> None:
    """Set every element of a contiguous device array to ``value`` (counted as an init write of ``name`` if named)."""
    flat = array.reshape(int(np.prod(array.shape)))
    threads = min(256, flat.shape[0])              # the simulator pays per thread: no idle ones on tiny arrays
    target = flat if name is None else tally(name, flat, init=True)
    _fill_kernel()[grid_size(flat.shape[0], threads), threads](target, float32(value))


def finish(array, layout: Layout, tail: tuple, *, per_query: bool = True):
    """A (Z, H, …) result back in the caller's leading axes: a NumPy array if NumPy came in, else a device array."""
    lead = layout.lead_q if per_query else layout.lead_kv
    shaped = array.reshape(tuple(lead) + tuple(tail))
    return shaped.copy_to_host() if layout.on_host else shaped


# -- counting hook (set by kernels_gpu.counting) ----------------------------------------------------------------

#: ``None``, or a function ``(name, array, init) -> array`` that wraps a global array in a counting view.
tally_hook = None


def tally(name: str, array, *, init: bool = False):
    """``array`` itself, or (inside :func:`kernels_gpu.counting.count_global_memory`) a counting view named ``name``.

    ``init=True`` marks the launch as an "Initialize … in HBM" step: its writes are counted apart, as fa2edu's
    ledger counts them apart from the algorithm's traffic.
    """
    return array if tally_hook is None else tally_hook(name, array, init)


def grid_size(n: int, block: int) -> int:
    """ceil(n / block), the number of blocks covering n items."""
    return max(1, math.ceil(n / block))


# -- progress of simulated launches ----------------------------------------------------------------------------------

#: A simulated launch that runs longer than this many seconds shows its progress bar (shorter ones print nothing).
PROGRESS_DELAY_S = 2.0

#: ``None`` (show the bar in a terminal or a Jupyter kernel, not in logs or captured output), True (always), False
#: (never). From the environment variable ``FA2EDU_PROGRESS`` (``1``/``0``) or :func:`simulator_progress`.
_progress = {"1": True, "0": False}.get(os.environ.get("FA2EDU_PROGRESS", ""), None)
_bar = None                                 # the bar of the launch in progress, if it shows one


def simulator_progress(show: bool | None = True) -> bool | None:
    """Show (True), hide (False) or let the output decide (None, the default) the simulator's progress bars.

    numba's CUDA simulator runs a launch one thread block after another, each block's threads as Python threads:
    a kernel at N = 512 takes tens of seconds. While the simulator is in use, every launch that runs longer than
    :data:`PROGRESS_DELAY_S` shows a tqdm bar on stderr counting its thread blocks, with the time left. ``None``
    shows it only where someone is watching (a terminal or a Jupyter kernel). On a GPU nothing changes.

    Parameters
    ----------
    show : bool or None, optional
        True, False or None as above. Default True.

    Returns
    -------
    bool or None
        The previous setting.
    """
    global _progress
    if show is not None and not isinstance(show, (bool, np.bool_)):
        raise TypeError(f"show must be True, False or None, got {show!r}")
    previous, _progress = _progress, None if show is None else bool(show)
    return previous


def _watched(stream) -> bool:
    """A terminal, or the output of a Jupyter kernel (which reports itself as no terminal)."""
    return type(stream).__module__.startswith("ipykernel") or bool(getattr(stream, "isatty", lambda: False)())


def _start_bar(kernel, grid_dim) -> None:
    """A fresh bar for a launch of ``grid_dim`` blocks (closing one an exception left open)."""
    global _bar
    _close_bar()
    if _progress is False or (_progress is None and not _watched(sys.stderr)):
        return
    name = getattr(kernel, "__name__", "kernel")
    _bar = tqdm(total=math.prod(grid_dim), desc=f"simulating {name}", unit="block", file=sys.stderr,
                delay=PROGRESS_DELAY_S, leave=False, dynamic_ncols=True, mininterval=0.5)


def _close_bar() -> None:
    global _bar
    if _bar is not None:
        bar, _bar = _bar, None
        bar.close()


#: the interpreter's thread switch interval while a simulated block runs (seconds; Python's default is 0.005)
SIMULATOR_SWITCH_S = 5e-4


def _install_simulator_progress() -> None:
    """Count the simulator's thread blocks: its launch loop makes one ``BlockManager`` per block, in
    ``np.ndindex`` order, so the block at grid point (0, 0, 0) starts a launch and the last grid point ends it.
    The subclass runs each block exactly as numba's does and only ticks the bar around it (device functions,
    called inside blocks, are untouched). Installed once, when kernels_gpu is imported with the simulator on.

    While a block runs, the interpreter's thread switch interval is lowered to :data:`SIMULATOR_SWITCH_S`: a
    simulated block is one Python thread per CUDA thread, and the threads that wait at a barrier (or spin on an
    mbarrier) hold the GIL for the whole default interval of 5 ms while the one they wait for cannot run. With
    0.5 ms a Hopper rung's block of 384 threads runs about six times faster; the setting is restored after the
    block."""
    from numba.cuda.simulator import kernel as simulator

    base = simulator.BlockManager
    if getattr(base, "counts_blocks", False):
        return

    class CountingBlockManager(base):
        counts_blocks = True

        def run(self, grid_point, *args):
            grid_dim = tuple(self._grid_dim)
            if not any(grid_point):
                _start_bar(self._f, grid_dim)
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, SIMULATOR_SWITCH_S))
            try:
                super().run(grid_point, *args)
            except BaseException:
                _close_bar()
                raise
            finally:
                sys.setswitchinterval(interval)
            if _bar is not None:
                _bar.update()
            if tuple(grid_point) == tuple(n - 1 for n in grid_dim):
                _close_bar()

    simulator.BlockManager = CountingBlockManager


if simulator_in_use():
    _install_simulator_progress()
