"""Split-KV decoding (Flash-Decoding) from a contiguous or paged KV cache, as numba.cuda kernels.

:func:`decode_attention` is :func:`fa2edu.decode_attention` on the GPU, with the same arguments and results::

    O, L = kernels_gpu.decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True)

q (B, H_q, N_new, d); a contiguous cache (B, H_kv, N_max, d) or a paged one (num_pages, H_kv, page_size, d) with
``block_table`` (B, max_pages); ``cache_seqlens`` (B,). Storage float32, float16 or bfloat16 (bfloat16 as PyTorch
tensors); all arithmetic float32. O (B, H_q, N_new, d_v) in the storage dtype, L (B, H_q, N_new) float32 (+inf on
a token that sees no key).

**Calls from Python.** A call on PyTorch CUDA tensors (index data too) keeps a :class:`DecodePlan` per shapes,
strides, dtypes and options: the next such call skips the checks, the typing and the split rule; it allocates the
partials, launches the split programs, then allocates O and L and launches the merge (or, where the splits merge
inside their thread-block cluster, allocates O and L and makes the one launch) — each launch one
``cuLaunchKernelEx`` of parameters packed once (:class:`kernels_gpu.driver_launch.Prepared`), the tensor maps found
by the caches' addresses. Where its host time goes (``python -m benchmarks.profilers.decode_host``, H100, batch 1 with
16k keys, ``decode_host_breakdown.json``): 65 µs a call — the plan's key 9, allocations 18, the maps 4, the two
launches 10 and 8 —, against 75 µs for SDPA's cuDNN backend under ``sdpa_kernel`` and 31 µs for SDPA's default
call, whose dispatch is C++ (host times move with the machine: the same measurement on another H100 host gave 38,
45 and 23 µs, ``decode_host_breakdown_ctypes.json``). The first plan (launches through ``cuda.core.launch``, maps
looked up as a list of tensor rows, four allocations) spent 94 µs at that shape in the decoding grid against
cuDNN's 87 (``decode_same_bytes.json``); this one 40 against 72, and SDPA's default call 33 (``decode.json``).

**Two split programs.** This module's :func:`split_kernel` does its dot products on the FMA units (the first
version, described below); :mod:`kernels_gpu.inference.decode_tc` does them on tensor cores and is the default for
float16 and bfloat16 caches whose head sizes are multiples of 8 (``kernel=`` names either). Both write the same
partials; everything else here — the checks, the split cut, the merge launch, paged lookups — serves both.

**Why these kernels look as they do.** A decoding step reads the whole cache to produce G·N_new rows of output per
KV head (G = H_q / H_kv): about 2·G·N_new FLOPs per element read, a few, against the hundreds a GPU can do per
element its memory delivers (chapter 13). So the kernel's only job is to stream K and V once, at the memory's rate:

1. **One pass over each page serves the whole query group.** A program is (sequence b, KV head h, split s): its
   query tile is the R = G·N_new rows of the G query heads of the group and the N_new new tokens (FA2 Alg. 1 with
   a single row block). Each cached K/V row is loaded once and used for all R rows while it is in registers.
2. **Split-KV.** One program per (sequence, KV head) is 8 programs for one sequence on a 132-SM GPU. The keys of a
   sequence are cut into ``num_splits`` ranges of whole key blocks (pages of a paged cache: the cut of
   :func:`fa2edu.inference.split_ranges`); each range is a program that writes a partial (O_s, L_s) in float32, and
   a second, small launch merges them by the log-sum-exp rule of :func:`fa2edu.merge_attention_states` (a split
   that saw no key holds O = 0, L = +inf, the merge's identity). On a Hopper GPU that can hold a (sequence, KV
   head)'s S programs as one thread-block cluster, the tensor-core programs merge among themselves instead,
   through distributed shared memory (:func:`_cluster_merge`; the header of
   :mod:`kernels_gpu.inference.decode_tc` measures it).
3. **Paged KV** (PagedAttention): key j of sequence b lives in physical page ``block_table[b, j // page_size]``,
   row ``j % page_size``; the page size is a compile-time constant, so the division is a multiply and a shift.
4. **Wide loads, no shared memory in the loop.** Inside a program, groups of ``lanes`` consecutive threads each
   take one key at a time: a lane holds ``vec`` 32-bit words (16 bytes when the layout allows) of the key's row
   per chunk, its slice of the R query rows in registers, and the partial dot products of its slice; a butterfly of
   warp shuffles sums the slices, so every lane of the group ends with the R scores. Consecutive groups take
   consecutive keys (a warp's loads cover whole, contiguous rows). Each group runs its own online softmax (FA2
   Alg. 1 lines 8-10) over its keys with its slice of Õ in registers; at the end the groups of a block merge
   through shared memory by the same (m, ℓ) rule (FA1 Section 3.1), and the block writes its (O_s, L_s).
5. **Two steps in flight.** The K/V words of a step go to one of two register buffers: the loads of step i + 1
   are issued before step i is computed, so a warp always has a step's bytes on their way from HBM (the loop runs
   two steps per trip, the buffers alternating, so that every register index is a compile-time constant).

Costs per (sequence b with n_b keys, KV head), R = G·N_new rows, S splits: global reads n_b·(d + d_v) cache
elements (once), S·R·d query elements, S·R·(d_v + 1) partial floats (merge); writes S·R·(d_v + 1) partial floats
(S > 1) and R·(d_v + 1) outputs. FLOPs 2·R·n_b·(d + d_v).

**Prediction** (written before any measurement; H100 SXM, decode N_new = 1, H_q = 32, H_kv = 8, d = 128, fp16, the
``benchmarks.decode`` grid): at contexts ≥ 16k, the bytes that must move (K, V once, q, O) over the kernel time
(CUDA-graph replay) reach 80-95 % of the device-to-device copy rate measured in the same run at batch 8 and 32,
and 65-85 % at batch 1 (fewer, shorter programs: the tail of the split programs and the merge launch weigh more);
at 4k, 30-60 %. A call made from Python (no graph) adds its host time, about 60-120 µs for two launches: at batch
1 and contexts ≤ 16k that host time, not the GPU, sets the pace, as it does for PyTorch's SDPA there. num_splits=1
at batch 1 and contexts ≥ 32k is 5-10× slower than the default (8 programs on 132 SMs). Paged (256-key pages)
within 3 % of contiguous with the same key blocks. Against SDPA's best backend: ahead at batch 1, within ±10 % at
batch 32 and long contexts, where both stream at the copy rate. The instruction budget: a lane spends about 130
instructions on a key (16 bytes of K, 16 of V: 16 conversions, 64 FFMAs, 16 shuffles and 16 adds for the score
sums, the online softmax, addresses), so at the memory's rate an SM issues about 1.8 of its 4 warp-instructions per
cycle: enough warps must be resident to hide the load latency, hence two steps in flight, 166 registers (3 blocks
of 4 warps per SM) and a split rule that fills the resident slots.

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks.decode --quick``: batch 1 and 32, contexts 4k, 16k, 64k;
copy rate 3007 GB/s; ``decode.json`` of that date, since replaced by the run of :mod:`kernels_gpu.inference.decode_tc`,
where this program is the line ``kernels_gpu_cuda_core``). Graph times reach 77 %, 88 %, 91 % of the
copy rate at batch 32 (predicted 80-95 % from 16k: met), but only 18 %, 34 %, 59 % at batch 1 (predicted 65-85 %
from 16k: missed; a 16k step is 65 µs of GPU time, in which the split programs' fixed costs and the merge launch
weigh more than predicted). num_splits=1 at batch 1 is 5.8×, 10.5×, 18× slower than the default rule (16, 32, 43
splits; predicted 5-10× at ≥ 32k: larger); at batch 32 (3 splits) 1.05-1.18×. Paged (256-key pages, shuffled)
takes 1.036-1.063× the contiguous time, bit for bit the same output (predicted within 3 %: missed; within 10 %).
SDPA's best backend (cuDNN) is faster everywhere: ours runs at 0.47-0.66 of its speed at batch 1 and 0.79-0.88 at
batch 32 (predicted ahead at batch 1: wrong); cuDNN reaches 1.02-1.04× the copy rate at batch 32, so the copy
rate (reads and writes in equal parts) is not a ceiling for a read-only stream. Host time of a call from Python:
0.19-1.1 ms (medians, varying between configurations; SDPA 0.06-0.12 ms), above the 60-120 µs predicted, and at
batch 1 it sets the pace of a call (0.60 ms at 16k for 0.065 ms of GPU work).
"""

from __future__ import annotations

import functools
import math
from numbers import Integral
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int64, uint32

from fa2edu.inference import DECODE_SMS, DecodeResult, check_decode_inputs, check_decode_values, decode_block_size
from fa2edu.validation import check_scale
from kernels_gpu import driver_launch, ptx
from kernels_gpu import runtime as rt
from kernels_gpu.inference import decode_io as io
from kernels_gpu.inference import decode_tc

