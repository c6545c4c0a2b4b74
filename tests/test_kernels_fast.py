"""kernels_gpu.fast (the numbered fast FA2 forward kernels) in numba's CUDA simulator, against the float64 oracle.

What these tests prove, on tiny ragged shapes (N_q, N_k not multiples of any tile side, N_q ≠ N_k):

* every version (v1: shared-memory row maxima; v2-v4: warp-shuffle butterflies, run here through the simulator's
  emulation ``_xor_shuffle_sim``, so the lane arithmetic itself is tested; v4: K_j/V_j loads pipelined through
  registers, on its whole-tile, ragged-last-tile and general (T % d ≠ 0) paths) gives O and L within DESIGN.md's
  float32 rule, causal and not, with GQA, for several thread tilings (TR, TC, NX of 1, 2, 4);
* fully masked rows (causal with N_q > N_k) give exactly O = 0 and L = +inf, never NaN;
* the dynamic shared-memory path (tiles above 48 KiB) computes the same thing as the static one;
* tile shapes the kernel cannot run are refused with a ValueError naming the tiling;
* v6 (operands double-buffered in registers, Q_i moved like the K/V tiles, the bare ``ex2`` emulated with its
  flush to zero, the Õ rescale skipped when α = 1) on even and odd step counts of both inner loops;
* v7 (the last wave split along the keys) and v8 (work units from a counter: whole items, then the last items'
  steps in equal stream-K ranges, the split items merged) on launches that really split, the plans checked
  against their specification;
* v7's and v8's merges of split items compute fa2edu.merge_attention_states (the specification) row by row,
  log-sum-exps near ±1e4 included;
* v5's and v6's per-head-dimension defaults (tiling and register cap) are tilings the kernel accepts, within the shared
  memory the GPU allows, and a bad register cap is refused with a ValueError naming ``max_registers``.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from numba import cuda
from tolerances import assert_close_to_oracle, baseline_error

import fa2edu
from kernels_gpu import runtime as rt
from kernels_gpu.fast import VERSIONS, Tiling, split, tiled

if not rt.simulator_in_use():  # pragma: no cover
    pytest.skip("simulator tests: NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py sets it)", allow_module_level=True)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Outputs start as NaN: an element the kernel never writes cannot pass."""
    monkeypatch.setattr(rt, "poison_outputs", True)


def _problem(seed, Z, H_q, H_kv, N_q, N_k, d, scale=1.0):
    rng = np.random.default_rng(seed)
    Q = (scale * rng.standard_normal((Z, H_q, N_q, d))).astype(np.float32)
    K = (scale * rng.standard_normal((Z, H_kv, N_k, d))).astype(np.float32)
    V = rng.standard_normal((Z, H_kv, N_k, d)).astype(np.float32)
    return Q, K, V


def _check(version, Q, K, V, causal, tiling, **options):
    """One call of a fast version (``options``: its own, e.g. ``slots``) against the float64 oracle."""
    O, L = VERSIONS[version](Q, K, V, causal=causal, tiling=tiling, **options)
    O_ref, L_ref = fa2edu.attention_reference(Q, K, V, causal=causal)
    base = fa2edu.standard_attention(Q, K, V, causal=causal).O      # float32 standard attention: the baseline error
    assert_close_to_oracle(O, O_ref, "O", dtype=np.float32, baseline=baseline_error(base, O_ref))
    # L: float32 rounding of a value of size |L| (the log-sum-exp), relative 1e-6, plus the absolute floor
    L_size = float(np.abs(L_ref[np.isfinite(L_ref)]).max(initial=1.0))
    assert_close_to_oracle(L, L_ref, "L", dtype=np.float32, baseline=1e-6 * max(1.0, L_size))
    return O, L


