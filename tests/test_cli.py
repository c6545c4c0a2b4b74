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


# -- the small defects of issue 34: help for every subcommand, a page-wide tour, a clear out-of-memory error ------

@pytest.mark.parametrize("command", ["io", "tour", "errata", "version"])
def test_every_subcommand_has_a_description(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]          # usage, blank line, the description, blank line, the options
    assert not description.startswith(("options:", "optional arguments:")), f"{command} --help has no description"
    assert len(description.split()) >= 4


def test_tour_lines_fit_the_page_and_name_both_algorithms(capsys):
    from fa2edu.cli import WIDTH

    out = run(capsys, "tour")
    long = [line for line in out.splitlines() if len(line) > WIDTH]
    assert WIDTH == 96 and not long, long
    report = simulate_io(TOUR_N, TOUR_D, TOUR_M)
    fp16 = fa2edu.hardware.itemsize("float16")
    std = (report.row("standard", "forward").total + report.row("standard", "backward").total) * fp16 / 1e6
    fa2 = (report.row("flash2", "forward").total + report.row("flash2", "backward").total) * fp16 / 1e6
    sentence = " ".join(out.split())                      # the paragraph, unwrapped
    assert f"standard attention moves {std:,.0f} MB" in sentence
    assert f"FlashAttention-2 {fa2:,.1f} MB" in sentence


def test_execute_too_large_for_memory_is_refused_before_allocating(capsys, monkeypatch):
    from fa2edu import cli

    def no_run(*args, **kwargs):
        raise AssertionError("simulate_io ran although the estimate exceeded the memory")

    monkeypatch.setattr(cli, "available_memory", lambda: 10**9)          # 1 GB available
    monkeypatch.setattr(cli, "simulate_io", no_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["io", "--method", "execute", "--N", "100000"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    need = cli.execute_bytes(100_000)
    assert need == 3 * 100_000**2 * 4
    assert f"needs about {cli._format_bytes(need)} of memory" in err and "120.00 GB" in err
    assert "1.00 GB available" in err and "--method closed_form" in err


def test_execute_memory_error_is_reported_not_raised(capsys, monkeypatch):
    import numpy as np

    from fa2edu import cli

    try:                                       # what numpy raises when an allocation fails
        from numpy._core._exceptions import _ArrayMemoryError
    except ImportError:                        # numpy 1.x
        from numpy.core._exceptions import _ArrayMemoryError

    def out_of_memory(*args, **kwargs):
        raise _ArrayMemoryError((4000, 4000), np.dtype(np.float32))

    monkeypatch.setattr(cli, "available_memory", lambda: None)           # no estimate possible: try, then catch
    monkeypatch.setattr(cli, "simulate_io", out_of_memory)
    with pytest.raises(SystemExit) as exit_info:
        main(["io", "--method", "execute", "--N", "4000"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"needs about {cli._format_bytes(cli.execute_bytes(4000))}" in err
    assert "--method closed_form" in err and "available" not in err


def test_execute_estimate_is_the_size_of_a_real_run():
    """The estimate is of the right size: at N = 2,048 the executed run's peak is within 25 % of it (48 MB)."""
    import tracemalloc

    from fa2edu import cli

    tracemalloc.start()
    try:
        simulate_io(2048, 16, 8192, method="execute", algorithms=("standard",))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.8 < peak / cli.execute_bytes(2048) < 1.25


def test_available_memory_is_a_plausible_number():
    from fa2edu import cli

    available = cli.available_memory()
    assert available is None or 0 <= available < 2**50          # bytes, under a petabyte
