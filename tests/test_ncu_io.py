"""benchmarks.ncu_io without a GPU: the model side against fa2edu's executed ledger, the ncu CSV parser on a sample
in ncu's documented details-page format, the record schema chapter 10.4 reads, and the ncu command line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import fa2edu
from benchmarks import ncu_io
from benchmarks.ncu_io import Config

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

KERNEL_NAMES = {
    "flash2_backward_preprocess_kernel":
        "_ZN11kernels_gpu6flash217preprocess_kernel12_3clocals_3e33flash2_backward_preprocess_kernel$2415E5ArrayIfLi4E",
    "_fill_kernel": "_ZN11kernels_gpu7runtime12_fill_kernel12_3clocals_3e4fill$2423E5ArrayIfLi1E1A7mutable7alignedE",
    "flash2_backward_kernel":
        "_ZN11kernels_gpu6flash215backward_kernel12_3clocals_3e22flash2_backward_kernel$2430E5ArrayIfLi4E",
}


def csv_sample(values: dict[str, dict[str, str]], units: dict[str, str]) -> str:
    """An ncu --csv report (details page) with ==PROF== chatter around it, one row per (kernel, metric)."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
             '==PROF== Profiling "flash2_backward_preprocess_kernel": 0%....50%....100% - 9 passes', HEADER]
    for kid, (kernel, metrics) in enumerate(values.items()):
        for metric, value in metrics.items():
            lines.append(f'"{kid}","4242","python3.12","127.0.0.1","{KERNEL_NAMES[kernel]}","1","7","(64, 1, 1)",'
                         f'"(16, 1, 4)","0","9.0","Command line profiler metrics","{metric}","{units[metric]}",'
                         f'"{value}"')
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


def fmt(n: int) -> str:
    return f"{n:,}"


# -- the model ------------------------------------------------------------------------------------------------------

SMALL = [Config("kg_flash1", "forward", 37, 8, (8, 16)), Config("kg_flash1", "forward", 37, 8, (8, 16), True),
         Config("kg_flash2", "forward", 37, 8, (16, 8)), Config("kg_flash2", "forward", 37, 8, (16, 8), True),
         Config("kg_flash2", "backward", 37, 8, (8, 16)), Config("kg_flash2", "backward", 37, 8, (8, 16), True)]


@pytest.mark.parametrize("config", SMALL, ids=lambda c: c.label)
def test_ledger_split_adds_up_to_the_executed_ledger(config):
    """The split by access pattern sums to what running the NumPy algorithm on fa2edu.HBM records, init included."""
    rng = np.random.default_rng(1)
    Q, K, V, dO = (rng.standard_normal((1, 1, config.N, config.d)) for _ in range(4))
    kw = dict(block_sizes=config.block_sizes, causal=config.causal)
    hbm = fa2edu.HBM()
    if config.impl == "kg_flash1":
        fa2edu.flash1_forward(Q, K, V, hbm=hbm, **kw)
    elif config.pass_ == "forward":
        fa2edu.flash2_forward(Q, K, V, hbm=hbm, **kw)
    else:
        fwd = fa2edu.flash2_forward(Q, K, V, **kw)
        fa2edu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, hbm=hbm, **kw)
    split = ncu_io.ledger_split(config)
    total = {k: v["row"] + v["coalesced"] for k, v in split.items()}
    assert (total["load"], total["store"], total["init_store"]) == (hbm.reads, hbm.writes, hbm.init_writes)
    assert (hbm.reads, hbm.writes, hbm.init_writes) == ncu_io.ledger_elements(config)


def test_model_bytes_scale_with_programs_and_match_the_closed_form():
    config = Config("kg_flash2", "forward", 4096, 64, (64, 64), batch=2, heads=3)
    model = ncu_io.model_bytes(config)
    reads, writes = fa2edu.io.closed_form("flash2", "forward", 4096, 64, 64, 64)
    assert model["model_load_bytes"] == reads * 4 * 6
    assert model["model_store_bytes"] == writes * 4 * 6
    assert model["model_init_store_bytes"] == 0
    # Everything FA2's forward loads is a d-wide row walked by one thread: 32 bytes of sector per element.
    assert model["model_sector_load_bytes"] == 8 * model["model_load_bytes"]
    # O_i rows (8x) and L (coalesced, 1x).
    assert model["model_sector_store_bytes"] == (8 * 4096 * 64 + 4096) * 4 * 6


