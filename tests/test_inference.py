"""fa2edu.decode_attention and fa2edu.varlen_attention against the float64 oracle, and their ledgers.

What these tests prove:

* decode_attention equals the oracle run on each sequence alone (its keys gathered from the cache), O and L, for
  contiguous and paged caches (pages in a shuffled physical order), ragged cache_seqlens including 0 (O = 0,
  L = +inf) and the full cache, N_new > 1 with bottom-right causal masking within each sequence, GQA groups of 1 to
  8 query heads, and num_splits from 1 to more than the key blocks (and the default rule); cache entries that no
  sequence owns are NaN in the drawn caches, so a read of one would show;
* float32 and float16 caches within the float32 rule (2× standard attention's error plus a floor);
* the ledger: each cached key and value is read exactly once per KV head, whatever the GQA group and the split
  count; the queries once per non-empty split; S > 1 writes S partials per sequence and reads them back; a paged
  cache moves exactly what a contiguous one does;
* varlen_attention equals the oracle per sequence (empty sequences included, n_q ≠ n_k, causal, GQA), its ledger
  is FA2's closed form summed over the sequences, and padded_batch_io is that form at the padded lengths: equal
  for equal lengths, larger for ragged ones;
* bad block tables, lengths out of range, non-monotone offsets and other bad arguments get a clear error naming
  the argument.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from strategies import decode_problems, packed_batches
from tolerances import assert_close_to_oracle, baseline_error

import fa2edu
from fa2edu import HBM, FlopCounter
from fa2edu.hardware import DEVICES
from fa2edu.inference import (
    DECODE_SMS,
    IndexDtypeError,
    check_cu_seqlens,
    decode_block_size,
    default_num_splits,
    split_ranges,
)
from fa2edu.partition import sm_utilisation

DECODE_ARGS = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "causal", "scale", "num_splits",
               "block_size")


def _decode(case, **overrides):
    kwargs = {name: case[name] for name in DECODE_ARGS}
    kwargs.update(overrides)
    return fa2edu.decode_attention(**kwargs)


def _check_decode_against_oracle(case, O, L, dtype=np.float64):
    q = case["q"]
    for b, (K_b, V_b) in enumerate(zip(case["keys"], case["values"])):
        if K_b.shape[-2] == 0:
            # An idle slot: no key to see.
            np.testing.assert_array_equal(O[b], 0.0)
            assert np.isposinf(L[b]).all()
            continue
        O_ref, L_ref = fa2edu.attention_reference(q[b], K_b, V_b, causal=case["causal"], scale=case["scale"])
        if np.dtype(dtype) == np.float64:
            assert_close_to_oracle(O[b], O_ref, f"O[{b}]")
            assert_close_to_oracle(L[b], L_ref, f"L[{b}]")
        else:
            base = fa2edu.standard_attention(q[b], K_b, V_b, causal=case["causal"], scale=case["scale"]).O
            assert_close_to_oracle(O[b], O_ref, f"O[{b}]", dtype=dtype, baseline=baseline_error(base, O_ref))
            L_size = float(np.abs(L_ref[np.isfinite(L_ref)]).max(initial=1.0))
            assert_close_to_oracle(L[b], L_ref, f"L[{b}]", dtype=np.float32, baseline=1e-6 * max(1.0, L_size))


# -- decode_attention: exactness ------------------------------------------------------------------------------------

@given(decode_problems())
def test_decode_matches_oracle_per_sequence(case):
    O, L = _decode(case)
    q = case["q"]
    assert O.shape == q.shape[:3] + (case["v_cache"].shape[-1],) and O.dtype == q.dtype
    assert L.shape == q.shape[:3]
    _check_decode_against_oracle(case, O, L)


@given(decode_problems(paged=True, dtypes=(np.float32, np.float16), max_group=4))
def test_decode_low_precision_within_the_float32_rule(case):
    O, L = _decode(case)
    assert O.dtype == case["q"].dtype and L.dtype == np.float32
    _check_decode_against_oracle(case, O, L, dtype=case["q"].dtype)


def _paged_case(seed=0, B=3, H_kv=2, G=4, N_new=2, d=8, d_v=6, page_size=4, max_pages=5, seqlens=(0, 9, 20)):
    """A fixed paged problem (shuffled pages, NaN where no sequence owns an entry) and its contiguous twin."""
    rng = np.random.default_rng(seed)
    num_pages = B * max_pages + 2
    k_cache = np.full((num_pages, H_kv, page_size, d), np.nan)
    v_cache = np.full((num_pages, H_kv, page_size, d_v), np.nan)
    table = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages)
    k_flat = np.full((B, H_kv, max_pages * page_size, d), np.nan)
    v_flat = np.full((B, H_kv, max_pages * page_size, d_v), np.nan)
    for b, n in enumerate(seqlens):
        k_flat[b, :, :n] = rng.standard_normal((H_kv, n, d))
        v_flat[b, :, :n] = rng.standard_normal((H_kv, n, d_v))
        for p in range(-(-n // page_size)):
            k_cache[table[b, p]] = k_flat[b, :, p * page_size:(p + 1) * page_size]
            v_cache[table[b, p]] = v_flat[b, :, p * page_size:(p + 1) * page_size]
    q = rng.standard_normal((B, H_kv * G, N_new, d))
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=np.array(seqlens), block_table=table,
                k_flat=k_flat, v_flat=v_flat)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 12])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_and_contiguous_caches_agree(num_splits, causal):
    """The same keys through a shuffled block table or in place: the same O and L, the same cache traffic."""
    c = _paged_case()
    paged, flat = HBM(), HBM()
    res_p = fa2edu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"],
                                    causal=causal, num_splits=num_splits, hbm=paged)
    res_c = fa2edu.decode_attention(c["q"], c["k_flat"], c["v_flat"], c["cache_seqlens"], causal=causal,
                                    num_splits=num_splits, hbm=flat, block_size=c["k_cache"].shape[2])
    np.testing.assert_allclose(res_p.O, res_c.O, rtol=0, atol=1e-14)
    np.testing.assert_array_equal(np.isposinf(res_p.L), np.isposinf(res_c.L))
    assert paged.by_tensor() == flat.by_tensor()


def test_new_tokens_see_keys_up_to_their_own_position():
    """N_new = 3 with causal: token t's output equals attention to the first n − N_new + t + 1 keys only;
    without causal every token sees all n keys."""
    c = _paged_case(N_new=3, seqlens=(2, 9, 20))
    O, L = fa2edu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"])
    for b, n in enumerate(c["cache_seqlens"]):
        for t in range(3):
            visible = n - 3 + t + 1
            if visible <= 0:
                np.testing.assert_array_equal(O[b, :, t], 0.0)
                assert np.isposinf(L[b, :, t]).all()
                continue
            O_ref, L_ref = fa2edu.attention_reference(c["q"][b][:, t:t + 1], c["k_flat"][b][:, :visible],
                                                      c["v_flat"][b][:, :visible])
            np.testing.assert_allclose(O[b, :, t:t + 1], O_ref, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(L[b, :, t:t + 1], L_ref, rtol=1e-12, atol=1e-12)


# -- decode_attention: the ledger --------------------------------------------------------------------------------------

@pytest.mark.parametrize("G", [1, 2, 8])
@pytest.mark.parametrize("num_splits", [1, 2, 4, 9])
def test_ledger_reads_the_cache_once_per_kv_head(G, num_splits):
    """Per KV head: K and V read once (Σ_b n_b keys), whatever G and S; q once per non-empty split; with S > 1,
    S partials of G·N_new rows written per sequence and read back once; O and L written once."""
    c = _paged_case(G=G)
    hbm, flops = HBM(), FlopCounter()
    fa2edu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"],
                            num_splits=num_splits, hbm=hbm, flops=flops)
    B, _, N_new, d = c["q"].shape
    d_v, page = c["v_cache"].shape[-1], c["k_cache"].shape[2]
    seqlens = c["cache_seqlens"]
    R = G * N_new                                                      # query rows per KV-head program
    t = hbm.by_tensor()
    assert t["K"]["read"] == d * seqlens.sum() and t["V"]["read"] == d_v * seqlens.sum()
    nonempty = sum(min(num_splits, -(-int(n) // page)) for n in seqlens)
    assert t["q"]["read"] == nonempty * R * d
    assert t["O"]["write"] == B * R * d_v and t["L"]["write"] == B * R
    if num_splits == 1:
        assert "O_part" not in t and "L_part" not in t
    else:
        assert t["O_part"] == {"read": B * num_splits * R * d_v, "write": B * num_splits * R * d_v, "init": 0}
        assert t["L_part"] == {"read": B * num_splits * R, "write": B * num_splits * R, "init": 0}
    assert hbm.reads == sum(row["read"] for row in t.values())
    # The two matmuls: 2·R·n·d for S = QKᵀ and 2·R·n·d_v for PV, per KV head, summed over the sequences.
    assert flops.matmul == 2 * R * seqlens.sum() * (d + d_v)


def test_default_num_splits_rule():
    """The smallest S whose SM utilisation is within 90 % of the best S ≤ min(blocks, SMs); 1 when the programs
    fill the SMs already or there is at most one block."""
    assert DECODE_SMS == DEVICES["H100-SXM"].sms == 132
    assert default_num_splits(1, 8, 1000) == 15            # 8 programs: 15 splits → 120 of 132 SMs (91 %)
    assert default_num_splits(1, 8, 5) == 5                # never more splits than blocks
    assert default_num_splits(64, 8, 1000) == 1            # 512 programs already fill the SMs
    assert default_num_splits(2, 1, 1) == 1 and default_num_splits(2, 1, 0) == 1
    for batch, H_kv, blocks in [(1, 1, 500), (3, 2, 40), (7, 4, 9), (5, 5, 300), (1, 3, 1000)]:
        S = default_num_splits(batch, H_kv, blocks)
        util = [sm_utilisation(batch * H_kv * s, DECODE_SMS)
                for s in range(1, min(blocks, DECODE_SMS) + 1)]
        assert util[S - 1] >= 0.9 * max(util) and all(u < 0.9 * max(util) for u in util[:S - 1])


def test_decode_without_num_splits_uses_the_rule():
    c = _paged_case(B=1, H_kv=1, G=2, seqlens=(20,))                          # 5 pages, 1 program: S = 5
    hbm = HBM()
    fa2edu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"], hbm=hbm)
    S = default_num_splits(1, 1, 5)
    assert S == 5
    assert hbm.by_tensor()["L_part"]["write"] == S * 2 * c["q"].shape[2]


def test_split_ranges_are_even_and_cover_every_block():
    for T in range(0, 12):
        for S in range(1, 15):
            ranges = split_ranges(T, S)
            assert [p for r in ranges for p in r] == list(range(T))
            sizes = [len(r) for r in ranges]
            assert max(sizes) - min(sizes) <= 1 and (S > T or min(sizes) >= 1)


def test_contiguous_block_size_default_is_fa1s_kv_block():
    assert decode_block_size(64) == math.ceil(fa2edu.DEFAULT_M / 256)
    assert decode_block_size(128, M=98_304) == 192


# -- decode_attention: bad input ---------------------------------------------------------------------------------------

def _bad(**changes):
    c = _paged_case()
    args = dict(q=c["q"], k_cache=c["k_cache"], v_cache=c["v_cache"], cache_seqlens=c["cache_seqlens"],
                block_table=c["block_table"])
    args.update(changes)
    return args


def _table_with(b, p, value):
    table = _paged_case()["block_table"].copy()
    table[b, p] = value
    return table


@pytest.mark.parametrize("changes, error, message", [
    (dict(block_table=_table_with(2, 0, -1)), ValueError, r"block_table\[2, 0\] = -1"),
    (dict(block_table=_table_with(1, 2, 17)), ValueError, r"block_table\[1, 2\] = 17 is not a page"),
    (dict(block_table=_paged_case()["block_table"][:, :4]), ValueError, "block_table has only 4 pages"),
    (dict(block_table=_paged_case()["block_table"].astype(np.float64)), ValueError, "block_table must hold int"),
    (dict(block_table=_paged_case()["block_table"].astype(np.float64)), TypeError, "block_table must hold int"),
    (dict(block_table=_paged_case()["block_table"][:2]), ValueError, "block_table must have shape"),
    (dict(block_table=_paged_case()["block_table"][0]), ValueError, "block_table must have 2 axes"),
    (dict(cache_seqlens=np.array([0, 9, 21])), ValueError, r"cache_seqlens\[2\] = 21 needs 6 pages"),
    (dict(cache_seqlens=np.array([0, -1, 20])), ValueError, "cache_seqlens must be non-negative"),
    (dict(cache_seqlens=np.array([0.0, 9.0, 20.0])), ValueError, "cache_seqlens must hold integers"),
    (dict(cache_seqlens=np.array([9, 20])), ValueError, r"cache_seqlens must have shape \(B,\)"),
    (dict(num_splits=0), ValueError, "num_splits must be at least 1"),
    (dict(num_splits=2.0), TypeError, "num_splits must be an int"),
    (dict(block_size=4), ValueError, "block_size applies to a contiguous cache"),
    (dict(q=np.zeros((3, 3, 2, 8))), ValueError, "H_q = 3 must be a multiple"),
    (dict(q=np.zeros((3, 8, 2, 5))), ValueError, "k_cache's head dimension"),
    (dict(q=np.zeros((3, 8, 8))), ValueError, r"q must have shape \(B, H_q, N_new, d\)"),
    (dict(q=np.full((3, 8, 2, 8), np.nan)), ValueError, "q contains NaN"),
    (dict(q=np.zeros((3, 8, 2, 8), np.float32)), TypeError, "share one dtype"),
    (dict(v_cache=np.zeros((17, 2, 3, 6))), ValueError, "v_cache must match k_cache"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_bad_decode_arguments_are_refused_by_name(changes, error, message):
    with pytest.raises(error, match=message):
        fa2edu.decode_attention(**_bad(**changes))


def test_bad_contiguous_cache_arguments_are_refused_by_name():
    c = _paged_case()
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 21 exceeds the cache's N_max = 20"):
        fa2edu.decode_attention(c["q"], c["k_flat"], c["v_flat"], np.array([0, 9, 21]))
    with pytest.raises(ValueError, match="a contiguous k_cache must have q's batch size"):
        fa2edu.decode_attention(c["q"], c["k_flat"][:2], c["v_flat"][:2], np.array([0, 9, 20]))
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        fa2edu.decode_attention(c["q"], c["k_flat"], c["v_flat"], c["cache_seqlens"], block_size=0)


def test_unused_block_table_entries_are_never_read():
    """Entries past a sequence's pages may hold anything (here −1 and huge ids): same result, no error."""
    c = _paged_case()
    table = c["block_table"].copy()
    table[0, :] = -1                                  # sequence 0 is empty
    table[1, 3:] = [10**9, -5]                        # sequence 1 uses 3 pages of 4 keys (n = 9)
    expected = fa2edu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"])
    got = fa2edu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], table)
    np.testing.assert_array_equal(got.O, expected.O)


