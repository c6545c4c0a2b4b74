"""fp16 storage with fp32 arithmetic in the fast FA2 kernels (``storage="float16"``), in numba's CUDA simulator.

What these tests prove, on tiny ragged shapes (N_q, N_k not multiples of any tile side, N_q ≠ N_k, GQA, causal),
with outputs poisoned (NaN) before each run:

* **Only the storage changes.** Forward v5 (and v4) and backward v1 with float16 storage return O, dQ, dK, dV as
  float16 and L as float32, and they are *bit for bit* the float32 kernels' results on the same (float16-rounded)
  values, rounded once to float16: every load is converted to float32, the arithmetic is the float32 kernel's,
  L is never rounded, dQ is accumulated in float32 and rounded once.
* **Against the float64 oracle** (``fa2edu.attention_reference`` and ``attention_reference_backward`` evaluated
  on the float16-rounded inputs), within a bound derived in :func:`_rounding_bound`'s docstring from float16's
  output rounding: 2^-11 relative per output element, plus, in the backward, what the float16 O moves in
  D = rowsum(dO ∘ O), plus DESIGN.md's float32 rule for the arithmetic.
* Fully masked rows (causal, N_q > N_k) give exactly O = 0, L = +inf and dQ = 0 there, never NaN.
* Device inputs (numba device arrays) are used as they are when their dtype is the storage's and give device
  arrays back; a device dtype that does not match ``storage`` is a TypeError naming the argument and both
  dtypes; a ``storage`` other than "float32"/"float16" is a ValueError; a NumPy value beyond float16's range is
  a ValueError naming the argument.
* The GPU check script ``benchmarks.fp16_check`` (which needs a GPU to run) parses its arguments, plans the grid
  (batch × N = 16k, heads × d = 2048), pairs fp16 with fp32 records, and its byte model equals fa2edu's closed
  forms in float32 and halves every float16 tensor; ``kg_flash2_fast_fp16`` is registered (not by default).

Not tested here: that the float16 path moves half the bytes *as counted by the simulator*.
``kernels_gpu.counting`` counts elements, not bytes, and the fast kernels do not hand their arrays to it (only
the teaching kernels do), so the halving is shown by the byte model and the dtypes of the arrays the kernels get;
on the GPU, Nsight Compute's byte counters measure it.
"""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_same_nan_and_inf, baseline_error

import fa2edu
from kernels_gpu import runtime as rt
from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS, Tiling, split, tiled

if not rt.simulator_in_use():  # pragma: no cover
    pytest.skip("simulator tests: NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py sets it)", allow_module_level=True)

from numba import cuda  # noqa: E402  (after the simulator check: numba.cuda is the simulator here)

#: float16's unit roundoff: round to nearest moves a normal number by at most 2^-11 of itself
U16 = 2.0 ** -11


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Outputs start as NaN: an element the kernel never writes cannot pass."""
    monkeypatch.setattr(rt, "poison_outputs", True)


def _problem(seed, Z, H_q, H_kv, N_q, N_k, d):
    """Q, K, V, dO as float16 (the stored values; every one exactly a float32 and a float64 too)."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((Z, H_q, N_q, d)).astype(np.float16)
    K = rng.standard_normal((Z, H_kv, N_k, d)).astype(np.float16)
    V = rng.standard_normal((Z, H_kv, N_k, d)).astype(np.float16)
    dO = rng.standard_normal((Z, H_q, N_q, d)).astype(np.float16)
    return Q, K, V, dO


def _f32(*arrays):
    return tuple(a.astype(np.float32) for a in arrays)


def _f64(*arrays):
    return tuple(a.astype(np.float64) for a in arrays)


