"""Where the host time of a decoding call goes, piece by piece, beside SDPA's: what a step pays when it is not
captured in a CUDA graph.

    python -m benchmarks.profilers.decode_host \
        --out benchmarks/results/<device>/decode_host_breakdown.json [--profile 2000]

For each shape (the :mod:`benchmarks.decode` grid's H_q = 32, H_kv = 8, d = 128, float16, contiguous cache), after
warm-up calls (so the call finds its :class:`kernels_gpu.inference.decode.DecodePlan`): the median host time
(``perf_counter`` around one call, the GPU idle before it; 400 calls) of

* ``call``: :func:`kernels_gpu.decode_attention`, whole;
* ``plan_key``, ``plan_call``: the plan's cache key, and the plan's own call (outputs, maps, launches);
* ``allocations``: the plan's ``torch.empty`` calls alone (O, L and, with splits, the partials);
* ``maps``: finding the tensor maps of the caches (:meth:`kernels_gpu.tensor_map.DeviceMaps.pointers`);
* ``launch_split``, ``launch_merge``: one prepared launch each (:class:`kernels_gpu.driver_launch.Prepared`);
  ``launch_split_cuda_bindings``, ``launch_split_cuda_core``: the driver call alone, its parameter words as they
  are (no addresses written, no lock), through ``cuda.bindings``' ``cuLaunchKernelEx`` and through
  ``cuda.core.launch`` (the words handed over one by one, as Prepared did before);
* ``sdpa_<backend>``: ``scaled_dot_product_attention`` under ``sdpa_kernel(<backend>)``, as
  :mod:`benchmarks.decode` calls it; ``sdpa_default``: the same call without the context manager (PyTorch picks
  the backend); ``sdpa_kernel_context``: entering and leaving the context manager alone.

and, between CUDA events (the harness's ``call`` mode: the GPU waits for the host), one call of ours and of SDPA's
default dispatch. ``--profile N``: the 30 costliest functions (own time) over N calls of ours, by cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

SHAPES = ((1, 16384), (32, 4096))


def host_us(torch, fn, calls: int = 400) -> float:
    """Median host time of one call, the GPU idle before each."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(1e6 * statistics.median(times), 2)


