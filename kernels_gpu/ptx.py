"""The warp-level instructions of tensor-core FlashAttention, issued from numba kernels — and their simulator twins.

numba has no tensor-core API, but a numba kernel can issue any PTX instruction through
``numba.cuda.extending.intrinsic`` with an ``llvmlite.ir.InlineAsm`` body. Every such wrapper of fa2edu lives in
this module; the kernel bodies stay Python. Each wrapper cites the PTX ISA section it implements; the operand
layouts are tabulated in :mod:`kernels_gpu.fragments`::

    =========================  ===============================================  ==============================
    function                   PTX instruction                                  PTX ISA section
    =========================  ===============================================  ==============================
    ``mma_f16``, ``mma_bf16``  ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,     9.7.14.5.14 (mma), fragments:
                               bf16}.{f16,bf16}.f32``: D = A·B + C                9.7.14.5.8 "m16n8k16"
    ``ldmatrix_x4``,           ``ldmatrix.sync.aligned.m8n8.x4{.trans}.shared    9.7.14.5.15 (ldmatrix)
    ``ldmatrix_x4_trans``      .b16``: four 8 × 8 tiles of 16-bit values from
                               shared memory into fragments
    ``cp_async16``             ``cp.async.cg.shared.global`` 16 bytes, global →   9.7.9.25.3 (cp.async)
                               shared without passing through registers; a
                               source size of 0 fills the 16 bytes with zeros
    ``cp_async16_l2_128``      the same with the ``.L2::128B`` prefetch-size
                               hint: the L2 fetches the whole 128-byte line
                               around the copied 16 bytes
    ``cp_async_commit``,       ``cp.async.commit_group``,                          9.7.9.25.3.2, 9.7.9.25.3.3
    ``cp_async_wait_all``,     ``cp.async.wait_group N``: wait until at most N
    ``cp_async_wait_one``,     groups of this thread are still in flight
    ``cp_async_wait_two``,     (N = 0, 1, 2, 3)
    ``cp_async_wait_three``
    ``pack_f16x2``,            ``cvt.rn.{f16x2,bf16x2}.f32``: two floats rounded  9.7.9.21 (cvt)
    ``pack_bf16x2``            to nearest-even and packed, the first in the
                               low half
    ``unpack_f16x2``,          two 16-bit halves → two floats (exact)             9.7.9.21 (cvt)
    ``unpack_bf16x2``
    ``ex2``                    ``ex2.approx.ftz.f32``: 2^x (~2 ulp; results      9.7.3.20 (ex2)
                               below 2^-126 flushed to 0)
    ``shfl_xor``               ``shfl.sync.bfly.b32``: the value of lane         9.7.9.7 (shfl.sync)
                               ``lane ^ mask``
    ``syncwarp``               ``bar.warp.sync``: the warp's lanes meet; their   9.7.13.5 (bar.warp.sync)
                               shared-memory writes are visible to each other
    ``mma_tf32``               ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.     9.7.14.5.14 (mma), fragments:
                               tf32.f32``: D = A·B + C, A 16 × 8, B 8 × 8, one  9.7.14.5.7 "m16n8k8"
                               tf32 value per 32-bit register
    ``cvt_tf32``               ``cvt.rna.tf32.f32``: a float rounded to tf32    9.7.9.21 (cvt)
                               (10 mantissa bits; nearest, ties away from
                               zero), as the 32 bits the mma takes
    ``split_tf32``             x → (big, small), both tf32: big = x rounded to   9.7.9.21 (cvt), 9.7.3
                               tf32 (``cvt.rna``, low 13 bits cleared), small =  (sub)
                               (x − big) rounded to tf32 — big + small carries
                               ~22 of float32's 24 significand bits (the
                               operands of 3xTF32's three products); x a float
                               or its 32 bits (from ``ldmatrix``)
    ``bulk_copy``              ``cp.async.bulk.shared::cluster.global.mbarrier  cp.async.bulk (PTX ISA
                               ::complete_tx::bytes``: one contiguous run of a    8.0, sm_90)
                               multiple of 16 bytes, global → shared, by the
                               copy engine; the bytes count down the mbarrier's
                               transaction count as they land
    ``mbar_init``,             ``mbarrier.init.shared::cta.b64``, ``mbarrier.   mbarrier: .init,
    ``mbar_arrive_expect_tx``, arrive.expect_tx.shared::cta.b64`` (one arrival,  .arrive (expect-tx),
    ``mbar_try_wait``          and that many bytes to come), ``mbarrier.try_     .try_wait.parity
                               wait.parity.shared::cta.b64`` (1 once the phase
                               of that parity has completed, else 0): a phase
                               completes when its arrivals are in and its bytes
                               have landed
    ``fence_mbarrier_init``,   ``fence.mbarrier_init.release.cluster`` (the     membar/fence
    ``fence_proxy_async``      barriers' initialisation visible before their
                               first use); ``fence.proxy.async.shared::cta``
                               (shared memory written by ordinary stores or
                               cp.async ordered before later bulk copies)
    ``tensor_copy_4d``         ``cp.async.bulk.tensor.4d.shared::cluster.global cp.async.bulk.tensor (PTX
                               .tile.mbarrier::complete_tx::bytes``: one box    ISA 8.0, sm_90)
                               of a 4-D tensor, described by a tensor map
                               (``CUtensorMap``: 128 bytes in global memory,
                               the array passed; :mod:`kernels_gpu.tensor_map`)
                               at the given coordinates, global → shared by
                               the copy engine, laid out (and swizzled) as the
                               map says; the bytes count down the mbarrier's
                               transaction count as they land
    ``griddep_wait``,          ``griddepcontrol.wait``: wait until the grid     9.7.13 (griddepcontrol)
    ``griddep_launch_          this one depends on has completed and its
    dependents``               writes are visible; ``griddepcontrol.launch_
                               dependents``: this block lets the dependent
                               grid start early (programmatic dependent
                               launch; both are no-ops in a launch without it)
    ``cluster_arrive``,        ``barrier.cluster.arrive.release.aligned``,      9.7.13.4 (barrier.cluster)
    ``cluster_wait``           ``barrier.cluster.wait.acquire.aligned``: every
                               thread of every block of the thread-block
                               cluster meets; shared-memory writes before the
                               arrival are visible to the cluster's blocks
                               after the wait (GPU only: the simulator runs
                               one block at a time)
    ``ld_cluster_f32``         ``mapa.shared::cluster.u32`` then ``ld.shared::   9.7.9.20 (mapa), 9.7.9.8
                               cluster.f32``: the float at the same shared-      (ld, .shared::cluster)
                               memory word of block ``rank`` of the cluster
                               (distributed shared memory; GPU only)
    ``red_add_v4_f32``         ``red.global.add.v4.f32``: four consecutive      red (vector types: PTX
                               floats added atomically into global memory by    ISA 8.1, sm_90)
                               one instruction (16-byte aligned); each of the
                               four additions is atomic, not the four together
    **Hopper (sm_90a)**
    ``make_wgmma(dtype, N,     ``wgmma.mma_async.sync.aligned.m64nNk16.f32.     9.7.15.5.2 (wgmma.mma_async);
    a, trans_b)``              {f16,bf16}``: D (64 × N) = A·B + D by the        layouts: 9.7.15.5.1 and
                               warpgroup, B (and A when ``a="smem"``) named by  :mod:`kernels_gpu.wgmma_layout`
                               shared-memory descriptors, A otherwise from four
                               registers per thread; the accumulators a local
                               array updated in place; ``trans_b``: B MN-major
    ``make_wgmma_fp8(N, a)``   ``wgmma.mma_async.sync.aligned.m64nNk32.f32.     9.7.15.5.2; fragments:
                               e4m3.e4m3``: the same on float8 e4m3, K = 32,     9.7.15.5.1.1.3 (Figure 152)
                               both operands K-major (no transpose for 8-bit
                               types), A from descriptors or four registers of
                               four e4m3 bytes
    ``pack_e4m3x4``            two ``cvt.rn.satfinite.e4m3x2.f32``: four floats   9.7.9.21 (cvt)
                               rounded to e4m3 (nearest even, saturating at
                               ±448) in one register, the first in the lowest
                               byte
    ``wgmma_fence``,           ``wgmma.fence``, ``wgmma.commit_group``,          9.7.15.6, 9.7.15.7, 9.7.15.8
    ``wgmma_commit``,          ``wgmma.wait_group N`` (the accumulators tied
    ``make_wgmma_wait``,       through the wait, so no use of them is moved
    ``make_register_fence``    above it)
    ``descriptor``,            a matrix descriptor from a shared byte address    9.7.15.5.1.2.2
    ``shared_byte_address``    (``cvta.to.shared``), LBO, SBO, swizzle mode
    ``mbar_arrive``            ``mbarrier.arrive.shared::cta.b64``: one arrival  9.7.13.15.13 (mbarrier.arrive)
    ``make_setmaxnreg``        ``setmaxnreg.{inc,dec}.sync.aligned.u32 n``:      9.7.17.1 (setmaxnreg)
                               the warpgroup's register budget moved
    ``elect_one``              ``elect.sync``: 1 in one lane of the warp          9.7.13.10 (elect.sync)
    ``opaque_u32``             ``mov.b32`` in a volatile asm: the value itself,   9.7.9.9 (mov)
                               which the compiler can no longer hoist out of a
                               loop (what is computed from it is recomputed in
                               the loop instead of held in registers)
    ``named_barrier_sync``,    ``bar.sync id, n`` / ``bar.arrive id, n``: the    9.7.13.1 (bar, barrier)
    ``named_barrier_arrive``   n threads of barrier ``id`` meet (arrive: count
                               in without waiting)
    ``globaltimer``            ``mov.u64 %globaltimer``: nanoseconds             10.28 (%globaltimer)
    ``clock64``                ``mov.u64 %clock64``: the SM's cycle counter       10.14 (%clock64)
    =========================  ===============================================  ==============================

**Simulator twins.** Under ``NUMBA_ENABLE_CUDASIM=1`` (how CI runs kernels) every name above is a Python function
that emulates the instruction exactly, so the same kernel source runs in numba's CUDA simulator: the warp-level ones
(mma, ldmatrix, shfl) make the 32 lanes of the warp meet at a barrier, exchange their registers, and each lane
takes what the fragment tables say it gets (:mod:`~kernels_gpu.fragments`). ``cp.async`` is emulated as
*asynchronous*: a copy lands only when a ``cp_async_wait_*`` says its group may have completed, so a kernel that
reads a tile before waiting for it reads stale data in the simulator too. Bulk and tensor copies likewise land only
when a lane tries to wait on their mbarrier, whose phases the twin keeps as the hardware does (arrivals and a
transaction count, which may go below zero when bytes land before they are announced); a tensor copy's map is a
stand-in (:func:`kernels_gpu.tensor_map.simulated_map`), and its box lands swizzled as the copy engine writes it. The
mma twin rounds once, after an exact sum; the hardware's internal accumulation may differ in the last bits of float32
(the GPU tests bound it).

The warpgroup instructions (``wgmma``) meet all 128 threads of the warpgroup the same way; the twin reads its shared
memory operands through the descriptors (:func:`kernels_gpu.wgmma_layout.read_operand`) and computes the product
when it is issued (the hardware may read them until ``wgmma.wait_group``: a kernel that overwrites an operand
before waiting is wrong on the GPU and not caught here — the GPU tests and racecheck are). Named barriers count
threads in as ``bar.sync``/``bar.arrive`` do; ``setmaxnreg`` only checks its count.

Every warp-level function must be called by all 32 lanes of the warp, together (as on the hardware: the ``.sync``
and ``.aligned`` qualifiers require it).
"""

