"""Hopper FA2 forward on float8, rung fp8: h2's kernel (two consumer warpgroups sharing each K/V tile, TMA copies
into a ring of mbarrier-guarded stages) with both products on the FP8 tensor cores — FlashAttention-3 Section 3.3.

What changes against h2 (:mod:`kernels_gpu.hopper.flash_forward_h2`), all of it in
:mod:`kernels_gpu.hopper.fp8_steps`:

1. Q, K, V arrive as float8 e4m3 (one byte each); S = Q₈K₈ᵀ is ``wgmma m64n{B_c}k32 .e4m3`` — twice the K per
   instruction, twice bf16's peak rate.
2. V_j is **transposed in shared memory** after its copy lands (the 8-bit wgmma reads K-major operands only, and V
   arrives with d contiguous), with the key permutation that lets P̃ be packed straight from the accumulators;
   a block barrier and a proxy fence stand between the transpose's stores and the tensor cores' reads.
3. P̃ = 2⁸·exp(S − m) is rounded to e4m3 and packed four to a register: O += P̃ V is ``wgmma m64n{d}k32 .e4m3``
   with A from registers and Vᵀ as B.
4. The descales fold in where they cost nothing: τ·δ_q·δ_k into the softmax's one scale, δ_v into the final 1/ℓ.
   O is written in bfloat16, L in float32 (L = m + log(ℓ/2⁸)).

Shapes: Q (…, N_q, d), K, V (…, N_k, d) e4m3, descales (…) per (batch, head) of their own tensor (Q's heads for
δ_q, K's for δ_k, δ_v); GQA by head mapping; d a multiple of 16 up to 256. Tile shape: B_r = 128, B_c = 128 for
d ≤ 128 and 64 for d = 256 (h2's), two stages. Shared memory at d = 128: Q_i 16 KB, two stages of (K_j, V_j)
64 KB, Vᵀ 16 KB — 97 KB, half of h2's 160 KB for the same tile (one byte an element); at d = 256: 161 KB.

**Costs per (batch, head)** with N_q = N_k = N, not causal: 4N²d FLOPs on FP8 tensor cores (2N²d a product, as
bf16), plus T_r·T_c = N²/(128·B_c) transposes of a B_c × d tile in shared memory — every row block of 128 queries
transposes all of V again, N·d bytes, so N²d/128 bytes in all, one byte moved per 256 multiply-adds; HBM reads
Nd + 2Nd·T_r **bytes** (half of bf16's), writes 2Nd + 4N bytes (O in bfloat16, L in float32).

**Prediction (written before any GPU run — NOT MEASURED).** The FP8 tensor cores double the MMA rate (H100/H200
dense FP8 ~1980 TFLOP/s against ~990 bf16), but h2 is not MMA-bound: its measured 474 (d = 128) / 502 (d = 256)
TFLOP/s at N = 16384 are about half the bf16 peak, the rest lost to the softmax that nothing overlaps (FA3 §3.1).
The softmax costs the same per score in FP8, and this rung adds the V transpose (one shared-memory load and store
per byte of V per row block, plus a block barrier per tile) and two conversions per P̃ element. Model: time per
tile = MMA time (halved) + softmax time (unchanged) + transpose. With h2's MMA and softmax roughly even at
d = 128, halving the MMA part gives ≈ 1.33× and the transpose takes a few percent back: expect **1.2-1.4× h2's
bf16 TFLOP/s at d = 128 (≈ 520-650 TFLOP/s at N ≥ 4096, non-causal)** and a little more at d = 256, where the
MMA share is larger (≈ 1.3-1.5×, 600-750) — so the issue's target of ≥ 1.5× is **likely missed** by this rung:
reaching it needs h3/h4's overlap (producer warpgroup, ping-pong) under FP8 as in FA3 (which reports ~1.2 PFLOP/s
with all of it), and the transpose done by the producer (FA3's LDSM.T/STSM) rather than by the consumers.
Registers: as h2 plus four packed P̃ registers per step (≤ 212 + ~8 at d = 128); at d = 256 with B_c = 64 about
h2's 230. Risk: the byte transpose's shared-memory traffic may conflict in banks (consecutive threads write words
of one Vᵀ row, 4 bytes apart: conflict-free; their loads read four key rows, swizzled: ≤ 2-way).

**What ptxas made of it** (read without a GPU, ``python -m benchmarks.profilers.hopper_sass fp8``, committed in
``benchmarks/results/sm90a_offline/``; CUDA 13.0's ptxas for sm_90a): the inline PTX assembles, the products are
``QGMMA.64x128x32.F32.E4M3.E4M3``; 214 registers at d = 128 (200 at 256, 167 at 64), no local memory. The V
transpose, run for every tile, is a loop whose body alone holds 362 instructions, mostly integer address arithmetic
(IMAD, IADD3, SHF, LOP3, LEA) — more than the unmasked softmax of a tile — so it may cost more than the few percent
the model allows.

**Measured** (H200, 2026-12-02, ``benchmarks/results/nvidia-h200/hopper_forward_fp8.json``, calls queued,
non-causal; the bf16 column is ``hopper.flash_forward``, h5, in the same run): d = 128, N = 4096 / 16384: 236 /
245 TFLOP/s against bf16's 510 / 505 and cuDNN's 675 / 611; d = 256: 257 / 266 against 581 / 580 — **0.44-0.49×
bf16**, a miss by a factor of three of the 1.2-1.4× predicted (and of the issue's 1.5×). Relative error 0.053
against the bf16 inputs' float32 reference at every point (FP8's own rounding; the GPU tests of the rung did not
run: the run stopped at the instruction test, below), and the error study on the kernel matches
fa2edu.fp8's prediction to 10⁻⁴ (per-head) and 1.5·10⁻³ (incoherent), incoherent processing cutting the RMSE
to 0.33× plain. FP8 at 245 is half of h2's bf16 at the same shape (494 in the h5 run), so this rung spends about
as long again as h2 on what it adds; the per-tile V transpose, 362 integer-heavy instructions a thread for every
tile of every row block, is the first suspect, the two conversions per P̃ element the second. Not yet profiled:
the timeline and Nsight Compute's view of this rung are the next run. The GPU test of the FP8 instruction also
taught something: wgmma's e4m3 sums are not float32-exact (:func:`kernels_gpu.hopper.selftest.check_wgmma_fp8`).
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.hopper import launch
from kernels_gpu.hopper.fp8_steps import Fp8Config, make_fp8_steps
from kernels_gpu.tensorcore.steps import LOG2E

__all__ = ["flash_forward_fp8", "make_kernel", "config_for"]


def config_for(d: int, causal: bool, simulated: bool, B_c: int | None = None, stages: int | None = None) -> Fp8Config:
    """The rung's tile shape for head dimension ``d`` (``B_c``, ``stages`` override it)."""
    Bc = B_c or (128 if d <= 128 else 64)
    return Fp8Config(d=d, B_c=Bc, causal=causal, simulated=simulated, stages=stages or 2)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Fp8Config):
    """The FP8 kernel for one configuration (compiled on first launch)."""
    st = make_fp8_steps(cfg)
    aligned_base, tma_q, tma_kv, wait_phase = st["aligned_base"], st["tma_q"], st["tma_kv"], st["wait_phase"]
    s_equals_q_kt, transpose_v, o_plus_p_v = st["s_equals_q_kt"], st["transpose_v"], st["o_plus_p_v"]
    zero, init_stats, online_softmax, finish_rows = st["zero"], st["init_stats"], st["online_softmax"], \
        st["finish_rows"]
    B_r, B_c, STAGES = cfg.B_r, cfg.B_c, cfg.stages
    Q_WORDS, KV_WORDS = cfg.tile_words(B_r), cfg.tile_words(B_c)
    STAGE = 2 * KV_WORDS                      # one stage: K_j, then V_j
    VT_WORDS = cfg.vt_words
    Q_BYTES, STAGE_BYTES = 4 * Q_WORDS, 4 * STAGE
    S_LEN, O_LEN = B_c // 2, cfg.D // 2
    causal = cfg.causal

    @cuda.jit
    def flash_forward_fp8(Q, K, V, O, L, N_q, N_k, G, scale, descale_q, descale_k, descale_v, q_map, k_map, v_map):
        tid = cuda.threadIdx.x
        wg = tid // 128                       # the consumer warpgroup: rows 64·wg … 64·wg + 63 of the block
        warp = (tid % 128) // 32
        g = cuda.laneid // 4
        if causal:                            # grid (heads, batch, row blocks): the longest row blocks first
            h = cuda.blockIdx.x
            z = cuda.blockIdx.y
            i = cuda.gridDim.z - 1 - cuda.blockIdx.z
        else:
            i = cuda.blockIdx.x               # row block i (FA2 Alg. 1 line 3)
            h = cuda.blockIdx.y
            z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)
        q_off = aligned_base(sm)              # words: Q_i, the stages (K_j, V_j), Vᵀ, then the mbarriers
        kv_off = q_off + Q_WORDS
        vt_off = kv_off + STAGES * STAGE
        full = vt_off + VT_WORDS              # full[s] at full + 2s ("stage s holds its tile"), Q's after them
        q_bar = full + 2 * STAGES
        sm_byte = ptx.shared_byte_address(sm, 0)
        s = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        row0 = i * B_r + 64 * wg + 16 * warp + g
        diag = N_k - N_q
        # FA3 §3.3: S = τ·(δ_q Q₈)(δ_k K₈)ᵀ = (Q₈K₈ᵀ)·τδ_qδ_k — the descales join the softmax's one scale.
        scale_log2 = scale * descale_q[z, h] * descale_k[z, hk] * float32(LOG2E)
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)

        if tid == 0:                          # one arrival (the expect-tx) and the bytes complete each phase
            for k in range(STAGES + 1):
                ptx.mbar_init(sm, full + 2 * k, 1)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        # Alg. 1 lines 4 and 7: Q_i and the first tiles (1-byte codes), by the copy engine.
        if tid == 0:
            ptx.mbar_arrive_expect_tx(sm, q_bar, Q_BYTES)
            tma_q(sm, q_off, q_map, i * B_r, h, z, q_bar)
            for k in range(min(STAGES, n_tiles)):
                ptx.mbar_arrive_expect_tx(sm, full + 2 * k, STAGE_BYTES)
                tma_kv(sm, kv_off + k * STAGE, k_map, k * B_c, hk, z, full + 2 * k)
                tma_kv(sm, kv_off + k * STAGE + KV_WORDS, v_map, k * B_c, hk, z, full + 2 * k)
        # Alg. 1 line 5.
        zero(o, O_LEN)
        init_stats(m, l)
        wait_phase(sm, q_bar, 0)
        for j in range(n_tiles):               # Alg. 1 line 6
            stage = j % STAGES
            k_off = kv_off + stage * STAGE
            wait_phase(sm, full + 2 * stage, (j // STAGES) % 2)     # tile j has landed in its stage
            # FA3 §3.3: V_j → Vᵀ in shared memory (K-major, keys permuted), by all 256 threads; the stores made
            # visible to the tensor cores (async proxy) and to each other before anyone's O += P̃ V reads them.
            transpose_v(sm, k_off + KV_WORDS, vt_off, tid)
            ptx.fence_proxy_async()
            cuda.syncthreads()
            # Line 8: S_ij = Q₈,i K₈,jᵀ for this warpgroup's 64 rows (FP8 wgmma, both operands in shared memory).
            s_equals_q_kt(sm, s, sm_byte + 4 * q_off + 64 * 128 * wg, sm_byte + 4 * k_off)
            # Lines 9-10: the online softmax, P̃ = 2⁸·exp(S − m).
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            online_softmax(s, o, m, l, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            # Line 10 (second half): Õ_i += fp8(P̃_ij) V_j (P̃ packed from registers, Vᵀ from shared memory).
            o_plus_p_v(sm, o, s, sm_byte + 4 * vt_off)
            cuda.syncthreads()                # both warpgroups are done with the stage and with Vᵀ ...
            if tid == 0 and j + STAGES < n_tiles:     # ... which takes tile j + STAGES
                ptx.fence_proxy_async()       # (V_j was read by ordinary loads; the copy engine writes next)
                ptx.mbar_arrive_expect_tx(sm, full + 2 * stage, STAGE_BYTES)
                tma_kv(sm, k_off, k_map, (j + STAGES) * B_c, hk, z, full + 2 * stage)
                tma_kv(sm, k_off + KV_WORDS, v_map, (j + STAGES) * B_c, hk, z, full + 2 * stage)
        # Lines 12-15: O_i = δ_v·diag(ℓ_i)⁻¹Õ_i in bfloat16, L_i = m_i + log(ℓ_i/2⁸).
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2, descale_v[z, hk])

    return flash_forward_fp8


def flash_forward_fp8(Q, K, V, causal=False, scale=None, descale_q=None, descale_k=None, descale_v=None,
                      incoherent=True, **options):
    """FA2 forward on Hopper's FP8 tensor cores (FA3 §3.3): softmax(τ·(δ_q Q₈)(δ_k K₈)ᵀ + mask)·(δ_v V₈).

    Args:
        Q: (…, H_q, N_q, d) float8 e4m3 — ``torch.float8_e4m3fn`` tensors (CUDA in place; CPU tensors copied, how
            the simulator runs it), or NumPy / numba arrays of uint8 e4m3 codes. d a multiple of 16 up to 256.
        K, V: (…, H_kv, N_k, d), the same kind; H_q a multiple of H_kv (GQA/MQA).
        causal: bottom-right aligned causal mask.
        scale: τ of the original (dequantised) inputs; default 1/√d.
        descale_q: float32 (…, H_q), δ_q per (batch, head), or None (1); descale_k, descale_v: (…, H_kv).
            ``fa2edu.torch.quantize_fp8`` returns them (per-(batch, head) scales only: block scales are
            ``fa2edu.fp8``'s NumPy path).
        incoherent: whether Q and K were rotated (``quantize_fp8(…, incoherent=True)``): documentation only —
            (QM)(KM)ᵀ = QKᵀ, so the kernel computes the same thing either way.
        options: ``B_c`` (32, 64, 96, 128), ``stages``.

    Returns:
        ``Flash2Forward(O, L)``: O (…, H_q, N_q, d) bfloat16 (a torch tensor for torch inputs; for NumPy inputs
        float32 holding the bfloat16 values; for numba arrays uint16 bfloat16 bit patterns), L (…, H_q, N_q)
        float32, +inf on rows that see no key (their O is 0).
    """
    return launch.run_fp8(make_kernel, config_for, Q, K, V, causal=causal, scale=scale, descale_q=descale_q,
                          descale_k=descale_k, descale_v=descale_v, incoherent=incoherent, **options)
