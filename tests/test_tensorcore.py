"""Tensor-core kernels in numba's CUDA simulator: the fragment tables, the instruction twins, every forward rung.

The twins emulate each warp-level instruction (lanes meeting and exchanging registers), so the rungs' own source
runs here unchanged; ``tests/gpu/test_tensorcore_gpu.py`` runs the same checks on the real instructions.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, uint32

import fa2edu
import kernels_gpu.runtime as rt
from kernels_gpu import fragments, ptx
from kernels_gpu.tensorcore import VERSIONS, backward_steps, selftest, steps

torch = pytest.importorskip("torch")


# -- the fragment tables -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, shape", [(fragments.a_layout, (16, 16)), (fragments.b_layout, (16, 8)),
                                           (fragments.c_layout, (16, 8))])
def test_each_element_held_by_exactly_one_lane(layout, shape):
    lay = layout().reshape(-1, 2)
    assert len({tuple(x) for x in lay}) == shape[0] * shape[1]
    assert lay[:, 0].max() == shape[0] - 1 and lay[:, 1].max() == shape[1] - 1


def test_fragment_round_trips_and_mma_reference():
    rng = np.random.default_rng(1)
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    assert np.array_equal(fragments.from_a_fragments(fragments.a_fragments(A)), A)
    assert np.array_equal(fragments.from_b_fragments(fragments.b_fragments(B)), B)
    D = fragments.from_c_fragments(fragments.mma_reference(fragments.a_fragments(A), fragments.b_fragments(B),
                                                           fragments.c_fragments(C)))
    np.testing.assert_allclose(D, A @ B + C, rtol=1e-6, atol=1e-6)


def test_accumulators_of_two_tiles_are_the_a_operand():
    """FA2's register reuse: C of columns 0-7 and 8-15 of a 16 × 16 block, lane by lane, is that block's A."""
    S = np.arange(256.0).reshape(16, 16)
    got = fragments.c_to_a(fragments.c_fragments(S[:, :8]), fragments.c_fragments(S[:, 8:]))
    assert np.array_equal(got, fragments.a_fragments(S))


def test_ldmatrix_addressing_gives_the_mma_operands():
    """The addresses the rungs give ldmatrix (Q as A; K as B of two n-tiles; V, transposed, as B of P·V)."""
    M = np.arange(16 * 16).reshape(16, 16)                       # a 16 × 16 tile, row-major, 16 halves per row
    lane = np.arange(32)
    a_rows = (lane % 16) * 16 + 8 * (lane // 16)
    got = fragments.ldmatrix_reference(M.reshape(-1), a_rows)   # (32, 4, 2)
    assert np.array_equal(got.reshape(32, 8), fragments.a_fragments(M))
    k_rows = (lane % 8 + 8 * (lane // 16)) * 16 + 8 * ((lane // 8) % 2)   # K[key][dim]: B = Kᵀ
    got = fragments.ldmatrix_reference(M.reshape(-1), k_rows).reshape(32, 8)
    assert np.array_equal(got[:, :4], fragments.b_fragments(M[:8].T))
    assert np.array_equal(got[:, 4:], fragments.b_fragments(M[8:].T))
    v_rows = (lane % 8 + 8 * ((lane // 8) % 2)) * 16 + 8 * (lane // 16)  # V[key][dim]: B = V, transposed load
    got = fragments.ldmatrix_reference(M.reshape(-1), v_rows, trans=True).reshape(32, 8)
    assert np.array_equal(got[:, :4], fragments.b_fragments(M[:, :8]))
    assert np.array_equal(got[:, 4:], fragments.b_fragments(M[:, 8:]))


def test_layout_table_lists_every_lane():
    table = fragments.layout_table("A").splitlines()
    assert len(table) == 32 and table[5].startswith("lane  5: a0=(1,2), (1,3)")


# -- the instruction twins against the NumPy specification -----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_twin(dtype):
    got, expected = selftest.check_mma(dtype)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_twin(trans):
    got, expected = selftest.check_ldmatrix(trans)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pack_twin(dtype):
    (words, back), (exp_words, exp_back) = selftest.check_pack(dtype)
    np.testing.assert_array_equal(words, exp_words)
    np.testing.assert_array_equal(back, exp_back)


def test_bf16_rounding_matches_torch():
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32) * 1e3
    ours = ptx.half_values(ptx.half_bits(x, "bfloat16"), "bfloat16")
    theirs = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_cp_async_twin_lands_only_after_wait():
    got, expected = selftest.check_cp_async()
    np.testing.assert_array_equal(got, expected)
    # a copy not yet waited for has not landed: the twin is asynchronous, so a missing wait shows in CI
    groups = [[]]
    sm = np.zeros(4, dtype=np.uint32)
    ptx._PENDING.groups = groups
    ptx.cp_async16(sm, 0, np.arange(4, dtype=np.uint32) + 1, 0, 16)
    ptx.cp_async_commit()
    ptx.cp_async16(sm, 0, np.arange(4, dtype=np.uint32) + 9, 0, 16)
    ptx.cp_async_commit()
    assert not sm.any()
    ptx.cp_async_wait_one()
    assert sm.tolist() == [1, 2, 3, 4]
    ptx.cp_async_wait_all()
    assert sm.tolist() == [9, 10, 11, 12]


def test_cp_async_twin_reads_a_strided_source_in_address_order():
    """The GPU reads ``gmem + 4·index`` whatever the array's layout; the twin does the same for a strided view (the
    words between its rows included), where the C-contiguous flat index would be another element."""
    base = np.arange(2 * 6 * 3 * 8, dtype=np.uint32).reshape(2, 6, 3, 8)
    view = base.transpose(0, 2, 1, 3)                      # (Z, H, N, d) over (Z, N, H, d) memory
    sm = np.zeros(4, dtype=np.uint32)
    ptx._PENDING.groups = [[]]
    offset = 1 * (view.strides[0] // 4) + 2 * (view.strides[1] // 4) + 3 * (view.strides[2] // 4) + 4
    ptx.cp_async16(sm, 0, view, offset, 16)
    ptx.cp_async_commit()
    ptx.cp_async_wait_all()
    assert sm.tolist() == view[1, 2, 3, 4:8].tolist()


def test_vector_reduction_twin_adds_four_aligned_floats():
    """``red.global.add.v4.f32``'s twin adds four consecutive floats at a 16-byte aligned index, into a flat view
    of the array (as the GPU adds at ``gmem + 4·index``); a misaligned index or a strided array is refused, as the
    hardware would fault or add elsewhere."""
    acc = np.zeros((2, 8), dtype=np.float32)
    ptx.red_add_v4_f32(acc.reshape(-1), 4, 1.0, 2.0, 3.0, 4.0)
    ptx.red_add_v4_f32(acc.reshape(-1), 4, 0.5, 0.5, 0.5, 0.5)
    ptx.red_add_v4_f32(acc.reshape(-1), 12, -1.0, 0.0, 0.0, 1.0)
    assert acc.tolist() == [[0, 0, 0, 0, 1.5, 2.5, 3.5, 4.5], [0, 0, 0, 0, -1, 0, 0, 1]]
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ptx.red_add_v4_f32(acc.reshape(-1), 2, 1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        ptx.red_add_v4_f32(acc.T, 0, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("module", ["steps", "backward_steps"])
@pytest.mark.parametrize("which", ["copy_kv_async", "copy_kv_async_inc"])
def test_tile_copies_follow_the_strides(module, which):
    """Both tile copies of both step modules find rows by the array's strides: a (Z, H, N, d) view of (Z, N, H, d)
    memory — a transposed projection, as a GPT hands q, k, v over — lands the same tile as its contiguous copy,
    rows past N as zeros."""
    d, warps = 32, 2
    if module == "steps":
        cfg = steps.Config(d=d, warps=warps, B_c=32, dtype="float16", causal=False, simulated=True)
        copy, rows, RS = steps.make_steps(cfg)[which], cfg.B_c, cfg.RS
    else:
        cfg = backward_steps.BackwardConfig(d=d, warps=warps, B_r=16, dtype="float16", causal=False, simulated=True)
        copy, rows, RS = backward_steps.make_backward_steps(cfg)[which], cfg.B_c, cfg.RS
    T, size = 32 * warps, rows * RS

    @cuda.jit
    def land(X, out, z, h, row0, N):
        sm = cuda.shared.array(size, uint32)
        tid = cuda.threadIdx.x
        for e in range(tid, size, T):
            sm[e] = uint32(0xFFFFFFFF)
        cuda.syncthreads()
        copy(sm, 0, X, z, h, row0, N, tid)
        ptx.cp_async_commit()
        ptx.cp_async_wait_all()
        cuda.syncthreads()
        for e in range(tid, size, T):
            out[e] = sm[e]

    Z, H, N = 2, 3, 45
    memory = np.random.default_rng(5).integers(0, 2**32, size=(Z, N, H, d // 2), dtype=np.uint32)
    strided = cuda.to_device(memory).transpose((0, 2, 1, 3))
    packed = cuda.to_device(np.ascontiguousarray(memory.transpose(0, 2, 1, 3)))
    assert strided.strides != packed.strides
    for row0 in (0, 32):                                   # a whole tile, and one that runs past N
        tiles = []
        for X in (strided, packed):
            out = cuda.to_device(np.zeros(size, dtype=np.uint32))
            land[1, T](X, out, 1, 2, row0, N)
            tiles.append(out.copy_to_host().reshape(rows, RS)[:, :d // 2])
        np.testing.assert_array_equal(tiles[0], tiles[1])
        valid = min(rows, N - row0)
        np.testing.assert_array_equal(tiles[0][:valid], memory[1, row0:row0 + valid, 2])
        assert not tiles[0][valid:].any()


def test_bulk_copy_and_mbarrier_twins():
    got, expected = selftest.check_bulk_copy()
    np.testing.assert_array_equal(got, expected)


def test_mbarrier_twin_phases_like_the_hardware(monkeypatch):
    """Bytes may land before they are announced (the count goes below zero); a phase completes only when its
    arrivals are in and its bytes have landed; try_wait reports the phase of the given parity; a phase that can
    never complete is reported, not waited on forever."""
    import threading
    import types

    monkeypatch.setattr(ptx, "_MBAR_SPIN_LIMIT", 100)
    monkeypatch.setattr(ptx, "_MBAR_WAIT_S", 0.0)
    manager = types.SimpleNamespace()
    thread = threading.current_thread()
    thread._manager = manager                     # what a simulated CUDA thread carries
    try:
        sm = np.zeros(16, dtype=np.uint32)
        src = np.arange(1, 9, dtype=np.uint32)
        ptx.mbar_init(sm, 8, 1)
        ptx.bulk_copy(sm, 0, src, 0, 16, 8)
        assert ptx.mbar_try_wait(sm, 8, 0) == 0 and sm[:4].tolist() == [1, 2, 3, 4]   # landed, not announced
        ptx.mbar_arrive_expect_tx(sm, 8, 32)      # 32 announced, 16 in: still open
        assert ptx.mbar_try_wait(sm, 8, 0) == 0
        ptx.bulk_copy(sm, 4, src, 4, 16, 8)
        assert ptx.mbar_try_wait(sm, 8, 0) == 1 and sm[4:8].tolist() == [5, 6, 7, 8]
        assert ptx.mbar_try_wait(sm, 8, 1) == 0   # the next phase (parity 1) has not completed
        with pytest.raises(RuntimeError, match="never completes"):
            while ptx.mbar_try_wait(sm, 8, 1) == 0:
                pass
        with pytest.raises(RuntimeError, match="8-byte aligned"):
            ptx.mbar_init(sm, 3, 1)
        with pytest.raises(ValueError, match="multiple of 16"):
            ptx.bulk_copy(sm, 0, src, 0, 8, 8)
    finally:
        del thread._manager


def test_shfl_and_ex2_twins():
    (shuffled, powers), (exp_shuffled, exp_powers) = selftest.check_shfl_ex2()
    np.testing.assert_array_equal(shuffled, exp_shuffled)
    np.testing.assert_allclose(powers, exp_powers, rtol=1e-6, atol=0)


def test_cluster_instructions_have_no_twin_but_a_clear_error():
    """Thread-block clusters cannot be emulated by numba's simulator, which runs one block at a time: the cluster
    instructions' stand-ins refuse clearly (kernels_gpu.inference.decode never takes its cluster path there)."""
    if not ptx.SIMULATED:
        pytest.skip("the stand-ins exist in numba's simulator")
    for call in (ptx.cluster_arrive, ptx.cluster_wait, lambda: ptx.ld_cluster_f32(None, 0, 1)):
        with pytest.raises(RuntimeError, match="clusters need a GPU"):
            call()