from __future__ import annotations

import functools
import math
import threading
import time

import numpy as np
from numba import uint64

from kernels_gpu import fragments as frag
from kernels_gpu.runtime import simulator_in_use

__all__ = [
    "mma_f16", "mma_bf16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async16", "cp_async16_l2_128",
    "cp_async_commit",
    "cp_async_wait_all", "cp_async_wait_one", "cp_async_wait_two", "cp_async_wait_three", "pack_f16x2",
    "pack_bf16x2", "unpack_f16x2", "unpack_bf16x2", "ex2",
    "shfl_xor", "syncwarp", "SIMULATED", "mma_tf32", "cvt_tf32", "split_tf32", "tf32_round", "griddep_wait",
    "griddep_launch_dependents", "bulk_copy", "mbar_init", "mbar_arrive_expect_tx", "mbar_try_wait",
    "fence_mbarrier_init", "fence_proxy_async", "tensor_copy_4d", "red_add_v4_f32", "cluster_arrive",
    "cluster_wait", "ld_cluster_f32", "make_wgmma", "wgmma_fence", "wgmma_commit", "make_wgmma_wait",
    "make_register_fence", "make_wgmma_fence", "descriptor", "shared_byte_address", "mbar_arrive",
    "make_setmaxnreg", "elect_one", "named_barrier_sync", "named_barrier_arrive", "globaltimer", "clock64",
    "make_wgmma_fp8", "pack_e4m3x4", "opaque_u32",
]

#: True when the names of this module are the simulator twins (decided once, at import).
SIMULATED = simulator_in_use()

FULL_MASK = 0xFFFFFFFF


# ================================================================================================================
# Bit-level helpers (NumPy), shared by the twins and the tests
# ================================================================================================================

def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 → bfloat16 bit patterns (uint16), rounded to nearest even (what ``cvt.rn.bf16.f32`` does)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_bits_to_f32(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) → float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint32) << 16).astype(np.uint32).view(np.float32)


def half_bits(x, dtype: str) -> np.ndarray:
    """float values → 16-bit patterns (uint16) of ``dtype`` ``"float16"`` or ``"bfloat16"``, round to nearest even."""
    if dtype == "float16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")


def half_values(bits, dtype: str) -> np.ndarray:
    """16-bit patterns (uint16) of ``dtype`` → float32 (exact)."""
    bits = np.asarray(bits, dtype=np.uint16)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_f32(bits)
    raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")


def _u32(x) -> int:
    return int(x) & 0xFFFFFFFF


def _halves(word, dtype: str) -> tuple[float, float]:
    """A 32-bit register of two 16-bit values → (low, high) as float32."""
    w = _u32(word)
    vals = half_values(np.array([w & 0xFFFF, w >> 16], dtype=np.uint16), dtype)
    return vals[0], vals[1]


def _pack(lo, hi, dtype: str) -> np.uint32:
    bits = half_bits(np.array([lo, hi], dtype=np.float32), dtype).astype(np.uint32)
    return np.uint32(bits[0] | (bits[1] << 16))


def tf32_round(x) -> np.ndarray:
    """float32 → the nearest tf32 value, ties away from zero, as float32 with the low 13 mantissa bits zero (what
    ``cvt.rna.tf32.f32`` does): adding half of the dropped range, 0x1000, to the magnitude's bits and clearing the 13
    bits rounds the magnitude to nearest with ties upward, i.e. away from zero; a carry into the exponent is the
    correct next binade (or inf past the largest tf32). Subnormals round the same way. NaN stays NaN (0x7FFFFFFF)."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return np.where(np.isnan(x), np.uint32(0x7FFFFFFF), rounded).astype(np.uint32).view(np.float32)


# ================================================================================================================
# Simulator twins
# ================================================================================================================

_STATE_LOCK = threading.Lock()
#: seconds a lane waits for the rest of its warp before the twin reports a divergent call
_WARP_TIMEOUT_S = 120.0


class _Warp:
    """The meeting point of one warp's 32 simulated lanes: a barrier, one slot per lane, and the results."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(frag.WARP, timeout=_WARP_TIMEOUT_S)
        self.slots: list = [None] * frag.WARP
        self.results: list = [None] * frag.WARP


def _this_lane():
    """(warp state, lane) of the calling simulated thread (numba's simulator runs each CUDA thread as a Python
    thread; its block manager outlives the blocks it runs one after the other, so warp state is kept there)."""
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError("a warp-level instruction twin was called outside a simulated CUDA kernel")
    tid = thread.thread_id
    with _STATE_LOCK:
        warps = manager.__dict__.setdefault("_fa2edu_warps", {})
        warp = warps.get(tid // frag.WARP)
        if warp is None:
            warp = warps[tid // frag.WARP] = _Warp()
    return warp, tid % frag.WARP


def _collective(value, compute):
    """Every lane of the warp passes ``value``; lane 0 computes ``compute(values)`` (a list of 32 results, by
    lane) once all have arrived; every lane returns its own result. Two barriers: a lane that races ahead into the
    next collective cannot overwrite slots or results that another lane still has to read."""
    warp, lane = _this_lane()
    try:
        warp.slots[lane] = value
        warp.barrier.wait()
        if lane == 0:
            try:
                warp.results = compute(list(warp.slots))
            except Exception:
                warp.barrier.abort()
                raise
        warp.barrier.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError("a warp-level instruction was not reached by all 32 lanes of the warp (divergent "
                           "call, or a lane failed)") from None
    return warp.results[lane]


def _words_to_values(words, dtype: str) -> np.ndarray:
    """(32, k) 32-bit registers → (32, 2k) float32: each register's low half, then its high half."""
    w = np.array([[_u32(x) for x in row] for row in words], dtype=np.uint32)
    return half_values(w.view(np.uint16), dtype).reshape(w.shape[0], -1)


def _mma_twin(dtype: str):
    def compute(values):
        a = _words_to_values([v[0] for v in values], dtype)
        b = _words_to_values([v[1] for v in values], dtype)
        c = np.array([v[2] for v in values], dtype=np.float32)
        d = frag.mma_reference(a, b, c)
        return [tuple(np.float32(x) for x in row) for row in d]

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _collective(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), compute)
    mma.__name__ = f"mma_{'f16' if dtype == 'float16' else 'bf16'}"
    mma.__doc__ = (f"Simulator twin of ``mma.sync.aligned.m16n8k16.row.col.f32.{mma.__name__[4:]}."
                   f"{mma.__name__[4:]}.f32``.")
    return mma


def _mma_tf32_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """Simulator twin of ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``: a0…a3, b0, b1 the 32-bit patterns
    of tf32 values (from :func:`cvt_tf32`), c0…c3 float32. A register with any of its low 13 bits set is refused: it
    is not a tf32 value, and what the tensor core makes of one is not what fa2edu specifies."""
    def compute(values):
        a = np.array([[_u32(x) for x in v[0]] for v in values], dtype=np.uint32)
        b = np.array([[_u32(x) for x in v[1]] for v in values], dtype=np.uint32)
        if ((a & 0x1FFF) != 0).any() or ((b & 0x1FFF) != 0).any():
            raise RuntimeError("mma_tf32: an operand register is not a tf32 value (low 13 bits set): convert it "
                               "with cvt_tf32 first")
        c = np.array([v[2] for v in values], dtype=np.float32)
        d = frag.mma_tf32_reference(a.view(np.float32), b.view(np.float32), c)
        return [tuple(np.float32(x) for x in row) for row in d]
    return _collective(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), compute)


