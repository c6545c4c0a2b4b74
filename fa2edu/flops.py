"""FLOPs of standard attention, FlashAttention and FlashAttention-2: counted by execution, and the benchmark model.

FA2 Section 3.1 separates two kinds of arithmetic. **Matmul** FLOPs run on tensor cores (312 TFLOPs/s of fp16 on an
A100); **non-matmul** FLOPs (exp, max, sums, rescaling, masking) run on the CUDA cores at 19.5 TFLOPs/s, so "each
non-matmul FLOP is 16× more expensive". FA2's forward tweaks remove non-matmul work: the accumulator is rescaled by
``e^{m_old − m_new}`` only, and divided by ℓ once at the end instead of at every step (FA1 Alg. 1 line 12).

:func:`count_flops` executes an algorithm with a :class:`~fa2edu.memory.FlopCounter` (matmul and non-matmul kept
apart, per algorithm line), so its numbers are the code's. :func:`model_flops` is the FA2 paper's benchmark model
(Section 4.1): forward ``4·N²·d·heads·batch``, halved with a causal mask, backward 2.5× the forward; it counts the
matmuls only, and is what TFLOPs/s figures divide by.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from fa2edu import flash1, flash2, standard
from fa2edu.blocks import block_sizes_kv_outer, resolve_block_sizes
from fa2edu.memory import FlopCounter

__all__ = ["count_flops", "count_all_flops", "model_flops", "PASSES_MODEL"]

ALGORITHMS = ("standard", "flash1", "flash2")
PASSES = ("forward", "backward")
#: The passes :func:`model_flops` knows; "forward+backward" is what FA2's Figures 4-7 time as "fwd + bwd".
PASSES_MODEL = ("forward", "backward", "forward+backward")


def _check_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def count_flops(algorithm: str, pass_: str, N: int, d: int, *, M: int | None = None, block_sizes=None,
                causal: bool = False, N_k: int | None = None, seed: int = 0) -> FlopCounter:
    """Execute one (algorithm, pass) on random float64 data and return its :class:`FlopCounter`.

    One head: Q (N, d), K and V (N_k, d). The backward pass's own forward pass (for P, or O and its statistics) is
    not counted. Cost: the algorithm's own, O(N²d) arithmetic.

    Parameters
    ----------
    algorithm : {"standard", "flash1", "flash2"}
        ``"standard"`` (FA1 Alg. 0 / 3), ``"flash1"`` (FA1 Alg. 1 / 4) or ``"flash2"`` (FA2 Alg. 1 / 2).
    pass_ : {"forward", "backward"}
        Which pass to count.
    N : int
        Sequence length of the queries, positive.
    d : int
        Head dimension, positive.
    M : int, optional
        SRAM size in elements, which sets the tiled algorithms' block sizes by their rules (standard attention's FLOPs
        do not depend on it). Default None: :data:`~fa2edu.blocks.DEFAULT_M`'s block sizes.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)`` for the tiled algorithms, overriding the rule. Default None: from ``M``.
    causal : bool, default False
        Count causal attention (skipped blocks cost nothing).
    N_k : int, optional
        Sequence length of the keys and values. Default None: N_k = N.
    seed : int, default 0
        Seed of the random inputs.

    Returns
    -------
    FlopCounter
        ``.matmul``, ``.nonmatmul``, ``.total`` and ``.by_line``, per (batch, head).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    N = _check_int(N, "N")
    d = _check_int(d, "d")
    N_k = N if N_k is None else _check_int(N_k, "N_k")
    rng = np.random.default_rng(seed)
    Q, K, V = rng.standard_normal((N, d)), rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d))
    dO = rng.standard_normal((N, d))
    counter = FlopCounter()
    forward = pass_ == "forward"
    tiling = {"M": M, "block_sizes": block_sizes, "causal": causal}
    if algorithm == "standard":
        fwd = standard.standard_attention(Q, K, V, causal=causal, flops=counter if forward else None)
        if not forward:
            standard.standard_attention_backward(Q, K, V, fwd.P, dO, causal=causal, flops=counter)
    elif algorithm == "flash1":
        fwd = flash1.flash1_forward(Q, K, V, **tiling, flops=counter if forward else None)
        if not forward:
            flash1.flash1_backward(Q, K, V, fwd.O, fwd.l, fwd.m, dO, **tiling, flops=counter)
    elif forward:
        flash2.flash2_forward(Q, K, V, **tiling, flops=counter)
    else:
        # The forward pass only supplies O and L; run it with the backward's block sizes (any would do).
        fwd_bs = resolve_block_sizes(M, block_sizes, d, block_sizes_kv_outer)
        fwd = flash2.flash2_forward(Q, K, V, block_sizes=fwd_bs, causal=causal)
        flash2.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, **tiling, flops=counter)
    return counter


def count_all_flops(N: int, d: int, *, M: int | None = None, block_sizes=None, causal: bool = False,
                    seed: int = 0) -> dict[tuple[str, str], FlopCounter]:
    """:func:`count_flops` for all six (algorithm, pass) pairs, keyed ``(algorithm, pass)``."""
    return {(a, p): count_flops(a, p, N, d, M=M, block_sizes=block_sizes, causal=causal, seed=seed)
            for a in ALGORITHMS for p in PASSES}


def model_flops(batch: int, heads: int, N: int, d: int, causal: bool = False, pass_: str = "forward") -> float:
    """The FA2 paper's benchmark FLOP count (FA2 Section 4.1), used to turn run times into TFLOPs/s.

    Forward: ``4 · N² · d · heads · batch`` (two N × N × d matmuls, 2 FLOPs per multiply-add); halved with a
    causal mask (about half the blocks are skipped); backward: 2.5× the forward (five matmuls instead of two);
    ``"forward+backward"``: 3.5× the forward. Example: batch 8, 16 heads, N = 2048, d = 128, forward:
    4 · 2048² · 128 · 16 · 8 ≈ 2.75e11 FLOPs.
    """
    batch, heads = _check_int(batch, "batch"), _check_int(heads, "heads")
    N, d = _check_int(N, "N"), _check_int(d, "d")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if pass_ not in PASSES_MODEL:
        raise ValueError(f"pass_ must be one of {PASSES_MODEL}, got {pass_!r}")
    forward = 4.0 * N * N * d * heads * batch
    if causal:
        forward /= 2.0
    return forward * {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}[pass_]