# -- every rung against the float64 oracle ------------------------------------------------------------------------

def _inputs(shape_q, shape_kv, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    Q = (torch.randn(shape_q, generator=g) * scale).to(tdt)
    K = (torch.randn(shape_kv, generator=g) * scale).to(tdt)
    V = torch.randn(shape_kv, generator=g).to(tdt)
    return Q, K, V


def flash_attn_rule(O, L, Q, K, V, causal):
    """flash-attn's test rule: error ≤ 2 × that of PyTorch's attention in the same dtype, + a small slack."""
    q, k, v = (x.double().numpy() for x in (Q, K, V))
    O_ref, L_ref = fa2edu.attention_reference(q, k, v, causal=causal)
    G = Q.shape[-3] // K.shape[-3]
    kr, vr = K.repeat_interleave(G, dim=-3), V.repeat_interleave(G, dim=-3)
    N_q, N_k = Q.shape[-2], K.shape[-2]
    mask = torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q) if causal else None
    O_pt = torch.nn.functional.scaled_dot_product_attention(Q.float(), kr.float(), vr.float(),
                                                            attn_mask=mask).to(Q.dtype)
    O_pt = torch.nan_to_num(O_pt).double().numpy()                   # torch gives NaN on fully masked rows
    O_ref0 = np.where(np.isinf(L_ref)[..., None], 0.0, O_ref)
    err = np.abs(O.double().numpy() - O_ref0).max()
    err_pt = np.abs(O_pt - O_ref0).max()
    assert not torch.isnan(O).any() and not np.isnan(L.numpy()).any()
    assert err <= 2 * err_pt + 1e-3, (err, err_pt)
    finite = np.isfinite(L_ref)
    assert np.array_equal(np.isinf(L.numpy()), ~finite)
    np.testing.assert_allclose(L.numpy()[finite], L_ref[finite], rtol=1e-4, atol=1e-4)
    assert (O.double().numpy()[~finite] == 0).all()


