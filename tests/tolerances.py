"""the conventions' exactness rule, in one place for every test.

float64: within 1e-10 relative in the max-norm. Lower precisions: within 2× the error of standard attention
computed in the same dtype (against the float64 oracle), plus a small absolute floor (the flash-attn test rule).
"""

from __future__ import annotations

import numpy as np

__all__ = ["assert_close_to_oracle", "assert_same_nan_and_inf", "baseline_error"]


def assert_same_nan_and_inf(actual: np.ndarray, expected: np.ndarray, name: str) -> None:
    """NaN-ness and infinities must match exactly (the oracle never has NaN; a NaN there is a bug)."""
    assert not np.isnan(expected).any(), f"the reference {name} has NaN: a bug in the reference"
    assert not np.isnan(actual).any(), f"{name} has NaN where the reference has none"
    assert (np.isposinf(actual) == np.isposinf(expected)).all(), f"{name}: +inf pattern differs from the reference"
    assert (np.isneginf(actual) == np.isneginf(expected)).all(), f"{name}: -inf pattern differs from the reference"


def baseline_error(low_precision: np.ndarray, expected: np.ndarray) -> float:
    """Max-norm error of a same-dtype standard computation against the float64 oracle."""
    finite = np.isfinite(expected)
    return float(np.max(np.abs(low_precision.astype(np.float64)[finite] - expected[finite]), initial=0.0))


def assert_close_to_oracle(actual: np.ndarray, expected: np.ndarray, name: str, *, dtype=np.float64,
                           baseline: float | None = None, floor: float = 1e-5) -> None:
    """float64: max |a − e| ≤ 1e-10 · max(1, max |e|); else ≤ 2·baseline + floor (dtype-aware floor)."""
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != reference {expected.shape}"
    assert_same_nan_and_inf(actual, expected, name)
    finite = np.isfinite(expected)
    err = float(np.max(np.abs(actual.astype(np.float64)[finite] - expected[finite]), initial=0.0))
    scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    if np.dtype(dtype) == np.float64:
        assert err <= 1e-10 * scale, f"{name}: max error {err:.3e} > 1e-10 × {scale:.3g} (float64)"
    else:
        if baseline is None:
            raise ValueError("low-precision comparisons need the same-dtype baseline error")
        floor = max(floor, 1e-3 * scale) if np.dtype(dtype) == np.float16 else floor * scale
        assert err <= 2 * baseline + floor, (f"{name}: max error {err:.3e} > 2 × baseline {baseline:.3e} "
                                             f"+ floor {floor:.1e} ({np.dtype(dtype).name})")
