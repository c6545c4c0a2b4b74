"""benchmarks.harness.tensorcore_book: what chapter 14 reads from the committed tensor-core runs, checked.

Two kinds of test: properties of the committed H100 runs that the chapter relies on (every rung in the run that
first measured it, SDPA flash in every run, TFLOP/s consistent with the times, the tables' arithmetic, the
Nsight Compute numbers the rung headers quote), and the helpers on small synthetic files whose answers are known
(missing or duplicated records, the target verdicts, prediction verdicts, an Nsight Compute report, the
sanitizer log's error classes).
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.harness import tensorcore_book as tcb


@pytest.fixture(scope="module")
def run():
    return tcb.load()


@pytest.fixture(scope="module")
def runs():
    return tcb.load_runs()


def _write(tmp_path, records, ceiling=500.0, name="tensorcore.json", date="2030-01-02T03:04:05+00:00"):
    path = tmp_path / name
    path.write_text(json.dumps({"header": {"device": "Test GPU", "date": date},
                                "mma_ceiling": {"tflops": ceiling}, "records": records}))
    return path


def _rec(impl, N, tflops, d=64, dtype="float16", causal=False, batch=2, heads=4):
    flops = tcb.forward_flops(batch, heads, N, d, causal)
    return dict(impl=impl, dtype=dtype, causal=causal, d=d, N=N, batch=batch, heads=heads,
                ms=flops / tflops / 1e9, tflops=tflops, status="ok")


# -- the committed runs ---------------------------------------------------------------------------------------------

def test_the_committed_runs_have_what_the_chapter_plots(runs):
    assert tcb.NEWEST in runs and tcb.LADDER_RUN in runs and set(tcb.FIRST_RUN.values()) <= set(runs)
    assert len({r.device for r in runs.values()}) == 1
    assert set(tcb.RUNG_FILE.values()) == {tcb.LADDER_RUN}            # one run for the whole ladder
    assert runs[tcb.LADDER_RUN].impls == [*tcb.RUNGS, tcb.BASELINE]
    for rung in tcb.RUNGS:
        # each rung was first measured beside the rung below it
        Ns, _, name = tcb.rung_series(runs, rung, 64, files=tcb.FIRST_RUN)
        assert name == tcb.FIRST_RUN[rung] and len(Ns) >= 3, (rung, Ns)
        for d in (64, 128):
            Ns, values, name = tcb.rung_series(runs, rung, d)
            assert name == tcb.RUNG_FILE[rung] and Ns == sorted(Ns) and len(Ns) >= 3, (rung, d, Ns)
            ceiling = runs[name].ceiling
            assert all(0 < v < ceiling for v in values)
            # the rung below was timed in the same run (the gains of the chapter are within one run)
            below = tcb.rung_below(rung)
            if below:
                assert tcb.series(runs[name], below, d)[0] == Ns, (rung, below)
    for name, r in runs.items():            # every run measured SDPA flash beside its rungs
        for d in {rec["d"] for rec in r.records}:
            assert len(tcb.series(r, tcb.BASELINE, d)[0]) >= 3, (name, d)
    assert tcb.rung_series(runs, "v8", 64, causal=True)[0] == []          # the ladder run: non-causal
    assert len(tcb.series(runs[tcb.NEWEST], tcb.LATEST, 128, causal=True)[0]) >= 3


def test_tflops_agree_with_the_times(runs):
    """Each record's TFLOP/s is the paper's FLOP count over its time (causal halves the count)."""
    for r in (rec for run in runs.values() for rec in run.records):
        expected = tcb.forward_flops(r["batch"], r["heads"], r["N"], r["d"], r["causal"]) / r["ms"] / 1e9
        assert math.isclose(r["tflops"], expected, rel_tol=1e-6), r


def test_rung_points_are_same_run_ratios(runs):
    for rung in ("v1", "v7", "v11"):
        for p in tcb.rung_points(runs, rung, 128):
            run = runs[tcb.RUNG_FILE[rung]]
            assert p.tflops == tcb.tflops(run, rung, 128, p.N)
            assert math.isclose(p.of_sdpa * tcb.tflops(run, tcb.BASELINE, 128, p.N), p.tflops)
            if rung == "v1":
                assert p.gain is None
            else:
                assert math.isclose(p.gain * tcb.tflops(run, tcb.rung_below(rung), 128, p.N), p.tflops)
    with pytest.raises(ValueError, match="rung"):
        tcb.rung_below("v12")


def test_baseline_range_spans_every_run(runs):
    Ns, low, high = tcb.baseline_range(runs, 64)
    for i, N in enumerate(Ns):
        values = [tcb.tflops(r, tcb.BASELINE, 64, N) for r in runs.values()
                  if N in tcb.series(r, tcb.BASELINE, 64)[0]]
        assert (low[i], high[i]) == (min(values), max(values)) and len(values) >= 5


def test_cuda_core_series_is_chapter_10s_fastest_kernel():
    for causal in (False, True):
        Ns, values, device = tcb.cuda_core_series(128, causal)
        assert Ns == sorted(Ns) and len(Ns) >= 3 and device
        assert all(10 < v < 100 for v in values)       # fp32 CUDA cores: tens of TFLOP/s


def test_ladder_table_arithmetic(run):
    rows = tcb.ladder_table(run, N=4096)
    assert [row.impl for row in rows] == ["v1", "v2", "v3", "v4", "v5"] * 2
    for d in (64, 128):
        mine = [row for row in rows if row.d == d]
        assert mine[0].gain is None
        for low, high in zip(mine, mine[1:]):
            assert math.isclose(high.gain, high.tflops / low.tflops)
        sdpa = tcb.tflops(run, tcb.BASELINE, d, 4096)
        assert all(math.isclose(row.of_sdpa * sdpa, row.tflops) for row in mine)
        assert all(math.isclose(row.of_ceiling * run.ceiling, row.tflops) for row in mine)


def test_load_runs_skips_other_files_and_orders_by_date(tmp_path):
    _write(tmp_path, [_rec("v2", 1024, 5.0)], name="tensorcore_b.json", date="2030-01-01T00:00:00")
    _write(tmp_path, [_rec("v1", 1024, 5.0)], name="tensorcore_a.json", date="2030-01-02T00:00:00")
    (tmp_path / "tensorcore_tiles.json").write_text(json.dumps({"header": {}, "records": []}))
    assert list(tcb.load_runs(tmp_path)) == ["tensorcore_b.json", "tensorcore_a.json"]
    with pytest.raises(FileNotFoundError):
        tcb.load_runs(tmp_path / "nowhere")


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


# -- targets --------------------------------------------------------------------------------------------------------

def test_targets_and_pairs_on_known_numbers(tmp_path):
    records = [_rec("v11", 1024, 100.0), _rec(tcb.BASELINE, 1024, 300.0),     # 0.33 < 0.5; TFLOP/s n/a
               _rec("v11", 4096, 160.0), _rec(tcb.BASELINE, 4096, 400.0),     # 160 ≥ 150, 0.4 < 0.5
               _rec("v11", 8192, 140.0), _rec(tcb.BASELINE, 8192, 200.0),     # 140 < 150, 0.7 ≥ 0.5
               _rec("v11", 8192, 120.0, causal=True),                         # ms: 140 / 2 / 120 → 1.71×
               _rec(tcb.BASELINE, 8192, 100.0, causal=True),                  # SDPA: 200 / 2 / 100 → 1.0×
               _rec("v11", 512, 50.0)]                                        # no baseline: left out
    run = tcb.load(_write(tmp_path, records))
    checks = tcb.targets(run)
    assert [(c.N, c.causal, c.meets_tflops, c.meets_ratio) for c in checks] == [
        (1024, False, None, False), (4096, False, True, False), (8192, False, False, True),
        (8192, True, False, True)]
    assert [c.N for c in tcb.targets(run, ratio_min_N=4096) if c.meets_ratio is None] == [1024]
    assert [row.N for row in tcb.pair_table(run)] == [1024, 4096, 8192, 8192]
    assert [row.N for row in tcb.pair_table(run, N=4096)] == [4096]
    speed = tcb.causal_speedup(run, "v11", 64, 8192)
    assert math.isclose(speed, 2 * 120.0 / 140.0)
    (causal,) = tcb.causal_targets(run)
    assert causal.meets and math.isclose(causal.speedup, speed) and math.isclose(causal.sdpa_speedup, 1.0)
    assert not tcb.causal_targets(run, target=1.8)[0].meets


def test_the_committed_targets_as_the_chapter_states_them(runs):
    newest = runs[tcb.NEWEST]
    checks = tcb.targets(newest)
    assert len(checks) == 40
    rated = [c for c in checks if c.meets_tflops is not None]
    assert all(c.N >= tcb.TARGET_TFLOPS_MIN_N for c in rated) and len(rated) == 24
    # with the planned launch every forward target is met, N = 1024 included
    assert all(c.meets_tflops for c in rated) and all(c.meets_ratio for c in checks)
    assert len(tcb.causal_targets(newest)) == 4 and all(c.meets for c in tcb.causal_targets(newest))
    # with numba's ordinary launch, the same kernel missed half of SDPA flash at N = 1024 everywhere
    before = tcb.targets(runs["tensorcore_v11_numba_call.json"])
    assert all(c.meets_ratio is False for c in before if c.N == 1024)
    assert all(c.meets_ratio for c in before if c.N >= 4096)


def test_as_text_aligns_and_formats():
    text = tcb.as_text([tcb.PairRow("float16", True, 64, 4096, 1.234, 10.0, 0.1234)], digits=1)
    header, line = text.splitlines()
    assert len(header) == len(line)
    assert line.split() == ["float16", "yes", "64", "4096", "1.2", "10.0", "0.1"]
    assert tcb.as_text([]) == "(no rows)"


# -- headers and predictions ----------------------------------------------------------------------------------------

def test_rung_headers_quote_prediction_and_measurement():
    for version in tcb.RUNGS:
        header = tcb.rung_header(version)
        assert header["title"].startswith(f"Tensor-core FA2 forward, {version}:")
        assert header["prediction"].startswith("**Prediction")
        assert header["measured"].startswith("**Measured")
    assert tcb.rung_header("v5")["limits"].startswith("**What limits")
    with pytest.raises(ValueError, match="version"):
        tcb.rung_header("v12")


def test_every_rung_has_a_prediction_and_its_words_are_the_headers(runs):
    assert {p.rung for p in tcb.PREDICTIONS} == set(tcb.RUNGS)
    for p in tcb.PREDICTIONS:
        assert p.low <= p.high and p.unit in ("ratio", "TFLOP/s", "causal")
        assert p.against is None or p.unit == "ratio"
        assert len(p.words) <= 30
    # the ranges as the headers print them
    for p in tcb.PREDICTIONS:
        text = tcb.rung_header(p.rung)["prediction"]
        if p.unit == "TFLOP/s":
            assert f"{p.low:.0f}-{p.high:.0f}" in text, p
        elif p.words.startswith("+"):
            assert f"+{round(100 * (p.low - 1))}-{round(100 * (p.high - 1))} %" in text, p


def test_check_predictions_on_known_numbers(tmp_path):
    records = [_rec("v2", N, 2.0 * t, d=d) for N, t in ((4096, 10.0), (8192, 10.0), (16384, 10.0))
               for d in (64, 128)]
    records += [_rec("v1", N, 10.0, d=d) for N in (4096, 8192, 16384) for d in (64, 128)]
    runs = {"tensorcore.json": tcb.load(_write(tmp_path, records))}
    p = tcb.Prediction("v2", 64, 1.5, 2.5, "ratio", "1.5-2.5× v1", "v1")
    (row,) = tcb.check_predictions(runs, [p])
    assert (row.got_low, row.got_high, row.verdict, row.same_run) == (2.0, 2.0, "within", True)
    for low, high, verdict in ((2.1, 3.0, "below"), (1.2, 1.9, "above"), (1.995, 2.2, "within")):
        (row,) = tcb.check_predictions(runs, [p._replace(low=low, high=high)])
        assert row.verdict == verdict, (low, high)
    (row,) = tcb.check_predictions(runs, [tcb.Prediction("v1", 64, 9.0, 10.0, "TFLOP/s", "9-10")])
    assert row.verdict == "within" and row.got_low == 10.0
    with pytest.raises(ValueError, match="unit"):
        tcb.check_predictions(runs, [p._replace(unit="percent")])
    assert tcb._verdict(1.0, 2.0, 0.5, 1.5) == "partly"


def test_the_committed_predictions(runs):
    rows = tcb.check_predictions(runs)
    verdict = {(r.prediction.rung, r.prediction.d, r.prediction.causal, r.prediction.unit): r.verdict
               for r in rows}
    assert verdict[("v1", 64, False, "TFLOP/s")] == "below"
    assert verdict[("v4", 128, False, "ratio")] == "above"
    assert verdict[("v7", 64, False, "ratio")] == "below"
    assert [r.same_run for r in rows].count(False) == 2              # v11 causal against v9's run
    text = tcb.format_predictions(rows)
    assert len(text.splitlines()) == len(rows) + 1
    assert max(len(line) for line in text.splitlines()) <= 96
    assert "partly*" in text or "within*" in text


# -- Nsight Compute -------------------------------------------------------------------------------------------------

_NCU = """==PROF== Connected to process 1 (/usr/bin/python3)
[1] python3@127.0.0.1
  flash2_forward_v7::flash2_forward_tc_v7[v1,abc](Array<unsigned int, 4, C>, int) (32, 16, 4)x(128, 1, 1), CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Duration                         ms         3.38
    Block Size                                   128
    ----------------------- ----------- ------------

    OPT   This kernel executes 24576 fused and 36347985 non-fused FP64 instructions. By converting pairs of 12345
          non-fused instructions to their fused equivalent.
    ----- --------------------------------------------------------------------------------------------------------
    INF   ALU is the highest-utilized pipeline (30.1%) based on elapsed cycles in the workload.

    Section: Instruction Statistics
    ---------------------------------------- ----------- -------------
    Metric Name                              Metric Unit  Metric Value
    ---------------------------------------- ----------- -------------
    Executed Instructions                           inst 1,287,326,677
    Registers Per Thread             register/thread             255
    ---------------------------------------- ----------- -------------

    Section: Launch Statistics
    ---------------------------------------- ----------- -------------
    Metric Name                              Metric Unit  Metric Value
    ---------------------------------------- ----------- -------------
    Duration                         ms         9.99
    ---------------------------------------- ----------- -------------
  other_module::some_kernel[v2](int) (1, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Launch Statistics
    ---------------------------------------- ----------- -------------
    Metric Name                              Metric Unit  Metric Value
    ---------------------------------------- ----------- -------------
    Registers Per Thread             register/thread              16
    ---------------------------------------- ----------- -------------
"""


def test_parse_ncu_text_on_a_small_report():
    v7, other = tcb.parse_ncu_text(_NCU)
    assert (v7.rung, v7.grid, v7.block) == ("v7", (32, 16, 4), (128, 1, 1))
    assert v7.instructions == 1_287_326_677 and v7.registers == 255
    assert v7.metric("Block Size") == 128
    assert v7.metric("Duration", "GPU Speed Of Light Throughput") == 3.38
    with pytest.raises(ValueError, match="differs"):
        v7.metric("Duration")                       # two sections, two values
    with pytest.raises(KeyError, match="Spilling"):
        v7.metric("Local Memory Spilling Requests")
    assert v7.fused_nonfused("FP64") == (24576, 36347985)        # the advice paragraph is joined
    assert v7.fused_nonfused("FP32") == (0, 0)
    assert v7.busiest_pipe() == ("ALU", 30.1)
    assert (other.rung, other.registers, other.busiest_pipe()) == ("other_module", 16, None)
    assert tcb.parse_ncu_text("no kernels here") == []


def test_the_committed_ncu_reports_agree_with_the_headers():
    """The figures v7-v9's headers quote: 1 287 and 903 and 545 million instructions, 36 million FP64 in v7,
    ten then four instructions per MMA, the shared pipe busiest in v9; batch 4 × 16 heads at N = 4096."""
    ncu = tcb.ncu_report("ncu_tensorcore_v6_v7_d128.txt") | tcb.ncu_report("ncu_tensorcore_v8_v9_d128.txt")
    assert list(ncu) == ["v6", "v7", "v8", "v9"]
    assert [round(ncu[v].instructions / 1e6) for v in ("v7", "v8", "v9")] == [1287, 903, 545]
    assert round(sum(ncu["v7"].fused_nonfused("FP64")) / 1e6) == 36
    assert sum(ncu["v8"].fused_nonfused("FP64")) < 1e5
    assert round(tcb.instructions_per_mma(ncu["v7"], 4096, 128)) == 10
    assert round(tcb.instructions_per_mma(ncu["v9"], 4096, 128)) == 4
    assert ncu["v9"].busiest_pipe()[0] == "Shared"
    for k in ncu.values():
        assert k.grid[1:] == (2048 // 128, 16384 // 4096)             # heads, batch of the profiled call
        assert k.registers == (172 if k.rung == "v6" else 255)
        assert tcb.blocks_by_registers(k.registers) == k.metric("Block Limit Registers")
    with pytest.raises(FileNotFoundError):
        tcb.ncu_report("no_such_report.txt")


def test_mma_count_is_flops_over_one_instruction():
    assert tcb.MMA_FLOPS == 4096
    assert tcb.mma_count(4096, 128, 4, 16) == 4 * 4096 ** 2 * 128 * 64 / 4096
    assert tcb.mma_count(4096, 128, 4, 16, causal=True) == tcb.mma_count(4096, 128, 4, 16) / 2


# -- registers and the tile sweep -----------------------------------------------------------------------------------

def test_blocks_by_registers_steps():
    # 128 threads = 4 warps; per warp registers rounded up to 256
    assert [tcb.blocks_by_registers(r) for r in (128, 129, 168, 169, 255)] == [4, 3, 3, 2, 2]
    assert tcb.blocks_by_registers(32) == 16                          # the 64-warp limit
    assert tcb.blocks_by_registers(64, threads=256) == 4
    for bad in (0, 256):
        with pytest.raises(ValueError, match="registers"):
            tcb.blocks_by_registers(bad)
    with pytest.raises(ValueError, match="threads"):
        tcb.blocks_by_registers(64, threads=100)


def test_tile_sweep_rows():
    rows = tcb.tile_sweep()
    assert rows == sorted(rows) and {(r.d, r.B_c) for r in rows} == {(64, 32), (64, 64), (128, 32), (128, 64)}
    by = {(r.d, r.N, r.B_c): r for r in rows}
    assert by[(64, 4096, 32)].blocks == 3 and by[(64, 4096, 64)].blocks == 2
    assert by[(64, 4096, 32)].tflops > by[(64, 4096, 64)].tflops          # v10's choice at d = 64
    assert by[(128, 4096, 64)].tflops > by[(128, 4096, 32)].tflops        # and at d = 128
    assert all(0 < r.of_sdpa < 1 for r in rows)


def test_launch_overhead_rows():
    for name in ("tensorcore_launch_overhead.json", "tensorcore_launch_overhead_numba_call.json"):
        rows = tcb.launch_overhead(name)
        assert {r.impl for r in rows} == {"tensorcore", tcb.BASELINE}
        for r in rows:
            assert r.queued_ms <= r.single_ms and r.tflops_queued >= r.tflops_single and r.host_us > 0


def test_launch_overhead_before_and_after_the_planned_launch():
    """numba's ordinary call cost the host over 3x SDPA's; the planned launch costs less than SDPA's."""
    def host(name):
        return {(r.impl, r.d, r.N): r.host_us for r in tcb.launch_overhead(name)}
    before, after = host("tensorcore_launch_overhead_numba_call.json"), host("tensorcore_launch_overhead.json")
    for d in (64, 128):
        for N in (1024, 4096):
            assert before["tensorcore", d, N] > 3 * before[tcb.BASELINE, d, N]
            assert after["tensorcore", d, N] < after[tcb.BASELINE, d, N]
            assert after["tensorcore", d, N] < before["tensorcore", d, N] / 4


# -- logs -----------------------------------------------------------------------------------------------------------

def test_sanitizer_report_tells_api_errors_from_kernel_errors(tmp_path):
    log = tmp_path / "memcheck.log"
    log.write_text("\n".join([
        "========= COMPUTE-SANITIZER",
        '========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call '
        "to cuGetProcAddress_v2.",
        "========= Invalid __shared__ read of size 4 bytes",
        "v1 torch.float16 d=64 causal=False: max error 2.91e-04 ok",
        "v11 torch.float16 d=64 causal=False: max error 2.91e-04 ok",
        "v2 torch.float16 d=64 causal=False: max error 2.91e-04 FAILED",
        "========= ERROR SUMMARY: 2 errors",
    ]))
    report = tcb.sanitizer_report(log)
    assert report == tcb.SanitizerReport(2, 2, {"cuGetProcAddress_v2": 1}, 1, None)
    race = tmp_path / "racecheck.log"
    race.write_text("v7 torch.float16 d=64 causal=True: max error 1e-04 ok\n"
                    "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n")
    assert tcb.sanitizer_report(race) == tcb.SanitizerReport(1, None, {}, 0, 3)
    for name in ("sanitizer_tensorcore_memcheck.log", "sanitizer_tensorcore_v7_v11_memcheck.log"):
        committed = tcb.sanitizer_report(name)
        assert committed.errors_reported == sum(committed.api_errors.values()) + committed.kernel_errors
        assert committed.cases_ok > 0 and committed.kernel_errors == 0
    assert tcb.sanitizer_report("sanitizer_tensorcore_v7_v11_racecheck.log").hazards == 0


def test_gpu_test_counts_reads_the_committed_log():
    counts = tcb.gpu_test_counts()
    assert counts["passed"] > 0 and counts.get("failed", 0) == 0 and counts["seconds"] > 0


# -- the backward, split-K against split-Q, TF32 --------------------------------------------------------------------

@pytest.mark.parametrize("name, impls, grid", [
    (tcb.BACKWARD_RUN, {tcb.BACKWARD_RUN_RUNG}, [(dt, c) for dt in ("float16", "bfloat16") for c in (False, True)]),
    (tcb.BACKWARD_LADDER_RUN, set(tcb.BACKWARD_LADDER_RUNGS), [("float16", False)]),
    (tcb.BACKWARD_ORDER_RUN, {"v3", "v4"}, [("bfloat16", False), ("bfloat16", True)]),
    (tcb.BACKWARD_V5_RUN, {"v3", "v5"}, [(dt, c) for dt in ("float16", "bfloat16") for c in (False, True)]),
    (tcb.BACKWARD_V7_RUN, {"v5", "v7"}, [("bfloat16", False), ("bfloat16", True)])])
def test_backward_table_ratios_and_targets(name, impls, grid):
    for dtype, causal in grid:
        rows = tcb.backward_table(name, dtype=dtype, causal=causal)
        assert {r.impl for r in rows} == impls | {tcb.BASELINE}
        for r in rows:
            sdpa = next(b for b in rows if b.impl == tcb.BASELINE and (b.d, b.N) == (r.d, r.N))
            assert math.isclose(r.of_sdpa, r.tflops / sdpa.tflops) and 0 < r.max_rel_error < 1e-2
            if r.impl == tcb.BASELINE or r.N < tcb.TARGET_BWD_MIN_N:
                assert r.meets is None
            else:
                assert r.meets == (r.tflops >= tcb.TARGET_BWD_TFLOPS and r.of_sdpa >= tcb.TARGET_BWD_RATIO)
        assert all(r.meets for r in rows if r.impl != tcb.BASELINE and r.meets is not None
                   and r.impl not in ("v1", "v2"))


def test_backward_kernel_times_read_both_runs():
    rows = tcb.backward_kernel_times()
    assert {r.rung for r in rows} == {"v4", "v5"} and {r.d for r in rows} == {64, 128}
    for r in rows:
        assert 0 < r.key_block_ms + r.dq_ms < r.call_ms and r.cudnn_ms > 0
        assert all(0 < n <= 255 for n in r.registers)
    # v5 changes only the copies: at every tile shape both runs timed, both of its kernels are faster than v4's
    by = {(r.rung, r.d, r.warps, r.B_r): r for r in rows}
    pairs = [(by[k], by[("v5",) + k[1:]]) for k in by if k[0] == "v4" and ("v5",) + k[1:] in by]
    assert len(pairs) == 4
    assert all(new.key_block_ms < old.key_block_ms and new.dq_ms < old.dq_ms for old, new in pairs)


def test_backward_kernel_times_of_v5_v6_v7_on_one_machine():
    rows = tcb.backward_kernel_times(tcb.BACKWARD_V7_KERNEL_RUNS)
    assert {r.rung for r in rows} == {"v5", "v6", "v7"} and {r.d for r in rows} == {64, 128}
    by = {(r.rung, r.d, r.warps, r.B_r): r for r in rows}
    # v6 and v7 change only the key-block kernel: at each tile shape the dQ kernel (v5's) stays within noise,
    # and at the default shapes the key-block kernel is faster than v5's
    for (_rung, d, w, b), r in by.items():
        assert math.isclose(r.dq_ms, by["v5", d, w, b].dq_ms, rel_tol=0.05)
    for d, tile in ((64, (4, 64)), (128, (4, 32))):
        assert by[("v7", d) + tile].key_block_ms < by[("v6", d) + tile].key_block_ms * 1.05
        assert by[("v6", d) + tile].key_block_ms < by[("v5", d) + tile].key_block_ms


def test_sass_opcodes_reads_the_committed_summary_and_refuses_other_text(tmp_path):
    kernels = tcb.sass_opcodes("ncu_tensorcore_bwd_v5_d128_sass.txt")
    assert set(kernels) == {"flash2_backward_tc_v5", "flash2_backward_dq_tc_v5"}
    key_block = kernels["flash2_backward_tc_v5"]
    # the summary lists opcodes most executed first, and the key-block kernel issues more integer than MMA work
    assert list(key_block.values()) == sorted(key_block.values(), reverse=True)
    assert sum(n for op, n in key_block.items() if op in tcb.INTEGER_OPCODES) > key_block["HMMA"]
    (tmp_path / "x.txt").write_text("no sections here\n")
    with pytest.raises(ValueError, match="no '== kernel'"):
        tcb.sass_opcodes("x.txt", folder=tmp_path)


def test_backward_kernel_times_refuse_mixed_shapes(tmp_path):
    def run(N):
        return dict(header=dict(batch=4, heads=8, N=N, dtype="bfloat16", causal=True), records=[])
    (tmp_path / "a.json").write_text(json.dumps(run(4096)))
    (tmp_path / "b.json").write_text(json.dumps(run(2048)))
    with pytest.raises(ValueError, match="shape"):
        tcb.backward_kernel_times(("a.json", "b.json"), folder=tmp_path)


def test_backward_table_on_a_synthetic_file(tmp_path):
    def rec(impl, N, tflops):
        return dict(impl=impl, dtype="float16", causal=False, d=64, N=N, status="ok", tflops=tflops,
                    rel_error={"dQ": 1e-4, "dK": 3e-4, "dV": 2e-4})
    records = [rec("v1", 4096, 95.0), rec(tcb.BASELINE, 4096, 250.0), rec("v1", 1024, 10.0),
               rec(tcb.BASELINE, 1024, 100.0)]
    (tmp_path / "b.json").write_text(json.dumps({"header": {}, "records": records}))
    rows = tcb.backward_table("b.json", folder=tmp_path)
    assert [(r.impl, r.N) for r in rows] == [("v1", 1024), (tcb.BASELINE, 1024), ("v1", 4096), (tcb.BASELINE, 4096)]
    assert rows[0].meets is None and rows[2].meets is False and rows[2].max_rel_error == 3e-4   # 0.38× SDPA
    (tmp_path / "b.json").write_text(json.dumps({"header": {}, "records": records[:1]}))
    with pytest.raises(KeyError, match="SDPA flash"):
        tcb.backward_table("b.json", folder=tmp_path)
    (tmp_path / "b.json").write_text(json.dumps({"records": records}))
    with pytest.raises(ValueError, match="header"):
        tcb.backward_table("b.json", folder=tmp_path)


def test_partitioning_table_counts_the_exchange():
    rows = tcb.partitioning_table()
    for r in rows:
        if r.impl == tcb.BASELINE:
            assert r.kib_per_tile is None
            continue
        assert (r.exchange_kib == 0) == (r.impl == "split-q")
        # bytes per FLOP × TFLOP/s is the shared-memory rate
        assert math.isclose(r.bytes_per_flop * r.tflops, r.shared_tb_s, rel_tol=1e-6)
    by = {(r.impl, r.d, r.N): r for r in rows}
    for d in (64, 128):
        ratio = by["split-k", d, 4096].kib_per_tile / by["split-q", d, 4096].kib_per_tile
        assert 2.2 < ratio < 2.5 and by["split-k", d, 4096].of_split_q < 0.55


def test_precision_table_labels_and_errors():
    rows = tcb.precision_table()
    assert {r.precision for r in rows} == {"TF32", "fp32"}
    assert all(r.precision == "TF32" for r in rows if "tf32" in r.impl)
    assert all((r.tflops is None) == bool(r.note) for r in rows)
    fp32 = {r.d: r.error_f64 for r in rows if r.impl == "fast_fp32"}
    assert all(r.error_f64 > 50 * fp32[r.d] for r in rows if r.precision == "TF32")
    assert tcb.precision_label("sdpa_math_tf32") == "TF32" and tcb.precision_label("fast_fp32") == "fp32"


def test_gpu_test_progress_tells_a_cut_off_log(tmp_path):
    log = tmp_path / "cut.log"
    log.write_text("....F.s..\n....\n  warn(...)\n")
    assert tcb.gpu_test_progress(log) == {"passed": 11, "failed": 1, "errors": 0, "skipped": 1, "complete": False}
    log.write_text("....\n4 passed, 2 warnings in 3.50s\n")
    assert tcb.gpu_test_progress(log)["complete"] is True
    full = tcb.gpu_test_progress("gpu_tests_tensorcore_backward.log")
    assert full["passed"] > 0 and full["failed"] == 0 and full["complete"]
    assert tcb.sanitizer_report("sanitizer_tensorcore_bwd_v3_memcheck.log").cases_ok > 0