def test_model_counts_the_init_launch_and_the_atomics():
    fa1 = ncu_io.model_bytes(Config("kg_flash1", "forward", 1024, 64, (64, 64)))
    assert fa1["model_init_store_bytes"] == 1024 * 66 * 4 * 4
    bwd = Config("kg_flash2", "backward", 1024, 64, (32, 64))
    split = ncu_io.ledger_split(bwd)
    T_c = 1024 // 64
    atomic = 1024 * 64 * T_c                        # dQ_i in and out once per visited block: d·RV elements
    assert split["load"]["coalesced"] >= atomic and split["store"]["coalesced"] == 1024 + atomic
    reads, writes = fa2edu.io.closed_form("flash2", "backward", 1024, 64, 32, 64)
    assert ncu_io.model_bytes(bwd)["model_load_bytes"] == reads * 16


def test_causal_halves_roughly_and_tiles_change_the_model():
    dense = ncu_io.model_bytes(Config("kg_flash2", "forward", 4096, 64, (64, 64)))
    causal = ncu_io.model_bytes(Config("kg_flash2", "forward", 4096, 64, (64, 64), causal=True))
    assert 0.45 < causal["model_load_bytes"] / dense["model_load_bytes"] < 0.6
    taller = ncu_io.model_bytes(Config("kg_flash2", "forward", 4096, 64, (128, 32)))
    assert taller["model_load_bytes"] < dense["model_load_bytes"]   # T_r halves: K, V read half as often


def test_default_grid_is_small_and_valid():
    configs = ncu_io.default_configs()
    assert 6 <= len(configs) <= 16 and len(ncu_io.default_configs(quick=True)) < len(configs)
    assert {(c.impl, c.pass_) for c in configs[:3]} == set(ncu_io.KERNELS)   # every kernel early
    assert any(c.causal for c in configs)
    from kernels_gpu.runtime import SHARED_FLOATS, flash2_backward_shared
    for c in configs:
        B_r, B_c = c.block_sizes
        if c.pass_ == "backward":
            assert flash2_backward_shared(B_r, B_c, c.d, c.d) <= SHARED_FLOATS and B_c <= 1024
        else:
            assert B_c * 2 * c.d <= SHARED_FLOATS and B_r <= 1024


def test_config_refuses_bad_input():
    with pytest.raises(ValueError, match="impl"):
        Config("kg_standard", "forward", 64, 64, (64, 64))
    with pytest.raises(ValueError, match="N"):
        Config("kg_flash2", "forward", 0, 64, (64, 64))
    with pytest.raises(ValueError, match="block_sizes"):
        Config("kg_flash2", "forward", 64, 64, (64,))
    with pytest.raises(TypeError, match="causal"):
        Config("kg_flash2", "forward", 64, 64, (64, 64), causal=1)


# -- the CSV --------------------------------------------------------------------------------------------------------

def test_parse_value_handles_separators_and_units():
    assert ncu_io.parse_value("1,048,576", "byte") == 1048576
    assert ncu_io.parse_value("12", "") == 12
    assert ncu_io.parse_value("1.5", "Mbyte") == 1.5e6
    assert ncu_io.parse_value("2", "KiB") == 2048
    assert ncu_io.parse_value("9,5", "%") == 9.5
    assert ncu_io.parse_value("3,072", "sector") == 3072          # counts stay counts
    assert ncu_io.parse_value("n/a", "byte") is None
    with pytest.raises(ValueError, match="unit"):
        ncu_io.parse_value("1", "furlong")


