"""Shared hypothesis strategies: attention problems with awkward sizes, GQA groupings, masks and extreme logits.

Sizes are drawn so that N_q, N_k, d and the block sizes B_r, B_c generally do not divide one another, N_q ≠ N_k is
common, and masks can leave rows fully masked. ``logit_scale`` stretches the inputs so that scores reach ±1e4.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from fa2edu import flex

__all__ = ["attention_problems", "block_sizes", "AttentionCase", "attention_states", "key_splits",
           "decode_problems", "packed_batches", "flex_problems", "FLEX_MASKS", "FLEX_SCORES"]


class AttentionCase(dict):
    """A drawn problem: keys Q, K, V, causal, mask, block_sizes, scale; attribute access for readability."""

    __getattr__ = dict.__getitem__

    def kwargs(self) -> dict:
        """The keyword arguments every algorithm accepts (causal, scale, mask)."""
        return {"causal": self["causal"], "scale": self["scale"], "mask": self["mask"]}


def block_sizes(max_block: int = 9):
    """A (B_r, B_c) pair, each in [1, max_block]."""
    return st.tuples(st.integers(1, max_block), st.integers(1, max_block))


@st.composite
def attention_problems(draw, *, max_n: int = 24, max_d: int = 9, dtypes=(np.float64,), gqa: bool = True,
                       masks: bool = True, causal=None, extreme: bool = True, batch: bool = True,
                       dv_differs: bool = True):
    """Draw an attention problem.

    Shapes: Q (B, H_q, N_q, d), K (B, H_kv, N_k, d), V (B, H_kv, N_k, d_v) with H_q a multiple of H_kv (or plain
    (N, d) matrices when ``batch=False``). ``mask`` is None, an (N_q, N_k) mask, or a per-batch key-padding mask
    (B, 1, N_q, N_k), possibly with fully masked rows. ``extreme`` sometimes scales logits up to about ±1e4.
    """
    dtype = draw(st.sampled_from(dtypes))
    N_q = draw(st.integers(1, max_n))
    N_k = draw(st.integers(1, max_n))
    d = draw(st.integers(1, max_d))
    d_v = draw(st.integers(1, max_d)) if dv_differs and draw(st.booleans()) else d
    if batch:
        B = draw(st.integers(1, 2))
        H_kv = draw(st.integers(1, 2))
        G = draw(st.integers(1, 3)) if gqa else 1
        lead_q, lead_kv = (B, H_kv * G), (B, H_kv)
    else:
        B, lead_q, lead_kv = 1, (), ()
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    spread = draw(st.sampled_from([1.0, 1.0, 3.0, 30.0, 100.0])) if extreme else 1.0
    Q = (rng.standard_normal(lead_q + (N_q, d)) * spread).astype(dtype)
    K = (rng.standard_normal(lead_kv + (N_k, d)) * spread).astype(dtype)
    V = rng.standard_normal(lead_kv + (N_k, d_v)).astype(dtype)
    is_causal = draw(st.booleans()) if causal is None else causal
    mask = None
    if masks:
        kind = draw(st.sampled_from(["none", "none", "random", "padding"]))
        if kind == "random":
            density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
            mask = rng.random((N_q, N_k)) < density
            if N_q > 1 and draw(st.booleans()):
                mask[rng.integers(N_q)] = False               # a fully masked row, for sure
        elif kind == "padding" and batch:
            lengths = rng.integers(0, N_k + 1, size=B)
            keep = np.arange(N_k)[None, :] < lengths[:, None]
            mask = np.broadcast_to(keep[:, None, None, :], (B, 1, N_q, N_k)).copy()
    scale = draw(st.sampled_from([None, None, 0.5, 1.0]))
    bs = draw(block_sizes(max(2, min(9, max(N_q, N_k) + 2))))
    return AttentionCase(Q=Q, K=K, V=V, causal=is_causal, mask=mask, block_sizes=bs, scale=scale)


# -- partial attentions, KV caches, packed batches (fa2edu.merge, fa2edu.inference) ---------------------------------

@st.composite
def attention_states(draw, *, count: int = 3, dtypes=(np.float32, np.float64)):
    """``count`` partial attention states (O, L) of one shape: O (..., N, d_v), L (..., N), one dtype.

    L is centred on 0, 1e4 or −1e4 (the overflow tests) with a spread up to 30; rows are sometimes empty
    (O = 0, L = +inf, the merge's identity), sometimes in every state at once.
    """
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    N, d_v = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    centre = draw(st.sampled_from([0.0, 0.0, 1e4, -1e4]))
    spread = draw(st.sampled_from([0.0, 1.0, 30.0]))
    empty_rate = draw(st.sampled_from([0.0, 0.3]))
    all_empty_row = draw(st.booleans())
    states = []
    for _ in range(count):
        O = rng.standard_normal(lead + (N, d_v)).astype(dtype)
        L = (centre + spread * rng.standard_normal(lead + (N,))).astype(dtype)
        empty = rng.random(lead + (N,)) < empty_rate
        if all_empty_row:
            empty[..., 0] = True
        O[empty] = 0.0
        L[empty] = np.inf
        states.append((O, L))
    return states


@st.composite
def key_splits(draw, *, max_n: int = 16, max_d: int = 6):
    """An attention problem Q (H, N_q, d), K (H, N_k, d), V (H, N_k, d_v) and cut points 0 ≤ c_1 ≤ … ≤ N_k that
    cut the keys into 2–4 contiguous chunks (some possibly empty), with logits up to about ±1e4."""
    H, N_q, N_k = draw(st.integers(1, 2)), draw(st.integers(1, max_n)), draw(st.integers(1, max_n))
    d, d_v = draw(st.integers(1, max_d)), draw(st.integers(1, max_d))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([1.0, 1.0, 30.0, 100.0]))
    Q = rng.standard_normal((H, N_q, d)) * spread
    K = rng.standard_normal((H, N_k, d)) * spread
    V = rng.standard_normal((H, N_k, d_v))
    cuts = sorted(draw(st.lists(st.integers(0, N_k), min_size=1, max_size=3)))
    return Q, K, V, [0] + cuts + [N_k]


@st.composite
def decode_problems(draw, *, paged=None, dtypes=(np.float64,), max_group: int = 8):
    """A decoding step: q (B, H_q, N_new, d), a contiguous or paged KV cache, ragged ``cache_seqlens``.

    Lengths include 0 (an idle slot) and the full capacity; a paged cache has its pages in a shuffled physical
    order, and every cache entry that no sequence owns (unused pages, rows past a length) is NaN, so reading one
    shows. ``num_splits`` is None or 1 … (the longest sequence's blocks + 2); G = H_q / H_kv is 1 … ``max_group``.
    Returns a dict of decode_attention's arguments plus ``keys``/``values``: each sequence's keys and values,
    gathered (H_kv, n_b, d), for the oracle.
    """
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, H_kv, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, max_group))
    N_new, d = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    d_v = draw(st.sampled_from([d, draw(st.integers(1, 8))]))
    is_paged = draw(st.booleans()) if paged is None else paged
    block = draw(st.integers(1, 5))                                # page size, or contiguous block_size
    max_pages = draw(st.integers(1, 4))
    capacity = block * max_pages if is_paged else draw(st.integers(1, 14))
    lengths = draw(st.lists(st.sampled_from([0, capacity, None, None]), min_size=B, max_size=B))
    seqlens = np.array([rng.integers(0, capacity + 1) if n is None else n for n in lengths], dtype=np.int64)
    spread = draw(st.sampled_from([1.0, 1.0, 30.0]))
    q = (spread * rng.standard_normal((B, H_kv * G, N_new, d))).astype(dtype)
    keys = [(spread * rng.standard_normal((H_kv, n, d))).astype(dtype) for n in seqlens]
    values = [rng.standard_normal((H_kv, n, d_v)).astype(dtype) for n in seqlens]
    if is_paged:
        num_pages = B * max_pages + draw(st.integers(0, 3))
        k_cache = np.full((num_pages, H_kv, block, d), np.nan, dtype=dtype)
        v_cache = np.full((num_pages, H_kv, block, d_v), np.nan, dtype=dtype)
        table = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages)
        for b, n in enumerate(seqlens):
            for p in range(-(-int(n) // block)):
                rows = slice(p * block, min((p + 1) * block, int(n)))
                k_cache[table[b, p], :, :rows.stop - rows.start] = keys[b][:, rows]
                v_cache[table[b, p], :, :rows.stop - rows.start] = values[b][:, rows]
            table[b, -(-int(n) // block):] = -1                    # unused entries: never read
        block_table, block_size = table, None
    else:
        k_cache = np.full((B, H_kv, capacity, d), np.nan, dtype=dtype)
        v_cache = np.full((B, H_kv, capacity, d_v), np.nan, dtype=dtype)
        for b, n in enumerate(seqlens):
            k_cache[b, :, :n], v_cache[b, :, :n] = keys[b], values[b]
        block_table, block_size = None, block
    max_blocks = max(-(-int(n) // block) for n in seqlens)
    num_splits = draw(st.one_of(st.none(), st.integers(1, max_blocks + 2)))
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=block_table,
                causal=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.5])), num_splits=num_splits,
                block_size=block_size, keys=keys, values=values)


@st.composite
def packed_batches(draw, *, max_len: int = 10, dtypes=(np.float64,)):
    """A packed batch for varlen_attention: q (H_q, total_q, d), k, v (H_kv, total_k, d | d_v) and the offsets
    ``cu_seqlens_q``, ``cu_seqlens_k`` of 1–4 sequences whose lengths include 0, n_q ≠ n_k, GQA."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, H_kv, G = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = draw(st.integers(1, 6))
    d_v = draw(st.sampled_from([d, draw(st.integers(1, 6))]))
    n_q = draw(st.lists(st.integers(0, max_len), min_size=B, max_size=B))
    n_k = draw(st.lists(st.integers(0, max_len), min_size=B, max_size=B))
    cu_q, cu_k = np.cumsum([0] + n_q), np.cumsum([0] + n_k)
    q = rng.standard_normal((H_kv * G, int(cu_q[-1]), d)).astype(dtype)
    k = rng.standard_normal((H_kv, int(cu_k[-1]), d)).astype(dtype)
    v = rng.standard_normal((H_kv, int(cu_k[-1]), d_v)).astype(dtype)
    bs = draw(st.one_of(st.none(), block_sizes(5)))
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=draw(st.booleans()),
                block_sizes=bs)


# -- FlexAttention: mask_mods and score_mods (fa2edu.flex) -------------------------------------------------------

def _block_table_mask(b, h, q_idx, kv_idx, table, rows_per_cell, cols_per_cell):
    """A random block-sparse pattern: table[b, h, q // rows_per_cell, kv // cols_per_cell] (vectorises)."""
    return table[b, h, q_idx // rows_per_cell, kv_idx // cols_per_cell]


def _every_third(b, h, q_idx, kv_idx):
    """A mask_mod that only scalars can run (`if`, `and`): keeps keys j ≡ i (mod 3) up to i + 2."""
    if (q_idx - kv_idx) % 3 == 0 and kv_idx <= q_idx + 2:
        return True
    return False


def _wavy(score, b, h, q_idx, kv_idx):
    """A score_mod in plain Python and math (falls back to per-element calls): a head-dependent stretch and a
    bounded positional wiggle."""
    return score * (1.0 + 0.25 * h) + math.sin(0.5 * (q_idx - kv_idx))


def _wavy_grad(score, b, h, q_idx, kv_idx):
    return 1.0 + 0.25 * h


_wavy.score_mod_grad = _wavy_grad


def _drop_some(score, b, h, q_idx, kv_idx):
    """A score_mod that masks by returning −inf (as PyTorch allows): every fifth (q, kv) pair."""
    return -math.inf if (7 * q_idx + kv_idx) % 5 == 0 else score


def _drop_some_grad(score, b, h, q_idx, kv_idx):
    return 1.0


_drop_some.score_mod_grad = _drop_some_grad


FLEX_MASKS = ("none", "causal", "window", "prefix", "document", "causal_document", "blocks", "scalar_only",
              "union")
FLEX_SCORES = ("none", "alibi", "softcap", "relative_bias", "wavy", "drop")


@st.composite
def flex_problems(draw, *, max_n: int = 18, max_d: int = 6, dtypes=(np.float64,), masks=FLEX_MASKS,
                  scores=FLEX_SCORES, extreme: bool = True):
    """A FlexAttention problem: q (B, H_q, N_q, d), k, v (B, H_kv, N_k, d | d_v), a mask_mod, a score_mod.

    Returns an :class:`AttentionCase` with keys q, k, v, mask_mod (None or a mod before alignment), B, H (the
    create_block_mask arguments: None to broadcast, or q's sizes when the mask depends on b or h), BLOCK_SIZE (an
    int or a pair, rarely dividing N_q or N_k), score_mod (None or a mod carrying ``score_mod_grad``), scale,
    enable_gqa and dO. Masks include fully masked rows (causal with N_q > N_k, a window past the keys, a random
    block pattern with an empty row); with ``extreme``, logits reach about ±1e4.
    """
    dtype = draw(st.sampled_from(dtypes))
    B, H_kv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    H_q = H_kv * G
    N_q, N_k = draw(st.integers(1, max_n)), draw(st.integers(1, max_n))
    d = draw(st.integers(1, max_d))
    d_v = draw(st.sampled_from([d, draw(st.integers(1, max_d))]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([1.0, 1.0, 3.0, 30.0, 100.0])) if extreme else 1.0
    q = (rng.standard_normal((B, H_q, N_q, d)) * spread).astype(dtype)
    k = (rng.standard_normal((B, H_kv, N_k, d)) * spread).astype(dtype)
    v = rng.standard_normal((B, H_kv, N_k, d_v)).astype(dtype)
    dO = rng.standard_normal((B, H_q, N_q, d_v)).astype(dtype)
    block = draw(st.one_of(st.integers(1, 7), st.tuples(st.integers(1, 7), st.integers(1, 7))))

    kind = draw(st.sampled_from(masks))
    per_program = False
    n = max(N_q, N_k)
    if kind == "none":
        mask_mod = None
    elif kind == "causal":
        mask_mod = flex.causal
    elif kind == "window":
        mask_mod = flex.sliding_window(draw(st.integers(1, N_k + 2)))
    elif kind == "prefix":
        mask_mod = flex.prefix_lm(draw(st.integers(0, N_k)))
    elif kind in ("document", "causal_document"):
        ids = np.sort(rng.integers(0, draw(st.integers(1, 4)), size=n))
        mask_mod = flex.document(ids)
        if kind == "causal_document":
            mask_mod = flex.and_masks(flex.causal, mask_mod)
    elif kind == "blocks":
        cell_r, cell_c = draw(st.integers(1, 5)), draw(st.integers(1, 5))
        density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
        table = rng.random((B, H_q, -(-N_q // cell_r), -(-N_k // cell_c))) < density
        if draw(st.booleans()):
            table[rng.integers(B), rng.integers(H_q), rng.integers(table.shape[2])] = False   # an empty row
        mask_mod = flex.bind(_block_table_mask, table, cell_r, cell_c)
        per_program = True
    elif kind == "scalar_only":
        mask_mod = _every_third
    else:
        mask_mod = flex.or_masks(flex.sliding_window(draw(st.integers(1, 4))), flex.prefix_lm(draw(st.integers(0, 3))))
    B_arg = B if per_program or draw(st.booleans()) else None
    H_arg = H_q if per_program or draw(st.booleans()) else None

    score = draw(st.sampled_from(scores))
    if score == "none":
        score_mod = None
    elif score == "alibi":
        score_mod = flex.alibi(flex.alibi_slopes(H_q) * draw(st.sampled_from([1.0, 10.0])))
    elif score == "softcap":
        score_mod = flex.softcap(draw(st.sampled_from([0.5, 5.0, 50.0])))
    elif score == "relative_bias":
        score_mod = flex.relative_bias(rng.standard_normal(draw(st.integers(1, 2 * n))) * 3.0)
    elif score == "wavy":
        score_mod = _wavy
    else:
        score_mod = _drop_some
    return AttentionCase(q=q, k=k, v=v, dO=dO, mask_mod=mask_mod, B=B_arg, H=H_arg, BLOCK_SIZE=block,
                         score_mod=score_mod, scale=draw(st.sampled_from([None, None, 0.5])),
                         enable_gqa=G > 1 or draw(st.booleans()), mask_kind=kind, score_kind=score)
