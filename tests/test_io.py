"""IO accounting: the executed ledger is the ground truth, and the formulas equal it; Theorem 2 and Prop. 4 hold.

The formulas (:func:`fa2edu.io.closed_form`, :func:`fa2edu.io.visit_form`, :func:`fa2edu.io.peak_sram_form`) let
``simulate_io`` answer instantly at N = 65 536; these tests prove them equal to the executed ledger for ragged sizes,
N_q ≠ N_k, causal masks, block masks and arbitrary block sizes. Then the book's claims are checked on them: FA1
Theorem 2's exponents, FA2 < FA1, Proposition 4's proportionality to s, the SRAM bound, the one-second contract.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fa2edu
from fa2edu import hardware
from fa2edu.blocks import block_sizes_kv_outer, block_sizes_q_outer, num_blocks, sram_capacity
from fa2edu.flash1 import flash1_backward_working_set, flash1_forward_working_set
from fa2edu.flash2 import flash2_backward, flash2_backward_working_set, flash2_forward, flash2_forward_working_set
from fa2edu.io import (
    ALGORITHMS,
    PASSES,
    IOReport,
    block_rule,
    block_visits,
    closed_form,
    execute_io,
    simulate_io,
    visit_form,
)
from fa2edu.masks import BlockKind, classify_block, random_block_mask
from fa2edu.memory import HBM

PAIRS = [(a, p) for a in ALGORITHMS for p in PASSES]


def _counts(report: IOReport) -> list[tuple]:
    return [(r.algorithm, r.pass_, r.reads, r.writes, r.peak_sram, r.block_sizes, r.blocks_visited)
            for r in report.rows]


# -- the formulas equal the executed ledger ------------------------------------------------------------------------

@st.composite
def io_problems(draw):
    """Ragged sizes up to N ≈ 300 with block sizes that keep the executed runs to a few hundred blocks."""
    N_q = draw(st.integers(1, 300))
    N_k = draw(st.integers(1, 300)) if draw(st.booleans()) else N_q
    d = draw(st.integers(1, 9))
    B_r = draw(st.integers(max(1, N_q // 16), max(1, N_q // 16) + 12))
    B_c = draw(st.integers(max(1, N_k // 16), max(1, N_k // 16) + 12))
    causal = draw(st.booleans())
    block_mask = None
    if draw(st.booleans()):
        density = draw(st.sampled_from([0.0, 0.25, 0.5, 0.9]))
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        block_mask = rng.random((num_blocks(N_q, B_r), num_blocks(N_k, B_c))) < density
    return N_q, N_k, d, (B_r, B_c), causal, block_mask


@given(io_problems())
def test_executed_ledger_equals_visit_form(problem):
    """Reads, writes, peak SRAM and blocks visited: executed == formula, for every (algorithm, pass)."""
    N_q, N_k, d, bs, causal, block_mask = problem
    kwargs = dict(N_k=N_k, causal=causal, block_sizes=bs, block_sparsity=block_mask)
    executed = simulate_io(N_q, d, None, method="execute", **kwargs)
    formula = simulate_io(N_q, d, None, method="closed_form", **kwargs)
    assert [r.method for r in executed.rows] == ["execute"] * 6
    assert [r.method for r in formula.rows] == ["closed_form"] * 6
    assert _counts(executed) == _counts(formula)


@pytest.mark.parametrize("N, d, M", [(1, 4, 16), (37, 5, 61), (100, 8, 96), (129, 16, 700), (250, 3, 120),
                                     (203, 8, 257), (64, 16, 1024)])
def test_design_table_equals_executed_ledger(N, d, M):
    """the conventions' table (closed_form) with each pass's own block-size rule from M, exact for ragged N."""
    report = simulate_io(N, d, M, method="execute")
    for row in report.rows:
        B_r, B_c = row.block_sizes or (None, None)
        assert (row.reads, row.writes) == closed_form(row.algorithm, row.pass_, N, d, B_r, B_c), row
    # the block sizes are the rules of docs/conventions.md
    assert report.row("flash1", "forward").block_sizes == block_sizes_kv_outer(M, d)
    assert report.row("flash2", "forward").block_sizes == block_sizes_q_outer(M, d)
    assert report.row("flash2", "backward").block_sizes == block_sizes_kv_outer(M, d)


@pytest.mark.parametrize("N, d, M, causal", [(150, 8, 200, True), (97, 4, 64, False), (120, 6, 100, True)])
def test_executed_with_M_equals_formula(N, d, M, causal):
    """With M (not explicit block sizes) the SRAM has a capacity, and the peak still matches the formula."""
    assert _counts(simulate_io(N, d, M, causal, method="execute")) == \
        _counts(simulate_io(N, d, M, causal, method="closed_form"))


@pytest.mark.parametrize("N, N_k, d, bs", [(40, 40, 4, (5, 7)), (33, 50, 3, (4, 6)), (50, 17, 5, (6, 4))])
@pytest.mark.parametrize("causal", [False, True])
def test_flash2_redundant_loads_form(N, N_k, d, bs, causal):
    """Erratum 9's printed FA2 Alg. 2 (O_i and dQ_i also loaded at line 9) costs exactly 2d·Σ_visited r_i more."""
    rng = np.random.default_rng(0)
    Q, K, V, dO = (rng.standard_normal(s) for s in ((N, d), (N_k, d), (N_k, d), (N, d)))
    fwd = flash2_forward(Q, K, V, block_sizes=bs, causal=causal)
    visits = block_visits(N, N_k, *bs, causal=causal)
    for redundant in (False, True):
        hbm = HBM()
        flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes=bs, causal=causal, redundant_loads=redundant,
                        hbm=hbm)
        assert (hbm.reads, hbm.writes) == visit_form("flash2", "backward", d, visits, redundant_loads=redundant)