def _rounding_bound(got, ref, base32, extra=0.0):
    """Check ``|got − ref| ≤ 2^-11·|ref| + extra + 2·base32 + 1e-5·max(1, max|ref|)`` element by element.

    Why this bound: the kernel reads the float16 inputs exactly (a float16 converts to float32 without error) and
    computes in float32, so before its last store it holds a float32 value v whose error against the float64
    oracle on the same inputs obeys DESIGN.md's float32 rule, |v − ref| ≤ 2·base32 + 1e-5·scale (base32: the
    error of float32 standard attention on those inputs). Storing v as float16 rounds to nearest: it moves v by at
    most 2^-11·|v| (normal range; below 2^-14 by at most 2^-25, inside the 1e-5 floor), and 2^-11·|v| ≤
    2^-11·|ref| + 2^-11·|v − ref|, the second term again inside the floor. ``extra``: what float16 inputs of
    the backward that are themselves rounded results (O) add (see :func:`_d_shift`). A kernel that rounded any
    intermediate to float16 (Q·τ, the S or P tiles, the running Õ, ℓ, dQ's partial sums) would add errors of
    2^-11 times those intermediates: rounding Q·τ·log₂e alone exceeds the bound 4-8× on the forward cases."""
    got = np.asarray(got).astype(np.float64)
    assert_same_nan_and_inf(got, ref, "output")
    finite = np.isfinite(ref)
    scale = max(1.0, float(np.abs(ref[finite]).max(initial=0.0)))
    bound = U16 * np.abs(ref) + extra + 2 * base32 + 1e-5 * scale
    err = np.abs(got - ref)
    worst = float(np.max(np.where(finite, err / bound, 0.0)))
    assert worst <= 1.0, f"error exceeds the float16-rounding bound by a factor {worst:.3g}"


def _check_forward(Q, K, V, causal, tiling, version="v5", **options):
    """The float16-storage forward against (a) the float32 kernel on the same values, bit for bit, and (b) the
    float64 oracle on those values, within :func:`_rounding_bound`. ``options``: the version's own (``slots``)."""
    O, L = VERSIONS[version](Q, K, V, causal=causal, tiling=tiling, storage="float16", **options)
    assert O.dtype == np.float16 and L.dtype == np.float32
    O32, L32 = VERSIONS[version](*_f32(Q, K, V), causal=causal, tiling=tiling, **options)
    np.testing.assert_array_equal(O, O32.astype(np.float16))      # only the final store is rounded
    np.testing.assert_array_equal(L, L32)                          # L is never rounded to float16
    O_ref, L_ref = fa2edu.attention_reference(*_f64(Q, K, V), causal=causal)
    base = baseline_error(fa2edu.standard_attention(*_f32(Q, K, V), causal=causal).O, O_ref)
    _rounding_bound(O, O_ref, base)
    # L: float32, so the float32 rule of tests/test_kernels_fast.py (relative 1e-6 of |L|, plus the floor)
    assert_same_nan_and_inf(L, L_ref, "L")
    finite = np.isfinite(L_ref)
    L_size = max(1.0, float(np.abs(L_ref[finite]).max(initial=1.0)))
    assert np.abs(L[finite] - L_ref[finite]).max(initial=0.0) <= 2e-6 * L_size + 1e-5
    return O, L


FORWARD_CASES = [  # (tiling (NY, NX, TR, TC), Z, H_q, H_kv, N_q, N_k, d, causal)
    (Tiling(4, 2, 2, 2), 1, 2, 1, 13, 11, 8, True),     # GQA, causal, N_q > N_k (two fully masked rows)
    (Tiling(8, 1, 2, 4), 2, 1, 1, 9, 13, 4, False),     # several K/V tiles: the K_{j+1} prefetch runs; a batch
    (Tiling(2, 4, 3, 1), 1, 1, 1, 7, 9, 16, True),      # T % d ≠ 0: the general tile move
]


@pytest.mark.parametrize("version", ["v5", "v6", "v7", "v8"])
@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, causal", FORWARD_CASES)
def test_forward_fp16_storage(version, tiling, Z, H_q, H_kv, N_q, N_k, d, causal):
    Q, K, V, _ = _problem(hash((N_q, N_k, d)) % 2**32, Z, H_q, H_kv, N_q, N_k, d)
    _check_forward(Q, K, V, causal, tiling, version=version)


def test_forward_fp16_storage_through_split_launches():
    """v7's split last wave and v8's stream-K pieces: the merge writes float16 O from float32 sums, rounded once,
    as the float32 launch's merge does (2 slots: v7 splits the last of 3 items in 2 pieces, v8 cuts its 5 K/V
    tiles in 2 ranges)."""
    Q, K, V, _ = _problem(12, 1, 1, 1, 9, 37, 8)
    assert split.split_plan(3, 5, 2, False) == (2, 1, 2)                        # the cases really split
    assert any(p[4] >= 0 for p in split.stream_pieces(3, 5, 2))
    for version in ("v7", "v8"):
        _check_forward(Q, K, V, False, Tiling(2, 2, 2, 4), version=version, slots=2)