def _cvt_tf32_twin(x):
    """Simulator twin of ``cvt.rna.tf32.f32``: the tf32 nearest to ``x`` (ties away from zero), as its 32 bits."""
    return np.uint32(tf32_round(np.float32(x)).view(np.uint32))


def _split_tf32_twin(x):
    """Simulator twin of :func:`split_tf32`: ``(big, small)`` as the 32 bits of two tf32 values, big = tf32(x),
    small = tf32(x − big) (float32 subtraction, exact: big is x with its low bits rounded away). ``x``: a float32,
    or its 32 bits as an unsigned integer (what :func:`ldmatrix_x4` returns)."""
    x = np.uint32(x).view(np.float32) if isinstance(x, (np.unsignedinteger, int)) else np.float32(x)
    big = tf32_round(x)
    small = tf32_round(np.float32(x - big))
    return np.uint32(big.view(np.uint32)), np.uint32(small.view(np.uint32))


def _ldmatrix_twin(trans: bool):
    def compute(values):
        if len({v[0].__array_interface__["data"][0] for v in values}) != 1:
            raise RuntimeError("ldmatrix: all lanes must address the same shared array")
        memory = np.ascontiguousarray(values[0][0]).view(np.uint32).view(np.uint16)
        rows = 2 * np.array([v[1] for v in values], dtype=np.int64)
        if (rows % 8).any():
            raise RuntimeError("ldmatrix: every row address must be 16-byte aligned")
        got = frag.ldmatrix_reference(memory, rows, trans).astype(np.uint32)          # (32, 4, 2)
        words = got[..., 0] | (got[..., 1] << 16)
        return [tuple(np.uint32(x) for x in row) for row in words]

    def ldmatrix(smem, index):
        """Simulator twin of ``ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16``: ``smem`` a 1-D shared array of
        32-bit words, ``index`` the word where this lane's 16-byte row starts (4-word aligned)."""
        return _collective((smem, int(index)), compute)
    return ldmatrix


_PENDING = threading.local()


def _pending() -> list:
    if not hasattr(_PENDING, "groups"):
        _PENDING.groups = [[]]              # the last group is the one still open (not committed)
    return _PENDING.groups


def _memory(gmem) -> np.ndarray:
    """The memory an array spans, as a 1-D array of its elements in address order, element 0 first (the GPU's
    view of ``gmem + 4·index``): the array itself, flattened, when it is C-contiguous; for a strided view (positive
    strides, whole elements apart), every element between its first and its last, holes included."""
    a = np.asarray(getattr(gmem, "_ary", gmem))
    if a.flags.c_contiguous:
        return a.reshape(-1)
    if any(st <= 0 or st % a.itemsize for st in a.strides):
        raise ValueError(f"a strided source needs positive strides in whole elements, got {a.strides}")
    span = sum((n - 1) * st for n, st in zip(a.shape, a.strides)) // a.itemsize + 1
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,), writeable=False)


def _cp_async16_twin(smem, s_index, gmem, g_index, src_bytes):
    """Simulator twin of ``cp.async.cg.shared.global [smem + 4·s_index], [gmem + 4·g_index], 16, src_bytes``: four
    32-bit words (``gmem`` an array of any rank, ``g_index`` the first word's offset from element 0 in words — the
    flat index when ``gmem`` is C-contiguous, computed from its strides when it is not), queued in this thread's
    open group (zeros when ``src_bytes`` is 0)."""
    s, g, n = int(s_index), int(g_index), int(src_bytes)
    if n not in (0, 16):
        raise ValueError("cp_async16: src_bytes must be 0 or 16")
    if s % 4 or g % 4:
        raise RuntimeError("cp_async16: source and destination must be 16-byte aligned")
    flat = _memory(gmem)
    data = np.array(flat[g:g + 4], copy=True) if n else np.zeros(4, dtype=smem.dtype)
    _pending()[-1].append((smem, s, data))


def _cp_async_commit_twin():
    """Simulator twin of ``cp.async.commit_group``: close this thread's open group of copies."""
    _pending().append([])


def _land(groups: list, keep: int) -> None:
    committed = groups[:-1]
    while len(committed) > keep:
        for smem, s, data in committed.pop(0):
            if data.dtype != smem.dtype and data.dtype.itemsize == smem.dtype.itemsize:
                data = data.view(smem.dtype)          # bytes are bytes: float32 rows into a uint32 array
            smem.reshape(-1)[s:s + 4] = data
    groups[:] = committed + [groups[-1]]


def _cp_async_wait_all_twin():
    """Simulator twin of ``cp.async.wait_group 0``: every committed copy of this thread has landed."""
    _land(_pending(), 0)


def _cp_async_wait_one_twin():
    """Simulator twin of ``cp.async.wait_group 1``: all but the newest committed group have landed."""
    _land(_pending(), 1)


def _cp_async_wait_two_twin():
    """Simulator twin of ``cp.async.wait_group 2``: all but the two newest committed groups have landed."""
    _land(_pending(), 2)


def _cp_async_wait_three_twin():
    """Simulator twin of ``cp.async.wait_group 3``: all but the three newest committed groups have landed."""
    _land(_pending(), 3)


def _pack_twin(dtype: str):
    def pack(lo, hi):
        return _pack(lo, hi, dtype)
    pack.__doc__ = f"Simulator twin of ``cvt.rn.{'f16x2' if dtype == 'float16' else 'bf16x2'}.f32`` (lo, hi)."
    return pack


def _unpack_twin(dtype: str):
    def unpack(word):
        lo, hi = _halves(word, dtype)
        return np.float32(lo), np.float32(hi)
    return unpack


def _ex2_twin(x):
    """Simulator twin of ``ex2.approx.ftz.f32``: 2^x exactly rounded, flushed to 0 below 2^-126 as the GPU does."""
    x = float(x)
    y = np.float32(0.0) if x == -math.inf else np.float32(math.exp2(min(x, 128.0)))
    return y if y >= np.float32(1.1754943508222875e-38) else np.float32(0.0)


def _syncwarp_twin():
    """Simulator twin of ``bar.warp.sync 0xffffffff``."""
    _collective(None, lambda values: values)


def _griddep_twin():
    """Simulator twin of ``griddepcontrol.wait`` and ``griddepcontrol.launch_dependents``: nothing to do — the
    simulator runs one launch after another, so the grid a launch depends on has always completed."""


def _mbarriers() -> dict:
    """The simulated mbarriers of the calling thread's block, by shared-memory word index (kept on the block manager,
    as the warps are; ``mbar_init`` resets one at the start of every block)."""
    manager = getattr(threading.current_thread(), "_manager", None)
    if manager is None:
        raise RuntimeError("an mbarrier twin was called outside a simulated CUDA kernel")
    with _STATE_LOCK:
        return manager.__dict__.setdefault("_fa2edu_mbarriers", {})


#: try_wait calls on one incomplete phase, and seconds since the first of them, before the twin reports a barrier
#: that can never complete. Both must be exceeded: the simulator runs one Python thread at a time, so the warp's
#: other lanes may spin a million times before the lane that issues the copy is scheduled on a loaded machine.
_MBAR_SPIN_LIMIT = 1_000_000
_MBAR_WAIT_S = 30.0


def _mbar_complete_if_done(bar: dict) -> None:
    if bar["pending"] == 0 and bar["tx"] == 0:
        bar["completed"] += 1
        bar["pending"] = bar["count"]
        bar["spins"] = 0
        bar["since"] = None


def _mbar_init_twin(smem, index, count):
    """Simulator twin of ``mbarrier.init``: phase 0, ``count`` arrivals expected, no bytes, no queued copies."""
    i = int(index)
    if i % 2:
        raise RuntimeError("mbar_init: an mbarrier is 8 bytes and must be 8-byte aligned (an even word index)")
    bars = _mbarriers()
    with _STATE_LOCK:
        bars[i] = dict(count=int(count), pending=int(count), tx=0, completed=0, queue=[], spins=0)


