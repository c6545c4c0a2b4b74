"""The register-tiled FA2 forward kernel that every numbered fast version is built from.

FA2 Algorithm 1, one thread block per (row block i, batch z, query head h), as in the teaching kernel
(:mod:`kernels_gpu.flash2`), but the work of a block is spread over a 2-D grid of threads so that every thread does
many multiply-adds per value it reads from shared memory:

* **Threads.** ``NY × NX`` threads; thread (ty, tx) owns the ``TR`` query rows ``ty·TR + r`` of the row block, the
  ``TC`` key columns ``tx + NX·c`` of each S tile (interleaved: a quarter-warp's 16-byte reads of K then hit distinct
  banks), and the ``TD = d_v / NX`` output columns ``4·tx + 4·NX·q + e`` of Õ (again interleaved in 4-wide chunks).
  B_r = NY·TR, B_c = NX·TC. A row's NX threads are consecutive lanes of one warp (NX ≤ 32).
* **Registers.** S/P̃ (TR × TC), Õ (TR × TD), m, ℓ (TR each) are ``cuda.local.array`` of compile-time size indexed
  only inside fully unrolled constant-trip loops, so LLVM keeps them in registers (the resource report shows 0 bytes
  of local memory: ``resources()``).
* **Shared memory**, one flat float32 array: Q_i (B_r × (d+4), pre-scaled by τ·log₂e so that the softmax uses
  ``exp2``), K_j (B_c × (d+4)), V_j (B_c × d_v), P̃ (B_r × (B_c+4)). The +4 pads keep every row 16-byte aligned
  (so the inner loops read 4 floats per instruction) while shifting rows across banks.
* **Row statistics.** m is the same for the NX threads of a row: each thread takes the max over its TC columns, then
  the row's NX partial maxima are combined — through shared memory (v1) or with warp shuffles (v2+). ℓ needs no
  exchange inside the loop: each thread keeps the partial sum of its own columns, rescaled by the common
  e^{m_old − m_new}; the partial sums are added once, after the loop (Alg. 1 line 12).
* **Masking.** Ragged column tiles and the causal diagonal set S = −inf only in the tiles that need it; causal tiles
  entirely above the diagonal are never loaded (the loop stops before them). Fully masked rows keep m = −inf: the
  guard ``m_use = 0 if m = −inf`` makes every exponential exactly 0, so O = 0 and L = +inf.

* **Operand fragments** (v6, ``fragments=True``). Each inner loop reads its operands from shared memory in steps
  of 4 (4 columns of Q_i and K_j, a row of V_j, 4 columns of P̃); two register buffers alternate, so a step's loads
  are in flight while the previous step's FFMAs run. The last prefetch of each loop reads the rows' padding (or one
  row past V_j) and is never used.
* **Sharing out the work** (v7 ``split=True``, v8 ``stream=True``). Blocks take their (row block, batch, head)
  item from a 1-D grid (v7) or from a work counter, looping (v8), and may cover only a range of the item's K/V
  tiles, writing a partial O, L that a second launch merges (:mod:`kernels_gpu.fast.split`).

Shared memory above numba's 48 KiB of static shared memory is taken as *dynamic* shared memory, after raising the
kernel's limit (``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``, up to 227 KiB on Hopper).

**Storage** (``run_forward(..., storage=)``): ``"float32"`` (the default), or ``"float16"``: Q, K, V sit in HBM as
float16 and O is written as float16; L stays float32. numba compiles one kernel per argument dtype from the same
source, and every global load is converted by an explicit ``float32(…)`` on its way to shared memory or registers
(without it, an expression of two float16 values would be float16 arithmetic), so all arithmetic and accumulation
is float32 in both. The shared tiles stay float32: the inner loops are then the same instructions in both kernels,
and what float16 changes is the bytes that cross HBM (half of them) and the capacity a tensor needs there, not the
arithmetic. The store of O converts back (round to nearest).
Cost per (batch, head), N_q = N_k = N, not causal: 4N²d FLOPs (plus ~5 non-matmul ops per S element); global
reads Nd + 2Nd·T_r, writes Nd + N (the same traffic as the teaching kernel: tiles, not traffic, changed).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int64, uint64

from fa2edu.flash2 import Flash2Forward
from kernels_gpu import runtime as rt
from kernels_gpu.fast.split import (
    MERGE_ROWS,
    MERGE_THREADS,
    merge_kernel,
    split_plan,
    step_bound,
    stream_merge_kernel,
    stream_plan,
    zero_counter,
)

__all__ = ["Tiling", "make_forward", "run_forward", "resources", "STATIC_FLOATS"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: numba's static shared memory per block (48 KiB) in floats; beyond it the kernel takes dynamic shared memory.
STATIC_FLOATS = 48 * 1024 // 4
#: Hopper's largest opt-in dynamic shared memory per block, in bytes.
MAX_DYNAMIC_BYTES = 227 * 1024


class Tiling(NamedTuple):
    """A tile shape: NY × NX threads, each owning TR rows and TC columns of S (B_r = NY·TR, B_c = NX·TC)."""

    NY: int
    NX: int
    TR: int
    TC: int

    @property
    def B_r(self) -> int:
        return self.NY * self.TR

    @property
    def B_c(self) -> int:
        return self.NX * self.TC

    @property
    def threads(self) -> int:
        return self.NY * self.NX


def layout(tiling: Tiling, d: int, d_v: int, shuffle: bool, fragments: bool = False) -> dict:
    """Offsets and row strides (floats) of Q_i, K_j, V_j, P̃ (and, without shuffles, the B_r × NX partial row
    maxima) in the block's flat shared array, and its size. With ``fragments`` (v6), d_v floats of slack at the end:
    the last prefetch of V_j reads one row past it, which must stay inside the array."""
    B_r, B_c = tiling.B_r, tiling.B_c
    QS, KS, VS, PS = d + 4, d + 4, d_v, B_c + 4
    q_off = 0
    k_off = q_off + B_r * QS
    v_off = k_off + B_c * KS
    p_off = v_off + B_c * VS
    red_off = p_off + B_r * PS
    return dict(QS=QS, KS=KS, VS=VS, PS=PS, q_off=q_off, k_off=k_off, v_off=v_off, p_off=p_off,
                red_off=red_off, size=red_off + (0 if shuffle else B_r * tiling.NX) + (d_v if fragments else 0))


def check_tiling(tiling: Tiling, d: int, d_v: int) -> None:
    """Refuse tile shapes the kernel cannot run (it needs 4-float chunks everywhere and a row inside one warp)."""
    NY, NX, TR, TC = tiling
    if NX not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"tiling NX (threads per row) must be a power of two <= 32, got {NX}")
    if d % 4 or d_v % (4 * NX):
        raise ValueError(f"the fast kernels need d % 4 == 0 and d_v % (4·NX) == 0; got d = {d}, d_v = {d_v}, "
                         f"NX = {NX}: use kernels_gpu.flash2_forward for other head sizes")
    if tiling.B_c % 4 or TR < 1 or TC < 1 or NY < 1:
        raise ValueError(f"tiling needs B_c = NX·TC a multiple of 4 and TR, TC, NY >= 1, got {tiling}")
    if tiling.threads > rt.MAX_THREADS:
        raise ValueError(f"tiling {tiling} gives {tiling.threads} threads; CUDA allows {rt.MAX_THREADS}")


# -- warp exchange: the real shuffle, and its emulation for the simulator -----------------------------------------

@cuda.jit(device=True, inline=True)
def _xor_shuffle_gpu(scratch, t, value, lane_mask):
    """The value held by lane ``lane ^ lane_mask`` of this warp (``shfl.sync.bfly``); ``scratch`` unused."""
    return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)


@cuda.jit(device=True)
def _xor_shuffle_sim(scratch, t, value, lane_mask):
    """The simulator has no warp shuffles: the same exchange through shared memory. Every thread of the block
    must call it (the kernel calls it unconditionally), since it synchronises the block twice."""
    scratch[t] = value
    cuda.syncthreads()
    other = scratch[t ^ lane_mask]
    cuda.syncthreads()
    return other


# -- v6: 2^x as one MUFU.EX2 instruction --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _ex2_ftz_gpu():
    """``ex2.approx.ftz.f32``: 2^x with ~2 ulp error, results below 2^-126 flushed to 0 (one ``MUFU.EX2``; numba's
    ``math.exp2`` is libdevice's, which adds a range test and two multiplies to keep subnormal results). Built on
    first use: the simulator has no NVVM intrinsics."""
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @intrinsic
    def ex2_ftz(typingctx, x):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            return builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.nvvm.ex2.approx.ftz.f"),
                                args)
        return types.float32(types.float32), codegen
    return ex2_ftz


@cuda.jit(device=True)
def _ex2_ftz_sim(x):
    """The simulator's stand-in for :func:`_ex2_ftz_gpu`: exact 2^x, flushed to 0 below 2^-126 as the GPU does."""
    y = float32(math.exp2(x))
    return y if y >= float32(1.1754943508222875e-38) else float32(0.0)


# -- v4: the move of K_j, V_j from global to shared memory, split so that it overlaps arithmetic ---------------

@functools.lru_cache(maxsize=None)
def _tile_io(T: int, B_c: int, width: int, simulator: bool):
    """Two device functions for a B_c × width tile of K or V, moved by the block's T threads:

    * ``fetch(Xf, base, col0, N_k, t, reg)``: rows col0 … col0 + B_c − 1 of one head of X (``Xf`` the flat
      array, ``base`` the head's first element) into this thread's registers ``reg`` (n = ⌈B_c·width / T⌉ values;
      element e = t + T·u of the tile, so coalesced across the block). Every load is issued before any is used and
      none sits behind a branch (the ragged last tile clamps the row and zeroes rows past N_k by a select), so all
      n are in flight together and land while the caller computes. The flat array makes the row stride the
      compile-time ``width``: the n addresses are one register plus constant offsets (with the 4-D indexing and
      its run-time strides, ptxas kept a 64-bit address per load: 255 registers at d = 64);
    * ``store(sm, reg, t, off, stride)``: those registers into shared memory, row c at ``off + c·stride``.

    v1-v3 instead load and store element by element behind the bounds branch: each store waits for its load.
    """
    n = -(-B_c * width // T)
    R = T // width if T % width == 0 else 0     # rows per pass when the block covers whole rows, else 0
    regular = R > 0 and B_c % R == 0            # every thread moves whole columns k0 of rows c0 + R·u, all < B_c
    jit = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)

    @jit
    def fetch(Xf, base, col0, N_k, t, reg):
        if regular:
            c0 = t // width
            k0 = t - c0 * width
            if col0 + B_c <= N_k:
                # A whole tile: n loads at compile-time-constant distances R·width from one address.
                start = base + (col0 + c0) * width + k0
                for u in range(n):
                    reg[u] = float32(Xf[uint64(start + u * R * width)])     # float16 storage: converted here
            else:
                # The ragged last tile: clamp the row, zero past N_k (a select, not a branch).
                for u in range(n):
                    row = col0 + c0 + R * u
                    x = float32(Xf[uint64(base + min(row, N_k - 1) * width + k0)])
                    reg[u] = x if row < N_k else float32(0.0)
        else:
            for u in range(n):
                e = t + T * u
                c = e // width
                row = col0 + c
                x = float32(Xf[uint64(base + min(row, N_k - 1) * width + e - c * width)])
                reg[u] = x if row < N_k else float32(0.0)

    @jit
    def store(sm, reg, t, off, stride):
        if regular:
            c0 = t // width
            start = off + c0 * stride + t - c0 * width
            for u in range(n):
                sm[uint64(start + u * R * stride)] = reg[u]
        else:
            for u in range(n):
                e = t + T * u
                c = e // width
                if c < B_c:
                    sm[uint64(off + c * stride + e - c * width)] = reg[u]

    return fetch, store


# -- the kernel ----------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_forward(tiling: Tiling, d: int, d_v: int, shuffle: bool, simulator: bool, pipeline: bool = False,
                 max_registers: int | None = None, fragments: bool = False, split: bool = False,
                 stream: bool = False):
    """Compile-time specialisation of the kernel: tile shape, head sizes, how rows exchange their maxima,
    whether the K_j/V_j loads are pipelined (``pipeline``, v4+: see :func:`_tile_io`), and a cap on registers per
    thread for ptxas (``max_registers``, v5+; ignored by the simulator), which trades registers for resident
    blocks per SM, and whether the shared-memory operands of the two inner loops are double-buffered in registers
    and Q_i is moved like the K/V tiles (``fragments``, v6+: see :mod:`kernels_gpu.fast.flash2_forward_v6`), and
    whether blocks take their (row block, batch, head) from a 1-D grid and may cover only part of the keys
    (``split``, v7: see :func:`run_forward` and :mod:`kernels_gpu.fast.flash2_forward_v7`), or from a range of
    (item, K/V tile) steps, looping over the items and pieces in it (``stream``, v8: stream-K, see
    :mod:`kernels_gpu.fast.split` and :mod:`kernels_gpu.fast.flash2_forward_v8`)."""
    check_tiling(tiling, d, d_v)
    NY, NX, TR, TC = tiling
    B_r, B_c, T = tiling.B_r, tiling.B_c, tiling.threads
    # pipeline: each thread moves NK values of K_j and NV of V_j through registers (see _tile_io).
    fetch_k, store_k = _tile_io(T, B_c, d, simulator)
    fetch_v, store_v = _tile_io(T, B_c, d_v, simulator)
    NK, NV = -(-B_c * d // T), -(-B_c * d_v // T)
    # Q_i moves in passes of QROWS rows, at most 32 values per thread each (all of Q_i at once spills at d = 128).
    QROWS = B_r
    while QROWS * d > 32 * T and QROWS % 2 == 0:
        QROWS //= 2
    fetch_q, store_q = _tile_io(T, QROWS, d, simulator)
    NQ = -(-QROWS * d // T) if fragments else 1
    TD = d_v // NX                     # output columns per thread, in TD // 4 chunks of 4
    TQ = TD // 4
    S_REGS, O_REGS, QA_REGS, KA_REGS = TR * TC, TR * TD, TR * 4, TC * 4   # local-array sizes: compile-time constants
    VA_REGS = 2 * TD if fragments else TD
    QB_REGS, KB_REGS, PP_REGS = (QA_REGS, KA_REGS, 2 * QA_REGS) if fragments else (1, 1, 1)
    NK4, NC4 = d // 4, B_c // 4          # steps of 4 along d (S = Q Kᵀ) and along B_c (P̃ V)
    lay = layout(tiling, d, d_v, shuffle, fragments)
    QS, KS, VS, PS = lay["QS"], lay["KS"], lay["VS"], lay["PS"]
    Q_OFF, K_OFF, V_OFF, P_OFF, RED_OFF = (lay[k] for k in ("q_off", "k_off", "v_off", "p_off", "red_off"))
    SIZE = lay["size"]
    STATIC = SIZE if SIZE <= STATIC_FLOATS else 0      # 0: numba's dynamic shared array (size set at launch)
    SCRATCH = T if (shuffle and simulator) else 1
    xor_shuffle = _xor_shuffle_sim if simulator else _xor_shuffle_gpu
    # 2^x for the softmax: v6 uses the bare MUFU.EX2 (flushing results below 2^-126 to 0, as the simulator's
    # emulation does), v1-v5 libdevice's exp2f (which also scales subnormal results: 3 more instructions).
    exp2 = (_ex2_ftz_sim if simulator else _ex2_ftz_gpu()) if fragments else math.exp2
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    jit = cuda.jit(max_registers=max_registers) if (max_registers and not simulator) else cuda.jit

    dev = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)
    stream_bound = dev(step_bound)

    @dev
    def load_qk(sm, qx, kx, q_row, k_row, k):
        """Columns k … k+3 of this thread's TR rows of Q_i and TC rows of K_j into one operand buffer, one 16-byte
        shared load per row."""
        for r in range(TR):
            for u in range(4):
                qx[r * 4 + u] = sm[uint64(q_row + r * QS + k + u)]
        for c in range(TC):
            for u in range(4):
                kx[c * 4 + u] = sm[uint64(k_row + NX * c * KS + k + u)]

    @dev
    def s_step(s, qx, kx):
        """S += Q_i[rows, 4k:4k+4] K_j[cols, 4k:4k+4]ᵀ for this thread's TR × TC, from one buffer of operands: four
        outer products, so that consecutive FFMAs share an operand (each element still sums u = 0 … 3 in order)."""
        for u in range(4):
            for r in range(TR):
                for c in range(TC):
                    s[r * TC + c] += qx[r * 4 + u] * kx[c * 4 + u]

    @dev
    def pv_row(sm, o, pp, va, cur, u, c_next, v_col):
        """Õ += P̃[:, c] V_j[c, :] for c = 4g + u, P̃'s group in buffer ``cur`` of ``pp``, V_j's row c in buffer
        u % 2 of ``va``; first loads row ``c_next`` of V_j into the other buffer (in flight during the FFMAs)."""
        for q in range(TQ):
            for e in range(4):
                va[((u + 1) % 2) * TD + q * 4 + e] = sm[uint64(v_col + c_next * VS + 4 * NX * q + e)]
        for r in range(TR):
            for x in range(TD):
                o[r * TD + x] += pp[cur * QA_REGS + r * 4 + u] * va[(u % 2) * TD + x]

    @dev
    def pv_group(sm, o, pp, va, cur, g, p_row, v_col):
        """Õ += P̃[:, 4g:4g+4] V_j[4g:4g+4, :] for this thread's TR × TD, with P̃'s group g in buffer ``cur`` of
        ``pp`` and V_j's row 4g in buffer 0 of ``va``; loads group g+1 of P̃ into buffer 1 − cur and each next row
        of V_j into the other ``va`` buffer while the current one feeds the FFMAs (indices clamp at the end).
        Written as four calls with constant ``u`` so that every register index is a compile-time constant."""
        gn = g + 1                      # the last group loads P̃'s pad columns, never used
        for r in range(TR):
            for u in range(4):
                pp[(1 - cur) * QA_REGS + r * 4 + u] = sm[uint64(p_row + r * PS + 4 * gn + u)]
        pv_row(sm, o, pp, va, cur, 0, 4 * g + 1, v_col)
        pv_row(sm, o, pp, va, cur, 1, 4 * g + 2, v_col)
        pv_row(sm, o, pp, va, cur, 2, 4 * g + 3, v_col)
        pv_row(sm, o, pp, va, cur, 3, 4 * g + 4, v_col)

    @jit
    def flash2_forward_fast(Q, K, V, O, L, scale2, causal, Kf, Vf, Qf, item0, S, Opart, Lpart, counter):
        N_q = Q.shape[2]
        N_k = K.shape[2]
        if split:
            # (v7) a 1-D grid: block b is piece b % S of item item0 + b // S, item = (z·H_q + h)·T_r + i; piece p of
            # S covers K/V tiles [p·T_c/S, (p+1)·T_c/S) (S = 1: all of them).
            b = cuda.blockIdx.x
            item = item0 + b // S
            piece = b - (b // S) * S
            T_r = (N_q + B_r - 1) // B_r
            i = item % T_r
            h = (item // T_r) % Q.shape[1]
            z = item // (T_r * Q.shape[1])
            T_all = (N_k + B_c - 1) // B_c
            j_lo = piece * T_all // S
            j_hi = (piece + 1) * T_all // S
            it = hi = first_item = 0
        elif stream:
            # (v8) the grid is the P blocks the GPU holds at once; each takes work units from a counter, in order:
            # unit u < item0 is the whole item u (as v6's block u), unit item0 + r is range r of the S equal
            # ranges of the last items' (items − item0)·T_c steps (stream-K), a range holding a piece of an item
            # at either end (written to Opart slot 2r or 2r + 1) and whole items between.
            T_r = (N_q + B_r - 1) // B_r
            T_all = (N_k + B_c - 1) // B_c
            W = (T_r * Q.shape[0] * Q.shape[1] - item0) * T_all
            b = it = hi = first_item = 0
            item = i = z = h = j_lo = j_hi = 0
        else:
            i = cuda.blockIdx.x
            z = cuda.blockIdx.y
            h = cuda.blockIdx.z
            b = 0
            j_lo = 0
            j_hi = 0
            item = it = hi = first_item = T_all = 0
        t = cuda.threadIdx.x
        tx = t % NX
        ty = t // NX
        ticket = cuda.shared.array(1, int64)           # (v8) the block's current work unit
        while True:                                     # (v8: one pass per item or piece; v1-v7: one pass)
            if stream:
                if it >= hi:
                    # the unit is done (or none taken yet): take the next one, one atomic for the block
                    if t == 0:
                        ticket[0] = cuda.atomic.add(counter, 0, 1)
                    cuda.syncthreads()
                    u = ticket[0]
                    if u >= item0 + S:
                        break                           # every unit is taken
                    if u < item0:
                        it = u * T_all
                        hi = it + T_all
                    else:
                        b = u - item0
                        it = item0 * T_all + stream_bound(b, W, S)
                        hi = item0 * T_all + stream_bound(b + 1, W, S)
                    first_item = it // T_all
                # this pass: item = (z·H_q + h)·T_r + i, its K/V tiles [j_lo, j_hi)
                item = it // T_all
                j_lo = it - item * T_all
                j_hi = min(T_all, j_lo + hi - it)
                i = item % T_r
                h = (item // T_r) % Q.shape[1]
                z = item // (T_r * Q.shape[1])
            h_kv = h // (Q.shape[1] // K.shape[1])        # GQA: query head h reads K/V head h // G
            row0 = i * B_r
            offset = N_k - N_q                              # causal, bottom-right: row sees col iff col <= row + offset
            if simulator:
                sm = cuda.shared.array(STATIC, float32)                    # (the simulator refuses `alignment`)
            else:
                sm = cuda.shared.array(STATIC, float32, alignment=16)      # 16-byte rows for 4-float loads
            scratch = cuda.shared.array(SCRATCH, float32)   # the simulator's shuffle emulation only

            s = cuda.local.array(S_REGS, float32)          # S_i^(j), then P̃_i^(j): this thread's TR × TC sub-tile
            o = cuda.local.array(O_REGS, float32)          # Õ_i: TR × TD
            m = cuda.local.array(TR, float32)               # m_i (log2 units), shared by the row's NX threads
            l = cuda.local.array(TR, float32)               # ℓ_i: this thread's partial sum over its own columns
            qa = cuda.local.array(QA_REGS, float32)
            ka = cuda.local.array(KA_REGS, float32)
            va = cuda.local.array(VA_REGS, float32)
            pa = cuda.local.array(QA_REGS, float32)
            qb = cuda.local.array(QB_REGS, float32)         # fragments: the second buffer of Q_i's and K_j's 4 columns
            kbuf = cuda.local.array(KB_REGS, float32)
            pp = cuda.local.array(PP_REGS, float32)         # fragments: two buffers of P̃'s 4 columns
            kreg = cuda.local.array(NK, float32)           # pipeline: K_{j+1} in flight (registers) during P̃_j V_j
            vreg = cuda.local.array(NV, float32)           # pipeline: V_j in flight during S_j = Q_i K_jᵀ

            # Alg. 1 line 4: load Q_i to shared memory, scaled by τ·log2(e) (the softmax then uses exp2); coalesced:
            # consecutive threads read consecutive elements of a row. Rows past N_q are zero (never written out).
            kv_base = (z * K.shape[1] + h_kv) * N_k          # pipeline: the head's first row in the flat Kf, Vf
            if fragments:
                # (v6) K_0's loads go first (Alg. 1 line 7, stored below), then Q_i's in passes of QROWS rows, each
                # pass's loads all issued before its stores, as the K/V tiles are moved (see _tile_io).
                fetch_k(Kf, kv_base * d, j_lo * B_c, N_k, t, kreg)
                qreg = cuda.local.array(NQ, float32)
                for qc in range(B_r // QROWS):
                    fetch_q(Qf, (z * Q.shape[1] + h) * N_q * d, row0 + qc * QROWS, N_q, t, qreg)
                    for u in range(NQ):
                        qreg[u] *= scale2
                    store_q(sm, qreg, t, Q_OFF + qc * QROWS * QS, QS)
            else:
                for e in range(t, B_r * d, T):
                    r = e // d
                    k = e - r * d
                    x = float32(0.0)
                    if row0 + r < N_q:
                        x = float32(Q[z, h, row0 + r, k]) * scale2
                    sm[Q_OFF + r * QS + k] = x
            # Alg. 1 line 5: Õ_i = 0, ℓ_i = 0, m_i = −inf, in registers.
            for x in range(TR * TD):
                o[x] = 0.0
            for r in range(TR):
                m[r] = NEG_INF
                l[r] = 0.0

            # FA2 Section 3.1 (causal): tiles entirely above the diagonal are all past the one holding column
            # last_row + offset, so the loop stops there (nothing of them is loaded).
            T_c = (N_k + B_c - 1) // B_c
            if causal:
                last_row = min(row0 + B_r, N_q) - 1
                T_c = max(0, min(T_c, (last_row + offset + B_c) // B_c))
            if split or stream:
                T_c = j_hi                                  # (v7, v8: the host splits non-causal calls only)
            my_row0 = row0 + ty * TR
            q_row = Q_OFF + ty * TR * QS                     # this thread's first row of Q_i, K_j, P̃ and column of V_j
            k_row = K_OFF + tx * KS
            p_row = P_OFF + ty * TR * PS
            v_col = V_OFF + 4 * tx
            if pipeline and T_c > 0:
                # Alg. 1 line 7 (K_0 only): every load issued before the first store, then K_0 to shared memory.
                if not fragments:
                    fetch_k(Kf, kv_base * d, 0, N_k, t, kreg)
                store_k(sm, kreg, t, K_OFF, KS)
            # Alg. 1 line 6: stream K_j, V_j through shared memory.
            for j in range(j_lo, T_c):
                col0 = j * B_c
                cuda.syncthreads()                          # everyone is done with the previous K_j, V_j, P̃
                if pipeline:
                    # Alg. 1 line 7 (V_j): issue the loads now; they land while S_j is computed, stored after it.
                    fetch_v(Vf, kv_base * d_v, col0, N_k, t, vreg)
                else:
                    # Alg. 1 line 7: load K_j, V_j (zero past N_k, so padding never makes NaN).
                    for e in range(t, B_c * d, T):
                        c = e // d
                        k = e - c * d
                        x = float32(0.0)
                        if col0 + c < N_k:
                            x = float32(K[z, h_kv, col0 + c, k])
                        sm[K_OFF + c * KS + k] = x
                    for e in range(t, B_c * d_v, T):
                        c = e // d_v
                        k = e - c * d_v
                        x = float32(0.0)
                        if col0 + c < N_k:
                            x = float32(V[z, h_kv, col0 + c, k])
                        sm[V_OFF + c * VS + k] = x
                    cuda.syncthreads()

                # Alg. 1 line 8: S_i^(j) = τ Q_i K_jᵀ, this thread's TR × TC sub-tile, 4 values of d at a time.
                for x in range(TR * TC):
                    s[x] = 0.0
                if fragments:
                    # Step k reads Q_i[:, 4k:4k+4] and K_j[:, 4k:4k+4] into buffer k % 2 while buffer (k-1) % 2 feeds
                    # the FFMAs: the shared loads of step k+1 are in flight during the 16·TR·TC/4 FFMAs of step k.
                    # (+0.0: an exact no-op that keeps LLVM from merging these loads with the loop's last prefetch
                    # into one load at the top of the loop, which would undo the prefetch.)
                    for r in range(TR):
                        for u in range(4):
                            qa[r * 4 + u] = sm[uint64(q_row + r * QS + u)] + ZERO
                    for c in range(TC):
                        for u in range(4):
                            ka[c * 4 + u] = sm[uint64(k_row + NX * c * KS + u)] + ZERO
                    for p2 in range(NK4 // 2):
                        load_qk(sm, qb, kbuf, q_row, k_row, (2 * p2 + 1) * 4)
                        s_step(s, qa, ka)
                        # (the last pair loads the rows' pad, columns d … d+3, never used)
                        load_qk(sm, qa, ka, q_row, k_row, (2 * p2 + 2) * 4)
                        s_step(s, qb, kbuf)
                    if NK4 % 2 == 1:
                        s_step(s, qa, ka)
                else:
                    for k4 in range(0, d, 4):
                        for r in range(TR):
                            for u in range(4):
                                qa[r * 4 + u] = sm[uint64(Q_OFF + (ty * TR + r) * QS + k4 + u)]
                        for c in range(TC):
                            for u in range(4):
                                ka[c * 4 + u] = sm[uint64(K_OFF + (tx + NX * c) * KS + k4 + u)]
                        for r in range(TR):
                            for c in range(TC):
                                acc = s[r * TC + c]
                                for u in range(4):
                                    acc += qa[r * 4 + u] * ka[c * 4 + u]
                                s[r * TC + c] = acc
                # Mask (only tiles that need it): columns past N_k, and keys after the causal diagonal, get −inf.
                if col0 + B_c > N_k or (causal and col0 + B_c - 1 > my_row0 + offset):
                    for r in range(TR):
                        for c in range(TC):
                            col = col0 + tx + NX * c
                            if col >= N_k or (causal and col > my_row0 + r + offset):
                                s[r * TC + c] = NEG_INF

                # Alg. 1 line 9: m_i^(j) = max(m_i^(j−1), rowmax(S_i^(j))): own columns, then the row's NX threads.
                for r in range(TR):
                    mx = m[r]
                    for c in range(TC):
                        mx = max(mx, s[r * TC + c])
                    qa[r] = mx                              # (qa is free until the next k4 loop: reuse it)
                if shuffle:
                    lane = 1
                    while lane < NX:                        # butterfly over the NX consecutive lanes of the row
                        for r in range(TR):
                            qa[r] = max(qa[r], xor_shuffle(scratch, t, qa[r], lane))
                        lane *= 2
                else:
                    for r in range(TR):
                        sm[RED_OFF + (ty * TR + r) * NX + tx] = qa[r]
                    cuda.syncthreads()
                    for r in range(TR):
                        mx = qa[r]
                        for u in range(NX):
                            mx = max(mx, sm[RED_OFF + (ty * TR + r) * NX + u])
                        qa[r] = mx
                for r in range(TR):
                    m_new = qa[r]
                    # Guard m = −inf (every key so far masked): subtract 0 instead, so every exponential is exactly 0.
                    m_use = float32(0.0) if m_new == NEG_INF else m_new
                    alpha = exp2(m[r] - m_use)              # e^{m_old − m_new}; 0 while m_old = −inf
                    # Alg. 1 line 9: P̃ = exp(S − m_new), ℓ = e^{m_old − m_new} ℓ + rowsum(P̃) (own columns only).
                    ls = float32(0.0)
                    for c in range(TC):
                        p = exp2(s[r * TC + c] - m_use)
                        ls += p
                        sm[P_OFF + (ty * TR + r) * PS + tx + NX * c] = p
                    l[r] = alpha * l[r] + ls
                    m[r] = m_new
                    # Alg. 1 line 10 (first half): Õ_i = diag(e^{m_old − m_new}) Õ_i (v6: skipped when the maximum did
                    # not move, α = 1 exactly, as it mostly does once a row has seen many keys).
                    if not fragments or alpha != 1.0:
                        for x in range(TD):
                            o[r * TD + x] *= alpha
                if pipeline:
                    store_v(sm, vreg, t, V_OFF, VS)         # V_j arrived during S_j: to shared memory
                cuda.syncthreads()                          # P̃ (and V_j) complete before any thread reads other columns
                if pipeline:
                    # Alg. 1 line 7 (K_{j+1}): issue the loads now, in flight during P̃_j V_j (the last tile reloads
                    # its own K: a clamped index instead of a branch).
                    fetch_k(Kf, kv_base * d, min(j + 1, T_c - 1) * B_c, N_k, t, kreg)
                # Alg. 1 line 10 (second half): Õ_i += P̃_i^(j) V_j, 4 columns of P̃ at a time.
                if fragments:
                    # Row c of V_j goes to buffer c % 2 while buffer (c-1) % 2 feeds the FFMAs; the 4 columns of P̃
                    # of group g+1 are loaded into the other P̃ buffer when group g starts.
                    for r in range(TR):
                        for u in range(4):
                            pp[r * 4 + u] = sm[uint64(p_row + r * PS + u)] + ZERO      # (+0.0: as above)
                    for q in range(TQ):
                        for e in range(4):
                            va[q * 4 + e] = sm[uint64(v_col + 4 * NX * q + e)] + ZERO
                    for g2 in range(NC4 // 2):
                        pv_group(sm, o, pp, va, 0, 2 * g2, p_row, v_col)
                        pv_group(sm, o, pp, va, 1, 2 * g2 + 1, p_row, v_col)
                    if NC4 % 2 == 1:
                        pv_group(sm, o, pp, va, 0, NC4 - 1, p_row, v_col)
                else:
                    for c4 in range(0, B_c, 4):
                        for r in range(TR):
                            for u in range(4):
                                pa[r * 4 + u] = sm[uint64(P_OFF + (ty * TR + r) * PS + c4 + u)]
                        for u in range(4):
                            for q in range(TQ):
                                for e in range(4):
                                    va[q * 4 + e] = sm[uint64(V_OFF + (c4 + u) * VS + 4 * tx + 4 * NX * q + e)]
                            for r in range(TR):
                                for x in range(TD):
                                    o[r * TD + x] += pa[r * 4 + u] * va[x]
                if pipeline:
                    # K_j is no longer read by anyone (they all passed the barrier after S_j): K_{j+1} replaces it.
                    store_k(sm, kreg, t, K_OFF, KS)

            # Alg. 1 line 12: ℓ_i = the sum of the row's NX partial sums (once, after the loop).
            for r in range(TR):
                qa[r] = l[r]
            if shuffle:
                lane = 1
                while lane < NX:
                    for r in range(TR):
                        qa[r] += xor_shuffle(scratch, t, qa[r], lane)
                    lane *= 2
            else:
                cuda.syncthreads()                          # the last max exchange is read by everyone
                for r in range(TR):
                    sm[RED_OFF + (ty * TR + r) * NX + tx] = qa[r]
                cuda.syncthreads()
                for r in range(TR):
                    acc = float32(0.0)
                    for u in range(NX):
                        acc += sm[RED_OFF + (ty * TR + r) * NX + u]
                    qa[r] = acc
            if (split and S > 1) or (stream and (j_lo > 0 or j_hi < T_all)):
                # (v7, v8) a piece of the keys: its own O and L (Alg. 1 lines 12-13 on its tiles), for the merge;
                # v8: slot 2r for the piece of range r's first item, 2r + 1 for that of its last
                slot = b
                if stream:
                    slot = 2 * b + (0 if item == first_item else 1)
                for r in range(TR):
                    if my_row0 + r < N_q:
                        l_i = qa[r]
                        inv_l = float32(0.0) if l_i == 0.0 else float32(1.0) / l_i
                        for q in range(TQ):
                            for e in range(4):
                                Opart[slot, ty * TR + r, 4 * tx + 4 * NX * q + e] = o[r * TD + q * 4 + e] * inv_l
                        if tx == 0:
                            Lpart[slot, ty * TR + r] = (math.inf if l_i == 0.0
                                                        else float32(LN2) * (m[r] + math.log2(l_i)))
            else:
                for r in range(TR):
                    row = my_row0 + r
                    if row < N_q:
                        l_i = qa[r]
                        # Alg. 1 line 12: O_i = diag(ℓ_i)^{-1} Õ_i; guard ℓ = 0 (a row that saw no key): O_i = 0.
                        inv_l = float32(0.0) if l_i == 0.0 else float32(1.0) / l_i
                        # Alg. 1 line 14: write O_i, once, 4 consecutive columns per chunk.
                        for q in range(TQ):
                            for e in range(4):
                                O[z, h, row, 4 * tx + 4 * NX * q + e] = o[r * TD + q * 4 + e] * inv_l
                        # Alg. 1 lines 13, 15: L_i = m_i + log ℓ_i in natural units (m in log2 units); +inf if ℓ = 0.
                        if tx == 0:
                            L[z, h, row] = math.inf if l_i == 0.0 else float32(LN2) * (m[r] + math.log2(l_i))
            if not stream:
                break
            it += j_hi - j_lo                           # (v8) the next item or piece of this unit, if any

    return flash2_forward_fast


def _allow_dynamic_shared(kernel, args, nbytes: int) -> None:
    """Raise the kernel's dynamic shared-memory limit to ``nbytes`` (needed above 48 KiB): compile for these
    argument types first, then set ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` on the loaded kernel."""
    from numba.cuda.cudadrv.driver import binding, driver
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    compiled = kernel.compile(argtypes)
    cufunc = compiled._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)


def _no_parts():
    """The (unused) piece arrays and counter of an unsplit launch: the kernel's signature always has them."""
    return (cuda.device_array((1, 1, 1), dtype=np.float32), cuda.device_array((1, 1), dtype=np.float32),
            cuda.device_array(1, dtype=np.int64))


_RESIDENT: dict = {}


def _resident_blocks(kernel, args, threads: int, dynamic: int) -> int:
    """How many blocks of the kernel compiled for ``args`` the GPU holds at once (SMs × blocks per SM, the
    occupancy calculator's answer), asked once per kernel and launch shape."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    key = (kernel, argtypes, threads, dynamic)
    if key not in _RESIDENT:
        _RESIDENT[key] = max(1, kernel.compile(argtypes).max_cooperative_grid_blocks(threads, dynamic))
    return _RESIDENT[key]


def run_forward(Q, K, V, *, tiling: Tiling, shuffle: bool, causal=False, scale=None,
                pipeline: bool = False, max_registers: int | None = None, storage: str = "float32",
                fragments: bool = False, split: bool = False, slots: int | None = None,
                stream: bool = False) -> Flash2Forward:
    """Check inputs (as :func:`kernels_gpu.flash2_forward` does), launch the tiled kernel, return ``(O, L)``.
    ``max_registers``: None (no cap) or a positive int, the ptxas cap on registers per thread.
    ``storage``: ``"float32"``, or ``"float16"``: Q, K, V stored as float16 (NumPy inputs cast; device inputs must
    be float16), O returned as float16, L as float32; arithmetic float32 either way. Global bytes per (batch, head):
    reads 2(Nd + 2Nd·T_r) instead of 4(…), writes 2Nd + 4N instead of 4Nd + 4N.
    ``split`` (v7): launch over a 1-D grid planned by :func:`split_plan` for ``slots`` resident blocks (None: the
    GPU's own count from the occupancy calculator; the simulator counts 1, so tests pass it); the split items cost
    their pieces' partial O, L (S·B_r·(d_v + 1) floats each, written and read once) and one more launch.
    ``stream`` (v8): a grid of min(``slots``, units) blocks taking work units from a counter — whole items for the
    whole waves, then R ≤ ``slots`` equal ranges of the leftover items' (item, K/V tile) steps, stream-K
    (:func:`kernels_gpu.fast.split.stream_plan`, :func:`~kernels_gpu.fast.split.stream_pieces`); the items that
    the ranges split cost their pieces' partial O, L (at most 2R·B_r·(d_v + 1) floats, written and read once) and
    a merge launch. Causal calls run the plain grid (their items differ in cost)."""
    rt.storage_dtype(storage)                          # a bad name is a ValueError before anything else
    if max_registers is not None and (isinstance(max_registers, bool) or not isinstance(max_registers, int)
                                      or not 16 <= max_registers <= 255):
        raise ValueError(f"max_registers must be None or an int in [16, 255], got {max_registers!r}")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ValueError(f"slots must be None or a positive int, got {slots!r}")
    layout_, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale, storage=storage)
    d, d_v = layout_.d, layout_.d_v
    simulator = rt.simulator_in_use()
    stream = bool(stream) and not causal
    kernel = make_forward(tiling, d, d_v, bool(shuffle), simulator, bool(pipeline), max_registers,
                          bool(fragments), bool(split), stream)
    size = layout(tiling, d, d_v, bool(shuffle), bool(fragments))["size"]
    if 4 * size > MAX_DYNAMIC_BYTES:
        raise ValueError(f"tiling {tiling} needs {4 * size} bytes of shared memory at d = {d}; the GPU allows "
                         f"{MAX_DYNAMIC_BYTES}: choose a smaller tiling")
    dynamic = 4 * size if size > STATIC_FLOATS else 0
    O = rt.device_empty((layout_.Z, layout_.H_q, layout_.N_q, d_v), storage=storage)
    L = rt.device_empty((layout_.Z, layout_.H_q, layout_.N_q))              # the log-sum-exp stays float32
    # Qf, Kf, Vf: flat views of Q, K, V (contiguous), read by the pipelined loads only.
    args = (Q4, K4, V4, O, L, np.float32(float(tau) * LOG2E), bool(causal), K4.reshape(-1), V4.reshape(-1),
            Q4.reshape(-1))
    whole = args + (0, 1) + _no_parts()
    if dynamic and not simulator:
        _allow_dynamic_shared(kernel, whole, dynamic)
    T_r = rt.grid_size(layout_.N_q, tiling.B_r)
    T_c = rt.grid_size(layout_.N_k, tiling.B_c)
    items = T_r * layout_.Z * layout_.H_q
    if (split or stream) and slots is None:
        # the simulator runs one block at a time; the GPU: what the occupancy calculator says fits at once
        slots = 1 if simulator else _resident_blocks(kernel, whole, tiling.threads, dynamic)
    if stream:
        n_whole, R = stream_plan(items, T_c, slots)
        Opart = rt.device_empty((max(1, 2 * R), tiling.B_r, d_v))
        Lpart = rt.device_empty((max(1, 2 * R), tiling.B_r))
        counter = cuda.device_array(1, dtype=np.int64)
        zero_counter[1, 1](counter)
        kernel[min(slots, n_whole + R), tiling.threads, 0, dynamic](*args, n_whole, R, Opart, Lpart, counter)
        W = (items - n_whole) * T_c
        if R > 1 and (np.arange(1, R) * W // R % T_c).any():         # some boundary between ranges splits an item
            merger = stream_merge_kernel(tiling.B_r, d_v)
            merger[-(-(R - 1) * tiling.B_r // MERGE_ROWS), MERGE_THREADS](Opart, Lpart, O, L, T_r, T_c, R, n_whole)
    elif not split:
        kernel[(T_r, layout_.Z, layout_.H_q), tiling.threads, 0, dynamic](*whole)
    else:
        n_full, n_split, S = split_plan(items, T_c, slots, bool(causal))
        if n_full:
            kernel[n_full, tiling.threads, 0, dynamic](*whole)
        if n_split:
            Opart = rt.device_empty((n_split * S, tiling.B_r, d_v))
            Lpart = rt.device_empty((n_split * S, tiling.B_r))
            kernel[n_split * S, tiling.threads, 0, dynamic](*args, n_full, S, Opart, Lpart, whole[-1])
            merger = merge_kernel(tiling.B_r, d_v)
            merger[-(-n_split * tiling.B_r // MERGE_ROWS), MERGE_THREADS](Opart, Lpart, O, L, n_full, S, T_r, n_split)
    return Flash2Forward(rt.finish(O, layout_, (layout_.N_q, d_v)), rt.finish(L, layout_, (layout_.N_q,)))


def resources(tiling: Tiling, d: int, d_v: int, shuffle: bool, pipeline: bool = False,
              max_registers: int | None = None, storage: str | None = None, fragments: bool = False,
              split: bool = False, stream: bool = False) -> dict:
    """The compiler's resource report for a compiled kernel (GPU only): registers, local memory (spills), shared.
    ``storage``: the report of the kernel compiled for that storage dtype (None: the last one compiled)."""
    kernel = make_forward(tiling, d, d_v, bool(shuffle), False, bool(pipeline), max_registers, bool(fragments),
                          bool(split), bool(stream))
    out = {}
    for argtypes, compiled in kernel.overloads.items():
        if storage is not None and np.dtype(str(argtypes[0].dtype)) != rt.storage_dtype(storage):
            continue
        out = dict(registers=compiled.regs_per_thread, local_bytes=compiled.local_mem_per_thread,
                   static_shared_bytes=compiled.shared_mem_per_block,
                   shared_floats=layout(tiling, d, d_v, shuffle, fragments)["size"])
    return out
