"""FA2 Section 3.3 in numba's CUDA simulator: the split-K (FA1) and split-Q (FA2) tensor-core forwards against the
float64 oracle, and their shared-memory traffic — :func:`kernels_gpu.tensorcore.traffic.shared_memory_traffic`
checked against the bytes the kernels really move, counted access by access in the simulator."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kernels_gpu import ptx
from kernels_gpu.tensorcore import PARTITIONING, launch
from kernels_gpu.tensorcore import flash2_forward_splitk as splitk
from kernels_gpu.tensorcore import flash2_forward_splitq as splitq
from kernels_gpu.tensorcore.traffic import shared_memory_traffic

torch = pytest.importorskip("torch")
from test_tensorcore import _inputs, flash_attn_rule  # noqa: E402  (the oracle rule of the ladder's tests)

CASES = [  # (Q shape, K/V shape, causal, dtype)
    ((1, 2, 37, 24), (1, 1, 50, 24), True, "float16"),        # GQA, N_q < N_k, bottom-right causal, d % 16 = 8
    ((1, 1, 70, 16), (1, 1, 90, 16), False, "bfloat16"),      # ragged: two row blocks, two K/V tiles, both partial
    ((1, 1, 64, 16), (1, 1, 4, 16), True, "float16"),         # N_q > N_k causal: 60 rows see no key
]
IDS = ["gqa-causal-f16", "ragged-bf16", "masked-rows-f16"]


@pytest.fixture
def poisoned(monkeypatch):
    import kernels_gpu.runtime as rt
    monkeypatch.setattr(rt, "poison_outputs", True)


def test_registered_by_name():
    assert PARTITIONING == {"split-k": splitk.flash2_forward, "split-q": splitq.flash2_forward}


@pytest.mark.parametrize("variant", ["split-k", "split-q"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_matches_oracle(variant, case, poisoned):
    shape_q, shape_kv, causal, dtype = CASES[case]
    Q, K, V = _inputs(shape_q, shape_kv, dtype, seed=10 + case)
    O, L = PARTITIONING[variant](Q, K, V, causal=causal)
    assert O.dtype == Q.dtype and O.shape == Q.shape and L.shape == Q.shape[:-1]
    flash_attn_rule(O, L, Q, K, V, causal)
    if case == 2:
        assert np.isinf(L.numpy()[..., :60]).all()


def test_split_k_extreme_logits(poisoned):
    """Scores in the hundreds: each warp's slice has its own maximum, and the merge's e^(m_w − m) must neither
    overflow nor lose the slice that holds the row's maximum."""
    Q, K, V = _inputs((1, 1, 40, 16), (1, 1, 75, 16), "float16", seed=3, scale=6.0)
    O, L = splitk.flash2_forward(Q, K, V, causal=False)
    flash_attn_rule(O, L, Q, K, V, False)


def test_comparison_limited_to_d_128():
    Q = torch.zeros(1, 8, 136, dtype=torch.float16)
    with pytest.raises(ValueError, match="d ≤ 128"):
        splitk.flash2_forward(Q, Q, Q)


# -- the traffic formula ----------------------------------------------------------------------------------------