def test_forward_v4_takes_the_storage_option_too():
    Q, K, V, _ = _problem(4, 1, 2, 1, 7, 9, 8)
    O4, L4 = _check_forward(Q, K, V, True, Tiling(4, 2, 2, 2), version="v4")
    # v5 with a tiling and no register cap is v4's kernel: the same float16 results
    O5, L5 = VERSIONS["v5"](Q, K, V, causal=True, tiling=Tiling(4, 2, 2, 2), storage="float16")
    np.testing.assert_array_equal(O4, O5)
    np.testing.assert_array_equal(L4, L5)


def test_forward_fully_masked_rows_give_zero_output_and_infinite_L():
    # causal with N_q > N_k: the first N_q − N_k = 6 rows see no key at all (bottom-right alignment)
    Q, K, V, _ = _problem(7, 1, 1, 1, 11, 5, 8)
    O, L = _check_forward(Q, K, V, True, Tiling(4, 2, 2, 2))
    assert np.all(O[..., :6, :] == 0.0) and np.all(np.isposinf(L[..., :6]))
    assert np.isfinite(L[..., 6:]).all() and np.abs(O[..., 6:, :]).max() > 0


def _d_shift(O_ref, dO):
    """δD = 2^-11 · Σ_k |dO_ik O_ik|: how far D_i = rowsum(dO ∘ O) can move when O arrives rounded to float16."""
    return U16 * np.sum(np.abs(dO * O_ref), axis=-1)


def _check_backward(Q, K, V, dO, causal, tiling):
    """The float16-storage backward against (a) the float32 kernel on the same values, bit for bit, and (b) the
    float64 oracle gradients on those values, within :func:`_rounding_bound` with the float16 O's effect on D:
    dS = P ∘ (dP − D) moves by P_ij·δD_i, so dQ_i = τ Σ_j dS_ij K_j by at most τ·δD_i·Σ_j P_ij |K_j| and
    dK_j = τ Σ_i dS_ij Q_i by at most τ·Σ_i P_ij·δD_i·|Q_i| (summed over the GQA group); dV = Pᵀ dO not at all."""
    O, L = VERSIONS["v5"](Q, K, V, causal=causal, tiling=Tiling(4, 2, 2, 2), storage="float16")
    grads = BACKWARD_VERSIONS["v1"](Q, K, V, O, L, dO, causal=causal, tiling=tiling, storage="float16")
    assert all(g.dtype == np.float16 for g in grads)
    grads32 = BACKWARD_VERSIONS["v1"](*_f32(Q, K, V, O), L, *_f32(dO), causal=causal, tiling=tiling)
    for name, g, g32 in zip(("dQ", "dK", "dV"), grads, grads32):
        np.testing.assert_array_equal(g, g32.astype(np.float16), err_msg=name)   # rounded once, at the end

    Q64, K64, V64, dO64 = _f64(Q, K, V, dO)
    ref = fa2edu.attention_reference_backward(Q64, K64, V64, dO64, causal=causal)
    O_ref, _ = fa2edu.attention_reference(Q64, K64, V64, causal=causal)
    P = fa2edu.standard_attention(Q64, K64, V64, causal=causal).P               # float64, (Z, H_q, N_q, N_k)
    G = Q.shape[1] // K.shape[1]
    tau = Q.shape[-1] ** -0.5
    dD = _d_shift(O_ref, dO64)                                                  # (Z, H_q, N_q)
    Kg, Qa = np.repeat(np.abs(K64), G, axis=1), np.abs(Q64)                     # K as seen by each query head
    shift_dQ = tau * dD[..., None] * (P @ Kg)
    shift_dK = tau * (np.swapaxes(P * dD[..., None], -1, -2) @ Qa)              # (Z, H_q, N_k, d)
    shift_dK = shift_dK.reshape(K.shape[0], K.shape[1], G, *shift_dK.shape[2:]).sum(axis=2)
    P32 = fa2edu.standard_attention(*_f32(Q, K, V), causal=causal).P
    low = fa2edu.standard_attention_backward(*_f32(Q, K, V), P32, *_f32(dO), causal=causal)
    for name, g, want, base, extra in zip(("dQ", "dK", "dV"), grads, ref[:3], low[:3], (shift_dQ, shift_dK, 0.0)):
        assert np.isfinite(g).all(), f"{name} has NaN/inf"
        _rounding_bound(g, want, baseline_error(np.asarray(base), want), extra)
    return grads