def test_index_dtype_error_is_both_value_and_type_error():
    assert issubclass(IndexDtypeError, ValueError) and issubclass(IndexDtypeError, TypeError)


# -- varlen_attention ----------------------------------------------------------------------------------------------

@given(packed_batches())
def test_varlen_matches_oracle_per_sequence(case):
    res = fa2edu.varlen_attention(case["q"], case["k"], case["v"], case["cu_seqlens_q"], case["cu_seqlens_k"],
                                  causal=case["causal"], block_sizes=case["block_sizes"])
    H_q, total_q, _ = case["q"].shape
    assert res.O.shape == (H_q, total_q, case["v"].shape[-1]) and res.L.shape == (H_q, total_q)
    cu_q, cu_k = case["cu_seqlens_q"], case["cu_seqlens_k"]
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:
            np.testing.assert_array_equal(res.O[:, rows], 0.0)
            assert np.isposinf(res.L[:, rows]).all()
            continue
        O_ref, L_ref = fa2edu.attention_reference(case["q"][:, rows], case["k"][:, keys], case["v"][:, keys],
                                                  causal=case["causal"])
        assert_close_to_oracle(res.O[:, rows], O_ref, f"O of sequence {b}")
        assert_close_to_oracle(res.L[:, rows], L_ref, f"L of sequence {b}")