def test_exchange_is_split_k_extra():
    """Same tile shape, same copies; split-K's warps load fewer operand bytes (a quarter of K_j and V_j each, all of
    Q_i) and add the exchange, W·B_r·(D + 8) floats written and as many read per tile: more in all."""
    for d in (64, 128, 40):
        q, k = (shared_memory_traffic(v, 4096, 4096, d) for v in ("split-q", "split-k"))
        assert k["per_tile"]["ldmatrix_read"] < q["per_tile"]["ldmatrix_read"]
        assert q["total"]["cp_async_write"] == k["total"]["cp_async_write"]
        assert q["per_tile"]["exchange_write"] == q["per_tile"]["exchange_read"] == 0
        D = -(-d // 16) * 16
        assert k["per_tile"]["exchange_write"] == k["per_tile"]["exchange_read"] == 4 * 64 * (D + 8) * 4
        assert k["total_bytes"] > q["total_bytes"] and k["shared_bytes_per_block"] > q["shared_bytes_per_block"]
    # d = 64, per tile and block: split-Q 16 KiB copied in + 72 KiB of operand loads; split-K 16 + 48 + 72 + 72
    q, k = (shared_memory_traffic(v, 4096, 4096, 64)["per_tile"] for v in ("split-q", "split-k"))
    assert (q["cp_async_write"], q["ldmatrix_read"]) == (16 * 1024, 72 * 1024)
    assert (k["ldmatrix_read"], k["exchange_write"], k["exchange_read"]) == (48 * 1024, 72 * 1024, 72 * 1024)


def test_traffic_scales_and_causal_skips():
    one = shared_memory_traffic("split-k", 1000, 1000, 64)
    many = shared_memory_traffic("split-k", 1000, 1000, 64, batch=3, heads=5)
    assert many["total_bytes"] == 15 * one["total_bytes"] and many["blocks"] == 15 * one["blocks"]
    causal = shared_memory_traffic("split-k", 1000, 1000, 64, causal=True)
    assert causal["tiles"] == 16 * 17 // 2 and causal["total_bytes"] < 0.6 * one["total_bytes"]
    # causal, N_q = 200 > N_k = 10: row blocks 0 and 1 see no key and visit no tile, but still copy their Q_i
    few = shared_memory_traffic("split-q", 200, 10, 64, causal=True)
    tile = few["per_tile"]
    assert few["tiles"] == 2 and few["blocks"] == 4
    assert few["total_bytes"] == 4 * 64 * 64 * 2 + 2 * (tile["cp_async_write"] + tile["ldmatrix_read"])
    with pytest.raises(ValueError, match="variant"):
        shared_memory_traffic("split-v", 64, 64, 64)
    with pytest.raises(ValueError, match="N_q"):
        shared_memory_traffic("split-q", 0, 64, 64)


@pytest.fixture
def shared_counter(monkeypatch):
    """Every byte the simulated kernels move in dynamic shared memory: each element read or written through the
    shared array (scalar accesses, cp.async landing its 16 bytes), and 16 bytes per lane for each ldmatrix."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    counts = dict(read=0, write=0, ldmatrix=0)
    lock = threading.Lock()

    class Counting(np.ndarray):
        def __getitem__(self, key):
            out = super().__getitem__(key)
            if np.ndim(out) == 0:                # an element read (a slice is a view of the array, moves nothing)
                with lock:
                    counts["read"] += np.asarray(out).nbytes
            return out

        def __setitem__(self, key, value):
            plain = self.view(np.ndarray)        # (a subclass's slice assignment would read through __getitem__)
            plain[key] = value
            with lock:
                counts["write"] += np.asarray(plain[key]).nbytes

    original = FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        out = original(self, shape, dtype, alignment)
        return out.view(Counting) if shape == 0 else out

    def counted(load):
        def ldmatrix(smem, index):
            with lock:
                counts["ldmatrix"] += 16
            return load(smem, index)
        return ldmatrix

    monkeypatch.setattr(FakeCUDAShared, "array", array)
    monkeypatch.setattr(ptx, "ldmatrix_x4", counted(ptx.ldmatrix_x4))
    monkeypatch.setattr(ptx, "ldmatrix_x4_trans", counted(ptx.ldmatrix_x4_trans))
    return counts


@pytest.mark.parametrize("variant, module", [("split-q", splitq), ("split-k", splitk)])
def test_traffic_counted_in_the_simulator(variant, module, shared_counter):
    """The formula against the kernel: the same bytes, category by category (causal with N_q ≠ N_k, so that the
    two row blocks visit 1 and 2 tiles, the second partial)."""
    N_q, N_k, d = 100, 80, 16
    Q, K, V = _inputs((1, 1, N_q, d), (1, 1, N_k, d), "float16", seed=5)
    # a kernel built now, with the counting ldmatrix (the cached one holds the plain twin)
    launch.run(module.make_kernel.__wrapped__, module.config_for, module.shared_words, Q, K, V, causal=True,
               scale=None)
    expected = shared_memory_traffic(variant, N_q, N_k, d, causal=True)
    assert expected["tiles"] == 1 + 2
    total = expected["total"]
    assert shared_counter["ldmatrix"] == total["ldmatrix_read"]
    assert shared_counter["write"] == total["cp_async_write"] + total["exchange_write"]
    assert shared_counter["read"] == total["exchange_read"]
