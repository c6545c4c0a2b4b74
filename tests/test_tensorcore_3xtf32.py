"""3xTF32 on tensor cores in numba's CUDA simulator: the big/small split of a float32 (``ptx.split_tf32``'s twin)
against its definition, and the 3xTF32 forward against the float64 oracle — within the bound of
:func:`~kernels_gpu.tensorcore.flash2_forward_3xtf32.error_bound` and at float32's accuracy, hundreds of times
closer than the TF32 rung on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
from test_tensorcore_tf32 import _inputs, check_against_oracle  # the TF32 rung's inputs and oracle check

import fa2edu
import kernels_gpu.runtime as rt
from kernels_gpu import ptx
from kernels_gpu.tensorcore import TF32
from kernels_gpu.tensorcore.flash2_forward_3xtf32 import PRODUCT_ERROR, Flash2Forward3xTF32, error_bound

forward_3x = TF32["3xtf32"]
u = 2.0 ** -11


# -- the split ------------------------------------------------------------------------------------------------------

def _split_all(x):
    pairs = [ptx.split_tf32(np.float32(v)) for v in x]
    big = np.array([p[0] for p in pairs], dtype=np.uint32)
    small = np.array([p[1] for p in pairs], dtype=np.uint32)
    return big, small


def test_split_gives_two_tf32_values_that_carry_the_float():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(2000), rng.standard_normal(200) * 1e30,
                        rng.standard_normal(200) * 1e-30]).astype(np.float32)
    big, small = _split_all(x)
    assert not ((big & 0x1FFF) | (small & 0x1FFF)).any()          # both are tf32 values: the mma takes them
    b, s = big.view(np.float32).astype(np.float64), small.view(np.float32).astype(np.float64)
    x64 = x.astype(np.float64)
    assert (np.abs(x64 - b) <= u * np.abs(x64)).all()               # big: x rounded to tf32
    assert (np.abs(x64 - b - s) <= u * u * np.abs(x64)).all()       # big + small: ~22 bits of x's 24
    assert (np.abs(x64 - b - s) > 0).any()                          # ... not all of them


def test_split_of_a_tf32_value_has_no_small_part():
    x = ptx.tf32_round(np.random.default_rng(1).standard_normal(100).astype(np.float32))
    big, small = _split_all(x)
    assert np.array_equal(big.view(np.float32), x) and not small.any()


# -- the forward against the float64 oracle ---------------------------------------------------------------------------

CASES = [  # (Q shape, K/V shape, causal, scale of Q and K): the first form (its other shapes run on the GPU)
    ((1, 2, 37, 24), (1, 1, 50, 24), True, 1.0),      # GQA, bottom-right causal with N_q < N_k, d % 16 = 8
    ((1, 1, 90, 16), (1, 1, 30, 16), True, 1.0),      # N_q > N_k causal: 60 rows see no key (O = 0, L = +inf)
]
IDS = ["gqa-causal", "masked-rows"]
#: the planes form takes head dimensions that are multiples of 16; tiles of 16 keys and, here, two warps' 32 query
#: rows (the GPU's eight warps run the same code on four times the threads)
PLANES_CASES = [
    ((1, 2, 12, 32), (1, 1, 24, 32), True, 1.0),      # GQA, bottom-right causal with N_q < N_k, a partial tile
    ((1, 1, 12, 48), (1, 1, 35, 48), False, 1.0),     # three K/V tiles (the raw stages reused); d = 48: the
                                                      # split pass's general path (the threads do not divide d)
    ((1, 1, 150, 16), (1, 1, 30, 16), True, 1.0),     # N_q > N_k causal: 120 rows see no key, five row blocks
    ((1, 1, 17, 32), (1, 1, 24, 32), False, 5.0),     # extreme logits (scores in the hundreds)
]
PLANES_IDS = ["gqa-causal", "ragged-d48", "masked-rows", "extreme-logits"]
RUNS = [("3xtf32", c) for c in CASES] + [("3xtf32-planes", c) for c in PLANES_CASES]
RUN_IDS = [f"first-{i}" for i in IDS] + [f"planes-{i}" for i in PLANES_IDS]


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


@pytest.mark.parametrize("form, case", RUNS, ids=RUN_IDS)
def test_3xtf32_forward_within_bound(form, case, poisoned):
    shape_q, shape_kv, causal, scale = case
    Q, K, V = _inputs(shape_q, shape_kv, RUNS.index((form, case)), scale=scale)
    tile = {"warps": 2} if form == "3xtf32-planes" else {}
    check_against_oracle(TF32[form](Q, K, V, causal=causal, **tile), Q, K, V, causal, bound=error_bound,
                         kind=Flash2Forward3xTF32, precision="3xtf32")


def test_float32_accuracy_where_tf32_has_tf32s():
    """The same inputs through the TF32 rung and this one: TF32 misses by ~1e-4, 3xTF32 by float32's ~1e-6 — and its
    worst-case bound is itself within a small multiple of float32's unit roundoff."""
    Q, K, V = _inputs((1, 1, 16, 32), (1, 1, 24, 32), seed=11)
    O_ref, _ = fa2edu.attention_reference(*(x.astype(np.float64) for x in (Q, K, V)), causal=True)
    err_3x = np.abs(forward_3x(Q, K, V, causal=True).O - O_ref).max()
    err_1x = np.abs(TF32["tf32"](Q, K, V, causal=True).O - O_ref).max()
    assert err_3x < 4e-6 < 1e-4 < err_1x
    assert 100 * err_3x < err_1x
    assert PRODUCT_ERROR < 16 * 2.0 ** -24


def test_bad_input_names_the_kernel():
    with pytest.raises(ValueError, match="planes kernel takes head dimensions that are multiples of 16 up to 128"):
        TF32["3xtf32-planes"](*(np.zeros((4, 24), np.float32),) * 3)
    Q = np.zeros((4, 12), np.float32)
    with pytest.raises(ValueError, match="3xTF32 kernel takes head dimensions that are multiples of 8"):
        forward_3x(Q, Q, Q)
    with pytest.raises(ValueError, match="V's head dimension must equal Q's for the 3xTF32 kernel"):
        forward_3x(np.zeros((4, 16), np.float32), np.zeros((4, 16), np.float32), np.zeros((4, 24), np.float32))
