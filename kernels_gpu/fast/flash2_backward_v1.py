"""Fast FA2 backward, version 1: FA2 Algorithm 2 with register tiles (the forward v4's techniques, applied backward).

**What it does.** One thread block per (column block j, batch z, key/value head), as the teaching kernel
(:func:`kernels_gpu.flash2_backward`), but ``NY × NX`` threads share every tile product:

* K_j (pre-scaled by τ·log₂e, so that P = exp2(S₂ − L·log₂e)) and V_j sit in shared memory for the whole block;
  dK_j and dV_j are accumulated in registers, thread (ty, tx) owning key rows ``ty·KC + c`` (KC = B_c / NY) and
  feature columns ``4·tx + 4·NX·q + e`` (4-wide chunks, interleaved as in the forward).
* The loop runs over the G query heads of the GQA group and the row blocks i (Alg. 2 line 8), skipping row blocks
  entirely above the causal diagonal. Per step: Q_i, dO_i (shared), L_i, D_i; thread (ty, tx) computes its
  TR × TC sub-tiles of S_i^(j) = τ Q_i K_jᵀ and dP_i^(j) = dO_i V_jᵀ (rows ``ty·TR + r``, columns ``tx + NX·c``),
  P = exp(S − L) and dS = P ∘ (dP − D) in registers, and stages P and dS in shared memory (row-major in the query
  row, so both later products read 16-byte chunks). Then dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i (register tiles
  KC × d/NX), and dQ_i += τ dS K_j: a TR × d/NX register tile per thread, added into HBM with ``cuda.atomic.add``
  (other column blocks update the same rows concurrently; dQ is zeroed first, Alg. 2 line 3).
* Q_{i+1}, dO_{i+1}, L_{i+1}, D_{i+1} are fetched into registers while step i computes (the forward v4's
  ``tiled._tile_io``, flat views, no load behind a branch), and stored to shared memory at the top of the next step.
* Masking: columns past N_k and keys after the causal diagonal give P = 0 (only in tiles that need it); rows past
  N_q read L = +inf, so P = 0 and dS = 0. Fully masked rows (L = +inf from the forward) give P = 0: their dQ is 0
  and they add nothing to dK, dV.
* D = rowsum(dO ∘ O) (Alg. 2 line 4) is a preprocessing launch, one thread per row: the teaching kernel's
  (:func:`kernels_gpu.flash2.preprocess_kernel`), whose loads convert to float32, so that float16 storage
  multiplies in float32.

Cost per (batch, head), N_q = N_k = N, not causal: 10·N²·d FLOPs by the FA2 paper's model (this kernel does
8·N²·d in its four products plus the dQ product's 2·N²·d: exactly that); global reads 2Nd (K, V) + T_c·(2Nd + 2N)
(Q, dO, L, D per column block), dQ atomics T_c·N·d, writes 2Nd (dK, dV). Shared memory:
B_c·(d+4) + B_c·(d_v+4) + B_r·(d+4) + B_r·(d_v+4) + 2·B_r·(B_c+4) + 2·B_r floats (68 KiB for the d = 64 default,
167 KiB at d = 128, taken as dynamic shared memory).

**fp16 storage** (``storage="float16"``; the same kernel source, compiled for float16 arguments): Q, K, V, O and
dO are stored in HBM as float16 (NumPy inputs are cast on the way in; device inputs must be float16), L stays
float32 (the forward writes it so), and every load is converted to float32 on its way into shared memory or
registers: all arithmetic and accumulation is float32, in float32 shared tiles (the inner loops are unchanged).
dK and dV are written as float16 once, at the end. dQ is different: other column blocks add into it concurrently,
so its accumulator stays a float32 array in HBM (float16 atomics would accumulate in float16), and one more launch
converts it to float16 at the end (reads 4 bytes, writes 2 bytes per element of dQ). What it changes: the bytes of
Q, K, V, dO (and O, in D's pass) halve; dQ's atomic traffic (T_c·N·d float32 read-modify-writes per (batch, head),
as large as the Q_i, dO_i reloads in float32) does not, so the total falls by about a quarter
(``benchmarks.fp16_check.model_bytes``). Compiled here for sm_90 (numba's NVVM, ptxas of CUDA 13.0): no float16
arithmetic in the PTX (each global load of Q, K, V, dO is an ``ld.global.u16`` and one ``cvt.f32.f16``), the same
registers as float32 (d = 64 capped: 168; d = 128: 255), no spills. **Prediction** (written before the device
run): the kernel is compute-bound (floor 54.1 ms of arithmetic against 0.26 ms of memory at d = 64, N = 8192, see
benchmarks/README.md), so time should change little, within a few per cent (the extra cast launch moves 6 bytes
per element of dQ: microseconds); the accuracy cost is the float16 rounding of the inputs and of dQ, dK, dV, each
2^-11 relative. **Measured** (H200, 2026-11-22, ``fast_fp16.json``, ``python -m benchmarks.fp16_check``, with forward
v6; d = 64 and 128, N = 1024 and 4096, causal and not): float16 storage takes 1.01-1.04× the float32 time (slower,
not faster: compute-bound, one load instruction per element either way, plus a conversion), for 0.75 of the bytes;
relative error against the float64 reference 5.0-5.3e-4 (float32 storage: 0.7-1.6e-6). The prediction held.

**Resources** (ptxas sm_90, also the device's report in the results files): (16, 16, 4, 4) at d = 64 uses 244
registers with no cap, so one 256-thread block per SM (8 warps); ``max_registers=168`` on (8, 16, 4, 4)
(B_r = 32, B_c = 64, 128 threads) gives 168 registers and 0 bytes of spills: three blocks per SM (12 warps,
3 × 68 KiB of shared memory). At d = 128, (16, 16, 4, 4) takes 255 registers, no spills (one block per SM).

**Measured** (H200, 2026-11-22, fp32, batch × N = 16k tokens, hidden 2048, ``benchmarks/fast_backward.py``, every
configuration checked against the float64 oracle first; TFLOP/s by the FA2 paper's model, 10·N²·d per head):

* exploration (``fast_backward_v1_explore.json``, d = 64, non-causal, N = 4096 / 16384): (16, 16, 4, 4) uncapped
  25.8 / 26.3; the same capped at 128 registers (40 bytes of spills, two blocks per SM) 28.0 / 28.4;
  (8, 16, 4, 4) capped at 168 (no spills, three blocks per SM) 30.8 / 31.3; (16, 8, 4, 4) capped at 168 (144 bytes
  of spills, and B_c = 32 doubles the Q_i/dO_i reloads and the dQ atomics) 24.5 / 24.8. More resident warps won.
  (8, 16, 4, 4) at 168 registers is the d = 64 default; at d = 128 it spilled 544 bytes and ran at 11.8-15.0 against
  22.0-28.8 for (16, 16, 4, 4), which stays the d = 128 default (``fast_backward_v1.json``, both columns);
* full grid with both (``fast_backward_v1.json``; N = 1024 … 16384, causal and not): d = 64 non-causal 29.2-31.3
  (the default's column), causal 25.2-30.4; the teaching kernel 1.9 (16× slower); PyTorch eager fp32 autograd
  34.8-37.1 non-causal, 13.8-14.4 causal; SDPA memory-efficient fp32 34.0-35.6 / 30.4-34.7. d = 128: 25.5-28.1
  non-causal, 22.0-28.8 causal; eager 46.6-49.2 / 19.8-20.7; SDPA 36.0-37.2 / 30.1-37.9;
* final run with the default (``fast_backward_v1_final.json``, d = 64, N = 4096 … 16384): non-causal 30.9 / 31.1
  / 31.3 TFLOP/s (88.3 ms at N = 8192), causal 29.1 / 29.9 / 30.4, both within 0.2 of the first run: the
  project's target (≥ 12 at d = 64) is met 2.6×. Eager 33.9-37.0 and SDPA 34.2-35.6 stay ahead non-causal (v1 is at
  83-92 % of eager); causal v1 is 2.0-2.2× eager, 85-89 % of SDPA;
* ``compute-sanitizer --tool racecheck`` on small ragged GQA problems (``sanitizer_fast_backward_v1.log``): 0 hazards,
  and the results match fa2edu's oracle.

Failures on the way: a first typing error (a product of two compile-time constants inside the kernel is a run-time
int64 to numba, so ``cuda.local.array(TR * TC, …)`` did not compile: the sizes are now computed outside the kernel).
The driver's ragged-shape check of that run compared dK, dV against nothing on the two shapes with fully masked
rows (the torch oracle's L = −inf made its whole dK, dV reference NaN, so those two errors read 0.0); the check now
puts L = +inf there, and those shapes were checked in the sanitizer run against fa2edu's oracle instead.

What limits v1 now: as the forward, FFMA issue with one 16-byte shared load per 4-8 FFMAs, five products per tile
pair, and 12 resident warps; not tried: keeping P or dS in registers across phases (warp shuffles), dQ in a
separate kernel (no atomics), a larger B_c at d = 128.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint64

from fa2edu.flash2 import Flash2Backward
from kernels_gpu import ptx
from kernels_gpu import runtime as rt
from kernels_gpu.fast import tiled
from kernels_gpu.flash2 import preprocess_kernel

__all__ = ["BackwardTiling", "flash2_backward", "make_backward", "layout", "resources", "TILINGS",
           "cast_kernel", "run_backward", "teaching_preprocess"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


#: The backward's tile shape is the forward's: NY × NX threads, each owning TR query rows and TC key columns of S
#: (B_r = NY·TR, B_c = NX·TC). One type, so a tiling means the same thing in both passes.
BackwardTiling = tiled.Tiling


TILINGS = {64: BackwardTiling(8, 16, 4, 4), 128: BackwardTiling(16, 16, 4, 4)}


#: default register caps per head dimension (None: ptxas's own choice)
MAX_REGISTERS = {64: 168, 128: None}


def default_tiling(d: int) -> BackwardTiling:
    return TILINGS[64] if d <= 64 else TILINGS[128]


def layout(tiling: BackwardTiling, d: int, d_v: int) -> dict:
    """Offsets and row strides (floats) of K_j, V_j, Q_i, dO_i, P, dS, L_i, D_i in the block's flat shared array."""
    B_r, B_c = tiling.B_r, tiling.B_c
    KS, VS, QS, OS, PS = d + 4, d_v + 4, d + 4, d_v + 4, B_c + 4
    k_off = 0
    v_off = k_off + B_c * KS
    q_off = v_off + B_c * VS
    o_off = q_off + B_r * QS
    p_off = o_off + B_r * OS
    ds_off = p_off + B_r * PS
    l_off = ds_off + B_r * PS
    d_off = l_off + B_r
    return dict(KS=KS, VS=VS, QS=QS, OS=OS, PS=PS, k_off=k_off, v_off=v_off, q_off=q_off, o_off=o_off,
                p_off=p_off, ds_off=ds_off, l_off=l_off, d_off=d_off, size=d_off + B_r)