def test_parse_ncu_csv_groups_metrics_by_kernel():
    units = {"l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum": "byte", "dram__bytes_read.sum": "byte",
             "smsp__sass_thread_inst_executed_op_global_ld_pred_on.sum": "inst"}
    text = csv_sample({
        "flash2_backward_preprocess_kernel": {"l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum": fmt(16_777_216),
                                              "dram__bytes_read.sum": fmt(2_097_152),
                                              "smsp__sass_thread_inst_executed_op_global_ld_pred_on.sum": "524,288"},
        "flash2_backward_kernel": {"l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum": fmt(123_456_789),
                                   "dram__bytes_read.sum": "0",
                                   "smsp__sass_thread_inst_executed_op_global_ld_pred_on.sum": "7"},
    }, units)
    kernels = ncu_io.parse_ncu_csv(text)
    assert [k.id for k in kernels] == [0, 1]
    assert kernels[0].metrics["l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum"] == 16_777_216
    assert kernels[1].metrics["l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum"] == 123_456_789
    assert kernels[0].metrics["smsp__sass_thread_inst_executed_op_global_ld_pred_on.sum"] == 524_288
    assert kernels[0].grid == "(16, 1, 4)"
    config = Config("kg_flash2", "backward", 1024, 64, (32, 64))
    assert [ncu_io.classify(k.name, config) for k in kernels] == ["flash2_backward_preprocess_kernel",
                                                                  "flash2_backward_kernel"]
    assert ncu_io.classify(KERNEL_NAMES["_fill_kernel"], config) == "_fill_kernel"
    assert ncu_io.classify("fill", config) == "_fill_kernel"
    assert ncu_io.classify("flash2_forward_kernel", config) is None


def test_parse_ncu_csv_without_a_report():
    assert ncu_io.parse_ncu_csv("==PROF== ERR_NVGPUCTRPERM - no permission\n") == []
    with pytest.raises(ValueError, match="Metric Name"):
        ncu_io.parse_ncu_csv('"ID","Kernel Name"\n"0","k"\n')


def test_measured_bytes_sums_launches_and_counts_atomics_both_ways():
    config = Config("kg_flash2", "backward", 1024, 64, (32, 64))
    chosen = ncu_io.choose_metrics(None)
    per_kernel = {m: "1,000" for m in chosen.values()}
    per_kernel[chosen["red_bytes"]] = "300"
    per_kernel[chosen["thread_red"]] = "50"
    units = {m: ("inst" if "inst" in m else "byte") for m in chosen.values()}
    kernels = ncu_io.parse_ncu_csv(csv_sample({k: per_kernel for k in KERNEL_NAMES}, units))
    measured = ncu_io.measured_bytes(kernels, chosen)
    assert measured["ncu_load_bytes"] == 3 * (1000 + 300 + 1000)      # ld + red + atom, over three launches
    assert measured["ncu_store_bytes"] == 3 * (1000 + 300 + 1000)
    assert measured["ncu_thread_load_bytes"] == 4 * 3 * (1000 + 50 + 1000)
    assert measured["dram_read_bytes"] == 3000 and measured["dram_write_bytes"] == 3000
    record = ncu_io.make_record(config, measured, kernels=kernels, device="NVIDIA H200")
    assert record["load_ratio"] == pytest.approx(measured["ncu_load_bytes"] / record["model_load_bytes"], rel=1e-3)


def test_sector_fallback_is_converted_to_bytes():
    config = Config("kg_flash2", "forward", 1024, 64, (64, 64))
    chosen = {"ld_bytes": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "st_bytes": "l1tex__t_bytes_pipe_lsu_"
              "mem_global_op_st.sum", "dram_read": "dram__sectors_read.sum", "dram_write": "dram__bytes_write.sum"}
    text = csv_sample({"flash2_backward_kernel": {chosen["ld_bytes"]: "10", chosen["st_bytes"]: "64",
                                                  chosen["dram_read"]: "2", chosen["dram_write"]: "96"}},
                      {chosen["ld_bytes"]: "sector", chosen["st_bytes"]: "byte", chosen["dram_read"]: "sector",
                       chosen["dram_write"]: "byte"})
    measured = ncu_io.measured_bytes(ncu_io.parse_ncu_csv(text), chosen)
    assert measured["ncu_load_bytes"] == 320 and measured["dram_read_bytes"] == 64
    assert measured["ncu_store_bytes"] == 64 and measured["ncu_thread_load_bytes"] is None
    assert ncu_io.make_record(config, measured)["thread_load_ratio"] is None


