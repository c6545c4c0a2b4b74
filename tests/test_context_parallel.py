"""fa2edu.simulate_context_parallel: hand-counted small rings, the causal imbalance and zigzag's balance, totals
equal to single-device attention, the overlap condition, bad arguments; the simulator against what
fa2edu.distributed.ring_attention records on real gloo process groups; the interconnect figures; exercise 15.1's
checker against plausible wrong answers; and the multi-GPU benchmark script's CPU dry run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fa2edu
from fa2edu import exercises, hardware
from fa2edu.context_parallel import BlockStep, chunk_ranges, ring_step_plan, simulate_context_parallel, visible_pairs
from fa2edu.flops import model_flops
from fa2edu.memory import HBM

ROOT = Path(__file__).resolve().parent.parent
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _positions(N, rank, W, layout):
    return np.concatenate([np.arange(a, b) for a, b in chunk_ranges(N, rank, W, layout)])


# -- hand-counted small rings -------------------------------------------------------------------------------------

def test_contiguous_causal_two_ranks_by_hand():
    """N = 4, W = 2, d = 2, block sizes 1 × 1. Rank 0 holds tokens 0, 1; rank 1 tokens 2, 3.

    Visible pairs: rank 0 sees its own triangle (1 + 2 = 3) and nothing of rank 1's keys; rank 1 its own triangle
    (3) and all 2 × 2 of rank 0's keys. FLOPs = 4·d·pairs. One K/V block: 2 tokens × (K and V) × d = 8 elements,
    sent at step 0 only.

    HBM of rank 0, step 0 (FA2 forward on 2 rows against 2 keys, causal, 1 × 1 blocks): row block 0 visits key
    block 0, row block 1 visits key blocks 0 and 1, so 3 K/V rows are streamed: reads N_q·d + 2d·3 = 4 + 12 = 16,
    writes (d + 1)·N_q = 6; the merge reads O, L and O_j, L_j (2·(d + 1)·2 = 12) and writes O, L (6).
    Rank 1, step 1 (no mask): 4 K/V rows streamed: reads 4 + 16 = 20, plus 12; writes 6 + 6.
    """
    r = simulate_context_parallel(4, 2, 2, causal=True, layout="contiguous", block_sizes=(1, 1), dtype_bytes=4,
                                  link=1e9, flop_rate=1e9)
    want = {  # (rank, step): (source, pairs, skipped, reads, writes, sent)
        (0, 0): (0, 3, False, 28, 12, 8), (0, 1): (1, 0, True, 0, 0, 0),
        (1, 0): (1, 3, False, 28, 12, 8), (1, 1): (0, 4, False, 32, 12, 0)}
    for (rank, step), (source, pairs, skipped, reads, writes, sent) in want.items():
        s = r.step(rank, step)
        assert (s.source_rank, s.visible, s.flops, s.skipped) == (source, pairs, 4 * 2 * pairs, skipped)
        assert (s.hbm_reads, s.hbm_writes) == (reads, writes)
        assert s.elements_sent == s.elements_received == sent
    assert r.flops_per_rank == [24, 56]
    assert r.idle_fractions == [pytest.approx(1 - 24 / 56), 0.0]
    # Time: 1 GFLOP/s and 1 GB/s; the block is 8 elements × 4 bytes = 32 bytes, 32 ns.
    assert r.step(0, 0).compute_s == pytest.approx(24e-9) and r.step(0, 0).transfer_s == pytest.approx(32e-9)
    assert not r.step(0, 0).hidden and r.step(0, 0).min_link_bandwidth == pytest.approx(32 / 24e-9)
    # Both ranks wait for the step-0 exchange (32 ns), then rank 1 computes 32 ns more.
    assert r.step(1, 1).start_s == pytest.approx(32e-9) and r.time_s == pytest.approx(64e-9)
    assert r.compute_time_s == pytest.approx(56e-9)
    # Rank 1's step 0 computes for 24 ns: a link of 32 bytes / 24 ns hides the exchange, no slower one does.
    assert r.bandwidth_to_hide == pytest.approx(32 / 24e-9, rel=1e-9)


def test_zigzag_causal_two_ranks_by_hand():
    """N = 8, W = 2, chunks of c = 2: rank 0 holds chunks 0 and 3 (tokens 0, 1, 6, 7), rank 1 chunks 1 and 2
    (tokens 2-5). Step 0: each rank's own block, two diagonal triangles (3 + 3) and one full chunk pair (4) = 10.
    Step 1: rank 0's early chunk sees nothing of tokens 2-5, its late chunk sees all 4 of them (8 pairs); rank 1's
    two chunks both see tokens 0, 1 only (2 × 4 = 8 pairs), one unmasked computation of 4 rows × 2 keys.
    Both ranks: 18 = (2W − 1)·c² + c(c + 1)."""
    N, W = 8, 2
    assert chunk_ranges(N, 0, W, "zigzag") == [(0, 2), (6, 8)] and chunk_ranges(N, 1, W, "zigzag") == [(2, 4), (4, 6)]
    assert ring_step_plan(N, 0, 0, W, "zigzag") == [BlockStep((0, 2), 2, True, 3), BlockStep((2, 4), 4, True, 7)]
    assert ring_step_plan(N, 0, 1, W, "zigzag") == [BlockStep((2, 4), 4, False, 8)]
    assert ring_step_plan(N, 1, 0, W, "zigzag") == [BlockStep((0, 4), 2, False, 8)]
    assert ring_step_plan(N, 1, 1, W, "zigzag") == [BlockStep((0, 2), 2, True, 3), BlockStep((2, 4), 4, True, 7)]
    r = simulate_context_parallel(N, 4, W, layout="zigzag", batch=2, heads=3)
    assert [s.visible for s in r.steps] == [10, 8, 10, 8]
    assert r.flops_per_rank == [4 * 4 * 18 * 6] * 2 and r.idle_fractions == [0.0, 0.0]
    assert r.step(0, 0).elements_sent == 2 * 3 * 4 * 2 * 4 and r.step(0, 1).elements_sent == 0


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_visible_pairs_and_plans_against_brute_force(W, layout):
    """Every (rank, source): the closed-form pair count and the plan's items equal the causal mask on global
    positions, item by item (the items tile the visible pairs exactly, no pair twice)."""
    N = 2 * W * 3
    for rank in range(W):
        queries = _positions(N, rank, W, layout)
        for source in range(W):
            keys = _positions(N, source, W, layout)
            want = keys[None, :] <= queries[:, None]
            assert visible_pairs(N, rank, source, W, layout) == want.sum()
            assert visible_pairs(N, rank, source, W, layout, causal=False) == want.size
            got = np.zeros(want.shape, dtype=int)
            for item in ring_step_plan(N, rank, source, W, layout):
                a, b = item.rows
                tile = np.ones((b - a, item.keys), dtype=bool)
                if item.causal:
                    tile = np.tril(tile, item.keys - (b - a))
                assert tile.sum() == item.visible
                got[a:b, :item.keys] += tile
            np.testing.assert_array_equal(got, want.astype(int))


def test_step_hbm_is_the_executed_flash2_ledger():
    """The HBM model of a step is FA2's executed ledger on the step's items, plus the merge's 3(d + 1) per row:
    run fa2edu.flash2_forward on every item of a zigzag ring with ragged blocks and compare."""
    N, W, d, block_sizes = 24, 2, 3, (4, 5)
    r = simulate_context_parallel(N, d, W, layout="zigzag", block_sizes=block_sizes)
    rng = np.random.default_rng(0)
    n = N // W
    Q, K, V = (rng.standard_normal((n, d)) for _ in range(3))
    for rank in range(W):
        for step in range(W):
            source = (rank - step) % W
            reads = writes = 0
            for item in ring_step_plan(N, rank, source, W, "zigzag"):
                a, b = item.rows
                hbm = HBM()
                fa2edu.flash2_forward(Q[a:b], K[:item.keys], V[:item.keys], block_sizes=block_sizes,
                                      causal=item.causal, hbm=hbm)
                reads += hbm.reads + 2 * (d + 1) * (b - a)
                writes += hbm.writes + (d + 1) * (b - a)
            s = r.step(rank, step)
            assert (s.hbm_reads, s.hbm_writes) == (reads, writes), (rank, step)


# -- the imbalance, the balance, the totals -----------------------------------------------------------------------

@pytest.mark.parametrize("W", [2, 4, 8])
def test_contiguous_causal_imbalance(W):
    """Contiguous, causal: rank r computes r full blocks and its own triangle, skips W − 1 − r steps; the last
    rank does about 2W − 1 times the first one's work; idle fractions 1 − work_r / work_{W−1}."""
    n = 512
    r = simulate_context_parallel(n * W, 64, W, causal=True, layout="contiguous", heads=2)
    tri = n * (n + 1) // 2
    work = [rank * n * n + tri for rank in range(W)]
    assert [t.visible for t in r.ranks] == work
    assert [t.skipped_steps for t in r.ranks] == [W - 1 - rank for rank in range(W)]
    assert r.flops_per_rank[-1] / r.flops_per_rank[0] == pytest.approx(2 * W - 1, rel=2 / n)
    assert r.idle_fractions == pytest.approx([1 - w / work[-1] for w in work], abs=1e-15)
    assert r.idle_fractions[0] == pytest.approx(1 - 1 / (2 * W - 1), rel=2 / n)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 7, 8])
