"""kernels_gpu.fast on a real GPU: every numbered version against the float64 oracle at benchmark-like sizes, and the
float16 storage option against the float32 kernels.

Run on the device from the repository root (the default run skips this file)::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu -q -p no:cacheprovider

What it proves (issue 5 item 1: "every version stays correct, checked against the oracle on the GPU"):

* each fast forward version v1 … v8 (its default tiling and register cap for the head size) meets the conventions'
  float32 rule against the oracle at N in the thousands, d = 64 and 128, causal on and off, GQA/MQA, N_q ≠ N_k with
  fully masked rows (sampled rows, as in ``test_kernels_gpu.py``); the fast backward likewise on full gradients;
* v8's stream-K launch on grids of few blocks and of more blocks than the GPU holds;
* with ``storage="float16"`` the newest forward and the backward return float16 (L float32) that are bit for bit the
  float32 kernels' results on the same float16-rounded inputs, rounded once to float16: only the storage changed
  (dQ within one float16 ulp of the largest: its float32 atomics sum in a run-dependent order).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":  # the conftest skips these too; never compile for the simulator here
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

from numba import cuda  # noqa: E402

if not cuda.is_available():
    pytest.skip("no CUDA GPU available", allow_module_level=True)

from test_kernels_gpu import assert_rule, make, rows_attention, sample_rows  # noqa: E402

import fa2edu  # noqa: E402
from kernels_gpu import runtime as rt  # noqa: E402
from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS  # noqa: E402

NEWEST = list(VERSIONS)[-1]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


FAST_FORWARD_SIZES = [  # (B, H_q, H_kv, N_q, N_k, d)
    (2, 4, 2, 4096, 4096, 64),          # GQA
    (1, 4, 4, 4096, 4096, 128),
    (1, 2, 1, 3001, 4099, 128),         # N_q < N_k, MQA, ragged tiles
    (1, 2, 2, 4099, 3001, 64),          # N_q > N_k: 1098 fully masked rows when causal
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", FAST_FORWARD_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("version", list(VERSIONS))
def test_fast_forward_matches_oracle(version, size, causal):
    Q, K, V, _ = make(*size)
    rows = sample_rows(Q.shape[2])
    O_ref, L_ref = rows_attention(Q, K, V, rows, causal, np.float64)
    O32, L32 = rows_attention(Q, K, V, rows, causal, np.float32)
    O, L = VERSIONS[version](Q, K, V, causal=causal)
    assert_rule(O[:, :, rows], O_ref, O32, "O")
    assert_rule(L[:, :, rows], L_ref, L32, "L")


@pytest.mark.parametrize("slots", [7, 50, 1000])
@pytest.mark.parametrize("size", [(1, 4, 4, 4096, 4096, 128), (1, 2, 1, 3001, 4099, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_v8_stream_k_on_any_grid_matches_oracle(size, slots):
    """v8 planned for other numbers of resident blocks than the GPU's: few (whole items on few blocks, the rest in
    long ranges), and more than the GPU holds (every item a stream-K one, in many short pieces)."""
    from kernels_gpu.fast import flash2_forward_v8, split
    B, H_q, _, N_q, N_k, d = size
    tiling = flash2_forward_v8.default_tiling(d)
    items, T_c = B * H_q * -(-N_q // tiling.B_r), -(-N_k // tiling.B_c)
    assert any(piece[4] >= 0 for piece in split.stream_pieces(items, T_c, slots))      # the case really splits
    Q, K, V, _ = make(*size)
    rows = sample_rows(Q.shape[2])
    O_ref, L_ref = rows_attention(Q, K, V, rows, False, np.float64)
    O32, L32 = rows_attention(Q, K, V, rows, False, np.float32)
    O, L = VERSIONS["v8"](Q, K, V, slots=slots)
    assert_rule(O[:, :, rows], O_ref, O32, "O")
    assert_rule(L[:, :, rows], L_ref, L32, "L")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [(1, 4, 2, 1500, 2100, 64), (1, 2, 1, 2100, 1500, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("version", list(BACKWARD_VERSIONS))
def test_fast_backward_matches_oracle(version, size, causal):
    Q, K, V, dO = make(*size)
    grads_ref = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal)
    std = fa2edu.standard_attention(Q, K, V, causal=causal)           # float32 NumPy: the same-dtype baseline
    grads32 = fa2edu.standard_attention_backward(Q, K, V, std.P, dO, causal=causal)
    O, L = VERSIONS[NEWEST](Q, K, V, causal=causal)
    grads = BACKWARD_VERSIONS[version](Q, K, V, O, L, dO, causal=causal)
    for name, g, e, low in zip(("dQ", "dK", "dV"), grads, grads_ref, grads32):
        assert_rule(g, e, low, name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [(1, 4, 2, 2048, 1500, 64), (1, 2, 2, 1500, 2048, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp16_storage_changes_only_the_storage(size, causal):
    Q, K, V, dO = (x.astype(np.float16) for x in make(*size))
    Q32, K32, V32, dO32 = (x.astype(np.float32) for x in (Q, K, V, dO))   # the same values, float32
    forward = VERSIONS[NEWEST]
    O16, L16 = forward(Q, K, V, causal=causal, storage="float16")
    O32, L32 = forward(Q32, K32, V32, causal=causal)
    assert O16.dtype == np.float16 and L16.dtype == np.float32
    np.testing.assert_array_equal(O16, O32.astype(np.float16))
    np.testing.assert_array_equal(L16, L32)
    backward = BACKWARD_VERSIONS[list(BACKWARD_VERSIONS)[-1]]
    g16 = backward(Q, K, V, O16, L16, dO, causal=causal, storage="float16")
    g32 = backward(Q32, K32, V32, O16.astype(np.float32), L16, dO32, causal=causal)
    for name, a, b in zip(("dQ", "dK", "dV"), g16, g32):
        assert a.dtype == np.float16, name
        if name == "dQ":
            # dQ is summed with float32 atomics, in an order that changes between runs: the two float32 sums may
            # differ in their last bits, and so, rarely, their float16 roundings by one float16 ulp.
            b = b.astype(np.float64)
            assert np.max(np.abs(a.astype(np.float64) - b)) <= 2.0 ** -10 * np.max(np.abs(b)), name
        else:
            np.testing.assert_array_equal(a, b.astype(np.float16), err_msg=name)