# -- records, files, command line -----------------------------------------------------------------------------------

def test_record_schema_matches_chapter_10(tmp_path):
    config = Config("kg_flash1", "forward", 1024, 64, (64, 64))
    ok = ncu_io.make_record(config, {"ncu_load_bytes": 8.0e7, "ncu_store_bytes": 1.0e6, "dram_read_bytes": 1e6,
                                     "dram_write_bytes": 5e5}, device="NVIDIA H200")
    skipped = ncu_io.make_record(config, status="skipped", error="budget")
    for record in (ok, skipped):
        for key in ("impl", "pass", "batch", "heads", "N", "d", "causal", "block_sizes", "model_load_bytes",
                    "model_store_bytes", "ncu_load_bytes", "ncu_store_bytes", "dram_read_bytes",
                    "dram_write_bytes", "load_ratio", "store_ratio"):
            assert key in record
        assert record["impl"] in ("kg_flash1", "kg_flash2") and record["pass"] in ("forward", "backward")
    assert ok["load_ratio"] == pytest.approx(8.0e7 / ok["model_load_bytes"], rel=1e-3)
    assert skipped["ncu_load_bytes"] is None and skipped["load_ratio"] is None
    with pytest.raises(ValueError, match="error message"):
        ncu_io.make_record(config, status="error")
    path = ncu_io.write_json(str(tmp_path / "dev" / "ncu_io.json"), {"device": "NVIDIA H200"}, [ok, skipped])
    payload = json.loads(open(path).read())
    rows = payload.get("records", payload)
    # What chapter 10.4 does with each row: every numeric field ending in "bytes" is a byte count.
    for row in rows:
        sizes = {k: v for k, v in row.items() if k.endswith("bytes")}
        assert sizes and all(v is None or isinstance(v, int) for v in sizes.values())
        assert tuple(row["block_sizes"]) == (64, 64)
    table = ncu_io.format_table(rows)
    assert "kg_flash1" in table and "skipped" in table


def test_ncu_command_selects_the_measured_call():
    config = Config("kg_flash2", "backward", 1024, 64, (32, 64), causal=True)
    cmd = ncu_io.ncu_command("/usr/local/cuda/bin/ncu", config, ["dram__bytes_read.sum"], python="python3",
                             info_path="/tmp/i.json", options={"--print-units", "--print-metric-name"})
    joined = " ".join(cmd)
    assert "--profile-from-start off" in joined and "--clock-control none" in joined
    assert "--cache-control all" in joined and "--print-units base" in joined and "--csv" in joined
    assert cmd[cmd.index("--run-one") - 2:cmd.index("--run-one")] == ["-m", "benchmarks.ncu_io"]
    assert "--causal" in cmd and cmd[cmd.index("--block-sizes") + 1] == "32,64"
    named = ncu_io.ncu_command("ncu", config, ["dram__bytes_read.sum"], info_path="i", selection="name")
    assert named[named.index("--launch-skip") + 1] == "3" and named[named.index("--launch-count") + 1] == "3"
    assert "flash2_backward_preprocess_kernel" in named[named.index("--kernel-name") + 1]
    args = ncu_io.build_parser().parse_args(cmd[cmd.index("--run-one"):])
    assert (args.impl, args.pass_, args.N, tuple(args.block_sizes), args.causal) == (
        config.impl, config.pass_, config.N, config.block_sizes, config.causal)


def test_choose_metrics_prefers_listed_names_and_falls_back():
    listed = {"l1tex__t_sectors_pipe_lsu_mem_global_op_ld", "l1tex__t_bytes_pipe_lsu_mem_global_op_st",
              "dram__bytes_read", "dram__bytes_write"}
    chosen = ncu_io.choose_metrics(listed)
    assert chosen["ld_bytes"] == "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"
    assert chosen["st_bytes"] == "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum"
    assert "red_bytes" not in chosen and chosen["thread_ld"].startswith("smsp__sass")
    with pytest.raises(RuntimeError, match="dram"):
        ncu_io.choose_metrics({"l1tex__t_bytes_pipe_lsu_mem_global_op_ld", "l1tex__t_bytes_pipe_lsu_mem_global_op_st"})


