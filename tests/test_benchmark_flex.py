"""benchmarks/flex.py without a GPU: its arithmetic (kept scores, model FLOPs, the ledger's prediction for causal
over a sliding window) and a dry run of the whole harness on the CPU at toy sizes, which writes the results file
(device, versions, date, every row, the summary) and the chapter's figure; ``--plot`` redraws it."""

from __future__ import annotations

import json

import numpy as np
import pytest

PNG = b"\x89PNG\r\n\x1a\n"


def test_kept_scores_and_model_flops():
    from benchmarks import flex as bench
    from fa2edu import flex
    N = 300
    assert bench.kept_scores(flex.causal, N, rows_per_chunk=64) == N * (N + 1) // 2
    assert bench.kept_scores(flex.sliding_window(10), N) == sum(min(i + 1, 10) for i in range(N))
    assert bench.kept_scores(None, N) == N * N
    assert bench.model_flops(100, 64, 2, 3, "forward") == 4.0 * 64 * 100 * 6
    assert bench.model_flops(100, 64, 2, 3, "forward_backward") == 3.5 * 4.0 * 64 * 100 * 6
    ids = bench.document_ids(4096)
    assert len(ids) == 4096 and len(np.unique(ids)) == 8 and np.all(np.diff(ids) >= 0)


def test_the_ledger_predicts_the_window_ratio_from_the_blocks_it_visits():
    from benchmarks import flex as bench
    N, B = 2048, 64
    predicted = bench.predicted_ratio(N, 64, B, window=256)
    T = N // B
    assert predicted["visited"]["causal"] == T * (T + 1) // 2
    # a row block of 64 queries sees keys back to 255 before its first: its diagonal block and the 4 before it
    assert predicted["visited"]["window"] == sum(min(i + 1, 5) for i in range(T))
    assert predicted["visited_blocks"] == pytest.approx(predicted["visited"]["causal"] / predicted["visited"]["window"])
    assert 1 < predicted["hbm_forward"] < predicted["visited_blocks"] + 1


def test_dry_run_writes_results_and_figure(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from benchmarks import flex as bench
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "flex_bf16.json").read_text())
    assert result["dry_run"] and result["device"] and result["date"] and result["versions"]["torch"]
    rows = result["rows"]
    assert {r["mod"] for r in rows} == set(bench.MODS)
    ours = [r for r in rows if r["impl"] == "fa2edu"]
    assert len(ours) == 2 * len(bench.MODS) and all(r["status"] == "ok" and r["tflops"] > 0 for r in ours)
    assert all(r["rel_error"] < 1e-4 for r in ours if r["pass_"] == "forward")       # float32 NumPy vs PyTorch
    sdpa = {r["mod"] for r in rows if r["impl"] == "sdpa"}
    assert sdpa == {"causal", "sliding_window"}
    assert {r["impl"] for r in rows} == {"fa2edu", "torch_flex", "sdpa"}
    ratios = result["summary"]["causal_over_window"]
    assert any(r["impl"] == "fa2edu" for r in ratios) and all(r["predicted_blocks"] >= 1 for r in ratios)
    figure = tmp_path / "flex_bf16.png"
    assert figure.read_bytes()[:8] == PNG
    assert "ledger predicts" in capsys.readouterr().out
    figure.unlink()
    assert bench.main(["--plot", str(tmp_path / "flex_bf16.json")]) == 0 and figure.read_bytes()[:8] == PNG


def test_bad_arguments_are_named():
    from benchmarks import flex as bench
    with pytest.raises(SystemExit):
        bench.parse_args(["--mods", "causal,nope"])
    with pytest.raises(ValueError, match="mod must be one of"):
        bench.make_mods("nope", 128, 2, "cpu")
