#!/usr/bin/env bash
# Issue 39 on a lent nvidia-h200-x4 (or x2): the NCCL GPU tests of the ring for W = 2 and 4, then
# benchmarks.context_parallel at its defaults (W = 1, 2, 4; strong N = 131072, weak N_local = 32768; H = 16,
# d = 128; causal; both layouts; forward and forward+backward; fa2edu's ring and PyTorch's context parallelism;
# SDPA on one GPU) in parts that each fit a command's 10 minutes, merged into one results file. Each step under
# `timeout`, logged under $OUT; NVLink multicast off; the checkout on PYTHONPATH. STEPS picks the steps, in order.
# The predictions (benchmarks/results/predictions/ring_predictions_h200_training.json) estimate the timed parts:
# bf16 both passes ~60 s, fp32 forward ~80 s, fp32 forward+backward ~320 s on four GPUs, plus compilation and
# checks. So two calls:
#   STEPS="tests bench16 bench32f" bash benchmarks/context_parallel_device_run.sh
#   STEPS="bench32b merge" bash benchmarks/context_parallel_device_run.sh     # same $OUT: merges the three parts
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FA2EDU_GPU=1 NCCL_NVLS_ENABLE=0
unset NUMBA_ENABLE_CUDASIM
STEPS="${STEPS:-tests bench16 bench32f bench32b merge}"
NAME="${NAME:-context_parallel_4gpu_training}"
BENCH=(python3 -m benchmarks.context_parallel --world-sizes "${WORLD_SIZES:-1,2,4}" --timeout-s "${T_COLL:-240}")
step() {
    case "$1" in
    tests) FA2EDU_NCCL_WORLD_SIZES="${TEST_W:-2,4}" timeout "${T_TESTS:-540}" python3 -m pytest -m gpu \
        tests/gpu/test_distributed_nccl.py -q -p no:cacheprovider 2>&1 | tee "$OUT/distributed_nccl_w24.log" | tail -25 ;;
    bench16) timeout "${T_BENCH:-560}" "${BENCH[@]}" --dtypes bfloat16 --budget-s "${BUDGET:-420}" \
        --out "$OUT/${NAME}_bf16.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/${NAME}_bf16.log" | tail -60 ;;
    bench32f) timeout "${T_BENCH:-560}" "${BENCH[@]}" --dtypes float32 --passes forward --budget-s "${BUDGET:-420}" \
        --out "$OUT/${NAME}_fp32_forward.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/${NAME}_fp32_forward.log" | tail -40 ;;
    bench32b) timeout "${T_BENCH:-580}" "${BENCH[@]}" --dtypes float32 --passes backward --budget-s "${BUDGET:-440}" \
        --out "$OUT/${NAME}_fp32_backward.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/${NAME}_fp32_backward.log" | tail -40 ;;
    merge) parts=(); for p in bf16 fp32_forward fp32_backward; do
            [[ -f "$OUT/${NAME}_$p.json" ]] && parts+=("$OUT/${NAME}_$p.json"); done
        python3 -m benchmarks.context_parallel --out "$OUT/$NAME.json" --merge "${parts[@]}" 2>&1 \
            | tee "$OUT/$NAME.log" | tail -30 ;;
    *) echo "unknown step $1" ;;
    esac
}
{
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
nvidia-smi topo -m
for s in $STEPS; do echo "== $s"; step "$s"; done
} 2>&1 | tee -a "$OUT/context_parallel_device_run.log"
