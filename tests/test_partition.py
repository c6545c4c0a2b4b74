"""FA2 Section 3.3 by simulation: split-K (FA1) and split-Q (FA2) compute the same attention, split-Q talks less.

What is proven here (fa2edu/partition.py):
* both warp schemes return O and L within 1e-10 of the float64 oracle, for ragged sizes, GQA and any warp count;
* the executed shared-memory counts equal the closed forms of the module docstring, term by term;
* split-Q never exchanges partial results, and synchronises 2·T_c times per thread block against split-K's 3·T_c;
* with d_v = d and tiles no wider than the row block (c_j ≤ r), split-Q's total shared-memory traffic is strictly
  lower; for wide tiles over few rows it is not (the condition matters);
* FA1's and FA2's grid sizes, waves and SM utilisation (FA2 Section 3.2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import attention_problems
from tolerances import assert_close_to_oracle

import fa2edu
from fa2edu.blocks import tiles
from fa2edu.partition import (
    SCHEMES,
    SharedMemoryCounts,
    grid_blocks,
    partitioned_forward,
    shared_memory_counts,
    sm_utilisation,
    thread_block_counts,
    warp_slices,
    waves,
)

warp_counts = st.integers(1, 9)


@given(case=attention_problems(max_n=20, max_d=7, masks=False, causal=False), warps=warp_counts,
       scheme=st.sampled_from(SCHEMES))
def test_both_schemes_are_exact(case, warps, scheme):
    """Whichever way the warps split a block, the result is softmax(τQKᵀ)V and its log-sum-exp."""
    O_ref, L_ref = fa2edu.attention_reference(case.Q, case.K, case.V, scale=case.scale)
    out = partitioned_forward(case.Q, case.K, case.V, scheme=scheme, warps=warps, block_sizes=case.block_sizes,
                              scale=case.scale)
    assert_close_to_oracle(out.O, O_ref, "O")
    assert_close_to_oracle(out.L, L_ref, "L")
    assert out.thread_blocks == math.ceil(case.Q.shape[-2] / case.block_sizes[0])


@given(case=attention_problems(max_n=20, max_d=7, masks=False, causal=False, batch=False), warps=warp_counts,
       scheme=st.sampled_from(SCHEMES))
def test_executed_counts_equal_closed_forms(case, warps, scheme):
    """The simulation's ledger and the docstring's table agree exactly, term by term, ragged tiles included."""
    (N_q, d), (N_k, d_v) = case.Q.shape, case.V.shape
    B_r, B_c = case.block_sizes
    out = partitioned_forward(case.Q, case.K, case.V, scheme=scheme, warps=warps, block_sizes=(B_r, B_c))
    assert out.counts == shared_memory_counts(scheme, N_q, N_k, d, B_r, B_c, warps, d_v=d_v)


def test_counts_are_per_program():
    """Batch and heads do not change the per-program counts (as the HBM ledger counts per program)."""
    rng = np.random.default_rng(1)
    one = [rng.standard_normal((13, 4)) for _ in range(3)]
    many = [np.broadcast_to(x, (2, 3, 13, 4)).copy() for x in one]
    for scheme in SCHEMES:
        a = partitioned_forward(*one, scheme=scheme, warps=4, block_sizes=(5, 3)).counts
        b = partitioned_forward(*many, scheme=scheme, warps=4, block_sizes=(5, 3)).counts
        assert a == b


sizes = st.integers(1, 300)


@given(r=sizes, N_k=sizes, d=st.integers(1, 256), d_v=st.integers(1, 256), B_c=sizes, warps=warp_counts)
def test_split_q_never_exchanges_and_synchronises_less(r, N_k, d, d_v, B_c, warps):
    """FA2 Section 3.3: "There is no need for communication between warps"; split-K needs one more barrier a step."""
    q = thread_block_counts("split_q", r, N_k, d, d_v, B_c, warps)
    k = thread_block_counts("split_k", r, N_k, d, d_v, B_c, warps)
    T_c = len(tiles(N_k, B_c))
    assert q.exchange_reads == q.exchange_writes == 0
    assert k.exchange_reads == k.exchange_writes > 0
    assert (q.barriers, k.barriers) == (2 * T_c, 3 * T_c)
    assert q.tile_writes == k.tile_writes == r * d + N_k * (d + d_v)   # the same tiles arrive from HBM


@given(r=sizes, N_k=sizes, d=st.integers(1, 256), B_c=sizes, warps=warp_counts)
def test_split_q_moves_less_when_tiles_are_not_wider_than_the_block(r, N_k, d, B_c, warps):
    """With d_v = d and every tile at most r columns wide (c_j ≤ r), split-Q's total traffic is strictly lower.

    Per step the difference is (W_k − 1)·r·d + 2·W_k·r·(d + 2) − 2·(W_q − 1)·c·d > 0 (see the module docstring).
    """
    if min(B_c, N_k) > r:
        B_c = r                                 # make the premise true rather than discard the example
    q = thread_block_counts("split_q", r, N_k, d, d, B_c, warps)
    k = thread_block_counts("split_k", r, N_k, d, d, B_c, warps)
    assert q.total < k.total
    # The per-step formula above, summed over the tiles, is exactly the gap.
    W_q = min(warps, r)
    gap = sum((min(warps, c) - 1) * r * d + 2 * min(warps, c) * r * (d + 2) - 2 * (W_q - 1) * c * d
              for c in (t.stop - t.start for t in tiles(N_k, B_c)))
    assert k.total - q.total == gap


def test_wide_tiles_over_few_rows_can_favour_split_k():
    """The premise matters: split-Q reads K_j and V_j once per warp, which outweighs the exchange for wide tiles."""
    q = thread_block_counts("split_q", 4, 512, 64, 64, 256, 4)
    k = thread_block_counts("split_k", 4, 512, 64, 64, 256, 4)
    assert q.operand_reads > k.operand_reads + k.exchange_reads + k.exchange_writes
    assert q.total > k.total
    assert q.barriers < k.barriers                 # the barrier saving holds regardless


def test_one_warp_split_q_is_plain_fa2():
    """With one warp, split-Q is FA2 Alg. 1 itself: the same O and L as fa2edu.flash2_forward, to rounding."""
    rng = np.random.default_rng(7)
    Q, K, V = (rng.standard_normal((2, 19, 6)) for _ in range(3))
    a = partitioned_forward(Q, K, V, scheme="split_q", warps=1, block_sizes=(4, 5))
    b = fa2edu.flash2_forward(Q, K, V, block_sizes=(4, 5))
    np.testing.assert_allclose(a.O, b.O, rtol=0, atol=1e-13)
    np.testing.assert_allclose(a.L, b.L, rtol=0, atol=1e-13)


@given(n=st.integers(0, 200), warps=warp_counts)
def test_warp_slices_partition_the_rows(n, warps):
    parts = warp_slices(n, warps)
    assert len(parts) == min(n, warps)
    assert [i for s in parts for i in range(s.start, s.stop)] == list(range(n))
    sizes_ = [s.stop - s.start for s in parts]
    assert not sizes_ or max(sizes_) - min(sizes_) <= 1


@given(blocks=st.integers(1, 10_000), sms=st.integers(1, 200), resident=st.integers(1, 8))
def test_waves_and_utilisation(blocks, sms, resident):
    w = waves(blocks, sms, resident)
    slots = sms * resident
    assert (w - 1) * slots < blocks <= w * slots
    u = sm_utilisation(blocks, sms, resident)
    assert 0 < u <= 1
    assert (u == 1) == (blocks % slots == 0)


def test_grid_sizes_fa1_vs_fa2():
    """FA2 Section 3.2: FA1 launches batch·heads blocks, FA2's forward batch·heads·T_r; long sequences need FA2's."""
    assert grid_blocks("flash1", 2, 16) == 32
    assert grid_blocks("flash2", 2, 16, N=1000, B_r=128) == 32 * 8
    # 16k tokens, d = 128 (16 heads) on an A100's 108 SMs: at N = 16k the batch is 1 and FA1 fills 16 of 108 SMs.
    sms = 108
    assert sm_utilisation(grid_blocks("flash1", 1, 16), sms) == pytest.approx(16 / 108)
    assert sm_utilisation(grid_blocks("flash2", 1, 16, N=16384, B_r=128), sms) > 0.9


def test_bad_input_is_refused():
    x = np.ones((4, 2))
    with pytest.raises(ValueError, match="scheme"):
        partitioned_forward(x, x, x, scheme="split_v")
    with pytest.raises(ValueError, match="warps"):
        partitioned_forward(x, x, x, warps=0)
    with pytest.raises(TypeError, match="warps"):
        partitioned_forward(x, x, x, warps=2.0)
    with pytest.raises(ValueError, match="B_c"):
        thread_block_counts("split_q", 4, 4, 2, 2, 0, 4)
    with pytest.raises(ValueError, match="flash2's grid"):
        grid_blocks("flash2", 1, 1)
    with pytest.raises(ValueError, match="algorithm"):
        grid_blocks("flash3", 1, 1)
    with pytest.raises(TypeError, match="Q"):
        partitioned_forward([[1.0]], x, x)


def test_counts_add_up():
    a = SharedMemoryCounts(1, 2, 3, 4, 5)
    assert a + a == SharedMemoryCounts(2, 4, 6, 8, 10)
    assert a.total == a.reads + a.writes == 1 + 2 + 3 + 4
