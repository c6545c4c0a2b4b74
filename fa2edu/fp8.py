"""FP8 attention in NumPy: exact float8 rounding, FA3's quantisation (per head, per block, incoherent), and FA2
Algorithm 1 on 1-byte inputs (FlashAttention-3, Shah et al. 2024, Section 3.3; taught in chapter 18).

Hopper's tensor cores multiply float8 matrices at twice the bf16 rate. FA3 feeds them Q, K, V in the e4m3 format
and keeps three things from costing accuracy:

1. **Scales.** Each (batch, head) of Q, K and V is divided by ``δ = amax / 448`` before it is rounded, so that its
   largest entry lands on the largest e4m3 number; the float32 *descale* δ travels with the 1-byte codes and is
   folded back in where it costs nothing: ``S = τ·δ_q·δ_k·(Q₈K₈ᵀ)`` (into the softmax scale) and ``O = δ_v·(…)``
   (into the output's final rescale). With ``block=B``, every B rows along the sequence share one scale instead
   ("block quantisation").
2. **Incoherent processing.** Outlier channels (a few head-dim features a hundred times larger than the rest, as in
   LLM activations) make the rounding error of q·k large, because that error is relative to each product
   q_l·k_l. FA3 multiplies Q and K by one random orthogonal matrix M first: ``(QM)(KM)ᵀ = QMMᵀKᵀ = QKᵀ`` in exact
   arithmetic, and M spreads each outlier over all d channels. M is a Hadamard matrix with random signs, applied
   in O(d log d) by the fast Walsh–Hadamard transform (:func:`rotate`). V is not rotated: O = PV needs V itself.
3. **P in FP8.** The second product P̃V also runs on FP8 tensor cores, so P̃ is rounded to e4m3. FA3 computes
   ``P̃ = 2⁸·exp(S − m)`` (its softmax's ``Max_offset = 8``), so that P̃'s entries fill [0, 256] and small
   probabilities stay above e4m3's subnormal range; the factor 2⁸ cancels in the final division by ℓ.

The float8 formats (the OCP 8-bit floating point specification; PyTorch's ``float8_e4m3fn`` and ``float8_e5m2``):

======  ========  ====  ========  ================  ==================  ==============================
format  exponent  bias  mantissa  largest finite    smallest (normal)   inf and NaN
======  ========  ====  ========  ================  ==================  ==============================
e4m3    4 bits    7     3 bits    448 = 1.75·2⁸     2⁻⁹ (2⁻⁶)           no inf; NaN is S.1111.111 only
e5m2    5 bits    15    2 bits    57344 = 1.75·2¹⁵  2⁻¹⁶ (2⁻¹⁴)         IEEE: inf S.11111.00, NaN
======  ========  ====  ========  ================  ==================  ==============================

:func:`round_to_fp8` rounds to the nearest float8 value, ties to even, exactly (it is checked bit for bit against
PyTorch's casts over all 256 codes and some 800 000 float32 inputs per format); :func:`to_bits` and
:func:`from_bits` convert between values and the uint8 codes. :func:`quantize_fp8` makes FA3's inputs,
:func:`flash2_forward_fp8` is FA2 Alg. 1 on them, :func:`fp8_attention` does both, :func:`fp8_error_bound` predicts
the worst-case error, and :func:`fp8_error_study` measures plain, block-scaled and incoherent FP8 on inputs with
outlier channels.

The HBM ledger (:mod:`fa2edu.memory`) counts **elements**, not bytes: here Q, K and V are uint8 codes, so their
element counts are also their bytes; descales are float32 (4 bytes), O is float32 here (FA3 writes bfloat16,
2 bytes) and L is float32. Multiply by those sizes for bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from fa2edu.blocks import block_sizes_q_outer, start_run
from fa2edu.flash2 import Flash2Forward, flash2_forward_working_set
from fa2edu.masks import BlockKind, classify_block
from fa2edu.memory import HBM, FlopCounter
from fa2edu.reference import attention_reference
from fa2edu.softmax import exp_minus
from fa2edu.validation import _check_array, guard_overflow, prepare

__all__ = ["Fp8Format", "FORMATS", "round_to_fp8", "to_bits", "from_bits", "fp8_values",
           "hadamard_matrix", "fwht", "random_signs", "rotation_matrix", "rotate", "unrotate",
           "Fp8Tensor", "quantize_fp8", "flash2_forward_fp8", "fp8_attention", "fp8_error_bound",
           "Fp8ErrorStudy", "fp8_error_study", "outlier_inputs", "STUDY_METHODS", "P_OFFSET"]


# -- the two float8 formats ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fp8Format:
    """One 8-bit floating-point format: 1 sign bit, ``exponent_bits``, ``mantissa_bits``.

    Attributes
    ----------
    name : str
        ``"e4m3"`` or ``"e5m2"``.
    exponent_bits : int
        Width of the biased exponent field.
    mantissa_bits : int
        Width of the mantissa (fraction) field: the precision is ``mantissa_bits + 1`` bits.
    bias : int
        Exponent bias, ``2**(exponent_bits - 1) - 1``.
    max : float
        The largest finite value (448 for e4m3, 57344 for e5m2).
    has_inf : bool
        True for e5m2 (IEEE-like: exponent all ones and mantissa 0 is ±inf); e4m3 ("fn", finite) has no inf and
        uses only S.1111.111 for NaN, which buys it 448 instead of 240.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    has_inf: bool

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number, ``1 − bias``."""
        return 1 - self.bias

    @property
    def min_normal(self) -> float:
        """The smallest normal number, ``2**emin`` (2⁻⁶ for e4m3, 2⁻¹⁴ for e5m2)."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive number, ``2**(emin − mantissa_bits)`` (2⁻⁹ for e4m3, 2⁻¹⁶ for e5m2)."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def unit_roundoff(self) -> float:
        """u = 2^−(mantissa_bits+1): round-to-nearest errs by at most ``u·|x|`` in the normal range (2⁻⁴ for e4m3)."""
        return math.ldexp(1.0, -(self.mantissa_bits + 1))


FORMATS = {
    "e4m3": Fp8Format("e4m3", exponent_bits=4, mantissa_bits=3, bias=7, max=448.0, has_inf=False),
    "e5m2": Fp8Format("e5m2", exponent_bits=5, mantissa_bits=2, bias=15, max=57344.0, has_inf=True),
}

