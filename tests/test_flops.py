"""FLOP accounting: executed matmul counts equal the papers' formulas, FA2 does fewer non-matmul FLOPs than FA1, the
FA2 benchmark model agrees with the code, and the roofline helper behaves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa2edu import hardware
from fa2edu.flops import count_all_flops, count_flops, model_flops
from fa2edu.io import block_visits


@given(st.integers(1, 80), st.integers(1, 80), st.integers(1, 12), st.integers(0, 9), st.integers(0, 9))
def test_matmul_flops_are_exact(N, N_k, d, extra_r, extra_c):
    """Forward: 2 matmuls (S = QKᵀ, PV) = 4·N·N_k·d; backward: standard 4 matmuls (8·N·N_k·d), flash 5 (10·N·N_k·d,
    S recomputed): FA2 Section 4.1's "backward 2.5× forward" for the flash algorithms. Ragged blocks included."""
    bs = (max(1, N // 8) + extra_r, max(1, N_k // 8) + extra_c)
    assert count_flops("standard", "forward", N, d, N_k=N_k).matmul == 4 * N * N_k * d
    assert count_flops("standard", "backward", N, d, N_k=N_k).matmul == 8 * N * N_k * d
    for algorithm in ("flash1", "flash2"):
        assert count_flops(algorithm, "forward", N, d, N_k=N_k, block_sizes=bs).matmul == 4 * N * N_k * d
        assert count_flops(algorithm, "backward", N, d, N_k=N_k, block_sizes=bs).matmul == 10 * N * N_k * d


@pytest.mark.parametrize("N, d, bs", [(64, 8, (8, 8)), (100, 16, (16, 7)), (256, 32, (32, 32))])
def test_causal_matmul_flops_count_visited_blocks(N, d, bs):
    """With causal skipping, a pass does its matmuls on the visited blocks only: about half as many for large N/B."""
    full = count_flops("flash2", "forward", N, d, block_sizes=bs).matmul
    causal = count_flops("flash2", "forward", N, d, block_sizes=bs, causal=True).matmul
    visits = block_visits(N, N, *bs, causal=True)
    # every visited block is a full (r_i × c_j) product, masked or not
    expected = 4 * d * sum(int(r) * int(c) for i, r in enumerate(visits.row_sizes)
                           for j, c in enumerate(visits.col_sizes) if j < visits.row_visits[i])
    assert causal == expected
    assert 0.5 <= causal / full < 0.5 + 1.0 / visits.T_r + 1e-12


@pytest.mark.parametrize("N, d, tiling", [(64, 8, {"M": 128}), (200, 16, {"M": 1024}),
                                          (512, 32, {"block_sizes": (64, 64)}), (128, 64, {"block_sizes": (64, 64)}),
                                          (100, 16, {"block_sizes": (7, 30)}), (33, 4, {"block_sizes": (40, 40)})])
@pytest.mark.parametrize("causal", [False, True])
def test_flash2_does_fewer_nonmatmul_flops_than_flash1(N, d, tiling, causal):
    """FA2 Section 3.1: no per-step rescale by diag(ℓ)⁻¹ (tweak 1), D precomputed once in the backward pass.
    The matmul FLOPs are the same: all the saving is in the expensive non-matmul kind.

    The tweaks save work per inner step, so the comparison is at equal block sizes (the M rule gives equal ones
    while ceil(M/4d) ≤ d). With larger M, FA1's K/V-outer rule and fa2edu's mirrored Q-outer rule for FA2 give
    transposed blocks, (d, B) against (B, d): FA2's forward then takes B/d times more, smaller steps per row, which
    cancels its per-step saving (see test_flash2_backward_saves_nonmatmul_flops_at_the_rules)."""
    counts = count_all_flops(N, d, causal=causal, **tiling)
    for pass_ in ("forward", "backward"):
        fa1, fa2 = counts[("flash1", pass_)], counts[("flash2", pass_)]
        assert fa2.nonmatmul < fa1.nonmatmul
        assert fa2.matmul == fa1.matmul


@pytest.mark.parametrize("N, d, M", [(512, 32, 8192), (256, 64, 98_304), (300, 16, 4000)])
def test_flash2_backward_saves_nonmatmul_flops_at_the_rules(N, d, M):
    """Both backward passes use the K/V-outer rule. FA2 computes D = rowsum(dO ∘ O) once (Alg. 2 line 4) instead of
    once per visited block (FA1 Alg. 4 line 19), and rebuilds P from one statistic, exp(S − L) (Alg. 2 line 11),
    instead of diag(ℓ)⁻¹ exp(S − m) (FA1 Alg. 4 line 13)."""
    counts = count_all_flops(N, d, M=M)
    fa1, fa2 = counts[("flash1", "backward")], counts[("flash2", "backward")]
    assert fa2.nonmatmul < fa1.nonmatmul


def test_flop_counter_splits_by_line():
    counter = count_flops("flash2", "forward", 40, 8, block_sizes=(8, 8))
    assert sum(row["matmul"] for row in counter.by_line.values()) == counter.matmul
    assert sum(row["nonmatmul"] for row in counter.by_line.values()) == counter.nonmatmul
    assert {"Alg 1 line 8", "Alg 1 line 10"} <= set(counter.by_line)


def test_model_flops_matches_fa2_paper_and_executed_counts():
    """FA2 Section 4.1: forward 4·N²·d·heads·batch, halved when causal, backward 2.5×; it is the matmul count."""
    assert model_flops(8, 16, 2048, 128) == 4 * 2048**2 * 128 * 16 * 8
    assert model_flops(8, 16, 2048, 128, causal=True) == model_flops(8, 16, 2048, 128) / 2
    assert model_flops(2, 3, 512, 64, pass_="backward") == 2.5 * model_flops(2, 3, 512, 64)
    assert model_flops(2, 3, 512, 64, pass_="forward+backward") == 3.5 * model_flops(2, 3, 512, 64)
    N, d = 48, 8
    assert model_flops(1, 1, N, d) == count_flops("flash2", "forward", N, d, block_sizes=(8, 8)).matmul
    assert model_flops(1, 1, N, d, pass_="backward") == \
        count_flops("flash2", "backward", N, d, block_sizes=(8, 8)).matmul


@pytest.mark.parametrize("kwargs, error", [
    ({"batch": 0, "heads": 1, "N": 8, "d": 8}, ValueError),
    ({"batch": 1, "heads": 1.5, "N": 8, "d": 8}, TypeError),
    ({"batch": 1, "heads": 1, "N": 8, "d": 8, "pass_": "sideways"}, ValueError),
    ({"batch": 1, "heads": 1, "N": 8, "d": 8, "causal": 1}, TypeError),
])
def test_model_flops_bad_arguments(kwargs, error):
    with pytest.raises(error):
        model_flops(**kwargs)


def test_count_flops_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        count_flops("flash3", "forward", 8, 4)
    with pytest.raises(ValueError, match="pass_"):
        count_flops("flash2", "sideways", 8, 4)
    with pytest.raises(ValueError, match="N must be at least 1"):
        count_flops("flash2", "forward", 0, 4)


# -- roofline -------------------------------------------------------------------------------------------------------

def test_roofline_time_takes_the_larger_of_compute_and_memory():
    a100 = hardware.device("A100-40GB")
    est = hardware.roofline_time(312e12, 0, "A100-40GB", "float16")
    assert est.seconds == pytest.approx(1.0) and est.bound == "compute"
    est = hardware.roofline_time(0, a100.hbm_bandwidth, "a100", "float16")
    assert est.seconds == pytest.approx(1.0) and est.bound == "memory"
    # the ridge point: FLOPs per byte where both times are equal
    est = hardware.roofline_time(1e12, 1e12 / 200.0, "a100")
    assert est.ridge == pytest.approx(312e12 / a100.hbm_bandwidth)
    assert est.compute_s == pytest.approx(1e12 / 312e12) and est.memory_s == pytest.approx(5e9 / 1.555e12)
    # fp32 on CUDA cores is the slower rate
    assert hardware.peak_flops("A100-40GB", "float32", tensor_cores=False) == a100.fp32
    with pytest.raises(ValueError, match="flops"):
        hardware.roofline_time(-1, 10, "a100")


def test_standard_attention_is_memory_bound_and_flash_is_not():
    """The book's point in roofline terms: at N = 4096, d = 64 standard attention's forward traffic takes longer
    than its matmuls on an A100, FlashAttention-2's does not."""
    from fa2edu.io import simulate_io

    report = simulate_io(4096, 64, hardware.M_for("A100-40GB", "float16"), passes=("forward",))
    flops = model_flops(1, 1, 4096, 64)
    fp16 = hardware.itemsize("float16")
    standard = hardware.roofline_time(flops, report.row("standard", "forward").total * fp16, "A100-40GB")
    flash2 = hardware.roofline_time(flops, report.row("flash2", "forward").total * fp16, "A100-40GB")
    assert standard.bound == "memory"
    assert flash2.bound == "compute"
    assert np.isclose(flash2.compute_s, standard.compute_s)