BACKWARD_CASES = [  # (tiling (NY, NX, TR, TC), Z, H_q, H_kv, N_q, N_k, d, causal)
    (Tiling(2, 2, 2, 2), 1, 2, 1, 11, 13, 8, True),      # GQA, causal, N_q < N_k, several row/column blocks
    (Tiling(2, 4, 3, 2), 1, 1, 1, 10, 9, 16, False),     # T % d ≠ 0 (general tile move), KC = 4
]


@pytest.mark.parametrize("tiling, Z, H_q, H_kv, N_q, N_k, d, causal", BACKWARD_CASES)
def test_backward_v1_fp16_storage(tiling, Z, H_q, H_kv, N_q, N_k, d, causal):
    Q, K, V, dO = _problem(hash((N_q, N_k, d, causal)) % 2**32, Z, H_q, H_kv, N_q, N_k, d)
    _check_backward(Q, K, V, dO, causal, tiling)


def test_backward_fully_masked_rows_give_zero_dQ():
    Q, K, V, dO = _problem(8, 1, 1, 1, 11, 5, 8)          # causal, N_q − N_k = 6 rows see no key (L = +inf)
    dQ, dK, dV = _check_backward(Q, K, V, dO, True, Tiling(2, 2, 2, 2))
    assert np.all(dQ[..., :6, :] == 0.0) and np.abs(dQ[..., 6:, :]).max() > 0


# -- device inputs and bad input -------------------------------------------------------------------------------

def test_device_inputs_in_the_storage_dtype_are_used_and_give_device_arrays():
    Q, K, V, dO = _problem(3, 1, 1, 1, 9, 10, 8)
    til = Tiling(4, 2, 2, 2)
    O, L = VERSIONS["v5"](Q, K, V, causal=True, tiling=til, storage="float16")              # NumPy in, NumPy out
    dQ, dK, dV = BACKWARD_VERSIONS["v1"](Q, K, V, O, L, dO, causal=True, tiling=Tiling(2, 2, 2, 2),
                                         storage="float16")
    Qd, Kd, Vd, dOd = (cuda.to_device(x) for x in (Q, K, V, dO))
    Od, Ld = VERSIONS["v5"](Qd, Kd, Vd, causal=True, tiling=til, storage="float16")
    assert rt.is_device_array(Od) and Od.dtype == np.float16 and Ld.dtype == np.float32
    np.testing.assert_array_equal(Od.copy_to_host(), O)
    np.testing.assert_array_equal(Ld.copy_to_host(), L)
    grads = BACKWARD_VERSIONS["v1"](Qd, Kd, Vd, Od, Ld, dOd, causal=True, tiling=Tiling(2, 2, 2, 2),
                                    storage="float16")
    for g, want in zip(grads, (dQ, dK, dV)):
        assert rt.is_device_array(g) and g.dtype == np.float16
        np.testing.assert_array_equal(g.copy_to_host(), want)


def test_float16_numpy_inputs_with_float32_storage_compute_as_float32():
    Q, K, V, _ = _problem(5, 1, 1, 1, 6, 7, 8)
    O, L = VERSIONS["v5"](Q, K, V, tiling=Tiling(4, 2, 2, 2))             # default storage: float32 in and out
    O32, L32 = VERSIONS["v5"](*_f32(Q, K, V), tiling=Tiling(4, 2, 2, 2))
    assert O.dtype == np.float32
    np.testing.assert_array_equal(O, O32)
    np.testing.assert_array_equal(L, L32)


