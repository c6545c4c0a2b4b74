"""One-off measurements and profilers: what a kernel's time is made of, and the A/B runs behind each decision.

Each module answers one question for one kernel family and writes its own results file (the benchmarks README
lists them): where a decoding call's host time goes (``decode_host``), what the merge launch costs
(``decode_merge_cost``), which knob of the decoding program wins (``decode_variants``), tile and variant sweeps of
the tensor-core ladder (``tensorcore_tiles``, ``tensorcore_variants``, ``tensorcore_backward_tiles``), Nsight
Compute and torch.profiler runs (``profile_*``, ``gpt_step_profile``, ``sdpa_fp32_pipes``), launch and host
overheads (``launch_overhead``, ``op_host_time``, ``op_kernels``) and which dtype SDPA's baselines run in
(``sdpa_baseline_dtype``). They build on the harness and on the drivers; nothing imports them.
"""
