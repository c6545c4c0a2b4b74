"""kernels_gpu.decode_attention and kernels_gpu.varlen_attention on a real GPU, at serving-like sizes, against the
float64 oracle with flash-attn's rule: the error is at most twice PyTorch's own attention computed in the same
dtype (against the same oracle), plus a small absolute slack.

Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_decode_gpu.py -q -p no:cacheprovider

What it proves:

* decoding from paged caches (shuffled pages, unused entries NaN) and contiguous ones, ragged lengths with 0 and the
  full capacity, N_new = 1 and 3 (causal), GQA 1, 4 and 8, d = 64 and 128, the default split rule, one split and
  more splits than pages, float32, float16 and bfloat16 storage, a strided cache read in place: O and L per
  sequence within the rule;
* whole tiles by tensor copies (the default) and by ``cp.async`` give bit-identical results, through the kept plan
  on caches it was not made for too; tensor maps first made inside a graph capture serve the replay and the next
  call;
* the driver-level launch (the default) and numba's ordinary launch give bit-identical results; a call is
  bit-identical over reruns (no race); a decoding call captured in a CUDA graph replays to the same result; the
  merge launched early (programmatic dependent launch) gives the bits of an ordinary launch; a q that is not
  16-byte aligned runs the CUDA-core program; one kept plan called from four threads on their own streams gives
  each thread its own answer; splits merged inside their thread-block cluster give the oracle's answer, and the
  merge launch's within float16 rounding;
* device index arrays: ``validate=True`` refuses a bad block table; without it a bad one is clamped into the cache
  (never a fault);
* packed varlen batches with long-tailed lengths (empty sequences included), causal or not, GQA, three dtypes.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":  # the conftest skips these too; never compile for the simulator here
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU available", allow_module_level=True)

import kernels_gpu  # noqa: E402
from kernels_gpu import runtime as rt  # noqa: E402
from kernels_gpu.inference import decode_io  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(rt, "poison_outputs", True)


# -- problems and the oracle --------------------------------------------------------------------------------------

def make_cache(seed, *, B, H_kv, G, N_new, d, page, max_pages, lengths, dtype, paged=True):
    """q and a KV cache on the GPU: paged (pages shuffled, 3 spare pages, unused entries NaN) or contiguous
    (capacity page·max_pages). Returns a dict with the tensors and each sequence's keys/values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = DTYPES[dtype]
    capacity = page * max_pages
    seqlens = torch.tensor([capacity if n == "full" else n for n in lengths], dtype=torch.int32, device="cuda")
    q = torch.randn(B, H_kv * G, N_new, d, device="cuda", generator=g).to(tdt)
    keys = [torch.randn(H_kv, int(n), d, device="cuda", generator=g).to(tdt) for n in seqlens]
    values = [torch.randn(H_kv, int(n), d, device="cuda", generator=g).to(tdt) for n in seqlens]
    if paged:
        num_pages = B * max_pages + 3
        k_cache = torch.full((num_pages, H_kv, page, d), float("nan"), device="cuda").to(tdt)
        v_cache = torch.full((num_pages, H_kv, page, d), float("nan"), device="cuda").to(tdt)
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[:B * max_pages]
        table = perm.reshape(B, max_pages).to(torch.int32)
        for b, n in enumerate(seqlens.tolist()):
            for p in range(-(-n // page)):
                rows = slice(p * page, min((p + 1) * page, n))
                k_cache[table[b, p], :, :rows.stop - rows.start] = keys[b][:, rows]
                v_cache[table[b, p], :, :rows.stop - rows.start] = values[b][:, rows]
            table[b, -(-n // page):] = -1
        table = table.cuda()
    else:
        k_cache = torch.full((B, H_kv, capacity, d), float("nan"), device="cuda").to(tdt)
        v_cache = torch.full((B, H_kv, capacity, d), float("nan"), device="cuda").to(tdt)
        for b, n in enumerate(seqlens.tolist()):
            k_cache[b, :, :n], v_cache[b, :, :n] = keys[b], values[b]
        table = None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=table, keys=keys,
                values=values, N_new=N_new)


def attention(q, k, v, causal, compute_dtype):
    """softmax(τ q kᵀ + causal mask) v for one sequence (q (H_q, N_q, d), k, v (H_kv, N_k, d)), GQA by repeat, in
    ``compute_dtype`` (float64: the oracle; the storage dtype: PyTorch's own attention in that dtype). Rows that
    see no key: O = 0, L = +inf."""
    G = q.shape[0] // k.shape[0]
    q, k, v = q.to(compute_dtype), k.repeat_interleave(G, 0).to(compute_dtype), v.repeat_interleave(G, 0).to(
        compute_dtype)
    S = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if causal:
        N_q, N_k = S.shape[-2:]
        keep = torch.ones(N_q, N_k, dtype=torch.bool, device=S.device).tril(N_k - N_q)
        S = S.masked_fill(~keep, -torch.inf)
    L = torch.logsumexp(S.float() if compute_dtype != torch.float64 else S, -1)
    P = torch.softmax(S, -1).nan_to_num(0.0)
    return P @ v, L


def assert_rule(O, L, O_ref, L_ref, O_pt, what, slack):
    err = (O.double() - O_ref).abs().max().item() if O.numel() else 0.0
    err_pt = (O_pt.double() - O_ref).abs().max().item() if O.numel() else 0.0
    assert not O.isnan().any() and not L.isnan().any(), f"{what}: NaN"
    assert err <= 2 * err_pt + slack, f"{what}: error {err:.3e} > 2 × PyTorch's {err_pt:.3e} + {slack}"
    finite = torch.isfinite(L_ref)
    assert torch.equal(torch.isinf(L), ~finite), f"{what}: +inf pattern of L"
    assert (O[~finite] == 0).all(), f"{what}: rows that see no key must be 0"
    if finite.any():
        torch.testing.assert_close(L[finite].double(), L_ref[finite], rtol=2e-5, atol=2e-4)


SLACK = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 4e-3}


def check_decode(case, O, L, dtype, causal=True):
    for b, n in enumerate(case["cache_seqlens"].tolist()):
        if n == 0:
            assert (O[b] == 0).all() and torch.isinf(L[b]).all(), "an idle slot: O = 0, L = +inf"
            continue
        q, k, v = case["q"][b], case["keys"][b], case["values"][b]
        O_ref, L_ref = attention(q, k, v, causal, torch.float64)
        O_pt, _ = attention(q, k, v, causal, DTYPES[dtype])
        assert_rule(O[b], L[b], O_ref, L_ref, O_pt, f"sequence {b} (n = {n})", SLACK[dtype])


# -- decoding ----------------------------------------------------------------------------------------------------

DECODE = [  # (B, H_kv, G, N_new, d, page, max_pages, lengths, paged, num_splits)
    (4, 8, 4, 1, 128, 256, 16, [4096, 0, "full", 1], True, None),          # the benchmark's heads, ragged
    (3, 2, 8, 1, 128, 16, 64, [1000, 7, "full"], True, None),               # small pages, GQA 8
    (2, 4, 1, 3, 64, 256, 8, [2048, 2], True, 5),                            # MHA, 3 new tokens (one sees nothing)
    (2, 8, 4, 1, 128, 256, 12, ["full", 777], False, 1),                     # contiguous, one split
    (1, 8, 4, 1, 128, 256, 8, [2000], True, 40),                             # more splits than pages
]


@pytest.mark.parametrize("program", ["default", "cuda_core"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("spec", DECODE, ids=lambda s: f"B{s[0]}-G{s[2]}-new{s[3]}-d{s[4]}-p{s[5]}-"
                                                        f"{'paged' if s[8] else 'contig'}-S{s[9]}")
def test_decode_matches_oracle(dtype, spec, program):
    """Both split programs: the default (tensor cores for float16/bfloat16) and the CUDA-core
    one (float32 always runs it)."""
    if program == "cuda_core" and dtype == "float32":
        pytest.skip("float32 runs the CUDA-core program by default")
    B, H_kv, G, N_new, d, page, max_pages, lengths, paged, S = spec
    case = make_cache(zlib.crc32(repr((dtype, spec)).encode()), B=B, H_kv=H_kv, G=G, N_new=N_new, d=d, page=page,
                      max_pages=max_pages, lengths=lengths, dtype=dtype, paged=paged)
    extra = {} if paged else {"block_size": page}
    if program == "cuda_core":
        extra["kernel"] = "cuda_core"
    O, L = kernels_gpu.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                        case["block_table"], num_splits=S, **extra)
    torch.cuda.synchronize()
    assert O.dtype == DTYPES[dtype] and O.shape == case["q"].shape and L.dtype == torch.float32
    check_decode(case, O, L, dtype)


@pytest.mark.parametrize("d, d_v, G, N_new", [(40, 40, 4, 1), (256, 256, 4, 1), (64, 128, 8, 3), (8, 8, 2, 2)])
def test_tensorcore_program_head_sizes_and_row_tiles(d, d_v, G, N_new):
    """The tensor-core program at head sizes off the fast copy path (d = 40: 5 chunks a row; d = 8: half a 16-wide
    MMA step), d = 256 (the largest), d ≠ d_v, and 24 rows (two 16-row tiles); its partials, merged on the host in
    float32, give the call's answer."""
    from kernels_gpu.inference import decode
    g = torch.Generator(device="cuda").manual_seed(d * 1000 + d_v + G)
    B, H_kv, page, max_pages = 3, 2, 16, 40
    seqlens = torch.tensor([600, 0, 640], dtype=torch.int32, device="cuda")
    q = torch.randn(B, H_kv * G, N_new, d, device="cuda", generator=g).half()
    k = torch.randn(B, H_kv, page * max_pages, d, device="cuda", generator=g).half()
    v = torch.randn(B, H_kv, page * max_pages, d_v, device="cuda", generator=g).half()
    O, L = kernels_gpu.decode_attention(q, k, v, seqlens, block_size=page, num_splits=7, kernel="tensorcore")
    O_s, L_s, S = decode.decode_split_partials(q, k, v, seqlens, block_size=page, num_splits=7, kernel="tensorcore")
    O_m, L_m = decode.merge_split_partials(O_s.cpu().numpy(), L_s.cpu().numpy())
    torch.cuda.synchronize()
    for b, n in enumerate(seqlens.tolist()):
        if n == 0:
            assert (O[b] == 0).all() and torch.isinf(L[b]).all()
            continue
        O_ref, L_ref = attention(q[b], k[b, :, :n], v[b, :, :n], True, torch.float64)
        O_pt, _ = attention(q[b], k[b, :, :n], v[b, :, :n], True, torch.float16)
        assert_rule(O[b], L[b], O_ref, L_ref, O_pt, f"d {d}, d_v {d_v}, sequence {b}", SLACK["float16"])
    torch.testing.assert_close(O.float().cpu(), torch.from_numpy(O_m).float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(L.cpu(), torch.from_numpy(L_m), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("paged, S", [(True, None), (False, 1), (True, 3)])
def test_a_repeated_call_runs_the_kept_plan(paged, S, monkeypatch):
    """A call on PyTorch CUDA tensors keeps a DecodePlan; the next call with the same shapes, strides, dtypes and
    options runs it (no checks, two prepared launches): the same bits on the same data, and new tensors of the
    same shapes read at their own addresses (a new cache, new lengths, a new block table) within the rule."""
    from kernels_gpu.inference import decode
    spec = dict(B=3, H_kv=2, G=4, N_new=1, d=128, page=16, max_pages=20, dtype="float16", paged=paged)
    case = make_cache(11, lengths=[300, 0, "full"], **spec)
    extra = {} if paged else {"block_size": 16}

    def call(c):
        return kernels_gpu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"],
                                            c["block_table"], num_splits=S, **extra)
    monkeypatch.setattr(decode, "_PLANS", {})
    first = call(case)
    assert len(decode._PLANS) == 1
    plan = next(iter(decode._PLANS.values()))
    ran = []
    monkeypatch.setattr(decode.DecodePlan, "__call__",
                        lambda self, *a, _real=decode.DecodePlan.__call__: ran.append(self) or _real(self, *a))
    again = call(case)
    other = make_cache(12, lengths=[17, "full", 0], **spec)
    got = call(other)
    torch.cuda.synchronize()
    assert ran == [plan, plan] and len(decode._PLANS) == 1
    assert torch.equal(first.O, again.O) and torch.equal(first.L, again.L)
    check_decode(other, got.O, got.L, "float16")


TENSOR_COPY = [  # (B, H_kv, G, N_new, d, page, max_pages, lengths, paged, num_splits)
    (3, 2, 4, 1, 128, 16, 40, [300, 0, "full"], True, None),                # small pages, the split rule
    (2, 8, 4, 1, 128, 256, 6, ["full", 777], False, 1),                     # contiguous, one split
    (2, 2, 8, 3, 64, 64, 9, [500, "full"], True, 5),                         # d 64, 3 new tokens, GQA 8
    (2, 2, 1, 2, 256, 32, 7, [129, "full"], False, None),                   # d 256 (four boxes a row), MHA
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("spec", TENSOR_COPY, ids=lambda s: f"B{s[0]}-G{s[2]}-new{s[3]}-d{s[4]}-p{s[5]}-"
                                                             f"{'paged' if s[8] else 'contig'}-S{s[9]}")
def test_tensor_copies_give_the_bits_of_cp_async(dtype, spec, monkeypatch):
    """Whole tiles by the copy engine (``decode_tc.COPY = "tensor"``, the default on a GPU: tensor maps, swizzled
    tiles) or by ``cp.async`` (padded tiles): the same arithmetic on the same values in the same order, so the
    same bits. Two caches alternate and each is called twice, so the kept plan reads a cache it was not made for
    (its maps are encoded for the new addresses) — with unused cache entries NaN, a tile read from the wrong
    place shows."""
    from kernels_gpu import driver_launch
    from kernels_gpu.inference import decode, decode_tc
    B, H_kv, G, N_new, d, page, max_pages, lengths, paged, S = spec
    cases = [make_cache(40 + i, B=B, H_kv=H_kv, G=G, N_new=N_new, d=d, page=page, max_pages=max_pages,
                        lengths=lengths, dtype=dtype, paged=paged) for i in range(2)]

    def run(copy, c):
        monkeypatch.setattr(decode_tc, "COPY", copy)
        return kernels_gpu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"],
                                            c["block_table"], num_splits=S, **({} if paged else {"block_size": page}))
    monkeypatch.setattr(decode, "_PLANS", driver_launch.PlanCache())
    tensor = [run("tensor", c) for c in cases + cases]
    assert [p.call.copy for p in decode._PLANS.values()] == ["tensor"]
    monkeypatch.setattr(decode, "_PLANS", driver_launch.PlanCache())
    plain = [run("cp.async", c) for c in cases]
    torch.cuda.synchronize()
    for i, (O, L) in enumerate(tensor):
        assert torch.equal(O.view(torch.int16), plain[i % 2].O.view(torch.int16)), f"call {i}: O"
        assert torch.equal(L, plain[i % 2].L), f"call {i}: L"
    check_decode(cases[1], *tensor[3], dtype)


def test_two_warp_programs_where_programs_outnumber_the_sms(monkeypatch):
    """The split rule's two-warp programs (decode.tc_warps: more programs than SMs, one split): batch 40 × 8 KV
    heads = 320 programs on an H100's 132 SMs, within the rule; the same call with four warps agrees to float32
    rounding (the warps' merge order differs)."""
    from kernels_gpu.inference import decode
    assert decode.tc_warps(320, 132) == 2 and decode.tc_warps(128, 132) == 4
    case = make_cache(60, B=40, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=2, lengths=[511] * 39 + ["full"],
                      dtype="bfloat16")
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"])
    monkeypatch.setattr(decode, "_PLANS", {})
    two = kernels_gpu.decode_attention(*args)
    monkeypatch.setattr(decode, "TC_WARPS", 4)
    monkeypatch.setattr(decode, "_PLANS", {})
    four = kernels_gpu.decode_attention(*args)
    torch.cuda.synchronize()
    check_decode(case, two.O, two.L, "bfloat16")
    torch.testing.assert_close(two.O.float(), four.O.float(), atol=1e-2, rtol=0)
    torch.testing.assert_close(two.L, four.L, atol=1e-5, rtol=1e-6)


def test_tensor_maps_first_made_inside_a_graph_capture():
    """A cache first seen while a CUDA graph is being captured: its tensor maps are uploaded by a copy the graph
    captures (nothing runs during a capture), so the replay reads them — and the next call outside the capture
    uploads them again before using them."""
    spec = dict(B=2, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=8, dtype="float16")
    warm, fresh = make_cache(50, lengths=[1500, "full"], **spec), make_cache(51, lengths=["full", 900], **spec)

    def call(c):
        return kernels_gpu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["block_table"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(warm)                                           # compile, plan: the same shapes as ``fresh``
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        O_g, L_g = call(fresh)
    graph.replay()
    eager = call(fresh)
    torch.cuda.synchronize()
    assert torch.equal(O_g, eager.O) and torch.equal(L_g, eager.L)
    check_decode(fresh, O_g, L_g, "float16")


def test_a_kept_plan_keeps_no_tensor_of_its_call(monkeypatch):
    """The plan a call leaves behind holds shapes, strides and addresses' geometry, never the call's tensors: once
    the caller drops its cache, the memory is free (a serving loop that replaces caches must not leak them)."""
    import gc
    import weakref

    from kernels_gpu.inference import decode
    monkeypatch.setattr(decode, "_PLANS", {})
    case = make_cache(70, B=2, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=4, lengths=[700, "full"],
                      dtype="float16")
    kernels_gpu.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                 case["block_table"])
    torch.cuda.synchronize()
    assert len(decode._PLANS) == 1
    refs = [weakref.ref(case[k]) for k in ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")]
    del case
    gc.collect()
    assert all(r() is None for r in refs)


def test_decode_strided_cache_read_in_place():
    """A (B, N_max, H_kv, d) cache seen as (B, H_kv, N_max, d) through a transpose: read where it is."""
    case = make_cache(3, B=2, H_kv=4, G=2, N_new=1, d=128, page=256, max_pages=4, lengths=[900, 1024],
                      dtype="float16", paged=False)
    k_bnhd = case["k_cache"].transpose(1, 2).contiguous()
    v_bnhd = case["v_cache"].transpose(1, 2).contiguous()
    O, L = kernels_gpu.decode_attention(case["q"], k_bnhd.transpose(1, 2), v_bnhd.transpose(1, 2),
                                        case["cache_seqlens"])
    torch.cuda.synchronize()
    check_decode(case, O, L, "float16")


def test_lean_launch_equals_numba_launch_and_reruns(monkeypatch):
    """The same kernels launched by the driver-level launch and by numba's: the same bits (the merge launch in
    both: numba's launch has no clusters), over reruns too."""
    from kernels_gpu.inference import decode
    monkeypatch.setattr(decode, "CLUSTER_MERGE", False)
    monkeypatch.setattr(decode, "_PLANS", {})
    case = make_cache(5, B=3, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=8, lengths=[2000, "full", 300],
                      dtype="bfloat16")
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"])
    O1, L1 = kernels_gpu.decode_attention(*args)
    O2, L2 = kernels_gpu.decode_attention(*args)
    monkeypatch.setenv("FA2EDU_LEAN_LAUNCH", "0")
    assert not decode_io.lean_launch_enabled()
    O3, L3 = kernels_gpu.decode_attention(*args)
    torch.cuda.synchronize()
    for O, L in ((O2, L2), (O3, L3)):
        assert torch.equal(O.view(torch.int16), O1.view(torch.int16)) and torch.equal(L, L1)


def test_numpy_inputs_and_numba_device_arrays():
    from numba import cuda
    case = make_cache(6, B=2, H_kv=2, G=4, N_new=1, d=64, page=64, max_pages=6, lengths=[300, 17],
                      dtype="float16")
    host = [case[k].cpu().numpy() for k in ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")]
    O, L = kernels_gpu.decode_attention(*host)
    assert isinstance(O, np.ndarray) and O.dtype == np.float16
    check_decode(case, torch.from_numpy(O).cuda(), torch.from_numpy(L).cuda(), "float16")
    dev = [cuda.to_device(x) for x in host[:3]]
    O_d, L_d = kernels_gpu.decode_attention(*dev, host[3], host[4])
    np.testing.assert_array_equal(O_d.copy_to_host(), O)


def test_cuda_graph_replay():
    case = make_cache(7, B=2, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=8, lengths=[1500, "full"],
                      dtype="float16")
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"])
    O_eager, L_eager = kernels_gpu.decode_attention(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels_gpu.decode_attention(*args)                  # compile and warm up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        O_g, L_g = kernels_gpu.decode_attention(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(O_g, O_eager) and torch.equal(L_g, L_eager)


@pytest.mark.parametrize("B, lengths, S, clustered", [
    (1, [1500], 4, True),                                        # 4 splits a head, some past the keys (empty)
    (2, ["full", 0], 3, True),                                   # an idle slot: every split empty
    (8, [777, "full", 0, 5, 4000, 256, 3000, "full"], None, True),   # the split rule: 2 splits
    (1, ["full"], None, None),                                   # 16 splits: clusters only where the GPU fits them
])
def test_splits_merged_in_their_cluster(B, lengths, S, clustered, monkeypatch):
    """Where the GPU can hold them, the S split programs of a (sequence, KV head) run as one thread-block cluster
    and merge their partials through distributed shared memory (one launch, nothing in HBM but O and L): within
    the rule of the oracle, sequences with no key included, and within float16 rounding of the merge launch's
    answer (a different order of float32 additions). Clusters of 2 to 4 programs, one per SM, fit an H100 or H200
    many times over, so those calls must take the cluster path; 8 clusters of 16 do not fit an H100 one program
    per SM (``cuOccupancyMaxActiveClusters``: 7), and the call then takes the merge launch."""
    from kernels_gpu.inference import decode
    case = make_cache(60 + B, B=B, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=16, lengths=lengths,
                      dtype="float16")
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"])
    out = {}
    for merged in (True, False):
        monkeypatch.setattr(decode, "CLUSTER_MERGE", merged)
        monkeypatch.setattr(decode, "_PLANS", {})
        out[merged] = kernels_gpu.decode_attention(*args, num_splits=S)
        plan = next(iter(decode._PLANS.values()))
        splits = kernels_gpu.inference.decode.planned_splits(*args, num_splits=S)
        taken = len(plan.launches) == 1 and plan.launches[0].cluster == splits
        assert taken if merged and clustered else not taken if not merged else True
        assert len(plan.launches) == 1 + (splits > 1 and not taken)
        again = kernels_gpu.decode_attention(*args, num_splits=S)         # through the kept plan
        torch.cuda.synchronize()
        assert torch.equal(again.O, out[merged].O) and torch.equal(again.L, out[merged].L)
        check_decode(case, *out[merged], "float16")
    torch.testing.assert_close(out[True].O.float(), out[False].O.float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(out[True].L, out[False].L, atol=1e-5, rtol=1e-6)


def test_one_plan_from_threads_on_their_own_streams(monkeypatch):
    """A kept plan's launches pack their parameters in storage the plan owns (kernels_gpu.driver_launch.Prepared):
    four threads calling the same plan at once, each on its own stream with its own cache, get their own answers —
    no thread's addresses end up in another's launch — bit for bit those of calls made one at a time."""
    import threading

    from kernels_gpu.inference import decode
    cases = [make_cache(40 + i, B=2, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=8, lengths=["full", 900],
                        dtype="float16") for i in range(4)]

    def call(c):
        return kernels_gpu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"],
                                            c["block_table"])
    monkeypatch.setattr(decode, "_PLANS", {})
    alone = [call(c) for c in cases]
    torch.cuda.synchronize()
    assert len(decode._PLANS) == 1
    results, errors = {}, []
    start = threading.Barrier(len(cases))

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            start.wait(timeout=60)
            with torch.cuda.stream(stream):
                results[i] = [call(cases[i]) for _ in range(50)]
            stream.synchronize()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for i, runs in results.items():
        for O, L in runs:
            assert torch.equal(O, alone[i].O) and torch.equal(L, alone[i].L)
    check_decode(cases[0], *alone[0], "float16")


def test_merge_launched_early_equals_an_ordinary_launch(monkeypatch, request):
    """The merge as a programmatic dependent launch (where the device and cuda.core have it: it may start while the
    split programs still run) gives the bits of an ordinary launch. Two caches alternate, so partials left in
    reused memory by the previous call belong to the other problem: a merge that read them before the split
    programs were done would give a different answer."""
    from kernels_gpu import driver_launch
    from kernels_gpu.inference import decode
    request.addfinalizer(driver_launch.pdl_available.cache_clear)
    cases = [make_cache(20 + i, B=1, H_kv=8, G=4, N_new=1, d=128, page=256, max_pages=32, lengths=["full"],
                        dtype="float16") for i in range(2)]

    def call(c):
        return kernels_gpu.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"],
                                            c["block_table"], num_splits=32)
    monkeypatch.setattr(decode, "_PLANS", {})
    early = [call(cases[i % 2]) for i in range(40)]
    monkeypatch.setenv("FA2EDU_PDL", "0")
    driver_launch.pdl_available.cache_clear()
    assert not driver_launch.pdl_available()
    monkeypatch.setattr(decode, "_PLANS", {})
    ordinary = [call(c) for c in cases]
    torch.cuda.synchronize()
    for i, (O, L) in enumerate(early):
        assert torch.equal(O, ordinary[i % 2].O) and torch.equal(L, ordinary[i % 2].L), f"call {i}"
    check_decode(cases[0], *ordinary[0], "float16")


def test_q_not_16_byte_aligned_runs_the_cuda_core_program():
    """The tensor-core program copies q's rows 16 bytes at a time: a q 4 bytes off (a view into a larger buffer)
    runs the CUDA-core program, correctly, and naming the tensor-core one is an error that says why."""
    from kernels_gpu.inference import decode
    case = make_cache(9, B=2, H_kv=2, G=4, N_new=1, d=64, page=16, max_pages=8, lengths=[100, 37],
                      dtype="bfloat16")
    buf = torch.empty(case["q"].numel() + 2, dtype=torch.bfloat16, device="cuda")
    q = buf[2:].view(case["q"].shape)
    q.copy_(case["q"])
    assert q.data_ptr() % 16 == 4
    args = (q, case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"])
    assert decode._prepare(*args, True, None, None, None, None).program == "cuda_core"
    O, L = kernels_gpu.decode_attention(*args)
    torch.cuda.synchronize()
    check_decode(case, O, L, "bfloat16")
    with pytest.raises(ValueError, match="16-byte aligned rows of q"):
        kernels_gpu.decode_attention(*args, kernel="tensorcore")


def test_device_index_arrays_validate_or_clamp():
    """Device index data is checked with validate=True; unchecked, the kernel clamps it — page ids to
    [0, num_pages), lengths to the capacity — so a bad value gives a wrong answer for its own sequence, never a
    fault and never a change to the other sequences: the result is, bit for bit, the result of the clamped
    arguments, and the sequence whose arguments are good is right."""
    case = make_cache(8, B=2, H_kv=2, G=2, N_new=1, d=64, page=16, max_pages=4, lengths=[40, 20],
                      dtype="float32")
    num_pages, max_pages = case["k_cache"].shape[0], case["block_table"].shape[1]
    capacity = case["k_cache"].shape[2] * max_pages
    bad = case["block_table"].clone()
    bad[0, 1] = 10**6
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], bad)
    with pytest.raises(ValueError, match="block_table"):
        kernels_gpu.decode_attention(*args, validate=True)
    O, L = kernels_gpu.decode_attention(*args)                 # unchecked: clamped, a wrong answer, no fault
    too_long = torch.tensor([10**6, 5], dtype=torch.int32, device="cuda")
    O2, L2 = kernels_gpu.decode_attention(case["q"], case["k_cache"], case["v_cache"], too_long,
                                          case["block_table"])
    # the same calls with the arguments clamped as the kernel clamps them (page 10**6 → the last page, length
    # 10**6 → the capacity; the table's -1 entries past sequence 0's pages → page 0); still device data, unchecked
    O_c, L_c = kernels_gpu.decode_attention(*args[:4], bad.clamp(0, num_pages - 1))
    O2_c, L2_c = kernels_gpu.decode_attention(case["q"], case["k_cache"], case["v_cache"],
                                              too_long.clamp(0, capacity), case["block_table"].clamp(0, num_pages - 1))
    torch.cuda.synchronize()                                   # no fault (an illegal address would raise here)
    for got, want, what in ((O, O_c, "O"), (L, L_c, "L"), (O2, O2_c, "O2"), (L2, L2_c, "L2")):
        assert got.shape == want.shape, what
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{what}: not the clamped answer")
    # Sequence 1's arguments are good in the first call (its whole cache) and in the second (its first 5 keys).
    sequence_1 = dict(case, q=case["q"][1:], cache_seqlens=case["cache_seqlens"][1:], keys=case["keys"][1:],
                      values=case["values"][1:])
    check_decode(sequence_1, O[1:], L[1:], "float32")
    first_5 = dict(sequence_1, cache_seqlens=too_long[1:], keys=[case["keys"][1][:, :5]],
                   values=[case["values"][1][:, :5]])
    check_decode(first_5, O2[1:], L2[1:], "float32")


# -- varlen --------------------------------------------------------------------------------------------------------

def long_tailed(seed, B, median, cap):
    rng = np.random.default_rng(seed)
    return np.minimum(cap, rng.lognormal(np.log(median), 1.0, size=B).astype(np.int64))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_oracle(dtype, causal):
    lengths = long_tailed(11, 12, 300, 3000)
    lengths[3] = 0
    n_q = lengths.copy()
    n_k = lengths + (np.arange(12) % 3) * 17                     # n_k ≥ n_q (a prefix of cached keys)
    n_k[5] = 0                                                   # queries with no key at all
    cu_q = np.concatenate([[0], np.cumsum(n_q)])
    cu_k = np.concatenate([[0], np.cumsum(n_k)])
    g = torch.Generator(device="cuda").manual_seed(12)
    tdt = DTYPES[dtype]
    H_kv, G, d = 2, 4, 128
    q = torch.randn(H_kv * G, int(cu_q[-1]), d, device="cuda", generator=g).to(tdt)
    k = torch.randn(H_kv, int(cu_k[-1]), d, device="cuda", generator=g).to(tdt)
    v = torch.randn(H_kv, int(cu_k[-1]), d, device="cuda", generator=g).to(tdt)
    O, L = kernels_gpu.varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    torch.cuda.synchronize()
    assert O.dtype == tdt and O.shape == q.shape
    for b in range(12):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:
            assert (O[:, rows] == 0).all() and torch.isinf(L[:, rows]).all()
            continue
        O_ref, L_ref = attention(q[:, rows], k[:, keys], v[:, keys], causal, torch.float64)
        O_pt, _ = attention(q[:, rows], k[:, keys], v[:, keys], causal, tdt)
        assert_rule(O[:, rows], L[:, rows], O_ref, L_ref, O_pt, f"sequence {b}", SLACK[dtype])