# The simulator's cost is threads × steps (one Python thread per CUDA thread), so each case is as small as what it
# exercises allows: the Tiling(2, 4, 3, 1) cases at d = 16 (T % d ≠ 0: the general tile move) carry a batch of two
# and GQA in one ragged row block (N_q = 5 < B_r = 6) and three K/V tiles; each version's other case has several
# row blocks.
CASES = [  # (version, tiling (NY, NX, TR, TC), Z, H_q, H_kv, N_q, N_k, d, causal)
    ("v1", Tiling(4, 2, 2, 2), 1, 2, 1, 13, 11, 8, False),
    ("v1", Tiling(2, 4, 2, 1), 1, 1, 1, 9, 17, 16, True),
    ("v2", Tiling(4, 2, 2, 2), 1, 2, 2, 13, 11, 8, True),
    ("v2", Tiling(2, 4, 3, 1), 2, 2, 1, 5, 11, 16, False),
    ("v3", Tiling(4, 1, 2, 4), 1, 2, 1, 7, 12, 4, True),
    ("v3", Tiling(2, 2, 2, 2), 1, 1, 1, 6, 6, 8, True),
    # v4 (pipelined loads): T % d == 0 with B_c % (T/d) == 0 (the "regular" move, whole tiles by constant offsets,
    # ragged last tile clamped), several tiles so the K_{j+1} prefetch runs, and T % d != 0 (the general move)
    ("v4", Tiling(4, 2, 2, 2), 1, 2, 1, 13, 11, 8, False),
    ("v4", Tiling(8, 1, 2, 4), 1, 2, 2, 9, 21, 4, True),
    ("v4", Tiling(2, 4, 3, 1), 2, 2, 1, 5, 11, 16, False),
    # v5: v4's kernel with a register cap (a ptxas option: the simulator ignores it, so this tests the same
    # arithmetic through v5's entry point, with and without a cap)
    ("v5", Tiling(4, 2, 2, 2), 1, 2, 1, 13, 11, 8, True),
    ("v5", Tiling(8, 1, 2, 4), 2, 2, 2, 9, 21, 4, False),
    # v6: double-buffered operands. d/4 steps even and odd (the odd one ends on the first buffer), B_c/4 groups even
    # and odd (likewise for P̃'s buffers), the Q_i move in several passes (B_r·d > 32·T), the prefetch past the tile
    # reading the padding, the general tile move (T % d ≠ 0), several K/V tiles, GQA, fully masked rows
    ("v6", Tiling(4, 2, 2, 2), 1, 2, 1, 13, 11, 8, True),
    ("v6", Tiling(8, 1, 2, 4), 2, 2, 2, 9, 21, 12, False),
    ("v6", Tiling(2, 2, 2, 6), 1, 2, 2, 7, 30, 24, True),
    ("v6", Tiling(2, 1, 2, 12), 1, 1, 1, 5, 29, 20, False),
    ("v6", Tiling(2, 4, 3, 1), 1, 2, 1, 10, 11, 16, True),
    ("v6", Tiling(4, 1, 1, 4), 1, 2, 2, 6, 9, 4, True),
    # v7 through its default launch (the simulator counts one resident block: whole items only, 1-D grid)
    ("v7", Tiling(4, 2, 2, 2), 1, 2, 1, 13, 11, 8, True),
    ("v7", Tiling(2, 4, 3, 1), 2, 2, 1, 5, 11, 16, False),
    # v8 through its default launch (the simulator counts one resident block: one block walks every item in turn)
    ("v8", Tiling(4, 2, 2, 2), 1, 2, 1, 13, 11, 8, True),
    ("v8", Tiling(2, 4, 3, 1), 2, 2, 1, 5, 11, 16, False),
]


@pytest.mark.parametrize("version, tiling, Z, H_q, H_kv, N_q, N_k, d, causal", CASES)
def test_matches_oracle_on_ragged_shapes(version, tiling, Z, H_q, H_kv, N_q, N_k, d, causal):
    Q, K, V = _problem(zlib.crc32(repr((version, N_q, N_k)).encode()), Z, H_q, H_kv, N_q, N_k, d)
    _check(version, Q, K, V, causal, tiling)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_fully_masked_rows_give_zero_output_and_infinite_L(version):
    # causal with N_q > N_k: the first N_q − N_k rows see no key at all (bottom-right alignment)
    Q, K, V = _problem(7, 1, 1, 1, 11, 5, 8)
    O, L = _check(version, Q, K, V, True, Tiling(4, 2, 2, 2))
    assert np.all(O[..., :6, :] == 0.0) and np.all(np.isposinf(L[..., :6]))
    assert np.isfinite(L[..., 6:]).all()


