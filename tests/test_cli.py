"""The ``fa2edu`` command: ``io`` prints the computed table, ``tour`` its five sections, bad arguments fail clearly."""

from __future__ import annotations

import re

import pytest

import fa2edu
from fa2edu.cli import TOUR_D, TOUR_M, TOUR_N, main
from fa2edu.io import simulate_io


def run(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_io_prints_the_table_and_bytes(capsys):
    out = run(capsys, "io", "--N", "4096", "--d", "64", "--M", "98304", "--causal", "--dtype", "float32",
              "--batch", "2", "--heads", "3")
    report = simulate_io(4096, 64, 98_304, causal=True)
    for row in report.rows:
        assert f"{row.total:,}" in out                    # the numbers are simulate_io's
    assert "(causal)" in out
    assert "In bytes, float32 elements, 2 × 3" in out
    assert out.count("reads") >= 6


def test_io_small_problem_executes_and_device_adds_roofline(capsys):
    out = run(capsys, "io", "--N", "64", "--d", "8", "--M", "256", "--method", "execute")
    assert out.count("execute") == 6
    out = run(capsys, "io", "--N", "2048", "--d", "64", "--device", "A100-40GB")
    assert "HBM time on NVIDIA A100" in out
    assert f"M = {fa2edu.hardware.M_for('A100-40GB', 'float16'):,}" in out   # M defaults to the device's SM


def test_io_progress_bar_goes_to_stderr_only_when_asked(capsys):
    small = ["io", "--N", "64", "--d", "8", "--M", "256", "--method", "execute"]
    assert main(small + ["--progress"]) == 0
    shown = capsys.readouterr()
    assert "executing" in shown.err and "elements" in shown.err      # tqdm's bar, counting HBM elements
    assert "executing" not in shown.out and shown.out.count("execute") == 6
    for quiet in (small + ["--no-progress"], small):                 # the default: only on a terminal
        assert main(quiet) == 0
        assert capsys.readouterr().err == ""


def test_io_block_options(capsys):
    out = run(capsys, "io", "--N", "512", "--d", "16", "--block-sizes", "32", "16", "--M", "4096",
              "--block-sparsity", "0.5")
    assert "32 × 16" in out and "block-sparse s = 0.5" in out


def test_tour_has_five_sections_of_computed_numbers(capsys):
    out = run(capsys, "tour")
    for number in range(1, 6):
        assert re.search(rf"^\({number}\) ", out, flags=re.MULTILINE), f"section ({number}) missing"
    report = simulate_io(TOUR_N, TOUR_D, TOUR_M)
    std = report.row("standard", "forward").total + report.row("standard", "backward").total
    assert f"standard {std:,}" in out                                   # (1): computed, not typed
    causal = simulate_io(TOUR_N, TOUR_D, TOUR_M, causal=True).row("flash2", "forward")
    assert f"{causal.blocks_visited:,} of {causal.blocks_total:,} blocks visited" in out     # (4)
    # (3): the exactness table shows float64-level errors for both algorithms
    errors = [float(x) for x in re.findall(r"(\d\.\de-\d\d)", out.split("(3)")[1].split("(4)")[0])]
    assert len(errors) == 10 and max(errors) < 1e-10
    assert "Double M" in out and "Double N" in out                     # (2)
    assert "fa2edu io --help" in out                                    # (5)


def test_errata_and_version(capsys):
    out = run(capsys, "errata")
    assert out.count("Erratum") == 11 and "WRONG" in out
    assert "Not computed: 11 (" in out and "Not computed: 13 (" in out   # the numbers not checked, and why
    assert run(capsys, "version").strip() == f"fa2edu {fa2edu.__version__}"
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert fa2edu.__version__ in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert "io" in run(capsys)


@pytest.mark.parametrize("argv, message", [
    (["io", "--N", "0"], "--N: must be at least 1"),
    (["io", "--N", "ten"], "--N: expected a positive integer"),
    (["io", "--d", "64", "--M", "100"], "M = 100 is too small for d = 64"),
    (["io", "--block-sparsity", "2"], "--block-sparsity: must lie in (0, 1]"),
    (["io", "--N", "64", "--d", "8", "--M", "256", "--block-sizes", "64", "64"], "SRAM"),
    (["io", "--device", "Z80"], "--device: invalid choice"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_with_a_clear_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["io", "--d", "64", "--M", "100"],                                    # found by simulate_io, after parsing
    ["io", "--N", "64", "--d", "8", "--M", "256", "--block-sizes", "64", "64"],
    ["io", "--N", "0"],                                                   # found by argparse
])
def test_io_errors_print_the_io_usage_not_the_top_level_one(capsys, argv):
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert err.startswith("usage: fa2edu io [-h]") and "--block-sizes" in err
    assert "fa2edu io: error: " in err and "{io,tour,errata,version}" not in err
