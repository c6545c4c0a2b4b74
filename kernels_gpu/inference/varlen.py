"""FA2's forward pass over a packed batch of sequences of different lengths (``cu_seqlens``), as a numba.cuda
kernel: :func:`fa2edu.varlen_attention` on the GPU::

    O, L = kernels_gpu.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False)

q (H_q, total_q, d), k (H_kv, total_k, d), v (H_kv, total_k, d_v): the sequences concatenated along the token axis,
sequence b at rows ``cu_seqlens[b] … cu_seqlens[b + 1] − 1``; its queries attend only to its keys. Storage float32,
float16 or bfloat16 (bfloat16 as PyTorch tensors); arithmetic float32 for all three. O (H_q, total_q, d_v) in the
storage dtype, L (H_q, total_q) float32 (+inf on rows that see no key).

**The kernel family.** The fastest kernels for float16/bfloat16 are the tensor-core ones
(:mod:`kernels_gpu.tensorcore`), which take one (…, N, d) problem and no offsets; for float32 the fastest are the
register-tiled CUDA-core kernels of :mod:`kernels_gpu.fast`. This kernel is the latter's design (FA2 Alg. 1, one
block per (row block, head), a 2-D grid of threads each owning a TR × TC sub-tile of S and TR × TD of Õ in
registers, Q_i, K_j, V_j and P̃ in shared memory with 16-byte-aligned rows, row maxima and sums across a row's NX
lanes by warp shuffles, 2^x with τ·log₂e folded into Q) with float32 arithmetic for every storage dtype — also for
float16 and bfloat16, where a tensor-core varlen kernel would be faster. Not carried over from
:mod:`kernels_gpu.fast`: the register double-buffering of v6 and the pipelined tile loads of v4 (each tile's loads
are issued together, then stored).

**Packed, not padded.** A block's row block and key tiles start at its own sequence's offsets, so no tile holds
another sequence's tokens or padding. The grid is (row blocks of all sequences, heads): a host-side map gives each
block its (sequence, row block), ordered by decreasing work (the longest sequences' blocks first, so that the
short ones fill the tail). A padded batch pays every sequence at the longest length: Σ_b T_r(N_max)·N_max keys per
query block instead of Σ_b T_r(n_b)·n_b (``benchmarks.decode`` measures both).

Cost per query head: as :func:`fa2edu.varlen_attention` — Σ_b of FA2's forward cost on sequence b alone: reads
n_q·d + T_r(n_q)·n_k·(d + d_v), writes n_q·(d_v + 1) elements; 4·n_q·n_k·d FLOPs (half when causal).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int64, uint16, uint32, uint64

from fa2edu.flash2 import Flash2Forward
from fa2edu.inference import check_cu_seqlens, check_varlen_values
from fa2edu.validation import check_scale
from kernels_gpu import runtime as rt
from kernels_gpu.inference import decode_io as io

__all__ = ["varlen_attention", "VarlenTiling", "default_varlen_tiling", "block_map", "varlen_kernel",
           "shared_floats"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: Hopper's largest dynamic shared memory per block (bytes)
MAX_SHARED_BYTES = 227 * 1024


class VarlenTiling(NamedTuple):
    """NY × NX threads, each owning TR rows and TC (interleaved) columns of S: B_r = NY·TR, B_c = NX·TC."""

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


def default_varlen_tiling(d: int) -> VarlenTiling:
    """B_r = 64, B_c = 32 on 128 threads (d ≤ 128; B_r = 32 above): each thread 4 × 4 of S. In numba's simulator,
    8 × 8 tiles on 16 threads (it runs every thread as a Python thread)."""
    if rt.simulator_in_use():
        return VarlenTiling(4, 4, 2, 2)
    return VarlenTiling(16, 8, 4, 4) if d <= 128 else VarlenTiling(8, 8, 4, 4)


def _layout(tiling: VarlenTiling, d: int, d_v: int) -> dict:
    """Offsets (floats) of Q_i, K_j, V_j, P̃ in the block's shared array. Rows of Q_i and K_j have d rounded up to
    4 plus 4 floats (16-byte aligned rows, shifted across banks), V_j's rows the columns the threads own."""
    DP = -(-d // 4) * 4
    TQ = -(-d_v // (4 * tiling.NX))
    QS, VS, PS = DP + 4, 4 * tiling.NX * TQ, tiling.B_c + 4
    q_off = 0
    k_off = q_off + tiling.B_r * QS
    v_off = k_off + tiling.B_c * QS
    p_off = v_off + tiling.B_c * VS
    return dict(DP=DP, TQ=TQ, QS=QS, VS=VS, PS=PS, q_off=q_off, k_off=k_off, v_off=v_off, p_off=p_off,
                size=p_off + tiling.B_r * PS)


def shared_floats(tiling: VarlenTiling, d: int, d_v: int) -> int:
    """Shared-memory floats of a block (Q_i, K_j, V_j, P̃)."""
    return _layout(tiling, d, d_v)["size"]


@functools.lru_cache(maxsize=None)
def _to_float(storage: str, simulator: bool):
    """A device function: one stored element → float32 (16-bit: its bits, through the conversion of
    :mod:`kernels_gpu.ptx`; bfloat16's is a shift into the upper half of a float32)."""
    jit = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)
    if storage == "float32":
        @jit
        def identity(x):
            return float32(x)
        return identity
    from kernels_gpu import ptx
    unpack = ptx.unpack_f16x2 if storage == "float16" else ptx.unpack_bf16x2

    @jit
    def half(x):
        lo, _ = unpack(uint32(x))
        return lo
    return half


@functools.lru_cache(maxsize=None)
def _from_float(storage: str, simulator: bool):
    """A device function: float32 → the stored element (16-bit: bits, rounded to nearest even)."""
    jit = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)
    if storage == "float32":
        @jit
        def identity(x):
            return x
        return identity
    from kernels_gpu import ptx
    pack = ptx.pack_f16x2 if storage == "float16" else ptx.pack_bf16x2

    @jit
    def half(x):
        return uint16(uint32(pack(x, float32(0.0))) & uint32(0xFFFF))
    return half


