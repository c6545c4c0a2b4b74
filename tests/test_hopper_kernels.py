"""kernels_gpu.hopper in numba's CUDA simulator: every instruction twin against the NumPy specification (the GPU
tests check the hardware against the same one), and every rung against the float64 oracle on small ragged shapes
that cross tiles, reuse the ring's stages, mask whole rows and map GQA heads."""

from __future__ import annotations

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
    "h3": [((1, 2, 70, 40), (1, 1, 45, 40), True, dict(B_c=16))],
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
    assert list(hopper.VERSIONS) == ["h1", "h2", "h3"]
    assert hopper.flash_forward is hopper.VERSIONS["h2"]


def test_a_gpu_that_is_not_sm90_gets_a_clear_error(monkeypatch):
    class Device:
        compute_capability = (8, 0)
    monkeypatch.setattr(hopper_launch.rt, "simulator_in_use", lambda: False)
    monkeypatch.setattr(hopper_launch.cuda, "get_current_device", lambda: Device())
    with pytest.raises(hopper.HopperRequired, match="kernels_gpu.tensorcore"):
        hopper_launch.require_hopper()
