"""Tensor-core FA2 backward, v3: dQ in a pass of its own, parallel over query blocks — no atomics (v2 + one change).

FA2 Section 3.2 names the choice: the backward's two sums run in opposite directions (dK_j, dV_j over the row
blocks i; dQ_i over the key blocks j), and a kernel parallel over one of them must merge the other across thread
blocks. v1 and v2 do what FA2 does: parallel over key blocks, dQ merged by float32 atomic adds in HBM (B_r·d of
them per key block and row block: T_c·N_q·d per head, as much traffic as re-reading Q and dO for every key block,
plus a zeroing and a conversion launch, and a dQ that is not bit-reproducible). The alternative is two kernels,
each owning its sum:

* the key-block kernel of v2 without Alg. 2 line 20: Sᵀ, Pᵀ, dV_j, dPᵀ, dSᵀ, dK_j — no dSᵀ through shared
  memory, no dQ products, no atomics;
* a dQ kernel in the forward's orientation (one block per query block of 64 rows, a warp per 16 rows, K_j and V_j
  double-buffered as in the forward v4): per key tile it recomputes S = Q_i K_jᵀ, P = exp(S − L_i) and
  dP = dO_i V_jᵀ, forms dS = P ∘ (dP − D_i), and accumulates dQ_i += dS K_j in registers — dS's accumulators are
  the A operand (C → A), K_j the B operand by ``ldmatrix.trans`` — then writes τ dQ_i once, in the input dtype.

The price is recomputation: S and dP twice, 7 matrix products per (i, j) instead of 5 (1.4× the tensor-core
work); the gain is no atomics, no shared-memory round trip for dS, one barrier per step instead of two (each
kernel issues the next step's copy right after the barrier that ends the previous step's reads), and a
deterministic dQ. Both kernels keep the tile shapes of v2.

**Prediction (written before the first GPU run).** If v2 is bound by its tensor-core and shared-memory pipes,
1.4× the products makes v3 slower by up to 25 %; if the atomics and the dSᵀ round trip (two barriers per row
block) bound v2, v3 gains. From the forward ladder (16-row warps at ~120 TFLOP/s of their own products on this
H100), v3's two kernels should each run near the forward v6's rate, so v3 ≈ 5/7 of that: 70-85 TFLOP/s by the
paper's model at d = 64 and 128 (N = 4096, fp16, non-causal) — within ±15 % of v2, 0.25-0.3× SDPA flash's
backward. FlashAttention-2 and -3 keep the atomics; this rung is here to measure the choice. Registers (ptxas,
sm_90, before any run; ``python -m kernels_gpu.tensorcore.inspect_ptx bwd_v3 bwd_v3_dq --d 64 128 256``): key-block
kernel 224-240 at d = 64 (cap 248), 252-255 at d = 128, 245-255 at d = 256, no spills; dQ kernel 168
(capped: three blocks per SM) at d = 64 with a 16-byte spill when causal, 159-162 at d = 128, 164-167 at d = 256.
Shared memory: 55 / 68.5 / 132.5 KiB (key blocks) and 54 / 68 / 132 KiB (dQ) at d = 64 / 128 / 256.

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks/results/nvidia-h100/tensorcore_backward.json``; fp16, non-causal,
batch × N = 16k tokens, hidden 2048, TFLOP/s by the model backward = 2.5 × forward, at N = 1024 / 4096 / 8192;
SDPA flash's backward in the same run: 200.8 / 248.0 / 276.0 at d = 64, 198.9 / 271.3 / 290.6 at d = 128).
d = 64: 114.1 / 144.2 / 153.8 (0.57 / 0.58 / 0.56× SDPA flash); d = 128: 97.5 / 141.3 / 155.2 (0.49 / 0.52 / 0.53×)
— +24-54 % over v2 (+29 % / +34 % at N = 4096), the fastest rung: ``kernels_gpu.tensorcore.flash2_backward`` is v3.
The prediction (70-85, within ±15 % of v2) failed in the good direction: v2 was bound by the atomics and the dSᵀ
round trip with its second barrier, not by its products, so 1.4× the tensor-core work costs less than they did.
Against the project's target (≥ 90 TFLOP/s and ≥ 0.4× SDPA flash at N ≥ 4096, d = 64 and 128): met in fp16,
non-causal — 141-155 TFLOP/s, 0.52-0.58×; bf16 and causal were not timed (not established). Largest relative error
of dQ, dK, dV 3.0e-4, SDPA flash's. Key-block kernel 248 / 252 registers, 55 / 68.5 KiB of shared memory, no local
memory. compute-sanitizer memcheck (``sanitizer_tensorcore_bwd_v3_memcheck.log``: fp16 and bf16, d = 64 / 128 /
256, causal and not): 0 errors. The backward GPU tests (``gpu_tests_tensorcore_backward.log``): 34 passed, every
rung.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, types, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import backward_launch
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps

__all__ = ["flash2_backward", "make_kernel", "make_dq_kernel", "config_for", "shared_words", "dq_shared_words"]

_WORDS, _FLOATS = types.uint32[:, :, :, ::1], types.float32[:, :, :, ::1]
_SCALARS = (types.int32,) * 3 + (types.float32,) * 2
#: the argument types of the two kernels, for ``kernels_gpu.tensorcore.inspect_ptx`` (``bwd_v3``, ``bwd_v3_dq``)
PTX_SIGNATURE = (_WORDS,) * 4 + (_FLOATS,) + (_WORDS,) * 2 + _SCALARS        # Q, K, V, dO, stats, dK, dV, …
DQ_PTX_SIGNATURE = (_WORDS,) * 4 + (_FLOATS,) + (_WORDS,) + _SCALARS         # Q, K, V, dO, stats, dQ, …


def config_for(d: int, dtype: str, causal: bool, simulated: bool, *, warps: int = 4, B_r: int | None = None,
               chunks: int | None = None) -> BackwardConfig:
    """v3's tile shape (v2's): 4 warps (B_c = 64 keys per key block, 64 queries per query block of the dQ
    kernel); B_r = 64 queries per row block (keys per tile in the dQ kernel) up to d = 64, 32 beyond; two column
    chunks above d = 128. Registers: the key-block kernel capped at 248 up to d = 64 (v2's), the dQ kernel at 168
    up to d = 128 — three blocks (12 warps) per SM; ptxas then spills nothing except 16 bytes at d = 64 causal
    (uncapped it takes 199-202 at d = 64, 159-164 at d = 128: two blocks). The keywords override the shape (the
    tests run small shapes in the simulator)."""
    B_r = B_r or (64 if d <= 64 else 32)
    return BackwardConfig(d=d, warps=warps, B_r=B_r, dtype=dtype, causal=causal, simulated=simulated,
                          chunks=chunks or (1 if d <= 128 else 2),
                          max_registers=248 if d <= 64 and B_r == 64 and warps == 4 else None,
                          max_registers_dq=168 if d <= 128 and warps == 4 else None)


def shared_words(cfg: BackwardConfig) -> int:
    """The key-block kernel: K_j, V_j, two stages of Q_i, dO_i (RS words per row), two stages of L_i, D_i."""
    return 2 * cfg.B_c * cfg.RS + 4 * cfg.B_r * cfg.RS + 4 * cfg.B_r


def dq_shared_words(cfg: BackwardConfig) -> int:
    """The dQ kernel: Q_i, dO_i (16·W rows), two stages of K_j, V_j (B_r rows each)."""
    return 2 * cfg.B_c * cfg.RS + 4 * cfg.B_r * cfg.RS


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: BackwardConfig):
    """v3's key-block kernel (dK_j, dV_j) for one configuration (compiled on first launch)."""
    st = make_backward_steps(cfg)
    copy_kv, copy_q, copy_stats, zero = st["copy_kv_async"], st["copy_q_async"], st["copy_stats_async"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    probabilities, softmax_gradient, store_rows = st["probabilities"], st["softmax_gradient"], st["store_rows"]
    B_r, B_c, RS = cfg.B_r, cfg.B_c, cfg.RS
    CHUNKS, DC = cfg.chunks, cfg.DC
    K_OFF = 0                                # word offsets: K_j, V_j, stage 0 (Q_i, dO_i), stage 1 (Q_i, dO_i),
    V_OFF = B_c * RS                         # then (as floats) stage 0 (L_i·log₂e, D_i), stage 1
    Q_OFF = 2 * B_c * RS
    DO_OFF = Q_OFF + B_r * RS
    STAGE = 2 * B_r * RS
    L_OFF = Q_OFF + 2 * STAGE
    D_OFF = L_OFF + B_r
    FSTAGE = 2 * B_r
    S_LEN, C_LEN = 4 * cfg.NT, 4 * cfg.NC
    causal = cfg.causal

    @cfg.jit()
    def flash2_backward_tc_v3(Q, K, V, dO, stats, dK, dV, N_q, N_k, G, scale, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        j = cuda.blockIdx.x // CHUNKS         # key block j (Alg. 2 line 5: one block per j, in parallel)
        c = cuda.blockIdx.x - j * CHUNKS      # the column chunk of dK_j, dV_j this block computes
        hk = cuda.blockIdx.y
        z = cuda.blockIdx.z
        sm = cuda.shared.array(0, uint32)
        smf = cuda.shared.array(0, float32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dk = cuda.local.array(C_LEN, float32)
        dv = cuda.local.array(C_LEN, float32)
        diag = N_k - N_q
        key0 = j * B_c + 16 * warp
        col_word = c * (DC // 2)

        # Alg. 2 line 8's loop over (query head of the GQA group, row block i), flattened, as in v2.
        T_r = (N_q + B_r - 1) // B_r
        i_first = 0
        if causal and j * B_c - diag > 0:
            i_first = min(T_r, (j * B_c - diag) // B_r)
        n_i = T_r - i_first
        n_steps = G * n_i
        # Alg. 2 line 6, and lines 9-10 for the first step, as one group.
        copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        if n_steps > 0:
            copy_q(sm, Q_OFF, Q, z, hk * G, i_first * B_r, N_q, tid)
            copy_q(sm, DO_OFF, dO, z, hk * G, i_first * B_r, N_q, tid)
            copy_stats(smf, L_OFF, stats, z, hk * G, i_first * B_r, tid)
        ptx.cp_async_commit()
        # Alg. 2 line 7: dK_j = 0, dV_j = 0.
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        for step in range(n_steps):
            gq = step // n_i
            i = i_first + step - gq * n_i
            stage = step % 2
            ptx.cp_async_wait_all()           # this step's tiles have landed (the only group in flight) ...
            cuda.syncthreads()                # ... for everyone, and nobody still reads the other stage
            # Lines 9-10 for the next step, into the other stage, land while this one is computed.
            if step + 1 < n_steps:
                gq_next = (step + 1) // n_i
                i_next = i_first + step + 1 - gq_next * n_i
                h_next = hk * G + gq_next
                other = 1 - stage
                copy_q(sm, Q_OFF + other * STAGE, Q, z, h_next, i_next * B_r, N_q, tid)
                copy_q(sm, DO_OFF + other * STAGE, dO, z, h_next, i_next * B_r, N_q, tid)
                copy_stats(smf, L_OFF + other * FSTAGE, stats, z, h_next, i_next * B_r, tid)
            ptx.cp_async_commit()
            q_off = Q_OFF + stage * STAGE
            do_off = DO_OFF + stage * STAGE

            # Line 11: Sᵀ = K_j Q_iᵀ; line 13: Pᵀ = exp(τSᵀ − L_i) (masked only where needed).
            product_transposed(s, sm, K_OFF, q_off, warp, lane)
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            probabilities(s, smf, L_OFF + stage * FSTAGE, key0 + lane // 4, i * B_r, N_k, scale_log2, diag,
                          mask_tile)
            # Line 16: dV_j += Pᵀ dO_i.
            product_accumulate(dv, s, sm, do_off, col_word, lane)
            # Line 17: dPᵀ = V_j dO_iᵀ; line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            product_transposed(dp, sm, V_OFF, do_off, warp, lane)
            softmax_gradient(s, dp, smf, D_OFF + stage * FSTAGE)
            # Line 21: dK_j += dSᵀ Q_i. (Line 20, dQ_i, is the dQ kernel's.)
            product_accumulate(dk, s, sm, q_off, col_word, lane)

        ptx.cp_async_wait_all()
        # Line 24: write dK_j = τ Σ dSᵀQ, dV_j to HBM, once.
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flash2_backward_tc_v3


@functools.lru_cache(maxsize=None)
def make_dq_kernel(cfg: BackwardConfig):
    """v3's dQ kernel for one configuration: one block per query block of 16·W rows (a warp per 16 rows, the
    forward's split), looping over key tiles of B_r keys. The same products as the key-block kernel with the roles
    of the operands exchanged: the warp's 16 rows are queries, the tile's B_r rows are keys."""
    st = make_backward_steps(cfg)
    copy_rows, copy_tile, zero = st["copy_kv_async"], st["copy_q_async"], st["zero"]     # 16·W rows; B_r rows
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    probabilities, softmax_gradient, store_rows = st["probabilities_rows"], st["softmax_gradient_rows"], \
        st["store_rows"]
    B_r, B_q, RS = cfg.B_r, cfg.B_c, cfg.RS  # keys per tile; queries per block (16 per warp)
    CHUNKS, DC = cfg.chunks, cfg.DC
    Q_OFF = 0                                # word offsets: Q_i, dO_i, stage 0 (K_j, V_j), stage 1 (K_j, V_j)
    DO_OFF = B_q * RS
    K_OFF = 2 * B_q * RS
    V_OFF = K_OFF + B_r * RS
    STAGE = 2 * B_r * RS
    S_LEN, C_LEN = 4 * cfg.NT, 4 * cfg.NC
    causal = cfg.causal

    @cfg.jit(dq=True)
    def flash2_backward_dq_tc_v3(Q, K, V, dO, stats, dQ, N_q, N_k, G, scale, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        i = cuda.blockIdx.x // CHUNKS         # query block i: one block per i (FA2 Section 3.2, as the forward)
        c = cuda.blockIdx.x - i * CHUNKS      # the column chunk of dQ_i this block computes
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dq = cuda.local.array(C_LEN, float32)
        lrow = cuda.local.array(2, float32)
        drow = cuda.local.array(2, float32)
        diag = N_k - N_q
        first_row = i * B_q + 16 * warp
        row0 = first_row + lane // 4          # this lane's first row; its second is row0 + 8
        col_word = c * (DC // 2)
        # Alg. 2 line 10 for the lane's two rows: L·log₂e and D (+∞ and 0 past N_q: P = 0, dS = 0).
        for hh in range(2):
            lrow[hh] = stats[z, h, 0, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(math.inf)
            drow[hh] = stats[z, h, 1, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(0.0)

        # Causal: the key tiles right of the block's last row's diagonal are never visited.
        n_tiles = (N_k + B_r - 1) // B_r
        if causal:
            last = min(N_k, (i + 1) * B_q + diag)
            n_tiles = max(0, (last + B_r - 1) // B_r)
        copy_rows(sm, Q_OFF, Q, z, h, i * B_q, N_q, tid)
        copy_rows(sm, DO_OFF, dO, z, h, i * B_q, N_q, tid)
        if n_tiles > 0:
            copy_tile(sm, K_OFF, K, z, hk, 0, N_k, tid)
            copy_tile(sm, V_OFF, V, z, hk, 0, N_k, tid)
        ptx.cp_async_commit()
        zero(dq, C_LEN)                       # Alg. 2 line 3 for this block's rows: dQ_i = 0, in registers
        for jt in range(n_tiles):
            stage = (jt % 2) * STAGE
            ptx.cp_async_wait_all()           # this tile (and Q_i, dO_i) has landed ...
            cuda.syncthreads()                # ... for everyone, and nobody still reads the other stage
            if jt + 1 < n_tiles:              # the next tile's copy runs under this tile's products
                copy_tile(sm, K_OFF + STAGE - stage, K, z, hk, (jt + 1) * B_r, N_k, tid)
                copy_tile(sm, V_OFF + STAGE - stage, V, z, hk, (jt + 1) * B_r, N_k, tid)
            ptx.cp_async_commit()
            # Alg. 2 lines 11, 13: S = Q_i K_jᵀ (the warp's 16 rows × B_r keys), P = exp(τS − L_i).
            product_transposed(s, sm, Q_OFF, K_OFF + stage, warp, lane)
            mask_tile = (jt + 1) * B_r > N_k or (causal and (jt + 1) * B_r - 1 > i * B_q + diag)
            probabilities(s, lrow, row0, jt * B_r, N_k, scale_log2, diag, mask_tile)
            # Lines 17, 19: dP = dO_i V_jᵀ, dS = P ∘ (dP − D_i).
            product_transposed(dp, sm, DO_OFF, V_OFF + stage, warp, lane)
            softmax_gradient(s, dp, drow)
            # Line 20: dQ_i += dS K_j — dS's accumulators are the A operand, K_j the B operand (transposed load).
            product_accumulate(dq, s, sm, K_OFF + stage, col_word, lane)

        ptx.cp_async_wait_all()
        # dQ_i = τ Σ_j dS K_j, written once in the input dtype (no float32 copy, no atomics).
        store_rows(dq, dQ, z, h, first_row, N_q, col_word, scale, lane)

    return flash2_backward_dq_tc_v3


def flash2_backward(Q, K, V, O, L, dO, causal=False, scale=None, **tile):
    """FA2 backward on tensor cores, rung v3 (dK, dV by key blocks as v2; dQ by a second kernel over query blocks,
    without atomics). Same arguments and result as v1's
    (:func:`kernels_gpu.tensorcore.flash2_backward_v1.flash2_backward`); dQ is bit-reproducible here. Cost:
    14·N_q·N_k·d FLOPs per head (7 products; the paper's model counts 10), no atomic adds; ``tile``: ``warps``,
    ``B_r``, ``chunks``."""
    return backward_launch.run_backward_dq_pass(make_kernel, make_dq_kernel, config_for, shared_words,
                                                dq_shared_words, Q, K, V, O, L, dO, causal=causal, scale=scale,
                                                **tile)
