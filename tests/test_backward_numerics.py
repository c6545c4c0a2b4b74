"""Recomputation and rounding: the backward pass must rebuild the forward's S, not merely an equal one in exact
arithmetic (chapter 5, "Recomputation and rounding").

FA2's backward pass rebuilds P = exp(S − L) from a recomputed S = τQKᵀ and the forward's L, with no normalisation
that could absorb a difference: if its S is rounded differently from the S that produced L, by δ, P is off by a
factor e^δ, and δ is about |S|·ε. With fa2edu's default tiles (FA2 forward Q-outer (192, 64), backward K/V-outer
(64, 192) at d = 64) NumPy's matrix products round some entries of S differently, so at scores of a few thousand
(inputs ×30) float32 dV is several times less accurate than PyTorch's float32 attention; with the forward's tiles
(``block_sizes="forward"``) S is the same bit for bit and the error is PyTorch's, up to L's own rounding. FA1, whose
passes share one tile rule and which saves (m, ℓ) rather than L, matches PyTorch with its defaults.

Errors follow the flash-attn rule: max |grad − oracle| (float64 oracle) against max |torch_fp32 grad − oracle|.
"""

from __future__ import annotations

import numpy as np
import pytest

import fa2edu
from fa2edu.blocks import DEFAULT_M, block_sizes_kv_outer, block_sizes_q_outer, tiles
from fa2edu.io import closed_form

H, d = 8, 64
SCALE = 30.0                                   # inputs ×30: scores up to a few thousand
RAGGED_N = 200                                 # ragged last tiles for both (192, 64) and (64, 192)


def inputs(N: int, seed: int, scale: float = SCALE):
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal((H, N, d)) for _ in range(4))
    return Q * scale, K * scale, V, dO


def tiled_scores(Q32, K32, B_r: int, B_c: int) -> np.ndarray:
    """S = τQKᵀ computed tile by tile as a pass with block sizes (B_r, B_c) computes it (one product per tile)."""
    N, tau = Q32.shape[-2], 1 / np.sqrt(d)
    S = np.empty(Q32.shape[:-1] + (N,), dtype=np.float32)
    for rows in tiles(N, B_r):
        for cols in tiles(N, B_c):
            S[..., rows, cols] = tau * (Q32[..., rows, :] @ np.swapaxes(K32[..., cols, :], -1, -2))
    return S