def test_zigzag_causal_is_balanced(W):
    """Zigzag, causal: every rank computes (2W − 1)·c² + c(c + 1) pairs, skips nothing, idles 0."""
    c = 5
    r = simulate_context_parallel(2 * W * c, 16, W, causal=True, layout="zigzag", batch=3, heads=2)
    assert [t.visible for t in r.ranks] == [(2 * W - 1) * c * c + c * (c + 1)] * W
    assert len(set(r.flops_per_rank)) == 1 and r.idle_fractions == [0.0] * W
    assert all(t.skipped_steps == 0 for t in r.ranks)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_totals_equal_single_device_attention(W, layout):
    """Non-causal: the ranks' FLOPs add up to FA2's model exactly (4N²d per (batch, head)); causal: to 4d times
    the N(N + 1)/2 visible scores (the model's N²/2 counts half the diagonal)."""
    N, d, batch, heads = 2 * W * 6, 8, 2, 3
    full = simulate_context_parallel(N, d, W, causal=False, layout=layout, batch=batch, heads=heads)
    assert full.total_flops == model_flops(batch, heads, N, d, causal=False)
    assert len(set(full.flops_per_rank)) == 1
    causal = simulate_context_parallel(N, d, W, causal=True, layout=layout, batch=batch, heads=heads)
    assert sum(t.visible for t in causal.ranks) == N * (N + 1) // 2
    assert causal.total_flops == 4 * d * (N * (N + 1) // 2) * batch * heads
    # K/V traffic: every rank sends W − 1 blocks of batch·H_kv·N_local·2d elements.
    assert all(t.elements_sent == t.elements_received == (W - 1) * batch * heads * (N // W) * 2 * d
               for t in causal.ranks)


def test_gqa_moves_fewer_elements_and_the_same_flops():
    a = simulate_context_parallel(64, 8, 4, heads=8)
    b = simulate_context_parallel(64, 8, 4, heads=8, heads_kv=2)
    assert a.flops_per_rank == b.flops_per_rank
    assert [t.elements_sent for t in b.ranks] == [t.elements_sent // 4 for t in a.ranks]


# -- the overlap condition and the time model ---------------------------------------------------------------------

def test_full_step_needs_e_R_over_2_N_local():
    """A full (non-causal) step hides its transfer iff link ≥ e·R·H_kv / (2·N_local·H): d cancels."""
    R = 500e12
    for N_local in (1024, 4096, 16384):
        for d in (64, 128):
            r = simulate_context_parallel(4 * N_local, d, 4, causal=False, layout="contiguous", heads=16,
                                          heads_kv=4, dtype_bytes=2, flop_rate=R)
            need = 2 * R * 4 / (2 * N_local * 16)
            steps = [s for s in r.steps if s.elements_sent]
            assert all(s.min_link_bandwidth == pytest.approx(need, rel=1e-12) for s in steps)
            assert r.min_link_bandwidth == pytest.approx(need, rel=1e-12)
            # All ranks identical and hidden: the ring's bound is the step's bound.
            assert r.bandwidth_to_hide == pytest.approx(need, rel=1e-6)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_overlap_condition_is_monotone_in_the_link(layout):
    """A faster link never hurts: time non-increasing, hidden steps only gained; a step is hidden exactly when the
    link reaches its min_link_bandwidth; at bandwidth_to_hide the ring runs as on a free link, below it slower."""
    kwargs = dict(N=8 * 1024, d=64, world_size=4, causal=True, layout=layout, heads=8, flop_rate=300e12)
    links = np.geomspace(1e9, 5e12, 25)
    reports = [simulate_context_parallel(**kwargs, link=float(x)) for x in links]
    times = [r.time_s for r in reports]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:]))
    hidden = [np.array([s.hidden for s in r.steps]) for r in reports]
    assert all((h_fast >= h_slow).all() for h_slow, h_fast in zip(hidden, hidden[1:]))
    for x, r in zip(links, reports):
        for s in r.steps:
            assert s.hidden == (x >= s.min_link_bandwidth * (1 - 1e-12)) or s.min_link_bandwidth == 0
        assert r.time_s >= r.compute_time_s * (1 - 1e-12)
    need = reports[0].bandwidth_to_hide
    assert 0 < need < math.inf
    at = simulate_context_parallel(**kwargs, link=need * (1 + 1e-9))
    assert at.time_s == pytest.approx(at.compute_time_s, rel=1e-9)
    below = simulate_context_parallel(**kwargs, link=need * 0.9)
    assert below.time_s > below.compute_time_s * (1 + 1e-6)
    # Compute time grows with the work, not with the link; the time model is exact for W = 1.
    solo = simulate_context_parallel(8 * 1024, 64, 1, heads=8, flop_rate=300e12, link=1.0)
    assert solo.time_s == solo.compute_time_s == pytest.approx(solo.total_flops / 300e12)
    assert solo.bandwidth_to_hide == 0.0 and solo.hides_communication