def test_large_logits_stay_finite():
    Q, K, V = _problem(3, 1, 1, 1, 9, 10, 8, scale=12.0)     # scores of a few hundred: exp overflows unguarded
    _check("v2", Q, K, V, False, Tiling(4, 2, 2, 2))


def test_dynamic_shared_memory_path_matches_static(monkeypatch):
    Q, K, V = _problem(5, 1, 2, 1, 10, 9, 8)
    O_static, L_static = VERSIONS["v2"](Q, K, V, causal=True, tiling=Tiling(4, 2, 2, 2))
    tiled.make_forward.cache_clear()
    monkeypatch.setattr(tiled, "STATIC_FLOATS", 16)          # force the dynamic-shared-memory declaration
    O_dyn, L_dyn = VERSIONS["v2"](Q, K, V, causal=True, tiling=Tiling(4, 2, 2, 2))
    tiled.make_forward.cache_clear()
    np.testing.assert_array_equal(O_dyn, O_static)
    np.testing.assert_array_equal(L_dyn, L_static)


@pytest.mark.parametrize("tiling, message", [(Tiling(4, 3, 2, 4), "NX"), (Tiling(4, 2, 2, 1), "B_c"),
                                              (Tiling(1024, 2, 1, 2), "threads")])
def test_bad_tilings_are_refused(tiling, message):
    Q, K, V = _problem(0, 1, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=message):
        VERSIONS["v1"](Q, K, V, tiling=tiling)


def test_head_size_the_kernel_cannot_tile_is_refused():
    Q, K, V = _problem(0, 1, 1, 1, 4, 4, 6)                  # d = 6: not a multiple of 4
    with pytest.raises(ValueError, match="d % 4"):
        VERSIONS["v2"](Q, K, V, tiling=Tiling(2, 2, 2, 2))


def test_v5_register_cap_is_passed_and_checked():
    Q, K, V = _problem(11, 1, 2, 1, 10, 13, 8)
    O0, L0 = VERSIONS["v5"](Q, K, V, causal=True, tiling=Tiling(4, 2, 2, 2))
    O1, L1 = VERSIONS["v5"](Q, K, V, causal=True, tiling=Tiling(4, 2, 2, 2), max_registers=128)
    np.testing.assert_array_equal(O0, O1)     # the cap changes register allocation, never the arithmetic
    np.testing.assert_array_equal(L0, L1)
    for bad in (8, 300, 128.0, True):
        with pytest.raises(ValueError, match="max_registers"):
            VERSIONS["v5"](Q, K, V, tiling=Tiling(4, 2, 2, 2), max_registers=bad)


@pytest.mark.parametrize("version", ["v5", "v6", "v7", "v8"])
@pytest.mark.parametrize("d", [64, 128])
def test_defaults_are_runnable_tilings(version, d):
    import importlib
    module = importlib.import_module(f"kernels_gpu.fast.flash2_forward_{version}")
    tiling, cap = module.default_tiling(d), module.default_max_registers(d)
    tiled.check_tiling(tiling, d, d)                                   # raises on a tiling the kernel cannot run
    size = tiled.layout(tiling, d, d, module.SHUFFLE, getattr(module, "FRAGMENTS", False))["size"]
    assert 4 * size <= tiled.MAX_DYNAMIC_BYTES
    assert cap is None or 16 <= cap <= 255


def test_v6_ex2_emulation_flushes_subnormal_results_to_zero():
    """The simulator's stand-in for ``ex2.approx.ftz``: 2^x exactly where the result is normal, 0 below 2^-126."""
    @cuda.jit
    def probe(x, out):
        i = cuda.threadIdx.x
        if i < x.shape[0]:
            out[i] = tiled._ex2_ftz_sim(x[i])
    x = np.array([0.0, -1.5, 3.25, -126.0, -126.5, -149.0, -np.inf], np.float32)
    out = np.full_like(x, np.nan)
    probe[1, 8](x, out)
    np.testing.assert_array_equal(out[:4], np.exp2(x[:4]))
    np.testing.assert_array_equal(out[4:], 0.0)


# -- v7: the last wave split along the keys ----------------------------------------------------------------------