#: FA3's ``Max_offset`` for FP8: P̃ = 2^P_OFFSET · exp(S − m) fills [0, 256] of e4m3's range (module docstring).
P_OFFSET = 8


def _format(fmt) -> Fp8Format:
    if isinstance(fmt, Fp8Format):
        return fmt
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)} (float8 e4m3, the 'fn' variant PyTorch calls "
                         f"float8_e4m3fn, or e5m2), got {fmt!r}")
    return FORMATS[fmt]


def _decode_table(spec: Fp8Format) -> np.ndarray:
    """The value of each of the 256 codes, from the bit fields (the format's definition), as float64."""
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> spec.mantissa_bits) & ((1 << spec.exponent_bits) - 1)
    mantissa = codes & ((1 << spec.mantissa_bits) - 1)
    top = (1 << spec.exponent_bits) - 1
    # normal: (1 + m/2^p)·2^(e − bias); subnormal (e = 0): (m/2^p)·2^emin
    significand = np.where(exponent == 0, 0.0, 1.0) + mantissa / (1 << spec.mantissa_bits)
    values = sign * np.ldexp(significand, np.maximum(exponent, 1) - spec.bias)
    if spec.has_inf:                                   # e5m2: IEEE specials in the top exponent
        values = np.where((exponent == top) & (mantissa == 0), sign * np.inf, values)
        values = np.where((exponent == top) & (mantissa != 0), np.copysign(np.nan, sign), values)
    else:                                              # e4m3fn: only S.1111.111 is NaN
        values = np.where((exponent == top) & (mantissa == (1 << spec.mantissa_bits) - 1),
                          np.copysign(np.nan, sign), values)
    return values


_TABLES = {name: _decode_table(spec) for name, spec in FORMATS.items()}


def fp8_values(fmt: str = "e4m3") -> np.ndarray:
    """The non-negative finite values of a format, increasing, as float64 (index = code; 127 of e4m3, 124 of e5m2).

    Parameters
    ----------
    fmt : str, default "e4m3"
        ``"e4m3"`` or ``"e5m2"``.

    Returns
    -------
    ndarray, shape (127,) or (124,)
        Value of code c at index c, for the codes 0 … largest finite.
    """
    spec = _format(fmt)
    table = _TABLES[spec.name][:128]
    return table[np.isfinite(table)].copy()


def _as_float_array(x, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind not in "fiub":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    return x


def round_to_fp8(x, fmt: str = "e4m3", *, saturate: bool = True) -> np.ndarray:
    """Round to the nearest float8 value, ties to even: the exact value a float8 cast produces.

    The rounding is done on the float64 value of ``x`` with no intermediate rounding: a quantum ``q`` (the spacing
    of float8 numbers in the binade of ``|x|``, never finer than the subnormal spacing) is a power of two, so
    ``rint(|x|/q)·q`` is exact, and ``np.rint`` rounds halves to even. Cost: a handful of elementwise operations.

    Overflow. ``saturate=True`` (the default) clamps everything beyond ±max, infinities included, to ±max: what a
    quantiser wants, what CUDA's ``__NV_SATFINITE`` conversions do, and what PyTorch 2.13's CPU cast to
    ``float8_e4m3fn`` does (measured: ``torch.tensor(1e9).to(torch.float8_e4m3fn)`` is 448, inf too). With
    ``saturate=False`` values that round beyond ±max become NaN in e4m3 (it has no inf: the OCP specification's
    non-saturating mode; for e4m3 that is every ``|x| > 464``, the midpoint between 448 and the missing 480) and ±inf
    in e5m2 (IEEE: ``|x| ≥ 61440``), which is exactly PyTorch's cast to ``float8_e5m2``. NaN stays NaN (sign kept).

    float64 inputs are rounded once, correctly. PyTorch rounds a float64 tensor to float32 first, so the two differ
    on float64 values within 2⁻²⁴ (relative) of a float8 tie; on float32, float16 and integer inputs they agree.

    Parameters
    ----------
    x : array_like
        Real numbers, any shape.
    fmt : str, default "e4m3"
        ``"e4m3"`` (PyTorch's ``float8_e4m3fn``: max 448, no inf) or ``"e5m2"`` (max 57344, inf and NaN).
    saturate : bool, default True
        Clamp overflow to ±max (True) or give NaN (e4m3) / ±inf (e5m2) (False); see above.

    Returns
    -------
    ndarray
        Same shape; float8 values held in x's dtype when that is float16, float32 or float64 (every float8 value
        is exact in all three), else float64.
    """
    spec = _format(fmt)
    x = _as_float_array(x, "x")
    out_dtype = x.dtype if x.dtype in (np.float16, np.float32, np.float64) else np.dtype(np.float64)
    with np.errstate(all="ignore"):                    # inf, NaN are handled explicitly below
        x64 = x.astype(np.float64)
        a = np.abs(x64)
        finite = np.isfinite(a)
        a_fin = np.where(finite, a, 0.0)
        # exponent of the leading bit of |x|: a = f·2^E with f in [0.5, 1) → 2^(E−1) ≤ a < 2^E
        _, E = np.frexp(a_fin)
        e = np.maximum(E - 1, spec.emin)                   # subnormals share the smallest normal's spacing
        q = np.ldexp(1.0, e - spec.mantissa_bits)          # float8 spacing in that binade (a power of two)
        r = np.rint(a_fin / q) * q                         # exact division, exact product: one rounding, RNE
        overflow = (r > spec.max) | np.isposinf(a)
        if saturate:
            r = np.where(overflow, spec.max, r)
        else:
            r = np.where(overflow, np.inf if spec.has_inf else np.nan, r)
        r = np.where(np.isnan(a), np.nan, r)
        r = np.copysign(r, x64)                            # signs of zeros and of NaN kept, as the casts do
    return r.astype(out_dtype)


def to_bits(x, fmt: str = "e4m3", *, saturate: bool = True) -> np.ndarray:
    """The uint8 float8 codes of ``x``: :func:`round_to_fp8`, then the code of each rounded value.

    A NaN becomes S.1111.111 (0x7F, or 0xFF when its sign bit is set), PyTorch's pattern for both formats;
    e5m2's ±inf is 0x7C / 0xFC.

    Parameters
    ----------
    x : array_like
        Real numbers, any shape.
    fmt : str, default "e4m3"
        ``"e4m3"`` or ``"e5m2"``.
    saturate : bool, default True
        Overflow behaviour, as in :func:`round_to_fp8`.

    Returns
    -------
    ndarray of uint8
        Same shape: sign bit, exponent field, mantissa field.
    """
    spec = _format(fmt)
    r = round_to_fp8(x, spec, saturate=saturate).astype(np.float64)
    magnitudes = fp8_values(spec.name)                 # code c ↦ value, increasing: the code is an index
    with np.errstate(invalid="ignore"):
        a = np.abs(r)
        code = np.searchsorted(magnitudes, np.where(np.isfinite(a), a, 0.0)).astype(np.uint8)
    if spec.has_inf:
        code = np.where(np.isinf(a), np.uint8(0x7C), code)
    code = np.where(np.isnan(a), np.uint8(0x7F), code)
    return (code | (np.signbit(r).astype(np.uint8) << 7)).astype(np.uint8)


def from_bits(codes, fmt: str = "e4m3") -> np.ndarray:
    """The float values of uint8 float8 codes (a table of the 256 values, decoded from the bit fields).

    Parameters
    ----------
    codes : array_like of uint8
        Float8 codes, any shape.
    fmt : str, default "e4m3"
        ``"e4m3"`` or ``"e5m2"``.

    Returns
    -------
    ndarray of float32
        Same shape; every float8 value is exact in float32.
    """
    spec = _format(fmt)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes must have dtype uint8 (one float8 code per byte), got {codes.dtype}")
    return _TABLES[spec.name].astype(np.float32)[codes]


# -- incoherent processing: a random Hadamard rotation ---------------------------------------------------------------

def _check_power_of_two(d: int, name: str) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"{name}: the head dimension d = {d} is not a power of two, and the Hadamard rotation of "
                         f"incoherent processing needs one (Sylvester's construction). Pad the last axis of Q "
                         f"and K with zeros to {1 << max(0, (d - 1).bit_length())} (zero channels leave QKᵀ "
                         f"unchanged), or pass incoherent=False")


