"""Input checks shared by every algorithm (and by kernels_gpu): clear errors, nothing silently broadcast.

Every public algorithm calls :func:`prepare` first. It checks Q, K, V, the scale and the mask, and returns an
:class:`AttentionProblem` whose arrays have one fixed layout, so the algorithms can be written once for single
heads, batches and GQA alike:

* ``Q``: ``(Z, H_kv, G, N_q, d)`` where Z is the product of the batch axes and G = H_q // H_kv is the group size;
* ``K``: ``(Z, H_kv, 1, N_k, d)`` and ``V``: ``(Z, H_kv, 1, N_k, d_v)``.

Query head ``h`` lives at ``(h // G, h % G)``, so it reads K/V head ``h // G`` through NumPy broadcasting: the
head-index mapping of FA2 Section 3.1, with no copy of K or V. Gradients dK, dV come back summed over the G axis.

Arrays must be plain ``numpy.ndarray`` (a ``numpy.memmap`` is read as one). Subclasses that change what the numbers
mean are refused with a TypeError naming the argument: ``numpy.matrix`` (always 2-D, ``*`` is a matrix product) and
``numpy.ma.MaskedArray`` (its mask would be silently dropped; attention masks go in ``mask=``).

Range. Finite inputs can still be too large: the scores τ·QKᵀ of Q·1e307 overflow float64, and inf − inf then
gives NaN. :func:`check_score_range` refuses such Q, K before any work, with an :class:`AttentionOverflowError`
(a ValueError and an OverflowError) that names them; :func:`guard_overflow` turns any other overflow inside an
algorithm (huge V or dO, a float16 gradient beyond ±65504) into the same error instead of inf or NaN.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from numbers import Real

import numpy as np

from fa2edu.blocks import _check_block_sizes
from fa2edu.blocks import check_M as _check_M

__all__ = ["AttentionProblem", "AttentionOverflowError", "prepare", "check_like", "check_scale", "check_score_range",
           "score_range_error", "largest_abs_dot", "check_block_sizes", "check_M", "cast_output", "guard_overflow",
           "compute_dtype", "FLOAT_DTYPES"]

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float64 inputs compute in float64; float32 and float16 inputs compute (accumulate) in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


class AttentionOverflowError(ValueError, OverflowError):
    """Finite inputs whose attention arithmetic would leave the range of the dtype it runs in.

    A ValueError, like every other bad-input error, and an OverflowError, which is what it is.
    """


def _plain_array(x, name: str) -> np.ndarray:
    """``x`` as a plain ndarray; a ``numpy.memmap`` is read as one, other ndarray subclasses are refused."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a numpy.ma.MaskedArray: fa2edu would silently ignore its mask; pass "
                        f"{name}.filled(...) (its values), and give the entries attention must skip as mask= "
                        f"(True = attend)")
    if isinstance(x, np.matrix):
        raise TypeError(f"{name} is a numpy.matrix (always 2-D, with * as a matrix product); "
                        f"pass np.asarray({name})")
    if type(x) is not np.ndarray and not isinstance(x, np.memmap):
        raise TypeError(f"{name} must be a plain numpy.ndarray, got the subclass {type(x).__name__}; "
                        f"pass np.asarray({name}) if its entries are plain numbers")
    return np.asarray(x)


def _check_array(x, name: str, *, finite: bool = True) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__cuda_array_interface__"):
            raise TypeError(f"{name} is a GPU array; fa2edu's NumPy algorithms take NumPy arrays "
                            f"(use kernels_gpu for GPU arrays, or copy it to the host)")
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    x = _plain_array(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype (float16, float32 or float64), got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., N, d) with at least 2 axes, got shape {x.shape}")
    if 0 in x.shape:
        raise ValueError(f"{name} must not be empty, got shape {x.shape}")
    if finite and not np.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or infinite values; attention inputs must be finite")
    return x


