"""FlexAttention's HBM traffic: the executed ledger is the ground truth, the closed form equals it, and a sliding
window's traffic grows with N·w where causal attention's grows with N².

:func:`fa2edu.io.flex_visit_form` writes FA2's lines summed over the blocks a BlockMask visits; these tests prove it
equal to what :func:`fa2edu.flex.flex_attention` and its backward record on the ledger (ragged blocks, N_q ≠ N_k,
d_v ≠ d, classes that differ per batch entry and head, GQA), and :func:`fa2edu.io.simulate_flex_io`'s two methods
equal to each other, peak SRAM included. Then the book's claim: the skipped blocks are the saved traffic.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from strategies import flex_problems

from fa2edu import flex
from fa2edu.blocks import num_blocks
from fa2edu.io import IOReport, flex_visit_form, simulate_flex_io
from fa2edu.memory import HBM, SRAMOverflowError


@settings(max_examples=20)
@given(case=flex_problems(scores=("none", "alibi")))
def test_executed_ledger_equals_flex_visit_form(case):
    N_q, N_k, d, d_v = case.q.shape[2], case.k.shape[2], case.q.shape[3], case.v.shape[3]
    bm = flex.create_block_mask(case.mask_mod, case.B, case.H, N_q, N_k, BLOCK_SIZE=case.BLOCK_SIZE)
    fwd, bwd = HBM(), HBM()
    common = dict(score_mod=case.score_mod, block_mask=bm, scale=case.scale, enable_gqa=case.enable_gqa)
    O, L = flex.flex_attention(case.q, case.k, case.v, return_lse=True, hbm=fwd, **common)
    flex.flex_attention_backward(case.q, case.k, case.v, O, L, case.dO, hbm=bwd, **common)
    for pass_, hbm in (("forward", fwd), ("backward", bwd)):
        reads, writes = flex_visit_form(pass_, bm, d, d_v)
        assert hbm.reads == pytest.approx(reads, rel=1e-12, abs=1e-9), pass_
        assert hbm.writes == pytest.approx(writes, rel=1e-12, abs=1e-9), pass_
    assert bwd.init_writes == N_q * d                                      # dQ = 0 (Alg 2 line 3), kept apart


MASKS = {
    "none": None,
    "causal": flex.causal,
    "window": flex.sliding_window(9),
    "causal documents": flex.and_masks(flex.causal, flex.document(np.repeat([0, 1, 2], [20, 7, 23]))),
    "prefix": flex.prefix_lm(11),
}


SHAPES = [(50, 50, 8), (37, 50, (8, 5)), (50, 29, (3, 7))]


@pytest.mark.parametrize("name, N, N_k, block", [(name, *shape) for name in MASKS for shape in SHAPES
                                                 if name != "causal documents" or shape[0] == shape[1]])
def test_simulate_flex_io_executed_equals_closed_form(name, N, N_k, block):
    a = simulate_flex_io(MASKS[name], N, 6, N_k=N_k, BLOCK_SIZE=block, method="execute")
    b = simulate_flex_io(MASKS[name], N, 6, N_k=N_k, BLOCK_SIZE=block, method="closed_form")
    assert [r.method for r in a.rows] == ["execute"] * 2 and [r.method for r in b.rows] == ["closed_form"] * 2
    strip = lambda report: [{k: v for k, v in r.items() if k != "method"} for r in report.to_records()]
    assert strip(a) == strip(b)
    assert a.block_density == pytest.approx(b.block_density)


def test_per_program_classes_average_over_batch_and_heads():
    """A mask that differs per (b, h): each program's traffic is its own blocks; the report holds their mean."""
    def half_the_heads_see_nothing_past_16(b, h, q_idx, kv_idx):
        return (kv_idx < 16) | (h % 2 == 0)
    both = simulate_flex_io(half_the_heads_see_nothing_past_16, 40, 4, B=1, H=2, BLOCK_SIZE=8, method="execute")
    dense = simulate_flex_io(None, 40, 4, BLOCK_SIZE=8, method="execute")
    narrow = simulate_flex_io(lambda b, h, q_idx, kv_idx: kv_idx < 16, 40, 4, BLOCK_SIZE=8, method="execute")
    for pass_ in ("forward", "backward"):
        mean = (dense.row("flex", pass_).reads + narrow.row("flex", pass_).reads) / 2
        assert both.row("flex", pass_).reads == pytest.approx(mean)
        assert simulate_flex_io(half_the_heads_see_nothing_past_16, 40, 4, B=1, H=2, BLOCK_SIZE=8,
                                method="closed_form").row("flex", pass_).reads == pytest.approx(mean)


def window_blocks_per_row(N: int, w: int, B: int) -> np.ndarray:
    """Key blocks a row block of the window visits, from the index ranges alone: row block i (queries s … e)
    reaches keys max(0, s − w + 1) … e, which span floor(e/B) − floor(lo/B) + 1 blocks."""
    starts = np.arange(0, N, B)
    ends = np.minimum(starts + B, N) - 1
    lows = np.maximum(0, starts - w + 1)
    return ends // B - lows // B + 1