__all__ = ["decode_attention", "decode_split_partials", "merge_split_partials", "planned_splits", "DecodeResult",
           "DecodeTiling", "decode_tiling", "default_num_splits", "rounds_num_splits",
           "SPLIT_OVERHEAD", "load_words", "butterfly_sum",
           "split_kernel", "merge_kernel", "tc_warps", "PROGRAMS", "DecodePlan"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: a CUDA-core split program's fixed cost (its query load, the merge of its groups, its partial), in key blocks, for
#: its split rule (:func:`rounds_num_splits`)
SPLIT_OVERHEAD = 0.5
#: warps of a merge block (one block per output row; the warps share its splits)
MERGE_WARPS = 4
#: splits a merge warp takes per trip (their loads all in flight before the first is used)
MERGE_UNROLL = 8
#: 32-bit words of K and V one lane loads per step (K and V of its ``keys`` keys); two steps are in flight
WORDS_IN_FLIGHT = 16
#: float32 values of the query tile (and of Õ) one lane holds per KV row
LANE_FLOATS = 32
#: warps per block in numba's simulator (which runs every thread as a Python thread); 4 on a GPU
SIMULATOR_WARPS = 1
#: warps of a tensor-core split program on a GPU (:mod:`kernels_gpu.inference.decode_tc`); None: :func:`tc_warps`' rule
TC_WARPS = None


# -- the 16-byte load --------------------------------------------------------------------------------------------

def _build_loads_gpu() -> dict:
    """``ld.global.nc.v{2,4}.{u32,f32}`` (PTX ISA 9.7.9.8, ``ld.global.nc``: a load through the read-only data
    cache; the cache is never written while a kernel reads it): 2 or 4 consecutive 32-bit words in one
    instruction. The caller guarantees the address is a multiple of 8 or 16 bytes (see :func:`decode_tiling`)."""
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def make(vec: int):
        @intrinsic
        def load(typingctx, ary, index):
            if not isinstance(ary, types.Array) or ary.dtype not in (types.uint32, types.float32):
                return None
            is_float = ary.dtype == types.float32
            sig = types.UniTuple(ary.dtype, vec)(ary, index)

            def codegen(context, builder, signature, args):
                array = context.make_array(signature.args[0])(context, builder, args[0])
                idx = context.cast(builder, args[1], signature.args[1], types.intp)
                addr = builder.ptrtoint(builder.gep(array.data, [idx]), ir.IntType(64))
                elt = ir.FloatType() if is_float else ir.IntType(32)
                regs = ",".join(f"${i}" for i in range(vec))
                text = (f"{{ .reg .u64 ga; cvta.to.global.u64 ga, ${vec}; "
                        f"ld.global.nc.v{vec}.{'f32' if is_float else 'u32'} {{{regs}}}, [ga]; }}")
                constraints = ",".join([("=f" if is_float else "=r")] * vec) + ",l"
                fnty = ir.FunctionType(ir.LiteralStructType([elt] * vec), [ir.IntType(64)])
                res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=False), [addr])
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, i) for i in range(vec)])
            return sig, codegen
        return load

    return {2: make(2), 4: make(4)}


def _load2_twin(ary, index):
    """Simulator twin of the 8-byte load: the two words."""
    i = int(index)
    return ary[i], ary[i + 1]


def _load4_twin(ary, index):
    """Simulator twin of the 16-byte load: the four words."""
    i = int(index)
    return ary[i], ary[i + 1], ary[i + 2], ary[i + 3]


@functools.lru_cache(maxsize=None)
def _wide_loads(simulator: bool) -> dict:
    return {2: _load2_twin, 4: _load4_twin} if simulator else _build_loads_gpu()


@functools.lru_cache(maxsize=None)
def load_words(vec: int, simulator: bool):
    """A device function ``load(X, i, dst, o)``: words X[i … i + vec − 1] into ``dst[o …]``, in one instruction
    for vec = 2 or 4 (8 or 16 bytes), a plain load for vec = 1."""
    jit = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)
    if vec == 1:
        @jit
        def load1(X, i, dst, o):
            dst[o] = X[i]
        return load1
    wide = _wide_loads(simulator)[vec]
    if vec == 2:
        @jit
        def load2(X, i, dst, o):
            w0, w1 = wide(X, i)
            dst[o] = w0
            dst[o + 1] = w1
        return load2

    @jit
    def load4(X, i, dst, o):
        w0, w1, w2, w3 = wide(X, i)
        dst[o] = w0
        dst[o + 1] = w1
        dst[o + 2] = w2
        dst[o + 3] = w3
    return load4


# -- storage: a 32-bit word → float32 values, and back ---------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _converters(storage: str, simulator: bool):
    """``unpack(word) -> (lo, hi)`` (float32 storage: (word, 0)) and ``pack(lo, hi) -> word`` (float32: lo)."""
    from kernels_gpu import ptx
    jit = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)
    if storage == "float32":
        @jit
        def unpack(w):
            return w, float32(0.0)

        @jit
        def pack(lo, hi):
            return lo
        return unpack, pack
    if storage == "float16":
        return ptx.unpack_f16x2, ptx.pack_f16x2
    return ptx.unpack_bf16x2, ptx.pack_bf16x2


@functools.lru_cache(maxsize=None)
def butterfly_sum(n: int, lanes: int, simulator: bool):
    """A device function ``butterfly(s, scratch, t)``: each of the ``n`` values of ``s`` summed over the ``lanes``
    consecutive threads of this thread's group (lanes a power of two ≤ 32), every lane ending with the sums.

    On the GPU: log2(lanes) stages of ``shfl.sync.bfly`` (each stage adds the value of lane ``lane ^ mask``); the
    lanes' results are bitwise equal, since each stage adds the same two numbers in either order. The simulator
    has no warp shuffles: there each stage exchanges all n values through shared memory (``scratch``, n floats per
    thread) between two barriers, so every thread of the block must call it."""
    if simulator:
        @cuda.jit(device=True)
        def butterfly_sim(s, scratch, t):
            mask = 1
            while mask < lanes:
                for x in range(n):
                    scratch[t * n + x] = s[x]
                cuda.syncthreads()
                for x in range(n):
                    s[x] += scratch[(t ^ mask) * n + x]
                cuda.syncthreads()
                mask *= 2
        return butterfly_sim

    @cuda.jit(device=True, inline=True)
    def butterfly(s, scratch, t):
        mask = 1
        while mask < lanes:
            for x in range(n):
                s[x] += cuda.shfl_xor_sync(0xFFFFFFFF, s[x], mask)
            mask *= 2
    return butterfly


# -- the shape of a program ---------------------------------------------------------------------------------------

class DecodeTiling(NamedTuple):
    """How a split program spreads its work over threads (all compile-time constants of the kernel).

    warps: warps per block; lanes: consecutive threads that share one key (a power of two ≤ 32); keys: keys a group
    of ``lanes`` takes per step; rows: query rows per program (R = G·N_new, or a tile of them); vec: 32-bit words
    per load (4: 16 bytes)."""

    warps: int
    lanes: int
    keys: int
    rows: int
    vec: int

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def groups(self) -> int:
        """Groups of ``lanes`` threads in a block: the keys a block reads side by side."""
        return self.threads // self.lanes


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def decode_tiling(storage: str, d: int, d_v: int, R: int, vec: int = 4, warps: int | None = None) -> DecodeTiling:
    """The tiling rule (documented constants, no search):

    * rows: all R = G·N_new rows if R·max(d, d_v) ≤ 32·:data:`LANE_FLOATS`, else the most rows that fit (the
      programs of the other row tiles read the same keys again);
    * lanes: the fewest (a power of two) that keep each lane's slice of the query tile and of Õ within
      :data:`LANE_FLOATS` floats (R = 4, d = 128: 16 lanes of 8 columns);
    * vec: 4 words (16 bytes) when the caller's layout allows it (``vec``), fewer while a row has fewer chunks than
      lanes (so every lane has a chunk);
    * keys: as many as fit :data:`WORDS_IN_FLIGHT` words of K and V per lane and step (1 to 8; two steps are in
      flight: R = 4, d = 128, float16: 2 keys, 16 words, 166 registers, 3 blocks of 128 threads per SM);
    * warps: 4 on a GPU (:data:`SIMULATOR_WARPS` in the simulator: faster), fewer if the groups' merge would not
      fit 48 KiB of shared memory.
    """
    if warps is None:
        warps = SIMULATOR_WARPS if rt.simulator_in_use() else 4
    return _decode_tiling(storage, d, d_v, R, vec, warps)


