"""fa2edu.distributed: ring attention on real gloo process groups, checked against the float64 oracle.

Spawning a process group costs seconds (each process imports torch), so the module starts **one** group of 4
processes, whose workers run every case in turn and send their shards back through a queue; the checks then run
here, in the test process, on the unsharded results. The rings of W = 4 run on the whole world (the default
group), those of W = 2 and W = 3 on the subgroups of ranks 0, 1 and 0, 1, 2. Every collective runs under the
group's timeout and the workers are joined with a deadline and killed past it: nothing can hang.

The same group also runs the W = 1 ring (each rank in a group of its own) and a ring on a subgroup whose group
ranks differ from the global ones (ranks 1, 2, 3).
"""

from __future__ import annotations

import math
import os
import queue as queue_module
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from tolerances import assert_close_to_oracle  # noqa: E402

import fa2edu  # noqa: E402
from fa2edu import distributed as cp  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with the gloo backend")

GROUP_TIMEOUT_S = 45          # every collective and point-to-point wait of the workers
DEADLINE_S = 240              # the whole group (every W's cases), from spawn to the last result
WORLD = 4                     # the one group's size; W = 2 and 3 ring on its first ranks


# ----------------------------------------------------------------------------------------------------------------
# Cases: each one is a dict, run by every rank of its ring
# ----------------------------------------------------------------------------------------------------------------

SHAPES = [  # (B, H_q, H_kv, c, d, d_v): c tokens per zigzag chunk, N = 2·W·c (so both layouts can split it)
    (2, 2, 2, 3, 8, 8),       # heads of their own, N_local = 6
    (1, 4, 2, 5, 6, 4),       # GQA, d_v ≠ d, odd chunks
    (1, 3, 1, 2, 4, 4),       # MQA
]


def _cases(W: int) -> list[dict]:
    """The cases of a ring of W ranks: on the world when W = WORLD, else on the subgroup of ranks 0 … W − 1."""
    cases = []
    i = 0
    for layout in cp.LAYOUTS:
        for causal in (False, True):
            for dtype in ("float64", "float32"):
                B, H_q, H_kv, c, d, d_v = SHAPES[i % len(SHAPES)]
                cases.append(dict(name=f"{layout}-{'causal' if causal else 'full'}-{dtype}", kind="ring",
                                  group="world", W=W, layout=layout, causal=causal, dtype=dtype, B=B, H_q=H_q,
                                  H_kv=H_kv, N=2 * W * c, d=d, d_v=d_v, scale=None, logit_gain=1.0, seed=i))
                i += 1
    # Extreme logits (scores up to ~±400 in the merge) and an explicit scale.
    cases.append(dict(cases[0], name="zigzag-causal-extreme", layout="zigzag", causal=True, logit_gain=12.0,
                      scale=0.9, seed=100))
    # Errors: each raises a ValueError on every rank, and the group goes on working afterwards. With check=False
    # the ranks still exchange a small header first: a mismatch raises there instead of aborting the process in
    # gloo (EnforceNotMet, SIGABRT) when mismatched buffers meet in the ring.
    for error in ("odd_zigzag", "shape_mismatch", "dtype_mismatch", "bad_heads_on_one_rank", "grad_mismatch",
                  "nan_on_one_rank", "scores_overflow", "exact_check_passes"):
        cases.append(dict(cases[0], name=f"error-{error}", kind="error", layout="zigzag", error=error))
    for error in ("shape_mismatch", "dtype_mismatch", "bad_heads_on_one_rank", "nan_on_one_rank"):
        cases.append(dict(cases[0], name=f"error-{error}-unchecked", kind="error", layout="zigzag", error=error,
                          check=False))
    cases.append(dict(cases[3], name="after-errors", seed=200, check=False))
    # The W = 1 ring: every rank alone in a group of its own.
    cases.append(dict(cases[3], name="alone", group="self", W=1, N=2 * 4, seed=300))
    if W < WORLD:
        for case in cases:
            case.update(group="sub" if case["group"] == "world" else case["group"], ranks=list(range(W)))
    return cases


def _subgroup_case(ranks: list[int]) -> dict:
    W = len(ranks)
    B, H_q, H_kv, c, d, d_v = SHAPES[1]
    return dict(name="subgroup", kind="ring", group="sub", ranks=ranks, W=W, layout="zigzag", causal=True,
                dtype="float64", B=B, H_q=H_q, H_kv=H_kv, N=2 * W * c, d=d, d_v=d_v, scale=None, logit_gain=1.0,
                seed=400)


