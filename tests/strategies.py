"""Shared hypothesis strategies: attention problems with awkward sizes, GQA groupings, masks and extreme logits.

Sizes are drawn so that N_q, N_k, d and the block sizes B_r, B_c generally do not divide one another, N_q ≠ N_k is
common, and masks can leave rows fully masked. ``logit_scale`` stretches the inputs so that scores reach ±1e4.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

__all__ = ["attention_problems", "block_sizes", "AttentionCase"]


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
