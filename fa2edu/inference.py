"""FlashAttention at inference: decoding from a KV cache (contiguous or paged, split-KV) and packed batches.

Serving a language model runs attention in two shapes the training papers do not dwell on (chapter 13):

* **Decoding.** Each step appends N_new new tokens (1, or a few with speculative decoding) to every sequence and
  attends them to the sequence's whole cache of keys and values. The cache is read once per step for a handful of
  query rows, so the step is bound by HBM bandwidth, not by arithmetic. :func:`decode_attention` reads each cached
  K/V block once per KV head for the whole GQA group of query heads (``G = H_q / H_kv`` heads × N_new tokens share
  one query tile), finds the cache through a **block table** (PagedAttention: Kwon et al., "Efficient Memory
  Management for Large Language Model Serving with PagedAttention", SOSP 2023), and cuts each sequence's keys into
  ``num_splits`` ranges processed by separate programs whose partial results are merged by
  :func:`fa2edu.merge.merge_attention_states` (Flash-Decoding: Dao, Haziza, Massa, Sizov, "Flash-Decoding for
  long-context inference", 2023).
* **Packed batches.** Prompts of different lengths are concatenated into one token axis with offsets
  ``cu_seqlens`` instead of being padded to the longest. :func:`varlen_attention` runs FA2's forward pass
  (FA2 Algorithm 1) on each sequence's slice, so no tile ever holds padding; :func:`padded_batch_io` counts what
  the same batch would move if it were padded, for comparison.

Both run on fa2edu's memory model (:class:`fa2edu.memory.HBM`, ``hbm=``), so their traffic is counted by
executing them. Units: :func:`decode_attention` counts per **KV head** (its program is one (sequence, KV head,
split) and serves the G query heads of the group), summed over the batch's sequences and splits;
:func:`varlen_attention` counts per **query head** (FA2's program), summed over the sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import NamedTuple

import numpy as np

from fa2edu.blocks import DEFAULT_M, block_sizes_q_outer, resolve_block_sizes
from fa2edu.flash2 import Flash2Forward, flash2_forward
from fa2edu.hardware import DEVICES
from fa2edu.memory import HBM, SRAM, FlopCounter
from fa2edu.merge import merge_attention_states
from fa2edu.partition import sm_utilisation
from fa2edu.softmax import exp_minus
from fa2edu.validation import (
    FLOAT_DTYPES,
    AttentionOverflowError,
    cast_output,
    check_scale,
    check_score_range,
    compute_dtype,
)

__all__ = [
    "DecodeResult", "DecodeProblem", "IndexDtypeError", "PaddedIO", "DECODE_SMS", "decode_attention",
    "check_decode_inputs", "check_decode_values", "decode_block_size", "default_num_splits", "split_ranges",
    "varlen_attention", "check_cu_seqlens", "check_varlen_values", "padded_batch_io",
]

#: SMs the default split rule fills: an H100 SXM's 132 (:data:`fa2edu.hardware.DEVICES`).
DECODE_SMS = DEVICES["H100-SXM"].sms


class DecodeResult(NamedTuple):
    """:func:`decode_attention`'s outputs.

    Attributes
    ----------
    O : numpy.ndarray, shape (B, H_q, N_new, d_v)
        The attention output of each new token, in q's dtype (0 for a token that sees no key).
    L : numpy.ndarray, shape (B, H_q, N_new)
        Its log-sum-exp, in the compute dtype (+inf for a token that sees no key).
    """

    O: np.ndarray
    L: np.ndarray


class IndexDtypeError(ValueError, TypeError):
    """An index array (block table, sequence lengths, offsets) that does not hold integers.

    It is a bad block table or bad lengths (a ``ValueError``) and a wrong type (a ``TypeError``): either catches it.
    """


class PaddedIO(NamedTuple):
    """HBM elements per query head that FA2's forward pass moves on a padded batch (:func:`padded_batch_io`).

    Attributes
    ----------
    reads : int
        Elements read from HBM, per query head, summed over the batch.
    writes : int
        Elements written to HBM, per query head, summed over the batch.
    total : int
        ``reads + writes``.
    N_q_max : int
        The length every sequence's queries are padded to.
    N_k_max : int
        The length every sequence's keys are padded to.
    """

    reads: int
    writes: int
    total: int
    N_q_max: int
    N_k_max: int


# -- checks shared with kernels_gpu ----------------------------------------------------------------------------------

def _index_array(x, name: str, ndim: int) -> np.ndarray:
    """``x`` as an integer array of ``ndim`` axes, or a clear error naming ``name``."""
    if hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{name} is a GPU array; fa2edu's NumPy algorithms take NumPy arrays")
    arr = np.asarray(x)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise IndexDtypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} {'axes' if ndim > 1 else 'axis'}, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _float_array(x, name: str, ndim: int, shape_text: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__cuda_array_interface__"):
            raise TypeError(f"{name} is a GPU array; fa2edu's NumPy algorithms take NumPy arrays "
                            f"(use kernels_gpu for GPU arrays, or copy it to the host)")
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype (float16, float32 or float64), got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_text}, got shape {x.shape}")
    return x


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be at least 1, got {x}")
    return int(x)


@dataclass
class DecodeProblem:
    """Checked inputs of :func:`decode_attention` (also used by ``kernels_gpu.decode_attention``)."""

    q: np.ndarray                     # (B, H_q, N_new, d), the caller's array
    k_cache: np.ndarray               # (B, H_kv, N_max, d) or (num_pages, H_kv, page_size, d)
    v_cache: np.ndarray               # the same with d_v
    cache_seqlens: np.ndarray         # (B,) int64
    block_table: np.ndarray | None    # (B, max_pages) int64, or None for a contiguous cache
    causal: bool
    scale: float                      # τ
    block_size: int                   # keys per block: the page size, or the contiguous cache's block
    num_splits: int                   # splits per sequence (the rule applied when the caller gave None)

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def H_q(self) -> int:
        return self.q.shape[1]

    @property
    def H_kv(self) -> int:
        return self.k_cache.shape[1]

    @property
    def G(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.H_q // self.H_kv

    @property
    def N_new(self) -> int:
        return self.q.shape[2]

    @property
    def d(self) -> int:
        return self.q.shape[3]

    @property
    def d_v(self) -> int:
        return self.v_cache.shape[3]

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    def num_blocks(self, b: int) -> int:
        """Key blocks of sequence b: ceil(cache_seqlens[b] / block_size)."""
        return -(-int(self.cache_seqlens[b]) // self.block_size)


def decode_block_size(d: int, M: int = DEFAULT_M) -> int:
    """Keys per block of a contiguous cache: ``ceil(M / 4d)``, FA1 Alg. 1 line 1's K/V block (B_c) at SRAM size M.

    A decoding program's query tile is only G·N_new rows, so the SRAM goes to the K_j, V_j tiles, as FA1's rule
    gives it to the loop whose tiles are large. (A paged cache's block is its page.)
    """
    return math.ceil(M / (4 * d))


def default_num_splits(batch: int, H_kv: int, max_blocks: int, sms: int = DECODE_SMS) -> int:
    """Flash-Decoding's split count when the caller gives none: the fewest splits that keep the SMs busy.

    One program per (sequence, KV head) leaves most SMs idle when ``P = batch · H_kv`` is small (one sequence
    with 8 KV heads: 8 programs on 132 SMs). With S splits there are P·S programs of equal work running in waves
    of ``sms``; their utilisation u(S) = :func:`fa2edu.partition.sm_utilisation` (P·S, sms), and the modelled time
    is waves/S = P / (sms · u(S)), so a higher utilisation is a shorter time. The rule takes the **smallest** S
    whose u(S) is at least 90 % of the best u over S = 1 … min(max_blocks, sms) — within 11 % of the fastest
    modelled choice, with as few partials to write and merge as possible. It returns 1 when the programs already
    fill the SMs (P ≥ sms) or no sequence has more than one key block (``max_blocks`` is the longest sequence's).
    """
    programs = batch * H_kv
    if max_blocks <= 1 or programs >= sms:
        return 1
    candidates = range(1, min(max_blocks, sms) + 1)
    utilisation = {S: sm_utilisation(programs * S, sms) for S in candidates}
    best = max(utilisation.values())
    return min(S for S in candidates if utilisation[S] >= 0.9 * best)


def split_ranges(T: int, S: int) -> list[range]:
    """Split s of ``S`` gets key blocks ``[s·T // S, (s + 1)·T // S)``: as evenly as integers allow.

    Every split holds ⌊T/S⌋ or ⌈T/S⌉ blocks; with S > T the first S − T splits are empty.
    (The same cut as kernels_gpu.fast.split.step_bound.)
    """
    return [range(s * T // S, (s + 1) * T // S) for s in range(S)]


def check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True, scale=None,
                        num_splits=None, block_size=None) -> DecodeProblem:
    """Check :func:`decode_attention`'s arguments (shapes, dtypes, the block table, the lengths) and resolve the
    defaults (τ, the block size, the split count). Errors name the argument; see :func:`decode_attention`."""
    q = _float_array(q, "q", 4, "(B, H_q, N_new, d)")
    k_cache = _float_array(k_cache, "k_cache", 4, "(B, H_kv, N_max, d) or (num_pages, H_kv, page_size, d)")
    v_cache = _float_array(v_cache, "v_cache", 4, "(B, H_kv, N_max, d_v) or (num_pages, H_kv, page_size, d_v)")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if 0 in x.shape:
            raise ValueError(f"{name} must not be empty, got shape {x.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not np.isfinite(q).all():
        raise ValueError("q contains NaN or infinite values; attention inputs must be finite")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    B, H_q, _, d = q.shape
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache's head dimension must equal q's: q has d = {d}, k_cache has {k_cache.shape[3]}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache in every axis but the last: k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape}")
    H_kv = k_cache.shape[1]
    if H_q % H_kv != 0:
        raise ValueError(f"the number of query heads H_q = {H_q} must be a multiple of the number of key/value "
                         f"heads H_kv = {H_kv} (GQA/MQA)")
    seqlens = _index_array(cache_seqlens, "cache_seqlens", 1)
    if seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), one length per sequence of q; "
                         f"got {seqlens.shape}")
    if block_table is None:
        # Contiguous cache: sequence b's keys are rows 0 … cache_seqlens[b] − 1 of k_cache[b].
        if k_cache.shape[0] != B:
            raise ValueError(f"a contiguous k_cache must have q's batch size B = {B} in axis 0, got "
                             f"{k_cache.shape[0]} (for a paged cache, pass block_table)")
        capacity = k_cache.shape[2]
        size = decode_block_size(d) if block_size is None else _positive_int(block_size, "block_size")
        table = None
    else:
        # Paged cache (PagedAttention): logical page p of sequence b is physical page block_table[b, p].
        if block_size is not None:
            raise ValueError("block_size applies to a contiguous cache; a paged cache's key block is its page")
        table = _index_array(block_table, "block_table", 2)
        if table.shape[0] != B:
            raise ValueError(f"block_table must have shape (B, max_pages) with B = {B}, got {table.shape}")
        size = k_cache.shape[2]                                    # page_size
        capacity = table.shape[1] * size
    if (seqlens < 0).any():
        raise ValueError(f"cache_seqlens must be non-negative, got {seqlens.tolist()}")
    too_long = np.flatnonzero(seqlens > capacity)
    if too_long.size:
        b = int(too_long[0])
        if table is None:
            raise ValueError(f"cache_seqlens[{b}] = {seqlens[b]} exceeds the cache's N_max = {capacity} keys")
        raise ValueError(f"cache_seqlens[{b}] = {seqlens[b]} needs {-(-int(seqlens[b]) // size)} pages of "
                         f"{size} keys, but block_table has only {table.shape[1]} pages per sequence")
    if table is not None:
        num_pages = k_cache.shape[0]
        for b in range(B):
            used = table[b, :-(-int(seqlens[b]) // size)]          # only the pages that hold keys are read
            bad = np.flatnonzero((used < 0) | (used >= num_pages))
            if bad.size:
                p = int(bad[0])
                raise ValueError(f"block_table[{b}, {p}] = {used[p]} is not a page of k_cache (it has "
                                 f"num_pages = {num_pages}: valid ids are 0 … {num_pages - 1})")
    tau = check_scale(scale, d)
    problem = DecodeProblem(q, k_cache, v_cache, seqlens, table, bool(causal), tau, size, 0)
    if num_splits is None:
        max_blocks = max(problem.num_blocks(b) for b in range(B))
        problem.num_splits = default_num_splits(B, H_kv, max_blocks)
    else:
        problem.num_splits = _positive_int(num_splits, "num_splits")
    return problem


def _used_cache(k_cache, v_cache, block_table, b: int, n: int):
    """The keys and values sequence b reads, (H_kv, n, d) and (H_kv, n, d_v) (views of a contiguous cache, a
    copy of the pages of a paged one), and a function naming the cache entry of (head h, key j)."""
    if block_table is None:
        return k_cache[b, :, :n], v_cache[b, :, :n], lambda name, h, j: f"{name}[{b}, {h}, {j}]"
    page = k_cache.shape[2]
    pages = np.asarray(block_table[b, :-(-n // page)], dtype=np.int64)

    def gather(cache):
        used = cache[pages]                                           # (T, H_kv, page, ·)
        return np.swapaxes(used, 0, 1).reshape(used.shape[1], -1, used.shape[-1])[:, :n]

    def where(name, h, j):
        return f"{name}[{pages[j // page]}, {h}, {j % page}] (page block_table[{b}, {j // page}])"
    return gather(k_cache), gather(v_cache), where


def check_decode_values(q, k_cache, v_cache, cache_seqlens, block_table, scale, score_dtype, *,
                        float64_helps: bool = True, storage=None) -> None:
    """The values of :func:`decode_attention`'s inputs: finite q, finite keys and values **where the sequences
    read them**, and scores τ·q·k within ``score_dtype`` — the contract of ``flash2_forward``
    (:func:`fa2edu.validation.check_score_range`), with errors that name q, k_cache and v_cache.

    Only the used entries are checked: rows 0 … cache_seqlens[b] − 1 of sequence b (through ``block_table`` for a
    paged cache). Entries past a length, and pages no sequence reads, are never read and may hold anything (NaN
    included). The overflow check is cheap first (d·max|q|·max|k|, over every sequence), exact per sequence only
    where that bound fails. ``storage``, when given, is the dtype the values will be stored in (float32 for the
    GPU kernels' NumPy float64 inputs): values beyond its range are refused too. Shapes and indices must already
    have passed :func:`check_decode_inputs`. Cost: one read of the used cache (the NumPy algorithm reads it anyway;
    ``kernels_gpu.decode_attention`` calls this on host data only, before copying it to the device).
    """
    B, H_q, N_new, d = q.shape
    H_kv = k_cache.shape[1]
    G = H_q // H_kv
    seqlens = np.asarray(cache_seqlens, dtype=np.int64)
    limit_storage = None if storage is None else float(np.finfo(storage).max)
    if not np.isfinite(q).all():
        raise ValueError("q contains NaN or infinite values; attention inputs must be finite")
    q_max = float(np.max(np.abs(q)))
    if limit_storage is not None and q_max > limit_storage:
        raise ValueError(f"q has values beyond the range of {np.dtype(storage).name}: it cannot be stored as "
                         f"{np.dtype(storage).name}")
    k_max = 0.0
    for b in range(B):
        n = int(seqlens[b])
        if n == 0:
            continue
        keys, values, where = _used_cache(k_cache, v_cache, block_table, b, n)
        for name, x in (("k_cache", keys), ("v_cache", values)):
            bad = ~np.isfinite(x)
            if bad.any():
                h, j = (int(i) for i in np.argwhere(bad)[0][:2])
                raise ValueError(f"{name} contains NaN or infinite values among the keys sequence {b} reads "
                                 f"(cache_seqlens[{b}] = {n}), first at {where(name, h, j)}; attention inputs "
                                 f"must be finite (entries past a sequence's length are never read and may hold "
                                 f"anything)")
            top = float(np.max(np.abs(x)))
            if limit_storage is not None and top > limit_storage:
                raise ValueError(f"{name} has values beyond the range of {np.dtype(storage).name} among the keys "
                                 f"sequence {b} reads: it cannot be stored as {np.dtype(storage).name}")
            if name == "k_cache":
                k_max = max(k_max, top)
    score_dtype = np.dtype(score_dtype)
    if d * q_max * k_max * max(1.0, abs(float(scale))) <= float(np.finfo(score_dtype).max) / 2:
        return                                                     # the cheap bound: no score can overflow
    for b in range(B):
        n = int(seqlens[b])
        if n:
            keys = _used_cache(k_cache, v_cache, block_table, b, n)[0]
            # GQA: query head h·G + g reads KV head h; its G·N_new rows meet KV head h's keys only.
            check_score_range(q[b].reshape(H_kv, G * N_new, d), keys, scale, score_dtype, names=("q", "k_cache"),
                              context=f" (sequence {b})", float64_helps=float64_helps)


def _decode_overflow(error, problem: DecodeProblem, work: np.dtype) -> AttentionOverflowError:
    """An overflow inside decode_attention's arithmetic (a huge v_cache), reported with the user's names."""
    k_max = v_max = 0.0
    for b in range(problem.B):
        n = int(problem.cache_seqlens[b])
        if n:
            keys, values, _ = _used_cache(problem.k_cache, problem.v_cache, problem.block_table, b, n)
            k_max, v_max = max(k_max, float(np.max(np.abs(keys)))), max(v_max, float(np.max(np.abs(values))))
    remedy = "rescale them" if work == np.float64 else "rescale them, or pass float64 inputs"
    return AttentionOverflowError(
        f"decode_attention: an intermediate result left the range of {work.name} ({error}); the inputs are too "
        f"large in magnitude for {work.name} arithmetic (max |q| = {float(np.max(np.abs(problem.q))):.3g}, and "
        f"over the entries the sequences read, max |k_cache| = {k_max:.3g}, max |v_cache| = {v_max:.3g}): "
        f"{remedy}")


# -- decoding ----------------------------------------------------------------------------------------------------------

def _split_program(problem: DecodeProblem, b: int, blocks: range, mem: HBM, sram: SRAM, count: FlopCounter,
                   work: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """One Flash-Decoding program: sequence b, every KV head (vectorised), the key blocks ``blocks``.

    It is FA2 Alg. 1 with a single row block: the query tile is the G·N_new rows of one KV head's group, and the
    inner loop streams the split's K/V blocks, found through the block table when the cache is paged.
    Returns the split's normalised O_s (H_kv, G·N_new, d_v) and L_s (H_kv, G·N_new), +inf on rows that saw no key.
    """
    G, N_new, d, d_v, n = problem.G, problem.N_new, problem.d, problem.d_v, int(problem.cache_seqlens[b])
    rows = G * N_new
    H_kv = problem.H_kv
    # Row r of the tile is new token t = r % N_new (of query head g = r // N_new of the group).
    t = np.arange(rows) % N_new
    # Causal, bottom-right within the sequence: new token t sees keys j <= n − N_new + t.
    last_key = n - N_new + t                                                   # (G·N_new,)
    # FA2 Alg. 1 line 4: load the query tile to SRAM, once per program.
    Q_i = sram.hold("Q_i", mem.read("q", slice(0, rows), line="split: Alg 1 line 4"))   # (H_kv, G·N_new, d)
    # FA2 Alg. 1 line 5: on chip, Õ_i = 0, ℓ_i = 0, m_i = −inf.
    O_i = sram.hold("O_i", np.zeros((H_kv, rows, d_v), dtype=work))
    l_i = sram.hold("l_i", np.zeros((H_kv, rows), dtype=work), vector=True)
    m_i = sram.hold("m_i", np.full((H_kv, rows), -np.inf, dtype=work), vector=True)
    # FA2 Alg. 1 line 6: stream this split's key blocks.
    for p in blocks:
        start = p * problem.block_size
        c = min(problem.block_size, n - start)                              # keys of this block (ragged last)
        if problem.paged:
            # PagedAttention: logical block p of sequence b lives in physical page block_table[b, p].
            page = int(problem.block_table[b, p])
            mem.put("K", problem.k_cache[page])                              # (H_kv, page_size, d), in place
            mem.put("V", problem.v_cache[page])
            keys = slice(0, c)
        else:
            keys = slice(start, start + c)
        # FA2 Alg. 1 line 7: load K_j, V_j: the only time this program (or any other) reads these keys.
        K_j = sram.hold("K_j", mem.read("K", keys, line="split: Alg 1 line 7").astype(work, copy=False))
        V_j = sram.hold("V_j", mem.read("V", keys, line="split: Alg 1 line 7").astype(work, copy=False))
        # FA2 Alg. 1 line 8: S = τ Q_i K_jᵀ for all G heads and N_new tokens of the group at once.
        S_ij = sram.hold("S_ij", problem.scale * (Q_i @ np.swapaxes(K_j, -1, -2)))   # (H_kv, G·N_new, c)
        count.add_matmul(rows, c, d, line="split: Alg 1 line 8")
        count.add_nonmatmul(rows * c, line="split: Alg 1 line 8")
        if problem.causal and start + c - 1 > last_key.min():
            # Only a block that reaches past the earliest new token's last key needs the elementwise mask.
            visible = (start + np.arange(c))[None, :] <= last_key[:, None]   # (G·N_new, c)
            S_ij = np.where(visible, S_ij, -np.inf)
            count.add_nonmatmul(rows * c, line="split: Alg 1 line 8 (mask)")
        # FA2 Alg. 1 line 9: m_new = max(m_i, rowmax S); P̃ = exp(S − m_new) guarded where m_new = −inf;
        # ℓ_i = e^{m_i − m_new} ℓ_i + rowsum P̃.
        m_new = np.maximum(m_i, S_ij.max(axis=-1))
        P_ij = exp_minus(S_ij, m_new)
        alpha = exp_minus(m_i[..., None], m_new)[..., 0]
        l_i = alpha * l_i + P_ij.sum(axis=-1)
        count.add_nonmatmul(rows * c * 4 + rows * 5, line="split: Alg 1 line 9")
        # FA2 Alg. 1 line 10: Õ_i = diag(e^{m_i − m_new}) Õ_i + P̃ V_j.
        O_i = alpha[..., None] * O_i + P_ij @ V_j
        count.add_matmul(rows, d_v, c, line="split: Alg 1 line 10")
        count.add_nonmatmul(2 * rows * d_v, line="split: Alg 1 line 10")
        m_i = m_new
        sram.free("S_ij", "K_j", "V_j")
    # FA2 Alg. 1 lines 12-13: O_s = Õ_i / ℓ_i and L_s = m_i + log ℓ_i, guarded where ℓ = 0 (O = 0, L = +inf).
    l_safe = np.where(l_i == 0.0, 1.0, l_i)
    O_s = O_i / l_safe[..., None]
    with np.errstate(divide="ignore"):
        L_s = np.where(l_i == 0.0, np.inf, m_i + np.log(l_safe))
    count.add_nonmatmul(rows * d_v + 2 * rows, line="split: Alg 1 lines 12-13")
    sram.free("Q_i", "O_i", "l_i", "m_i")
    return O_s, L_s


def _decode_sequences(problem: DecodeProblem, q_tiles: np.ndarray, O: np.ndarray, L: np.ndarray, mem: HBM,
                      sram: SRAM, count: FlopCounter, work: np.dtype) -> None:
    """decode_attention's grid, sequence by sequence: the split programs, then (S > 1) the merge of the partials
    (Flash-Decoding's reduction), writing O and L (B, H_kv, G·N_new, ·) in place."""
    B, H_kv, G, N_new, d_v, S = (problem.B, problem.H_kv, problem.G, problem.N_new, problem.d_v,
                                 problem.num_splits)
    rows = G * N_new
    for b in range(B):
        mem.put("q", q_tiles[b])                                            # (H_kv, G·N_new, d)
        mem.put("O", O[b])                                                  # written in place
        mem.put("L", L[b], vector=True)
        if not problem.paged:
            mem.put("K", problem.k_cache[b])                                # (H_kv, N_max, d)
            mem.put("V", problem.v_cache[b])
        T = problem.num_blocks(b)
        if S > 1:
            # Flash-Decoding: S partial results per (sequence, KV head), split s in rows s·R … (s + 1)·R − 1.
            mem.put("O_part", np.zeros((H_kv, S * rows, d_v), dtype=work))
            mem.put("L_part", np.zeros((H_kv, S * rows), dtype=work), vector=True)
        # One program per split (they run in parallel on a GPU; here, one after the other).
        for s, blocks in enumerate(split_ranges(T, S)):
            if len(blocks):
                O_s, L_s = _split_program(problem, b, blocks, mem, sram, count, work)
            else:
                # A split with no key: the merge's identity, without loading the queries.
                O_s, L_s = np.zeros((H_kv, rows, d_v), dtype=work), np.full((H_kv, rows), np.inf, dtype=work)
            if S == 1:
                # FA2 Alg. 1 lines 14-15: one split, so its result is the answer: write O and L once.
                mem.write("O", slice(0, rows), O_s, line="split: Alg 1 line 14")
                mem.write("L", slice(0, rows), L_s, line="split: Alg 1 line 15")
            else:
                part = slice(s * rows, (s + 1) * rows)
                mem.write("O_part", part, O_s, line="split: write O_s, L_s")
                mem.write("L_part", part, L_s, line="split: write O_s, L_s")
        if S > 1:
            # Flash-Decoding's reduction: read the S partials back and merge them by the log-sum-exp rule,
            # starting from the identity (O = 0, L = +inf) on chip.
            O_acc = np.zeros((H_kv, rows, d_v), dtype=work)
            L_acc = np.full((H_kv, rows), np.inf, dtype=work)
            for s in range(S):
                part = slice(s * rows, (s + 1) * rows)
                O_s = mem.read("O_part", part, line="combine: read partials")
                L_s = mem.read("L_part", part, line="combine: read partials")
                O_acc, L_acc = merge_attention_states(O_acc, L_acc, O_s, L_s)
                count.add_nonmatmul(rows * (3 * d_v + 8), line="combine: merge")
            mem.write("O", slice(0, rows), O_acc, line="combine: write O, L")
            mem.write("L", slice(0, rows), L_acc, line="combine: write O, L")


def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table=None, causal=True, scale=None,
                     num_splits=None, hbm=None, *, block_size=None, flops=None) -> DecodeResult:
    """Attention of N_new new tokens per sequence to a KV cache: split-KV (Flash-Decoding) over a contiguous or
    paged (PagedAttention) cache, with GQA, on fa2edu's counted memory.

    For each sequence b and KV head, the G = H_q / H_kv query heads of the group and the N_new new tokens form
    one query tile of G·N_new rows. The sequence's keys 0 … cache_seqlens[b] − 1 are cut into blocks (the pages
    of a paged cache, ``block_size`` keys of a contiguous one) and the blocks into ``num_splits`` ranges
    (:func:`split_ranges`). Each (sequence, KV head, split) program runs FA2 Alg. 1 over its range and, when
    there is more than one split, writes a partial (O_s, L_s) to HBM; a second step reads the partials back and
    merges them with :func:`fa2edu.merge.merge_attention_states` (Flash-Decoding's reduction). Every cached key
    and value is read once per KV head, whatever G and the split count.

    Parameters
    ----------
    q : numpy.ndarray, shape (B, H_q, N_new, d)
        Queries of the N_new ≥ 1 new tokens of each sequence. Their keys and values are already in the cache, as
        its last N_new entries. float16, float32 or float64, finite.
    k_cache : numpy.ndarray, shape (B, H_kv, N_max, d) or (num_pages, H_kv, page_size, d)
        Cached keys: contiguous (sequence b's keys are rows 0 … cache_seqlens[b] − 1 of ``k_cache[b]``), or paged
        when ``block_table`` is given. q's dtype. The entries the sequences read must be finite; entries past a
        sequence's length (and pages no sequence reads) are never read nor checked, and may hold anything.
    v_cache : numpy.ndarray, shape (B, H_kv, N_max, d_v) or (num_pages, H_kv, page_size, d_v)
        Cached values, laid out as ``k_cache``.
    cache_seqlens : array of int, shape (B,)
        Keys in the cache per sequence, new tokens included: 0 ≤ cache_seqlens[b] ≤ N_max (contiguous) or
        ≤ max_pages · page_size (paged). A sequence of length 0 (an idle slot) gives O = 0, L = +inf.
    block_table : array of int, shape (B, max_pages), optional
        Paged cache (PagedAttention): sequence b's logical page p (keys p·page_size … (p + 1)·page_size − 1) is
        physical page ``block_table[b, p]`` of the cache. Only the first ceil(cache_seqlens[b] / page_size)
        entries of a row are read (they must lie in [0, num_pages)); the rest may hold anything. Pages may be
        shared between sequences (a common prefix). None (default): a contiguous cache.
    causal : bool, default True
        Bottom-right causal within each sequence: new token t sees keys j ≤ cache_seqlens[b] − N_new + t. With
        N_new = 1 every key is visible either way. A token that sees no key gets O = 0, L = +inf.
    scale : float, optional
        The softmax scale τ; default 1/√d.
    num_splits : int, optional
        Flash-Decoding's split count S ≥ 1 per sequence. S = 1: one program per (sequence, KV head), no partials.
        S larger than a sequence's key blocks leaves splits empty; each writes the merge's identity (O = 0,
        L = +inf). Default None: :func:`default_num_splits`, the fewest splits whose SM utilisation on the
        H100's 132 SMs is within 90 % of the best any split count reaches (1 when B · H_kv ≥ 132), at most the
        longest sequence's number of key blocks.
    hbm : fa2edu.memory.HBM, optional
        Memory that records the traffic (per KV head, summed over sequences and splits; see Notes). Default
        None: a fresh, unreturned one.
    block_size : int, optional
        Keys per block of a contiguous cache; default :func:`decode_block_size` = ceil(M / 4d) at fa2edu's
        default M. Not allowed with a paged cache, whose block is its page.
    flops : fa2edu.memory.FlopCounter, optional
        Counter that records the FLOPs (per KV head, as the ledger). Default None: a fresh, unreturned one.

    Returns
    -------
    DecodeResult
        ``(O, L)``: O (B, H_q, N_new, d_v) in q's dtype, L (B, H_q, N_new) in the compute dtype (float64 for
        float64 inputs, else float32); +inf on tokens that see no key.

    Raises
    ------
    ValueError
        Bad shapes, H_q not a multiple of H_kv, cache_seqlens out of range, a block table too short for a length
        or naming a page the cache does not have, num_splits or block_size < 1; NaN or inf in q or in the
        entries of k_cache, v_cache that the sequences read (the error names the entry:
        :func:`check_decode_values`). Index arrays that do not hold integers raise :class:`IndexDtypeError`
        (both a ValueError and a TypeError).
    fa2edu.validation.AttentionOverflowError
        Finite q and k_cache whose scores τ·q·k would overflow the compute dtype (named q and k_cache, with the
        sequence), or a v_cache so large that the output's accumulator overflows — as ``flash2_forward``
        raises (a ValueError and an OverflowError), whatever the split count; never inf or NaN in O, L.
    TypeError
        Non-array or non-float inputs, mixed dtypes, a non-bool ``causal``, a non-int ``num_splits``.

    Notes
    -----
    Cost per (sequence b with n_b keys, KV head), T_b = ceil(n_b / block) blocks, S splits, R = G·N_new rows:

    * FLOPs: 2·R·n_b·(d + d_v) for the two matmuls; non-matmul O(R·n_b).
    * HBM reads: n_b·(d + d_v) of cache, min(S, T_b)·R·d of queries, and with S > 1 the partials, S·R·(d_v + 1).
    * HBM writes: R·(d_v + 1) of output, and with S > 1 the partials, S·R·(d_v + 1).

    The cache term dominates: about 2·R FLOPs per element moved, R = G·N_new (a few), against the hundreds per
    element at which a GPU's arithmetic, not its memory, becomes the limit (chapter 13).

    References
    ----------
    T. Dao, D. Haziza, F. Massa, G. Sizov, "Flash-Decoding for long-context inference", PyTorch blog, 2023.
    W. Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
    SOSP 2023. T. Dao, "FlashAttention-2", 2023, Algorithm 1 (each split's loop).
    """
    problem = check_decode_inputs(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits,
                                  block_size)
    work = compute_dtype(problem.q.dtype)
    # The values where they are read: finite, and scores within the compute dtype (as flash2_forward checks).
    check_decode_values(problem.q, problem.k_cache, problem.v_cache, problem.cache_seqlens, problem.block_table,
                        problem.scale, work)
    mem = HBM() if hbm is None else hbm
    if not isinstance(mem, HBM):
        raise TypeError(f"hbm must be a fa2edu.memory.HBM, got {type(mem).__name__}")
    count = FlopCounter() if flops is None else flops
    if not isinstance(count, FlopCounter):
        raise TypeError(f"flops must be a fa2edu.memory.FlopCounter, got {type(count).__name__}")
    B, H_kv, N_new, d_v = problem.B, problem.H_kv, problem.N_new, problem.d_v
    rows = problem.G * N_new
    sram = SRAM(None)
    mem.sram, mem.flops, mem.block_sizes, mem.algorithm = sram, count, (rows, problem.block_size), "decode_attention"
    # GQA: query head h = k·G + g reads KV head k = h // G; its N_new tokens are rows g·N_new … of KV head k's tile.
    q_tiles = problem.q.astype(work, copy=False).reshape(B, H_kv, rows, problem.d)
    O = np.zeros((B, H_kv, rows, d_v), dtype=work)
    L = np.zeros((B, H_kv, rows), dtype=work)
    try:
        # Overflow or an invalid operation inside (a v_cache too large for the accumulator Õ, say) is an error
        # naming the inputs, never an inf or NaN in O, L (nor an error naming the merge's internal partials).
        with np.errstate(over="raise", invalid="raise", under="ignore"):
            _decode_sequences(problem, q_tiles, O, L, mem, sram, count, work)
    except (FloatingPointError, AttentionOverflowError) as error:
        raise _decode_overflow(error, problem, work) from error
    O = cast_output(O.reshape(B, problem.H_q, N_new, d_v), problem.q.dtype, "O")
    return DecodeResult(O, L.reshape(B, problem.H_q, N_new))


# -- packed variable-length batches ----------------------------------------------------------------------------------

def check_cu_seqlens(cu_seqlens, name: str, total: int) -> np.ndarray:
    """``cu_seqlens`` (B + 1,) integers: starts at 0, never decreases, ends at ``total`` (the packed length).

    Sequence b occupies positions ``cu_seqlens[b] … cu_seqlens[b + 1] − 1``; equal neighbours make an empty one.
    """
    cu = _index_array(cu_seqlens, name, 1)
    if cu.size == 0:
        raise ValueError(f"{name} must have B + 1 ≥ 1 entries (offsets starting at 0), got none")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    drops = np.flatnonzero(np.diff(cu) < 0)
    if drops.size:
        b = int(drops[0])
        raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {cu[b]} > {name}[{b + 1}] = "
                         f"{cu[b + 1]}")
    if cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {name}[-1] = {cu[-1]}")
    return cu


def check_varlen_values(q, k, v, cu_q: np.ndarray, cu_k: np.ndarray, scale: float, score_dtype, *,
                        float64_helps: bool = True) -> None:
    """The values of :func:`varlen_attention`'s inputs: q, k, v finite (all of them: the offsets cover every packed
    position), and each sequence's scores τ·q·k within ``score_dtype`` — ``flash2_forward``'s contract
    (:func:`fa2edu.validation.check_score_range`) with errors naming q, k, v and the sequence.

    Only pairs that meet are checked: sequence b's queries against sequence b's keys. Cheap first (d·max|q|·max|k|
    over the whole batch), exact per sequence only where that bound fails. Shapes (H_q, total_q, d),
    (H_kv, total_k, d), (H_kv, total_k, d_v); offsets already checked by :func:`check_cu_seqlens`. Cost: one read
    of q, k, v.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not np.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or infinite values; attention inputs must be finite")
    if 0 in q.shape or 0 in k.shape:
        return
    score_dtype = np.dtype(score_dtype)
    d = q.shape[-1]
    bound = d * float(np.max(np.abs(q))) * float(np.max(np.abs(k))) * max(1.0, abs(float(scale)))
    if bound <= float(np.finfo(score_dtype).max) / 2:
        return
    H_q, H_kv = q.shape[0], k.shape[0]
    for b in range(cu_q.size - 1):
        (a, e), (c, f) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
        if e > a and f > c:
            # GQA: query head h·G + g reads key head h.
            check_score_range(q[:, a:e].reshape(H_kv, H_q // H_kv, e - a, d), k[:, None, c:f], scale, score_dtype,
                              names=("q", "k"), context=f" (sequence {b}: q[:, {a}:{e}] and k[:, {c}:{f}])",
                              float64_helps=float64_helps)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, M=None, block_sizes=None,
                     hbm=None, *, flops=None) -> Flash2Forward:
    """FA2's forward pass (FA2 Algorithm 1) over a packed batch of sequences of different lengths.

    Sequence b's queries are ``q[:, cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` and its keys and values
    ``k[:, cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``; its queries attend to its keys only. FA2 runs on each
    sequence's slice, so tiles start at the sequence's offset and never hold another sequence's tokens or padding
    (flash-attn's ``flash_attn_varlen_func``; the grid covers (sequence, row block) pairs).

    Parameters
    ----------
    q : numpy.ndarray, shape (H_q, total_q, d)
        Queries of all sequences, packed along axis 1. float16, float32 or float64, finite.
    k : numpy.ndarray, shape (H_kv, total_k, d)
        Keys of all sequences, packed; q's dtype; H_q a multiple of H_kv (GQA as everywhere).
    v : numpy.ndarray, shape (H_kv, total_k, d_v)
        Values, packed as ``k``.
    cu_seqlens_q : array of int, shape (B + 1,)
        Query offsets: non-decreasing from 0 to total_q (:func:`check_cu_seqlens`).
    cu_seqlens_k : array of int, shape (B + 1,)
        Key offsets: non-decreasing from 0 to total_k, with as many sequences as ``cu_seqlens_q``.
    causal : bool, default False
        Causal masking, bottom-right aligned within each sequence (query i of a sequence with n_q queries and n_k
        keys sees key j iff j ≤ i + n_k − n_q). Rows that see no key get O = 0, L = +inf.
    scale : float, optional
        The softmax scale τ; default 1/√d.
    M : int, optional
        SRAM size in elements for FA2's block-size rule (``B_r = ceil(M/4d)``, ``B_c = min(ceil(M/4d), d)``);
        default :data:`fa2edu.blocks.DEFAULT_M`.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``, overriding the rule. Default None: the rule.
    hbm : fa2edu.memory.HBM, optional
        Memory that records the traffic, per query head, summed over the sequences. Default None: a fresh,
        unreturned one.
    flops : fa2edu.memory.FlopCounter, optional
        Counter that records the FLOPs, per query head, summed over the sequences. Default None: a fresh,
        unreturned one.

    Returns
    -------
    Flash2Forward
        ``(O, L)``: O (H_q, total_q, d_v) in q's dtype, L (H_q, total_q) in the compute dtype.

    Raises
    ------
    ValueError
        Bad shapes, H_q not a multiple of H_kv, offsets that do not start at 0, decrease, or do not end at the
        packed lengths, different sequence counts, M < 4d, block sizes < 1; NaN or inf in q, k or v.
    fa2edu.validation.AttentionOverflowError
        Finite q and k whose scores τ·q·k within a sequence would overflow the compute dtype (named q and k, with
        the sequence), or any other overflow inside (a huge v), as ``flash2_forward`` raises.
    TypeError
        Non-array or non-float inputs, mixed dtypes; offsets that are not integers raise
        :class:`IndexDtypeError` (both a ValueError and a TypeError).

    Notes
    -----
    Cost per query head: Σ_b of FA2's forward cost on sequence b alone — reads n_q·d + T_r(n_q)·n_k·(d + d_v),
    writes n_q·(d_v + 1) without a mask, T_r(n_q) = ceil(n_q / B_r). A padded batch pays the same with every
    n_q, n_k replaced by the longest; :func:`padded_batch_io` counts it.
    """
    q = _float_array(q, "q", 3, "(H_q, total_q, d)")
    k = _float_array(k, "k", 3, "(H_kv, total_k, d)")
    v = _float_array(v, "v", 3, "(H_kv, total_k, d_v)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    H_q, total_q, d = q.shape
    H_kv, total_k, d_v = v.shape
    if k.shape[2] != d:
        raise ValueError(f"k's head dimension must equal q's: q has d = {d}, k has {k.shape[2]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same heads and packed length, got {k.shape} and {v.shape}")
    if min(H_q, H_kv, d, d_v) == 0:
        raise ValueError(f"heads and head dimensions must be at least 1, got q {q.shape}, k {k.shape}, v {v.shape}")
    if H_q % H_kv != 0:
        raise ValueError(f"the number of query heads H_q = {H_q} must be a multiple of the number of key/value "
                         f"heads H_kv = {H_kv} (GQA/MQA)")
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k)
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same B sequences, got {cu_q.size - 1} "
                         f"and {cu_k.size - 1}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    tau = check_scale(scale, d)
    resolve_block_sizes(M, block_sizes, d, block_sizes_q_outer)       # checked even if every sequence is empty
    work = compute_dtype(q.dtype)
    # The values: finite, and every sequence's scores within the compute dtype, named as the caller names them
    # (flash2_forward below would check each sequence too, but naming its own Q, K).
    check_varlen_values(q, k, v, cu_q, cu_k, tau, work)
    mem = HBM() if hbm is None else hbm
    if not isinstance(mem, HBM):
        raise TypeError(f"hbm must be a fa2edu.memory.HBM, got {type(mem).__name__}")
    count = FlopCounter() if flops is None else flops
    if not isinstance(count, FlopCounter):
        raise TypeError(f"flops must be a fa2edu.memory.FlopCounter, got {type(count).__name__}")
    O = np.zeros((H_q, total_q, d_v), dtype=q.dtype)
    L = np.full((H_q, total_q), np.inf, dtype=work)
    sram = None
    for b in range(cu_q.size - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
        if n_q == 0:
            continue                                              # no query: no program runs for this sequence
        if n_k == 0:
            # No key: every row is fully masked. The programs write O = 0, L = +inf without loading anything.
            mem.put("O", O[:, rows])
            mem.put("L", L[:, rows], vector=True)
            mem.write("O", slice(0, n_q), 0.0, line="Alg 1 line 14")
            mem.write("L", slice(0, n_q), np.inf, line="Alg 1 line 15")
            continue
        # FA2 Alg. 1 on sequence b alone: its row blocks and K/V blocks start at its own offsets.
        try:
            fwd = flash2_forward(q[:, rows], k[:, keys], v[:, keys], M=M, block_sizes=block_sizes, causal=causal,
                                 scale=scale, hbm=mem, flops=count)
        except AttentionOverflowError as error:
            # An overflow inside FA2 (a v too large for the accumulator Õ): name the sequence and its slices.
            raise AttentionOverflowError(
                f"varlen_attention, sequence {b} (Q, K, V below are q[:, {rows.start}:{rows.stop}], "
                f"k and v[:, {keys.start}:{keys.stop}]): {error}") from error
        O[:, rows], L[:, rows] = fwd.O, fwd.L
        if sram is None or mem.sram.peak > sram.peak:
            sram = mem.sram
    mem.sram = sram if sram is not None else SRAM(None)
    mem.flops, mem.algorithm = count, "varlen_attention"
    return Flash2Forward(O, L)


def padded_batch_io(cu_seqlens_q, cu_seqlens_k, d: int, d_v: int | None = None, causal: bool = False, M=None,
                    block_sizes=None) -> PaddedIO:
    """HBM traffic of FA2's forward pass on the same batch padded to its longest sequence, per query head.

    Every sequence is padded to N_q_max queries and N_k_max keys and the (B, 1, N_q_max, d) batch runs through
    :func:`fa2edu.flash2.flash2_forward` with a ledger: padding rows are loaded and padding outputs written as if
    they were tokens. The counts are per query head, summed over the B sequences, the unit of
    :func:`varlen_attention`'s ledger, so the two compare directly (equal when all lengths are equal).

    Parameters
    ----------
    cu_seqlens_q : array of int, shape (B + 1,)
        Query offsets of the packed batch (as for :func:`varlen_attention`).
    cu_seqlens_k : array of int, shape (B + 1,)
        Key offsets of the packed batch.
    d : int
        Head dimension of queries and keys.
    d_v : int, optional
        Head dimension of values; default d.
    causal : bool, default False
        Causal masking (bottom-right, on the padded lengths), which changes the blocks visited.
    M : int, optional
        SRAM size in elements, as for :func:`varlen_attention`; default :data:`fa2edu.blocks.DEFAULT_M`.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``, as for :func:`varlen_attention`; default None: FA2's rule from M.

    Returns
    -------
    PaddedIO
        reads, writes, total (elements per query head, summed over the batch) and the padded lengths.

    Notes
    -----
    Cost: one FA2 forward pass on B · N_q_max · N_k_max scores (it executes; keep the batch small).
    """
    d = _positive_int(d, "d")
    d_v = d if d_v is None else _positive_int(d_v, "d_v")
    cu_q = _index_array(cu_seqlens_q, "cu_seqlens_q", 1)
    cu_k = _index_array(cu_seqlens_k, "cu_seqlens_k", 1)
    cu_q = check_cu_seqlens(cu_q, "cu_seqlens_q", int(cu_q[-1]) if cu_q.size else 0)
    cu_k = check_cu_seqlens(cu_k, "cu_seqlens_k", int(cu_k[-1]) if cu_k.size else 0)
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same B sequences, got {cu_q.size - 1} "
                         f"and {cu_k.size - 1}")
    B = cu_q.size - 1
    N_q_max = int(np.diff(cu_q).max(initial=0))
    N_k_max = int(np.diff(cu_k).max(initial=0))
    if B == 0 or N_q_max == 0:
        return PaddedIO(0, 0, 0, N_q_max, N_k_max)
    if N_k_max == 0:
        # Nothing to attend to: the padded batch only writes O = 0, L = +inf for its B · N_q_max rows.
        writes = B * N_q_max * (d_v + 1)
        return PaddedIO(0, writes, writes, N_q_max, N_k_max)
    hbm = HBM()
    zeros = np.zeros
    flash2_forward(zeros((B, 1, N_q_max, d), np.float32), zeros((B, 1, N_k_max, d), np.float32),
                   zeros((B, 1, N_k_max, d_v), np.float32), M=M, block_sizes=block_sizes, causal=causal, hbm=hbm)
    # The ledger is per (batch, head) program, and every padded program does the same work: × B for the batch.
    reads, writes = int(B * hbm.reads), int(B * hbm.writes)
    return PaddedIO(reads, writes, reads + writes, N_q_max, N_k_max)
