"""FlashAttention-2 as numba.cuda kernels: forward (FA2 Algorithm 1) and backward (FA2 Algorithm 2).

These are the *teaching* kernels: each mirrors :func:`fa2edu.flash2.flash2_forward` / ``flash2_backward`` line for
line, with the same ``# Alg. 1 line …`` comments, and chooses the simplest mapping of the algorithm onto threads.

**Forward** (FA2 Section 3.2): one thread block per (row block i, batch z, query head h), B_r threads, thread t owns
query row ``i·B_r + t``. Its row of Q_i, its accumulator Õ_i and its statistics m, ℓ live in the thread's registers
(on chip) for the whole loop; the K_j, V_j tiles are loaded into shared memory cooperatively (each element read from
global memory once per thread block) and streamed. O_i and L_i are written once. Global traffic per (batch, head):
reads Nd + 2·N_k·d·T_r, writes Nd + N: exactly fa2edu's ledger (tests/test_kernels_io.py checks it).

**Backward** (FA2 Section 3.2): one thread block per (column block j, batch z, key/value head), B_c threads, thread t
owns key row ``j·B_c + t`` with its V_j row and its dK_j, dV_j accumulators in registers; K_j sits in shared memory
because every thread needs all of it for dQ_i. The inner loop streams (Q_i, dO_i, L_i, D_i) through shared memory,
puts dS_ij in shared memory, and adds τ·dS_ij·K_j into dQ_i in global memory with ``cuda.atomic.add`` (other column
blocks update the same rows concurrently). GQA: the block loops over the G query heads that share its K/V head, so
dK, dV are summed over the group in registers — no atomics, K_j and V_j loaded once per group.
``deterministic=True`` replaces the atomics by a separate dQ kernel, one thread block per (row block, batch, query
head), each thread summing its dQ row over the column blocks in a fixed order: bit-identical results, at the price
of recomputing S and dP once more (the atomic version is the one whose IO matches the ledger).

Fully masked rows (causal with N_q > N_k): m stays −inf and ℓ = 0, so O = 0 and L = +inf; in the backward
``exp(S − L) = 0``, so their gradients are 0. Causal blocks entirely above the diagonal are skipped (no loads).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from fa2edu.flash2 import Flash2Backward, Flash2Forward
from kernels_gpu import runtime as rt

__all__ = ["Flash2Forward", "Flash2Backward", "flash2_forward", "flash2_backward"]


# -- forward ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def forward_kernel(B_r: int, B_c: int, d: int, d_v: int):
    """The FA2 forward kernel for one tile shape (compiled on first launch, cached per shape)."""

    @cuda.jit
    def flash2_forward_kernel(Q, K, V, O, L, tau, causal):
        # Grid: (T_r, Z, H_q); block: B_r threads. Thread t owns query row `row` of row block i.
        i = cuda.blockIdx.x
        z = cuda.blockIdx.y
        h = cuda.blockIdx.z
        t = cuda.threadIdx.x
        N_q = Q.shape[2]
        N_k = K.shape[2]
        h_kv = h // (Q.shape[1] // K.shape[1])          # GQA: query head h reads K/V head h // G
        row = i * B_r + t
        active = row < N_q                                # the last row block may be ragged
        offset = N_k - N_q                                # causal, bottom-right: row sees col iff col <= row + offset

        K_j = cuda.shared.array((B_c, d), float32)        # (one shared.array per source line: the simulator
        V_j = cuda.shared.array((B_c, d_v), float32)      #  aliases two on the same line)
        q = cuda.local.array(d, float32)                  # this thread's row of Q_i
        o = cuda.local.array(d_v, float32)                # this thread's row of Õ_i
        s = cuda.local.array(B_c, float32)                # this thread's row of S_i^(j), then P̃_i^(j)

        # Alg. 1 line 4: load Q_i from HBM to on-chip memory (this thread's row, into registers).
        if active:
            for k in range(d):
                q[k] = Q[z, h, row, k]
        # Alg. 1 line 5: on chip, Õ_i = 0, ℓ_i = 0, m_i = −inf.
        for k in range(d_v):
            o[k] = 0.0
        l_i = float32(0.0)
        m_i = float32(-math.inf)

        # FA2 Section 3.1 (causal): column blocks entirely above the diagonal are skipped, and they are all the
        # blocks past the one holding column last_row + offset, so the loop simply stops there.
        T_c = (N_k + B_c - 1) // B_c
        if causal:
            last_row = min(i * B_r + B_r, N_q) - 1
            T_c = max(0, min(T_c, (last_row + offset + B_c) // B_c))
        # Alg. 1 line 6: stream the K/V blocks j = 1 … T_c through shared memory.
        for j in range(T_c):
            col0 = j * B_c
            cols = min(B_c, N_k - col0)
            cuda.syncthreads()                            # every thread is done with the previous K_j, V_j
            # Alg. 1 line 7: load K_j, V_j from HBM to shared memory, each element once, rows shared out over threads.
            for c in range(t, cols, B_r):
                for k in range(d):
                    K_j[c, k] = K[z, h_kv, col0 + c, k]
                for k in range(d_v):
                    V_j[c, k] = V[z, h_kv, col0 + c, k]
            cuda.syncthreads()
            if active:
                # Alg. 1 line 8: S_i^(j) = τ Q_i K_jᵀ (this thread's row), −inf where the causal mask hides a key;
                # Alg. 1 line 9 (first part): m_i^(j) = max(m_i^(j−1), rowmax(S_i^(j))).
                m_new = m_i
                for c in range(cols):
                    acc = float32(0.0)
                    for k in range(d):
                        acc += q[k] * K_j[c, k]
                    acc *= tau
                    if causal and col0 + c > row + offset:
                        acc = float32(-math.inf)
                    s[c] = acc
                    m_new = max(m_new, acc)
                # Guard m = −inf (every key so far masked): then every exponential below must be exactly 0.
                if m_new == -math.inf:
                    alpha = float32(0.0)
                else:
                    # e^{m_old − m_new}, which is e^{−inf} = 0 while m_old = −inf.
                    alpha = math.exp(m_i - m_new)
                # Alg. 1 line 9: P̃_i^(j) = exp(S_i^(j) − m_i^(j)),  ℓ_i^(j) = e^{m_old − m_new} ℓ_i^(j−1) + rowsum(P̃).
                rowsum = float32(0.0)
                for c in range(cols):
                    p = float32(0.0) if m_new == -math.inf else math.exp(s[c] - m_new)
                    s[c] = p
                    rowsum += p
                l_i = alpha * l_i + rowsum
                # Alg. 1 line 10: Õ_i^(j) = diag(e^{m_old − m_new}) Õ_i^(j−1) + P̃_i^(j) V_j  (no inverse: erratum 4).
                for k in range(d_v):
                    acc = alpha * o[k]
                    for c in range(cols):
                        acc += s[c] * V_j[c, k]
                    o[k] = acc
                m_i = m_new

        if active:
            # Alg. 1 line 12: O_i = diag(ℓ_i)^{-1} Õ_i, the one normalisation. Guard ℓ = 0 (a row that saw no key):
            # its Õ_i is 0 and O_i must be 0, not 0/0.
            inv_l = float32(0.0) if l_i == 0.0 else float32(1.0) / l_i
            # Alg. 1 line 14: write O_i to HBM, once.
            for k in range(d_v):
                O[z, h, row, k] = o[k] * inv_l
            # Alg. 1 lines 13, 15: L_i = m_i + log ℓ_i, +inf for a fully masked row (so exp(S − L) = 0 later).
            L[z, h, row] = math.inf if l_i == 0.0 else m_i + math.log(l_i)

    return flash2_forward_kernel


def flash2_forward(Q, K, V, block_sizes=None, causal=False, scale=None) -> Flash2Forward:
    """FlashAttention-2 forward pass on the GPU (FA2 Algorithm 1): ``Flash2Forward(O, L)``.

    Cost per (batch, head), N_q = N_k = N, not causal: 4N²d FLOPs; global reads Nd + 2Nd·T_r, writes Nd + N
    (T_r = ceil(N/B_r)). Shared memory: B_c·(d + d_v) floats. Grid: (T_r, Z, H_q) blocks of B_r threads.

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
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``: B_r threads per block, one per query row, and B_c keys per shared-memory tile. Default None:
        :func:`kernels_gpu.runtime.default_block_sizes`.
    causal : bool, default False
        Apply the causal mask aligned to the bottom-right corner: query i sees key j iff j ≤ i + N_k − N_q.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.

    Returns
    -------
    Flash2Forward
        ``(O, L)``, float32: O (..., N_q, d_v) and L (..., N_q), +inf on a fully masked row; NumPy arrays for NumPy
        inputs, numba device arrays for device inputs.
    """
    layout, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale)
    d, d_v = layout.d, layout.d_v
    B_r, B_c = rt.checked_block_sizes(block_sizes, "flash2_forward", d, d_v)
    rt.check_resources(threads=B_r, shared_floats=B_c * (d + d_v), what="flash2_forward")
    O = rt.device_empty((layout.Z, layout.H_q, layout.N_q, d_v))
    L = rt.device_empty((layout.Z, layout.H_q, layout.N_q))
    grid = (rt.grid_size(layout.N_q, B_r), layout.Z, layout.H_q)
    forward_kernel(B_r, B_c, d, d_v)[grid, B_r](
        rt.tally("Q", Q4), rt.tally("K", K4), rt.tally("V", V4), rt.tally("O", O), rt.tally("L", L),
        tau, bool(causal))
    return Flash2Forward(rt.finish(O, layout, (layout.N_q, d_v)), rt.finish(L, layout, (layout.N_q,)))


# -- backward --------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def preprocess_kernel(B: int, d_v: int):
    """FA2 Alg. 2 line 4, D = rowsum(dO ∘ O): one thread per row, B rows per block. Loads are converted to float32,
    so the fast kernels' float16 storage (``kernels_gpu.fast``) gets a float32 product, not a float16 one."""

    @cuda.jit
    def flash2_backward_preprocess_kernel(O, dO, D):
        z = cuda.blockIdx.y
        h = cuda.blockIdx.z
        row = cuda.blockIdx.x * B + cuda.threadIdx.x
        if row < O.shape[2]:
            # Alg. 2 line 4: read dO_i and O_i, write D_i = rowsum(dO_i ∘ O_i) (D ∈ R^N: erratum 5 prints R^d).
            acc = float32(0.0)
            for k in range(d_v):
                acc += float32(dO[z, h, row, k]) * float32(O[z, h, row, k])
            D[z, h, row] = acc

    return flash2_backward_preprocess_kernel