@functools.lru_cache(maxsize=256)
def _decode_tiling(storage: str, d: int, d_v: int, R: int, vec: int, warps: int) -> DecodeTiling:
    """:func:`decode_tiling`, memoised (it runs on every call)."""
    epw = 1 if storage == "float32" else 2
    d_w, dv_w = d // epw, d_v // epw
    width = max(d, d_v)
    rows = R if R * width <= 32 * LANE_FLOATS else max(1, (32 * LANE_FLOATS) // width)
    lanes = min(32, _pow2_at_least(-(-rows * width // LANE_FLOATS)))
    while vec > 1 and (d_w % vec or dv_w % vec or -(-max(d_w, dv_w) // vec) < lanes):
        vec //= 2
    lanes = min(lanes, _pow2_at_least(-(-max(d_w, dv_w) // vec)))
    words_per_key = vec * (-(-(d_w // vec) // lanes) + -(-(dv_w // vec) // lanes))
    keys = max(1, min(8, WORDS_IN_FLIGHT // words_per_key))
    while warps > 1 and (32 * warps // lanes) * rows * (d_v + 2) > rt.SHARED_FLOATS - 32 * warps:
        warps //= 2
    if (32 * warps // lanes) * rows * (d_v + 2) > rt.SHARED_FLOATS:
        raise ValueError(f"d_v = {d_v} is too large for the decoding kernels' shared memory (48 KiB)")
    return DecodeTiling(warps, lanes, keys, rows, vec)


# -- the split program ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def split_kernel(storage: str, d: int, d_v: int, tiling: DecodeTiling, page: int, causal: bool, simulator: bool):
    """Compile-time specialisation of the split program: storage dtype, head sizes (d, d_v even for 16-bit
    storage), tiling, page size (0: a contiguous cache), causal masking.

    Grid (num_splits · row_tiles, H_kv, B); block ``tiling.threads``. Every argument array is flat: Qw, Kw, Vw
    (words: float32, or uint32 of two 16-bit values), table, seqlens (int32/int64), Ow (words), L, Opart, Lpart
    (float32)."""
    WARPS, LPK, KB, RT, VEC = tiling
    THREADS = 32 * WARPS
    NG = THREADS // LPK                      # groups of LPK lanes per block
    TK = NG * KB                             # keys a block takes per step
    EPW = 1 if storage == "float32" else 2   # values per 32-bit word
    D_W, DV_W = d // EPW, d_v // EPW
    CH_K, CH_V = D_W // VEC, DV_W // VEC     # chunks of VEC words per row of K and of V
    NCH_K, NCH_V = -(-CH_K // LPK), -(-CH_V // LPK)
    QF, OF = NCH_K * VEC * EPW, NCH_V * VEC * EPW     # floats of a query row / of an output row per lane
    KW, VW = NCH_K * VEC, NCH_V * VEC                  # words of a K row / of a V row per lane
    # (local and shared array sizes must be compile-time constants: computed here, not in the kernel)
    Q_REGS, O_REGS, S_REGS, KW_REGS, VW_REGS = RT * QF, RT * OF, RT * KB, KB * KW, KB * VW
    SM_STATS, SM_O = NG * RT, NG * RT * d_v
    CAUSAL = causal
    SCRATCH = THREADS * RT * KB if simulator else 1
    WORD = float32 if storage == "float32" else uint32
    NEG_INF = float32(-math.inf)
    unpack, pack = _converters(storage, simulator)
    load = load_words(VEC, simulator)
    rows = io.cache_rows(page, simulator)
    butterfly = butterfly_sum(RT * KB, LPK, simulator)
    from kernels_gpu import ptx
    ex2 = ptx.ex2

    dev = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)

    @dev
    def load_step(Kw, Vw, table, kw, vw, t0, hi, b, h, grp, li, max_pages, num_pages, k_so, k_sh, k_sn, v_so, v_sh,
                  v_sn):
        """Alg. 1 line 7: this lane's chunks of the K and V rows of its group's KB keys t0 + kk·NG + grp (at each kk
        the groups of a warp read consecutive rows), every load issued before any value is used. A key past the
        split is replaced by the split's last key (a valid address; masked in compute_step)."""
        for kk in range(KB):
            j = min(t0 + kk * NG + grp, hi - 1)
            # key j's rows in K and V (paged: through the block table)
            k_row, v_row = rows(table, b, h, j, max_pages, num_pages, k_so, k_sh, k_sn, v_so, v_sh, v_sn)
            for u in range(NCH_K):
                c = li + LPK * u
                if c < CH_K:
                    load(Kw, k_row + c * VEC, kw, (kk * NCH_K + u) * VEC)
                else:
                    for v in range(VEC):
                        kw[(kk * NCH_K + u) * VEC + v] = 0
            for u in range(NCH_V):
                c = li + LPK * u
                if c < CH_V:
                    load(Vw, v_row + c * VEC, vw, (kk * NCH_V + u) * VEC)
                else:
                    for v in range(VEC):
                        vw[(kk * NCH_V + u) * VEC + v] = 0

    @dev
    def compute_step(kw, vw, t0, hi, grp, qf, last, s, o, m, l, scratch, t):
        """Alg. 1 lines 8-10 for the group's KB keys of the step starting at key t0 (their words in kw, vw)."""
        # Alg. 1 line 8: S = (τ Q) K_jᵀ — each lane its slice of d, for the R rows and the KB keys ...
        for x in range(S_REGS):
            s[x] = 0.0
        for kk in range(KB):
            for w in range(KW):
                k_lo, k_hi = unpack(kw[kk * KW + w])
                for rr in range(RT):
                    acc = s[rr * KB + kk] + qf[rr * QF + w * EPW] * k_lo
                    if EPW == 2:
                        acc += qf[rr * QF + w * EPW + 1] * k_hi
                    s[rr * KB + kk] = acc
        # ... then summed over the group's lanes: every lane ends with the R × KB scores.
        butterfly(s, scratch, t)
        # Keys past the split, and (causal) keys after a row's last visible key, get −inf.
        for kk in range(KB):
            j = t0 + kk * NG + grp
            for rr in range(RT):
                if j >= hi or (CAUSAL and j > last[rr]):
                    s[rr * KB + kk] = NEG_INF
        # Alg. 1 line 9: m_new = max(m, rowmax S), P̃ = 2^(S − m_new), ℓ = 2^(m − m_new) ℓ + rowsum P̃.
        for rr in range(RT):
            mx = m[rr]
            for kk in range(KB):
                mx = max(mx, s[rr * KB + kk])
            # Guard m = −inf (no key seen yet): subtract 0 instead, so every exponential is exactly 0.
            m_use = float32(0.0) if mx == NEG_INF else mx
            alpha = ex2(m[rr] - m_use)
            ls = float32(0.0)
            for kk in range(KB):
                p = ex2(s[rr * KB + kk] - m_use)
                s[rr * KB + kk] = p
                ls += p
            l[rr] = alpha * l[rr] + ls
            m[rr] = mx
            # Alg. 1 line 10, first half: Õ = diag(2^(m − m_new)) Õ (skipped when the maximum did not move).
            if alpha != 1.0:
                for x in range(OF):
                    o[rr * OF + x] *= alpha
        # Alg. 1 line 10, second half: Õ += P̃ V_j, this lane's columns of V.
        for kk in range(KB):
            for w in range(VW):
                v_lo, v_hi = unpack(vw[kk * VW + w])
                for rr in range(RT):
                    p = s[rr * KB + kk]
                    o[rr * OF + w * EPW] += p * v_lo
                    if EPW == 2:
                        o[rr * OF + w * EPW + 1] += p * v_hi

    @cuda.jit
    def decode_split(Qw, Kw, Vw, table, seqlens, Ow, L, Opart, Lpart, H_q, H_kv, N_new, R, S, row_tiles, block,
                     max_pages, num_pages, capacity, k_so, k_sh, k_sn, v_so, v_sh, v_sn, scale2):
        t = cuda.threadIdx.x
        grp = t // LPK                               # this thread's group: the keys it loads
        li = t - grp * LPK                           # its lane in the group: the chunks of a row it holds
        split = cuda.blockIdx.x // row_tiles
        r0 = (cuda.blockIdx.x - split * row_tiles) * RT
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        G = H_q // H_kv
        # Sequence b's keys 0 … n − 1, clamped to the cache (lengths on the device are not checked by the host:
        # a bad one gives a wrong answer, never a read outside the cache).
        n = min(max(int64(seqlens[b]), int64(0)), capacity)
        # This split's key blocks: [split·T // S, (split + 1)·T // S) of the T = ceil(n / block) blocks
        # (fa2edu.inference.split_ranges), as keys [lo, hi).
        T = (n + block - 1) // block
        lo = (split * T // S) * block
        hi = min(n, ((split + 1) * T // S) * block)
        # GQA: row r of the tile is query head h·G + r // N_new, new token r % N_new; its flat row in q and O:
        row_base = (b * H_q + h * G) * N_new + r0
        scratch = cuda.shared.array(SCRATCH, float32)

        # FA2 Alg. 1 line 4: this lane's slice of the R query rows, in registers, scaled by τ·log2(e) so that the
        # softmax can use 2^x.
        qf = cuda.local.array(Q_REGS, float32)
        last = cuda.local.array(RT, int64)           # causal: the last key row r may see
        for rr in range(RT):
            r = r0 + rr
            last[rr] = n - N_new + r % N_new
            for u in range(NCH_K):
                c = li + LPK * u
                for v in range(VEC):
                    lo_v = float32(0.0)
                    hi_v = float32(0.0)
                    if r < R and c < CH_K:
                        lo_v, hi_v = unpack(Qw[(row_base + rr) * D_W + c * VEC + v])
                    qf[rr * QF + (u * VEC + v) * EPW] = lo_v * scale2
                    if EPW == 2:
                        qf[rr * QF + (u * VEC + v) * EPW + 1] = hi_v * scale2
        # FA2 Alg. 1 line 5: Õ = 0, ℓ = 0, m = −inf (this group's, over the keys it takes).
        o = cuda.local.array(O_REGS, float32)
        m = cuda.local.array(RT, float32)
        l = cuda.local.array(RT, float32)
        for x in range(RT * OF):
            o[x] = 0.0
        for rr in range(RT):
            m[rr] = NEG_INF
            l[rr] = 0.0
        # Two register buffers of K/V words: the next step's loads are in flight while this step computes.
        kw0 = cuda.local.array(KW_REGS, WORD)
        vw0 = cuda.local.array(VW_REGS, WORD)
        kw1 = cuda.local.array(KW_REGS, WORD)
        vw1 = cuda.local.array(VW_REGS, WORD)
        s = cuda.local.array(S_REGS, float32)

        # FA2 Alg. 1 line 6: the split's keys, TK per step, two steps per trip (buffers 0 and 1 alternate).
        if lo < hi:
            load_step(Kw, Vw, table, kw0, vw0, lo, hi, b, h, grp, li, max_pages, num_pages, k_so, k_sh, k_sn,
                      v_so, v_sh, v_sn)
        for t0 in range(lo, hi, 2 * TK):
            load_step(Kw, Vw, table, kw1, vw1, t0 + TK, hi, b, h, grp, li, max_pages, num_pages, k_so, k_sh, k_sn,
                      v_so, v_sh, v_sn)
            compute_step(kw0, vw0, t0, hi, grp, qf, last, s, o, m, l, scratch, t)
            if t0 + TK < hi:
                if t0 + 2 * TK < hi:
                    load_step(Kw, Vw, table, kw0, vw0, t0 + 2 * TK, hi, b, h, grp, li, max_pages, num_pages, k_so,
                              k_sh, k_sn, v_so, v_sh, v_sn)
                compute_step(kw1, vw1, t0 + TK, hi, grp, qf, last, s, o, m, l, scratch, t)

        # The NG groups merge by the (m, ℓ) rule (FA1 Section 3.1) through shared memory.
        sm_m = cuda.shared.array(SM_STATS, float32)
        sm_l = cuda.shared.array(SM_STATS, float32)
        sm_o = cuda.shared.array(SM_O, float32)
        if li == 0:
            for rr in range(RT):
                sm_m[grp * RT + rr] = m[rr]
                sm_l[grp * RT + rr] = l[rr]
        for rr in range(RT):
            for u in range(NCH_V):
                c = li + LPK * u
                if c < CH_V:
                    for x in range(VEC * EPW):
                        sm_o[(grp * RT + rr) * d_v + c * VEC * EPW + x] = o[rr * OF + u * VEC * EPW + x]
        cuda.syncthreads()
        # One thread per (row, output word): M = max_g m_g, ℓ = Σ_g 2^(m_g − M) ℓ_g, O = Σ_g 2^(m_g − M) Õ_g / ℓ
        # (Alg. 1 lines 12-13; ℓ = 0 means the split saw no key for this row: O = 0, L = +inf).
        for e in range(t, RT * DV_W, THREADS):
            rr = e // DV_W
            w = e - rr * DV_W
            r = r0 + rr
            if r < R:
                M = NEG_INF
                for g in range(NG):
                    M = max(M, sm_m[g * RT + rr])
                M_use = float32(0.0) if M == NEG_INF else M
                lt = float32(0.0)
                a_lo = float32(0.0)
                a_hi = float32(0.0)
                for g in range(NG):
                    wgt = ex2(sm_m[g * RT + rr] - M_use)
                    lt += wgt * sm_l[g * RT + rr]
                    a_lo += wgt * sm_o[(g * RT + rr) * d_v + w * EPW]
                    if EPW == 2:
                        a_hi += wgt * sm_o[(g * RT + rr) * d_v + w * EPW + 1]
                inv = float32(0.0) if lt == 0.0 else float32(1.0) / lt
                L_r = float32(math.inf) if lt == 0.0 else float32(LN2) * (M + math.log2(lt))
                if S == 1:
                    # Alg. 1 lines 14-15: the only split: O and L, once.
                    Ow[(row_base + rr) * DV_W + w] = pack(a_lo * inv, a_hi * inv)
                    if w == 0:
                        L[row_base + rr] = L_r
                else:
                    # Flash-Decoding: this split's partial (O_s, L_s), float32, merged by merge_kernel.
                    part = ((b * H_kv + h) * S + split) * R + r
                    Opart[part * d_v + w * EPW] = a_lo * inv
                    if EPW == 2:
                        Opart[part * d_v + w * EPW + 1] = a_hi * inv
                    if w == 0:
                        Lpart[part] = L_r

    return decode_split


@functools.lru_cache(maxsize=None)
def merge_kernel(storage: str, d_v: int, simulator: bool):
    """Flash-Decoding's reduction: the S partials (O_s, L_s) of each output row merged by the log-sum-exp rule of
    :func:`fa2edu.merge_attention_states` — L = M + log Σ_s e^{L_s − M} with M = max_s L_s, O = Σ_s e^{L_s − M} O_s
    / Σ_s e^{L_s − M}; splits with L_s = +inf (no key) weigh 0; rows with no key at all get O = 0, L = +inf.

    One block of :data:`MERGE_WARPS` warps per output row (row x = (b·H_kv + h)·R + r, also O's flat row
    (b·H_q + h·G)·N_new + r). Warp w takes the splits w·U … w·U + U − 1, then every W·U further (U =
    :data:`MERGE_UNROLL`), lane k the columns k, k + 32, …; per trip it loads all U partials (L_s and its columns of
    O_s) before using any, then folds them into a running (m, ℓ, Σ) by the online rule — the maximum m moves, what
    came before is scaled by e^{m_old − m_new} (FA1 Section 3.1, once more). At S ≤ W·U that is one memory round
    trip per row. The warps' (m, ℓ, Σ) then meet in shared memory by the same rule.

    (The first version gave a row one warp and took one split per trip: S round trips in a row. At batch 1 and 32
    splits the merge launch took longer than the split programs' memory stream would have. A warp per row taking
    16 splits per trip, each lane computing every weight itself — no shared memory, no barrier, four rows a block —
    was tried after Nsight Compute timed this launch at 5.6 µs against cuDNN's reduction's 4.5 (batch 1, 16k
    keys, 16 splits): slower, 14.3 → 15.0 µs a step at 4k keys, 31.8 → 32.4 at 16k, 96.8 → 97.4 at 64k, batch 8
    unchanged (H100, the two trees alternated twice: ``decode_merge_warp_per_row_{old,new}_{1,2}.json``) — a row's
    loads from one warp instead of two, and a quarter of the blocks.)

    Reads S·(d_v + 1) floats per row, once; writes d_v values and L."""
    EPW = 1 if storage == "float32" else 2
    DV_W = d_v // EPW
    WPL = -(-d_v // 32)                      # columns per lane
    THREADS = 32 * MERGE_WARPS
    U = MERGE_UNROLL
    COLS = 32 * WPL                          # columns of a warp's sums in shared memory
    ACC_SM = MERGE_WARPS * COLS
    VALS = U * WPL
    _, pack = _converters(storage, simulator)
    griddep_wait = ptx.griddep_wait
    NEG_INF = float32(-math.inf)
    POS_INF = float32(math.inf)

    @cuda.jit
    def decode_merge(Opart, Lpart, Ow, L, rows, R, S):
        # Launched early (programmatic dependent launch, :func:`kernels_gpu.driver_launch.pdl_available`): the split
        # programs may still run — nothing they write is read before they have all finished.
        griddep_wait()
        x = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        base = (x // R) * R * S + x % R            # partial of split s: base + s·R
        acc_sm = cuda.shared.array(ACC_SM, float32)
        m_sm = cuda.shared.array(MERGE_WARPS, float32)
        l_sm = cuda.shared.array(MERGE_WARPS, float32)
        acc = cuda.local.array(WPL, float32)
        Ls = cuda.local.array(U, float32)
        vals = cuda.local.array(VALS, float32)
        for q in range(WPL):
            acc[q] = 0.0
        m = NEG_INF                                # this warp's running maximum of L_s, and ℓ = Σ e^{L_s − m}
        l = float32(0.0)
        for s0 in range(warp * U, S, MERGE_WARPS * U):
            # every load of the trip first (an absent split reads as empty: L = +inf, O = 0) ...
            for u in range(U):
                sp = s0 + u
                Ls[u] = Lpart[base + sp * R] if sp < S else POS_INF
                for q in range(WPL):
                    c = lane + 32 * q
                    vals[u * WPL + q] = Opart[(base + sp * R) * d_v + c] if sp < S and c < d_v else float32(0.0)
            # ... then the online rule: m_new = max(m, L_s of the splits that saw a key)
            m_new = m
            for u in range(U):
                if Ls[u] != POS_INF:
                    m_new = max(m_new, Ls[u])
            if m_new != NEG_INF:
                alpha = float32(math.exp(m - m_new))          # 0 while m = −inf (nothing to scale yet)
                l *= alpha
                for q in range(WPL):
                    acc[q] *= alpha
                for u in range(U):
                    # every exponent ≤ 0: no overflow; an empty split weighs exactly 0
                    w = float32(0.0) if Ls[u] == POS_INF else float32(math.exp(Ls[u] - m_new))
                    l += w
                    for q in range(WPL):
                        acc[q] += w * vals[u * WPL + q]
                m = m_new
        for q in range(WPL):
            acc_sm[warp * COLS + lane + 32 * q] = acc[q]
        if lane == 0:
            m_sm[warp] = m
            l_sm[warp] = l
        cuda.syncthreads()
        # The warps' (m_w, ℓ_w, Σ_w) by the same rule: M = max_w m_w, ℓ = Σ_w e^{m_w − M} ℓ_w.
        M = NEG_INF
        for v in range(MERGE_WARPS):
            M = max(M, m_sm[v])
        if M == NEG_INF:
            # No split saw a key: the merge of identities is the identity.
            for w in range(tid, DV_W, THREADS):
                Ow[x * DV_W + w] = pack(float32(0.0), float32(0.0))
            if tid == 0:
                L[x] = math.inf
            return
        total = float32(0.0)
        for v in range(MERGE_WARPS):
            total += float32(math.exp(m_sm[v] - M)) * l_sm[v]
        inv = float32(1.0) / total
        for w in range(tid, DV_W, THREADS):
            lo = float32(0.0)
            hi = float32(0.0)
            for v in range(MERGE_WARPS):
                f = float32(math.exp(m_sm[v] - M)) * inv
                lo += f * acc_sm[v * COLS + w * EPW]
                if EPW == 2:
                    hi += f * acc_sm[v * COLS + w * EPW + 1]
            Ow[x * DV_W + w] = pack(lo, hi)
        if tid == 0:
            L[x] = M + math.log(total)

    return decode_merge


# -- the split rule --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def default_num_splits(programs: int, n_max: int, block: int, sms: int) -> int:
    """The tensor-core program's split count when the caller gives none: at most one program per SM (the
    CUDA-core program's rule is :func:`rounds_num_splits`).

    ``programs`` = B · H_kv · row tiles (one program each without splitting); a sequence of n_max keys has
    T = ceil(n_max / block) key blocks (pages); ``sms`` = the GPU's streaming multiprocessors.

    1. S = floor(sms / programs), at least 1 and at most T: splitting stops before a second program would share
       an SM. Measured on an H100 (graph replay, ``benchmarks/results/nvidia-h100/decode_split_sweep.json``),
       batch 1 with 8 KV heads: 16 splits (128 programs, one per SM) against 32 (256, two on most SMs) took
       33.9 against 35.2 µs at 16k keys, 56.7 against 59.6 at 32k, 101.8 against 104.0 at 64k; 22 splits (176
       programs: one SM in three runs two, and the step waits for those) was slower than either; batch 8:
       2 splits against 4, 0.7-2.6 % faster; batch 32 (256 programs without splitting): 1 split against 2 and 4
       at 4k, 16k, 64k keys, 190 / 725 / 2865 µs against 207-202 / 782-751 / 3043-2942
       (``decode_split_sweep_b32.json``). Two programs on an SM do not stream twice as fast as one: the SMs with
       a single program finished their split first (globaltimer stamps of every warp, 16k keys, 32 splits:
       ``decode_tc_trace_16k_S32.npy``), so
       the step ends with the doubled SMs' tail, and more programs only add partials to write and merge.
       (The first version of this rule filled 2/3 of the resident slots, 3 per SM: 32 splits at batch 1.)
    2. Splits are whole blocks (:func:`fa2edu.inference.split_ranges`), so the longest split has ceil(T / S)
       blocks: S is then lowered to the fewest splits with that same longest split (64 pages in 17 splits are as
       slow as 16 splits of 4 pages, and write more partials).

    Examples for 8 KV heads, 256-key pages, 132 SMs: batch 1 at 4k to 128k keys → 16 splits; batch 8 → 2;
    batch 32 → 1."""
    if n_max <= 0 or programs < 1:
        return 1
    T = -(-n_max // block)
    S = max(1, min(T, sms // programs))
    return -(-T // -(-T // S))


@functools.lru_cache(maxsize=4096)
def rounds_num_splits(programs: int, n_max: int, block: int, slots: int) -> int:
    """The CUDA-core program's split rule: the split count whose programs finish soonest on the resident slots.

    Arguments as :func:`default_num_splits`. With S splits a program streams at most ceil(T / S) blocks and the
    programs run in ceil(programs · S / slots) rounds, so the modelled time is

        rounds(S) · (ceil(T / S) + :data:`SPLIT_OVERHEAD`),

    the overhead being a program's fixed cost in key blocks; the rule takes the S = 1 … T of least modelled time,
    the smallest on ties. It leans towards more programs, which suits this program: it cannot stream the cache
    with two programs per SM (it issues ~69 warp-instructions per key at G = 4, d = 128), and on the H100 it ran
    1.05-1.18× faster at batch 32 with 3 splits (the model's choice) than with 1 (``decode.json``: 0.76-0.78 of the
    copy rate with 1 split, 0.88-0.91 with 3 in the run before). Examples (8 KV heads, 256-key pages, 396 slots):
    batch 1 at 16k keys → 32, at 32k → 43, at 128k → 47; batch 8 at 16k → 6; batch 32 → 3."""
    if n_max <= 0 or programs < 1:
        return 1
    T = -(-n_max // block)
    best, best_cost = 1, math.inf
    for S in range(1, T + 1):
        cost = -(-programs * S // slots) * (-(-T // S) + SPLIT_OVERHEAD)
        if cost < best_cost - 1e-9:
            best, best_cost = S, cost
    return best


# -- arguments ------------------------------------------------------------------------------------------------------

def _positive(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be at least 1, got {x}")
    return int(x)


def _check_shapes(q, k, v, seq, table, block_size):
    """The shape rules of :func:`fa2edu.inference.check_decode_inputs`, on shapes alone (device arrays too)."""
    for t, text in ((q, "(B, H_q, N_new, d)"), (k, "(B, H_kv, N_max, d) or (num_pages, H_kv, page_size, d)"),
                    (v, "(B, H_kv, N_max, d_v) or (num_pages, H_kv, page_size, d_v)")):
        if len(t.shape) != 4:
            raise ValueError(f"{t.name} must have shape {text}, got shape {t.shape}")
        if 0 in t.shape:
            raise ValueError(f"{t.name} must not be empty, got shape {t.shape}")
    B, H_q, _, d = q.shape
    if k.shape[3] != d:
        raise ValueError(f"k_cache's head dimension must equal q's: q has d = {d}, k_cache has {k.shape[3]}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v_cache must match k_cache in every axis but the last: k_cache {k.shape}, "
                         f"v_cache {v.shape}")
    H_kv = k.shape[1]
    if H_q % H_kv:
        raise ValueError(f"the number of query heads H_q = {H_q} must be a multiple of the number of key/value "
                         f"heads H_kv = {H_kv} (GQA/MQA)")
    if seq.shape != (B,):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), one length per sequence of q; got "
                         f"{seq.shape}")
    if table is None:
        if k.shape[0] != B:
            raise ValueError(f"a contiguous k_cache must have q's batch size B = {B} in axis 0, got {k.shape[0]} "
                             f"(for a paged cache, pass block_table)")
    else:
        if block_size is not None:
            raise ValueError("block_size applies to a contiguous cache; a paged cache's key block is its page")
        if len(table.shape) != 2 or table.shape[0] != B:
            raise ValueError(f"block_table must have shape (B, max_pages) with B = {B}, got {table.shape}")


def _host_index_values(ix: io.Index, validate: bool) -> np.ndarray | None:
    """The host values of an index operand to check (device ones only when ``validate``: a synchronising copy)."""
    if ix.host is not None:
        return ix.host
    if not validate:
        return None
    if ix.flat.keep is not None and type(ix.flat.keep).__module__.startswith("torch"):
        return ix.flat.keep.cpu().numpy()
    return np.asarray(cuda.as_cuda_array(ix.flat.keep).copy_to_host())


class _Call(NamedTuple):
    """Everything one decoding call launches with (built by :func:`_prepare`)."""

    kind: str
    storage: str
    out: io.Outputs
    stream: int
    Qw: io.Flat
    Kw: io.Flat
    Vw: io.Flat
    table: io.Flat
    seqlens: io.Flat
    B: int
    H_q: int
    H_kv: int
    N_new: int
    d: int
    d_v: int
    d_v_user: int
    R: int
    tiling: DecodeTiling
    row_tiles: int
    page: int
    block: int
    max_pages: int
    num_pages: int
    capacity: int
    n_max: int
    k_strides: tuple
    v_strides: tuple
    scale2: float
    causal: bool
    num_splits: int | None
    program: str = "cuda_core"      # the split program: "tensorcore" (decode_tc) or "cuda_core" (split_kernel)
    copy: str = "cp.async"          # how the tensor-core program copies whole tiles (decode_tc.COPY, where it applies)
    tile: int = 16                  # the tensor-core program's keys per warp tile (decode_tc.tile_for)


#: the split programs a caller may name (``kernel=``); None picks the tensor-core one wherever it applies
PROGRAMS = ("tensorcore", "cuda_core")


def _words_view(t: io.Tensor, name: str) -> tuple[io.Flat, tuple, int]:
    """A device operand as a flat word array (float32, or uint32 pairs of 16-bit values) with its strides in
    words, and the widest load (words) its alignment allows."""
    epw = 1 if t.storage == "float32" else 2
    if epw == 2 and (t.strides[-1] != 1 or any(s % 2 for s in t.strides[:-1]) or t.shape[-1] % 2 or t.ptr % 4):
        raise ValueError(f"{name} (16-bit) must have an even head dimension, a contiguous last axis, even strides "
                         f"and 4-byte aligned data, got shape {t.shape}, strides {t.strides}")
    if t.strides[-1] != 1:
        raise ValueError(f"{name} must have a contiguous last axis (stride 1), got strides {t.strides}")
    flat = io.device_flat(t, np.float32 if epw == 1 else np.uint32)
    strides = tuple(s // epw for s in t.strides)
    vec = 4
    while vec > 1 and (t.ptr % (4 * vec) or any(s % vec for s in strides[:-1])):
        vec //= 2
    return flat, strides, vec


def _host_words(x: np.ndarray, storage: str, pad_to: int) -> tuple[io.Flat, tuple]:
    """A host operand (bits from :func:`io.host_bits`) padded with zeros to ``pad_to`` columns, on the device as
    words; strides in words."""
    if x.shape[-1] < pad_to:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad_to - x.shape[-1],), x.dtype)], axis=-1)
    view = np.float32 if storage == "float32" else np.uint32
    words = np.ascontiguousarray(x).view(view)
    flat = io._numba_flat(cuda.to_device(words))
    strides = tuple(s // 4 for s in words.strides)
    return flat, strides


def _check_host_values(tq: io.Tensor, tk: io.Tensor, tv: io.Tensor, seq: io.Index, table, seq_vals, table_vals,
                       tau: float, capacity: int, num_pages: int) -> None:
    """Host (NumPy or CPU tensor) q and caches, before they are copied to the device: the checks of
    :func:`fa2edu.inference.check_decode_values` — q and the cache entries the sequences read finite, scores within
    float32 (the kernels' arithmetic), NumPy float64 values within float32 (their storage) — with the same errors
    as ``fa2edu.decode_attention``. The entries checked are those the kernel reads: lengths clamped to the cache
    and page ids to [0, num_pages), as the kernel clamps unchecked device index data (checked data is unchanged by
    the clamp; device index data is copied back for this, which costs nothing beside the caches' own copy)."""
    seq_h = seq_vals if seq_vals is not None else _host_index_values(seq, True)
    seq_h = np.clip(np.asarray(seq_h, dtype=np.int64), 0, capacity)
    table_h = None
    if table is not None:
        table_h = table_vals if table_vals is not None else _host_index_values(table, True)
        table_h = np.clip(np.asarray(table_h, dtype=np.int64), 0, num_pages - 1)
    stored_as = np.float32 if tq.storage == "float32" and tq.host.dtype == np.float64 else None
    check_decode_values(io.host_values(tq), io.host_values(tk), io.host_values(tv), seq_h, table_h, tau, np.float32,
                        float64_helps=False, storage=stored_as)


def _prepare(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits, block_size, validate,
             kernel=None):
    rt.require_device()
    if kernel is not None and kernel not in PROGRAMS:
        raise ValueError(f"kernel must be None, 'tensorcore' or 'cuda_core', got {kernel!r}")
    tq, tk, tv = io.tensor(q, "q"), io.tensor(k_cache, "k_cache"), io.tensor(v_cache, "v_cache")
    kind = io.check_kinds(tq, tk, tv)
    storage = tq.storage
    seq = io.index(cache_seqlens, "cache_seqlens", 1)
    table = None if block_table is None else io.index(block_table, "block_table", 2)
    _check_shapes(tq, tk, tv, seq, table, block_size)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if validate is not None and not isinstance(validate, (bool, np.bool_)):
        raise TypeError(f"validate must be None, True or False, got {validate!r}")
    B, H_q, N_new, d = tq.shape
    H_kv, d_v = tk.shape[1], tv.shape[3]
    tau = check_scale(scale, d)
    if num_splits is not None:
        num_splits = _positive(num_splits, "num_splits")
    paged = table is not None
    if paged:
        page = tk.shape[2]
        block = page
        max_pages, num_pages = table.shape[1], tk.shape[0]
        capacity = max_pages * page
    else:
        page = 0
        block = decode_block_size(d) if block_size is None else _positive(block_size, "block_size")
        max_pages, num_pages, capacity = 1, 1, tk.shape[2]
    # Index values: host ones are checked by fa2edu's rules (the same errors as fa2edu.decode_attention), with
    # stand-ins for q, k, v (their shapes are checked above; their values need not be read for this).
    seq_vals = _host_index_values(seq, bool(validate))
    table_vals = None if table is None else _host_index_values(table, bool(validate))
    if seq_vals is not None:
        stand = [np.broadcast_to(np.float32(0.0), t.shape) for t in (tq, tk, tv)]
        # a device block table left unchecked: zeros stand in (page 0 exists), so only the lengths are checked
        tv_ = None if table is None else (table_vals if table_vals is not None else np.zeros(table.shape, np.int64))
        checked = check_decode_inputs(stand[0], stand[1], stand[2], seq_vals, tv_, bool(causal), tau,
                                      1 if num_splits is None else num_splits, None if paged else block)
        n_max = int(checked.cache_seqlens.max(initial=0))
    else:
        # Device lengths, unchecked: the split rule plans for the longest length the cache can hold.
        n_max = capacity
    seq_flat = seq.flat if seq.host is None else io.upload_index(seq.host, "cache_seqlens")
    if table is None:
        table_flat = seq_flat                       # (never read by a contiguous cache's kernel)
    elif table.host is None:
        table_flat = table.flat
    else:
        used = np.array(table.host, dtype=np.int64)
        if seq_vals is not None:                    # entries past a length are never read: any value may be there
            for b in range(B):
                used[b, -(-int(seq_vals[b]) // page):] = 0
        table_flat = io.upload_index(np.clip(used, -2**31, 2**31 - 1), "block_table")
    out = io.Outputs(kind, getattr(q, "device", None))
    if tq.on_device:
        (Qw, _, vec_q), (Kw, k_strides, vec_k), (Vw, v_strides, vec_v) = (
            _words_view(t, name) for t, name in ((tq, "q"), (tk, "k_cache"), (tv, "v_cache")))
        if tq.strides != (H_q * N_new * d, N_new * d, d, 1):
            raise ValueError(f"q must be C-contiguous on the device (it is small: .contiguous() is cheap), got "
                             f"strides {tq.strides}")
        vec = min(vec_k, vec_v)
        d_pad, dv_pad = d, d_v
        tc_vec = min(vec, vec_q)                    # (the tensor-core program copies q's rows 16 bytes at a time)
    else:
        _check_host_values(tq, tk, tv, seq, table, seq_vals, table_vals, tau, capacity, num_pages)
        epw = 1 if storage == "float32" else 2
        d_pad, dv_pad = -(-d // epw) * epw, -(-d_v // epw) * epw     # 16-bit: even head sizes (zero columns)
        hq = io.host_bits(tq.host, storage)
        Qw, _ = _host_words(hq, storage, d_pad)
        Kw, k_strides = _host_words(io.host_bits(tk.host, storage), storage, d_pad)
        Vw, v_strides = _host_words(io.host_bits(tv.host, storage), storage, dv_pad)
        vec = tc_vec = 4
    R = (H_q // H_kv) * N_new
    tiling = decode_tiling(storage, d_pad, dv_pad, R, vec)
    row_tiles = -(-R // tiling.rows)
    # The split program: tensor cores wherever they apply (16-bit storage, head sizes multiples of 8, 16-byte rows,
    # pages of whole tiles), unless the caller names one.
    tc_ok = decode_tc.supports(storage, d_pad, dv_pad, page, tc_vec)
    if kernel == "tensorcore" and not tc_ok:
        raise ValueError(f"kernel='tensorcore' needs float16 or bfloat16 storage, d and d_v multiples of 8 up to "
                         f"256, 16-byte aligned rows of q and the caches and a page size that is a multiple of "
                         f"16; got {storage}, d = {d}, d_v = {d_v}, page size {page or 'none'}, rows "
                         f"aligned to {4 * tc_vec} bytes")
    program = "tensorcore" if tc_ok and kernel != "cuda_core" else "cuda_core"
    copy = "cp.async"
    tile = 16
    if program == "tensorcore":
        row_tiles = -(-R // 16)                     # one 16-row MMA tile per program
        copy = decode_tc.COPY
        tile = decode_tc.tile_for(page)
        # tensor copies: their maps are kept in PyTorch memory (the simulator's stand-ins aside), for caches whose
        # strides the copy engine can walk
        if copy == "tensor" and not ((kind == "torch-cuda" or rt.simulator_in_use())
                                     and _tensor_maps_apply(d_pad, dv_pad, k_strides, v_strides)):
            copy = "cp.async"
    return _Call(kind, storage, out, io.stream_of(kind, getattr(q, "device", None)), Qw, Kw, Vw, table_flat,
                 seq_flat, B, H_q, H_kv, N_new, d_pad, dv_pad, d_v, R, tiling, row_tiles, page, block, max_pages,
                 num_pages, capacity, n_max, k_strides[:3], v_strides[:3], float(tau) * LOG2E, bool(causal),
                 num_splits, program, copy, tile)


def _tensor_maps_apply(d: int, d_v: int, k_strides: tuple, v_strides: tuple) -> bool:
    """Whether tensor copies can take the caches: :func:`decode_tc.tensor_copy_applies`, rows contiguous, and the
    (sequence or page, head, row) strides positive multiples of 16 bytes, in any order (the copy engine walks a
    (B, N, H, d) cache seen as (B, H, N, d) as readily as a (B, H, N, d) one)."""
    if not decode_tc.tensor_copy_applies(d, d_v, rt.simulator_in_use()):
        return False
    return all(x % 4 == 0 and x > 0 for st in (k_strides, v_strides) for x in st[:3])   # (words: 4 = 16 bytes)


def _tensor_maps(c: _Call) -> list:
    """The tensor maps of K and V (kernels_gpu.tensor_map.encode_4d): dims (column, row, head, sequence or page),
    boxes of ``c.tile`` rows × 64 columns."""
    from kernels_gpu import tensor_map
    rows = c.page if c.page else c.capacity
    outer = c.num_pages if c.page else c.B
    maps = []
    for X, st, width in ((c.Kw, c.k_strides, c.d), (c.Vw, c.v_strides, c.d_v)):
        so, sh, sn = st[:3]
        geometry = ((width, rows, c.H_kv, outer), (4 * sn, 4 * sh, 4 * so), (64, c.tile, 1, 1))
        if rt.simulator_in_use():
            maps.append(tensor_map.simulated_map(X.numba_array(), *geometry))
        else:
            maps.append(tensor_map.encode_4d(X.ptr, 2, *geometry))
    return maps


def _slots(kernel, args, threads: int, shared: int = 0) -> int:
    """Resident blocks of the split kernel: the occupancy calculator's answer on a GPU, 2 × 132 in the simulator."""
    if rt.simulator_in_use():
        return 2 * DECODE_SMS
    return io.resident_blocks(kernel, args, threads, shared)


def _split_program(c: _Call, simulator: bool, cluster: int = 0) -> tuple:
    """(kernel, threads, dynamic shared bytes) of the call's split program; ``cluster``: the tensor-core program
    that merges its cluster's partials itself (:func:`_cluster_merge`)."""
    if c.program == "tensorcore":
        warps = (SIMULATOR_WARPS if simulator else TC_WARPS if TC_WARPS is not None
                 else tc_warps(c.B * c.H_kv * c.row_tiles, _sms()))
        stages = decode_tc.STAGES
        shared = decode_tc.shared_bytes(c.d, c.d_v, warps, stages, c.copy, c.tile, cluster)
        if cluster:
            # one program per SM, as the split rule plans: more than half an SM's shared memory per program
            shared = max(shared, CLUSTER_SHARED_BYTES)
        return (decode_tc.split_kernel_tc(c.storage, c.d, c.d_v, warps, c.page, c.causal, simulator, stages,
                                          c.copy, decode_tc.CHAINS, c.tile, cluster),
                32 * warps, shared)
    return split_kernel(c.storage, c.d, c.d_v, c.tiling, c.page, c.causal, simulator), c.tiling.threads, 0


#: merge the splits inside the split launch where the GPU can (:func:`_cluster_merge`); False: always the merge
#: launch (:func:`merge_kernel`)
CLUSTER_MERGE = True
#: the dynamic shared memory a clustered split program asks for at least: more than half of an sm_90 SM's 228 KB,
#: so that no SM holds two programs (the split rule's one program per SM)
CLUSTER_SHARED_BYTES = 116 * 1024


def _cluster_merge(c: _Call, S: int, simulator: bool, args: tuple) -> int:
    """S when the call's S split programs of each (sequence, KV head) can run as one thread-block cluster and
    merge their partials through distributed shared memory — no partials in HBM, no merge launch —, else 0.

    Where: the tensor-core program with one row tile, 2 ≤ S ≤ 16 (16 is Hopper's largest cluster), the
    driver-level launch on a GPU of compute capability 9 or more (not numba's simulator, which runs one block at a
    time), :data:`CLUSTER_MERGE`, and the GPU able to hold every cluster of the grid at once
    (``cuOccupancyMaxActiveClusters`` ≥ B·H_kv: the clusters must not wait for each other, one program per SM)."""
    if (not CLUSTER_MERGE or simulator or c.program != "tensorcore" or c.row_tiles != 1 or not 2 <= S <= 16
            or not driver_launch.enabled()):
        return 0
    key = (c.storage, c.d, c.d_v, c.page, c.causal, c.copy, c.tile, S, c.B * c.H_kv, TC_WARPS, decode_tc.STAGES,
           decode_tc.CHAINS, CLUSTER_SHARED_BYTES)
    hit = _CLUSTER_FITS.get(key)
    if hit is None:
        kernel, threads, shared = _split_program(c, simulator, S)
        grid = (S, c.H_kv, c.B)
        hit = _CLUSTER_FITS[key] = driver_launch.max_active_clusters(kernel, args, grid, threads, shared,
                                                                     S) >= c.B * c.H_kv
    return S if hit else 0


#: whether a clustered launch fits (see _cluster_merge), per call geometry
_CLUSTER_FITS: dict = {}


def tc_warps(programs: int, sms: int) -> int:
    """Warps per tensor-core split program (:data:`TC_WARPS` = None): 4, or 2 where the programs outnumber the SMs
    (then the split rule gives one split, and the SMs hold two programs or more).

    Measured on an H100 with tensor copies (graph replay, cuDNN in the same rounds; ``decode_tc_tensor_knobs.json``,
    ``decode_tc_tensor_warps2_b16_b32.json``): batch 32 (256 programs), 2 warps against 4 at 4k / 16k / 64k keys
    180.3-181.3 / 694.3-701.6 / 2737.0 µs against 181.5-181.6 / 700.0-704.4 / 2768.6 (0.2-1.1 % faster); where
    programs ≤ SMs 2 warps lose 17-21 % (batch 1 and 8: the split rule already gives one program per SM, so fewer
    warps are fewer loads in flight per SM; batch 16, 128 programs: 419.1 against 352.4 µs at 16k)."""
    return 2 if programs > sms else 4


def _sms() -> int:
    """Streaming multiprocessors of the current GPU (an H100's 132 in the simulator)."""
    if rt.simulator_in_use():
        return DECODE_SMS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _split_count(c: _Call, kernel, probe, threads: int, shared: int) -> int:
    """The split count of the call's program when the caller gives none: :func:`default_num_splits` (from the SM
    count) for the tensor-core program, :func:`rounds_num_splits` (from the resident slots) for the CUDA-core one.
    ``probe``: launch arguments of the right types (the occupancy is asked of the kernel compiled for them)."""
    programs = c.B * c.H_kv * c.row_tiles
    if c.program == "tensorcore":
        return default_num_splits(programs, c.n_max, c.block, _sms())
    return rounds_num_splits(programs, c.n_max, c.block, _slots(kernel, probe, threads, shared))


def _split_args(c: _Call, S: int, Ow, L, Opart, Lpart):
    """The split program's arguments; the tensor-core one also takes its tensor maps of K and V (unread stand-ins
    without tensor copies)."""
    i64 = np.int64
    args = (c.Qw, c.Kw, c.Vw, c.table, c.seqlens, Ow, L, Opart, Lpart, i64(c.H_q), i64(c.H_kv), i64(c.N_new),
            i64(c.R), i64(S), i64(c.row_tiles), i64(c.block), i64(c.max_pages), i64(c.num_pages), i64(c.capacity),
            *(i64(s) for s in c.k_strides), *(i64(s) for s in c.v_strides), np.float32(c.scale2))
    if c.program == "tensorcore":
        args += _map_arrays(c)
    return args


#: the tensor maps the tensor-core program's tensor copies have used, per cache address and geometry
_MAPS = None
#: a stand-in for the maps' parameters of a program without tensor copies, per device (never read)
_NO_MAPS: dict = {}


def _map_geometry(c: _Call) -> tuple:
    """What the tensor maps of a call depend on besides the caches' addresses and the L2 promotion."""
    return (c.d, c.d_v, c.page, c.capacity, c.num_pages, c.B, c.H_kv, c.k_strides, c.v_strides, c.out.device,
            c.tile)


def _map_key(c: _Call, k_ptr: int, v_ptr: int) -> tuple:
    from kernels_gpu import tensor_map
    return (k_ptr, v_ptr, _map_geometry(c), tensor_map.L2_PROMOTION)


def _device_maps():
    """The tensor maps kept for the caches that calls have used (kernels_gpu.tensor_map.DeviceMaps)."""
    global _MAPS
    if _MAPS is None:
        from kernels_gpu.tensor_map import DeviceMaps
        _MAPS = DeviceMaps()
    return _MAPS


def _map_arrays(c: _Call) -> tuple:
    """(K's map, V's map) as flat uint64 arrays of 16 words, the split program's last two parameters."""
    if c.copy != "tensor":
        dev = None if rt.simulator_in_use() else cuda.get_current_device().id
        if dev not in _NO_MAPS:
            _NO_MAPS[dev] = io._numba_flat(cuda.to_device(np.zeros(16, np.uint64)))
        return _NO_MAPS[dev], _NO_MAPS[dev]
    if rt.simulator_in_use():                   # (stand-in maps, made for each call)
        return tuple(io._numba_flat(cuda.to_device(m)) for m in _tensor_maps(c))
    k, v = _device_maps().get(_map_key(c, c.Kw.ptr, c.Vw.ptr), lambda: _tensor_maps(c), c.out.device)
    return (io.Flat(k.data_ptr(), 16, np.dtype(np.uint64), None, k),
            io.Flat(v.data_ptr(), 16, np.dtype(np.uint64), None, v))


def _run(c: _Call, partials_out: bool = False, plan_key=None):
    """Launch the split program (and the merge when S > 1); returns (O, L[, O_part, L_part, S]). With a
    ``plan_key`` the launches are kept as a :class:`DecodePlan` for the next call with that key."""
    simulator = rt.simulator_in_use()
    kernel, threads, shared = _split_program(c, simulator)
    view = np.float32 if c.storage == "float32" else np.uint32
    O_user, Ow = c.out.empty((c.B, c.H_q, c.N_new, c.d_v), c.storage, view)
    L_user, Lf = c.out.empty((c.B, c.H_q, c.N_new), "float32")
    S = c.num_splits
    if S is None:
        S = _split_count(c, kernel, _split_args(c, 1, Ow, Lf, Lf, Lf), threads, shared)
    if partials_out and S < 2:
        raise ValueError("partials exist only with num_splits >= 2")
    if S > 1:
        # Flash-Decoding: S partials (O_s, L_s) per output row, float32
        n_rows = c.B * c.H_kv * S * c.R
        if partials_out:
            P_user, Opart = c.out.empty((n_rows * c.d_v,), "float32")
            PL_user, Lpart = c.out.empty((n_rows,), "float32")
        else:
            Opart, Lpart = c.out.scratch(n_rows * c.d_v), c.out.scratch(n_rows)
    else:
        Opart = Lpart = Lf                          # (not written: the single split writes O and L)
    args = _split_args(c, S, Ow, Lf, Opart, Lpart)
    grid = (S * c.row_tiles, c.H_kv, c.B)
    cluster = 0 if partials_out else _cluster_merge(c, S, simulator, args)
    if cluster:
        # the S programs of a (sequence, KV head) as one cluster, merging in the launch: no partials, no merge
        kernel, threads, shared = _split_program(c, simulator, cluster)
    launches = [(kernel, grid, threads, args, shared, False, cluster)]
    if S > 1 and not cluster:
        # The merge as a programmatic dependent launch: its blocks may be scheduled while the split programs'
        # last blocks still run, and wait (griddepcontrol.wait) before reading the partials.
        rows = c.B * c.H_kv * c.R
        launches.append((merge_kernel(c.storage, c.d_v, simulator), (rows,), 32 * MERGE_WARPS,
                         (Opart, Lpart, Ow, Lf, np.int64(rows), np.int64(c.R), np.int64(S)), 0, True, 0))
    for kernel_, grid_, threads_, args_, shared_, early, cluster_ in launches:
        io.launch(kernel_, grid_, threads_, c.stream, args_, shared_, early, cluster_)
    if plan_key is not None:
        _PLANS[plan_key] = DecodePlan(c, S, launches)
    O = c.out.finish(O_user, c.storage)
    if c.d_v != c.d_v_user:
        O = O[..., :c.d_v_user]
    L = c.out.finish(L_user, "float32")
    if partials_out:
        return O, L, c.out.finish(P_user, "float32"), c.out.finish(PL_user, "float32"), S
    return O, L


# -- the short road for PyTorch CUDA tensors -------------------------------------------------------------------------

#: plans per call signature, the 64 most recently used: what a repeated call on PyTorch CUDA tensors needs beyond
#: allocating its outputs
_PLANS = driver_launch.PlanCache()


def _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits, block_size, validate,
              kernel):
    """The cache key of a call whose operands are all PyTorch CUDA tensors (index data included, so nothing is
    checked on the host) with the driver-level launch; None otherwise (no plan). It holds everything the checks,
    the program's choice, the split count and the launches depend on: shapes, strides, dtypes, device, 16-byte
    alignment (it picks the load width and the program) and the type and value of every option — so a call that
    finds a plan would have passed the checks of the call that made it, and launched the same kernels."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None or validate or not driver_launch.enabled():
        return None
    operands = (q, k_cache, v_cache, cache_seqlens) + (() if block_table is None else (block_table,))
    if not all(type(x) is torch.Tensor and x.is_cuda for x in operands):
        return None
    return (tuple((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16) for x in operands),
            block_table is None, type(causal), causal, type(scale), scale, type(num_splits), num_splits,
            type(block_size), block_size, kernel)


class DecodePlan:
    """A decoding call on PyTorch CUDA tensors of fixed shapes, strides, dtypes and options, made from a first
    call's checked :class:`_Call` and its launches (:class:`~kernels_gpu.driver_launch.Prepared`: compiled,
    configured, parameters packed). A call allocates the partials (with S > 1 splits merged by the merge launch),
    launches the split programs, allocates O and L (poisoned when asked) and launches the merge — or, with one
    split or the splits merged inside their cluster, allocates O and L and makes the one launch —, on PyTorch's
    current stream with the new addresses: no checks, no typing, no split rule (host time: the module's header,
    ``benchmarks.profilers.decode_host``)."""

    def __init__(self, c: _Call, S: int, launches: list):
        import torch
        self.launches = [driver_launch.Prepared(kernel, grid, threads, args, shared, early, cluster)
                         for kernel, grid, threads, args, shared, early, cluster in launches]
        self.dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[c.storage]
        self.o_shape, self.l_shape = (c.B, c.H_q, c.N_new, c.d_v), (c.B, c.H_q, c.N_new)
        # partial rows (O_s, L_s) in HBM: with S > 1 splits, unless the splits merge in their cluster
        self.partials = c.B * c.H_kv * S * c.R if len(launches) > 1 else 0
        self.d_v, self.paged = c.d_v, c.page > 0
        self.device = c.out.device
        # tensor copies: the maps hold the caches' addresses (kept per address by _MAPS); else the stand-ins
        self.no_maps = (() if c.program != "tensorcore" else
                        None if c.copy == "tensor" else tuple(x.ptr for x in _map_arrays(c)))
        # the call's geometry, for the maps of the caches a later call brings — without the first call's tensors
        # (a plan must not keep a cache alive)
        self.call = c._replace(Qw=None, Kw=io.Flat(0, c.Kw.n, c.Kw.dtype), Vw=io.Flat(0, c.Vw.n, c.Vw.dtype),
                               table=None, seqlens=None)
        self.geometry = _map_geometry(self.call)

    def _maps(self, k_ptr: int, v_ptr: int) -> tuple:
        """The addresses of the tensor maps of the caches at ``k_ptr``, ``v_ptr`` (made the first time)."""
        from kernels_gpu import tensor_map

        def encode():
            return _tensor_maps(self.call._replace(Kw=io.Flat(k_ptr, self.call.Kw.n, self.call.Kw.dtype),
                                                   Vw=io.Flat(v_ptr, self.call.Vw.n, self.call.Vw.dtype)))
        return _device_maps().pointers((k_ptr, v_ptr, self.geometry, tensor_map.L2_PROMOTION), encode,
                                       self.device)

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table) -> DecodeResult:
        import torch
        stream = driver_launch.current_stream(self.device.index)
        table = block_table if self.paged else cache_seqlens   # (a contiguous cache's kernel never reads it)
        k, v = k_cache.data_ptr(), v_cache.data_ptr()
        maps = self.no_maps
        if maps is None:
            maps = self._maps(k, v)
        split = (stream, q.data_ptr(), k, v, table.data_ptr(), cache_seqlens.data_ptr())
        if self.partials:
            # With splits the split programs write only the partials O_s then L_s (one allocation, freed once the
            # merge is queued): they are launched before O and L exist, so the GPU starts on the cache sooner.
            P = torch.empty(self.partials * (self.d_v + 1), dtype=torch.float32, device=self.device)
            op = P.data_ptr()
            lp = op + 4 * self.partials * self.d_v
            self.launches[0](*split, op, op, op, lp, *maps)     # (O and L: never written with splits)
            O, L = self._outputs()
            self.launches[1](stream, op, lp, O.data_ptr(), L.data_ptr())
        else:
            O, L = self._outputs()
            o, l = O.data_ptr(), L.data_ptr()
            self.launches[0](*split, o, l, l, l, *maps)         # (one split: no partials to write)
        return DecodeResult(O, L)

    def _outputs(self):
        import torch
        O = torch.empty(self.o_shape, dtype=self.dtype, device=self.device)
        L = torch.empty(self.l_shape, dtype=torch.float32, device=self.device)
        if rt.poison_outputs:                         # (as decode_io.Outputs.empty poisons them)
            if self.dtype == torch.float32:
                O.fill_(math.nan)
            else:
                O.view(torch.int16).fill_(-1)
            L.fill_(math.nan)
        return O, L


# -- the public functions ----------------------------------------------------------------------------------------

def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True, scale=None,
                     num_splits=None, *, block_size=None, validate=None, kernel=None) -> DecodeResult:
    """Attention of N_new new tokens per sequence to a KV cache on the GPU: split-KV (Flash-Decoding), contiguous
    or paged (PagedAttention), GQA — :func:`fa2edu.decode_attention`'s semantics (see the module header for the
    kernels).

    Parameters
    ----------
    q : array, shape (B, H_q, N_new, d)
        Queries of the new tokens (their keys and values are already the last N_new entries of each sequence's
        cache). float32, float16 or bfloat16 (PyTorch); NumPy float64 is stored as float32. On the device: C-contiguous.
    k_cache : array, shape (B, H_kv, N_max, d) or (num_pages, H_kv, page_size, d)
        Cached keys, contiguous per sequence or paged (with ``block_table``); q's kind and dtype. Device arrays are
        read in place and may be strided (last axis contiguous; 16-byte loads when strides and alignment allow).
    v_cache : array, shape (B, H_kv, N_max, d_v) or (num_pages, H_kv, page_size, d_v)
        Cached values, laid out as ``k_cache``.
    cache_seqlens : array of int, shape (B,)
        Keys per sequence, new tokens included (0 … the capacity). Host data (NumPy, list, CPU tensor) is checked
        with fa2edu's rules; device data (int32/int64) is used as is (see ``validate``).
    block_table : array of int, shape (B, max_pages), optional
        Paged cache: sequence b's logical page p is physical page ``block_table[b, p]``; entries past a
        sequence's length are never read. Default None: a contiguous cache.
    causal : bool, default True
        Bottom-right causal within each sequence: new token t sees keys j ≤ cache_seqlens[b] − N_new + t (with
        N_new = 1 every key is visible either way).
    scale : float, optional
        The softmax scale τ; default 1/√d.
    num_splits : int, optional
        Splits per sequence (Flash-Decoding); each is a range of whole key blocks (pages, or ``block_size`` keys),
        cut by :func:`fa2edu.inference.split_ranges`. Default: :func:`default_num_splits`.
    block_size : int, optional
        Keys per block of a contiguous cache (the unit of the split cut); default
        :func:`fa2edu.inference.decode_block_size` (as fa2edu). Not allowed with a paged cache.
    validate : bool, optional
        Check device ``cache_seqlens``/``block_table`` values on the host (a synchronising copy). Default None:
        host index data is always checked; device index data is not (the kernel clamps lengths to the cache and
        page ids to [0, num_pages), so a bad value gives a wrong result, never a read outside the cache), and the
        split rule then plans for the cache's capacity as the longest length.
    kernel : {None, "tensorcore", "cuda_core"}, optional
        The split program. Default None: the tensor-core program (:mod:`kernels_gpu.inference.decode_tc`) for float16
        and bfloat16 caches with head sizes multiples of 8 (≤ 256), 16-byte aligned rows and pages of a multiple of
        16 keys; the CUDA-core program (this module's :func:`split_kernel`) otherwise. Naming "tensorcore" where
        it does not apply is an error.

    Returns
    -------
    DecodeResult
        ``(O, L)``: O (B, H_q, N_new, d_v) in the storage dtype, L (B, H_q, N_new) float32 (+inf where a token
        sees no key), in the caller's kind: CUDA tensors, numba device arrays, NumPy arrays or CPU tensors.

    Raises
    ------
    ValueError
        Bad shapes, H_q not a multiple of H_kv, lengths out of range, a block table naming a page the cache does
        not have or too short for a length, num_splits or block_size < 1; on host data, NaN or inf in q or in the
        cache entries the sequences read, and NumPy float64 values beyond float32 (their storage).
    fa2edu.validation.AttentionOverflowError
        On host data: finite q and k_cache whose scores τ·q·k would overflow float32, the kernels' arithmetic
        (named q and k_cache, with the sequence) — as ``fa2edu.decode_attention`` raises.
    TypeError
        Unsupported array kinds or dtypes, mixed kinds or dtypes, a non-bool ``causal``.

    Notes
    -----
    **What is checked where.** Host data (NumPy arrays, CPU tensors) is copied to the device by this call, so its
    values are checked first, exactly as ``fa2edu.decode_attention`` checks them
    (:func:`fa2edu.inference.check_decode_values`: q and the entries the sequences read finite, scores within
    float32), at the cost of one host pass beside the copy. Device data (CUDA tensors, numba device arrays) is
    read in place and its **values are not checked**: q, k_cache and v_cache may hold NaN, inf or scores beyond
    float32, and the kernels then return what the arithmetic gives — a NaN key can be dropped by the running
    maximum or turn O into NaN, and scores that overflow float32 can come back as O = 0, L = +inf, as if no key
    were seen. Checking would mean one more pass over the cache in HBM (the step's whole cost is reading the
    cache once: a second read would double it) and a host synchronisation to bring the verdict back, on every
    call. Device index data (``cache_seqlens``, ``block_table``) is checked only with ``validate=True``; unchecked,
    the kernels clamp it (above). Check device inputs yourself where they may be bad, e.g. with
    ``torch.isfinite(k_cache[...]).all()`` on the used entries, or call ``fa2edu.decode_attention`` on copies.

    Cost per (sequence, KV head): reads n_b·(d + d_v) cache elements once, whatever G and the split count;
    2·G·N_new·n_b·(d + d_v) FLOPs; with S > 1 splits, S·G·N_new·(d_v + 1) partial floats written and read back.

    References
    ----------
    T. Dao, D. Haziza, F. Massa, G. Sizov, "Flash-Decoding for long-context inference", 2023. W. Kwon et al.,
    "Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023.
    T. Dao, "FlashAttention-2", 2023, Algorithm 1.
    """
    key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits, block_size,
                    validate, kernel)
    if key is not None:
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(q, k_cache, v_cache, cache_seqlens, block_table)
    call = _prepare(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits, block_size,
                    validate, kernel)
    O, L = _run(call, plan_key=key)
    return DecodeResult(O, L)


def planned_splits(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True, num_splits=None, *,
                   block_size=None, kernel=None) -> int:
    """The split count :func:`decode_attention` would launch with for these arguments (the rule of
    :func:`default_num_splits` when ``num_splits`` is None), without launching anything."""
    call = _prepare(q, k_cache, v_cache, cache_seqlens, block_table, causal, None, num_splits, block_size, None,
                    kernel)
    if call.num_splits is not None:
        return call.num_splits
    program, threads, shared = _split_program(call, rt.simulator_in_use())
    _, Ow = call.out.empty((2,), call.storage, np.float32 if call.storage == "float32" else np.uint32)
    _, Lf = call.out.empty((1,), "float32")
    return _split_count(call, program, _split_args(call, 1, Ow, Lf, Lf, Lf), threads, shared)


def decode_split_partials(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True, scale=None,
                          num_splits=2, *, block_size=None, validate=None, kernel=None):
    """The split program alone (for inspection and tests): ``(O_s, L_s, S)`` with O_s (S, B, H_q, N_new, d_v) and
    L_s (S, B, H_q, N_new) float32 — split s's attention over its own key blocks (O_s = 0, L_s = +inf where it saw
    no key), before the merge. Arguments as :func:`decode_attention`; ``num_splits`` ≥ 2."""
    call = _prepare(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits, block_size,
                    validate, kernel)
    if call.num_splits is None or call.num_splits < 2:
        raise ValueError("decode_split_partials needs num_splits >= 2 (a single split writes no partials)")
    *_, P, PL, S = _run(call, partials_out=True)
    B, H_kv, d_v = call.B, call.H_kv, call.d_v
    G = call.H_q // H_kv

    def arrange(x, tail):
        # kernel order (b, h, s, r = g·N_new + t, …) → (s, b, h·G + g, t, …)
        x = x.reshape((B, H_kv, S, G, call.N_new) + tail)
        perm = (2, 0, 1, 3, 4) + tuple(range(5, 5 + len(tail)))
        x = x.permute(perm) if hasattr(x, "permute") else np.transpose(x, perm)
        return x.reshape((S, B, call.H_q, call.N_new) + tail)
    O_s = arrange(P, (d_v,))
    if d_v != call.d_v_user:
        O_s = O_s[..., :call.d_v_user]
    return O_s, arrange(PL, ()), S


def merge_split_partials(O_s, L_s):
    """Merge partials (O_s (S, …, d_v), L_s (S, …), float32 NumPy) with :func:`merge_kernel` (the decode merge
    launch, float32 storage), for tests and the book: returns (O (…, d_v), L (…)), NumPy."""
    rt.require_device()
    O_s, L_s = np.asarray(O_s, dtype=np.float32), np.asarray(L_s, dtype=np.float32)
    if O_s.ndim < 2 or L_s.shape != O_s.shape[:-1]:
        raise ValueError(f"O_s must be (S, ..., d_v) and L_s (S, ...): got {O_s.shape} and {L_s.shape}")
    S, d_v = O_s.shape[0], O_s.shape[-1]
    lead = O_s.shape[1:-1]
    rows = int(np.prod(lead))
    # kernel order: partial of (row x, split s) at x·S + s with R = 1 (each row its own group)
    Op = np.ascontiguousarray(np.moveaxis(O_s.reshape(S, rows, d_v), 0, 1)).reshape(-1)
    Lp = np.ascontiguousarray(np.moveaxis(L_s.reshape(S, rows), 0, 1)).reshape(-1)
    out = io.Outputs("numpy")
    O_user, Ow = out.empty((rows, d_v), "float32")
    L_user, Lf = out.empty((rows,), "float32")
    args = (io._numba_flat(cuda.to_device(Op)), io._numba_flat(cuda.to_device(Lp)), Ow, Lf, np.int64(rows),
            np.int64(1), np.int64(S))
    io.launch(merge_kernel("float32", d_v, rt.simulator_in_use()), (rows,), 32 * MERGE_WARPS,
              0, args)
    return O_user.copy_to_host().reshape(lead + (d_v,)), L_user.copy_to_host().reshape(lead)
