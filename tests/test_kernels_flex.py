"""kernels_gpu.flex in numba's CUDA simulator: the FlexAttention forward with the user's mods compiled in.

Every ready mod of :mod:`fa2edu.flex`, and compositions of them, against a dense float64 oracle written here
(one Python call of each mod per score), which must agree with :func:`fa2edu.flex.flex_attention` to 1e-10. The
kernel must be within flash-attn's rule of it: 2× the error of the same computation in float16 (NumPy's
flex_attention on the float16 inputs), plus a floor. Then the claims of the module: skipped blocks are never
loaded (the ``cp.async`` copies counted), full blocks never call mask_mod (a mod that records its calls: in the
simulator a device function runs as Python), and the bad inputs' errors. Tiles are (16, 16), one warp, except
where a case says otherwise: the simulator runs each CUDA thread as a Python thread.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fa2edu
import kernels_gpu.flex as kflex
from fa2edu import flex as F
from tests.tolerances import assert_close_to_oracle, baseline_error

# -- the dense float64 oracle -----------------------------------------------------------------------------------


def dense_oracle(q, k, v, mask_mod, score_mod, scale=None):
    """softmax(MASK(score_mod(τ·qkᵀ)))·v in float64, one scalar call of each mod per score (aligned to the
    lengths as create_block_mask does); O = 0, L = +inf on rows that keep no score."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, N_q, d = q.shape
    G = H // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    N_k = k.shape[2]
    tau = 1.0 / math.sqrt(d) if scale is None else scale
    S = tau * q @ np.swapaxes(k, -1, -2)
    mask_mod = None if mask_mod is None else F.at_lengths(mask_mod, N_q, N_k)
    score_mod = None if score_mod is None else F.at_lengths(score_mod, N_q, N_k)
    for b, h, i, j in np.ndindex(S.shape):
        if mask_mod is not None and not mask_mod(b, h, i, j):
            S[b, h, i, j] = -np.inf
        elif score_mod is not None:
            S[b, h, i, j] = score_mod(float(S[b, h, i, j]), b, h, i, j)
    m = S.max(axis=-1, keepdims=True)
    masked = np.isneginf(m)
    P = np.exp(S - np.where(masked, 0.0, m))
    ell = P.sum(axis=-1, keepdims=True)
    O = np.where(masked, 0.0, P @ v / np.where(masked, 1.0, ell))
    with np.errstate(divide="ignore"):
        L = np.where(masked, np.inf, m + np.log(np.where(masked, 1.0, ell)))[..., 0]
    return O, L


def _inputs(B, H_q, H_kv, N_q, N_k, d, seed, logit_scale=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, H_q, N_q, d)) * logit_scale).astype(np.float16)
    k = (rng.standard_normal((B, H_kv, N_k, d)) * logit_scale).astype(np.float16)
    v = rng.standard_normal((B, H_kv, N_k, d)).astype(np.float16)
    return q, k, v