def _mbar_bar(index) -> dict:
    bar = _mbarriers().get(int(index))
    if bar is None:
        raise RuntimeError(f"mbarrier at word {int(index)} used before mbar_init")
    return bar


def _mbar_arrive_expect_tx_twin(smem, index, nbytes):
    """Simulator twin of ``mbarrier.arrive.expect_tx``: ``nbytes`` more to come in this phase, and one arrival."""
    bar = _mbar_bar(index)
    with _STATE_LOCK:
        bar["tx"] += int(nbytes)
        bar["pending"] -= 1
        _mbar_complete_if_done(bar)


def _bulk_copy_twin(smem, s_index, gmem, g_index, nbytes, bar_index):
    """Simulator twin of ``cp.async.bulk … mbarrier::complete_tx::bytes``: ``nbytes`` (a multiple of 16) from word
    ``g_index`` of ``gmem`` to word ``s_index`` of ``smem``, queued on the mbarrier at word ``bar_index``: it lands
    (and counts down the barrier's bytes) when a lane next tries to wait on that barrier."""
    s, g, n = int(s_index), int(g_index), int(nbytes)
    if n <= 0 or n % 16:
        raise ValueError(f"bulk_copy: the size must be a positive multiple of 16 bytes, got {n}")
    if s % 4 or g % 4:
        raise RuntimeError("bulk_copy: source and destination must be 16-byte aligned")
    a = np.asarray(getattr(gmem, "_ary", gmem))
    if not a.flags.c_contiguous:
        raise ValueError("red_add_v4_f32: gmem must be C-contiguous (its flat index is the address)")
    flat = a.reshape(-1)
    if g + n // 4 > flat.size:
        raise IndexError(f"bulk_copy: words {g} … {g + n // 4 - 1} are past the source's {flat.size}")
    data = np.array(flat[g:g + n // 4], copy=True)
    bar = _mbar_bar(bar_index)
    with _STATE_LOCK:
        bar["queue"].append((smem, s, data))


def _mbar_try_wait_twin(smem, index, parity):
    """Simulator twin of ``mbarrier.try_wait.parity``: the queued bulk copies land; 1 if the phase of parity
    ``parity`` has completed (the current phase has the other parity), else 0."""
    bar = _mbar_bar(index)
    with _STATE_LOCK:
        for dst, s, data in bar["queue"]:
            dst.reshape(-1)[s:s + data.size] = data
            bar["tx"] -= 4 * data.size
        bar["queue"].clear()
        _mbar_complete_if_done(bar)
        done = (bar["completed"] & 1) != (int(parity) & 1)
        if not done:
            bar["spins"] += 1
            if bar.get("since") is None:
                bar["since"] = time.monotonic()
            if bar["spins"] > _MBAR_SPIN_LIMIT and time.monotonic() - bar["since"] > _MBAR_WAIT_S:
                raise RuntimeError(f"mbarrier at word {int(index)}: phase {bar['completed']} never completes "
                                   f"({bar['pending']} arrivals and {bar['tx']} bytes outstanding)")
    return np.uint32(1 if done else 0)


def _tensor_copy_twin(smem, s_index, tmap, c0, c1, c2, c3, bar_index):
    """Simulator twin of ``cp.async.bulk.tensor.4d … mbarrier::complete_tx::bytes``: the box of the stand-in tensor
    map ``tmap`` (:func:`kernels_gpu.tensor_map.simulated_map`: the driver's maps are opaque) at coordinates (c0,
    c1, c2, c3), swizzled as the copy engine writes it (:func:`kernels_gpu.tensor_map.simulated_box`), queued on the
    mbarrier at word ``bar_index`` as a bulk copy is: it lands when a lane next tries to wait on that barrier."""
    from kernels_gpu import tensor_map
    s = int(s_index)
    if s % 32:
        raise RuntimeError("tensor_copy_4d: the shared-memory destination must be 128-byte aligned")
    data = tensor_map.simulated_box(getattr(tmap, "_ary", tmap), (c0, c1, c2, c3), 4 * s)
    bar = _mbar_bar(bar_index)
    with _STATE_LOCK:
        bar["queue"].append((smem, s, data))


def _fence_twin():
    """Simulator twin of ``fence.mbarrier_init`` and ``fence.proxy.async``: the simulator has one proxy and its
    stores are visible at once."""


def _red_add_v4_f32_twin(gmem, index, x0, x1, x2, x3):
    """Simulator twin of ``red.global.add.v4.f32 [gmem + 4·index], {x0, x1, x2, x3}``: four atomic additions into
    the C-contiguous float32 array ``gmem`` at flat ``index`` … ``index + 3`` (16-byte aligned, as the hardware
    requires)."""
    from numba.cuda.simulator import kernelapi  # (the lock the simulator's own atomic adds take)
    i = int(index)
    if i % 4:
        raise RuntimeError("red_add_v4_f32: the address must be 16-byte aligned (index a multiple of 4)")
    a = np.asarray(getattr(gmem, "_ary", gmem))
    if not a.flags.c_contiguous:
        raise ValueError("red_add_v4_f32: gmem must be C-contiguous (its flat index is the address)")
    flat = a.reshape(-1)
    for e, x in enumerate((x0, x1, x2, x3)):
        with kernelapi.addlock:
            flat[i + e] += x


def _cluster_twin(*args):
    """Simulator stand-in of the cluster instructions: numba's simulator runs a grid one block at a time, so blocks
    cannot meet or read each other's shared memory — kernels_gpu.inference.decode never takes its cluster path there."""
    raise RuntimeError("thread-block clusters need a GPU: numba's CUDA simulator runs one block at a time")


def _shfl_xor_twin(value, mask):
    """Simulator twin of ``shfl.sync.bfly.b32`` over the full warp (every lane passes the same ``mask``)."""
    m = int(mask)
    return _collective(value, lambda values: [values[lane ^ m] for lane in range(frag.WARP)])



# -- Hopper: warpgroup MMA, descriptors, named barriers ---------------------------------------------------------

class _Group:
    """The meeting point of one warpgroup's 128 simulated threads (as :class:`_Warp` for a warp)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=_WARP_TIMEOUT_S)
        self.slots: list = [None] * size
        self.results: list = [None] * size


def _group_collective(value, compute, size: int = 128):
    """:func:`_collective` over the ``size`` consecutive threads (a warpgroup) that the caller belongs to."""
    thread = threading.current_thread()
    manager = getattr(thread, "_manager", None)
    if manager is None:
        raise RuntimeError("a warpgroup instruction twin was called outside a simulated CUDA kernel")
    tid = thread.thread_id
    with _STATE_LOCK:
        groups = manager.__dict__.setdefault("_fa2edu_groups", {})
        group = groups.get((size, tid // size))
        if group is None:
            group = groups[(size, tid // size)] = _Group(size)
    me = tid % size
    try:
        group.slots[me] = value
        group.barrier.wait()
        if me == 0:
            try:
                group.results = compute(list(group.slots))
            except Exception:
                group.barrier.abort()
                raise
        group.barrier.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError(f"a warpgroup instruction was not reached by all {size} threads of the warpgroup "
                           "(divergent call, or a thread failed)") from None
    return group.results[me]


def _uniform(values, name: str):
    first = values[0]
    if any(v != first for v in values):
        raise RuntimeError(f"wgmma: {name} must be the same in every thread of the warpgroup")
    return first


def _wgmma_twin(dtype: str, N: int, a_from: str, trans_b: bool):
    from kernels_gpu import wgmma_layout as wl
    n_acc = N // 2

    def compute(values):
        smem = values[0][0]
        desc_b = _uniform([v[3] for v in values], "the B descriptor")
        scale_d = _uniform([v[4] for v in values], "scale-d")
        if a_from == "smem":
            A = half_values(wl.read_operand(smem, _uniform([v[2] for v in values], "the A descriptor"), 64, "K"),
                            dtype)
        else:
            regs = np.array([[_u32(x) for x in v[2]] for v in values], dtype=np.uint32)     # (128, 4)
            A = wl.from_a_fragments(half_values(regs.view(np.uint16), dtype).reshape(128, 8))
        B = half_values(wl.read_operand(smem, desc_b, N, "MN" if trans_b else "K"), dtype).T        # (16, N)
        C = wl.from_accumulator_fragments(np.array([v[1] for v in values], dtype=np.float32))
        D = wl.wgmma_reference(A, B, C if scale_d else None)
        return list(wl.accumulator_fragments(D))

    def wgmma_ss(smem, acc, desc_a, desc_b, scale_d):
        """Simulator twin of ``wgmma.mma_async.sync.aligned.m64nNk16.f32`` with A and B in shared memory."""
        mine = tuple(np.float32(acc[i]) for i in range(n_acc))
        acc[:n_acc] = _group_collective((smem, mine, int(desc_a), int(desc_b), int(scale_d)), compute)

    def wgmma_rs(smem, acc, a0, a1, a2, a3, desc_b, scale_d):
        """Simulator twin of ``wgmma.mma_async.sync.aligned.m64nNk16.f32`` with A in registers."""
        mine = tuple(np.float32(acc[i]) for i in range(n_acc))
        acc[:n_acc] = _group_collective((smem, mine, (a0, a1, a2, a3), int(desc_b), int(scale_d)), compute)
    return wgmma_ss if a_from == "smem" else wgmma_rs


def _e4m3_values(codes) -> np.ndarray:
    """uint8 e4m3 codes → float32 (exact; the two NaN codes give NaN), by the format's definition."""
    from fa2edu.fp8 import from_bits
    return from_bits(np.asarray(codes, dtype=np.uint8), "e4m3")


def _wgmma_fp8_twin(N: int, a_from: str):
    from kernels_gpu import wgmma_layout as wl
    n_acc = N // 2

    def compute(values):
        smem = values[0][0]
        desc_b = _uniform([v[3] for v in values], "the B descriptor")
        scale_d = _uniform([v[4] for v in values], "scale-d")
        if a_from == "smem":
            A = _e4m3_values(wl.read_operand(smem, _uniform([v[2] for v in values], "the A descriptor"), 64, "K",
                                             element_bytes=1))
        else:
            regs = np.array([[_u32(x) for x in v[2]] for v in values], dtype=np.uint32)     # (128, 4)
            A = wl.from_a_fragments_fp8(_e4m3_values(regs.view(np.uint8).reshape(128, 16)))  # byte 0 lowest
        B = _e4m3_values(wl.read_operand(smem, desc_b, N, "K", element_bytes=1)).T          # (32, N)
        C = wl.from_accumulator_fragments(np.array([v[1] for v in values], dtype=np.float32))
        D = wl.wgmma_reference(A, B, C if scale_d else None)
        return list(wl.accumulator_fragments(D))

    def wgmma_ss(smem, acc, desc_a, desc_b, scale_d):
        """Simulator twin of ``wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3`` with A and B in shared
        memory: both read as e4m3 bytes through their K-major descriptors, the product summed exactly."""
        mine = tuple(np.float32(acc[i]) for i in range(n_acc))
        acc[:n_acc] = _group_collective((smem, mine, int(desc_a), int(desc_b), int(scale_d)), compute)

    def wgmma_rs(smem, acc, a0, a1, a2, a3, desc_b, scale_d):
        """Simulator twin of ``wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3`` with A in registers (four
        bytes per register, the lowest byte the first element)."""
        mine = tuple(np.float32(acc[i]) for i in range(n_acc))
        acc[:n_acc] = _group_collective((smem, mine, (a0, a1, a2, a3), int(desc_b), int(scale_d)), compute)
    return wgmma_ss if a_from == "smem" else wgmma_rs


def _pack_e4m3x4_twin(x0, x1, x2, x3):
    """Simulator twin of :func:`pack_e4m3x4`: four floats rounded to e4m3 (nearest even, saturating at ±448, as
    ``cvt.rn.satfinite`` does), x0 in the lowest byte."""
    from fa2edu.fp8 import to_bits
    b = to_bits(np.array([x0, x1, x2, x3], dtype=np.float32), "e4m3", saturate=True).astype(np.uint32)
    return np.uint32(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24))


def _wgmma_sync_twin(*args):
    """Simulator twin of ``wgmma.fence`` / ``commit_group`` / ``wait_group`` and the register fence: the twin's
    products are complete when issued, so there is nothing to order."""


def _opaque_u32_twin(x):
    """Simulator twin of :func:`opaque_u32`: the value, as a uint32 (the simulator hoists nothing)."""
    return np.uint32(int(x) & 0xFFFFFFFF)


def _shared_byte_address_twin(smem, index):
    """Simulator twin of ``cvta.to.shared``: the byte offset of ``smem[index]`` from the start of ``smem`` (the
    twins read descriptors relative to the shared array they are given)."""
    return np.uint32(int(index) * np.asarray(smem).dtype.itemsize)


def _mbar_arrive_twin(smem, index):
    """Simulator twin of ``mbarrier.arrive``: one arrival on the current phase."""
    bar = _mbar_bar(index)
    with _STATE_LOCK:
        bar["pending"] -= 1
        if bar["pending"] < 0:
            raise RuntimeError(f"mbarrier at word {int(index)}: more arrivals than its count")
        _mbar_complete_if_done(bar)


def _setmaxnreg_twin(inc: bool, count: int):
    def setmaxnreg():
        """Simulator twin of ``setmaxnreg``: registers are not simulated; the count is checked."""
    return setmaxnreg


def _elect_one_twin():
    """Simulator twin of ``elect.sync`` over the full warp: lane 0 is the elected one (the lowest active lane)."""
    return np.uint32(1 if threading.current_thread().thread_id % frag.WARP == 0 else 0)


class _NamedBarrier:
    """One of the block's 16 hardware barriers: threads count in until ``n`` have, then the phase completes."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count, self.generation, self.n = 0, 0, None

    def arrive(self, n: int, wait: bool, ident: int) -> None:
        with self.cond:
            if self.n is None:
                self.n = n
            elif self.n != n:
                raise RuntimeError(f"named barrier {ident}: threads disagree on its count ({self.n} and {n})")
            generation = self.generation
            self.count += 1
            if self.count == n:
                self.count, self.n = 0, None
                self.generation += 1
                self.cond.notify_all()
                return
            if wait and not self.cond.wait_for(lambda: self.generation != generation, timeout=_WARP_TIMEOUT_S):
                raise RuntimeError(f"named barrier {ident}: {self.count} of {n} threads arrived; the rest never "
                                   "did")


def _named_barrier(ident) -> _NamedBarrier:
    manager = getattr(threading.current_thread(), "_manager", None)
    if manager is None:
        raise RuntimeError("a named-barrier twin was called outside a simulated CUDA kernel")
    i = int(ident)
    if not 0 <= i < 16:
        raise RuntimeError(f"named barrier ids are 0 … 15, got {i}")
    with _STATE_LOCK:
        bars = manager.__dict__.setdefault("_fa2edu_named_barriers", {})
        return bars.setdefault(i, _NamedBarrier())


def _check_barrier_count(n) -> int:
    n = int(n)
    if n <= 0 or n % frag.WARP:
        raise RuntimeError(f"a named barrier's thread count must be a positive multiple of 32, got {n}")
    return n


def _named_barrier_sync_twin(ident, n):
    """Simulator twin of ``bar.sync id, n``: wait until ``n`` threads have arrived at barrier ``id``."""
    _named_barrier(ident).arrive(_check_barrier_count(n), True, int(ident))


def _named_barrier_arrive_twin(ident, n):
    """Simulator twin of ``bar.arrive id, n``: count in at barrier ``id`` without waiting."""
    _named_barrier(ident).arrive(_check_barrier_count(n), False, int(ident))


def _globaltimer_twin():
    """Simulator twin of ``%globaltimer``: nanoseconds of the host's monotonic clock."""
    return np.uint64(time.monotonic_ns())


def _clock64_twin():
    """Simulator twin of ``%clock64``: the host's performance counter in nanoseconds (a clock that only goes
    forward, as the SM's cycle counter does)."""
    return np.uint64(time.perf_counter_ns())


# ================================================================================================================
# The real instructions (built only when a GPU compiles kernels)
# ================================================================================================================

def _build_gpu() -> dict:
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def asm(builder, ret, args, text, constraints, side_effect=True):
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    def cast_all(context, builder, sig, args, to):
        return [context.cast(builder, v, t, f) for v, t, f in zip(args, sig.args, to)]

    def shared_address(context, builder, aryty, ary, index, indexty):
        """The 32-bit shared-state-space address of ``ary[index]`` (numba hands shared arrays out as generic
        pointers: an addrspacecast to space 3 turns it into ``cvta.to.shared``)."""
        array = context.make_array(aryty)(context, builder, ary)
        idx = context.cast(builder, index, indexty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, array, [idx], wraparound=False)
        sptr = builder.addrspacecast(builder.bitcast(ptr, ir.PointerType(ir.IntType(8))),
                                     ir.PointerType(ir.IntType(8), 3))
        return builder.ptrtoint(sptr, i32)

    def global_address(context, builder, aryty, ary, index, indexty):
        """The address ``index`` elements past element 0 of an array of any rank and layout (the flat index of a
        C-contiguous array; for a strided one the kernels compute the offset from its strides)."""
        array = context.make_array(aryty)(context, builder, ary)
        idx = context.cast(builder, index, indexty, types.intp)
        return builder.ptrtoint(builder.gep(array.data, [idx]), i64)

    def make_mma(kind, shape="m16n8k16"):
        text = (f"mma.sync.aligned.{shape}.row.col.f32.{kind}.{kind}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            formal = (types.uint32,) * 6 + (types.float32,) * 4
            sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

            def codegen(context, builder, signature, args):
                vals = [context.cast(builder, v, t, f) for v, t, f in zip(args, signature.args, formal)]
                res = asm(builder, ir.LiteralStructType([f32] * 4), vals, text,
                          "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, i) for i in range(4)])
            return sig, codegen
        return mma

    def make_ldmatrix(trans):
        text = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") +
                ".shared.b16 {$0,$1,$2,$3}, [$4];")

        @intrinsic
        def ldmatrix(typingctx, smem, index):
            sig = types.UniTuple(types.uint32, 4)(smem, index)

            def codegen(context, builder, signature, args):
                addr = shared_address(context, builder, signature.args[0], args[0], args[1], signature.args[1])
                res = asm(builder, ir.LiteralStructType([i32] * 4), [addr], text, "=r,=r,=r,=r,r")
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, i) for i in range(4)])
            return sig, codegen
        return ldmatrix

    def make_cp_async16(prefetch: str = ""):
        text = f"cp.async.cg.shared.global{prefetch} [$0], [$1], 16, $2;"

        @intrinsic
        def cp_async16(typingctx, smem, s_index, gmem, g_index, src_bytes):
            sig = types.void(smem, s_index, gmem, g_index, src_bytes)

            def codegen(context, builder, signature, args):
                dst = shared_address(context, builder, signature.args[0], args[0], args[1], signature.args[1])
                src = global_address(context, builder, signature.args[2], args[2], args[3], signature.args[3])
                n = context.cast(builder, args[4], signature.args[4], types.uint32)
                asm(builder, ir.VoidType(), [dst, src, n], text, "r,l,r,~{memory}")
                return context.get_dummy_value()
            return sig, codegen
        return cp_async16

    @intrinsic
    def bulk_copy(typingctx, smem, s_index, gmem, g_index, nbytes, bar_index):
        sig = types.void(smem, s_index, gmem, g_index, nbytes, bar_index)

        def codegen(context, builder, signature, args):
            a = signature.args
            dst = shared_address(context, builder, a[0], args[0], args[1], a[1])
            src = global_address(context, builder, a[2], args[2], args[3], a[3])
            n = context.cast(builder, args[4], a[4], types.uint32)
            bar = shared_address(context, builder, a[0], args[0], args[5], a[5])
            asm(builder, ir.VoidType(), [dst, src, n, bar],
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                "r,l,r,r,~{memory}")
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def tensor_copy_4d(typingctx, smem, s_index, tmap, c0, c1, c2, c3, bar_index):
        sig = types.void(smem, s_index, tmap, c0, c1, c2, c3, bar_index)

        def codegen(context, builder, signature, args):
            a = signature.args
            dst = shared_address(context, builder, a[0], args[0], args[1], a[1])
            desc = builder.ptrtoint(context.make_array(a[2])(context, builder, args[2]).data, i64)
            coords = [context.cast(builder, args[i], a[i], types.int32) for i in range(3, 7)]
            bar = shared_address(context, builder, a[0], args[0], args[7], a[7])
            asm(builder, ir.VoidType(), [dst, desc, *coords, bar],
                "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                "[$0], [$1, {$2, $3, $4, $5}], [$6];", "r,l,r,r,r,r,r,~{memory}")
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def red_add_v4_f32(typingctx, gmem, index, x0, x1, x2, x3):
        sig = types.void(gmem, index, x0, x1, x2, x3)

        def codegen(context, builder, signature, args):
            a = signature.args
            dst = global_address(context, builder, a[0], args[0], args[1], a[1])
            xs = [context.cast(builder, args[i], a[i], types.float32) for i in range(2, 6)]
            asm(builder, ir.VoidType(), [dst, *xs], "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
                "l,f,f,f,f,~{memory}")
            return context.get_dummy_value()
        return sig, codegen

    def make_mbar_op(text):
        @intrinsic
        def op(typingctx, smem, index, value):
            sig = types.void(smem, index, value)

            def codegen(context, builder, signature, args):
                a = signature.args
                bar = shared_address(context, builder, a[0], args[0], args[1], a[1])
                v = context.cast(builder, args[2], a[2], types.uint32)
                asm(builder, ir.VoidType(), [bar, v], text, "r,r,~{memory}")
                return context.get_dummy_value()
            return sig, codegen
        return op

    @intrinsic
    def mbar_try_wait(typingctx, smem, index, parity):
        sig = types.uint32(smem, index, parity)

        def codegen(context, builder, signature, args):
            a = signature.args
            bar = shared_address(context, builder, a[0], args[0], args[1], a[1])
            p = context.cast(builder, args[2], a[2], types.uint32)
            text = ("{ .reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; "
                    "selp.u32 $0, 1, 0, done; }")
            return asm(builder, i32, [bar, p], text, "=r,r,r,~{memory}")
        return sig, codegen

    def make_simple(text):
        @intrinsic
        def op(typingctx):
            def codegen(context, builder, signature, args):
                asm(builder, ir.VoidType(), [], text, "~{memory}")
                return context.get_dummy_value()
            return types.void(), codegen
        return op

    def make_pack(kind):
        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(lo, hi)

            def codegen(context, builder, signature, args):
                lo_, hi_ = [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)]
                # cvt.rn.f16x2.f32 d, a, b puts a in the upper half: pass hi first
                return asm(builder, i32, [hi_, lo_], f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f",
                           side_effect=False)
            return sig, codegen
        return pack

    def make_unpack(kind):
        # f16 → f32 by cvt; bf16 → f32 is a shift of the bits into the upper half (exact)
        if kind == "f16":
            text = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }")
        else:
            text = ("{ .reg .b32 lo, hi; shl.b32 lo, $2, 16; and.b32 hi, $2, 0xFFFF0000; "
                    "mov.b32 $0, lo; mov.b32 $1, hi; }")

        @intrinsic
        def unpack(typingctx, word):
            sig = types.UniTuple(types.float32, 2)(word)

            def codegen(context, builder, signature, args):
                w = context.cast(builder, args[0], signature.args[0], types.uint32)
                res = asm(builder, ir.LiteralStructType([f32, f32]), [w], text, "=f,=f,r", side_effect=False)
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, i) for i in range(2)])
            return sig, codegen
        return unpack

    @intrinsic
    def pack_e4m3x4(typingctx, x0, x1, x2, x3):
        # cvt.rn.satfinite.e4m3x2.f32 d, a, b puts a in the upper byte of d: pass the higher element first
        text = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
                "mov.b32 $0, {lo, hi}; }")
        sig = types.uint32(x0, x1, x2, x3)

        def codegen(context, builder, signature, args):
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)]
            return asm(builder, i32, vals, text, "=r,f,f,f,f", side_effect=False)
        return sig, codegen

    @intrinsic
    def cvt_tf32(typingctx, x):
        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], types.float32)
            return asm(builder, i32, [v], "cvt.rna.tf32.f32 $0, $1;", "=r,f", side_effect=False)
        return types.uint32(x), codegen

    @intrinsic
    def split_tf32(typingctx, x):
        # Both roundings are cvt.rna's, done on the bits: half of the dropped range (0x1000) added to the magnitude,
        # the 13 low bits cleared — two integer instructions, where ptxas expands cvt.rna.tf32.f32 on sm_90 into
        # about five (an infinity test and a select around the same addition). Equal to cvt.rna for every finite
        # x (a carry into the exponent is the rounding up it should be; past the largest tf32 it gives infinity);
        # a NaN with a payload above 0x7FFFF000 would not survive, and fa2edu's inputs are finite. big is exactly
        # the float the mma reads, x − big is exact, and the outputs are written last (no early clobber of x).
        # x: a float32, or the 32 bits of one (an unsigned integer, as ldmatrix returns them)
        bits = isinstance(x, types.Integer)
        text = ("{ .reg .b32 w, b, c; .reg .f32 x, h, r; mov.b32 w, $2; mov.b32 x, w; "
                "add.u32 b, w, 0x1000; and.b32 b, b, 0xFFFFE000; mov.b32 h, b; sub.f32 r, x, h; mov.b32 c, r; "
                "add.u32 c, c, 0x1000; and.b32 c, c, 0xFFFFE000; mov.b32 $1, c; mov.b32 $0, b; }")
        sig = types.UniTuple(types.uint32, 2)(x)

        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], types.uint32 if bits else types.float32)
            res = asm(builder, ir.LiteralStructType([i32, i32]), [v], text, "=r,=r," + ("r" if bits else "f"),
                      side_effect=False)
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(res, i) for i in range(2)])
        return sig, codegen

    @intrinsic
    def ex2(typingctx, x):
        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[0], signature.args[0], types.float32)
            fnty = ir.FunctionType(f32, [f32])
            return builder.call(cgutils.get_or_insert_function(builder.module, fnty,
                                                               "llvm.nvvm.ex2.approx.ftz.f"), [v])
        return types.float32(x), codegen

    @intrinsic
    def ld_cluster_f32(typingctx, smem, index, rank):
        sig = types.float32(smem, index, rank)

        def codegen(context, builder, signature, args):
            a = signature.args
            local = shared_address(context, builder, a[0], args[0], args[1], a[1])
            r = context.cast(builder, args[2], a[2], types.uint32)
            text = "{ .reg .u32 remote; mapa.shared::cluster.u32 remote, $1, $2; ld.shared::cluster.f32 $0, [remote]; }"
            return asm(builder, f32, [local, r], text, "=f,r,r,~{memory}")
        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def shfl_xor(value, mask):
        return cuda.shfl_xor_sync(FULL_MASK, value, mask)

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        cuda.syncwarp(FULL_MASK)


    @intrinsic
    def shared_byte_address(typingctx, smem, index):
        def codegen(context, builder, signature, args):
            a = signature.args
            return shared_address(context, builder, a[0], args[0], args[1], a[1])
        return types.uint32(smem, index), codegen

    @intrinsic
    def mbar_arrive(typingctx, smem, index):
        def codegen(context, builder, signature, args):
            a = signature.args
            bar = shared_address(context, builder, a[0], args[0], args[1], a[1])
            asm(builder, ir.VoidType(), [bar], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}")
            return context.get_dummy_value()
        return types.void(smem, index), codegen

    @intrinsic
    def opaque_u32(typingctx, x):
        def codegen(context, builder, signature, args):
            value = context.cast(builder, args[0], signature.args[0], types.uint32)
            return asm(builder, i32, [value], "mov.b32 $0, $1;", "=r,r")
        return types.uint32(x), codegen

    @intrinsic
    def elect_one(typingctx):
        def codegen(context, builder, signature, args):
            return asm(builder, i32, [], "{ .reg .pred p; elect.sync _|p, 0xffffffff; selp.u32 $0, 1, 0, p; }",
                       "=r")
        return types.uint32(), codegen

    def make_bar(op):
        @intrinsic
        def bar(typingctx, ident, n):
            def codegen(context, builder, signature, args):
                vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, signature.args)]
                asm(builder, ir.VoidType(), vals, f"{op} $0, $1;", "r,r,~{memory}")
                return context.get_dummy_value()
            return types.void(ident, n), codegen
        return bar

    @intrinsic
    def globaltimer(typingctx):
        def codegen(context, builder, signature, args):
            return asm(builder, i64, [], "mov.u64 $0, %globaltimer;", "=l")
        return types.uint64(), codegen

    @intrinsic
    def clock64(typingctx):
        def codegen(context, builder, signature, args):
            return asm(builder, i64, [], "mov.u64 $0, %clock64;", "=l")
        return types.uint64(), codegen

    return dict(syncwarp=syncwarp, mma_f16=make_mma("f16"), mma_bf16=make_mma("bf16"), ldmatrix_x4=make_ldmatrix(False),
                ldmatrix_x4_trans=make_ldmatrix(True), cp_async16=make_cp_async16(),
                cp_async16_l2_128=make_cp_async16(".L2::128B"),
                cp_async_commit=make_simple("cp.async.commit_group;"),
                cp_async_wait_all=make_simple("cp.async.wait_group 0;"),
                cp_async_wait_one=make_simple("cp.async.wait_group 1;"),
                cp_async_wait_two=make_simple("cp.async.wait_group 2;"),
                cp_async_wait_three=make_simple("cp.async.wait_group 3;"),
                pack_f16x2=make_pack("f16"), pack_bf16x2=make_pack("bf16"), pack_e4m3x4=pack_e4m3x4,
                unpack_f16x2=make_unpack("f16"), unpack_bf16x2=make_unpack("bf16"), ex2=ex2, shfl_xor=shfl_xor,
                mma_tf32=make_mma("tf32", "m16n8k8"), cvt_tf32=cvt_tf32, split_tf32=split_tf32,
                griddep_wait=make_simple("griddepcontrol.wait;"),
                griddep_launch_dependents=make_simple("griddepcontrol.launch_dependents;"),
                bulk_copy=bulk_copy, tensor_copy_4d=tensor_copy_4d,
                mbar_init=make_mbar_op("mbarrier.init.shared::cta.b64 [$0], $1;"),
                mbar_arrive_expect_tx=make_mbar_op("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;"),
                mbar_try_wait=mbar_try_wait,
                fence_mbarrier_init=make_simple("fence.mbarrier_init.release.cluster;"),
                fence_proxy_async=make_simple("fence.proxy.async.shared::cta;"), red_add_v4_f32=red_add_v4_f32,
                cluster_arrive=make_simple("barrier.cluster.arrive.release.aligned;"),
                cluster_wait=make_simple("barrier.cluster.wait.acquire.aligned;"), ld_cluster_f32=ld_cluster_f32,
                wgmma_fence=make_simple("wgmma.fence.sync.aligned;"),
                wgmma_commit=make_simple("wgmma.commit_group.sync.aligned;"),
                shared_byte_address=shared_byte_address, mbar_arrive=mbar_arrive, elect_one=elect_one,
                opaque_u32=opaque_u32, named_barrier_sync=make_bar("bar.sync"),
                named_barrier_arrive=make_bar("bar.arrive"),
                globaltimer=globaltimer, clock64=clock64)


