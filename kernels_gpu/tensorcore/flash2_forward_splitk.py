"""Tensor-core FA2 forward, **split-K** (FA1's work partitioning, FA2 Section 3.3): the warps of a block split each
K/V tile and share the row block Q_i, then merge their partial results through shared memory after every tile.

FA2 Section 3.3: *"For each block, FlashAttention splits K and V across 4 warps while keeping Q accessible by all
warps. Each warp multiplies to get a slice of QKᵀ, then they need to multiply with a slice of V and communicate to
add up the result. This is referred to as the 'split-K' scheme. However, this is inefficient since all warps need to
write their intermediate results out to shared memory, synchronize, then add up the intermediate results."* This
rung is that scheme on tensor cores, with FA2's loop order (Q_i outer) and everything else taken from its partner
:mod:`~kernels_gpu.tensorcore.flash2_forward_splitq`: the same block (4 warps, B_r = 64, B_c = 64, d ≤ 128), the
same copies, ``ldmatrix`` operand loads, the same float32 base-2 arithmetic, P̃ in registers. Only the
partitioning differs, and what follows from it.

**Split-K, per K/V tile j.** Warp w takes the keys 16w … 16w + 15 of the tile and *all* 64 rows of Q_i (four 16-row
MMA tiles). For each row tile it computes the 16 × 16 slice S_w = Q_i K_{j,w}ᵀ, its own statistics over its 16 keys
— m_w = rowmax(S_w), P̃_w = exp(S_w − m_w), ℓ_w = rowsum(P̃_w) — and its partial product Õ_w = P̃_w V_{j,w}
(16 × d: a full row tile of output from a quarter of the keys), and writes (m_w, ℓ_w, Õ_w) to shared memory.
``syncthreads``. Then warp r, which owns row tile r of Õ_i (the rows split-Q would give it), merges the four warps'
partials into its running (m, ℓ, Õ) by the log-sum-exp rule (:func:`fa2edu.merge_attention_states`' rule, tile by
tile): m_new = max(m, max_w m_w), Õ ← e^(m − m_new)·Õ + Σ_w e^(m_w − m_new)·Õ_w, ℓ likewise. Why every tile and
not once at the end? A warp that kept its own (m, ℓ, Õ) over its key slice for the whole run would hold Õ for all
64 rows: 2d float registers per lane (256 at d = 128, past the 255 a thread may have) — FA1 reduces as it goes for
the same reason, and so must any split-K that keeps the accumulators in registers.

What follows, per warp and tile (ldmatrix.x4 loads, KS = d/16 k-steps): split-Q loads its 16 Q rows (KS), all of
K_j (4·KS) and all of V_j (4·d/16); split-K loads all of Q_i (4·KS), its 16 keys of K_j (KS) and its 16 rows of V_j
(d/16, kept in registers for the four row tiles) — fewer operand bytes (48 KiB per tile and block against 72 at
d = 64). What split-K adds is the exchange: each warp writes B_r·(d + 8) floats per tile (its Õ_w fragments,
m_w and ℓ_w, in fragment order so that the reader's lane l finds what the writer's lane l held: no bank conflicts,
and every access one base register plus a constant) and each owner reads 4 × 16·(d + 8); a third ``syncthreads``
per tile; and an exchange buffer of 4·64·(d + 8)·4 bytes (72 KiB at d = 64, 136 KiB at d = 128), which leaves room
for one block (4 warps) per SM where split-Q fits four (d = 64) or two (d = 128).
:func:`~kernels_gpu.tensorcore.traffic.shared_memory_traffic` counts every byte. ptxas (sm_90, no GPU needed:
``python -m kernels_gpu.tensorcore.inspect_ptx splitk splitq``): split-K 135 / 255 registers at d = 64 / 128, no
spills; split-Q 123 / 161.

**Prediction (written before any GPU run).** Per tile and block at d = 64, split-Q moves 88 KiB of shared memory
(16 KiB of K_j, V_j copied in, 72 KiB of operand loads); split-K 208 KiB (16 + 48 + 72 written + 72 read) — 2.4×,
and 2.3× at d = 128 (176 against 400 KiB) — while v9's Nsight profile already found the shared-memory pipe the
busiest unit (48 %). On top: the third barrier per tile (four warps wait for the slowest), and a quarter (d = 64) or
half (d = 128) of split-Q's resident warps to hide latencies with. **Split-K at 0.2-0.4× split-Q's TFLOP/s at
d = 64 and d = 128, N ≥ 4096** — FA2's qualitative claim ("these shared memory reads/writes slow down the forward
pass") made quantitative; how much of the loss is traffic and how much is occupancy only a profile can split
(Nsight Compute: shared-memory pipe utilisation, barrier stalls, achieved occupancy).

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks/results/nvidia-h100/tensorcore_variants.json``; fp16,
non-causal, batch × N = 16k tokens, hidden 2048, TFLOP/s at N = 4096 / 16384): d = 64: 61.0 / 65.5 (split-Q 179.9 /
239.5: 0.34 / 0.27×); d = 128: 78.2 / 83.2 (split-Q 157.8 / 189.4: 0.50 / 0.44×); SDPA flash 309-343. Shared-memory
traffic counted as above: 208 / 400 KiB per tile and block (2.36 / 2.27× split-Q's), 0.20 bytes per FLOP, moved at
12.4 / 13.3 TB/s (d = 64) and 15.3 / 16.3 TB/s (d = 128). At d = 64 the prediction (0.2-0.4×) holds; at d = 128
split-K did better than predicted, about as well as its extra traffic alone allows — it moves shared memory as fast
as split-Q there (split-Q: 13.6 / 16.3 TB/s), so its time follows its bytes. At d = 64 it loses more than the
traffic explains (12-13 against split-Q's 15.5-20.6 TB/s); that the rest is the one resident block per SM (split-Q
fits four at d = 64, two at d = 128) and the third barrier is likely but not established without a profile.
ptxas as above (135 / 255 registers, no spills; 117 / 221 KiB of shared memory per block). Relative error
against SDPA's float32 output 2.4e-4 (split-Q 2.8-2.9e-4). GPU tests (``gpu_tests_tensorcore_tf32_partitioning.log``):
31 passed.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint32

from kernels_gpu import ptx
from kernels_gpu.tensorcore import flash2_forward_splitq, launch
from kernels_gpu.tensorcore.steps import LOG2E, Config, device, make_steps

__all__ = ["flash2_forward", "make_kernel", "config_for", "shared_words", "exchange_words"]

#: split-Q's tile shape and head-dimension limit: the comparison changes the partitioning only
config_for = flash2_forward_splitq.config_for


def exchange_words(cfg: Config) -> int:
    """32-bit words of the exchange buffer: for each of the W writing warps and each of the B_r / 16 row tiles, the
    partial Õ_w (d/8 tiles × 4 registers × 32 lanes) and m_w, ℓ_w (2 rows × 32 lanes each): W·B_r·(D + 8)."""
    return cfg.warps * cfg.B_r * (cfg.D + 8)


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, two stages of K_j, V_j (RS words per row), and the exchange buffer."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS + exchange_words(cfg)


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: Config):
    """The split-K kernel for one configuration (compiled on first launch)."""
    st = make_steps(cfg)
    copy_q, copy_kv, zero, init_stats = st["copy_q_async_inc"], st["copy_kv_async_inc"], st["zero"], st["init_stats"]
    finish_rows, mma_into = st["finish_rows_exp2"], st["mma_into"]
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    shfl_xor, ex2 = ptx.shfl_xor, ptx.ex2
    jit = device(cfg.simulated)
    W, B_r, B_c, RS, NO = cfg.warps, cfg.B_r, cfg.B_c, cfg.RS, cfg.NO
    RT = B_r // 16                           # 16-row MMA tiles of Q_i, every one computed by every warp
    if B_c != 16 * W or RT != W or W != 4:
        raise ValueError(f"split-K here gives each of 4 warps 16 keys of a tile and one row tile to own: W = 4, "
                         f"B_c = B_r = 64, got B_c = {B_c}, B_r = {B_r}, W = {W}")
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    K_OFF = B_r * RS                         # word offsets in the one shared array: Q_i, stage 0 (K, V),
    V_OFF = K_OFF + B_c * RS                 # stage 1 (K, V), then the exchange: Õ_w, m_w, ℓ_w of every warp
    STAGE = 2 * B_c * RS
    X_OFF = K_OFF + 2 * STAGE
    # The exchange buffer, per writing warp w and row tile r, SL slots of 32 words (one per lane): Õ_w's 4·NO
    # accumulator registers (slot 4n + e), then m_w of rows g, g + 8 (slots 4NO, 4NO + 1), then ℓ_w (4NO + 2, + 3).
    # Word X_OFF + ((w·RT + r)·SL + slot)·32 + lane: a lane writes and reads at fixed offsets from one base.
    SL = 4 * NO + 4
    M_SLOT, L_SLOT = 4 * NO, 4 * NO + 2
    causal = cfg.causal
    S_LEN, O_LEN = 4 * 2 * RT, 4 * NO        # register arrays: S_w (2 tiles of 16 × 8 per row tile), Õ
    VB_LEN = 2 * NO                          # ... and the warp's V_j slice as B fragments
    neg_inf = float32(-float("inf"))

    @jit
    def slice_softmax(s, q, h, row, col0, N_k, scale_log2, diag, mask_tile):
        """The warp's own softmax statistics of one row (h = 0: row g, h = 1: row g + 8 of the row tile whose
        accumulators are S tiles q, q + 1) over its 16 keys col0 … col0 + 15, in place: mask, m_w = the row
        maximum over the slice (the lane's 4 values, then xor 1, xor 2 over its group), P̃_w = 2^((S − m_w)·τlog₂e),
        and the lane's part of ℓ_w. Returns (m_w, lane's ℓ_w); a row that sees none of the 16 keys gets m_w = −∞,
        P̃_w = 0, ℓ_w = 0 (the guard: exp(x − m) with m = −∞ would be NaN)."""
        mx = neg_inf
        for n in range(2):
            for e in range(2):
                if mask_tile:
                    col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                    if col >= N_k or (causal and col > row + diag):
                        s[4 * (q + n) + 2 * h + e] = neg_inf
                mx = max(mx, s[4 * (q + n) + 2 * h + e])
        mx = max(mx, shfl_xor(mx, 1))
        mx = max(mx, shfl_xor(mx, 2))
        rowsum = float32(0.0)
        if mx == neg_inf:
            for n in range(2):
                for e in range(2):
                    s[4 * (q + n) + 2 * h + e] = float32(0.0)
            return mx, rowsum
        m_scaled = mx * scale_log2
        for n in range(2):
            for e in range(2):
                p = ex2(s[4 * (q + n) + 2 * h + e] * scale_log2 - m_scaled)
                s[4 * (q + n) + 2 * h + e] = p
                rowsum += p
        return mx, rowsum

    @jit
    def row_tile_partials(s, po, vb, out, r, row, col0, N_k, scale_log2, diag, mask_tile):
        """FA2 Alg. 1 lines 9-10 on the warp's slice of row tile r (constant: see the kernel), in place: the slice's
        statistics and P̃_w for the lane's two rows (``row``: its first, global), then the partial
        Õ_w = P̃_w V_{j,w} — one 16-key k-step, A straight from S's accumulators of tiles 2r, 2r + 1, B from ``vb``
        — and (m_w, ℓ_w, Õ_w) written to the exchange buffer for the owner of row tile r. ``out``: the buffer seen
        from this warp's and lane's first word (``out[(r·SL + slot)·32]``); ``col0``: the warp's first key."""
        for hh in range(2):
            m_w, l_w = slice_softmax(s, 2 * r, hh, row + 8 * hh, col0, N_k, scale_log2, diag, mask_tile)
            out[(r * SL + M_SLOT + hh) * 32] = m_w
            out[(r * SL + L_SLOT + hh) * 32] = l_w
        a0 = pack(s[8 * r], s[8 * r + 1])
        a1 = pack(s[8 * r + 2], s[8 * r + 3])
        a2 = pack(s[8 * r + 4], s[8 * r + 5])
        a3 = pack(s[8 * r + 6], s[8 * r + 7])
        zero(po, O_LEN)
        for n in range(NO):
            mma_into(po, n, a0, a1, a2, a3, vb[2 * n], vb[2 * n + 1])
        # Õ_w to shared memory in fragment order (slot 4n + e), lane by lane.
        for n in range(NO):
            for e in range(4):
                out[(r * SL + 4 * n + e) * 32] = po[4 * n + e]

    @jit
    def merge_row(o, m, l, h, inp, mw, scale_log2):
        """The exchange's second half for one of the owner lane's two rows (constant h): the W warps' (m_w, ℓ_w,
        Õ_w) of the owner's row tile, read in fragment order, merged into the running (m, ℓ, Õ) by the log-sum-exp
        rule — m_new = max(m, max_w m_w), ℓ ← e^(m − m_new)·ℓ + Σ_w e^(m_w − m_new)·ℓ_w, Õ likewise (FA2 Alg. 1
        lines 9-10 across warps). ``inp``: the buffer seen from writer 0's first word for the owner's row tile and
        this lane (writer w's slot at ``inp[(w·RT·SL + slot)·32]``); ``mw``: W registers of scratch."""
        m_new = m[h]
        for w in range(W):
            mw[w] = inp[(w * RT * SL + M_SLOT + h) * 32]
            m_new = max(m_new, mw[w])
        # Guard: while no warp's slice has had a visible key for this row, m_new = −∞ and e^(m_w − m_new) would be
        # NaN; measuring from 0 instead makes every β = e^(−∞) = 0 (the partials of such a row are 0 anyway), and
        # every lane reads the same words whatever the mask (the traffic does not depend on the data).
        m_scaled = m_new * scale_log2 if m_new != neg_inf else float32(0.0)
        # Alg. 1 line 10: the old ℓ and Õ scaled down to the new maximum, only if it moved.
        if m_new != m[h]:
            alpha = ex2(m[h] * scale_log2 - m_scaled)
            l[h] *= alpha
            for n in range(NO):
                for e in range(2):
                    o[4 * n + 2 * h + e] *= alpha
        # The merge: each warp's partial weighted by e^(m_w − m_new) (0 for a slice with no visible key).
        for w in range(W):
            beta = ex2(mw[w] * scale_log2 - m_scaled)
            l[h] += beta * inp[(w * RT * SL + L_SLOT + h) * 32]
            for n in range(NO):
                for e in range(2):
                    o[4 * n + 2 * h + e] += beta * inp[(w * RT * SL + 4 * n + 2 * h + e) * 32]
        m[h] = m_new

    @cuda.jit
    def flash2_forward_tc_splitk(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, as 32-bit words ...
        x = cuda.shared.array(0, float32)     # ... and the same memory as floats (the exchange)
        s = cuda.local.array(S_LEN, float32)  # S_w, then P̃_w: all 64 rows × this warp's 16 keys
        po = cuda.local.array(O_LEN, float32)  # the partial Õ_w = P̃_w V_{j,w} of one row tile
        o = cuda.local.array(O_LEN, float32)  # the running Õ of the row tile this warp owns
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        mw = cuda.local.array(W, float32)
        vb = cuda.local.array(VB_LEN, uint32)  # this warp's 16 rows of V_j as B fragments (b0, b1 of each O tile)
        row0 = i * B_r + 16 * warp + g        # the owned row tile's rows of this lane: row0 and row0 + 8
        # The exchange buffer as this lane writes it (its warp's slots) and reads it (its row tile's slots): views
        # from one base each, so every access is the base plus a constant (one address register, not hundreds).
        out = x[X_OFF + warp * RT * SL * 32 + lane:]
        inp = x[X_OFF + warp * SL * 32 + lane:]
        diag = N_k - N_q
        scale_log2 = scale * float32(LOG2E)   # τ·log₂e: exp(τx) = 2^(x·τlog₂e)

        # Causal: the tiles right of the block's last row's diagonal are never visited (all masked).
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)
        # Alg. 1 lines 4 and 7 (j = 1): start the copies of Q_i, K_1, V_1, as one group.
        copy_q(sm, 0, Q, z, h, i * B_r, N_q, tid)
        if n_tiles > 0:
            copy_kv(sm, K_OFF, K, z, hk, 0, N_k, tid)
            copy_kv(sm, V_OFF, V, z, hk, 0, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ for the owned row tile (in registers).
        zero(o, O_LEN)
        init_stats(m, l)
        # Alg. 1 line 6: for j = 1 … T_c.
        for j in range(n_tiles):
            stage = (j % 2) * STAGE
            # Line 7 for tile j + 1, started now, lands while tile j is computed.
            if j + 1 < n_tiles:
                copy_kv(sm, K_OFF + STAGE - stage, K, z, hk, (j + 1) * B_c, N_k, tid)
                copy_kv(sm, V_OFF + STAGE - stage, V, z, hk, (j + 1) * B_c, N_k, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_one()           # this thread's copies of tile j (and Q_i) have landed ...
            cuda.syncthreads()                # ... and everyone's

            # Line 8, split-K: S_w = Q_i K_{j,w}ᵀ — all four row tiles of Q_i against this warp's 16 keys
            # (16w … 16w + 15 of the tile): one ldmatrix of K per k-step serves the four row tiles.
            zero(s, S_LEN)
            for kk in range(KS):
                # B: lanes 8u … 8u+7 address keys 16w + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                k_row = K_OFF + stage + (16 * warp + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                b0, b1, b2, b3 = ldmatrix(sm, k_row)
                for r in range(RT):
                    # A: row tile r of Q_i (lanes 0-15 rows 16r + 0…15 at word 8kk, lanes 16-31 4 words on).
                    a0, a1, a2, a3 = ldmatrix(sm, (16 * r + lane % 16) * RS + 8 * kk + 4 * (lane // 16))
                    mma_into(s, 2 * r, a0, a1, a2, a3, b0, b1)
                    mma_into(s, 2 * r + 1, a0, a1, a2, a3, b2, b3)

            # Lines 9-10, each warp on its own slice, row tile by row tile: statistics, P̃_w, the partial Õ_w, all
            # written out for the owner of that row tile. The mask only where a key of the tile can be invisible to
            # some row. Four calls with a constant r, not a loop: a loop over r stayed rolled, and S_w's registers
            # went to local memory to be indexed by it (as steps.row_softmax says of h).
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            row = i * B_r + g                 # this lane's first row in row tile 0
            col0 = j * B_c + 16 * warp        # this warp's first key
            for p in range(NO // 2):
                # B (transposed on the way): this warp's keys 16w + 8(u % 2) + 0…7, columns 16p + 8(u // 2) …
                v_row = (V_OFF + stage + (16 * warp + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 8 * p
                         + 4 * (lane // 16))
                b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                vb[4 * p] = b0
                vb[4 * p + 1] = b1
                vb[4 * p + 2] = b2
                vb[4 * p + 3] = b3
            row_tile_partials(s, po, vb, out, 0, row, col0, N_k, scale_log2, diag, mask_tile)
            row_tile_partials(s, po, vb, out, 1, row + 16, col0, N_k, scale_log2, diag, mask_tile)
            row_tile_partials(s, po, vb, out, 2, row + 32, col0, N_k, scale_log2, diag, mask_tile)
            row_tile_partials(s, po, vb, out, 3, row + 48, col0, N_k, scale_log2, diag, mask_tile)
            cuda.syncthreads()                # the exchange: every warp's partials are in shared memory

            # The owner of row tile w merges the four warps' partials of its rows (log-sum-exp rule).
            merge_row(o, m, l, 0, inp, mw, scale_log2)
            merge_row(o, m, l, 1, inp, mw, scale_log2)
            cuda.syncthreads()                # stage j mod 2 (and the exchange buffer) free for the next tiles

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once, by the owners.
        finish_rows(o, m, l, O, L, z, h, row0, N_q, scale_log2)

    return flash2_forward_tc_splitk


def flash2_forward(Q, K, V, causal=False, scale=None):
    """FA2 forward on tensor cores with FA1's split-K work partitioning between warps (FA2 Section 3.3): every warp
    takes a quarter of each K/V tile's keys for all rows of the block, and the warps merge their partial results
    through shared memory after every tile. Q (…, N_q, d), K, V (…, N_k, d), float16 or bfloat16, d ≤ 128 (see
    :mod:`kernels_gpu.tensorcore.launch` for the kinds of arrays accepted). Returns ``Flash2Forward(O, L)``: O in
    the input dtype, L float32 (+inf on rows that see no key). ``causal``: bottom-right aligned; ``scale``: τ,
    default 1/√d."""
    return launch.run(make_kernel, config_for, shared_words, Q, K, V, causal=causal, scale=scale)