@pytest.mark.parametrize("storage", ["fp16", "float64", "bfloat16", None, np.float16])
def test_unknown_storage_is_a_value_error(storage):
    Q, K, V, dO = _problem(0, 1, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="storage must be 'float32' or 'float16'"):
        VERSIONS["v5"](Q, K, V, tiling=Tiling(4, 2, 2, 2), storage=storage)
    with pytest.raises(ValueError, match="storage"):
        tiled.run_forward(Q, K, V, tiling=Tiling(4, 2, 2, 2), shuffle=True, storage=storage)
    O, L = VERSIONS["v5"](Q, K, V, tiling=Tiling(4, 2, 2, 2))
    with pytest.raises(ValueError, match="storage"):
        BACKWARD_VERSIONS["v1"](Q, K, V, O, L, dO, tiling=Tiling(2, 2, 2, 2), storage=storage)


def test_device_dtype_that_does_not_match_storage_is_a_type_error():
    Q, K, V, dO = _problem(1, 1, 1, 1, 5, 6, 8)
    Q32, K32, V32 = (cuda.to_device(x) for x in _f32(Q, K, V))
    Q16, K16, V16, dO16 = (cuda.to_device(x) for x in (Q, K, V, dO))
    with pytest.raises(TypeError, match=r"Q must be float16 on the device .*got float32"):
        VERSIONS["v5"](Q32, K32, V32, tiling=Tiling(4, 2, 2, 2), storage="float16")
    with pytest.raises(TypeError, match=r"K must be float16 on the device .*got float32"):
        VERSIONS["v5"](Q16, K32, V16, tiling=Tiling(4, 2, 2, 2), storage="float16")
    with pytest.raises(TypeError, match=r"Q must be float32 on the device .*got float16"):
        VERSIONS["v5"](Q16, K16, V16, tiling=Tiling(4, 2, 2, 2))                   # default storage: float32
    O, L = VERSIONS["v5"](Q16, K16, V16, tiling=Tiling(4, 2, 2, 2), storage="float16")
    L16 = cuda.to_device(L.copy_to_host().astype(np.float16))
    with pytest.raises(TypeError, match=r"L must be float32 on the device .*got float16"):
        BACKWARD_VERSIONS["v1"](Q16, K16, V16, O, L16, dO16, tiling=Tiling(2, 2, 2, 2), storage="float16")
    dO32 = cuda.to_device(dO.astype(np.float32))
    with pytest.raises(TypeError, match=r"dO must be float16 on the device .*got float32"):
        BACKWARD_VERSIONS["v1"](Q16, K16, V16, O, L, dO32, tiling=Tiling(2, 2, 2, 2), storage="float16")


def test_numpy_values_beyond_float16_range_are_refused():
    Q, K, V, _ = _problem(2, 1, 1, 1, 4, 4, 8)
    Q = Q.astype(np.float32)
    Q[0, 0, 1, 2] = 7.0e4                                    # finite in float32, inf in float16 (max 65504)
    with pytest.raises(ValueError, match="Q has values beyond the range of float16"):
        VERSIONS["v5"](Q, *_f32(K, V), tiling=Tiling(4, 2, 2, 2), storage="float16")


# -- the GPU check script and the harness entry (no GPU needed) ---------------------------------------------

def test_fp16_check_parses_arguments_and_plans_the_papers_grid():
    from benchmarks import fp16_check
    args = fp16_check.parse_args([])
    configs = fp16_check.plan(args)
    assert {(c["d"], c["N"], c["causal"]) for c in configs} == {(d, N, c) for d in (64, 128) for N in (1024, 4096)
                                                                 for c in (False, True)}
    assert all(c["batch"] * c["N"] == 16384 and c["heads"] * c["d"] == 2048 for c in configs)
    assert args.passes == ("forward", "backward")
    args = fp16_check.parse_args(["--d", "64", "--N", "512", "--causal", "1", "--passes", "backward"])
    assert fp16_check.plan(args) == [dict(d=64, causal=True, N=512, batch=32, heads=32)]
    labels = [(label, spec.dtype, fast) for label, spec, fast in fp16_check.specs(args.passes)]
    assert labels == [("v1_fp32", "float32", ("backward", "float32")), ("v1_fp16", "float16", ("backward", "float16"))]


@pytest.mark.parametrize("argv", [["--d", "48"], ["--d", "6"], ["--N", "0"], ["--causal", "2"],
                                  ["--passes", "sideways"], ["--budget-s", "0"]])