def _build_twins() -> dict:
    return dict(mma_f16=_mma_twin("float16"), mma_bf16=_mma_twin("bfloat16"), ldmatrix_x4=_ldmatrix_twin(False),
                ldmatrix_x4_trans=_ldmatrix_twin(True), cp_async16=_cp_async16_twin,
                cp_async16_l2_128=_cp_async16_twin,
                cp_async_commit=_cp_async_commit_twin, cp_async_wait_all=_cp_async_wait_all_twin,
                cp_async_wait_one=_cp_async_wait_one_twin, cp_async_wait_two=_cp_async_wait_two_twin,
                cp_async_wait_three=_cp_async_wait_three_twin,
                pack_f16x2=_pack_twin("float16"),
                pack_bf16x2=_pack_twin("bfloat16"), pack_e4m3x4=_pack_e4m3x4_twin,
                unpack_f16x2=_unpack_twin("float16"),
                unpack_bf16x2=_unpack_twin("bfloat16"), ex2=_ex2_twin, shfl_xor=_shfl_xor_twin,
                syncwarp=_syncwarp_twin, mma_tf32=_mma_tf32_twin, cvt_tf32=_cvt_tf32_twin,
                split_tf32=_split_tf32_twin,
                griddep_wait=_griddep_twin, griddep_launch_dependents=_griddep_twin,
                bulk_copy=_bulk_copy_twin, tensor_copy_4d=_tensor_copy_twin, mbar_init=_mbar_init_twin,
                mbar_arrive_expect_tx=_mbar_arrive_expect_tx_twin,
                mbar_try_wait=_mbar_try_wait_twin, fence_mbarrier_init=_fence_twin, fence_proxy_async=_fence_twin,
                red_add_v4_f32=_red_add_v4_f32_twin, cluster_arrive=_cluster_twin, cluster_wait=_cluster_twin,
                ld_cluster_f32=_cluster_twin, wgmma_fence=_wgmma_sync_twin, wgmma_commit=_wgmma_sync_twin,
                shared_byte_address=_shared_byte_address_twin, mbar_arrive=_mbar_arrive_twin,
                elect_one=_elect_one_twin, opaque_u32=_opaque_u32_twin, named_barrier_sync=_named_barrier_sync_twin,
                named_barrier_arrive=_named_barrier_arrive_twin, globaltimer=_globaltimer_twin,
                clock64=_clock64_twin)


