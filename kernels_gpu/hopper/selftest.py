"""The Hopper instructions against their NumPy specification (:mod:`kernels_gpu.wgmma_layout`), on whatever runs
the kernel: in numba's simulator the twins of :mod:`kernels_gpu.ptx` answer (CI checks twin = spec), on an H100 or
H200 the hardware does (the GPU tests check hardware = spec). Each ``check_*`` returns ``(got, expected)``."""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32, uint64

from kernels_gpu import ptx
from kernels_gpu import wgmma_layout as wl

__all__ = ["check_wgmma", "check_wgmma_fp8", "check_pack_e4m3", "check_named_barrier", "check_elect", "LAYOUTS",
           "MEMORY_WORDS"]

#: shared memory of the probe kernel, 32-bit words (plus 1024 bytes of alignment slack)
MEMORY_WORDS = 10240
_SHARED_WORDS = MEMORY_WORDS + 256

#: operand geometry by (major, swizzle mode): (LBO, SBO) in bytes of the layouts tested
LAYOUTS = {
    ("K", 0): (128, 256),        # core matrices: the two along K adjacent, 8-row groups 256 bytes apart
    ("K", 2): (16, 512),         # 64-byte rows, 8-row atoms of 512 bytes
    ("K", 1): (16, 1024),        # 128-byte rows (a TMA box of 64 columns), atoms of 1024 bytes
    ("MN", 0): (2048, 128),      # core matrices of 8 keys × 8 columns, n-groups adjacent, k-groups 2 KB apart
    ("MN", 2): (1024, 512),      # 32-column panels of 64-byte rows: next panel 1 KB on, 8 keys 512 bytes on
    ("MN", 1): (2048, 1024),     # 64-column panels (V as TMA lands it): next panel 2 KB on, 8 keys 1 KB on
}


