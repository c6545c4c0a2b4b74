"""Scores and masks as code: FlexAttention (PyTorch's ``torch.nn.attention.flex_attention``) in NumPy.

FlexAttention lets a user write two small Python functions instead of a new kernel:

* a **mask_mod** ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True keeps the score of query ``q_idx`` for key
  ``kv_idx`` in batch entry ``b``, query head ``h``; False sets it to −inf;
* a **score_mod** ``score_mod(score, b, h, q_idx, kv_idx) -> score``: rewrites the scaled score τ·q·k before the
  softmax (a bias, a soft cap).

Its algorithm is FA1's block-sparse FlashAttention (FA1 Algorithm 5) run inside FA2's loops. The mask is evaluated
once per (query block, key block) pair, ahead of time, by :func:`create_block_mask`; each pair is then *skipped*
(no score kept: never loaded, no FLOP), *partial* (some kept: the mask is evaluated per element of the tile) or
*full* (all kept: no mask at all) — FA2 Section 3.1's classification, :class:`fa2edu.masks.BlockKind`'s SKIP, MASK
and PLAIN. :func:`flex_attention` is FA2 Algorithm 1 over that classification, :func:`flex_attention_backward`
FA2 Algorithm 2; both count their HBM traffic on a :class:`~fa2edu.memory.HBM` ledger, so the blocks skipped are
blocks never read (:func:`fa2edu.io.simulate_flex_io` turns that into a report and a closed form).

Mods. A mod is written for scalars — plain Python and ``math`` (or NumPy ufuncs), as numba compiles them — and
is evaluated elementwise. The NumPy path first calls it once on broadcast index arrays (``b`` (B, 1, 1, 1),
``q_idx`` (1, 1, r, 1), …): a mod built from ``<=``, ``&``, ``|``, ``+``, indexing and ufuncs then evaluates a whole
tile at once. When that call fails (Python's ``and``, ``or``, ``if``, ``math.tanh``, ``min`` need scalars) or
disagrees with scalar calls at a few sampled elements, it falls back to one Python call per element: slower, the
same answer. Mods that index arrays (document ids, a bias table) receive them as trailing arguments bound with
:func:`bind`. The ready mods below are written with operators and ufuncs only, so they work on Python numbers,
NumPy arrays and PyTorch tensors alike. flash-attn's keywords have their own mods, as flash-attn defines them:
:func:`local_window` (``window_size=(left, right)``), :func:`softcap`, :func:`symmetric_alibi` (``alibi_slopes``),
composed by :func:`chain_score_mods` (``fa2edu.torch.flash_attention`` builds them from its keywords).

Alignment. fa2edu aligns causal masks bottom-right (:func:`fa2edu.masks.causal_offset`): with Q_LEN queries and
KV_LEN keys, query i sits at key position ``i + KV_LEN − Q_LEN``. A mask_mod cannot know the lengths, so the ready
mods that have a diagonal (:func:`causal`, :func:`sliding_window`, :func:`prefix_lm`) carry an ``at_lengths``
method, and :func:`at_lengths` (called by :func:`create_block_mask` and :func:`flex_attention`) specialises them;
called directly they are aligned for Q_LEN = KV_LEN (where top-left and bottom-right agree). PyTorch's own
examples (``q_idx >= kv_idx``) are top-left aligned: the two differ only when Q_LEN ≠ KV_LEN.

Conventions (the rest of fa2edu's): q (B, H_q, N_q, d), k (B, H_kv, N_k, d), v (B, H_kv, N_k, d_v); τ = 1/√d by
default; L is the natural-log log-sum-exp of each row of the modified, masked scores; a fully masked row has O = 0,
L = +inf (PyTorch returns −inf there) and zero gradients. Gradients with respect to the arrays a mod binds (a bias
table, ALiBi slopes) are out of scope: only q, k and v get gradients.
"""

from __future__ import annotations

import inspect
from numbers import Integral, Real

import numpy as np

from fa2edu.blocks import num_blocks, start_run, tiles
from fa2edu.flash2 import (
    Flash2Backward,
    Flash2Forward,
    _check_saved,
    flash2_backward_working_set,
    flash2_forward_working_set,
)
from fa2edu.masks import BlockKind, causal_offset
from fa2edu.memory import HBM
from fa2edu.softmax import exp_minus
from fa2edu.validation import _check_array, cast_output, guard_overflow, prepare

__all__ = [
    "BlockMask", "create_block_mask", "flex_attention", "flex_attention_backward",
    "SKIPPED", "PARTIAL", "FULL", "at_lengths", "bind", "or_masks", "and_masks", "chain_score_mods",
    "causal", "sliding_window", "local_window", "prefix_lm", "document", "alibi", "alibi_slopes", "symmetric_alibi",
    "softcap", "relative_bias",
]

#: Block classes, as stored in :attr:`BlockMask.classes` (ordered by how much work a block costs).
SKIPPED, PARTIAL, FULL = 0, 1, 2
#: The class codes as :class:`fa2edu.masks.BlockKind`: skipped = SKIP, partial = MASK, full = PLAIN.
KINDS = (BlockKind.SKIP, BlockKind.MASK, BlockKind.PLAIN)

#: Mask elements evaluated per call of a mask_mod in :func:`create_block_mask` (bounds its memory).
_CHUNK_ELEMENTS = 1 << 22


# -- evaluating a mod over a tile ------------------------------------------------------------------------------------

def _name(mod) -> str:
    return getattr(mod, "__name__", type(mod).__name__)


def _check_callable(mod, name: str, signature: str):
    if not callable(mod):
        raise TypeError(f"{name} must be a callable {signature}, got {type(mod).__name__}")
    return mod


def _scalar_result(value, name: str, kind: str, where: tuple):
    """One element's answer, checked: a bool from a mask_mod, a real number from a score_mod (or its derivative).
    ``name`` is the role and the function, e.g. "mask_mod causal"."""
    array = np.asarray(value)
    if kind == "mask":
        if array.ndim != 0 or array.dtype != np.bool_:
            raise TypeError(f"{name} must return a bool (True = keep the score), got {type(value).__name__} "
                            f"{value!r} at (b, h, q_idx, kv_idx) = {where}")
        return bool(array)
    if array.ndim != 0 or array.dtype.kind not in "fiu":
        raise TypeError(f"{name} must return a real number, got {type(value).__name__} {value!r} at "
                        f"(score, b, h, q_idx, kv_idx) = {where}")
    return float(array)


def _with_context(error: Exception, name: str, where: tuple) -> Exception:
    """The mod's own error, with the element it failed at (same type where the type allows a message)."""
    try:
        return type(error)(f"{name} raised {type(error).__name__} at {where}: {error}")
    except Exception:                                   # an exception type with another constructor
        return error


def _elementwise(mod, name: str, args: list[np.ndarray], shape: tuple, kind: str) -> np.ndarray:
    """The mod called once per element with Python scalars (ints for indices, a float for the score)."""
    args = [np.broadcast_to(a, shape) for a in args]
    out = np.empty(shape, dtype=bool if kind == "mask" else np.float64)
    for index in np.ndindex(*shape):
        scalars = tuple(float(a[index]) if a.dtype.kind == "f" else int(a[index]) for a in args)
        try:
            value = mod(*scalars)
        except Exception as error:
            raise _with_context(error, name, scalars) from error
        out[index] = _scalar_result(value, name, kind, scalars)
    return out