globals().update(_build_twins() if SIMULATED else _build_gpu())


# ================================================================================================================
# Hopper instructions whose operand counts are compile-time constants: made per shape, in either world
# ================================================================================================================

def _wgmma_gpu(dtype: str, N: int, a_from: str, trans_b: bool):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    kind = {"float16": "f16", "bfloat16": "bf16", "e4m3": "e4m3"}[dtype]
    # 8-bit types: K = 32 per instruction, and no transpose immediates (both operands K-major)
    K, trans = (32, "") if kind == "e4m3" else (16, ", %d" % int(trans_b))
    n = N // 2
    d = ",".join(f"${i}" for i in range(n))
    f32 = ir.FloatType()
    if a_from == "smem":
        text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.m64n%dk%d.f32.%s.%s {%s}, "
                "$%d, $%d, p, 1, 1%s%s; }" % (2 * n + 2, N, K, kind, kind, d, 2 * n, 2 * n + 1,
                                              ", 0" if trans else "", trans))
        operands = "l,l,r"
    else:
        text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.m64n%dk%d.f32.%s.%s {%s}, "
                "{$%d, $%d, $%d, $%d}, $%d, p, 1, 1%s; }"
                % (2 * n + 5, N, K, kind, kind, d, 2 * n, 2 * n + 1, 2 * n + 2, 2 * n + 3, 2 * n + 4, trans))
        operands = "r,r,r,r,l,r"
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)]) + "," + operands + ",~{memory}"

    def body(context, builder, signature, args, scalars, scalar_types):
        acc_ty = signature.args[1]
        data = context.make_array(acc_ty)(context, builder, args[1]).data
        ptrs = [builder.gep(data, [ir.Constant(ir.IntType(64), i)]) for i in range(n)]
        vals = [builder.load(p) for p in ptrs]
        extra = [context.cast(builder, v, t, f) for v, t, f in scalars]
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * n), [x.type for x in vals + extra])
        res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), vals + extra)
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(res, i), p)
        return context.get_dummy_value()

    if a_from == "smem":
        @intrinsic
        def wgmma_ss(typingctx, smem, acc, desc_a, desc_b, scale_d):
            def codegen(context, builder, signature, args):
                a = signature.args
                return body(context, builder, signature, args,
                            [(args[2], a[2], types.uint64), (args[3], a[3], types.uint64),
                             (args[4], a[4], types.uint32)], a)
            return types.void(smem, acc, desc_a, desc_b, scale_d), codegen
        return wgmma_ss

    @intrinsic
    def wgmma_rs(typingctx, smem, acc, a0, a1, a2, a3, desc_b, scale_d):
        def codegen(context, builder, signature, args):
            a = signature.args
            scalars = [(args[i], a[i], types.uint32) for i in range(2, 6)]
            scalars += [(args[6], a[6], types.uint64), (args[7], a[7], types.uint32)]
            return body(context, builder, signature, args, scalars, a)
        return types.void(smem, acc, a0, a1, a2, a3, desc_b, scale_d), codegen
    return wgmma_rs


