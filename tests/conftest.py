"""Hypothesis profiles: no deadline (NumPy tiling is slow by design); CI bounds the example count."""

import os

# kernels_gpu: numba's CUDA simulator unless FA2EDU_GPU=1 asks for the real GPU (set before numba is imported).
# Tests marked `gpu` run only with FA2EDU_GPU=1 (`FA2EDU_GPU=1 pytest -m gpu tests/gpu`); otherwise they are skipped.
if os.environ.get("FA2EDU_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FA2EDU_GPU") == "1":
        return
    import pytest
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