def test_sliding_window_traffic_grows_with_n_times_w_and_causal_with_n_squared():
    """w = 256 keys, BLOCK_SIZE 128, d = 16, executed on the ledger: doubling N doubles the window's reads (each
    row block visits 3 key blocks, whatever N), while causal reads grow towards 4× (T(T + 1)/2 blocks)."""
    w, block, d = 256, 128, 16
    window, causal = {}, {}
    for N in (1024, 2048, 4096, 8192):
        report = simulate_flex_io(flex.sliding_window(w), N, d, BLOCK_SIZE=block, method="execute")
        window[N] = report.row("flex", "forward").reads, report.row("flex", "backward").reads
        # The closed form from the index ranges alone: Q once, K and V over 3 blocks per row block.
        visited = window_blocks_per_row(N, w, block)
        assert window[N][0] == N * d + 2 * d * block * visited.sum()
        assert report.row("flex", "forward").blocks_visited == visited.sum()
        executed = N <= 2048
        report = simulate_flex_io(flex.causal, N, d, BLOCK_SIZE=block, method="execute" if executed else "closed_form")
        causal[N] = report.row("flex", "forward").reads, report.row("flex", "backward").reads
    for p in (0, 1):
        # Affine in N, w fixed: every query block beyond the first two costs the same (a constant slope per query).
        slopes = {(window[2 * N][p] - window[N][p]) / N for N in (1024, 2048, 4096)}
        assert len(slopes) == 1
        ratios = [window[2 * N][p] / window[N][p] for N in (1024, 2048, 4096)]
        assert all(2.0 <= r < 2.15 for r in ratios) and ratios == sorted(ratios, reverse=True)    # → 2
        ratios = [causal[2 * N][p] / causal[N][p] for N in (1024, 2048, 4096)]
        assert all(r > 3.3 for r in ratios) and ratios == sorted(ratios)            # → 4: quadratic in N
    assert causal[8192][0] / window[8192][0] > 8                                         # the window's saving
    # Linear in w as well: the part beyond Q's one pass grows with the blocks the window spans.
    wide = simulate_flex_io(flex.sliding_window(4 * w), 4096, d, BLOCK_SIZE=block, method="closed_form")
    extra = lambda reads: reads - 4096 * d
    assert extra(wide.row("flex", "forward").reads) / extra(window[4096][0]) == pytest.approx(
        window_blocks_per_row(4096, 4 * w, block).sum() / window_blocks_per_row(4096, w, block).sum())


def test_block_sparse_traffic_scales_with_the_density():
    """FA1 Proposition 4 for a block-table mask_mod: reads beyond Q's pass are ∝ s, the fraction of blocks kept."""
    N, B, d = 256, 16, 8
    T = num_blocks(N, B)
    rng = np.random.default_rng(0)
    extra = []
    for s in (0.25, 0.5, 1.0):
        table = rng.random((T, T)) < s
        mod = flex.bind(lambda b, h, q_idx, kv_idx, table: table[q_idx // B, kv_idx // B], table)
        report = simulate_flex_io(mod, N, d, BLOCK_SIZE=B, method="closed_form")
        assert report.block_density == pytest.approx(table.mean())
        extra.append((report.row("flex", "forward").reads - N * d) / (2 * d * N * T))      # K, V: T passes at s = 1
        assert extra[-1] == pytest.approx(table.mean())


def test_report_reads_like_simulate_io():
    report = simulate_flex_io(flex.sliding_window(16), 64, 8, BLOCK_SIZE=(16, 8))
    assert isinstance(report, IOReport) and [r.method for r in report.rows] == ["execute", "execute"]
    assert "mask_mod sliding_window(16)" in str(report) and "flex" in report._repr_html_()
    records = report.to_records()
    assert {r["pass"] for r in records} == {"forward", "backward"} and records[0]["block_sizes"] == (16, 8)
    assert report.to_bytes("float16")[0]["total_bytes"] == 2 * records[0]["total"]
    big = simulate_flex_io(flex.causal, 4096, 64, M=98_304)
    assert [r.method for r in big.rows] == ["closed_form", "closed_form"]
    assert simulate_flex_io(flex.causal, 64, 8, passes=("backward",)).rows[0].pass_ == "backward"
    bm = flex.create_block_mask(flex.causal, None, None, 30, 20, BLOCK_SIZE=4)
    assert simulate_flex_io(bm, 30, 4, N_k=20).row("flex", "forward").blocks_total == bm.T_r * bm.T_c


@pytest.mark.parametrize("call, error, match", [
    (lambda: simulate_flex_io("causal", 64, 8), TypeError, "mask must be a mask_mod"),
    (lambda: simulate_flex_io(flex.create_block_mask(None, None, None, 8, 8), 16, 4), ValueError,
     "the BlockMask was made for Q_LEN = 8"),
    (lambda: simulate_flex_io(flex.causal, 64, 8, M=64, BLOCK_SIZE=128), SRAMOverflowError, "need"),
    (lambda: simulate_flex_io(flex.causal, 64, 8, method="guess"), ValueError, "method must be one of"),
    (lambda: simulate_flex_io(flex.causal, 64, 8, passes="forward"), ValueError, "passes must be"),
    (lambda: simulate_flex_io(flex.causal, 0, 8), ValueError, "N must be at least 1"),
    (lambda: flex_visit_form("sideways", flex.create_block_mask(None, None, None, 8, 8), 4), ValueError, "pass_"),
    (lambda: flex_visit_form("forward", np.ones((2, 2), bool), 4), TypeError, "block_mask must be"),
])
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