@functools.lru_cache(maxsize=None)
def make_wgmma(dtype: str, N: int, a: str = "smem", trans_b: bool = False):
    """``wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}`` (PTX ISA 9.7.15.5.2) for one shape,
    as a device function that the warpgroup's 128 threads call together:

    * ``a="smem"``: ``wgmma(smem, acc, desc_a, desc_b, scale_d)`` — A (64 × 16, K-major) and B named by matrix
      descriptors (:func:`descriptor`);
    * ``a="regs"``: ``wgmma(smem, acc, a0, a1, a2, a3, desc_b, scale_d)`` — A from four registers of packed
      16-bit pairs per thread (the fragment table of :mod:`kernels_gpu.wgmma_layout`).

    ``acc`` is a local float32 array whose first N/2 elements are the thread's accumulators, updated in place
    (D = A·B + D, or D = A·B when ``scale_d`` is 0); ``trans_b``: B is MN-major (V of O = P·V) rather than
    K-major (K of S = Q·Kᵀ). ``smem`` is the shared array the descriptors point into (the twin reads it; the
    hardware reads the addresses). The product is asynchronous on the GPU: :func:`wgmma_commit`, then a wait
    (:func:`make_wgmma_wait`) before ``acc`` is read. N: a multiple of 8 from 8 to 256."""
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    if N % 8 or not 8 <= N <= 256:
        raise ValueError(f"wgmma's N must be a multiple of 8 from 8 to 256, got {N}")
    if a not in ("smem", "regs"):
        raise ValueError(f"a must be 'smem' or 'regs', got {a!r}")
    return _wgmma_twin(dtype, N, a, bool(trans_b)) if SIMULATED else _wgmma_gpu(dtype, N, a, bool(trans_b))