def test_contiguous_waits_zigzag_does_not():
    """With a free link, contiguous causal finishes when its last rank does, about (W − 1/2)·n² pairs of work;
    zigzag splits the same N²/2 pairs evenly, W·n²/2 each: faster by (2W − 1)/W, 1.875× at W = 8."""
    kw = dict(N=8 * 4096, d=128, world_size=8, causal=True, heads=16, link=1e15)
    contiguous = simulate_context_parallel(layout="contiguous", **kw)
    zigzag = simulate_context_parallel(layout="zigzag", **kw)
    assert contiguous.total_flops == zigzag.total_flops
    assert contiguous.time_s == pytest.approx(max(t.compute_s for t in contiguous.ranks), rel=1e-3)
    assert contiguous.time_s / zigzag.time_s == pytest.approx((2 * 8 - 1) / 8, rel=0.01)


# -- the backward ------------------------------------------------------------------------------------------------

def test_backward_two_ranks_by_hand():
    """N = 8, W = 2, zigzag, c = 2, d = 4, batch 2 × 3 heads: the visible pairs of the forward (10, 8 per rank),
    FA2 Alg. 2's 10·d FLOPs on each, the K/V block (2·3·4·2·4 = 192 elements) at step 0 only, the float32 dK, dV
    accumulators (192 elements, 4 bytes) at both steps; "forward+backward" is both, the forward first."""
    N, W, d, programs, block = 8, 2, 4, 6, 2 * 3 * 4 * 2 * 4
    b = simulate_context_parallel(N, d, W, layout="zigzag", batch=2, heads=3, pass_="backward")
    assert b.passes == ("backward",) and b.grad_dtype_bytes == 4 and len(b.steps) == W * W
    assert [s.visible for s in b.steps] == [10, 8, 10, 8]
    assert [s.flops for s in b.steps] == [10 * d * v * programs for v in (10, 8, 10, 8)]
    assert [s.elements_sent for s in b.steps] == [block, 0, block, 0]
    assert all(s.grad_elements_sent == s.grad_elements_received == block and s.pass_ == "backward"
               for s in b.steps)
    assert [t.grad_elements_sent for t in b.ranks] == [2 * block] * 2
    both = simulate_context_parallel(N, d, W, layout="zigzag", batch=2, heads=3, pass_="forward+backward")
    fwd = simulate_context_parallel(N, d, W, layout="zigzag", batch=2, heads=3)
    assert both.step(1, 0, "forward") == fwd.step(1, 0) and both.step(1, 0) == fwd.step(1, 0)
    assert both.step(1, 1, "backward")._replace(start_s=0, end_s=0) == b.step(1, 1)._replace(start_s=0, end_s=0)
    assert both.flops_per_rank == [f + g for f, g in zip(fwd.flops_per_rank, b.flops_per_rank)]
    with pytest.raises(ValueError, match="pass_ must be one of"):
        fwd.step(0, 0, "backward")
    assert "(backward)" in b.title() and "dK/dV sent" in b.to_text(steps=True)
    assert max(len(line) for line in both.to_text(steps=True).splitlines()) <= 110


