"""The memory model (FA1 Section 2.1): the HBM ledger, the SRAM's capacity and peak, the FLOP counter."""

from __future__ import annotations

import numpy as np
import pytest

from fa2edu import flash2_backward, flash2_forward
from fa2edu.memory import HBM, SRAM, FlopCounter, SRAMOverflowError, tile_elements


def test_reads_and_writes_count_elements_per_program():
    hbm = HBM()
    hbm.put("Q", np.arange(2 * 3 * 10 * 4, dtype=float).reshape(2, 3, 10, 4))   # 6 programs of (10, 4)
    hbm.put("L", np.zeros((2, 3, 10)), vector=True)
    Q_1 = hbm.read("Q", slice(0, 3), line="Alg 1 line 4")
    assert Q_1.shape == (2, 3, 3, 4)
    assert hbm.reads == 12                                    # 3 rows × 4 columns, per program
    hbm.read("Q", slice(8, 10), cols=slice(1, 3), line="Alg 1 line 4")
    assert hbm.reads == 12 + 4
    hbm.write("L", slice(2, 7), np.ones((2, 3, 5)), line="Alg 1 line 15")
    assert hbm.writes == 5 and hbm.total == 21
    np.testing.assert_array_equal(hbm["L"][..., 2:7], 1.0)
    assert (hbm["L"][..., :2] == 0).all()


def test_read_returns_a_copy_and_inputs_are_not_counted():
    hbm = HBM()
    hbm.put("K", np.zeros((4, 2)))
    assert (hbm.reads, hbm.writes, hbm.init_writes) == (0, 0, 0)     # placing inputs is free
    tile = hbm.read("K", slice(0, 2), line="x")
    tile += 1.0
    assert (hbm["K"] == 0).all()                              # on-chip changes do not leak into HBM
    assert "K" in hbm and "V" not in hbm


def test_vectors_have_no_columns():
    hbm = HBM()
    hbm.put("m", np.zeros(5), vector=True)
    with pytest.raises(ValueError, match="vector"):
        hbm.read("m", slice(0, 2), cols=slice(0, 1), line="x")


def test_initialisation_writes_are_kept_apart():
    hbm = HBM()
    O = hbm.allocate("O", (2, 6, 3), 0.0, np.float64, line="Alg 1 line 2")
    m = hbm.allocate("m", (2, 6), -np.inf, np.float64, line="Alg 1 line 2", vector=True)
    assert O.shape == (2, 6, 3) and (O == 0).all() and np.isneginf(m).all()
    assert hbm.init_writes == 18 + 6 and hbm.writes == 0 and hbm.total == 0
    hbm.write("O", slice(0, 6), np.ones((2, 6, 3)), line="Alg 1 line 12")
    assert hbm.writes == 18 and hbm.init_writes == 24
    assert hbm.by_tensor()["O"] == {"read": 0, "write": 18, "init": 18}


def test_share_averages_over_programs():
    hbm = HBM()
    hbm.put("K", np.zeros((4, 8, 2)))
    hbm.read("K", slice(0, 4), line="x", share=0.25)          # one program in four visits this block
    assert hbm.reads == 2.0
    hbm.read("K", slice(0, 3), line="x", share=0.5)
    assert hbm.reads == 5 and isinstance(hbm.reads, int)     # whole numbers stay ints
    hbm.read("K", slice(0, 1), line="x", share=0.25)
    assert hbm.reads == 5.5


def test_by_tensor_and_by_line_sum_to_the_totals_of_a_real_run():
    rng = np.random.default_rng(0)
    Q, K, V, dO = rng.standard_normal((4, 2, 3, 17, 5))
    hbm = HBM()
    fwd = flash2_forward(Q, K, V, M=60, causal=True, hbm=hbm)
    flash2_backward(Q, K, V, fwd.O, fwd.L, dO, M=60, causal=True, hbm=hbm)  # one ledger, two passes
    for table in (hbm.by_tensor(), hbm.by_line()):
        for kind, total in (("read", hbm.reads), ("write", hbm.writes), ("init", hbm.init_writes)):
            assert sum(row[kind] for row in table.values()) == total
    assert list(hbm.by_line())[0] == "Alg 1 line 4"          # lines in the order they first ran
    assert "Alg 2 line 18" in hbm.by_line()
    report = hbm.report()
    assert "Alg 2 line 15" in report and f"{hbm.reads:,}" in report.splitlines()[-1]
    assert hbm.algorithm == "flash2_backward" and hbm.sram is not None and hbm.flops is not None


def test_sram_tracks_occupancy_and_peak():
    sram = SRAM(capacity=100, M=100)
    sram.hold("Q_i", np.zeros((2, 5, 4)))                     # 20 per program
    sram.hold("K_j", np.zeros((2, 6, 4)))                     # 24
    assert sram.occupancy == 44 and sram.peak == 44
    sram.hold("K_j", np.zeros((2, 3, 4)))                     # replacing a tile of the same name: 12
    assert sram.occupancy == 32 and sram.peak == 44
    sram.hold("m_i", np.zeros((2, 5)), vector=True)
    assert sram.occupancy == 37
    sram.free("Q_i", "K_j", "not held")                       # freeing an absent tile is harmless
    assert sram.occupancy == 5 and sram.peak == 44


def test_sram_overflow_names_the_tile_and_the_capacity():
    sram = SRAM(capacity=30, M=30)
    sram.hold("Q_i", np.zeros((5, 4)))
    with pytest.raises(SRAMOverflowError, match=r"'K_j'.*holds 30"):
        sram.hold("K_j", np.zeros((3, 4)))
    assert sram.occupancy == 20                               # the refused tile was not taken
    sram.hold("K_j", np.zeros((2, 5)))                        # exactly full is fine
    assert sram.occupancy == sram.peak == 30
    assert issubclass(SRAMOverflowError, ValueError)


def test_unbounded_sram_still_records_the_peak():
    sram = SRAM()
    sram.hold("S_ij", np.zeros((1000, 1000)))
    sram.free("S_ij")
    assert sram.peak == 10**6 and sram.occupancy == 0


def test_tile_elements():
    assert tile_elements(np.zeros((7, 3, 5, 2))) == 10
    assert tile_elements(np.zeros((7, 3, 5)), vector=True) == 5


def test_flop_counter():
    count = FlopCounter()
    count.add_matmul(3, 4, 5, line="Alg 1 line 8")            # (3, 5) @ (5, 4): 2·3·4·5
    count.add_nonmatmul(12, line="Alg 1 line 9")
    count.add_matmul(2, 2, 2, line="Alg 1 line 8", share=0.5)
    assert count.matmul == 120 + 8 and count.nonmatmul == 12 and count.total == 140
    assert count.by_line == {"Alg 1 line 8": {"matmul": 128, "nonmatmul": 0},
                             "Alg 1 line 9": {"matmul": 0, "nonmatmul": 12}}
    count.add_nonmatmul(1, line="Alg 1 line 9", share=0.5)
    assert count.nonmatmul == 12.5