def _fa2_forward_io(n_q, n_k, d, d_v, B_r):
    """FA2 Alg. 1's traffic per head without a mask: reads n_q·d + T_r·n_k·(d + d_v), writes n_q·(d_v + 1).
    A sequence with no key loads nothing and writes O = 0, L = +inf."""
    if n_q == 0:
        return 0, 0
    if n_k == 0:
        return 0, n_q * (d_v + 1)
    T_r = -(-n_q // B_r)
    return n_q * d + T_r * n_k * (d + d_v), n_q * (d_v + 1)


@pytest.mark.parametrize("n_q, n_k", [([5, 0, 12, 3], [7, 4, 12, 0]), ([8, 8, 8], [8, 8, 8]), ([1, 30], [1, 30])])
def test_varlen_ledger_is_fa2_per_sequence_and_saves_the_padding(n_q, n_k):
    d, d_v, block_sizes = 4, 3, (4, 3)
    rng = np.random.default_rng(1)
    cu_q, cu_k = np.cumsum([0] + n_q), np.cumsum([0] + n_k)
    q = rng.standard_normal((2, cu_q[-1], d))
    k, v = rng.standard_normal((1, cu_k[-1], d)), rng.standard_normal((1, cu_k[-1], d_v))
    hbm = HBM()
    fa2edu.varlen_attention(q, k, v, cu_q, cu_k, block_sizes=block_sizes, hbm=hbm)
    forms = [_fa2_forward_io(a, b, d, d_v, block_sizes[0]) for a, b in zip(n_q, n_k)]
    assert hbm.reads == sum(r for r, _ in forms) and hbm.writes == sum(w for _, w in forms)
    padded = fa2edu.padded_batch_io(cu_q, cu_k, d, d_v, block_sizes=block_sizes)
    r, w = _fa2_forward_io(max(n_q), max(n_k), d, d_v, block_sizes[0])
    assert (padded.reads, padded.writes) == (len(n_q) * r, len(n_q) * w)
    assert padded.total == padded.reads + padded.writes
    assert (padded.N_q_max, padded.N_k_max) == (max(n_q), max(n_k))
    if len(set(n_q)) == 1 and len(set(n_k)) == 1:
        assert hbm.total == padded.total                          # nothing to save without padding
    else:
        assert hbm.total < padded.total


def test_varlen_causal_ledger_never_exceeds_the_padded_batch():
    cu = np.array([0, 3, 3, 20, 26])
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 26, 4)) for _ in range(3))
    hbm = HBM()
    fa2edu.varlen_attention(q, k, v, cu, cu, causal=True, block_sizes=(4, 4), hbm=hbm)
    padded = fa2edu.padded_batch_io(cu, cu, 4, causal=True, block_sizes=(4, 4))
    assert 0 < hbm.total < padded.total


