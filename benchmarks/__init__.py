"""The benchmarks: fa2edu's kernels timed on a GPU beside PyTorch's, and the results files the book reads.

Three parts, imports going one way (``tests/test_layering.py``): :mod:`benchmarks.harness` (the measurement
protocol, what is timed, the FLOP model, the results files and their readers), the drivers in this package (one per
subject: ``bench_attention``, ``fast_kernels``, ``tensorcore``, ``decode``, ``gpt_speed``, ``context_parallel`` …,
each ``python -m benchmarks.NAME``, each producing a committed results file) and :mod:`benchmarks.profilers`
(one-off measurements and A/B runs). Nothing here imports torch or numba.cuda at import time: ``--help``, the plots
and the tests run on a machine without a GPU. ``benchmarks/README.md`` is the index.
"""
