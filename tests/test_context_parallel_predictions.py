"""The committed multi-GPU predictions are what the simulator says (and say what the chapter claims)."""

import json
from pathlib import Path

import pytest

from benchmarks.context_parallel_predictions import predictions

COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks/results/predictions/ring_predictions.json"


def test_zigzag_balances_and_strong_scaling_halves_the_time():
    recs = {(r["scaling"], r["layout"], r["world_size"]): r for r in predictions()}
    for W in (2, 4, 8):
        assert max(recs["strong", "zigzag", W]["idle_fractions"]) < 1e-9
        assert max(recs["strong", "contiguous", W]["idle_fractions"]) > 0.5
        ratio = recs["strong", "zigzag", W // 2]["predicted_ms"] / recs["strong", "zigzag", W]["predicted_ms"]
        assert ratio == pytest.approx(2.0, rel=0.05)


def test_committed_file_matches_the_simulator():
    committed = json.loads(COMMITTED.read_text())["records"]
    fresh = predictions()
    assert [(r["scaling"], r["layout"], r["world_size"]) for r in committed] == \
        [(r["scaling"], r["layout"], r["world_size"]) for r in fresh]
    for a, b in zip(committed, fresh):
        assert a["predicted_ms"] == pytest.approx(b["predicted_ms"], rel=1e-9)


TRAINING = COMMITTED.parent / "ring_predictions_h200_training.json"


def test_training_predictions_committed_before_the_run_match_the_simulator():
    """ring_predictions_h200_training.json (issue 39) is what the simulator says with the rates read from the
    committed H200 results, for every (pass, dtype, scaling, layout, W)."""
    from benchmarks.context_parallel_predictions import TRAINING as CONFIG
    from benchmarks.context_parallel_predictions import measured_rates, training_predictions
    committed = json.loads(TRAINING.read_text())
    rates = measured_rates()
    assert committed["rates"]["link"] == rates["link"] and committed["rates"]["backward"] == rates["backward"]
    fresh = training_predictions(rates)
    key = ("pass", "dtype", "scaling", "layout", "world_size", "N")
    assert [tuple(r[k] for k in key) for r in committed["records"]] == [tuple(r[k] for k in key) for r in fresh]
    for a, b in zip(committed["records"], fresh):
        assert a["predicted_rank_ms"] == pytest.approx(b["predicted_rank_ms"], rel=1e-9)
    n = len(CONFIG["passes"]) * len(CONFIG["dtypes"]) * 2 * 2 * len(CONFIG["world_sizes"])
    assert len(fresh) == n and {r["N_local"] for r in fresh if r["scaling"] == "weak"} == {32768}


def test_training_predictions_zigzag_balances_and_scales():
    """Zigzag: every rank finishes together, forward and forward + backward; strong-scaling efficiency at W = 4
    is at least the issue's 0.85 in the model (the prediction a run is held to), below 1 for the backward (its
    last dK, dV transfer is exposed); contiguous rings wait for their last rank."""
    from benchmarks.context_parallel_predictions import training_predictions
    recs = {(r["pass"], r["dtype"], r["scaling"], r["layout"], r["world_size"]): r for r in training_predictions()}
    for pass_ in ("forward", "forward+backward"):
        for dtype in ("bfloat16", "float32"):
            for W in (2, 4, 8):
                zig = recs[pass_, dtype, "strong", "zigzag", W]
                assert max(zig["idle_fractions"]) < 1e-9
                assert max(zig["predicted_rank_ms"]) - min(zig["predicted_rank_ms"]) < 1e-9 * zig["predicted_ms"]
                assert max(recs[pass_, dtype, "strong", "contiguous", W]["idle_fractions"]) > 0.5
            eff = recs[pass_, dtype, "strong", "zigzag", 4]["strong_efficiency"]
            assert 0.85 <= eff <= 1.0 + 1e-9
    assert recs["forward+backward", "bfloat16", "strong", "zigzag", 4]["predicted_comm_ms"] > 0
    assert recs["forward+backward", "bfloat16", "strong", "zigzag", 4]["strong_efficiency"] < 1.0


EIGHT_FILE = COMMITTED.parent / "ring_predictions_h200_x8.json"


def test_eight_gpu_predictions_committed_before_the_run_match_the_simulator():
    """ring_predictions_h200_x8.json (issue 41: bf16, W = 1 … 8, strong N = 262144, weak N_local = 32768) is what
    the simulator says at the committed rates, and the model meets the issue's 0.8 efficiency at W = 8 (zigzag)."""
    from benchmarks.context_parallel_predictions import EIGHT, measured_rates, training_predictions
    committed = json.loads(EIGHT_FILE.read_text())
    fresh = training_predictions(measured_rates(), EIGHT)
    key = ("pass", "dtype", "scaling", "layout", "world_size", "N")
    assert [tuple(r[k] for k in key) for r in committed["records"]] == [tuple(r[k] for k in key) for r in fresh]
    for a, b in zip(committed["records"], fresh):
        assert a["predicted_rank_ms"] == pytest.approx(b["predicted_rank_ms"], rel=1e-9)
    strong = {(r["pass"], r["world_size"]): r for r in fresh if r["scaling"] == "strong" and r["layout"] == "zigzag"}
    assert {r["N"] for r in strong.values()} == {262144}
    for pass_ in ("forward", "forward+backward"):
        assert strong[pass_, 8]["strong_efficiency"] >= 0.8