def _agrees_at_samples(mod, name: str, out: np.ndarray, args: list[np.ndarray], kind: str) -> bool:
    """A vectorised answer must match scalar calls at the tile's first, middle and last elements."""
    shape = out.shape
    args = [np.broadcast_to(a, shape) for a in args]
    rtol = 1e-9 if out.dtype == np.float64 else 1e-5
    for flat in sorted({0, out.size // 2, out.size - 1}):
        index = np.unravel_index(flat, shape)
        expected = _elementwise(mod, name, [a[index] for a in args], (), kind)[()]
        if kind == "mask" and bool(out[index]) != bool(expected):
            return False
        if kind == "score" and not np.isclose(out[index], expected, rtol=rtol, atol=rtol):
            return False
    return True


def _evaluate(mod, name: str, args: list[np.ndarray], shape: tuple, kind: str, dtype=np.float64) -> np.ndarray:
    """``mod(*args)`` over a tile of ``shape``: vectorised when the mod allows it, element by element otherwise.

    ``args`` are arrays that broadcast to ``shape`` (the score tile first for a score_mod, then b, h, q_idx,
    kv_idx). ``kind`` is "mask" (a bool tile comes back) or "score" (a ``dtype`` tile).
    """
    try:
        value = mod(*args)
        out = np.broadcast_to(np.asarray(value), shape)
    except FloatingPointError:                          # an overflow is an overflow, whichever way it is evaluated
        raise
    except Exception:                                   # `and`, `if`, math.* need scalars: evaluate per element
        out = None
    accepted = out is not None and (out.dtype == np.bool_ if kind == "mask" else out.dtype.kind in "fiu")
    if accepted and _agrees_at_samples(mod, name, out.astype(dtype) if kind == "score" else out, args, kind):
        return out.astype(dtype) if kind == "score" else out
    out = _elementwise(mod, name, args, shape, kind)
    return out if kind == "mask" else out.astype(dtype)


def _mask_tile(mask_mod, B: int, H: int, rows: slice, cols: slice) -> np.ndarray:
    """mask_mod over batch entries 0 … B−1, heads 0 … H−1, queries ``rows``, keys ``cols``: (B, H, r, c) bool."""
    b = np.arange(B)[:, None, None, None]
    h = np.arange(H)[None, :, None, None]
    q_idx = np.arange(rows.start, rows.stop)[None, None, :, None]
    kv_idx = np.arange(cols.start, cols.stop)[None, None, None, :]
    shape = (B, H, rows.stop - rows.start, cols.stop - cols.start)
    return _evaluate(mask_mod, f"mask_mod {_name(mask_mod)}", [b, h, q_idx, kv_idx], shape, "mask")


# -- composing and binding mods ----------------------------------------------------------------------------------

def at_lengths(mod, Q_LEN: int, KV_LEN: int):
    """``mod`` as it applies to Q_LEN queries and KV_LEN keys.

    A mod whose diagonal depends on the lengths (the ready :func:`causal`, :func:`sliding_window`,
    :func:`prefix_lm`, and :func:`or_masks` / :func:`and_masks` of them) carries a method ``at_lengths(Q_LEN,
    KV_LEN)`` returning the mod aligned bottom-right, key offset ``KV_LEN − Q_LEN``
    (:func:`fa2edu.masks.causal_offset`); every other mod is returned unchanged.

    Parameters
    ----------
    mod : callable
        A mask_mod or score_mod.
    Q_LEN : int
        Number of queries.
    KV_LEN : int
        Number of keys.

    Returns
    -------
    callable
        The mod to evaluate for these lengths.
    """
    hook = getattr(mod, "at_lengths", None)
    return mod if hook is None else hook(Q_LEN, KV_LEN)


def bind(mod, *arrays):
    """``mod`` with trailing arguments bound: ``bind(mod, ids)(b, h, q_idx, kv_idx) = mod(b, h, q_idx, kv_idx, ids)``.

    Mods stay functions of scalars (as numba compiles them) and receive the arrays they index — document ids, a
    bias table, per-head slopes — as extra arguments. The result keeps ``mod`` and ``arrays`` as attributes (what
    a GPU kernel compiles), and a derivative ``mod.score_mod_grad`` is bound to the same arrays. Gradients with
    respect to bound arrays are not computed.

    Parameters
    ----------
    mod : callable
        ``mod(b, h, q_idx, kv_idx, *arrays) -> bool`` or ``mod(score, b, h, q_idx, kv_idx, *arrays) -> score``.
    *arrays : array_like
        Values passed after the mod's usual arguments (lists and tuples become NumPy arrays).

    Returns
    -------
    callable
        The bound mod.
    """
    _check_callable(mod, "mod", "mask_mod or score_mod")
    arrays = tuple(np.asarray(a) if isinstance(a, (list, tuple)) else a for a in arrays)
    # The bound mod has the signature of a mask_mod or a score_mod, as PyTorch and numba read it.
    leading = _positional_count(mod) - len(arrays)
    if leading == 4:
        def bound(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx, kv_idx, *arrays)
    elif leading == 5:
        def bound(score, b, h, q_idx, kv_idx):
            return mod(score, b, h, q_idx, kv_idx, *arrays)
    elif leading < 0 and _positional_count(mod) >= 0:
        raise TypeError(f"mod {_name(mod)} takes {_positional_count(mod)} positional arguments, fewer than the "
                        f"{len(arrays)} arrays bound to it")
    else:                                  # *args, or a signature Python cannot read: pass everything through
        def bound(*args):
            return mod(*args, *arrays)
    bound.__name__ = _name(mod)
    bound.__doc__ = mod.__doc__
    bound.mod, bound.arrays = mod, arrays
    grad = getattr(mod, "score_mod_grad", None)
    if grad is not None:
        bound.score_mod_grad = bind(grad, *arrays)
    return bound


def _positional_count(mod) -> int:
    """Positional parameters of ``mod``; −1 when it takes ``*args`` or its signature cannot be read."""
    try:
        parameters = inspect.signature(mod).parameters.values()
    except (TypeError, ValueError):
        return -1
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return -1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def _combine(mask_mods, combiner: str):
    if not mask_mods:
        raise ValueError(f"{combiner} needs at least one mask_mod")
    for position, mod in enumerate(mask_mods):
        _check_callable(mod, f"{combiner} argument {position}", "mask_mod(b, h, q_idx, kv_idx) -> bool")
    return tuple(mask_mods)


def or_masks(*mask_mods):
    """A mask_mod that keeps a score when **any** of ``mask_mods`` keeps it (elementwise ``|``).

    Parameters
    ----------
    *mask_mods : callable
        One or more ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Returns
    -------
    callable
        Their union, with an ``at_lengths`` method when any of them has one; its parts are kept as ``.mods``
        and this function as ``.combine`` (to rebuild it from other parts, say the same mods on tensors).
    """
    mods = _combine(mask_mods, "or_masks")

    def any_of(b, h, q_idx, kv_idx):
        keep = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            keep = keep | mod(b, h, q_idx, kv_idx)
        return keep
    any_of.__name__ = f"or_masks({', '.join(_name(m) for m in mods)})"
    any_of.mods, any_of.combine = mods, or_masks
    if any(hasattr(m, "at_lengths") for m in mods):
        any_of.at_lengths = lambda Q_LEN, KV_LEN: or_masks(*(at_lengths(m, Q_LEN, KV_LEN) for m in mods))
    return any_of


def and_masks(*mask_mods):
    """A mask_mod that keeps a score when **all** of ``mask_mods`` keep it (elementwise ``&``).

    Parameters
    ----------
    *mask_mods : callable
        One or more ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Returns
    -------
    callable
        Their intersection, with an ``at_lengths`` method when any of them has one; its parts are kept as ``.mods``
        and this function as ``.combine`` (to rebuild it from other parts, say the same mods on tensors).
    """
    mods = _combine(mask_mods, "and_masks")

    def all_of(b, h, q_idx, kv_idx):
        keep = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            keep = keep & mod(b, h, q_idx, kv_idx)
        return keep
    all_of.__name__ = f"and_masks({', '.join(_name(m) for m in mods)})"
    all_of.mods, all_of.combine = mods, and_masks
    if any(hasattr(m, "at_lengths") for m in mods):
        all_of.at_lengths = lambda Q_LEN, KV_LEN: and_masks(*(at_lengths(m, Q_LEN, KV_LEN) for m in mods))
    return all_of


def chain_score_mods(*score_mods):
    """A score_mod that applies ``score_mods`` in turn: ``chain_score_mods(f, g)(s, …) = g(f(s, …), …)``.

    Its derivative is the chain rule, ``d/ds g(f(s)) = g'(f(s)) · f'(s)``: the product of each part's
    ``score_mod_grad`` at the score that part receives. flash-attn caps the scaled score, then adds its ALiBi bias
    (``softcap=``, ``alibi_slopes=``): ``chain_score_mods(softcap(c), symmetric_alibi(slopes))``, derivative
    ``1 − tanh²(s/c)``.

    Parameters
    ----------
    *score_mods : callable
        One or more ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied first to last.

    Returns
    -------
    callable
        Their composition; with ``score_mod_grad`` when every part carries one (else a backward pass through it
        needs ``score_mod_grad=``), with an ``at_lengths`` method when any part has one; its parts are kept as
        ``.mods`` and this function as ``.combine``.
    """
    if not score_mods:
        raise ValueError("chain_score_mods needs at least one score_mod")
    for position, mod in enumerate(score_mods):
        _check_callable(mod, f"chain_score_mods argument {position}", "score_mod(score, b, h, q_idx, kv_idx) -> score")
    mods = tuple(score_mods)

    def chained(score, b, h, q_idx, kv_idx):
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score
    chained.__name__ = f"chain_score_mods({', '.join(_name(m) for m in mods)})"
    chained.mods, chained.combine = mods, chain_score_mods
    grads = [getattr(mod, "score_mod_grad", None) for mod in mods]
    if all(grad is not None for grad in grads):
        def chained_derivative(score, b, h, q_idx, kv_idx):
            slope = 1.0
            for mod, grad in zip(mods, grads):
                # the chain rule: each part's derivative at the score it receives, then that part's output
                slope = slope * grad(score, b, h, q_idx, kv_idx)
                score = mod(score, b, h, q_idx, kv_idx)
            return slope
        chained_derivative.__name__ = f"d {chained.__name__}"
        chained.score_mod_grad = chained_derivative
    if any(hasattr(mod, "at_lengths") for mod in mods):
        chained.at_lengths = lambda Q_LEN, KV_LEN: chain_score_mods(*(at_lengths(m, Q_LEN, KV_LEN) for m in mods))
        if hasattr(chained, "score_mod_grad"):
            # the backward specialises the derivative on its own: it is the specialised chain's derivative
            chained.score_mod_grad.at_lengths = lambda Q_LEN, KV_LEN: chained.at_lengths(Q_LEN, KV_LEN).score_mod_grad
    return chained


# -- ready mask_mods -------------------------------------------------------------------------------------------------

def _positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _causal_at(offset: int):
    def causal_mask_mod(b, h, q_idx, kv_idx):
        # Query q_idx sits at key position q_idx + offset and sees every key up to it.
        return kv_idx <= q_idx + offset
    causal_mask_mod.__name__ = f"causal[offset={offset}]"
    return causal_mask_mod


def causal(b, h, q_idx, kv_idx):
    """mask_mod: query i sees key j iff ``j ≤ i + KV_LEN − Q_LEN`` (bottom-right aligned, as fa2edu.masks).

    Called directly it has offset 0 (``kv_idx <= q_idx``: Q_LEN = KV_LEN, where top-left and bottom-right agree);
    :func:`create_block_mask` specialises it to the lengths through ``causal.at_lengths(Q_LEN, KV_LEN)``
    (offset :func:`fa2edu.masks.causal_offset`). With Q_LEN > KV_LEN the first Q_LEN − KV_LEN queries see no key.

    Parameters
    ----------
    b : int or ndarray
        Batch index (unused).
    h : int or ndarray
        Query head index (unused).
    q_idx : int or ndarray
        Query index.
    kv_idx : int or ndarray
        Key index.

    Returns
    -------
    bool or ndarray of bool
        True where the score is kept.
    """
    return kv_idx <= q_idx


causal.at_lengths = lambda Q_LEN, KV_LEN: _causal_at(causal_offset(Q_LEN, KV_LEN))


def sliding_window(w: int):
    """mask_mod factory: a causal window of the ``w`` most recent keys, the query's own position included.

    Query i at key position ``p = i + KV_LEN − Q_LEN`` (bottom-right aligned) sees exactly the keys j with
    ``p − w < j ≤ p``: keys p − w + 1, …, p (fewer near the start). ``w = 1`` is the diagonal alone; ``w ≥ KV_LEN``
    is :func:`causal`. (PyTorch's example ``q_idx - kv_idx <= W`` keeps W + 1 keys.) Each row block of B_r queries
    visits about ``(w + B_r)/B_c + 1`` key blocks, so the work and HBM traffic grow as N·w, not N².

    Parameters
    ----------
    w : int
        Window length in keys, at least 1.

    Returns
    -------
    callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` with an ``at_lengths`` method.
    """
    w = _positive_int(w, "w")

    def at(offset: int):
        def sliding_window_mask_mod(b, h, q_idx, kv_idx):
            p = q_idx + offset
            return (kv_idx <= p) & (kv_idx > p - w)
        sliding_window_mask_mod.__name__ = f"sliding_window({w})" + (f"[offset={offset}]" if offset else "")
        return sliding_window_mask_mod
    mod = at(0)
    mod.at_lengths = lambda Q_LEN, KV_LEN: at(causal_offset(Q_LEN, KV_LEN))
    return mod


def _window_side(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int (-1 for no bound), got {type(value).__name__}")
    if value < -1:
        raise ValueError(f"{name} must be -1 (no bound) or at least 0, got {value}")
    return int(value)


def local_window(left: int, right: int):
    """mask_mod factory: flash-attn's ``window_size=(left, right)``, a band around the (bottom-right) diagonal.

    Query i at key position ``p = i + KV_LEN − Q_LEN`` (bottom-right aligned, as flash-attn) sees exactly the keys j
    with ``p − left ≤ j ≤ p + right``; −1 leaves that side unbounded. So ``(-1, -1)`` keeps every score,
    ``(-1, 0)`` is :func:`causal`, ``(w − 1, 0)`` is :func:`sliding_window` (w) and ``(w, w)`` a bidirectional
    band of 2w + 1 keys. Rows whose band misses ``0 … KV_LEN − 1`` see no key (O = 0, L = +inf). flash-attn's
    ``causal=True`` with a window is ``(left, 0)``.

    Parameters
    ----------
    left : int
        Keys before the query's position it may see, at least 0; −1: all of them.
    right : int
        Keys after the query's position it may see, at least 0; −1: all of them.

    Returns
    -------
    callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` with an ``at_lengths`` method.
    """
    left, right = _window_side(left, "left"), _window_side(right, "right")

    def at(offset: int):
        # the bounds are decided here, once: the mod itself is one or two comparisons (numba compiles it as is)
        if left >= 0 and right >= 0:
            def local_window_mask_mod(b, h, q_idx, kv_idx):
                p = q_idx + offset
                return (kv_idx >= p - left) & (kv_idx <= p + right)
        elif left >= 0:
            def local_window_mask_mod(b, h, q_idx, kv_idx):
                return kv_idx >= q_idx + offset - left
        elif right >= 0:
            def local_window_mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + offset + right
        else:
            def local_window_mask_mod(b, h, q_idx, kv_idx):
                return kv_idx >= 0
        local_window_mask_mod.__name__ = f"local_window({left}, {right})" + (f"[offset={offset}]" if offset else "")
        return local_window_mask_mod
    mod = at(0)
    mod.at_lengths = lambda Q_LEN, KV_LEN: at(causal_offset(Q_LEN, KV_LEN))
    return mod


def prefix_lm(n: int):
    """mask_mod factory: every query sees the first ``n`` keys (the bidirectional prefix), and the rest causally.

    Query i sees key j iff ``j < n`` or ``j ≤ i + KV_LEN − Q_LEN`` (bottom-right aligned causal part).

    Parameters
    ----------
    n : int
        Prefix length in keys, at least 0 (0 is :func:`causal`).

    Returns
    -------
    callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool`` with an ``at_lengths`` method.
    """
    n = _positive_int(n, "n", minimum=0)

    def at(offset: int):
        def prefix_lm_mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < n) | (kv_idx <= q_idx + offset)
        prefix_lm_mask_mod.__name__ = f"prefix_lm({n})" + (f"[offset={offset}]" if offset else "")
        return prefix_lm_mask_mod
    mod = at(0)
    mod.at_lengths = lambda Q_LEN, KV_LEN: at(causal_offset(Q_LEN, KV_LEN))
    return mod


def _integer_ids(ids, name: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be a non-empty 1-D integer array (one document id per position), got "
                        f"dtype {ids.dtype} and shape {ids.shape}")
    return ids


def _same_document(b, h, q_idx, kv_idx, q_ids, kv_ids):
    return q_ids[q_idx] == kv_ids[kv_idx]


def document(ids, kv_ids=None):
    """mask_mod factory for packed documents: query i sees key j iff they belong to the same document.

    ``ids[i]`` is the document of position i (a packed batch: ``[0, 0, 0, 1, 1, 2, …]``); keys use ``kv_ids`` when
    the keys are not the queries' positions (default: ``ids``). The mask is bidirectional: combine it as
    ``and_masks(causal, document(ids))`` for causal documents. Each document's diagonal blocks are partial or full,
    blocks between different documents are skipped.

    Parameters
    ----------
    ids : array_like of int, shape (Q_LEN,) or longer
        Document id of each query position.
    kv_ids : array_like of int, shape (KV_LEN,) or longer, optional
        Document id of each key position. Default None: ``ids``.

    Returns
    -------
    callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``, :func:`bind` of ``_same_document`` to the ids.
    """
    ids = _integer_ids(ids, "ids")
    kv_ids = ids if kv_ids is None else _integer_ids(kv_ids, "kv_ids")
    mod = bind(_same_document, ids, kv_ids)
    mod.__name__ = f"document({len(ids)} ids)"
    return mod


# -- ready score_mods (each with its derivative with respect to score) ---------------------------------------------

def _unit_derivative(score, b, h, q_idx, kv_idx, bias_array):
    """d/dscore of ``score + bias`` is 1 (``score * 0 + 1`` keeps the score's shape and type); ``bias_array`` is the
    array the score_mod binds (slopes, a table), bound here too so that the two mods take the same arguments."""
    return score * 0.0 + 1.0


def _real_vector(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be a non-empty 1-D array of real numbers, got dtype {array.dtype} and "
                        f"shape {array.shape}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite")
    return array


def _alibi_bias(score, b, h, q_idx, kv_idx, slopes):
    # ALiBi: a linear penalty on distance, slope m_h per query head; kv_idx − q_idx ≤ 0 for the keys a causal query
    # sees, so far keys are pushed down.
    return score + slopes[h] * (kv_idx - q_idx)


def alibi(slopes):
    """score_mod factory: ALiBi, ``score + slopes[h] · (kv_idx − q_idx)`` (Press et al., 2022).

    ``slopes`` has one entry per query head (:func:`alibi_slopes` gives the paper's). The distance is the raw index
    difference; with Q_LEN ≠ KV_LEN a bottom-right alignment would shift each row by the constant
    ``slopes[h]·(KV_LEN − Q_LEN)``, which the softmax cancels: O is the same either way (L moves by that constant).
    Derivative with respect to score: 1 (``alibi(slopes).score_mod_grad``).

    Parameters
    ----------
    slopes : array_like of float, shape (H,)
        Slope of each query head.

    Returns
    -------
    callable
        ``score_mod(score, b, h, q_idx, kv_idx)``, with ``score_mod_grad``.
    """
    slopes = _real_vector(slopes, "slopes")
    mod = bind(_alibi_bias, slopes)
    mod.score_mod_grad = bind(_unit_derivative, slopes)
    mod.__name__ = f"alibi({len(slopes)} slopes)"
    return mod


def alibi_slopes(H: int) -> np.ndarray:
    """ALiBi's slopes for H heads: the geometric sequence ``2^(−8(h+1)/H)``, h = 0 … H−1 (Press et al., 2022).

    Parameters
    ----------
    H : int
        Number of query heads, at least 1.

    Returns
    -------
    ndarray, shape (H,)
        The slopes, float64.
    """
    H = _positive_int(H, "H")
    return 2.0 ** (-8.0 * np.arange(1, H + 1) / H)


def _real_slopes(values) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim not in (1, 2) or array.size == 0 or array.dtype.kind not in "fiu":
        raise TypeError(f"slopes must be a non-empty array of real numbers of shape (H,) or (B, H), got dtype "
                        f"{array.dtype} and shape {array.shape}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError("slopes must be finite")
    return array


def symmetric_alibi(slopes):
    """score_mod factory: ALiBi as flash-attn adds it (``alibi_slopes=``), ``score − slope · |i + KV_LEN − Q_LEN − j|``.

    The distance is measured from the query's key position ``p = i + KV_LEN − Q_LEN`` (bottom-right aligned, as
    :func:`local_window`) and in both directions, so keys after the query are penalised too when nothing masks
    them; ``slope`` is ``slopes[h]`` for slopes of shape (H,), ``slopes[b, h]`` for (B, H). Where :func:`alibi`'s
    ``slopes[h]·(j − i)`` differs: under a causal mask (j ≤ p) the two are equal up to the row constant
    ``slopes[h]·(KV_LEN − Q_LEN)``, which changes L but not O; without a mask they differ. Derivative with respect
    to score: 1.

    Parameters
    ----------
    slopes : array_like of float, shape (H,) or (B, H)
        Slope of each query head, or of each (batch entry, query head); positive slopes penalise distance.

    Returns
    -------
    callable
        ``score_mod(score, b, h, q_idx, kv_idx)``, with ``score_mod_grad`` and an ``at_lengths`` method.
    """
    slopes = _real_slopes(slopes)

    def at(offset: int):
        if slopes.ndim == 1:
            def symmetric_alibi_bias(score, b, h, q_idx, kv_idx, slopes):
                return score - slopes[h] * abs(q_idx + offset - kv_idx)
        else:
            def symmetric_alibi_bias(score, b, h, q_idx, kv_idx, slopes):
                return score - slopes[b, h] * abs(q_idx + offset - kv_idx)
        mod = bind(symmetric_alibi_bias, slopes)
        mod.score_mod_grad = bind(_unit_derivative, slopes)
        mod.__name__ = (f"symmetric_alibi({'x'.join(map(str, slopes.shape))} slopes)"
                        + (f"[offset={offset}]" if offset else ""))
        return mod
    mod = at(0)
    mod.at_lengths = lambda Q_LEN, KV_LEN: at(causal_offset(Q_LEN, KV_LEN))
    return mod


def softcap(c: float):
    """score_mod factory: soft capping, ``c · tanh(score / c)`` (Gemma 2): scores stay inside (−c, c).

    Derivative with respect to score: ``1 − tanh²(score / c)`` (``softcap(c).score_mod_grad``). Written with
    ``np.tanh``, which takes a Python float, an array, and compiles under numba.

    Parameters
    ----------
    c : float
        The cap, positive and finite.

    Returns
    -------
    callable
        ``score_mod(score, b, h, q_idx, kv_idx)``, with ``score_mod_grad``.
    """
    if isinstance(c, bool) or not isinstance(c, Real):
        raise TypeError(f"c must be a real number, got {type(c).__name__}")
    if not (np.isfinite(c) and c > 0):
        raise ValueError(f"c must be positive and finite, got {c}")
    c = float(c)

    def softcap_score_mod(score, b, h, q_idx, kv_idx):
        return c * np.tanh(score / c)

    def softcap_derivative(score, b, h, q_idx, kv_idx):
        t = np.tanh(score / c)
        return 1.0 - t * t
    softcap_score_mod.__name__ = f"softcap({c:g})"
    softcap_score_mod.score_mod_grad = softcap_derivative
    return softcap_score_mod


def relative_bias(table, offset: int | None = None):
    """score_mod factory: a learned relative-position bias, ``score + table[kv_idx − q_idx + offset]`` (T5-style).

    ``offset`` is the table entry of distance 0; by default the table's middle, ``(len(table) − 1) // 2``, so a
    table of 2R + 1 entries holds distances −R … R. Distances beyond the table saturate: they get the bias of its
    nearest end (T5 buckets far distances together), so any Q_LEN and KV_LEN are allowed. The clipping is written
    with arithmetic, not ``min``/``max``, so it works alike on integers and index arrays. Derivative with respect
    to score: 1.

    Parameters
    ----------
    table : array_like of float, shape (T,)
        Bias of each relative distance.
    offset : int, optional
        Index of distance 0 in ``table``, in [0, T). Default None: ``(T − 1) // 2``.

    Returns
    -------
    callable
        ``score_mod(score, b, h, q_idx, kv_idx)``, with ``score_mod_grad``.
    """
    table = _real_vector(table, "table")
    last = len(table) - 1
    offset = last // 2 if offset is None else _positive_int(offset, "offset", minimum=0)
    if offset > last:
        raise ValueError(f"offset must index table (0 … {last}), got {offset}")

    def relative_bias_score_mod(score, b, h, q_idx, kv_idx, table):
        entry = kv_idx - q_idx + offset
        entry = entry - (entry - last) * (entry > last)      # saturate above: min(entry, last)
        entry = entry * (entry > 0)                           # and below: max(entry, 0)
        return score + table[entry]
    mod = bind(relative_bias_score_mod, table)
    mod.score_mod_grad = bind(_unit_derivative, table)
    mod.__name__ = f"relative_bias({len(table)} entries, offset {offset})"
    return mod


# -- the block mask --------------------------------------------------------------------------------------------------

def _block_size(BLOCK_SIZE) -> tuple[int, int]:
    if isinstance(BLOCK_SIZE, (tuple, list)):
        if len(BLOCK_SIZE) != 2:
            raise TypeError(f"BLOCK_SIZE must be an int or a pair (B_r, B_c), got {BLOCK_SIZE!r}")
        return (_positive_int(BLOCK_SIZE[0], "BLOCK_SIZE B_r"), _positive_int(BLOCK_SIZE[1], "BLOCK_SIZE B_c"))
    size = _positive_int(BLOCK_SIZE, "BLOCK_SIZE")
    return size, size


class BlockMask:
    """Which (query block, key block) pairs of S a mask leaves skipped, partial or full, per (batch, head).

    Made by :func:`create_block_mask`. The score matrix of each (b, h) is cut into T_r = ceil(Q_LEN/B_r) row blocks
    and T_c = ceil(KV_LEN/B_c) column blocks (the last of each ragged); block (i, j) is **skipped** when mask_mod
    keeps none of its scores (FA1 Alg. 5's zero block: never loaded), **partial** when it keeps some (the mask is
    evaluated per element), **full** when it keeps all (no mask at all). These are :class:`fa2edu.masks.BlockKind`'s
    SKIP, MASK and PLAIN; :meth:`kind` answers in those terms.

    A batch or head axis of size 1 broadcasts: the mask_mod was evaluated at b = 0 (or h = 0) and its answer holds
    for every batch entry (head). Cost of the classification: one mask_mod evaluation per element of S,
    O(B·H·Q_LEN·KV_LEN), as in PyTorch; memory O(B·H·T_r·T_c).

    Parameters
    ----------
    mask_mod : callable or None
        The mask, ``mask_mod(b, h, q_idx, kv_idx) -> bool``, already specialised to the lengths
        (:func:`at_lengths`); None: keep every score.
    B : int
        Batch entries the classes cover (1: broadcast over the batch).
    H : int
        Query heads the classes cover (1: broadcast over heads).
    Q_LEN : int
        Number of queries.
    KV_LEN : int
        Number of keys.
    BLOCK_SIZE : tuple of int
        ``(B_r, B_c)``: rows of a query block, rows of a key block.
    classes : ndarray of int8, shape (B, H, T_r, T_c)
        :data:`SKIPPED`, :data:`PARTIAL` or :data:`FULL` per block.

    Attributes
    ----------
    shape : tuple of int
        ``(B, H, Q_LEN, KV_LEN)``.
    """

    def __init__(self, mask_mod, B: int, H: int, Q_LEN: int, KV_LEN: int, BLOCK_SIZE, classes) -> None:
        if mask_mod is not None:
            _check_callable(mask_mod, "mask_mod", "mask_mod(b, h, q_idx, kv_idx) -> bool")
        self.mask_mod = mask_mod
        self.B, self.H = _positive_int(B, "B"), _positive_int(H, "H")
        self.Q_LEN, self.KV_LEN = _positive_int(Q_LEN, "Q_LEN"), _positive_int(KV_LEN, "KV_LEN")
        self.BLOCK_SIZE = _block_size(BLOCK_SIZE)
        expected = (self.B, self.H, num_blocks(self.Q_LEN, self.BLOCK_SIZE[0]),
                    num_blocks(self.KV_LEN, self.BLOCK_SIZE[1]))
        classes = np.asarray(classes)
        if classes.shape != expected or not np.isin(classes, (SKIPPED, PARTIAL, FULL)).all():
            raise ValueError(f"classes must be an array of shape (B, H, T_r, T_c) = {expected} holding SKIPPED, "
                             f"PARTIAL or FULL ({SKIPPED}, {PARTIAL}, {FULL}); got shape {classes.shape}")
        if mask_mod is None and (classes != FULL).any():
            raise ValueError("a BlockMask without mask_mod keeps every score: its classes must all be FULL")
        self.classes = classes.astype(np.int8)

    # -- shape ----------------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Q_LEN, KV_LEN)``, as PyTorch's BlockMask.shape."""
        return self.B, self.H, self.Q_LEN, self.KV_LEN

    @property
    def T_r(self) -> int:
        """Number of query blocks, ceil(Q_LEN / B_r)."""
        return self.classes.shape[2]

    @property
    def T_c(self) -> int:
        """Number of key blocks, ceil(KV_LEN / B_c)."""
        return self.classes.shape[3]

    def row_tiles(self) -> list[slice]:
        """The T_r query ranges of the blocks (the last ragged)."""
        return tiles(self.Q_LEN, self.BLOCK_SIZE[0])

    def col_tiles(self) -> list[slice]:
        """The T_c key ranges of the blocks (the last ragged)."""
        return tiles(self.KV_LEN, self.BLOCK_SIZE[1])

    # -- the classes ------------------------------------------------------------------------------------------------
    @property
    def skipped(self) -> np.ndarray:
        """(B, H, T_r, T_c) bool: blocks no score of which is kept."""
        return self.classes == SKIPPED

    @property
    def partial(self) -> np.ndarray:
        """(B, H, T_r, T_c) bool: blocks that need the mask per element."""
        return self.classes == PARTIAL

    @property
    def full(self) -> np.ndarray:
        """(B, H, T_r, T_c) bool: blocks whose scores are all kept."""
        return self.classes == FULL

    def kind(self, b: int, h: int, i: int, j: int) -> BlockKind:
        """Block (i, j) of (b, h) as a :class:`fa2edu.masks.BlockKind` (a size-1 axis broadcasts)."""
        return KINDS[int(self.classes[0 if self.B == 1 else b, 0 if self.H == 1 else h, i, j])]

    def counts(self) -> dict[str, int]:
        """Blocks of each class over all (b, h): ``{"skipped", "partial", "full", "total"}``."""
        return {"skipped": int(self.skipped.sum()), "partial": int(self.partial.sum()),
                "full": int(self.full.sum()), "total": int(self.classes.size)}

    def density(self) -> float:
        """Fraction of blocks visited (partial or full): FA1 Proposition 4's s."""
        return float((self.classes != SKIPPED).mean())

    def sparsity(self) -> float:
        """Percentage of blocks skipped (never computed), as PyTorch's ``BlockMask.sparsity()``."""
        return 100.0 * float(self.skipped.mean())

    # -- display ----------------------------------------------------------------------------------------------------
    def grid(self, b: int = 0, h: int = 0) -> str:
        """The (T_r × T_c) classes of (b, h) as text: ``█`` full, ``░`` partial, ``·`` skipped."""
        symbol = {SKIPPED: "·", PARTIAL: "░", FULL: "█"}
        block = self.classes[0 if self.B == 1 else b, 0 if self.H == 1 else h]
        return "\n".join("".join(symbol[int(c)] for c in row) for row in block)

    def __repr__(self) -> str:
        c = self.counts()
        name = "None" if self.mask_mod is None else _name(self.mask_mod)
        text = (f"BlockMask(mask_mod={name}, shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"blocks: {c['skipped']} skipped, {c['partial']} partial, {c['full']} full of {c['total']}, "
                f"sparsity={self.sparsity():.2f}%)")
        if self.T_r <= 32 and self.T_c <= 64:
            text += "\n(b, h) = (0, 0), █ full, ░ partial, · skipped:\n" + self.grid()
        return text


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128) -> BlockMask:
    """Classify every (query block, key block) pair of S as skipped, partial or full under ``mask_mod``.

    The mask is evaluated once per element (vectorised where the mod allows, one query block at a time): a block
    with no kept score is skipped, with every score kept full, otherwise partial — FA2 Section 3.1's classification
    (:func:`fa2edu.masks.classify_block`) for any mask. Blocks are B_r × B_c; Q_LEN and KV_LEN need not be
    multiples (the ragged last blocks are classified on their real rows only: a mod never sees an index past
    Q_LEN − 1 or KV_LEN − 1). Cost: B·H·Q_LEN·KV_LEN mask evaluations.

    Parameters
    ----------
    mask_mod : callable or None
        ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = keep the score; first specialised to the lengths by
        :func:`at_lengths` (the ready causal mods align bottom-right). None: every block full.
    B : int or None
        Batch size; None broadcasts over the batch (the mod is evaluated at b = 0 only).
    H : int or None
        Number of query heads; None broadcasts over heads (the mod is evaluated at h = 0 only).
    Q_LEN : int
        Number of queries.
    KV_LEN : int
        Number of keys.
    BLOCK_SIZE : int or tuple of int, default 128
        Block size for both axes, or ``(B_r, B_c)``: query rows and key rows per block. Default 128, as PyTorch.

    Returns
    -------
    BlockMask
        The classes, shape (B or 1, H or 1, T_r, T_c).
    """
    if mask_mod is not None:
        _check_callable(mask_mod, "mask_mod", "mask_mod(b, h, q_idx, kv_idx) -> bool")
    B = 1 if B is None else _positive_int(B, "B")
    H = 1 if H is None else _positive_int(H, "H")
    Q_LEN, KV_LEN = _positive_int(Q_LEN, "Q_LEN"), _positive_int(KV_LEN, "KV_LEN")
    B_r, B_c = _block_size(BLOCK_SIZE)
    T_r, T_c = num_blocks(Q_LEN, B_r), num_blocks(KV_LEN, B_c)
    classes = np.full((B, H, T_r, T_c), FULL, dtype=np.int8)
    if mask_mod is None:
        return BlockMask(None, B, H, Q_LEN, KV_LEN, (B_r, B_c), classes)
    mod = at_lengths(mask_mod, Q_LEN, KV_LEN)
    for i, rows in enumerate(tiles(Q_LEN, B_r)):
        r = rows.stop - rows.start
        # Key blocks per evaluation: as many as keep one call's mask under _CHUNK_ELEMENTS elements.
        step = B_c * max(1, _CHUNK_ELEMENTS // (B * H * r * B_c))
        for start in range(0, KV_LEN, step):
            keep = _mask_tile(mod, B, H, rows, slice(start, min(start + step, KV_LEN)))   # (B, H, r, ≤ step)
            # Any / all over a block's rows, then over its columns (reduceat: one segment per key block).
            starts = np.arange(0, keep.shape[-1], B_c)
            kept_any = np.logical_or.reduceat(keep.any(axis=-2), starts, axis=-1)      # (B, H, blocks)
            kept_all = np.logical_and.reduceat(keep.all(axis=-2), starts, axis=-1)
            j = start // B_c
            classes[:, :, i, j:j + len(starts)] = np.where(kept_all, FULL, np.where(kept_any, PARTIAL, SKIPPED))
    return BlockMask(mod, B, H, Q_LEN, KV_LEN, (B_r, B_c), classes)


# -- the algorithms ----------------------------------------------------------------------------------------------

class _Programs:
    """The checked problem, seen by block: the BlockMask's (B, H) classes and mods in the algorithms' layout.

    fa2edu's algorithms run every program (batch entry, query head) at once in the layout (Z, H_kv, G, …) of
    :mod:`fa2edu.validation`, query head h = (h // G, h % G). A tile is loaded when *some* program visits it; the
    ledger's ``share`` is the fraction that do, and the programs that skip it see only −inf there.
    """

    def __init__(self, problem, block_mask: BlockMask, score_mod) -> None:
        self.problem, self.block_mask = problem, block_mask
        Z, H_kv, G = problem.lead
        self.shape = (Z, H_kv * G)                                             # the caller's (B, H_q)
        T_r, T_c = block_mask.T_r, block_mask.T_c
        self.classes = np.broadcast_to(block_mask.classes, self.shape + (T_r, T_c)).reshape(
            Z, H_kv, G, T_r, T_c)
        self.score_mod = None if score_mod is None else at_lengths(score_mod, problem.N_q, problem.N_k)
        # score_mod's b and h for each program: batch entry z, query head kv_head·G + g.
        self.b = np.arange(Z)[:, None, None, None, None]
        self.h = (np.arange(H_kv)[:, None] * G + np.arange(G)[None, :])[None, :, :, None, None]

    def kinds(self, i: int, j: int) -> np.ndarray:
        """(Z, H_kv, G) classes of block (i, j)."""
        return self.classes[..., i, j]

    def visible(self, kinds: np.ndarray, rows: slice, cols: slice) -> np.ndarray | None:
        """The (Z, H_kv, G, r, c) keep-tile of block (rows, cols), or None when every program sees it in full.

        True throughout for programs whose block is full; mask_mod's answer, evaluated per element, where it is
        partial (the only place a mask_mod runs); False where it is skipped.
        """
        if (kinds == FULL).all():
            return None
        Z, H_kv, G = kinds.shape
        keep = np.broadcast_to((kinds == FULL)[..., None, None], kinds.shape + (rows.stop - rows.start,
                                                                                cols.stop - cols.start))
        partial = kinds == PARTIAL
        if partial.any():
            bm = self.block_mask
            mask = _mask_tile(bm.mask_mod, bm.B, bm.H, rows, cols)                      # (B | 1, H | 1, r, c)
            mask = np.broadcast_to(mask, self.shape + mask.shape[2:]).reshape(Z, H_kv, G, *mask.shape[2:])
            keep = keep | (partial[..., None, None] & mask)
        return keep

    def _mod_args(self, S: np.ndarray, rows: slice, cols: slice) -> list[np.ndarray]:
        q_idx = np.arange(rows.start, rows.stop)[None, None, None, :, None]
        kv_idx = np.arange(cols.start, cols.stop)[None, None, None, None, :]
        return [S, self.b, self.h, q_idx, kv_idx]

    def modified(self, S: np.ndarray, rows: slice, cols: slice, visible: np.ndarray | None) -> np.ndarray:
        """score_mod applied elementwise to the scaled scores S = τQ_iK_jᵀ of a tile; its answer must be a number
        that is not NaN and not +inf wherever the score is kept (−inf is a mask)."""
        out = _evaluate(self.score_mod, f"score_mod {_name(self.score_mod)}", self._mod_args(S, rows, cols),
                        S.shape, "score", S.dtype)
        kept = out if visible is None else out[visible]
        if np.isnan(kept).any() or np.isposinf(kept).any():
            raise ValueError(f"score_mod {_name(self.score_mod)} returned NaN or +inf for a kept score (queries "
                             f"{rows.start}…{rows.stop - 1}, keys {cols.start}…{cols.stop - 1}): a score_mod must "
                             f"return a finite score, or −inf to mask it")
        return out

    def derivative(self, grad, S: np.ndarray, rows: slice, cols: slice, visible: np.ndarray | None) -> np.ndarray:
        """score_mod_grad, d score_mod / d score, at the scaled scores S of a tile (finite where kept)."""
        out = _evaluate(grad, f"score_mod_grad {_name(grad)}", self._mod_args(S, rows, cols), S.shape, "score",
                        S.dtype)
        kept = out if visible is None else out[visible]
        if not np.isfinite(kept).all():
            raise ValueError(f"score_mod_grad {_name(grad)} returned a non-finite derivative for a kept score "
                             f"(queries {rows.start}…{rows.stop - 1}, keys {cols.start}…{cols.stop - 1})")
        return out


def _check_inputs(q, k, v, scale, enable_gqa):
    """q (B, H_q, N_q, d), k (B, H_kv, N_k, d), v (B, H_kv, N_k, d_v), checked with their own names; GQA only on
    request. Returns the :class:`~fa2edu.validation.AttentionProblem` (dtypes, finiteness, score range)."""
    q, k, v = _check_array(q, "q"), _check_array(k, "k"), _check_array(v, "v")
    for name, x, axes in (("q", q, "(B, H, N_q, d)"), ("k", k, "(B, H_kv, N_k, d)"), ("v", v, "(B, H_kv, N_k, d_v)")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 axes {axes}, as torch's flex_attention, got shape {x.shape}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"q, k, v must have the same batch size B, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same heads and keys (B, H_kv, N_k), got {k.shape} and {v.shape}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"k's head dimension must equal q's: q has d = {q.shape[3]}, k has {k.shape[3]}")
    H_q, H_kv = q.shape[1], k.shape[1]
    if H_q != H_kv and not enable_gqa:
        raise ValueError(f"q has H = {H_q} heads but k and v have {H_kv}: pass enable_gqa=True for grouped-query "
                         f"attention (query head h reads key/value head h // (H_q / H_kv)), or give k and v "
                         f"q's heads")
    if H_q % H_kv:
        raise ValueError(f"with enable_gqa, q's heads H_q = {H_q} must be a multiple of k's and v's H_kv = {H_kv}")
    return prepare(q, k, v, scale=scale)


def _check_block_mask(block_mask, problem) -> BlockMask:
    """The BlockMask to run, matching q and k; None means every block full at PyTorch's BLOCK_SIZE = 128."""
    N_q, N_k = problem.N_q, problem.N_k
    if block_mask is None:
        return create_block_mask(None, None, None, N_q, N_k)
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a fa2edu.flex.BlockMask (from create_block_mask) or None, got "
                        f"{type(block_mask).__name__}")
    B, H_q = problem.q_shape[0], problem.q_shape[1]
    if (block_mask.Q_LEN, block_mask.KV_LEN) != (N_q, N_k):
        raise ValueError(f"block_mask was made for Q_LEN = {block_mask.Q_LEN}, KV_LEN = {block_mask.KV_LEN}, but q "
                         f"has N_q = {N_q} queries and k has N_k = {N_k} keys: make it with "
                         f"create_block_mask(mask_mod, B, H, {N_q}, {N_k})")
    if block_mask.B not in (1, B) or block_mask.H not in (1, H_q):
        raise ValueError(f"block_mask covers (B, H) = ({block_mask.B}, {block_mask.H}); q has (B, H) = ({B}, {H_q}):"
                         f" each must match or be 1 (None in create_block_mask: broadcast)")
    return block_mask


def _check_score_mod(score_mod):
    if score_mod is not None:
        _check_callable(score_mod, "score_mod", "score_mod(score, b, h, q_idx, kv_idx) -> score")
    return score_mod


@guard_overflow
def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                   hbm: HBM | None = None):
    """FlexAttention forward: FA2 Algorithm 1 over a BlockMask's classification, with a score_mod.

    O = softmax(MASK(score_mod(τ·qkᵀ)))·v, where MASK sets the scores mask_mod drops to −inf. The loops are FA2
    Alg. 1's with (B_r, B_c) = ``block_mask.BLOCK_SIZE``: a skipped block (for every program) is never loaded, a
    partial block evaluates the mask per element, a full block skips the mask (FA1 Alg. 5 line 8, FA2 Section 3.1).

    Cost per (batch, head): 4·d·(visited blocks' area) matmul FLOPs (2·(d + d_v)·… with d_v ≠ d), one score_mod
    evaluation per visited score, one mask_mod evaluation per score of a partial block; HBM reads N_q·d +
    (d + d_v)·CV with CV = Σ over visited blocks of their key rows, writes N_q·(d_v + 1)
    (:func:`fa2edu.io.flex_visit_form`). Arrays bound into a mod are not counted.

    Parameters
    ----------
    q : ndarray, shape (B, H_q, N_q, d)
        Queries, float16, float32 or float64 (float16 and float32 compute in float32), finite.
    k : ndarray, shape (B, H_kv, N_k, d)
        Keys in q's dtype; H_kv = H_q unless ``enable_gqa``.
    v : ndarray, shape (B, H_kv, N_k, d_v)
        Values in q's dtype; d_v may differ from d.
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied elementwise to the scaled score τ·q·k (h is the
        query head); it may return −inf to drop a score. Default None: the scores unchanged.
    block_mask : BlockMask, optional
        From ``create_block_mask(mask_mod, B, H, N_q, N_k, BLOCK_SIZE)``, its B and H equal to q's or 1. Default
        None: no mask, every block full, BLOCK_SIZE 128.
    scale : float, optional
        The softmax scale τ. Default None: 1/√d.
    enable_gqa : bool, default False
        Allow H_q ≠ H_kv (a multiple): query head h reads key/value head h // (H_q / H_kv), never a copy.
    return_lse : bool, default False
        Also return L, the log-sum-exp of each row (natural log; +inf on a fully masked row).
    hbm : HBM, optional
        Ledger that records this run's reads and writes per algorithm line, per (batch, head); afterwards also
        ``hbm.sram``, ``hbm.flops``, ``hbm.block_sizes``. Default None: a fresh ledger, discarded.

    Returns
    -------
    ndarray or Flash2Forward
        O (B, H_q, N_q, d_v) in q's dtype (0 on a fully masked row); with ``return_lse``, the pair ``(O, L)``,
        L (B, H_q, N_q) in the compute dtype.
    """
    problem = _check_inputs(q, k, v, scale, enable_gqa)
    score_mod = _check_score_mod(score_mod)
    block_mask = _check_block_mask(block_mask, problem)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    programs = _Programs(problem, block_mask, score_mod)
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    # Alg. 1 line 1: the tiles are the BlockMask's blocks, (B_r, B_c) = BLOCK_SIZE.
    run = start_run("flex_attention", N_q, N_k, d, M=None, block_sizes=block_mask.BLOCK_SIZE, rule=None,
                    working_set=lambda br, bc: flash2_forward_working_set(br, bc, d, d_v), hbm=hbm, flops=None)
    mem, sram, count = run.hbm, run.sram, run.flops
    lead = problem.lead                                        # (Z, H_kv, G)
    mem.put("Q", problem.Q)
    mem.put("K", problem.K)
    mem.put("V", problem.V)
    # Alg. 1 line 2: O and L are outputs in HBM, each row block written exactly once.
    mem.put("O", np.zeros(lead + (N_q, d_v), dtype=problem.dtype))
    mem.put("L", np.zeros(lead + (N_q,), dtype=problem.dtype), vector=True)

    # Alg. 1 line 3: the outer loop runs over the T_r query blocks.
    for i, rows in enumerate(run.row_tiles):
        r = rows.stop - rows.start
        # Alg. 1 line 4: load Q_i from HBM to on-chip SRAM.
        Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 1 line 4"))              # (…, B_r, d)
        # Alg. 1 line 5: on chip, Õ_i = 0, ℓ_i = 0, m_i = −inf.
        O_i = sram.hold("O_i", np.zeros(lead + (r, d_v), dtype=problem.dtype))        # (…, B_r, d_v)
        l_i = sram.hold("l_i", np.zeros(lead + (r,), dtype=problem.dtype), vector=True)
        m_i = sram.hold("m_i", np.full(lead + (r,), -np.inf, dtype=problem.dtype), vector=True)

        # Alg. 1 line 6: the inner loop streams the T_c key blocks through SRAM.
        for j, cols in enumerate(run.col_tiles):
            c = cols.stop - cols.start
            kinds = programs.kinds(i, j)                                                # (Z, H_kv, G)
            share = float(np.mean(kinds != SKIPPED))
            # FA1 Alg. 5 line 8: a block the BlockMask skips (for every program) is never loaded: no read, no FLOP.
            if share == 0.0:
                continue
            # Alg. 1 line 7: load K_j, V_j from HBM to on-chip SRAM (counted for the programs that visit it).
            K_j = sram.hold("K_j", mem.read("K", cols, line="Alg 1 line 7", share=share))    # (…, B_c, d)
            V_j = sram.hold("V_j", mem.read("V", cols, line="Alg 1 line 7", share=share))    # (…, B_c, d_v)
            # Alg. 1 line 8: S_i^(j) = τ Q_i K_jᵀ.
            S_ij = sram.hold("S_ij", tau * (Q_i @ np.swapaxes(K_j, -1, -2)))            # (…, B_r, B_c)
            count.add_matmul(r, c, d, line="Alg 1 line 8", share=share)
            count.add_nonmatmul(r * c, line="Alg 1 line 8", share=share)
            visible = programs.visible(kinds, rows, cols)        # None for a full block: no mask evaluated at all
            if score_mod is not None:
                # Alg. 1 line 8, FlexAttention: S ← score_mod(S, b, h, q_idx, kv_idx), elementwise.
                S_ij = programs.modified(S_ij, rows, cols, visible)
                count.add_nonmatmul(r * c, line="Alg 1 line 8 (score_mod)", share=share)
            if visible is not None:
                # Alg. 1 line 8, FlexAttention: MASK(S); mask_mod ran per element only for partial blocks.
                S_ij = np.where(visible, S_ij, -np.inf)
                count.add_nonmatmul(r * c, line="Alg 1 line 8 (mask_mod)", share=float(np.mean(kinds == PARTIAL)))
            # Alg. 1 line 9: m_i^(j) = max(m_i^(j−1), rowmax(S_i^(j))).
            m_new = sram.hold("m_new", np.maximum(m_i, S_ij.max(axis=-1)), vector=True)
            # Alg. 1 line 9: P̃_i^(j) = exp(S_i^(j) − m_i^(j)), guarded where a row has seen no key yet (m = −inf).
            P_ij = exp_minus(S_ij, m_new)
            # Alg. 1 line 9: ℓ_i^(j) = e^{m_i^(j−1) − m_i^(j)} ℓ_i^(j−1) + rowsum(P̃_i^(j)).
            alpha = exp_minus(m_i[..., None], m_new)[..., 0]          # e^{m_old − m_new}, 0 while m_old = −inf
            l_i = alpha * l_i + P_ij.sum(axis=-1)
            count.add_nonmatmul(r * c * 4 + r * 5, line="Alg 1 line 9", share=share)
            # Alg. 1 line 10: Õ_i^(j) = diag(e^{m_old − m_new}) Õ_i^(j−1) + P̃_i^(j) V_j (no inverse: erratum 4).
            O_i = alpha[..., None] * O_i + P_ij @ V_j
            count.add_matmul(r, d_v, c, line="Alg 1 line 10", share=share)
            count.add_nonmatmul(2 * r * d_v, line="Alg 1 line 10", share=share)
            m_i = sram.hold("m_i", m_new, vector=True)
            sram.free("m_new", "S_ij")

        # Alg. 1 line 12: O_i = diag(ℓ_i^(T_c))^{-1} Õ_i^(T_c); guard ℓ = 0 (a row that kept no score): O_i = 0.
        l_safe = np.where(l_i == 0.0, 1.0, l_i)
        O_i = O_i / l_safe[..., None]
        # Alg. 1 line 13: L_i = m_i + log ℓ_i; +inf for a fully masked row so that exp(S − L) = 0 in the backward.
        with np.errstate(divide="ignore"):
            L_i = np.where(l_i == 0.0, np.inf, m_i + np.log(l_safe))
        count.add_nonmatmul(r * d_v + 2 * r, line="Alg 1 lines 12-13")
        # Alg. 1 lines 14-15: write O_i and L_i to HBM, once per query block.
        mem.write("O", rows, O_i, line="Alg 1 line 14")
        mem.write("L", rows, L_i, line="Alg 1 line 15")
        sram.free("Q_i", "O_i", "l_i", "m_i", "K_j", "V_j")

    # Alg. 1 line 17: return O (in q's dtype) and L.
    O = cast_output(problem.from_q_layout(mem["O"]), problem.in_dtype, "O")
    if return_lse:
        return Flash2Forward(O, problem.from_q_layout(mem["L"]))
    return O


def _score_mod_derivative(score_mod, score_mod_grad):
    """The derivative d score_mod / d score: ``score_mod_grad``, else the one a ready mod carries, else an error."""
    if score_mod is None:
        if score_mod_grad is not None:
            raise ValueError("score_mod_grad was given without a score_mod")
        return None
    if score_mod_grad is None:
        score_mod_grad = getattr(score_mod, "score_mod_grad", None)
    if score_mod_grad is None:
        raise ValueError(f"the backward pass needs d score_mod / d score: score_mod {_name(score_mod)} carries no "
                         f"score_mod_grad attribute; pass score_mod_grad=, a function of the same signature "
                         f"(score, b, h, q_idx, kv_idx) returning the derivative with respect to score")
    return _check_callable(score_mod_grad, "score_mod_grad", "score_mod_grad(score, b, h, q_idx, kv_idx) -> float")


@guard_overflow
def flex_attention_backward(q, k, v, O, L, dO, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                            score_mod_grad=None, hbm: HBM | None = None) -> Flash2Backward:
    """FlexAttention backward: FA2 Algorithm 2 over a BlockMask's classification, through a score_mod.

    With S = τQKᵀ, S' = MASK(score_mod(S)), P = exp(S' − L): dV = Pᵀ dO, dP = dO Vᵀ, dS' = P ∘ (dP − D) with
    D = rowsum(dO ∘ O), and the chain rule through the mod, dS = dS' ∘ score_mod_grad(S); then dQ = τ dS K,
    dK = τ dSᵀ Q. Blocks the BlockMask skips are never loaded; partial blocks re-evaluate the mask per element.

    Cost per (batch, head): 8·d·(visited area) matmul FLOPs with d_v = d (2.5× the forward's 4·d·…, FA2 §4.1);
    HBM reads 2N_q·d_v + N_k·(d + d_v) + (2d + d_v + 2)·RV, writes N_q + N_k·(d + d_v) + d·RV, RV = Σ over visited
    blocks of their query rows (:func:`fa2edu.io.flex_visit_form`), plus N_q·d initialisation writes of dQ.

    Parameters
    ----------
    q : ndarray, shape (B, H_q, N_q, d)
        Queries, as given to :func:`flex_attention`.
    k : ndarray, shape (B, H_kv, N_k, d)
        Keys in q's dtype.
    v : ndarray, shape (B, H_kv, N_k, d_v)
        Values in q's dtype.
    O : ndarray, shape (B, H_q, N_q, d_v)
        The forward pass's output, in q's dtype.
    L : ndarray, shape (B, H_q, N_q)
        The forward pass's log-sum-exp (``return_lse=True``): finite, or +inf on a fully masked row.
    dO : ndarray, shape (B, H_q, N_q, d_v)
        Gradient of the loss with respect to O, in q's dtype, finite.
    score_mod : callable, optional
        The forward pass's ``score_mod(score, b, h, q_idx, kv_idx)``. Default None: none.
    block_mask : BlockMask, optional
        The forward pass's block mask. Default None: no mask, every block full, BLOCK_SIZE 128.
    scale : float, optional
        The softmax scale τ. Default None: 1/√d.
    enable_gqa : bool, default False
        Allow H_q ≠ H_kv; dK and dV are summed over the query heads of each group.
    score_mod_grad : callable, optional
        ``score_mod_grad(score, b, h, q_idx, kv_idx) -> d score_mod / d score`` at the scaled score. Default None:
        ``score_mod.score_mod_grad`` (every ready score_mod carries one); a score_mod without one is an error.
    hbm : HBM, optional
        Ledger that records this run's reads and writes per algorithm line, per (batch, head). Default None: a
        fresh ledger, discarded.

    Returns
    -------
    Flash2Backward
        ``(dQ, dK, dV)`` in q's dtype, shaped like q, k and v; dK, dV summed over each GQA group; fully masked rows
        give zero gradients, never NaN.
    """
    problem = _check_inputs(q, k, v, scale, enable_gqa)
    score_mod = _check_score_mod(score_mod)
    grad = _score_mod_derivative(score_mod, score_mod_grad)
    block_mask = _check_block_mask(block_mask, problem)
    O5, L5, dO5 = _check_saved(problem, O, L, dO)
    programs = _Programs(problem, block_mask, score_mod)
    grad = None if grad is None else at_lengths(grad, problem.N_q, problem.N_k)
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    # Alg. 2 line 1: the tiles are the BlockMask's blocks (the forward's, so S is recomputed bit for bit).
    run = start_run("flex_attention_backward", N_q, N_k, d, M=None, block_sizes=block_mask.BLOCK_SIZE, rule=None,
                    working_set=lambda br, bc: flash2_backward_working_set(br, bc, d, d_v), hbm=hbm, flops=None)
    mem, sram, count = run.hbm, run.sram, run.flops
    lead = problem.lead                                        # (Z, H_kv, G)
    for name, x in (("Q", problem.Q), ("K", problem.K), ("V", problem.V), ("O", O5), ("dO", dO5)):
        mem.put(name, x)
    mem.put("L", L5, vector=True)
    # Alg. 2 line 3: initialise dQ = 0 in HBM: every key block adds its share to it (line 15).
    mem.allocate("dQ", lead + (N_q, d), 0.0, problem.dtype, line="Alg 2 line 3")
    # Alg. 2 line 3: dK, dV per query head (GQA sums them at the end); each block is written once (line 18).
    mem.put("dK", np.zeros(lead + (N_k, d), dtype=problem.dtype))
    mem.put("dV", np.zeros(lead + (N_k, d_v), dtype=problem.dtype))
    # Alg. 2 line 4: D ∈ R^N (the paper prints R^d: erratum 5).
    mem.put("D", np.zeros(lead + (N_q,), dtype=problem.dtype), vector=True)

    # Alg. 2 line 4: D = rowsum(dO ∘ O), its own pass over the query blocks (a score_mod does not change it:
    # D_i = Σ_j P_ij dP_ij = rowsum(dO_i ∘ O_i) for any scores).
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        dO_i = sram.hold("dO_i", mem.read("dO", rows, line="Alg 2 line 4"))          # (…, B_r, d_v)
        O_i = sram.hold("O_i", mem.read("O", rows, line="Alg 2 line 4"))            # (…, B_r, d_v)
        D_i = sram.hold("D_i", (dO_i * O_i).sum(axis=-1), vector=True)             # (…, B_r)
        count.add_nonmatmul(2 * r * d_v, line="Alg 2 line 4")
        mem.write("D", rows, D_i, line="Alg 2 line 4")
        sram.free("dO_i", "O_i", "D_i")

    # Alg. 2 line 5: the outer loop runs over the T_c key blocks.
    for j, cols in enumerate(run.col_tiles):
        c = cols.stop - cols.start
        # Alg. 2 line 6: load K_j, V_j from HBM to on-chip SRAM.
        K_j = sram.hold("K_j", mem.read("K", cols, line="Alg 2 line 6"))                # (…, B_c, d)
        V_j = sram.hold("V_j", mem.read("V", cols, line="Alg 2 line 6"))                # (…, B_c, d_v)
        # Alg. 2 line 7: dK_j = 0, dV_j = 0 on chip.
        dK_j = sram.hold("dK_j", np.zeros(lead + (c, d), dtype=problem.dtype))          # (…, B_c, d)
        dV_j = sram.hold("dV_j", np.zeros(lead + (c, d_v), dtype=problem.dtype))        # (…, B_c, d_v)

        # Alg. 2 line 8: the inner loop streams the T_r query blocks of Q, dO, L, D (and dQ) through SRAM.
        for i, rows in enumerate(run.row_tiles):
            r = rows.stop - rows.start
            kinds = programs.kinds(i, j)
            share = float(np.mean(kinds != SKIPPED))
            # FA1 Alg. 5 line 8: a block the BlockMask skips (for every program) is never loaded.
            if share == 0.0:
                continue
            # Alg. 2 line 9: load Q_i, dO_i, L_i, D_i from HBM to on-chip SRAM.
            Q_i = sram.hold("Q_i", mem.read("Q", rows, line="Alg 2 line 9", share=share))       # (…, B_r, d)
            dO_i = sram.hold("dO_i", mem.read("dO", rows, line="Alg 2 line 9", share=share))    # (…, B_r, d_v)
            L_i = sram.hold("L_i", mem.read("L", rows, line="Alg 2 line 9", share=share), vector=True)
            D_i = sram.hold("D_i", mem.read("D", rows, line="Alg 2 line 9", share=share), vector=True)
            # Alg. 2 line 10: S_i^(j) = τ Q_i K_jᵀ, as the forward pass computed it.
            S_ij = sram.hold("S_ij", tau * (Q_i @ np.swapaxes(K_j, -1, -2)))                     # (…, B_r, B_c)
            count.add_matmul(r, c, d, line="Alg 2 line 10", share=share)
            count.add_nonmatmul(r * c, line="Alg 2 line 10", share=share)
            visible = programs.visible(kinds, rows, cols)
            S_mod = S_ij
            if score_mod is not None:
                # Alg. 2 line 10, FlexAttention: S' = score_mod(S), as in the forward pass.
                S_mod = programs.modified(S_ij, rows, cols, visible)
                count.add_nonmatmul(r * c, line="Alg 2 line 10 (score_mod)", share=share)
            if visible is not None:
                # Alg. 2 line 10, FlexAttention: MASK(S'), mask_mod per element of partial blocks only.
                S_mod = np.where(visible, S_mod, -np.inf)
                count.add_nonmatmul(r * c, line="Alg 2 line 10 (mask_mod)", share=float(np.mean(kinds == PARTIAL)))
            # Alg. 2 line 11: P_i^(j) = exp(S'_i^(j) − L_i); a fully masked row has L_i = +inf and gets P = 0.
            P_ij = np.exp(S_mod - L_i[..., None])                                                 # (…, B_r, B_c)
            sram.free("S_ij")
            sram.hold("P_ij", P_ij)
            count.add_nonmatmul(2 * r * c, line="Alg 2 line 11", share=share)
            # Alg. 2 line 12: dV_j ← dV_j + (P_i^(j))ᵀ dO_i.
            dV_j = sram.hold("dV_j", dV_j + np.swapaxes(P_ij, -1, -2) @ dO_i)
            count.add_matmul(c, d_v, r, line="Alg 2 line 12", share=share)
            count.add_nonmatmul(c * d_v, line="Alg 2 line 12", share=share)
            # Alg. 2 line 13: dP_i^(j) = dO_i V_jᵀ.
            dP_ij = sram.hold("dP_ij", dO_i @ np.swapaxes(V_j, -1, -2))                         # (…, B_r, B_c)
            count.add_matmul(r, c, d_v, line="Alg 2 line 13", share=share)
            # Alg. 2 line 14: dS'_i^(j) = P_i^(j) ∘ (dP_i^(j) − D_i), the gradient with respect to the modified score.
            dS_ij = P_ij * (dP_ij - D_i[..., None])                                               # (…, B_r, B_c)
            sram.free("dP_ij")
            count.add_nonmatmul(2 * r * c, line="Alg 2 line 14", share=share)
            if grad is not None:
                # Alg. 2 line 14, FlexAttention: the chain rule through score_mod, dS = dS' ∘ ∂score_mod/∂S at S.
                dS_ij = dS_ij * programs.derivative(grad, S_ij, rows, cols, visible)
                count.add_nonmatmul(2 * r * c, line="Alg 2 line 14 (score_mod_grad)", share=share)
            sram.hold("dS_ij", dS_ij)
            # Alg. 2 line 15: load dQ_i, add τ dS_i^(j) K_j on chip, write it back (atomic adds on a GPU).
            dQ_i = sram.hold("dQ_i", mem.read("dQ", rows, line="Alg 2 line 15", share=share))   # (…, B_r, d)
            dQ_i = dQ_i + tau * (dS_ij @ K_j)
            count.add_matmul(r, d, c, line="Alg 2 line 15", share=share)
            count.add_nonmatmul(2 * r * d, line="Alg 2 line 15", share=share)
            mem.write("dQ", rows, dQ_i, line="Alg 2 line 15", share=share)
            # Alg. 2 line 16: dK_j ← dK_j + τ dS_i^(j)ᵀ Q_i (the FA2 text's dK = Q dSᵀ is erratum 1).
            dK_j = sram.hold("dK_j", dK_j + tau * (np.swapaxes(dS_ij, -1, -2) @ Q_i))
            count.add_matmul(c, d, r, line="Alg 2 line 16", share=share)
            count.add_nonmatmul(2 * c * d, line="Alg 2 line 16", share=share)
            sram.free("Q_i", "dO_i", "L_i", "D_i", "dQ_i", "P_ij", "dS_ij")

        # Alg. 2 line 18: write dK_j, dV_j to HBM, once per key block.
        mem.write("dK", cols, dK_j, line="Alg 2 line 18")
        mem.write("dV", cols, dV_j, line="Alg 2 line 18")
        sram.free("K_j", "V_j", "dK_j", "dV_j")

    # GQA (FA2 Section 3.1): each query head of a group computed its own dK, dV: sum them.
    dQ = cast_output(problem.from_q_layout(mem["dQ"]), problem.in_dtype, "dQ")
    dK = cast_output(problem.from_kv_layout(mem["dK"]), problem.in_dtype, "dK")
    dV = cast_output(problem.from_kv_layout(mem["dV"]), problem.in_dtype, "dV")
    return Flash2Backward(dQ, dK, dV)
