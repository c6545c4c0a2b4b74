"""One-warp kernels that exercise each wrapper of :mod:`kernels_gpu.ptx`, and their NumPy expectations.

The same kernels run on the GPU (the real instructions) and in numba's CUDA simulator (the twins), and both are
compared with the NumPy specification in :mod:`kernels_gpu.fragments`: in CI that checks the twins, on
the GPU the real instructions — so the twin and the hardware are checked against each other through one spec.
Each ``check_*`` returns ``(got, expected)`` NumPy arrays.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, uint32

from kernels_gpu import fragments as frag
from kernels_gpu import ptx

__all__ = ["check_mma", "check_ldmatrix", "check_pack", "check_cp_async", "check_bulk_copy", "check_shfl_ex2",
           "check_mma_tf32", "check_cvt_tf32"]


def _words(values: np.ndarray, dtype: str) -> np.ndarray:
    """(32, 2k) values → (32, k) uint32 registers (low half = even element)."""
    bits = ptx.half_bits(values, dtype).astype(np.uint32)
    return bits[:, 0::2] | (bits[:, 1::2] << 16)


@functools.lru_cache(maxsize=None)
def _mma_kernel(dtype: str):
    mma = ptx.mma_f16 if dtype == "float16" else ptx.mma_bf16

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        r = mma(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
        for e in range(4):
            d[lane, e] = r[e]
    return kernel


def check_mma(dtype: str = "float16", seed: int = 0, scale: float = 1.0):
    """D = A·B + C for random 16-bit A (16 × 16), B (16 × 8) and float32 C, per lane: (got, expected), (32, 4)."""
    rng = np.random.default_rng(seed)
    A = ptx.half_values(ptx.half_bits(rng.standard_normal((16, 16)) * scale, dtype), dtype)
    B = ptx.half_values(ptx.half_bits(rng.standard_normal((16, 8)) * scale, dtype), dtype)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a, b, c = _words(frag.a_fragments(A), dtype), _words(frag.b_fragments(B), dtype), frag.c_fragments(C)
    d = cuda.to_device(np.full((32, 4), np.nan, dtype=np.float32))
    _mma_kernel(dtype)[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d)
    return d.copy_to_host(), frag.mma_reference(frag.a_fragments(A), frag.b_fragments(B), c)


@functools.lru_cache(maxsize=None)
def _ldmatrix_kernel(trans: bool, words: int):
    load = ptx.ldmatrix_x4_trans if trans else ptx.ldmatrix_x4

    @cuda.jit
    def kernel(src, rows, out):
        lane = cuda.threadIdx.x
        sm = cuda.shared.array(words, uint32)
        for k in range(lane, words, 32):
            sm[k] = src[k]
        cuda.syncthreads()
        r = load(sm, rows[lane])
        for e in range(4):
            out[lane, e] = r[e]
    return kernel


def check_ldmatrix(trans: bool = False, seed: int = 0):
    """``ldmatrix.x4`` on a 16 × 24-word shared tile with shuffled row addresses: (got, expected) (32, 4) uint32."""
    rng = np.random.default_rng(seed)
    words = 16 * 24
    src = rng.integers(0, 2**32, words, dtype=np.uint64).astype(np.uint32)
    rows = (4 * rng.permutation(words // 4)[:32]).astype(np.int32)        # any 16-byte-aligned rows
    out = cuda.to_device(np.zeros((32, 4), dtype=np.uint32))
    _ldmatrix_kernel(bool(trans), words)[1, 32](cuda.to_device(src), cuda.to_device(rows), out)
    halves = frag.ldmatrix_reference(src.view(np.uint16), 2 * rows.astype(np.int64), trans).astype(np.uint32)
    return out.copy_to_host(), halves[..., 0] | (halves[..., 1] << 16)


@functools.lru_cache(maxsize=None)
def _pack_kernel(dtype: str):
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2
    unpack = ptx.unpack_f16x2 if dtype == "float16" else ptx.unpack_bf16x2

    @cuda.jit
    def kernel(x, words, back):
        k = cuda.grid(1)
        if k < words.shape[0]:
            w = pack(x[2 * k], x[2 * k + 1])
            words[k] = w
            lo, hi = unpack(w)
            back[2 * k] = lo
            back[2 * k + 1] = hi
    return kernel


def check_pack(dtype: str = "float16", seed: int = 0):
    """``cvt.rn`` packing of float32 pairs and the unpacking back: ((words, values), (expected words, values))."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal(60) * 10.0 ** rng.integers(-6, 5, 60),
                        [0.0, -0.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11]]).astype(np.float32)   # ties too
    n = x.size // 2
    words = cuda.to_device(np.zeros(n, dtype=np.uint32))
    back = cuda.to_device(np.zeros(x.size, dtype=np.float32))
    _pack_kernel(dtype)[1, 32](cuda.to_device(x), words, back)
    bits = ptx.half_bits(x, dtype).astype(np.uint32)
    expected = bits[0::2] | (bits[1::2] << 16)
    return (words.copy_to_host(), back.copy_to_host()), (expected, ptx.half_values(bits, dtype))