def test_module_imports_without_a_gpu():
    """Importing (and --help) must not touch CUDA: the driver runs no kernel itself."""
    code = ("import sys, benchmarks.ncu_io as m; "
            "assert 'numba' not in sys.modules and 'kernels_gpu' not in sys.modules, sorted(sys.modules); "
            "print(len(m.default_configs()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == len(ncu_io.default_configs())


FAKE_NCU = r'''#!/usr/bin/env python3
"""A stand-in for ncu: version, help, metric list, and a CSV report naming the kernels of the --run-one call."""
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\nVersion 2025.3.0.0 (build 1) (public-release)")
elif args == ["--help"]:
    print("  --csv  --print-units  --print-metric-name  --profile-from-start  --cache-control  --clock-control")
elif args == ["--query-metrics"]:
    print("Device GH100\n---------\n" + "\n".join(
        f"{n}    Counter    # of something" for n in ("dram__bytes_read", "dram__bytes_write",
        "l1tex__t_bytes_pipe_lsu_mem_global_op_ld", "l1tex__t_bytes_pipe_lsu_mem_global_op_st",
        "l1tex__t_bytes_pipe_lsu_mem_global_op_red")))
else:
    metrics = args[args.index("--metrics") + 1].split(",")
    impl, pass_ = args[args.index("--impl") + 1], args[args.index("--pass") + 1]
    names = {("kg_flash1", "forward"): ["flash1_init_kernel", "flash1_forward_kernel"],
             ("kg_flash2", "forward"): ["flash2_forward_kernel"],
             ("kg_flash2", "backward"): ["flash2_backward_preprocess_kernel", "fill", "flash2_backward_kernel"]}
    print("==PROF== Connected to process 1")
    print('"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"')
    for kid, name in enumerate(names[(impl, pass_)]):
        for m in metrics:
            print(f'"{kid}","1","{name}$241","{m}","{"inst" if "inst" in m else "byte"}","1,024"')
'''


def test_driver_end_to_end_with_a_stand_in_ncu(tmp_path):
    """The driver's whole path (find ncu, choose metrics, one ncu run per configuration, parse, records, file,
    table) with a fake ncu that prints a report: no GPU needed."""
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU)
    fake.chmod(0o755)
    out = tmp_path / "ncu_io.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.ncu_io", "--quick", "--ncu", str(fake),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads(out.read_text())
    records = payload["records"]
    assert len(records) == len(ncu_io.default_configs(quick=True))
    assert payload["header"]["versions"]["ncu"] == "2025.3.0.0"
    for r in records:
        launches = len(ncu_io.KERNELS[(r["impl"], r["pass"])])
        assert r["status"] == "ok" and len(r["kernels"]) == launches
        assert r["ncu_load_bytes"] == launches * (1024 + 1024)          # ld + red, no atom metric listed
        assert r["ncu_thread_load_bytes"] == 4 * launches * 3 * 1024     # SASS metrics kept although unlisted
    assert "kg_flash2" in done.stdout


@pytest.mark.parametrize("extra", [["--impl", "kg_flash1", "--causal"], ["--impl", "kg_flash2", "--pass", "backward"]])
def test_run_one_child_in_the_simulator(tmp_path, extra):
    """The --run-one child builds its inputs, warms up, runs the bracketed call and checks it (here in numba's
    simulator, where the profiler bracket is a no-op): it says which launches one call makes."""
    info = tmp_path / "info.json"
    env = dict(__import__("os").environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.ncu_io", "--run-one", *extra, "--N", "12", "--d", "4",
                           "--block-sizes", "4,4", "--heads", "2", "--info", str(info)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""                                   # stdout is ncu's, for the CSV
    got = json.loads(info.read_text())
    assert got["finite"] and got["launches"] == list(ncu_io.KERNELS[(extra[1], "backward" if "backward" in extra
                                                                     else "forward")])
    if got["rel_error"] is not None:
        assert got["rel_error"] < 1e-5