def hadamard_matrix(d: int) -> np.ndarray:
    """Sylvester's Hadamard matrix H_d (entries ±1, ``H Hᵀ = d·I``, symmetric), for d a power of two.

    ``H_1 = [1]``, ``H_2d = [[H_d, H_d], [H_d, −H_d]]``: the matrix :func:`fwht` applies without forming it.

    Parameters
    ----------
    d : int
        A power of two.

    Returns
    -------
    ndarray, shape (d, d), float64
    """
    _check_power_of_two(int(d), "hadamard_matrix")
    H = np.ones((1, 1))
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    return H


def fwht(x: np.ndarray) -> np.ndarray:
    """The fast Walsh–Hadamard transform of the last axis: ``x @ H_d`` in d·log₂d additions (not d² multiplies).

    Each of the log₂d stages pairs entries h apart and replaces (a, b) by (a + b, a − b): the butterfly of
    Sylvester's recursion. Unnormalised (divide by √d for an orthogonal map).

    Parameters
    ----------
    x : ndarray, shape (..., d)
        d a power of two.

    Returns
    -------
    ndarray, shape (..., d), float64
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    _check_power_of_two(d, "fwht")
    lead = x.shape[:-1]
    y = x.reshape(-1, d).copy()
    h = 1
    while h < d:
        pairs = y.reshape(-1, d // (2 * h), 2, h)          # entries h apart: (…, pair, {a, b}, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = np.stack((a + b, a - b), axis=2).reshape(-1, d)
        h *= 2
    return y.reshape(lead + (d,))


def random_signs(d: int, seed: int = 0) -> np.ndarray:
    """The diagonal of D: d independent ±1 from ``numpy.random.default_rng(seed)``, float64.

    Parameters
    ----------
    d : int
        Head dimension.
    seed : int, default 0
        Non-negative seed; Q and K must use the same one.

    Returns
    -------
    ndarray, shape (d,)
    """
    return np.where(np.random.default_rng(seed).random(d) < 0.5, -1.0, 1.0)


def rotation_matrix(d: int, seed: int = 0) -> np.ndarray:
    """FA3's random orthogonal M = D·H_d/√d (D = diag(:func:`random_signs`)), formed explicitly (for teaching).

    Rows are rotated as ``x ↦ x·M`` (:func:`rotate`): in column-vector form ``Mᵀxᵀ = H·D·xᵀ/√d``, the random-sign
    Hadamard "H·diag(±1)/√d". The signs come first so that the transform sees a randomised vector: that is what
    spreads any fixed outlier pattern (signs applied after H would flip signs without changing magnitudes).

    Parameters
    ----------
    d : int
        A power of two.
    seed : int, default 0
        Seed of the signs.

    Returns
    -------
    ndarray, shape (d, d), float64, orthogonal (``M Mᵀ = I``)
    """
    return random_signs(d, seed)[:, None] * hadamard_matrix(d) / math.sqrt(d)


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``x·M`` with M = diag(signs)·H/√d, by :func:`fwht`: O(d log d) per row.

    Parameters
    ----------
    x : ndarray, shape (..., d)
        d a power of two.
    signs : ndarray, shape (d,)
        The diagonal of D (±1).

    Returns
    -------
    ndarray, shape (..., d), float64
    """
    return fwht(np.asarray(x, dtype=np.float64) * signs) / math.sqrt(len(signs))