@pytest.mark.parametrize("items, T_c, slots, causal, expected", [
    # the benchmark at d = 128 on 132 SMs: 15 waves, then 68 items; in 7 pieces the last wave is 4 rounds of
    # 32/7 + 0.35 tiles = 19.7 tiles (2 pieces: 2 rounds of 16.35 = 32.7, no better than 32.35 unsplit)
    (2048, 32, 132, False, (1980, 68, 7)),
    (2048, 16, 132, False, (1980, 68, 7)),     # 4 × (16/7 + 0.35) = 10.6 tiles; 5 pieces: 3 × 3.55 = 10.65
    (1980, 32, 132, False, (1980, 0, 1)),      # whole waves: nothing to split
    (2048, 32, 132, True, (2048, 0, 1)),       # causal items differ in cost: never split
    (100, 32, 132, False, (100, 0, 1)),        # less than one wave
    (2048, 3, 132, False, (2048, 0, 1)),       # too few tiles to cut
    (8192, 64, 396, False, (7920, 272, 7)),    # d = 64, 3 blocks per SM: 5 × (64/7 + 0.35) = 47.5 tiles, not 64.35
])
def test_split_plan(items, T_c, slots, causal, expected):
    n_full, n_split, S = split.split_plan(items, T_c, slots, causal)
    assert (n_full, n_split, S) == expected
    assert n_full + n_split == items and n_full % slots == 0 or n_split == 0


@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, slots", [
    (Tiling(4, 2, 2, 2), 2, 2, 1, 13, 21, 8, 5),   # 8 items × 6 tiles on 5 slots: 5 whole, 3 split in 3 pieces
    (Tiling(2, 1, 2, 4), 1, 2, 2, 9, 21, 4, 4),    # 6 items × 6 tiles on 4 slots: 4 whole, 2 split in 2 pieces
])
def test_v7_split_items_match_oracle(tiling, Z, H_q, H_kv, N_q, N_k, d, slots):
    """The split path: pieces over ranges of K/V tiles, merged by the (m, ℓ) rule, give O and L within the float32
    rule; causal calls (never split) too. Outputs are poisoned, so a row neither launch wrote shows as NaN."""
    T_r, T_c = -(-N_q // tiling.B_r), -(-N_k // tiling.B_c)
    assert split.split_plan(T_r * Z * H_q, T_c, slots, False)[1] > 0          # the case really splits
    Q, K, V = _problem(7, Z, H_q, H_kv, N_q, N_k, d)
    for causal in (False, True):
        _check("v7", Q, K, V, causal, tiling, slots=slots)


@pytest.mark.parametrize("version", ["v7", "v8"])
def test_bad_slots_are_refused(version):
    Q, K, V = _problem(3, 1, 1, 1, 5, 9, 8)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="slots"):
            VERSIONS[version](Q, K, V, tiling=Tiling(4, 2, 2, 2), slots=bad)


# -- v8: stream-K ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("items, T_c, slots", [(2048, 32, 132), (2048, 16, 132), (8192, 64, 396), (12, 6, 5),
                                               (3, 7, 8), (5, 4, 20), (1, 9, 1), (6, 1, 4), (1980, 32, 132)])
