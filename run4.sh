#!/usr/bin/env bash
set -u
export PYTHONPATH=$PWD FA2EDU_GPU=1
unset NUMBA_ENABLE_CUDASIM
python3 -m benchmarks.tensorcore_backward_tiles --rung v4 --tiles 4x32 4x64 --d 128 64 --out $OUT/tensorcore_backward_tiles_v4.json > $OUT/tiles_v4.log 2>&1; echo "tiles v4 rc $?"
python3 -m benchmarks.tensorcore_backward_tiles --rung v5 --tiles 4x32 4x64 8x64 8x32 --d 128 64 --out $OUT/tensorcore_backward_tiles_v5.json > $OUT/tiles_v5.log 2>&1; echo "tiles v5 rc $?"
cat $OUT/tiles_v4.log $OUT/tiles_v5.log | sed 's/.*\r//' | grep -a " ms" 
compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python3 -m kernels_gpu.tensorcore.sanitize bwd_v5 > $OUT/sanitizer_tensorcore_bwd_v5_memcheck.log 2>&1; echo "memcheck rc $?"
tail -2 $OUT/sanitizer_tensorcore_bwd_v5_memcheck.log
( time python3 -m pytest -m gpu -q tests/gpu/test_tensorcore_backward_gpu.py -k "v5 or fastest or bit_identical_to_v3" ) > $OUT/gpu_tests_tensorcore_backward_v5.log 2>&1
tail -3 $OUT/gpu_tests_tensorcore_backward_v5.log