@cuda.jit
def _cp_async_kernel(src, after):
    t = cuda.threadIdx.x
    sm = cuda.shared.array(256, uint32)
    for k in range(4):
        sm[4 * t + k] = uint32(7)
    cuda.syncthreads()
    # rows of 4 words: thread t copies words 4(t ^ 1) …, so each reads what another thread's copy wrote;
    # even threads fill with zeros (source size 0)
    ptx.cp_async16(sm, 4 * (t ^ 1), src, 4 * t, 16 if t % 2 else 0)
    ptx.cp_async_commit()
    ptx.cp_async_wait_all()
    cuda.syncthreads()
    for k in range(4):
        after[4 * t + k] = sm[4 * t + k]


def check_cp_async(seed: int = 0):
    """``cp.async`` 16-byte copies (some zero-filled), committed and waited for: (got, expected) (256,) uint32."""
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 2**32, 256, dtype=np.uint64).astype(np.uint32)
    after = cuda.to_device(np.zeros(256, dtype=np.uint32))
    _cp_async_kernel[1, 64](cuda.to_device(src), after)
    expected = np.zeros(256, dtype=np.uint32)
    for t in range(64):
        if t % 2:
            expected[4 * (t ^ 1):4 * (t ^ 1) + 4] = src[4 * t:4 * t + 4]
    return after.copy_to_host(), expected


@cuda.jit
def _bulk_copy_kernel(src, after):
    lane = cuda.threadIdx.x
    sm = cuda.shared.array(264, uint32)         # 256 words of rows, then one mbarrier (words 256, 257)
    if lane == 0:
        ptx.mbar_init(sm, 256, 1)
        ptx.fence_mbarrier_init()
    ptx.syncwarp()
    for phase in range(2):
        # Phase p: lane t copies the 8-word row (p·32 + t) % 64 of src into row t ^ 3 — 32 bytes per bulk copy, the
        # barrier expecting all 1024 bytes (the arrival may come after some bytes have landed: the count goes
        # below zero and the phase still completes only with both in).
        ptx.bulk_copy(sm, 8 * (lane ^ 3), src, 8 * ((phase * 32 + lane) % 64), 32, 256)
        if lane == 0:
            ptx.mbar_arrive_expect_tx(sm, 256, 1024)
        while ptx.mbar_try_wait(sm, 256, phase) == 0:
            pass
        for k in range(8):
            after[phase, 8 * lane + k] = sm[8 * lane + k]
        ptx.syncwarp()                          # every lane has read this phase's rows before the next overwrite
        if lane == 0:
            ptx.fence_proxy_async()
        ptx.syncwarp()


def check_bulk_copy(seed: int = 0):
    """``cp.async.bulk`` of 32-byte rows completing on an mbarrier, two phases (parity 0, then 1): (got,
    expected), (2, 256) uint32."""
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 2**32, 512, dtype=np.uint64).astype(np.uint32)
    after = cuda.to_device(np.zeros((2, 256), dtype=np.uint32))
    _bulk_copy_kernel[1, 32](cuda.to_device(src), after)
    expected = np.zeros((2, 256), dtype=np.uint32)
    for phase in range(2):
        for t in range(32):
            row = (phase * 32 + t) % 64
            expected[phase, 8 * (t ^ 3):8 * (t ^ 3) + 8] = src[8 * row:8 * row + 8]
    return after.copy_to_host(), expected


