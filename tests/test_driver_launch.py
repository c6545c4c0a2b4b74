"""kernels_gpu.driver_launch without a GPU: the parameter layout it packs is numba's, views and reshapes keep the
address, and bad uses are refused clearly. (The launch itself is compared with numba's on the GPU:
tests/gpu/test_tensorcore_gpu.py and tests/gpu/test_decode_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

torch = pytest.importorskip("torch")

from kernels_gpu import driver_launch  # noqa: E402
from kernels_gpu.driver_launch import Buffer  # noqa: E402


def test_params_follow_numbas_array_layout():
    b = Buffer(0x7F00_0000_1000, (2, 3, 5, 4), np.uint32)
    # meminfo, parent, nitems, itemsize, data, shape, strides (bytes, C order)
    assert b.params() == [0, 0, 120, 4, 0x7F00_0000_1000, 2, 3, 5, 4, 240, 80, 16, 4]
    from numba.cuda import types
    assert b.numba_type() == types.Array(types.uint32, 4, "C")


def test_strided_buffer_is_typed_any_layout():
    b = Buffer(4096, (3, 4), np.float32, strides=(64, 4))
    assert not b.contiguous and b.numba_type().layout == "A"
    assert b.params()[-2:] == [64, 4]
    with pytest.raises(ValueError, match="contiguous"):
        b.reshape(-1)


@pytest.mark.parametrize("dtype, words", [(torch.float16, 32), (torch.bfloat16, 32), (torch.float32, 64)])
def test_torch_memory_seen_as_words(dtype, words):
    t = torch.zeros(2, 3, 5, 64, dtype=dtype)
    b = Buffer.of_torch(t, np.uint32)
    assert b.ptr == t.data_ptr() and b.shape == (2, 3, 5, words) and b.keep is t
    flat = b.reshape(-1)
    assert flat.shape == (2 * 3 * 5 * words,) and flat.ptr == b.ptr and flat.keep is t
    assert b.reshape(6, 5, words).params()[5:8] == [6, 5, words]


def test_bad_uses_are_refused():
    t = torch.zeros(4, 6, dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        Buffer.of_torch(t.t(), np.uint32)
    with pytest.raises(ValueError, match="whole number"):
        Buffer.of_torch(torch.zeros(3, 5, dtype=torch.float16), np.uint32)
    with pytest.raises(ValueError, match="cannot reshape"):
        Buffer(0, (4, 6), np.float32).reshape(5, 5)
    with pytest.raises(TypeError, match="NumPy int32, int64 or float32"):
        driver_launch._numba_type(3)


def test_shared_memory_above_the_limit_is_a_clear_error():
    with pytest.raises(ValueError, match="bytes of shared memory"):
        driver_launch.raise_shared_limit(None, (), driver_launch.MAX_DYNAMIC_BYTES + 4)


@cuda.jit
def add_one(x, n):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < n:
        x[i] += 1.0


def test_simulator_path_launches_numba_arrays():
    x = cuda.to_device(np.arange(10, dtype=np.float32))
    driver_launch.launch(add_one, 1, 16, 0, (x, np.int32(10)))
    np.testing.assert_array_equal(x.copy_to_host(), np.arange(10, dtype=np.float32) + 1)


def test_plan_cache_keeps_the_most_recently_used():
    cache = driver_launch.PlanCache(maxsize=2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1                     # "a" is now the most recently used ...
    cache["c"] = 3                                  # ... so "b" goes
    assert list(cache) == ["a", "c"] and cache.get("b") is None and cache.get("b", 0) == 0
    cache["a"] = 4                                  # a new value for a kept key counts as a use
    cache["d"] = 5
    assert dict(cache) == {"a": 4, "d": 5}
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="maxsize"):
        driver_launch.PlanCache(0)