def _inputs(case: dict) -> dict[str, np.ndarray]:
    """The full (unsharded) Q, K, V, dO of a case, float64 values representable in the case's dtype."""
    rng = np.random.default_rng(case["seed"])
    B, H_q, H_kv, N, d, d_v = (case[key] for key in ("B", "H_q", "H_kv", "N", "d", "d_v"))
    x = {"q": rng.standard_normal((B, H_q, N, d)) * case["logit_gain"],
         "k": rng.standard_normal((B, H_kv, N, d)) * case["logit_gain"],
         "v": rng.standard_normal((B, H_kv, N, d_v)),
         "do": rng.standard_normal((B, H_q, N, d_v))}
    return {name: a.astype(case["dtype"]).astype(np.float64) for name, a in x.items()}


# ----------------------------------------------------------------------------------------------------------------
# The worker: one process of the group
# ----------------------------------------------------------------------------------------------------------------

def _run_ring(case: dict, group, rank: int) -> dict:
    W, layout, dtype = case["W"], case["layout"], getattr(torch, case["dtype"])
    x = _inputs(case)
    local = {name: torch.from_numpy(cp.shard(a, rank, W, layout)).to(dtype) for name, a in x.items()}
    q, k, v = (local[name].requires_grad_() for name in ("q", "k", "v"))
    # Two nested traces: the forward-only one (its records as they always were) and one with the backward.
    with cp.trace(backward=True) as both:
        with cp.trace() as steps:
            o = cp.ring_attention(q, k, v, causal=case["causal"], scale=case["scale"], group=group, layout=layout,
                                  check=case.get("check", True))
        o.backward(local["do"])
    assert o.dtype == dtype and q.grad.dtype == dtype and k.grad.dtype == dtype
    return {"o": o.detach().double().numpy(), "dq": q.grad.double().numpy(), "dk": k.grad.double().numpy(),
            "dv": v.grad.double().numpy(), "trace": steps, "trace_both": both}


def _run_error(case: dict, group, rank: int) -> dict:
    W, layout = case["W"], case["layout"]
    B, H_q, H_kv, N, d = (case[key] for key in ("B", "H_q", "H_kv", "N", "d"))
    n, dtype, error = N // W, torch.float64, case["error"]
    if error == "odd_zigzag":
        n = n + 1
    elif error == "shape_mismatch" and rank == 0:
        n = n + 2
    elif error == "dtype_mismatch" and rank == W - 1:
        dtype = torch.float32
    elif error == "bad_heads_on_one_rank" and rank == 1:
        H_q = H_kv + 1
    q, k, v = (torch.zeros(B, H, n, d, dtype=dtype) for H in (H_q, H_kv, H_kv))
    if error == "grad_mismatch" and rank == 0:
        q.requires_grad_()
    elif error == "nan_on_one_rank" and rank == W - 1:
        k[0, 0, 1, 0] = math.nan                      # one NaN key on the last rank only
    elif error == "scores_overflow":
        q, k = q + 1e160, k + 1e160                   # τ·q·k ≈ 2.8e320: beyond float64 on every pair
    elif error == "exact_check_passes":
        # d·max|q|·max|k| = 8e400 fails the cheap bound, but no product q_l·k_l is huge: the exact check, which
        # sends K once more around the ring, must let it through (scores ~1e200, softmax one-hot, O finite).
        q, k = q + 1, k + 1
        q[..., 0], k[..., 1] = 1e200, 1e200
    try:
        o = cp.ring_attention(q, k, v, causal=True, group=group, layout=layout, check=case.get("check", True))
    except ValueError as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"error": None, "finite": bool(torch.isfinite(o).all())}


def _worker(rank: int, world_size: int, init_method: str, cases: list, results) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        # Every rank takes part in creating every group (new_group is collective).
        alone = [dist.new_group([r], timeout=timeout) for r in range(world_size)]
        subgroups = {}
        for case in cases:
            if case["group"] == "sub" and tuple(case["ranks"]) not in subgroups:
                subgroups[tuple(case["ranks"])] = dist.new_group(case["ranks"], timeout=timeout)
        out = {}
        for case in cases:
            if rank not in case.get("ranks", range(world_size)):
                continue
            if case["group"] == "world":
                group, group_rank = None, rank
            elif case["group"] == "self":
                group, group_rank = alone[rank], 0
            else:
                group, group_rank = subgroups[tuple(case["ranks"])], case["ranks"].index(rank)
            run = _run_ring if case["kind"] == "ring" else _run_error
            # a case's key names it among the group's cases (its name where the caller gives no key)
            out[case.get("key", case["name"])] = dict(run(case, group, group_rank), group_rank=group_rank)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, out, None))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with the traceback
        results.put((rank, None, traceback.format_exc()))