@cuda.jit
def _shfl_ex2_kernel(x, shuffled, powers):
    lane = cuda.threadIdx.x
    shuffled[lane] = ptx.shfl_xor(x[lane], 5)
    powers[lane] = ptx.ex2(x[lane])


def check_shfl_ex2(seed: int = 0):
    """``shfl.sync.bfly`` (xor 5) and ``ex2.approx.ftz``: ((shuffled, 2^x), (expected, expected))."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(-140, 20, 29), [-np.inf, 0.0, -126.5]]).astype(np.float32)
    shuffled = cuda.to_device(np.zeros(32, dtype=np.float32))
    powers = cuda.to_device(np.zeros(32, dtype=np.float32))
    _shfl_ex2_kernel[1, 32](cuda.to_device(x), shuffled, powers)
    exact = np.exp2(x.astype(np.float64))
    exact[exact < 2.0**-126] = 0.0
    return (shuffled.copy_to_host(), powers.copy_to_host()), (x[np.arange(32) ^ 5], exact.astype(np.float32))


@cuda.jit
def _mma_tf32_kernel(a, b, c, d):
    lane = cuda.threadIdx.x
    r = ptx.mma_tf32(ptx.cvt_tf32(a[lane, 0]), ptx.cvt_tf32(a[lane, 1]), ptx.cvt_tf32(a[lane, 2]),
                     ptx.cvt_tf32(a[lane, 3]), ptx.cvt_tf32(b[lane, 0]), ptx.cvt_tf32(b[lane, 1]),
                     c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for e in range(4):
        d[lane, e] = r[e]


def check_mma_tf32(seed: int = 0, scale: float = 1.0):
    """D = A·B + C for float32 A (16 × 8), B (8 × 8) converted to tf32 in the kernel (``cvt.rna``) and float32 C,
    per lane: ``(got, expected, magnitude)``, each (32, 4): ``magnitude`` = ``Σ|a·b| + |c|`` of each element, the scale
    of the summation error a tensor core may make (see :func:`~kernels_gpu.fragments.mma_tf32_reference`)."""
    rng = np.random.default_rng(seed)
    A = (rng.standard_normal((16, 8)) * scale).astype(np.float32)
    B = (rng.standard_normal((8, 8)) * scale).astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a, b, c = frag.a_fragments_tf32(A), frag.b_fragments_tf32(B), frag.c_fragments(C)
    d = cuda.to_device(np.full((32, 4), np.nan, dtype=np.float32))
    _mma_tf32_kernel[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d)
    At, Bt = ptx.tf32_round(A), ptx.tf32_round(B)
    expected = frag.mma_tf32_reference(frag.a_fragments_tf32(At), frag.b_fragments_tf32(Bt), c)
    magnitude = np.abs(At.astype(np.float64)) @ np.abs(Bt.astype(np.float64)) + np.abs(C)
    return d.copy_to_host(), expected, frag.c_fragments(magnitude)


@cuda.jit
def _cvt_tf32_kernel(x, bits):
    k = cuda.grid(1)
    if k < x.shape[0]:
        bits[k] = ptx.cvt_tf32(x[k])


def check_cvt_tf32(seed: int = 0):
    """``cvt.rna.tf32.f32`` on random floats of every magnitude, exact ties (both signs), values that round up into
    the next binade, subnormals and ±inf: (got bits, expected bits), (n,) uint32."""
    rng = np.random.default_rng(seed)
    random = (rng.standard_normal(200) * 10.0 ** rng.integers(-30, 30, 200)).astype(np.float32)
    one = np.float32(1.0).view(np.uint32)
    special = np.array([one | 0x1000, one | 0x3000, one | 0x0FFF, one | 0x1FFF, one | 0x7FFFFF,   # ties, near ties
                        0x80000000 | one | 0x1000, 0x00001000, 0x00003000, 0x00000FFF, 0x007FFFFF,   # subnormals
                        0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000],                # max, inf, 0
                       dtype=np.uint32).view(np.float32)
    x = np.concatenate([random, special]).astype(np.float32)
    bits = cuda.to_device(np.zeros(x.size, dtype=np.uint32))
    _cvt_tf32_kernel[-(-x.size // 64), 64](cuda.to_device(x), bits)
    return bits.copy_to_host(), ptx.tf32_round(x).view(np.uint32)

