"""Hypothesis profiles: no deadline (NumPy tiling is slow by design); CI bounds the example count. The
``ptx_calls`` fixture: which warp-level instructions a simulated kernel issued, and with what."""

import os
import sys

import pytest

# numba's CUDA simulator runs each CUDA thread as a Python thread, and the PTX twins make a warp's 32 threads meet
# at barriers: a GIL switch interval of 0.5 ms instead of Python's 5 ms lets woken threads through sooner (a
# simulated fast-kernel launch here: 3.7 s → 2.7 s; the tensor-core backward about 1.5×). It changes scheduling only.
sys.setswitchinterval(5e-4)

# kernels_gpu: numba's CUDA simulator unless FA2EDU_GPU=1 asks for the real GPU (set before numba is imported).
# Tests marked `gpu` run only with FA2EDU_GPU=1 (`FA2EDU_GPU=1 pytest -m gpu tests/gpu`); otherwise they are skipped.
if os.environ.get("FA2EDU_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


#: The `slow` tier: what runs the fast, tensor-core and inference kernels in numba's CUDA simulator, executes the
#: book, builds the docs or starts several processes. `pytest -m "not slow"` leaves it out: the NumPy textbook, the
#: teaching kernels in the simulator, the exercises, the CLI, the formats and the guards, in about a minute on
#: two cores (a contributor's loop); the full suite runs everything.
SLOW_FILES = ("test_kernels_fast", "test_kernels_decode", "test_tensorcore", "test_docs_build", "test_distributed",
              "test_torch_dispatch", "test_book_route", "test_hopper_kernels", "test_kernels_flex")
SLOW_TESTS = ("test_chapters.py::test_chapter_executes",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.nodeid.split("/")[-1]
        if name.startswith(SLOW_FILES) or any(name.startswith(test) for test in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("FA2EDU_GPU") == "1":
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run `FA2EDU_GPU=1 pytest -m gpu tests/gpu` on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", deadline=None, max_examples=500,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def ptx_calls(monkeypatch):
    """``ptx_calls("bulk_copy")`` → a list that, from then on, receives the arguments of every call of that
    :mod:`kernels_gpu.ptx` function (in the simulator, its twin, which still runs): how a test sees
    which copies or reductions a kernel really issued."""
    from kernels_gpu import ptx

    def spy(name: str) -> list:
        calls, original = [], getattr(ptx, name)

        def recorded(*args):
            calls.append(args)
            return original(*args)
        monkeypatch.setattr(ptx, name, recorded)
        return calls
    return spy
