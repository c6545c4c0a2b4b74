"""The benchmark harness: FA2's paper grid, timed with CUDA events, against PyTorch baselines.

Modules (lowest first): ``flop_model`` (the FA2 paper's FLOP count), ``results_io`` (record schema, JSON writer),
``torch_allocator`` (numba allocations through PyTorch's allocator, so peak memory is counted one way for every
implementation), ``impls`` (what is timed, and the float64 reference it is checked against) ← ``timing`` (events,
warm-up, median, input rotation, the per-configuration protocol, the CUDA set-up, a run's record) ← the drivers
(``bench_attention``, the CLI; ``fast_kernels``, ``fast_backward``, ``fp16_check``, ``gpt_speed`` …) and ``plot``
(the figures). Imports go one way: no module imports one to its right. Nothing here imports torch or numba.cuda
at import time: ``--help``, the plots and the tests run on a machine without a GPU.
"""
