export PYTHONPATH=$PWD FA2EDU_GPU=1; unset NUMBA_ENABLE_CUDASIM
timeout 330 python3 -m pytest -q tests/gpu/test_torch_gpu.py > $OUT/gpu_tests_torch_op.log 2>&1; tail -2 $OUT/gpu_tests_torch_op.log
timeout 240 python3 -m benchmarks.tensorcore_backward --impls v5,v7,sdpa_flash --dtypes bfloat16 --causal 0,1 --d 64,128 --N 1024,4096,8192 --out $OUT/tensorcore_backward_v7.json > $OUT/tensorcore_backward_v7.log 2>&1; tail -3 $OUT/tensorcore_backward_v7.log
