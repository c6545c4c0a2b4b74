export PYTHONPATH=$PWD FA2EDU_GPU=1; unset NUMBA_ENABLE_CUDASIM
( time timeout 540 python3 -m pytest -q tests/gpu/test_torch_gpu.py ) > $OUT/gpu_tests_torch_op.log 2>&1; tail -4 $OUT/gpu_tests_torch_op.log