def _run_group(world_size: int, cases: list, tmp_path) -> dict:
    """Spawn the group, run every case, return {case key: {group rank: result}}; fail (never hang) otherwise."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    processes = [ctx.Process(target=_worker, args=(r, world_size, init_method, cases, results), daemon=True)
                 for r in range(world_size)]
    for p in processes:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    received, failures = {}, []
    try:
        while len(received) + len(failures) < world_size:
            try:
                rank, out, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
                pytest.fail(f"the group of {world_size} did not finish within {DEADLINE_S} s "
                            f"(ranks that died: {dead})")
            if error is not None:
                failures.append(f"rank {rank}:\n{error}")
            else:
                received[rank] = out
        for p in processes:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    if failures:
        pytest.fail("\n".join(failures))
    # Keyed by the rank in the case's ring (the global rank for the W = 1 rings, where every rank is rank 0).
    alone = {case.get("key", case["name"]) for case in cases if case["group"] == "self"}
    by_case: dict[str, dict[int, dict]] = {}
    for rank, out in received.items():
        for name, result in out.items():
            by_case.setdefault(name, {})[rank if name in alone else result["group_rank"]] = result
    return by_case


@pytest.fixture(scope="module")
def world_run(tmp_path_factory):
    """Every W's cases, run by one group of WORLD processes: the W = 4 rings (and the subgroup of ranks 1, 2, 3)
    first, then W = 3 and W = 2 on ranks 0 … W − 1 (a rank outside them goes on to the next ring it is in)."""
    cases = []
    for W in (4, 3, 2):
        ring = _cases(W) + ([_subgroup_case([1, 2, 3])] if W == WORLD else [])
        cases += [dict(case, key=f"W{W}/{case['name']}") for case in ring]
    return cases, _run_group(WORLD, cases, tmp_path_factory.mktemp("ring"))


@pytest.fixture(params=[2, 3, 4], ids=lambda W: f"W{W}")
def group_run(request, world_run):
    """W, {case name: case} and {case name: {group rank: result}} of the rings of W ranks."""
    W, (cases, results) = request.param, world_run
    mine = [case for case in cases if case["key"].startswith(f"W{W}/")]
    return W, {case["name"]: case for case in mine}, {case["name"]: results[case["key"]] for case in mine}


# ----------------------------------------------------------------------------------------------------------------
# Checks on the groups' results
# ----------------------------------------------------------------------------------------------------------------

def _standard_torch_float32(x: dict, causal: bool, scale) -> dict[str, np.ndarray]:
    """Single-device standard attention in float32 with autograd: the same-dtype baseline of the tolerance rule."""
    q, k, v = (torch.tensor(x[name], dtype=torch.float32, requires_grad=True) for name in ("q", "k", "v"))
    G = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = tau * q @ kr.transpose(-1, -2)
    if causal:
        N = S.shape[-1]
        S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), -math.inf)
    o = torch.softmax(S, dim=-1) @ vr
    o.backward(torch.tensor(x["do"], dtype=torch.float32))
    return {"o": o.detach().double().numpy(), "dq": q.grad.double().numpy(), "dk": k.grad.double().numpy(),
            "dv": v.grad.double().numpy()}


def _ring_case_names(cases: dict) -> list[str]:
    return [name for name, case in cases.items() if case["kind"] == "ring"]


def test_ring_attention_equals_single_device_attention(group_run):
    """Output and gradients, unsharded, equal the float64 oracle on the unsharded inputs: every layout, causal
    or not, float64 and float32, GQA/MQA, d_v ≠ d, odd chunk sizes, extreme logits, W = 1, a subgroup."""
    W, cases, results = group_run
    for name in _ring_case_names(cases):
        case = cases[name]
        by_rank = results[name]
        assert sorted(by_rank) == list(range(case["W"] if case["group"] != "self" else W)), name
        x = _inputs(case)
        ref = fa2edu.attention_reference(x["q"], x["k"], x["v"], causal=case["causal"], scale=case["scale"])
        grads = fa2edu.attention_reference_backward(x["q"], x["k"], x["v"], x["do"], causal=case["causal"],
                                                    scale=case["scale"])
        expected = {"o": ref.O, "dq": grads.dQ, "dk": grads.dK, "dv": grads.dV}
        baseline = None
        if case["dtype"] == "float32":
            std = _standard_torch_float32(x, case["causal"], case["scale"])
            baseline = {key: float(np.max(np.abs(std[key] - expected[key]))) for key in expected}
        if case["group"] == "self":     # every rank ran the whole sequence alone
            runs = [{key: [r[key]] for key in expected} for r in by_rank.values()]
        else:
            runs = [{key: [by_rank[r][key] for r in range(case["W"])] for key in expected}]
        for run in runs:
            for key, want in expected.items():
                got = cp.unshard(run[key], layout=case["layout"])
                assert_close_to_oracle(got, want, f"{name} {key}", dtype=np.dtype(case["dtype"]),
                                       baseline=None if baseline is None else baseline[key])


def _positions(case: dict, rank: int) -> np.ndarray:
    """Global token positions a rank holds, from its definition (independent of the module's planner)."""
    N, W = case["N"], case["W"]
    if case["layout"] == "contiguous":
        n = N // W
        return np.arange(rank * n, (rank + 1) * n)
    c = N // (2 * W)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * W - 1 - rank) * c, (2 * W - rank) * c)])


def test_trace_records_every_forward_step(group_run):
    """One record per step; sources around the ring; K/V elements sent on every step but the last; FLOPs and
    visible scores equal to a brute-force count of the (query, key) pairs the causal mask leaves."""
    W, cases, results = group_run
    for name in _ring_case_names(cases):
        case = cases[name]
        if case["group"] == "self":
            continue
        Wc, n = case["W"], case["N"] // case["W"]
        kv_elements = case["B"] * case["H_kv"] * n * (case["d"] + case["d_v"])
        for rank, result in results[name].items():
            steps = result["trace"]
            assert [s["step"] for s in steps] == list(range(Wc)), name
            for s in steps:
                assert set(s) == {"rank", "step", "source_rank", "flops", "visible", "elements_sent",
                                  "elements_received", "skipped"}
                assert s["rank"] == rank and s["source_rank"] == (rank - s["step"]) % Wc
                moved = kv_elements if s["step"] < Wc - 1 else 0
                assert s["elements_sent"] == s["elements_received"] == moved, (name, s)
                queries, keys = _positions(case, rank), _positions(case, s["source_rank"])
                pairs = (keys[None, :] <= queries[:, None]).sum() if case["causal"] else n * n
                assert s["visible"] == pairs, (name, s)
                assert s["flops"] == 2 * (case["d"] + case["d_v"]) * pairs * case["B"] * case["H_q"], (name, s)
                assert s["skipped"] == (pairs == 0), (name, s)
        N = case["N"]
        total = sum(s["visible"] for r in results[name].values() for s in r["trace"])
        assert total == (N * (N + 1) // 2 if case["causal"] else N * N), name


def test_trace_records_every_backward_step(group_run):
    """trace(backward=True): the W forward records (with "pass": "forward"), then W backward records: FA2 Alg. 2's
    (6d + 4d_v) FLOPs per visible pair, the K/V block on every step but the last, the dK, dV accumulators on every
    step (W > 1), the same sources and skipped steps as the forward."""
    W, cases, results = group_run
    for name in _ring_case_names(cases):
        case = cases[name]
        if case["group"] == "self":
            continue
        Wc, n = case["W"], case["N"] // case["W"]
        block = case["B"] * case["H_kv"] * n * (case["d"] + case["d_v"])
        for result in results[name].values():
            forward, both = result["trace"], result["trace_both"]
            assert [s["pass"] for s in both] == ["forward"] * Wc + ["backward"] * Wc, name
            assert [{k: v for k, v in s.items() if k != "pass"} for s in both[:Wc]] == forward, name
            for f, b in zip(forward, both[Wc:]):
                assert set(b) == set(f) | {"pass", "grad_elements_sent", "grad_elements_received"}
                assert (b["rank"], b["step"], b["source_rank"], b["visible"], b["skipped"]) == \
                    (f["rank"], f["step"], f["source_rank"], f["visible"], f["skipped"]), (name, b)
                assert b["flops"] == (6 * case["d"] + 4 * case["d_v"]) * b["visible"] * case["B"] * case["H_q"]
                assert b["elements_sent"] == b["elements_received"] == f["elements_sent"], (name, b)
                assert b["grad_elements_sent"] == b["grad_elements_received"] == (block if Wc > 1 else 0)


def test_trace_shows_the_causal_imbalance_and_zigzag_balance(group_run):
    """Causal: under zigzag every rank computes exactly the same number of scores and skips nothing; under the
    contiguous layout rank r skips W − 1 − r steps and the last rank computes 2W − 1 times the first one's work
    (up to the diagonal's halves: (2W − 1)·n² + n(n+1)/2 ... against n(n+1)/2)."""
    W, cases, results = group_run
    for layout in cp.LAYOUTS:
        name = f"{layout}-causal-float64"
        case = cases[name]
        per_rank = {r: sum(s["flops"] for s in res["trace"]) for r, res in results[name].items()}
        skipped = {r: sum(s["skipped"] for s in res["trace"]) for r, res in results[name].items()}
        if layout == "zigzag":
            assert len(set(per_rank.values())) == 1, per_rank
            assert set(skipped.values()) == {0}, skipped
        else:
            assert skipped == {r: W - 1 - r for r in range(W)}, skipped
            n = case["N"] // W
            first, last = n * (n + 1) // 2, (W - 1) * n * n + n * (n + 1) // 2
            assert per_rank[W - 1] * first == per_rank[0] * last
            assert per_rank[W - 1] > W * per_rank[0]


def test_bad_arguments_raise_on_every_rank(group_run):
    """An odd zigzag shard, shapes or dtypes that differ across ranks, a bad head count on one rank, gradients
    wanted on one rank only (its backward would wait forever for the others): every rank raises a ValueError
    naming the problem (no rank hangs), and the group keeps working ("after-errors")."""
    W, cases, results = group_run
    expect = {"error-odd_zigzag": "N_local must be even", "error-shape_mismatch": "disagree on shapes",
              "error-dtype_mismatch": "disagree on dtype", "error-bad_heads_on_one_rank": "bad arguments on rank 1",
              "error-grad_mismatch": "disagree on grad"}
    for name, phrase in expect.items():
        messages = [results[name][r]["error"] for r in range(W)]
        assert all(m is not None and phrase in m for m in messages), (name, messages)
    assert sorted(results["after-errors"]) == list(range(W))


def test_bad_values_raise_on_every_rank(group_run):
    """A NaN key on one rank only: every rank raises a ValueError naming k_local and that rank (the others would
    otherwise wait in the ring, or return NaN). Scores beyond float64: every rank raises AttentionOverflowError
    naming q_local and k_local. Inputs that fail only the cheap bound pass the exact check (K sent once more
    around the ring) and compute a finite result."""
    W, cases, results = group_run
    messages = [results["error-nan_on_one_rank"][r]["error"] for r in range(W)]
    assert all(m is not None and f"NaN or infinite values in k_local on rank {W - 1}" in m for m in messages), \
        messages
    overflow = [results["error-scores_overflow"][r] for r in range(W)]
    assert all(o["type"] == "AttentionOverflowError" and o["error"].startswith(
        "q_local and k_local (over every rank's shards) are too large for float64") for o in overflow), overflow
    passes = [results["error-exact_check_passes"][r] for r in range(W)]
    assert all(p["error"] is None and p["finite"] for p in passes), passes


def test_check_false_still_raises_on_every_rank(group_run):
    """check=False skips the gathering of Python objects, not the agreement: a small numeric header is always
    exchanged first, so shapes or dtypes that differ between ranks raise a ValueError on every rank (the old
    code let gloo abort the process), a rank's bad arguments raise on every rank (that rank in its own words,
    the others pointing to it), and a NaN on one rank raises on every rank."""
    W, cases, results = group_run
    expect = {"error-shape_mismatch-unchecked": "disagree on shapes",
              "error-dtype_mismatch-unchecked": "disagree on dtype",
              "error-nan_on_one_rank-unchecked": f"NaN or infinite values in k_local on rank {W - 1}"}
    for name, phrase in expect.items():
        messages = [results[name][r]["error"] for r in range(W)]
        assert all(m is not None and phrase in m for m in messages), (name, messages)
    heads = [results["error-bad_heads_on_one_rank-unchecked"][r]["error"] for r in range(W)]
    assert "bad arguments on rank 1: H_q = " in heads[1], heads
    assert all(m is not None and "bad arguments on rank 1" in m for m in heads), heads


# ----------------------------------------------------------------------------------------------------------------
# In-process checks: layouts, the step plan, the block step, the merge
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_shard_unshard_round_trip(W, layout):
    N = 2 * W * 3
    x = np.arange(2 * N * 2, dtype=np.float64).reshape(2, N, 2)
    shards = [cp.shard(x, r, W, layout) for r in range(W)]
    for r, s in enumerate(shards):
        assert s.shape == (2, N // W, 2) and s.flags.c_contiguous
        expected_tokens = np.concatenate([np.arange(a, b) for a, b in cp.chunk_ranges(N, r, W, layout)])
        np.testing.assert_array_equal(s[0, :, 0], x[0, expected_tokens, 0])
    np.testing.assert_array_equal(cp.unshard(shards, layout), x)
    t = torch.tensor(x)
    assert torch.equal(cp.unshard([cp.shard(t, r, W, layout) for r in range(W)], layout), t)


def test_zigzag_and_contiguous_tokens():
    assert cp.chunk_ranges(8, 0, 2, "zigzag") == [(0, 2), (6, 8)]
    assert cp.chunk_ranges(8, 1, 2, "zigzag") == [(2, 4), (4, 6)]
    assert cp.chunk_ranges(12, 2, 3, "contiguous") == [(8, 12)]
    x = torch.arange(8.0).reshape(8, 1)
    assert cp.shard(x, 0, 2, "zigzag").flatten().tolist() == [0, 1, 6, 7]


def test_shard_errors():
    x = np.zeros((10, 4))
    with pytest.raises(ValueError, match="divisible by W = 3"):
        cp.shard(x, 0, 3, "contiguous")
    with pytest.raises(ValueError, match="divisible by 2W"):
        cp.shard(x, 0, 3, "zigzag")
    with pytest.raises(ValueError, match="rank must be in"):
        cp.shard(x, 2, 2, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="at least 2 axes"):
        cp.shard(np.zeros(8), 0, 2, "contiguous")
    with pytest.raises(TypeError, match="x must be"):
        cp.shard([[0.0]], 0, 1, "contiguous")
    with pytest.raises(ValueError, match="must be even"):
        cp.unshard([np.zeros((3, 2))] * 2, "zigzag")
    with pytest.raises(ValueError, match="one shape"):
        cp.unshard([np.zeros((4, 2)), np.zeros((2, 2))], "contiguous")
    with pytest.raises(ValueError, match="none"):
        cp.unshard([], "zigzag")


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_step_plan_covers_exactly_the_visible_pairs(W, layout):
    """The causal plan's items, drawn as a mask over (local query, local key), equal the global causal mask."""
    N = 2 * W * 3
    for rank in range(W):
        queries = np.concatenate([np.arange(a, b) for a, b in cp.chunk_ranges(N, rank, W, layout)])
        for source in range(W):
            keys = np.concatenate([np.arange(a, b) for a, b in cp.chunk_ranges(N, source, W, layout)])
            want = keys[None, :] <= queries[:, None]
            got = np.zeros_like(want)
            plan = cp.step_plan(N, rank, source, W, layout, causal=True)
            for item in plan:
                a, b = item.rows
                tile = np.ones((b - a, item.keys), dtype=bool)
                if item.causal:
                    tile = np.tril(tile, item.keys - (b - a))
                assert not got[a:b, :item.keys][tile].any(), "items overlap"
                got[a:b, :item.keys] |= tile
                assert item.visible == tile.sum()
            np.testing.assert_array_equal(got, want)
            assert (plan == []) == (not want.any())
            assert cp.step_plan(N, rank, source, W, layout, causal=False) == [
                cp.PlanItem((0, len(queries)), len(queries), False, len(queries) ** 2)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 7, 5, 5, 3), (1, 3, 3, 9, 4, 6, 6), (1, 2, 1, 3, 8, 4, 4)])
def test_block_attention_equals_the_oracle(shape, causal):
    """The step's arithmetic, float64, N_q ≠ N_k both ways (causal with N_q > N_k: rows that see no key get
    O = 0, L = +inf and zero gradients, never NaN), GQA, d_v ≠ d."""
    B, H_q, H_kv, N_q, N_k, d, d_v = shape
    rng = np.random.default_rng(sum(shape))
    Q, K = rng.standard_normal((B, H_q, N_q, d)), rng.standard_normal((B, H_kv, N_k, d))
    V, dO = rng.standard_normal((B, H_kv, N_k, d_v)), rng.standard_normal((B, H_q, N_q, d_v))
    ref = fa2edu.attention_reference(Q, K, V, causal=causal)
    O, L = cp.block_attention(*(torch.tensor(a) for a in (Q, K, V)), causal=causal)
    assert_close_to_oracle(O.numpy(), ref.O, "O")
    assert_close_to_oracle(L.numpy(), ref.L, "L")
    if causal and N_q > N_k:
        assert np.isposinf(L.numpy()).any()
    grads = fa2edu.attention_reference_backward(Q, K, V, dO, causal=causal)
    D = (dO * O.numpy()).sum(-1)
    dQ, dK, dV = cp.block_attention_backward(*(torch.tensor(a) for a in (Q, K, V, dO)), L, torch.tensor(D),
                                             causal=causal)
    for got, want, name in ((dQ, grads.dQ, "dQ"), (dK, grads.dK, "dK"), (dV, grads.dV, "dV")):
        assert_close_to_oracle(got.numpy(), want, name)


def test_merge_is_the_numpy_merge():
    """The torch merge equals fa2edu.merge_attention_states: ordinary rows, extreme log-sum-exps, empty sides."""
    rng = np.random.default_rng(7)
    O_a, O_b = rng.standard_normal((2, 3, 6, 4)), rng.standard_normal((2, 3, 6, 4))
    L_a, L_b = rng.standard_normal((2, 3, 6)) * 3, rng.standard_normal((2, 3, 6)) * 3
    L_a[0, 0, :2], L_b[0, 0, :2] = 1e4, -1e4                 # exp(1e4) would overflow
    L_a[0, 1, 0], L_b[0, 1, 0] = np.inf, 0.5                 # one side empty
    L_a[0, 1, 1], L_b[0, 1, 1] = 2.0, np.inf
    L_a[0, 1, 2] = L_b[0, 1, 2] = np.inf                     # both empty
    for empty_rows in ((0, 1, 0), (0, 1, 2)):
        O_a[empty_rows] = 0.0
    O_b[0, 1, 1] = O_b[0, 1, 2] = 0.0
    for dtype in (np.float64, np.float32):
        args = [a.astype(dtype) for a in (O_a, L_a, O_b, L_b)]
        want_O, want_L = fa2edu.merge_attention_states(*args)
        got_O, got_L = cp.merge_attention_states(*(torch.tensor(a) for a in args))
        assert got_O.dtype == (torch.float64 if dtype == np.float64 else torch.float32)
        assert not torch.isnan(got_O).any() and not torch.isnan(got_L).any()
        rtol = 1e-14 if dtype == np.float64 else 1e-6
        np.testing.assert_allclose(got_O.numpy(), want_O, rtol=rtol, atol=rtol)
        np.testing.assert_array_equal(np.isposinf(got_L.numpy()), np.isposinf(want_L))
        finite = np.isfinite(want_L)
        np.testing.assert_allclose(got_L.numpy()[finite], want_L[finite], rtol=rtol, atol=rtol)
        assert np.isposinf(got_L.numpy()[0, 1, 2]) and (got_O.numpy()[0, 1, 2] == 0).all()
        np.testing.assert_array_equal(got_O.numpy()[0, 1, 0], args[2][0, 1, 0])    # empty a: b unchanged


@pytest.fixture
def group_of_one(tmp_path):
    """A gloo group of this process alone (W = 1), torn down afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ring_of_one_with_more_batch_axes(group_of_one):
    """W = 1 in this process: (B1, B2, H, N, d) inputs, the result and gradients of single-device attention."""
    rng = np.random.default_rng(11)
    Q, K, V, dO = (rng.standard_normal(s) for s in ((2, 3, 4, 6, 5), (2, 3, 2, 6, 5), (2, 3, 2, 6, 3),
                                                     (2, 3, 4, 6, 3)))
    q, k, v = (torch.tensor(a, requires_grad=True) for a in (Q, K, V))
    with cp.trace() as steps:
        o = cp.ring_attention(q, k, v, causal=True, scale=0.7)
    o.backward(torch.tensor(dO))
    ref = fa2edu.attention_reference(Q, K, V, causal=True, scale=0.7)
    grads = fa2edu.attention_reference_backward(Q, K, V, dO, causal=True, scale=0.7)
    for got, want, name in ((o, ref.O, "O"), (q.grad, grads.dQ, "dQ"), (k.grad, grads.dK, "dK"),
                            (v.grad, grads.dV, "dV")):
        assert_close_to_oracle(got.detach().numpy(), want, name)
    assert len(steps) == 1 and steps[0]["elements_sent"] == 0 and steps[0]["visible"] == 6 * 7 // 2
    assert steps[0]["flops"] == 2 * (5 + 3) * 21 * 2 * 3 * 4


def test_trace_backward_on_another_thread(group_of_one):
    """A backward run on another thread (as autograd runs CUDA tensors' backward) is recorded by the trace that was
    open around the forward call; a trace(backward=True) opened around the backward alone records only it; a
    forward-only trace records no backward step; a closed trace receives nothing."""
    import threading
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with cp.trace() as forward_only, cp.trace(backward=True) as both:
        o = cp.ring_attention(q, k, v, causal=True)
        worker = threading.Thread(target=lambda: o.backward(torch.ones_like(o)))
        worker.start()
        worker.join(30)
    assert [s["pass"] for s in both] == ["forward", "backward"]
    assert both[1]["flops"] == 10 * 3 * (4 * 5 // 2) * 2 and both[1]["grad_elements_sent"] == 0
    assert len(forward_only) == 1 and "pass" not in forward_only[0]
    o = cp.ring_attention(q, k, v, causal=True)
    with cp.trace(backward=True) as later:
        o.backward(torch.ones_like(o))
    assert [s["pass"] for s in later] == ["backward"]
    with cp.trace(backward=True) as closed:
        o = cp.ring_attention(q, k, v, causal=True)
    o.backward(torch.ones_like(o))
    assert len(both) == 2 and len(later) == 1 and [s["pass"] for s in closed] == ["forward"]
    with pytest.raises(TypeError, match="backward must be a bool"):
        with cp.trace(backward="yes"):
            pass


def test_ring_attention_bad_arguments(group_of_one):
    q = torch.zeros(1, 2, 4, 8)
    cases = [((q, q, q[..., :3, :]), {}, "same heads and length"),
             ((q, q[:, :1, :, :4], q[:, :1]), {}, "head dimension"),
             ((q, q[:, :1], q[:, :1]), {"layout": "striped"}, "layout must be one of"),
             ((q, q, q), {"causal": 1}, "causal must be a bool"),
             ((q, q, q), {"scale": -1.0}, "scale must be a positive"),
             ((q.int(), q, q), {}, "float16, bfloat16, float32 or float64"),
             ((q, q.double(), q), {}, "share one dtype"),
             ((q[0], q, q), {}, "batch axes"),
             ((q, q[:, :, :2], q[:, :, :2]), {}, "same number of tokens"),
             ((q[:, :, :3], q[:, :, :3], q[:, :, :3]), {}, "N_local must be even"),
             ((q.numpy(), q, q), {}, "must be a torch.Tensor")]
    for args, kwargs, phrase in cases:
        for check in (True, False):
            with pytest.raises(ValueError, match=phrase):
                cp.ring_attention(*args, check=check, **kwargs)


def test_ring_attention_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.ring_attention(q, q, q)


def test_trace_nests_and_keeps_its_lists_apart():
    with cp.trace() as outer:
        with cp.trace() as inner:
            cp._record({"step": 0})
        cp._record({"step": 1})
    assert inner == [{"step": 0}] and outer == [{"step": 0}, {"step": 1}]
    with cp.trace() as empty:
        pass
    assert empty == []


def test_import_fa2edu_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, fa2edu; assert 'torch' not in sys.modules, 'fa2edu imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_ring_steps_run_where_the_op_runs():
    """CUDA tensors step on the op's backend for their dtype; CPU tensors and float64 on the PyTorch step."""
    from fa2edu import _torch_ops
    cuda = torch.device("cuda")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert cp.step_backend(cuda, dtype) == _torch_ops.DISPATCH["cuda", dtype]
    assert cp.step_backend(cuda, torch.bfloat16) == "tensorcore" and cp.step_backend(cuda, torch.float32) == "3xtf32"
    assert cp.step_backend(cuda, torch.float64) is None
    assert cp.step_backend(torch.device("cpu"), torch.float32) is None


# (the 3xTF32 backend's steps are the op's own "3xtf32" route, which the op's tests run in the simulator: too slow
# there to run twice)
@pytest.mark.parametrize("pass_, backend, dtype", [("forward", "tensorcore", torch.float16),
                                                   ("backward", "tensorcore", torch.float16)])
def test_backend_steps_follow_the_step_contract(pass_, backend, dtype):
    """A CUDA step's kernels, run on CPU tensors in numba's CUDA simulator, on a causal diagonal step (6 queries
    against a prefix of 12 keys, GQA, d = 20: padded inside the op): the same (O, L) — L in natural-log units — and
    the same gradients from the global O and L as block_attention / block_attention_backward."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("runs in numba's CUDA simulator (tests/gpu covers the GPU)")
    gen = torch.Generator().manual_seed(3)
    B, H_q, H_kv, n, m, d = 1, 2, 1, 6, 12, 20
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double()
               for s in ((B, H_q, n, d), (B, H_kv, m, d), (B, H_kv, m, d)))
    dO = torch.randn((B, H_q, n, d), generator=gen, dtype=torch.float64).to(dtype).double()
    O, L = cp.block_attention(q, k, v, causal=True)
    tol = 5e-5 if dtype == torch.float32 else 5e-3
    if pass_ == "forward":
        got = cp._on_backend(pass_, backend, tuple(x.to(dtype) for x in (q, k, v)), causal=True, scale=None)
        assert got[0].dtype == dtype and got[1].dtype == torch.float32
        torch.testing.assert_close(got[0].double(), O, atol=tol, rtol=0)
        torch.testing.assert_close(got[1].double(), L, atol=tol, rtol=0)
    else:
        want = cp.block_attention_backward(q, k, v, dO, L, (dO * O).sum(-1), causal=True)
        got = cp._on_backend(pass_, backend, tuple(x.to(dtype) for x in (q, k, v, O, L, dO)), causal=True,
                             scale=None)
        for name, g, w in zip(("dQ", "dK", "dV"), got, want):
            assert g.shape == w.shape, name
            torch.testing.assert_close(g.double(), w, atol=tol, rtol=0, msg=name)


def test_public_functions_document_every_parameter():
    from test_api_docs import problems
    found = {name: problems(getattr(cp, name)) for name in cp.__all__ if callable(getattr(cp, name))}
    assert not any(found.values()), {name: p for name, p in found.items() if p}
