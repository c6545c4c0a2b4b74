"""The kernels' own global-memory traffic, counted in the simulator, equals fa2edu's ledger (issue 3 item 5).

:func:`kernels_gpu.counting.count_global_memory` counts every element each kernel reads and writes in global memory
(see its module docstring for how). These tests set those counts beside the ledger of the NumPy algorithm run with
the same block sizes (:class:`fa2edu.HBM`), tensor by tensor, reads, writes and initialisation writes apart:

* FA2 forward (Alg. 1), FA1 forward (Alg. 1) and FA2 backward (Alg. 2, atomic dQ) move exactly what the ledger
  says, for ragged blocks, N_q ≠ N_k, causal block skipping, and (forward) GQA;
* both equal the conventions' closed forms for N_q = N_k (so neither can drift without the other noticing);
* the GQA backward kernel loads K_j, V_j once per K/V head (the ledger counts them per query head: G times more);
* the deterministic backward trades dQ's atomic read-modify-writes for T_r extra passes over K and V;
* standard attention materialises S and P: N_q·N_k written each (its softmax kernel reads S twice).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fa2edu
import kernels_gpu
from kernels_gpu import runtime as rt

if not rt.simulator_in_use():  # pragma: no cover
    pytest.skip("counting global memory needs numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)",
                allow_module_level=True)

from kernels_gpu.counting import count_global_memory  # noqa: E402


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output starts as NaN, so an element a kernel never writes cannot pass as stale or zero memory."""
    monkeypatch.setattr(rt, "poison_outputs", True)

# (lead_q, lead_kv, N_q, N_k, d, d_v, block_sizes, causal)
CONFIGS = {
    "ragged": ((1, 1), (1, 1), 7, 9, 5, 3, (3, 4), False),
    "ragged-causal": ((1, 1), (1, 1), 7, 9, 5, 3, (3, 4), True),
    "masked-rows-causal": ((2, 1), (2, 1), 10, 6, 4, 4, (4, 3), True),
    "square-causal": ((), (), 9, 9, 3, 3, (2, 4), True),
}


def make(name, seed=0):
    lead_q, lead_kv, N_q, N_k, d, d_v, bs, causal = CONFIGS[name]
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal(lead_q + (N_q, d)).astype(np.float32)
    K = rng.standard_normal(lead_kv + (N_k, d)).astype(np.float32)
    V = rng.standard_normal(lead_kv + (N_k, d_v)).astype(np.float32)
    dO = rng.standard_normal(lead_q + (N_q, d_v)).astype(np.float32)
    programs = int(np.prod(lead_q)) if lead_q else 1
    return Q, K, V, dO, bs, causal, programs


def ledger(algorithm, *args, **kwargs):
    hbm = fa2edu.HBM()
    algorithm(*args, hbm=hbm, **kwargs)
    return hbm


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flash2_forward_traffic_equals_ledger(name):
    Q, K, V, _, bs, causal, programs = make(name)
    with count_global_memory() as traffic:
        kernels_gpu.flash2_forward(Q, K, V, block_sizes=bs, causal=causal)
    expected = ledger(fa2edu.flash2_forward, Q, K, V, block_sizes=bs, causal=causal)
    assert traffic.by_tensor(programs) == expected.by_tensor()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flash1_forward_traffic_equals_ledger(name):
    Q, K, V, _, bs, causal, programs = make(name)
    with count_global_memory() as traffic:
        kernels_gpu.flash1_forward(Q, K, V, block_sizes=bs, causal=causal)
    expected = ledger(fa2edu.flash1_forward, Q, K, V, block_sizes=bs, causal=causal)
    assert traffic.by_tensor(programs) == expected.by_tensor()
    assert traffic.init_writes / programs == expected.init_writes        # O = 0, ℓ = 0, m = −inf, apart


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flash2_backward_traffic_equals_ledger(name):
    Q, K, V, dO, bs, causal, programs = make(name)
    O, L = kernels_gpu.flash2_forward(Q, K, V, block_sizes=bs, causal=causal)
    with count_global_memory() as traffic:
        kernels_gpu.flash2_backward(Q, K, V, O, L, dO, block_sizes=bs, causal=causal)
    expected = ledger(fa2edu.flash2_backward, Q, K, V, O, L, dO, block_sizes=bs, causal=causal)
    assert traffic.by_tensor(programs) == expected.by_tensor()


def test_gqa_forward_traffic_equals_ledger_per_query_head():
    """Forward kernels run one block per query head, each loading its K/V head's tiles: the ledger's count."""
    rng = np.random.default_rng(1)
    Q = rng.standard_normal((1, 3, 5, 4)).astype(np.float32)
    K = rng.standard_normal((1, 1, 7, 4)).astype(np.float32)
    V = rng.standard_normal((1, 1, 7, 2)).astype(np.float32)
    for gpu, cpu in ((kernels_gpu.flash2_forward, fa2edu.flash2_forward),
                     (kernels_gpu.flash1_forward, fa2edu.flash1_forward)):
        with count_global_memory() as traffic:
            gpu(Q, K, V, block_sizes=(2, 3), causal=True)
        assert traffic.by_tensor(3) == ledger(cpu, Q, K, V, block_sizes=(2, 3), causal=True).by_tensor()