def test_backward_time_model_by_hand():
    """N = 4, W = 2, contiguous, no mask, d = 2, 4-byte elements: every step 2 × 2 pairs, 10·2·4 = 80 FLOPs at
    1 GFLOP/s = 80 ns; the K/V block and the accumulators are 8 elements, 32 bytes.

    Fast link (1 GB/s, 32 ns a transfer): step 0's K/V and step 0's accumulators (posted at 80 ns) hide under
    the computation; the accumulators of step 1 leave at 160 ns and arrive at 192: the exposed tail.
    Slow link (0.25 GB/s, 128 ns): K/V done at 128; step 0's accumulators wait for the exchange before them,
    128 → 256; step 1 computes 128 → 208, waits for them to 256, sends its own: 384 ns."""
    kw = dict(N=4, d=2, world_size=2, causal=False, layout="contiguous", dtype_bytes=4, flop_rate=1e9,
              pass_="backward")
    fast = simulate_context_parallel(**kw, link=1e9)
    assert fast.compute_time_s == pytest.approx(160e-9) and fast.time_s == pytest.approx(192e-9)
    assert fast.step(0, 0).hidden and fast.step(0, 1).hidden and fast.hides_communication
    assert fast.step(0, 1).min_link_bandwidth == pytest.approx(32 / 80e-9)     # step 0's accumulators under it
    assert fast.step(0, 0).grad_transfer_s == pytest.approx(32e-9)
    assert fast.bandwidth_to_hide == math.inf            # the last accumulators are never under a computation
    slow = simulate_context_parallel(**kw, link=0.25e9)
    assert [slow.step(0, s).end_s for s in range(2)] == pytest.approx([128e-9, 256e-9])
    assert slow.time_s == pytest.approx(384e-9) and not slow.hides_communication
    # forward + backward: the backward starts where the forward ends (forward: 32 ns a step at 4·2·4 FLOPs,
    # its one exchange 32 ns: 64 ns), and the ring of one rank is compute alone.
    both = simulate_context_parallel(**dict(kw, pass_="forward+backward"), link=1e9)
    assert both.step(0, 0, "backward").start_s == pytest.approx(64e-9) and both.time_s == pytest.approx(256e-9)
    solo = simulate_context_parallel(64, 8, 1, heads=2, flop_rate=1e12, backward_flop_rate=0.5e12,
                                     pass_="forward+backward", link=1.0)
    fwd_flops = 4 * 8 * (64 * 65 // 2) * 2
    assert solo.time_s == solo.compute_time_s == pytest.approx(fwd_flops / 1e12 + 2.5 * fwd_flops / 0.5e12)
    assert solo.bandwidth_to_hide == 0.0


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_backward_totals_are_2_5_times_the_forward(W, layout):
    """The backward's FLOPs are exactly 2.5 times the forward's on every rank and step (the same visible pairs);
    over the ranks, model_flops(pass_="backward") without a mask; K/V traffic as the forward, plus W accumulator
    transfers per rank (W > 1)."""
    N, d, batch, heads = 2 * W * 6, 8, 2, 3
    for causal in (False, True):
        fwd = simulate_context_parallel(N, d, W, causal=causal, layout=layout, batch=batch, heads=heads)
        bwd = simulate_context_parallel(N, d, W, causal=causal, layout=layout, batch=batch, heads=heads,
                                        pass_="backward")
        assert [2 * b.flops for b in bwd.steps] == [5 * f.flops for f in fwd.steps]
        assert [b.skipped for b in bwd.steps] == [f.skipped for f in fwd.steps]
        assert [t.elements_sent for t in bwd.ranks] == [t.elements_sent for t in fwd.ranks]
        assert all(t.grad_elements_sent == (W * batch * heads * (N // W) * 2 * d if W > 1 else 0)
                   for t in bwd.ranks)
        if not causal:
            assert bwd.total_flops == model_flops(batch, heads, N, d, causal=False, pass_="backward")


@pytest.mark.parametrize("W", [2, 4, 8])
def test_backward_zigzag_balance_and_contiguous_imbalance(W):
    """Causal backward: zigzag ranks compute the same FLOPs and finish together; contiguous ranks idle as in the
    forward (1 − work_r / work_{W−1})."""
    zig = simulate_context_parallel(W * 512, 64, W, layout="zigzag", heads=2, pass_="backward")
    assert len(set(zig.flops_per_rank)) == 1 and zig.idle_fractions == [0.0] * W
    assert len({round(t.finish_s, 18) for t in zig.ranks}) == 1
    cont = simulate_context_parallel(W * 512, 64, W, layout="contiguous", heads=2, pass_="backward")
    fwd = simulate_context_parallel(W * 512, 64, W, layout="contiguous", heads=2)
    assert cont.idle_fractions == pytest.approx(fwd.idle_fractions, abs=1e-15)


@pytest.mark.parametrize("pass_", ["forward", "backward", "forward+backward"])
def test_strong_scaling_ratios(pass_):
    """Zigzag causal at N = 32768, d = 128, 16 heads, a free link: W ranks run W times faster up to the diagonal's
    c(c + 1) pairs (efficiency time(1) / (W·time(W)) within 0.1 % of 1); on a real link the backward's exposed
    last accumulators and the forward's transfers keep it at or below 1."""
    kw = dict(N=32768, d=128, causal=True, layout="zigzag", heads=16, flop_rate=300e12, pass_=pass_)
    one = simulate_context_parallel(world_size=1, link=1e30, **kw).time_s
    for W in (2, 4, 8):
        free = simulate_context_parallel(world_size=W, link=1e30, **kw)
        assert one / (W * free.time_s) == pytest.approx(1.0, abs=1e-3)
        real = simulate_context_parallel(world_size=W, link=235e9, **kw)
        assert real.time_s >= free.time_s * (1 - 1e-12)
        assert one / (W * real.time_s) <= 1.0 + 1e-3


def test_backward_hbm_is_the_executed_flash2_ledger():
    """The backward's HBM model of a step is FA2 Alg. 2's executed ledger on the step's items (line 4 included),
    plus the accumulation of dQ_j, dK_j, dV_j (2d reads and d writes per query row, 4d and 2d per key row) and,
    from step 1, the received accumulators added (4nd reads, 2nd writes)."""
    N, W, d, block_sizes = 24, 2, 3, (4, 5)
    r = simulate_context_parallel(N, d, W, layout="zigzag", block_sizes=block_sizes, pass_="backward")
    assert r.backward_block_sizes == block_sizes
    rng = np.random.default_rng(1)
    n = N // W
    Q, K, V, dO = (rng.standard_normal((n, d)) for _ in range(4))
    for rank in range(W):
        for step in range(W):
            reads = writes = 0
            for item in ring_step_plan(N, rank, (rank - step) % W, W, "zigzag"):
                a, b = item.rows
                fwd = fa2edu.flash2_forward(Q[a:b], K[:item.keys], V[:item.keys], causal=item.causal)
                hbm = HBM()
                fa2edu.flash2_backward(Q[a:b], K[:item.keys], V[:item.keys], fwd.O, fwd.L, dO[a:b],
                                       block_sizes=block_sizes, causal=item.causal, hbm=hbm)
                reads += hbm.reads + 2 * d * (b - a) + 4 * d * item.keys
                writes += hbm.writes + d * (b - a) + 2 * d * item.keys
            if step > 0:
                reads, writes = reads + 4 * n * d, writes + 2 * n * d
            s = r.step(rank, step)
            assert (s.hbm_reads, s.hbm_writes) == (reads, writes), (rank, step)


# -- reports and arguments ----------------------------------------------------------------------------------------

def test_report_views():
    r = simulate_context_parallel(32, 8, 4, layout="zigzag", heads=2, link="pcie5")
    text = str(r)
    assert "zigzag, causal" in text and "idle" in text and len(r.to_text(steps=True).splitlines()) > 16 + 4
    assert max(len(line) for line in r.to_text(steps=True).splitlines()) <= 96
    assert "<table>" in r._repr_html_() and "ContextParallelReport(" in repr(r)
    rows = r.to_rows()
    assert len(rows) == 16 and rows[5]["rank"] == 1 and rows[5]["step"] == 1
    assert {"flops", "elements_sent", "elements_received", "skipped", "hbm_reads", "hidden"} <= set(rows[0])
    json.dumps(rows)
    json.dumps(r.rank_rows())
    assert [row["idle_fraction"] for row in r.rank_rows()] == r.idle_fractions
    assert r.link_bandwidth == hardware.interconnect("PCIe5-x16").per_direction
    assert r.flop_rate == hardware.peak_flops("H100-SXM", "float16")
    with pytest.raises(ValueError, match="rank and step"):
        r.step(4, 0)
    if importlib.util.find_spec("pandas") is None:
        with pytest.raises(ImportError, match="pandas"):
            r.to_dataframe()
    else:
        assert len(r.to_dataframe(per="rank")) == 4
    with pytest.raises(ValueError, match="per must be"):
        r.to_dataframe(per="steps")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(N=10, d=8, world_size=3, layout="contiguous"), ValueError, "divisible by W = 3"),
    (dict(N=9, d=8, world_size=3, layout="zigzag"), ValueError, r"divisible by 2W \(2W equal chunks\) = 6"),
    (dict(N=12, d=8, world_size=3, layout="striped"), ValueError, "layout must be one of"),
    (dict(N=12, d=8, world_size=0), ValueError, "world_size must be at least 1"),
    (dict(N=12.0, d=8, world_size=2), TypeError, "N must be an int"),
    (dict(N=12, d=True, world_size=2), TypeError, "d must be an int"),
    (dict(N=12, d=8, world_size=2, causal="yes"), TypeError, "causal must be a bool"),
    (dict(N=12, d=8, world_size=2, heads=6, heads_kv=4), ValueError, "multiple of heads_kv"),
    (dict(N=12, d=8, world_size=2, batch=0), ValueError, "batch must be at least 1"),
    (dict(N=12, d=8, world_size=2, link=-1.0), ValueError, "link"),
    (dict(N=12, d=8, world_size=2, link="carrier pigeon"), ValueError, "unknown interconnect"),
    (dict(N=12, d=8, world_size=2, flop_rate=0), ValueError, "flop_rate"),
    (dict(N=12, d=8, world_size=2, dtype_bytes=3), ValueError, "dtype_bytes"),
    (dict(N=12, d=8, world_size=2, block_sizes=(0, 4)), ValueError, "B_r must be at least 1"),
    (dict(N=12, d=8, world_size=2, pass_="bwd"), ValueError, "pass_ must be one of"),
    (dict(N=12, d=8, world_size=2, pass_="backward", grad_dtype_bytes=0), ValueError, "grad_dtype_bytes"),
    (dict(N=12, d=8, world_size=2, backward_flop_rate=-1.0), ValueError, "flop_rate"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        simulate_context_parallel(**kwargs)


def test_interconnects():
    nvlink = hardware.interconnect("nvlink")
    assert nvlink is hardware.INTERCONNECTS["NVLink4-H100"] and nvlink.per_direction == 450e9
    assert hardware.interconnect("NVLink4-H200").total == 900e9
    assert hardware.interconnect("pcie5").per_direction == 64e9 and hardware.interconnect("pcie4").per_direction == 32e9
    assert hardware.interconnect("ib").per_direction == 50e9
    for link in hardware.INTERCONNECTS.values():
        assert link.total == 2 * link.per_direction and link.source
    assert hardware.interconnect(nvlink) is nvlink
    with pytest.raises(ValueError, match="unknown interconnect"):
        hardware.interconnect("nvlink9")
    with pytest.raises(TypeError, match="link must be"):
        hardware.interconnect(450e9)


# -- the simulator against fa2edu.distributed ---------------------------------------------------------------------

@pytest.mark.skipif(not HAS_TORCH, reason="fa2edu.distributed needs PyTorch")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_plan_and_layout_equal_the_ring_engines(W, layout):
    """The torch-free plan here is the one ring_attention executes (fa2edu.distributed.step_plan)."""
    from fa2edu import distributed as cp
    N = 2 * W * 3
    for rank in range(W):
        assert chunk_ranges(N, rank, W, layout) == cp.chunk_ranges(N, rank, W, layout)
        for source in range(W):
            for causal in (False, True):
                ours = [tuple(item) for item in ring_step_plan(N, rank, source, W, layout, causal)]
                theirs = [tuple(item) for item in cp.step_plan(N, rank, source, W, layout, causal)]
                assert ours == theirs, (rank, source, causal)


TRACE_CASES = [  # (layout, causal, B, H_q, H_kv, c, d): N = 2·W·c
    ("contiguous", True, 1, 2, 2, 2, 4),
    ("zigzag", True, 2, 4, 2, 3, 4),
    ("zigzag", False, 1, 3, 1, 2, 6),
]


@pytest.mark.skipif(not HAS_TORCH, reason="fa2edu.distributed needs PyTorch")
def test_simulator_equals_the_traced_ring(tmp_path):
    """Run ring_attention, forward and backward, on a real gloo group of 3 processes, and on a ring of 2 of them
    (global ranks 1 and 2, group ranks 0 and 1), under fa2edu.distributed.trace(backward=True), and compare every
    rank's every step of both passes with the simulator: source, visible pairs, FLOPs, elements sent and
    received (K/V and the dK, dV accumulators), skipped."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with the gloo backend")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_distributed import _run_group  # the spawn harness of the ring's own tests (deadline, kill)

    cases = []
    for W, group in ((3, dict(group="world")), (2, dict(group="sub", ranks=[1, 2]))):
        for i, (layout, causal, B, H_q, H_kv, c, d) in enumerate(TRACE_CASES):
            cases.append(dict(name=f"trace-W{W}-{i}", kind="ring", W=W, layout=layout, causal=causal,
                              dtype="float32", B=B, H_q=H_q, H_kv=H_kv, N=2 * W * c, d=d, d_v=d, scale=None,
                              logit_gain=1.0, seed=500 + 10 * W + i, **group))
    results = _run_group(3, cases, tmp_path)
    keys = ("rank", "step", "source_rank", "visible", "flops", "elements_sent", "elements_received", "skipped")
    grad_keys = keys + ("grad_elements_sent", "grad_elements_received")
    for case in cases:
        W = case["W"]
        report = simulate_context_parallel(case["N"], case["d"], W, causal=case["causal"], layout=case["layout"],
                                           batch=case["B"], heads=case["H_q"], heads_kv=case["H_kv"],
                                           pass_="forward+backward")
        assert sorted(results[case["name"]]) == list(range(W))
        for rank in range(W):
            traced = results[case["name"]][rank]["trace"]
            assert len(traced) == W
            for s, record in enumerate(traced):
                predicted = report.step(rank, s)._asdict()
                assert {k: record[k] for k in keys} == {k: predicted[k] for k in keys}, (case["name"], rank, s)
            backward = [r for r in results[case["name"]][rank]["trace_both"] if r["pass"] == "backward"]
            assert len(backward) == W
            for s, record in enumerate(backward):
                predicted = report.step(rank, s, "backward")._asdict()
                assert {k: record[k] for k in grad_keys} == {k: predicted[k] for k in grad_keys}, \
                    (case["name"], rank, s)


# -- exercise 15.1's checker --------------------------------------------------------------------------------------

def pairs_as_contiguous(N, W, layout, rank, source):          # zigzag ignored
    return exercises.solution("15.1")(N, W, "contiguous", rank, source)


def pairs_strict(N, W, layout, rank, source):                  # j < i: forgets the diagonal
    return exercises.solution("15.1")(N, W, layout, rank, source) - sum(
        max(0, min(qb, kb) - max(qa, ka)) for qa, qb in chunk_ranges(N, rank, W, layout)
        for ka, kb in chunk_ranges(N, source, W, layout))


def pairs_whole_blocks(N, W, layout, rank, source):            # a block is all or nothing
    return (N // W) ** 2 if source <= rank else 0


@pytest.mark.parametrize("wrong, minimal", [
    (pairs_as_contiguous, lambda c: c["layout"] == "zigzag" and c["W"] == 2 and c["c"] == 1),
    (pairs_strict, lambda c: c["W"] == 1 and c["c"] == 1),
    (pairs_whole_blocks, lambda c: c["W"] == 1 and c["c"] == 1),
])
def test_exercise_15_1_catches_wrong_counts(wrong, minimal):
    result = exercises.check("15.1", wrong, verbose=False)
    assert not result and result.attempted
    assert minimal(result.failure.case), result.report
    assert "visible pairs, got" in result.report and "■" in result.report


# -- the multi-GPU benchmark script on CPU ------------------------------------------------------------------------

def test_benchmark_script_help_needs_no_gpu():
    out = subprocess.run([sys.executable, "-m", "benchmarks.context_parallel", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torchrun --nproc_per_node" in out.stdout and "--dry-run" in out.stdout


@pytest.mark.skipif(not HAS_TORCH, reason="the benchmark needs PyTorch")
def test_benchmark_dry_run_on_gloo(tmp_path):
    """--dry-run: a world of 2 CPU processes on gloo, tiny sizes: the check of output and gradients against
    one-device attention, strong and weak scaling over W = 1, 2, both layouts, forward and forward + backward, the
    simulator's predictions (pass by pass) beside the times, PyTorch's context parallelism listed as not run (CUDA
    only), the JSON."""
    out_file = tmp_path / "cp.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "benchmarks.context_parallel", "--dry-run", "--out", str(out_file)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    payload = json.loads(out_file.read_text())
    header, records, summary = payload["header"], payload["records"], payload["summary"]
    assert header["backend"] == "gloo" and header["world_size"] == 2 and header["dry_run"]
    assert header["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert {"device", "versions", "date"} <= set(header)
    checks = summary["checks"]
    assert len(checks) == 2 * 2 * 2 and all(c["status"] == "ok" for c in checks), checks
    for c in checks:
        assert set(c["errors"]) == {"o", "dq", "dk", "dv"} == set(c["sdpa_errors"]) == set(c["tolerances"])
        assert all(c["errors"][n] <= c["tolerances"][n] for n in c["errors"])
    timed = [r for r in records if r["kind"] == "ring" and r["status"] == "ok"]
    seen = {(r["scaling"], r["world_size"], r["layout"], r["pass"]) for r in timed}
    assert {(s, w, lay, p) for s in ("strong", "weak") for w in (1, 2) for lay in ("contiguous", "zigzag")
            for p in ("forward", "forward+backward")} <= seen
    rates = {(r["dtype"], r["N_local"]): r for r in summary["step_flop_rate"]}
    for r in timed:
        assert len(r["rank_ms"]) == r["world_size"] == len(r["predicted_rank_ms"])
        assert len(r["predicted_idle_fraction"]) == r["world_size"] and isinstance(r["predicted_comm_hidden"], bool)
        assert r["ms"] == max(r["rank_ms"]) > 0 and r["predicted_comm_ms"] >= 0
        assert r["flop_rate"] == rates[r["dtype"], r["rate_N_local"]]["flop_rate"]
        predicted = simulate_context_parallel(r["N"], r["d"], r["world_size"], causal=r["causal"],
                                              layout=r["layout"], batch=r["batch"], heads=r["heads"],
                                              dtype_bytes=r["dtype_bytes"], link=r["link_bytes_per_s"],
                                              flop_rate=r["flop_rate"], backward_flop_rate=r["backward_flop_rate"],
                                              pass_=r["pass"])
        assert r["predicted_idle_fraction"] == pytest.approx(predicted.idle_fractions)
        assert r["predicted_ms"] == pytest.approx(predicted.time_s * 1e3, rel=1e-12)
        if r["pass"] == "forward+backward" and r["world_size"] > 1:
            assert r["predicted_comm_ms"] > 0          # the last dK, dV transfer is never hidden
    assert summary["link_bytes_per_s"] > 0
    assert summary["not_run"] == [{"kind": "torch_cp", "reason": summary["not_run"][0]["reason"]}]
    assert "CUDA only" in summary["not_run"][0]["reason"]
    singles = {(r["N"], r["pass"]) for r in records if r["kind"] == "single" and r["status"] == "ok"}
    assert singles == {(N, p) for N in (8, 16) for p in ("forward", "forward+backward")}
    efficiencies = {(e["layout"], e["dtype"], e["pass"]) for e in summary["scaling"]}
    assert ("zigzag", "bfloat16", "forward+backward") in efficiencies and summary["comparisons"] == []
    # --merge: parts of one run (one per dtype on the device) into one file.
    merged = tmp_path / "merged.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.context_parallel", "--merge", str(out_file),
                          str(out_file), "--out", str(merged)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    both = json.loads(merged.read_text())
    assert len(both["records"]) == 2 * len(records) and len(both["header"]["parts"]) == 2
    assert len(both["summary"]["checks"]) == 2 * len(checks)