@functools.lru_cache(maxsize=None)
def backward_kernel(B_r: int, B_c: int, d: int, d_v: int, with_dQ: bool):
    """The FA2 backward kernel for one tile shape; ``with_dQ`` adds the atomic dQ update (Alg. 2 line 15)."""

    @cuda.jit
    def flash2_backward_kernel(Q, K, V, dO, L, D, dQ, dK, dV, tau, causal):
        # Grid: (T_c, Z, H_kv); block: B_c threads. Thread t owns key row `col` of column block j.
        j = cuda.blockIdx.x
        z = cuda.blockIdx.y
        h_kv = cuda.blockIdx.z
        t = cuda.threadIdx.x
        N_q = Q.shape[2]
        N_k = K.shape[2]
        G = Q.shape[1] // K.shape[1]
        col0 = j * B_c
        cols = min(B_c, N_k - col0)
        col = col0 + t
        active = t < cols
        offset = N_k - N_q

        K_j = cuda.shared.array((B_c, d), float32)
        Q_i = cuda.shared.array((B_r, d), float32)
        dO_i = cuda.shared.array((B_r, d_v), float32)
        dS_ij = cuda.shared.array((B_r, B_c), float32)
        L_i = cuda.shared.array(B_r, float32)
        D_i = cuda.shared.array(B_r, float32)
        v = cuda.local.array(d_v, float32)                # this thread's row of V_j
        dK_acc = cuda.local.array(d, float32)             # this thread's row of dK_j
        dV_acc = cuda.local.array(d_v, float32)           # this thread's row of dV_j

        # Alg. 2 line 6: load K_j (to shared memory: all threads need it for dQ) and V_j (own row, registers).
        if active:
            for k in range(d):
                K_j[t, k] = K[z, h_kv, col, k]
            for k in range(d_v):
                v[k] = V[z, h_kv, col, k]
        # Alg. 2 line 7: initialise dK_j = 0, dV_j = 0 on chip.
        for k in range(d):
            dK_acc[k] = 0.0
        for k in range(d_v):
            dV_acc[k] = 0.0

        # FA2 Section 3.1 (causal): row blocks entirely above the diagonal are skipped. Rows before
        # first_row = col0 − offset see none of this block's keys, so the loop starts at the block holding it.
        T_r = (N_q + B_r - 1) // B_r
        i_start = 0
        if causal:
            i_start = min(T_r, max(0, col0 - offset) // B_r)
        # GQA: the G query heads of this K/V head all add into the same dK_j, dV_j (the sum over the group).
        for g in range(G):
            h = h_kv * G + g
            # Alg. 2 line 8: loop over the row blocks i.
            for i in range(i_start, T_r):
                row0 = i * B_r
                rows = min(B_r, N_q - row0)
                cuda.syncthreads()                        # every thread is done with the previous tiles
                # Alg. 2 line 9: load Q_i, dO_i, L_i, D_i to shared memory (dQ_i is updated in place at line 15;
                # O_i is not needed once D is precomputed: erratum 9).
                for r in range(t, rows, B_c):
                    for k in range(d):
                        Q_i[r, k] = Q[z, h, row0 + r, k]
                    for k in range(d_v):
                        dO_i[r, k] = dO[z, h, row0 + r, k]
                    L_i[r] = L[z, h, row0 + r]
                    D_i[r] = D[z, h, row0 + r]
                cuda.syncthreads()
                for r in range(rows):
                    ds = float32(0.0)
                    if active and not (causal and col > row0 + r + offset):
                        # Alg. 2 line 10: S_i^(j) = τ Q_i K_jᵀ (this thread's column).
                        s = float32(0.0)
                        for k in range(d):
                            s += Q_i[r, k] * K_j[t, k]
                        s *= tau
                        # Alg. 2 line 11: P_i^(j) = exp(S_i^(j) − L_i); 0 on a fully masked row (L = +inf).
                        p = math.exp(s - L_i[r])
                        # Alg. 2 line 12: dV_j ← dV_j + (P_i^(j))ᵀ dO_i.
                        for k in range(d_v):
                            dV_acc[k] += p * dO_i[r, k]
                        # Alg. 2 line 13: dP_i^(j) = dO_i V_jᵀ.
                        dp = float32(0.0)
                        for k in range(d_v):
                            dp += dO_i[r, k] * v[k]
                        # Alg. 2 line 14: dS_i^(j) = P_i^(j) ∘ (dP_i^(j) − D_i).
                        ds = p * (dp - D_i[r])
                        # Alg. 2 line 16: dK_j ← dK_j + τ dS_i^(j)ᵀ Q_i.
                        for k in range(d):
                            dK_acc[k] += tau * ds * Q_i[r, k]
                    dS_ij[r, t] = ds                      # masked and out-of-range columns add nothing to dQ_i
                if with_dQ:
                    cuda.syncthreads()                    # dS_ij complete before any thread reads other columns
                    # Alg. 2 line 15: dQ_i ← dQ_i + τ dS_i^(j) K_j, read-modify-written in HBM with atomic adds
                    # because other column blocks update the same rows at the same time.
                    for e in range(t, rows * d, B_c):
                        r = e // d
                        k = e % d
                        acc = float32(0.0)
                        for c in range(cols):
                            acc += dS_ij[r, c] * K_j[c, k]
                        cuda.atomic.add(dQ, (z, h, row0 + r, k), tau * acc)

        # Alg. 2 line 17: write dK_j, dV_j to HBM, once (summed over the GQA group already).
        if active:
            for k in range(d):
                dK[z, h_kv, col, k] = dK_acc[k]
            for k in range(d_v):
                dV[z, h_kv, col, k] = dV_acc[k]

    return flash2_backward_kernel


@functools.lru_cache(maxsize=None)
def dq_kernel(B_r: int, B_c: int, d: int, d_v: int):
    """Deterministic dQ (``deterministic=True``): one thread block per (row block, batch, query head), B_r threads,
    thread t sums its row of dQ = τ Σ_j dS_i^(j) K_j over the column blocks in a fixed order, no atomics."""

    @cuda.jit
    def flash2_backward_dq_kernel(Q, K, V, dO, L, D, dQ, tau, causal):
        i = cuda.blockIdx.x
        z = cuda.blockIdx.y
        h = cuda.blockIdx.z
        t = cuda.threadIdx.x
        N_q = Q.shape[2]
        N_k = K.shape[2]
        h_kv = h // (Q.shape[1] // K.shape[1])
        row = i * B_r + t
        active = row < N_q
        offset = N_k - N_q

        K_j = cuda.shared.array((B_c, d), float32)
        V_j = cuda.shared.array((B_c, d_v), float32)
        q = cuda.local.array(d, float32)
        do = cuda.local.array(d_v, float32)
        dq = cuda.local.array(d, float32)

        L_row = float32(math.inf)
        D_row = float32(0.0)
        if active:
            for k in range(d):
                q[k] = Q[z, h, row, k]
            for k in range(d_v):
                do[k] = dO[z, h, row, k]
            L_row = L[z, h, row]
            D_row = D[z, h, row]
        for k in range(d):
            dq[k] = 0.0

        T_c = (N_k + B_c - 1) // B_c
        if causal:
            last_row = min(i * B_r + B_r, N_q) - 1
            T_c = max(0, min(T_c, (last_row + offset + B_c) // B_c))
        for j in range(T_c):
            col0 = j * B_c
            cols = min(B_c, N_k - col0)
            cuda.syncthreads()
            for c in range(t, cols, B_r):
                for k in range(d):
                    K_j[c, k] = K[z, h_kv, col0 + c, k]
                for k in range(d_v):
                    V_j[c, k] = V[z, h_kv, col0 + c, k]
            cuda.syncthreads()
            if active:
                for c in range(cols):
                    if causal and col0 + c > row + offset:
                        continue
                    # Alg. 2 lines 10-14 again, for this row: S, P = exp(S − L), dP = dO V_jᵀ, dS = P ∘ (dP − D).
                    s = float32(0.0)
                    for k in range(d):
                        s += q[k] * K_j[c, k]
                    p = math.exp(s * tau - L_row)
                    dp = float32(0.0)
                    for k in range(d_v):
                        dp += do[k] * V_j[c, k]
                    ds = p * (dp - D_row)
                    # Alg. 2 line 15, in a fixed order: dQ_i ← dQ_i + τ dS_i^(j) K_j.
                    for k in range(d):
                        dq[k] += tau * ds * K_j[c, k]
        if active:
            for k in range(d):
                dQ[z, h, row, k] = dq[k]

    return flash2_backward_dq_kernel


def flash2_backward(Q, K, V, O, L, dO, block_sizes=None, causal=False, scale=None,
                    deterministic: bool = False) -> Flash2Backward:
    """FlashAttention-2 backward pass on the GPU (FA2 Algorithm 2): ``Flash2Backward(dQ, dK, dV)``.

    Cost per (batch, head), N_q = N_k = N, not causal: 10N²d FLOPs (2.5× the forward, FA2 Section 4.1; the
    deterministic dQ pass adds 6N²d); global reads 4Nd + T_c(3Nd + 2N) and writes N + 2Nd + T_c·Nd with the atomic
    dQ (each atomic add counted as one read and one write), T_c = ceil(N/B_c).
    Launches: D = rowsum(dO ∘ O) (grid (ceil(N_q/B_r), Z, H_q)), then the main kernel (grid (T_c, Z, H_kv)).

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
    O : array, shape (..., N_q, d_v)
        The output of :func:`flash2_forward` (or :func:`fa2edu.flash2.flash2_forward`), of the same kind as Q (NumPy
        or device float32).
    L : array, shape (..., N_q)
        The forward pass's log-sum-exp (+inf on fully masked rows), of the same kind as Q (NumPy or device float32).
    dO : array, shape (..., N_q, d_v)
        Gradient of the loss with respect to O, of the same kind as Q (NumPy or device float32).
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``: B_c threads per block, one per key row, and B_r query rows per shared-memory tile; they need not
        match the forward pass's. Default None: :func:`kernels_gpu.runtime.default_block_sizes`.
    causal : bool, default False
        Apply the causal mask aligned to the bottom-right corner: query i sees key j iff j ≤ i + N_k − N_q.
    scale : float, optional
        The softmax scale τ of S = τQKᵀ. Default None: 1/√d.
    deterministic : bool, default False
        Compute dQ in a separate kernel without atomics, so that it is bit-identical over runs (6N²d more FLOPs).
        Otherwise dQ is accumulated with atomic adds, whose order varies.

    Returns
    -------
    Flash2Backward
        ``(dQ, dK, dV)``, float32, shaped like Q, K and V (dK, dV summed over each GQA group); NumPy arrays for NumPy
        inputs, numba device arrays for device inputs.
    """
    layout, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    N_q, d, d_v = layout.N_q, layout.d, layout.d_v
    O4 = rt.prepare_like(O, "O", layout, (N_q, d_v))
    L4 = rt.prepare_like(L, "L", layout, (N_q,), finite=False)
    dO4 = rt.prepare_like(dO, "dO", layout, (N_q, d_v))
    B_r, B_c = rt.checked_block_sizes(block_sizes, "flash2_backward", d, d_v)
    rt.check_resources(threads=B_c, shared_floats=rt.flash2_backward_shared(B_r, B_c, d, d_v),
                       what="flash2_backward")
    if deterministic:
        rt.check_resources(threads=B_r, shared_floats=B_c * (d + d_v), what="flash2_backward (dQ pass)")
    Z, H_q, H_kv = layout.Z, layout.H_q, layout.H_kv

    # Alg. 2 line 4: D = rowsum(dO ∘ O), one pass before the main loop.
    D = rt.device_empty((Z, H_q, N_q))
    preprocess_kernel(B_r, d_v)[(rt.grid_size(N_q, B_r), Z, H_q), B_r](
        rt.tally("O", O4), rt.tally("dO", dO4), rt.tally("D", D))

    dK = rt.device_empty((Z, H_kv, layout.N_k, d))
    dV = rt.device_empty((Z, H_kv, layout.N_k, d_v))
    if deterministic:
        dQ = rt.device_empty((Z, H_q, N_q, d))
    else:
        # Alg. 2 line 3: initialise dQ = 0 in HBM (the atomic adds accumulate into it).
        dQ = rt.device_zeros((Z, H_q, N_q, d), name="dQ")
    grid = (rt.grid_size(layout.N_k, B_c), Z, H_kv)
    backward_kernel(B_r, B_c, d, d_v, not deterministic)[grid, B_c](
        rt.tally("Q", Q4), rt.tally("K", K4), rt.tally("V", V4), rt.tally("dO", dO4), rt.tally("L", L4),
        rt.tally("D", D), rt.tally("dQ", dQ), rt.tally("dK", dK), rt.tally("dV", dV), tau, bool(causal))
    if deterministic:
        dq_kernel(B_r, B_c, d, d_v)[(rt.grid_size(N_q, B_r), Z, H_q), B_r](
            rt.tally("Q", Q4), rt.tally("K", K4), rt.tally("V", V4), rt.tally("dO", dO4), rt.tally("L", L4),
            rt.tally("D", D), rt.tally("dQ", dQ), tau, bool(causal))
    return Flash2Backward(rt.finish(dQ, layout, (N_q, d)),
                          rt.finish(dK, layout, (layout.N_k, d), per_query=False),
                          rt.finish(dV, layout, (layout.N_k, d_v), per_query=False))
