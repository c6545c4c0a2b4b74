"""The shared-memory bytes of FA2 Section 3.3's two work partitionings, counted from their kernels' code.

FA2 Section 3.3 argues that split-K (FA1: the warps of a block split K and V) loses to split-Q (FA2: the warps split
Q) because split-K's warps "write their intermediate results out to shared memory, synchronize, then add up the
intermediate results". :func:`shared_memory_traffic` turns that into bytes for the two rungs that make the
comparison, :mod:`~kernels_gpu.tensorcore.flash2_forward_splitq` and
:mod:`~kernels_gpu.tensorcore.flash2_forward_splitk` (same tile shape, same copies, same MMAs), by counting
what their code does — every ``cp.async`` writes 16 bytes into shared memory, every ``ldmatrix.x4`` reads 4 × 8 rows
of 16 bytes (512 bytes per warp), every scalar shared access of split-K's exchange moves 4 bytes per lane:

=================  =============================================  ============================================
per block          split-Q                                        split-K
=================  =============================================  ============================================
copies in, once    Q_i: B_r·D·2                                   the same
copies in, tile j  K_j, V_j: 2·B_c·D·2                            the same
ldmatrix, tile j   W·512·(KS·(1 + B_c/16) + (B_c/16)·D/16)        W·512·(KS·(1 + B_r/16) + D/16)
exchange, tile j   none                                           writes W·B_r·(D + 8)·4, reads as many
=================  =============================================  ============================================

(D: d rounded up to 16; KS = D/16 k-steps; B_r = B_c = 16·W = 64. Split-Q's warps each load their Q rows and all of
K_j, V_j; split-K's load all of Q_i and their quarter of K_j, V_j, the V quarter once for the four row tiles: split-K
reads fewer operand bytes, 2/3 of split-Q's at d = 64, and the exchange is its extra.) Tests count the same bytes in
numba's simulator, access by access, and compare.
"""

from __future__ import annotations

from kernels_gpu.runtime import grid_size
from kernels_gpu.tensorcore import flash2_forward_splitk, flash2_forward_splitq
from kernels_gpu.tensorcore.steps import causal_tiles

__all__ = ["shared_memory_traffic", "VARIANTS"]

#: the partitionings :func:`shared_memory_traffic` knows, and the module of each one's kernel
VARIANTS = {"split-q": flash2_forward_splitq, "split-k": flash2_forward_splitk}

LDMATRIX_BYTES = 4 * 8 * 16          # one ldmatrix.x4 for a whole warp: four 8 × 8 tiles of 16-bit values
CP_ASYNC_BYTES = 16


def _per_tile(variant: str, cfg) -> dict:
    """Bytes one block moves in shared memory for one visited K/V tile: its copy in, operand loads, exchange."""
    W, B_r, B_c, D = cfg.warps, cfg.B_r, cfg.B_c, cfg.D
    KS, NO = D // 16, cfg.NO
    if variant == "split-q":
        # per warp: Q's A fragments once per k-step, K's B fragments for B_c/16 key pairs per k-step, V's for
        # B_c/16 k-steps × D/16 column pairs (flash2_forward_splitq: the loops over kk, p)
        ldmatrix = KS * (1 + B_c // 16) + (B_c // 16) * (NO // 2)
        write = read = 0
    else:
        RT = B_r // 16
        # per warp: its K slice once per k-step plus the RT row tiles of Q_i, and its V slice once (kept in
        # registers for the RT row tiles)
        ldmatrix = KS * (1 + RT) + NO // 2
        # per lane: RT row tiles × (m_w, ℓ_w for two rows + Õ_w's NO·4 accumulators) written; each owner lane
        # reads, for its two rows, the W warps' m_w, ℓ_w and NO·2 accumulators (flash2_forward_splitk.merge_row)
        write = W * 32 * 4 * RT * (4 + 4 * NO)
        read = W * 32 * 4 * 2 * W * (2 + 2 * NO)
    return dict(cp_async_write=CP_ASYNC_BYTES * 2 * B_c * (D // 8), ldmatrix_read=W * LDMATRIX_BYTES * ldmatrix,
                exchange_write=write, exchange_read=read)


def shared_memory_traffic(variant: str, N_q: int, N_k: int, d: int, *, causal: bool = False, batch: int = 1,
                          heads: int = 1) -> dict:
    """The bytes of shared memory that ``variant`` (``"split-q"`` or ``"split-k"``) writes and reads for one call
    of its kernel on (batch, heads, N_q, d) queries and N_k keys (float16 or bfloat16: the bytes do not depend on
    which). Returns a dict:

    * ``per_tile``: the bytes of one visited K/V tile, per block — ``cp_async_write`` (K_j, V_j copied in),
      ``ldmatrix_read`` (operand loads of all warps), ``exchange_write``, ``exchange_read`` (split-K's partial
      results; 0 for split-Q);
    * ``per_block``: the same four for a whole row block that visits every tile (non-causal), Q_i's copy included;
    * ``total``: the four summed over every block of the call (causal blocks visit only the tiles left of their
      last row's diagonal), and ``total_bytes``, their sum;
    * ``blocks``, ``tiles`` (K/V tiles visited, all blocks), ``shared_bytes_per_block`` (the kernel's shared-memory
      footprint, which sets how many blocks an SM holds), ``B_r``, ``B_c``, ``warps``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    for value, name in ((N_q, "N_q"), (N_k, "N_k"), (d, "d"), (batch, "batch"), (heads, "heads")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    module = VARIANTS[variant]
    cfg = module.config_for(d, "float16", bool(causal), True)
    tile = _per_tile(variant, cfg)
    q_copy = CP_ASYNC_BYTES * cfg.B_r * (cfg.D // 8)
    T_r, T_c = grid_size(N_q, cfg.B_r), grid_size(N_k, cfg.B_c)
    tiles_per_head = sum(causal_tiles(i, cfg.B_r, cfg.B_c, N_q, N_k) if causal else T_c for i in range(T_r))
    tiles = tiles_per_head * batch * heads
    blocks = T_r * batch * heads
    total = {key: value * tiles for key, value in tile.items()}
    total["cp_async_write"] += q_copy * blocks
    per_block = {key: value * T_c for key, value in tile.items()}
    per_block["cp_async_write"] += q_copy
    return dict(variant=variant, B_r=cfg.B_r, B_c=cfg.B_c, warps=cfg.warps, blocks=blocks, tiles=tiles,
                per_tile=tile, per_block=per_block, total=total, total_bytes=sum(total.values()),
                shared_bytes_per_block=4 * module.shared_words(cfg))