def unrotate(y: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``y·Mᵀ`` = ``y·H·diag(signs)/√d``, the inverse of :func:`rotate` (M is orthogonal, H symmetric).

    Parameters
    ----------
    y : ndarray, shape (..., d)
        Rotated rows.
    signs : ndarray, shape (d,)
        The signs :func:`rotate` used.

    Returns
    -------
    ndarray, shape (..., d), float64
    """
    return fwht(y) / math.sqrt(len(signs)) * signs


# -- quantisation ----------------------------------------------------------------------------------------------------

@dataclass
class Fp8Tensor:
    """A quantised tensor: 1-byte codes, float32 descales, and the rotation applied before rounding.

    The tensor it stands for is ``from_bits(codes) · descale`` (per row block), times Mᵀ when rotated:
    :meth:`dequantize`.

    Attributes
    ----------
    codes : ndarray of uint8, shape (..., N, d)
        The float8 codes of ``x·M / δ`` (``x / δ`` without a rotation).
    descale : ndarray of float32, shape (...) or (..., ceil(N / block))
        δ = amax / (the format's max) of each (batch, head), or of each block of ``block`` rows with ``block``;
        1 where the amax is 0 (an all-zero head or block).
    fmt : str
        ``"e4m3"`` or ``"e5m2"``.
    block : int or None
        Rows per scale along the sequence axis; None: one scale per (batch, head).
    signs : ndarray of float64, shape (d,), or None
        The diagonal of D in M = D·H/√d (:func:`rotation_matrix`), or None when not rotated.
    """

    codes: np.ndarray
    descale: np.ndarray
    fmt: str
    block: int | None
    signs: np.ndarray | None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape (..., N, d) of the tensor it stands for."""
        return tuple(self.codes.shape)

    @property
    def values(self) -> np.ndarray:
        """The float8 values of the codes, float32, shape (..., N, d): what the tensor core multiplies."""
        return from_bits(self.codes, self.fmt)

    @property
    def nbytes(self) -> int:
        """Bytes in HBM: one per code plus four per descale."""
        return int(self.codes.size + 4 * self.descale.size)

    def row_descale(self) -> np.ndarray:
        """The descale of every row, float32, shape (..., N)."""
        N = self.codes.shape[-2]
        if self.block is None:
            return np.broadcast_to(self.descale[..., None], self.codes.shape[:-1])
        return np.repeat(self.descale, self.block, axis=-1)[..., :N]

    def dequantize(self, unrotate_back: bool = False) -> np.ndarray:
        """``values · δ`` per row, float64, shape (..., N, d): the (rotated) tensor the codes represent.

        Parameters
        ----------
        unrotate_back : bool, default False
            Also multiply by Mᵀ, to compare with the tensor before its rotation.
        """
        x = self.values.astype(np.float64) * self.row_descale()[..., None].astype(np.float64)
        if unrotate_back and self.signs is not None:
            x = unrotate(x, self.signs)
        return x


def _check_block(block) -> int | None:
    if block is None:
        return None
    if isinstance(block, bool) or not isinstance(block, Integral):
        raise TypeError(f"block must be a positive int (rows per scale) or None, got {type(block).__name__}")
    if block < 1:
        raise ValueError(f"block must be positive (rows that share one scale), got {block}")
    return int(block)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


def quantize_fp8(x, incoherent: bool = False, block=None, seed: int = 0, fmt: str = "e4m3") -> Fp8Tensor:
    """FA3's FP8 quantisation (Section 3.3): optionally rotate, scale into range, round to float8.

    1. With ``incoherent``: ``x ← x·M``, M = D·H/√d (:func:`rotation_matrix`, applied by :func:`rotate`).
    2. ``δ = amax(|x|) / max`` over each (batch, head), i.e. the last two axes, or over each block of ``block``
       rows of them; δ is stored as float32.
    3. ``codes = to_bits(x / δ)`` (saturating: ``x/δ`` can exceed max by float32's rounding of δ).

    Every entry then satisfies ``|x̂ − x| ≤ u·|x| + ν·δ`` with x̂ = value·δ, u = 2⁻⁴ and ν = 2⁻¹⁰ (half the
    smallest subnormal) for e4m3: relative error at most 2⁻⁴ where ``|x/δ| ≥ 2⁻⁶`` (the normal range).

    Cost per (batch, head): N·d reads and N·d one-byte writes, about 5·N·d operations (plus N·d·log₂d additions
    with ``incoherent``). A kernel fuses this into the layer that produces x; the attention ledger starts after it.

    Parameters
    ----------
    x : ndarray, shape (..., N, d)
        float16, float32 or float64, finite, at least two axes; leading axes are batch and heads.
    incoherent : bool, default False
        Rotate the last axis by M first. Needs d a power of two (ValueError otherwise: pad with zeros).
        Use it for Q and K with one seed; never for V (see the module docstring).
    block : int, optional
        Rows (along N) per scale. Default None: one scale per (batch, head).
    seed : int, default 0
        Seed of the rotation's random signs (:func:`random_signs`); Q and K must share it.
    fmt : str, default "e4m3"
        ``"e4m3"`` (FA3's choice for the forward pass) or ``"e5m2"``.

    Returns
    -------
    Fp8Tensor
        codes (uint8, x's shape), descale (float32), fmt, block, signs (None without ``incoherent``).
    """
    spec = _format(fmt)
    block = _check_block(block)
    seed = _check_seed(seed)
    if not isinstance(incoherent, (bool, np.bool_)):
        raise TypeError(f"incoherent must be a bool, got {type(incoherent).__name__}")
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"x must have a floating dtype (float16, float32 or float64), got {x.dtype}")
    if x.ndim < 2 or 0 in x.shape:
        raise ValueError(f"x must have shape (..., N, d) with at least 2 axes and no empty axis, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x contains NaN or infinite values; FP8 quantisation needs finite inputs (its scale is "
                         "the largest |x|)")
    x = x.astype(np.float64)
    signs = None
    if incoherent:
        _check_power_of_two(x.shape[-1], "incoherent=True")
        signs = random_signs(x.shape[-1], seed)
        x = rotate(x, signs)
    row_amax = np.abs(x).max(axis=-1)                                  # (..., N)
    if block is None:
        amax = row_amax.max(axis=-1)                                   # (...)
    else:
        amax = np.maximum.reduceat(row_amax, np.arange(0, x.shape[-2], block), axis=-1)   # (..., ceil(N/block))
    descale = np.where(amax > 0.0, amax / spec.max, 1.0).astype(np.float32)
    tensor = Fp8Tensor(codes=np.empty(x.shape, np.uint8), descale=descale, fmt=spec.name, block=block,
                       signs=signs)
    tensor.codes = to_bits(x / tensor.row_descale()[..., None].astype(np.float64), spec, saturate=True)
    return tensor


# -- FA2 Algorithm 1 on FP8 inputs -----------------------------------------------------------------------------------

def _check_fp8_tensor(t, name: str) -> Fp8Tensor:
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"{name} must be an Fp8Tensor (from fa2edu.fp8.quantize_fp8), got {type(t).__name__}")
    return t


