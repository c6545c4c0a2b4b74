"""The benchmark harness without a GPU: FLOP model, record schema and JSON writer, the timing protocol on a fake
device with a fake clock, argument parsing and the plan, and the plot script on a synthetic results file."""

import contextlib
import json
import math
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # benchmarks/ is a top-level package of the checkout, not an installed one
    sys.path.insert(0, ROOT)

from benchmarks import bench_attention as bench  # noqa: E402
from benchmarks.harness import results_io, timing  # noqa: E402
from benchmarks.harness.flop_model import model_flops, tflops  # noqa: E402

# ---------------------------------------------------------------------------------------------- FLOP model

def test_flop_model_is_the_fa2_papers():
    # FA2 Sec. 4.1: forward 4·N²·d·heads·batch; causal halves it; backward is 2.5× forward
    assert model_flops(2, 3, 1000, 64) == 4 * 1000**2 * 64 * 3 * 2
    assert model_flops(2, 3, 1000, 64, causal=True) == model_flops(2, 3, 1000, 64) / 2
    assert model_flops(2, 3, 1000, 64, pass_="backward") == 2.5 * model_flops(2, 3, 1000, 64)
    assert model_flops(2, 3, 1000, 64, True, "backward") == 2.5 * model_flops(2, 3, 1000, 64, True)


