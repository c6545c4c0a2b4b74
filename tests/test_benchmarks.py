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
from benchmarks import results_io, timing  # noqa: E402
from benchmarks.flop_model import model_flops, tflops  # noqa: E402

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
    from benchmarks import plot
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
    from benchmarks import plot
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
from benchmarks import torch_allocator
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
    from benchmarks import impls
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
    from benchmarks import impls
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
    from benchmarks import impls
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
    from benchmarks import impls
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
    from benchmarks import impls
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
    from benchmarks import check_targets
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
    from benchmarks import check_targets
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