CASES = [  # (Q shape, K/V shape, causal, dtype): ragged N, N_q ≠ N_k, GQA, d not a multiple of 16
    ((1, 2, 37, 24), (1, 1, 50, 24), True, "float16"),
    ((1, 1, 20, 64), (1, 1, 45, 64), False, "bfloat16"),   # two K/V tiles, the second partial
    ((1, 1, 21, 136), (1, 1, 33, 136), True, "float16"),   # d > 128: one row tile per warp from v10 on
    ((1, 2, 19, 16), (1, 1, 29, 16), True, "float16"),     # small: causal, GQA, N_q ≠ N_k, one tile
]
CASE_IDS = ["causal-gqa-f16", "ragged-bf16", "d136-causal", "small-causal-gqa"]


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


NEWEST = list(VERSIONS)[-1]

# the simulator is slow: every case for the fastest rung, the small case for every other rung (each rung still
# runs in CI against the oracle; the GPU tests run every rung at benchmark-like sizes)
RUNG_CASES = [(v, c) for v in VERSIONS for c in range(len(CASES))
              if (v == NEWEST and c < 3) or (v != NEWEST and c == 3)]


@pytest.mark.parametrize("version, case", RUNG_CASES, ids=[f"{v}-{CASE_IDS[c]}" for v, c in RUNG_CASES])
def test_rung_matches_oracle(version, case, poisoned):
    shape_q, shape_kv, causal, dtype = CASES[case]
    Q, K, V = _inputs(shape_q, shape_kv, dtype, seed=int(version.strip('v')))   # fixed per rung
    O, L = VERSIONS[version](Q, K, V, causal=causal)
    assert O.dtype == Q.dtype and L.dtype == torch.float32 and O.shape == Q.shape and L.shape == Q.shape[:-1]
    flash_attn_rule(O, L, Q, K, V, causal)


