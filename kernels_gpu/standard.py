"""Standard attention as separate numba.cuda kernels: FA1 Algorithm 0 (forward) and Algorithm 3 (backward).

This is the baseline FlashAttention beats. Each line of the algorithms is its own kernel launch that reads its
operands from global memory and writes its result back, so the N_q × N_k matrices S, P (and dP, dS in the backward
pass) are *materialised* in HBM: Θ(N²) memory and traffic (FA1 Theorems 2 and 5).

* :func:`matmul_kernel` — a tiled matrix product in shared memory (T × T threads per block, each computing one
  element of C; the T × T tiles of the two operands are loaded cooperatively and reused T times from shared memory).
  One kernel serves every product of both passes: operands may be transposed (compile-time flags) and the head
  mapping is an argument, ``C[z, h] = α Σ_{g<n_sum} op(A[z, h·a_mul + g]) op(B[z, (h·b_mul + g) // b_div])``, which
  expresses both GQA's broadcast (query head h reads K/V head h // G) and its reduction (dK, dV summed over a group).
* :func:`softmax_kernel` — one thread block per row of S: each thread streams a strided slice of the row keeping the
  online statistics (m, ℓ) (:mod:`fa2edu.softmax`), the block merges them with a tree reduction in shared memory
  (the (m, ℓ) merge: associative, so any tree works), then P = exp(S − m)/ℓ is written. The causal mask is applied
  as S is read (masked scores count as −inf; a fully masked row gives P = 0). It reads S twice (statistics, then
  normalisation) where Algorithm 0 counts one read: a row of N_k scores need not fit on chip.
* :func:`softmax_backward_kernel` — one thread block per row: D_i = Σ_j P_ij dP_ij by a tree reduction, then
  dS_ij = P_ij (dP_ij − D_i) (FA1 Alg. 3 line 3).

No warp shuffles anywhere: the reductions are shared-memory trees, so the same kernels run in the CUDA simulator.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from fa2edu.standard import StandardBackward, StandardForward
from kernels_gpu import runtime as rt

__all__ = ["StandardForward", "StandardBackward", "standard_attention", "standard_attention_backward",
           "DEFAULT_TILE"]

#: Default matmul tile: 16 × 16 threads per block; the row kernels use TILE² = 256 threads.
DEFAULT_TILE = 16


@functools.lru_cache(maxsize=None)
def matmul_kernel(T: int, trans_a: bool, trans_b: bool):
    """``C[z, h] = α Σ_g op(A[z, h·a_mul + g]) op(B[z, (h·b_mul + g) // b_div])`` with T × T tiles in shared memory.

    ``op`` transposes the last two axes when ``trans_a`` / ``trans_b``. Grid: (ceil(cols/T), ceil(rows/T), Z·H_C),
    block (T, T); thread (x, y) computes C[row = by·T + y, col = bx·T + x]. Cost: 2·rows·cols·inner·n_sum FLOPs.
    """

    @cuda.jit
    def batched_matmul_kernel(A, B, C, alpha, a_mul, b_mul, b_div, n_sum):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        col = cuda.blockIdx.x * T + tx
        row = cuda.blockIdx.y * T + ty
        H = C.shape[1]
        z = cuda.blockIdx.z // H
        h = cuda.blockIdx.z % H
        n_rows = C.shape[2]
        n_cols = C.shape[3]
        inner = A.shape[2] if trans_a else A.shape[3]

        A_tile = cuda.shared.array((T, T), float32)      # one shared.array per source line (simulator aliasing)
        B_tile = cuda.shared.array((T, T), float32)
        acc = float32(0.0)
        for g in range(n_sum):
            h_a = h * a_mul + g
            h_b = (h * b_mul + g) // b_div
            for k0 in range(0, inner, T):
                # Load one T × T tile of op(A) (rows of C × inner index) and of op(B) (inner index × columns of C);
                # out-of-range entries are 0 so that ragged edges add nothing. Neighbouring threads (tx) always
                # read neighbouring addresses (coalesced): a transposed operand is read along its own rows and
                # stored transposed into shared memory.
                if trans_a:
                    r = cuda.blockIdx.y * T + tx
                    k = k0 + ty
                    a = float32(0.0)
                    if r < n_rows and k < inner:
                        a = A[z, h_a, k, r]
                    A_tile[tx, ty] = a
                else:
                    k = k0 + tx
                    a = float32(0.0)
                    if row < n_rows and k < inner:
                        a = A[z, h_a, row, k]
                    A_tile[ty, tx] = a
                if trans_b:
                    c = cuda.blockIdx.x * T + ty
                    k = k0 + tx
                    b = float32(0.0)
                    if k < inner and c < n_cols:
                        b = B[z, h_b, c, k]
                    B_tile[tx, ty] = b
                else:
                    k = k0 + ty
                    b = float32(0.0)
                    if k < inner and col < n_cols:
                        b = B[z, h_b, k, col]
                    B_tile[ty, tx] = b
                cuda.syncthreads()
                for kk in range(T):
                    acc += A_tile[ty, kk] * B_tile[kk, tx]
                cuda.syncthreads()                        # the tiles are reloaded next step
        if row < n_rows and col < n_cols:
            C[z, h, row, col] = alpha * acc

    return batched_matmul_kernel


@functools.lru_cache(maxsize=None)
def softmax_kernel(W: int):
    """P = softmax(S) row by row with the causal mask applied as S is read; W (a power of two) threads per row."""

    @cuda.jit
    def row_softmax_kernel(S, P, causal):
        row = cuda.blockIdx.x
        H = S.shape[1]
        z = cuda.blockIdx.y // H
        h = cuda.blockIdx.y % H
        t = cuda.threadIdx.x
        N_k = S.shape[3]
        offset = N_k - S.shape[2]                         # causal, bottom-right: row sees col iff col <= row + offset
        m_part = cuda.shared.array(W, float32)
        l_part = cuda.shared.array(W, float32)

        # Online statistics of this thread's columns t, t + W, …: m = max, ℓ = Σ exp(S − m).
        m = float32(-math.inf)
        l = float32(0.0)  # noqa: E741 (the paper's ℓ)
        for col in range(t, N_k, W):
            if not (causal and col > row + offset):
                x = S[z, h, row, col]
                m_new = max(m, x)
                l = l * math.exp(m - m_new) + math.exp(x - m_new)   # e^{−inf − m_new} = 0 while m = −inf
                m = m_new
        m_part[t] = m
        l_part[t] = l
        cuda.syncthreads()
        # Tree reduction with the (m, ℓ) merge: m = max(m_a, m_b), ℓ = e^{m_a − m} ℓ_a + e^{m_b − m} ℓ_b.
        stride = W // 2
        while stride > 0:
            if t < stride:
                m_a = m_part[t]
                m_b = m_part[t + stride]
                m_ab = max(m_a, m_b)
                if m_ab != -math.inf:                     # guard m = −inf: both halves empty stay (−inf, 0)
                    l_part[t] = l_part[t] * math.exp(m_a - m_ab) + l_part[t + stride] * math.exp(m_b - m_ab)
                    m_part[t] = m_ab
            cuda.syncthreads()
            stride //= 2
        m = m_part[0]
        l = l_part[0]
        # P = exp(S − m) / ℓ; 0 where masked and on a fully masked row (ℓ = 0: guard before dividing).
        for col in range(t, N_k, W):
            p = float32(0.0)
            if l != 0.0 and not (causal and col > row + offset):
                p = math.exp(S[z, h, row, col] - m) / l
            P[z, h, row, col] = p

    return row_softmax_kernel


@functools.lru_cache(maxsize=None)
def softmax_backward_kernel(W: int):
    """FA1 Alg. 3 line 3 row by row: D_i = Σ_j P_ij dP_ij, dS_ij = P_ij (dP_ij − D_i); W threads per row."""

    @cuda.jit
    def row_softmax_backward_kernel(P, dP, dS):
        row = cuda.blockIdx.x
        H = P.shape[1]
        z = cuda.blockIdx.y // H
        h = cuda.blockIdx.y % H
        t = cuda.threadIdx.x
        N_k = P.shape[3]
        part = cuda.shared.array(W, float32)
        acc = float32(0.0)
        for col in range(t, N_k, W):
            acc += P[z, h, row, col] * dP[z, h, row, col]
        part[t] = acc
        cuda.syncthreads()
        stride = W // 2
        while stride > 0:
            if t < stride:
                part[t] += part[t + stride]
            cuda.syncthreads()
            stride //= 2
        D_i = part[0]
        for col in range(t, N_k, W):
            dS[z, h, row, col] = P[z, h, row, col] * (dP[z, h, row, col] - D_i)

    return row_softmax_backward_kernel


def _check_tile(tile) -> int:
    tile = DEFAULT_TILE if tile is None else tile
    if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)):
        raise TypeError(f"tile must be an int, got {type(tile).__name__}")
    if tile < 1 or tile & (tile - 1) or tile > 32:
        raise ValueError(f"tile must be a power of two between 1 and 32 (tile² threads per block), got {tile}")
    return int(tile)


def _matmul(A, B, C, *, trans_a: bool, trans_b: bool, T: int, alpha=1.0, a_mul=1, b_mul=1, b_div=1, n_sum=1,
            names=("A", "B", "C")):
    """Launch :func:`matmul_kernel` over the whole of C (Z, H_C, rows, cols)."""
    Z, H_C, n_rows, n_cols = C.shape
    grid = (rt.grid_size(n_cols, T), rt.grid_size(n_rows, T), Z * H_C)
    matmul_kernel(T, trans_a, trans_b)[grid, (T, T)](
        rt.tally(names[0], A), rt.tally(names[1], B), rt.tally(names[2], C),
        np.float32(alpha), a_mul, b_mul, b_div, n_sum)


def standard_attention(Q, K, V, causal=False, scale=None, tile=None) -> StandardForward:
    """Standard attention on the GPU (FA1 Algorithm 0, Alg. 2's τ and causal mask): ``StandardForward(O, P)``.

    Three launches, each through global memory: S = τQKᵀ (Alg. 0 line 1), P = softmax(S) (line 2), O = PV (line 3).

    Cost per (batch, head), N_q = N_k = N: 4N²d FLOPs; memory N² floats each for S and P; global traffic in the
    paper's count 3Nd + 2N² reads and Nd + 2N² writes (the softmax kernel reads S twice; a tiled matmul re-reads
    operand tiles from L2).

    Parameters
    ----------
    Q : array, shape (..., N_q, d)
        Queries: a NumPy array (float16, float32 or float64, checked as fa2edu checks it, copied to the device as
        float32) or a float32 device array (numba, or anything with ``__cuda_array_interface__`` such as a CUDA PyTorch
        tensor), used in place. Heads on the axis before N_q.
    K : array, shape (..., N_k, d)
        Keys, of the same kind as Q (all NumPy or all device arrays), with Q's batch axes and H_kv heads; H_q must be a
        multiple of H_kv (GQA/MQA).
    V : array, shape (..., N_k, d_v)
        Values, of the same kind as Q, with K's leading axes.
    causal : bool, default False
        Apply the causal mask aligned to the bottom-right corner: query i sees key j iff j ≤ i + N_k − N_q.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.
    tile : int, optional
        T, for T × T threads per block of the matmul and softmax kernels: a power of two ≤ 32. Default None: 16.

    Returns
    -------
    StandardForward
        ``(O, P)``, float32: O (..., N_q, d_v) and P (..., N_q, N_k); NumPy arrays for NumPy inputs, numba device arrays
        for device inputs.
    """
    layout, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale)
    T = _check_tile(tile)
    Z, H_q, N_q, N_k, d_v = layout.Z, layout.H_q, layout.N_q, layout.N_k, layout.d_v
    # Alg. 0 line 1: load Q, K by blocks from HBM, compute S = τ Q Kᵀ, write S to HBM.
    S = rt.device_empty((Z, H_q, N_q, N_k))
    _matmul(Q4, K4, S, trans_a=False, trans_b=True, T=T, alpha=tau, b_div=layout.G, names=("Q", "K", "S"))
    # Alg. 0 line 2 (with Alg. 2's MASK): read S from HBM, compute P = softmax(S), write P to HBM.
    P = rt.device_empty((Z, H_q, N_q, N_k))
    softmax_kernel(T * T)[(N_q, Z * H_q), T * T](rt.tally("S", S), rt.tally("P", P), bool(causal))
    # Alg. 0 line 3: load P and V by blocks from HBM, compute O = PV, write O to HBM.
    O = rt.device_empty((Z, H_q, N_q, d_v))
    _matmul(P, V4, O, trans_a=False, trans_b=False, T=T, b_div=layout.G, names=("P", "V", "O"))
    return StandardForward(rt.finish(O, layout, (N_q, d_v)), rt.finish(P, layout, (N_q, N_k)))


def standard_attention_backward(Q, K, V, P, dO, causal=False, scale=None, tile=None) -> StandardBackward:
    """Standard attention backward on the GPU (FA1 Algorithm 3): ``StandardBackward(dQ, dK, dV)``.

    ``P`` (..., N_q, N_k) is :func:`standard_attention`'s; it already holds the causal mask (masked P = 0, hence
    dS = 0), so ``causal`` is accepted for a uniform interface and needs no work. dK, dV sum over each GQA group.
    Five launches through global memory: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D), dQ = τ dS K, dK = τ dSᵀ Q.

    Cost per (batch, head), N_q = N_k = N: 8N²d FLOPs; memory 2N² floats for dP, dS; traffic in the paper's count
    5Nd + 5N² reads and 3Nd + 2N² writes.

    Parameters
    ----------
    Q : array, shape (..., N_q, d)
        Queries: a NumPy array (float16, float32 or float64, checked as fa2edu checks it, copied to the device as
        float32) or a float32 device array (numba, or anything with ``__cuda_array_interface__`` such as a CUDA PyTorch
        tensor), used in place. Heads on the axis before N_q.
    K : array, shape (..., N_k, d)
        Keys, of the same kind as Q (all NumPy or all device arrays), with Q's batch axes and H_kv heads; H_q must be a
        multiple of H_kv (GQA/MQA).
    V : array, shape (..., N_k, d_v)
        Values, of the same kind as Q, with K's leading axes.
    P : array, shape (..., N_q, N_k)
        The probabilities that :func:`standard_attention` returned, of the same kind as Q (NumPy or device float32).
    dO : array, shape (..., N_q, d_v)
        Gradient of the loss with respect to O, of the same kind as Q (NumPy or device float32).
    causal : bool, default False
        Accepted for a uniform interface: P already holds the causal mask (masked P = 0, hence dS = 0), so it needs no
        work.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.
    tile : int, optional
        T, for T × T threads per block of the matmul and softmax kernels: a power of two ≤ 32. Default None: 16.

    Returns
    -------
    StandardBackward
        ``(dQ, dK, dV)``, float32, shaped like Q, K and V (dK, dV summed over each GQA group); NumPy arrays for NumPy
        inputs, numba device arrays for device inputs.
    """
    layout, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale)
    T = _check_tile(tile)
    Z, H_q, H_kv, G = layout.Z, layout.H_q, layout.H_kv, layout.G
    N_q, N_k, d, d_v = layout.N_q, layout.N_k, layout.d, layout.d_v
    P4 = rt.prepare_like(P, "P", layout, (N_q, N_k))
    dO4 = rt.prepare_like(dO, "dO", layout, (N_q, d_v))
    # Alg. 3 line 1: load P, dO by blocks from HBM, compute dV = Pᵀ dO (summed over the GQA group), write dV.
    dV = rt.device_empty((Z, H_kv, N_k, d_v))
    _matmul(P4, dO4, dV, trans_a=True, trans_b=False, T=T, a_mul=G, b_mul=G, n_sum=G, names=("P", "dO", "dV"))
    # Alg. 3 line 2: load dO, V by blocks from HBM, compute dP = dO Vᵀ, write dP to HBM.
    dP = rt.device_empty((Z, H_q, N_q, N_k))
    _matmul(dO4, V4, dP, trans_a=False, trans_b=True, T=T, b_div=G, names=("dO", "V", "dP"))
    # Alg. 3 line 3: read P, dP from HBM, compute dS_ij = P_ij (dP_ij − Σ_l P_il dP_il), write dS to HBM.
    dS = rt.device_empty((Z, H_q, N_q, N_k))
    softmax_backward_kernel(T * T)[(N_q, Z * H_q), T * T](rt.tally("P", P4), rt.tally("dP", dP), rt.tally("dS", dS))
    # Alg. 3 line 4: load dS and K by blocks from HBM, compute dQ = τ dS K, write dQ to HBM.
    dQ = rt.device_empty((Z, H_q, N_q, d))
    _matmul(dS, K4, dQ, trans_a=False, trans_b=False, T=T, alpha=tau, b_div=G, names=("dS", "K", "dQ"))
    # Alg. 3 line 5: load dS and Q by blocks from HBM, compute dK = τ dSᵀ Q (summed over the group), write dK.
    dK = rt.device_empty((Z, H_kv, N_k, d))
    _matmul(dS, Q4, dK, trans_a=True, trans_b=False, T=T, alpha=tau, a_mul=G, b_mul=G, n_sum=G,
            names=("dS", "Q", "dK"))
    return StandardBackward(rt.finish(dQ, layout, (N_q, d)), rt.finish(dK, layout, (N_k, d), per_query=False),
                            rt.finish(dV, layout, (N_k, d_v), per_query=False))