def check_tiling(tiling: BackwardTiling, d: int, d_v: int) -> None:
    """Refuse tile shapes the kernel cannot run."""
    if not isinstance(tiling, tuple) or len(tiling) != 4:
        raise TypeError(f"tiling must be a BackwardTiling (NY, NX, TR, TC), got {tiling!r}")
    NY, NX, TR, TC = tiling
    if min(NY, NX, TR, TC) < 1:
        raise ValueError(f"tiling entries must be >= 1, got {tiling}")
    if tiling.threads > rt.MAX_THREADS:
        raise ValueError(f"tiling {tiling} gives {tiling.threads} threads; CUDA allows {rt.MAX_THREADS}")
    if NX not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"tiling NX (threads per row) must be a power of two <= 32, got {NX}")
    if d % (4 * NX) or d_v % (4 * NX):
        raise ValueError(f"the fast backward needs d and d_v multiples of 4·NX; got d = {d}, d_v = {d_v}, "
                         f"NX = {NX}: use kernels_gpu.flash2_backward for other head sizes")
    if (NX * TC) % NY:
        raise ValueError(f"tiling {tiling}: B_c = NX·TC = {NX * TC} must be a multiple of NY = {NY} "
                         f"(each thread owns B_c / NY rows of dK_j, dV_j)")


