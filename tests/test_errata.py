"""Every checkable erratum of the papers: the printed formula is wrong, the corrected one is right (fa2edu.errata).

Each erratum function evaluates the printed formula, the corrected one, and what both should equal (the float64
oracle, an exact softmax, the executed ledger or FLOP count) on random blocks; several seeds make the verdict a
property of the formula, not of one draw.
"""

from __future__ import annotations

import numpy as np
import pytest

from fa2edu.errata import ERRATA, UNCHECKED, Erratum, check_all, distance, errata_table
from fa2edu.masks import BlockKind, classify_block

SEEDS = (0, 1, 2, 3)


@pytest.mark.parametrize("number", sorted(ERRATA))
@pytest.mark.parametrize("seed", SEEDS)
def test_printed_is_wrong_and_corrected_is_right(number, seed):
    erratum = ERRATA[number](seed=seed)
    assert isinstance(erratum, Erratum) and erratum.number == number
    assert erratum.corrected_is_right, str(erratum)
    assert not erratum.printed_is_right, str(erratum)
    # "wrong" by a wide margin, not by rounding: five times the tolerance at least (or a wrong shape)
    assert erratum.printed_error > max(5 * erratum.tolerance, 1e-3), str(erratum)


def test_the_errata_cover_the_readme_list():
    """README errata 1-10 and 12 are numerical claims; 11 (a sentence) and 13 (slides) are not, and say so."""
    assert sorted(ERRATA) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]
    assert [e.number for e in check_all()] == sorted(ERRATA)
    # No number is skipped silently: together the two registries number 1-13, each erratum once.
    assert sorted(UNCHECKED) == [11, 13] and not set(UNCHECKED) & set(ERRATA)
    assert sorted(set(ERRATA) | set(UNCHECKED)) == list(range(1, 14))
    assert all(where and what and why for where, what, why in UNCHECKED.values())
    table = errata_table().splitlines()[1:]
    assert [int(line.split()[0]) for line in table] == list(range(1, 14))
    assert all(why in table[number - 1] for number, (_, _, why) in UNCHECKED.items())


def test_erratum_1_printed_dK_does_not_even_conform_when_N_differs_from_d():
    rng = np.random.default_rng(0)
    Q, dS = rng.standard_normal((6, 4)), rng.standard_normal((6, 6))
    with pytest.raises(ValueError):
        Q @ dS.T                               # (N, d)·(N, N)
    assert (dS.T @ Q).shape == (6, 4)          # dK has K's shape


def test_erratum_4_literal_first_step_is_nan():
    """Alg. 1 line 10 as printed at j = 1: m^(0) = −inf, so diag(e^{m^(0) − m^(1)})⁻¹ = inf and inf · 0 = NaN."""
    m_old, m_new, O_old = np.array([-np.inf]), np.array([0.3]), np.zeros((1, 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        printed = (1.0 / np.exp(m_old - m_new))[:, None] * O_old
    assert np.isnan(printed).all()
    assert (np.exp(m_old - m_new)[:, None] * O_old == 0).all()     # the corrected factor is 0: no harm


def test_erratum_5_shapes():
    e = ERRATA[5]()
    assert np.shape(e.printed) == (3,) and np.shape(e.corrected) == np.shape(e.expected) == (7,)


def test_erratum_6_corrected_rule_is_fa2edus_block_classification():
    """The corrected reading (row ≥ column everywhere: no mask; row < column everywhere: skip) is what
    fa2edu.masks.classify_block does for N_q = N_k, block by block."""
    N, B = 12, 4
    for r0 in range(0, N, B):
        for c0 in range(0, N, B):
            rows, cols = slice(r0, r0 + B), slice(c0, c0 + B)
            kind = classify_block(N, N, rows, cols, True)[0]
            if rows.start >= cols.stop - 1:
                assert kind is BlockKind.PLAIN
            elif rows.stop - 1 < cols.start:
                assert kind is BlockKind.SKIP          # the printed text's "no mask needed" blocks
            else:
                assert kind is BlockKind.MASK


def test_erratum_9_redundant_loads_change_traffic_only():
    e = ERRATA[9]()
    assert e.notes["gradients_identical"]
    assert e.notes["extra_reads"] == 2 * e.notes["T_c"] * 40 * 4 == e.printed - e.corrected


def test_erratum_10_flops_grow_linearly_in_d():
    flops = ERRATA[10]().notes["flops"]
    dims = sorted(flops)
    for small, large in zip(dims, dims[1:]):
        assert 1.8 < flops[large] / flops[small] <= 2.0     # doubling d nearly doubles the backward FLOPs


def test_distance_and_display():
    assert distance([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert distance([1.0], [1.0, 2.0]) == float("inf")
    assert distance([np.nan], [1.0]) == float("inf")
    assert distance(3, 4) == 0.25
    text = str(ERRATA[2]())
    assert "printed" in text and "WRONG" in text and "right" in text
    table = errata_table()
    assert all(f"{n:>3}" in table for n in ERRATA)