@given(st.integers(1, 200), st.integers(1, 200), st.integers(1, 30), st.integers(1, 30))
def test_causal_block_visits_match_classify_block(N_q, N_k, B_r, B_c):
    """block_visits' O(T_r + T_c) causal counts equal FA2 Section 3.1's classification block by block."""
    visits = block_visits(N_q, N_k, B_r, B_c, causal=True)
    grid = np.array([[classify_block(N_q, N_k, slice(i, min(i + B_r, N_q)), slice(j, min(j + B_c, N_k)), True)[0]
                      is not BlockKind.SKIP for j in range(0, N_k, B_c)] for i in range(0, N_q, B_r)])
    assert (visits.row_visits == grid.sum(axis=1)).all()
    assert (visits.col_visits == grid.sum(axis=0)).all()


def test_standard_count_ignores_causal_and_sparsity():
    """Standard attention materialises S and P whatever the mask: its rows do not change."""
    dense = simulate_io(96, 8, 256, method="execute", algorithms=("standard",))
    causal = simulate_io(96, 8, 256, True, method="execute", algorithms=("standard",))
    assert _counts(dense) == _counts(causal)
    sparse = simulate_io(4096, 64, 98_304, block_sparsity=0.3, algorithms=("standard",))
    assert _counts(sparse) == _counts(simulate_io(4096, 64, 98_304, algorithms=("standard",)))


# -- Theorem 2, FA2 vs FA1, Proposition 4 ----------------------------------------------------------------------------