def event_us(torch, fn, calls: int = 50) -> float:
    """Median time of one call between two CUDA events (host work the GPU waits for included)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return round(statistics.median(times), 2)


def bindings_launcher(prepared, stream: int):
    """The driver call alone of ``prepared``: ``cuda.bindings``' cuLaunchKernelEx with its parameter words and its
    launch configuration for ``stream`` as they are."""
    config = prepared.configs.get(stream) or prepared._config(stream)
    return lambda: prepared.driver.cuLaunchKernelEx(config, prepared.func, prepared.address, 0)


def core_launcher(prepared, stream: int):
    """A call of ``prepared`` through ``cuda.core.launch``, the parameter words handed over one by one."""
    import ctypes

    from cuda.core import LaunchConfig, launch

    from kernels_gpu import driver_launch
    grid, block, shared = prepared.dims
    config = LaunchConfig(grid=grid, block=block, shmem_size=shared)
    words = [w.value if isinstance(w, ctypes.c_int64) else w for w in prepared.words]
    on = driver_launch._core_stream(stream)
    return lambda: launch(on, config, prepared.kernel, *words)


def breakdown(torch, batch: int, context: int, profile: int = 0) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernels_gpu
    from benchmarks import decode as bench
    from kernels_gpu import driver_launch
    from kernels_gpu.inference import decode

    s = bench.make_sets(torch, batch, context, bench.PAGE, 1, seed=0)[0]
    q, k, v, seqlens = s["q"], s["k"], s["v"], s["seqlens"]

    def ours():
        return kernels_gpu.decode_attention(q, k, v, seqlens, block_size=bench.PAGE)
    for _ in range(3):
        ours()
    key = decode._plan_key(q, k, v, seqlens, None, True, None, None, bench.PAGE, None, None)
    plan = decode._PLANS.get(key)
    if plan is None:
        raise RuntimeError("the call made no plan (driver-level launches off?)")
    r = dict(batch=batch, context=context, splits=plan.partials // max(1, batch * bench.H_Q) or 1)
    r["call"] = host_us(torch, ours)
    r["plan_key"] = host_us(torch, lambda: decode._plan_key(q, k, v, seqlens, None, True, None, None, bench.PAGE,
                                                            None, None))
    r["plan_call"] = host_us(torch, lambda: plan(q, k, v, seqlens, None))

    def allocations():
        torch.empty(plan.o_shape, dtype=plan.dtype, device=plan.device)
        torch.empty(plan.l_shape, dtype=torch.float32, device=plan.device)
        if plan.partials:
            torch.empty(plan.partials * (plan.d_v + 1), dtype=torch.float32, device=plan.device)
    r["allocations"] = host_us(torch, allocations)
    if plan.no_maps is None:
        r["maps"] = host_us(torch, lambda: plan._maps(k.data_ptr(), v.data_ptr()))
        maps = plan._maps(k.data_ptr(), v.data_ptr())
    else:
        maps = plan.no_maps
    O, L = ours()
    P = torch.empty(max(plan.partials, 1) * (plan.d_v + 1), dtype=torch.float32, device=plan.device)
    op, lp = P.data_ptr(), P.data_ptr() + 4 * max(plan.partials, 1) * plan.d_v
    stream = driver_launch.current_stream(plan.device.index)
    split = (stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), seqlens.data_ptr(), seqlens.data_ptr(),
             O.data_ptr(), L.data_ptr(), op, lp, *maps)
    r["launch_split"] = host_us(torch, lambda: plan.launches[0](*split))
    if plan.partials:
        r["launch_merge"] = host_us(torch, lambda: plan.launches[1](stream, op, lp, O.data_ptr(), L.data_ptr()))
    # the same split launch, its words packed once, through cuda.bindings' cuLaunchKernelEx and through
    # cuda.core.launch (how Prepared launched before)
    prepared = plan.launches[0]
    r["launch_split_cuda_bindings"] = host_us(torch, bindings_launcher(prepared, stream))
    r["launch_split_cuda_core"] = host_us(torch, core_launcher(prepared, stream))
    for backend in bench.SDPA_BACKENDS[:-1]:            # (not math)
        fn = bench._sdpa(torch, backend)
        try:
            fn(s)
        except RuntimeError as e:
            r[f"sdpa_{backend}"] = f"error: {str(e).splitlines()[0][:120]}"
            continue
        r[f"sdpa_{backend}"] = host_us(torch, lambda fn=fn: fn(s))

    def sdpa_default():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    r["sdpa_default"] = host_us(torch, sdpa_default)

    def context_only():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            pass
    r["sdpa_kernel_context"] = host_us(torch, context_only)
    r["event_call"] = event_us(torch, ours)
    r["event_sdpa_default"] = event_us(torch, sdpa_default)
    r["event_sdpa_cudnn"] = event_us(torch, lambda: bench._sdpa(torch, "cudnn")(s))
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(profile):
            ours()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        r["profile"] = text.getvalue()
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="CALLS")
    a = p.parse_args(argv)
    from benchmarks.harness.results_io import write_measurement
    from benchmarks.harness.timing import cuda_setup, package_versions
    cuda_setup(use_torch_allocator=False)
    import torch
    rows = []
    for batch, context in SHAPES:
        r = breakdown(torch, batch, context, a.profile)
        rows.append(r)
        print({key: val for key, val in r.items() if key != "profile"}, flush=True)
        if "profile" in r:
            print(r["profile"][:5000], flush=True)
    write_measurement(a.out, "fa2edu.decode_host/1", rows, device=torch.cuda.get_device_name(0),
                      versions=package_versions(), unit="microseconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
