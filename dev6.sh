export PYTHONPATH=$PWD FA2EDU_GPU=1; unset NUMBA_ENABLE_CUDASIM
for r in v5 v7; do
  python3 -m benchmarks.tensorcore_backward_tiles --rung $r --tiles 4x32 --d 128 --full --out $OUT/tiles_full_$r.json > $OUT/tiles_full_$r.log 2>&1
  grep "d=128" $OUT/tiles_full_$r.log | tail -3
done
