"""benchmarks.context_parallel on the GPUs of the machine, small sizes: the NCCL path of the multi-GPU script.

It starts one process per visible GPU (at most 2 here), checks every ring against one-device attention, times
strong and weak scaling for W = 1 (and 2 with two GPUs), and records the simulator's predictions and what it
could not run. Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_context_parallel_benchmark_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_small_on_the_visible_gpus(tmp_path):
    gpus = min(2, torch.cuda.device_count())
    out = tmp_path / "cp.json"
    command = [sys.executable, "-m", "benchmarks.context_parallel", "--out", str(out), "--nprocs", str(gpus),
               "--world-sizes", "1,2,4", "--strong-N", "2048", "--weak-N", "1024", "--d", "64", "--heads", "4",
               "--dtypes", "bfloat16,float32", "--repeats", "2", "--check-local", "256", "--link-mib", "16",
               "--timeout-s", "180", "--budget-s", "240"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0")
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    payload = json.loads(out.read_text())
    header, records, summary = payload["header"], payload["records"], payload["summary"]
    assert header["backend"] == "nccl" and header["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert all(c["status"] == "ok" for c in summary["checks"]), summary["checks"]
    rings = [r for r in records if r["kind"] == "ring"]
    assert rings and all(r["status"] == "ok" for r in rings), [r for r in rings if r["status"] != "ok"]
    assert {r["world_size"] for r in rings} == set(range(1, gpus + 1)) & {1, 2}
    assert any(item.get("world_size") == 4 for item in summary["not_run"])
    assert all(r["status"] == "ok" for r in records if r["kind"] == "single")
