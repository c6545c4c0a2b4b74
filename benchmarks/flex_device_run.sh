#!/usr/bin/env bash
# One call on a lent H100/H200 for FlexAttention (issue 38): the GPU tests of the op's CUDA route
# (tests/gpu/test_flex_gpu.py) and the harness (benchmarks/flex.py: every ready mod, fa2edu beside PyTorch's compiled
# FlexAttention and SDPA, bf16, d = 64 and 128, N 4096-16384), each step under `timeout`, logged under $OUT; the
# checkout on PYTHONPATH, nothing installed. STEPS picks the steps (default: versions tests bench), in that order.
#   bash benchmarks/flex_device_run.sh          # planned for one 600 s call (not yet run: split with BENCH_ARGS)
#   STEPS="bench" BENCH_ARGS="--d 128 --N 16384 --mods causal,sliding_window" bash benchmarks/flex_device_run.sh
# Then, with no GPU: mkdir -p benchmarks/results/<device>; cp FILES_AT/flex_bf16.json FILES_AT/*.log there;
# python -m benchmarks.flex --plot benchmarks/results/<device>/flex_bf16.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FA2EDU_GPU=1 NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0
unset NUMBA_ENABLE_CUDASIM
STEPS="${STEPS:-versions tests bench}"
step() {
    case "$1" in
    versions) python3 -c "import sys, torch, numba, numpy; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'numba', numba.__version__, 'numba-cuda', __import__('numba_cuda').__version__,
'numpy', numpy.__version__)" ;;
    tests) timeout "${T_TESTS:-300}" python3 -m pytest -m gpu tests/gpu/test_flex_gpu.py -q --maxfail=${MAXFAIL:-10} \
        -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/flex_gpu_tests.log" | tail -30 ;;
    bench) timeout "${T_BENCH:-280}" python3 -m benchmarks.flex --out "$OUT/${BENCH_NAME:-flex_bf16}.json" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/flex_bench.log" | tail -60 ;;
    *) echo "unknown step $1" ;;
    esac
}
{
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
for s in $STEPS; do echo "== $s"; step "$s"; done
} 2>&1 | tee "$OUT/flex_device_run.log"