def test_fastest_rung_extreme_logits_and_masked_rows(poisoned):
    """Scores in the hundreds (exp would overflow without the running maximum) and rows that see no key
    (causal, N_q > N_k): O = 0, L = +inf, never NaN."""
    Q, K, V = _inputs((1, 1, 40, 32), (1, 1, 17, 32), "float16", seed=3, scale=6.0)
    O, L = VERSIONS[NEWEST](Q, K, V, causal=True)
    flash_attn_rule(O, L, Q, K, V, True)
    assert np.isinf(L.numpy()[..., :23]).all()


def test_numpy_float16_in_and_out():
    rng = np.random.default_rng(4)
    Q, K, V = (rng.standard_normal((1, 19, 16)).astype(np.float16) for _ in range(3))
    O, L = VERSIONS[NEWEST](Q, K, V)
    assert isinstance(O, np.ndarray) and O.dtype == np.float16 and L.dtype == np.float32
    O_ref, _ = fa2edu.attention_reference(Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64))
    assert np.abs(O - O_ref).max() < 2e-3


@pytest.mark.parametrize("bad, match", [
    (dict(Q=np.zeros((4, 12), np.float16), K=np.zeros((4, 12), np.float16), V=np.zeros((4, 12), np.float16)),
     "multiples of 8"),
    (dict(Q=np.zeros((4, 16), np.float32)), "float16 or bfloat16"),
    (dict(K=np.zeros((5, 8), np.float16)), "head dimension"),
    (dict(Q=np.zeros((3, 4, 16), np.float16), K=np.zeros((2, 4, 16), np.float16),
          V=np.zeros((2, 4, 16), np.float16)), "multiple of the number of key/value heads"),
    (dict(Q="matrix"), "must be"),
    (dict(Q=np.full((4, 16), np.inf, np.float16)), "finite"),
])
def test_bad_input(bad, match):
    args = dict(Q=np.zeros((4, 16), np.float16), K=np.zeros((4, 16), np.float16), V=np.zeros((4, 16), np.float16))
    args.update(bad)
    if isinstance(args["Q"], str):                       # an ndarray subclass is refused, not half-handled
        with pytest.warns(PendingDeprecationWarning):
            args["Q"] = np.matrix(np.zeros((4, 16), np.float16))
    with pytest.raises((TypeError, ValueError), match=match):
        VERSIONS[NEWEST](args["Q"], args["K"], args["V"])
