"""kernels_gpu.hopper in numba's CUDA simulator: every instruction twin against the NumPy specification (the GPU
tests check the hardware against the same one), and every rung against the float64 oracle on small ragged shapes
that cross tiles, reuse the ring's stages, mask whole rows and map GQA heads."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from tolerances import assert_close_to_oracle, baseline_error

import fa2edu
import kernels_gpu.runtime as rt
from kernels_gpu import hopper
from kernels_gpu.hopper import launch as hopper_launch
from kernels_gpu.hopper import selftest


@pytest.mark.parametrize("case", [
    dict(N=64), dict(N=16, mode_a=0, mode_b=0), dict(N=32, mode_a=2, mode_b=2, dtype="float16"),
    dict(N=64, a_from="regs", trans_b=True), dict(N=48, a_from="regs", trans_b=True, mode_b=0),
    dict(N=64, a_from="regs", trans_b=True, mode_b=2, dtype="float16"), dict(N=8, a_start=96, b_start=8192 + 32),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_wgmma_twin_is_the_specification(case):
    got, expected = selftest.check_wgmma(**case, seed=5)
    np.testing.assert_array_equal(got, expected)


def test_named_barrier_and_elect_twins():
    got, expected = selftest.check_named_barrier()
    np.testing.assert_array_equal(got, expected)


def _check(version, Q, K, V, causal, **options):
    O, L = hopper.VERSIONS[version](Q, K, V, causal=causal, **options)
    G = Q.shape[-3] // K.shape[-3]
    K64, V64 = (np.repeat(x.astype(np.float64), G, axis=-3) for x in (K, V))
    O_ref, L_ref = fa2edu.attention_reference(Q.astype(np.float64), K64, V64, causal=causal)
    # the same-dtype baseline: standard attention on the float16 inputs, its O rounded to float16
    base = fa2edu.standard_attention(Q, np.repeat(K, G, axis=-3), np.repeat(V, G, axis=-3), causal=causal).O
    assert O.dtype == np.float16 and O.shape == Q.shape and L.shape == Q.shape[:-1]
    assert_close_to_oracle(O.astype(np.float64), O_ref, "O", dtype=np.float16,
                           baseline=baseline_error(base.astype(np.float16), O_ref))
    finite = np.isfinite(L_ref)
    assert np.array_equal(np.isinf(L), ~finite) and (O[~finite] == 0).all()
    np.testing.assert_allclose(L[finite], L_ref[finite], rtol=1e-4, atol=1e-4)


# (Q shape, K/V shape, causal, options): the ragged, GQA, masked-rows case crosses three 16-key tiles, so a
# two-stage ring refills a stage and waits on both parities of its barriers
CASES = {
    "h1": [((1, 2, 70, 40), (1, 1, 45, 40), True, {}), ((1, 1, 64, 64), (1, 1, 150, 64), False, {})],
    "h2": [((1, 2, 70, 40), (1, 1, 45, 40), True, dict(B_c=16))],
    # h3: its producer and consumers are h4's without the turns; chapter 16 runs h3 against the oracle, and the
    # trace tests below run both on a block of their own
    "h4": [((1, 2, 70, 40), (1, 1, 45, 40), True, dict(B_c=16))],
    # h5: 20 queries against 60 keys, causal: tiles 0 and 1 take the unmasked softmax, 2 and 3 the masked one
    "h5": [((1, 2, 20, 40), (1, 1, 60, 40), True, dict(B_c=16))],
    # h6: five tiles through a ring of three stages (the PV product of tile j − 1 issued at tile j, the last
    # alone), GQA, the two softmax kinds, and rows 0-24 fully masked
    "h6": [((1, 2, 70, 24), (1, 1, 75, 24), True, dict(B_c=16))],
}


@pytest.mark.parametrize("version, case", [(v, c) for v, cs in CASES.items() for c in cs],
                         ids=[f"{v}-{c[0][2]}x{c[1][2]}-d{c[0][3]}" for v, cs in CASES.items() for c in cs])
def test_rung_matches_oracle(version, case, monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)
    shape_q, shape_kv, causal, options = case
    rng = np.random.default_rng(list(hopper.VERSIONS).index(version) * 10 + CASES[version].index(case))
    Q = rng.standard_normal(shape_q).astype(np.float16)
    K = rng.standard_normal(shape_kv).astype(np.float16)
    V = rng.standard_normal(shape_kv).astype(np.float16)
    _check(version, Q, K, V, causal, **options)


def test_versions_and_the_fastest_rung():
    assert list(hopper.VERSIONS) == ["h1", "h2", "h3", "h4", "h5", "h6"]
    assert hopper.flash_forward is hopper.VERSIONS["h5"]
    assert list(hopper.BACKWARD_VERSIONS) == ["b1", "b2", "b3"]
    assert hopper.flash_backward is hopper.BACKWARD_VERSIONS["b3"]


def test_a_gpu_that_is_not_sm90_gets_a_clear_error(monkeypatch):
    class Device:
        compute_capability = (8, 0)
    monkeypatch.setattr(hopper_launch.rt, "simulator_in_use", lambda: False)
    monkeypatch.setattr(hopper_launch.cuda, "get_current_device", lambda: Device())
    with pytest.raises(hopper.HopperRequired, match="kernels_gpu.tensorcore"):
        hopper_launch.require_hopper()


@functools.lru_cache(maxsize=None)
def _traced(version, tiles=4):
    """Block 0's trace of one rung on a single block of 128 query rows over ``tiles`` key tiles of 16 (run once
    per rung and shared by the tests that read it)."""
    from numba import cuda
    rng = np.random.default_rng(3)
    Q = rng.standard_normal((1, 1, 128, 16)).astype(np.float16)
    K, V = (rng.standard_normal((1, 1, 16 * tiles, 16)).astype(np.float16) for _ in range(2))
    T = cuda.to_device(np.zeros((1, 4, tiles, 5), np.uint64))
    hopper.VERSIONS[version](Q, K, V, B_c=16, trace=("globaltimer", T))
    T = T.copy_to_host()[0].astype(np.int64)
    T.flags.writeable = False
    return T


@pytest.mark.parametrize("version", ["h3", "h4"])
def test_trace_stamps_every_step_in_order(version):
    T = _traced(version)
    consumers = T[1:3]                       # warpgroups 1 and 2 (0 is the producer)
    assert (consumers > 0).all() and (T[0, :, :3] > 0).all() and (T[3] == 0).all()
    steps = consumers.reshape(2, -1)         # wait ≤ ready ≤ S ≤ softmax ≤ PV, tile after tile
    assert (np.diff(steps, axis=1) >= 0).all()
    # a stage is refilled only after both consumers released it: the producer's "stage free" of tile j + 2 comes
    # after both consumers' PV of tile j
    assert (T[0, 2:, 1] >= consumers[:, :-2, 4].max(axis=0)).all()


def test_ping_pong_turns_alternate():
    """h4's protocol as stamps: consumer 1 starts S_ij only after consumer 0 finished its own, and consumer 0
    starts S_i,j+1 only after consumer 1 finished S_ij."""
    T = _traced("h4")
    c0, c1 = T[1], T[2]
    assert (c1[:, 1] >= c0[:, 2]).all()
    assert (c0[1:, 1] >= c1[:-1, 2]).all()


def test_trace_array_of_the_wrong_shape_is_refused():
    from numba import cuda
    Q = np.zeros((1, 1, 64, 16), np.float16)
    with pytest.raises(ValueError, match="trace: T must be a uint64 device array"):
        hopper.VERSIONS["h3"](Q, Q, Q, trace=("clock64", cuda.to_device(np.zeros((1, 3, 1, 5), np.uint64))))
    with pytest.raises(ValueError, match="only the rungs that copy by TMA"):
        hopper.VERSIONS["h1"](Q, Q, Q, trace=("clock64", cuda.to_device(np.zeros((1, 4, 1, 5), np.uint64))))


@pytest.mark.parametrize("shape_q, shape_kv, dtype, scale", [
    # two key blocks of 128 (the second ragged), N_q < N_k causal, d = 16
    ((1, 1, 40, 16), (1, 1, 150, 16), "float16", 1.0),
    # GQA; N_q > N_k causal: 25 rows see no key; two row blocks of 64 (the second ragged); d = 24 (padded to
    # 32); scores in the tens; bf16
    ((1, 2, 70, 24), (1, 1, 45, 24), "bfloat16", 3.0),
    # the deterministic mode (dK, dV kernel + the dQ pass over key tiles of 64) on the first case
    ((1, 1, 40, 16), (1, 1, 150, 16), "float16", 1.0),
], ids=["two-key-blocks-f16", "masked-rows-d24-bf16", "deterministic-f16"])
def test_backward_rung_b1_matches_oracle(shape_q, shape_kv, dtype, scale, monkeypatch, request):
    pytest.importorskip("torch")
    from test_tensorcore_backward import _problem, flash_attn_rule
    monkeypatch.setattr(rt, "poison_outputs", True)
    Q, K, V, O, L, dO = _problem(shape_q, shape_kv, dtype, True, seed=21, scale=scale)
    deterministic = request.node.callspec.id == "deterministic-f16"
    grads = hopper.BACKWARD_VERSIONS["b1"](Q, K, V, O, L, dO, causal=True, deterministic=deterministic)
    flash_attn_rule(grads, Q, K, V, dO, True)


def test_backward_rung_b2_matches_oracle(monkeypatch):
    """b2's dQ step: d = 72 (D = 80: a full 64-column panel, then a narrower one whose last columns are padding),
    GQA, a ragged row block, 20 rows that see no key, bf16."""
    pytest.importorskip("torch")
    from test_tensorcore_backward import _problem, flash_attn_rule
    monkeypatch.setattr(rt, "poison_outputs", True)
    Q, K, V, O, L, dO = _problem((1, 2, 40, 72), (1, 1, 20, 72), "bfloat16", True, seed=22, scale=2.0)
    flash_attn_rule(hopper.BACKWARD_VERSIONS["b2"](Q, K, V, O, L, dO, causal=True), Q, K, V, dO, True)


@pytest.mark.parametrize("shape_q, shape_kv, deterministic", [
    # three row blocks (the last ragged: 22 rows) for each of two query heads (GQA): six row blocks through two
    # stages, each stage refilled twice, both parities of its full and empty barriers waited on; causal with
    # N_q > N_k: rows 0-49 see no key
    ((1, 2, 150, 16), (1, 1, 100, 16), False),
    # the deterministic mode: b3's dK/dV kernel through both stages (two row blocks, rows 0-29 masked), then b2's
    # dQ pass
    ((1, 1, 70, 16), (1, 1, 40, 16), True),
], ids=["ring-gqa-masked-rows", "deterministic"])
def test_backward_rung_b3_matches_oracle(shape_q, shape_kv, deterministic, monkeypatch):
    """b3's ring of row blocks against the oracle with flash-attn's rule (bf16, logits in the tens)."""
    pytest.importorskip("torch")
    from test_tensorcore_backward import _problem, flash_attn_rule
    monkeypatch.setattr(rt, "poison_outputs", True)
    Q, K, V, O, L, dO = _problem(shape_q, shape_kv, "bfloat16", True, seed=23, scale=2.0)
    grads = hopper.BACKWARD_VERSIONS["b3"](Q, K, V, O, L, dO, causal=True, deterministic=deterministic)
    flash_attn_rule(grads, Q, K, V, dO, True)


def test_backward_rung_b3_refuses_a_deterministic_that_is_not_a_bool():
    Q = np.zeros((1, 1, 64, 16), np.float16)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        hopper.BACKWARD_VERSIONS["b3"](Q, Q, Q, Q, np.zeros((1, 1, 64), np.float32), Q, deterministic="yes")


def test_backward_refuses_wide_heads():
    Q = np.zeros((1, 1, 64, 136), np.float16)
    L = np.zeros((1, 1, 64), np.float32)
    with pytest.raises(ValueError, match="head dimensions up to 128.*tensorcore.flash2_backward"):
        hopper.flash_backward(Q, Q, Q, Q, L, Q)