@functools.lru_cache(maxsize=None)
def make_backward(tiling: BackwardTiling, d: int, d_v: int, simulator: bool, max_registers: int | None = None,
                  vector_red: bool = False, scale_q: bool = False):
    """The kernel for one tile shape and head sizes (compile-time constants); ``max_registers`` caps ptxas's
    registers per thread (more resident blocks per SM, at the price of spills), GPU only. ``vector_red``: dQ's
    atomic additions four floats per instruction (``red.global.add.v4.f32``, fast backward v3) instead of one.
    ``scale_q``: τ·log₂e multiplies Q_i, not K_j, so that S₂ is rounded as the fast forward rounds it (v4)."""
    check_tiling(tiling, d, d_v)
    VECTOR_RED = vector_red
    SCALE_Q = scale_q
    NY, NX, TR, TC = tiling
    B_r, B_c, T = tiling.B_r, tiling.B_c, tiling.threads
    KC = B_c // NY                      # rows of dK_j, dV_j per thread
    TD, TDV = d // NX, d_v // NX        # feature columns per thread (dK, dQ: TD; dV: TDV), in chunks of 4
    TQ, TQV = TD // 4, TDV // 4
    fetch_q, store_q = tiled._tile_io(T, B_r, d, simulator)
    fetch_o, store_o = tiled._tile_io(T, B_r, d_v, simulator)
    NQ, NO = -(-B_r * d // T), -(-B_r * d_v // T)
    NL = -(-B_r // T)                   # L_i, D_i values per thread (1 unless B_r > T)
    lay = layout(tiling, d, d_v)
    KS, VS, QS, OS, PS = lay["KS"], lay["VS"], lay["QS"], lay["OS"], lay["PS"]
    K_OFF, V_OFF, Q_OFF, O_OFF, P_OFF, DS_OFF, L_OFF, D_OFF = (
        lay[k] for k in ("k_off", "v_off", "q_off", "o_off", "p_off", "ds_off", "l_off", "d_off"))
    SIZE = lay["size"]
    STATIC = SIZE if SIZE <= tiled.STATIC_FLOATS else 0
    INF = float32(math.inf)
    # local-array sizes: computed here, since a product inside the kernel is no compile-time constant to numba
    S_REGS, DK_REGS, DV_REGS, DQ_REGS, RA_REGS, CA_REGS = TR * TC, KC * TD, KC * TDV, TR * TD, TR * 4, TC * 4

    jit = cuda.jit(max_registers=max_registers) if (max_registers and not simulator) else cuda.jit

    @jit
    def flash2_backward_fast(K, V, L, D, dQf, dK, dV, Qf, dOf, H_q, N_q, tau, scale2, causal):
        # Grid: (T_c, Z, H_kv); block: NY·NX threads.
        j = cuda.blockIdx.x
        z = cuda.blockIdx.y
        h_kv = cuda.blockIdx.z
        t = cuda.threadIdx.x
        tx = t % NX
        ty = t // NX
        N_k = K.shape[2]
        G = H_q // K.shape[1]
        col0 = j * B_c
        offset = N_k - N_q                               # causal, bottom-right: row sees col iff col <= row + offset
        if simulator:
            sm = cuda.shared.array(STATIC, float32)
        else:
            sm = cuda.shared.array(STATIC, float32, alignment=16)

        s = cuda.local.array(S_REGS, float32)         # S_i^(j) (log2 units), then P_i^(j)
        dp = cuda.local.array(S_REGS, float32)        # dP_i^(j)
        dk = cuda.local.array(DK_REGS, float32)        # dK_j: rows ty·KC + c, columns 4tx + 4NX·q + e
        dv = cuda.local.array(DV_REGS, float32)       # dV_j
        dq = cuda.local.array(DQ_REGS, float32)        # this step's τ dS K_j, rows ty·TR + r
        ra = cuda.local.array(RA_REGS, float32)         # operand chunks
        ca = cuda.local.array(CA_REGS, float32)
        pa = cuda.local.array(KC, float32)
        fa = cuda.local.array(TD, float32)
        fv = cuda.local.array(TDV, float32)
        qreg = cuda.local.array(NQ, float32)           # Q_{i+1} in flight
        oreg = cuda.local.array(NO, float32)           # dO_{i+1} in flight
        lreg = cuda.local.array(NL, float32)           # L_{i+1}·log2e, D_{i+1}
        dreg = cuda.local.array(NL, float32)

        # Alg. 2 line 6: load K_j (scaled by τ·log2e, unless Q_i is) and V_j to shared memory; rows past N_k are
        # zero. What multiplies the products at the end: dQ's by (τ or ln 2), dK's by (ln 2 or τ).
        fq = tau if SCALE_Q else float32(LN2)
        fk = float32(LN2) if SCALE_Q else tau
        for e in range(t, B_c * d, T):
            c = e // d
            k = e - c * d
            x = float32(0.0)
            if col0 + c < N_k:
                x = float32(K[z, h_kv, col0 + c, k])                # float16 storage: converted before scaling
                if not SCALE_Q:
                    x *= scale2
            sm[K_OFF + c * KS + k] = x
        for e in range(t, B_c * d_v, T):
            c = e // d_v
            k = e - c * d_v
            x = float32(0.0)
            if col0 + c < N_k:
                x = float32(V[z, h_kv, col0 + c, k])
            sm[V_OFF + c * VS + k] = x
        # Alg. 2 line 7: dK_j = 0, dV_j = 0, in registers.
        for x in range(KC * TD):
            dk[x] = 0.0
        for x in range(KC * TDV):
            dv[x] = 0.0

        # FA2 Section 3.1 (causal): rows before col0 − offset see none of this block's keys.
        T_r = (N_q + B_r - 1) // B_r
        i_start = 0
        if causal:
            i_start = min(T_r, max(0, col0 - offset) // B_r)
        n_i = T_r - i_start
        n_it = G * n_i                                  # GQA: the G query heads of this K/V head, one after another
        if n_it > 0:
            # Alg. 2 line 9 (step 0): fetch Q_i, dO_i, L_i, D_i into registers.
            h = h_kv * G
            row0 = i_start * B_r
            fetch_q(Qf, (z * H_q + h) * N_q * d, row0, N_q, t, qreg)
            fetch_o(dOf, (z * H_q + h) * N_q * d_v, row0, N_q, t, oreg)
            for u in range(NL):
                r = t + T * u
                lreg[u] = INF
                dreg[u] = float32(0.0)
                if r < B_r and row0 + r < N_q:
                    lreg[u] = L[z, h, row0 + r] * float32(LOG2E)
                    dreg[u] = D[z, h, row0 + r]
        # Alg. 2 line 8: loop over (query head g of the group, row block i).
        for it in range(n_it):
            g = it // n_i
            i = i_start + it - g * n_i
            h = h_kv * G + g
            row0 = i * B_r
            cuda.syncthreads()                          # everyone is done with the previous Q_i, dO_i, P, dS
            if SCALE_Q:
                # (v4) Q_i scaled by τ·log2e as the forward scales it: S₂ below is the forward's, bit for bit
                for u in range(NQ):
                    qreg[u] *= scale2
            store_q(sm, qreg, t, Q_OFF, QS)
            store_o(sm, oreg, t, O_OFF, OS)
            for u in range(NL):
                r = t + T * u
                if r < B_r:
                    sm[L_OFF + r] = lreg[u]
                    sm[D_OFF + r] = dreg[u]
            cuda.syncthreads()
            # Alg. 2 line 9 (step it + 1): issue the loads of the next Q_i, dO_i, L_i, D_i now; they land while
            # this step computes (the last step refetches its own tile: a clamped index, not a branch).
            nx = min(it + 1, n_it - 1)
            g2 = nx // n_i
            h2 = h_kv * G + g2
            nrow0 = (i_start + nx - g2 * n_i) * B_r
            fetch_q(Qf, (z * H_q + h2) * N_q * d, nrow0, N_q, t, qreg)
            fetch_o(dOf, (z * H_q + h2) * N_q * d_v, nrow0, N_q, t, oreg)
            for u in range(NL):
                r = t + T * u
                lreg[u] = INF
                dreg[u] = float32(0.0)
                if r < B_r and nrow0 + r < N_q:
                    lreg[u] = L[z, h2, nrow0 + r] * float32(LOG2E)
                    dreg[u] = D[z, h2, nrow0 + r]

            # Alg. 2 line 10: S_i^(j) = τ Q_i K_jᵀ (times log2e: K_j, or Q_i, is pre-scaled), TR × TC per thread.
            for x in range(TR * TC):
                s[x] = 0.0
                dp[x] = 0.0
            for k4 in range(0, d, 4):
                for r in range(TR):
                    for u in range(4):
                        ra[r * 4 + u] = sm[uint64(Q_OFF + (ty * TR + r) * QS + k4 + u)]
                for c in range(TC):
                    for u in range(4):
                        ca[c * 4 + u] = sm[uint64(K_OFF + (tx + NX * c) * KS + k4 + u)]
                for r in range(TR):
                    for c in range(TC):
                        acc = s[r * TC + c]
                        for u in range(4):
                            acc += ra[r * 4 + u] * ca[c * 4 + u]
                        s[r * TC + c] = acc
            # Alg. 2 line 13: dP_i^(j) = dO_i V_jᵀ.
            for k4 in range(0, d_v, 4):
                for r in range(TR):
                    for u in range(4):
                        ra[r * 4 + u] = sm[uint64(O_OFF + (ty * TR + r) * OS + k4 + u)]
                for c in range(TC):
                    for u in range(4):
                        ca[c * 4 + u] = sm[uint64(V_OFF + (tx + NX * c) * VS + k4 + u)]
                for r in range(TR):
                    for c in range(TC):
                        acc = dp[r * TC + c]
                        for u in range(4):
                            acc += ra[r * 4 + u] * ca[c * 4 + u]
                        dp[r * TC + c] = acc
            # Alg. 2 lines 11, 14: P = exp(S − L), 0 where masked; dS = P ∘ (dP − D); both to shared memory.
            my_row0 = row0 + ty * TR
            need_mask = col0 + B_c > N_k or (causal and col0 + B_c - 1 > my_row0 + offset)
            for r in range(TR):
                l2 = sm[L_OFF + ty * TR + r]            # +inf on rows past N_q and fully masked rows: P = 0
                Di = sm[D_OFF + ty * TR + r]
                for c in range(TC):
                    p = math.exp2(s[r * TC + c] - l2)
                    if need_mask:
                        col = col0 + tx + NX * c
                        if col >= N_k or (causal and col > my_row0 + r + offset):
                            p = float32(0.0)
                    sm[P_OFF + (ty * TR + r) * PS + tx + NX * c] = p
                    sm[DS_OFF + (ty * TR + r) * PS + tx + NX * c] = p * (dp[r * TC + c] - Di)
            cuda.syncthreads()                          # P, dS complete before anyone reads other threads' parts

            # Alg. 2 lines 12, 16: dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i (τ applied once, at the end).
            for r in range(B_r):
                for c in range(KC):
                    pa[c] = sm[uint64(P_OFF + r * PS + ty * KC + c)]
                for q in range(TQV):
                    for e in range(4):
                        fv[q * 4 + e] = sm[uint64(O_OFF + r * OS + 4 * tx + 4 * NX * q + e)]
                for c in range(KC):
                    for x in range(TDV):
                        dv[c * TDV + x] += pa[c] * fv[x]
                for c in range(KC):
                    pa[c] = sm[uint64(DS_OFF + r * PS + ty * KC + c)]
                for q in range(TQ):
                    for e in range(4):
                        fa[q * 4 + e] = sm[uint64(Q_OFF + r * QS + 4 * tx + 4 * NX * q + e)]
                for c in range(KC):
                    for x in range(TD):
                        dk[c * TD + x] += pa[c] * fa[x]

            # Alg. 2 line 15: dQ_i ← dQ_i + τ dS K_j (times fq: ln 2 where K_j holds τ·log2e·K, else τ), atomically
            # in HBM.
            for x in range(TR * TD):
                dq[x] = 0.0
            for c4 in range(0, B_c, 4):
                for r in range(TR):
                    for u in range(4):
                        ra[r * 4 + u] = sm[uint64(DS_OFF + (ty * TR + r) * PS + c4 + u)]
                for u in range(4):
                    for q in range(TQ):
                        for e in range(4):
                            fa[q * 4 + e] = sm[uint64(K_OFF + (c4 + u) * KS + 4 * tx + 4 * NX * q + e)]
                    for r in range(TR):
                        for x in range(TD):
                            dq[r * TD + x] += ra[r * 4 + u] * fa[x]
            for r in range(TR):
                row = my_row0 + r
                if row < N_q:
                    base = ((z * H_q + h) * N_q + row) * d
                    for q in range(TQ):
                        x = r * TD + q * 4
                        if VECTOR_RED:
                            # (v3) the chunk's four floats by one instruction: 16-byte aligned, as d is a
                            # multiple of 4·NX
                            ptx.red_add_v4_f32(dQf, base + 4 * tx + 4 * NX * q, dq[x] * fq, dq[x + 1] * fq,
                                               dq[x + 2] * fq, dq[x + 3] * fq)
                        else:
                            for e in range(4):
                                cuda.atomic.add(dQf, base + 4 * tx + 4 * NX * q + e, dq[x + e] * fq)

        # Alg. 2 line 17: write dK_j (times fk: τ, or ln 2 where Q_i held τ·log2e·Q), dV_j to HBM, once (summed
        # over the GQA group already); float16 storage rounds here.
        for c in range(KC):
            col = col0 + ty * KC + c
            if col < N_k:
                for q in range(TQ):
                    for e in range(4):
                        dK[z, h_kv, col, 4 * tx + 4 * NX * q + e] = dk[c * TD + q * 4 + e] * fk
                for q in range(TQV):
                    for e in range(4):
                        dV[z, h_kv, col, 4 * tx + 4 * NX * q + e] = dv[c * TDV + q * 4 + e]

    return flash2_backward_fast


@functools.lru_cache(maxsize=None)
def cast_kernel():
    """``out[k] = src[k]`` for flat device arrays of one length (float32 → float16 rounds to nearest): the float32
    dQ accumulator to the float16 dQ of float16 storage. Reads 4 bytes and writes 2 per element."""

    @cuda.jit
    def cast(src, out):
        k = cuda.grid(1)
        if k < src.shape[0]:                            # the grid may not cover the array exactly: guard the tail
            out[k] = src[k]

    return cast


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, tiling=None, max_registers=None,
                    storage="float32") -> Flash2Backward:
    """FA2 backward (Alg. 2), fast version 1: ``Flash2Backward(dQ, dK, dV)``, same inputs and outputs as
    :func:`kernels_gpu.flash2_backward` (O, L from a forward; dK, dV summed over each GQA group).

    ``tiling``: a :class:`BackwardTiling` (default :data:`TILINGS`); needs d, d_v multiples of 4·NX.
    ``max_registers``: a cap on registers per thread for ptxas (default :data:`MAX_REGISTERS` with the default tiling).
    ``storage``: ``"float32"``, or ``"float16"``: Q, K, V, O, dO stored as float16 (NumPy inputs cast; device inputs
    must be float16; L stays float32), dQ, dK, dV returned as float16, arithmetic float32 (see "fp16 storage").
    Cost per (batch, head), N_q = N_k = N, not causal: 10·N²·d FLOPs; reads 2Nd + T_c·(2Nd + 2N), T_c·N·d atomic
    adds into dQ, writes 2Nd (plus D's pass: reads 2Nd, writes N; dQ's zeroing: Nd; float16: dQ's cast, Nd each).
    Launches: D = rowsum(dO ∘ O), dQ = 0, then the main kernel (grid (T_c, Z, H_kv)); float16: the cast of dQ.
    """
    return run_backward(Q, K, V, O, L, dO, causal, scale, tiling, max_registers, storage, teaching_preprocess)


def teaching_preprocess(O4, dO4, D, d_v: int) -> None:
    """Alg. 2 line 4, D = rowsum(dO ∘ O) into D (Z, H_q, N_q), float32: the teaching kernel, one thread per row."""
    Z, H_q, N_q = D.shape
    preprocess_kernel(64, d_v)[(rt.grid_size(N_q, 64), Z, H_q), 64](O4, dO4, D)


def run_backward(Q, K, V, O, L, dO, causal, scale, tiling, max_registers, storage, preprocess,
                 vector_red: bool = False, scale_q: bool = False) -> Flash2Backward:
    """The body of :func:`flash2_backward` (same arguments), with the launch of Alg. 2 line 4 passed in:
    ``preprocess(O4, dO4, D, d_v)`` fills D (Z, H_q, N_q) with rowsum(dO ∘ O) (v2 changes only that),
    ``vector_red``: dQ's additions by vector reductions (v3), ``scale_q``: Q_i scaled instead of K_j (v4; both
    :func:`make_backward`)."""
    rt.storage_dtype(storage)                          # a bad name is a ValueError before anything else
    layout_, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale, storage=storage)
    N_q, d, d_v = layout_.N_q, layout_.d, layout_.d_v
    O4 = rt.prepare_like(O, "O", layout_, (N_q, d_v), storage=storage)
    L4 = rt.prepare_like(L, "L", layout_, (N_q,), finite=False)                 # float32 in both storages
    dO4 = rt.prepare_like(dO, "dO", layout_, (N_q, d_v), storage=storage)
    if tiling is None:
        tiling = default_tiling(d)
        max_registers = MAX_REGISTERS.get(64 if d <= 64 else 128) if max_registers is None else max_registers
    check_tiling(tiling, d, d_v)
    size = layout(tiling, d, d_v)["size"]
    if 4 * size > tiled.MAX_DYNAMIC_BYTES:
        raise ValueError(f"tiling {tiling} needs {4 * size} bytes of shared memory at d = {d}; the GPU allows "
                         f"{tiled.MAX_DYNAMIC_BYTES}: choose a smaller tiling")
    simulator = rt.simulator_in_use()
    Z, H_q, H_kv = layout_.Z, layout_.H_q, layout_.H_kv

    # Alg. 2 line 4: D = rowsum(dO ∘ O), float32.
    D = rt.device_empty((Z, H_q, N_q))
    preprocess(O4, dO4, D, d_v)
    # Alg. 2 line 3: dQ = 0 in HBM (the atomic adds accumulate into it: float32 in both storages).
    dQ = rt.device_zeros((Z, H_q, N_q, d))
    dK = rt.device_empty((Z, H_kv, layout_.N_k, d), storage=storage)
    dV = rt.device_empty((Z, H_kv, layout_.N_k, d_v), storage=storage)
    kernel = make_backward(tiling, d, d_v, simulator, max_registers, vector_red, scale_q)
    dynamic = 4 * size if size > tiled.STATIC_FLOATS else 0
    args = (K4, V4, L4, D, dQ.reshape(-1), dK, dV, _flat(Q4, "Q"), _flat(dO4, "dO"), np.int64(H_q),
            np.int64(N_q), np.float32(tau), np.float32(float(tau) * LOG2E), bool(causal))
    if dynamic and not simulator:
        tiled._allow_dynamic_shared(kernel, args, dynamic)
    grid = (rt.grid_size(layout_.N_k, tiling.B_c), Z, H_kv)
    kernel[grid, tiling.threads, 0, dynamic](*args)
    if storage == "float16":
        # float16 storage: dQ, accumulated in float32, is rounded to float16 once, by one more launch.
        dQ16 = rt.device_empty((Z, H_q, N_q, d), storage=storage)
        n = Z * H_q * N_q * d
        cast_kernel()[rt.grid_size(n, 256), 256](dQ.reshape(n), dQ16.reshape(n))
        dQ = dQ16
    return Flash2Backward(rt.finish(dQ, layout_, (N_q, d)),
                          rt.finish(dK, layout_, (layout_.N_k, d), per_query=False),
                          rt.finish(dV, layout_, (layout_.N_k, d_v), per_query=False))


def _flat(x, name: str):
    """The flat view of a C-contiguous (Z, H, N, d) device array (the pipelined loads index it)."""
    try:
        return x.reshape(-1)
    except Exception as error:  # noqa: BLE001 (numba refuses flat views of non-contiguous arrays)
        raise ValueError(f"{name} must be C-contiguous for the fast backward: {error}") from error


def resources(tiling: BackwardTiling, d: int, d_v: int, max_registers: int | None = None,
              storage: str | None = None) -> dict:
    """The compiler's resource report of the compiled kernel (GPU only): registers, local memory, shared.
    ``storage``: the report of the kernel compiled for that storage dtype (None: the last one compiled)."""
    kernel = make_backward(tiling, d, d_v, False, max_registers)
    out = {}
    for argtypes, compiled in kernel.overloads.items():
        if storage is not None and np.dtype(str(argtypes[0].dtype)) != rt.storage_dtype(storage):
            continue
        out = dict(registers=compiled.regs_per_thread, local_bytes=compiled.local_mem_per_thread,
                   static_shared_bytes=compiled.shared_mem_per_block, shared_floats=layout(tiling, d, d_v)["size"])
    return out