@functools.lru_cache(maxsize=None)
def _probe(dtype: str, N: int, a_from: str, trans_b: bool):
    mma = ptx.make_wgmma(dtype, N, a_from, trans_b)
    wait = ptx.make_wgmma_wait(0, N // 2)
    fence = ptx.make_wgmma_fence(N // 2)
    n_acc, words = N // 2, MEMORY_WORDS

    @cuda.jit
    def probe(mem, descs, a_regs, acc_in, acc_out):
        sm = cuda.shared.array(_SHARED_WORDS, uint32)
        t = cuda.threadIdx.x
        a = ptx.shared_byte_address(sm, 0)
        off = ((uint32(1024) - (a & uint32(1023))) & uint32(1023)) >> uint32(2)
        for e in range(t, words, 128):
            sm[off + e] = mem[e]
        ptx.fence_proxy_async()
        cuda.syncthreads()
        shift = uint64((a + 4 * off) >> uint32(4))      # descriptors are given relative to the aligned start
        acc = cuda.local.array(n_acc, float32)
        for k in range(n_acc):
            acc[k] = acc_in[t, k]
        fence(acc)
        if a_from == "smem":
            mma(sm, acc, descs[0] + shift, descs[1] + shift, uint32(1))
        else:
            mma(sm, acc, a_regs[t, 0], a_regs[t, 1], a_regs[t, 2], a_regs[t, 3], descs[1] + shift, uint32(1))
        ptx.wgmma_commit()
        wait(acc)
        for k in range(n_acc):
            acc_out[t, k] = acc[k]
    return probe


def _random_halves(rng, n: int, dtype: str) -> np.ndarray:
    """n 16-bit patterns of random values in [-2, 2) of ``dtype`` (finite, exact in float32)."""
    return ptx.half_bits(rng.uniform(-2, 2, n).astype(np.float32), dtype)


def check_wgmma(dtype: str = "bfloat16", N: int = 64, a_from: str = "smem", trans_b: bool = False,
                mode_a: int = 1, mode_b: int = 1, seed: int = 0, a_start: int = 0, b_start: int = 8192):
    """One ``wgmma m64nNk16`` on random shared memory: A (K-major, swizzle ``mode_a``; or random registers) at byte
    ``a_start``, B (MN-major if ``trans_b``, swizzle ``mode_b``) at byte ``b_start``, random accumulators. Returns
    (the warpgroup's accumulators after the instruction, the specification's): (128, N/2) float32 each."""
    rng = np.random.default_rng(seed)
    memory = _random_halves(rng, 2 * MEMORY_WORDS, dtype).view(np.uint32)
    lbo_a, sbo_a = LAYOUTS[("K", mode_a)]
    lbo_b, sbo_b = LAYOUTS[("MN" if trans_b else "K", mode_b)]
    desc_a = wl.encode_descriptor(a_start, lbo_a, sbo_a, mode_a)
    desc_b = wl.encode_descriptor(b_start, lbo_b, sbo_b, mode_b)
    a_regs = _random_halves(rng, 128 * 8, dtype).view(np.uint32).reshape(128, 4)
    acc_in = rng.standard_normal((128, N // 2)).astype(np.float32)
    acc_out = np.full((128, N // 2), np.nan, dtype=np.float32)
    descs = np.array([desc_a, desc_b], dtype=np.uint64)
    d_out = cuda.to_device(acc_out)
    _probe(dtype, N, a_from, bool(trans_b))[1, 128](cuda.to_device(memory), cuda.to_device(descs),
                                                    cuda.to_device(a_regs), cuda.to_device(acc_in), d_out)
    got = d_out.copy_to_host()
    if a_from == "smem":
        A = ptx.half_values(wl.read_operand(memory, desc_a, 64, "K"), dtype)
    else:
        A = wl.from_a_fragments(ptx.half_values(a_regs.view(np.uint16), dtype).reshape(128, 8))
    B = ptx.half_values(wl.read_operand(memory, desc_b, N, "MN" if trans_b else "K"), dtype).T
    expected = wl.accumulator_fragments(wl.wgmma_reference(A, B, wl.from_accumulator_fragments(acc_in)))
    return got, expected


@functools.lru_cache(maxsize=None)
def _probe_fp8(N: int, a_from: str):
    mma = ptx.make_wgmma_fp8(N, a_from)
    wait = ptx.make_wgmma_wait(0, N // 2)
    fence = ptx.make_wgmma_fence(N // 2)
    n_acc, words = N // 2, MEMORY_WORDS

    @cuda.jit
    def probe(mem, descs, a_regs, acc_in, acc_out):
        sm = cuda.shared.array(_SHARED_WORDS, uint32)
        t = cuda.threadIdx.x
        a = ptx.shared_byte_address(sm, 0)
        off = ((uint32(1024) - (a & uint32(1023))) & uint32(1023)) >> uint32(2)
        for e in range(t, words, 128):
            sm[off + e] = mem[e]
        ptx.fence_proxy_async()
        cuda.syncthreads()
        shift = uint64((a + 4 * off) >> uint32(4))
        acc = cuda.local.array(n_acc, float32)
        for k in range(n_acc):
            acc[k] = acc_in[t, k]
        fence(acc)
        if a_from == "smem":
            mma(sm, acc, descs[0] + shift, descs[1] + shift, uint32(1))
        else:
            mma(sm, acc, a_regs[t, 0], a_regs[t, 1], a_regs[t, 2], a_regs[t, 3], descs[1] + shift, uint32(1))
        ptx.wgmma_commit()
        wait(acc)
        for k in range(n_acc):
            acc_out[t, k] = acc[k]
    return probe


def _random_e4m3(rng, n: int) -> np.ndarray:
    """n e4m3 codes of random finite values (the two NaN codes, 0x7F and 0xFF, left out)."""
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    return np.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes).astype(np.uint8)


def check_wgmma_fp8(N: int = 64, a_from: str = "smem", mode_a: int = 1, mode_b: int = 1, seed: int = 0,
                    a_start: int = 0, b_start: int = 8192):
    """One ``wgmma m64nNk32 .e4m3`` on random e4m3 shared memory: A (K-major, swizzle ``mode_a``; or random
    registers of four codes) at byte ``a_start``, B (K-major, swizzle ``mode_b``) at byte ``b_start``, random
    accumulators. Returns (the warpgroup's accumulators after the instruction, the specification's, the size of
    each sum, Σ_k abs(a_ik·b_kj) + abs(c_ij), laid out like them).

    The specification sums exactly (float64, rounded once to float32). The hardware does not, for FP8: on the
    H200 (2026-12-02, ``tests/gpu/test_hopper_fp8_gpu.py``) its sums differed from the exact ones by 10⁻⁶-2·10⁻⁴
    of their size (the five elements its log printed; up to 53 in sums of ~10⁵): the accumulator keeps fewer
    mantissa bits than float32 while it adds FP8 products, as DeepSeek-V3's report found on the H800 (about 14
    bits). A layout mistake errs by the size itself; the GPU test separates the two with a bound of 2⁻⁸ of the
    size."""
    from fa2edu.fp8 import from_bits
    rng = np.random.default_rng(seed)
    memory = _random_e4m3(rng, 4 * MEMORY_WORDS).view(np.uint32)
    lbo_a, sbo_a = LAYOUTS[("K", mode_a)]
    lbo_b, sbo_b = LAYOUTS[("K", mode_b)]
    desc_a = wl.encode_descriptor(a_start, lbo_a, sbo_a, mode_a)
    desc_b = wl.encode_descriptor(b_start, lbo_b, sbo_b, mode_b)
    a_regs = _random_e4m3(rng, 128 * 16).view(np.uint32).reshape(128, 4)
    acc_in = rng.standard_normal((128, N // 2)).astype(np.float32)
    acc_out = np.full((128, N // 2), np.nan, dtype=np.float32)
    descs = np.array([desc_a, desc_b], dtype=np.uint64)
    d_out = cuda.to_device(acc_out)
    _probe_fp8(N, a_from)[1, 128](cuda.to_device(memory), cuda.to_device(descs), cuda.to_device(a_regs),
                                  cuda.to_device(acc_in), d_out)
    got = d_out.copy_to_host()
    if a_from == "smem":
        A = from_bits(wl.read_operand(memory, desc_a, 64, "K", element_bytes=1))
    else:
        A = wl.from_a_fragments_fp8(from_bits(a_regs.view(np.uint8).reshape(128, 16)))
    B = from_bits(wl.read_operand(memory, desc_b, N, "K", element_bytes=1)).T
    C = wl.from_accumulator_fragments(acc_in)
    expected = wl.accumulator_fragments(wl.wgmma_reference(A, B, C))
    size = wl.accumulator_fragments(np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64)) + np.abs(C))
    return got, expected, size


@functools.lru_cache(maxsize=None)
def _pack_kernel():
    @cuda.jit
    def kernel(x, out):
        t = cuda.grid(1)
        if t < out.shape[0]:
            out[t] = ptx.pack_e4m3x4(x[t, 0], x[t, 1], x[t, 2], x[t, 3])
    return kernel


def check_pack_e4m3(seed: int = 0, n: int = 256):
    """``pack_e4m3x4`` on floats spread over e4m3's range and past it (ties, subnormals, ±0, values above 448
    that saturate). Returns (the packed words, fa2edu.fp8's codes packed the same way)."""
    from fa2edu.fp8 import fp8_values, to_bits
    rng = np.random.default_rng(seed)
    grid = fp8_values("e4m3")
    mids = (grid[1:] + grid[:-1]) / 2                               # exact ties: round to even
    pool = np.concatenate([grid, mids, -mids, rng.uniform(-500, 500, 256), 2.0 ** rng.uniform(-12, 9, 256),
                           [0.0, -0.0, 448.0, 464.0, 1e6, -1e6]])
    x = rng.choice(pool, size=(n, 4)).astype(np.float32)
    out = cuda.to_device(np.zeros(n, np.uint32))
    _pack_kernel()[-(-n // 128), 128](cuda.to_device(x), out)
    codes = to_bits(x, "e4m3", saturate=True).astype(np.uint32)
    expected = codes[:, 0] | (codes[:, 1] << 8) | (codes[:, 2] << 16) | (codes[:, 3] << 24)
    return out.copy_to_host(), expected.astype(np.uint32)


@functools.lru_cache(maxsize=None)
def _barrier_kernel():
    @cuda.jit
    def kernel(out):
        t = cuda.threadIdx.x
        sm = cuda.shared.array(384, uint32)
        sm[t] = uint32(0)
        cuda.syncthreads()
        # warpgroups 1 and 2 meet at barrier 1 (256 threads) after each wrote its word; warpgroup 0 is not part of
        # it and writes later, after barrier 2 (all 384)
        if t >= 128:
            sm[t] = uint32(t + 1)
            ptx.named_barrier_sync(1, 256)
            out[t] = sm[(t - 128 + 128) % 256 + 128]       # another consumer's word, written before the barrier
        else:
            ptx.named_barrier_arrive(2, 384)
        if t >= 128:
            ptx.named_barrier_sync(2, 384)
        if t < 128:
            out[t] = uint32(ptx.elect_one())
    return kernel


def check_named_barrier():
    """``bar.sync 1, 256`` between warpgroups 1 and 2 (each thread then reads another's word, written before the
    barrier), ``bar.arrive`` / ``bar.sync 2, 384`` with warpgroup 0 arriving only, and ``elect.sync`` in warpgroup 0.
    Returns (what the threads read, what they must read)."""
    out = cuda.to_device(np.zeros(384, dtype=np.uint32))
    _barrier_kernel()[1, 384](out)
    got = out.copy_to_host()
    expected = np.zeros(384, dtype=np.uint32)
    t = np.arange(128, 384)
    expected[128:] = ((t - 128 + 128) % 256 + 128) + 1
    expected[:128] = (np.arange(128) % 32 == 0).astype(np.uint32)
    return got, expected


def check_elect():
    """``elect.sync`` elects exactly one lane per warp (the lowest: lane 0 with every lane active)."""
    got, expected = check_named_barrier()
    return got[:128], expected[:128]