def check_against_oracle(q, k, v, mask_mod, score_mod, block_mask, enable_gqa=False, fully_masked_rows=None):
    O, L = kflex.flex_forward(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
    assert O.dtype == np.float16 and O.shape == q.shape and L.dtype == np.float32 and L.shape == q.shape[:-1]
    O_ref, L_ref = dense_oracle(q, k, v, mask_mod, score_mod)
    # the oracle and fa2edu's NumPy FlexAttention agree (float64 in, float64 arithmetic)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    O_np, L_np = F.flex_attention(q64, k64, v64, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                                  return_lse=True)
    assert_close_to_oracle(O_np, O_ref, "NumPy flex O")
    assert_close_to_oracle(L_np, L_ref, "NumPy flex L")
    # the kernel within flash-attn's rule: twice the same computation's error in float16, plus a floor
    O_16 = F.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
    assert_close_to_oracle(O, O_ref, "O", dtype=np.float16, baseline=baseline_error(O_16, O_ref))
    finite = np.isfinite(L_ref)
    assert np.array_equal(np.isposinf(L), ~finite), "L = +inf exactly on the fully masked rows"
    np.testing.assert_allclose(L[finite], L_ref[finite], rtol=1e-4, atol=1e-4)
    assert (O[~finite] == 0).all(), "O = 0 on fully masked rows"
    if fully_masked_rows is not None:
        assert (~finite).sum() >= fully_masked_rows
    return O, L


# -- every ready mod, and compositions --------------------------------------------------------------------------

def _striped(b, h, q_idx, kv_idx):
    # depends on b and h: the BlockMask's classes differ per (b, h), none broadcast
    return (kv_idx + 2 * h + b) % 3 != 0


Q_DOCS = np.repeat(np.arange(4), [9, 12, 6, 10])            # 37 queries in documents 0-3
KV_DOCS = np.repeat(np.array([0, 1, 3, 4]), [11, 14, 9, 7])  # 41 keys: document 2 has no key (masked rows)

# (id, mask_mod, score_mod, (B, H_q, H_kv, N_q, N_k, d), BLOCK_SIZE, B and H of the block mask, masked rows)
CASES = [
    ("causal", F.causal, None, (1, 2, 2, 40, 29, 16), 16, (None, None), 11),
    ("sliding_window", F.sliding_window(7), None, (1, 1, 1, 45, 45, 24), 16, (None, None), 0),
    ("prefix_lm-gqa-32x16", F.prefix_lm(10), None, (1, 2, 1, 33, 47, 16), (32, 16), (None, None), 0),
    ("document-and-causal", F.and_masks(F.causal, F.document(Q_DOCS, KV_DOCS)), None, (1, 1, 1, 37, 41, 8),
     16, (None, None), 6),
    ("alibi-causal", F.causal, F.alibi(F.alibi_slopes(2)), (1, 2, 2, 30, 38, 16), 16, (None, 2), 0),
    ("softcap-window", F.sliding_window(20), F.softcap(2.0), (1, 1, 1, 35, 35, 16), 16, (None, None), 0),
    ("relative_bias-prefix", F.prefix_lm(4), F.relative_bias(np.linspace(-1.0, 1.0, 9)), (1, 1, 1, 21, 34, 16),
     16, (None, None), 0),
    ("or_masks-window-prefix", F.or_masks(F.sliding_window(5), F.prefix_lm(8)), None, (1, 1, 1, 40, 40, 16), 16,
     (None, None), 0),
    ("per-b-h-mask", _striped, None, (2, 2, 2, 17, 20, 16), 16, (2, 2), 0),
    ("d128-causal-bias", F.causal, F.relative_bias(np.arange(5.0)), (1, 1, 1, 17, 21, 128), 16, (None, None), 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ready_mods_match_the_oracle(case):
    _, mask_mod, score_mod, (B, H_q, H_kv, N_q, N_k, d), block_size, (bB, bH), masked = case
    q, k, v = _inputs(B, H_q, H_kv, N_q, N_k, d, seed=len(case[0]), logit_scale=1.5)
    bm = F.create_block_mask(mask_mod, None if bB is None else B, bH, N_q, N_k, BLOCK_SIZE=block_size)
    check_against_oracle(q, k, v, mask_mod, score_mod, bm, enable_gqa=H_q != H_kv, fully_masked_rows=masked)


def test_no_block_mask_runs_the_default_tile_with_a_score_mod():
    """block_mask=None: every block full at (64, 64), 4 warps; softcap alone (one tile: the simulator is slow)."""
    q, k, v = _inputs(1, 1, 1, 20, 30, 16, seed=3, logit_scale=2.0)
    check_against_oracle(q, k, v, None, F.softcap(1.5), None)


def test_extreme_logits_and_a_block_mask_that_skips_whole_rows():
    """Scores in the hundreds (the running maximum keeps exp finite) and row blocks whose every key block is
    skipped (causal with N_q > N_k: the first row block visits nothing): O = 0, L = +inf, never NaN."""
    q, k, v = _inputs(1, 1, 1, 40, 12, 16, seed=4, logit_scale=6.0)
    bm = F.create_block_mask(F.causal, None, None, 40, 12, BLOCK_SIZE=16)
    assert (bm.classes[0, 0, 0] == F.SKIPPED).all()
    O, L = check_against_oracle(q, k, v, F.causal, None, bm, fully_masked_rows=28)
    assert np.isinf(L[..., :28]).all() and np.isfinite(L[..., 28:]).all()


def test_torch_bfloat16_in_and_out():
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(1, 1, 1, 18, 24, 16, seed=5)
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in (q, k, v))
    bm = F.create_block_mask(F.causal, None, None, 18, 24, BLOCK_SIZE=16)
    O, L = kflex.flex_forward(tq, tk, tv, block_mask=bm)
    assert O.dtype == torch.bfloat16 and L.dtype == torch.float32
    O_ref, L_ref = dense_oracle(tq.double().numpy(), tk.double().numpy(), tv.double().numpy(), F.causal, None)
    assert np.abs(O.double().numpy() - O_ref).max() < 2e-2
    np.testing.assert_allclose(L.numpy(), L_ref, rtol=1e-3, atol=1e-3)


# -- what the kernel loads and calls ----------------------------------------------------------------------------

def test_skipped_blocks_are_never_loaded(ptx_calls):
    """Every 16-byte ``cp.async`` copy that reads global memory (source size 16), counted: Q_i once per row block,
    K_j and V_j once per *visited* block — the BlockMask's skipped blocks never — and the rows of K, V read are
    exactly those of the visited blocks."""
    B, H, N_q, N_k, d, Bs = 1, 2, 20, 50, 16, 16
    q, k, v = _inputs(B, H, H, N_q, N_k, d, seed=6)
    window = F.sliding_window(9)
    bm = F.create_block_mask(window, None, None, N_q, N_k, BLOCK_SIZE=Bs)
    assert bm.counts()["skipped"] > 0
    copies = ptx_calls("cp_async16")
    kflex.flex_forward(q, k, v, block_mask=bm)
    chunks = d // 8                                                 # 16-byte chunks of a row
    rows_q, rows_kv = [], []
    for _, _, gmem, g_index, src_bytes in copies:
        if int(src_bytes) == 0:
            continue                                                # zero fill: nothing read
        flat_row = int(g_index) // (d // 2)                         # (Z·H·N) row of a contiguous word view
        (rows_q if gmem.shape[2] == N_q else rows_kv).append(flat_row)
    T_r = bm.T_r
    assert len(rows_q) == H * N_q * chunks                          # Q_i: each row once
    visited = [(h, j) for h in range(H) for i in range(T_r) for j in range(bm.T_c)
               if bm.classes[0, 0, i, j] != F.SKIPPED]
    expected = []
    for h, j in visited:
        expected += [h * N_k + r for r in range(j * Bs, min((j + 1) * Bs, N_k))] * chunks
    assert sorted(rows_kv) == sorted(expected * 2)                  # K and V, each visited block's rows
    skipped_rows = {h * N_k + r for h in range(H) for r in range(N_k)
                    if all(bm.classes[0, 0, i, r // Bs] == F.SKIPPED for i in range(T_r))}
    assert skipped_rows and not skipped_rows & set(rows_kv)         # keys only skipped blocks hold: never read


def test_mask_mod_runs_only_in_partial_blocks(monkeypatch):
    """A mask_mod that records its calls (in the simulator a device function is the Python function itself): it is
    called once per score of each partial block, for the real rows and keys, and never in a full block."""
    calls = []

    def recorded_causal(b, h, q_idx, kv_idx):
        if np.ndim(q_idx) == 0:
            calls.append((int(b), int(h), int(q_idx), int(kv_idx)))
        return kv_idx <= q_idx + 6
    # the recording mod appends to a Python list, which numba could not compile: skip the host's typing check
    monkeypatch.setattr(kflex, "_typed_on_host", lambda *args: None)
    N_q, N_k, Bs = 34, 40, 16
    q, k, v = _inputs(1, 1, 1, N_q, N_k, 16, seed=7)
    bm = F.create_block_mask(recorded_causal, None, None, N_q, N_k, BLOCK_SIZE=Bs)
    assert bm.counts()["full"] > 0 and bm.counts()["partial"] > 0
    calls.clear()                                                   # (create_block_mask's own evaluations)
    kflex.flex_forward(q, k, v, block_mask=bm)
    expected = [(0, 0, r, c) for i, rows in enumerate(bm.row_tiles()) for j, cols in enumerate(bm.col_tiles())
                if bm.classes[0, 0, i, j] == F.PARTIAL for r in range(rows.start, rows.stop)
                for c in range(cols.start, cols.stop)]
    assert sorted(calls) == sorted(expected)


# -- bad input --------------------------------------------------------------------------------------------------

def _small():
    return _inputs(1, 1, 1, 20, 24, 16, seed=8)


def test_block_size_the_kernel_cannot_run():
    q, k, v = _small()
    bm = F.create_block_mask(F.causal, None, None, 20, 24, BLOCK_SIZE=(24, 16))
    with pytest.raises(ValueError, match="BLOCK_SIZE = \\(24, 16\\)"):
        kflex.flex_forward(q, k, v, block_mask=bm)
    big = _inputs(1, 1, 1, 20, 24, 256, seed=8)
    with pytest.raises(ValueError, match="shared memory"):               # v4: the BlockMask's block is its tile
        kflex.flex_forward(*big, block_mask=F.create_block_mask(F.causal, None, None, 20, 24, BLOCK_SIZE=128),
                           rung="v4")
    cfg = kflex.config_for(256, "float16", (128, 128), True)           # v11: v10's (64, 32) tile inside the block
    assert (cfg.B_r, cfg.B_c, cfg.row_tiles, cfg.warps) == (64, 32, 1, 4)
    with pytest.raises(ValueError, match="rung must be one of"):
        kflex.flex_forward(q, k, v, rung="v99")


def test_block_mask_for_other_lengths_or_programs():
    q, k, v = _small()
    with pytest.raises(ValueError, match="Q_LEN = 21"):
        kflex.flex_forward(q, k, v, block_mask=F.create_block_mask(F.causal, None, None, 21, 24, BLOCK_SIZE=16))
    with pytest.raises(ValueError, match="block_mask covers"):
        kflex.flex_forward(q, k, v, block_mask=F.create_block_mask(F.causal, 3, None, 20, 24, BLOCK_SIZE=16))
    with pytest.raises(TypeError, match="block_mask must be a fa2edu.BlockMask"):
        kflex.flex_forward(q, k, v, block_mask=np.ones((1, 1, 2, 2)))


def test_mods_and_arguments_checked():
    q, k, v = _small()
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        kflex.flex_forward(q, k, v, score_mod=3.0)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        kflex.flex_forward(q, k, v, enable_gqa=1)
    q2 = np.concatenate([q, q], axis=1)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        kflex.flex_forward(q2, k, v)
    with pytest.raises(ValueError, match="4 axes"):
        kflex.flex_forward(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        kflex.flex_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))


def test_a_mod_numba_cannot_compile_is_named():
    q, k, v = _small()
    names = {0: "a"}

    def uses_a_dict(score, b, h, q_idx, kv_idx):
        return score + len(names[b])
    with pytest.raises(TypeError, match="score_mod uses_a_dict cannot be compiled for the GPU"):
        kflex.flex_forward(q, k, v, score_mod=uses_a_dict)

    def mask_with_a_string(b, h, q_idx, kv_idx):
        return "yes" if kv_idx <= q_idx else 0
    bm = F.create_block_mask(F.causal, None, None, 20, 24, BLOCK_SIZE=16)
    bm.mask_mod = mask_with_a_string                                 # (create_block_mask would reject it first)
    with pytest.raises(TypeError, match="mask_mod mask_with_a_string cannot be compiled"):
        kflex.flex_forward(q, k, v, block_mask=bm)


def test_too_many_bound_arrays():
    q, k, v = _small()
    ids = np.zeros(24, dtype=np.int64)
    # three documents' masks over other id arrays: six arrays
    mask = F.and_masks(*(F.document(ids[:20].copy(), ids.copy()) for _ in range(3)))
    bm = F.create_block_mask(mask, None, None, 20, 24, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="at most 4 bound arrays"):
        kflex.flex_forward(q, k, v, block_mask=bm)
    # the same arrays bound again keep their slot: three masks over one pair of id arrays need two
    same = F.and_masks(*(F.document(ids[:20], ids) for _ in range(3)))
    (_, arrays) = kflex.plan_mods(same, None)
    assert len(arrays) == 4 and len({id(a) for a in arrays}) == 4       # ids[:20] is a new view each time
    shared_q = ids[:20]
    (plan, arrays) = kflex.plan_mods(F.and_masks(*(F.document(shared_q, ids) for _ in range(3))), None)
    assert len(arrays) == 2 and all(leaf[2] == (0, 1) for leaf in plan[0][1:])


def test_a_kernel_is_compiled_once_per_program_not_per_mask_object():
    """Two BlockMasks of ``causal`` made separately (each with its own closure), and document masks over other ids,
    reuse the kernel: the cache key is what numba compiles, and bound arrays are kernel arguments."""
    q, k, v = _small()
    ids_a, ids_b = np.repeat(np.arange(2), [10, 14]), np.repeat(np.arange(3), [4, 10, 10])
    runs = [F.create_block_mask(F.causal, None, None, 20, 24, BLOCK_SIZE=16) for _ in range(2)]
    runs += [F.create_block_mask(F.document(ids[:20], ids), None, None, 20, 24, BLOCK_SIZE=16)
             for ids in (ids_a, ids_b)]
    plans = [kflex.plan_mods(bm.mask_mod, None) for bm in runs]
    assert plans[0][0] == plans[1][0] and plans[2][0] == plans[3][0] and plans[0][0] != plans[2][0]
    assert not np.array_equal(plans[2][1][0], plans[3][1][0])        # the ids travel as arguments
    kflex.flex_forward(q, k, v, block_mask=runs[3])                  # compiled (or found) once ...
    misses = kflex.make_kernel.cache_info().misses
    O, L = kflex.flex_forward(q, k, v, block_mask=runs[2])           # ... and reused with other ids
    assert kflex.make_kernel.cache_info().misses == misses
    O_ref, _ = dense_oracle(q, k, v, runs[2].mask_mod, None)
    assert np.abs(O - O_ref).max() < 5e-3


def test_host_twin_of_the_walk():
    classes = np.array([[F.SKIPPED, F.PARTIAL, F.SKIPPED, F.FULL]])
    assert [kflex.next_visited(classes, 0, j) for j in range(5)] == [1, 1, 3, 3, 4]
    assert fa2edu.flex.SKIPPED == 0


# -- rung v11: v10's tiles inside the BlockMask's blocks, the host's walk, the longest row blocks first ---------------

def _opposite_triangles(b, h, q_idx, kv_idx):
    # head 0 keeps the lower triangle, head 1 the upper one: their row blocks' lengths run in opposite orders
    return (kv_idx <= q_idx) if h == 0 else (kv_idx >= q_idx)


# (id, mask_mod, score_mod, (B, H_q, H_kv, N_q, N_k, d), BLOCK_SIZE, B and H of the block mask, masked rows,
#  the kernel tile (B_r, B_c, row tiles, warps) that v11 must pick)
V11_CASES = [
    # two row tiles per warp (v7) and two warps; ragged N, GQA, bottom-right causal with 20 queries that see nothing
    ("causal-2warps-2rowtiles-gqa", F.causal, None, (1, 2, 1, 84, 64, 16), (64, 32), (None, None), 20,
     (64, 32, 2, 2)),
    # a kernel tile half as wide as the BlockMask's block (B_c = gcd(32, 64)): both halves of a partial block are
    # partial, of a skipped block skipped; documents with masked rows, and a score_mod on top
    ("document-alibi-tile-inside-block", F.document(Q_DOCS, KV_DOCS), F.alibi(F.alibi_slopes(1)),
     (1, 1, 1, 37, 41, 16), (32, 64), (None, None), 6, (32, 32, 2, 1)),
    # per-head classes whose row blocks rank in opposite orders: order[b, h, blockIdx.z] per head
    ("per-head-order-softcap", _opposite_triangles, F.softcap(3.0), (1, 2, 2, 40, 40, 16), 16, (None, 2), 0,
     (16, 16, 1, 1)),
    # d > 128: one row tile per warp (v10's third row), a copy whose chunks do not divide the threads
    ("d160-window", F.sliding_window(12), None, (1, 1, 1, 30, 30, 160), (16, 32), (None, None), 0, (16, 32, 1, 1)),
]


@pytest.mark.parametrize("case", V11_CASES, ids=[c[0] for c in V11_CASES])
def test_v11_tiles_and_orders_match_the_oracle(case):
    _, mask_mod, score_mod, (B, H_q, H_kv, N_q, N_k, d), block_size, (bB, bH), masked, tile = case
    cfg = kflex.config_for(d, "float16", block_size if isinstance(block_size, tuple) else (block_size,) * 2, True)
    assert (cfg.B_r, cfg.B_c, cfg.row_tiles, cfg.warps) == tile
    q, k, v = _inputs(B, H_q, H_kv, N_q, N_k, d, seed=len(case[0]), logit_scale=1.5)
    bm = F.create_block_mask(mask_mod, None if bB is None else B, bH, N_q, N_k, BLOCK_SIZE=block_size)
    check_against_oracle(q, k, v, mask_mod, score_mod, bm, enable_gqa=H_q != H_kv, fully_masked_rows=masked)


def test_v11_tiles_for_pytorchs_block_size_are_v10s():
    """BLOCK_SIZE = 128 runs v10's tiles at every head dimension, except B_c = 32 at d = 128 when mods are compiled
    in (spill-free there: flex_tile); (64, 64) runs 64-row tiles; B_c overrides the preferred width."""
    for d, mods, tile in ((64, True, (128, 32, 2, 4)), (128, False, (128, 64, 2, 4)), (128, True, (128, 32, 2, 4)),
                          (256, True, (64, 32, 1, 4))):
        cfg = kflex.config_for(d, "bfloat16", (128, 128), False, mods=mods)
        assert (cfg.B_r, cfg.B_c, cfg.row_tiles, cfg.warps) == tile
        assert 4 * kflex.shared_words(cfg) <= kflex.MAX_DYNAMIC_BYTES
    cfg = kflex.config_for(128, "float16", (64, 64), False)
    assert (cfg.B_r, cfg.B_c, cfg.row_tiles, cfg.warps) == (64, 32, 2, 2)
    assert kflex.config_for(128, "float16", (128, 128), False, B_c=64).B_c == 64
    for bad in ((24, 16), (16, 8), (0, 16)):
        with pytest.raises(ValueError, match="multiples of 16"):
            kflex.config_for(64, "float16", bad, True)
    with pytest.raises(ValueError, match="B_c must be a multiple of 16"):
        kflex.config_for(64, "float16", (16, 16), True, B_c=24)
    q, k, v = _small()
    with pytest.raises(TypeError, match="tile option B_c with rung 'v11' only"):
        kflex.flex_forward(q, k, v, rung="v4", B_c=32)


def _walk_by_hand(classes, block_size, tile, N_q, N_k):
    """The host twin of the kernel's walk, by loops: each kernel tile's class is its block's, skipped ones left out."""
    (B_r, B_c), (tr, tc) = block_size, tile
    walks = {}
    for b, h in np.ndindex(classes.shape[:2]):
        for i in range(-(-N_q // tr)):
            walks[b, h, i] = [2 * j + int(classes[b, h, i * tr // B_r, j * tc // B_c] == F.PARTIAL)
                              for j in range(-(-N_k // tc)) if classes[b, h, i * tr // B_r, j * tc // B_c] != F.SKIPPED]
    return walks


def test_visit_table_is_the_walk_and_the_order_is_longest_first():
    bm = F.create_block_mask(_opposite_triangles, None, 2, 70, 90, BLOCK_SIZE=(32, 64))
    counts, visits, order = kflex.visit_table(bm.classes, bm.BLOCK_SIZE, (16, 32), 70, 90)
    by_hand = _walk_by_hand(bm.classes, bm.BLOCK_SIZE, (16, 32), 70, 90)
    assert counts.dtype == visits.dtype == order.dtype == np.int32
    for (b, h, i), codes in by_hand.items():
        assert counts[b, h, i] == len(codes)
        assert list(visits[b, h, i, :len(codes)]) == codes and (visits[b, h, i, len(codes):] == -1).all()
    for b, h in np.ndindex(counts.shape[:2]):
        assert sorted(order[b, h]) == list(range(counts.shape[2]))
        assert (np.diff(counts[b, h, order[b, h]]) <= 0).all()          # longest first
    # the last row block is head 0's longest (3 tiles against 2) and head 1's shortest (1 against 3)
    assert list(order[0, 0]) == [4, 0, 1, 2, 3] and list(order[0, 1]) == [0, 1, 2, 3, 4]
    # a causal mask's walk is ordered (the grid puts heads fastest); no mask's is not (v10's grid)
    cfg = kflex.config_for(16, "float16", (16, 16), True)
    causal = F.create_block_mask(F.causal, None, None, 40, 40, BLOCK_SIZE=16)
    assert kflex.walk_for(causal, cfg, 40, 40).ordered and not kflex.walk_for(None, cfg, 40, 40).ordered


def test_v11_mask_mod_only_in_partial_blocks_when_the_tile_is_smaller(monkeypatch, ptx_calls):
    """A kernel tile half a block wide: mask_mod is called on exactly the scores of the BlockMask's partial blocks
    (both kernel tiles of each), never in a full one, and the keys only skipped blocks hold are never read."""
    calls = []

    def recorded_window(b, h, q_idx, kv_idx):
        if np.ndim(q_idx) == 0:
            calls.append((int(q_idx), int(kv_idx)))
        return (kv_idx <= q_idx + 40) & (kv_idx > q_idx - 30)
    monkeypatch.setattr(kflex, "_typed_on_host", lambda *args: None)
    N_q, N_k, d = 20, 100, 16
    q, k, v = _inputs(1, 1, 1, N_q, N_k, d, seed=9)
    bm = F.create_block_mask(recorded_window, None, None, N_q, N_k, BLOCK_SIZE=(16, 64))
    assert (bm.classes == F.PARTIAL).sum() and (bm.classes == F.SKIPPED).sum()
    assert kflex.config_for(d, "float16", bm.BLOCK_SIZE, True).B_c == 32
    calls.clear()
    copies = ptx_calls("cp_async16")
    O, _ = kflex.flex_forward(q, k, v, block_mask=bm)
    expected = [(r, c) for i, rows in enumerate(bm.row_tiles()) for j, cols in enumerate(bm.col_tiles())
                if bm.classes[0, 0, i, j] == F.PARTIAL for r in range(rows.start, rows.stop)
                for c in range(cols.start, cols.stop)]
    assert sorted(calls) == sorted(expected)
    rows_kv = {int(g_index) // (d // 2) for _, _, gmem, g_index, size in copies
               if int(size) and gmem.shape[2] == N_k}
    skipped = {r for r in range(N_k) if (bm.classes[0, 0, :, r // 64] == F.SKIPPED).all()}
    assert skipped and not skipped & rows_kv
    O_ref, _ = dense_oracle(q, k, v, bm.mask_mod, None)
    assert np.abs(O - O_ref).max() < 5e-3


def test_rung_v4_is_kept_and_agrees():
    q, k, v = _inputs(1, 1, 1, 24, 30, 16, seed=10)
    bm = F.create_block_mask(F.sliding_window(9), None, None, 24, 30, BLOCK_SIZE=16)
    O4, L4 = kflex.flex_forward(q, k, v, block_mask=bm, rung="v4")
    O11, L11 = kflex.FORWARD_VERSIONS["v11"](q, k, v, block_mask=bm)
    assert kflex.FORWARD_VERSIONS["v4"] is kflex.flex_forward_v4
    assert np.abs(O4.astype(np.float64) - O11).max() < 2e-3
    np.testing.assert_allclose(L4, L11, rtol=1e-5, atol=1e-5)


def test_repeated_calls_reuse_the_walk_the_plan_and_the_bound_arrays():
    """What a repeated call finds made: the BlockMask's device walk, the mods' plan, the bound arrays' copies."""
    bm = F.create_block_mask(F.document(Q_DOCS, KV_DOCS), None, None, 37, 41, BLOCK_SIZE=16)
    cfg = kflex.config_for(16, "float16", bm.BLOCK_SIZE, True)
    assert kflex.walk_for(bm, cfg, 37, 41) is kflex.walk_for(bm, cfg, 37, 41)
    bias = F.relative_bias(np.linspace(0.0, 1.0, 5))
    first = kflex.planned_mods(bm.mask_mod, bias, 37, 41)
    assert kflex.planned_mods(bm.mask_mod, bias, 37, 41)[0] is first[0]
    copies = kflex._bound_on_device(first[1])
    assert all(a is b for a, b in zip(copies, kflex._bound_on_device(first[1])))
    replaced = F.BlockMask(bm.mask_mod, 1, 1, 37, 41, 16, bm.classes.copy())
    assert kflex.walk_for(replaced, cfg, 37, 41) is not kflex.walk_for(bm, cfg, 37, 41)
