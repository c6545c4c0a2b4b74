#!/usr/bin/env bash
# One call on the lent H100/H200 (≤ 10 minutes of wall time): versions, the GPU test suite, compute-sanitizer
# memcheck and racecheck over kernels_gpu.sanitize, the benchmark sweep and the long-sequence run.
#
#   bash benchmarks/device_run.sh                  # everything, into $OUT (the device tool's output folder)
#   STEPS="sweep long" bash benchmarks/device_run.sh
#   STEPS=sweep SWEEP_NAME=sweep_d128 SWEEP_ARGS="--d 128" T_SWEEP=540 bash benchmarks/device_run.sh
#
# Each step runs under `timeout`, so one hang cannot eat the budget; every step logs with `tee` and the script
# goes on after a failing step. Nothing is installed into the environment: the checkout goes on PYTHONPATH.
# The image already has torch, numba 0.68, numba-cuda 0.30.4, numpy 2.5 (kernels_gpu restores np.row_stack),
# pytest, hypothesis, tqdm and matplotlib (KINDS.md's package list): no wheels need to be carried.
# Files written under $OUT (at most 8 come back): device_run.log, gpu_tests.log, sanitizer.log,
# $SWEEP_NAME.json, long.json.

set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"

STEPS="${STEPS:-versions tests sanitizer sweep long}"
T_TESTS="${T_TESTS:-320}"          # seconds for `pytest -m gpu tests/gpu` (111 tests: 190 s on an H200)
T_SANITIZER="${T_SANITIZER:-55}"   # seconds for each compute-sanitizer tool
T_SWEEP="${T_SWEEP:-170}"          # seconds for the sweep (it stops starting configurations 35 s before)
T_LONG="${T_LONG:-100}"            # seconds for the long-sequence run
SWEEP_NAME="${SWEEP_NAME:-sweep_d64}"
SWEEP_ARGS="${SWEEP_ARGS:---d 64 --target-ms 100 --max-call-ms 1000}"
LONG_ARGS="${LONG_ARGS:-}"
PY="${PY:-python3}"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export FA2EDU_GPU=1                  # tests/conftest.py: real GPU, not numba's simulator
unset NUMBA_ENABLE_CUDASIM

started=$(date +%s)
main() {
step() { echo; echo "=== $1 ($(( $(date +%s) - started )) s since start) ==="; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has versions; then
  step versions
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
  "$PY" - <<'EOF' || true
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "numba", "numba-cuda", "numpy", "llvmlite", "cuda-bindings", "pytest", "hypothesis",
             "tqdm", "matplotlib"):
    try:
        print(f"{name:14s}", md.version(name))
    except md.PackageNotFoundError:
        print(f"{name:14s} MISSING")
import torch
print("torch.cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "L2", getattr(torch.cuda.get_device_properties(0), "L2_cache_size", "?"))
import kernels_gpu  # the np.row_stack shim, and an import check of the package under test
print("kernels_gpu imported from", kernels_gpu.__file__)
EOF
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer || true
fi

if has tests; then
  step "GPU tests (timeout ${T_TESTS} s)"
  timeout -k 10 "$T_TESTS" "$PY" -m pytest -m gpu tests/gpu -x -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  echo "gpu tests exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
fi

if has sanitizer; then
  SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool (timeout ${T_SANITIZER} s)"
    timeout -k 10 "$T_SANITIZER" "$SAN" --tool "$tool" --error-exitcode 9 "$PY" -m kernels_gpu.sanitize 2>&1 \
      | tee -a "$OUT/sanitizer.log"
    echo "compute-sanitizer $tool exit status: ${PIPESTATUS[0]} (0 clean, 9 errors found, 124 timed out)" \
      | tee -a "$OUT/sanitizer.log"
  done
fi

if has sweep; then
  step "benchmark sweep $SWEEP_NAME (timeout ${T_SWEEP} s)"
  # shellcheck disable=SC2086
  timeout -k 10 "$T_SWEEP" "$PY" -m benchmarks.bench_attention $SWEEP_ARGS --budget-s $(( T_SWEEP - 35 )) \
    --name "$SWEEP_NAME" --out "$OUT/$SWEEP_NAME.json"
  echo "sweep exit status: $?"
fi

if has long; then
  step "long-sequence run (timeout ${T_LONG} s)"
  # shellcheck disable=SC2086
  timeout -k 10 "$T_LONG" "$PY" -m benchmarks.bench_attention --long $LONG_ARGS --no-ceilings \
    --out "$OUT/long.json"
  echo "long exit status: $?"
fi

step summary
[ -f "$OUT/gpu_tests.log" ] && grep -E "passed|failed|error|exit status" "$OUT/gpu_tests.log" | tail -3
[ -f "$OUT/sanitizer.log" ] && grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit status" "$OUT/sanitizer.log"
for f in "$OUT/$SWEEP_NAME.json" "$OUT/long.json"; do
  [ -f "$f" ] && "$PY" -m benchmarks.bench_attention --show "$f"
done
echo "done in $(( $(date +%s) - started )) s; files in $OUT:"; ls -la "$OUT"
}

main 2>&1 | tee -a "$OUT/device_run.log"
