#!/usr/bin/env bash
# One call on a lent H100/H200 for the Hopper ladder: the rungs' resources, the GPU tests of the instructions and
# the rungs, then the benchmark grid. Each step under `timeout`, logged under $OUT; the checkout on PYTHONPATH.
#   BENCH_ARGS="--d 128 --N 4096" bash benchmarks/hopper_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FA2EDU_GPU=1
unset NUMBA_ENABLE_CUDASIM
STEPS="${STEPS:-resources tests bench}"
has() { [[ " $STEPS " == *" $1 "* ]]; }
{
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
has resources && timeout "${T_RES:-120}" python3 -m benchmarks.profilers.hopper_resources --d "${RES_D:-64,128,256}"
has tests && timeout "${T_TESTS:-240}" python3 -m pytest -m gpu tests/gpu/test_hopper_gpu.py -q --maxfail=${MAXFAIL:-8} -p no:cacheprovider \
    ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/hopper_gpu_tests.log" | tail -25
has bench && timeout "${T_BENCH:-300}" python3 -m benchmarks.hopper --out "$OUT/${BENCH_NAME:-hopper_forward}.json" \
    ${BENCH_ARGS:-} 2>&1 | grep -v "it/s" | tail -80
} 2>&1 | tee "$OUT/hopper_device_run.log"