def _slope(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


@pytest.mark.parametrize("algorithm", ["flash1", "flash2"])
@pytest.mark.parametrize("pass_", PASSES)
def test_theorem_2_flash_traffic_scales_as_N2_d2_over_M(algorithm, pass_):
    """FA1 Theorem 2 / Theorem 5: Θ(N²d²/M). Fitted exponents at N ≫ block sizes: N → 2, d → 2, M → −1 (±0.1)."""
    def total(N, d, M):
        return simulate_io(N, d, M, algorithms=(algorithm,), passes=(pass_,)).row(algorithm, pass_).total

    Ns = [8192, 16384, 32768, 65536]
    assert abs(_slope(Ns, [total(N, 64, 98_304) for N in Ns]) - 2.0) < 0.1
    ds = [32, 64, 128]
    assert abs(_slope(ds, [total(65536, d, 98_304) for d in ds]) - 2.0) < 0.1
    Ms = [2**14, 2**15, 2**16, 2**17]
    assert abs(_slope(Ms, [total(65536, 64, M) for M in Ms]) + 1.0) < 0.1


@pytest.mark.parametrize("pass_", PASSES)
def test_theorem_2_standard_traffic_is_N2_and_independent_of_M(pass_):
    def total(N, M):
        return simulate_io(N, 64, M, algorithms=("standard",), passes=(pass_,)).row("standard", pass_).total

    Ns = [8192, 16384, 32768, 65536]
    assert abs(_slope(Ns, [total(N, 98_304) for N in Ns]) - 2.0) < 0.05
    assert len({total(16384, M) for M in (256, 4096, 98_304, 1 << 20)}) == 1
    # and the executed ledger agrees on the independence from M
    executed = {simulate_io(64, 8, M, method="execute", algorithms=("standard",)).row("standard", pass_).total
                for M in (32, 100, 1000)}
    assert len(executed) == 1


@pytest.mark.parametrize("N, d, M", [(1024, 64, 98_304), (4096, 64, 98_304), (4096, 128, 98_304),
                                     (16384, 64, 49_152), (300, 16, 1024), (1000, 48, 4000)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash2_moves_less_than_flash1(N, d, M, causal):
    """FA2's Q-outer forward writes O_i, L_i once instead of O_i, ℓ_i, m_i on every inner step: always less.

    The backward passes share their loop order. FA2 saves O_i's load per visited block (d·Σ_visited r_i) but pays
    a pass of its own for D (2Nd + N): it wins exactly when a row block visits more than 2 + 1/d column blocks on
    average, so not for a causal N = 1024 with B_c = 384 (T_c = 3).
    """
    report = simulate_io(N, d, M, causal)
    assert report.row("flash2", "forward").total < report.row("flash1", "forward").total
    fa1, fa2 = report.row("flash1", "backward"), report.row("flash2", "backward")
    RV = block_visits(N, N, *fa2.block_sizes, causal=causal).row_elements
    assert fa2.total - fa1.total == 2 * N * d + N - d * RV
    assert (fa2.total < fa1.total) == (RV * d > 2 * N * d + N)


def test_flash_beats_standard_at_realistic_sizes():
    report = simulate_io(4096, 64, 98_304)
    for algorithm in ("flash1", "flash2"):
        for pass_ in PASSES:
            assert report.ratio(algorithm, pass_) > 5


@pytest.mark.parametrize("pass_", PASSES)
def test_proposition_4_block_sparse_traffic_scales_with_s(pass_):
    """FA1 Prop. 4: Θ(Nd + N²d²s/M). With full blocks the N²-term is exactly proportional to the density s."""
    N, d, M = 8192, 64, 16_384                      # B = 64 divides N: every block is full
    dense = simulate_io(N, d, M, algorithms=("flash1",), passes=(pass_,)).row("flash1", pass_)
    linear = 2 * N * d if pass_ == "forward" else 4 * N * d   # K, V once (and dK, dV once): the Nd term
    for s in (0.1, 0.3, 0.6):
        row = simulate_io(N, d, M, block_sparsity=s, algorithms=("flash1",), passes=(pass_,)).row("flash1", pass_)
        realised = row.blocks_visited / row.blocks_total
        assert realised == pytest.approx(s, abs=0.03)
        assert (row.total - linear) / (dense.total - linear) == pytest.approx(realised, rel=1e-12)


def test_block_sparse_executed_matches_formula_with_random_mask():
    bs = (6, 5)
    mask = random_block_mask(num_blocks(70, 6), num_blocks(70, 5), 0.4, seed=3)
    kwargs = dict(block_sizes=bs, block_sparsity=mask, algorithms=("flash1", "flash2"))
    assert _counts(simulate_io(70, 4, None, method="execute", **kwargs)) == \
        _counts(simulate_io(70, 4, None, method="closed_form", **kwargs))


@pytest.mark.parametrize("causal, sparsity", [(False, None), (True, 0.5)])
def test_simulate_io_reusing_the_forward_pass_changes_no_ledger(causal, sparsity):
    """simulate_io runs each backward pass on its own forward pass's result; execute_io recomputes it uncounted.
    Ledgers equal line by line, with block masks on different grids (FA2) or the same one (FA1)."""
    report = simulate_io(90, 8, 256, causal, method="execute", block_sparsity=sparsity, seed=5)
    for row in report.rows:
        mask = None
        if sparsity is not None and row.algorithm != "standard":
            mask = random_block_mask(num_blocks(90, row.block_sizes[0]), num_blocks(90, row.block_sizes[1]),
                                     sparsity, seed=5)
        alone = execute_io(row.algorithm, row.pass_, 90, 90, 8, 256, causal=causal, block_mask=mask, seed=5)
        assert (row, row.by_line) == (alone, alone.by_line)


def test_progress_bar_counts_every_ledger_element(monkeypatch, capsys):
    """The bar's length is the formulas' count and the executed ledger fills it exactly (on stderr only)."""
    bars = []

    class Recording(fa2edu.io.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(fa2edu.io, "tqdm", Recording)
    report = simulate_io(77, 8, 256, True, method="execute", progress=True)
    (bar,) = bars
    assert bar.n == bar.total == sum(row.total for row in report.rows)
    assert "executing" in capsys.readouterr().err
    simulate_io(77, 8, 256, True, method="execute")                  # progress=False by default: nothing shown
    assert bars[1].disable and capsys.readouterr().err == ""
    with pytest.raises(TypeError, match="progress must be a bool or None"):
        simulate_io(77, 8, 256, progress="yes")


# -- SRAM, speed, auto ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N, d, M", [(41, 4, 16), (41, 4, 17), (120, 8, 300), (64, 16, 64 * 12)])
def test_sram_peak_within_capacity(N, d, M):
    """Executed runs never exceed the SRAM of their M; the rule's working set is Θ(M) (here at most 5M)."""
    working_sets = {("flash1", "forward"): flash1_forward_working_set, ("flash1", "backward"):
                    flash1_backward_working_set, ("flash2", "forward"): flash2_forward_working_set,
                    ("flash2", "backward"): flash2_backward_working_set}
    report = simulate_io(N, d, M, True, method="execute", algorithms=("flash1", "flash2"))
    for row in report.rows:
        ws = working_sets[(row.algorithm, row.pass_)]
        capacity = sram_capacity(M, d, block_rule(row.algorithm, row.pass_), lambda br, bc, ws=ws: ws(br, bc, d))
        assert 0 < row.peak_sram <= capacity
        assert row.peak_sram <= 5 * M


@pytest.mark.parametrize("causal", [False, True])
def test_simulate_io_answers_the_big_case_within_a_second(causal):
    """the conventions' contract: simulate_io(65 536, 64, 98 304) in under a second (a generous margin here)."""
    start = time.perf_counter()
    report = simulate_io(65536, 64, 98_304, causal)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"simulate_io took {elapsed:.2f} s"
    assert len(report.rows) == 6
    assert {r.method for r in report.rows} == {"closed_form"}


def test_auto_executes_small_problems_and_uses_formulas_for_large_ones():
    assert {r.method for r in simulate_io(64, 8, 256).rows} == {"execute"}
    assert {r.method for r in simulate_io(4096, 64, 98_304).rows} == {"closed_form"}


# -- the report --------------------------------------------------------------------------------------------------

def test_report_records_bytes_and_display():
    report = simulate_io(256, 16, 1024, method="execute")
    records = report.to_records()
    assert len(records) == 6
    for rec, row in zip(records, report.rows):
        assert {"algorithm", "pass", "reads", "writes", "total", "block_sizes", "peak_sram", "method"} <= set(rec)
        assert rec["total"] == rec["reads"] + rec["writes"] == row.total
    in_bytes = report.to_bytes("float32", batch=3, heads=5)
    for rec, b in zip(records, in_bytes):
        assert b["total_bytes"] == rec["total"] * 4 * 3 * 5
        assert b["reads_bytes"] == rec["reads"] * 4 * 15 and b["writes_bytes"] == rec["writes"] * 4 * 15
    assert report.to_bytes()[0]["total_bytes"] == records[0]["total"] * 2          # float16, one program
    text = str(report)
    for algorithm in ALGORITHMS:
        assert algorithm in text
    assert f"{report.row('flash2', 'forward').total:,}" in text
    assert "<table>" in report._repr_html_()
    assert report.ratio("flash1", "forward") == report.row("standard", "forward").total / \
        report.row("flash1", "forward").total
    partial = simulate_io(256, 16, 1024, algorithms=("flash2",), passes=("forward",))
    with pytest.raises(KeyError):
        partial.row("flash1", "forward")
    with pytest.raises(ValueError, match="batch"):
        report.to_bytes("float16", batch=0)


def test_simulate_io_is_exported():
    assert fa2edu.simulate_io is simulate_io
    assert isinstance(fa2edu.simulate_io(8, 4, 16), fa2edu.IOReport)


# -- bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, error, match", [
    ((0, 64, 98_304), {}, ValueError, "N must be at least 1"),
    ((64, 0, 98_304), {}, ValueError, "d must be at least 1"),
    ((64.5, 64, 98_304), {}, TypeError, "N must be an int"),
    ((64, 64, 100), {}, ValueError, "M = 100 is too small"),
    ((64, 64, 1000.0), {}, TypeError, "M"),
    ((64, 8, None), {}, ValueError, "M .* is required"),
    ((64, 8, 256), {"N_k": 0}, ValueError, "N_k"),
    ((64, 8, 256), {"causal": "yes"}, TypeError, "causal"),
    ((64, 8, 256), {"method": "guess"}, ValueError, "method"),
    ((64, 8, 256), {"block_sparsity": 1.5}, ValueError, "block_sparsity"),
    ((64, 8, 256), {"block_sparsity": np.ones((2, 2), dtype=bool)}, ValueError, "block_sizes"),
    ((64, 8, 256), {"block_sizes": (0, 4)}, ValueError, "B_r"),
    ((64, 8, 256), {"algorithms": ("flash3",)}, ValueError, "algorithms"),
    ((64, 8, 256), {"block_sizes": (64, 64)}, ValueError, "SRAM"),
])
def test_bad_arguments_raise_clear_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        simulate_io(*args, **kwargs)


def test_closed_form_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        closed_form("flash3", "forward", 10, 4, 2, 2)
    with pytest.raises(ValueError, match="pass_"):
        closed_form("flash1", "sideways", 10, 4, 2, 2)
    with pytest.raises(ValueError, match="block sizes"):
        closed_form("flash1", "forward", 10, 4)


# -- hardware profiles (M in elements) -------------------------------------------------------------------------------

def test_hardware_conversions():
    assert hardware.M_for("A100-40GB", "float16") == 164 * 1024 // 2
    assert hardware.M_for("h100", "float32") == 228 * 1024 // 4
    assert hardware.elements(1000, "float16") == 500
    # simulate_io takes hardware's M directly
    M = hardware.M_for("T4", "float16")
    assert simulate_io(2048, 64, M).row("flash2", "forward").block_sizes == block_sizes_q_outer(M, 64)
    with pytest.raises(ValueError, match="unknown device"):
        hardware.device("Z80")
    with pytest.raises(TypeError, match="floating"):
        hardware.itemsize("int8")