@functools.lru_cache(maxsize=None)
def make_wgmma_fp8(N: int, a: str = "smem"):
    """``wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3`` (PTX ISA 9.7.15.5.2; fragments 9.7.15.5.1.1.3) for
    one shape: D (64 × N, float32) = A (64 × 32) · B (32 × N) + D on float8 e4m3 operands, both **K-major** (the
    8-bit forms have no transpose flags). The same calls as :func:`make_wgmma`:

    * ``a="smem"``: ``wgmma(smem, acc, desc_a, desc_b, scale_d)`` — A and B named by descriptors over 1-byte
      elements (a 128-byte swizzled row holds 128 of them; one instruction reads 32 bytes of each row);
    * ``a="regs"``: ``wgmma(smem, acc, a0, a1, a2, a3, desc_b, scale_d)`` — A from four registers of four e4m3
      bytes per thread (:func:`kernels_gpu.wgmma_layout.a_register_layout_fp8`; :func:`pack_e4m3x4` makes them).

    Twice the K of the 16-bit instruction in the same issue slot: the tensor cores' FP8 rate is twice bf16's.
    N: a multiple of 8 from 8 to 256."""
    if N % 8 or not 8 <= N <= 256:
        raise ValueError(f"wgmma's N must be a multiple of 8 from 8 to 256, got {N}")
    if a not in ("smem", "regs"):
        raise ValueError(f"a must be 'smem' or 'regs', got {a!r}")
    return _wgmma_fp8_twin(N, a) if SIMULATED else _wgmma_gpu("e4m3", N, a, False)


def _tied_gpu(text: str, count: int):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
    f32 = ir.FloatType()
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)]) + ",~{memory}"

    @intrinsic
    def tied(typingctx, acc):
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            ptrs = [builder.gep(data, [ir.Constant(ir.IntType(64), i)]) for i in range(count)]
            vals = [builder.load(p) for p in ptrs]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * count), [f32] * count)
            res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), vals)
            for i, p in enumerate(ptrs):
                builder.store(builder.extract_value(res, i), p)
            return context.get_dummy_value()
        return types.void(acc), codegen
    return tied


@functools.lru_cache(maxsize=None)
def make_wgmma_wait(pending: int, count: int):
    """``wgmma.wait_group.sync.aligned pending`` (PTX ISA 9.7.15.8): wait until at most ``pending`` committed
    groups of this warpgroup's wgmma are in flight, as ``wait(acc)`` with the first ``count`` accumulators of the
    local array ``acc`` passed through the instruction — so the compiler cannot move a read of them above the
    wait (the registers are the wgmma's until then; CUTLASS's ``warpgroup_fence_operand``)."""
    if not 0 <= pending <= 7:
        raise ValueError(f"pending must be 0 … 7, got {pending}")
    return _wgmma_sync_twin if SIMULATED else _tied_gpu(f"wgmma.wait_group.sync.aligned {pending};", count)


@functools.lru_cache(maxsize=None)
def make_wgmma_fence(count: int):
    """``wgmma.fence.sync.aligned`` (PTX ISA 9.7.15.6) as ``fence(acc)``, the first ``count`` accumulators of
    ``acc`` tied through it: every ordinary write of them (a rescale of O) stays before the fence, which must stand
    between such writes and the next wgmma that reads them."""
    return _wgmma_sync_twin if SIMULATED else _tied_gpu("wgmma.fence.sync.aligned;", count)


@functools.lru_cache(maxsize=None)
def make_register_fence(count: int):
    """``fence(acc)``: the first ``count`` floats of ``acc`` pass through an empty volatile asm — ordered after the
    asm before it (a wgmma wait) and before the one after it (the next wgmma), so the compiler keeps every read
    and write of them in between. No instruction is emitted."""
    return _wgmma_sync_twin if SIMULATED else _tied_gpu("", count)


@functools.lru_cache(maxsize=None)
def make_setmaxnreg(inc: bool, count: int):
    """``setmaxnreg.{inc,dec}.sync.aligned.u32 count`` (PTX ISA 9.7.17.1): the warpgroup asks for (inc) or gives
    back (dec) registers, ``count`` per thread, a multiple of 8 from 24 to 256. ptxas keeps it only in a kernel
    compiled with ``launch_bounds=(threads, 1)`` (GPU.md)."""
    if count % 8 or not 24 <= count <= 256:
        raise ValueError(f"setmaxnreg's count must be a multiple of 8 from 24 to 256, got {count}")
    if SIMULATED:
        return _setmaxnreg_twin(inc, count)
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
    text = f"setmaxnreg.{'inc' if inc else 'dec'}.sync.aligned.u32 {count};"

    @intrinsic
    def setmaxnreg(typingctx):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen
    return setmaxnreg


def _descriptor(byte_address, lbo, sbo, mode):
    """A matrix descriptor (PTX ISA 9.7.15.5.1.2.2; :func:`kernels_gpu.wgmma_layout.encode_descriptor`) from the
    operand's shared byte address, LBO and SBO in bytes, and the swizzle mode (0 none, 1 128-byte, 2 64-byte)."""
    return (uint64((byte_address & 0x3FFFF) >> 4) | (uint64((lbo & 0x3FFFF) >> 4) << uint64(16))
            | (uint64((sbo & 0x3FFFF) >> 4) << uint64(32)) | (uint64(mode) << uint64(62)))


def _make_descriptor():
    from numba import cuda
    if SIMULATED:
        return cuda.jit(device=True)(_descriptor)
    return cuda.jit(device=True, forceinline=True)(_descriptor)


#: ``descriptor(byte_address, lbo, sbo, mode)`` — a device function (both worlds)
descriptor = _make_descriptor()