def test_gqa_backward_loads_kv_once_per_group():
    """One backward block per (column block, K/V head) serves all G = 2 query heads: the Q-side traffic is the
    ledger's, while K, V reads and dK, dV writes are the ledger's per-query-head counts divided by G."""
    rng = np.random.default_rng(2)
    Q = rng.standard_normal((2, 4, 7, 5)).astype(np.float32)
    K = rng.standard_normal((2, 2, 9, 5)).astype(np.float32)
    V = rng.standard_normal((2, 2, 9, 3)).astype(np.float32)
    dO = rng.standard_normal((2, 4, 7, 3)).astype(np.float32)
    O, L = kernels_gpu.flash2_forward(Q, K, V, block_sizes=(3, 4))
    with count_global_memory() as traffic:
        kernels_gpu.flash2_backward(Q, K, V, O, L, dO, block_sizes=(3, 4))
    counted = traffic.by_tensor(programs=2 * 4)
    expected = ledger(fa2edu.flash2_backward, Q, K, V, O, L, dO, block_sizes=(3, 4)).by_tensor()
    G = 2
    for tensor, row in expected.items():
        if tensor in ("K", "V", "dK", "dV"):
            assert counted[tensor] == {kind: n / G for kind, n in row.items()}, tensor
        else:
            assert counted[tensor] == row, tensor


@pytest.mark.parametrize("N, d, bs", [(10, 4, (3, 4)), (7, 2, (7, 2))])
def test_traffic_equals_the_closed_forms(N, d, bs):
    """the conventions' table, per (batch, head), N_q = N_k = N, T_r = ceil(N/B_r), T_c = ceil(N/B_c)."""
    rng = np.random.default_rng(3)
    Q, K, V, dO = (rng.standard_normal((N, d)).astype(np.float32) for _ in range(4))
    T_r, T_c = math.ceil(N / bs[0]), math.ceil(N / bs[1])
    with count_global_memory() as fa2:
        O, L = kernels_gpu.flash2_forward(Q, K, V, block_sizes=bs)
    with count_global_memory() as fa1:
        kernels_gpu.flash1_forward(Q, K, V, block_sizes=bs)
    with count_global_memory() as bwd:
        kernels_gpu.flash2_backward(Q, K, V, O, L, dO, block_sizes=bs)
    assert (fa2.reads, fa2.writes) == (N * d + 2 * N * d * T_r, N * d + N)
    assert (fa1.reads, fa1.writes) == (2 * N * d + T_c * (2 * N * d + 2 * N), T_c * (N * d + 2 * N))
    assert (bwd.reads, bwd.writes) == (4 * N * d + T_c * (3 * N * d + 2 * N), N + 2 * N * d + T_c * N * d)


def test_deterministic_backward_traffic():
    """Without atomics dQ is written once (no read, no initialisation); the dQ pass re-reads K and V once per row
    block, and Q, dO, L, D once more."""
    Q, K, V, dO, bs, causal, programs = make("ragged")
    N_q, N_k, d, d_v = Q.shape[-2], K.shape[-2], Q.shape[-1], V.shape[-1]
    T_r = math.ceil(N_q / bs[0])
    O, L = kernels_gpu.flash2_forward(Q, K, V, block_sizes=bs)
    with count_global_memory() as atomic:
        kernels_gpu.flash2_backward(Q, K, V, O, L, dO, block_sizes=bs)
    with count_global_memory() as det:
        kernels_gpu.flash2_backward(Q, K, V, O, L, dO, block_sizes=bs, deterministic=True)
    a, b = atomic.by_tensor(), det.by_tensor()
    assert b["dQ"] == {"read": 0, "write": N_q * d, "init": 0}
    assert a["dQ"]["init"] == N_q * d and a["dQ"]["read"] == a["dQ"]["write"] > N_q * d
    assert b["K"]["read"] - a["K"]["read"] == T_r * N_k * d
    assert b["V"]["read"] - a["V"]["read"] == T_r * N_k * d_v
    for tensor, width in (("Q", d), ("dO", d_v), ("L", 1), ("D", 1)):
        assert b[tensor]["read"] - a[tensor]["read"] == N_q * width, tensor


def test_standard_attention_materialises_S_and_P():
    """Alg. 0 writes the N_q × N_k matrices S and P to global memory; its row softmax reads S twice."""
    rng = np.random.default_rng(4)
    N_q, N_k, d = 5, 6, 3
    Q = rng.standard_normal((N_q, d)).astype(np.float32)
    K, V = (rng.standard_normal((N_k, d)).astype(np.float32) for _ in range(2))
    with count_global_memory() as traffic:
        kernels_gpu.standard_attention(Q, K, V, tile=4)
    counts = traffic.by_tensor()
    assert counts["S"] == {"read": 2 * N_q * N_k, "write": N_q * N_k, "init": 0}
    assert counts["P"]["write"] == N_q * N_k and counts["O"]["write"] == N_q * d
    # A tiled product reads each operand once per tile of the other side: Q once per column tile of S.
    assert counts["Q"]["read"] == N_q * d * math.ceil(N_k / 4)