@functools.lru_cache(maxsize=None)
def _tile_mover(rows: int, width: int, threads: int, stride: int, storage: str, simulator: bool):
    """``fetch(X, base, row0, n_valid, cols, t, reg)``: the rows × width tile of X whose first row is row0 (row r at
    ``base + r·stride``, the token stride a compile-time constant; rows past ``n_valid`` and columns past ``cols``
    are zero) into this thread's registers — element e = t + threads·u, so consecutive threads read consecutive
    elements — every load issued before any value is used; ``store(sm, off, sm_stride, scale, t, reg)``: those
    registers, times ``scale``, into shared memory (row r at off + r·sm_stride).

    When the block covers whole rows (threads a multiple of width), a thread always reads the same column of rows
    r0, r0 + threads/width, …: for a tile wholly inside the sequence its loads are one address plus compile-time
    offsets (a 64-bit address per load otherwise costs two registers each: the first version of this kernel
    spilled 2 KB at d = 128); the ragged last tile clamps each row (a select, not a branch)."""
    n = -(-rows * width // threads)
    step = threads // width if threads % width == 0 else 0
    regular = step > 0 and rows % step == 0
    jit = cuda.jit(device=True) if simulator else cuda.jit(device=True, inline=True)
    to_float = _to_float(storage, simulator)

    @jit
    def fetch(X, base, row0, n_valid, cols, t, reg):
        if regular:
            r0 = t // width
            c0 = t - r0 * width
            col_ok = c0 < cols
            c = min(c0, cols - 1)
            if row0 + rows <= n_valid:
                start = base + (row0 + r0) * stride + c
                for u in range(n):
                    x = to_float(X[uint64(start + u * step * stride)])
                    reg[u] = x if col_ok else float32(0.0)
            else:
                for u in range(n):
                    row = row0 + r0 + step * u
                    x = to_float(X[uint64(base + min(row, n_valid - 1) * stride + c)])
                    reg[u] = x if (col_ok and row < n_valid) else float32(0.0)
        else:
            for u in range(n):
                e = t + threads * u
                r = e // width
                c = e - r * width
                row = row0 + r
                x = to_float(X[uint64(base + min(row, n_valid - 1) * stride + min(c, cols - 1))])
                reg[u] = x if (row < n_valid and c < cols) else float32(0.0)

    @jit
    def store(sm, off, sm_stride, scale, t, reg):
        for u in range(n):
            e = t + threads * u
            r = e // width
            if r < rows:
                sm[uint64(off + r * sm_stride + e - r * width)] = reg[u] * scale

    return fetch, store, n


@functools.lru_cache(maxsize=None)
def _row_reducers(NX: int, TR: int, threads: int, simulator: bool):
    """``row_max(x, scratch, t)`` and ``row_sum(x, scratch, t)``: each of this thread's TR values combined over
    the NX consecutive lanes of its row (butterfly of ``shfl.sync.bfly``; in the simulator, which has no warp
    shuffles, an exchange through shared memory between barriers — every thread of the block calls them)."""
    if simulator:
        def make(combine_max):
            @cuda.jit(device=True)
            def reduce(x, scratch, t):
                mask = 1
                while mask < NX:
                    for r in range(TR):
                        scratch[t * TR + r] = x[r]
                    cuda.syncthreads()
                    for r in range(TR):
                        other = scratch[(t ^ mask) * TR + r]
                        x[r] = max(x[r], other) if combine_max else x[r] + other
                    cuda.syncthreads()
                    mask *= 2
            return reduce
        return make(True), make(False)

    def make_gpu(combine_max):
        @cuda.jit(device=True, inline=True)
        def reduce(x, scratch, t):
            mask = 1
            while mask < NX:
                for r in range(TR):
                    other = cuda.shfl_xor_sync(0xFFFFFFFF, x[r], mask)
                    x[r] = max(x[r], other) if combine_max else x[r] + other
                mask *= 2
        return reduce
    return make_gpu(True), make_gpu(False)


@functools.lru_cache(maxsize=None)
def varlen_kernel(storage: str, d: int, d_v: int, tiling: VarlenTiling, causal: bool, strides: tuple,
                  simulator: bool):
    """Compile-time specialisation: storage dtype, head sizes, tiling, causal. Grid (blocks of the map, H_q);
    block NY·NX threads; dynamic shared memory :func:`shared_floats` floats.

    ``strides``: the token strides (elements) of q, k, v, compiled in. Arguments: Qf, Kf, Vf (flat: float32, or
    uint16 bits), Of (flat, the storage's elements), L (float32), cu_q, cu_k, block_seq, block_row (int32), H_q,
    H_kv, q_sh, k_sh, v_sh (element strides of a head), total_q, scale2 (τ·log₂e)."""
    NY, NX, TR, TC = tiling
    B_r, B_c, T = tiling.B_r, tiling.B_c, tiling.threads
    lay = _layout(tiling, d, d_v)
    DP, TQ, QS, VS, PS = lay["DP"], lay["TQ"], lay["QS"], lay["VS"], lay["PS"]
    Q_OFF, K_OFF, V_OFF, P_OFF = lay["q_off"], lay["k_off"], lay["v_off"], lay["p_off"]
    TD = 4 * TQ                                         # output columns per thread: 4·tx + 4·NX·q + e
    S_REGS, O_REGS, QA_REGS, KA_REGS = TR * TC, TR * TD, 4 * TR, 4 * TC
    # Q_i moves in passes of at most 32 values per thread
    QROWS = B_r
    while QROWS * DP > 32 * T and QROWS % 2 == 0:
        QROWS //= 2
    q_sn, k_sn, v_sn = strides                          # token strides: compile-time constants (see _tile_mover)
    fetch_q, store_q, NQ = _tile_mover(QROWS, DP, T, q_sn, storage, simulator)
    fetch_k, store_k, NK = _tile_mover(B_c, DP, T, k_sn, storage, simulator)
    fetch_v, store_v, NV = _tile_mover(B_c, VS, T, v_sn, storage, simulator)
    row_max, row_sum = _row_reducers(NX, TR, T, simulator)
    from_float = _from_float(storage, simulator)
    from kernels_gpu import ptx
    ex2 = ptx.ex2
    CAUSAL = causal
    SIMULATOR = simulator
    SCRATCH = T * TR if simulator else 1
    NEG_INF = float32(-math.inf)

    @cuda.jit
    def varlen_forward(Qf, Kf, Vf, Of, L, cu_q, cu_k, block_seq, block_row, H_q, H_kv, q_sh, k_sh, v_sh, total_q,
                       scale2):
        t = cuda.threadIdx.x
        tx = t % NX
        ty = t // NX
        h = cuda.blockIdx.y
        h_kv = h // (H_q // H_kv)                       # GQA: query head h reads K/V head h // G
        # This block's sequence and row block (the host's map: longest work first).
        b = block_seq[cuda.blockIdx.x]
        row0 = int64(block_row[cuda.blockIdx.x]) * B_r
        q0 = int64(cu_q[b])
        n_q = int64(cu_q[b + 1]) - q0
        k0 = int64(cu_k[b])
        n_k = int64(cu_k[b + 1]) - k0
        offset = n_k - n_q                              # causal, bottom-right: row i sees key j iff j ≤ i + offset
        if SIMULATOR:
            sm = cuda.shared.array(0, float32)          # dynamic: Q_i, K_j, V_j, P̃ (the simulator refuses alignment)
        else:
            sm = cuda.shared.array(0, float32, alignment=16)
        scratch = cuda.shared.array(SCRATCH, float32)   # the simulator's shuffle emulation only
        s = cuda.local.array(S_REGS, float32)
        o = cuda.local.array(O_REGS, float32)
        m = cuda.local.array(TR, float32)
        l = cuda.local.array(TR, float32)
        x = cuda.local.array(TR, float32)
        qa = cuda.local.array(QA_REGS, float32)         # 4 columns of Q_i (then of P̃) for each of TR rows
        ka = cuda.local.array(KA_REGS, float32)
        va = cuda.local.array(TD, float32)
        qreg = cuda.local.array(NQ, float32)
        kreg = cuda.local.array(NK, float32)
        vreg = cuda.local.array(NV, float32)

        # Alg. 1 line 4: Q_i to shared memory, scaled by τ·log₂e (the softmax then uses 2^x); in passes.
        for qc in range(B_r // QROWS):
            fetch_q(Qf, h * q_sh + q0 * q_sn, row0 + qc * QROWS, n_q, d, t, qreg)
            store_q(sm, Q_OFF + qc * QROWS * QS, QS, scale2, t, qreg)
        # Alg. 1 line 5: Õ_i = 0, ℓ_i = 0, m_i = −inf (m in log₂ units).
        for e in range(O_REGS):
            o[e] = 0.0
        for r in range(TR):
            m[r] = NEG_INF
            l[r] = 0.0
        # The key tiles: all of the sequence's, or (causal) up to the one holding the last row's diagonal.
        T_c = (n_k + B_c - 1) // B_c
        if CAUSAL:
            last_row = min(row0 + B_r, n_q) - 1
            T_c = max(int64(0), min(T_c, (last_row + offset + B_c) // B_c))
        my_row0 = row0 + ty * TR
        k_base = h_kv * k_sh + k0 * k_sn
        v_base = h_kv * v_sh + k0 * v_sn
        # Alg. 1 line 7 for K_0: every load issued, then stored (rows past n_k: zeros, so padding makes no NaN).
        if T_c > 0:
            fetch_k(Kf, k_base, 0, n_k, d, t, kreg)
            store_k(sm, K_OFF, QS, float32(1.0), t, kreg)
        # Alg. 1 line 6: stream K_j, V_j of this sequence only. The loads of V_j are in flight while S_j is
        # computed, those of K_{j+1} while P̃_j V_j is: one tile's registers live at a time.
        for j in range(T_c):
            col0 = j * B_c
            cuda.syncthreads()                          # K_j stored; everyone is done with V_{j-1} and P̃
            fetch_v(Vf, v_base, col0, n_k, d_v, t, vreg)
            # Alg. 1 line 8: S = (τ Q_i) K_jᵀ, this thread's TR × TC (columns tx + NX·c), 4 values of d at a time
            # (one 16-byte shared load per row and step: rows are 16-byte aligned).
            for e in range(S_REGS):
                s[e] = 0.0
            for k4 in range(0, DP, 4):
                for r in range(TR):
                    for u in range(4):
                        qa[r * 4 + u] = sm[uint64(Q_OFF + (ty * TR + r) * QS + k4 + u)]
                for c in range(TC):
                    for u in range(4):
                        ka[c * 4 + u] = sm[uint64(K_OFF + (tx + NX * c) * QS + k4 + u)]
                for r in range(TR):
                    for c in range(TC):
                        acc = s[r * TC + c]
                        for u in range(4):
                            acc += qa[r * 4 + u] * ka[c * 4 + u]
                        s[r * TC + c] = acc
            # Mask (only tiles that need it): keys past n_k, and (causal) keys after a row's diagonal.
            if col0 + B_c > n_k or (CAUSAL and col0 + B_c - 1 > my_row0 + offset):
                for r in range(TR):
                    for c in range(TC):
                        col = col0 + tx + NX * c
                        if col >= n_k or (CAUSAL and col > my_row0 + r + offset):
                            s[r * TC + c] = NEG_INF
            # Alg. 1 line 9: m_new = max(m, rowmax S) over the row's NX lanes; P̃ = 2^(S − m_new);
            # ℓ = 2^(m − m_new) ℓ + rowsum P̃ (each lane its own columns; the lanes' ℓ are added after the loop).
            for r in range(TR):
                mx = m[r]
                for c in range(TC):
                    mx = max(mx, s[r * TC + c])
                x[r] = mx
            row_max(x, scratch, t)
            for r in range(TR):
                m_new = x[r]
                m_use = float32(0.0) if m_new == NEG_INF else m_new   # guard m = −inf: every exponential 0
                alpha = ex2(m[r] - m_use)
                ls = float32(0.0)
                for c in range(TC):
                    p = ex2(s[r * TC + c] - m_use)
                    ls += p
                    sm[uint64(P_OFF + (ty * TR + r) * PS + tx + NX * c)] = p
                l[r] = alpha * l[r] + ls
                m[r] = m_new
                # Alg. 1 line 10, first half: Õ = diag(2^(m − m_new)) Õ.
                if alpha != 1.0:
                    for e in range(TD):
                        o[r * TD + e] *= alpha
            store_v(sm, V_OFF, VS, float32(1.0), t, vreg)    # V_j arrived during S_j
            cuda.syncthreads()                          # P̃ and V_j complete; nobody reads K_j any more
            # Alg. 1 line 7 for K_{j+1}: issued now, in flight during P̃_j V_j (the last tile reloads its own K_j:
            # a clamped index instead of a branch).
            fetch_k(Kf, k_base, min(j + 1, T_c - 1) * B_c, n_k, d, t, kreg)
            # Alg. 1 line 10, second half: Õ += P̃ V_j, 4 columns of P̃ (rows of V_j) at a time.
            for c4 in range(0, B_c, 4):
                for r in range(TR):
                    for u in range(4):
                        qa[r * 4 + u] = sm[uint64(P_OFF + (ty * TR + r) * PS + c4 + u)]
                for u in range(4):
                    for q in range(TQ):
                        for e in range(4):
                            va[q * 4 + e] = sm[uint64(V_OFF + (c4 + u) * VS + 4 * tx + 4 * NX * q + e)]
                    for r in range(TR):
                        for e in range(TD):
                            o[r * TD + e] += qa[r * 4 + u] * va[e]
            store_k(sm, K_OFF, QS, float32(1.0), t, kreg)    # K_{j+1} replaces K_j
        # Alg. 1 line 12: ℓ = the sum of the row's NX partial sums.
        for r in range(TR):
            x[r] = l[r]
        row_sum(x, scratch, t)
        for r in range(TR):
            row = my_row0 + r
            if row < n_q:
                l_i = x[r]
                # O = diag(ℓ)^{-1} Õ, guarded where ℓ = 0 (a row that saw no key): O = 0.
                inv = float32(0.0) if l_i == 0.0 else float32(1.0) / l_i
                out_row = (h * total_q + q0 + row) * d_v
                for q in range(TQ):
                    for e in range(4):
                        col = 4 * tx + 4 * NX * q + e
                        if col < d_v:
                            Of[out_row + col] = from_float(o[r * TD + q * 4 + e] * inv)
                # Alg. 1 lines 13, 15: L = m + log ℓ in natural units (m in log₂ units); +inf if ℓ = 0.
                if tx == 0:
                    L[h * total_q + q0 + row] = (math.inf if l_i == 0.0
                                                 else float32(LN2) * (m[r] + math.log2(l_i)))

    return varlen_forward


# -- the host side ---------------------------------------------------------------------------------------------------

def block_map(cu_q: np.ndarray, cu_k: np.ndarray, B_r: int, B_c: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, row block) of every block of the grid, the most work first: the row blocks of every sequence with
    queries (T_r(n_q) = ceil(n_q / B_r) each), ordered by the key tiles each visits (all ceil(n_k / B_c), or,
    causal, those up to its last row's diagonal), ties in sequence order. Returns two int32 arrays."""
    seqs, rows, work = [], [], []
    n_q, n_k = np.diff(cu_q), np.diff(cu_k)
    for b in range(n_q.size):
        T_r = -(-int(n_q[b]) // B_r)
        T_c = -(-int(n_k[b]) // B_c)
        for i in range(T_r):
            tiles = T_c
            if causal:
                last = min((i + 1) * B_r, int(n_q[b])) - 1 + int(n_k[b]) - int(n_q[b])
                tiles = max(0, min(T_c, (last + B_c) // B_c))
            seqs.append(b)
            rows.append(i)
            work.append(tiles)
    order = np.argsort(-np.asarray(work, dtype=np.int64), kind="stable")
    return (np.asarray(seqs, dtype=np.int32)[order], np.asarray(rows, dtype=np.int32)[order])


def _offsets(x, name: str, total: int) -> np.ndarray:
    """Host values of a cu_seqlens argument, checked by fa2edu's rule (device data is copied back: the grid's map
    is built on the host)."""
    ix = io.index(x, name, 1)
    if ix.host is not None:
        values = ix.host
    elif type(ix.flat.keep).__module__.startswith("torch"):
        values = ix.flat.keep.cpu().numpy()
    else:
        values = np.asarray(cuda.as_cuda_array(ix.flat.keep).copy_to_host())
    return check_cu_seqlens(values, name, total)


def _element_view(t: io.Tensor, name: str) -> tuple[io.Flat, tuple]:
    """(flat array of elements: float32 or uint16 bits, element strides (head, token)) of a 3-D operand."""
    view = np.float32 if t.storage == "float32" else np.uint16
    if t.on_device:
        if t.strides[-1] != 1:
            raise ValueError(f"{name} must have a contiguous last axis (stride 1), got strides {t.strides}")
        return io.device_flat(t, view), t.strides[:2]
    host = io.host_bits(t.host, t.storage)
    return io._numba_flat(cuda.to_device(host if host.size else np.zeros(1, host.dtype))), \
        tuple(s // host.itemsize for s in host.strides[:2])


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, *,
                     tiling: VarlenTiling | None = None) -> Flash2Forward:
    """FA2's forward pass (Alg. 1) over a packed batch on the GPU — :func:`fa2edu.varlen_attention`'s semantics.

    Parameters
    ----------
    q : array, shape (H_q, total_q, d)
        Queries of all sequences, packed along axis 1: float32, float16 or bfloat16 (PyTorch); NumPy float64 is
        stored as float32. Device arrays are read in place (last axis contiguous).
    k : array, shape (H_kv, total_k, d)
        Keys, packed; q's kind and dtype; H_q a multiple of H_kv.
    v : array, shape (H_kv, total_k, d_v)
        Values, packed as ``k``.
    cu_seqlens_q : array of int, shape (B + 1,)
        Query offsets: non-decreasing from 0 to total_q. Host or device data; device offsets are copied to the host
        (the grid's map is built there: one synchronisation).
    cu_seqlens_k : array of int, shape (B + 1,)
        Key offsets: non-decreasing from 0 to total_k, as many sequences as ``cu_seqlens_q``.
    causal : bool, default False
        Bottom-right causal within each sequence; rows that see no key get O = 0, L = +inf.
    scale : float, optional
        The softmax scale τ; default 1/√d.
    tiling : VarlenTiling, optional
        The thread tiling (default :func:`default_varlen_tiling`).

    Returns
    -------
    Flash2Forward
        ``(O, L)``: O (H_q, total_q, d_v) in the storage dtype, L (H_q, total_q) float32, in the caller's kind.

    Raises
    ------
    ValueError
        Bad shapes, H_q not a multiple of H_kv, offsets that do not start at 0, decrease or miss the packed
        lengths, different sequence counts; on host data, NaN or inf in q, k or v, or NumPy float64 values beyond
        float32 (their storage).
    fa2edu.validation.AttentionOverflowError
        On host data: finite q and k whose scores within a sequence would overflow float32 (named q and k, with
        the sequence), as ``fa2edu.varlen_attention`` raises. Device data is read in place and its values are not
        checked (a second pass over q, k, v in HBM and a host synchronisation on every call): NaN, inf or
        overflowing scores there give what the arithmetic gives.
    TypeError
        Unsupported kinds or dtypes, mixed kinds or dtypes, a non-bool ``causal``.

    Notes
    -----
    Cost per query head: Σ_b FA2's forward on sequence b alone (see the module header); a padded batch costs the
    same with every length replaced by the longest.
    """
    rt.require_device()
    tq, tk, tv = io.tensor(q, "q"), io.tensor(k, "k"), io.tensor(v, "v")
    kind = io.check_kinds(tq, tk, tv)
    for t, text in ((tq, "(H_q, total_q, d)"), (tk, "(H_kv, total_k, d)"), (tv, "(H_kv, total_k, d_v)")):
        if len(t.shape) != 3:
            raise ValueError(f"{t.name} must have shape {text}, got shape {t.shape}")
    H_q, total_q, d = tq.shape
    H_kv, total_k, d_v = tv.shape
    if tk.shape[2] != d:
        raise ValueError(f"k's head dimension must equal q's: q has d = {d}, k has {tk.shape[2]}")
    if tk.shape[:2] != tv.shape[:2]:
        raise ValueError(f"k and v must have the same heads and packed length, got {tk.shape} and {tv.shape}")
    if min(H_q, H_kv, d, d_v) == 0:
        raise ValueError(f"heads and head dimensions must be at least 1, got q {tq.shape}, k {tk.shape}, "
                         f"v {tv.shape}")
    if H_q % H_kv:
        raise ValueError(f"the number of query heads H_q = {H_q} must be a multiple of the number of key/value "
                         f"heads H_kv = {H_kv} (GQA/MQA)")
    cu_q = _offsets(cu_seqlens_q, "cu_seqlens_q", total_q)
    cu_k = _offsets(cu_seqlens_k, "cu_seqlens_k", total_k)
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same B sequences, got {cu_q.size - 1} "
                         f"and {cu_k.size - 1}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    tau = check_scale(scale, d)
    if not tq.on_device:
        # Host data is copied to the device here: its values are checked first, as fa2edu.varlen_attention checks
        # them (finite q, k, v; each sequence's scores within float32, the kernel's arithmetic). Device data is read
        # in place and not checked (a second pass over it in HBM, and a host synchronisation, on every call).
        check_varlen_values(io.host_values(tq), io.host_values(tk), io.host_values(tv), cu_q, cu_k, tau, np.float32,
                            float64_helps=False)
        for t in (tq, tk, tv):
            if t.host.dtype == np.float64 and t.host.size and float(np.max(np.abs(t.host))) > np.finfo(np.float32).max:
                raise ValueError(f"{t.name} has values beyond the range of float32: it cannot be stored as float32")
    tiling = default_varlen_tiling(max(d, d_v)) if tiling is None else VarlenTiling(*tiling)
    if (tiling.NX not in (1, 2, 4, 8, 16, 32) or min(tiling) < 1 or tiling.threads > rt.MAX_THREADS
            or tiling.B_c % 4):
        raise ValueError(f"tiling needs NX a power of two ≤ 32, all sizes ≥ 1, B_c = NX·TC a multiple of 4 and at "
                         f"most {rt.MAX_THREADS} threads, got {tiling}")
    nbytes = 4 * shared_floats(tiling, d, d_v)
    if nbytes > MAX_SHARED_BYTES:
        raise ValueError(f"tiling {tiling} needs {nbytes} bytes of shared memory at d = {d}, d_v = {d_v}; a block "
                         f"may have {MAX_SHARED_BYTES}: choose a smaller tiling")
    storage = tq.storage
    (Qf, q_str), (Kf, k_str), (Vf, v_str) = (_element_view(t, n) for t, n in ((tq, "q"), (tk, "k"), (tv, "v")))
    out = io.Outputs(kind, getattr(q, "device", None))
    O_user, Of = out.empty((H_q, total_q, d_v), storage)
    L_user, Lf = out.empty((H_q, total_q), "float32")
    seqs, rows = block_map(cu_q, cu_k, tiling.B_r, tiling.B_c, bool(causal))
    if seqs.size:
        kernel = varlen_kernel(storage, d, d_v, tiling, bool(causal), (q_str[1], k_str[1], v_str[1]),
                               rt.simulator_in_use())
        i64 = np.int64
        args = (Qf, Kf, Vf, Of, Lf, io.upload_index(cu_q, "cu_seqlens_q"), io.upload_index(cu_k, "cu_seqlens_k"),
                io.upload_index(seqs, "block map"), io.upload_index(rows, "block map"), i64(H_q), i64(H_kv),
                i64(q_str[0]), i64(k_str[0]), i64(v_str[0]), i64(total_q), np.float32(float(tau) * LOG2E))
        io.launch(kernel, (seqs.size, H_q), tiling.threads, io.stream_of(kind, getattr(q, "device", None)), args,
                  shared_bytes=nbytes)
    return Flash2Forward(out.finish(O_user, storage), out.finish(L_user, "float32"))
