"""FlashAttention (FA1) forward as a numba.cuda kernel, the way FA1 runs it (FA1 Algorithm 1, with Alg. 2's scale τ
and causal mask).

One thread block per (batch z, query head h), B_r threads. The **outer loop runs over K/V blocks j**: K_j and V_j are
loaded into shared memory once. The inner loop runs over the Q blocks i; thread t handles query row ``i·B_r + t``
and, as Algorithm 1 prescribes, reads that row's Q_i, O_i, ℓ_i, m_i from global memory, updates them with the
block's statistics, and writes O_i, ℓ_i, m_i back — on every inner step. That round trip through HBM is exactly the
traffic FA2 removes by swapping the loops (compare :mod:`kernels_gpu.flash2`). Global traffic per (batch, head):
reads 2·N_k·d + T_c(2·N_q·d + 2·N_q), writes T_c(N_q·d + 2·N_q), plus the initialisation O = 0, ℓ = 0, m = −inf
(counted apart, as fa2edu's ledger does).

The initialisation (Alg. 1 line 2) is a launch of its own, so the kernel boundary orders it before the loop; in the
loop, each thread touches only its own rows of O, ℓ, m, and only the shared K_j, V_j tiles need barriers.
Only (batch × heads) blocks run: FA1 parallelises over batch and heads alone (FA2 Section 3.2).

Fully masked rows (causal with N_q > N_k) keep (ℓ, m) = (0, −inf) and O = 0: the guards below are the ones of
:mod:`fa2edu.softmax` (``exp_minus``, ``merge_stats``).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32

from fa2edu.flash1 import Flash1Forward
from kernels_gpu import runtime as rt

__all__ = ["Flash1Forward", "flash1_forward"]


@functools.lru_cache(maxsize=None)
def init_kernel(B_r: int, d_v: int):
    """FA1 Alg. 1 line 2 as its own launch: initialise O = 0, ℓ = 0, m = −inf in HBM, one thread per row."""

    @cuda.jit
    def flash1_init_kernel(O, l, m):
        z = cuda.blockIdx.y
        h = cuda.blockIdx.z
        row = cuda.blockIdx.x * B_r + cuda.threadIdx.x
        if row < O.shape[2]:
            # Alg. 1 line 2: initialise O = (0)_{N×d}, ℓ = (0)_N, m = (−∞)_N in HBM.
            for k in range(d_v):
                O[z, h, row, k] = 0.0
            l[z, h, row] = 0.0
            m[z, h, row] = -math.inf

    return flash1_init_kernel


@functools.lru_cache(maxsize=None)
def forward_kernel(B_r: int, B_c: int, d: int, d_v: int):
    """The FA1 forward kernel for one tile shape (compiled on first launch, cached per shape)."""

    @cuda.jit
    def flash1_forward_kernel(Q, K, V, O, l, m, tau, causal):
        # Grid: (Z, H_q); block: B_r threads. Thread t handles row i·B_r + t of every row block i.
        z = cuda.blockIdx.x
        h = cuda.blockIdx.y
        t = cuda.threadIdx.x
        N_q = Q.shape[2]
        N_k = K.shape[2]
        h_kv = h // (Q.shape[1] // K.shape[1])          # GQA: query head h reads K/V head h // G
        offset = N_k - N_q                                # causal, bottom-right: row sees col iff col <= row + offset
        T_r = (N_q + B_r - 1) // B_r
        T_c = (N_k + B_c - 1) // B_c

        K_j = cuda.shared.array((B_c, d), float32)        # one shared.array per source line (simulator aliasing)
        V_j = cuda.shared.array((B_c, d_v), float32)
        q = cuda.local.array(d, float32)                  # this thread's row of Q_i
        o = cuda.local.array(d_v, float32)                # this thread's row of O_i
        s = cuda.local.array(B_c, float32)                # this thread's row of S_ij, then P̃_ij

        # Alg. 1 line 5: the outer loop runs over the K/V blocks j.
        for j in range(T_c):
            col0 = j * B_c
            cols = min(B_c, N_k - col0)
            cuda.syncthreads()                            # every thread is done with the previous K_j, V_j
            # Alg. 1 line 6: load K_j, V_j from HBM to shared memory, each element once.
            for c in range(t, cols, B_r):
                for k in range(d):
                    K_j[c, k] = K[z, h_kv, col0 + c, k]
                for k in range(d_v):
                    V_j[c, k] = V[z, h_kv, col0 + c, k]
            cuda.syncthreads()
            # Alg. 1 line 7: the inner loop runs over the Q blocks i. FA2 Section 3.1 (causal): blocks entirely
            # above the diagonal are skipped; they are the row blocks before the one holding row col0 − offset.
            i_start = 0
            if causal:
                i_start = min(T_r, max(0, col0 - offset) // B_r)
            for i in range(i_start, T_r):
                row = i * B_r + t
                if row < N_q:
                    # Alg. 1 line 8: load Q_i, O_i, ℓ_i, m_i from HBM (this thread's row).
                    for k in range(d):
                        q[k] = Q[z, h, row, k]
                    for k in range(d_v):
                        o[k] = O[z, h, row, k]
                    l_i = l[z, h, row]
                    m_i = m[z, h, row]
                    # Alg. 1 line 9: S_ij = τ Q_i K_jᵀ (Alg. 2 line 9's scale), −inf where the causal mask hides a key;
                    # Alg. 1 line 10 (first part): m̃_ij = rowmax(S_ij).
                    m_tilde = float32(-math.inf)
                    for c in range(cols):
                        acc = float32(0.0)
                        for k in range(d):
                            acc += q[k] * K_j[c, k]
                        acc *= tau
                        if causal and col0 + c > row + offset:
                            acc = float32(-math.inf)
                        s[c] = acc
                        m_tilde = max(m_tilde, acc)
                    # Alg. 1 line 10: P̃_ij = exp(S_ij − m̃_ij), ℓ̃_ij = rowsum(P̃_ij); guard m̃ = −inf (all masked).
                    l_tilde = float32(0.0)
                    for c in range(cols):
                        p = float32(0.0) if m_tilde == -math.inf else math.exp(s[c] - m_tilde)
                        s[c] = p
                        l_tilde += p
                    # Alg. 1 line 11: m_new = max(m_i, m̃_ij), ℓ_new = e^{m_i − m_new} ℓ_i + e^{m̃_ij − m_new} ℓ̃_ij,
                    # each exponential 0 when its own max is −inf (the merge_stats guard).
                    m_new = max(m_i, m_tilde)
                    alpha = float32(0.0) if m_i == -math.inf else math.exp(m_i - m_new)
                    beta = float32(0.0) if m_tilde == -math.inf else math.exp(m_tilde - m_new)
                    l_new = alpha * l_i + beta * l_tilde
                    # Alg. 1 line 12: O_i = diag(ℓ_new)^{-1} (diag(ℓ_i) e^{m_i − m_new} O_i + e^{m̃ − m_new} P̃_ij V_j),
                    # written back to HBM; guard ℓ_new = 0 (no key seen yet): O_i stays 0.
                    inv_l = float32(0.0) if l_new == 0.0 else float32(1.0) / l_new
                    for k in range(d_v):
                        pv = float32(0.0)
                        for c in range(cols):
                            pv += s[c] * V_j[c, k]
                        O[z, h, row, k] = (l_i * alpha * o[k] + beta * pv) * inv_l
                    # Alg. 1 line 13: write ℓ_i ← ℓ_new, m_i ← m_new to HBM.
                    l[z, h, row] = l_new
                    m[z, h, row] = m_new

    return flash1_forward_kernel


def flash1_forward(Q, K, V, block_sizes=None, causal=False, scale=None) -> Flash1Forward:
    """FlashAttention forward pass on the GPU (FA1 Algorithm 1 with Alg. 2's τ and causal mask): ``(O, l, m)``.

    Cost per (batch, head), N_q = N_k = N, not causal: 4N²d FLOPs; global reads 2Nd + T_c(2Nd + 2N), writes
    T_c(Nd + 2N), T_c = ceil(N/B_c) (FA1 Theorem 2's Θ(N²d²/M) with B_c ∝ M/d). Grid: (Z, H_q) blocks of B_r threads.

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
    Flash1Forward
        ``(O, l, m)``, float32: O (..., N_q, d_v), ℓ and m (..., N_q), with ℓ = 0 and m = −inf on a fully masked
        row; NumPy arrays for NumPy inputs, numba device arrays for device inputs.
    """
    layout, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale)
    d, d_v = layout.d, layout.d_v
    B_r, B_c = rt.checked_block_sizes(block_sizes, "flash1_forward", d, d_v)
    rt.check_resources(threads=B_r, shared_floats=B_c * (d + d_v), what="flash1_forward")
    O = rt.device_empty((layout.Z, layout.H_q, layout.N_q, d_v))
    l = rt.device_empty((layout.Z, layout.H_q, layout.N_q))  # noqa: E741 (the paper's ℓ)
    m = rt.device_empty((layout.Z, layout.H_q, layout.N_q))
    # Alg. 1 line 2, a launch of its own so that its writes count apart (as fa2edu's ledger keeps them apart).
    init_kernel(B_r, d_v)[(rt.grid_size(layout.N_q, B_r), layout.Z, layout.H_q), B_r](
        rt.tally("O", O, init=True), rt.tally("l", l, init=True), rt.tally("m", m, init=True))
    forward_kernel(B_r, B_c, d, d_v)[(layout.Z, layout.H_q), B_r](
        rt.tally("Q", Q4), rt.tally("K", K4), rt.tally("V", V4), rt.tally("O", O), rt.tally("l", l),
        rt.tally("m", m), tau, bool(causal))
    lead = (layout.N_q,)
    return Flash1Forward(rt.finish(O, layout, (layout.N_q, d_v)), rt.finish(l, layout, lead),
                         rt.finish(m, layout, lead))