def _descale_blocks(t: Fp8Tensor, rows: slice) -> slice:
    """Which entries of t's (compact) descale vector cover the rows ``rows``: one per (batch, head) without blocks."""
    if t.block is None:
        return slice(0, 1)
    return slice(rows.start // t.block, (rows.stop - 1) // t.block + 1)


def _tile_descale(t: Fp8Tensor, blocks: np.ndarray, rows: slice) -> np.ndarray:
    """Expand a tile's descale entries (…, n_blocks) to one per row (…, rows)."""
    if t.block is None:
        return np.broadcast_to(blocks, blocks.shape[:-1] + (rows.stop - rows.start,))
    first = rows.start // t.block
    return blocks[..., np.arange(rows.start, rows.stop) // t.block - first]


@guard_overflow
def flash2_forward_fp8(Q8: Fp8Tensor, K8: Fp8Tensor, V8: Fp8Tensor, causal: bool = False, scale=None, *,
                       M=None, block_sizes=None, hbm: HBM | None = None,
                       flops: FlopCounter | None = None) -> Flash2Forward:
    """FA2 Algorithm 1 on float8 inputs, as FA3 runs it: descales folded into the softmax scale and the output,
    P̃ rounded to e4m3 for the second product, float32 accumulation.

    The differences from :func:`fa2edu.flash2.flash2_forward`, line by line:

    * line 4/7: the tiles come from HBM as 1-byte codes (plus their descales) and are decoded on chip;
    * line 8: ``S_ij = (Q₈,i K₈,jᵀ) ∘ (τ·δ_q,i δ_k,jᵀ)``: one scalar ``τ·δ_q·δ_k`` per (batch, head) without
      blocks, an outer product of the tiles' row descales with them;
    * line 9: ``P̃ = 2⁸·exp(S − m)`` (FA3's ``Max_offset = 8``), and ℓ sums this float32 P̃;
    * line 10: ``Õ ← diag(e^{m_old − m_new}) Õ + fp8(P̃)·V₈`` (V's tile dequantised on chip when V has block
      scales: their descales differ from key block to key block, so they cannot wait for the end);
    * line 12: ``O_i = δ_v · diag(ℓ_i)⁻¹ Õ_i`` (one V scale per head: FA3's epilogue).

    L = m + log(ℓ/2⁸) is the log-sum-exp of the dequantised scores. Cost per (batch, head), N_q = N_k = N, no mask:
    4N²d matmul FLOPs on float8 operands; HBM reads Nd + 2Nd·T_r **one-byte** elements plus the descales (one per
    tile, or one per scale block a tile covers), writes Nd + N (O in float32 here, bfloat16 in FA3; L float32).
    The ledger counts elements (:mod:`fa2edu.memory`); bytes follow from those sizes.

    Parameters
    ----------
    Q8 : Fp8Tensor
        Quantised queries, shape (..., N_q, d), from :func:`quantize_fp8`.
    K8 : Fp8Tensor
        Quantised keys (..., N_k, d), with Q8's rotation (both None, or the same signs); GQA as in flash2_forward.
    V8 : Fp8Tensor
        Quantised values (..., N_k, d_v), not rotated.
    causal : bool, default False
        Bottom-right aligned causal mask.
    scale : float, optional
        The softmax scale τ of the original inputs. Default None: 1/√d.
    M : int, optional
        SRAM size in elements, as in :func:`~fa2edu.flash2.flash2_forward`. Default None: the default block sizes.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``. Default None: the Q-outer rule applied to ``M``.
    hbm : HBM, optional
        Ledger for this run (tensors Q, K, V as uint8 codes, descale_Q/K/V float32, O, L). Default None: a fresh one.
    flops : FlopCounter, optional
        FLOP counter. Default None: a fresh one (``hbm.flops``).

    Returns
    -------
    Flash2Forward
        ``(O, L)``: O (..., N_q, d_v) float32 and L (..., N_q) float32; O = 0, L = +inf on a fully masked row.
    """
    Q8, K8, V8 = (_check_fp8_tensor(t, n) for t, n in ((Q8, "Q8"), (K8, "K8"), (V8, "V8")))
    if (Q8.signs is None) != (K8.signs is None) or (
            Q8.signs is not None and not np.array_equal(Q8.signs, K8.signs)):
        raise ValueError("Q8 and K8 must share one rotation (both incoherent with the same seed, or neither): "
                         "(QM)(KM')ᵀ equals QKᵀ only when M' = M")
    if V8.signs is not None:
        raise ValueError("V8 must not be rotated: O = PV needs V itself (FA3 rotates only Q and K)")
    # Shapes, GQA, τ and the internal layout (Z, H_kv, G, N, d), checked on the float8 values.
    problem = prepare(Q8.values, K8.values, V8.values, causal=causal, scale=scale)
    N_q, N_k, d, d_v, tau = problem.N_q, problem.N_k, problem.d, problem.d_v, problem.scale
    lead = problem.lead
    run = start_run("flash2_forward_fp8", N_q, N_k, d, M=M, block_sizes=block_sizes,
                    rule=block_sizes_q_outer,
                    working_set=lambda br, bc: flash2_forward_working_set(br, bc, d, d_v) + br + 2 * bc,
                    hbm=hbm, flops=flops)
    mem, sram, count = run.hbm, run.sram, run.flops
    kv_lead = (lead[0], lead[1], 1)
    mem.put("Q", Q8.codes.reshape(lead + (N_q, d)))
    mem.put("K", K8.codes.reshape(kv_lead + (N_k, d)))
    mem.put("V", V8.codes.reshape(kv_lead + (N_k, d_v)))
    for name, t, shape in (("descale_Q", Q8, lead), ("descale_K", K8, kv_lead), ("descale_V", V8, kv_lead)):
        compact = t.descale if t.block is not None else t.descale[..., None]
        mem.put(name, compact.reshape(shape + (compact.shape[-1],)), vector=True)
    mem.put("O", np.zeros(lead + (N_q, d_v), dtype=np.float32))
    mem.put("L", np.zeros(lead + (N_q,), dtype=np.float32), vector=True)
    offset = np.float32(2.0 ** P_OFFSET)
    v_blocked = V8.block is not None

    # Alg. 1 line 3: the outer loop over the T_r row blocks of Q.
    for rows in run.row_tiles:
        r = rows.stop - rows.start
        # Alg. 1 line 4: load Q_i (1-byte codes) and its descales; decode on chip (a tensor core reads FP8 as is).
        Q_i = from_bits(sram.hold("Q_i", mem.read("Q", rows, line="Alg 1 line 4")), Q8.fmt)       # (…, B_r, d)
        dq = _tile_descale(Q8, mem.read("descale_Q", _descale_blocks(Q8, rows), line="Alg 1 line 4"), rows)
        sram.hold("dq_i", dq, vector=True)                                                          # (…, B_r)
        # Alg. 1 line 5: on chip, Õ_i = 0, ℓ_i = 0, m_i = −inf (float32 accumulators).
        O_i = sram.hold("O_i", np.zeros(lead + (r, d_v), dtype=np.float32))
        l_i = sram.hold("l_i", np.zeros(lead + (r,), dtype=np.float32), vector=True)
        m_i = sram.hold("m_i", np.full(lead + (r,), -np.inf, dtype=np.float32), vector=True)

        # Alg. 1 line 6: the inner loop over the T_c blocks of K and V.
        for cols in run.col_tiles:
            c = cols.stop - cols.start
            kind, share, visible = classify_block(N_q, N_k, rows, cols, problem.causal, problem.mask)
            if kind is BlockKind.SKIP:
                continue
            # Alg. 1 line 7: load K_j, V_j (1-byte codes) and K's descales (V's too when V has block scales).
            K_j = from_bits(sram.hold("K_j", mem.read("K", cols, line="Alg 1 line 7", share=share)), K8.fmt)
            V_j = from_bits(sram.hold("V_j", mem.read("V", cols, line="Alg 1 line 7", share=share)), V8.fmt)
            dk = _tile_descale(K8, mem.read("descale_K", _descale_blocks(K8, cols), line="Alg 1 line 7",
                                            share=share), cols)
            sram.hold("dk_j", dk, vector=True)                                                      # (…, B_c)
            if v_blocked:
                dv = _tile_descale(V8, mem.read("descale_V", _descale_blocks(V8, cols), line="Alg 1 line 7",
                                                share=share), cols)
                sram.hold("dv_j", dv, vector=True)
                # V's scale changes with the key block: dequantise the tile on chip before P̃V.
                V_j = V_j * dv[..., None]
            # Alg. 1 line 8: S = τ Q Kᵀ with Q = δ_q Q₈, K = δ_k K₈: the descales fold into the softmax scale.
            S_ij = (Q_i @ np.swapaxes(K_j, -1, -2)) * (tau * dq[..., :, None] * dk[..., None, :])   # (…, B_r, B_c)
            S_ij = sram.hold("S_ij", S_ij.astype(np.float32))
            count.add_matmul(r, c, d, line="Alg 1 line 8", share=share)
            count.add_nonmatmul(2 * r * c, line="Alg 1 line 8", share=share)
            if kind is BlockKind.MASK:
                S_ij = np.where(visible, S_ij, -np.inf)
                count.add_nonmatmul(r * c, line="Alg 1 line 8 (mask)", share=share)
            # Alg. 1 line 9: m_i^(j) = max(m_i^(j−1), rowmax(S_i^(j))).
            m_new = sram.hold("m_new", np.maximum(m_i, S_ij.max(axis=-1)), vector=True)
            # Alg. 1 line 9 (FA3 FP8): P̃ = 2⁸·exp(S − m) fills [0, 256] of e4m3; guarded where m = −inf.
            P_ij = offset * exp_minus(S_ij, m_new)
            # Alg. 1 line 9: ℓ = e^{m_old − m_new} ℓ + rowsum(P̃), summed in float32 before P̃ is rounded.
            alpha = exp_minus(m_i[..., None], m_new)[..., 0]
            l_i = alpha * l_i + P_ij.sum(axis=-1)
            count.add_nonmatmul(r * c * 4 + r * 5, line="Alg 1 line 9", share=share)
            # Alg. 1 line 10: Õ = diag(e^{m_old − m_new}) Õ + fp8(P̃) V: both operands of P̃V are float8.
            # (No inverse on diag(…), erratum 4: the old accumulator is scaled down.)
            P8 = round_to_fp8(P_ij, "e4m3")
            O_i = (alpha[..., None] * O_i + P8 @ V_j).astype(np.float32)
            count.add_matmul(r, d_v, c, line="Alg 1 line 10", share=share)
            count.add_nonmatmul(2 * r * d_v + r * c, line="Alg 1 line 10", share=share)
            m_i = sram.hold("m_i", m_new, vector=True)
            sram.free("m_new", "S_ij")

        # Alg. 1 line 12: O_i = diag(ℓ_i)⁻¹ Õ_i, guarded where ℓ = 0 (a row that saw no key) ...
        l_safe = np.where(l_i == 0.0, np.float32(1.0), l_i)
        O_i = O_i / l_safe[..., None]
        if not v_blocked:
            # ... times V's one descale per head: FA3 folds δ_v into this final rescale (its epilogue).
            dv = mem.read("descale_V", slice(0, 1), line="Alg 1 line 12")                    # (…, 1)
            O_i = O_i * dv[..., None]
        # Alg. 1 line 13: L_i = m_i + log(ℓ_i / 2⁸): the 2⁸ of P̃ taken back out; +inf on a fully masked row.
        with np.errstate(divide="ignore"):
            L_i = np.where(l_i == 0.0, np.inf, m_i + np.log(l_safe / offset))
        count.add_nonmatmul(2 * r * d_v + 3 * r, line="Alg 1 lines 12-13")
        # Alg. 1 lines 14-15: write O_i and L_i to HBM.
        mem.write("O", rows, O_i.astype(np.float32), line="Alg 1 line 14")
        mem.write("L", rows, L_i.astype(np.float32), line="Alg 1 line 15")
        sram.free("Q_i", "dq_i", "O_i", "l_i", "m_i", "K_j", "V_j", "dk_j", "dv_j")

    return Flash2Forward(problem.from_q_layout(mem["O"]), problem.from_q_layout(mem["L"]))


def fp8_attention(q, k, v, causal: bool = False, scale=None, incoherent: bool = False, block=None, seed: int = 0,
                  hbm: HBM | None = None, *, M=None, block_sizes=None) -> Flash2Forward:
    """Attention with FP8 inputs, end to end: :func:`quantize_fp8` of q, k (rotated together with
    ``incoherent``) and v (never rotated), then :func:`flash2_forward_fp8`.

    Approximates ``softmax(τ·qkᵀ)·v`` (:func:`fa2edu.attention_reference`) within :func:`fp8_error_bound`.
    Cost per (batch, head): the quantisation (O(Nd), or O(Nd log d) with ``incoherent``, not in the ledger) and
    FA2 Alg. 1's 4N²d FLOPs and Nd + 2Nd·T_r one-byte reads (:func:`flash2_forward_fp8`).

    Parameters
    ----------
    q : ndarray, shape (..., N_q, d)
        Queries, float16/32/64, finite (the conventions' shapes; GQA as in flash2_forward).
    k : ndarray, shape (..., N_k, d)
        Keys, q's dtype.
    v : ndarray, shape (..., N_k, d_v)
        Values, q's dtype.
    causal : bool, default False
        Bottom-right aligned causal mask.
    scale : float, optional
        Softmax scale τ. Default None: 1/√d.
    incoherent : bool, default False
        Rotate q and k by one random Hadamard matrix before quantising (FA3 §3.3); d must be a power of two.
    block : int, optional
        Rows per scale along the sequence (block quantisation). Default None: one scale per (batch, head).
    seed : int, default 0
        Seed of the rotation's signs.
    hbm : HBM, optional
        Ledger for the attention (see flash2_forward_fp8). Default None: a fresh one.
    M : int, optional
        SRAM size in elements. Default None: the default block sizes.
    block_sizes : tuple of int, optional
        ``(B_r, B_c)``. Default None: the Q-outer rule.

    Returns
    -------
    Flash2Forward
        ``(O, L)``, float32: O (..., N_q, d_v), L (..., N_q).
    """
    # The attention's checks first: each array by its own name, then shapes, GQA, scale and the scores' range.
    q, k, v = _check_array(q, "q"), _check_array(k, "k"), _check_array(v, "v")
    prepare(q, k, v, causal=causal, scale=scale)
    q8 = quantize_fp8(q, incoherent=incoherent, block=block, seed=seed)
    k8 = quantize_fp8(k, incoherent=incoherent, block=block, seed=seed)
    v8 = quantize_fp8(v, incoherent=False, block=block, seed=seed)
    return flash2_forward_fp8(q8, k8, v8, causal=causal, scale=scale, M=M, block_sizes=block_sizes, hbm=hbm)


# -- how wrong can it be: a bound, and a measurement -----------------------------------------------------------------

def _element_error(x: np.ndarray, t: Fp8Tensor) -> np.ndarray:
    """Per-entry bound ``u·|x| + ν·δ`` on ``|x̂ − x|`` for x (already rotated) quantised as t."""
    spec = FORMATS[t.fmt]
    nu = spec.min_subnormal / 2
    return spec.unit_roundoff * np.abs(x) + nu * t.row_descale()[..., None].astype(np.float64)


def fp8_error_bound(q, k, v, causal: bool = False, scale=None, incoherent: bool = False, block=None,
                    seed: int = 0) -> float:
    """A worst-case bound on ``max |O_fp8 − O|`` of :func:`fp8_attention` against exact attention, from the inputs
    and the formats' precision alone (FA3 gives none; this one is proven below and tested).

    Per entry of the (rotated) inputs, ``|x̂ − x| ≤ e_x = u|x| + ν·δ`` (:func:`quantize_fp8`). Then for each row i:

    * scores: ``|ŝ_ij − s_ij| ≤ ε_i = τ·max_j Σ_l (e_q|k| + |q|e_k + e_q e_k)_ijl`` (+ float32's γ_d·Σ|q̂||k̂|);
    * softmax: a perturbation of at most ε moves each probability by a factor in [e^{−2ε}, e^{2ε}], so
      ``Σ_j |P̂_ij − P_ij|·|v̂_j| ≤ (e^{2ε_i} − 1)·max|v̂|``;
    * values: ``Σ_j P_ij |v̂_j − v_j| ≤ max e_v``;
    * P̃ in FP8: ``|fp8(p) − p| ≤ u p + ν`` and ℓ ≥ 2⁸, so the rounding of P̃ adds ``(u + ν·N_k/2⁸)·max|v̂|``;
    * float32 accumulation: ``(N_k + d_v)·2⁻²³·max|v̂|``.

    The bound is the sum, maximised over rows. It is tight for small scores and grows like e^{2ε}: for scores of
    tens it is far above the error actually seen (rounding errors are random, the bound assumes they conspire).
    Cost: two N_q×N_k×d products (all pairs are bounded, masked or not).

    Parameters
    ----------
    q : ndarray, shape (..., N_q, d)
        Queries.
    k : ndarray, shape (..., N_k, d)
        Keys.
    v : ndarray, shape (..., N_k, d_v)
        Values.
    causal : bool, default False
        Accepted for symmetry with fp8_attention; the bound covers every pair, so it holds either way.
    scale : float, optional
        Softmax scale τ. Default None: 1/√d.
    incoherent : bool, default False
        As in fp8_attention.
    block : int, optional
        As in fp8_attention. Default None: one scale per (batch, head).
    seed : int, default 0
        As in fp8_attention.

    Returns
    -------
    float
        The bound on the largest absolute error of any entry of O.
    """
    q, k, v = _check_array(q, "q"), _check_array(k, "k"), _check_array(v, "v")
    problem = prepare(q, k, v, causal=causal, scale=scale)
    tau, N_k, d = problem.scale, problem.N_k, problem.d
    q8 = quantize_fp8(q, incoherent=incoherent, block=block, seed=seed)
    k8 = quantize_fp8(k, incoherent=incoherent, block=block, seed=seed)
    v8 = quantize_fp8(v, block=block, seed=seed)
    # the (rotated) inputs in the internal layout, and their per-entry error bounds
    qr = rotate(q, q8.signs) if incoherent else np.asarray(q, np.float64)
    kr = rotate(k, k8.signs) if incoherent else np.asarray(k, np.float64)
    e_q, e_k, e_v = _element_error(qr, q8), _element_error(kr, k8), _element_error(np.asarray(v, np.float64), v8)
    Q5, K5 = problem.to_q_layout(np.abs(qr)), np.abs(kr).reshape(problem.K.shape)
    Eq5, Ek5 = problem.to_q_layout(e_q), e_k.reshape(problem.K.shape)
    KT, EkT = np.swapaxes(K5, -1, -2), np.swapaxes(Ek5, -1, -2)
    perturb = Eq5 @ KT + Q5 @ EkT + Eq5 @ EkT                                   # (Z, H_kv, G, N_q, N_k)
    magnitude = (Q5 + Eq5) @ (KT + EkT)                                         # ≥ Σ|q̂||k̂|
    # float32: the d-term dot product, the descale and τ products, S − m: at most d + 6 roundings of 2⁻²⁴
    gamma_d = (d + 6) * 2.0 ** -24 / (1 - (d + 6) * 2.0 ** -24)
    eps = abs(tau) * (perturb + gamma_d * magnitude).max(axis=-1)               # (…, N_q)
    v_hat_max = float(np.max(np.abs(v) + e_v))
    spec_p = FORMATS["e4m3"]
    p_rounding = spec_p.unit_roundoff + spec_p.min_subnormal / 2 * N_k / 2.0 ** P_OFFSET
    accumulation = (N_k + problem.d_v) * 2.0 ** -23
    with np.errstate(over="ignore"):
        softmax_term = float(np.expm1(2 * eps).max())
    return softmax_term * v_hat_max + float(e_v.max()) + (p_rounding + accumulation) * v_hat_max


@dataclass
class Fp8ErrorStudy:
    """What :func:`fp8_error_study` measured: the error of each FP8 recipe against the float64 oracle, per seed.

    Attributes
    ----------
    rmse : dict of str to ndarray
        Method name → root-mean-square error of O, one entry per seed.
    max_error : dict of str to ndarray
        Method name → largest absolute error of any entry of O, per seed.
    seeds : tuple of int
        The seeds, in order.
    settings : dict
        N, d, outlier_channels, outlier_scale, block and causal of the study.
    """

    rmse: dict[str, np.ndarray]
    max_error: dict[str, np.ndarray]
    seeds: tuple[int, ...]
    settings: dict

    def mean_rmse(self, method: str) -> float:
        """The RMSE of ``method`` averaged over the seeds."""
        return float(np.mean(self.rmse[method]))

    def table(self) -> str:
        """One line per method: mean RMSE, worst max error, and the ratio to plain per-head FP8."""
        base = self.mean_rmse("per_head")
        lines = [f"{'method':<20} {'RMSE':>10} {'max error':>10} {'vs per_head':>12}"]
        for name in self.rmse:
            lines.append(f"{name:<20} {self.mean_rmse(name):>10.3e} {float(np.max(self.max_error[name])):>10.3e}"
                         f" {self.mean_rmse(name) / base:>11.3f}×")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


#: The recipes the study compares: (incoherent, block) for each name.
STUDY_METHODS = {"per_head": (False, None), "block": (False, "block"), "incoherent": (True, None),
                 "block_incoherent": (True, "block")}


def outlier_inputs(N: int, d: int, outlier_channels: int, outlier_scale: float, seed: int):
    """Attention inputs with outlier channels, as LLM activations have them: a few head-dim channels of Q and K
    (the same channels in both, which is what gives such models their large scores) ``outlier_scale`` times the
    rest.

    Entries are N(0, 1); ``outlier_channels`` channels, drawn from the seed, of Q and K are multiplied by
    ``outlier_scale``; then Q and K are divided by √outlier_scale. That overall rescale keeps the ratio of outlier
    to ordinary entries and makes an outlier product q_l·k_l of order outlier_scale instead of its square, so the
    scores are tens, not thousands (where softmax is one-hot and every recipe picks the same key). V is N(0, 1).

    Parameters
    ----------
    N : int
        Rows of each (N_q = N_k = N).
    d : int
        Head dimension.
    outlier_channels : int
        Number of outlier channels, 0 … d.
    outlier_scale : float
        Their magnitude relative to the other channels.
    seed : int
        Seed of the entries and of the channels chosen.

    Returns
    -------
    tuple of ndarray
        Q, K, V, each (N, d) float32.
    """
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, N, d))
    channels = rng.choice(d, size=outlier_channels, replace=False)
    for x in (q, k):
        x[:, channels] *= outlier_scale
        x /= math.sqrt(outlier_scale)
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def fp8_error_study(N: int = 256, d: int = 64, outlier_channels: int = 4, outlier_scale: float = 100.0,
                    seeds=(0, 1, 2), *, block: int = 64, causal: bool = False) -> Fp8ErrorStudy:
    """Measure FP8 attention's error on inputs with outlier channels, four ways (FA3 Section 4.3, Table 3).

    The methods: ``per_head`` (one scale per (batch, head): here one per tensor, the plain recipe), ``block``
    (one scale per ``block`` rows), ``incoherent`` (the random Hadamard rotation of Q and K, one scale), and
    ``block_incoherent`` (both: FA3's FP8). Each is :func:`fp8_attention` with the rotation seeded like the inputs,
    measured against :func:`fa2edu.attention_reference` (float64) by the RMSE and the largest error of O.
    Inputs: :func:`outlier_inputs`. Cost: four FP8 attentions and one oracle per seed (N²d each).

    Parameters
    ----------
    N : int, default 256
        Sequence length (N_q = N_k).
    d : int, default 64
        Head dimension, a power of two (the rotation needs one).
    outlier_channels : int, default 4
        How many head-dim channels of Q and K are outliers.
    outlier_scale : float, default 100.0
        How much larger those channels are.
    seeds : iterable of int, default (0, 1, 2)
        One input draw (and rotation) per seed.
    block : int, default 64
        Rows per scale for the block methods.
    causal : bool, default False
        Causal attention.

    Returns
    -------
    Fp8ErrorStudy
        Per-method, per-seed RMSE and max error; ``str()`` prints the table.
    """
    seeds = tuple(_check_seed(s) for s in seeds)
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    if isinstance(outlier_channels, bool) or not isinstance(outlier_channels, Integral) or not (
            0 <= outlier_channels <= d):
        raise ValueError(f"outlier_channels must be an int in [0, d = {d}], got {outlier_channels!r}")
    if isinstance(outlier_scale, bool) or not (isinstance(outlier_scale, Real) and math.isfinite(outlier_scale)
                                               and outlier_scale > 0):
        raise ValueError(f"outlier_scale must be a positive finite number, got {outlier_scale!r}")
    rmse = {name: [] for name in STUDY_METHODS}
    max_error = {name: [] for name in STUDY_METHODS}
    for seed in seeds:
        q, k, v = outlier_inputs(N, d, outlier_channels, outlier_scale, seed)
        O_ref = attention_reference(q, k, v, causal=causal).O
        for name, (incoherent, blocked) in STUDY_METHODS.items():
            O = fp8_attention(q, k, v, causal=causal, incoherent=incoherent,
                              block=block if blocked else None, seed=seed).O
            err = O.astype(np.float64) - O_ref
            rmse[name].append(float(np.sqrt(np.mean(err ** 2))))
            max_error[name].append(float(np.max(np.abs(err))))
    return Fp8ErrorStudy(rmse={n: np.array(r) for n, r in rmse.items()},
                         max_error={n: np.array(m) for n, m in max_error.items()}, seeds=seeds,
                         settings={"N": N, "d": d, "outlier_channels": outlier_channels,
                                   "outlier_scale": outlier_scale, "block": block, "causal": causal})