@pytest.mark.parametrize("cu_q, cu_k, error, message", [
    ([0, 5, 3, 8], [0, 2, 4, 6], ValueError, r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 5"),
    ([0, 3, 8], [0, 4, 2], ValueError, "cu_seqlens_k must be non-decreasing"),
    ([1, 3, 8], [0, 2, 6], ValueError, "cu_seqlens_q must start at 0"),
    ([0, 3, 7], [0, 2, 6], ValueError, "cu_seqlens_q must end at the packed length 8"),
    ([0, 8], [0, 2, 6], ValueError, "the same B sequences"),
    ([0.0, 3.0, 8.0], [0, 2, 6], ValueError, "cu_seqlens_q must hold integers"),
    ([[0, 3, 8]], [0, 2, 6], ValueError, "cu_seqlens_q must have 1 axis"),
    ([], [0, 2, 6], ValueError, "cu_seqlens_q must have B"),
])
def test_bad_offsets_are_refused_by_name(cu_q, cu_k, error, message):
    q, k, v = np.zeros((2, 8, 4)), np.zeros((1, 6, 4)), np.zeros((1, 6, 4))
    with pytest.raises(error, match=message):
        fa2edu.varlen_attention(q, k, v, np.array(cu_q) if cu_q else np.array([], int), np.array(cu_k))


def test_bad_varlen_arrays_are_refused_by_name():
    cu = np.array([0, 3])
    with pytest.raises(ValueError, match="H_q = 3 must be a multiple"):
        fa2edu.varlen_attention(np.zeros((3, 3, 4)), np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), cu, cu)
    with pytest.raises(ValueError, match=r"q must have shape \(H_q, total_q, d\)"):
        fa2edu.varlen_attention(np.zeros((1, 1, 3, 4)), np.zeros((1, 3, 4)), np.zeros((1, 3, 4)), cu, cu)
    with pytest.raises(ValueError, match="M = 8 is too small"):
        fa2edu.varlen_attention(np.zeros((1, 0, 4)), np.zeros((1, 3, 4)), np.zeros((1, 3, 4)),
                                np.array([0, 0]), cu, M=8)
    with pytest.raises(TypeError, match="share one dtype"):
        fa2edu.varlen_attention(np.zeros((1, 3, 4)), np.zeros((1, 3, 4), np.float32), np.zeros((1, 3, 4)), cu, cu)


def test_check_cu_seqlens_accepts_empty_sequences():
    np.testing.assert_array_equal(check_cu_seqlens([0, 0, 3, 3], "cu", 3), [0, 0, 3, 3])
