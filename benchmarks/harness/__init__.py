"""The machinery every benchmark driver shares, and the readers of its results.

Layered one way, bottom first: :mod:`~benchmarks.harness.impls` (what is timed: fa2edu's kernels and PyTorch's
baselines behind one calling convention), :mod:`~benchmarks.harness.flop_model` (the FA2 paper's FLOP count),
:mod:`~benchmarks.harness.results_io` (a run's JSON record: device, versions, date),
:mod:`~benchmarks.harness.torch_allocator`, then :mod:`~benchmarks.harness.timing` (the protocol: check first,
CUDA events, warm-up, inputs rotated past the L2 cache, the median). The readers sit on
:mod:`~benchmarks.harness.results_io` only: :mod:`~benchmarks.harness.plot` and
:mod:`~benchmarks.harness.check_targets` (commands), :mod:`~benchmarks.harness.book` and
:mod:`~benchmarks.harness.tensorcore_book` (what the chapters read from the results files). Nothing here imports a
driver (``benchmarks/*.py``) or a profiler (``benchmarks/profilers``).
"""
