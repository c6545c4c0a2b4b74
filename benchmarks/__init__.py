"""The benchmark harness: FA2's paper grid, timed with CUDA events, against PyTorch baselines.

Modules (lowest first): ``flop_model`` (the FA2 paper's FLOP count), ``results_io`` (record schema, JSON writer),
``timing`` (events, warm-up, median, input rotation, the per-configuration protocol), ``torch_allocator`` (numba
allocations through PyTorch's allocator, so peak memory is counted one way for every implementation),
``impls`` (what is timed, and the float64 reference it is checked against) ← ``bench_attention`` (the CLI) and
``plot`` (the figures). Nothing here imports torch or numba.cuda at import time: ``--help``, the plots and the
tests run on a machine without a GPU.
"""