def test_flop_model_scaling_on_the_papers_grid():
    # batch × N fixed at 16k tokens, heads × d = 2048: FLOPs grow linearly in N, and d does not matter
    grid = {N: model_flops(16384 // N, 2048 // 64, N, 64) for N in (512, 1024, 2048, 4096, 8192, 16384)}
    for N in grid:
        assert grid[N] == pytest.approx(grid[512] * N / 512)
        assert model_flops(16384 // N, 2048 // 128, N, 128) == grid[N]
    assert model_flops(1, 1, 2048, 64) == 4 * model_flops(1, 1, 1024, 64)  # N² per (batch, head)


@pytest.mark.parametrize("kwargs, name", [
    (dict(batch=0, heads=1, N=8, d=8), "batch"), (dict(batch=1, heads=1.5, N=8, d=8), "heads"),
    (dict(batch=1, heads=1, N=-1, d=8), "N"), (dict(batch=1, heads=1, N=8, d=True), "d"),
    (dict(batch=1, heads=1, N=8, d=8, pass_="sideways"), "pass_")])
def test_flop_model_rejects_bad_input(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        model_flops(**kwargs)


def test_tflops():
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert tflops(4e9, 2.0) == pytest.approx(2.0)
    assert tflops(1e9, None) is None
    with pytest.raises(ValueError, match="ms"):
        tflops(1e9, 0.0)


# ---------------------------------------------------------------------------------------------- records, JSON

def _record(**overrides):
    fields = dict(impl="kg_flash2", pass_="forward", dtype="float32", batch=2, heads=32, N=8192, d=64,
                  causal=False, device="NVIDIA H100 80GB HBM3", ms=10.0, tflops=1.5, peak_mem_bytes=123456)
    fields.update(overrides)
    return results_io.make_record(**fields)


def test_record_has_the_issue_schema():
    record = _record(repeats=7)
    for key in ("impl", "pass", "dtype", "batch", "heads", "N", "d", "causal", "ms", "tflops", "peak_mem_bytes",
                "device", "date", "status", "error"):
        assert key in record
    assert record["pass"] == "forward" and record["status"] == "ok" and record["repeats"] == 7
    results_io.validate_record(record)


def test_record_rules():
    with pytest.raises(ValueError, match="ms and tflops"):
        _record(ms=None, tflops=None)
    with pytest.raises(ValueError, match="error message"):
        _record(status="skipped", ms=None, tflops=None)
    with pytest.raises(ValueError, match="status"):
        _record(status="fine")
    with pytest.raises(ValueError, match="clash"):
        _record(**{"pass": "backward"})  # an extra key may not overwrite a schema key
    skipped = _record(status="skipped", ms=None, tflops=None, error="out of memory: 40 GiB")
    results_io.validate_record(skipped)


@pytest.mark.parametrize("key, value, match", [
    ("N", 0, "N"), ("causal", 1, "causal"), ("pass", "fwd", "pass"), ("ms", None, "ms"), ("status", "?", "status")])
def test_validate_record_catches_bad_values(key, value, match):
    record = _record()
    record[key] = value
    with pytest.raises(ValueError, match=match):
        results_io.validate_record(record)
    del record[key]
    if key in results_io.REQUIRED_KEYS:  # 'status' may be absent: the issue's schema reads it as 'ok'
        with pytest.raises(ValueError, match="missing"):
            results_io.validate_record(record)


def test_write_and_load_round_trip(tmp_path):
    records = [_record(), _record(N=16384, status="skipped", ms=None, tflops=None, error="out of memory"),
               _record(status="wrong", ms=None, tflops=None, error="mismatch", rel_error=float("nan"))]
    header = {"device": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0"}, "date": results_io.utc_now()}
    path = results_io.write_results(str(tmp_path / "a" / "b.json"), header, records, summary={"n": 3})
    assert os.listdir(tmp_path / "a") == ["b.json"]  # the temporary file was renamed, not left behind
    loaded_header, loaded, summary = results_io.load_results(path)
    assert loaded_header == header and summary == {"n": 3}
    assert loaded[0] == records[0] and loaded[1] == records[1]
    assert loaded[2]["rel_error"] == "nan"  # strict JSON: a NaN is written as a string, never dropped
    json.loads(open(path).read())  # valid strict JSON
    with open(path, "w") as f:
        json.dump({"schema": 99, "records": []}, f)
    with pytest.raises(ValueError, match="schema"):
        results_io.load_results(path)


def test_write_refuses_an_invalid_record(tmp_path):
    bad = _record()
    del bad["device"]
    with pytest.raises(ValueError, match="device"):
        results_io.write_results(str(tmp_path / "x.json"), {}, [bad])
    assert not os.path.exists(tmp_path / "x.json")


def test_device_slug_and_path():
    assert results_io.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert results_io.device_slug(" NVIDIA H200 ") == "nvidia-h200"
    for bad in ("", "  ", "!!!", None):
        with pytest.raises(ValueError, match="name"):
            results_io.device_slug(bad)
    path = results_io.default_results_path("NVIDIA H200", "sweep", root="/r")
    assert path == os.path.join("/r", "nvidia-h200", "sweep.json")
    assert results_io.default_results_path("NVIDIA H200", "x").endswith(
        os.path.join("benchmarks", "results", "nvidia-h200", "x.json"))
    with pytest.raises(ValueError, match="name"):
        results_io.default_results_path("NVIDIA H200", "../escape")


# ---------------------------------------------------------------------------------------------- timing protocol

class FakeEvent:
    def __init__(self, device):
        self.device, self.t = device, None

    def record(self):
        self.t = self.device.now

    def elapsed_time(self, end):
        return end.t - self.t


class FakeDevice:
    """A device whose clock advances only when a fake kernel 'runs', with a byte-counting allocator."""

    def __init__(self, free=10**12):
        self.now, self.allocated, self.peak, self.free = 0.0, 0, 0, free
        self.poison = False

    def event(self):
        return FakeEvent(self)

    def synchronize(self):
        pass

    def alloc(self, n):
        if self.allocated + n > self.free:
            raise MemoryError("out of memory (fake)")
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def release(self, n):
        self.allocated -= n

    def memory_allocated(self):
        return self.allocated

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def max_memory_allocated(self):
        return self.peak

    def free_bytes(self):
        return self.free - self.allocated

    def empty_cache(self):
        pass

    def is_out_of_memory(self, exc):
        return isinstance(exc, MemoryError)

    @contextlib.contextmanager
    def poisoned(self):
        self.poison = True
        try:
            yield
        finally:
            self.poison = False


class FakeImpl:
    """make_call(k): input set k holds ``input_bytes``; each call allocates ``temp_bytes`` for a moment and
    takes ``ms(k, n)`` on the fake clock (n = the call's index), returning an output that says whether it ran
    poisoned. The first call of all is slow, as a JIT compilation would be."""

    def __init__(self, device, input_bytes=1000, temp_bytes=500, ms=lambda k, n: 2.0 + k, compile_ms=1e6):
        self.device, self.input_bytes, self.temp_bytes, self.ms, self.compile_ms = (
            device, input_bytes, temp_bytes, ms, compile_ms)
        self.calls = []

    def make_call(self, k):
        self.device.alloc(self.input_bytes)

        def call():
            n = len(self.calls)
            self.calls.append((k, self.device.poison))
            self.device.alloc(self.temp_bytes)
            self.device.now += self.ms(k, n) + (self.compile_ms if n == 0 else 0.0)
            self.device.release(self.temp_bytes)
            return {"O": self.device.poison}
        return call


def _ok_check(outputs):
    return True, {"rel_error": 1e-7}


def test_time_calls_times_only_the_timed_calls_and_rotates():
    device = FakeDevice()
    durations = {0: 1.0, 1: 2.0, 2: 3.0}
    log = []

    def make(k):
        def call():
            log.append(k)
            device.now += durations[k] + (1000.0 if len(log) <= 3 else 0.0)  # warm-up calls are slow
        return call
    times = timing.time_calls([make(0), make(1), make(2)], device, warmup=2, repeats=7)
    assert log == [0, 1, 2] + [0, 1, 2, 0, 1, 2, 0]  # every input set warmed once, then cycled
    assert times == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0]
    assert timing.summarize_ms(times)["ms"] == 2.0
    with pytest.raises(ValueError, match="calls"):
        timing.time_calls([], device, 1, 1)


def test_plan_repeats_and_pool_copies():
    assert timing.plan_repeats(10.0, 200.0, 3, 50) == 20
    assert timing.plan_repeats(1000.0, 200.0, 3, 50) == 3
    assert timing.plan_repeats(0.01, 200.0, 3, 50) == 50
    # sets of 40 MB rotate until they exceed 120 MB: 4 sets; a 400 MB set needs no rotation
    assert timing.pool_copies(40 * 2**20, 120 * 2**20, 8) == 4
    assert timing.pool_copies(400 * 2**20, 120 * 2**20, 8) == 1
    assert timing.pool_copies(1, 120 * 2**20, 8) == 8
    assert timing.pool_copies(40 * 2**20, 120 * 2**20, 8, free_bytes=100 * 2**20, headroom_bytes=30 * 2**20) == 2


def test_measure_ok_median_peak_pool_and_poison():
    device = FakeDevice()
    impl = FakeImpl(device, input_bytes=1000, temp_bytes=500, ms=lambda k, n: [4.0, 6.0, 5.0][k % 3])
    protocol = timing.Protocol(warmup=1, min_repeats=3, max_repeats=9, target_ms=45.0, max_call_ms=100.0,
                               pool_target_bytes=2500, max_pool=8)
    poisoned_outputs = []

    def check(outputs):
        poisoned_outputs.append(outputs["O"])
        return True, {"rel_error": 1e-7}
    out = timing.measure(impl.make_call, check, device, protocol, flops=5e9)
    assert out["status"] == "ok" and out["error"] is None
    assert poisoned_outputs == [True]  # the correctness call, and only it, ran poisoned
    assert [p for _, p in impl.calls].count(True) == 1
    assert out["pool"] == 3  # 3 × 1000 bytes > 2500
    assert out["repeats"] == 9  # 45 ms / 4 ms, at most 9
    # timed calls cycle 0, 1, 2 → 4, 6, 5 ms; median 5
    assert out["ms"] == 5.0 and out["tflops"] == pytest.approx(5e9 / 5e-3 / 1e12)
    assert out["peak_mem_bytes"] == 1000 + 500  # one input set and the call's temporaries
    assert out["rel_error"] == 1e-7
    uncounted = timing.measure(FakeImpl(device).make_call, _ok_check, device, protocol, 5e9, count_memory=False)
    assert uncounted["status"] == "ok" and uncounted["peak_mem_bytes"] is None


def test_measure_wrong_result_is_not_timed():
    device = FakeDevice()
    impl = FakeImpl(device)
    out = timing.measure(impl.make_call, lambda o: (False, {"rel_error": 0.5}), device, timing.Protocol(), 1e9)
    assert out["status"] == "wrong" and "0.5" in out["error"] and out["ms"] is None
    assert len(impl.calls) == 1


def test_measure_skips_a_call_slower_than_the_cap():
    device = FakeDevice()
    impl = FakeImpl(device, ms=lambda k, n: 5000.0)
    out = timing.measure(impl.make_call, _ok_check, device, timing.Protocol(max_call_ms=1500.0), 1e9)
    assert out["status"] == "skipped" and "cap" in out["error"] and out["ms_one_call"] == 5000.0
    assert out["ms"] is None and len(impl.calls) == 2  # the check and the one measured call


def test_measure_long_mode_uses_the_measured_call_as_its_sample():
    device = FakeDevice()
    impl = FakeImpl(device, ms=lambda k, n: 30_000.0)
    protocol = timing.Protocol(warmup=0, min_repeats=1, max_repeats=3, target_ms=2000.0, max_call_ms=120_000.0)
    out = timing.measure(impl.make_call, _ok_check, device, protocol, 3e13)
    assert out["status"] == "ok" and out["repeats"] == 1 and out["ms"] == 30_000.0
    assert len(impl.calls) == 2 and out["tflops"] == pytest.approx(1.0)


def test_measure_out_of_memory_and_errors_become_records():
    device = FakeDevice(free=800)
    out = timing.measure(FakeImpl(device, input_bytes=1000).make_call, _ok_check, device, timing.Protocol(), 1e9)
    assert out["status"] == "skipped" and out["error"].startswith("out of memory")

    def broken(k):
        raise RuntimeError("kernel launch failed")
    out = timing.measure(broken, _ok_check, FakeDevice(), timing.Protocol(), 1e9)
    assert out["status"] == "error" and "RuntimeError: kernel launch failed" in out["error"]


def test_measure_pool_stops_where_memory_ends():
    device = FakeDevice(free=3200)
    impl = FakeImpl(device, input_bytes=1000, temp_bytes=100)
    protocol = timing.Protocol(pool_target_bytes=10_000, max_pool=8)
    out = timing.measure(impl.make_call, _ok_check, device, protocol, 1e9)
    assert out["status"] == "ok" and out["pool"] == 3


def test_protocol_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_repeats"):
        timing.Protocol(min_repeats=5, max_repeats=2)
    with pytest.raises(ValueError, match="warmup"):
        timing.Protocol(warmup=-1)


# ---------------------------------------------------------------------------------------------- CLI and plan

def test_parse_args_modes():
    full = bench.parse_args([])
    assert full.N == (512, 1024, 2048, 4096, 8192, 16384) and full.d == (64, 128)
    assert full.causal == (False, True) and full.passes == ("forward", "backward")
    assert "kg_flash2" in full.impls and "sdpa_flash" in full.impls and "kg_flash2_det" not in full.impls
    # the fast kernels (forward v5, backward v1) are one default implementation; v3 alone is not default any more
    assert "kg_flash2_fast" in full.impls and "kg_flash2_v3" not in full.impls
    quick = bench.parse_args(["--quick"])
    assert quick.N == (512, 1024) and quick.budget_s == 120.0 and quick.name == "quick"
    long = bench.parse_args(["--long"])
    assert long.N[-1] == 65536 and long.passes == ("forward",)
    assert long.impls == ("kg_flash2", "kg_flash2_v3", "kg_standard")
    assert long.min_repeats == 1 and long.name == "long"
    custom = bench.parse_args(["--impls", "kg_flash2,torch_eager", "--N", "1024,4096", "--d", "128",
                               "--causal", "1", "--passes", "bwd", "--block-sizes", "64,32", "--max-call-ms", "9"])
    assert custom.impls == ("kg_flash2", "torch_eager") and custom.N == (1024, 4096) and custom.d == (128,)
    assert custom.causal == (True,) and custom.passes == ("backward",) and custom.block_sizes == (64, 32)
    assert custom.max_call_ms == 9.0


@pytest.mark.parametrize("argv", [["--impls", "cudnn"], ["--N", "1000"], ["--d", "96"], ["--passes", "sideways"],
                                  ["--causal", "maybe"], ["--quick", "--long"], ["--block-sizes", "64"],
                                  ["--impls", "kg_flash1", "--passes", "backward"], ["--min-repeats", "0"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_plan_follows_the_papers_grid():
    configs = bench.plan(bench.parse_args([]))
    # 8 forward and 7 backward implementations (FA1 has no backward here) × 6 N × 2 d × 2 causal
    assert len(configs) == (8 + 7) * 6 * 2 * 2
    for c in configs:
        assert c.batch * c.N == 16384 and c.heads * c.d == 2048
        assert not (c.impl == "kg_flash1" and c.pass_ == "backward")
    # N ascends within every series, so a series can stop once it is too slow or out of memory
    seen = {}
    for c in configs:
        assert c.N > seen.get(c.series, 0)
        seen[c.series] = c.N
    long = bench.plan(bench.parse_args(["--long"]))
    assert {(c.batch, c.heads, c.d) for c in long} == {(1, 16, 64)} and max(c.N for c in long) == 65536


def test_predicted_skip():
    args = bench.parse_args(["--impls", "kg_standard", "--passes", "forward", "--d", "64", "--causal", "0"])
    small, large = bench.plan(args)[2], bench.plan(args)[3]  # N = 2048, 4096
    history = {}
    assert bench.predicted_skip(history, large, 1500.0) is None
    bench.update_history(history, small, {"status": "ok", "ms": 500.0})
    assert bench.predicted_skip(history, large, 1500.0) is None  # 1000 ms predicted: under 2 × cap
    bench.update_history(history, small, {"status": "ok", "ms": 2000.0})
    assert "predicted 4000 ms" in bench.predicted_skip(history, large, 1500.0)
    bench.update_history(history, small, {"status": "skipped", "error": "out of memory: S"})
    assert "out of memory already at N = 2048" in bench.predicted_skip(history, large, 1500.0)
    bench.update_history(history, small, {"status": "skipped", "error": "one call took 9 ms > cap 1 ms",
                                          "ms_one_call": 9.0})
    assert "slower than the cap" in bench.predicted_skip(history, large, 1500.0)


def test_memory_slope_tells_linear_from_quadratic():
    Ns = [1024, 2048, 4096, 8192]
    assert bench.memory_slope([(N, 5e6 * N) for N in Ns]) == pytest.approx(1.0)
    assert bench.memory_slope([(N, 8 * N * N) for N in Ns]) == pytest.approx(2.0)
    # inputs (∝ N) beside S and P (∝ N²): the fit lands between, the top two points near 2
    mixed = [(N, 8 * N * N + 1e3 * N) for N in Ns]
    assert 1.9 < bench.memory_slope(mixed) < bench.memory_slope(mixed[-2:]) < 2.0
    assert bench.memory_slope([(1024, 5.0)]) is None


def _synthetic_records(device="NVIDIA H100 80GB HBM3"):
    records = []
    for pass_ in ("forward", "backward"):
        for causal in (False, True):
            for d in (64, 128):
                for N in (512, 1024, 2048):
                    for k, impl in enumerate(("kg_flash2", "kg_standard", "torch_eager")):
                        common = dict(impl=impl, pass_=pass_, dtype="float32", batch=16384 // N, heads=2048 // d,
                                      N=N, d=d, causal=causal, device=device, mode="sweep")
                        if impl == "kg_standard" and N == 2048:
                            records.append(results_io.make_record(status="skipped", error="out of memory: x",
                                                                  **common))
                        else:
                            ms = (1 + k) * N / 512
                            flops = model_flops(16384 // N, 2048 // d, N, d, causal, pass_)
                            records.append(results_io.make_record(ms=ms, tflops=tflops(flops, ms),
                                                                  peak_mem_bytes=2**20 * N * (1 + k), **common))
    for N in (4096, 16384, 65536):
        for impl, mem in (("kg_flash2", 4e3 * N), ("kg_standard", 8.0 * N * N)):
            common = dict(impl=impl, pass_="forward", dtype="float32", batch=1, heads=16, N=N, d=64, causal=False,
                          device=device, mode="long")
            if impl == "kg_standard" and N == 65536:
                records.append(results_io.make_record(status="skipped", error="out of memory: 512 GiB", **common))
            else:
                records.append(results_io.make_record(ms=N / 100, tflops=1.0, peak_mem_bytes=int(mem), **common))
    return records


def test_summary_and_table():
    records = _synthetic_records()
    summary = bench.summarize([r for r in records if r["mode"] == "long"], "long")
    flash = summary["series"]["kg_flash2/forward/d64/full"]
    standard = summary["series"]["kg_standard/forward/d64/full"]
    assert flash["memory_slope_top"] == pytest.approx(1.0) and flash["max_N_ok"] == 65536
    assert standard["memory_slope_top"] == pytest.approx(2.0) and standard["max_N_ok"] == 16384
    assert standard["skipped"] == 1
    table = bench.format_table(records)
    assert "forward, d = 64, not causal" in table and "backward, d = 128, causal" in table
    assert "kg_standard" in table and " -" in table


def test_cli_plan_and_help_need_no_gpu():
    env = dict(os.environ, PYTHONPATH=ROOT)
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.bench_attention", "--help"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "--quick" in help_text.stdout and "sdpa_flash" in help_text.stdout
    plan_text = subprocess.run([sys.executable, "-c",
                                "import sys; from benchmarks import bench_attention as b; "
                                "rc = b.main(['--plan', '--quick']); "
                                "assert 'torch' not in sys.modules, 'torch imported eagerly'; "
                                "assert 'kernels_gpu' not in sys.modules, 'kernels_gpu imported eagerly'; "
                                "sys.exit(rc)"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert plan_text.returncode == 0, plan_text.stderr
    assert plan_text.stdout.strip().endswith("60 configurations")  # (8 forward + 7 backward) × 2 N × 2 causal


# ---------------------------------------------------------------------------------------------- plots

def test_plot_renders_png_from_a_results_file(tmp_path):
    from benchmarks.harness import plot
    path = results_io.write_results(str(tmp_path / "r.json"), {"device": "NVIDIA H100 80GB HBM3"},
                                    _synthetic_records())
    assert plot.main([path, "--out", str(tmp_path / "fig")]) == 0
    names = sorted(os.listdir(tmp_path / "fig"))
    assert names == ["memory.png", "tflops_backward.png", "tflops_forward.png"]
    for name in names:
        with open(tmp_path / "fig" / name, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_refuses_mixed_devices(tmp_path):
    from benchmarks.harness import plot
    a = results_io.write_results(str(tmp_path / "a.json"), {}, _synthetic_records("NVIDIA H100 80GB HBM3")[:3])
    b = results_io.write_results(str(tmp_path / "b.json"), {}, _synthetic_records("NVIDIA H200")[:3])
    with pytest.raises(ValueError, match="different devices"):
        plot.render([a, b], str(tmp_path / "fig"))


# ---------------------------------------------------------------------------------------------- allocator plugin

ALLOCATOR_SCRIPT = """
import sys, types
live = {}
def alloc(size):
    address = 0x7F0000000000 + 512 * len(live)
    live[address] = size
    return address
sys.modules["torch"] = types.SimpleNamespace(
    cuda=types.SimpleNamespace(caching_allocator_alloc=alloc, caching_allocator_delete=live.pop))
from benchmarks.harness import torch_allocator
manager = torch_allocator.TorchNumbaMemoryManager(context=None)
assert manager.interface_version == 1
memory = manager.memalloc(4096)
assert memory.device_pointer_value == 0x7F0000000000 and memory.size == 4096, memory.device_pointer_value
assert live == {0x7F0000000000: 4096}, live
del memory  # numba frees when the pointer dies: the block goes back to PyTorch's allocator
assert live == {}, live
with torch_allocator.poisoned():
    assert torch_allocator._state["poison"] is True
assert torch_allocator._state["poison"] is False
print("allocator ok")
"""


def test_torch_allocator_plugin_allocates_and_frees_through_torch():
    # in a fresh process on numba's real CUDA target (this one may run the simulator), with a fake torch
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = ROOT
    result = subprocess.run([sys.executable, "-c", ALLOCATOR_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "allocator ok" in result.stdout, result.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- with PyTorch (CPU)
# The GPU runs these same functions on CUDA tensors; on a machine with PyTorch they are checked on the CPU.

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 8 * 3 * 29])  # whole heads per chunk; 3 rows per chunk
def test_reference_matches_the_fa2edu_oracle(causal, chunk_bytes):
    torch = pytest.importorskip("torch")
    import fa2edu
    from benchmarks.harness import impls
    x = impls.make_inputs(2, 3, 29, 8, seed=5, device="cpu")
    scale = 1 / math.sqrt(8)
    O, L = impls.reference_forward(x["Q"], x["K"], x["V"], causal, scale, chunk_bytes=chunk_bytes)
    dQ, dK, dV = impls.reference_backward(x["Q"], x["K"], x["V"], x["dO"], O, L, causal, scale,
                                          chunk_bytes=chunk_bytes)
    Q, K, V, dO = (x[n].numpy() for n in ("Q", "K", "V", "dO"))
    O_ref, L_ref = fa2edu.attention_reference(Q, K, V, causal=causal, scale=scale)
    grads = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal, scale=scale)
    for ours, theirs in ((O, O_ref), (L, L_ref), (dQ, grads.dQ), (dK, grads.dK), (dV, grads.dV)):
        assert ours.dtype == torch.float64
        assert abs(ours.numpy() - theirs).max() <= 1e-12 * max(1.0, abs(theirs).max())


@pytest.mark.parametrize("impl", ["torch_eager", "sdpa_math"])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_baselines_pass_the_check(impl, pass_, causal):
    pytest.importorskip("torch")
    from benchmarks.harness import impls
    x = impls.make_inputs(2, 2, 40, 16, seed=1, device="cpu")
    scale = 0.25
    O, L = impls.reference_forward(x["Q"], x["K"], x["V"], causal, scale)
    reference = {"O": O, "L": L}
    if pass_ == "backward":
        dQ, dK, dV = impls.reference_backward(x["Q"], x["K"], x["V"], x["dO"], O, L, causal, scale)
        reference = {"dQ": dQ, "dK": dK, "dV": dV}
    call = impls.IMPLS[impl].build(pass_, x, causal, scale, {})
    outputs = call()
    assert set(outputs) == ({"O"} if pass_ == "forward" else {"dQ", "dK", "dV"})
    ok, details = impls.make_check(reference, "float32", pass_)(outputs)
    assert ok and details["rel_error"] < 1e-5, details
    # the same check fails a wrong answer (one row off) and an unwritten (NaN) element
    name = "O" if pass_ == "forward" else "dK"
    bad = {k: v.detach().clone() for k, v in outputs.items()}
    bad[name][0, 0, 3] += 1.0
    assert not impls.make_check(reference, "float32", pass_)(bad)[0]
    bad[name][0, 0, 3] = float("nan")
    ok, details = impls.make_check(reference, "float32", pass_)(bad)
    assert not ok and details["rel_errors"][name] is None and details["rel_error"] is None


def test_check_reads_fa1_statistics_as_a_log_sum_exp():
    torch = pytest.importorskip("torch")
    from benchmarks.harness import impls
    x = impls.make_inputs(1, 2, 33, 8, seed=2, device="cpu")
    O, L = impls.reference_forward(x["Q"], x["K"], x["V"], True, 0.3)
    m = L - 0.5  # any m with ℓ = exp(L − m) describes the same row statistics
    outputs = {"O": O.float(), "l": torch.exp(L - m).float(), "m": m.float()}
    ok, details = impls.make_check({"O": O, "L": L}, "float32", "forward")(outputs)
    assert ok and set(details["rel_errors"]) == {"O", "L"}
    outputs["m"] = outputs["m"] + 0.01  # L off by 0.01 everywhere
    assert not impls.make_check({"O": O, "L": L}, "float32", "forward")(outputs)[0]


class WallClockDevice(FakeDevice):
    """The CPU as a 'device': events read the wall clock; memory statistics stay at zero."""

    class Event:
        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    def event(self):
        return self.Event()


def test_the_whole_run_on_cpu_with_torch_baselines(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from benchmarks.harness import impls
    real_make_inputs = impls.make_inputs
    monkeypatch.setattr(impls, "make_inputs", lambda *a, **k: real_make_inputs(*a, device="cpu", **k))
    args = bench.parse_args(["--impls", "torch_eager,sdpa_math", "--N", "32,64", "--d", "16", "--tokens", "128",
                             "--hidden", "32", "--target-ms", "2", "--max-repeats", "4"])
    configs = bench.plan(args)
    assert len(configs) == 2 * 2 * 2 * 2  # impls × N × causal × passes
    header = {"device": "CPU test", "device_properties": {}, "numba_allocator": "torch"}
    out = str(tmp_path / "cpu.json")
    records = bench.run(args, configs, WallClockDevice(), header, out, progress=False)
    assert [r["status"] for r in records] == ["ok"] * len(configs), [r["error"] for r in records]
    loaded_header, loaded, summary = results_io.load_results(out)
    assert loaded_header["settings"]["mode"] == "sweep" and len(loaded) == len(configs)
    for r in loaded:
        assert r["rel_error"] < 1e-5 and r["repeats"] >= 3 and r["batch"] * r["N"] == 128
        flops = model_flops(r["batch"], r["heads"], r["N"], r["d"], r["causal"], r["pass"])
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
    assert summary["series"]["sdpa_math/backward/d16/causal"]["ok"] == 2
    assert "torch_eager" in bench.format_table(loaded)
    assert bench.main(["--show", out]) == 0


def test_run_records_a_spent_budget_and_a_failed_reference(tmp_path, monkeypatch):
    from benchmarks.harness import impls
    args = bench.parse_args(["--impls", "kg_flash2,torch_eager", "--N", "32,64", "--d", "16", "--tokens", "128",
                             "--hidden", "32", "--passes", "forward", "--budget-s", "0"])
    header = {"device": "CPU test", "device_properties": {}, "numba_allocator": "torch"}
    records = bench.run(args, bench.plan(args), FakeDevice(), header, str(tmp_path / "a.json"), progress=False)
    assert len(records) == 8 and all(r["status"] == "skipped" and "budget" in r["error"] for r in records)

    def no_memory(*a, **k):
        raise MemoryError("out of memory (fake) for the float64 reference")
    monkeypatch.setattr(impls, "make_inputs", no_memory)
    args.budget_s = None
    records = bench.run(args, bench.plan(args), FakeDevice(), header, str(tmp_path / "b.json"), progress=False)
    assert all(r["status"] == "skipped" and r["error"].startswith("float64 reference failed") for r in records)
    assert len(results_io.load_results(str(tmp_path / "b.json"))[1]) == 8


# ---------------------------------------------------------------------------------------------- check_targets

def _target_records(eager_d128_tflops=30.0, drop=None):
    """A synthetic file in which every issue-5 target is met, unless ``eager_d128_tflops`` beats the fast forward
    at d = 128 (30 TFLOP/s) or ``drop`` = (impl, pass, d, causal, N) removes one record."""
    records = []
    for pass_ in ("forward", "backward"):
        for causal in (False, True):
            for d in (64, 128):
                for N in (1024, 4096, 8192):
                    flops = model_flops(16384 // N, 2048 // d, N, d, causal, pass_)
                    rates = {"kg_flash2_fast": 30.0, "kg_standard": 5.0,
                             "torch_eager": eager_d128_tflops if (d == 128 and not causal) else 20.0}
                    for impl, rate in rates.items():
                        if (impl, pass_, d, causal, N) == drop:
                            continue
                        # causal: half the FLOPs at the same rate, so exactly 2x faster in wall time
                        ms = flops / (rate * 1e12) * 1e3
                        records.append(results_io.make_record(
                            impl=impl, pass_=pass_, dtype="float32", batch=16384 // N, heads=2048 // d, N=N, d=d,
                            causal=causal, device="NVIDIA H200", ms=ms, tflops=tflops(flops, ms), mode="sweep"))
    return records


def test_check_targets_reports_met_and_missed(tmp_path, capsys):
    from benchmarks.harness import check_targets
    assert all(t.met for t in check_targets.evaluate(_target_records()))

    # eager faster at d = 128, non-causal: only target 2 is missed, on exactly those rows (3 N)
    targets = check_targets.evaluate(_target_records(eager_d128_tflops=35.0))
    assert [t.met for t in targets] == [True, False, True, True, True]
    assert sum("missed" in line for line in targets[1].lines) == 3

    # a missing record is a missed target, never a silent pass
    targets = check_targets.evaluate(_target_records(drop=("kg_flash2_fast", "forward", 64, True, 8192)))
    assert [t.met for t in targets] == [True, False, True, False, False]

    # the CLI on a written file: exit status 1 with the missed target named, 0 when all are met
    path = str(tmp_path / "final.json")
    results_io.write_results(path, {"device": "NVIDIA H200"}, _target_records(eager_d128_tflops=35.0))
    assert check_targets.main([path]) == 1
    out = capsys.readouterr().out
    assert "MISSED 2." in out and "missed: target(s) 2" in out and "35.00" in out
    results_io.write_results(path, {"device": "NVIDIA H200"}, _target_records())
    assert check_targets.main([path]) == 0 and "all targets met" in capsys.readouterr().out


def test_check_targets_ratios_are_wall_time():
    from benchmarks.harness import check_targets
    # target 4: equal TFLOP/s causal and not means the causal pass is 2x faster (half the FLOPs)
    line = check_targets.evaluate(_target_records())[3].lines[0]
    assert "= 2.00×" in line
    # target 5: 30 vs 5 TFLOP/s at the same FLOPs is 6x in wall time
    assert "= 6.00×" in check_targets.evaluate(_target_records())[4].lines[0]


def test_fast_kernels_parses_a_register_cap():
    from benchmarks import fast_kernels
    label, spec, fast = fast_kernels._parse_impl("v5@16x8x4x4r168")
    assert label == "v5@16x8x4x4r168" and fast[2] == 168 and tuple(fast[1]) == (16, 8, 4, 4)
    assert fast_kernels._parse_impl("v4@32x8x4x4")[2][2] is None               # no cap unless one is named
    assert fast_kernels._parse_impl("v5")[2][1:] == (None, None)               # the version's own defaults
    assert spec.passes == ("forward",) and not spec.default


# ---------------------------------------------------------------------------------------------- book (chapter 10)
#
# benchmarks.harness.book reads the committed results of benchmarks/results/<device>/ for chapter 10. The tests below
# check its arithmetic on synthetic files and its answers on the committed ones (the same files the chapter reads).

def _book_file(folder, name, records, date, **header):
    results_io.write_results(str(folder / name), {"device": "NVIDIA H200", "date": date, **header}, records)


def test_book_finds_the_device_folder_and_its_ceilings():
    from benchmarks.harness import book
    folder = book.device_folder()
    assert folder.parent == book.RESULTS and list(folder.glob("sweep*.json"))
    dev = book.device(folder)
    final = book.run("final.json", folder).header
    assert dev.sms == final["device_properties"]["multiprocessors"]
    assert dev.ridge == pytest.approx(dev.matmul_tflops / dev.copy_tbps)
    assert dev.first_date <= dev.last_date and dev.profile is not None
    # the measured ceilings lie below the datasheet's peaks
    assert dev.matmul_tflops < dev.profile.fp32 / 1e12 and dev.copy_tbps < dev.profile.hbm_bandwidth / 1e12


def test_book_sweep_keeps_the_newer_file_and_the_papers_grid(tmp_path):
    from benchmarks.harness import book
    settings = {"tokens": 128}
    old = [_record(batch=2, N=64, d=16, heads=2, ms=2.0, tflops=1.0),
           _record(batch=1, N=64, d=16, heads=2, ms=9.0, tflops=9.0, impl="kg_standard")]  # off the grid
    new = [_record(batch=2, N=64, d=16, heads=2, ms=1.0, tflops=2.0)]
    folder = tmp_path / "some-gpu"
    _book_file(folder, "sweep_a.json", new, "2026-01-02", settings=settings)
    _book_file(folder, "sweep_b.json", old, "2026-01-01", settings=settings)
    combined = book.sweep(folder)
    assert list(combined) == [("kg_flash2", "forward", 16, False, 64)]      # batch x N = 64: not the grid's 128
    assert combined[("kg_flash2", "forward", 16, False, 64)]["tflops"] == 2.0   # the newer file wins
    _book_file(tmp_path / "older-gpu", "sweep.json", new, "2025-12-31", settings=settings)
    assert book.device_folder(tmp_path) == folder       # the folder whose newest sweep is newest


def test_book_run_refuses_ambiguous_and_missing_files(tmp_path):
    from benchmarks.harness import book
    _book_file(tmp_path, "twice.json", [_record(), _record(ms=11.0)], "2026-01-01")
    with pytest.raises(ValueError, match="two timed records"):
        book.run("twice.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="absent.json"):
        book.run("absent.json", tmp_path)
    with pytest.raises(KeyError, match="no timed record"):
        _book_file(tmp_path, "one.json", [_record()], "2026-01-01")
        book.tflops("one.json", "kg_flash2", 64, 4096, folder=tmp_path)


def test_book_inventory_counts_and_failed_records(tmp_path):
    from benchmarks.harness import book
    records = [_record(), _record(N=16384, status="skipped", ms=None, tflops=None, error="out of memory: 9 GiB"),
               _record(N=4096, status="wrong", ms=None, tflops=None, error="rel error 0.5 > 0.001")]
    _book_file(tmp_path, "a.json", records, "2026-01-01")
    (summary,) = book.inventory(tmp_path)
    assert (summary.records, summary.timed) == (3, 1)
    assert summary.not_timed == {("skipped", "out of memory"): 1, ("wrong", "rel error # > #"): 1}
    assert [r["N"] for _, r in book.failed_records(tmp_path)] == [4096]
    assert book.failed_records() == []                  # the committed files: nothing failed its check


def test_book_run_to_run_spread(tmp_path):
    from benchmarks.harness import book
    settings = {"tokens": 8192 * 2}
    for k, rate in enumerate((30.0, 30.3, 29.7)):
        _book_file(tmp_path, f"r{k}.json", [_record(impl="torch_eager", tflops=rate)], f"2026-01-0{k + 1}",
                   settings=settings)
    spread = book.run_to_run_spread("torch_eager", tmp_path)
    assert spread == {(64, False, 8192): (3, pytest.approx(30.3 / 29.7 - 1))}
    assert book.run_to_run_spread("torch_eager", tmp_path, min_files=4) == {}


def test_book_ladder_points_at_files_that_hold_its_records():
    from benchmarks.harness import book
    names = [r.name for r in book.FORWARD_LADDER]
    assert names == ["teaching"] + [f"v{k}" for k in range(1, 9)]
    for rung in book.FORWARD_LADDER:
        for d in (64, 128):
            name, impl = rung.measured[d]
            assert any(k[0] == impl and k[2] == d for k in book.run(name).ok), (rung.name, d)
            if d in rung.test:
                file, new, old = rung.test[d]
                assert book.same_run_ratios(file, new, old, d), (rung.name, d)
            p = rung.predicted.get(d)
            assert p is None or (p.low < p.high and p.unit in ("ratio", "TFLOP/s") and p.words)
    with pytest.raises(ValueError, match="rung"):
        book.rung("v9")


def test_book_tiles_are_the_kernels_defaults():
    # the tiles the results files recorded for v6 are the module's defaults today: B_r = NY·TR, B_c = NX·TC
    from benchmarks.harness import book
    from kernels_gpu.fast import flash2_forward_v6
    for d in (64, 128):
        t = flash2_forward_v6.default_tiling(d)
        assert book.tiling("v6", d) == (t.NY * t.TR, t.NX * t.TC)


def test_book_same_run_ratio_is_the_files_ratio():
    from benchmarks.harness import book
    ok = book.run("fast_forward.json").ok
    ratios = book.same_run_ratios("fast_forward.json", "fast_v2", "fast_v1", 128)
    assert set(ratios) == {k[4] for k in ok if k[:4] == ("fast_v1", "forward", 128, False)}
    N = max(ratios)
    assert ratios[N] == ok[("fast_v2", "forward", 128, False, N)]["tflops"] \
        / ok[("fast_v1", "forward", 128, False, N)]["tflops"]


def test_book_verdicts():
    from benchmarks.harness import book
    p = book.Prediction(1.01, 1.03, "ratio", "+2 %")
    assert book._verdict(p, [1.015, 1.02]) == "held"
    assert book._verdict(p, [1.02, 1.05]) == "beaten"
    assert book._verdict(p, [0.99, 1.0]) == "failed"
    assert book._verdict(p, [0.99, 1.02]) == "mixed"
    assert book._verdict(None, [2.0]) == "none"


def test_book_checks_predictions_on_the_committed_runs():
    from benchmarks.harness import book
    c = book.check_prediction("v4", 64)
    assert c.prediction.unit == "TFLOP/s" and min(c.measured) >= c.prediction.N_min
    for N, value in c.measured.items():             # a TFLOP/s prediction is judged on the rate itself
        assert value == book.tflops(c.file, "fast_v4", 64, N)
    lo, hi = c.ratio_range
    assert lo == pytest.approx(c.prediction.low / c.below_rate) and hi > lo
    assert c.verdict == book._verdict(c.prediction, c.measured.values())
    ratio = book.check_prediction("v7", 128)
    assert ratio.measured == ratio.ratios and ratio.ratio_range == (ratio.prediction.low, ratio.prediction.high)
    with pytest.raises(ValueError, match="no same-run"):
        book.check_prediction("v1", 64)
    rows = book.ladder_table(N=4096)
    assert len(rows) == 2 * len(book.FORWARD_LADDER)
    assert [r.gain is None for r in rows if r.d == 64] == [not r.test for r in book.FORWARD_LADDER]


def test_book_resident_blocks_match_the_occupancy_the_headers_report():
    # v8's header: the occupancy calculator gave 132 slots at d = 128 and 396 at d = 64 on 132 SMs; backward v1:
    # one block per SM uncapped at d = 64, three under its 168-register cap; v3 at d = 64: two blocks of 8 warps
    from benchmarks.harness import book
    sram = book.device().profile.sram_per_sm
    res = {d: book.run(f"fast_v8e_explore_d{d}.json").header["resources"][f"v6/d{d}"] for d in (64, 128)}
    assert book.resident_blocks(res[128], sram) == 1 and book.resident_blocks(res[64], sram) == 3
    bwd = book.run("fast_backward_v1.json").header["resources"]
    assert book.resident_blocks(bwd["v1/d64"], sram) == 1
    assert book.resident_blocks(bwd["v1@8x16x4x4r168/d64"], sram) == 3
    assert book.resident_blocks(book.run("fast_forward.json").header["resources"]["v3/d64"], sram) == 2
    # shared memory binds when registers do not: 2 blocks of 100 KiB fit in 228 KiB, 3 do not
    fat = {"tiling": [4, 8, 1, 1], "registers": 32, "shared_floats": 100 * 256}
    assert book.resident_blocks(fat, sram) == 2


def test_book_wave_runs():
    from benchmarks.harness import book
    runs = book.wave_runs()
    assert [r.heads for r in runs] == sorted(r.heads for r in runs) and len(runs) == 3
    for r in runs:
        assert r.blocks == r.heads * -(-2048 // book.tiling("v6", 128)[0])
        assert r.paid_waves == math.ceil(r.blocks / r.slots) and r.waves <= r.paid_waves


@pytest.mark.parametrize("items, tiles, slots", [(2048, 32, 132), (8192, 64, 396), (264, 16, 132), (7, 5, 3)])
def test_book_busy_slots_conserve_the_work(items, tiles, slots):
    from benchmarks.harness import book
    plans = {plan: book.busy_slots(items, tiles, slots, plan) for plan in ("waves", "stream")}
    for steps in plans.values():
        assert sum((end - start) * busy for start, end, busy in steps) == pytest.approx(items * tiles)
        assert all(busy <= slots for _, _, busy in steps)
    end = {plan: steps[-1][1] for plan, steps in plans.items()}
    assert end["stream"] <= end["waves"] and end["stream"] == pytest.approx(items * tiles / slots, abs=tiles)
    with pytest.raises(ValueError, match="plan"):
        book.busy_slots(items, tiles, slots, "sideways")


def test_book_kernel_durations(tmp_path):
    from benchmarks.harness import book
    v8 = book.kernel_durations("ncu_v8b_v8_N1024.csv")
    assert set(v8) == {"zero_counter", "flash2_forward_fast", "merge_stream"}
    assert set(book.kernel_durations("ncu_v8b_v6_N1024.csv")) == {"flash2_forward_fast"}
    assert all(v > 0 for v in v8.values())
    text = ("  mod::first_kernel[v1,abc](Array)\n    gpu__time_duration.sum   us   12.50\n"
            "  mod::second[v2,def]\n    gpu__time_duration.sum   ms   1.5\n")
    (tmp_path / "named.txt").write_text(text)
    assert book.kernel_durations("named.txt", tmp_path) == {"first_kernel": 12.5, "second": 1500.0}
    (tmp_path / "bare.txt").write_text("    gpu__time_duration.sum   ns   500\n")
    assert book.kernel_durations("bare.txt", tmp_path) == {"launch 0": 0.5}


def test_book_causal_speedups_are_wall_time_ratios():
    from benchmarks.harness import book
    ok = book.run("final.json").ok
    s = book.causal_speedups("final.json", 128, impls=["kg_flash2_fast"])["kg_flash2_fast"]
    for N, ratio in s.items():
        assert ratio == ok[("kg_flash2_fast", "forward", 128, False, N)]["ms"] \
            / ok[("kg_flash2_fast", "forward", 128, True, N)]["ms"]


def test_book_roofline():
    from benchmarks.harness import book
    from fa2edu.io import closed_form
    dev = book.device()
    for d in (64, 128):
        points = {p.label: p for p in book.roofline(d, 4096)}
        batch, heads = 16384 // 4096, 2048 // d
        for name in ("teaching", "v8"):
            p = points[name]
            B_r, B_c = book.tiling(name, d)
            assert p.model_bytes == 4 * batch * heads * sum(closed_form("flash2", "forward", 4096, d, B_r, B_c))
            assert p.intensity == pytest.approx(B_r / 2, rel=0.05)       # K, V re-read T_r times
            assert p.once_intensity > 10 * p.intensity
        assert points["kg_standard"].intensity == pytest.approx(d / 4, rel=0.05)   # S and P through HBM
        for p in points.values():
            assert p.roof_tflops == min(dev.matmul_tflops, p.intensity * dev.copy_tbps) and 0 < p.of_roof < 1


def test_book_ncu_rows_and_the_long_run():
    from benchmarks.harness import book
    rows = book.ncu_rows()
    fa2 = next(r for r in rows if (r["impl"], r["pass"]) == ("kg_flash2", "forward"))
    assert book.compulsory_read_bytes(fa2) == 4 * 3 * fa2["N"] * fa2["d"] * fa2["batch"] * fa2["heads"]
    assert fa2["L1_ld"] == fa2["ncu_load_bytes"] / fa2["model_load_bytes"]
    run = book.run("long.json")
    for r in run.ok.values():       # the allocator holds exactly the modelled tensors
        assert r["peak_mem_bytes"] == book.model_memory(r["impl"], r["N"], r["batch"], r["heads"], r["d"])
    series = book.memory_series()
    assert all([n for n, _ in pts] == sorted(n for n, _ in pts) for pts in series.values())


def test_book_pytest_counts():
    from benchmarks.harness import book
    counts = book.pytest_counts("...\n==== 3 failed, 10 passed, 2 skipped, 1 error, 4 deselected in 12.5s ====\n")
    assert counts == {"failed": 3, "passed": 10, "skipped": 2, "error": 1, "deselected": 4, "seconds": 12.5}
    assert book.pytest_counts("1 passed in 0.1s\n...\n7 passed, 2 warnings in 3.0s (0:00:03)")["passed"] == 7
    with pytest.raises(ValueError, match="summary"):
        book.pytest_counts("collected 0 items")
    logs = book.gpu_test_summary()
    assert logs and all(log.clean and log.seconds > 0 for log in logs)


def test_book_sanitizer_logs():
    from benchmarks.harness import book
    text = "\n".join([
        "========= COMPUTE-SANITIZER", "ok: case 1", "ok: case 2", "========= ERROR SUMMARY: 2 errors",
        "compute-sanitizer memcheck exit status: 9 (0 clean, 9 errors found, 124 timed out)",
        "ok: case 1", "========= RACECHECK SUMMARY: 1 hazard displayed (1 errors, 0 warnings)",
        "racecheck exit 0",
        "ok: case 1", "compute-sanitizer racecheck exit status: 124 (0 clean, 9 errors found, 124 timed out)"])
    runs = book.parse_sanitizer_log(text, "x.log")
    assert [(r.tool, r.problems, r.exit_status, r.cases) for r in runs] == [
        ("memcheck", 2, 9, 2), ("racecheck", 1, 0, 1), ("racecheck", None, 124, 1)]
    assert not any(r.clean for r in runs)
    committed = book.sanitizer_summary()
    assert {r.tool for r in committed} == {"memcheck", "racecheck"} and all(r.cases > 0 for r in committed)
    assert all(r.clean for r in committed if r.exit_status != 124)


def test_book_figures_fit_the_page():
    """Every figure of chapter 10: at most two panels, 7 inches wide (700 px at 100 dpi), no text under 9 pt."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from benchmarks.harness import book, plot
    dev = book.device()
    rows = book.ladder_table(N=4096)
    runs = book.wave_runs()
    checks = [book.check_prediction(r, d) for r in book.FORWARD_LADDER if r.predicted for d in (64, 128)]
    series = book.memory_series()
    figures = [
        plot.ladder_figure(rows, {d: book.baselines(d, 4096) for d in (64, 128)}, dev),
        plot.prediction_figure(checks, dev),
        plot.wave_figure(runs, book.busy_slots(2048, 32, 132, "waves"), book.busy_slots(2048, 32, 132, "stream"),
                         32, dev),
        plot.causal_figure({d: book.causal_speedups(d=d, impls=["kg_flash2_fast", "torch_eager"])
                            for d in (64, 128)}, dev),
        plot.backward_figure({d: {"torch_eager": {1024: 30.0, 4096: 31.0}} for d in (64, 128)}, dev),
        plot.roofline_figure({d: book.roofline(d, 4096) for d in (64, 128)}, dev),
        plot.memory_figure(series, lambda impl, N: book.model_memory(impl, N, 1, 16, 64), dev, "memory"),
        plot.ncu_figure(book.ncu_rows(), dev),
    ]
    try:
        for fig in figures:
            fig.canvas.draw()
            assert fig.get_size_inches()[0] == pytest.approx(plot.BOOK_WIDTH) and plot.BOOK_WIDTH <= 7.0
            assert 1 <= len(fig.axes) <= 2
            small = [(t.get_text(), t.get_fontsize()) for t in fig.findobj(Text)
                     if t.get_visible() and t.get_text().strip() and t.get_fontsize() < 9]
            assert not small, small
            assert dev.name in fig._suptitle.get_text() and dev.first_date in fig._suptitle.get_text()
    finally:
        for fig in figures:
            plt.close(fig)


# ---------------------------------------------------------------------------------------------- FP8 (issue 40)

def test_fp8_error_study_and_targets_without_a_gpu(tmp_path):
    """benchmarks.hopper's FP8 error study with fa2edu.fp8's emulation standing in for the kernel: the measurement
    is then the prediction (same codes, same arithmetic), incoherent FP8 beats plain FP8 on the outlier inputs, and
    the targets read the records and the study; the summary writes as strict JSON."""
    import numpy as np

    from benchmarks import hopper as bench_hopper
    from fa2edu import fp8

    def emulated(Q8, K8, V8, causal):
        return fp8.flash2_forward_fp8(Q8, K8, V8, causal=causal).O

    study = bench_hopper.fp8_error_study(emulated, N=128, d=64, seeds=(0, 1), block=32)
    assert set(study["methods"]) == set(fp8.STUDY_METHODS)
    for name in bench_hopper.FP8_KERNEL_METHODS:
        assert study["methods"][name]["measured_over_predicted"] == pytest.approx(1.0, rel=1e-9)
    assert "note" in study["methods"]["block"] and "rmse_measured" not in study["methods"]["block"]
    assert study["incoherent_over_per_head"]["measured"] < 1.0
    common = dict(pass_="forward", batch=4, heads=16, N=4096, d=128, causal=False, device="fake", ms=1.0)
    records = [results_io.make_record(impl="hopper_fp8", dtype="float8_e4m3fn", tflops=700.0, **common),
               results_io.make_record(impl="hopper_bf16", dtype="bfloat16", tflops=500.0, **common)]
    targets = bench_hopper.fp8_targets(records, study)
    assert targets["speedup"]["points"][0]["speedup"] == pytest.approx(1.4) and not targets["speedup"]["met"]
    assert targets["prediction"]["met"]
    assert targets["incoherent_error"]["met"] == (study["incoherent_over_per_head"]["measured"] <= 0.5)
    path = results_io.write_results(tmp_path / "hopper_forward_fp8.json", {"device": "fake"}, records,
                                    dict(error_study=study, targets=targets))
    loaded = json.loads(open(path).read())
    assert loaded["summary"]["targets"]["speedup"]["target"] == 1.5
    assert np.isfinite(loaded["summary"]["error_study"]["methods"]["per_head"]["rmse_predicted"])