def check_scale(scale, d: int) -> float:
    """The softmax scale τ: ``1/sqrt(d)`` by default (FA2 footnote 2 prints 1/d: erratum 7)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_like(x, name: str, shape: tuple[int, ...], dtype: np.dtype | None = None, *,
               finite: bool = True) -> np.ndarray:
    """Check that ``x`` is a float array of exactly ``shape`` (a saved statistic or a gradient)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    x = _plain_array(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if dtype is not None and x.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)} (the inputs' dtype), got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if finite and not np.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return x


def _largest_abs_dot(A: np.ndarray, B: np.ndarray) -> float:
    """``max_ij Σ_l |A_il|·|B_jl|`` over the pairs that meet (A (…, n_a, k) and B (…, n_b, k) broadcast), as a
    float64 that cannot overflow: each operand is first scaled by a power of two so that its entries are < 1 (exact),
    and the result is returned with those powers added back (possibly as inf). Row blocks keep memory bounded."""
    a_max, b_max = float(np.max(np.abs(A))), float(np.max(np.abs(B)))
    if a_max == 0.0 or b_max == 0.0:
        return 0.0
    a_exp, b_exp = math.frexp(a_max)[1], math.frexp(b_max)[1]
    A1 = np.ldexp(np.abs(A).astype(np.float64), -a_exp)            # entries in [0, 1)
    B1t = np.swapaxes(np.ldexp(np.abs(B).astype(np.float64), -b_exp), -1, -2)
    others = max(1, int(np.prod(np.broadcast_shapes(A.shape[:-2], B.shape[:-2]))) * B.shape[-2])
    step = max(1, (1 << 22) // others)
    largest = max(float((A1[..., start:start + step, :] @ B1t).max()) for start in range(0, A.shape[-2], step))
    if largest == 0.0:
        return 0.0
    try:
        return math.ldexp(largest, a_exp + b_exp)
    except OverflowError:                               # beyond float64 itself
        return math.inf


def largest_abs_dot(A: np.ndarray, B: np.ndarray) -> float:
    """``max_ij Σ_l |A_il|·|B_jl|`` over the pairs that meet, as a float64 that cannot overflow (inf when it is
    beyond float64 itself): the exact quantity :func:`check_score_range` bounds. Shapes as there."""
    return _largest_abs_dot(A, B)


def score_range_error(reach: float, scale: float, dtype, *, names=("Q", "K"), context: str = "",
                      float64_helps: bool = True) -> AttentionOverflowError:
    """The error :func:`check_score_range` raises, for scores that reach ``reach`` (``max(1, τ)·max Σ_l |q_l k_l|``)
    in ``dtype``; ``names`` are the caller's names for the two operands and ``context`` is appended to them
    (``" (sequence 3)"``). Returned, not raised, so that callers that compute ``reach`` their own way (across the
    ranks of a ring, say) report it in the same words."""
    dtype = np.dtype(dtype)
    limit = float(np.finfo(dtype).max) / 2
    first, second = names
    remedies = [f"rescale {first} or {second}"]
    if float64_helps and dtype != np.float64 and reach <= float(np.finfo(np.float64).max) / 2:
        remedies.append("pass float64 inputs")
    if abs(float(scale)) > 1.0:
        remedies.append("pass a smaller scale=")
    shown = f"{reach:.3g}" if math.isfinite(reach) else f"more than {float(np.finfo(np.float64).max):.3g}"
    return AttentionOverflowError(
        f"{first} and {second}{context} are too large for {dtype.name}: their scores reach {shown} (the largest "
        f"max(1, τ)·Σ_l |{first}_il·{second}_jl| over query/key pairs, τ = {float(scale):g}), beyond "
        f"{limit:.3g}, half the largest {dtype.name}, which S and S − max S need to stay finite. Softmax of such "
        f"scores is one-hot at any precision: {', or '.join(remedies)}")


def check_score_range(Q: np.ndarray, K: np.ndarray, scale: float, dtype, *, float64_helps: bool = True,
                      names=("Q", "K"), context: str = "") -> None:
    """Refuse finite Q, K whose scores S = τ·QKᵀ would overflow ``dtype``: an :class:`AttentionOverflowError`
    naming Q and K, instead of inf and then NaN (inf − inf) in the softmax.

    Every algorithm forms the products q·k in ``dtype``, scales them by τ, then subtracts a row maximum m. Every
    partial sum of q·k, in any order a matrix product may use, is at most ``Σ_l |q_l k_l|``; so the arithmetic stays
    finite when ``max(1, τ)·max Σ_l |q_l k_l| ≤ max(dtype)/2`` (the half keeps S − m finite). The test is cheap
    first, ``d·max|Q|·max|K|`` in O(N·d); only where that bound fails is the exact ``max Σ_l |q_l k_l|`` computed
    (one float64 product of ``|Q|`` and ``|K|ᵀ``, in row blocks). Scores of 1e4 or 1e6 are far inside both.

    Shapes: Q (…, N_q, d) and K (…, N_k, d), leading axes broadcasting; a pair is checked when they meet.
    ``float64_helps=False`` when the arithmetic stays in ``dtype`` whatever the inputs' dtype (the float32 GPU
    kernels): the error then does not suggest float64 inputs. ``names`` are the caller's names for Q and K (the
    decoding functions pass ``("q", "k_cache")``) and ``context`` follows them in the message.
    """
    dtype = np.dtype(dtype)
    limit = float(np.finfo(dtype).max) / 2
    grow = max(1.0, abs(float(scale)))                  # the products are formed before τ (τ < 1) and after (τ > 1)
    d = Q.shape[-1]
    if d * float(np.max(np.abs(Q))) * float(np.max(np.abs(K))) * grow <= limit:
        return
    reach = grow * _largest_abs_dot(Q, K)
    if reach <= limit:
        return
    raise score_range_error(reach, scale, dtype, names=names, context=context, float64_helps=float64_helps)


def check_block_sizes(block_sizes) -> tuple[int, int]:
    """``block_sizes`` as the pair ``(B_r, B_c)`` of ints ≥ 1 that every tiled algorithm takes (the rule of
    :func:`fa2edu.blocks.resolve_block_sizes`): a TypeError naming ``block_sizes`` for anything that is not a
    pair of integers (floats such as 2.5 and bools are refused, never truncated), a ValueError for sizes < 1."""
    return _check_block_sizes(block_sizes)


def check_M(M, d: int) -> int:
    """M, the SRAM size in elements, as every tiled algorithm checks it (:func:`fa2edu.blocks.check_M`): an int
    with ``M ≥ 4d``."""
    return _check_M(M, d)


def cast_output(x: np.ndarray, dtype, name: str) -> np.ndarray:
    """``x`` in ``dtype`` (the inputs' dtype, for a returned O or gradient); a finite value that does not fit
    (a float16 gradient beyond ±65504) raises an :class:`AttentionOverflowError` naming ``name``, not inf."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    with np.errstate(over="ignore"):                   # an overflow is reported below, naming the result
        out = x.astype(dtype)
    if np.any(np.isinf(out) & np.isfinite(x)):
        raise AttentionOverflowError(
            f"{name} reaches {float(np.max(np.abs(x[np.isfinite(x)]))):.3g}, beyond the largest {dtype.name} "
            f"({float(np.finfo(dtype).max):g}): it cannot be returned in the inputs' dtype; use float32 inputs "
            f"or smaller inputs")
    return out


_ARRAY_ARGUMENTS = ("Q", "K", "V", "O", "dO", "P")
_SAVED_ARGUMENTS = ("O", "L", "l", "m", "P")


def guard_overflow(function):
    """Run an algorithm with NumPy's overflow and invalid-operation flags raising, and report a hit as an
    :class:`AttentionOverflowError` naming the function, the dtype and its inputs' magnitudes.

    The inputs' own checks (finite values, :func:`check_score_range`) catch the common cases with a precise
    message before any work; this catches what no cheap check can foresee (a huge V or dO whose products overflow),
    so that no algorithm returns inf or NaN for finite inputs. It costs nothing when nothing overflows.
    """
    signature = inspect.signature(function)

    @functools.wraps(function)
    def guarded(*args, **kwargs):
        try:
            # Underflow is part of attention (exp of a very negative score is 0): never an error here.
            with np.errstate(over="raise", invalid="raise", under="ignore"):
                return function(*args, **kwargs)
        except FloatingPointError as error:
            bound = signature.bind_partial(*args, **kwargs).arguments
            sizes = ", ".join(f"max |{name}| = {float(np.max(np.abs(bound[name]))):.3g}" for name in _ARRAY_ARGUMENTS
                              if isinstance(bound.get(name), np.ndarray) and bound[name].size
                              and bound[name].dtype.kind == "f")
            dtypes = sorted({bound[name].dtype.name for name in _ARRAY_ARGUMENTS
                             if isinstance(bound.get(name), np.ndarray)})
            remedy = "rescale them" if dtypes == ["float64"] else "rescale them, or pass float64 inputs"
            stats = [name for name in _SAVED_ARGUMENTS if name in bound]
            if stats:
                remedy += f"; and check that {', '.join(stats)} come from the forward pass on these inputs"
            raise AttentionOverflowError(
                f"{function.__name__}: an intermediate result left the range of its dtype ({error}); the inputs "
                f"are too large in magnitude for {'/'.join(dtypes)} arithmetic ({sizes}): {remedy}") from error
    return guarded


@dataclass
class AttentionProblem:
    """Checked inputs in the algorithms' layout (see the module docstring)."""

    Q: np.ndarray            # (Z, H_kv, G, N_q, d), compute dtype
    K: np.ndarray            # (Z, H_kv, 1, N_k, d)
    V: np.ndarray            # (Z, H_kv, 1, N_k, d_v)
    mask: np.ndarray | None  # (Z, H_kv, G, N_q, N_k) bool, True = attend; None = no mask
    scale: float             # τ
    causal: bool
    q_shape: tuple[int, ...]   # the caller's Q shape
    kv_shape: tuple[int, ...]  # the caller's K shape
    v_shape: tuple[int, ...]   # the caller's V shape
    dtype: np.dtype            # compute dtype
    in_dtype: np.dtype         # the caller's dtype (O is returned in it)

    @property
    def N_q(self) -> int:
        return self.Q.shape[-2]

    @property
    def N_k(self) -> int:
        return self.K.shape[-2]

    @property
    def d(self) -> int:
        return self.Q.shape[-1]

    @property
    def d_v(self) -> int:
        return self.V.shape[-1]

    @property
    def group(self) -> int:
        return self.Q.shape[2]

    @property
    def lead(self) -> tuple[int, ...]:
        """Leading (batch, head) axes of the internal layout, (Z, H_kv, G)."""
        return self.Q.shape[:3]

    @property
    def programs(self) -> int:
        """Number of (batch, query-head) pairs: the papers' per-head counts are per program."""
        return int(np.prod(self.Q.shape[:3]))

    # -- layout conversions ----------------------------------------------------------------------------------
    def to_q_layout(self, x: np.ndarray) -> np.ndarray:
        """A caller-shaped per-query tensor (..., N_q, k) or (..., N_q) in the internal layout."""
        tail = x.shape[len(self.q_shape) - 2:]
        return x.reshape(self.Q.shape[:3] + tail)

    def from_q_layout(self, x: np.ndarray) -> np.ndarray:
        """Internal (Z, H_kv, G, N_q, ...) back to the caller's leading axes."""
        return x.reshape(self.q_shape[:-2] + x.shape[3:])

    def from_kv_layout(self, x: np.ndarray) -> np.ndarray:
        """Internal (Z, H_kv, G, N_k, ...) summed over the group G (dK, dV of GQA), in the caller's K/V layout."""
        summed = x.sum(axis=2) if x.shape[2] != 1 else x[:, :, 0]
        return summed.reshape(self.kv_shape[:-2] + x.shape[3:])


def _check_mask(mask, q_shape: tuple[int, ...], N_q: int, N_k: int) -> np.ndarray:
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"mask must be a numpy.ndarray of bool (True = attend), got {type(mask).__name__}")
    mask = _plain_array(mask, "mask")
    if mask.dtype != np.bool_:
        raise TypeError(f"mask must have dtype bool (True = attend, False = masked out), got {mask.dtype}")
    lead = q_shape[:-2]
    if mask.shape[-2:] != (N_q, N_k) or mask.ndim not in (2, len(q_shape)):
        raise ValueError(f"mask must have shape (N_q, N_k) = {(N_q, N_k)} or (*Q's leading axes, N_q, N_k) "
                         f"with each leading axis equal to Q's {lead} or 1; got {mask.shape}")
    if mask.ndim == len(q_shape):
        for axis, (m, q) in enumerate(zip(mask.shape[:-2], lead)):
            if m not in (1, q):
                raise ValueError(f"mask axis {axis} has size {m}; it must be 1 or Q's size {q} "
                                 f"(mask shape {mask.shape}, Q shape {q_shape})")
    return mask


def prepare(Q, K, V, *, causal: bool = False, scale=None, mask=None, allow_mask: bool = True,
            score_dtype=None) -> AttentionProblem:
    """Check Q, K, V (and scale, mask) and put them in the algorithms' layout.

    Shapes: Q (..., N_q, d), K (..., N_k, d), V (..., N_k, d_v). With three or more axes the axis before N is heads:
    Q has H_q heads, K and V have H_kv, and H_q must be a multiple of H_kv (GQA/MQA); other leading axes must match.
    The scores τ·QKᵀ must fit the dtype they are computed in (:func:`check_score_range`): ``score_dtype``, by
    default the compute dtype (the float64 oracle passes float64).
    """
    Q = _check_array(Q, "Q")
    K = _check_array(K, "K")
    V = _check_array(V, "V")
    if not (Q.dtype == K.dtype == V.dtype):
        raise TypeError(f"Q, K, V must share one dtype, got {Q.dtype}, {K.dtype}, {V.dtype}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not (Q.ndim == K.ndim == V.ndim):
        raise ValueError(f"Q, K, V must have the same number of axes, got shapes {Q.shape}, {K.shape}, {V.shape}")
    N_q, d = Q.shape[-2:]
    N_k = K.shape[-2]
    if K.shape[-1] != d:
        raise ValueError(f"K's head dimension must equal Q's: Q has d = {d}, K has {K.shape[-1]} (shape {K.shape})")
    if V.shape[-2] != N_k:
        raise ValueError(f"V must have as many rows as K: K has N_k = {N_k}, V has {V.shape[-2]}")
    if K.shape[:-2] != V.shape[:-2]:
        raise ValueError(f"K and V must have the same leading axes, got {K.shape[:-2]} and {V.shape[:-2]}")
    if Q.ndim >= 3:
        if Q.shape[:-3] != K.shape[:-3]:
            raise ValueError(f"Q and K must have the same batch axes, got {Q.shape[:-3]} and {K.shape[:-3]}")
        H_q, H_kv = Q.shape[-3], K.shape[-3]
        if H_q % H_kv != 0:
            raise ValueError(f"the number of query heads H_q = {H_q} must be a multiple of the number of "
                             f"key/value heads H_kv = {H_kv} (GQA/MQA)")
    else:
        H_q = H_kv = 1
    if mask is not None and not allow_mask:
        raise ValueError("this algorithm does not take a mask")
    if mask is not None:
        mask = _check_mask(mask, Q.shape, N_q, N_k)
    tau = check_scale(scale, d)
    work = compute_dtype(Q.dtype)
    Z = int(np.prod(Q.shape[:-3])) if Q.ndim >= 3 else 1
    G = H_q // H_kv
    Q5 = Q.astype(work, copy=False).reshape(Z, H_kv, G, N_q, d)
    K5 = K.astype(work, copy=False).reshape(Z, H_kv, 1, N_k, d)
    check_score_range(Q5, K5, tau, work if score_dtype is None else score_dtype,
                      float64_helps=score_dtype is None)
    V5 = V.astype(work, copy=False).reshape(Z, H_kv, 1, N_k, V.shape[-1])
    mask5 = None
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.reshape((1,) * (Q.ndim - 2) + mask.shape)
        mask5 = np.broadcast_to(mask, Q.shape[:-2] + (N_q, N_k)).reshape(Z, H_kv, G, N_q, N_k)
    return AttentionProblem(Q=Q5, K=K5, V=V5, mask=mask5, scale=tau, causal=bool(causal),
                            q_shape=tuple(Q.shape), kv_shape=tuple(K.shape), v_shape=tuple(V.shape),
                            dtype=work, in_dtype=Q.dtype)
