"""kernels_gpu.flex.flex_backward in numba's CUDA simulator: the FlexAttention backward with the mods compiled in.

The oracle is :func:`fa2edu.flex.flex_attention_backward` on float64 inputs (the same O and L the kernel gets).
The kernel must be within flash-attn's rule of it, as tests/test_tensorcore_backward.py applies it: each of dQ,
dK, dV within 2× the error of the same computation in float16 (NumPy's flex_attention_backward on the float16
inputs) plus a floor (tests/tolerances.py). O and L come from NumPy's forward (float64, O rounded to float16), so
that only the backward runs in the simulator. Tiles are (16, 16), one warp: the simulator runs each CUDA thread
as a Python thread.

The default rung is v7 (two kernels, each walking a list made on the host); the cases after the ready mods exercise
what that structure adds: the key-block kernel's walk over a GQA group whose heads have different masks, kernel
tiles smaller than the BlockMask's blocks, composed masks with chained score_mods, the longest-first grids and
fully masked rows with a score_mod. The walks themselves are checked on the host against a direct count, and one
case runs the kept rung v1.
"""

from __future__ import annotations

import numpy as np
import pytest

import kernels_gpu.flex as kflex
from fa2edu import flex as F
from tests.tolerances import assert_close_to_oracle, baseline_error


def _problem(B, H_q, H_kv, N_q, N_k, d, seed, score_mod, block_mask, enable_gqa):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H_q, N_q, d)).astype(np.float16)
    k = rng.standard_normal((B, H_kv, N_k, d)).astype(np.float16)
    v = rng.standard_normal((B, H_kv, N_k, d)).astype(np.float16)
    dO = rng.standard_normal((B, H_q, N_q, d)).astype(np.float16)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    O64, L64 = F.flex_attention(q64, k64, v64, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                                return_lse=True)
    return q, k, v, O64.astype(np.float16), L64.astype(np.float32), dO