def test_fp16_check_rejects_bad_arguments(argv, capsys):
    from benchmarks import fp16_check
    with pytest.raises(SystemExit) as info:
        fp16_check.parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("N, d", [(1000, 64), (4096, 128), (77, 32)])
def test_fp16_check_byte_model_matches_the_closed_forms_and_halves_fp16_tensors(N, d):
    from benchmarks.fp16_check import model_bytes
    from fa2edu.io import closed_form
    B_r, B_c = 64, 32
    # float32: 4 bytes per element of fa2edu's closed forms (the executed ledger's); the backward adds dQ's
    # zeroing (an initialisation write, outside the paper's totals)
    assert model_bytes("forward", "float32", N, d, B_r, B_c) == 4 * sum(closed_form("flash2", "forward", N, d, B_r,
                                                                                        B_c))
    assert model_bytes("backward", "float32", N, d, B_r, B_c) == 4 * sum(closed_form("flash2", "backward", N, d,
                                                                                         B_r, B_c)) + 4 * N * d
    # float16: every Q, K, V, O byte halves; L (N float32 written) does not
    f32, f16 = (model_bytes("forward", s, N, d, B_r, B_c) for s in ("float32", "float16"))
    assert f32 - 4 * N == 2 * (f16 - 4 * N)
    # backward: L, D and the float32 dQ atomics stay; the cast adds 6 bytes per element of dQ
    b32, b16 = (model_bytes("backward", s, N, d, B_r, B_c) for s in ("float32", "float16"))
    T_c = -(-N // B_c)
    fixed = 4 * N + 4 * N * d + T_c * 8 * N + T_c * N * d * 8          # D, dQ = 0, L and D reads, atomics
    assert b32 - fixed == 2 * (b16 - fixed - 6 * N * d)


def test_fp16_check_summary_pairs_fp16_with_fp32():
    from benchmarks import fp16_check

    def record(pass_, dtype, ms):
        return {"impl": "x", "pass": pass_, "dtype": dtype, "d": 64, "causal": False, "N": 1024, "ms": ms,
                "tflops": 1.0, "status": "ok", "rel_error": 1e-3, "model_bytes": 100 if dtype == "float32" else 50}
    records = [record("forward", "float32", 2.0), record("forward", "float16", 1.5),
               record("backward", "float32", 4.0)]                             # no fp16 partner: left out
    rows = fp16_check.summarize(records)
    assert len(rows) == 1 and rows[0]["ratio"] == pytest.approx(0.75) and rows[0]["pass_"] == "forward"
    text = fp16_check.format_summary(rows)
    assert "0.750" in text and "0.500" in text                                # time ratio, byte ratio
    records[1]["status"], records[1]["ms"] = "wrong", None
    assert fp16_check.summarize(records)[0]["ratio"] is None


def test_harness_registers_the_fp16_implementation_outside_the_default_set():
    from benchmarks.harness import impls
    spec = impls.IMPLS["kg_flash2_fast_fp16"]
    assert spec.dtype == "float16" and spec.passes == ("forward", "backward") and spec.family == "kernels_gpu"
    assert "kg_flash2_fast_fp16" not in impls.DEFAULT_IMPLS
    assert ("float16", "forward") in impls.TOLERANCE and ("float16", "backward") in impls.TOLERANCE
    assert impls.FP16_FORWARD in VERSIONS and impls.FP16_BACKWARD in BACKWARD_VERSIONS


def test_fp16_check_shape_check_runs_the_float16_path_against_the_oracle():
    # the script's GPU pre-check, here in the simulator on one tiny shape with the default tilings (d = 64):
    # causal with N_q > N_k, so two rows are fully masked
    from benchmarks import fp16_check
    (row,) = fp16_check.check_shapes(shapes=[(1, 1, 1, 5, 3, 64, True)])
    assert row["ok"] and row["forward_bitwise"]
    assert row["dtypes"] == ["float16", "float32", "float16", "float16", "float16"]
    # O carries float16's output rounding (nonzero, about 2^-11 of |O|); L is float32 (orders of magnitude less)
    assert 0 < row["errors"]["O"] <= 4 * U16 and row["errors"]["L"] < 1e-5