def torch_fp32_errors(Q, K, V, dO, oracle) -> dict[str, float]:
    """The same-precision baseline: PyTorch's float32 attention on the CPU, differentiated by autograd."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(x.astype(np.float32), requires_grad=True) for x in (Q, K, V))
    out = torch.softmax(q @ k.transpose(-1, -2) / np.sqrt(d), dim=-1) @ v
    out.backward(torch.tensor(dO.astype(np.float32)))
    return {name: float(np.max(np.abs(t.grad.numpy() - ref))) for name, t, ref in zip("QKV", (q, k, v), oracle)}


def errors(grads, oracle) -> dict[str, float]:
    return {name: float(np.max(np.abs(g - ref))) for name, g, ref in zip("QKV", grads, oracle)}


def fa2_errors(Q, K, V, dO, oracle, block_sizes) -> dict[str, float]:
    Q32, K32, V32, dO32 = (x.astype(np.float32) for x in (Q, K, V, dO))
    fwd = fa2edu.flash2_forward(Q32, K32, V32)
    return errors(fa2edu.flash2_backward(Q32, K32, V32, fwd.O, fwd.L, dO32, block_sizes=block_sizes), oracle)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_forward_tiles_bring_fp32_dv_to_pytorch_accuracy_at_large_logits(seed):
    """With block_sizes="forward" the recomputed S is the forward's, whatever the BLAS: what is left is L's rounding
    (L = m + log ℓ stored in float32 is off by up to half an ulp of |m|), a small factor over PyTorch."""
    Q, K, V, dO = inputs(RAGGED_N, seed)
    oracle = fa2edu.attention_reference_backward(Q, K, V, dO)
    baseline = torch_fp32_errors(Q, K, V, dO, oracle)
    same_tiles = fa2_errors(Q, K, V, dO, oracle, "forward")
    for name in "QKV":
        assert same_tiles[name] <= 4 * baseline[name] + 1e-6, (name, same_tiles[name], baseline[name])


@pytest.mark.parametrize("seed", [0, 1])
def test_other_tiles_round_s_differently_and_dv_pays_for_it(seed):
    """The default tiles differ between the passes. Where this BLAS rounds some entries of S differently for the
    two tilings (ragged last tiles: on OpenBLAS, several per cent of the entries, by an ulp or two), dV's error
    grows several-fold over the same-tiles error; where it happens to round them alike, the two agree."""
    Q, K, V, dO = inputs(RAGGED_N, seed)
    oracle = fa2edu.attention_reference_backward(Q, K, V, dO)
    Q32, K32 = Q.astype(np.float32), K.astype(np.float32)
    forward_tiles, backward_tiles = block_sizes_q_outer(DEFAULT_M, d), block_sizes_kv_outer(DEFAULT_M, d)
    assert forward_tiles != backward_tiles                        # (192, 64) and (64, 192)
    S_forward, S_backward = tiled_scores(Q32, K32, *forward_tiles), tiled_scores(Q32, K32, *backward_tiles)
    default = fa2_errors(Q, K, V, dO, oracle, None)
    same_tiles = fa2_errors(Q, K, V, dO, oracle, "forward")
    if np.array_equal(S_forward, S_backward):
        assert default["V"] == pytest.approx(same_tiles["V"], rel=0.5)
        return
    # The rounding differences are ulp-sized, |ΔS| ≈ |S|·ε: the size the chapter's explanation rests on.
    differ = S_forward != S_backward
    relative = np.abs(S_forward - S_backward)[differ] / np.abs(S_forward)[differ]
    assert np.median(relative) < 8 * np.finfo(np.float32).eps
    assert default["V"] > 2 * same_tiles["V"], (default["V"], same_tiles["V"])
    assert default["V"] > 3 * torch_fp32_errors(Q, K, V, dO, oracle)["V"]


def test_the_gap_grows_with_the_logits():
    """At ordinary logits (inputs ×1) the tiles do not matter; the |S|·ε amplification needs large |S|."""
    Q, K, V, dO = inputs(RAGGED_N, 0, scale=1.0)
    oracle = fa2edu.attention_reference_backward(Q, K, V, dO)
    baseline = torch_fp32_errors(Q, K, V, dO, oracle)
    for block_sizes in (None, "forward"):
        assert fa2_errors(Q, K, V, dO, oracle, block_sizes)["V"] <= 3 * baseline["V"] + 1e-6


def test_fa1_needs_no_option():
    """FA1's passes share one tile rule (K/V outer) and it saves (m, ℓ): exp(S − m) is exact at a row's maximum and
    ℓ divides with a relative ε, so its float32 dV matches PyTorch's at large logits with the defaults."""
    Q, K, V, dO = inputs(RAGGED_N, 0)
    oracle = fa2edu.attention_reference_backward(Q, K, V, dO)
    baseline = torch_fp32_errors(Q, K, V, dO, oracle)
    Q32, K32, V32, dO32 = (x.astype(np.float32) for x in (Q, K, V, dO))
    fwd = fa2edu.flash1_forward(Q32, K32, V32)
    fa1 = errors(fa2edu.flash1_backward(Q32, K32, V32, fwd.O, fwd.l, fwd.m, dO32), oracle)
    assert fa1["V"] <= 2 * baseline["V"] + 1e-6


@pytest.mark.parametrize("N, M", [(200, DEFAULT_M), (77, 4096), (130, 1000)])
def test_forward_tiles_keep_the_closed_form_for_their_block_sizes(N, M):
    """block_sizes="forward" is FA2 Alg. 2 with other tiles: its ledger is the closed form at those tiles, with the
    larger T_c the forward's smaller B_c implies."""
    rng = np.random.default_rng(0)
    Q, K, V, dO = (rng.standard_normal((N, d)) for _ in range(4))
    fwd = fa2edu.flash2_forward(Q, K, V, M=M)
    hbm = fa2edu.HBM()
    fa2edu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=M, block_sizes="forward", hbm=hbm)
    B_r, B_c = block_sizes_q_outer(M, d)
    assert hbm.block_sizes == (B_r, B_c)
    assert (hbm.reads, hbm.writes) == closed_form("flash2", "backward", N, d, B_r, B_c)
    default = fa2edu.HBM()
    fa2edu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=M, hbm=default)
    assert (default.reads, default.writes) == closed_form("flash2", "backward", N, d, *block_sizes_kv_outer(M, d))
    assert hbm.reads >= default.reads                            # the price of the forward's smaller B_c


def test_an_unknown_block_sizes_string_is_refused():
    Q, K, V, dO = (np.ones((4, 2)) for _ in range(4))
    fwd = fa2edu.flash2_forward(Q, K, V)
    with pytest.raises(ValueError, match=r"^block_sizes must be a pair \(B_r, B_c\) or 'forward', got 'fwd'"):
        fa2edu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, block_sizes="fwd")