def test_stream_pieces_cover_every_step_once(items, T_c, slots):
    """v8's plan (the specification the kernel and the merge follow): whole items for whole waves of ``slots``
    blocks, then the rest cut into R equal ranges of steps; the pieces tile every (item, K/V tile) step exactly
    once; a piece is whole (slot −1) exactly when it covers its item's T_c tiles; every partial piece has its own
    slot, 2r or 2r + 1 of its range r; a split item's pieces come from consecutive ranges, and an item is split
    exactly where a boundary between ranges falls inside it."""
    n_whole, R = split.stream_plan(items, T_c, slots)
    assert n_whole % slots == 0 and 0 <= items - n_whole < slots and R == min(slots, (items - n_whole) * T_c)
    pieces = split.stream_pieces(items, T_c, slots)
    covered = np.zeros((items, T_c), int)
    per_unit = np.zeros(n_whole + R, int)
    for unit, item, j_lo, j_hi, slot in pieces:
        covered[item, j_lo:j_hi] += 1
        per_unit[unit] += j_hi - j_lo
        assert (slot == -1) == (j_lo == 0 and j_hi == T_c)
        assert unit >= n_whole or (item == unit and slot == -1)
        assert slot in (-1, 2 * (unit - n_whole), 2 * (unit - n_whole) + 1)
    assert np.all(covered == 1)
    ranges = per_unit[n_whole:]
    assert ranges.sum() == (items - n_whole) * T_c and (R == 0 or ranges.max() - ranges.min() <= 1)
    slots_used = [p[4] for p in pieces if p[4] >= 0]
    assert len(slots_used) == len(set(slots_used))
    for item in {p[1] for p in pieces if p[4] >= 0}:
        units = [p[0] for p in pieces if p[1] == item]
        assert len(units) >= 2 and units == list(range(units[0], units[0] + len(units)))
    W, base = (items - n_whole) * T_c, n_whole * T_c
    inside = {(base + split.step_bound(r, W, R)) // T_c for r in range(1, R) if split.step_bound(r, W, R) % T_c}
    assert {p[1] for p in pieces if p[4] >= 0} == inside
    if (items, T_c, slots) == (2048, 32, 132):
        # the benchmark at d = 128: 15 waves of whole items, then 68 items (2176 steps) in 132 ranges of 16 or 17
        assert n_whole == 1980 and R == 132 and ranges.min() == 16 and ranges.max() == 17


@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, slots", [
    # (ragged N throughout but in the last case; batch and GQA in the first, where ranges cross item boundaries)
    (Tiling(4, 2, 2, 2), 2, 2, 1, 13, 21, 8, 5),   # 8 items × 6 tiles, 5 slots: 5 whole, 3 items in 5 ranges
    (Tiling(2, 1, 2, 4), 1, 2, 2, 9, 21, 4, 4),    # 6 items × 6 tiles, 4 slots: 4 whole, 2 items in 4 ranges
    (Tiling(4, 2, 2, 2), 1, 1, 1, 7, 23, 8, 3),    # 1 item × 6 tiles on 3 slots: one item in three pieces
    (Tiling(2, 2, 2, 2), 1, 2, 1, 3, 9, 8, 40),    # more slots than steps (2 items × 3 tiles): 6 ranges of 1 step
    (Tiling(2, 2, 2, 2), 2, 2, 2, 8, 12, 8, 5),    # whole tiles, 8 items × 3 tiles, 5 slots: 5 whole, 3 in 5 ranges
])
def test_v8_stream_matches_oracle(tiling, Z, H_q, H_kv, N_q, N_k, d, slots):
    """Work units from a counter (whole items, then equal ranges of the last items' steps, across item
    boundaries), the split items merged by the (m, ℓ) rule: O and L within the float32 rule; causal calls (v6's
    grid) too. Outputs are poisoned, so a row that neither launch wrote shows as NaN."""
    T_r, T_c = -(-N_q // tiling.B_r), -(-N_k // tiling.B_c)
    items = T_r * Z * H_q
    assert any(p[4] >= 0 for p in split.stream_pieces(items, T_c, slots))         # the case really splits
    Q, K, V = _problem(11, Z, H_q, H_kv, N_q, N_k, d)
    for causal in (False, True):
        _check("v8", Q, K, V, causal, tiling, slots=slots)


# -- the merges of split items against fa2edu's merge operator ---------------------------------------------------

def _merged(pieces):
    """fa2edu.merge_attention_states folded over (O_p, L_p) pieces, in float64: the specification."""
    O, L = pieces[0]
    for O_p, L_p in pieces[1:]:
        O, L = fa2edu.merge_attention_states(O, L, O_p, L_p)
    return O, L


def _check_merged_rows(O, L, expected):
    """Rows a merge wrote against the operator; every other row still holds the poison (NaN)."""
    written = np.zeros(L.shape, bool)
    for (z, h, row), (O_ref, L_ref) in expected.items():
        np.testing.assert_allclose(O[z, h, row], O_ref, rtol=0, atol=2e-6 * max(1.0, np.abs(O_ref).max()))
        np.testing.assert_allclose(L[z, h, row], L_ref, rtol=2e-7, atol=2e-6)
        written[z, h, row] = True
    assert np.isnan(L[~written]).all() and np.isnan(O[~written]).all()


def test_v7_merge_kernel_is_the_merge_operator():
    """split.merge_kernel on random pieces (log-sum-exps near 0, +1e4 and −1e4, one centre per split item) gives
    what fa2edu.merge_attention_states gives for the same pieces, row by row. Every piece here saw keys (finite
    L): split launches are never causal, so a piece always holds at least one key, and the kernel has no guard
    for the operator's empty side (L = +inf)."""
    Z, H, N, B_r, d_v, S, item0, n_split = 1, 2, 7, 4, 5, 3, 1, 3           # items 1, 2, 3 of T_r · H = 4
    T_r = -(-N // B_r)
    rng = np.random.default_rng(13)
    Opart = rng.standard_normal((n_split * S, B_r, d_v)).astype(np.float32)
    centre = np.repeat([0.0, 1e4, -1e4], S)[:, None]
    Lpart = (centre + 5 * rng.standard_normal((n_split * S, B_r))).astype(np.float32)
    O, L = np.full((Z, H, N, d_v), np.nan, np.float32), np.full((Z, H, N), np.nan, np.float32)
    d_O, d_L = cuda.to_device(O), cuda.to_device(L)
    merger = split.merge_kernel(B_r, d_v)
    merger[-(-n_split * B_r // split.MERGE_ROWS), split.MERGE_THREADS](cuda.to_device(Opart), cuda.to_device(Lpart),
                                                                      d_O, d_L, item0, S, T_r, n_split)
    expected = {}
    for g in range(n_split):
        item = item0 + g
        z, h, i = item // (T_r * H), (item // T_r) % H, item % T_r
        for r in range(B_r):
            if i * B_r + r < N:
                pieces = [(Opart[s, r:r + 1].astype(np.float64), Lpart[s, r:r + 1].astype(np.float64))
                          for s in range(g * S, g * S + S)]
                O_ref, L_ref = _merged(pieces)
                expected[(z, h, i * B_r + r)] = (O_ref[0], L_ref[0])
    _check_merged_rows(d_O.copy_to_host(), d_L.copy_to_host(), expected)


def test_v8_stream_merge_kernel_is_the_merge_operator():
    """split.stream_merge_kernel merges each split item's pieces (slots from split.stream_pieces) exactly as
    fa2edu.merge_attention_states does; whole items are left alone."""
    Z, H, N, B_r, d_v, T_c, slots = 1, 3, 10, 4, 6, 5, 5
    T_r = -(-N // B_r)
    items = Z * H * T_r                                                      # 9 items: 5 whole, 4 in 5 ranges
    n_whole, R = split.stream_plan(items, T_c, slots)
    pieces = split.stream_pieces(items, T_c, slots)
    split_items = sorted({p[1] for p in pieces if p[4] >= 0})
    assert split_items                                                       # the case really splits
    rng = np.random.default_rng(17)
    Opart = rng.standard_normal((2 * R, B_r, d_v)).astype(np.float32)
    Lpart = (30 * rng.standard_normal((2 * R, B_r))).astype(np.float32)
    O, L = np.full((Z, H, N, d_v), np.nan, np.float32), np.full((Z, H, N), np.nan, np.float32)
    d_O, d_L = cuda.to_device(O), cuda.to_device(L)
    merger = split.stream_merge_kernel(B_r, d_v)
    merger[-(-(R - 1) * B_r // split.MERGE_ROWS), split.MERGE_THREADS](
        cuda.to_device(Opart), cuda.to_device(Lpart), d_O, d_L, T_r, T_c, R, n_whole)
    expected = {}
    for item in split_items:
        slots_of_item = [p[4] for p in pieces if p[1] == item]
        assert all(s >= 0 for s in slots_of_item) and len(slots_of_item) >= 2
        z, h, i = item // (T_r * H), (item // T_r) % H, item % T_r
        for r in range(B_r):
            if i * B_r + r < N:
                O_ref, L_ref = _merged([(Opart[s, r:r + 1].astype(np.float64), Lpart[s, r:r + 1].astype(np.float64))
                                        for s in slots_of_item])
                expected[(z, h, i * B_r + r)] = (O_ref[0], L_ref[0])
    _check_merged_rows(d_O.copy_to_host(), d_L.copy_to_host(), expected)