def check_backward(q, k, v, O, L, dO, score_mod, block_mask, enable_gqa=False, rung="v7"):
    grads = kflex.flex_backward(q, k, v, O, L, dO, score_mod=score_mod, block_mask=block_mask,
                                enable_gqa=enable_gqa, rung=rung)
    f64 = [x.astype(np.float64) for x in (q, k, v, O, L, dO)]
    exact = F.flex_attention_backward(*f64, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
    half = F.flex_attention_backward(q, k, v, O, L.astype(np.float16), dO, score_mod=score_mod,
                                     block_mask=block_mask, enable_gqa=enable_gqa)
    for name, ours, ref, low, x in zip(("dQ", "dK", "dV"), grads, exact, half, (q, k, v)):
        assert ours.dtype == np.float16 and ours.shape == x.shape, name
        assert np.isfinite(ours).all(), name
        assert_close_to_oracle(ours, ref, name, dtype=np.float16, baseline=baseline_error(low, ref))
    return grads


DOC_IDS = np.array([0] * 7 + [1] * 13 + [2] * 12)

CASES = {  # (B, H_q, H_kv, N_q, N_k, d), mask_mod, score_mod, GQA
    # N_q < N_k, bottom-right causal: partial diagonal blocks, skipped blocks above them, ragged edges
    "causal": ((1, 1, 1, 20, 30, 16), F.causal, None, False),
    "sliding_window": ((1, 1, 1, 30, 30, 16), F.sliding_window(6), None, False),
    # a bound mask (two id arrays): partial blocks on document boundaries, skipped blocks between documents
    "document": ((1, 1, 1, 32, 32, 16), F.document(DOC_IDS), None, False),
    # softcap's derivative 1 − tanh²(τs / c) multiplies dS; no mask (every block full)
    "softcap": ((1, 1, 1, 16, 16, 16), None, F.softcap(2.0), False),
    # ALiBi (bound slopes, bound again for its derivative) under causal, two query heads on one K/V head: dK, dV
    # summed over the group
    "alibi-gqa": ((1, 2, 1, 20, 20, 16), F.causal, F.alibi(F.alibi_slopes(2)), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ready_mods_match_the_numpy_backward(case):
    shape, mask_mod, score_mod, gqa = CASES[case]
    B, H_q, H_kv, N_q, N_k, d = shape
    bm = None if mask_mod is None else F.create_block_mask(mask_mod, None, None, N_q, N_k, BLOCK_SIZE=16)
    check_backward(*_problem(B, H_q, H_kv, N_q, N_k, d, 3, score_mod, bm, gqa), score_mod, bm, enable_gqa=gqa)


def test_fully_masked_rows_get_zero_dq():
    """N_q > N_k causal: the first 14 queries see no key (L = +inf), a whole row block among them: dQ = 0 there."""
    bm = F.create_block_mask(F.causal, None, None, 26, 12, BLOCK_SIZE=16)
    problem = _problem(1, 1, 1, 26, 12, 16, 5, None, bm, False)
    assert np.isposinf(problem[4][0, 0, :14]).all()
    dQ, _, _ = check_backward(*problem, None, bm)
    assert (dQ[0, 0, :14] == 0).all()


def test_a_score_mod_without_a_derivative_is_refused():
    def shifted(score, b, h, q_idx, kv_idx):
        return score + 0.5
    q, k, v, O, L, dO = _problem(1, 1, 1, 16, 16, 16, 7, shifted, None, False)
    with pytest.raises(ValueError, match="carries no score_mod_grad"):
        kflex.flex_backward(q, k, v, O, L, dO, score_mod=shifted)
    with pytest.raises(ValueError, match="score_mod_grad was given without a score_mod"):
        kflex.flex_backward(q, k, v, O, L, dO, score_mod_grad=shifted)


def test_block_size_the_backward_cannot_run():
    with pytest.raises(ValueError, match="the flex backward runs tiles"):
        kflex.backward_config_for(16, "float16", (24, 16), True)
    with pytest.raises(ValueError, match="the flex backward runs tiles"):
        kflex.backward_config_for(16, "float16", (24, 16), True, rung="v1")
    with pytest.raises(ValueError, match="rung must be one of"):
        kflex.backward_config_for(16, "float16", (16, 16), True, rung="v3")
    q, k, v, O, L, dO = _problem(1, 1, 1, 16, 16, 16, 7, None, None, False)
    with pytest.raises(ValueError, match="rung must be one of"):
        kflex.flex_backward(q, k, v, O, L, dO, rung="v2")


# -- rung v7's structure ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d, block, tile", [
    (64, (128, 128), (4, 64)), (128, (128, 128), (4, 32)), (64, (64, 64), (4, 64)), (128, (128, 64), (4, 32)),
    (16, (16, 16), (1, 16)), (16, (32, 64), (2, 32)), (64, (48, 96), (1, 16)), (256, (128, 128), (4, 32))])
def test_v7_tiles_lie_inside_the_blocks(d, block, tile):
    """The key-block kernel's tile (B_r × 16·W) and the dQ kernel's (16·W × B_r) both divide the BlockMask's
    blocks, so each takes one block's class; PyTorch's BLOCK_SIZE 128 and (64, 64) run the ladder's v7 tiles."""
    cfg = kflex.backward_config_for(d, "bfloat16", block, False)
    assert (cfg.warps, cfg.B_r) == tile
    for size in block:
        assert size % cfg.B_r == 0 and size % cfg.B_c == 0
    assert cfg.chunks == (2 if d > 128 else 1)


def _walk_by_hand(classes, block_size, tile, N_q, N_k, G, b, hk, j):
    """The (gq, i, partial) pairs key tile j of key/value head hk visits, counted directly."""
    B_r, B_c = block_size
    pairs = []
    for gq in range(G):
        h = hk * G + gq if classes.shape[1] > 1 else 0
        for i in range(-(-N_q // tile[0])):
            kind = classes[b, h, i * tile[0] // B_r, j * tile[1] // B_c]
            if kind != F.SKIPPED:
                pairs.append((gq, i, int(kind == F.PARTIAL)))
    return pairs


@pytest.mark.parametrize("per_head", [False, True])
def test_the_key_block_walk_lists_every_pair_of_the_group(per_head):
    """kv_visit_table against a direct count: per key tile, the group's (query head, row block) pairs the mask does
    not skip, in order, partial flagged; the key tiles ordered longest first. A per-head mask (H = H_q) gives each
    head of a group its own walk; a broadcast one (H = 1) the same walk G times."""
    N_q, N_k, G, H_kv = 53, 70, 3, 2

    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 17 if h % 2 == 0 else kv_idx >= q_idx - 9
    H = G * H_kv if per_head else None
    bm = F.create_block_mask(mask if per_head else F.sliding_window(20), 2, H, N_q, N_k, BLOCK_SIZE=(32, 32))
    tile = (16, 16)
    counts, visits, order = kflex.kv_visit_table(bm.classes, bm.BLOCK_SIZE, tile, N_q, N_k, G)
    assert counts.shape == (2, H_kv if per_head else 1, -(-N_k // 16))
    for b in range(2):
        for hk in range(counts.shape[1]):
            for j in range(counts.shape[2]):
                want = _walk_by_hand(bm.classes, bm.BLOCK_SIZE, tile, N_q, N_k, G, b, hk, j)
                got = [(c >> kflex.GQ_SHIFT, (c >> 1) & ((1 << (kflex.GQ_SHIFT - 1)) - 1), c & 1)
                       for c in visits[b, hk, j, :counts[b, hk, j]]]
                assert got == want, (b, hk, j)
                assert (visits[b, hk, j, counts[b, hk, j]:] == -1).all()
            assert list(order[b, hk]) == sorted(range(counts.shape[2]), key=lambda j: -counts[b, hk, j])


V7_CASES = {  # (B, H_q, H_kv, N_q, N_k, d), mask_mod, score_mod, GQA, BLOCK_SIZE
    # two query heads per K/V head with different masks (a per-head BlockMask): the key-block kernel walks both
    # heads' lists in one loop, ragged N_q, N_k
    "per-head-gqa": ((1, 2, 1, 37, 40, 16), "per_head", None, True, 16),
    # kernel tiles (32 × 32 keys, 2 warps) smaller than the BlockMask's (32, 64) blocks; a window with prefix
    # (or_masks), ragged
    "tiles-inside-blocks": ((1, 1, 1, 41, 70, 16), F.or_masks(F.sliding_window(12), F.prefix_lm(5)), None, False,
                            (32, 64)),
    # composed masks and a chained score_mod (flash-attn's softcap then ALiBi): the chain rule compiled part by part
    "and-chain": ((1, 2, 2, 30, 30, 16), F.and_masks(F.causal, F.sliding_window(10)),
                  F.chain_score_mods(F.softcap(3.0), F.alibi(F.alibi_slopes(2))), False, 16),
    # N_q > N_k causal with softcap and GQA: the first query block visits nothing (dQ = 0 there, no mod call)
    "masked-rows-softcap": ((1, 2, 1, 30, 12, 16), F.causal, F.softcap(2.0), True, 16),
}


def _per_head(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + 3 if h % 2 == 0 else kv_idx + 6 >= q_idx


@pytest.mark.parametrize("case", list(V7_CASES))
def test_v7_structure_matches_the_numpy_backward(case):
    shape, mask_mod, score_mod, gqa, block = V7_CASES[case]
    B, H_q, H_kv, N_q, N_k, d = shape
    per_head = mask_mod == "per_head"
    bm = F.create_block_mask(_per_head if per_head else mask_mod, None, H_q if per_head else None, N_q, N_k,
                             BLOCK_SIZE=block)
    problem = _problem(B, H_q, H_kv, N_q, N_k, d, 11, score_mod, bm, gqa)
    dQ, _, _ = check_backward(*problem, score_mod, bm, enable_gqa=gqa)
    dead = np.isposinf(problem[4])
    assert (dQ[dead] == 0).all()
    if case == "masked-rows-softcap":
        assert dead[0, :, :18].all()


def test_rung_v1_is_kept():
    """The first flex backward (one kernel, dQ by atomic adds) is still reachable and still right."""
    bm = F.create_block_mask(F.causal, None, None, 20, 30, BLOCK_SIZE=16)
    problem = _problem(1, 1, 1, 20, 30, 16, 3, F.softcap(2.0), bm, False)
    v1 = check_backward(*problem, F.softcap(2.0), bm, rung="v1")
    v7 = check_backward(*problem, F.softcap(2.0), bm)
    for a, b in zip(v1, v7):
        assert np.abs(a.astype(np.float32) - b.astype(np.float32)).max() < 2e-2
