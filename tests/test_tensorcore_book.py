"""benchmarks.tensorcore_book: what chapter 14 reads from the committed tensor-core run, checked.

Two kinds of test: properties of the committed H100 run that the chapter relies on (every rung and SDPA at every
N, TFLOP/s consistent with the times, the tables' arithmetic), and the helpers on small synthetic files whose
answers are known (missing or duplicated records, the target verdicts, the sanitizer log's error classes).
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import tensorcore_book as tcb


@pytest.fixture(scope="module")
def run():
    return tcb.load()


def _write(tmp_path, records, ceiling=500.0):
    path = tmp_path / "tensorcore.json"
    path.write_text(json.dumps({"header": {"device": "Test GPU", "date": "2030-01-02T03:04:05+00:00"},
                                "mma_ceiling": {"tflops": ceiling}, "records": records}))
    return path


def _rec(impl, N, tflops, d=64, dtype="float16", causal=False, batch=2, heads=4):
    flops = tcb.forward_flops(batch, heads, N, d, causal)
    return dict(impl=impl, dtype=dtype, causal=causal, d=d, N=N, batch=batch, heads=heads,
                ms=flops / tflops / 1e9, tflops=tflops, status="ok")


def test_the_committed_run_has_what_the_chapter_plots(run):
    assert run.device and run.date[:4].isdigit() and run.ceiling > 0
    for impl in (*tcb.RUNGS, tcb.BASELINE):
        for d in (64, 128):
            Ns, values = tcb.series(run, impl, d)
            assert Ns == sorted(Ns) and len(Ns) >= 3, (impl, d, Ns)
            assert all(0 < v < run.ceiling * 1.7 for v in values)
    for row in tcb.pair_table(run):
        assert row.dtype in ("float16", "bfloat16")


def test_tflops_agree_with_the_times(run):
    """Each record's TFLOP/s is the paper's FLOP count over its time (causal halves the count)."""
    for r in run.records:
        expected = tcb.forward_flops(r["batch"], r["heads"], r["N"], r["d"], r["causal"]) / r["ms"] / 1e9
        assert math.isclose(r["tflops"], expected, rel_tol=1e-6), r


def test_ladder_table_arithmetic(run):
    rows = tcb.ladder_table(run, N=4096)
    assert [row.impl for row in rows] == list(tcb.RUNGS) * 2
    for d in (64, 128):
        mine = [row for row in rows if row.d == d]
        assert mine[0].gain is None
        for low, high in zip(mine, mine[1:]):
            assert math.isclose(high.gain, high.tflops / low.tflops)
        sdpa = tcb.tflops(run, tcb.BASELINE, d, 4096)
        assert all(math.isclose(row.of_sdpa * sdpa, row.tflops) for row in mine)
        assert all(math.isclose(row.of_ceiling * run.ceiling, row.tflops) for row in mine)


def test_record_errors_name_the_missing_or_duplicated_record(tmp_path):
    path = _write(tmp_path, [_rec("v5", 1024, 10.0), _rec("v5", 1024, 11.0), _rec("v5", 2048, 12.0)])
    run = tcb.load(path)
    assert run.device == "Test GPU" and run.date == "2030-01-02" and run.ceiling == 500.0
    with pytest.raises(ValueError, match="2 records"):
        tcb.tflops(run, "v5", 64, 1024)
    with pytest.raises(KeyError, match="N=4096"):
        tcb.tflops(run, "v5", 64, 4096)
    assert tcb.tflops(run, "v5", 64, 2048) == 12.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"records": [], "header": {}}))
    with pytest.raises(ValueError, match="mma_ceiling"):
        tcb.load(bad)
    incomplete = _write(tmp_path, [{"impl": "v5"}])
    with pytest.raises(ValueError, match="record 0 lacks"):
        tcb.load(incomplete)


def test_targets_and_pairs_on_known_numbers(tmp_path):
    records = [_rec("v5", 2048, 200.0), _rec(tcb.BASELINE, 2048, 300.0),
               _rec("v5", 4096, 160.0), _rec(tcb.BASELINE, 4096, 400.0),      # 160 ≥ 150, 0.4 < 0.5
               _rec("v5", 8192, 140.0), _rec(tcb.BASELINE, 8192, 200.0),      # 140 < 150, 0.7 ≥ 0.5
               _rec("v5", 8192, 50.0, causal=True)]                           # no baseline: left out
    run = tcb.load(_write(tmp_path, records))
    checks = tcb.targets(run)
    assert [(c.N, c.meets_tflops, c.meets_ratio) for c in checks] == [(4096, True, False), (8192, False, True)]
    assert [row.N for row in tcb.pair_table(run)] == [2048, 4096, 8192]
    assert [row.N for row in tcb.pair_table(run, N=4096)] == [4096]
    speed = tcb.causal_speedup(run, "v5", 64, 8192)
    expected = tcb.record(run, "v5", 64, 8192)["ms"] / tcb.record(run, "v5", 64, 8192, causal=True)["ms"]
    assert math.isclose(speed, expected)


def test_as_text_aligns_and_formats():
    text = tcb.as_text([tcb.PairRow("float16", True, 64, 4096, 1.234, 10.0, 0.1234)], digits=1)
    header, line = text.splitlines()
    assert len(header) == len(line)
    assert line.split() == ["float16", "yes", "64", "4096", "1.2", "10.0", "0.1"]
    assert tcb.as_text([]) == "(no rows)"


def test_rung_headers_quote_prediction_and_measurement():
    for version in tcb.RUNGS:
        header = tcb.rung_header(version)
        assert header["title"].startswith(f"Tensor-core FA2 forward, {version}")
        assert header["prediction"].startswith("**Prediction")
        assert header["measured"].startswith("**Measured")
    assert tcb.rung_header("v5")["limits"].startswith("**What limits")
    with pytest.raises(ValueError, match="version"):
        tcb.rung_header("v9")


def test_sanitizer_report_tells_api_errors_from_kernel_errors(tmp_path):
    log = tmp_path / "memcheck.log"
    log.write_text("\n".join([
        "========= COMPUTE-SANITIZER",
        '========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
        "to cuGetProcAddress_v2.",
        "========= Invalid __shared__ read of size 4 bytes",
        "v1 torch.float16 d=64 causal=False: max error 2.91e-04 ok",
        "v2 torch.float16 d=64 causal=False: max error 2.91e-04 FAILED",
        "========= ERROR SUMMARY: 2 errors",
    ]))
    report = tcb.sanitizer_report(log)
    assert report == tcb.SanitizerReport(1, 2, {"cuGetProcAddress_v2": 1}, 1)
    committed = tcb.sanitizer_report()
    assert committed.errors_reported == sum(committed.api_errors.values()) + committed.kernel_errors
    assert committed.cases_ok > 0


def test_gpu_test_counts_reads_the_committed_log():
    counts = tcb.gpu_test_counts()
    assert counts["passed"] > 0 and counts.get("failed", 0) == 0 and counts["seconds"] > 0
