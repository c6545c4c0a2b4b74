#!/usr/bin/env bash
# One call on a lent H100/H200 for the Hopper ladder: the rungs' resources, the GPU tests of the instructions and
# the rungs, the benchmark grid, the timeline of clock stamps, Nsight Compute's view of one launch per rung,
# compute-sanitizer, the PyTorch op's GPU tests, and the FP8 rung (its GPU tests, then its speed beside bf16 and
# its error study: `fp8`). Each step under `timeout`, logged under $OUT; the checkout on
# PYTHONPATH. STEPS picks the steps (default: resources tests bench), in the order given.
#   STEPS="tests timeline bench" TEST_K=h4 BENCH_ARGS="--d 128 --N 4096" bash benchmarks/hopper_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FA2EDU_GPU=1
unset NUMBA_ENABLE_CUDASIM
STEPS="${STEPS:-resources tests bench}"
step() {
    case "$1" in
    resources) timeout "${T_RES:-120}" python3 -m benchmarks.profilers.hopper_resources --d "${RES_D:-64,128,256}" ;;
    tests) timeout "${T_TESTS:-240}" python3 -m pytest -m gpu tests/gpu/test_hopper_gpu.py -q --maxfail=${MAXFAIL:-8} \
        -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/hopper_gpu_tests.log" | tail -25 ;;
    bench) timeout "${T_BENCH:-300}" python3 -m benchmarks.hopper --out "$OUT/${BENCH_NAME:-hopper_forward}.json" \
        ${BENCH_ARGS:-} 2>&1 | grep -v "it/s" | tail -80 ;;
    timeline) timeout "${T_TIME:-150}" python3 -m benchmarks.hopper_timeline --out "$OUT/hopper_timeline.json" \
        --rungs "${TIME_RUNGS:-h2,h5,h6}" ;;
    ncu) timeout "${T_NCU:-150}" ncu --clock-control none --kernel-name regex:flash_forward_h --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
        python3 -m benchmarks.profilers.hopper_ncu --rungs "${NCU_RUNGS:-h2,h5,h6}" > "$OUT/hopper_ncu.log" 2>&1
        tail -5 "$OUT/hopper_ncu.log" ;;
    sanitize) for tool in memcheck racecheck synccheck; do
            extra=(); [[ $tool == memcheck ]] && extra=(--report-api-errors no)
            timeout "${T_SAN:-100}" compute-sanitizer --tool $tool "${extra[@]}" python3 -m benchmarks.profilers.hopper_sanitize \
                --rungs "${SAN_RUNGS:-h1,h2,h5,h6,b1,b2,b3}" 2>&1 | tee -a "$OUT/hopper_sanitizer.log" | tail -4
        done ;;
    backward) timeout "${T_BWD:-200}" python3 -m benchmarks.tensorcore_backward --out "$OUT/${BWD_NAME:-hopper_backward}.json" \
        --impls "${BWD_IMPLS:-hopper_b1,hopper_b2,hopper_b3,v7,sdpa_default,sdpa_flash}" ${BWD_ARGS:-} 2>&1 | grep -v "it/s" | tail -40 ;;
    fp8) timeout "${T_FP8_TESTS:-240}" python3 -m pytest -m gpu tests/gpu/test_hopper_fp8_gpu.py -q -p no:cacheprovider \
        --maxfail=${MAXFAIL:-8} 2>&1 | tee "$OUT/hopper_fp8_gpu_tests.log" | tail -15
        timeout "${T_FP8:-420}" python3 -m benchmarks.hopper --fp8 --out "$OUT/${BENCH_NAME:-hopper_forward}.json" \
        ${FP8_ARGS:-} 2>&1 | grep -v "it/s" | tee "$OUT/hopper_fp8_bench.log" | tail -40 ;;
    torch) timeout "${T_TORCH:-200}" python3 -m pytest -m gpu tests/gpu/test_torch_gpu.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/torch_gpu_tests.log" | tail -15 ;;
    *) echo "unknown step $1" ;;
    esac
}
{
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
for s in $STEPS; do echo "== $s"; step "$s"; done
} 2>&1 | tee "$OUT/hopper_device_run.log"
