"""The benchmark of fa2edu.torch in a model (``benchmarks.gpt_speed``), and the harness it sits in.

* ``gpt_speed`` imports without torch, prints its help, and its ``--dry-run`` trains the three models and times the
  op on the CPU at toy sizes, writing the results file (device, versions, date, every loss curve, tokens/s, the
  op's times) and the figure; ``--plot`` redraws the figure from the file.
* The harness is layered one way: implementations (``impls``) ← ``timing`` ← drivers. Every import between
  ``benchmarks`` modules, top-level or inside a function, is read from the sources and checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def test_gpt_speed_imports_without_torch_and_has_help():
    code = ("import sys; import benchmarks.gpt_speed as g; "
            "assert 'torch' not in sys.modules and 'kernels_gpu' not in sys.modules; g.main(['--help'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--dry-run" in done.stdout and "tokens/s" in done.stdout


def test_gpt_speed_times_a_window_of_at_least_min_seconds():
    from benchmarks import gpt_speed
    calls = []

    def run(attention, steps):                 # a probe: 10 timed steps in 50 ms, so 5 ms a step
        calls.append((attention, steps))
        return {"seconds": 0.05, "timed_steps": steps - 5}

    settings = dict(steps=40, warmup=5, min_seconds=3.0)
    assert gpt_speed.timed_steps(run, settings) == (5 + 600, 0.005) and calls == [("sdpa", 15)]
    assert gpt_speed.timed_steps(run, dict(settings, min_seconds=0.1))[0] == 40      # --steps is the least
    assert gpt_speed.timed_steps(run, dict(settings, min_seconds=0)) == (40, None)   # no probe
    assert len(calls) == 2


def test_gpt_speed_dry_run_writes_results_and_figure(tmp_path, capsys):
    pytest.importorskip("torch")
    from benchmarks import gpt_speed

    assert gpt_speed.main(["--dry-run", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpt_speed.json").read_text())
    assert result["dry_run"] and result["device"] and result["date"] and result["versions"]["torch"]
    steps = gpt_speed.DRY["steps"]
    (entry,) = result["training"]
    assert set(entry["runs"]) == set(gpt_speed.RUNS) and entry["same_initial_weights"]
    for run in entry["runs"].values():
        assert len(run["loss"]) == steps and run["tokens_per_s"] > 0
        assert run["timed_steps"] == steps - gpt_speed.DRY["warmup"]
    # the same initial weights and batches: the three curves start together and stay within the noise bound
    assert entry["runs"]["fa2edu"]["loss"][0] == pytest.approx(entry["runs"]["sdpa"]["loss"][0], abs=1e-5)
    assert entry["within_bound"] and len(entry["bound"]) == steps
    assert [(r["d"], r["causal"]) for r in result["micro"]] == [(8, False), (8, True)]
    for row in result["micro"]:
        assert row["fa2edu"]["ms"] > 0 and row["sdpa"]["ms"] > 0 and row["max_abs_diff_O"] < 1e-5
        assert row["speed_ratio"] == pytest.approx(row["sdpa"]["ms"] / row["fa2edu"]["ms"])
    figure = tmp_path / "gpt_speed.png"
    assert figure.read_bytes()[:8] == PNG
    out = capsys.readouterr().out
    assert "training    d8  float32" in out and "MISSED" not in out          # a dry run is judged against nothing
    figure.unlink()
    assert gpt_speed.main(["--plot", str(tmp_path / "gpt_speed.json")]) == 0 and figure.read_bytes()[:8] == PNG


